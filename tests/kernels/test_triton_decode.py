"""Fused latent decode kernel against a float64 reference.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set by
``conftest.py``) on CPU tensors: small shapes, every code path (pre-RoPE rebuild with
neox / gptj / partial rotary / YaRN-scaled / non-rotation tables, post-RoPE mode,
packed 8/4/3/2-bit caches with per-row and grouped scales, aligned and unaligned
slots, uneven ranks in several rank classes, G > 1 head groups, split-K with the
reduce, key bias / QK-norm and sliding windows over NaN null blocks), each
prepared once as a :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch`, and
the start-up choice of a layer's decoder (:mod:`vllm_lowrank.attention.decoders`)
on a stand-in layer (``tests/decoder_layer.py``). On a CUDA machine the same
tests run the compiled kernels on the GPU.

    python -P -m pytest tests/kernels/test_triton_decode.py -q
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"

triton = pytest.importorskip("triton")

from vllm_lowrank.attention.rope import RopeTable  # noqa: E402
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402

import vllm_lowrank.kernels.triton.decode as dec  # noqa: E402
import vllm_lowrank.kernels.triton.launch as launch_params  # noqa: E402
from vllm_lowrank.kernels.triton.decode_prep import rank_classes  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
# float32 caches: exact float32 under the interpreter; tf32 tensor-core dots on GPUs.
TOL32 = 5e-3 if ON_GPU else 1e-5


# ---------------------------------------------------------------------------------
# Problem construction and float64 reference
# ---------------------------------------------------------------------------------
def make_rope(rot, max_pos=512, theta=10000.0, neox=True, mscale=1.0, kind="rotation"):
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    t = torch.arange(max_pos, dtype=torch.float64)
    ang = torch.outer(t, inv)
    if kind == "scrambled":  # not a rotation in t: forces the exact per-token path
        ang = ang + 0.3 * torch.sin(t)[:, None] ** 2
    cos = (ang.cos() * mscale).float()
    sin = (ang.sin() * mscale).float()
    return RopeTable(cos.to(DEV), sin.to(DEV), rot, neox)


def make_plan(g, *, heads, kv_heads, head_dim, group_size, k_ranks, v_ranks):
    """A plan and its block-diagonal random key up-projection (CPU, drawn from
    generator ``g``)."""
    shape = AttentionShape(heads * head_dim, heads, kv_heads, head_dim)
    plan = LayerPlan(shape, group_size, tuple(k_ranks), tuple(v_ranks))
    gw = plan.group_width
    k_up = torch.zeros(plan.k_width, kv_heads * head_dim)
    for gi, off in enumerate(plan.k_offsets()):
        r = plan.k_ranks[gi]
        k_up[off:off + r, gi * gw:(gi + 1) * gw] = torch.randn(r, gw, generator=g) / math.sqrt(r)
    return plan, k_up


def make_problem(*, heads=8, kv_heads=4, head_dim=32, group_size=1, k_ranks, v_ranks,
                 lens=(37, 70, 5), page=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    plan, k_up = make_plan(g, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           group_size=group_size, k_ranks=k_ranks, v_ranks=v_ranks)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    nblk_per = [math.ceil(n / page) for n in lens]
    max_blocks = max(nblk_per) + 1
    num_blocks = sum(nblk_per) + 7
    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous, shuffled blocks
    bt = torch.full((len(lens), max_blocks), 10**6, dtype=torch.int32)  # poison unused
    used = 0
    for b, n in enumerate(nblk_per):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    return plan, k_up, lens_t, bt, num_blocks, page, g


def gather(cache_rows, bt, lens, page):
    """Per sequence: [L, C] rows of a [num_blocks * page, C] tensor."""
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blk = bt[b, pos // page].long()
        out.append(cache_rows[blk * page + pos % page])
    return out


def rope64(x, pos, rope):
    """RoPE in float64 with the table's values. x: [L, G, d]."""
    cos = rope.cos.double().cpu()[pos][:, None]
    sin = rope.sin.double().cpu()[pos][:, None]
    rot = rope.rotary_dim
    r, rest = x[..., :rot], x[..., rot:]
    if rope.neox:
        x1, x2 = r.chunk(2, -1)
        o = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        o = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((o, rest), -1)


def ref_scores(plan, k_up, rope, qg, ck, gi, pos, mode="pre_rope", transform=None):
    """float64 unscaled scores ``[hg, L]`` of head group ``gi``'s query heads
    ``qg [hg, width]`` against its key latents ``ck [L, r_k]`` at positions ``pos``
    ``[L]`` (pre-RoPE: rebuild with ``k_up`` (float64, CPU), ``transform`` (a
    KeyTransform: bias, then per-head RMSNorm), RoPE; post-RoPE: ``q~ . c_k``)."""
    hg, gs, d = plan.heads_per_group, plan.group_size, plan.shape.head_dim
    gw = plan.group_width
    ko, rk = plan.k_offsets()[gi], plan.k_ranks[gi]
    if mode != "pre_rope":
        return qg[:, :rk] @ ck.T
    keys = (ck @ k_up[ko:ko + rk, gi * gw:(gi + 1) * gw]).view(len(pos), gs, d)
    if transform is not None and transform.bias is not None:
        keys = keys + transform.bias.double().cpu()[gi * gw:(gi + 1) * gw].view(gs, d)
    if transform is not None and transform.norm_weight is not None:
        ms = keys.pow(2).mean(-1, keepdim=True)
        keys = keys / torch.sqrt(ms + transform.norm_eps) * transform.norm_weight.double().cpu()
    keys = rope64(keys, pos, rope)  # [L, G, d]
    kv_of_head = torch.arange(hg) // plan.shape.queries_per_kv
    return torch.einsum("hd,lhd->hl", qg, keys[:, kv_of_head])


def reference(plan, k_up, rope, scale, q, k_lat, v_lat, lens, mode="pre_rope",
              transform=None, window=None):
    """float64 decode attention. k_lat/v_lat: per-sequence [L, Rk] / [L, Rv].
    ``transform`` (a KeyTransform): bias, then per-head RMSNorm, before RoPE;
    ``window``: sequence b sees positions >= lens[b] - window only (earlier
    latents may be NaN: they are dropped before any arithmetic)."""
    q = q.double().cpu()
    k_up = k_up.double().cpu()
    hg = plan.heads_per_group
    out = torch.zeros(q.shape[0], plan.out_width, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        kl, vl = k_lat[b].double().cpu(), v_lat[b].double().cpu()
        lo = max(0, n - window) if window is not None else 0
        kl, vl = kl[lo:n], vl[lo:n]
        for gi, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
            rk, rv = plan.k_ranks[gi], plan.v_ranks[gi]
            ck, cv = kl[:, ko:ko + rk], vl[:, vo:vo + rv]
            qg = q[b, gi * hg:(gi + 1) * hg]
            s = ref_scores(plan, k_up, rope, qg, ck, gi, torch.arange(lo, n), mode, transform)
            p = torch.softmax(s * scale, -1)
            o = p @ cv  # [hg, rv]
            out[b, hg * vo:hg * (vo + rv)] = o.flatten()
    return out


def float_cache(plan, num_blocks, page, g, dtype):
    rows = torch.randn(num_blocks * page, plan.k_width + plan.v_width, generator=g).to(dtype)
    return rows


def prepare(plan, k_up, rope, q, cache, *, layout=None, mode="pre_rope", config=None,
            transform=None, window=None, sink=0, recent=0):
    """The :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch` of a layer
    with these factors and launch arguments, for queries like ``q`` and a cache
    like ``cache`` (its block size and, unquantized, its element dtype); softmax
    scale ``head_dim ** -0.5`` in ``pre_rope`` mode, else 0.2."""
    return dec.LatentLaunch(
        plan, layout, mode=mode, scale=q.shape[-1] ** -0.5 if mode == "pre_rope" else 0.2,
        dtype=q.dtype, device=DEV, block_size=cache.shape[2],
        k_up=None if k_up is None else k_up.to(DEV), rope=rope,
        cache_dtype=None if layout is not None else cache.dtype, transform=transform,
        window=window, sink=sink, recent=recent, config=config)


def run(plan, k_up, rope, q, cache, bt, lens, *, num_splits=None, return_lse=False, **kw):
    """The kernel prepared by :func:`prepare` (``kw``: its launch arguments),
    launched on DEV with a NaN-poisoned output buffer; float64 CPU result (with
    ``return_lse=True``: ``(out, lse)``)."""
    launch = prepare(plan, k_up, rope, q, cache, **kw)
    out = torch.full((q.shape[0], plan.out_width), float("nan"), device=DEV)  # poisoned
    res = launch(q.to(DEV), cache.to(DEV), bt.to(DEV), lens.to(DEV), int(lens.max()),
                 num_splits=num_splits, return_lse=return_lse, out=out)
    lse = None
    if return_lse:
        res, lse = res
        assert lse.shape == (q.shape[0], plan.shape.num_heads) and lse.dtype == torch.float32
        assert not torch.isnan(lse).any() and (lse < float("inf")).all()
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(res).all(), "output not fully written"
    return res.double().cpu() if lse is None else (res.double().cpu(), lse.double().cpu())


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------
# Pre-RoPE (key rebuild) mode
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("neox,rot,group_size,splits", [
    (True, 32, 1, 1),     # full rotary, per-KV-head groups, no reduce
    (True, 32, 1, 3),     # split-K + reduce
    (False, 32, 2, 2),    # gptj pairs, 2 KV heads per group
    (True, 16, 2, 4),     # partial rotary (rest section), more splits than tiles
    (False, 16, 1, 1),    # gptj partial rotary
])
def test_pre_rope_float32(neox, rot, group_size, splits):
    kr = (8, 24, 16, 32) if group_size == 1 else (40, 16)
    vr = (16, 8, 32, 24) if group_size == 1 else (24, 64)
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=group_size,
                                                       k_ranks=kr, v_ranks=vr)
    rope = make_rope(rot, neox=neox)
    rows = float_cache(plan, nblk, page, g, torch.float32)
    q = torch.randn(len(lens), 8, 32, generator=g)
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=splits)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens)
    assert rel_err(out, ref) < TOL32
    assert (out - ref).abs().max() < (5e-2 if ON_GPU else 1e-4)


