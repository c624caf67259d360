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

This module is the CPU path: vectorized torch over the decode batch (one
gather, one GEMM per group for the key rebuild, one SDPA call per group) and
per prefill request (prefill chunks are few and long). Prefill reads the keys
and values back from the cache, exactly as decode will, so prompt
log-probabilities measure the compressed model. CUDA tensors go to the kernels
in :mod:`vllm_lowrank.triton_kernels` instead (dispatch in the backend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_lowrank.attention.rope import RopeTable
from vllm_lowrank.factorization.plan import LayerPlan

PREFILL_QUERY_CHUNK = 1024
"""Query rows per SDPA call in prefill: bounds the score buffer to
``heads x 1024 x context`` float32."""


def write_latents(
    kv_cache: torch.Tensor,
    k_latent: torch.Tensor,
    v_latent: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's latents into their paged slots.

    Args:
        kv_cache: ``[num_blocks, 1, block_size, Rk + Rv]``.
        k_latent: ``[num_tokens, Rk]`` (or ``[num_tokens, 1, Rk]``).
        v_latent: ``[num_tokens, Rv]``.
        slot_mapping: ``[num_tokens]`` int64 ``block * block_size + offset``;
            negative entries (padding) are skipped.
    """
    n = slot_mapping.shape[0]
    block_size = kv_cache.shape[2]
    rows = torch.cat(
        (k_latent[:n].reshape(n, -1), v_latent[:n].reshape(n, -1)), dim=-1
    ).to(kv_cache.dtype)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        rows, slot_mapping = rows[valid], slot_mapping[valid]
    slot_mapping = slot_mapping.long()
    kv_cache[slot_mapping // block_size, 0, slot_mapping % block_size] = rows


def gather_latents(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """Read positions ``0..length-1`` of each request from the paged cache.

    Args:
        kv_cache: ``[num_blocks, 1, block_size, C]``.
        block_table: ``[num_reqs, max_blocks]`` (rows of the requests to read).
        length: Positions to read (entries past a request's length are garbage
            and must be masked by the caller).

    Returns:
        ``[num_reqs, length, C]`` in the cache dtype.
    """
    block_size = kv_cache.shape[2]
    pos = torch.arange(length, device=kv_cache.device)
    blocks = block_table[:, pos // block_size].long()  # [B, L]
    return kv_cache[blocks, 0, (pos % block_size)[None, :].expand_as(blocks)]


def _group_keys(plan: LayerPlan, g: int, k_up: torch.Tensor, rope: RopeTable,
                lat: torch.Tensor, positions: torch.Tensor, post_rope: bool) -> torch.Tensor:
    """Keys of head group ``g`` over ``lat [B, L, Rk + Rv]`` (float32):
    ``[B, L, G, d]`` rebuilt and rotated, or ``[B, L, 1, r_k]`` post-RoPE latents."""
    k_off, r_k = plan.k_offsets()[g], plan.k_ranks[g]
    c_k = lat[:, :, k_off:k_off + r_k]
    if post_rope:
        return c_k[:, :, None, :]
    gw = plan.group_width
    b_k = k_up[k_off:k_off + r_k, g * gw:(g + 1) * gw]
    return rope.rebuild_rotated(c_k, b_k, positions, plan.shape.head_dim)


def _attend(
    plan: LayerPlan,
    k_up: torch.Tensor,
    rope: RopeTable,
    scale: float,
    query: torch.Tensor,
    latents: torch.Tensor,
    mask: torch.Tensor,
    post_rope: bool = False,
) -> torch.Tensor:
    """Attention of ``query`` over ``latents`` for every head group.

    Args:
        plan: Layer plan (groups and ranks).
        k_up: ``[Rk, kv_width]`` float32 block-diagonal key up-projection.
        rope: RoPE table.
        scale: Softmax scale.
        query: ``[B, Q, H, d]`` float32, post-RoPE (post-RoPE mode:
            ``[B, Q, H, max r_k]`` latent queries).
        latents: ``[B, L, Rk + Rv]`` (any float dtype), positions ``0..L-1``.
        mask: ``[B, Q, L]`` bool, True where query ``q`` may attend position ``l``.
        post_rope: Scores from post-RoPE latents (no rebuild).

    Returns:
        ``[B, Q, out_width]`` float32.
    """
    b, q_len = query.shape[:2]
    length = latents.shape[1]
    # Positions no query may see (padding past a request's length) hold
    # whatever the paged cache has there; zero them so NaN/inf cannot leak
    # through the masked softmax (0 * NaN is NaN).
    visible = mask.any(dim=1)[..., None]  # [B, L, 1]
    lat = torch.where(visible, latents.float(), 0.0)
    positions = torch.arange(length, device=lat.device)
    rk = plan.k_width
    hg, gs = plan.heads_per_group, plan.group_size
    attn_mask = mask[:, None, :, :]  # [B, 1, Q, L]
    outs = []
    for g, v_off in enumerate(plan.v_offsets()):
        r_v = plan.v_ranks[g]
        keys = _group_keys(plan, g, k_up, rope, lat, positions, post_rope).transpose(1, 2)
        values = lat[:, :, rk + v_off : rk + v_off + r_v]
        values = values[:, None].expand(b, gs, length, r_v)  # shared by the group
        q_g = query[:, :, g * hg : (g + 1) * hg, : keys.shape[-1]].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q_g, keys, values, attn_mask=attn_mask, scale=scale, enable_gqa=True
        )  # [B, Hg, Q, r_v]
        outs.append(o.transpose(1, 2).reshape(b, q_len, hg * r_v))
    return torch.cat(outs, dim=-1)


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
) -> torch.Tensor:
    """One new token per request, batched.

    Scores and the value product are two batched GEMMs per head group; the
    group's query heads are folded into the GEMM rows, so keys and the shared
    value latent are never expanded per query head (SDPA's GQA path copies
    them: 3x slower here, measured).

    Args:
        query: ``[B, H, d]`` post-RoPE (token at position ``seq_len - 1``).
        block_table: ``[B, max_blocks]``; seq_lens: ``[B]`` (including this token).
        max_seq_len: ``max(seq_lens)`` (host int).
        post_rope: ``query`` is ``[B, H, max r_k]`` in the key latent basis.

    Returns:
        ``[B, out_width]`` float32.
    """
    b = query.shape[0]
    length = max_seq_len
    latents = gather_latents(kv_cache, block_table, length)
    pos = torch.arange(length, device=query.device)
    visible = pos[None, :] < seq_lens[:, None].to(pos.device)  # [B, L]
    rk = plan.k_width
    gs, qpk = plan.group_size, plan.shape.queries_per_kv
    hg = plan.heads_per_group
    q = query.float()
    lat = latents.float()
    outs = []
    for g, v_off in enumerate(plan.v_offsets()):
        r_v = plan.v_ranks[g]
        keys = _group_keys(plan, g, k_up, rope, lat, pos, post_rope)
        width = keys.shape[-1]
        keys = keys.permute(0, 2, 3, 1)  # [B, G, width, L]
        q_g = q[:, g * hg:(g + 1) * hg, :width].reshape(b, gs, qpk, width)
        scores = torch.matmul(q_g, keys).mul_(scale)  # [B, G, qpk, L]
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, hg, length)
        values = lat[:, :, rk + v_off:rk + v_off + r_v]
        values = torch.where(visible[..., None], values, 0.0)  # no NaN from padding
        outs.append(torch.bmm(probs, values).reshape(b, hg * r_v))  # [B, Hg*r_v]
    return torch.cat(outs, dim=-1)


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
) -> torch.Tensor:
    """A chunk of ``Q`` new tokens of one request (positions ``seq_len-Q ..
    seq_len-1``), causal, over everything cached so far (prefix-cache hits and
    earlier chunks included).

    Args:
        query: ``[Q, H, d]`` post-RoPE (post-RoPE mode: ``[Q, H, max r_k]``).
        block_table_row: ``[max_blocks]``.
        seq_len: Tokens of the request after this chunk.
        post_rope: Scores from post-RoPE latents (no rebuild).

    Returns:
        ``[Q, out_width]`` float32.
    """
    q_len = query.shape[0]
    latents = gather_latents(kv_cache, block_table_row[None], seq_len)
    pos = torch.arange(seq_len, device=query.device)
    outs = []
    for start in range(0, q_len, PREFILL_QUERY_CHUNK):
        stop = min(q_len, start + PREFILL_QUERY_CHUNK)
        q_pos = torch.arange(seq_len - q_len + start, seq_len - q_len + stop,
                             device=query.device)
        mask = (pos[None, :] <= q_pos[:, None])[None]  # [1, Qc, L]
        end = int(q_pos[-1]) + 1
        outs.append(
            _attend(plan, k_up, rope, scale, query[None, start:stop].float(),
                    latents[:, :end], mask[..., :end], post_rope)[0]
        )
    return torch.cat(outs, dim=0)
