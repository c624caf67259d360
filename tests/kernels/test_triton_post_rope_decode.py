"""The fused token-adaptive decode of post-RoPE keys and value latents
(``vllm_lowrank/kernels/triton/decode_post_rope.py``) against the torch path
(:func:`vllm_lowrank.attention.token_adaptive.decode`), in the Triton
interpreter on CPU (or compiled on a GPU).

Exact-cache rows of positions the exact set does not hold are poisoned with
NaN (vLLM frees those blocks), and the output is poisoned before each call, so
a wrong read or an unwritten element shows up.
"""

from __future__ import annotations


import pytest
import torch

from post_rope_case import build
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.format.latent import SlotLayout

triton = pytest.importorskip("triton")
from vllm_lowrank.kernels.triton import decode_post_rope as kernel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
SCALE = 0.2


def make_case(group_size, rv, k_bits, v_bits, exact_bits, lens, sink, recent, seed=0,
              heads=4, kv_heads=2, d=64, lat_page=PAGE, q_lens=None):
    """:func:`post_rope_case.build` with key groups and exact blocks of ``PAGE``;
    float32 queries and the kernel's dtype (float32 on a CPU, bf16 on a GPU)."""
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    return (*build(lens, group_size=group_size, rv=rv, k_bits=k_bits, v_bits=v_bits,
                   exact_bits=exact_bits, kct=PAGE, page=PAGE, sink=sink, recent=recent,
                   heads=heads, kv_heads=kv_heads, d=d, lat_page=lat_page, q_lens=q_lens,
                   seed=seed, dtype=dtype), dtype)


def reference(plan, layout, slot, cache, exact, tables, v_up, q, lens, sink, recent):
    return tale.decode(plan, torch.empty(0, plan.shape.kv_width), v_up, None, SCALE, q,
                       cache, tables[0], exact, tables[1],
                       torch.tensor(lens, dtype=torch.int32),
                       max(lens), sink=sink, recent=recent, exact=slot, layout=layout,
                       mode="post_rope")


CASES = [
    # group_size, rv, k_bits, v_bits, exact_bits, lens, sink, recent, splits
    (1, 32, 4, 4, 16, [5, 40, 97, 130], 16, 16, 1),
    (1, 32, 4, 4, 8, [5, 40, 97, 130], 16, 16, 2, 2 * PAGE),  # latent blocks of 2 x 16
    (1, 48, 4, 4, 8, [17, 64, 130, 1], 16, 32, 3),
    (2, 64, 4, 8, 8, [130, 35, 64], 16, 16, 2),
    (1, 64, 2, 4, 16, [100, 33], 0, 16, 1),
    (2, 64, 2, 2, 8, [120, 49, 2], 16, 16, 4),
    (1, 32, 4, 4, 8, [0, 70], 16, 16, 2),       # a CUDA graph's padding row (length 0)
]


