"""CUDA-only tests: the CUDA extension (``vllm_lowrank/kernels/cuda``) and the
compiled Triton decode kernels at serving shapes (bf16), against float64 / the
float32 torch path. Skipped without a CUDA device.

    python -m pytest tests/kernels/test_gpu_kernels.py -q -m gpu
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402


def _problem(k_ranks, v_ranks, bits, qgroup, lens, heads=32, kv=8, d=128, page=16, seed=0):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    shape = AttentionShape(heads * d, heads, kv, d)
    plan = LayerPlan(shape, 1, tuple(k_ranks), tuple(v_ranks))
    layout = SlotLayout(k_ranks, v_ranks, bits[0], bits[1], qgroup, qgroup)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    per = [math.ceil(n / page) for n in lens]
    nblk = sum(per) + 3
    perm = torch.randperm(nblk, device=dev, generator=g)
    bt = torch.zeros(len(lens), max(per), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(per):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, device=dev, generator=g)
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    kd, vd = layout.decode(slots)
    return plan, layout, slots.view(nblk, 1, page, -1), kd, vd, bt, lens_t, page, g


def _gather(rows, bt, lens, page):
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=rows.device)
        out.append(rows[bt[b, pos // page].long() * page + pos % page].double())
    return out


def _launch(plan, layout, q, cache, *, scale, mode="pre_rope", k_up=None, rope=None):
    """The layer's :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch` on
    the GPU, default launch parameters, for queries like ``q`` and a cache like
    ``cache``."""
    from vllm_lowrank.kernels.triton.decode import LatentLaunch

    return LatentLaunch(plan, layout, mode=mode, scale=scale, dtype=q.dtype, device=q.device,
                        block_size=cache.shape[2], k_up=k_up, rope=rope,
                        cache_dtype=None if layout is not None else cache.dtype)


def test_missing_extension_message(monkeypatch):
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    monkeypatch.setattr(cuda_ext, "_LOADED", {})
    monkeypatch.setattr(cuda_ext, "MODULES", {"latent_decode": ("does_not_exist.cu",)})
    with pytest.raises(RuntimeError, match="does_not_exist.cu.*not found"):
        cuda_ext.load("latent_decode")


@pytest.mark.parametrize("ratio,quant", [(0.5, None), (0.25, None), (0.5, (8, 4)),
                                         (0.25, (4, 4)), (0.5, (3, 2))])
def test_triton_decode_serving_shape_bf16(ratio, quant):
    """Llama-3-8B attention (32 q / 8 kv heads, d=128, bf16), default launch
    parameters, split-K, against the float32 torch path. Catches compiler-version
    problems that the interpreter tests cannot (triton 3.6 miscompiled the
    BLOCK_N=64 / 4-warp bf16 variant)."""
    from vllm_lowrank.attention.latent_attention import decode_attention
    from vllm_lowrank.attention.rope import RopeTable

    r = int(ratio * 128)
    lens = [4000, 1, 777, 2500]
    plan, layout, cache_q, kd, vd, bt, lens_t, page, g = _problem(
        (r,) * 8, (r,) * 8, quant or (8, 8), None, lens, seed=5)
    k_up = torch.zeros(plan.k_width, 1024, device="cuda")
    for gi, off in enumerate(plan.k_offsets()):
        k_up[off:off + r, gi * 128:(gi + 1) * 128] = torch.randn(
            r, 128, device="cuda", generator=g) / math.sqrt(r)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    ang = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    rope = RopeTable(ang.cos(), ang.sin(), 128, True)
    q = torch.randn(4, 32, 128, device="cuda", generator=g).bfloat16()
    if quant is None:
        cache = torch.cat([kd, vd], -1).bfloat16().view(cache_q.shape[0], 1, page, -1)
        ref_cache, layout = cache, None
    else:
        cache = cache_q
        ref_cache = torch.cat([kd, vd], -1).view(cache_q.shape[0], 1, page, -1)
    out = torch.full((4, plan.out_width), float("nan"), device="cuda")
    _launch(plan, layout, q, cache, scale=128 ** -0.5, k_up=k_up, rope=rope)(
        q, cache, bt, lens_t, max(lens), out=out)
    ref = decode_attention(plan, k_up, rope, 128 ** -0.5, q.float(), ref_cache.float(), bt,
                           lens_t, max(lens))
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()) < 1e-2


def _llama_problem(ranks_k, ranks_v, lens, seed):
    from vllm_lowrank.attention.rope import RopeTable

    plan, layout, cache_q, kd, vd, bt, lens_t, page, g = _problem(
        ranks_k, ranks_v, (8, 8), None, lens, seed=seed)
    k_up = torch.zeros(plan.k_width, 1024, device="cuda")
    for gi, off in enumerate(plan.k_offsets()):
        r = ranks_k[gi]
        k_up[off:off + r, gi * 128:(gi + 1) * 128] = torch.randn(
            r, 128, device="cuda", generator=g) / math.sqrt(r)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    ang = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    rope = RopeTable(ang.cos(), ang.sin(), 128, True)
    cache = torch.cat([kd, vd], -1).bfloat16().view(cache_q.shape[0], 1, page, -1)
    return plan, k_up, rope, cache, bt, lens_t, g


def test_triton_decode_uneven_ranks_bf16():
    """High-spread ranks (rank classes 16..128 in one launch), default launch
    parameters, three splits."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    ranks = (16, 16, 32, 32, 64, 64, 128, 128)
    lens = [3000, 17, 1200, 4096]
    plan, k_up, rope, cache, bt, lens_t, g = _llama_problem(ranks, ranks[::-1], lens, 7)
    q = torch.randn(4, 32, 128, device="cuda", generator=g).bfloat16()
    out = torch.full((4, plan.out_width), float("nan"), device="cuda")
    _launch(plan, None, q, cache, scale=128 ** -0.5, k_up=k_up, rope=rope)(
        q, cache, bt, lens_t, max(lens), out=out, num_splits=3)
    ref = decode_attention(plan, k_up, rope, 128 ** -0.5, q.float(), cache.float(), bt,
                           lens_t, max(lens))
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_triton_post_rope_serving_shape_bf16(ratio):
    r = int(ratio * 128)
    lens = [4000, 1, 777, 2500]
    plan, k_up, rope, cache, bt, lens_t, g = _llama_problem((r,) * 8, (r,) * 8, lens, 9)
    q = torch.randn(4, 32, r, device="cuda", generator=g).bfloat16()
    out = torch.full((4, plan.out_width), float("nan"), device="cuda")
    _launch(plan, None, q, cache, scale=0.1, mode="post_rope")(
        q, cache, bt, lens_t, max(lens), out=out)
    hg, page = plan.heads_per_group, cache.shape[2]
    ref = torch.zeros_like(out, dtype=torch.float64)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        lat = cache.view(-1, cache.shape[-1])[bt[b, pos // page].long() * page + pos % page]
        lat = lat.double()
        for gi, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
            s = 0.1 * q[b, gi * hg:(gi + 1) * hg].double() @ lat[:, ko:ko + r].T
            o = torch.softmax(s, -1) @ lat[:, plan.k_width + vo:plan.k_width + vo + r]
            ref[b, hg * vo:hg * (vo + r)] = o.flatten()
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("ratio,bits,qgroup", [(1.0, (8, 4), None), (1.0, (4, 4), None),
                                               (0.5, (8, 4), None), (0.25, (8, 4), None),
                                               (0.5, (4, 2), None), (0.25, (3, 3), 8),
                                               (0.5, (2, 4), 16)])
def test_triton_post_rope_packed_serving_shape_bf16(ratio, bits, qgroup):
    """Post-RoPE mode on packed caches (bf16 queries, default launch parameters):
    8/4-bit per-token sides on the packed kernel (ratio 1.0 K8/V4: the ``2x``
    preset), grouped scales and 3/2-bit codes on the grid kernel; against float64
    on the decoded latents."""
    r = int(ratio * 128)
    lens = [4000, 1, 777, 2500]
    plan, layout, cache, kd, vd, bt, lens_t, page, g = _problem(
        (r,) * 8, (r,) * 8, bits, qgroup, lens, seed=11)
    q = torch.randn(4, 32, r, device="cuda", generator=g).bfloat16()
    out = torch.full((4, plan.out_width), float("nan"), device="cuda")
    launch = _launch(plan, layout, q, cache, scale=0.1, mode="post_rope")
    assert launch.kernel == ("packed" if qgroup is None and bits in ((8, 4), (4, 4))
                             else "grid")
    launch(q, cache, bt, lens_t, max(lens), out=out)
    hg = plan.heads_per_group
    kl, vl = _gather(kd, bt, lens_t, page), _gather(vd, bt, lens_t, page)
    ref = torch.zeros_like(out, dtype=torch.float64)
    for b in range(len(lens)):
        for gi, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
            s = 0.1 * q[b, gi * hg:(gi + 1) * hg].double() @ kl[b][:, ko:ko + r].T
            o = torch.softmax(s, -1) @ vl[b][:, vo:vo + r]
            ref[b, hg * vo:hg * (vo + r)] = o.flatten()
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


# ----------------------------------------------------------------------------------
# CUDA pre-RoPE decode kernel (vllm_lowrank/kernels/cuda/latent_decode.cu) against float64
# ----------------------------------------------------------------------------------
def _rope_table(neox, mscale=1.0, max_pos=8192):
    from vllm_lowrank.attention.rope import RopeTable

    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").double() / 128))
    ang = torch.outer(torch.arange(max_pos, device="cuda").double(), inv)
    return RopeTable((mscale * ang.cos()).float().contiguous(),
                     (mscale * ang.sin()).float().contiguous(), 128, neox)


def _cuda_problem(r_k, r_v, lens, page, dtype, seed):
    """Random latents in a paged cache with shuffled (non-contiguous) blocks and
    spare blocks, block-diagonal k_up, queries; all on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = AttentionShape(32 * 128, 32, 8, 128)
    plan = LayerPlan(shape, 1, (r_k,) * 8, (r_v,) * 8)
    per = [math.ceil(n / page) for n in lens]
    nblk = sum(per) + 5
    perm = torch.randperm(nblk, device="cuda", generator=g)
    bt = torch.full((len(lens), max(per) + 2), 10 ** 6, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(per):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    cache = torch.randn(nblk, 1, page, plan.k_width + plan.v_width, device="cuda",
                        generator=g).to(dtype)
    k_up = torch.zeros(plan.k_width, 8 * 128, device="cuda")
    for gi, off in enumerate(plan.k_offsets()):
        k_up[off:off + r_k, gi * 128:(gi + 1) * 128] = torch.randn(
            r_k, 128, device="cuda", generator=g) / math.sqrt(r_k)
    q = torch.randn(len(lens), 32, 128, device="cuda", generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return plan, k_up, cache, bt, lens_t, q


def _reference_f64(plan, k_up, rope, scale, q, cache, bt, lens):
    """float64 pre-RoPE decode: rebuild, RoPE at absolute positions, softmax,
    value latents. Returns (out [B, out_width], lse [B, H])."""
    page, d, hg = cache.shape[2], 128, plan.heads_per_group
    rows = cache.reshape(-1, cache.shape[-1]).double()
    out = torch.zeros(q.shape[0], plan.out_width, dtype=torch.float64, device="cuda")
    lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float64, device="cuda")
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device="cuda")
        lat = rows[bt[b, pos // page].long() * page + pos % page]
        c, s = rope.full_tables(d, pos)
        for gi, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
            rk, rv = plan.k_ranks[gi], plan.v_ranks[gi]
            k = lat[:, ko:ko + rk] @ k_up[ko:ko + rk, gi * d:(gi + 1) * d].double()
            k = k * c.double() + rope.rotate_half(k) * s.double()
            sc = scale * q[b, gi * hg:(gi + 1) * hg].double() @ k.T
            lse_g = torch.logsumexp(sc, -1)
            o = torch.exp(sc - lse_g[:, None]) @ lat[:, plan.k_width + vo:plan.k_width + vo + rv]
            out[b, hg * vo:hg * (vo + rv)] = o.flatten()
            lse[b, gi * hg:(gi + 1) * hg] = lse_g
    return out, lse


CUDA_DECODE_CASES = [
    # r_k, r_v, page, neox, splits, dtype, mscale
    (64, 64, 16, True, 1, torch.bfloat16, 1.0),     # ratio 0.5
    (32, 32, 16, True, 3, torch.bfloat16, 1.0),     # ratio 0.25, split-K
    (48, 96, 32, False, 1, torch.bfloat16, 1.0),    # uneven K/V ranks, gptj, block 32
    (128, 16, 32, True, 4, torch.bfloat16, 1.2),    # rank 128 (4-warp CTA), YaRN-like mscale
    (16, 128, 16, False, 2, torch.float16, 1.0),    # fp16 cache, gptj
    (64, 32, 16, True, None, torch.float16, 1.0),   # heuristic split count
    (96, 32, 16, True, 2, torch.bfloat16, 1.0),    # padded key rows, swizzled value rows
]


def _cuda_layer(plan, k_up, rope, dtype, page, **kw):
    """A stand-in layer (``tests/decoder_layer.py``) of these factors and its
    :class:`~vllm_lowrank.attention.decoders.DecoderContext` on the GPU
    (``kw``: the context's ``window``, ``max_model_len``)."""
    from decoder_layer import StandInLayer
    from vllm_lowrank.attention.decoders import DecoderContext

    layer = StandInLayer(plan, k_up=k_up, rope=rope, scale=kw.pop("scale", 128 ** -0.5))
    ctx = DecoderContext(dtype, torch.device("cuda"), page, kw.get("window"),
                         kw.get("max_model_len", 8192))
    return layer, ctx


@pytest.mark.parametrize("r_k,r_v,page,neox,splits,dtype,mscale", CUDA_DECODE_CASES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_cuda_pre_rope_decode_matches_float64(r_k, r_v, page, neox, splits, dtype, mscale,
                                              return_lse):
    """vllm_lowrank/kernels/cuda/latent_decode.cu with the key weights a
    :class:`~vllm_lowrank.attention.decoders.CudaDecoder` prepares (and its
    split where ``splits`` is None): random latents, ragged lengths (tail
    tiles, a one-token sequence, a split longer than a sequence), shuffled
    block tables, NaN-poisoned output."""
    from vllm_lowrank.attention import decoders
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    lens = [1, 17, 300, 1029, 4000, 33]
    plan, k_up, cache, bt, lens_t, q = _cuda_problem(r_k, r_v, lens, page, dtype,
                                                     seed=r_k + r_v + page)
    rope = _rope_table(neox, mscale)
    scale = 128 ** -0.5
    layer, ctx = _cuda_layer(plan, k_up, rope, dtype, page, scale=scale)
    assert decoders.CudaDecoder.supports(layer, ctx) is None
    decoder = decoders.CudaDecoder(layer, ctx)
    batch = decoders.DecodeBatch(bt, lens_t, max(lens), min(lens))
    out = torch.full((len(lens), plan.out_width), float("nan"), device="cuda")
    res = cuda_ext.latent_decode_pre_rope(q, cache, bt, lens_t, decoder.weights, decoder.rope,
                                          scale, num_splits=splits or decoder.plan(batch),
                                          out=out, return_lse=return_lse)
    torch.cuda.synchronize()
    ref, ref_lse = _reference_f64(plan, k_up, rope, scale, q, cache, bt, lens_t)
    assert torch.isfinite(out).all()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel
    for b in range(len(lens)):  # per sequence: a short one must not hide in the norm
        rb = ((out[b].double() - ref[b]).norm() / ref[b].norm()).item()
        assert rb < 1e-2, (b, rb)
    if return_lse:
        assert res[0] is out
        assert (res[1].double() - ref_lse).abs().max().item() < 2e-2
    else:
        assert res is out
        # the decoder's own run: the same output
        got = torch.full_like(out, float("nan"))
        decoder.run(q, cache, batch, decoder.plan(batch), got)
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_cuda_pre_rope_decode_is_the_default_decoder(monkeypatch):
    """Start-up chooses the CUDA decoder in its scope, and it runs the CUDA
    kernel with the result of the Triton grid decoder; a layer outside its scope
    (uneven ranks across groups) is refused with the reason."""
    from vllm_lowrank.attention import decoders
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    lens = [700, 2100]
    plan, k_up, cache, bt, lens_t, q = _cuda_problem(64, 64, lens, 16, torch.bfloat16, 4)
    rope = _rope_table(True)
    layer, ctx = _cuda_layer(plan, k_up, rope, torch.bfloat16, 16, scale=0.1)
    chosen = decoders.choose(layer, ctx)
    assert type(chosen) is decoders.CudaDecoder
    calls = []
    real = cuda_ext.latent_decode_pre_rope

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cuda_ext, "latent_decode_pre_rope", spy)
    batch = decoders.DecodeBatch(bt, lens_t, max(lens), min(lens))
    a = torch.empty(len(lens), plan.out_width, device="cuda")
    chosen.run(q, cache, batch, chosen.plan(batch), a)
    assert calls == [1]
    grid = decoders.GridDecoder(layer, ctx)
    b = torch.empty_like(a)
    grid.run(q, cache, batch, grid.plan(batch), b)
    assert calls == [1]
    assert ((a - b).norm() / b.norm()) < 1e-2
    uneven = dataclasses.replace(plan, k_ranks=(64,) * 7 + (32,))
    layer_u, _ = _cuda_layer(uneven, k_up[:uneven.k_width], rope, torch.bfloat16, 16)
    assert decoders.CudaDecoder.supports(layer_u, ctx) == "uneven ranks"


def test_cuda_pre_rope_decode_refuses_out_of_scope():
    """The CUDA decoder's scope names what it cannot decode; a cache block stride
    over its 32-bit in-block offsets is refused by the extension."""
    from decoder_layer import StandInLayer
    from vllm_lowrank.attention import decoders
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    lens = [100]
    plan, k_up, cache, bt, lens_t, q = _cuda_problem(64, 64, lens, 16, torch.bfloat16, 5)
    rope = _rope_table(True)
    layer, ctx = _cuda_layer(plan, k_up, rope, torch.bfloat16, 16)
    assert decoders.CudaDecoder.supports(layer, ctx) is None
    post = StandInLayer(plan, post_rope=True)
    assert "post_rope" in decoders.CudaDecoder.supports(post, ctx)
    windowed = dataclasses.replace(ctx, window=10)
    assert decoders.CudaDecoder.supports(layer, windowed) == "sliding window"
    assert "dtype" in decoders.CudaDecoder.supports(layer, dataclasses.replace(
        ctx, dtype=torch.float32))
    assert "block_size" in decoders.CudaDecoder.supports(layer, dataclasses.replace(
        ctx, block_size=8))
    decoder = decoders.CudaDecoder(layer, ctx)
    one = cache[:1].contiguous()
    huge = one.as_strided(one.shape, (2 ** 31,) + one.stride()[1:])
    with pytest.raises(RuntimeError, match="block stride"):
        cuda_ext.latent_decode_pre_rope(q, huge, torch.zeros_like(bt), lens_t, decoder.weights,
                                        decoder.rope, 0.1)


def wide_case(dev, group_size, ratio, quant, lens, seed=7, kct=None):
    """Relative error of the decode kernel (default launch: the wide-group
    kernel from 4 KV heads per group) against the float32 torch path: Llama-3-8B
    attention (32 q / 8 KV heads of 128), head groups of ``group_size`` KV heads
    at rank ``ratio * group_size * 128`` per side, bf16 queries, a bf16
    (``quant`` None) or packed cache (``kct``: keys per channel over groups of
    ``kct`` tokens, every group complete, 32-token blocks)."""
    from vllm_lowrank.attention.latent_attention import decode_attention
    from vllm_lowrank.attention.rope import RopeTable
    from vllm_lowrank.kernels.triton.launch import needs_wide

    g = torch.Generator(device=dev).manual_seed(seed)
    ng, r = 8 // group_size, int(ratio * group_size * 128)
    plan = LayerPlan(AttentionShape(4096, 32, 8, 128), group_size, (r,) * ng, (r,) * ng)
    gw = plan.group_width
    k_up = torch.zeros(plan.k_width, 1024, device=dev)
    for gi, off in enumerate(plan.k_offsets()):
        k_up[off:off + r, gi * gw:(gi + 1) * gw] = torch.randn(
            r, gw, device=dev, generator=g) / math.sqrt(r)
    page = 32 if kct else 16
    per = [math.ceil(n / page) for n in lens]
    nblk = sum(per) + 3
    perm = torch.randperm(nblk, device=dev, generator=g)
    bt = torch.zeros(len(lens), max(per), dtype=torch.int32, device=dev)
    for b, n in enumerate(per):
        bt[b, :n] = perm[sum(per[:b]):sum(per[:b]) + n].int()
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, device=dev, generator=g)
    if quant is None:
        cache = lat.bfloat16()
        layout, ref_rows = None, cache.float()
    else:
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, *quant, k_channel_tokens=kct)
        cache = layout.encode_complete(lat[:, :plan.k_width], lat[:, plan.k_width:])
        ref_rows = torch.cat(layout.decode(cache), -1)
    cache = cache.view(nblk, 1, page, -1)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
    ang = torch.outer(torch.arange(max(lens) + 1, device=dev).float(), inv)
    rope = RopeTable(ang.cos(), ang.sin(), 128, True)
    q = torch.randn(len(lens), 32, 128, device=dev, generator=g).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((len(lens), plan.out_width), float("nan"), device=dev)
    launch = _launch(plan, layout, q, cache, scale=128 ** -0.5, k_up=k_up, rope=rope)
    launch(q, cache, bt, lens_t, max(lens), out=out)
    ref = decode_attention(plan, k_up, rope, 128 ** -0.5, q.float(),
                           ref_rows.view(nblk, 1, page, -1), bt, lens_t, max(lens))
    assert torch.isfinite(out).all()
    assert needs_wide(plan, layout, 128) == (group_size >= 4)
    assert (launch.kernel == "wide") == (group_size >= 4)
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("group_size,ratio,quant", [
    (8, 0.5, None),      # the default J-LRD on Llama-3-8B: rank 512, wide kernel
    (4, 0.5, None),      # rank 256: wide
    (8, 0.5, (8, 4)),    # packed J-LRD
    (8, 0.25, (4, 4)),
])
def test_wide_decode_serving_shape_bf16(group_size, ratio, quant):
    """The wide-group kernel at serving shapes, default launch parameters,
    split-K (a 4,000-token sequence beside short ones)."""
    assert wide_case("cuda", group_size, ratio, quant, [4000, 1, 777, 2500]) < 1e-2


@pytest.mark.parametrize("group_size,ratio", [
    (1, 0.75),  # per-head groups at ratio 0.75: the grid kernel
    (1, 0.5),
    (8, 0.5),   # the 4x preset's J-LRD: the wide kernel
])
def test_channel_keys_serving_shape_bf16(group_size, ratio):
    """Per-channel 4-bit keys (32-token groups) and 4-bit values at serving
    shapes, default launch parameters, split-K."""
    assert wide_case("cuda", group_size, ratio, (4, 4), [4000, 1, 777, 2500], kct=32) < 1e-2


def _compiled_variants(fn) -> int:
    """Compiled specializations of a Triton kernel over all devices
    (``JITFunction.device_caches``: ``(kernel_cache, ...)`` per device)."""
    return sum(len(caches[0]) for caches in fn.device_caches.values())


def test_wide_kernel_compiles_once_for_layers_of_different_ranks():
    """Layers that differ only in their ranks (a byte-budget allocation: the
    ``8x`` preset) reuse one compiled wide kernel: the per-layer offsets and
    per-channel parameter bytes are runtime arguments, not specializations
    (``decode_wide.PER_LAYER_ARGS``). Ranks 512 and 384 at 4 bits with
    per-channel keys share the value tile (``RV_PAD`` 512), the slot strides'
    divisibility and alignment; they differ in the parameter bytes per slot
    (64 and 48), which compiled a second variant before."""
    from vllm_lowrank.kernels.triton.decode_wide import wide_decode_kernel

    lens = [4000, 1, 777, 2500]
    assert wide_case("cuda", 8, 0.5, (4, 4), lens, kct=32) < 1e-2
    before = _compiled_variants(wide_decode_kernel)
    assert wide_case("cuda", 8, 384 / 1024, (4, 4), lens, kct=32) < 1e-2
    assert _compiled_variants(wide_decode_kernel) == before
