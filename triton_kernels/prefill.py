r"""Varlen causal prefill attention with rebuilt keys and latent values.

One launch attends every prefill request of a step (no loop over requests),
FlashAttention-2 style (Dao 2023, Algorithm 1: online softmax over key tiles,
one program per ``BLOCK_M`` query rows and query head), with two differences
from a stock kernel:

- keys and values have different widths: keys are the rebuilt, rotated keys
  ``[S, num_key_heads, dk]`` (``dk = head_dim``; post-RoPE mode: the key
  latents, zero-padded to the widest rank), values the value *latents*
  ``[S, Rv]`` of which query head ``h`` reads its group's ``r_v`` columns
  (``B_v`` is folded into ``o_proj``, Palu eq. 6), so the output of head ``h``
  is ``r_v[group(h)]`` columns at its place in the plan's output layout;
- the keys of request ``n`` are its whole visible context (cached prefix and
  this chunk, rows ``cu_k[n] .. cu_k[n+1]``), of which the chunk's ``q_len``
  queries are the last ``q_len`` positions: query ``j`` sees key ``i`` iff
  ``i <= k_len - q_len + j`` (bottom-right causal), and with a sliding window
  also ``i > k_len - q_len + j - window``.

Without ``causal`` every query sees every key of its request (the latent
history of a token-adaptive chunk, which precedes all of it); with
``lse`` the kernel also returns each row's log-sum-exp, for a merge with another
part of the context (:mod:`vllm_lowrank.attention.token_adaptive`).

Scores are base 2 (``qk_scale = scale * log2 e``); operands enter the tensor
cores in the key dtype (bf16/fp16, or float32 under the interpreter) with
float32 accumulation; softmax and the accumulator are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_prep import LOG2E, TL_DTYPES, pow2
from .tiles import add_combine, max_combine


@triton.jit
def _prefill_kernel(
    q_ptr, s_qt, s_qh,
    k_ptr, s_kt, s_kh,
    v_ptr, s_vt,
    o_ptr, s_ot, lse_ptr, s_lt,
    head_table_ptr, cu_q_ptr, cu_k_ptr,
    qk_scale, window, dk, QPK,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, DT: tl.constexpr, CAUSAL: tl.constexpr, LSE: tl.constexpr,
):
    m_blk = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + n)
    q_len = tl.load(cu_q_ptr + n + 1) - q_start
    if m_blk * BLOCK_M < q_len:
        k_start = tl.load(cu_k_ptr + n)
        k_len = tl.load(cu_k_ptr + n + 1) - k_start
        ctx = k_len - q_len  # key index of query 0
        v_off = tl.load(head_table_ptr + 3 * h)
        r_v = tl.load(head_table_ptr + 3 * h + 1)
        o_col = tl.load(head_table_ptr + 3 * h + 2)
        kvh = h // QPK

        rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        dks = tl.arange(0, DK)
        dvs = tl.arange(0, DV)
        q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * s_qt + h * s_qh
                    + dks[None, :], mask=row_ok[:, None] & (dks[None, :] < dk), other=0.0)
        q = q.to(DT)
        last = ctx + rows  # last visible key of each row
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, DV], 0.0, tl.float32)
        hi = k_len
        if CAUSAL:
            hi = tl.minimum(ctx + m_blk * BLOCK_M + BLOCK_M, k_len)
        lo = 0
        if WINDOW:
            lo = tl.maximum(ctx + m_blk * BLOCK_M - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < k_len
            key_rows = (k_start + cols).to(tl.int64)
            k = tl.load(k_ptr + key_rows[:, None] * s_kt + kvh * s_kh + dks[None, :],
                        mask=col_ok[:, None] & (dks[None, :] < dk), other=0.0)
            s = tl.dot(q, tl.trans(k.to(DT))) * qk_scale
            visible = col_ok[None, :] & (rows[:, None] >= 0)
            if CAUSAL:
                visible = visible & (cols[None, :] <= last[:, None])
            if WINDOW:
                visible = visible & (cols[None, :] > last[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            v = tl.load(v_ptr + key_rows[:, None] * s_vt + v_off + dvs[None, :],
                        mask=col_ok[:, None] & (dvs[None, :] < r_v), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
            l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (q_start + rows).to(tl.int64)[:, None] * s_ot + o_col + dvs[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dvs[None, :] < r_v))
        if LSE:  # natural log; -inf for a row that saw no key
            log2_l = tl.log2(tl.where(l_i > 0, l_i, 1.0))
            lse = tl.where(l_i > 0, (m_i + log2_l) * 0.6931471805599453, float("-inf"))
            tl.store(lse_ptr + (q_start + rows).to(tl.int64) * s_lt + h, lse, mask=row_ok)


_HEAD_TABLES: dict = {}


def head_table(plan, device) -> torch.Tensor:
    """``[num_heads, 3]`` int32 per query head: first column of its group's value
    latent in ``[S, Rv]``, its rank ``r_v``, and its first output column in the
    plan's output layout (:attr:`LayerPlan.out_width`). Built once per plan and
    device."""
    key = (plan, str(device))
    if key not in _HEAD_TABLES:
        hg = plan.heads_per_group
        rows = []
        for v_off, r_v in zip(plan.v_offsets(), plan.v_ranks):
            for i in range(hg):
                rows.append((v_off, r_v, hg * v_off + i * r_v))
        _HEAD_TABLES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return _HEAD_TABLES[key]


PREFILL_SHARED_BYTES = 200 * 1024
"""Shared memory the two pipeline stages of key and value tiles may take
(``2 * BLOCK_N * (pad(dk) + pad(r_v)) * element bytes``), under the H100's
232,448-byte limit with room for the compiler's own buffers."""


