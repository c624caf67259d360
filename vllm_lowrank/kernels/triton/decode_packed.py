r"""Post-RoPE decode attention over per-token packed latents (the ``2x`` preset's path).

The case: post-RoPE latents (ZACK; no key rebuild, no RoPE in the kernel), one
uniform key rank ``RK`` and value rank ``RV`` for every head group, both sides
packed at 8 or 4 bits with one float16 scale/zero pair per token and head group
(Palu's per-token quantization, :class:`vllm_lowrank.format.latent.SlotLayout`
with ``k_group = v_group = None``). Per sequence ``b``, head group ``g`` (its
``HG`` query heads) and token ``t``, with codes ``c`` and the pair ``(s, z)``
(latent ``= s c + z``)::

    score_h,t = scale * (s_k,t (q~_h . c_k,t) + z_k,t sum(q~_h))
    o_h       = sum_t p_h,t (s_v,t c_v,t + z_v,t)
              = (P * s_v) C_v  +  (sum_t p_h,t z_v,t)  (added to every channel)

so the tensor cores see the codes themselves and the pairs are applied per token
after the dots (the same algebra as :mod:`.decode_kernels`' post-scaled mode).

What this kernel does differently from the general grid kernel: nothing is
unpacked into the channel order. A byte of 4-bit codes holds channels ``2j``
(low nibble) and ``2j + 1`` (high nibble); the low and high nibbles of a tile
are two separate ``[BLOCK_N, RV / 2]`` operands, so

- keys: ``q~ . c = q~[0::2] . lo + q~[1::2] . hi`` (the query is loaded in two
  strided halves once per program);
- values: two accumulators ``O_lo = (P s_v) lo``, ``O_hi = (P s_v) hi``, stored
  to the even and odd output channels.

8-bit sides are one operand. Codes enter the dots centred (``c - 2^(bits-1)``,
integers of at most 8 bits: exact in float16) and the zero points carry the
offset (``z + 2^(bits-1) s``); on a GPU the conversion is the float16
exponent trick (``0x6400 | c`` is the float16 ``1024 + c``): one OR and one
subtraction per code. Operands are float16 (10-bit mantissa: the queries are
rounded less than in bf16; queries must stay below 65504 in magnitude), scores,
softmax and accumulators float32. Under the Triton interpreter everything is
float32.

Split-K (flash-decoding), sliding windows and the token-adaptive latent span
(with its log-sum-exp) share the tile split of :func:`.tiles.split_tiles` and
the reduce pass :func:`.tiles.reduce_splits_kernel` with the other kernels; the
partial and output formats are theirs (output ``[B, out_width]`` float32, query
heads in order, ``RV`` columns each).

Host side: :func:`blocker` (why a layer is out of scope) and :func:`launch`,
called by :class:`vllm_lowrank.kernels.triton.decode.LatentLaunch`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tiles import add_pair, centred, offset_pair, query_rows, split_tiles, tokens_per_program

SUPPORTED_BITS = (8, 4)
"""Code widths of this kernel (one or two codes per byte)."""


@triton.jit
def _tile_pairs(bt_row, cache_ptr, s_blk, s_tok, pos, valid, g, k_scale_off, k_zero_off,
                v_scale_off, v_zero_off, PAGE: tl.constexpr, K_OFF: tl.constexpr,
                V_OFF: tl.constexpr):
    """The slot pointers [N] of positions ``pos`` and the key and value pairs
    of head group ``g`` there (:func:`.tiles.offset_pair`; 0 where not ``valid``):
    ``(rows, s_k, z_k', s_v, z_v')``, the pairs float32."""
    blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    rows = cache_ptr + (blk * s_blk + (pos % PAGE) * s_tok)
    ks, kz = offset_pair(rows, valid, k_scale_off + 2 * g, k_zero_off + 2 * g, K_OFF)
    vs, vz = offset_pair(rows, valid, v_scale_off + 2 * g, v_zero_off + 2 * g, V_OFF)
    return rows, ks, kz, vs, vz


@triton.jit
def packed_decode_kernel(
    q_ptr, s_qb, s_qh,
    cache_ptr, s_blk, s_tok,
    bt_ptr, s_bt, seq_lens_ptr,
    v_codes_off, k_scale_off, k_zero_off, v_scale_off, v_zero_off,
    po_ptr, plse_ptr, out_width, num_heads, n_splits, qk_scale,
    window, sink, recent, qsl_ptr,
    HG: tl.constexpr, Q_PAD: tl.constexpr, RK: tl.constexpr, RV: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, DT: tl.constexpr, F16: tl.constexpr,
    SPLIT: tl.constexpr, LSE: tl.constexpr, WINDOW: tl.constexpr, SPAN: tl.constexpr,
    QT: tl.constexpr,
):
    """One program per (split ``s``, head group ``g``, sequence ``b``). See the
    module docstring for the math; ``SPLIT``: store the normalised partial and
    its base-2 LSE at ``[row, s]`` of ``po_ptr`` / ``plse_ptr``; otherwise the
    output row (and with ``LSE`` the natural LSE into ``plse_ptr [rows, H]``).

    ``QT > 1``: sequence ``b`` has up to ``QT`` query tokens, rows ``qsl[b] ..
    qsl[b + 1] - 1`` of the queries and outputs (a speculative verify step);
    its token ``t`` attends positions ``< seq_len - (q_b - 1 - t)`` (causal
    over the drafts). Their ``QT x HG`` query rows share each key and value
    tile: the cache is read once for all of them. No window, no span.
    ``QT == 1``: one query row per sequence, row ``b`` (``qsl_ptr`` unused)."""
    s = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2)
    KC: tl.constexpr = 8 // K_BITS  # codes per byte
    VC: tl.constexpr = 8 // V_BITS
    KB: tl.constexpr = RK // KC     # code bytes per slot and group
    VB: tl.constexpr = RV // VC
    K_OFF: tl.constexpr = 1 << (K_BITS - 1)
    V_OFF: tl.constexpr = 1 << (V_BITS - 1)

    seq_len = tl.load(seq_lens_ptr + b)
    h, hm, tok, row_end, _ = query_rows(b, seq_len, qsl_ptr, Q_PAD, HG, QT)
    head = g * HG + h
    qrow = q_ptr + tok * s_qb + head.to(tl.int64) * s_qh
    kj = tl.arange(0, KB)
    vj = tl.arange(0, VB)
    # Query channels of each key operand: q~[KC j + n] meets nibble / byte n of byte j.
    q0 = tl.load(qrow[:, None] + KC * kj[None, :], mask=hm[:, None], other=0.0).to(DT)
    qsum = tl.sum(q0.to(tl.float32), 1)
    q1 = q0
    if KC == 2:
        q1 = tl.load(qrow[:, None] + 2 * kj[None, :] + 1, mask=hm[:, None], other=0.0).to(DT)
        qsum += tl.sum(q1.to(tl.float32), 1)
    k_codes = g * KB
    v_codes = v_codes_off + g * VB

    first, end, t_lo, t_hi = split_tiles(seq_len, s, n_splits, window, sink, recent,
                                         BLOCK_N, WINDOW, SPAN)
    i = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    m_i = tl.full([Q_PAD], float("-inf"), tl.float32)
    l_i = tl.full([Q_PAD], 0.0, tl.float32)
    z_i = tl.full([Q_PAD], 0.0, tl.float32)  # sum_t p (value zero point)
    acc0 = tl.full([Q_PAD, VB], 0.0, tl.float32)
    acc1 = acc0
    # The slot pointers and scale/zero pairs of tile t + 1 are loaded during
    # tile t (the 2-byte gathers are not pipelined by the compiler; waiting for
    # them in the tile that uses them cost 1.3x at 8 x 32k, H200). Carrying the
    # pointers over, rather than loading the block table again for the codes,
    # gave 2-3.5 % with 3 stages (H200, benchmarks/README.md).
    pos = first + t_lo * BLOCK_N + i
    valid = pos < tl.where(t_lo < t_hi, end, 0)
    rows_c, ks, kz, vs, vz = _tile_pairs(bt_row, cache_ptr, s_blk, s_tok, pos, valid, g,
                                         k_scale_off, k_zero_off, v_scale_off, v_zero_off,
                                         PAGE, K_OFF, V_OFF)
    for t in range(t_lo, t_hi):
        pos = first + t * BLOCK_N + i
        valid = pos < end
        rows = rows_c  # [BLOCK_N] slot pointers
        rows_n, ks_n, kz_n, vs_n, vz_n = _tile_pairs(
            bt_row, cache_ptr, s_blk, s_tok, pos + BLOCK_N,
            pos + BLOCK_N < tl.where(t + 1 < t_hi, end, 0), g, k_scale_off, k_zero_off,
            v_scale_off, v_zero_off, PAGE, K_OFF, V_OFF)
        # Keys, transposed [KB, BLOCK_N]: S = q~ C_k^T.
        kx = tl.load(rows[None, :] + k_codes + kj[:, None], mask=valid[None, :], other=0)
        if KC == 1:
            sc = tl.dot(q0, centred(kx, K_OFF, DT, F16))
        else:
            sc = tl.dot(q0, centred(kx & 15, K_OFF, DT, F16))
            sc = tl.dot(q1, centred(kx >> 4, K_OFF, DT, F16), sc)
        sc = (sc * ks[None, :] + qsum[:, None] * kz[None, :]) * qk_scale
        if QT == 1:
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = m_new
        else:
            sc = tl.where(valid[None, :] & (pos[None, :] < row_end[:, None]), sc,
                          float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            # a row whose context ends before this tile has seen no position yet
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(sc - m_use[:, None])
        # sum_t p and sum_t p z_v in one reduction (one pass over the warps).
        p_sum, pz_sum = tl.reduce((p, p * vz[None, :]), 1, add_pair)
        l_i = l_i * alpha + p_sum
        z_i = z_i * alpha + pz_sum
        ps = (p * vs[None, :]).to(DT)
        vx = tl.load(rows[:, None] + v_codes + vj[None, :], mask=valid[:, None], other=0)
        if VC == 1:
            acc0 = tl.dot(ps, centred(vx, V_OFF, DT, F16), acc0 * alpha[:, None])
        else:
            acc0 = tl.dot(ps, centred(vx & 15, V_OFF, DT, F16), acc0 * alpha[:, None])
            acc1 = tl.dot(ps, centred(vx >> 4, V_OFF, DT, F16), acc1 * alpha[:, None])
        m_i = m_new
        rows_c, ks, kz, vs, vz = rows_n, ks_n, kz_n, vs_n, vz_n

    # Epilogue: an empty split or span (l = 0) gives a zero row and LSE -inf.
    nonempty = l_i > 0.0
    inv_l = 1.0 / tl.where(nonempty, l_i, 1.0)
    zc = (z_i * inv_l)[:, None]
    lse2 = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    if SPLIT:
        o_row = po_ptr + (tok * n_splits + s) * out_width  # [Q_PAD]
        tl.store(plse_ptr + (tok * n_splits + s) * num_heads + head, lse2, mask=hm)
    else:
        o_row = po_ptr + tok * out_width
        if LSE:
            tl.store(plse_ptr + tok * num_heads + head, lse2 * 0.6931471805599453, mask=hm)
    col = o_row[:, None] + (head[:, None] * RV + VC * vj[None, :])
    tl.store(col, acc0 * inv_l[:, None] + zc, mask=hm[:, None])
    if VC == 2:
        tl.store(col + 1, acc1 * inv_l[:, None] + zc, mask=hm[:, None])


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def blocker(plan, layout, mode: str, slot_stride: int, block_size: int) -> str | None:
    """Why a layer cannot take :func:`packed_decode_kernel`, or ``None``.

    Its scope: ``post_rope`` mode; a packed cache (``layout`` given) with per-token
    keys (no ``k_channel_tokens``), both sides at :data:`SUPPORTED_BITS` with one
    scale/zero pair per token and head group (``k_group`` / ``v_group`` ``None``
    or the rank); one key rank and one value rank for every group, powers of two
    with at least 16 code bytes per side (``RK * bits / 8 >= 16``, the tensor
    cores' smallest K / N); at most 16 query heads per group; slots and cache
    strides of an even number of bytes (float16 pairs).

    Args:
        slot_stride: Bytes from one cache slot to the next.
        block_size: Tokens per KV block.
    """
    if mode != "post_rope":
        return "pre_rope mode"
    if layout is None:
        return "unquantized cache"
    if slot_stride % 2 or (slot_stride * block_size) % 2:
        return "odd slot or scale offsets"
    return _layout_blocker(plan, layout)


@functools.lru_cache(maxsize=256)
def _layout_blocker(plan, layout) -> str | None:
    if layout.k_per_channel:
        return "per-channel keys"
    if layout.k_bits not in SUPPORTED_BITS or layout.v_bits not in SUPPORTED_BITS:
        return f"bits ({layout.k_bits}, {layout.v_bits}) not in {SUPPORTED_BITS}"
    if layout.k_groups != layout.k_ranks or layout.v_groups != layout.v_ranks:
        return "grouped scales"
    if len(set(plan.k_ranks)) != 1 or len(set(plan.v_ranks)) != 1:
        return "uneven ranks"
    rk, rv = plan.k_ranks[0], plan.v_ranks[0]
    if not (_pow2(rk) and _pow2(rv)) or rk * layout.k_bits < 128 or rv * layout.v_bits < 128:
        return f"ranks ({rk}, {rv}) not powers of two with >= 16 code bytes"
    if plan.heads_per_group > 16:
        return "more than 16 query heads per group"
    if layout.slot_bytes % 2 or any(o % 2 for o in (
            layout.k_scale_offset, layout.k_zero_offset, layout.v_scale_offset,
            layout.v_zero_offset)):
        return "odd slot or scale offsets"
    return None


def launch(plan, layout, query, kv_cache, block_table, seq_lens, *, qk_scale: float,
           num_splits: int, block_n: int, num_warps: int, num_stages: int,
           po: torch.Tensor, plse: torch.Tensor, window: int, sink: int, recent: int,
           use_window: bool, use_span: bool, return_lse: bool, interpreting: bool,
           query_start_loc: torch.Tensor | None = None, max_query_len: int = 1) -> None:
    """Launch :func:`packed_decode_kernel` on the grid ``(num_splits, num_groups,
    B)``. ``po`` / ``plse``: the split partials ``[T, S, out_width]`` /
    ``[T, S, H]`` when ``num_splits > 1``, else the output ``[T, out_width]`` and
    the LSE buffer ``[T, H]`` (unused without ``return_lse``), for ``T`` query
    rows. Arguments are those :class:`.decode.LatentLaunch` prepared;
    ``qk_scale`` is the softmax scale times ``log2(e)``.

    ``query_start_loc``: ``[B + 1]`` int32 (device) offsets of each sequence's
    query rows, at most ``max_query_len`` each (a verify step); ``None``: one
    row per sequence (``T = B``).

    Raises:
        ValueError: several query tokens per sequence with a window or a span.
    """
    hg = plan.heads_per_group
    if query_start_loc is not None and (use_window or use_span):
        raise ValueError("several query tokens per sequence take no window or span")
    qt = tokens_per_program(query_start_loc, max_query_len)
    packed_decode_kernel[(num_splits, plan.num_groups, seq_lens.shape[0])](
        query, query.stride(0), query.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(2),
        block_table, block_table.stride(0), seq_lens,
        layout.v_codes_offset, layout.k_scale_offset, layout.k_zero_offset,
        layout.v_scale_offset, layout.v_zero_offset,
        po, plse, plan.out_width, plan.shape.num_heads, num_splits, qk_scale,
        window, sink, recent, seq_lens if query_start_loc is None else query_start_loc,
        HG=hg, Q_PAD=max(16, triton.next_power_of_2(qt * hg)), RK=plan.k_ranks[0],
        RV=plan.v_ranks[0], K_BITS=layout.k_bits, V_BITS=layout.v_bits, BLOCK_N=block_n,
        PAGE=kv_cache.shape[2], DT=tl.float32 if interpreting else tl.float16,
        F16=not interpreting, SPLIT=num_splits > 1, LSE=bool(return_lse),
        WINDOW=use_window, SPAN=use_span, QT=qt, num_warps=num_warps, num_stages=num_stages)