@pytest.mark.parametrize("kind,mscale", [("rotation", 1.3), ("scrambled", 1.0)])
def test_rope_tables(kind, mscale):
    """YaRN-style magnitude (fast path divides it out) and a table that is not a
    rotation in the position (exact per-token path)."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(16,) * 4,
                                                       lens=(50, 33), seed=3)
    rope = make_rope(32, mscale=mscale, kind=kind)
    assert dec.rope_is_rotation(rope) == (kind == "rotation")
    rows = float_cache(plan, nblk, page, g, torch.float32)
    q = torch.randn(2, 8, 32, generator=g)
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=2)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens)
    assert rel_err(out, ref) < TOL32


def test_pre_rope_bf16_matches_cpu_path():
    """bf16 cache and queries (the serving dtype): within bf16 rounding of the
    float64 reference, and agrees with the torch CPU path of the backend."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(8, 24, 16, 32),
                                                       v_ranks=(16, 8, 32, 24),
                                                       lens=(100, 17, 64), seed=5)
    rope = make_rope(32)
    rows = float_cache(plan, nblk, page, g, torch.bfloat16)
    q = torch.randn(3, 8, 32, generator=g).bfloat16()
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=2)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens)
    assert rel_err(out, ref) < 1e-2
    cpu = decode_attention(plan, k_up, RopeTable(rope.cos.cpu(), rope.sin.cpu(), 32, True),
                           32 ** -0.5, q.float(), rows.view(nblk, 1, page, -1).cpu(),
                           bt.clamp(max=nblk - 1), lens, int(lens.max()))
    assert rel_err(out, cpu.double()) < 1e-2


# ---------------------------------------------------------------------------------
# Post-RoPE mode
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [1, 3])
def test_post_rope_float32(splits):
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(8, 24, 16, 32),
                                                       v_ranks=(32, 8, 16, 24), seed=7)
    rows = float_cache(plan, nblk, page, g, torch.float32)
    q = torch.randn(3, 8, 40, generator=g)  # wider than max r_k: extra columns ignored
    out = run(plan, k_up, None, q, rows.view(nblk, 1, page, -1), bt, lens,
              num_splits=splits, mode="post_rope")
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    ref = reference(plan, k_up, None, 0.2, q, kl, vl, lens, mode="post_rope")
    assert rel_err(out, ref) < TOL32


# ---------------------------------------------------------------------------------
# Packed low-bit caches
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k_bits,v_bits,qgroup,mode,k_ranks,trans", [
    (8, 4, None, "pre_rope", (8, 24, 16, 32), True),
    (8, 4, None, "pre_rope", (8, 24, 16, 32), False),
    (4, 4, None, "pre_rope", (16, 16, 32, 32), True),
    (3, 2, None, "pre_rope", (8, 24, 16, 32), True),
    (2, 3, 8, "pre_rope", (8, 24, 16, 32), True),
    (2, 4, 8, "pre_rope", (8, 24, 16, 32), False),
    (8, 4, None, "post_rope", (8, 24, 16, 32), True),
    (8, 4, None, "post_rope", (8, 24, 16, 32), False),
    (2, 2, None, "post_rope", (16, 24, 16, 32), False),
    (4, 8, 8, "post_rope", (8, 24, 16, 32), True),
    (3, 4, None, "post_rope", (8, 16, 8, 24), True),  # odd code bytes: unaligned fp16 params
    (3, 3, 8, "post_rope", (8, 16, 8, 24), False),
])
def test_quantized(k_bits, v_bits, qgroup, mode, k_ranks, trans):
    """Every code width, per-row and grouped scales: codes unpacked in registers,
    per-row scales applied after the dots or (grouped, or pre-RoPE keys) to the
    dequantized tile. ``trans`` False forces the ``S = q' K'^T`` layout; True
    takes the device's default launch parameters (``S^T`` under the interpreter)."""
    vr = (16, 8, 32, 24)
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=k_ranks, v_ranks=vr, seed=11)
    layout = SlotLayout(k_ranks, vr, k_bits, v_bits, qgroup, qgroup)
    if k_ranks == (8, 16, 8, 24):
        assert layout.slot_bytes % 2 == 1 or layout.k_scale_offset % 2 == 1
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    kd, vd = layout.decode(slots)  # what the kernel must reproduce
    rope = make_rope(32)
    width = 32 if mode == "pre_rope" else 32
    q = torch.randn(3, 8, width, generator=g)
    out = run(plan, k_up, rope if mode == "pre_rope" else None, q,
              slots.view(nblk, 1, page, -1), bt, lens, num_splits=2, layout=layout, mode=mode,
              config=None if trans else dec.KernelConfig(transposed=False, block_n=16))
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    ref = reference(plan, k_up, rope, scale, q, gather(kd, bt, lens, page),
                    gather(vd, bt, lens, page), lens, mode=mode)
    assert rel_err(out, ref) < TOL32


