r"""Varlen causal prefill attention over rebuilt keys.

One launch attends every prefill request of a step (no loop over requests),
FlashAttention-2 style (Dao 2023, Algorithm 1: online softmax over key tiles,
one program per ``BLOCK_M`` query rows and query head), with two differences
from a stock kernel:

- keys and values may have different widths: keys are the rebuilt, rotated
  keys ``[S, num_key_heads, dk]`` (``dk = head_dim``; post-RoPE mode: the key
  latents, zero-padded to the widest rank), values either the value *latents*
  ``[S, Rv]`` of which query head ``h`` reads its group's ``r_v`` columns
  (``B_v`` is folded into ``o_proj``, Palu eq. 6), so the output of head ``h``
  is ``r_v[group(h)]`` columns at its place in the plan's output layout, or
  rebuilt values ``[S, num_kv_heads * head_dim]`` (token-adaptive layers);
- the keys of request ``n`` are its whole visible context (cached prefix and
  this chunk, rows ``cu_k[n] .. cu_k[n+1]``), of which the chunk's ``q_len``
  queries are the last ``q_len`` positions: query ``j`` sees key ``i`` iff
  ``i <= k_len - q_len + j`` (bottom-right causal), and with a sliding window
  also ``i > k_len - q_len + j - window``.

A ``prefix`` is a second key source ahead of that context, which every query
of the request sees (the latent history of a token-adaptive chunk, rebuilt,
ahead of its exact tokens in their own buffer): one softmax runs over both,
so the two parts need no merge and no copy into one buffer.

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
def _attend_tile(q, k_ptr, s_kt, v_ptr, s_vt, key_rows, col_ok, visible, dks, dvs, dk, r_v,
                 qk_scale, m_i, l_i, acc, DT: tl.constexpr):
    """One key tile of the online softmax (FlashAttention-2, Algorithm 1): keys
    at ``k_ptr + key_rows * s_kt + dks`` and values at ``v_ptr + key_rows *
    s_vt + dvs`` (``key_rows`` int64 ``[BLOCK_N]``, ``col_ok`` the rows that
    exist, ``visible`` ``[BLOCK_M, BLOCK_N]`` the scores kept); returns the
    updated ``(m_i, l_i, acc)``."""
    k = tl.load(k_ptr + key_rows[:, None] * s_kt + dks[None, :],
                mask=col_ok[:, None] & (dks[None, :] < dk), other=0.0)
    s = tl.dot(q, tl.trans(k.to(DT))) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_ptr + key_rows[:, None] * s_vt + dvs[None, :],
                mask=col_ok[:, None] & (dvs[None, :] < r_v), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
    l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, s_qt, s_qh,
    k_ptr, s_kt, s_kh,
    v_ptr, s_vt,
    pk_ptr, s_pkt, s_pkh,
    pv_ptr, s_pvt,
    o_ptr, s_ot,
    head_table_ptr, cu_q_ptr, cu_k_ptr, cu_p_ptr,
    qk_scale, window, dk, QPK,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, DT: tl.constexpr, PREFIX: tl.constexpr,
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
        if PREFIX:  # keys before the whole chunk: every query sees all of them
            p_start = tl.load(cu_p_ptr + n)
            p_len = tl.load(cu_p_ptr + n + 1) - p_start
            for start in range(0, p_len, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_ok = cols < p_len
                m_i, l_i, acc = _attend_tile(
                    q, pk_ptr + kvh * s_pkh, s_pkt, pv_ptr + v_off, s_pvt,
                    (p_start + cols).to(tl.int64), col_ok,
                    col_ok[None, :] & (rows[:, None] >= 0), dks, dvs, dk, r_v, qk_scale,
                    m_i, l_i, acc, DT)
        hi = tl.minimum(ctx + m_blk * BLOCK_M + BLOCK_M, k_len)
        lo = 0
        if WINDOW:
            lo = tl.maximum(ctx + m_blk * BLOCK_M - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < k_len
            visible = col_ok[None, :] & (cols[None, :] <= last[:, None])
            if WINDOW:
                visible = visible & (cols[None, :] > last[:, None] - window)
            m_i, l_i, acc = _attend_tile(
                q, k_ptr + kvh * s_kh, s_kt, v_ptr + v_off, s_vt,
                (k_start + cols).to(tl.int64), col_ok, visible, dks, dvs, dk, r_v, qk_scale,
                m_i, l_i, acc, DT)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (q_start + rows).to(tl.int64)[:, None] * s_ot + o_col + dvs[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dvs[None, :] < r_v))


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
    value rank 768 (``dv`` 1,024, latent 0.75 on 8 KV heads of 128)
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
                             max_rank_v: int, window: int | None = None,
                             prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                             ) -> torch.Tensor:
    """Causal attention of every prefill request of a step in one launch.

    Args:
        query: ``[T, H, dk]`` queries of the requests' new tokens, request ``n``
            at rows ``cu_q[n] .. cu_q[n+1]`` (post-RoPE; post-RoPE mode: latent
            queries, zero-padded), last dim contiguous.
        keys: ``[S, num_key_heads, dk]`` rebuilt, rotated keys of each
            request's visible context (rows ``cu_k[n] .. cu_k[n+1]``; its last
            ``q_len`` rows are the chunk itself); query head ``h`` uses key head
            ``h // (H / num_key_heads)``. bf16/fp16 (float32 on CPU).
        values: ``[S, Dv]`` values of the same rows (any float dtype): value
            latents, or rebuilt values of every KV head side by side.
        heads: ``[H, 3]`` int32 per query head: the first column of its values
            in ``values``, their width ``r_v``, and its first output column
            (:func:`head_table`).
        cu_q, cu_k: ``[N + 1]`` int32 cumulative query / key counts.
        max_q_len: Longest chunk (host int; sets the grid).
        scale: Softmax scale.
        out: ``[T, out_width]`` output (any float dtype, last dim contiguous):
            head ``h`` writes its ``r_v`` columns at ``heads[h, 2]``.
        max_rank_v: Largest ``r_v`` of ``heads``.
        window: Sliding window (query at position ``p`` sees ``t > p - window``),
            or ``None``.
        prefix: ``(keys, values, cu)``: keys that precede each request's
            context and that every one of its queries sees (rows ``cu[n] ..
            cu[n+1]``, laid out as ``keys`` / ``values``): the token-adaptive
            latent history, rebuilt, ahead of the exact tokens. Not with a
            window.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched shapes, or a prefix with a window.
    """
    t, num_heads, dk = query.shape
    s, nkh, dk_k = keys.shape
    if dk_k != dk or num_heads % nkh or values.shape[0] != s or out.shape[0] != t:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}, out "
                         f"{tuple(out.shape)}")
    if prefix is not None and (window is not None or prefix[0].shape[1:] != keys.shape[1:]
                               or prefix[1].shape[0] != prefix[0].shape[0]):
        raise ValueError("a prefix needs no window and keys shaped as the context's")
    n = cu_q.shape[0] - 1
    if t == 0 or n == 0:
        return out
    pk, pv, cu_p = prefix if prefix is not None else (keys, values, cu_k)
    dt = keys.dtype
    dv = pow2(max_rank_v)
    block_m, block_n = prefill_tiles(dk, dv, keys.element_size(), query.device.type == "cuda")
    grid = (triton.cdiv(max_q_len, block_m), num_heads, n)
    _prefill_kernel[grid](
        query, query.stride(0), query.stride(1),
        keys, keys.stride(0), keys.stride(1),
        values, values.stride(0),
        pk, pk.stride(0), pk.stride(1),
        pv, pv.stride(0),
        out, out.stride(0),
        heads, cu_q, cu_k, cu_p,
        float(scale) * LOG2E, int(window or 0), dk, num_heads // nkh,
        DK=pow2(dk), DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        WINDOW=window is not None, DT=TL_DTYPES[dt], PREFIX=prefix is not None,
        num_warps=4 if dv <= 64 else 8, num_stages=2,
    )
    return out
