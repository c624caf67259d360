"""Post-RoPE-keys test layers and caches, written by the real
:class:`~vllm_lowrank.format.latent.SlotLayout` and
:class:`~vllm_lowrank.format.exact.ExactSlot` encoders, and the torch path's
output on them: the Triton kernel's tests
(``tests/kernels/test_triton_post_rope_decode.py``) and the CUDA kernel's
(``tests/kernels/test_cuda_post_rope_decode.py``)."""

from __future__ import annotations

import math

import torch

from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.format.latent import SlotLayout

D = 128


def build(lens, *, group_size, rv, k_bits, v_bits, exact_bits, kct, page, sink, recent,
          heads, kv_heads, d, lat_page=None, q_lens=None, seed=0, dtype=torch.bfloat16):
    """A post-RoPE-keys layer and its caches for sequences of ``lens`` tokens: a
    paged latent cache (blocks of ``lat_page``, default ``page``; keys 4- or 2-bit
    per channel over ``kct`` tokens, every key group complete, an outlier channel)
    and an exact cache (blocks of ``page``, ``exact_bits`` 16 or 8) over shuffled
    blocks, the exact rows outside each sequence's exact set poisoned (0xFF, as
    freed blocks may hold; with ``q_lens``, a verify step's, the window is kept from
    its first new token), the value up-projection, and float32 queries ``[sum(q_lens)
    or len(lens), heads, d]``.

    Returns:
        ``(plan, layout, slot, cache, exact, (table, etable), v_up, q)``.
    """
    lat_page = lat_page or page
    g = torch.Generator().manual_seed(seed)
    shape = AttentionShape(heads * d, heads, kv_heads, d)
    ng = kv_heads // group_size
    plan = LayerPlan(shape, group_size, (group_size * d,) * ng, (rv,) * ng)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, k_bits, v_bits, k_channel_tokens=kct)
    slot = ExactSlot(shape.kv_width, d, dtype, exact_bits, 0, layout.slot_bytes)

    def paged(blk):
        per = [max(1, math.ceil(n / blk)) for n in lens]
        nblk = sum(per) + 2
        order = torch.randperm(nblk, generator=g)
        table = torch.zeros(len(lens), max(per), dtype=torch.int32)
        used = 0
        for b, n in enumerate(per):
            table[b, :n] = order[used:used + n]
            used += n
        return table, nblk

    table, nblk = paged(lat_page)
    rows = nblk * lat_page
    keys = torch.randn(rows, shape.kv_width, generator=g) * 2
    keys[:, 3] += 6  # an outlier channel (per-channel scales)
    vlat = torch.randn(rows, plan.v_width, generator=g)
    cache = layout.encode_complete(keys, vlat).view(nblk, 1, lat_page, -1)
    etable, eblk = paged(page)
    exact_k = torch.randn(eblk * page, shape.kv_width, generator=g)
    exact_v = torch.randn(eblk * page, shape.kv_width, generator=g)
    exact = slot.encode(exact_k, exact_v).view(eblk, 1, page, -1)
    for b, n in enumerate(lens):
        first = n - (q_lens[b] if q_lens else 1)  # the step's first new token
        for t in range(n):
            if not (t < sink or t >= max(sink, first - recent)):
                exact[int(etable[b, t // page]), 0, t % page] = 0xFF
    v_up = torch.zeros(plan.v_width, shape.kv_width)
    gw = plan.group_width
    for gi, off in enumerate(plan.v_offsets()):
        v_up[off:off + rv, gi * gw:(gi + 1) * gw] = torch.randn(rv, gw, generator=g) / rv ** 0.5
    q = torch.randn(sum(q_lens) if q_lens else len(lens), heads, d, generator=g)
    return plan, layout, slot, cache, exact, (table, etable), v_up, q


def make_case(lens, *, kct, page, v_bits, qpk, sink, recent, kv_heads=4, lat_page=None,
              seed=0, dtype=torch.bfloat16, rv=D):
    """:func:`build` for the CUDA kernel's scope: ``head_dim`` 128, one KV head per
    group at value rank ``rv`` (full rank by default), 4-bit keys, int8 exact tokens;
    queries in ``dtype``."""
    *case, q = build(lens, group_size=1, rv=rv, k_bits=4, v_bits=v_bits, exact_bits=8, kct=kct,
                     page=page, sink=sink, recent=recent, heads=qpk * kv_heads,
                     kv_heads=kv_heads, d=D, lat_page=lat_page, seed=seed, dtype=dtype)
    return (*case, q.to(dtype))


def reference(plan, layout, slot, cache, exact, tables, v_up, q, lens, *, sink, recent, scale):
    rows = [b for b, n in enumerate(lens) if n > 0]
    want = torch.zeros(len(lens), plan.shape.num_heads * D)
    want[rows] = tale.decode(plan, torch.empty(0, plan.shape.kv_width), v_up, None, scale,
                             q[rows].float(), cache, tables[0][rows], exact, tables[1][rows],
                             torch.tensor([lens[b] for b in rows], dtype=torch.int32),
                             max(lens), sink=sink, recent=recent, exact=slot, layout=layout,
                             mode="post_rope")
    return want
