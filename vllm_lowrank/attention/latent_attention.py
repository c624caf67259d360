r"""Attention computed from cached latents (pre-RoPE key latents, folded values).

Derivation (one layer, one head group ``g`` of ``G`` KV heads; ``x_t`` the layer
input of token ``t``; ``R_t`` RoPE at position ``t``; ``d`` the head dim)::

    latents (cached, per token):   c^k_t = x_t A_k[g]   (r_k)    c^v_t = x_t A_v[g]   (r_v)
    key of KV head j in g:         k_{t,j} = R_t (c^k_t B_k[g][:, j])            (Palu sec. 3.1.2)
    scores of query head i -> j:   s_{i,t} = q_i . k_{t,j} * scale    (q_i already RoPE'd)
    probabilities:                 p_{i,t} = softmax_t(s_{i,t})  over t <= pos(query)
    value output (latent space):   o_i = sum_t p_{i,t} c^v_t                       (r_v)
    layer output:                  y = sum_i o_i (B_v[g][:, j] W_O^{(i)})          (Palu eq. 6)

The last product is the folded ``o_proj`` (:mod:`vllm_lowrank.factorization.fold`),
so attention itself returns ``o`` of width ``sum_i r_v[group(i)]`` and never
rebuilds values. Keys must be rebuilt because RoPE sits between ``B_k`` and the
query: ``q^T R_t B_k^T`` depends on ``t``, so ``B_k`` cannot be folded into the
query (unlike MLA, whose RoPE part is separate). Rebuilding costs
``2 * r_k * G * d`` FLOP per cached token and group, shared by the
``G * num_heads / num_kv_heads`` query heads of the group.

Shapes (vLLM's paged cache, one "head slot" per token)::

    kv_cache      [num_blocks, 1, block_size, Rk + Rv]   (model dtype)
    slot_mapping  [num_tokens]           int64, -1 for padding
    block_table   [num_reqs, max_blocks] int32
    query         [num_tokens, num_heads, d]  (post-RoPE)
    output        [num_tokens, out_width]

Post-RoPE mode (``method="post_rope"``, ZACK sec. 4-5; one KV head per group):
the cached key latent is ``c^k_t = R_t k_t P_j`` and the query arrives as
``q~_i = (R q_i) P_j`` (``[num_heads, max r_k]``, zero-padded), so
``s_{i,t} = q~_i . c^k_t`` needs neither a rebuild nor RoPE here.

Models with a key bias or QK-norm (Qwen2, Qwen3, Gemma-3) rebuild
``k_{t,j} = R_t norm(c^k_t B_k[g][:, j] + b_j)`` (:class:`KeyTransform`).
Sliding-window layers (Gemma-3, Mistral) see keys ``t`` with
``pos - window < t <= pos`` only.

This module is the torch path: vectorized over the decode batch (one
gather, one GEMM per group for the key rebuild, two batched GEMMs per group for
scores and values) and per prefill request (prefill chunks are few and long;
torch's CPU flash kernel, no score matrix in memory). Prefill reads the keys
and values back from the cache, exactly as decode will, so prompt
log-probabilities measure the compressed model. On CUDA the backend
(:mod:`vllm_lowrank.attention.backend`) sends decode to the fused kernels of
:mod:`vllm_lowrank.kernels.triton` where the layer's cache format allows
(the torch path otherwise), and all prefill chunks of a step to one varlen
kernel call over keys rebuilt here (:func:`context_keys`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from vllm_lowrank.attention.rope import RopeTable
from vllm_lowrank.factorization.plan import LayerPlan

PREFILL_QUERY_CHUNK = 1024
"""Query rows per masked SDPA call in prefill off the CPU: bounds the score
buffer to ``heads x 1024 x context`` float32."""


@dataclasses.dataclass(frozen=True)
class KeyTransform:
    """What is applied to a rebuilt pre-RoPE key before RoPE.

    ``k = norm(c_k B_k + bias)`` with ``norm(x) = x / sqrt(mean(x^2) + eps) * w``
    per head (RMSNorm, Zhang & Sennrich 2019, eq. 4; QK-norm of Qwen3/Gemma-3).

    Attributes:
        bias: ``[num_kv_heads * head_dim]`` float32 k_proj bias, or ``None``.
        norm_weight: ``[head_dim]`` float32 effective norm weight ``w``
            (Gemma's ``1 + w`` already added), or ``None`` for no norm.
        norm_eps: The norm's epsilon.
    """

    bias: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    norm_eps: float = 0.0

    def apply(self, keys: torch.Tensor, group_cols: slice) -> torch.Tensor:
        """Transform ``keys [B, L, G, d]`` (float32, in place where possible)
        of the KV heads whose flattened columns are ``group_cols``."""
        if self.bias is not None:
            keys = keys + self.bias[group_cols].view(keys.shape[-2], keys.shape[-1])
        if self.norm_weight is not None:
            var = keys.pow(2).mean(dim=-1, keepdim=True)
            keys = keys * torch.rsqrt(var + self.norm_eps) * self.norm_weight
        return keys


def write_latents(
    kv_cache: torch.Tensor,
    k_latent: torch.Tensor,
    v_latent: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout=None,
) -> None:
    """Scatter this step's latents into their paged slots (quantize-on-write
    when ``layout`` is given: on CUDA one Triton launch,
    :func:`vllm_lowrank.kernels.triton.cache_write.write_packed_latents`, for
    packed sides; else :meth:`SlotLayout.encode` and :func:`scatter_rows`).

    Args:
        kv_cache: ``[num_blocks, 1, block_size, Rk + Rv]`` in the model dtype, or
            ``[num_blocks, 1, block_size, slot_bytes]`` uint8 with ``layout``.
        k_latent: ``[num_tokens, Rk]`` (or ``[num_tokens, 1, Rk]``).
        v_latent: ``[num_tokens, Rv]``.
        slot_mapping: ``[num_tokens]`` int64 ``block * block_size + offset``;
            negative entries (padding) are skipped.
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` or ``None``.
    """
    n = slot_mapping.shape[0]
    k_rows, v_rows = k_latent[:n].reshape(n, -1), v_latent[:n].reshape(n, -1)
    if layout is not None and kv_cache.is_cuda:
        from vllm_lowrank.kernels.triton import cache_write

        if cache_write.supports(layout):
            cache_write.write_packed_latents(kv_cache, k_rows, v_rows, slot_mapping, layout)
            return
    if layout is not None:
        rows = layout.encode(k_rows.float(), v_rows.float())
    else:
        rows = torch.cat((k_rows, v_rows), dim=-1).to(kv_cache.dtype)
    scatter_rows(kv_cache, rows, slot_mapping)


def scatter_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[block, 0, offset] = rows`` for ``slot_mapping [T]`` int64
    (``block * block_size + offset``); negative slots (padding) are skipped.

    Without a device sync (CUDA graphs capture it): a padding row is written to
    slot 0 with that slot's own current content, so nothing changes there
    (slot 0 lies in vLLM's null block, which no request owns:
    ``vllm/v1/core/block_pool.py``, ``null_block``).

    Args:
        cache: ``[num_blocks, 1, block_size, C]``; rows: ``[T, C]`` of its dtype.
    """
    block_size = cache.shape[2]
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping.long(), 0)
    blocks, offsets = slots // block_size, slots % block_size
    cache[blocks, 0, offsets] = torch.where(valid[:, None], rows, cache[blocks, 0, offsets])


def flat_ranges(starts: torch.Tensor, lens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of consecutive positions, flattened: request ``i`` contributes
    ``lens[i]`` positions from ``starts[i]`` (host int64 ``[N]`` each).

    Returns:
        ``(request [S], position [S], cu [N + 1])`` int64: each row's request
        index and position, and the cumulative row counts.
    """
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=cu[1:])
    total = int(cu[-1])
    req = torch.repeat_interleave(torch.arange(len(lens)), lens, output_size=total)
    return req, torch.arange(total) - cu[:-1][req] + starts[req], cu


def gather_slots(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
                 ) -> torch.Tensor:
    """Slots ``cache[blocks, 0, offsets]`` of a paged cache ``[num_blocks, 1,
    block_size, C]``: ``[*blocks.shape, C]``. A uint8 cache is read in the
    widest words that divide its slots (4 or 8 bytes), so that the index
    kernel moves one word per thread rather than one byte: the same bytes.

    Args:
        blocks, offsets: int64 block ids and offsets within the block, one
            shape.
    """
    if cache.dtype == torch.uint8:
        for word in (torch.int64, torch.int32):
            size = word.itemsize
            if cache.stride(-1) == 1 and cache.storage_offset() % size == 0 and all(
                    n % size == 0 for n in (cache.shape[-1], *cache.stride()[:-1])):
                return cache.view(word)[blocks, 0, offsets].view(torch.uint8)
    return cache[blocks, 0, offsets]


def gather_latents(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int, layout=None,
    start: int = 0,
) -> torch.Tensor:
    """Read positions ``start..length-1`` of each request from the paged cache.

    Args:
        kv_cache: ``[num_blocks, 1, block_size, C]`` (uint8 slots with ``layout``).
        block_table: ``[num_reqs, max_blocks]`` (rows of the requests to read).
        length: Positions to read (entries past a request's length are garbage
            and must be masked by the caller).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` to dequantize
            packed slots, or ``None``.
        start: First position to read.

    Returns:
        ``[num_reqs, length - start, Rk + Rv]`` in the cache dtype (float32
        when dequantized).
    """
    block_size = kv_cache.shape[2]
    # per-channel keys decode whole token groups (their scales are spread over
    # the group's slots); a group never spans two blocks
    g = layout.k_channel_tokens if layout is not None and layout.k_per_channel else 1
    lo, hi = start - start % g, max(-(-length // g) * g, start)
    pos = torch.arange(lo, hi, device=kv_cache.device)
    blocks = block_table[:, pos // block_size].long()  # [B, L]
    rows = gather_slots(kv_cache, blocks, (pos % block_size)[None, :].expand_as(blocks))
    if layout is None:
        return rows
    k, v = layout.decode(rows)
    return torch.cat((k, v), dim=-1)[:, start - lo:length - lo]


def _group_keys(plan: LayerPlan, g: int, k_up: torch.Tensor, rope: RopeTable,
                lat: torch.Tensor, positions: torch.Tensor, post_rope: bool,
                transform: KeyTransform | None = None) -> torch.Tensor:
    """Keys of head group ``g`` over ``lat [B, L, Rk + Rv]``:
    ``[B, L, G, d]`` rebuilt (then ``transform``-ed) and rotated, or
    ``[B, L, G, r_k / G]`` post-RoPE latents (per KV head: ZACK's ``[B, L, 1,
    r_k]``, post-RoPE keys' ``[B, L, G, d]``). The rebuild GEMM runs in
    ``lat``'s dtype (``k_up`` is cast to it); a transform (bias, QK-norm) and
    its rotation run in float32."""
    k_off, r_k = plan.k_offsets()[g], plan.k_ranks[g]
    c_k = lat[:, :, k_off:k_off + r_k]
    if post_rope:
        return c_k.unflatten(-1, (plan.group_size, r_k // plan.group_size))
    gw, d = plan.group_width, plan.shape.head_dim
    b_k = k_up[k_off:k_off + r_k, g * gw:(g + 1) * gw].to(lat.dtype)
    if transform is None:
        return rope.rebuild_rotated(c_k, b_k, positions, d)
    keys = (c_k @ b_k).float().view(c_k.shape[0], c_k.shape[1], -1, d)
    keys = transform.apply(keys, slice(g * gw, (g + 1) * gw))
    return rope.rotate_(keys.contiguous(), positions)


def context_keys(plan: LayerPlan, k_up: torch.Tensor, rope: RopeTable, lat: torch.Tensor,
                 positions: torch.Tensor, post_rope: bool,
                 transform: KeyTransform | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Keys of every head group over flat latent rows (the batched prefill).

    Args:
        lat: ``[S, Rk + Rv]`` latents (any float dtype).
        positions: ``[S]`` int64 position of each row.
        dtype: Of the rebuild GEMM ``lat @ k_up`` and of the result. The GPU
            prefill passes the query dtype: a bf16 GEMM on the tensor cores
            with float32 accumulation, the keys rounded to bf16 before RoPE
            (as stock vLLM rotates the bf16 output of ``k_proj``); float32
            (the default) keeps every step in float32.

    Returns:
        ``[S, num_kv_heads, head_dim]`` rebuilt, transformed and rotated keys
        in ``dtype``; post-RoPE mode: ``[S, num_kv_heads, max r_k / G]`` key
        latents per KV head, zero-padded past each group's rank.
    """
    lat = lat.to(dtype)[None]
    if post_rope:
        gs = plan.group_size
        keys = lat.new_zeros(lat.shape[1], plan.shape.num_kv_heads, max(plan.k_ranks) // gs)
        for g, (k_off, r_k) in enumerate(zip(plan.k_offsets(), plan.k_ranks)):
            keys[:, g * gs:(g + 1) * gs, :r_k // gs] = \
                lat[0, :, k_off:k_off + r_k].unflatten(-1, (gs, r_k // gs))
        return keys
    return torch.cat([_group_keys(plan, g, k_up, rope, lat, positions, False, transform)[0]
                      .to(dtype) for g in range(plan.num_groups)], dim=1)


def context_values(plan: LayerPlan, v_up: torch.Tensor, lat_v: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of every KV head rebuilt from flat value latents (the batched
    prefill of token-adaptive layers): head group ``g``'s
    ``c_v[g] B_v[g]`` (Palu, Chang et al. 2024, eq. 3: ``V = X A_v B_v``).

    Args:
        v_up: ``[Rv, num_kv_heads * head_dim]`` float32 block-diagonal value
            up-projection.
        lat_v: ``[S, Rv]`` value latents (any float dtype).
        dtype: Of the GEMM (float32 accumulation on the tensor cores for
            16-bit types) and of the result.

    Returns:
        ``[S, num_kv_heads * head_dim]`` in ``dtype``.
    """
    lat_v = lat_v.to(dtype)
    gw = plan.group_width
    parts = [lat_v[:, off:off + r] @ v_up[off:off + r, g * gw:(g + 1) * gw].to(dtype)
             for g, (off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks))]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _flash_cpu(q, k, v, causal: bool, scale: float):
    """(out, lse) of torch's CPU flash kernel; ``q/k/v [H, *, D]`` float32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, attn_mask=None, scale=scale)
    return out[0], lse[0]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int,
                      scale: float) -> torch.Tensor:
    """Causal attention of ``Q`` new tokens over ``context`` cached ones and
    themselves.

    Args:
        q: ``[H, Q, dk]``; k: ``[H, context + Q, dk]``; v: ``[H, context + Q, dv]``
            (float32; the new tokens are the last ``Q`` keys).
        context: Positions before the first query.

    Returns:
        ``[H, Q, dv]`` float32.

    On CPU this runs torch's flash kernel, which needs equal head dims (wider
    values run in key-width column slices, which share the scores; narrower
    ones are zero-padded, which changes no output column; 9 heads x 1024
    tokens with a 192-wide value latent: 218 ms padded, 55 ms sliced) and only
    top-left causal masks: with a context, the cached part (no mask) and the new
    chunk (causal) are attended separately and merged by log-sum-exp
    (flash-decoding's reduction). Elsewhere: :func:`_masked_attention`.
    """
    dk, dv = q.shape[-1], v.shape[-1]
    if q.device.type != "cpu":
        return _masked_attention(q, k, v, 0, context, scale)
    if dv > dk:  # value columns in key-width slices: same scores, one call each
        return torch.cat([_causal_attention(q, k, v[..., i:i + dk], context, scale)
                          for i in range(0, dv, dk)], dim=-1)
    width = max(dk, dv)
    if dv < width:
        v = F.pad(v, (0, width - dv))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    new_out, new_lse = _flash_cpu(q, k[:, context:], v[:, context:], True, scale)
    if context:
        old_out, old_lse = _flash_cpu(q, k[:, :context], v[:, :context], False, scale)
        top = torch.maximum(old_lse, new_lse)
        w_old, w_new = (old_lse - top).exp(), (new_lse - top).exp()
        new_out = (old_out * w_old[..., None] + new_out * w_new[..., None]) / (
            w_old + w_new)[..., None]
    return new_out[..., :dv]


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      first_key: int, first_query: int, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention by masked SDPA: the query at position ``p`` sees keys
    at ``t <= p`` (and ``t > p - window`` with a sliding window).

    Args:
        q: ``[H, Q, dk]`` at positions ``first_query ..``; k: ``[H, K, dk]`` and
            v: ``[H, K, dv]`` at positions ``first_key ..`` (float32).
        window: Sliding window, or ``None``.

    Returns:
        ``[H, Q, dv]`` float32 (SDPA in chunks of :data:`PREFILL_QUERY_CHUNK`
        queries, which bounds the mask and score buffers).
    """
    kpos = first_key + torch.arange(k.shape[1], device=q.device)[None, :]
    outs = []
    for start in range(0, q.shape[1], PREFILL_QUERY_CHUNK):
        stop = min(q.shape[1], start + PREFILL_QUERY_CHUNK)
        qpos = first_query + torch.arange(start, stop, device=q.device)[:, None]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        outs.append(F.scaled_dot_product_attention(q[:, start:stop], k, v,
                                                   attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=1)


def decode_attention(
    plan: LayerPlan,
    k_up: torch.Tensor,
    rope: RopeTable,
    scale: float,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    post_rope: bool = False,
    layout=None,
    transform: KeyTransform | None = None,
    window: int | None = None,
    min_seq_len: int = 0,
    sink: int = 0,
    recent: int = 0,
    return_lse: bool = False,
):
    """One new token per request, batched.

    Scores and the value product are two batched GEMMs per head group; the
    group's query heads are folded into the GEMM rows, so keys and the shared
    value latent are never expanded per query head (SDPA's GQA path copies
    them: 3x slower here, measured).

    Args:
        query: ``[B, H, d]`` post-RoPE (token at position ``seq_len - 1``).
        block_table: ``[B, max_blocks]``; seq_lens: ``[B]`` (including this token).
        max_seq_len: ``max(seq_lens)`` (host int).
        post_rope: Cached keys are post-RoPE latents and ``query`` is ``[B, H,
            max r_k / G]`` in each KV head's key basis.
        layout: Packed-slot layout of a quantized cache, or ``None``.
        transform: Key bias / QK-norm applied to rebuilt keys, or ``None``.
        window: Sliding window (keys ``seq_len - window <= t < seq_len``), or
            ``None``.
        min_seq_len: ``min(seq_lens)`` (host int); with ``window``, positions
            before ``min_seq_len - window`` are not read.
        sink, recent: Token-adaptive mode (TALE): only the latent span
            ``sink <= t < seq_len - recent`` is attended here (the first
            ``sink`` and last ``recent`` positions are attended exactly
            elsewhere, :func:`exact_attention`, and merged by :func:`merge`).
            Positions outside the span are never read unmasked.
        return_lse: Also return the log-sum-exp of the scaled scores.

    Returns:
        ``[B, out_width]`` float32, and with ``return_lse`` also ``[B, H]``
        float32 ``log sum_t exp(scale * q . k_t)`` over the attended span
        (``-inf``, with a zero output row, where the span is empty).
    """
    b = query.shape[0]
    first = max(0, min_seq_len - window) if window is not None else 0
    first = max(first, sink)
    latents = gather_latents(kv_cache, block_table, max(max_seq_len, first), layout,
                             start=first)
    pos = torch.arange(first, max(max_seq_len, first), device=query.device)
    length = pos.shape[0]
    lens = seq_lens[:, None].to(pos.device)
    visible = pos[None, :] < lens - recent  # [B, L]
    if window is not None:
        visible &= pos[None, :] >= lens - window
    rk = plan.k_width
    gs, qpk = plan.group_size, plan.shape.queries_per_kv
    hg = plan.heads_per_group
    q = query.float()
    lat = latents.float()
    outs, lses = [], []
    for g, v_off in enumerate(plan.v_offsets()):
        r_v = plan.v_ranks[g]
        keys = _group_keys(plan, g, k_up, rope, lat, pos, post_rope, transform)
        width = keys.shape[-1]
        keys = keys.permute(0, 2, 3, 1)  # [B, G, width, L]
        q_g = q[:, g * hg:(g + 1) * hg, :width].reshape(b, gs, qpk, width)
        scores = torch.matmul(q_g, keys).mul_(scale)  # [B, G, qpk, L]
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1).reshape(b, hg)
        probs = torch.exp(scores - lse.view(b, gs, qpk, 1)).nan_to_num_(0.0).view(b, hg, length)
        values = lat[:, :, rk + v_off:rk + v_off + r_v]
        values = torch.where(visible[..., None], values, 0.0)  # no NaN from padding
        outs.append(torch.bmm(probs, values).reshape(b, hg * r_v))  # [B, Hg*r_v]
        lses.append(lse)
    out = torch.cat(outs, dim=-1)
    return (out, torch.cat(lses, dim=-1)) if return_lse else out


def prefill_attention(
    plan: LayerPlan,
    k_up: torch.Tensor,
    rope: RopeTable,
    scale: float,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    post_rope: bool = False,
    layout=None,
    transform: KeyTransform | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """A chunk of ``Q`` new tokens of one request (positions ``seq_len-Q ..
    seq_len-1``), causal, over everything cached so far (prefix-cache hits and
    earlier chunks included).

    Args:
        query: ``[Q, H, d]`` post-RoPE (post-RoPE mode: ``[Q, H, max r_k]``).
        block_table_row: ``[max_blocks]``.
        seq_len: Tokens of the request after this chunk.
        post_rope: Scores from post-RoPE latents (no rebuild).
        layout: Packed-slot layout of a quantized cache, or ``None``.
        transform: Key bias / QK-norm applied to rebuilt keys, or ``None``.
        window: Sliding window of the layer, or ``None``.

    Returns:
        ``[Q, out_width]`` float32.
    """
    q_len = query.shape[0]
    first_query = seq_len - q_len
    first = max(0, first_query - window + 1) if window is not None else 0
    latents = gather_latents(kv_cache, block_table_row[None], seq_len, layout,
                             start=first).float()
    positions = torch.arange(first, seq_len, device=query.device)
    rk, hg = plan.k_width, plan.heads_per_group
    outs = []
    for g, v_off in enumerate(plan.v_offsets()):
        r_v = plan.v_ranks[g]
        keys = _group_keys(plan, g, k_up, rope, latents, positions, post_rope, transform)[0]
        keys = keys.repeat_interleave(hg // keys.shape[1], dim=1)  # [L, Hg, dk]
        values = latents[0, :, rk + v_off:rk + v_off + r_v]
        q_g = query[:, g * hg:(g + 1) * hg, :keys.shape[-1]].float()
        q_g, keys = q_g.transpose(0, 1), keys.transpose(0, 1)
        values = values[None].expand(hg, -1, -1)
        if window is not None:
            o = _masked_attention(q_g, keys, values, first, first_query, scale, window)
        else:
            o = _causal_attention(q_g, keys, values, first_query, scale)
        outs.append(o.transpose(0, 1).reshape(q_len, hg * r_v))
    return torch.cat(outs, dim=-1)
