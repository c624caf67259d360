"""The CUDA post-RoPE-keys decode kernel (``vllm_lowrank/kernels/cuda/post_rope_decode.cu``,
:func:`vllm_lowrank.kernels.cuda.ext.post_rope_decode`) against the torch path
(:func:`vllm_lowrank.attention.token_adaptive.decode`) and the Triton kernel it
replaces (:mod:`vllm_lowrank.kernels.triton.decode_post_rope`), on caches written
by the real :class:`~vllm_lowrank.format.latent.SlotLayout` and
:class:`~vllm_lowrank.format.exact.ExactSlot` encoders. Skipped without a CUDA device.

Exact-cache rows of positions the exact set does not hold are poisoned (0xFF:
NaN scales, as freed blocks may hold), and the output is poisoned before each
call, so a wrong read or an unwritten element shows up.

    source .gpuvllm/env.sh && python3 -P -m pytest -q tests/kernels/test_cuda_post_rope_decode.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from post_rope_case import make_case, reference  # noqa: E402
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402

DEV = "cuda"
D = 128
TOL = 2e-2  # bf16 queries and outputs, f16 codes (the Triton GPU tests' tolerance)


def run_cuda(plan, layout, slot, cache, exact, tables, v_up, q, lens, *, sink, recent, scale,
             splits, out_dtype=torch.float32):
    from vllm_lowrank.kernels.cuda import ext

    lift_t, vsum = ext.post_rope_lift(plan, v_up.to(DEV))
    out = torch.full((len(lens), plan.shape.num_heads * D), float("nan"), device=DEV,
                     dtype=out_dtype)
    ext.post_rope_decode(q.to(DEV), cache.to(DEV), tables[0].to(DEV), exact.to(DEV),
                         tables[1].to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
                         lift_t, vsum, layout=layout, exact_slot=slot, sink=sink, recent=recent,
                         scale=scale, num_splits=splits, out=out)
    return out.float().cpu()


def run_triton(plan, layout, slot, cache, exact, tables, v_up, q, lens, *, sink, recent, scale,
               splits, page):
    from vllm_lowrank.kernels.triton.decode_post_rope import PostRopeLaunch

    launch = PostRopeLaunch(plan, layout, slot, v_up.to(DEV), scale=scale, sink=sink,
                            recent=recent, dtype=q.dtype, block_size=page)
    out = torch.full((len(lens), plan.shape.num_heads * D), float("nan"), device=DEV)
    launch(q.to(DEV), cache.to(DEV), tables[0].to(DEV), exact.to(DEV), tables[1].to(DEV),
           torch.tensor(lens, dtype=torch.int32, device=DEV), splits, out)
    return out.cpu()


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# kct, page (exact cache), latent page, v_bits, qpk, sink, recent, lens, splits
CASES = [
    # the `4x` preset: key groups of 64, 2-bit values, block 64; lengths below
    # sink + recent + 1, at the span's first position (n = sink + recent + 1: empty
    # span), one latent token, one full group, a partial group, and a padding row
    (64, 64, 64, 2, 4, 64, 128, [1, 100, 193, 194, 257, 300, 0, 1000], 1),
    (64, 64, 64, 2, 4, 64, 128, [1, 100, 193, 194, 257, 300, 0, 1000], 3),
    (64, 64, 128, 4, 3, 64, 128, [70, 193, 450, 0, 777], 2),   # latent blocks of 2 x 64
    # latent blocks of 3 x 64, as vLLM gives the `4x` preset at the Llama-3-8B shape
    # (the exact slot padded to 3 latent slots: one page size for both caches)
    (64, 64, 192, 2, 4, 64, 128, [1, 193, 194, 257, 300, 0, 1000, 2500], 3),
    (32, 32, 96, 4, 4, 32, 32, [65, 66, 97, 400, 0], 2),
    (64, 128, 128, 4, 4, 128, 128, [5, 257, 258, 1300], 1),    # block 128
    (32, 64, 64, 2, 3, 64, 64, [1, 129, 130, 161, 500, 2049], 4),
    (32, 32, 64, 4, 4, 32, 32, [65, 66, 97, 400, 0], 2),
    (32, 64, 64, 4, 8, 0, 64, [65, 66, 300], 1),                 # no sinks, 8 query heads
    # value ranks under 128 per KV head (64 at 2 and 4 bits, 96 at 4 bits)
    (64, 64, 192, 2, 4, 64, 128, [1, 193, 257, 300, 0, 1000], 3, 64),
    (32, 32, 64, 4, 4, 32, 32, [65, 66, 97, 400, 0], 2, 64),
    (64, 64, 64, 4, 4, 64, 128, [70, 193, 450, 0, 777], 2, 96),
    (32, 64, 64, 4, 8, 0, 64, [65, 66, 300], 1, 96),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"kct{c[0]}-p{c[1]}-lp{c[2]}-v{c[3]}"
                         f"-q{c[4]}-s{c[5]}-r{c[6]}-x{c[8]}-rv{(c[9:] or (D,))[0]}")
def test_cuda_post_rope_decode_matches_torch_and_triton(case):
    """The CUDA kernel equals the torch path (latent span and exact tokens merged
    by log-sum-exp) and the Triton kernel, over key groups, value code widths and
    ranks, query heads per KV head, block sizes, a latent cache of larger blocks,
    split counts, sequences shorter than the exact window and at its boundaries; a
    padding row (length 0) gets zeros."""
    kct, page, lat_page, v_bits, qpk, sink, recent, lens, splits, *rv = case
    scale = D ** -0.5
    args = make_case(lens, kct=kct, page=page, v_bits=v_bits, qpk=qpk, sink=sink,
                     recent=recent, lat_page=lat_page, rv=rv[0] if rv else D)
    kw = dict(sink=sink, recent=recent, scale=scale)
    got = run_cuda(*args, lens, splits=splits, **kw)
    assert torch.isfinite(got).all()
    want = reference(*args, lens, **kw)
    tri = run_triton(*args, lens, splits=splits, page=page, **kw)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b]))
        else:
            assert rel(got[b], want[b]) < TOL, (b, n, rel(got[b], want[b]))
    assert rel(got, tri) < TOL


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_cuda_post_rope_decode_dtypes(q_dtype, out_dtype):
    """bf16 and fp16 queries, float32 / bf16 / fp16 outputs, one split (written by
    the kernel) and three (merged by the reduce kernel)."""
    lens, sink, recent = [300, 129, 700], 64, 128
    args = make_case(lens, kct=64, page=64, v_bits=2, qpk=4, sink=sink, recent=recent, seed=7,
                     dtype=q_dtype)
    kw = dict(sink=sink, recent=recent, scale=D ** -0.5)
    want = reference(*args, lens, **kw)
    for splits in (1, 3):
        got = run_cuda(*args, lens, splits=splits, out_dtype=out_dtype, **kw)
        assert rel(got, want) < TOL, (splits, rel(got, want))


def test_cuda_splits_agree_and_cover_every_tile():
    """Every split count gives the same output (the tile list, latent groups then
    exact tiles, cut without a gap or an overlap; splits with no tile)."""
    lens, sink, recent = [1500, 77, 200, 2], 64, 128
    args = make_case(lens, kct=64, page=64, v_bits=4, qpk=4, sink=sink, recent=recent, seed=5)
    kw = dict(sink=sink, recent=recent, scale=D ** -0.5)
    outs = [run_cuda(*args, lens, splits=s, **kw) for s in (1, 2, 5, 16, 40)]
    for o in outs[1:]:
        assert rel(o, outs[0]) < 1e-4


def test_llama_shape_and_the_decoder_choice():
    """At the Llama-3-8B shape (32 query / 8 KV heads) with the `4x` preset's
    layout, :func:`~vllm_lowrank.attention.decoders.choose` serves the CUDA
    decoder (it passes the start-up self-check against the torch path), and it
    agrees with the Triton decoder."""
    from decoder_layer import StandInLayer, exact_span
    from vllm_lowrank.attention import decoders

    shape = AttentionShape(32 * D, 32, 8, D)
    plan = LayerPlan(shape, 1, (D,) * 8, (D,) * 8)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 2, k_channel_tokens=64)
    g = torch.Generator().manual_seed(3)
    v_up = torch.zeros(plan.v_width, shape.kv_width)
    for j, off in enumerate(plan.v_offsets()):
        v_up[off:off + D, j * D:(j + 1) * D] = torch.randn(D, D, generator=g) / D ** 0.5
    exact = exact_span(plan, layout, torch.bfloat16, 64, 128, bits=8)
    layer = StandInLayer(plan, v_up=v_up.to(DEV), layout=layout, post_rope=True, exact=exact)
    ctx = decoders.DecoderContext(torch.bfloat16, torch.device(DEV), 64, None, 4096)
    assert decoders.PostRopeKeysCudaDecoder.supports(layer, ctx) is None
    cuda = decoders.PostRopeKeysCudaDecoder(layer, ctx)
    reference_dec = decoders.TorchDecoder(layer, ctx)
    assert decoders.self_check(cuda, reference_dec) < 1e-2
    chosen = decoders.choose(layer, ctx)
    assert type(chosen) is decoders.PostRopeKeysCudaDecoder
    q, cache, batch = decoders.random_batch(layer, ctx, seed=4)
    tri = decoders.PostRopeKeysDecoder(layer, ctx)
    outs = []
    for dec in (cuda, tri):
        out = torch.full((q.shape[0], layer.out_width), float("nan"), device=DEV)
        dec.run(q, cache, batch, dec.plan(batch), out)
        outs.append(out)
    assert rel(outs[0], outs[1]) < TOL
