r"""Token-adaptive decode: the exact part, the value up-projection of the latent
part and their merge, in one kernel.

A token-adaptive (TALE) decode step attends to two disjoint sets of positions
(:mod:`vllm_lowrank.attention.token_adaptive`): the latent span, decoded by the
latent kernels of this package into value-latent outputs ``o_L [B, out_width]``
with their log-sum-exp ``lse_L [B, H]``, and the exact set ``E`` (the ``S`` sink
positions and the last ``W + 1``, the new token included), read from the exact
cache. This kernel does the rest of the step for one sequence ``b`` and KV head
``j`` (its ``QPK`` query heads) per program::

    o_E, lse_E  = softmax attention of q over E           (exact keys/values)
    o_L'        = o_L[b, heads of j] B_v[g][:, j]           (Palu eq. 6, unfolded)
    o           = (e^{lse_L} o_L' + e^{lse_E} o_E) / (e^{lse_L} + e^{lse_E})

(the log-sum-exp merge of flash-decoding, Dao et al. 2023), and stores ``o`` in
the layer's output dtype: what :func:`~vllm_lowrank.attention.token_adaptive.
exact_attention`, :func:`~vllm_lowrank.attention.token_adaptive.values_up` and
:func:`~vllm_lowrank.attention.token_adaptive.merge` do in about 40 torch
kernels per layer.

Exact slots (:class:`vllm_lowrank.format.exact.ExactSlot`): post-RoPE keys and
values in the model dtype (``bits=16``), or per-head int8 codes with one float16
scale/zero pair per token, head and side (``bits=8``). Scores and the softmax
are float32 in base 2 (the exponent of ``exp2`` carries ``log2 e``); the dots
take the model dtype, as stock vLLM's attention does (float32 under the Triton
interpreter).

Host side: :func:`blocker` and :func:`exact_merge_decode`.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .decode_prep import LOG2E, TL_DTYPES, interpreting
from .tiles import add_combine, load_latent, max_combine

BLOCK = 32
"""Exact positions per tile."""


@triton.jit
def exact_merge_kernel(
    q_ptr, s_qb, s_qh,
    ex_ptr, s_eblk, s_etok,
    bt_ptr, s_bt, lens_ptr,
    lat_ptr, s_lat, lse_ptr, s_lse,
    vup_ptr, s_vup, heads_ptr,
    out_ptr, s_out,
    sink, recent, qk_scale,
    kv_width, v_codes_off, k_scale_off, k_zero_off, v_scale_off, v_zero_off,
    D: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr, RC: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
    ALIGNED: tl.constexpr, F32: tl.constexpr,
):
    """One program per ``(b, j)``: sequence ``b``, KV head ``j``.

    Pointers and strides: the queries ``[B, H, D]``; the exact cache (``BITS``
    16: viewed as its dtype, strides in elements; 8: uint8, in bytes); its block
    table ``[B, max_blocks]`` int32 and the sequence lengths ``[B]``; the latent
    part ``o_L [B, out_width]`` and ``lse_L [B, H]`` (natural log) float32;
    ``B_v [Rv, kv_width]`` float32; ``heads_ptr [Hkv, 3]`` int32 (first column of
    head ``j``'s query heads in ``o_L``, their value rank, its first row in
    ``B_v``); the output ``[B, H * D]``. ``qk_scale`` = softmax scale times
    ``log2 e``. ``DT``: the dots' operand dtype; ``F32``: float32 dots in IEEE
    precision; ``RC``: value-latent channels per step of the up-projection."""
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
    n_exact = sink + recent + 1
    m_i = tl.full([Q_PAD], float("-inf"), tl.float32)
    l_i = tl.full([Q_PAD], 0.0, tl.float32)
    acc = tl.full([Q_PAD, D], 0.0, tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for u0 in range(0, n_exact, BLOCK_N):
        u = u0 + i
        pos = tl.where(u < sink, u, tail + (u - sink))
        valid = (u < n_exact) & (pos < seq_len)
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        row = blk * s_eblk + (pos % PAGE).to(tl.int64) * s_etok
        if BITS == 16:
            base = ex_ptr + row[:, None]
            k = tl.load(base + j * D + c[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(base + kv_width + j * D + c[None, :], mask=valid[:, None], other=0.0)
        else:
            k, _, _ = load_latent(ex_ptr, row, valid, j * D, D, j, k_scale_off, k_zero_off,
                                  DT, True, BITS, D, 0, ALIGNED, 1, False)
            v, _, _ = load_latent(ex_ptr, row, valid, v_codes_off + j * D, D, j, v_scale_off,
                                  v_zero_off, DT, True, BITS, D, 0, ALIGNED, 1, False)
        if F32:
            sc = tl.dot(q, tl.trans(k.to(DT)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k.to(DT)))
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
        if F32:
            acc = tl.dot(p, v.to(DT), acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(DT), v.to(DT), acc * alpha[:, None])
        m_i = m_new

    # the exact set holds at least the new token (l_i > 0) unless the row is a
    # CUDA graph's padding (seq_len 0): then zeros
    seen = l_i > 0.0
    lse_e = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_e = acc / tl.where(seen, l_i, 1.0)[:, None]

    col0 = tl.load(heads_ptr + 3 * j)
    r_v = tl.load(heads_ptr + 3 * j + 1)
    v_row = tl.load(heads_ptr + 3 * j + 2)
    o_l = tl.full([Q_PAD, D], 0.0, tl.float32)
    lat_row = lat_ptr + b.to(tl.int64) * s_lat + col0 + hq[:, None] * r_v
    for r0 in range(0, r_v, RC):  # o_L' = o_L B_v, RC value-latent channels at a time
        rr = r0 + tl.arange(0, RC)
        lat = tl.load(lat_row + rr[None, :], mask=hm[:, None] & (rr[None, :] < r_v), other=0.0)
        bv = tl.load(vup_ptr + (v_row + rr).to(tl.int64)[:, None] * s_vup + j * D + c[None, :],
                     mask=(rr < r_v)[:, None], other=0.0)
        o_l = tl.dot(lat, bv, o_l, input_precision="ieee")
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
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


_HEAD_TABLES: dict = {}


def _head_table(plan, device) -> torch.Tensor:
    """``[Hkv, 3]`` int32, per KV head ``j``: first column of its query heads in
    ``o_L``, their value rank ``r_v``, the first row of its group in ``B_v``
    (query heads of a group are ordered ``(KV head in group, query of that
    head)``, ``r_v`` columns each); built once per plan and device."""
    key = (plan, str(device))
    if key not in _HEAD_TABLES:
        qpk, gs = plan.shape.queries_per_kv, plan.group_size
        rows, col = [], 0
        for v_off, r in zip(plan.v_offsets(), plan.v_ranks):
            rows += [(col + jj * qpk * r, r, v_off) for jj in range(gs)]
            col += plan.heads_per_group * r
        _HEAD_TABLES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return _HEAD_TABLES[key]


def exact_merge_decode(plan, v_up: torch.Tensor, scale: float, query: torch.Tensor,
                       exact_cache: torch.Tensor, slot, exact_block_table: torch.Tensor,
                       seq_lens: torch.Tensor, sink: int, recent: int,
                       lat: torch.Tensor, lat_lse: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact part of a token-adaptive decode step merged with the latent
    part (module docstring), in one launch with a fixed grid (CUDA graphs).

    Args:
        plan: The layer's :class:`~vllm_lowrank.factorization.plan.LayerPlan`.
        v_up: ``[Rv, kv_width]`` float32 block-diagonal value up-projection.
        scale: Softmax scale.
        query: ``[B, H, d]`` post-RoPE queries at ``seq_len - 1``.
        exact_cache: ``[num_blocks, 1, block_size, slot_bytes]`` uint8, this
            step's token already written; slot: its
            :class:`~vllm_lowrank.format.exact.ExactSlot`.
        exact_block_table: ``[B, max_blocks]`` int32 rows of its block table.
        seq_lens: ``[B]`` int32 (this token included).
        sink, recent: ``S`` and ``W``: the exact set is positions ``< S`` and
            ``>= max(S, seq_len - 1 - W)``.
        lat, lat_lse: The latent span's ``[B, plan.out_width]`` value-latent
            outputs and ``[B, H]`` natural-log log-sum-exp (``-inf``: empty).
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
        lat, lat.stride(0), lat_lse, lat_lse.stride(0),
        v_up, v_up.stride(0), _head_table(plan, query.device),
        out, out.stride(0),
        int(sink), int(recent), float(scale) * LOG2E,
        sh.kv_width, *offs,
        D=d, QPK=qpk, Q_PAD=max(16, triton.next_power_of_2(qpk)),
        RC=min(64, max(16, triton.next_power_of_2(max(plan.v_ranks)))), BLOCK_N=BLOCK,
        PAGE=exact_cache.shape[2], BITS=slot.bits,
        DT=tl.float32 if f32 else TL_DTYPES[query.dtype], ALIGNED=aligned, F32=f32,
        num_warps=4)
    return out
