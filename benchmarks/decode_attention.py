"""GPU decode attention over paged latent KV vs torch SDPA over full KV (issue #4).

Llama-3-8B attention shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, RoPE
theta 500000. Head groups: one KV head per group (G=1, the natural GQA case: each
latent serves the 4 query heads of its KV head), rank per group = ratio x 128 for K
and for V. Paged cache with 16-token blocks, block tables shuffled (non-contiguous
pages), every sequence at full context length.

Columns:
  kernel      cuda: the mma.sync kernel of vllm_lowrank/kernels/cuda/latent_decode.cu
              (the ``cuda`` decoder, vllm_lowrank.attention.decoders, which start-up
              chooses for a bf16 cache in its scope); triton: the Triton kernel
              (vllm_lowrank.kernels.triton.decode.LatentLaunch), the general path
  ours_us     median time of one decode-attention call (CUDA-graph replay, L2
              flushed before each replay)
  sdpa_us     torch SDPA, full bf16 K/V [B, 8, L, 128] contiguous, enable_gqa=True
  speedup     sdpa_us / ours_us
  GB/s        bytes our kernel must read (latents + packed B_k + q) / ours_us
  %copy       GB/s / device-to-device copy bandwidth measured in the same run
  max_abs     max |ours - ref|, ref = the torch path (vllm_lowrank.attention.
              latent_attention.decode_attention) in float32 on the same latents
  rel         ||ours - ref|| / ||ref||

Usage::

    python benchmarks/decode_attention.py                 # the table
    python benchmarks/decode_attention.py --sweep         # launch-parameter sweep
    python benchmarks/decode_attention.py --shapes 16x32k,8x128k --ratios 0.5
    python benchmarks/decode_attention.py --quant none --no-post   # issue-4 table
    python benchmarks/decode_attention.py --variants --shapes 16x8k,16x32k --ratios 0.5
    python benchmarks/decode_attention.py --span --shapes 16x8k,16x32k --ratios 0.5
    python benchmarks/decode_attention.py --groups --shapes 1x32k,16x4k,16x32k --ratios 0.5
    python benchmarks/decode_attention.py --settings recommended   # presets, candidates
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "benchmarks"))
from allocations import ALLOC_8X_SMOLLM2, scale_rank  # noqa: E402
from gpu_serving import JLRD_075_TALE  # noqa: E402
from vllm_lowrank.presets import PRESETS, TALE_CHANNEL_KEYS  # noqa: E402
from vllm_lowrank.attention.latent_attention import decode_attention  # noqa: E402
from vllm_lowrank.attention.rope import RopeTable  # noqa: E402
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402
from vllm_lowrank.kernels.triton.decode import (  # noqa: E402
    KernelConfig, LatentLaunch, choose_kernel, choose_num_splits)
from vllm_lowrank.kernels.triton.launch import needs_wide  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPES = {"1x32k": (1, 32768), "16x8k": (16, 8192), "16x32k": (16, 32768),
          "64x4k": (64, 4096), "8x128k": (8, 131072)}


def parse_shape(name):
    """``"16x32k"`` -> ``(16, 32768)``: batch x context tokens (``k`` = 1,024)."""
    try:
        bsz, length = name.lower().split("x")
        mult = 1024 if length.endswith("k") else 1
        return int(bsz), int(length.rstrip("k")) * mult
    except ValueError:
        raise SystemExit(f"--shapes: {name!r} is not BATCHxCONTEXT (e.g. 16x32k)") from None


# ---------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------
_FLUSH = None


def flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()


def time_graph(fn, reps=30, warmup=3):
    """Median microseconds of ``fn`` replayed from a CUDA graph, L2 flushed before
    each replay (the flush is outside the timed region)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times), times


def copy_bandwidth(nbytes=2 * 2**30):
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del x, y
    return 2 * nbytes / statistics.median(ts) / 1e9  # GB/s, read + write


# ---------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------
def llama3_rope(max_pos, device):
    """Llama-3.1 RoPE table (theta 5e5, llama3 frequency scaling, factor 8)."""
    rot = HEAD_DIM
    inv = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    factor, lo, hi, old = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    t = torch.arange(max_pos, dtype=torch.float32)
    ang = torch.outer(t, scaled.float())  # float32 angles, as vLLM computes them
    return RopeTable(ang.cos().to(device), ang.sin().to(device), rot, True)


def make_plan(k_ranks, v_ranks):
    shape = AttentionShape(HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM)
    return LayerPlan(shape, 1, tuple(k_ranks), tuple(v_ranks))


def make_problem(plan, batch, length, quant_bits, seed=0, lens=None, device="cuda"):
    dev = device
    g = torch.Generator(device=dev).manual_seed(seed)
    gw = plan.group_width
    k_up = torch.zeros(plan.k_width, KV_HEADS * HEAD_DIM, device=dev)
    for gi, off in enumerate(plan.k_offsets()):
        r = plan.k_ranks[gi]
        k_up[off:off + r, gi * gw:(gi + 1) * gw] = torch.randn(
            r, gw, device=dev, generator=g) / math.sqrt(r)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev) if lens is None else lens
    per = math.ceil(length / PAGE)
    num_blocks = batch * per
    bt = torch.randperm(num_blocks, device=dev, generator=g).int().view(batch, per)
    width = plan.k_width + plan.v_width
    layout = None
    latents = None
    if quant_bits is None:
        cache = torch.randn(num_blocks, 1, PAGE, width, device=dev, generator=g,
                            dtype=torch.bfloat16)
    else:
        kb, vb = quant_bits
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, kb, vb)
        chunk = 65536
        lat_rows = num_blocks * PAGE
        cache = torch.empty(lat_rows, layout.slot_bytes, dtype=torch.uint8, device=dev)
        for s in range(0, lat_rows, chunk):
            n = min(chunk, lat_rows - s)
            lat = torch.randn(n, width, device=dev, generator=g)
            cache[s:s + n] = layout.encode(lat[:, :plan.k_width], lat[:, plan.k_width:])
        cache = cache.view(num_blocks, 1, PAGE, layout.slot_bytes)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    q_lat = torch.randn(batch, HEADS, max(plan.k_ranks), device=dev, generator=g,
                        dtype=torch.bfloat16)
    return dict(k_up=k_up, lens=lens, bt=bt, cache=cache, layout=layout, q=q, q_lat=q_lat,
                num_blocks=num_blocks, latents=latents)


def reference(plan, rope, p, scale, mode="pre_rope"):
    """float32 torch path, one sequence at a time (bounded memory). ``post_rope``:
    scores ``q~ . c_k`` in the latent basis, same softmax and value path."""
    cache = p["cache"]
    if p["layout"] is not None:
        rows = cache.view(-1, p["layout"].slot_bytes)
        parts = []
        for s in range(0, rows.shape[0], 1 << 20):
            kd, vd = p["layout"].decode(rows[s:s + (1 << 20)])
            parts.append(torch.cat([kd, vd], -1))
        cache = torch.cat(parts).view(cache.shape[0], 1, PAGE, -1)
    if mode == "post_rope":
        from vllm_lowrank.attention.latent_attention import gather_latents

        hg = plan.heads_per_group
        outs = []
        for b in range(p["q"].shape[0]):
            n = int(p["lens"][b])
            lat = gather_latents(cache, p["bt"][b:b + 1], n)[0].float()  # [n, Rk+Rv]
            row = []
            for g, (ko, vo) in enumerate(zip(plan.k_offsets(), plan.v_offsets())):
                rk, rv = plan.k_ranks[g], plan.v_ranks[g]
                qg = p["q_lat"][b, g * hg:(g + 1) * hg, :rk].float()
                pr = torch.softmax(scale * qg @ lat[:, ko:ko + rk].T, -1)
                row.append((pr @ lat[:, plan.k_width + vo:plan.k_width + vo + rv]).flatten())
            outs.append(torch.cat(row))
        return torch.stack(outs)
    outs = []
    for b in range(p["q"].shape[0]):
        n = int(p["lens"][b])
        outs.append(decode_attention(plan, p["k_up"], rope, scale, p["q"][b:b + 1].float(),
                                     cache, p["bt"][b:b + 1], p["lens"][b:b + 1], n))
    return torch.cat(outs)


