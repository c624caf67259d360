"""Batched varlen prefill (one call for every prefill chunk of a step) against
the per-request torch path and a float64 loop.

On a machine without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (set
by ``conftest.py``) on CPU tensors in float32; on a CUDA machine the same tests
run the compiled kernel in bf16.

    python -P -m pytest tests/kernels/test_triton_prefill.py -q
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"

pytest.importorskip("triton")

from vllm_lowrank.attention import backend  # noqa: E402
from vllm_lowrank.attention import latent_attention as ops  # noqa: E402
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402

import vllm_lowrank.kernels.triton.prefill as pre  # noqa: E402

import test_triton_decode as problems  # noqa: E402  (shared problem builders)


DEV = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-4


def make_plan(seed, **shape):
    plan, k_up = problems.make_plan(torch.Generator().manual_seed(seed), **shape)
    return plan, k_up.to(DEV)


def make_step(plan, chunks, page, seed, width):
    """A reordered batch: one decode request, then prefill chunks ``(context,
    q_len)``; a shuffled paged cache of random latents (``width`` per slot)
    whose unused blocks hold NaN (never read)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [(17, 1)] + list(chunks)
    seq = [c + q for c, q in reqs]
    nblk = [math.ceil(n / page) for n in seq]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(reqs), max(nblk) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(nblk):
        table[r, :n] = perm[used:used + n].int()
        used += n
    cache = torch.full((num_blocks, 1, page, width), float("nan"))
    for r, n in enumerate(seq):
        for t in range(n):
            cache[table[r, t // page], 0, t % page] = torch.randn(width, generator=g)
    qsl = torch.tensor([0] + [q for _, q in reqs]).cumsum(0).int()
    total = int(qsl[-1])
    return cache.to(DEV), table.to(DEV), qsl, torch.tensor(seq, dtype=torch.int32), total


@pytest.mark.parametrize("case", [
    dict(heads=8, kv_heads=4, head_dim=32, group_size=1, k_ranks=(16, 32, 16, 24),
         v_ranks=(8, 16, 32, 16), window=None),
    dict(heads=6, kv_heads=2, head_dim=32, group_size=2, k_ranks=(40,), v_ranks=(48,),
         window=None),
    dict(heads=4, kv_heads=4, head_dim=32, group_size=1, k_ranks=(16,) * 4,
         v_ranks=(16,) * 4, window=13),
])
def test_batched_prefill_matches_per_request_path(case):
    window = case.pop("window")
    plan, k_up = make_plan(1, **case)
    rope = problems.make_rope(plan.shape.head_dim)
    chunks = [(0, 9), (21, 5), (40, 23)]
    cache, table, qsl, seq, total = make_step(plan, chunks, page=16, seed=2,
                                              width=plan.k_width + plan.v_width)
    query = torch.randn(total, plan.shape.num_heads, plan.shape.head_dim,
                        generator=torch.Generator().manual_seed(3)).to(DEV)
    batch = backend.prefill_batch(qsl, seq, 1, window, DEV)
    out = torch.full((total - 1, plan.out_width), float("nan"), device=DEV, dtype=DTYPE)
    backend.batched_prefill(plan, k_up, rope, 0.3, query[1:].to(DTYPE), cache.to(DTYPE), table,
                            batch, out, window=window)
    for r in range(1, len(qsl) - 1):
        a, b = int(qsl[r]), int(qsl[r + 1])
        ref = ops.prefill_attention(plan, k_up, rope, 0.3, query[a:b], cache, table[r],
                                    int(seq[r]), window=window)
        got = out[a - 1:b - 1].float()
        assert torch.isfinite(got).all()
        err = (got - ref).norm() / ref.norm()
        assert err < TOL, (r, float(err))


def test_batched_prefill_quantized_and_post_rope():
    """Packed 4-bit latents are dequantized on the gather; post-RoPE keys are
    the zero-padded key latents (no rebuild)."""
    plan, k_up = make_plan(4, heads=4, kv_heads=2, head_dim=32, group_size=1,
                           k_ranks=(16, 32), v_ranks=(16, 16))
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4)
    rope = problems.make_rope(32)
    chunks = [(5, 7), (30, 19)]
    lat_cache, table, qsl, seq, total = make_step(plan, chunks, page=16, seed=5,
                                                  width=plan.k_width + plan.v_width)
    flat = lat_cache.view(-1, lat_cache.shape[-1]).nan_to_num(0.0).float()
    packed = layout.encode(flat[:, :plan.k_width], flat[:, plan.k_width:])
    cache = packed.view(lat_cache.shape[0], 1, lat_cache.shape[2], -1)
    for post_rope in (False, True):
        width = max(plan.k_ranks) if post_rope else 32
        query = torch.randn(total, 4, width, generator=torch.Generator().manual_seed(6)).to(DEV)
        batch = backend.prefill_batch(qsl, seq, 1, None, DEV)
        out = torch.empty(total - 1, plan.out_width, device=DEV, dtype=DTYPE)
        backend.batched_prefill(plan, k_up, rope, 0.25, query[1:].to(DTYPE), cache, table,
                                batch, out, post_rope=post_rope, layout=layout)
        for r in range(1, len(qsl) - 1):
            a, b = int(qsl[r]), int(qsl[r + 1])
            ref = ops.prefill_attention(plan, k_up, rope, 0.25, query[a:b], cache, table[r],
                                        int(seq[r]), post_rope=post_rope, layout=layout)
            err = (out[a - 1:b - 1].float() - ref).norm() / ref.norm()
            assert err < TOL, (post_rope, r, float(err))


def test_kernel_against_float64_loop():
    """The kernel alone on hand-made keys and values (key width not a power of
    two, uneven value ranks, bottom-right causal mask) against a float64 loop."""
    g = torch.Generator().manual_seed(7)
    plan = LayerPlan(AttentionShape(4 * 24, 4, 2, 24), 1, (16, 16), (8, 24))
    cu_q = torch.tensor([0, 3, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 28], dtype=torch.int32)
    q = torch.randn(20, 4, 24, generator=g)
    k = torch.randn(28, 2, 24, generator=g)
    v = torch.randn(28, plan.v_width, generator=g)
    out_dev = torch.full((20, plan.out_width), float("nan"), device=DEV, dtype=DTYPE)
    pre.latent_prefill_attention(q.to(DEV, DTYPE), k.to(DEV, DTYPE), v.to(DEV, DTYPE),
                                 pre.head_table(plan, DEV), cu_q.to(DEV), cu_k.to(DEV), 17,
                                 0.5, out_dev, max_rank_v=24)
    ref = torch.empty(20, plan.out_width, dtype=torch.float64)
    for n in range(2):
        qa, qb, ka, kb = int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])
        ctx = (kb - ka) - (qb - qa)
        for j in range(qb - qa):
            for h in range(4):
                grp = h // 2
                v_off, r_v = plan.v_offsets()[grp], plan.v_ranks[grp]
                keys = k[ka:ka + ctx + j + 1, grp].double()
                p = torch.softmax(0.5 * keys @ q[qa + j, h].double(), 0)
                col = 2 * plan.v_offsets()[grp] + (h % 2) * r_v
                ref[qa + j, col:col + r_v] = p @ v[ka:ka + ctx + j + 1, v_off:v_off + r_v].double()
    err = (out_dev.double().cpu() - ref).norm() / ref.norm()
    assert err < TOL, float(err)


