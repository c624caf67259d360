"""Post-RoPE-keys test caches for the CUDA kernel's tests (the GPU tests of
``tests/kernels/test_cuda_post_rope_decode.py`` and the CPU emulation of
``tests/unit/test_cuda_post_rope_fragments.py``): written by the real
:class:`~vllm_lowrank.format.latent.SlotLayout` and
:class:`~vllm_lowrank.format.exact.ExactSlot` encoders, and the torch path's
output on them."""

from __future__ import annotations

import math

import torch

from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.format.latent import SlotLayout

D = 128


def make_case(lens, *, kct, page, v_bits, qpk, sink, recent, kv_heads=4, lat_page=None,
              seed=0, dtype=torch.bfloat16):
    """A paged latent cache (blocks of ``lat_page``, default ``page``) and an int8
    exact cache (blocks of ``page``) for sequences of ``lens`` tokens, shuffled
    blocks, every key group complete; the layer's plan, layout, exact slot, value
    up-projection and bf16 queries."""
    lat_page = lat_page or page
    g = torch.Generator().manual_seed(seed)
    shape = AttentionShape(qpk * kv_heads * D, qpk * kv_heads, kv_heads, D)
    plan = LayerPlan(shape, 1, (D,) * kv_heads, (D,) * kv_heads)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, v_bits, k_channel_tokens=kct)
    slot = ExactSlot(shape.kv_width, D, dtype, 8, 0, layout.slot_bytes)

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
    for b, n in enumerate(lens):  # poison the exact rows outside the exact set
        for t in range(n):
            if not (t < sink or t >= max(sink, n - 1 - recent)):
                exact[int(etable[b, t // page]), 0, t % page] = 0xFF
    v_up = torch.zeros(plan.v_width, shape.kv_width)
    for j, off in enumerate(plan.v_offsets()):
        v_up[off:off + D, j * D:(j + 1) * D] = torch.randn(D, D, generator=g) / D ** 0.5
    q = torch.randn(len(lens), shape.num_heads, D, generator=g).to(dtype)
    return plan, layout, slot, cache, exact, (table, etable), v_up, q



def reference(plan, layout, slot, cache, exact, tables, v_up, q, lens, *, sink, recent, scale):
    rows = [b for b, n in enumerate(lens) if n > 0]
    want = torch.zeros(len(lens), plan.shape.num_heads * D)
    want[rows] = tale.decode(plan, torch.empty(0, plan.shape.kv_width), v_up, None, scale,
                             q[rows].float(), cache, tables[0][rows], exact, tables[1][rows],
                             torch.tensor([lens[b] for b in rows], dtype=torch.int32),
                             max(lens), sink=sink, recent=recent, exact=slot, layout=layout,
                             mode="post_rope")
    return want
