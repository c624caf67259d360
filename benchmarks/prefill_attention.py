"""One layer's batched token-adaptive prefill step on a GPU: time per call and its kernels.

A token-adaptive layer's prefill chunks of one engine step, as the backend runs
them on CUDA (:func:`vllm_lowrank.attention.token_adaptive.prefill_batched`:
the latent history gathered, dequantized and rebuilt into keys and values, then
one varlen kernel call over it and the exact tokens). The layer is the largest
of a recommended setting (``decode_attention.py --settings recommended``, its
random latents and weights: ``setting_problem``), with ``--bits`` overriding
its slot bits (``4 4``: ``alloc-8x-re``'s 4-bit per-channel keys and 4-bit
values, as ``gpu_serving.py`` serves it). Every request of a shape ``NxL``
brings 128 new tokens (the token-adaptive prefill chunk) at a context of ``L``
tokens; its whole context is in both caches.

Columns: ``ms`` the median of 10 calls (CUDA events, host work included),
``rel`` the relative error of the first two requests' outputs against the
per-request float32 torch path (:func:`~vllm_lowrank.attention.token_adaptive.
prefill`), then the device time per call of the kernels of 5 calls
(``torch.profiler``), the largest first.

    python -P benchmarks/prefill_attention.py --shapes 64x1152,16x4224 --bits 4 4
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode_attention as da  # noqa: E402

CHUNK = 128


def problem(label: str, bits, reqs: int, length: int, seed: int = 0):
    """The layer, its caches and a step's prefill metadata (see the module docstring)."""
    from vllm_lowrank.attention import token_adaptive as tale
    from vllm_lowrank.format.exact import ExactSlot, ExactTokens
    from vllm_lowrank.format.latent import SlotLayout

    name, cfg, layers = next(da.selected_settings([label]))
    if not cfg.token_adaptive:
        raise SystemExit(f"{name!r} is not a token-adaptive setting")
    plan, layout, _ = max(layers, key=lambda x: x[2])
    if bits is not None:
        kct = cfg.k_channel_tokens if cfg.k_quant == "channel" else None
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, *bits, k_channel_tokens=kct)
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, *bits, k_channel_tokens=kct,
                            pad_to=-(-layout.slot_bytes // 4) * 4)
    p = da.setting_problem(cfg, plan, layout, reqs, length, "cuda", seed=seed)
    page, dev = p["page"], torch.device("cuda")
    slot = ExactSlot.for_layer(plan, layout, torch.bfloat16, ExactTokens(0, 0, cfg.exact_bits))
    # the exact cache holds every position (its own block table: the latent one)
    nb = p["bt"].numel()
    ex_cache = torch.zeros(nb, 1, page, slot.slot_bytes, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    width = plan.shape.kv_width
    for s in range(0, nb * page, 1 << 16):
        n = min(1 << 16, nb * page - s)
        staged = torch.randn(n, slot.staged_width, device=dev, generator=g) \
            if slot.staged_width else None
        tale.write_exact(ex_cache, slot,
                         torch.randn(n, width, device=dev, generator=g).bfloat16(),
                         torch.randn(n, width, device=dev, generator=g).bfloat16(),
                         torch.arange(s, s + n, device=dev), staged)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * CHUNK
    lens = torch.full((reqs,), length, dtype=torch.int32)
    group = layout.k_channel_tokens if layout is not None and layout.k_per_channel else 1
    spans = tale.prefill_spans(qsl, lens, 0, cfg.sink_tokens, cfg.recent_tokens, group, dev)
    q = torch.randn(reqs * CHUNK, plan.shape.num_heads, plan.shape.head_dim, device=dev,
                    generator=g).bfloat16()
    return {**p, "name": name, "cfg": cfg, "plan": plan, "layout": layout, "slot": slot,
            "ex_cache": ex_cache, "spans": spans, "q": q}


def row(label: str, bits, shape: str, top: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from vllm_lowrank.attention import token_adaptive as tale

    reqs, length = da.parse_shape(shape)
    pr = problem(label, bits, reqs, length)
    rope = da.llama3_rope(length + 1024, "cuda")
    cfg, plan, scale = pr["cfg"], pr["plan"], da.HEAD_DIM ** -0.5
    out = torch.empty(reqs * CHUNK, plan.shape.num_heads * plan.shape.head_dim,
                      device="cuda", dtype=torch.bfloat16)

    def call():
        tale.prefill_batched(plan, pr["k_up"], pr["v_up"], rope, scale, pr["q"], pr["cache"],
                             pr["bt"], pr["ex_cache"], pr["bt"], pr["spans"], out,
                             exact=pr["slot"], layout=pr["layout"])

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for _ in range(10):
        ev[0].record()
        call()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    times.sort()
    errs = []
    for r in range(min(2, reqs)):
        rows = slice(r * CHUNK, (r + 1) * CHUNK)
        ref = tale.prefill(plan, pr["k_up"], pr["v_up"], rope, scale, pr["q"][rows].float(),
                           pr["cache"], pr["bt"][r], pr["ex_cache"], pr["bt"][r], length,
                           sink=cfg.sink_tokens, recent=cfg.recent_tokens, exact=pr["slot"],
                           layout=pr["layout"])
        errs.append(((out[rows].float() - ref).norm() / ref.norm()).item())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    total, count = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] += e.device_time_total
            count[e.name] += 1
    lines = [f"{pr['name']} | k_ranks {plan.k_ranks} v_ranks {plan.v_ranks} | slot "
             f"{pr['layout'].slot_bytes if pr['layout'] else '16-bit'} B, exact "
             f"{pr['slot'].slot_bytes} B | {shape}: {reqs} x {CHUNK} new tokens at {length}",
             f"  ms per call {times[len(times) // 2]:.3f} (min {times[0]:.3f}), rel "
             f"{max(errs):.2e}"]
    for name, us in sorted(total.items(), key=lambda x: -x[1])[:top]:
        lines.append(f"  {us / 5:9.1f} us x{count[name] // 5:<3} {name[:100]}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="8x rope",
                    help="a token-adaptive setting's label (substring) in decode_attention.py")
    ap.add_argument("--bits", type=int, nargs=2, default=None, metavar=("K", "V"),
                    help="override the layer's key and value bits")
    ap.add_argument("--shapes", default="64x1152", help="NxL, comma-separated")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_attention.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}")
    for shape in args.shapes.split(","):
        print("\n".join(row(args.setting, args.bits, shape, args.top)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
