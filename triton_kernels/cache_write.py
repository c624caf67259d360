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
                               "z1_hi"))
def cache_write_kernel(
    k_ptr, s_kt, v_ptr, s_vt, slot_ptr, cache_ptr, s_blk, s_tok, tab_ptr,
    n_k, n_groups, z0_lo, z0_hi, z1_lo, z1_hi,
    PAGE: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_OCT: tl.constexpr, V_OCT: tl.constexpr, ZBLOCK: tl.constexpr,
):
    """Grid ``(T, n_groups + 1)``: token ``t``, quantization group ``i`` (the
    first ``n_k`` are the key side's). ``tab_ptr``: ``[n_groups, 5]`` int32 rows
    ``(channel offset in its side's row, channels, code byte offset, scale byte
    offset, zero byte offset)``. Program ``n_groups`` zeroes the byte ranges
    ``[z0_lo, z0_hi)`` and ``[z1_lo, z1_hi)`` of the slot. The widths and
    offsets that differ between layers are not specialized on (one compile per
    bit width and page, not per layer)."""
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
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != layout.slot_bytes \
            or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be uint8 [..., {layout.slot_bytes}] contiguous in "
                         f"its last dimension, got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    k_rows, v_rows = k_rows[:n], v_rows[:n]
    if k_rows.stride(-1) != 1:
        k_rows = k_rows.contiguous()
    if v_rows.stride(-1) != 1:
        v_rows = v_rows.contiguous()
    table, n_k, k_oct, v_oct = _group_table(layout, kv_cache.device)
    z0 = (0, layout.k_codes_bytes) if layout.k_per_channel else (0, 0)
    z1 = (layout.k_share_offset, layout.slot_bytes)
    cache_write_kernel[(n, table.shape[0] + 1)](
        k_rows, k_rows.stride(0), v_rows, v_rows.stride(0), slot_mapping, kv_cache,
        kv_cache.stride(0), kv_cache.stride(2), table, n_k, table.shape[0], *z0, *z1,
        PAGE=kv_cache.shape[2], K_BITS=layout.k_bits, V_BITS=layout.v_bits,
        K_OCT=k_oct, V_OCT=v_oct, ZBLOCK=128, num_warps=1)