@pytest.mark.parametrize("with_prefix", [False, True])
def test_wide_value_latents(with_prefix):
    """J-LRD's value rank 768 on 8 KV heads of 128 (latent 0.75 on a
    Llama-3-8B shape; on an H100 its first launch asked for 262,144 bytes of
    shared memory, over the limit) against a float64 reference; with a prefix,
    a second key source that every query sees ahead of the causal context (the
    token-adaptive latent history; 0 rows for one request, 45 for the other),
    against the softmax over both sources."""
    g = torch.Generator().manual_seed(11)
    plan = LayerPlan(AttentionShape(32 * 128, 32, 8, 128), 8, (768,), (768,))
    cu_q = torch.tensor([0, 5, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 150], dtype=torch.int32)
    cu_p = torch.tensor([0, 0, 45], dtype=torch.int32)
    q = torch.randn(37, 32, 128, generator=g)
    k = torch.randn(150, 8, 128, generator=g)
    v = torch.randn(150, 768, generator=g)
    pk = torch.randn(45, 8, 128, generator=g)
    pv = torch.randn(45, 768, generator=g)
    out = torch.full((37, plan.out_width), float("nan"), device=DEV, dtype=DTYPE)
    prefix = (pk.to(DEV, DTYPE), pv.to(DEV, DTYPE), cu_p.to(DEV)) if with_prefix else None
    pre.latent_prefill_attention(q.to(DEV, DTYPE), k.to(DEV, DTYPE), v.to(DEV, DTYPE),
                                 pre.head_table(plan, DEV), cu_q.to(DEV), cu_k.to(DEV), 32,
                                 128 ** -0.5, out, max_rank_v=768, prefix=prefix)
    ref = torch.empty(37, 32, 768, dtype=torch.float64)
    for n in range(2):
        qa, qb, ka, kb = (int(x) for x in (cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]))
        pa, pb = (int(cu_p[n]), int(cu_p[n + 1])) if with_prefix else (0, 0)
        keys = torch.cat((pk[pa:pb], k[ka:kb])).double().repeat_interleave(4, dim=1)
        vals = torch.cat((pv[pa:pb], v[ka:kb])).double()
        s = torch.einsum("qhd,shd->hqs", q[qa:qb].double(), keys) * 128 ** -0.5
        ctx = keys.shape[0] - (qb - qa)
        visible = torch.arange(keys.shape[0])[None, :] <= ctx + torch.arange(qb - qa)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        ref[qa:qb] = torch.einsum("hqs,sr->qhr", torch.softmax(s, -1), vals)
    err = (out.double().cpu() - ref.view(37, -1)).norm() / ref.norm()
    assert err < TOL, float(err)


def test_prefix_needs_no_window():
    """A prefix with a sliding window is refused before any launch."""
    plan = LayerPlan(AttentionShape(4 * 16, 4, 2, 16), 1, (8, 8), (8, 8))
    q, k, v = torch.zeros(3, 4, 16), torch.zeros(5, 2, 16), torch.zeros(5, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="window"):
        pre.latent_prefill_attention(q, k, v, pre.head_table(plan, "cpu"), cu, cu, 3, 1.0,
                                     torch.zeros(3, plan.out_width), max_rank_v=8, window=4,
                                     prefix=(k, v, cu))