# ---------------------------------------------------------------------------------
# Packed post-RoPE kernel (decode_packed): per-token 8/4-bit sides, uniform ranks
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k_bits,v_bits,group_size,kr,vr,splits,window", [
    (8, 4, 1, 16, 32, 1, None),   # the 2x preset's widths, no reduce
    (8, 4, 1, 32, 32, 3, None),   # split-K + reduce
    (4, 4, 1, 32, 32, 2, None),   # nibble halves on both sides
    (4, 8, 2, 32, 16, 2, None),   # two KV heads per group (8 query heads)
    (8, 8, 1, 16, 16, 2, 25),     # sliding window over poisoned rows
])
def test_packed_post_rope_kernel(k_bits, v_bits, group_size, kr, vr, splits, window):
    """The packed kernel is what a post-RoPE call on a per-token packed cache with
    uniform ranks takes by default, and it matches the float64 reference on the
    decoded latents (codes shifted far from zero: the zero points carry a large
    offset that the post-dot correction must cancel exactly)."""
    from vllm_lowrank.kernels.triton import decode_packed

    plan, k_up, lens, bt, nblk, page, g = make_problem(
        group_size=group_size, k_ranks=(kr,) * (4 // group_size),
        v_ranks=(vr,) * (4 // group_size), seed=53)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, k_bits, v_bits)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g) * 2 + 5
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    kd, vd = layout.decode(slots)
    kl, vl = gather(kd, bt, lens, page), gather(vd, bt, lens, page)
    if window is not None:  # 0xFF codes and NaN-pattern scales before the window
        slots = slots.clone()
        for b, n in enumerate(lens.tolist()):
            for t in range(max(0, n - window)):
                slots[int(bt[b, t // page]) * page + t % page] = 255
    cache = slots.view(nblk, 1, page, -1)
    assert decode_packed.blocker(plan, layout, "post_rope", cache.stride(2), page) is None
    q = torch.randn(3, 8, kr, generator=g)
    calls = []
    real = decode_packed.packed_decode_kernel

    class Spy:  # counts launches of the packed kernel, then runs it
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    decode_packed.packed_decode_kernel = Spy()
    try:
        out = run(plan, k_up, None, q, cache, bt, lens, num_splits=splits, layout=layout,
                  mode="post_rope", window=window)
    finally:
        decode_packed.packed_decode_kernel = real
    assert calls == [(splits, plan.num_groups, 3)]
    ref = reference(plan, k_up, None, 0.2, q, kl, vl, lens, mode="post_rope", window=window)
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("q_lens,splits", [([4, 1, 3], 1), ([3, 4, 0], 3)])
def test_packed_kernel_reads_a_verify_steps_query_tokens(q_lens, splits):
    """Several query tokens per sequence (a speculative verify step,
    ``query_start_loc``): token ``t`` of ``q_b`` equals a one-token decode over
    the first ``seq_len - (q_b - 1 - t)`` positions (float64 reference per
    token); a sequence with no tokens writes nothing."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(32,) * 4,
                                                       seed=7)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 8, 4)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g) * 2 + 5
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    kd, vd = layout.decode(slots)
    kl, vl = gather(kd, bt, lens, page), gather(vd, bt, lens, page)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), 8, 16, generator=g)
    launch = prepare(plan, k_up, None, q, slots.view(nblk, 1, page, -1), layout=layout,
                     mode="post_rope")
    assert launch.takes_query_tokens
    out = torch.full((q.shape[0], plan.out_width), float("nan"), device=DEV)
    launch(q.to(DEV), slots.view(nblk, 1, page, -1).to(DEV), bt.to(DEV), lens.to(DEV),
           int(lens.max()), num_splits=splits, out=out, query_start_loc=qsl.to(DEV),
           max_query_len=max(q_lens))
    rows = [(b, int(lens[b]) - (q_b - 1 - t)) for b, q_b in enumerate(q_lens) for t in range(q_b)]
    row_lens = torch.tensor([n for _, n in rows])
    ref = reference(plan, k_up, None, 0.2, q, [kl[b][:n] for b, n in rows],
                    [vl[b][:n] for b, n in rows], row_lens, mode="post_rope")
    assert rel_err(out.double().cpu(), ref) < TOL32


def test_packed_post_rope_kernel_scope():
    """Layers outside the packed kernel's scope say why; forcing it there is a
    ValueError naming the reason, and ``packed=False`` takes the grid kernel."""
    from vllm_lowrank.kernels.triton import decode_packed

    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(32,) * 4, v_ranks=(32,) * 4)
    ok = SlotLayout(plan.k_ranks, plan.v_ranks, 8, 4)
    uneven, _, *_ = make_problem(k_ranks=(16, 32, 32, 32), v_ranks=(32,) * 4)
    cases = [
        (plan, ok, "pre_rope", "pre_rope mode"),
        (plan, None, "post_rope", "unquantized"),
        (plan, SlotLayout(plan.k_ranks, plan.v_ranks, 3, 4), "post_rope", "bits"),
        (plan, SlotLayout(plan.k_ranks, plan.v_ranks, 8, 4, 16, None), "post_rope",
         "grouped scales"),
        (plan, SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4, k_channel_tokens=16),
         "post_rope", "per-channel"),
        (uneven, SlotLayout(uneven.k_ranks, uneven.v_ranks, 8, 4), "post_rope", "uneven"),
        (plan, SlotLayout(plan.k_ranks, plan.v_ranks, 8, 4, pad_to=ok.slot_bytes + 1),
         "post_rope", "odd"),
    ]
    for pl, lay, mode, why in cases:
        stride = pl.k_width + pl.v_width if lay is None else lay.slot_bytes
        assert why in decode_packed.blocker(pl, lay, mode, stride, page)
        if why not in ("pre_rope mode", "per-channel"):  # those two: other kernels' cases
            assert dec.choose_kernel(pl, lay, mode, page, 32) == "grid"
    assert decode_packed.blocker(plan, ok, "post_rope", ok.slot_bytes, page) is None
    # an odd slot stride of the cache the layer reads (the layout's own is even)
    assert "odd" in decode_packed.blocker(plan, ok, "post_rope", ok.slot_bytes + 1, page)
    assert dec.choose_kernel(plan, ok, "post_rope", page, 32,
                             slot_stride=ok.slot_bytes + 1) == "grid"
    # the one selector (launch and start-up log line): packed here, unless refused
    assert dec.choose_kernel(plan, ok, "post_rope", page, 32) == "packed"
    assert dec.choose_kernel(plan, ok, "post_rope", page, 32,
                             dec.KernelConfig(packed=False)) == "grid"
    q = torch.randn(3, 8, 32)
    bad = SlotLayout(plan.k_ranks, plan.v_ranks, 3, 4)
    bad_cache = torch.zeros(nblk, 1, page, bad.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed post-RoPE kernel cannot run this layer: bits"):
        prepare(plan, k_up, None, q, bad_cache, layout=bad, mode="post_rope",
                config=dec.KernelConfig(packed=True))
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    slots = ok.encode(lat[:, :plan.k_width], lat[:, plan.k_width:]).view(nblk, 1, page, -1)
    assert prepare(plan, k_up, None, q, slots, layout=ok, mode="post_rope").kernel == "packed"
    a = run(plan, k_up, None, q, slots, bt, lens, layout=ok, mode="post_rope")
    b = run(plan, k_up, None, q, slots, bt, lens, layout=ok, mode="post_rope",
            config=dec.KernelConfig(packed=False))
    assert rel_err(a, b) < TOL32


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_quantized_uneven_scale_groups(mode):
    """A scale group that is not a power of two (24 channels; ranks 48 and 24 in
    groups of two KV heads): one scale/zero pair gathered per element."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=2, k_ranks=(48, 24),
                                                       v_ranks=(24, 48), seed=23)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 8, 24, 24)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    kd, vd = layout.decode(slots)
    rope = make_rope(32)
    q = torch.randn(3, 8, 48 if mode == "post_rope" else 32, generator=g)
    out = run(plan, k_up, rope if mode == "pre_rope" else None, q,
              slots.view(nblk, 1, page, -1), bt, lens, num_splits=2, layout=layout, mode=mode)
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    ref = reference(plan, k_up, rope, scale, q, gather(kd, bt, lens, page),
                    gather(vd, bt, lens, page), lens, mode=mode)
    assert rel_err(out, ref) < TOL32


# ---------------------------------------------------------------------------------
# Host-side checks
# ---------------------------------------------------------------------------------
def test_rank_classes_merge():
    shape = AttentionShape(8 * 32, 8, 8, 32)
    plan = LayerPlan(shape, 1, (8, 16, 24, 32, 8, 16, 24, 32), (32, 8, 16, 8, 24, 32, 8, 16))
    classes, gcls = rank_classes(plan)
    assert len(classes) <= 4
    for (rk, rv), c in zip(zip(plan.k_ranks, plan.v_ranks), gcls):
        assert classes[c][0] >= rk and classes[c][1] >= rv


def test_errors():
    """A mode outside the kernels' is refused when the launch is prepared; a
    call whose cache or queries do not match what was prepared (slot width,
    element dtype, query heads) before any launch."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(16,) * 4)
    rope = make_rope(32)
    q = torch.randn(3, 8, 32)
    bad = torch.zeros(nblk, 1, page, 100)
    with pytest.raises(ValueError, match="mode"):
        prepare(plan, k_up, rope, q, bad, mode="x")
    good = torch.zeros(nblk, 1, page, plan.k_width + plan.v_width)
    launch = prepare(plan, k_up, rope, q, good)
    args = (bt.to(DEV), lens.to(DEV), 70)
    with pytest.raises(ValueError, match="slot width"):
        launch(q.to(DEV), bad.to(DEV), *args)
    with pytest.raises(ValueError, match="dtype"):
        launch(q.to(DEV), good.to(DEV, torch.float16), *args)
    with pytest.raises(ValueError, match="heads"):
        launch(q[:, :4].to(DEV), good.to(DEV), *args)


def test_split_heuristic():
    # One wave of 128 programs beats three waves of 384 for 16 x 32k.
    assert dec.choose_num_splits(16, 8, 32768, 128, 132) == 1
    # 1 x 32k: 8 (sequence, group) pairs must be split to use the GPU.
    assert dec.choose_num_splits(1, 8, 32768, 128, 132) >= 8
    assert dec.choose_num_splits(1, 8, 100, 64, 132) == 1
    for args in [(8, 8, 131072, 128, 132), (64, 8, 4096, 128, 132)]:
        s = dec.choose_num_splits(*args)
        assert 1 <= s <= 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_ext_clear_error_without_cuda():
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    for module in cuda_ext.MODULES:
        with pytest.raises(RuntimeError, match="CUDA device"):
            cuda_ext.load(module)


@pytest.mark.parametrize("mode", ["pre_rope", "post_rope"])
def test_non_transposed_variant(mode):
    """The S = q' K'^T form (rebuilt keys through shared memory) computes the same."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(8, 24, 16, 32),
                                                       v_ranks=(16, 8, 32, 24), seed=17)
    rope = make_rope(32)
    rows = float_cache(plan, nblk, page, g, torch.float32)
    q = torch.randn(3, 8, 32, generator=g)
    cfg = dec.KernelConfig(transposed=False, block_n=16)
    out = run(plan, k_up, rope if mode == "pre_rope" else None, q,
              rows.view(nblk, 1, page, -1), bt, lens, num_splits=2, mode=mode, config=cfg)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    ref = reference(plan, k_up, rope, scale, q, kl, vl, lens, mode=mode)
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("gpp,mode,bits,trans", [
    (2, "pre_rope", None, None), (4, "pre_rope", None, None), (4, "post_rope", None, None),
    (4, "pre_rope", (8, 4), None), (2, "post_rope", (4, 2), None), (1, "pre_rope", None, None),
    (2, "pre_rope", (8, 4), False), (4, "post_rope", (8, 4), False),
    (2, "post_rope", (8, 4, 8, 8), False), (4, "pre_rope", (3, 4, 8, 16), None),
])
def test_groups_per_program(gpp, mode, bits, trans):
    """Several head groups in one score tile (equal ranks) against the reference;
    packed caches with per-row (one pair per group) and grouped scales. ``trans``
    None: the device's default score layout."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(32,) * 4,
                                                       lens=(45, 3, 33), seed=19)
    rope = make_rope(32)
    q = torch.randn(3, 8, 32, generator=g)
    layout = None if bits is None else SlotLayout(plan.k_ranks, plan.v_ranks, *bits)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    if layout is None:
        cache, kd, vd = lat, lat[:, :plan.k_width], lat[:, plan.k_width:]
    else:
        cache = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
        kd, vd = layout.decode(cache)
    cfg = dec.KernelConfig(groups_per_program=gpp, block_n=16, transposed=trans)
    out = run(plan, k_up, rope if mode == "pre_rope" else None, q,
              cache.view(nblk, 1, page, -1), bt, lens, num_splits=2, mode=mode,
              layout=layout, config=cfg)
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    ref = reference(plan, k_up, rope, scale, q, gather(kd, bt, lens, page),
                    gather(vd, bt, lens, page), lens, mode=mode)
    assert rel_err(out, ref) < TOL32


def test_groups_per_program_rejects_uneven_ranks():
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(8, 24, 16, 32),
                                                       v_ranks=(16,) * 4)
    rows = float_cache(plan, nblk, page, g, torch.float32)
    with pytest.raises(ValueError, match="groups_per_program"):
        prepare(plan, k_up, make_rope(32), torch.randn(3, 8, 32),
                rows.view(nblk, 1, page, -1), config=dec.KernelConfig(groups_per_program=2))


# ---------------------------------------------------------------------------------
# Key bias / QK-norm (KeyTransform) and sliding windows
# ---------------------------------------------------------------------------------
def make_transform(plan, g, bias=True, norm=True, eps=1e-5):
    from vllm_lowrank.attention.latent_attention import KeyTransform

    sh = plan.shape
    b = 0.5 * torch.randn(sh.num_kv_heads * sh.head_dim, generator=g) if bias else None
    w = 1.0 + 0.3 * torch.randn(sh.head_dim, generator=g) if norm else None
    return KeyTransform(bias=b, norm_weight=w, norm_eps=eps if norm else 0.0)


def poison_outside_window(rows, bt, lens, page, window, nblk, sink=0, recent=0):
    """NaN (packed ``uint8`` rows: 0xFF bytes, i.e. NaN fp16 scales) in every
    cached row outside each sequence's visible span ``max(sink, n - window) <= t <
    n - recent`` (``window`` may be ``None``), and block-table entries of blocks
    wholly outside it pointed at one shared poisoned block (vLLM's null block).
    Returns (rows, bt, nblk) with the poisoned block appended."""
    fill = 255 if rows.dtype == torch.uint8 else float("nan")
    rows = rows.clone()
    bt = bt.clone()
    null = nblk
    rows = torch.cat((rows, torch.full((page, rows.shape[1]), fill, dtype=rows.dtype)))
    for b, n in enumerate(lens.tolist()):
        lo = max(sink, n - window if window is not None else 0)
        hi = n - recent
        for t in range(n):
            if not lo <= t < hi:
                blk = int(bt[b, t // page])
                rows[blk * page + t % page] = fill
        for k in range(math.ceil(n / page)):
            if lo >= hi or (k + 1) * page <= lo or k * page >= hi:
                bt[b, k] = null
    return rows, bt, nblk + 1


def window_problem(group_size, rot, neox, seed, window, dtype=torch.float32):
    kr = (8, 24, 16, 32) if group_size == 1 else (40, 16)
    vr = (16, 8, 32, 24) if group_size == 1 else (24, 64)
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=group_size,
                                                       k_ranks=kr, v_ranks=vr, seed=seed)
    rope = make_rope(rot, neox=neox)
    rows = float_cache(plan, nblk, page, g, dtype)
    # latents of the reference: before poisoning (the reference drops them anyway)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    if window is not None:
        rows, bt, nblk = poison_outside_window(rows, bt, lens, page, window, nblk)
    q = torch.randn(len(lens), 8, 32, generator=g)
    return plan, k_up, lens, bt, nblk, page, g, rope, rows, q, kl, vl


@pytest.mark.parametrize("bias,norm,window,group_size,rot,neox,splits", [
    (True, False, None, 1, 32, True, 1),   # Qwen2 key bias
    (False, True, None, 2, 16, True, 3),   # QK-norm, G = 2, rest section, split-K
    (True, True, None, 2, 32, False, 2),   # bias + norm, gptj pairs, G = 2
    (True, True, 20, 1, 16, True, 2),      # bias + norm + window (NaN before it)
    (False, False, 20, 2, 32, True, 3),    # window only, G = 2, empty splits
    (False, True, 40, 1, 32, True, 1),     # window, no split
])
def test_transform_window(bias, norm, window, group_size, rot, neox, splits):
    plan, k_up, lens, bt, nblk, page, g, rope, rows, q, kl, vl = window_problem(
        group_size, rot, neox, 29, window)
    tf = make_transform(plan, g, bias, norm) if bias or norm else None
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=splits,
              transform=tf, window=window)
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens, transform=tf, window=window)
    assert rel_err(out, ref) < TOL32
    if window is not None:  # the window does change the result
        full = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens, transform=tf)
        assert rel_err(full, ref) > 1e-2


@pytest.mark.parametrize("gpp,trans", [(2, False), (4, None)])
def test_transform_window_groups(gpp, trans):
    """Several head groups per score tile (per-group biases), with QK-norm,
    bias and a window over NaN blocks."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(32,) * 4,
                                                       lens=(45, 3, 33), seed=31)
    rope = make_rope(32)
    rows = float_cache(plan, nblk, page, g, torch.float32)
    kl = [x[:, :plan.k_width] for x in gather(rows, bt, lens, page)]
    vl = [x[:, plan.k_width:] for x in gather(rows, bt, lens, page)]
    rows, bt, nblk = poison_outside_window(rows, bt, lens, page, 18, nblk)
    q = torch.randn(3, 8, 32, generator=g)
    tf = make_transform(plan, g)
    cfg = dec.KernelConfig(groups_per_program=gpp, block_n=16, transposed=trans)
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=2,
              config=cfg, transform=tf, window=18)
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens, transform=tf, window=18)
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("bits", [None, (8, 4)])
def test_post_rope_window(bits):
    """Post-RoPE mode with a window (packed or float cache, NaN before it)."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(8, 24, 16, 32),
                                                       v_ranks=(32, 8, 16, 24), seed=37)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    if bits is None:
        cache, kd, vd, layout = lat, lat[:, :plan.k_width], lat[:, plan.k_width:], None
    else:
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, *bits)
        cache = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
        kd, vd = layout.decode(cache)
    kl, vl = gather(kd, bt, lens, page), gather(vd, bt, lens, page)
    if bits is None:
        cache, bt, nblk = poison_outside_window(cache, bt, lens, page, 25, nblk)
    else:  # 0xFF codes and NaN-pattern scales (0xFFFF) before the window
        cache = cache.clone()
        for b, n in enumerate(lens.tolist()):
            for t in range(max(0, n - 25)):
                cache[int(bt[b, t // page]) * page + t % page] = 255
    q = torch.randn(3, 8, 40, generator=g)
    out = run(plan, k_up, None, q, cache.view(nblk, 1, page, -1), bt, lens, num_splits=2,
              mode="post_rope", layout=layout, window=25)
    ref = reference(plan, k_up, None, 0.2, q, kl, vl, lens, mode="post_rope", window=25)
    assert rel_err(out, ref) < TOL32


def test_transform_window_matches_torch_path():
    """Same result as the backend's torch path (decode_attention) with a key
    transform and a window over NaN null blocks."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    plan, k_up, lens, bt, nblk, page, g, rope, rows, q, kl, vl = window_problem(
        2, 16, True, 41, 20)
    tf = make_transform(plan, g)
    cache = rows.view(nblk, 1, page, -1)
    out = run(plan, k_up, rope, q, cache, bt, lens, num_splits=2, transform=tf, window=20)
    cpu_rope = RopeTable(rope.cos.cpu(), rope.sin.cpu(), rope.rotary_dim, rope.neox)
    cpu = decode_attention(plan, k_up, cpu_rope, 32 ** -0.5, q, cache,
                           bt.clamp(max=nblk - 1), lens, int(lens.max()), transform=tf,
                           window=20, min_seq_len=int(lens.min()))
    assert torch.isfinite(cpu).all()
    assert rel_err(out, cpu.double()) < TOL32


