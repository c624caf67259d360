r"""Token-adaptive attention (TALE): exact sinks and recent tokens, latent middle.

TALE (``../shared/papers/tale.md``, sec. 2.2) keeps the first tokens (attention
sinks) and the most recent ones exact and reads the rest of the context from the
low-rank cache; the tokens being computed always use their own exact keys and
values (lazy approximation). For a step whose first new token is at position
``s`` (a prefill chunk ``s .. seq_len - 1``, or one decode token
``s = seq_len - 1``), with ``S`` sink and ``W`` recent tokens::

    exact  E = {t < S}  U  {t >= max(S, s - W)}        from the exact cache
    latent L = {S <= t < s - W}                        from the latent cache

(a sliding-window layer further drops ``t <= p - window`` for the query at
``p``). Both parts are attended separately and merged by their log-sum-exp
(flash-decoding's reduction, Dao et al. 2023)::

    o = (e^{lse_E} o_E + e^{lse_L} o_L) / (e^{lse_E} + e^{lse_L})

which equals one softmax over ``E U L``. The latent part's output lives in the
value latent space (``[.., sum_i r_v]``); :func:`values_up` lifts it with
``B_v`` to per-head values before the merge, so in this mode ``o_proj`` is the
model's own (not folded with ``B_v``). The batched GPU prefill
(:func:`prefill_batched`) takes the other route to the same softmax: it
rebuilds the latent history's keys and values per KV head and attends them and
the exact set in one kernel call, no merge.

Shapes: the exact cache is ``[num_blocks, 1, block_size, slot_bytes]`` uint8;
each slot starts with ``[k | v]`` (post-RoPE keys; model dtype or int8), then,
with per-channel key quantization, the staged key latent ``c_k`` (``Rk``
elements), then padding (:class:`vllm_lowrank.format.exact.ExactSlot`).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_lowrank.attention import latent_attention as latent
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.factorization.plan import LayerPlan

QUERY_CHUNK = latent.PREFILL_QUERY_CHUNK


def write_exact(exact_cache: torch.Tensor, slot: ExactSlot, key: torch.Tensor,
                value: torch.Tensor, slot_mapping: torch.Tensor,
                staged: torch.Tensor | None = None) -> None:
    """Scatter ``key``/``value`` ``[T, kv_width]`` (keys post-RoPE) into their
    slots, stored as ``slot`` says; negative slots (padding) are skipped. On
    CUDA int8 slots take one Triton launch
    (:func:`vllm_lowrank.kernels.triton.cache_write.write_exact_slots`), else
    :meth:`ExactSlot.encode` and a scatter.

    Args:
        staged: ``[T, Rk]`` key latents staged behind them (for per-channel
            key quantization, :func:`write_key_groups`), or ``None``.
    """
    if exact_cache.is_cuda:
        from vllm_lowrank.kernels.triton import cache_write

        if cache_write.supports_exact(slot):
            cache_write.write_exact_slots(exact_cache, slot, key, value, slot_mapping, staged)
            return
    n = slot_mapping.shape[0]
    rows = slot.encode(key[:n], value[:n], None if staged is None else staged[:n])
    latent.scatter_rows(exact_cache, rows, slot_mapping)


GRAPH_SAFE_TOKENS = 1024
"""Steps of at most this many tokens (every decode batch a CUDA graph captures)
take :func:`write_key_groups`'s path without a host sync."""


def key_group_ends(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, key_group: int,
                   device) -> torch.Tensor:
    """Indices of a step's tokens whose position ends a per-channel key group
    (``p % G == G - 1``), from the host copies of the step's metadata: the
    argument ``ends`` of :func:`write_key_groups`, made once per step for every
    layer (one host-to-device copy, no sync).

    Args:
        query_start_loc: ``[num_reqs + 1]`` host offsets of each request's
            tokens in the step.
        seq_lens: ``[num_reqs]`` host context lengths after the step.
        key_group: ``G`` (tokens per per-channel key group).
        device: Where the indices go.

    Returns:
        ``[N]`` int64 token indices, ascending.
    """
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    _, pos, _ = latent.flat_ranges(seq_lens.long() - q_lens, q_lens)
    return (pos % key_group == key_group - 1).nonzero()[:, 0].to(device, non_blocking=True)