def prefill_tiles(dk: int, dv: int, elem: int, on_gpu: bool) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of :func:`latent_prefill_attention`: 64 x 64 (32 x 32
    from ``dk`` 256) on a GPU, halved while the key and value tiles of two
    stages exceed :data:`PREFILL_SHARED_BYTES` (``BLOCK_N``) or the float32
    accumulator ``[BLOCK_M, dv]`` exceeds 32 K elements (``BLOCK_M``): J-LRD's
    value rank 768 (``dv`` 1,024, the ``lossless`` preset on 8 KV heads of 128)
    asked for 262,144 bytes at 64 x 64. 16 x 16 under the interpreter.

    Args:
        dk: Key width per head (power of two); dv: padded value width.
        elem: Bytes per key/value element; on_gpu: compiled (not interpreted).
    """
    if not on_gpu:
        return 16, 16
    block_m = block_n = 64 if dk <= 128 else 32
    while block_n > 16 and 2 * block_n * (pow2(dk) + dv) * elem > PREFILL_SHARED_BYTES:
        block_n //= 2
    while block_m > 16 and block_m * dv > 32 * 1024:
        block_m //= 2
    return block_m, block_n


def latent_prefill_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             heads: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                             max_q_len: int, scale: float, out: torch.Tensor, *,
                             max_rank_v: int, window: int | None = None, causal: bool = True,
                             lse: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every prefill request of a step in one launch.

    Args:
        query: ``[T, H, dk]`` queries of the requests' new tokens, request ``n``
            at rows ``cu_q[n] .. cu_q[n+1]`` (post-RoPE; post-RoPE mode: latent
            queries, zero-padded), last dim contiguous.
        keys: ``[S, num_key_heads, dk]`` rebuilt, rotated keys of each
            request's visible context (rows ``cu_k[n] .. cu_k[n+1]``; its last
            ``q_len`` rows are the chunk itself); query head ``h`` uses key head
            ``h // (H / num_key_heads)``. bf16/fp16 (float32 on CPU).
        values: ``[S, Rv]`` value latents of the same rows (any float dtype).
        heads: ``[H, 3]`` int32 from :func:`head_table`.
        cu_q, cu_k: ``[N + 1]`` int32 cumulative query / key counts.
        max_q_len: Longest chunk (host int; sets the grid).
        scale: Softmax scale.
        out: ``[T, out_width]`` output (any float dtype, last dim contiguous):
            head ``h`` writes its ``r_v`` columns at ``heads[h, 2]``.
        max_rank_v: Largest ``r_v`` of the plan.
        window: Sliding window (query at position ``p`` sees ``t > p - window``),
            or ``None``.
        causal: ``False``: every query sees all of its request's keys.
        lse: ``[T, H]`` float32 for each row's log-sum-exp (natural log of
            ``sum_t exp(scale * q . k_t)``; ``-inf`` where no key is visible),
            or ``None``.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched shapes.
    """
    t, num_heads, dk = query.shape
    s, nkh, dk_k = keys.shape
    if dk_k != dk or num_heads % nkh or values.shape[0] != s or out.shape[0] != t:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}, out "
                         f"{tuple(out.shape)}")
    n = cu_q.shape[0] - 1
    if t == 0 or n == 0:
        return out
    dt = keys.dtype
    dv = pow2(max_rank_v)
    block_m, block_n = prefill_tiles(dk, dv, keys.element_size(), query.device.type == "cuda")
    grid = (triton.cdiv(max_q_len, block_m), num_heads, n)
    _prefill_kernel[grid](
        query, query.stride(0), query.stride(1),
        keys, keys.stride(0), keys.stride(1),
        values, values.stride(0),
        out, out.stride(0), out if lse is None else lse, 0 if lse is None else lse.stride(0),
        heads, cu_q, cu_k,
        float(scale) * LOG2E, int(window or 0), dk, num_heads // nkh,
        DK=pow2(dk), DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        WINDOW=window is not None, DT=TL_DTYPES[dt], CAUSAL=causal, LSE=lse is not None,
        num_warps=4 if dv <= 64 else 8, num_stages=2,
    )
    return out