def test_transform_errors():
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(16,) * 4)
    rows = float_cache(plan, nblk, page, g, torch.float32).view(nblk, 1, page, -1)
    q = torch.randn(3, 8, 32)
    with pytest.raises(ValueError, match="pre_rope mode only"):
        prepare(plan, k_up, None, q, rows, mode="post_rope", transform=make_transform(plan, g))
    with pytest.raises(ValueError, match="window"):
        prepare(plan, k_up, make_rope(32), q, rows, window=0)


# ---------------------------------------------------------------------------------
# Token-adaptive mode (TALE): latent span only, log-sum-exp output
# ---------------------------------------------------------------------------------
TALE_LENS = (100, 37, 20, 5, 81)  # ragged; sink 16 + recent 64 empties three spans
LSE_TOL = 2e-2 if ON_GPU else 1e-5


def span_reference(plan, k_up, rope, scale, q, k_lat, v_lat, lens, keep, mode="pre_rope",
                   transform=None):
    """float64 attention of sequence ``b`` over the positions ``t`` with
    ``keep(t, lens[b])``, written independently of the kernel and the torch path:
    an explicit loop over positions picks the rows (the others are never touched:
    they may be NaN), then an explicit log-sum-exp ``m + log sum exp(s - m)``.
    Returns ``(out [B, out_width], lse [B, H])``; no kept position gives a zero
    row and ``lse = -inf``."""
    q, k_up = q.double().cpu(), k_up.double().cpu()
    hg = plan.heads_per_group
    out = torch.zeros(q.shape[0], plan.out_width, dtype=torch.float64)
    lse = torch.full((q.shape[0], plan.shape.num_heads), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pos = []
        for t in range(n):
            if keep(t, n):
                pos.append(t)
        if not pos:
            continue
        pos = torch.tensor(pos)
        kl, vl = k_lat[b].double().cpu()[pos], v_lat[b].double().cpu()[pos]
        for gi, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
            rk, rv = plan.k_ranks[gi], plan.v_ranks[gi]
            s = scale * ref_scores(plan, k_up, rope, q[b, gi * hg:(gi + 1) * hg],
                                   kl[:, ko:ko + rk], gi, pos, mode, transform)  # [hg, L]
            m = s.max(-1, keepdim=True).values
            ls = m + torch.log(torch.exp(s - m).sum(-1, keepdim=True))  # [hg, 1]
            o = torch.exp(s - ls) @ vl[:, vo:vo + rv]  # [hg, rv]
            out[b, hg * vo:hg * (vo + rv)] = o.flatten()
            lse[b, gi * hg:(gi + 1) * hg] = ls[:, 0]
    return out, lse


def in_span(sink, recent, window):
    """``keep`` of the latent span: ``max(sink, n - window) <= t < n - recent``."""
    return lambda t, n: max(sink, n - window if window is not None else 0) <= t < n - recent


def lse_merge(plan, out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets from the two parts'
    ``(out [B, out_width], lse [B, H])``: per head, weights ``e^(lse - max)``."""
    hg = plan.heads_per_group
    col_head = torch.cat([torch.full((rv,), g * hg + h) for g, rv in enumerate(plan.v_ranks)
                          for h in range(hg)])
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), 0.0, m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    out = (wa[:, col_head] * out_a + wb[:, col_head] * out_b) / (wa + wb)[:, col_head]
    return out, m + torch.log(wa + wb)


def tale_problem(ranks, bits, seed, sink, recent, window):
    """Ragged batch (TALE_LENS), shuffled blocks; float32 (``bits`` None), bf16
    (``"bf16"``) or packed (``(k_bits, v_bits)``) cache; rows and whole blocks
    outside each latent span poisoned (NaN / 0xFF, null block). Returns the
    problem, the poisoned cache and the clean per-sequence latents."""
    kr, vr = ((8, 24, 16, 32), (16, 8, 32, 24)) if ranks == "uneven" else ((16,) * 4, (32,) * 4)
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=kr, v_ranks=vr,
                                                       lens=TALE_LENS, seed=seed)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    layout = SlotLayout(kr, vr, *bits) if isinstance(bits, tuple) else None
    if layout is None:
        cache = lat.bfloat16() if bits == "bf16" else lat
        kd, vd = cache[:, :plan.k_width].float(), cache[:, plan.k_width:].float()
    else:
        cache = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
        kd, vd = layout.decode(cache)
    kl, vl = gather(kd, bt, lens, page), gather(vd, bt, lens, page)
    cache, bt, nblk = poison_outside_window(cache, bt, lens, page, window, nblk, sink, recent)
    return plan, k_up, lens, bt, nblk, page, g, layout, cache, kl, vl


@pytest.mark.parametrize("sink,recent,window,mode,ranks,bits,splits,extra", [
    (0, 0, None, "pre_rope", "uneven", None, 1, None),          # plain + LSE, no span
    (0, 17, None, "pre_rope", "uneven", None, 3, None),         # recent only, split-K
    (4, 0, None, "post_rope", "uneven", None, 1, None),         # sink only
    (16, 64, None, "pre_rope", "uneven", None, 2, None),        # 3 of 5 spans empty
    (4, 1, 30, "pre_rope", "uneven", None, 2, "transform"),     # window + bias/QK-norm
    (16, 17, None, "post_rope", "equal", (8, 4), 3, None),      # packed kernel, split
    (16, 17, None, "post_rope", "equal", (8, 4), 3, "grid"),    # grid kernel, GPP 4, split
    (4, 64, 90, "pre_rope", "uneven", (4, 4), 1, None),         # packed + window
    (4, 17, None, "pre_rope", "uneven", None, 2, "no-lse"),     # without the LSE
    (4, 17, None, "pre_rope", "uneven", "bf16", 2, None),       # bf16 cache and queries
    (16, 1, None, "post_rope", "uneven", (3, 2), 1, None),      # 3/2-bit codes
    # GPP 2, S = q' K'^T, no split; n = 20: the span would end (t < 3) before it
    # starts (t >= 4) inside tile 0, which must not be processed
    (4, 17, None, "pre_rope", "equal", None, 1, "gpp2"),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # interpreter: no NaN/inf arithmetic
def test_span(sink, recent, window, mode, ranks, bits, splits, extra):
    """Latent span ``max(sink, n - window) <= t < n - recent`` (everything else
    NaN or a NaN null block) with the span's LSE: against the float64 loop
    reference and the torch path (decode_attention) with the same arguments."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    plan, k_up, lens, bt, nblk, page, g, layout, cache, kl, vl = tale_problem(
        ranks, bits, 43, sink, recent, window)
    rope = make_rope(32) if mode == "pre_rope" else None
    q = torch.randn(len(lens), 8, 32 if mode == "pre_rope" else 40, generator=g)
    if bits == "bf16":
        q = q.bfloat16()
    tol = 1e-2 if ON_GPU and bits == "bf16" else TOL32  # bf16 tensor-core dots on GPUs
    lse_tol = 5e-2 if ON_GPU and bits == "bf16" else LSE_TOL
    tf = make_transform(plan, g) if extra == "transform" else None
    cfg = dec.KernelConfig(groups_per_program=2, block_n=16, transposed=False) \
        if extra == "gpp2" else dec.KernelConfig(packed=False) if extra == "grid" else None
    want_lse = extra != "no-lse"
    res = run(plan, k_up, rope, q, cache.view(nblk, 1, page, -1), bt, lens, num_splits=splits,
              mode=mode, layout=layout, transform=tf, window=window, sink=sink, recent=recent,
              return_lse=want_lse, config=cfg)
    out, lse = res if want_lse else (res, None)
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    keep = in_span(sink, recent, window)
    ref, ref_lse = span_reference(plan, k_up, rope, scale, q, kl, vl, lens, keep, mode, tf)
    empty = torch.isinf(ref_lse[:, 0])
    assert empty.any() == (sink + recent >= min(TALE_LENS)), "case exercises empty spans"
    assert (out[empty] == 0).all()
    assert rel_err(out, ref) < tol
    if want_lse:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert (lse[fin] - ref_lse[fin]).abs().max() < lse_tol
    # the torch path, same arguments (blocks outside the table: the null block)
    cpu_rope = None if rope is None else RopeTable(rope.cos.cpu(), rope.sin.cpu(), 32, True)
    cpu, cpu_lse = decode_attention(plan, k_up, cpu_rope, scale, q.float(),
                                    cache.view(nblk, 1, page, -1),
                                    bt.clamp(max=nblk - 1), lens, int(lens.max()),
                                    post_rope=mode == "post_rope", layout=layout, transform=tf,
                                    window=window, min_seq_len=int(lens.min()), sink=sink,
                                    recent=recent, return_lse=True)
    assert torch.isfinite(cpu).all()
    assert rel_err(out, cpu.double()) < tol
    if want_lse:
        assert torch.equal(torch.isinf(lse), torch.isinf(cpu_lse))
        fin = torch.isfinite(cpu_lse)
        assert (lse[fin] - cpu_lse[fin].double()).abs().max() < lse_tol


@pytest.mark.parametrize("sink,recent,window,mode,bits,splits", [
    (4, 17, None, "pre_rope", None, 3),
    (16, 1, 40, "post_rope", (8, 4), 1),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_span_merge_equals_full(sink, recent, window, mode, bits, splits):
    """The kernel's (out, lse) over the latent span merged by log-sum-exp with an
    exact part over the sink and recent positions (float64 here) is attention
    over every (in-window) position."""
    plan, k_up, lens, bt, nblk, page, g, layout, cache, kl, vl = tale_problem(
        "uneven", bits, 47, sink, recent, window)
    rope = make_rope(32) if mode == "pre_rope" else None
    q = torch.randn(len(lens), 8, 32 if mode == "pre_rope" else 40, generator=g)
    scale = 32 ** -0.5 if mode == "pre_rope" else 0.2
    out_a, lse_a = run(plan, k_up, rope, q, cache.view(nblk, 1, page, -1), bt, lens,
                       num_splits=splits, mode=mode, layout=layout, window=window, sink=sink,
                       recent=recent, return_lse=True)

    def exact(t, n):
        return (t < sink or t >= n - recent) and (window is None or t >= n - window)

    out_b, lse_b = span_reference(plan, k_up, rope, scale, q, kl, vl, lens, exact, mode)
    merged, merged_lse = lse_merge(plan, out_a, lse_a, out_b, lse_b)
    full = reference(plan, k_up, rope, scale, q, kl, vl, lens, mode=mode, window=window)
    assert rel_err(merged, full) < TOL32
    _, full_lse = span_reference(plan, k_up, rope, scale, q, kl, vl, lens,
                                 in_span(0, 0, window), mode)
    assert (merged_lse - full_lse).abs().max() < LSE_TOL
    assert rel_err(out_a, full) > 1e-2  # the exact part matters


def test_span_errors():
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(16,) * 4)
    rows = float_cache(plan, nblk, page, g, torch.float32).view(nblk, 1, page, -1)
    q = torch.randn(3, 8, 32)
    for kw in ({"sink": -1}, {"recent": -2}):
        with pytest.raises(ValueError, match="sink and recent"):
            prepare(plan, k_up, make_rope(32), q, rows, **kw)


# ---------------------------------------------------------------------------------
# Wide head groups (decode_wide): one program per KV head, the rank in chunks
# ---------------------------------------------------------------------------------
WIDE = dec.KernelConfig(wide=True)
WIDE_GRIDS = {"per-kv-head": dec.KernelConfig(wide=True, heads_per_program=1),
              "per-group": dec.KernelConfig(wide=True, heads_per_program=8, chunk_outer=False),
              "per-group, chunks outer": dec.KernelConfig(wide=True, heads_per_program=8),
              "two heads, chunks outer": dec.KernelConfig(wide=True, heads_per_program=2)}


@pytest.mark.parametrize("bsz,groups,g,qpk,rv_pad,hpp", [
    (1, 1, 8, 4, 512, 1),     # one sequence: one KV head per program
    (16, 1, 8, 4, 512, 4),    # 4 KV heads x 4 query heads: one 16-row tile
    (16, 1, 8, 4, 1024, 4),   # value accumulator [16, 1024]: 16 K float32
    (16, 1, 8, 4, 2048, 1),   # larger: it would spill
    (16, 1, 8, 8, 512, 2),
    (16, 2, 2, 3, 256, 2),    # 6 query rows, padded to 8
    (16, 8, 1, 4, 128, 1),    # per-head groups
    (16, 1, 4, 32, 128, 1),   # more query heads than one tile
])
def test_wide_heads_per_program(bsz, groups, g, qpk, rv_pad, hpp):
    """The wide kernel's KV heads per program: a divisor of the group size
    whose query heads fill at most one 16-row tile, with enough sequences and
    a value accumulator of at most 16 K float32."""
    from vllm_lowrank.kernels.triton.launch import wide_heads_per_program

    assert wide_heads_per_program(bsz, groups, g, qpk, rv_pad) == hpp


def latent_cache(plan, nblk, page, g, bits, qgroup=None):
    """Random latents as a float32 cache (``bits`` None) or packed
    (``(k_bits, v_bits)``): ``(cache rows, layout, key rows, value rows)``, the
    last two what the kernel must read back."""
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    if bits is None:
        return lat, None, lat[:, :plan.k_width], lat[:, plan.k_width:]
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, *bits, qgroup, qgroup)
    slots = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
    return (slots, layout, *layout.decode(slots))


@pytest.mark.parametrize("group_size,kr,vr,neox,rot,splits,bits,qgroup", [
    (4, (56,), (40,), True, 32, 1, None, None),        # every KV head in one group, 4 chunks
    (4, (56,), (40,), False, 16, 3, None, None),       # gptj, partial rotary, split-K
    (2, (40, 16), (24, 64), True, 32, 2, None, None),  # uneven ranks
    (1, (8, 24, 16, 32), (16, 8, 32, 24), True, 32, 2, None, None),  # per-head groups
    (4, (64,), (48,), True, 32, 2, (8, 4), None),      # packed, one scale/zero per row
    (2, (48, 32), (32, 48), True, 16, 1, (3, 2), None),  # 3/2-bit codes straddle chunks
    (4, (64,), (48,), True, 32, 2, (4, 8), 16),        # a scale pair per 16 channels
    (2, (48, 24), (24, 48), True, 32, 2, (4, 8), 24),  # groups of 24: one rank chunk
])
@pytest.mark.parametrize("grid", list(WIDE_GRIDS))
def test_wide(group_size, kr, vr, neox, rot, splits, bits, qgroup, grid):
    """The wide-group kernel (one program per KV head, and per head group)
    against the float64 reference: every grouping, uneven ranks, every code
    width and scale grouping, several rank chunks (16 channels each under the
    interpreter)."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=group_size, k_ranks=kr,
                                                       v_ranks=vr, seed=31)
    rope = make_rope(rot, neox=neox)
    cache, layout, kd, vd = latent_cache(plan, nblk, page, g, bits, qgroup)
    q = torch.randn(len(lens), 8, 32, generator=g)
    out = run(plan, k_up, rope, q, cache.view(nblk, 1, page, -1), bt, lens,
              num_splits=splits, layout=layout, config=WIDE_GRIDS[grid])
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, gather(kd, bt, lens, page),
                    gather(vd, bt, lens, page), lens)
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("bias,norm,window,rot,neox,splits", [
    (True, True, None, 16, True, 2),    # bias + QK-norm over the rotary halves and the rest
    (False, True, 20, 32, False, 3),    # QK-norm, gptj, window (NaN before it)
    (True, False, None, 16, True, 2),   # bias alone (added with the first rank chunk)
])
@pytest.mark.parametrize("grid", list(WIDE_GRIDS))
def test_wide_transform_window(bias, norm, window, rot, neox, splits, grid):
    plan, k_up, lens, bt, nblk, page, g, rope, rows, q, kl, vl = window_problem(
        2, rot, neox, 37, window)
    tf = make_transform(plan, g, bias, norm)
    out = run(plan, k_up, rope, q, rows.view(nblk, 1, page, -1), bt, lens, num_splits=splits,
              transform=tf, window=window, config=WIDE_GRIDS[grid])
    ref = reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens, transform=tf, window=window)
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("sink,recent,window,bits,splits", [
    (4, 17, None, None, 3),     # latent span with split-K and the merged LSE
    (16, 64, 90, (4, 4), 1),    # packed, window, empty spans, LSE from the kernel
])
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("grid", list(WIDE_GRIDS))
def test_wide_span(sink, recent, window, bits, splits, grid):
    """Token-adaptive latent span and its log-sum-exp (NaN outside the span)."""
    plan, k_up, lens, bt, nblk, page, g, layout, cache, kl, vl = tale_problem(
        "uneven", bits, 47, sink, recent, window)
    rope = make_rope(32)
    q = torch.randn(len(lens), 8, 32, generator=g)
    out, lse = run(plan, k_up, rope, q, cache.view(nblk, 1, page, -1), bt, lens,
                   num_splits=splits, layout=layout, window=window, sink=sink, recent=recent,
                   return_lse=True, config=WIDE_GRIDS[grid])
    keep = in_span(sink, recent, window)
    ref, ref_lse = span_reference(plan, k_up, rope, 32 ** -0.5, q, kl, vl, lens, keep)
    assert rel_err(out, ref) < TOL32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() < LSE_TOL


def channel_key_cache(plan, nblk, page, g, bits, kct):
    """Random latents packed with per-channel keys over groups of ``kct``
    positions (every group complete, as the token-adaptive writer leaves the
    latent span): ``(slots, layout, key rows, value rows)``."""
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, *bits, k_channel_tokens=kct)
    slots = layout.encode_complete(lat[:, :plan.k_width], lat[:, plan.k_width:])
    return (slots, layout, *layout.decode(slots))


@pytest.mark.parametrize("wide", [True, False], ids=["wide", "grid"])
@pytest.mark.parametrize("group_size,kr,vr,bits,kct,page,span,splits", [
    (1, (8, 24, 16, 32), (16, 8, 32, 24), (4, 4), 16, 16, None, 2),  # 20-byte shares
    (4, (56,), (40,), (2, 4), 32, 32, None, 1),     # 7-byte shares: float16s split over slots
    (2, (40, 16), (24, 64), (4, 8), 16, 32, (4, 17), 3),  # latent span (TALE) with LSE
    (1, (16, 16, 16, 16), (16, 16, 16, 16), (4, 4), 32, 32, (4, 17), 2),  # 32-token groups
])
def test_channel_keys(group_size, kr, vr, bits, kct, page, span, splits, wide):
    """Per-channel keys (KIVI) read by the wide and the grid kernel against the
    float64 reference on ``SlotLayout.decode``'s values and against the torch
    path; the default launch takes the grid kernel where its key tile fits."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=group_size, k_ranks=kr,
                                                       v_ranks=vr, page=page, seed=59)
    slots, layout, kd, vd = channel_key_cache(plan, nblk, page, g, bits, kct)
    assert layout.k_share_bytes == 4 * sum(kr) // kct
    rope = make_rope(32)
    q = torch.randn(len(lens), 8, 32, generator=g)
    sink, recent = span or (0, 0)
    cache = slots.view(nblk, 1, page, -1)
    assert dec.choose_kernel(plan, layout, "pre_rope", page, 32) == "grid"
    out, lse = run(plan, k_up, rope, q, cache, bt, lens, num_splits=splits, layout=layout,
                   sink=sink, recent=recent, return_lse=True,
                   config=dec.KernelConfig(wide=wide))
    ref, ref_lse = span_reference(plan, k_up, rope, 32 ** -0.5, q, gather(kd, bt, lens, page),
                                  gather(vd, bt, lens, page), lens, in_span(sink, recent, None))
    assert rel_err(out, ref) < TOL32
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - ref_lse[fin]).abs().max() < LSE_TOL
    torch_path = decode_attention(plan, k_up.to(DEV), rope, 32 ** -0.5, q.to(DEV), cache.to(DEV),
                                  bt.clamp(max=nblk - 1).to(DEV), lens.to(DEV), int(lens.max()),
                                  layout=layout, sink=sink, recent=recent)
    assert rel_err(out, torch_path.double().cpu()) < TOL32
    with pytest.raises(ValueError, match="pre_rope mode only"):
        run(plan, k_up, rope, torch.randn(len(lens), 8, max(kr)), cache, bt, lens,
            layout=layout, mode="post_rope")