@pytest.mark.parametrize("case", CASES)
def test_post_rope_decode_matches_torch_path(case):
    """Latent span and exact tokens in one kernel equal the torch path's two
    parts merged, over groupings, code widths, exact-slot formats, splits and
    a latent cache whose blocks are larger than the exact cache's."""
    group_size, rv, k_bits, v_bits, exact_bits, lens, sink, recent, splits, *page = case
    (plan, layout, slot, cache, exact, tables, v_up, q,
     dtype) = make_case(group_size, rv, k_bits, v_bits, exact_bits, lens, sink, recent,
                        lat_page=page[0] if page else PAGE)
    assert kernel.blocker(plan, layout, slot, post_rope=True, window=None,
                          block_size=PAGE) is None
    real = [n for n in lens if n > 0]
    rows = [b for b, n in enumerate(lens) if n > 0]
    want = reference(plan, layout, slot, cache, exact, (tables[0][rows], tables[1][rows]), v_up,
                     q[rows].float(), real, sink, recent)
    launch = kernel.PostRopeLaunch(plan, layout, slot, v_up.to(DEV), scale=SCALE, sink=sink,
                                   recent=recent, dtype=dtype, block_size=PAGE)
    out = torch.full((len(lens), plan.shape.num_heads * plan.shape.head_dim), float("nan"),
                     device=DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    launch(q.to(DEV, dtype), cache.to(DEV), tables[0].to(DEV), exact.to(DEV), tables[1].to(DEV),
           lens_t, splits, out)
    out = out.cpu()
    assert torch.isfinite(out).all()
    got = out[rows]
    err = ((got - want).norm() / want.norm()).item()
    assert err < (2e-3 if DEV == "cpu" else 2e-2), err
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("q_lens,splits", [([3, 1, 4], 1), ([4, 2, 0], 3)])
def test_a_verify_steps_query_tokens_read_the_cache_once(q_lens, splits):
    """Several query tokens per sequence (``query_start_loc``, a speculative
    verify step): token ``t`` of ``q_b`` equals the torch path decoding it
    alone at ``seq_len - (q_b - 1 - t)``, its own latent span and exact set
    (the exact rows before the step's window are poisoned, as vLLM frees
    them); a sequence with no tokens writes nothing."""
    lens, sink, recent = [40, 97, 130], 16, 16
    (plan, layout, slot, cache, exact, (table, etable), v_up, q,
     dtype) = make_case(1, 32, 4, 4, 8, lens, sink, recent, seed=3, q_lens=q_lens)
    req = torch.tensor([b for b, n in enumerate(q_lens) for _ in range(n)])
    row_lens = [lens[b] - (n - 1 - t) for b, n in enumerate(q_lens) for t in range(n)]
    want = reference(plan, layout, slot, cache, exact, (table[req], etable[req]), v_up,
                     q.float(), row_lens, sink, recent)
    launch = kernel.PostRopeLaunch(plan, layout, slot, v_up.to(DEV), scale=SCALE, sink=sink,
                                   recent=recent, dtype=dtype, block_size=PAGE)
    out = torch.full((q.shape[0], plan.shape.num_heads * plan.shape.head_dim), float("nan"),
                     device=DEV)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    launch(q.to(DEV, dtype), cache.to(DEV), table.to(DEV), exact.to(DEV), etable.to(DEV),
           torch.tensor(lens, dtype=torch.int32, device=DEV), splits, out,
           query_start_loc=qsl.to(DEV), max_query_len=max(q_lens))
    out = out.cpu()
    assert torch.isfinite(out).all()
    err = ((out - want).norm() / want.norm()).item()
    assert err < (2e-3 if DEV == "cpu" else 2e-2), err


def test_splits_agree_and_cover_every_tile():
    """Every split count gives the same output: the tile list (latent groups,
    then exact tiles) is cut without a gap or an overlap."""
    lens, sink, recent = [150, 77, 31], 16, 16
    (plan, layout, slot, cache, exact, (table, etable), v_up, q,
     dtype) = make_case(1, 32, 4, 4, 8, lens, sink, recent, seed=5)
    launch = kernel.PostRopeLaunch(plan, layout, slot, v_up.to(DEV), scale=SCALE, sink=sink,
                                   recent=recent, dtype=dtype, block_size=PAGE)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    outs = []
    for splits in (1, 2, 5, 16):
        out = torch.full((3, plan.shape.num_heads * plan.shape.head_dim), float("nan"),
                         device=DEV)
        launch(q.to(DEV, dtype), cache.to(DEV), table.to(DEV), exact.to(DEV), etable.to(DEV),
               lens_t, splits, out)
        outs.append(out.cpu())
    tol = 1e-4 if DEV == "cpu" else 2e-2  # bf16 outputs and partials on a GPU
    for o in outs[1:]:
        assert ((o - outs[0]).norm() / outs[0].norm()).item() < tol


def test_scope():
    """What the kernel refuses, by name."""
    (plan, layout, slot, *_rest) = make_case(1, 32, 4, 4, 8, [40], 16, 16)
    ok = dict(post_rope=True, window=None, block_size=PAGE)
    assert kernel.blocker(plan, layout, slot, **ok) is None
    assert "sliding window" in kernel.blocker(plan, layout, slot, **{**ok, "window": 64})
    assert "after RoPE" in kernel.blocker(plan, layout, slot, **{**ok, "post_rope": False})
    per_token = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4)
    assert "per channel" in kernel.blocker(plan, per_token, slot, **ok)
    k3 = SlotLayout(plan.k_ranks, plan.v_ranks, 3, 4, k_channel_tokens=PAGE)
    assert "bits" in kernel.blocker(plan, k3, slot, **ok)
    assert "divisor" in kernel.blocker(plan, layout, slot, **{**ok, "block_size": 24})
    with pytest.raises(ValueError, match="cannot run this layer"):
        kernel.PostRopeLaunch(plan, per_token, slot, torch.zeros(plan.v_width, 128), scale=1.0,
                              sink=0, recent=16, dtype=torch.float32, block_size=PAGE)


def test_batched_prefill_of_post_rope_keys_matches_the_torch_path():
    """The GPU prefill of a step's chunks (one varlen kernel over the latent
    history read as post-RoPE keys and lifted values, then the exact set) gives
    each request what the per-request torch path gives."""
    lens, sink, recent = [90, 60, 40], 16, 16
    q_lens = [20, 60, 5]
    (plan, layout, slot, cache, exact, (table, etable), v_up, _q,
     dtype) = make_case(1, 48, 4, 4, 8, lens, sink, recent, seed=9)
    for b, n in enumerate(lens):  # the exact rows of the chunks' own history are valid
        for t in range(n):
            blk = int(etable[b, t // PAGE])
            if exact[blk, 0, t % PAGE, 0] == 0xFF and exact[blk, 0, t % PAGE].eq(0xFF).all():
                k = torch.randn(1, plan.shape.kv_width)
                exact[blk, 0, t % PAGE] = slot.encode(k, k)[0]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(q_lens), plan.shape.num_heads, plan.shape.head_dim, generator=g)
    qsl = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    spans = tale.prefill_spans(qsl, seq_lens, 0, sink, recent, PAGE, torch.device(DEV))
    out = torch.full((sum(q_lens), plan.shape.num_heads * plan.shape.head_dim), float("nan"),
                     device=DEV)
    k_up = torch.empty(0, plan.shape.kv_width)
    tale.prefill_batched(plan, k_up.to(DEV), v_up.to(DEV), None, SCALE, q.to(DEV), cache.to(DEV),
                         table.to(DEV), exact.to(DEV), etable.to(DEV), spans, out, exact=slot,
                         layout=layout, post_rope=True)
    out = out.cpu()
    for b, n in enumerate(lens):
        start, stop = int(qsl[b]), int(qsl[b + 1])
        want = tale.prefill(plan, k_up, v_up, None, SCALE, q[start:stop], cache, table[b],
                            exact, etable[b], n, sink=sink, recent=recent, exact=slot,
                            layout=layout, post_rope=True)
        err = ((out[start:stop] - want).norm() / want.norm()).item()
        assert err < (1e-4 if DEV == "cpu" else 2e-2), (b, err)