def fused_key_groups(kv_cache: torch.Tensor, layout, slot: ExactSlot) -> bool:
    """Whether :func:`write_key_groups` takes the Triton kernel for this cache
    (CUDA, and a layout and slot in
    :func:`vllm_lowrank.kernels.triton.cache_write.supports_key_groups`): it
    then needs no ``ends``."""
    if not kv_cache.is_cuda:
        return False
    from vllm_lowrank.kernels.triton import cache_write

    return cache_write.supports_key_groups(layout, slot)


def _group_end_mask(lat: torch.Tensor, ex: torch.Tensor, g: int) -> torch.Tensor:
    """``[T]`` bool: the tokens (latent / exact slots ``lat`` / ``ex``, negative
    for padding) whose slot ends a group of ``g`` positions."""
    return (lat >= 0) & (ex >= 0) & (lat % g == g - 1)


def write_key_groups(kv_cache: torch.Tensor, exact_cache: torch.Tensor, slot: ExactSlot,
                     slot_mapping: torch.Tensor, exact_slots: torch.Tensor, layout,
                     ends: torch.Tensor | None = None) -> None:
    """Quantize per channel every key group completed in this step and write
    its codes and scales into the latent cache (KIVI's per-channel keys over
    groups of ``G = layout.k_channel_tokens`` tokens).

    A group is complete when its last position ``p`` (``p % G == G - 1``) is
    written; its ``G`` key latents are read back from the exact cache, where
    :func:`write_exact` staged them (all ``G`` tokens are still in the exact
    window, ``G <= recent``). ``G`` divides both groups' block sizes, so the
    group's slots are the ``G`` consecutive slots ending at ``p``'s in either
    cache. Run after this step's tokens were written to both caches.

    On CUDA one Triton launch does it for any step size
    (:func:`vllm_lowrank.kernels.triton.cache_write.write_key_groups`: tokens
    that end no group return at once). The torch path: steps of at most
    :data:`GRAPH_SAFE_TOKENS` tokens run without a host sync and with fixed
    shapes (CUDA graphs capture them): every token is treated as a group end,
    and a token that is not one rewrites slots ``0 .. G - 1`` of block 0,
    vLLM's null block that no request owns, with their own content (as
    :func:`~vllm_lowrank.attention.latent_attention.scatter_rows` does for
    padding). Longer steps (prefill) quantize only the completed
    groups: the tokens ``ends`` (:func:`key_group_ends`, computed once per
    step on the host), or, without it, those found with one host sync.

    Args:
        kv_cache: Latent cache ``[num_blocks, 1, block_size, slot_bytes]`` uint8.
        exact_cache: Exact cache (slots ``[k | v | c_k]``).
        slot: Its slot layout.
        slot_mapping, exact_slots: ``[T]`` int64 slots of this step's tokens in
            the latent and the exact cache (negative: padding).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` with per-channel keys.
        ends: ``[N]`` int64 indices of the step's tokens that end a key group
            (:func:`key_group_ends`), or ``None``.
    """
    if fused_key_groups(kv_cache, layout, slot):
        from vllm_lowrank.kernels.triton import cache_write

        cache_write.write_key_groups(kv_cache, exact_cache, slot, slot_mapping, exact_slots,
                                     layout)
        return
    g = layout.k_channel_tokens
    n = min(slot_mapping.shape[0], exact_slots.shape[0])
    lat, ex = slot_mapping[:n].long(), exact_slots[:n].long()
    back = torch.arange(g - 1, -1, -1, device=lat.device)
    if n > GRAPH_SAFE_TOKENS:
        if ends is None:
            ends = _group_end_mask(lat, ex, g).nonzero()[:, 0]  # one host sync
        if not ends.numel():
            return
        lat_slots, ex_slots, keep = lat[ends][:, None] - back, ex[ends][:, None] - back, None
    else:
        last = _group_end_mask(lat, ex, g)
        keep = last[:, None, None]
        null = (g - 1 - back)[None, :]  # slots 0 .. G-1 of the null block
        lat_slots = torch.where(last[:, None], lat[:, None] - back, null)  # [N, G]
        ex_slots = torch.where(last[:, None], ex[:, None] - back, null)
    eb, lb = exact_cache.shape[2], kv_cache.shape[2]
    rows = exact_cache[ex_slots // eb, 0, ex_slots % eb]  # [N, G, exact slot bytes]
    codes, share = layout.encode_key_groups(slot.staged(rows))
    blocks, offsets = lat_slots // lb, lat_slots % lb
    codes_at = (blocks, 0, offsets, slice(0, layout.k_codes_bytes))
    share_at = (blocks, 0, offsets, slice(layout.k_share_offset, layout.natural_bytes))
    if keep is not None:
        codes = torch.where(keep, codes, kv_cache[codes_at])
        share = torch.where(keep, share, kv_cache[share_at])
    kv_cache[codes_at] = codes
    kv_cache[share_at] = share


def read_exact(exact_cache: torch.Tensor, slot: ExactSlot, block_table: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``positions [B, L]`` (valid entries only; the caller
    masks the rest, which are read from block 0 of the row).

    Returns:
        ``(k, v)``, each ``[B, L, kv_width]`` float32.
    """
    block_size = exact_cache.shape[2]
    pos = positions.clamp(0, block_table.shape[1] * block_size - 1)
    blocks = torch.gather(block_table.long(), 1, pos // block_size)
    return slot.decode(latent.gather_slots(exact_cache, blocks, pos % block_size))


def values_up(plan: LayerPlan, v_up: torch.Tensor, out: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """Lift value-latent outputs ``[N, out_width]`` to ``[N, H, d]`` in ``dtype``:
    query head ``i`` of head group ``g`` reading KV head ``j`` gets
    ``o_i B_v[g][:, j]`` (Palu eq. 6 without the fold into ``o_proj``).

    Args:
        v_up: ``[Rv, kv_width]`` block-diagonal value up-projection, float32
            (the torch path) or the model dtype (the GPU decoders keep a copy:
            the GEMMs run on the tensor cores, float32 accumulation, and the
            latent part is rounded once more, as the layer's output is anyway).
        dtype: Of the GEMMs' operands and result (``None``: ``v_up``'s).
    """
    s = plan.shape
    d, qpk, gs, hg = s.head_dim, s.queries_per_kv, plan.group_size, plan.heads_per_group
    n = out.shape[0]
    dtype = dtype or v_up.dtype
    v_up = v_up.to(dtype)
    parts, col = [], 0
    for g, (v_off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks)):
        # one GEMM per group, batched over its KV heads, N * qpk rows each
        o = out[:, col:col + hg * r].to(dtype).view(n, gs, qpk * r).transpose(0, 1)
        b = v_up[v_off:v_off + r, g * gs * d:(g + 1) * gs * d].view(r, gs, d).transpose(0, 1)
        up = torch.bmm(o.reshape(gs, n * qpk, r), b)  # [G, N * qpk, d]
        parts.append(up.view(gs, n, qpk, d).transpose(0, 1).reshape(n, hg, d))
        col += hg * r
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> torch.Tensor:
    """One softmax from two disjoint parts: ``out_* [..., H, d]`` and their
    ``lse_* [..., H]`` (``-inf`` for an empty part, whose output is ignored).
    At least one part must be non-empty per row."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp(), (lse_b - top).exp()
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention with log-sum-exp, GQA by broadcasting.

    Args:
        q: ``[B, Hkv, qpk, Q, dk]``; k: ``[B, Hkv, 1, L, dk]``; v: ``[B, Hkv, 1, L, dv]``.
        visible: ``[B, 1, 1, Q, L]`` bool.

    Returns:
        ``(out [B, Hkv, qpk, Q, dv], lse [B, Hkv, qpk, Q])`` float32; rows
        with nothing visible give zeros and ``-inf``.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
    return torch.matmul(probs, v), lse


def _exact_positions(seq_lens: torch.Tensor, first_new: torch.Tensor, length: int,
                     sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the exact set per request: ``[B, sink + recent + length]``
    (sinks, the last ``recent`` history tokens, the new tokens) and a
    ``[B, ...]`` mask of the real ones (inside the sequence, no position twice)."""
    dev = seq_lens.device
    sinks = torch.arange(sink, device=dev).expand(seq_lens.shape[0], -1)
    tail_start = torch.clamp(first_new - recent, min=sink)  # [B]
    tail = tail_start[:, None] + torch.arange(recent + length, device=dev)[None, :]
    pos = torch.cat((sinks, tail), dim=1)
    real = torch.cat((sinks < seq_lens[:, None], tail < seq_lens[:, None]), dim=1)
    return pos, real


def exact_attention(query: torch.Tensor, exact_cache: torch.Tensor, slot: ExactSlot,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, q_lens: int,
                    sink: int, recent: int, scale: float, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact part for ``B`` requests with ``q_lens`` new tokens each.

    Args:
        query: ``[B, Q, H, d]`` post-RoPE queries at positions
            ``seq_len - Q .. seq_len - 1``.
        exact_cache: The exact cache (the new tokens already written).
        slot: Its slot layout.
        block_table: ``[B, max_blocks]`` of the exact cache group.
        seq_lens: ``[B]`` int (after this step).
        sink, recent: ``S`` and ``W`` (module docstring).

    Returns:
        ``(out [B, Q, H, d], lse [B, Q, H])`` float32.
    """
    b, q_len, h, d = query.shape
    hkv = slot.kv_width // d
    lens = seq_lens.long()
    first_new = lens - q_len
    pos, real = _exact_positions(lens, first_new, q_len, sink, recent)
    k, v = read_exact(exact_cache, slot, block_table, pos)
    k = torch.where(real[..., None], k, 0.0).view(b, -1, hkv, d).permute(0, 2, 1, 3)[:, :, None]
    v = torch.where(real[..., None], v, 0.0).view(b, -1, hkv, d).permute(0, 2, 1, 3)[:, :, None]
    q = query.float().view(b, q_len, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)
    outs, lses = [], []
    for start in range(0, q_len, QUERY_CHUNK):
        stop = min(q_len, start + QUERY_CHUNK)
        qpos = first_new[:, None] + torch.arange(start, stop, device=lens.device)[None, :]
        visible = real[:, None, :] & (pos[:, None, :] <= qpos[:, :, None])  # [B, Q, L]
        if window is not None:
            visible &= pos[:, None, :] > qpos[:, :, None] - window
        o, lse = _attend(q[:, :, :, start:stop], k, v, visible[:, None, None], scale)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=3).permute(0, 3, 1, 2, 4).reshape(b, q_len, h, d)
    lse = torch.cat(lses, dim=3).permute(0, 3, 1, 2).reshape(b, q_len, h)
    return out, lse


def latent_history_attention(plan: LayerPlan, k_up: torch.Tensor, rope, scale: float,
                             query: torch.Tensor, kv_cache: torch.Tensor,
                             block_table_row: torch.Tensor, first_new: int, sink: int,
                             recent: int, layout=None, transform=None,
                             window: int | None = None, post_rope: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent part of a prefill chunk: history ``sink <= t < first_new -
    recent``, which every query of the chunk sees (all of it precedes them;
    a sliding window still drops ``t <= p - window``).

    Args:
        query: ``[Q, H, d]`` post-RoPE queries at ``first_new ..``.
        post_rope: The cached key latents are the post-RoPE keys
            (``post_rope_keys``): read as they are, not rebuilt.

    Returns:
        ``(out [Q, out_width], lse [Q, H])`` float32 (zeros / ``-inf`` when
        the span is empty).
    """
    q_len, h, _ = query.shape
    stop = first_new - recent
    if stop <= sink:
        return (query.new_zeros(q_len, plan.out_width, dtype=torch.float32),
                query.new_full((q_len, h), float("-inf"), dtype=torch.float32))
    start = sink if window is None else max(sink, first_new - window + 1)
    lat = latent.gather_latents(kv_cache, block_table_row[None], stop, layout,
                                start=min(start, stop)).float()
    pos = torch.arange(min(start, stop), stop, device=query.device)
    qpos = first_new + torch.arange(q_len, device=query.device)
    visible = torch.ones(q_len, pos.shape[0], dtype=torch.bool, device=query.device)
    if window is not None:
        visible &= pos[None, :] > qpos[:, None] - window
    rk, hg, gs = plan.k_width, plan.heads_per_group, plan.group_size
    outs, lses = [], []
    for g, v_off in enumerate(plan.v_offsets()):
        r_v = plan.v_ranks[g]
        keys = latent._group_keys(plan, g, k_up, rope, lat, pos, post_rope, transform)[0]
        # keys [L, G, d] -> [G, 1, L, d]; queries [Q, Hg, d] -> [G, qpk, Q, d]
        k = keys.permute(1, 0, 2)[:, None]
        q = query[:, g * hg:(g + 1) * hg].float().view(q_len, gs, hg // gs, -1).permute(1, 2, 0, 3)
        v = lat[0, :, rk + v_off:rk + v_off + r_v][None, None]
        o, lse = _attend(q[None], k[None], v[None].expand(1, gs, 1, -1, -1),
                         visible[None, None, None], scale)
        outs.append(o[0].permute(2, 0, 1, 3).reshape(q_len, hg * r_v))
        lses.append(lse[0].permute(2, 0, 1).reshape(q_len, hg))
    return torch.cat(outs, dim=-1), torch.cat(lses, dim=-1)


def decode(plan: LayerPlan, k_up: torch.Tensor, v_up: torch.Tensor, rope, scale: float,
           query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           exact_cache: torch.Tensor, exact_block_table: torch.Tensor,
           seq_lens: torch.Tensor, max_seq_len: int, *, sink: int, recent: int,
           exact: ExactSlot, layout=None, transform=None,
           window: int | None = None, mode: str = "pre_rope",
           min_seq_len: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per request: latent span ``sink <= t < seq_len - 1 -
    recent`` plus the exact set, merged (the torch path; the GPU decoders of
    :mod:`vllm_lowrank.attention.decoders` compute the same).

    Args:
        query: ``[B, H, d]`` post-RoPE queries at ``seq_len - 1``.
        kv_cache, block_table: The latent cache and the requests' rows of its
            block table; exact_cache, exact_block_table: the same for the
            exact cache (this token already written to both), whose slots
            ``exact`` lays out.
        seq_lens: ``[B]`` (this token included); max_seq_len, min_seq_len:
            their max / min as host ints.
        mode: ``"post_rope"`` when the key latents are the post-RoPE keys
            (read as cached); otherwise they are rebuilt and rotated.
        out: ``[B, H * d]`` tensor to write the result into (any float dtype),
            or ``None``.

    Returns:
        ``[B, H * d]``: ``out``, or a new float32 tensor.
    """
    lat, lat_lse = latent.decode_attention(
        plan, k_up, rope, scale, query, kv_cache, block_table, seq_lens, max_seq_len,
        post_rope=mode == "post_rope", layout=layout, transform=transform, window=window,
        min_seq_len=min_seq_len, sink=sink, recent=recent + 1, return_lse=True)
    ex, ex_lse = exact_attention(query[:, None], exact_cache, exact, exact_block_table,
                                 seq_lens, 1, sink, recent, scale, window)
    merged = merge(values_up(plan, v_up, lat), lat_lse, ex[:, 0], ex_lse[:, 0])
    merged = merged.reshape(query.shape[0], -1)
    if out is None:
        return merged
    out.copy_(merged)
    return out


def prefill(plan: LayerPlan, k_up: torch.Tensor, v_up: torch.Tensor, rope, scale: float,
            query: torch.Tensor, kv_cache: torch.Tensor, block_table_row: torch.Tensor,
            exact_cache: torch.Tensor, exact_block_table_row: torch.Tensor, seq_len: int, *,
            sink: int, recent: int, exact: ExactSlot, layout=None,
            transform=None, window: int | None = None, post_rope: bool = False
            ) -> torch.Tensor:
    """A chunk of ``Q`` new tokens of one request (positions ``seq_len - Q ..``):
    latent history plus the exact set (its own tokens included), merged.

    Args:
        query: ``[Q, H, d]`` post-RoPE.
        block_table_row, exact_block_table_row: ``[max_blocks]`` each.
        exact: Layout of the exact cache's slots.
        post_rope: The key latents are post-RoPE keys (``post_rope_keys``).

    Returns:
        ``[Q, H * d]`` float32.
    """
    q_len = query.shape[0]
    lat, lat_lse = latent_history_attention(plan, k_up, rope, scale, query, kv_cache,
                                            block_table_row, seq_len - q_len, sink, recent,
                                            layout, transform, window, post_rope)
    lens = torch.tensor([seq_len], device=query.device)
    ex, ex_lse = exact_attention(query[None], exact_cache, exact, exact_block_table_row[None],
                                 lens, q_len, sink, recent, scale, window)
    return merge(values_up(plan, v_up, lat), lat_lse, ex[0], ex_lse[0]).reshape(q_len, -1)


@dataclasses.dataclass
class PrefillSpans:
    """The prefill chunks of a step, flattened for :func:`prefill_batched`
    (device tensors; rows in request order).

    Attributes:
        cu_q: ``[N + 1]`` int32 offsets of each chunk's queries.
        max_q_len: Longest chunk (host).
        lat_req, lat_pos: ``[S_g]`` int64 batch row and position of every
            latent slot read (each request's latent span ``S <= t < s - W``,
            widened to whole per-channel key groups).
        lat_keep: ``[S_l]`` int64 rows of those that are attended (the span
            itself), or ``None`` when they all are.
        lat_key_pos: ``[S_l]`` int64 their positions.
        cu_lat: ``[N + 1]`` int32 offsets of each request's attended latent rows.
        ex_req, ex_pos: ``[S_e]`` int64 batch row and position of every exact
            token of each chunk (sinks, the ``W`` before the chunk, the chunk),
            in position order: the chunk is the last ``q_len`` of its request's.
        cu_ex: ``[N + 1]`` int32 offsets of each request's exact rows.
    """

    cu_q: torch.Tensor
    max_q_len: int
    lat_req: torch.Tensor
    lat_pos: torch.Tensor
    lat_keep: torch.Tensor | None
    lat_key_pos: torch.Tensor
    cu_lat: torch.Tensor
    ex_req: torch.Tensor
    ex_pos: torch.Tensor
    cu_ex: torch.Tensor


def prefill_spans(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int,
                  sink: int, recent: int, key_group: int, device) -> PrefillSpans:
    """The step's prefill chunks as :class:`PrefillSpans` (host arithmetic, one
    host-to-device copy per tensor, no sync).

    Args:
        query_start_loc: ``[num_reqs + 1]`` host offsets of each request's new
            tokens (decodes first).
        seq_lens: ``[num_reqs]`` host context lengths after this step.
        num_decodes: Leading one-token requests (left out).
        sink, recent: ``S`` and ``W``.
        key_group: Tokens per per-channel key group (1: keys per token).
        device: Where the tensors go.
    """
    qsl = query_start_loc.long()
    q_lens = qsl[num_decodes + 1:] - qsl[num_decodes:-1]
    seq = seq_lens[num_decodes:].long()
    first = seq - q_lens
    rows = torch.arange(len(seq)) + num_decodes
    # latent span [S, first - W), read in whole key groups
    lat_hi = torch.clamp(first - recent, min=sink)
    has = lat_hi > sink
    g_lo = sink - sink % key_group
    g_hi = -(-lat_hi // key_group) * key_group
    g_req, g_pos, _ = latent.flat_ranges(torch.full_like(seq, g_lo),
                                         torch.where(has, g_hi - g_lo, 0))
    keep = (g_pos >= sink) & (g_pos < lat_hi[g_req])
    _, _, cu_lat = latent.flat_ranges(torch.zeros_like(seq), torch.where(has, lat_hi - sink, 0))
    # exact set: sinks, then max(S, first - W) .. seq - 1
    n_sink = torch.clamp(seq, max=sink)
    tail = torch.clamp(first - recent, min=sink)
    n_tail = torch.clamp(seq - tail, min=0)
    e_req, e_idx, cu_ex = latent.flat_ranges(torch.zeros_like(seq), n_sink + n_tail)
    e_pos = torch.where(e_idx < n_sink[e_req], e_idx, tail[e_req] + e_idx - n_sink[e_req])

    def dev(x, dtype=torch.long):
        return x.to(dtype).to(device, non_blocking=True)

    return PrefillSpans(
        cu_q=dev(qsl[num_decodes:] - qsl[num_decodes], torch.int32),
        max_q_len=int(q_lens.max()),
        lat_req=dev(rows[g_req]), lat_pos=dev(g_pos),
        lat_keep=None if bool(keep.all()) else dev(keep.nonzero()[:, 0]),
        lat_key_pos=dev(g_pos[keep]), cu_lat=dev(cu_lat, torch.int32),
        ex_req=dev(rows[e_req]), ex_pos=dev(e_pos), cu_ex=dev(cu_ex, torch.int32))


_KV_HEADS: dict = {}


def _kv_head_table(plan: LayerPlan, device) -> torch.Tensor:
    """The varlen kernel's head table
    (:func:`vllm_lowrank.kernels.triton.prefill.head_table`'s format) for values
    per KV head (the exact tokens', and the latent history's rebuilt): query
    head ``h`` reads KV head ``h // qpk``'s ``head_dim`` values and writes
    ``h * d``; built once per plan and device."""
    key = (plan, str(device))
    if key not in _KV_HEADS:
        s = plan.shape
        d, qpk = s.head_dim, s.queries_per_kv
        _KV_HEADS[key] = torch.tensor([(h // qpk * d, d, h * d) for h in range(s.num_heads)],
                                      dtype=torch.int32, device=device)
    return _KV_HEADS[key]


def prefill_batched(plan: LayerPlan, k_up: torch.Tensor, v_up: torch.Tensor, rope,
                    scale: float, query: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, exact_cache: torch.Tensor,
                    exact_block_table: torch.Tensor, spans: PrefillSpans, out: torch.Tensor,
                    *, exact: ExactSlot, layout=None, transform=None,
                    post_rope: bool = False) -> torch.Tensor:
    """Every prefill chunk of a step in one varlen kernel call, no loop over
    requests. The latent history is gathered and dequantized once, and its
    keys and values are rebuilt and the keys rotated
    (:func:`~vllm_lowrank.attention.latent_attention.context_keys`,
    :func:`~vllm_lowrank.attention.latent_attention.context_values`); the
    causal kernel attends them as a prefix that every query sees, ahead of
    the exact set (sinks, recent tokens, the chunk)
    (:func:`vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`). So
    one softmax covers both parts (no merge), and the score and value work per
    query head is that of a ``head_dim`` head rather than of the value
    latent's width. The same result as :func:`prefill` per request, up to the
    precision of the query dtype (the rebuilt keys and values and the
    kernel's operands).

    Args:
        query: ``[T, H, d]`` post-RoPE queries of the chunks, in request order.
        block_table, exact_block_table: ``[num_reqs, max_blocks]`` of the
            latent and the exact cache (rows indexed by the spans' requests).
        spans: From :func:`prefill_spans`.
        out: ``[T, H * d]``, written in place.
        post_rope: The key latents are post-RoPE keys (``post_rope_keys``),
            read as they are instead of rebuilt.

    Returns:
        ``out``.
    """
    from vllm_lowrank.kernels.triton import prefill as kernel

    _, _, d = query.shape
    nkh, dt = plan.shape.num_kv_heads, query.dtype
    prefix = None
    if spans.lat_key_pos.numel():
        bs = kv_cache.shape[2]
        blocks = block_table[spans.lat_req, spans.lat_pos // bs].long()
        rows = latent.gather_slots(kv_cache, blocks, spans.lat_pos % bs)
        lat = torch.cat(layout.decode(rows), dim=-1) if layout is not None else rows
        if spans.lat_keep is not None:
            lat = lat[spans.lat_keep]
        lat = lat.to(dt)  # once, for both rebuilds
        prefix = (latent.context_keys(plan, k_up, rope, lat, spans.lat_key_pos, post_rope,
                                      transform, dtype=dt),
                  latent.context_values(plan, v_up, lat[:, plan.k_width:], dtype=dt),
                  spans.cu_lat)
    eb = exact_cache.shape[2]
    blocks = exact_block_table[spans.ex_req, spans.ex_pos // eb].long()
    k, v = exact.decode(latent.gather_slots(exact_cache, blocks, spans.ex_pos % eb))
    return kernel.latent_prefill_attention(
        query, k.view(-1, nkh, d).to(dt), v.to(dt), _kv_head_table(plan, query.device),
        spans.cu_q, spans.cu_ex, spans.max_q_len, scale, out, max_rank_v=d, prefix=prefix)