def test_wide_chosen_for_large_key_tiles(monkeypatch):
    """The default launch takes the wide kernel exactly when a group's key tile
    exceeds TRITON_MAX_KEY_TILE (J-LRD on Llama-3-8B's 8 KV heads of 128 at rank
    512: 512 x 512), and gets the same result as the grid kernel."""
    llama = LayerPlan(AttentionShape(4096, 32, 8, 128), 8, (512,), (512,))
    assert launch_params.needs_wide(llama, None, 128)
    assert not launch_params.needs_wide(LayerPlan(llama.shape, 1, (64,) * 8, (64,) * 8),
                                        None, 128)
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=4, k_ranks=(48,),
                                                       v_ranks=(32,), seed=41)
    rope = make_rope(32)
    cache, _, kd, vd = latent_cache(plan, nblk, page, g, None)
    q = torch.randn(len(lens), 8, 32, generator=g)
    cache = cache.view(nblk, 1, page, -1)
    calls = []
    launch = dec.LatentLaunch._launch_wide
    monkeypatch.setattr(dec.LatentLaunch, "_launch_wide",
                        lambda *a, **k: calls.append(1) or launch(*a, **k))
    grid = run(plan, k_up, rope, q, cache, bt, lens, num_splits=2)
    assert not calls and not launch_params.needs_wide(plan, None, 32)
    assert dec.choose_kernel(plan, None, "pre_rope", page, 32) == "grid"
    monkeypatch.setattr(launch_params, "TRITON_MAX_KEY_TILE", 64 * 64 - 1)  # 64 x 64 no longer fits
    assert launch_params.needs_wide(plan, None, 32)
    assert dec.choose_kernel(plan, None, "pre_rope", page, 32) == "wide"
    assert dec.choose_kernel(plan, None, "post_rope", page, 32) == "grid"
    assert prepare(plan, k_up, rope, q, cache).kernel == "wide"
    wide = run(plan, k_up, rope, q, cache, bt, lens, num_splits=2)
    assert calls
    assert rel_err(wide, grid) < TOL32


