r"""Quantize-on-write of packed latents into vLLM's paged cache, one launch per layer.

:func:`write_packed_latents` does what
:func:`vllm_lowrank.attention.latent_attention.write_latents` does with a
:class:`~vllm_lowrank.format.latent.SlotLayout` (``layout.encode`` then a scatter
by slot mapping), for every token of a step in one kernel: one program per
token and quantization group computes the group's ``min``/``max``, its float16
``scale = (max - min) / (2^bits - 1)`` and ``zero = min``, the codes
``clamp(round((x - zero) / scale), 0, 2^bits - 1)`` (round half to even, IEEE
division: the same codes as :func:`vllm_lowrank.format.latent.quantize`; Palu
sec. 3.4, per-token asymmetric quantization) and packs them little-endian
(8 codes -> ``bits`` bytes) straight into the token's slot. One more program per
token zeroes what :meth:`SlotLayout.encode` leaves zero (the K codes of
per-channel keys, written once their token group is complete, the K share and
the padding). Padding tokens (negative slots) write nothing.

The torch encode launches about 40 small kernels per layer and step; at batch
16 on the H100 the step's cache writes took longer than its attention
(benchmarks/README.md, "GPU serving inside vLLM").

Token-adaptive layers write two more things per step, each in one launch:
:func:`write_exact_slots` (the exact cache's int8 keys and values through the
same kernel, plus the staged key latents) and :func:`write_key_groups` (the
per-channel key groups a step completes; tokens that complete none return at
once). In torch they took about 8.6 of the 32.8 ms of GPU time of a decode step at
107 sequences (Llama-3-8B shape, H200, benchmarks/README.md,
"Quantize-on-write").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .decode_prep import pow2


@triton.jit
def _pack_store(x_ptr, row_ptr, ch_off, q, code_off, scale_off, zero_off,
                BITS: tl.constexpr, OCT: tl.constexpr):
    """Quantize ``q`` channels of one token (``x_ptr + ch_off ..``, float) and
    store their packed codes at ``row_ptr + code_off`` and the float16 scale
    and zero at ``row_ptr + scale_off`` / ``zero_off`` (byte-wise: any alignment)."""
    levels = (1 << BITS) - 1
    o = tl.arange(0, OCT)
    k = tl.arange(0, 8)
    ch = o[:, None] * 8 + k[None, :]  # [OCT, 8] channel of each code
    m = ch < q
    x = tl.load(x_ptr + ch_off + ch, mask=m, other=0.0).to(tl.float32)
    lo = tl.min(tl.min(tl.where(m, x, float("inf")), 1), 0)
    hi = tl.max(tl.max(tl.where(m, x, float("-inf")), 1), 0)
    scale = tl.math.div_rn(hi - lo, levels * 1.0).to(tl.float16)
    zero = lo.to(tl.float16)
    s = scale.to(tl.float32)
    z = zero.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    # round half to even (torch.round): adding 1.5 * 2^23 leaves no fraction bits
    # for |v| < 2^22 (the interpreter has no libdevice rint)
    c = (tl.math.div_rn(x - z, safe) + 12582912.0) - 12582912.0
    c = tl.minimum(tl.maximum(tl.where(s > 0, c, 0.0), 0.0), levels * 1.0)
    codes = tl.where(m, c, 0.0).to(tl.int64)
    word = tl.sum(codes << (k * BITS).to(tl.int64)[None, :], 1)  # [OCT] < 2^(8 BITS)
    nb = tl.arange(0, 8)
    byte = (word[:, None] >> (nb * 8).to(tl.int64)[None, :]) & 0xFF  # [OCT, 8]
    bm = (o[:, None] * 8 < q) & (nb[None, :] < BITS)
    tl.store(row_ptr + code_off + o[:, None] * BITS + nb[None, :], byte.to(tl.uint8), mask=bm)
    two = tl.arange(0, 2)
    sb = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    zb = zero.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(row_ptr + scale_off + two, ((sb >> (two * 8)) & 0xFF).to(tl.uint8))
    tl.store(row_ptr + zero_off + two, ((zb >> (two * 8)) & 0xFF).to(tl.uint8))


@triton.jit(do_not_specialize=("s_kt", "s_vt", "n_k", "n_groups", "z0_lo", "z0_hi", "z1_lo",
                               "z1_hi", "s_rt", "n_raw", "raw_off"))
def cache_write_kernel(
    k_ptr, s_kt, v_ptr, s_vt, slot_ptr, cache_ptr, s_blk, s_tok, tab_ptr,
    n_k, n_groups, z0_lo, z0_hi, z1_lo, z1_hi, raw_ptr, s_rt, n_raw, raw_off,
    PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_OCT: tl.constexpr, V_OCT: tl.constexpr, ZBLOCK: tl.constexpr,
    RAW_BYTES: tl.constexpr,
):
    """Grid ``(T, n_groups + 1)``: token ``t``, quantization group ``i`` (the
    first ``n_k`` are the key side's). ``tab_ptr``: ``[n_groups, 5]`` int32 rows
    ``(channel offset in its side's row, channels, code byte offset, scale byte
    offset, zero byte offset)``. Program ``n_groups`` zeroes the byte ranges
    ``[z0_lo, z0_hi)`` and ``[z1_lo, z1_hi)`` of the slot and, with
    ``RAW_BYTES`` > 0, stores the ``n_raw`` elements of the token's row of
    ``raw_ptr`` (``RAW_BYTES`` bytes each, bit for bit, little-endian) at byte
    ``raw_off``. The widths and offsets that differ between layers are not
    specialized on (one compile per bit width and page, not per layer)."""
    t = tl.program_id(0)
    i = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + (slot // PAGE) * s_blk + (slot % PAGE) * s_tok
        if i < n_groups:
            tab = tab_ptr + i * 5
            ch_off = tl.load(tab)
            q = tl.load(tab + 1)
            code_off = tl.load(tab + 2)
            scale_off = tl.load(tab + 3)
            zero_off = tl.load(tab + 4)
            if i < n_k:
                _pack_store(k_ptr + t.to(tl.int64) * s_kt, row, ch_off, q, code_off,
                            scale_off, zero_off, K_BITS, K_OCT)
            else:
                _pack_store(v_ptr + t.to(tl.int64) * s_vt, row, ch_off, q, code_off,
                            scale_off, zero_off, V_BITS, V_OCT)
        else:
            zb = tl.arange(0, ZBLOCK)
            zeros = tl.zeros([ZBLOCK], dtype=tl.uint8)
            for off in range(z0_lo, z0_hi, ZBLOCK):
                tl.store(row + off + zb, zeros, mask=off + zb < z0_hi)
            for off in range(z1_lo, z1_hi, ZBLOCK):
                tl.store(row + off + zb, zeros, mask=off + zb < z1_hi)
            if RAW_BYTES > 0:
                _raw_store(raw_ptr + t.to(tl.int64) * s_rt, n_raw, row + raw_off, ZBLOCK,
                           RAW_BYTES)


@triton.jit
def _raw_store(x_ptr, n, dst_ptr, BLOCK: tl.constexpr, NBYTES: tl.constexpr):
    """Store ``n`` elements at ``x_ptr`` (``NBYTES`` = 2 or 4 bytes each) bit
    for bit as little-endian bytes at ``dst_ptr`` (any alignment)."""
    j = tl.arange(0, BLOCK)
    nb = tl.arange(0, NBYTES)
    for off in range(0, n, BLOCK):
        m = off + j < n
        x = tl.load(x_ptr + off + j, mask=m, other=0)
        if NBYTES == 2:
            word = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            word = x.to(tl.int32, bitcast=True)
        byte = (word[:, None] >> (nb * 8)[None, :]) & 0xFF
        tl.store(dst_ptr + (off + j)[:, None] * NBYTES + nb[None, :], byte.to(tl.uint8),
                 mask=m[:, None])


@functools.lru_cache(maxsize=None)
def supports(layout) -> bool:
    """Whether :func:`write_packed_latents` writes this layout: both sides
    packed (not raw float16) and every quantization group a multiple of 8
    channels (each group starts on a byte boundary)."""
    from vllm_lowrank.format.latent import RAW_BITS

    return RAW_BITS not in (layout.k_bits, layout.v_bits) and all(
        q % 8 == 0 for q in layout.k_groups + layout.v_groups)


@functools.lru_cache(maxsize=None)
def _group_table(layout, device) -> tuple[torch.Tensor, int, int, int]:
    """``(table [n, 5] int32, n_k, pad(max K group) / 8, pad(max V group) / 8)``
    of ``layout``'s per-token quantization groups
    (:meth:`~vllm_lowrank.format.latent.SlotLayout.quant_group_sizes`), cached
    per layout and device."""
    if not supports(layout):
        raise ValueError("write_packed_latents needs packed sides and quantization groups "
                         "of multiples of 8 channels")
    sides = [] if layout.k_per_channel else [
        ("k", layout.k_bits, 0, layout.k_scale_offset, layout.k_zero_offset)]
    sides.append(("v", layout.v_bits, layout.v_codes_offset, layout.v_scale_offset,
                  layout.v_zero_offset))
    rows, widest = [], {"k": 8, "v": 8}
    for side, bits, code_off, s_off, z_off in sides:
        ch = 0
        for i, q in enumerate(layout.quant_group_sizes(side)):
            rows.append((ch, q, code_off + ch * bits // 8, s_off + 2 * i, z_off + 2 * i))
            ch += q
            widest[side] = max(widest[side], q)
    n_k = 0 if layout.k_per_channel else len(layout.quant_group_sizes("k"))
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5).to(device)
    return table, n_k, pow2(widest["k"]) // 8, pow2(widest["v"]) // 8


def _check_cache(name: str, cache: torch.Tensor, slot_bytes: int) -> None:
    """Raise ``ValueError`` unless ``cache`` is uint8 ``[..., slot_bytes]``
    with a contiguous last dimension."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != slot_bytes or cache.stride(-1) != 1:
        raise ValueError(f"{name} must be uint8 [..., {slot_bytes}] contiguous in its last "
                         f"dimension, got {cache.dtype} {tuple(cache.shape)}")


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of ``x``, contiguous in the last dimension."""
    x = x[:n]
    return x if x.stride(-1) == 1 else x.contiguous()


def write_packed_latents(kv_cache: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                         slot_mapping: torch.Tensor, layout) -> None:
    """Quantize, pack and scatter one step's latents into their paged slots.

    Args:
        kv_cache: ``[num_blocks, 1, block_size, layout.slot_bytes]`` uint8, the
            last dimension contiguous.
        k_rows: ``[T, Rk]`` key latents (float, any dtype; last dim contiguous).
        v_rows: ``[T, Rv]`` value latents.
        slot_mapping: ``[T]`` int32/int64 ``block * block_size + offset``;
            negative entries (padding) write nothing.
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` with packed
            sides (``k_bits``/``v_bits`` in 8/4/3/2; per-channel keys: their
            codes and share are zeroed, :meth:`SlotLayout.encode_key_groups`
            fills them).

    Raises:
        ValueError: a layout outside :func:`supports` (a raw float16 side, a
            quantization group not a multiple of 8), or a cache that does not
            match the layout.
    """
    _check_cache("kv_cache", kv_cache, layout.slot_bytes)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    k_rows, v_rows = _rows(k_rows, n), _rows(v_rows, n)
    table, n_k, k_oct, v_oct = _group_table(layout, kv_cache.device)
    z0 = (0, layout.k_codes_bytes) if layout.k_per_channel else (0, 0)
    z1 = (layout.k_share_offset, layout.slot_bytes)
    cache_write_kernel[(n, table.shape[0] + 1)](
        k_rows, k_rows.stride(0), v_rows, v_rows.stride(0), slot_mapping, kv_cache,
        kv_cache.stride(0), kv_cache.stride(2), table, n_k, table.shape[0], *z0, *z1,
        k_rows, 0, 0, 0,
        PAGE=kv_cache.shape[2], K_BITS=layout.k_bits, V_BITS=layout.v_bits,
        K_OCT=k_oct, V_OCT=v_oct, ZBLOCK=128, RAW_BYTES=0, num_warps=1)


@functools.lru_cache(maxsize=None)
def supports_exact(slot) -> bool:
    """Whether :func:`write_exact_slots` writes this exact slot
    (:class:`~vllm_lowrank.format.exact.ExactSlot`): int8 keys and values
    (``bits=8``) in a 16- or 32-bit model dtype."""
    return slot.int8_layout is not None and supports(slot.int8_layout) \
        and slot.dtype.itemsize in (2, 4)


def write_exact_slots(exact_cache: torch.Tensor, slot, key: torch.Tensor, value: torch.Tensor,
                      slot_mapping: torch.Tensor, staged: torch.Tensor | None = None) -> None:
    """:meth:`ExactSlot.encode <vllm_lowrank.format.exact.ExactSlot.encode>` and
    the scatter by slot mapping in one launch: the same bytes as
    :func:`vllm_lowrank.attention.token_adaptive.write_exact`'s torch path.

    Keys and values are quantized per token and head to int8 by
    :func:`cache_write_kernel` (the slot's ``int8_layout``: one program per
    token and head and side); its last program per token copies the staged
    key latents bit for bit and zeroes the padding.

    Args:
        exact_cache: ``[num_blocks, 1, block_size, slot.slot_bytes]`` uint8.
        slot: The :class:`~vllm_lowrank.format.exact.ExactSlot`
            (:func:`supports_exact`).
        key, value: ``[T, kv_width]`` post-RoPE keys and values (any float
            dtype; last dimension contiguous).
        slot_mapping: ``[T]`` int32/int64 slots (negative: padding, nothing
            written).
        staged: ``[T, slot.staged_width]`` key latents, or ``None`` (their
            bytes are then zero, as the torch encode leaves them).

    Raises:
        ValueError: a slot outside :func:`supports_exact`, or a cache that does
            not match it.
    """
    if not supports_exact(slot):
        raise ValueError("write_exact_slots needs int8 exact slots in a 16- or 32-bit dtype")
    _check_cache("exact_cache", exact_cache, slot.slot_bytes)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    key, value = _rows(key, n), _rows(value, n)
    layout = slot.int8_layout
    table, n_k, k_oct, v_oct = _group_table(layout, exact_cache.device)
    if staged is None or not slot.staged_width:
        raw, n_raw, raw_bytes = key, 0, 0
    else:
        raw = _rows(staged.to(slot.dtype), n)
        n_raw, raw_bytes = slot.staged_width, slot.dtype.itemsize
    pad_from = slot.kv_bytes + n_raw * raw_bytes
    cache_write_kernel[(n, table.shape[0] + 1)](
        key, key.stride(0), value, value.stride(0), slot_mapping, exact_cache,
        exact_cache.stride(0), exact_cache.stride(2), table, n_k, table.shape[0],
        0, 0, pad_from, slot.slot_bytes, raw, raw.stride(0), n_raw, slot.kv_bytes,
        PAGE=exact_cache.shape[2], K_BITS=layout.k_bits, V_BITS=layout.v_bits,
        K_OCT=k_oct, V_OCT=v_oct, ZBLOCK=128, RAW_BYTES=raw_bytes, num_warps=1)


@triton.jit(do_not_specialize=("e_blk", "e_tok", "s_blk", "s_tok", "rk", "staged_off",
                               "share_off", "share_bytes", "ek_scale_off", "ek_zero_off"))
def key_group_write_kernel(
    lat_slot_ptr, ex_slot_ptr, exact_ptr, e_blk, e_tok, cache_ptr, s_blk, s_tok,
    rk, staged_off, share_off, share_bytes, ek_scale_off, ek_zero_off,
    G: tl.constexpr, EPAGE: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
    OCT: tl.constexpr, STAGED: tl.constexpr, EXACT_INT8: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Grid ``(T, cdiv(rk, 8 OCT))``: token ``t``, channels ``8 OCT c ..``. A
    token whose latent slot does not end a group of ``G`` (or a padding
    token) returns at once. Otherwise the program reads the group's ``G``
    staged key latents (``exact_ptr``: the exact cache, uint8, strides
    ``e_blk``/``e_tok``; ``STAGED`` elements from byte ``staged_off`` of a
    slot, read byte-wise: any alignment) or, for post-RoPE keys (nothing
    staged: the latent is the key), the exact keys themselves (``EXACT_INT8``:
    int8 codes per channel from byte 0 with a float16 scale and zero per
    ``HEAD_DIM`` channels at ``ek_scale_off`` / ``ek_zero_off``; else
    ``STAGED`` elements from byte ``staged_off = 0``), quantizes its channels over the ``G`` tokens and stores each
    token's packed codes (byte ``c OCT BITS`` of the K codes region) and the
    channels' float16 scales and zeros, byte by byte, where
    :meth:`SlotLayout.encode_key_groups` puts them (parameter byte ``b`` of
    the group in slot ``b // share_bytes`` at ``share_off + b % share_bytes``:
    scales from ``0``, zeros from ``2 rk``). Program ``c = 0`` also zeroes the
    share's padding bytes."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    lat = tl.load(lat_slot_ptr + t).to(tl.int64)
    ex = tl.load(ex_slot_ptr + t).to(tl.int64)
    if (lat >= 0) & (ex >= 0) & (lat % G == G - 1):
        levels = (1 << BITS) - 1
        first_lat = lat - (G - 1)
        first_ex = ex - (G - 1)
        lat_row = cache_ptr + (first_lat // PAGE) * s_blk + (first_lat % PAGE) * s_tok
        ex_row = exact_ptr + (first_ex // EPAGE) * e_blk + (first_ex % EPAGE) * e_tok \
            + staged_off
        i = tl.arange(0, G)
        o = tl.arange(0, OCT)
        k = tl.arange(0, 8)
        ch = c * (OCT * 8) + o[:, None] * 8 + k[None, :]  # [OCT, 8]
        m = ch < rk
        if EXACT_INT8:  # code * scale + zero, one pair per token and head
            rows = ex_row + i[:, None, None] * e_tok
            code = tl.load(rows + ch[None, :, :], mask=m[None, :, :], other=0).to(tl.float32)
            hd = (ch // HEAD_DIM)[None, :, :]
            ksc = _load_raw(rows + ek_scale_off, hd, m[None, :, :], tl.float16).to(tl.float32)
            kze = _load_raw(rows + ek_zero_off, hd, m[None, :, :], tl.float16).to(tl.float32)
            x = code * ksc + kze  # [G, OCT, 8]
        else:
            x = _load_raw(ex_row + i[:, None, None] * e_tok, ch[None, :, :], m[None, :, :],
                          STAGED).to(tl.float32)  # [G, OCT, 8]
        lo = tl.min(x, 0)
        hi = tl.max(x, 0)
        scale = tl.math.div_rn(hi - lo, levels * 1.0).to(tl.float16)  # [OCT, 8]
        zero = lo.to(tl.float16)
        s = scale.to(tl.float32)[None, :, :]
        z = zero.to(tl.float32)[None, :, :]
        safe = tl.where(s > 0, s, 1.0)
        # round half to even, as in _pack_store
        q = (tl.math.div_rn(x - z, safe) + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(tl.where(s > 0, q, 0.0), 0.0), levels * 1.0)
        codes = tl.where(m[None, :, :], q, 0.0).to(tl.int64)
        word = tl.sum(codes << (k * BITS).to(tl.int64)[None, None, :], 2)  # [G, OCT]
        nb = tl.arange(0, 8)
        byte = (word[:, :, None] >> (nb * 8).to(tl.int64)[None, None, :]) & 0xFF
        octet = c * OCT + o
        bm = (octet[None, :, None] * 8 < rk) & (nb[None, None, :] < BITS)
        tl.store(lat_row + i[:, None, None] * s_tok + octet[None, :, None] * BITS
                 + nb[None, None, :], byte.to(tl.uint8), mask=bm)
        # the channels' scales (parameter bytes 2 ch ..) and zeros (2 rk + 2 ch ..)
        _store_share(lat_row, 2 * ch, scale, m, s_tok, share_off, share_bytes)
        _store_share(lat_row, 2 * rk + 2 * ch, zero, m, s_tok, share_off, share_bytes)
        if c == 0:  # the share's padding, G * share_bytes - 4 rk < G bytes
            b = 4 * rk + i
            tl.store(lat_row + (b // share_bytes) * s_tok + share_off + b % share_bytes,
                     tl.zeros([G], dtype=tl.uint8), mask=b < G * share_bytes)


@triton.jit
def _store_share(group_ptr, first, x, mask, s_tok, share_off, share_bytes):
    """Store the float16 ``x`` (``[OCT, 8]``) as parameter bytes ``first``,
    ``first + 1`` (little-endian) of the group whose first slot is at
    ``group_ptr``: byte ``b`` in slot ``b // share_bytes`` at ``share_off + b %
    share_bytes``."""
    two = tl.arange(0, 2)
    bits16 = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    val = (bits16[:, :, None] >> (two * 8)[None, None, :]) & 0xFF
    b = first[:, :, None] + two[None, None, :]  # [OCT, 8, 2]
    tl.store(group_ptr + (b // share_bytes) * s_tok + share_off + b % share_bytes,
             val.to(tl.uint8), mask=mask[:, :, None])


@triton.jit
def _load_raw(row_ptr, idx, mask, DTYPE: tl.constexpr):
    """Elements ``idx`` of a ``DTYPE`` (16- or 32-bit float) array stored
    little-endian at the byte pointer ``row_ptr``, any alignment."""
    size: tl.constexpr = DTYPE.primitive_bitwidth // 8
    at = row_ptr + idx * size
    word = tl.load(at, mask=mask, other=0).to(tl.int32)
    for b in tl.static_range(1, size):
        word = word | (tl.load(at + b, mask=mask, other=0).to(tl.int32) << (8 * b))
    if size == 2:
        out = word.to(tl.int16).to(DTYPE, bitcast=True)
    else:
        out = word.to(DTYPE, bitcast=True)
    return out


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

KEY_GROUP_CHANNELS = 64
"""Channels per program of :func:`write_key_groups` (8 octets of codes)."""


@functools.lru_cache(maxsize=None)
def supports_key_groups(layout, slot) -> bool:
    """Whether :func:`write_key_groups` writes per-channel key groups of
    ``layout`` staged in ``slot`` (or, with nothing staged, read from its exact
    post-RoPE keys): packed keys (8/4/3/2 bits), a power-of-two group, and a
    model dtype of bfloat16, float16 or float32."""
    from vllm_lowrank.format.latent import SUPPORTED_BITS

    g = layout.k_channel_tokens
    rk = sum(layout.k_ranks)
    keys = slot.staged_width == rk or (slot.staged_width == 0 and rk == slot.kv_width)
    return (layout.k_per_channel and layout.k_bits in SUPPORTED_BITS and g & (g - 1) == 0
            and keys and slot.dtype in _TL_DTYPES)


def write_key_groups(kv_cache: torch.Tensor, exact_cache: torch.Tensor, slot,
                     slot_mapping: torch.Tensor, exact_slots: torch.Tensor, layout) -> None:
    """Quantize per channel every key group this step completes and write its
    codes and scales into the latent cache, in one launch and without a host
    sync, for any number of tokens: the bytes of
    :func:`vllm_lowrank.attention.token_adaptive.write_key_groups` (KIVI's
    per-channel keys, Liu et al. 2024, sec. 3.2; the group's ``G`` latents
    read back from the exact cache where they were staged).

    Tokens that end no group (``G - 1`` in ``G`` of a decode step) return at
    once; the torch path rewrote the null block for them inside CUDA graphs.

    Args:
        kv_cache: Latent cache ``[num_blocks, 1, block_size, layout.slot_bytes]`` uint8.
        exact_cache: Exact cache ``[num_blocks, 1, exact_block_size,
            slot.slot_bytes]`` uint8 holding the staged latents (or, for
            post-RoPE keys, the keys themselves).
        slot: Its :class:`~vllm_lowrank.format.exact.ExactSlot`.
        slot_mapping, exact_slots: ``[T]`` int32/int64 slots of this step's
            tokens in the latent and the exact cache (negative: padding).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` with
            per-channel keys.

    Raises:
        ValueError: a layout or slot outside :func:`supports_key_groups`, or
            caches that do not match them.
    """
    if not supports_key_groups(layout, slot):
        raise ValueError("write_key_groups needs packed per-channel keys in power-of-two "
                         "groups, staged in a 16- or 32-bit float exact slot")
    _check_cache("kv_cache", kv_cache, layout.slot_bytes)
    _check_cache("exact_cache", exact_cache, slot.slot_bytes)
    n = min(slot_mapping.shape[0], exact_slots.shape[0])
    if n == 0:
        return
    rk = sum(layout.k_ranks)
    staged = slot.staged_width > 0
    int8 = not staged and slot.int8_layout is not None
    ks_off, kz_off = ((slot.int8_layout.k_scale_offset, slot.int8_layout.k_zero_offset)
                      if int8 else (0, 0))
    key_group_write_kernel[(n, triton.cdiv(rk, KEY_GROUP_CHANNELS))](
        slot_mapping, exact_slots, exact_cache, exact_cache.stride(0), exact_cache.stride(2),
        kv_cache, kv_cache.stride(0), kv_cache.stride(2), rk, slot.kv_bytes if staged else 0,
        layout.k_share_offset, layout.k_share_bytes, ks_off, kz_off,
        G=layout.k_channel_tokens, EPAGE=exact_cache.shape[2], PAGE=kv_cache.shape[2],
        BITS=layout.k_bits, OCT=KEY_GROUP_CHANNELS // 8, STAGED=_TL_DTYPES[slot.dtype],
        EXACT_INT8=int8, HEAD_DIM=slot.head_dim, num_warps=4)