def _cuda_kernel_available() -> bool:
    """True when the CUDA pre-RoPE decode kernel (vllm_lowrank.kernels.cuda.ext) builds here."""
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    try:
        cuda_ext.load("latent_decode")
    except RuntimeError as exc:
        print(f"CUDA extension unavailable: {exc}")
        return False
    return True


class CudaLaunch:
    """The CUDA pre-RoPE kernel of one layer prepared as the ``cuda`` decoder
    prepares it (:class:`vllm_lowrank.attention.decoders.CudaDecoder`): its
    packed key weights, and per call the split of its wave model; called like
    :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch`."""

    def __init__(self, plan, k_up, rope, scale):
        from vllm_lowrank.kernels.cuda import ext as cuda_ext

        self.plan, self.rope, self.scale, self.ext = plan, rope, scale, cuda_ext
        self.weights = cuda_ext.pack_key_weights_t(plan, k_up, rope.neox, torch.bfloat16)
        self.tokens_per_step = 32 * cuda_ext.decode_config(plan.k_ranks[0], plan.v_ranks[0])[0]

    def geometry(self, bsz, max_seq_len):
        """``(num_splits,)``: the split the ``cuda`` decoder plans."""
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        return (choose_num_splits(bsz, self.plan.num_groups, max_seq_len,
                                  self.tokens_per_step, n_sm, 1),)

    def __call__(self, q, cache, bt, lens, max_seq_len, *, num_splits=None, out=None):
        splits = num_splits or self.geometry(q.shape[0], max_seq_len)[0]
        return self.ext.latent_decode_pre_rope(q, cache, bt, lens, self.weights, self.rope,
                                               self.scale, num_splits=splits, out=out)


def prepare_launch(plan, rope, p, *, mode="pre_rope", cfg=None, backend="triton", **kw):
    """One layer's decode of problem ``p`` prepared once: ``backend`` ``"triton"``
    a :class:`LatentLaunch` (``cfg``: its :class:`KernelConfig`; ``kw``: its
    ``transform``, ``window``, ``sink``, ``recent``), ``"cuda"`` a
    :class:`CudaLaunch`."""
    scale = HEAD_DIM ** -0.5
    if backend == "cuda":
        return CudaLaunch(plan, p["k_up"], rope, scale)
    q = p["q"] if mode == "pre_rope" else p["q_lat"]
    return LatentLaunch(plan, p["layout"], mode=mode, scale=scale, dtype=q.dtype,
                        device=q.device, block_size=p["cache"].shape[2],
                        k_up=None if mode == "post_rope" else p["k_up"],
                        rope=None if mode == "post_rope" else rope,
                        cache_dtype=None if p["layout"] is not None else p["cache"].dtype,
                        config=cfg, **kw)


def _heuristic_splits(plan, rope, p, kernel="triton"):
    """The split count the decoder of this case picks by default."""
    launch = prepare_launch(plan, rope, p, backend=kernel)
    return launch.geometry(p["q"].shape[0], int(p["lens"].max()))[0]


def kernel_bytes(plan, p):
    """Bytes the kernel must read: latent slots (only the group rows it uses),
    packed B_k (per group 2 sections x pad(r_k) x 64, bf16), q."""
    b = p["q"].shape[0]
    tokens = int(p["lens"].sum())
    if p["layout"] is None:
        lat = tokens * (plan.k_width + plan.v_width) * 2
    else:
        lat = tokens * p["layout"].slot_bytes
    wk = sum(2 * max(16, 1 << math.ceil(math.log2(r))) * 64 * 2 for r in plan.k_ranks)
    return lat + wk + b * HEADS * HEAD_DIM * 2


def sdpa_case(batch, length):
    dev = "cuda"
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, enable_gqa=True)
    t, _ = time_graph(fn)
    nbytes = 2 * k.numel() * 2 + q.numel() * 2
    return t, nbytes