def test_wide_errors():
    plan, k_up, lens, bt, nblk, page, g = make_problem(k_ranks=(16,) * 4, v_ranks=(16,) * 4)
    cache = float_cache(plan, nblk, page, g, torch.float32).view(nblk, 1, page, -1)
    q = torch.randn(len(lens), 8, 32, generator=g)
    with pytest.raises(ValueError, match="pre_rope mode only"):
        run(plan, k_up, None, q, cache, bt, lens, mode="post_rope", config=WIDE)


# ---------------------------------------------------------------------------------
# Start-up choice of a layer's decoder (vllm_lowrank.attention.decoders)
# ---------------------------------------------------------------------------------
def decoder_layer(group_size, bits, mode, span, seed, ranks=None):
    """A stand-in layer (``tests/decoder_layer.py``) with random factors: uneven
    ranks, a float (``bits`` None), packed (``(k_bits, v_bits)``) or per-channel
    key (``"channel"``, 16-token groups) cache, and with ``span`` a
    token-adaptive span (16 sink and 32 recent tokens, float32 exact slots);
    and its :class:`DecoderContext` (float32, 16-token blocks, 1,024 tokens).
    ``ranks``: ``(key ranks, value ranks)`` per group instead."""
    from decoder_layer import StandInLayer, exact_span
    from vllm_lowrank.attention.decoders import DecoderContext

    kr, vr = ranks or (((40, 16), (24, 64)) if group_size == 2
                       else ((8, 24, 16, 32), (16, 8, 32, 24)))
    plan, k_up, *_ = make_problem(group_size=group_size, k_ranks=kr, v_ranks=vr, seed=seed)
    layout = (SlotLayout(kr, vr, 4, 4, k_channel_tokens=16) if bits == "channel"
              else SlotLayout(kr, vr, *bits) if bits else None)
    v_up = torch.zeros(plan.v_width, plan.shape.kv_width)
    gw = plan.group_width
    for gi, (off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks)):
        v_up[off:off + r, gi * gw:(gi + 1) * gw] = torch.randn(r, gw) / math.sqrt(r)
    layer = StandInLayer(
        plan, k_up=None if mode == "post_rope" else k_up.to(DEV), v_up=v_up.to(DEV),
        rope=None if mode == "post_rope" else make_rope(32, max_pos=1024), layout=layout,
        post_rope=mode == "post_rope", scale=0.2,
        exact=exact_span(plan, layout, torch.float32, 16, 32) if span else None)
    return layer, DecoderContext(torch.float32, DEV, 16, None, 1024)


