r"""Token-adaptive decode: the exact part and its merge with the latent part, in one kernel.

A token-adaptive (TALE) decode step attends to two disjoint sets of positions
(:mod:`vllm_lowrank.attention.token_adaptive`): the latent span, decoded by the
latent kernels of this package into value-latent outputs ``o_L [B, out_width]``
with their log-sum-exp ``lse_L [B, H]``, and the exact set ``E`` (the ``S`` sink
positions and the last ``W + 1``, the new token included), read from the exact
cache. The latent outputs are lifted to head space before the call, ``o_L' =
o_L B_v`` (Palu eq. 6 unfolded: :func:`~vllm_lowrank.attention.token_adaptive.
values_up`, one GEMM per head group that reads ``B_v`` once; done inside this
kernel it was re-read from L2 by every program, ``r_v x d`` float32 per sequence
and KV head: 15 of 83 us at 16 x 4k for the ``8x`` preset, H200). This kernel
does the rest of the step for one sequence ``b`` and KV head ``j`` (its ``QPK``
query heads) per program::

    o_E, lse_E  = softmax attention of q over E           (exact keys/values)
    o           = (e^{lse_L} o_L' + e^{lse_E} o_E) / (e^{lse_L} + e^{lse_E})

(the log-sum-exp merge of flash-decoding, Dao et al. 2023), and stores ``o`` in
the layer's output dtype: what :func:`~vllm_lowrank.attention.token_adaptive.
exact_attention` and :func:`~vllm_lowrank.attention.token_adaptive.merge` do in
about 40 torch kernels per layer.

Exact slots (:class:`vllm_lowrank.format.exact.ExactSlot`): post-RoPE keys and
values in the model dtype (``bits=16``), or per-head int8 codes with one float16
scale/zero pair per token, head and side (``bits=8``). Int8 codes enter the dots
centred (``code - 128``, exact in bf16) and their scales are applied after them,
as in :mod:`.decode_packed`: ``s_t = scale_t (q . c_t) + zero_t sum(q)`` and
``o = (sum_t (p_t scale_t) c_t + sum_t p_t zero_t) / l`` (no dequantized tile in
registers: 1.35-1.43x faster than dequantizing, measured with the tile and warp
choice below). Scores and the softmax are float32 in base 2 (the exponent of
``exp2`` carries ``log2 e``); the dots take the model dtype, as stock vLLM's
attention does (float32 under the Triton interpreter).

Host side: :func:`blocker` and :func:`exact_merge_decode`.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .decode_prep import LOG2E, TL_DTYPES, interpreting, pow2_divisor
from .tiles import add_combine, load_latent, max_combine

BLOCK = 64
"""Most exact positions per tile. A tile is ``min(BLOCK, block size)`` aligned
positions, so it lies in one block of the exact cache: its slots are one
pointer plus 32-bit offsets. Tiles of positions that crossed blocks computed a
64-bit slot address per row in every register layout that used it (1,828 SASS
instructions per 64-position tile and 254 registers, against 554 per
32-position tile and 101 registers, sm_90, triton 3.6); 2.2x faster at 128 x
2k on an H200 with the same warps (benchmarks/README.md's history in git, "Fewer instructions
per tile")."""

STAGES = 1
"""Software-pipelining stages of the tile loop."""

WARPS = 4
"""Warps per program. H200 sweep of the block-aligned tiles (32 positions:
the ``8x`` preset's block size), ``8x`` int8 slots, warps x stages in {4, 8} x
{1, 2, 3}: 4 warps and 1 stage took 70.6 us at 128 x 2k (8 warps, 2 stages:
108.6; 4 warps, 2 stages: 84.8) and 25.0 us at 16 x 4k (the best, 4 warps and
2 stages: 21.2)."""


@triton.jit
def exact_merge_kernel(
    q_ptr, s_qb, s_qh,
    ex_ptr, s_eblk, s_etok,
    bt_ptr, s_bt, lens_ptr,
    up_ptr, s_ub, s_uh, lse_ptr, s_lse,
    out_ptr, s_out,
    sink, recent, qk_scale,
    kv_width, v_codes_off, k_scale_off, k_zero_off, v_scale_off, v_zero_off,
    D: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
    ALIGNED: tl.constexpr, F32: tl.constexpr, POST: tl.constexpr, SLOT_MULT: tl.constexpr,
):
    """One program per ``(b, j)``: sequence ``b``, KV head ``j``.

    Pointers and strides: the queries ``[B, H, D]``; the exact cache (``BITS``
    16: viewed as its dtype, strides in elements; 8: uint8, in bytes); its block
    table ``[B, max_blocks]`` int32 and the sequence lengths ``[B]``; the latent
    part lifted to head space ``o_L' [B, H, D]`` and its ``lse_L [B, H]``
    (natural log), float32; the output ``[B, H * D]``. ``qk_scale`` = softmax
    scale times ``log2 e``. ``DT``: the dots' operand dtype; ``F32``: float32
    dots in IEEE precision; ``POST``: int8 codes in the dots (module docstring)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    hq = tl.arange(0, Q_PAD)
    hm = hq < QPK
    c = tl.arange(0, D)
    heads = j * QPK + hq
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + c[None, :],
                mask=hm[:, None], other=0.0).to(DT)

    i = tl.arange(0, BLOCK_N)
    tail = tl.maximum(sink, seq_len - 1 - recent)  # first non-sink exact position
    # Tiles of BLOCK_N aligned positions (BLOCK_N divides the page: a tile lies
    # in one block, its slots one pointer plus 32-bit offsets): those holding
    # the sinks, then those holding the tail from the first one past them.
    n_sink = (tl.minimum(sink, seq_len) + BLOCK_N - 1) // BLOCK_N
    t_tail = tl.maximum(tail // BLOCK_N, n_sink)
    n_tiles = n_sink + tl.maximum((seq_len + BLOCK_N - 1) // BLOCK_N - t_tail, 0)
    roff = tl.multiple_of(i * s_etok, SLOT_MULT)
    m_i = tl.full([Q_PAD], float("-inf"), tl.float32)
    l_i = tl.full([Q_PAD], 0.0, tl.float32)
    acc = tl.full([Q_PAD, D], 0.0, tl.float32)
    z_i = tl.full([Q_PAD], 0.0, tl.float32)  # sum_t p z_v (POST)
    q_sum = tl.sum(q.to(tl.float32), 1)  # for the key zero points (POST)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for k_t in range(0, n_tiles):
        p0 = tl.where(k_t < n_sink, k_t, t_tail + k_t - n_sink) * BLOCK_N
        pos = p0 + i
        valid = (pos < seq_len) & ((pos < sink) | (pos >= tail))
        blk = tl.load(bt_row + p0 // PAGE).to(tl.int64)
        base = ex_ptr + tl.multiple_of(blk * s_eblk + (p0 % PAGE) * s_etok, SLOT_MULT)
        if BITS == 16:
            k = tl.load(base + roff[:, None] + (j * D + c)[None, :], mask=valid[:, None],
                        other=0.0)
            v = tl.load(base + roff[:, None] + (kv_width + j * D + c)[None, :],
                        mask=valid[:, None], other=0.0)
        else:
            k, ks, kz = load_latent(base, roff, valid, j * D, D, j, k_scale_off, k_zero_off,
                                    DT, True, BITS, D, 0, ALIGNED, 1, POST)
            v, vs, vz = load_latent(base, roff, valid, v_codes_off + j * D, D, j,
                                    v_scale_off, v_zero_off, DT, True, BITS, D, 0, ALIGNED, 1,
                                    POST)
        if F32:
            sc = tl.dot(q, tl.trans(k.to(DT)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k.to(DT)))
        if POST:
            sc = sc * ks[None, :] + q_sum[:, None] * kz[None, :]
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
        if POST:  # value codes in the dot, their scales on the probabilities
            z_i = z_i * alpha + tl.reduce(p * vz[None, :], 1, add_combine)
            p = p * vs[None, :]
        if F32:
            acc = tl.dot(p, v.to(DT), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(DT), v.to(DT), acc * alpha[:, None])
        m_i = m_new

    # the exact set holds at least the new token (l_i > 0) unless the row is a
    # CUDA graph's padding (seq_len 0): then zeros
    seen = l_i > 0.0
    lse_e = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_e = (acc + z_i[:, None]) / tl.where(seen, l_i, 1.0)[:, None]

    o_l = tl.load(up_ptr + b.to(tl.int64) * s_ub + heads[:, None] * s_uh + c[None, :],
                  mask=hm[:, None], other=0.0)
    lse_l = tl.load(lse_ptr + b.to(tl.int64) * s_lse + heads, mask=hm,
                    other=float("-inf")) * 1.4426950408889634
    top = tl.maximum(lse_l, lse_e)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_l = tl.exp2(lse_l - top)
    w_e = tl.exp2(lse_e - top)
    w = w_l + w_e
    o = (o_l * w_l[:, None] + o_e * w_e[:, None]) / tl.where(w > 0.0, w, 1.0)[:, None]
    tl.store(out_ptr + b.to(tl.int64) * s_out + heads[:, None] * D + c[None, :],
             o.to(out_ptr.dtype.element_ty), mask=hm[:, None])


def blocker(plan, slot, query: torch.Tensor, exact_cache: torch.Tensor,
            window: int | None) -> str | None:
    """Why a token-adaptive decode step cannot take :func:`exact_merge_decode`
    (then the torch functions of :mod:`vllm_lowrank.attention.token_adaptive`
    run), or ``None`` if it can.

    Its scope: a CUDA device (or the Triton interpreter); no sliding window;
    ``head_dim`` a power of two from 16 to 256; at most 64 query heads per KV
    head; exact slots at 16 bits in the query's dtype with an even slot size,
    or at 8 bits; an exact cache ``[num_blocks, 1, block_size, slot_bytes]``."""
    sh = plan.shape
    d = sh.head_dim
    checks = (
        (query.device.type == "cuda" or interpreting(), "not on a CUDA device"),
        (window is None, "sliding window"),
        (16 <= d <= 256 and d & (d - 1) == 0, "head_dim not a power of two in 16..256"),
        (sh.queries_per_kv <= 64, "more than 64 query heads per KV head"),
        (query.dtype in TL_DTYPES, "query dtype"),
        (slot.bits == 8 or (slot.dtype == query.dtype
                            and slot.slot_bytes % query.element_size() == 0),
         "16-bit exact slots in another dtype than the queries, or not a whole number "
         "of its elements"),
        (exact_cache.dim() == 4 and exact_cache.shape[1] == 1
         and exact_cache.dtype == torch.uint8, "exact cache layout"),
        (exact_cache.shape[2] >= 16 and exact_cache.shape[2] & (exact_cache.shape[2] - 1) == 0,
         "exact cache block size not a power of two of at least 16"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


def exact_merge_decode(plan, scale: float, query: torch.Tensor,
                       exact_cache: torch.Tensor, slot, exact_block_table: torch.Tensor,
                       seq_lens: torch.Tensor, sink: int, recent: int,
                       lat_up: torch.Tensor, lat_lse: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact part of a token-adaptive decode step merged with the latent
    part (module docstring), in one launch with a fixed grid (CUDA graphs).

    Args:
        plan: The layer's :class:`~vllm_lowrank.factorization.plan.LayerPlan`.
        scale: Softmax scale.
        query: ``[B, H, d]`` post-RoPE queries at ``seq_len - 1``.
        exact_cache: ``[num_blocks, 1, block_size, slot_bytes]`` uint8, this
            step's token already written; slot: its
            :class:`~vllm_lowrank.format.exact.ExactSlot`.
        exact_block_table: ``[B, max_blocks]`` int32 rows of its block table.
        seq_lens: ``[B]`` int32 (this token included).
        sink, recent: ``S`` and ``W``: the exact set is positions ``< S`` and
            ``>= max(S, seq_len - 1 - W)``.
        lat_up, lat_lse: The latent span's outputs lifted to head space,
            ``[B, H, d]`` float32 or the model dtype, with unit stride in ``d``
            (:func:`~vllm_lowrank.attention.token_adaptive.values_up`), and their
            ``[B, H]`` natural-log log-sum-exp (``-inf``: empty).
        out: ``[B, H * d]`` output (any float dtype, unit stride in its last
            dimension), or ``None`` for a new float32 tensor.

    Returns:
        ``out``.

    Raises:
        ValueError: a call outside :func:`blocker`'s scope.
    """
    why = blocker(plan, slot, query, exact_cache, None)
    if why is not None:
        raise ValueError(f"exact_merge_decode: {why}")
    sh = plan.shape
    bsz, h, d = query.shape
    if out is None:
        out = torch.empty(bsz, h * d, dtype=torch.float32, device=query.device)
    lat_up = lat_up if lat_up.stride(-1) == 1 else lat_up.contiguous()
    lay = slot.int8_layout
    offs = ((0, 0, 0, 0, 0) if lay is None else
            (lay.v_codes_offset, lay.k_scale_offset, lay.k_zero_offset, lay.v_scale_offset,
             lay.v_zero_offset))
    aligned = exact_cache.stride(2) % 2 == 0 and all(o % 2 == 0 for o in offs)
    cache = exact_cache.view(query.dtype) if slot.bits == 16 else exact_cache
    bt = exact_block_table if exact_block_table.dtype == torch.int32 else exact_block_table.int()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    qpk = sh.queries_per_kv
    # the interpreter's bf16/fp16 dots are wrong (triton 3.9): float32 there
    f32 = query.dtype == torch.float32 or interpreting()
    exact_merge_kernel[(bsz, sh.num_kv_heads)](
        query, query.stride(0), query.stride(1),
        cache, cache.stride(0), cache.stride(2),
        bt, bt.stride(0), lens,
        lat_up, lat_up.stride(0), lat_up.stride(1), lat_lse, lat_lse.stride(0),
        out, out.stride(0),
        int(sink), int(recent), float(scale) * LOG2E,
        sh.kv_width, *offs,
        D=d, QPK=qpk, Q_PAD=max(16, triton.next_power_of_2(qpk)),
        BLOCK_N=min(BLOCK, exact_cache.shape[2]),
        PAGE=exact_cache.shape[2], BITS=slot.bits,
        DT=tl.float32 if f32 else TL_DTYPES[query.dtype], ALIGNED=aligned, F32=f32,
        POST=slot.bits == 8, SLOT_MULT=pow2_divisor(cache.stride(2), cache.stride(0)),
        num_warps=WARPS, num_stages=STAGES)
    return out