# ---------------------------------------------------------------------------------
# Main table
# ---------------------------------------------------------------------------------
def run_case(plan, rope, p, cfg=None, num_splits=None, check=True, mode="pre_rope", ref=None,
             backend="triton"):
    """``(us, max_abs, rel)`` of one decode-attention call of problem ``p``
    (:func:`prepare_launch`), timed by :func:`time_graph`; with ``check``
    against ``ref`` (``None``: :func:`reference`)."""
    scale = HEAD_DIM ** -0.5
    b = p["q"].shape[0]
    out = torch.empty(b, plan.out_width, device=p["q"].device)
    max_len = int(p["lens"].max())
    q = p["q"] if mode == "pre_rope" else p["q_lat"]
    launch = prepare_launch(plan, rope, p, mode=mode, cfg=cfg, backend=backend)

    def fn():
        launch(q, p["cache"], p["bt"], p["lens"], max_len, num_splits=num_splits, out=out)

    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    err = rel = float("nan")
    if check:
        assert torch.isfinite(out).all(), "output not fully written"
        if ref is None:
            ref = reference(plan, rope, p, scale, mode=mode)
        err = (out - ref).abs().max().item()
        rel = ((out - ref).norm() / ref.norm()).item()
    t, _ = time_graph(fn)
    return t, err, rel


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ratios", default="0.5,0.25")
    ap.add_argument("--quant", default="none,k8v4", help="none, k8v4, k4v4 (comma list)")
    ap.add_argument("--sweep", action="store_true", help="launch-parameter sweep")
    ap.add_argument("--no-post", action="store_true", help="skip the post-RoPE rows")
    ap.add_argument("--no-cuda", action="store_true",
                    help="skip the CUDA pre-RoPE kernel rows (Triton only)")
    ap.add_argument("--json", default=None, help="write all rows to this file")
    ap.add_argument("--variants", action="store_true",
                    help="only: plain vs key bias + QK-norm vs sliding window (pre-RoPE)")
    ap.add_argument("--span", action="store_true",
                    help="only: plain vs token-adaptive latent span (sink 4, recent 128), "
                         "with and without return_lse (pre-RoPE, bf16)")
    ap.add_argument("--groups", action="store_true",
                    help="only: head groupings G = 1, 2, 4, 8 (uniform ranks, 16-bit), the "
                         "grid kernel (where its key tile fits) vs the wide-group kernel")
    ap.add_argument("--wide-sweep", action="store_true",
                    help="with --groups: launch-parameter sweep of the wide-group kernel")
    ap.add_argument("--quant-sweep", action="store_true",
                    help="launch-parameter sweep of the grid kernel on packed caches "
                         "(QUANT_SWEEP_CASES)")
    ap.add_argument("--settings", choices=["recommended"], default=None,
                    help="one row per recommended setting (presets and candidates), "
                         "default shapes 1x32k,16x32k,64x4k,8x128k")
    ap.add_argument("--settings-sweep", action="store_true",
                    help="--settings: launch variants of each setting's latent kernel")
    ap.add_argument("--only", nargs="*", default=None,
                    help="--settings: the settings whose label contains one of these")
    ap.add_argument("--packed-sweep", action="store_true",
                    help="the packed post-RoPE kernel against the grid kernel, with its "
                         "launch sweep (PACKED_SWEEP_CASES)")
    ap.add_argument("--quant-sweep-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sweep-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sdpa", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bw", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sweep_one:
        rope = llama3_rope(131072 + 1024, "cuda")
        sweep(rope, args.shapes.split(","), [float(r) for r in args.ratios.split(",")],
              args.bw, json.loads(args.sdpa), only=json.loads(args.sweep_one))
        return

    if args.quant_sweep_one:
        rope = llama3_rope(131072 + 1024, "cuda")
        quant_sweep(rope, args.shapes.split(","), json.loads(args.sdpa),
                    only=json.loads(args.quant_sweep_one))
        return

    dev = torch.cuda.get_device_name()
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    import triton
    print(f"device: {dev} ({n_sm} SMs), torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)")
    rope = llama3_rope(131072 + 1024, "cuda")
    rows = []
    shapes = args.shapes.split(",")
    if args.settings and args.shapes == ",".join(SHAPES):
        shapes = ["1x32k", "16x32k", "64x4k", "8x128k"]
    ratios = [float(r) for r in args.ratios.split(",")]
    quants = args.quant.split(",")
    qbits = {"none": None, "k8v4": (8, 4), "k4v4": (4, 4)}

    if args.span:
        print("\n".join(span_rows(rope, shapes, ratios[0])))
        return

    sdpa = {}
    for name in shapes:
        bsz, length = parse_shape(name)
        sdpa[name] = sdpa_case(bsz, length)
        torch.cuda.empty_cache()

    if args.settings:
        lines = (settings_sweep if args.settings_sweep else settings_rows)(
            rope, shapes, sdpa, args.only)
        print(f"\ndevice: {dev}")
        print("\n".join(lines))
        return
    if args.sweep:
        sweep(rope, shapes, ratios, bw, sdpa)
        return
    if args.quant_sweep or args.packed_sweep:
        quant_sweep(rope, shapes, sdpa,
                    cases=PACKED_SWEEP_CASES if args.packed_sweep else QUANT_SWEEP_CASES)
        return
    if args.variants:
        print("\n".join(variant_rows(rope, shapes, ratios[0])))
        return
    if args.groups:
        lines = grouping_rows(rope, shapes, ratios[0], sdpa, args.wide_sweep)
        print(f"\ndevice: {dev}")
        print("\n".join(lines))
        return

    hdr = (f"{'shape':>7} {'ratio':>5} {'cache':>5} {'kernel':>6} {'S':>3} {'ours_us':>8} "
           f"{'sdpa_us':>8} {'speedup':>7} {'GB/s':>6} {'%copy':>6} {'max_abs':>8} {'rel':>8}  "
           f"{'best S':>6} {'best_us':>8} {'best_x':>6}")
    lines = [hdr]
    cuda_ok = not args.no_cuda and _cuda_kernel_available()
    for ratio in ratios:
        r = int(round(ratio * HEAD_DIM))
        plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
        for qname in quants:
            for name in shapes:
                bsz, length = parse_shape(name)
                p = make_problem(plan, bsz, length, qbits[qname])
                ref = reference(plan, rope, p, HEAD_DIM ** -0.5)
                # The CUDA decoder serves the unquantized cache (start-up chooses it
                # there); the Triton kernel is timed beside it.
                kernels = ("cuda", "triton") if cuda_ok and qname == "none" else ("triton",)
                for kern in kernels:
                    t, err, rel = run_case(plan, rope, p, ref=ref, backend=kern)
                    s_h = _heuristic_splits(plan, rope, p, kern)
                    best = (t, s_h)
                    for s_try in sorted({1, 2, 4, 8, 16, 32} - {s_h}):
                        if s_try > math.ceil(length / 128):
                            continue
                        ts_, _, _ = run_case(plan, rope, p, num_splits=s_try, check=False,
                                             backend=kern)
                        best = min(best, (ts_, s_try))
                    gbs = kernel_bytes(plan, p) / t / 1e3
                    ts, _ = sdpa[name]
                    line = (f"{name:>7} {ratio:>5} {qname:>5} {kern:>6} {s_h:>3} {t:8.1f} "
                            f"{ts:8.1f} {ts / t:7.2f} {gbs:6.0f} {100 * gbs / bw:5.1f}% "
                            f"{err:8.1e} {rel:8.1e}  {best[1]:>6} {best[0]:8.1f} "
                            f"{ts / best[0]:6.2f}")
                    print(line, flush=True)
                    lines.append(line)
                    rows.append(dict(shape=name, ratio=ratio, cache=qname, kernel=kern,
                                     splits=s_h, ours_us=t, sdpa_us=ts, gbs=gbs, copy_gbs=bw,
                                     max_abs=err, rel=rel, best_splits=best[1],
                                     best_us=best[0]))
                del p, ref
                torch.cuda.empty_cache()
    if not args.no_post:
        lines += post_rope_rows(rope, bw, sdpa, rows, [s_ for s_ in ("16x32k", "8x128k")
                                                       if s_ in shapes])
    print()
    print(f"device: {dev}; copy {bw:.0f} GB/s; SDPA full-KV GB/s: " + ", ".join(
        f"{k} {v[1] / v[0] / 1e3:.0f}" for k, v in sdpa.items()))
    print("\n".join(lines))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


def grouping_rows(rope, shapes, ratio, sdpa, wide_sweep=False):
    """Pre-RoPE bf16 decode for head groups of G = 1, 2, 4, 8 KV heads (uniform
    rank ``ratio * G * 128`` per group for keys and values: the same bytes per
    token for every G), each kernel that can run it: the CUDA kernel (G = 1),
    the Triton grid kernel (where its key tile fits in one program) and the
    wide-group kernel (one program per KV head, the rank in chunks).
    ``TFLOP/s``: key-rebuild multiply-adds (``8 * ratio * G * 128^2`` per token,
    x2) per second; ``rel`` against the float32 torch path."""
    shape = AttentionShape(HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    lines = [f"{'shape':>7} {'ratio':>5} {'G':>2} {'rank':>5} {'kernel':>6} {'us':>9} "
             f"{'x sdpa':>6} {'TFLOP/s':>7} {'rel':>8}"]
    cuda_ok = _cuda_kernel_available()
    for name in shapes:
        bsz, length = parse_shape(name)
        ts = sdpa[name][0]
        for gs in (1, 2, 4, 8):
            r = int(round(ratio * gs * HEAD_DIM))
            plan = LayerPlan(shape, gs, (r,) * (KV_HEADS // gs), (r,) * (KV_HEADS // gs))
            p = make_problem(plan, bsz, length, None)
            ref = reference(plan, rope, p, scale)
            kernels = [("cuda", None, "cuda")] if gs == 1 and cuda_ok else []
            if not needs_wide(plan, None, HEAD_DIM):
                kernels.append(("grid", KernelConfig(wide=False), "triton"))
            kernels.append(("wide", KernelConfig(wide=True), "triton"))
            for label, cfg, backend in kernels:
                try:
                    t, _, rel = run_case(plan, rope, p, cfg=cfg, ref=ref, backend=backend)
                except Exception as exc:  # noqa: BLE001 (a kernel that cannot run: a row)
                    lines.append(f"{name:>7} {ratio:>5} {gs:>2} {r:>5} {label:>6} "
                                 f"{type(exc).__name__}")
                    print(lines[-1], flush=True)
                    continue
                flops = 2 * 8 * ratio * gs * HEAD_DIM ** 2 * bsz * length
                lines.append(f"{name:>7} {ratio:>5} {gs:>2} {r:>5} {label:>6} {t:9.1f} "
                             f"{ts / t:6.2f} {flops / t / 1e6:7.1f} {rel:8.1e}")
                print(lines[-1], flush=True)
            if wide_sweep and gs == 8:
                lines += _wide_sweep(plan, rope, p, ts, name, gs, r)
            del p, ref
            torch.cuda.empty_cache()
    return lines


def _wide_sweep(plan, rope, p, ts, name, gs, r):
    """Launch parameters of the wide-group kernel, fastest first."""
    import itertools

    found = []
    for bn, nw, rc, st in itertools.product((32, 64, 128), (4, 8), (32, 64), (2, 3)):
        cfg = KernelConfig(wide=True, block_n=bn, num_warps=nw, rank_chunk=rc, num_stages=st)
        try:
            t, _, _ = run_case(plan, rope, p, cfg=cfg, check=False)
        except Exception as exc:  # noqa: BLE001
            found.append((float("inf"), f"bn={bn} w={nw} rc={rc} st={st}: "
                                        f"{type(exc).__name__}"))
            continue
        found.append((t, f"bn={bn} w={nw} rc={rc} st={st}"))
    found.sort()
    out = [f"  wide sweep {name} G={gs} rank {r} (SDPA {ts:.1f} us):"]
    out += [f"    {t:9.1f} us  x{ts / t:5.2f}  {cfg}" for t, cfg in found[:8]]
    out += [f"    failed: {cfg}" for t, cfg in found if t == float("inf")][:4]
    print("\n".join(out), flush=True)
    return out


def variant_rows(rope, shapes, ratio, window=4096):
    """Pre-RoPE bf16 decode with the per-architecture key transforms, timed side
    by side with the plain kernel on the same cache: Qwen2's key bias plus a
    Qwen3/Gemma-3 QK-norm (``transform``), a sliding window (Gemma-3, Mistral)
    of ``window`` tokens, and both. ``max_abs`` is against the torch path."""
    from vllm_lowrank.attention.latent_attention import KeyTransform, decode_attention

    r = int(round(ratio * HEAD_DIM))
    plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
    g = torch.Generator(device="cuda").manual_seed(1)
    transform = KeyTransform(
        bias=torch.randn(KV_HEADS * HEAD_DIM, device="cuda", generator=g),
        norm_weight=1 + 0.3 * torch.randn(HEAD_DIM, device="cuda", generator=g),
        norm_eps=1e-6)
    scale = HEAD_DIM ** -0.5
    lines = [f"{'shape':>7} {'ratio':>5} {'variant':>16} {'us':>8} {'vs plain':>8} {'max_abs':>8}"]
    for name in shapes:
        bsz, length = parse_shape(name)
        p = make_problem(plan, bsz, length, None)
        max_len = int(p["lens"].max())
        base = None
        for label, kw in (("plain", {}), ("bias+qk-norm", {"transform": transform}),
                          (f"window {window}", {"window": window}),
                          ("both", {"transform": transform, "window": window})):
            out = torch.empty(bsz, plan.out_width, device="cuda")
            launch = prepare_launch(plan, rope, p, **kw)

            def fn(launch=launch, out=out):
                launch(p["q"], p["cache"], p["bt"], p["lens"], max_len, out=out)

            fn()
            ref = decode_attention(plan, p["k_up"], rope, scale, p["q"], p["cache"], p["bt"],
                                   p["lens"], max_len, transform=kw.get("transform"),
                                   window=kw.get("window"), min_seq_len=max_len) \
                if bsz * length <= 16 * 8192 else None
            err = (out - ref).abs().max().item() if ref is not None else float("nan")
            t, _ = time_graph(fn)
            base = base or t
            lines.append(f"{name:>7} {ratio:>5} {label:>16} {t:8.1f} {base / t:8.2f} {err:8.1e}")
            print(lines[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    return lines


def span_rows(rope, shapes, ratio, sink=4, recent=128):
    """Pre-RoPE bf16 decode in token-adaptive (TALE) mode: the kernel attends the
    latent span ``sink <= t < seq_len - recent`` only (the sink and recent
    positions are attended exactly elsewhere), with and without the span's
    log-sum-exp (``return_lse``, what the merge needs), timed side by side with
    the plain kernel over the whole context on the same cache (timed again last:
    the spread of two timings of one kernel). ``max_abs`` and ``lse_abs`` are
    against the torch path (decode_attention with the same arguments; shapes up
    to 16 x 8k)."""
    r = int(round(ratio * HEAD_DIM))
    plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
    scale = HEAD_DIM ** -0.5
    lines = [f"{'shape':>7} {'ratio':>5} {'variant':>22} {'us':>8} {'vs plain':>8} "
             f"{'max_abs':>8} {'lse_abs':>8}"]
    for name in shapes:
        bsz, length = parse_shape(name)
        p = make_problem(plan, bsz, length, None)
        max_len = int(p["lens"].max())
        base = None
        for label, kw in (("plain", {}),
                          (f"span {sink}/{recent}", {"sink": sink, "recent": recent}),
                          (f"span {sink}/{recent} +lse",
                           {"sink": sink, "recent": recent, "return_lse": True}),
                          ("plain (again)", {})):
            out = torch.empty(bsz, plan.out_width, device="cuda")
            res = {}
            lse = kw.get("return_lse", False)
            launch = prepare_launch(plan, rope, p, sink=kw.get("sink", 0),
                                    recent=kw.get("recent", 0))

            def fn(launch=launch, lse=lse, out=out, res=res):
                res["r"] = launch(p["q"], p["cache"], p["bt"], p["lens"], max_len, out=out,
                                  return_lse=lse)

            fn()
            err = lse_err = float("nan")
            if bsz * length <= 16 * 8192:
                ref = decode_attention(plan, p["k_up"], rope, scale, p["q"], p["cache"],
                                       p["bt"], p["lens"], max_len, return_lse=True,
                                       sink=kw.get("sink", 0), recent=kw.get("recent", 0))
                err = (out - ref[0]).abs().max().item()
                if kw.get("return_lse"):
                    lse_err = (res["r"][1] - ref[1]).abs().max().item()
                del ref
            t, _ = time_graph(fn)
            base = base or t
            lines.append(f"{name:>7} {ratio:>5} {label:>22} {t:8.1f} {base / t:8.2f} "
                         f"{err:8.1e} {lse_err:8.1e}")
            print(lines[-1], flush=True)
        del p
        torch.cuda.empty_cache()
    return lines


def post_rope_rows(rope, bw, sdpa, rows, shapes, ratios=(0.5, 0.25)):
    """Post-RoPE latent mode: the Triton kernel on bf16 and K8/V4 caches (the
    grid kernel, and the packed kernel where it reads the cache)."""
    out = ["", "post-RoPE mode (queries in the key-latent basis, no rebuild):",
           f"{'shape':>7} {'ratio':>5} {'cache':>5} {'path':>13} {'us':>8} {'x sdpa':>6} "
           f"{'GB/s':>6} {'%copy':>6} {'rel':>8}"]
    scale = HEAD_DIM ** -0.5
    for ratio, name in [(r_, n_) for r_ in ratios for n_ in shapes]:
        r = int(round(ratio * HEAD_DIM))
        plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
        bsz, length = parse_shape(name)
        for qname, bits in (("none", None), ("k8v4", (8, 4))):
            p = make_problem(plan, bsz, length, bits)
            nbytes = kernel_bytes(plan, p) - sum(2 * max(16, r) * 64 * 2 for _ in plan.k_ranks) \
                - bsz * HEADS * (HEAD_DIM - r) * 2
            ref = reference(plan, rope, p, scale, mode="post_rope")
            t, err, rel = run_case(plan, rope, p, mode="post_rope", ref=ref)
            cases = [("triton", t, rel)]
            for path, tt, rr in cases:
                gbs = nbytes / tt / 1e3
                line = (f"{name:>7} {ratio:>5} {qname:>5} {path:>13} {tt:8.1f} "
                        f"{sdpa[name][0] / tt:6.2f} {gbs:6.0f} {100 * gbs / bw:5.1f}% {rr:8.1e}")
                print(line, flush=True)
                out.append(line)
                rows.append(dict(post_rope=name, ratio=ratio, cache=qname, path=path, us=tt,
                                 rel=rr))
            del p, ref
            torch.cuda.empty_cache()
    return out


SWEEP_VARIANTS = [
    # (BLOCK_N=64, 4 warps, transposed, 1 group) is left out: triton 3.6
    # miscompiles it for bf16 (wrong scores, then an illegal address).
    dict(block_n=128, num_warps=8, num_stages=3, transposed=True, groups_per_program=1),
    dict(block_n=128, num_warps=8, num_stages=2, transposed=True, groups_per_program=2),
    dict(block_n=64, num_warps=8, num_stages=3, transposed=True, groups_per_program=2),
    dict(block_n=64, num_warps=4, num_stages=3, transposed=False, groups_per_program=2),
    dict(block_n=64, num_warps=8, num_stages=2, transposed=True, groups_per_program=4),
    dict(block_n=32, num_warps=4, num_stages=3, transposed=False, groups_per_program=4),
    dict(mode="post_rope", block_n=128, num_warps=8, num_stages=3, transposed=True,
         groups_per_program=1),
    dict(mode="post_rope", block_n=64, num_warps=8, num_stages=3, transposed=True,
         groups_per_program=4),
    dict(mode="post_rope", block_n=64, num_warps=4, num_stages=3, transposed=True,
         groups_per_program=4),
    dict(mode="post_rope", block_n=64, num_warps=4, num_stages=3, transposed=True,
         groups_per_program=2),
    dict(mode="post_rope", block_n=128, num_warps=4, num_stages=2, transposed=False,
         groups_per_program=2),
]


QUANT_SWEEP_CASES = [(1.0, "k8v4", "post_rope"), (1.0, "k8v8", "pre_rope"),
                     (0.5, "k4v4", "pre_rope")]
"""Packed-cache settings of the serving benchmark (``benchmarks/gpu_serving.py``
``pr-k8v4``, ``g1-k8v8``, ``g1-k4v4``): ratio, bits, mode."""


PACKED_SWEEP_CASES = [(1.0, "k8v4", "post_rope", "packed"), (1.0, "k8v8", "post_rope", "packed"),
                      (1.0, "k4v4", "post_rope", "packed"), (0.5, "k8v4", "post_rope", "packed")]
"""Per-token packed post-RoPE settings of the packed kernel (:mod:`.decode_packed`):
the ``2x`` preset (ratio 1.0, K8/V4) first."""


PACKED_SWEEP_LAUNCHES = [(32, 1, 3), (64, 2, 2), (64, 2, 3), (128, 4, 3), (128, 8, 2)]
"""``(BLOCK_N, warps, stages)`` of the packed kernel's sweep, each with the
heuristic split (:data:`~vllm_lowrank.kernels.triton.launch.PACKED_CONFIG`'s
programs per SM) and explicit splits: the fastest launches of an H200 sweep of
``BLOCK_N`` 32 / 64 / 128 x 1 / 2 / 4 / 8 warps x 2-4 stages, and the earlier
default ``(128, 8, 2)``."""


PACKED_SWEEP_SPLITS = (None, 4, 16, 64)
"""Context splits of each packed launch in the sweep (``None``: the heuristic)."""


def quant_sweep(rope, shapes, sdpa, only=None, cases=None):
    """Launch-parameter sweep on packed caches (G = 1). Grid-kernel cases
    (:data:`QUANT_SWEEP_CASES`): every ``BLOCK_N`` x warps x stages x transposed
    variant against the built-in default. Packed-kernel cases
    (:data:`PACKED_SWEEP_CASES`, fourth field ``"packed"``): the grid kernel's
    default, the packed kernel's default and every ``BLOCK_N`` x warps x stages
    variant of it. Each is checked against the float32 reference (``rel`` >
    1e-2: wrong, not a candidate); ``GB/s``: cache bytes read (slots of the
    attended tokens) per second. One process per case and shape (a variant that
    faults the CUDA context loses only its case)."""
    import subprocess

    if only is None:
        print(f"{'shape':>7} {'ratio':>5} {'cache':>5} {'mode':>9} {'variant':>22} "
              f"{'us':>8} {'x sdpa':>6} {'GB/s':>6} {'rel':>8}", flush=True)
        for case in cases or QUANT_SWEEP_CASES:
            for name in shapes:
                cmd = [sys.executable, __file__, "--quant-sweep-one", json.dumps(case),
                       "--shapes", name, "--sdpa", json.dumps({name: sdpa[name][0]})]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
                print(r.stdout, end="", flush=True)
                if r.returncode:
                    print(f"  case {case} {name} failed: "
                          f"{(r.stderr.strip().splitlines() or [''])[-1][:160]}", flush=True)
        return
    ratio, qname, mode, *kernel = only
    packed = kernel == ["packed"]
    bits = {"k8v4": (8, 4), "k8v8": (8, 8), "k4v4": (4, 4)}[qname]
    r = int(round(ratio * HEAD_DIM))
    plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
    if packed:
        variants = [dict(packed=False), dict(packed=True)] + [
            dict(block_n=b, num_warps=w, num_stages=st, packed=True, num_splits=sp)
            for b, w, st in PACKED_SWEEP_LAUNCHES for sp in PACKED_SWEEP_SPLITS]
    else:
        variants = [None] + [dict(block_n=b, num_warps=w, num_stages=st, transposed=t,
                                  groups_per_program=1)
                             for b in (32, 64, 128) for w in (4, 8) for st in (2, 3)
                             for t in (False, True)]
    for name in shapes:
        bsz, length = parse_shape(name)
        p = make_problem(plan, bsz, length, bits)
        ref = reference(plan, rope, p, HEAD_DIM ** -0.5, mode=mode)
        best = None
        nbytes = int(p["lens"].sum()) * p["layout"].slot_bytes
        for v in variants:
            if v is None or "block_n" not in v:
                label = "default" if v is None else (
                    "packed default" if v["packed"] else "grid default")
            elif packed:
                label = (f"packed N{v['block_n']} w{v['num_warps']} s{v['num_stages']} "
                         f"S{v['num_splits'] or 'h'}")
            else:
                label = (f"N{v['block_n']} w{v['num_warps']} s{v['num_stages']} "
                         f"{'T' if v['transposed'] else 'F'}")
            try:
                kw = dict(v or {})
                splits = kw.pop("num_splits", None)
                t, _, rel = run_case(plan, rope, p, cfg=KernelConfig(**kw) if kw else None,
                                     ref=ref, mode=mode, num_splits=splits)
            except Exception as exc:  # noqa: BLE001 (reported)
                print(f"{name:>7} {ratio:>5} {qname:>5} {mode:>9} {label:>22}  "
                      f"{type(exc).__name__}", flush=True)
                continue
            ts = sdpa[name]
            print(f"{name:>7} {ratio:>5} {qname:>5} {mode:>9} {label:>22} {t:8.1f} "
                  f"{ts / t:6.2f} {nbytes / t / 1e3:6.0f} {rel:8.1e}", flush=True)
            if rel < 1e-2 and (best is None or t < best[0]):
                best = (t, label)
        if best:
            print(f"{name:>7} {ratio:>5} {qname:>5} {mode:>9} best: {best[1]} {best[0]:.1f} us",
                  flush=True)


def sweep(rope, shapes, ratios, bw, sdpa, only=None):
    """Time launch-parameter variants, each in its own process (a miscompiled
    variant can poison the CUDA context); every variant is checked against the
    reference (rel >> 1e-2 is marked BAD)."""
    import subprocess

    if only is None:
        print(f"{'shape':>7} {'ratio':>5} {'variant':>24} {'pps':>3} {'S':>3} {'us':>8} "
              f"{'%copy':>6} {'x sdpa':>6} {'rel':>8}", flush=True)
        for v in SWEEP_VARIANTS:
            cmd = [sys.executable, __file__, "--sweep-one", json.dumps(v), "--shapes",
                   ",".join(shapes), "--ratios", ",".join(map(str, ratios)),
                   "--sdpa", json.dumps({k: sdpa[k][0] for k in shapes}), "--bw", str(bw)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            print(r.stdout, end="", flush=True)
            if r.returncode:
                print(f"  variant {v} failed: {r.stderr.strip().splitlines()[-1][:160]}",
                      flush=True)
        return
    v = dict(only)
    mode = v.pop("mode", "pre_rope")
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    scale = HEAD_DIM ** -0.5
    for ratio in ratios:
        r = int(round(ratio * HEAD_DIM))
        plan = make_plan((r,) * KV_HEADS, (r,) * KV_HEADS)
        for name in shapes:
            bsz, length = parse_shape(name)
            p = make_problem(plan, bsz, length, None)
            nbytes = kernel_bytes(plan, p)
            ref = reference(plan, rope, p, scale, mode=mode)
            out = torch.empty(bsz, plan.out_width, device="cuda")
            q = p["q"] if mode == "pre_rope" else p["q_lat"]
            for pps in (1, 2):
                cfg = KernelConfig(**v, programs_per_sm=pps)
                splits = choose_num_splits(bsz, 8 // v["groups_per_program"], length,
                                           v["block_n"], n_sm, pps)
                launch = prepare_launch(plan, rope, p, mode=mode, cfg=cfg)

                def fn(launch=launch):
                    launch(q, p["cache"], p["bt"], p["lens"], length, out=out)
                out.fill_(float("nan"))
                fn()
                rel = ((out - ref).norm() / ref.norm()).item()
                t, _ = time_graph(fn, reps=20)
                gbs = nbytes / t / 1e3
                bad = "" if rel < 2e-2 else " BAD"
                tag = (("post " if mode == "post_rope" else "") +
                       f"{v['block_n']}/{v['num_warps']}w/{v['num_stages']}s/" +
                       ("T" if v.get("transposed", True) else "N") +
                       f"/g{v['groups_per_program']}")
                print(f"{name:>7} {ratio:>5} {tag:>24} {pps:>3} {splits:>3} {t:8.1f} "
                      f"{100 * gbs / bw:5.1f}% {sdpa[name] / t:6.2f} {rel:8.1e}{bad}",
                      flush=True)
            del p, ref
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------
# The recommended settings (issue 20's acceptance table)
# ---------------------------------------------------------------------------------
RECOMMENDED = (
    ("2x (default)", {"preset": "2x"}, None),
    ("ratio 0.75, J-LRD 16-bit", {"rank_fraction": 0.75, "rank_allocation": "uniform"}, None),
    ("J-LRD 0.75 K4c/V4 TALE int8 (4.04x)", JLRD_075_TALE, None),
    ("J-LRD 0.5 K4c/V4 TALE (5.18x)", {"rank_fraction": 0.5, "k_bits": 4, "v_bits": 4,
                                       **TALE_CHANNEL_KEYS}, None),
    ("8x (8.45x allocation)", {"preset": "8x"}, ALLOC_8X_SMOLLM2),
    # the same storage with key bases that commute with RoPE: queries absorbed
    ("8x rope_equivariant", {**PRESETS["8x"].settings, "method": "rope_equivariant"},
     ALLOC_8X_SMOLLM2),
    ("G=1 0.75 K4c/V4 TALE (3.62x)", {**JLRD_075_TALE, "head_group_size": 1}, None),
    ("G=1 0.5 K4/V4 TALE", {"rank_fraction": 0.5, "head_group_size": 1, "k_bits": 4,
                            "v_bits": 4, "token_adaptive": True, "sink_tokens": 32,
                            "recent_tokens": 128}, None),
)
"""The settings of the README's results table (``preset``s as a user selects
them) and the per-head-group candidates: ``(label, --kv-compression-config,
per-layer allocation or None)``."""


def recommended_layers(raw, profile):
    """``(config, [(plan, layout, layers)])`` of one recommended setting at the
    Llama-3-8B attention shape: every distinct layer configuration with the
    number of layers that have it (one for uniform settings; an allocation's
    ranks scaled from SmolLM2's 192 channels per side to 1,024 in multiples of
    8, its bits as allocated), the slot layouts built as the plugin builds them
    (``slot_layouts``: page padding across layers included)."""
    from collections import Counter

    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.models.compression import slot_layouts

    cfg = LowRankConfig.from_dict(raw)
    gs = cfg.head_group_size or KV_HEADS
    n = KV_HEADS // gs
    shape = AttentionShape(HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM)
    if profile is None:
        r = int(round(cfg.rank_fraction * gs * HEAD_DIM))
        ranks, bits = [((r,) * n, (r,) * n)], None
    else:
        w = KV_HEADS * HEAD_DIM
        ranks = [((scale_rank(kr, w),) * n, (scale_rank(vr, w),) * n)
                 for kr, vr, _, _ in profile]
        bits = [(kb, vb) for _, _, kb, vb in profile]
    layouts = slot_layouts(cfg, ranks, bits, one_page=cfg.token_adaptive or None) \
        or [None] * len(ranks)
    counts = Counter(range(len(ranks)) if profile else [0])
    seen = {}
    for i, (k, v) in enumerate(ranks):
        key = (k, v, None if bits is None else bits[i])
        seen.setdefault(key, [i, 0])[1] += counts[i] if profile else 1
    out = [(LayerPlan(shape, gs, k, v), layouts[i], c) for (k, v, _), (i, c) in seen.items()]
    return cfg, out


def setting_problem(cfg, plan, layout, bsz, length, device, seed=0):
    """Random inputs of one decode-attention call of a layer with ``plan`` and
    ``layout`` under ``cfg``: latent cache on shuffled blocks (every position
    written, per-channel key groups complete), post-RoPE queries (post-RoPE
    mode: queries in the key-latent basis), and in the token-adaptive mode the
    exact cache holding each sequence's sink and recent positions (the rest of
    its block table points at a scratch block)."""
    from vllm_lowrank.format.exact import ExactSlot, ExactTokens
    from vllm_lowrank.attention import token_adaptive as tale

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    page = 32 if cfg.token_adaptive else PAGE
    kv_width = KV_HEADS * HEAD_DIM
    gw = plan.group_width

    def up(offsets, ranks, width):
        w = torch.zeros(width, kv_width, device=dev)
        for gi, (off, r) in enumerate(zip(offsets, ranks)):
            w[off:off + r, gi * gw:(gi + 1) * gw] = torch.randn(
                r, gw, device=dev, generator=g) / math.sqrt(r)
        return w

    def equivariant_up():  # rope_equivariant structure: a weight-only basis of a random W
        from vllm_lowrank.factorization.bases import rope_equivariant_basis

        w = torch.zeros(plan.k_width, kv_width, device=dev)
        for gi, (off, r) in enumerate(zip(plan.k_offsets(), plan.k_ranks)):
            wk = torch.randn(256, gw, device=dev, generator=g)
            w[off:off + r, gi * gw:(gi + 1) * gw] = rope_equivariant_basis(
                wk, None, None, head_dim=HEAD_DIM).b[:r] / math.sqrt(r)
        return w

    k_up = equivariant_up() if cfg.method == "rope_equivariant" else \
        up(plan.k_offsets(), plan.k_ranks, plan.k_width)
    v_up = up(plan.v_offsets(), plan.v_ranks, plan.v_width)
    per = math.ceil(length / page)
    num_blocks = bsz * per
    bt = torch.randperm(num_blocks, device=dev, generator=g).int().view(bsz, per)
    width = plan.k_width + plan.v_width
    if layout is None:
        cache = torch.randn(num_blocks, 1, page, width, device=dev, generator=g,
                            dtype=torch.bfloat16)
    else:
        rows = num_blocks * page
        cache = torch.empty(rows, layout.slot_bytes, dtype=torch.uint8, device=dev)
        for s in range(0, rows, 1 << 16):
            lat = torch.randn(min(1 << 16, rows - s), width, device=dev, generator=g)
            cache[s:s + lat.shape[0]] = layout.encode_complete(lat[:, :plan.k_width],
                                                              lat[:, plan.k_width:])
        cache = cache.view(num_blocks, 1, page, layout.slot_bytes)
    post = cfg.method == "post_rope"
    q = torch.randn(bsz, HEADS, max(plan.k_ranks) if post else HEAD_DIM, device=dev,
                    generator=g).to(torch.bfloat16)
    lens = torch.full((bsz,), length, dtype=torch.int32, device=dev)
    p = dict(k_up=k_up, v_up=v_up, cache=cache, bt=bt, lens=lens, q=q, page=page)
    if cfg.token_adaptive:
        slot = ExactSlot.for_layer(plan, layout, torch.bfloat16, ExactTokens(0, 0, cfg.exact_bits))
        sink, recent = cfg.sink_tokens, cfg.recent_tokens
        pos = torch.cat([torch.arange(min(sink, length)),
                         torch.arange(max(0, length - recent - 1 - page), length)]).unique()
        blocks = (pos // page).unique()
        ex_bt = torch.zeros(bsz, per, dtype=torch.int32)
        ex_bt[:, blocks] = 1 + torch.arange(bsz * len(blocks), dtype=torch.int32).view(bsz, -1)
        ex_cache = torch.zeros(1 + bsz * len(blocks), 1, page, slot.slot_bytes,
                               dtype=torch.uint8, device=dev)
        ex_bt = ex_bt.to(dev)
        slots = (ex_bt[:, pos // page].long() * page + (pos % page).to(dev)).flatten()
        t = slots.shape[0]
        staged = torch.randn(t, slot.staged_width, device=dev, generator=g) \
            if slot.staged_width else None
        tale.write_exact(ex_cache, slot, torch.randn(t, kv_width, device=dev, generator=g
                                                     ).to(torch.bfloat16),
                         torch.randn(t, kv_width, device=dev, generator=g).to(torch.bfloat16),
                         slots, staged)
        p.update(ex_cache=ex_cache, ex_bt=ex_bt, slot=slot)
    return p


def setting_mode(cfg) -> str:
    """The decode mode of a layer under ``cfg`` (``LatentAttention.decode_mode``
    for factors that keep their structure)."""
    return "post_rope" if cfg.method == "post_rope" else "latent_rope" \
        if cfg.method == "rope_equivariant" else "pre_rope"


def setting_call(cfg, plan, layout, rope, p, torch_path=False, config=None):
    """``(fn, out)``: one layer's decode attention as its decoder runs it on CUDA
    (the Triton decoders, :mod:`vllm_lowrank.attention.decoders`: a
    :class:`LatentLaunch` for plain layers; for token-adaptive ones the steps of
    ``TokenAdaptiveDecoder.run``: the latent span and its log-sum-exp, the
    value up-projection in bf16, the exact part and the merge in
    :func:`~vllm_lowrank.kernels.triton.decode_exact.exact_merge_decode`);
    ``torch_path``: the float32 torch path instead, the reference; ``config``: a
    :class:`KernelConfig` for the latent kernel)."""
    from vllm_lowrank.attention import token_adaptive as tale
    from vllm_lowrank.attention.latent_attention import decode_attention as torch_decode
    from vllm_lowrank.kernels.triton.decode_exact import exact_merge_decode

    bsz, length = p["q"].shape[0], int(p["lens"][0])
    scale = HEAD_DIM ** -0.5
    q = p["q"].float() if torch_path else p["q"]
    mode = setting_mode(cfg)
    post = mode == "post_rope"
    sink, recent = (cfg.sink_tokens, cfg.recent_tokens) if cfg.token_adaptive else (0, 0)
    launch = None if torch_path else LatentLaunch(
        plan, layout, mode=mode, scale=scale, dtype=q.dtype, device=q.device,
        block_size=p["page"], k_up=None if post else p["k_up"], rope=None if post else rope,
        sink=sink, recent=recent + 1 if cfg.token_adaptive else 0, config=config)
    if cfg.token_adaptive:
        out = torch.empty(bsz, HEADS * HEAD_DIM, device=q.device,
                          dtype=torch.float32 if torch_path else torch.bfloat16)
        v_up = p["v_up"].to(q.dtype)

        def fn():
            if torch_path:
                tale.decode(plan, p["k_up"], p["v_up"], rope, scale, q, p["cache"], p["bt"],
                            p["ex_cache"], p["ex_bt"], p["lens"], length, sink=sink,
                            recent=recent, exact=p["slot"], layout=layout,
                            mode="post_rope" if post else "pre_rope", min_seq_len=length,
                            out=out)
                return
            lat, lse = launch(q, p["cache"], p["bt"], p["lens"], length, return_lse=True)
            exact_merge_decode(plan, scale, q, p["ex_cache"], p["slot"], p["ex_bt"], p["lens"],
                               sink, recent, tale.values_up(plan, v_up, lat), lse, out)
        return fn, out
    out = torch.empty(bsz, plan.out_width, device=q.device,
                      dtype=torch.float32 if torch_path else torch.bfloat16)

    def fn():
        if torch_path:
            out.copy_(torch_decode(plan, p["k_up"], rope, scale, q, p["cache"], p["bt"],
                                   p["lens"], length, post_rope=post, layout=layout))
        else:
            out.copy_(launch(q, p["cache"], p["bt"], p["lens"], length))
    return fn, out


def setting_kernel(cfg, plan, layout, rope, p):
    """The latent kernel the Triton decoders take for this layer
    (:func:`~vllm_lowrank.kernels.triton.decode.choose_kernel`)."""
    mode = setting_mode(cfg)
    rot = HEAD_DIM if mode == "post_rope" else rope.rotary_dim
    return choose_kernel(plan, layout, mode, p["page"], rot,
                         sink=cfg.sink_tokens if cfg.token_adaptive else 0)


def sequence_ratio(cfg, plan, layout, length):
    """16-bit K+V bytes of a ``length``-token sequence over what this layer
    stores for it (latent slots for every position, plus the exact sink and
    recent slots in the token-adaptive mode)."""
    from vllm_lowrank.format.exact import ExactSlot, ExactTokens

    slot = layout.slot_bytes if layout is not None else 2 * (plan.k_width + plan.v_width)
    stored = length * slot
    if cfg.token_adaptive:
        ex = ExactSlot.for_layer(plan, layout, torch.bfloat16,
                                 ExactTokens(0, 0, cfg.exact_bits)).slot_bytes
        stored += min(length, cfg.sink_tokens + cfg.recent_tokens + 1) * ex
    return length * 2 * 2 * KV_HEADS * HEAD_DIM / stored


def selected_settings(only=None, bits=None):
    """``(label, config, layers)`` (:func:`recommended_layers`) of each
    :data:`RECOMMENDED` setting whose label contains one of ``only`` (all
    when ``None``); ``bits`` ``(key, value)``: every layer of an allocation at
    those bits instead of its own (``gpu_serving.py``'s ``alloc-8x-re`` serves
    4/4: a config cannot give bits per layer)."""
    for label, raw, profile in RECOMMENDED:
        if not only or any(o in label for o in only):
            if bits and profile:
                profile = [(k, v, *bits) for k, v, _, _ in profile]
            yield (label, *recommended_layers(raw, profile))


def settings_rows(rope, shapes, sdpa, only=None, check=(2, 4096)):
    """One row per recommended setting and shape: the median time of one
    layer's decode attention (layers of an allocation: the mean over its
    layers), against SDPA over full bf16 K/V; ``rel``: the largest relative
    error against the float32 torch path over the setting's layer
    configurations at ``check`` (batch, context); ``only``: labels containing
    one of these strings."""
    lines = [f"{'setting':>30} {'kernel':>6} {'shape':>7} {'ratio':>6} {'us':>9} "
             f"{'x sdpa':>6} {'rel':>8}"]
    for label, cfg, layers in selected_settings(only):
        rel = 0.0
        kernels = set()
        for plan, layout, _ in layers:
            p = setting_problem(cfg, plan, layout, *check, "cuda")
            kernels.add(setting_kernel(cfg, plan, layout, rope, p))
            fn, out = setting_call(cfg, plan, layout, rope, p)
            ref_fn, ref = setting_call(cfg, plan, layout, rope, p, torch_path=True)
            fn()
            ref_fn()
            rel = max(rel, ((out.float() - ref).norm() / ref.norm()).item())
            del p
        for name in shapes:
            bsz, length = parse_shape(name)
            total = ratio = 0.0
            n_layers = sum(c for _, _, c in layers)
            try:
                for plan, layout, count in layers:
                    p = setting_problem(cfg, plan, layout, bsz, length, "cuda")
                    fn, _ = setting_call(cfg, plan, layout, rope, p)
                    t, _ = time_graph(fn, reps=20)
                    total += t * count / n_layers
                    ratio += sequence_ratio(cfg, plan, layout, length) * count / n_layers
                    del p
                    torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 (a setting that cannot run: a row)
                lines.append(f"{label:>30} {'/'.join(sorted(kernels)):>6} {name:>7} "
                             f"{type(exc).__name__}: {str(exc)[:80]}")
                print(lines[-1], flush=True)
                torch.cuda.empty_cache()
                continue
            lines.append(f"{label:>30} {'/'.join(sorted(kernels)):>6} {name:>7} "
                         f"{ratio:5.2f}x {total:9.1f} {sdpa[name][0] / total:6.2f} {rel:8.1e}")
            print(lines[-1], flush=True)
    return lines + compiled_resources()


SETTINGS_SWEEP = {
    "wide": [dict(block_n=bn, num_warps=w, num_stages=st, rank_chunk=rc, heads_per_program=hpp,
                  chunk_outer=co)
             for bn, w, st, rc, hpp, co in (
                 (16, 4, 2, 64, 1, False), (32, 4, 2, 64, 8, False), (32, 4, 2, 64, 4, True),
                 (32, 8, 2, 64, 4, True), (16, 4, 2, 64, 4, True), (16, 8, 2, 64, 4, True),
                 (32, 4, 2, 32, 4, True), (32, 4, 1, 64, 4, True), (32, 4, 3, 64, 4, True),
                 (32, 8, 2, 64, 8, True))],
    # per-channel keys fix the tile at one token group (32): warps, stages, value chunks
    "latent_rope": [dict(num_warps=w, num_stages=st, value_chunk=vc)
                    for w, st, vc in ((8, 1, 512), (8, 3, 512), (4, 2, 512), (8, 2, 256),
                                      (4, 2, 256), (8, 2, 128), (4, 2, 128))],
    "grid": [dict(block_n=bn, num_warps=w, num_stages=st, transposed=False)
             for bn, w, st in ((32, 4, 3), (16, 4, 2), (64, 4, 2), (128, 4, 2), (32, 8, 2),
                               (64, 8, 2), (128, 8, 2))],
}
"""Launch variants :func:`settings_sweep` times per kernel."""


def settings_sweep(rope, shapes, sdpa, only=None):
    """Launch variants (:data:`SETTINGS_SWEEP`) of the latent kernel of each
    recommended setting (one layer configuration: an allocation's most common),
    timed as :func:`settings_rows` times the default, followed by the
    registers and spills of every variant compiled; ``rel`` against the float32
    torch path at 2 x 4k (a variant that a compiler miscompiles shows there)."""
    lines = [f"{'setting':>30} {'shape':>7} {'variant':>28} {'us':>9} {'x sdpa':>6} "
             f"{'rel':>8}"]
    for label, cfg, layers in selected_settings(only):
        plan, layout, _ = max(layers, key=lambda x: x[2])
        small = setting_problem(cfg, plan, layout, 2, 4096, "cuda")
        ref_fn, ref = setting_call(cfg, plan, layout, rope, small, torch_path=True)
        ref_fn()
        for name in shapes:
            bsz, length = parse_shape(name)
            p = setting_problem(cfg, plan, layout, bsz, length, "cuda")
            kernel = setting_kernel(cfg, plan, layout, rope, p)
            for v in [None] + SETTINGS_SWEEP.get(kernel, []):
                kc = KernelConfig(**v) if v else None
                tag = "default" if v is None else "/".join(f"{x}" for x in v.values())
                try:
                    check, out = setting_call(cfg, plan, layout, rope, small, config=kc)
                    check()
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    fn, _ = setting_call(cfg, plan, layout, rope, p, config=kc)
                    t, _ = time_graph(fn, reps=15)
                except Exception as exc:  # noqa: BLE001 (a variant that cannot run: a row)
                    lines.append(f"{label:>30} {name:>7} {tag:>28} {type(exc).__name__}")
                    print(lines[-1], flush=True)
                    continue
                lines.append(f"{label:>30} {name:>7} {tag:>28} {t:9.1f} "
                             f"{sdpa[name][0] / t:6.2f} {rel:8.1e}")
                print(lines[-1], flush=True)
            del p
            torch.cuda.empty_cache()
    return lines + compiled_resources()


def compiled_resources():
    """Registers and spills per thread of every decode kernel variant compiled in
    this process (triton's compiled-kernel metadata; empty where the running
    triton does not expose it)."""
    from vllm_lowrank.kernels.triton import (decode_exact, decode_kernels, decode_packed,
                                             decode_wide)

    out = []
    for fn in (decode_kernels.decode_grid_kernel, decode_wide.wide_decode_kernel,
               decode_packed.packed_decode_kernel, decode_exact.exact_merge_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for ck in getattr(cache, "values", lambda: [])():
                md = getattr(ck, "metadata", None)
                out.append(f"{fn.__name__}: {getattr(ck, 'n_regs', '?')} registers, "
                           f"{getattr(ck, 'n_spills', '?')} spills, "
                           f"{getattr(md, 'num_warps', '?')} warps, "
                           f"{getattr(md, 'shared', '?')} B shared")
    return out


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"[{time.time() - t0:.0f} s]")