def admitted(family, runs=None, factor=None):
    """``family`` with ``supports`` admitting every layer (the Triton families
    refuse CPU tensors, which the interpreter runs); its ``run`` counted in
    ``runs`` and, with ``factor``, its output multiplied by it (a kernel that
    computes the wrong attention)."""

    def run(self, query, kv_cache, batch, plan, out):
        family.run(self, query, kv_cache, batch, plan, out)
        if runs is not None:
            runs.append(query.shape[0])
        if factor is not None:
            out.mul_(factor)

    return type(f"Admitted{family.__name__}", (family,),
                {"supports": classmethod(lambda cls, layer, ctx: None), "run": run})


@pytest.mark.parametrize("group_size,bits,mode,span", [
    (2, None, "pre_rope", False),      # uneven ranks, 16-bit latents
    (1, (8, 4), "pre_rope", True),     # packed, token-adaptive span (LSE merge)
    (1, (4, 4), "post_rope", False),
    (2, "channel", "pre_rope", True),  # per-channel keys and the span
])
def test_self_check(group_size, bits, mode, span):
    """The self-check passes the decoder as it is and refuses one whose output
    (or, token-adaptive, the latent span's log-sum-exp) is off, on the layer's
    factors and a random cache."""
    from decoder_layer import triton_family
    from vllm_lowrank.attention import decoders

    layer, ctx = decoder_layer(group_size, bits, mode, span, 53)
    family = triton_family(layer, ctx)
    reference = decoders.TorchDecoder(layer, ctx)
    err = decoders.self_check(family(layer, ctx), reference)
    assert err < (1e-2 if ON_GPU else 1e-4)
    # what start-up serves: this family on a GPU, the torch path elsewhere
    chosen = decoders.choose(layer, ctx)
    assert type(chosen) is (family if ON_GPU else decoders.TorchDecoder)

    if span:
        # LSE off by one nat, outputs right: the merge weighs the latent part
        # e times too much (the self-check compares merged outputs; 0.1 nats
        # moves them by about 1 %, within the tolerance for bf16 rounding)
        class OffSpan(family.span_family):
            def span(self, *args):
                out, lse = super().span(*args)
                return out, lse + 1.0

        off = type("Off", (family,), {"span_family": OffSpan})
    else:
        off = admitted(family, factor=1.1)
    assert decoders.self_check(off(layer, ctx), reference) > decoders.SELF_CHECK_TOL


@pytest.mark.parametrize("kind", ["packed", "post-rope-keys"])
def test_self_check_covers_a_verify_step(kind):
    """A decoder that takes several query tokens per sequence (the packed
    kernel; the post-RoPE-keys kernel, whose tokens each have their own
    latent span and exact set) is self-checked on a verify step too: it
    agrees with the torch path's one-token rows, and one wrong only on verify
    steps is refused."""
    from decoder_layer import triton_family
    from vllm_lowrank.attention import decoders

    if kind == "packed":
        layer, ctx = decoder_layer(1, (8, 4), "post_rope", False, 53,
                                   ranks=((16,) * 4, (32,) * 4))
        family = triton_family(layer, ctx)
    else:  # keys at full width after RoPE, 4-bit per channel; 16 sink + 32 recent
        layer, ctx = decoder_layer(1, "channel", "post_rope", True, 53,
                                   ranks=((32,) * 4, (32,) * 4))
        family = decoders.PostRopeKeysDecoder
    decoder = family(layer, ctx)
    assert family.name == kind.replace("packed", "triton-packed") and decoder.takes_query_tokens
    reference = decoders.TorchDecoder(layer, ctx)
    assert decoders.self_check(decoder, reference) < (1e-2 if ON_GPU else 1e-4)

    class OffOnVerify(family):
        def run(self, query, kv_cache, batch, plan, out):
            super().run(query, kv_cache, batch, plan, out)
            if batch.query_start_loc is not None:
                out.mul_(1.1)

    assert decoders.self_check(OffOnVerify(layer, ctx), reference) > decoders.SELF_CHECK_TOL


