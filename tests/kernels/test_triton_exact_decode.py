"""The token-adaptive decode kernel (exact part and merge in one launch,
``vllm_lowrank/kernels/triton/decode_exact.py``, after ``token_adaptive.values_up``) against
the torch functions it replaces (``token_adaptive.exact_attention``, ``merge``;
those are checked against a float64 loop in ``tests/unit/test_token_adaptive.py``).

Under the Triton interpreter on CPU tensors without CUDA, compiled on a GPU:

    python -P -m pytest tests/kernels/test_triton_exact_decode.py -q
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_lowrank.attention import token_adaptive as tale  # noqa: E402
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.exact import ExactSlot  # noqa: E402
from vllm_lowrank.kernels.triton import decode_exact  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")
BLOCK = 16


def case(group_size, k_ranks, v_ranks, dtype, bits, lens, sink=16, recent=64, seed=0,
         block=BLOCK):
    """A plan (8 query / 4 KV heads of 32), an exact cache of ``block``-slot
    blocks holding random keys and values at every position of ``len(lens)``
    sequences on shuffled blocks (the rest of the cache NaN), queries,
    latent-part outputs and log-sum-exps (the first sequence's span empty:
    ``-inf``)."""
    BLOCK = block  # noqa: N806
    g = torch.Generator().manual_seed(seed)
    shape = AttentionShape(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32)
    plan = LayerPlan(shape, group_size, k_ranks=k_ranks, v_ranks=v_ranks)
    v_up = torch.zeros(plan.v_width, shape.kv_width)
    gw = plan.group_width
    for i, (off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks)):
        v_up[off:off + r, i * gw:(i + 1) * gw] = torch.randn(r, gw, generator=g) / r ** 0.5
    slot = ExactSlot(shape.kv_width, shape.head_dim, dtype, bits, plan.k_width, 64)
    nb = [-(-n // BLOCK) for n in lens]
    cache = torch.full((sum(nb) + 1, 1, BLOCK, slot.slot_bytes), 0xFF, dtype=torch.uint8)
    perm = torch.randperm(sum(nb), generator=g) + 1
    table = torch.zeros(len(lens), max(nb) + 2, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        table[b, :nb[b]] = perm[used:used + nb[b]].to(torch.int32)
        used += nb[b]
        pos = torch.arange(n)
        slots = table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k = torch.randn(n, shape.kv_width, generator=g)
        v = torch.randn(n, shape.kv_width, generator=g)
        tale.write_exact(cache, slot, k.to(dtype), v.to(dtype), slots,
                         torch.randn(n, plan.k_width, generator=g))
    q = torch.randn(len(lens), shape.num_heads, shape.head_dim, generator=g).to(dtype)
    lat = torch.randn(len(lens), plan.out_width, generator=g)
    lse = torch.randn(len(lens), shape.num_heads, generator=g) * 3
    lse[0] = float("-inf")
    lat[0] = 0.0
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent


def torch_path(plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent, scale):
    ex, ex_lse = tale.exact_attention(q[:, None], cache, slot, table, seq_lens, 1, sink, recent,
                                      scale)
    out = tale.merge(tale.values_up(plan, v_up, lat), lse, ex[:, 0], ex_lse[:, 0])
    return out.reshape(q.shape[0], -1)


SETTINGS = [
    # (group size, key ranks, value ranks): one KV head per group, equal ranks;
    # uneven ranks; two KV heads per group; all four in one group (J-LRD, the
    # presets' grouping; value rank 96: two steps of the up-projection)
    (1, (16, 16, 16, 16), (16, 16, 16, 16)),
    (1, (8, 24, 16, 8), (24, 8, 16, 32)),
    (2, (24, 40), (40, 24)),
    (4, (48,), (96,)),
]


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 16), (torch.float32, 8),
                                        (torch.bfloat16, 16), (torch.bfloat16, 8)])
@pytest.mark.parametrize("setting", SETTINGS, ids=["g1", "g1-uneven", "g2", "g4"])
def test_kernel_matches_the_torch_path(setting, dtype, bits):
    """Sequences shorter than the sinks, of exactly ``S + W + 1`` tokens, and
    longer (exact set = sinks + the last ``W + 1``), the first with an empty
    latent span; 16-bit slots in the query dtype and int8 slots."""
    plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent = case(
        *setting, dtype, bits, lens=[150, 7, 81, 83])
    scale = 0.3
    ref = torch_path(plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent, scale)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEV)
    got = decode_exact.exact_merge_decode(
        plan, scale, q.to(DEV), cache.to(DEV), slot, table.to(DEV),
        seq_lens.to(DEV), sink, recent, tale.values_up(plan, v_up, lat).to(DEV), lse.to(DEV),
        out)
    assert got is out
    # interpreter: float32 dots, a bf16 output rounds (2^-8 relative); GPU: float32 on
    # TF32 tensor cores, bf16 with the keys, values, queries and probabilities in
    # bf16 (as in stock vLLM's attention)
    if dtype == torch.float32:
        tol = 5e-3 if ON_GPU else 1e-5
    else:
        tol = 3e-2 if ON_GPU else 8e-3
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("block", [32, 128])
def test_kernel_tiles_within_and_across_blocks(block):
    """Blocks of 32 slots (one tile per block) and of 128 (several tiles per
    block; the tail starts inside one): sinks, a tail that begins inside the
    sink tile (length 81: tail 16) and later ones, int8 slots."""
    plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent = case(
        *SETTINGS[3], torch.float32, 8, lens=[300, 81, 200, 129], block=block)
    ref = torch_path(plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent, 0.3)
    got = decode_exact.exact_merge_decode(
        plan, 0.3, q.to(DEV), cache.to(DEV), slot, table.to(DEV), seq_lens.to(DEV), sink,
        recent, tale.values_up(plan, v_up, lat).to(DEV), lse.to(DEV))
    tol = 5e-3 if ON_GPU else 1e-5
    torch.testing.assert_close(got.cpu(), ref, rtol=tol, atol=tol)


def test_token_adaptive_decoder_takes_the_kernel(monkeypatch):
    """A token-adaptive decoder (:class:`vllm_lowrank.attention.decoders.TokenAdaptiveDecoder`,
    its latent span stubbed with known outputs and log-sum-exps) runs this
    kernel (the torch exact path is not called) and writes into ``out``; a
    sliding window is outside its scope (those layers take the torch path)."""
    from decoder_layer import StandInLayer
    from vllm_lowrank.attention import decoders

    plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent = case(
        *SETTINGS[1], torch.float32, 16, lens=[100, 40])
    ref = torch_path(plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent, 0.3)

    class KnownSpan(decoders.TritonDecoder):
        """The latent span's ``(out, lse)`` of this case, whatever the cache."""

        def __init__(self, layer, ctx):
            decoders.Decoder.__init__(self, layer, ctx)

        def plan(self, batch):
            return 1

        def span(self, query, kv_cache, batch, plan):
            return lat.to(DEV), lse.to(DEV)

    family = type("TokenAdaptiveKnownSpan", (decoders.TokenAdaptiveDecoder,),
                  {"span_family": KnownSpan})
    layer = StandInLayer(plan, v_up=v_up.to(DEV), scale=0.3,
                         exact=types.SimpleNamespace(sink=sink, recent=recent, slot=slot))
    ctx = decoders.DecoderContext(torch.float32, DEV, BLOCK, None, 1024)
    decoder = family(layer, ctx)
    batch = decoders.DecodeBatch(table.to(DEV), seq_lens.to(DEV), int(seq_lens.max()),
                                 exact_cache=cache.to(DEV), exact_block_table=table.to(DEV))

    def no_torch_path(*args, **kwargs):
        raise AssertionError("the torch exact path ran")

    out = torch.full(ref.shape, float("nan"), device=DEV)
    with monkeypatch.context() as m:
        m.setattr(tale, "exact_attention", no_torch_path)
        decoder.run(q.to(DEV), None, batch, decoder.plan(batch), out)
    torch.testing.assert_close(out.cpu(), ref, rtol=5e-3 if ON_GPU else 1e-5,
                               atol=5e-3 if ON_GPU else 1e-5)
    windowed = dataclasses.replace(ctx, window=64)
    assert "sliding window" in family.supports(layer, windowed)
    assert decode_exact.blocker(plan, slot, q.to(DEV), cache.to(DEV), 64) == "sliding window"