def test_decoder_choice(monkeypatch, caplog):
    """The selection loop of :func:`decoders.choose`: a family that raises (here
    the CUDA kernel forced onto a layer outside its scope) is skipped, the next
    one that agrees is taken and warmed up (two self-check runs, two warm-up
    runs); when none agrees the layer decodes on the torch path, the refused
    family run by its self-check only (on a GPU: logged as a warning naming the
    refusal)."""
    import logging

    from decoder_layer import triton_family
    from vllm_lowrank.attention import decoders

    layer, ctx = decoder_layer(2, None, "pre_rope", False, 61)
    family = triton_family(layer, ctx)
    tried = []

    class ForcedCuda(decoders.CudaDecoder):
        name = "cuda-forced"

        @classmethod
        def supports(cls, layer, ctx):
            tried.append(cls.name)
            return None

    runs = []
    monkeypatch.setattr(decoders, "_LOGGED", set())
    monkeypatch.setattr(decoders, "candidates",
                        lambda layer: (ForcedCuda, admitted(family, runs), decoders.TorchDecoder))
    with caplog.at_level(logging.INFO, logger="vllm.lowrank"):
        chosen = decoders.choose(layer, ctx)
    assert tried == ["cuda-forced"]
    assert isinstance(chosen, family) and chosen.name == family.name
    assert runs == [2, 4, 1, 4]  # self-check (2 and 4 sequences), warm-up (1 and 4)
    assert any(f"decoder {family.name}" in r.getMessage() for r in caplog.records)

    runs.clear()
    caplog.clear()
    monkeypatch.setattr(decoders, "candidates",
                        lambda layer: (admitted(family, runs, factor=2.0), decoders.TorchDecoder))
    with caplog.at_level(logging.INFO, logger="vllm.lowrank"):
        chosen = decoders.choose(layer, ctx)
    assert type(chosen) is decoders.TorchDecoder
    assert runs == [2, 4]  # the self-check only: never warmed up, never served
    torch_lines = [r for r in caplog.records if "decoder torch" in r.getMessage()]
    assert torch_lines
    if ON_GPU:
        assert torch_lines[0].levelno == logging.WARNING
        assert "disagrees with the torch path" in torch_lines[0].getMessage()


# ---------------------------------------------------------------------------------
# RoPE-equivariant latents (decode_latent_rope): queries absorbed, latent pairs turned
# ---------------------------------------------------------------------------------
def equivariant_k_up(plan, g, neox):
    """A random key up-projection of the ``rope_equivariant`` structure: per head
    group, ``r / 2`` complex components on random RoPE frequencies, each a pair
    of rows ``(Re c, Im c)`` (:func:`vllm_lowrank.factorization.bases.rope_pairs`)."""
    from vllm_lowrank.factorization.bases import rope_pairs

    d, gs, gw = plan.shape.head_dim, plan.group_size, plan.group_width
    re, im = rope_pairs(d, gs, neox)
    k_up = torch.zeros(plan.k_width, plan.shape.num_kv_heads * d)
    for gi, (off, r) in enumerate(zip(plan.k_offsets(), plan.k_ranks)):
        blk = torch.zeros(r, gw)
        for k in range(r // 2):
            f = int(torch.randint(d // 2, (1,), generator=g))
            u = torch.randn(gs, 2, generator=g)
            blk[2 * k, re[f]], blk[2 * k, im[f]] = u[:, 0], u[:, 1]
            blk[2 * k + 1, re[f]], blk[2 * k + 1, im[f]] = -u[:, 1], u[:, 0]
        k_up[off:off + r, gi * gw:(gi + 1) * gw] = blk / math.sqrt(r)
    return k_up


@pytest.mark.parametrize("group_size,kr,vr,neox,bits,kct,span,window,splits,vc", [
    (4, (56,), (40,), True, None, None, None, None, 1, None),          # one group, 4 key chunks
    (2, (40, 16), (24, 64), False, None, None, None, None, 3, None),   # gptj, uneven ranks, split
    (4, (64,), (48,), True, (8, 4), None, (4, 17), None, 2, None),     # packed per token, TALE span
    (4, (56,), (40,), True, (4, 4), 16, (16, 17), None, 2, None),      # per-channel keys (KIVI), span
    # 4-byte aligned slots and offsets (76 and 100 bytes), as the served ~8x
    # storage's 400: the aligned code loads (tiles.known_multiple)
    (4, (64,), (48,), True, (4, 4), 16, (16, 17), None, 2, None),
    (2, (48, 32), (40, 24), True, (4, 4), 16, (16, 17), None, 1, None),
    (2, (48, 32), (32, 48), True, (2, 3), 16, (32, 17), None, 1, None),  # 2-bit keys per channel
    (2, (48, 32), (32, 48), True, (3, 2), None, (16, 1), 60, 1, None),   # 3-bit keys, window
    # 4-bit values in one program (32 value channels and more): the low and the
    # high nibbles in two dots (value rank 88; ranks 40 and 24 in two groups)
    (4, (56,), (88,), True, (4, 4), 16, (16, 17), None, 2, 128),
    (2, (48, 32), (40, 24), True, (8, 4), None, (4, 17), None, 1, 64),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_latent_rope(group_size, kr, vr, neox, bits, kct, span, window, splits, vc):
    """``mode="latent_rope"`` (absorbed queries, latent pairs turned by the RoPE
    table) equals the float64 key-rebuild reference (rebuild, RoPE, softmax) on
    a RoPE-equivariant ``k_up``, for every cache format the 8x recipe uses and
    ``vc`` value channels per program (``None``: the default); the torch
    pre_rope path agrees too."""
    from vllm_lowrank.attention.latent_attention import decode_attention

    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=group_size, k_ranks=kr,
                                                       v_ranks=vr, page=16, lens=TALE_LENS,
                                                       seed=71)
    k_up = equivariant_k_up(plan, g, neox)
    rope = make_rope(32, neox=neox, mscale=1.1)
    lat = torch.randn(nblk * page, plan.k_width + plan.v_width, generator=g)
    if bits is None:
        cache, layout = lat, None
        kd, vd = lat[:, :plan.k_width], lat[:, plan.k_width:]
    else:
        layout = SlotLayout(kr, vr, *bits, k_channel_tokens=kct)
        cache = layout.encode_complete(lat[:, :plan.k_width], lat[:, plan.k_width:])
        kd, vd = layout.decode(cache)
    sink, recent = span or (0, 0)
    q = torch.randn(len(lens), 8, 32, generator=g)
    cache = cache.view(nblk, 1, page, -1)
    assert dec.choose_kernel(plan, layout, "latent_rope", page, 32) == "latent_rope"
    out, lse = run(plan, k_up, rope, q, cache, bt, lens, num_splits=splits, layout=layout,
                   sink=sink, recent=recent, window=window, return_lse=True,
                   mode="latent_rope", config=dec.KernelConfig(value_chunk=vc) if vc else None)
    ref, ref_lse = span_reference(plan, k_up, rope, 0.2, q, gather(kd, bt, lens, page),
                                  gather(vd, bt, lens, page), lens, in_span(sink, recent, window))
    assert rel_err(out, ref) < TOL32
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - ref_lse[fin]).abs().max() < LSE_TOL
    torch_path = decode_attention(plan, k_up.to(DEV), rope, 0.2, q.to(DEV), cache.to(DEV),
                                  bt.clamp(max=nblk - 1).to(DEV), lens.to(DEV), int(lens.max()),
                                  layout=layout, sink=sink, recent=recent, window=window)
    assert rel_err(out, torch_path.double().cpu()) < TOL32


def test_latent_rope_refuses_other_bases():
    """A key up-projection that is not complex-linear per frequency (a random
    one) is refused with the reason, never decoded wrongly."""
    plan, k_up, lens, bt, nblk, page, g = make_problem(group_size=4, k_ranks=(56,),
                                                       v_ranks=(40,), seed=73)
    cache = float_cache(plan, nblk, page, g, torch.float32).view(nblk, 1, page, -1)
    q = torch.randn(len(lens), 8, 32, generator=g)
    with pytest.raises(ValueError, match="complex-linear"):
        run(plan, k_up, make_rope(32), q, cache, bt, lens, mode="latent_rope")
    with pytest.raises(ValueError, match="whole head"):
        run(plan, equivariant_k_up(plan, g, True), make_rope(16), q, cache, bt, lens,
            mode="latent_rope")
    # per-channel key groups must be whole tiles: no window, sinks in whole groups
    k_up = equivariant_k_up(plan, g, True)
    slots, layout, _, _ = channel_key_cache(plan, nblk, page, g, (4, 4), 16)
    slots = slots.view(nblk, 1, page, -1)
    with pytest.raises(ValueError, match="sliding window"):
        run(plan, k_up, make_rope(32), q, slots, bt, lens, layout=layout, window=20,
            mode="latent_rope")
    with pytest.raises(ValueError, match="not a multiple"):
        run(plan, k_up, make_rope(32), q, slots, bt, lens, layout=layout, sink=4, recent=3,
            mode="latent_rope", return_lse=True)
    # ... and a block must hold whole groups (the kernel addresses a tile's slots
    # from its group's first one)
    slots, layout, _, _ = channel_key_cache(plan, nblk, page, g, (4, 4), 32)
    with pytest.raises(ValueError, match="not a multiple of the per-channel key group"):
        run(plan, k_up, make_rope(32), q, slots.view(nblk, 1, page, -1), bt, lens,
            layout=layout, mode="latent_rope")