def test_padding_rows_give_zeros_and_leave_the_others_alone():
    """A CUDA graph pads the decode batch with rows of ``seq_len`` 0 (empty
    latent span too): they come out as zeros, not NaN, and the real rows are
    those of a batch without them."""
    plan, v_up, slot, cache, table, seq_lens, q, lat, lse, sink, recent = case(
        *SETTINGS[0], torch.float32, 16, lens=[100, 40, 1])
    seq_lens[2] = 0
    lat[2], lse[2] = 0.0, float("-inf")
    args = (plan, 0.3)
    up = tale.values_up(plan, v_up, lat).to(DEV)
    got = decode_exact.exact_merge_decode(*args, q.to(DEV), cache.to(DEV), slot, table.to(DEV),
                                          seq_lens.to(DEV), sink, recent, up,
                                          lse.to(DEV)).cpu()
    alone = decode_exact.exact_merge_decode(*args, q[:2].to(DEV), cache.to(DEV), slot,
                                            table[:2].to(DEV), seq_lens[:2].to(DEV), sink,
                                            recent, up[:2], lse[:2].to(DEV)).cpu()
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    torch.testing.assert_close(got[:2], alone, rtol=0, atol=0)


def test_blocker_names_what_is_out_of_scope():
    plan, v_up, slot, cache, *_ = case(*SETTINGS[0], torch.float32, 16, lens=[20])
    q = torch.zeros(1, 8, 32, dtype=torch.bfloat16, device=DEV)
    assert "16-bit exact slots" in decode_exact.blocker(plan, slot, q, cache.to(DEV), None)
    assert "block size" in decode_exact.blocker(plan, slot, q.float(), cache[:, :, :8].to(DEV),
                                                None)
    with pytest.raises(ValueError, match="16-bit exact slots"):
        decode_exact.exact_merge_decode(plan, 1.0, q, cache.to(DEV), slot,
                                        torch.zeros(1, 4, dtype=torch.int32, device=DEV),
                                        torch.ones(1, dtype=torch.int32, device=DEV), 16, 32,
                                        torch.zeros(1, 8, 32, device=DEV),
                                        torch.zeros(1, 8, device=DEV))
