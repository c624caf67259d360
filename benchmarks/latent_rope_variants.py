"""The RoPE-equivariant latent decode kernel against copies of it, on a GPU.

Times the token-adaptive decode call as the backend runs it on CUDA (latent
span on :mod:`vllm_lowrank.kernels.triton.decode_latent_rope`, then
``values_up`` and the exact-merge kernel: ``decode_attention.setting_call``)
and the latent kernel alone, for the kept kernel and for each ``--variant``:
a copy of ``triton_kernels/decode_latent_rope.py`` with a change, whose
``launch`` replaces the kept one for its rows. The layers are those of
``alloc-8x-re`` (the ``8x`` preset's allocation stretched to the Llama-3-8B
shape, ``rope_equivariant`` bases, the bits of ``--bits``) with the key/value
ranks of ``--ranks``; random latents and weights (``setting_problem``).

Columns: ``call`` the median us of the whole decode call replayed from a CUDA
graph (L2 flushed before each replay), ``kernel`` the latent kernel's device
time per call (``torch.profiler``), ``rel`` the relative error at 2 x 4k
against the float32 torch path (the same for a correct variant as for the
kept kernel). ``--values-up-float32`` times the call as it was before
``values_up`` ran in the model dtype.

    source .gpuvllm/env.sh && python3 -P benchmarks/latent_rope_variants.py \\
        --variant my_copy.py --shapes 128x2k,16x4k --ranks 216/344,168/512
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode_attention as da  # noqa: E402

from vllm_lowrank.attention import token_adaptive as tale  # noqa: E402
from vllm_lowrank.kernels.triton import decode_latent_rope as dlr  # noqa: E402

KERNEL = "latent_rope_decode_kernel"


def variant_launch(path: str):
    """The ``launch`` of a copy of ``decode_latent_rope.py`` at ``path`` (its
    relative imports resolved against the installed package)."""
    src = pathlib.Path(path).read_text().replace("from .", "from vllm_lowrank.kernels.triton.")
    name = "_variant_" + pathlib.Path(path).stem
    tmp = pathlib.Path(path).with_name(name + ".py")
    tmp.write_text(src)  # Triton's JIT reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location(name, tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.launch


def kernel_us(fn, reps: int = 10) -> float:
    """Device time per call of the latent kernel over ``reps`` calls of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    hits = [e for e in prof.key_averages() if KERNEL in e.key]
    return sum(e.self_device_time_total for e in hits) / reps if hits else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], metavar="FILE",
                   help="a copy of triton_kernels/decode_latent_rope.py (repeatable)")
    p.add_argument("--shapes", default="128x2k,16x4k")
    p.add_argument("--ranks", default="216/344,168/512", help="key/value ranks of the layers")
    p.add_argument("--bits", default="4 4", help="key and value bits of every layer")
    p.add_argument("--values-up-float32", action="store_true",
                   help="lift the latent outputs in float32, as before 2026-11-27")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("latent_rope_variants.py times CUDA kernels: run it on the GPU "
                         "machine (../shared/gpu-vllm/README.md)")
    kb, vb = (int(x) for x in args.bits.split())
    launches = {"kept": dlr.launch}
    launches.update({pathlib.Path(v).name: variant_launch(v) for v in args.variant})
    if args.values_up_float32:
        lift = tale.values_up
        tale.values_up = lambda plan, v_up, out, dtype=None: lift(plan, v_up, out)
    _, cfg, layers = next(da.selected_settings(["8x rope_equivariant"], (kb, vb)))
    rope = da.llama3_rope(40000, "cuda")
    print(torch.cuda.get_device_name())
    print(f"{'layer':>8} {'shape':>8} {'kernel file':>24} {'call us':>8} {'kernel us':>9} "
          f"{'rel':>8}", flush=True)
    for ranks in args.ranks.split(","):
        rk, rv = (int(x) for x in ranks.split("/"))
        found = [x for x in layers if x[0].k_ranks == (rk,) and x[0].v_ranks == (rv,)]
        if not found:
            print(f"{ranks:>8} no such layer in alloc-8x-re", flush=True)
            continue
        plan, layout, _ = found[0]
        small = da.setting_problem(cfg, plan, layout, 2, 4096, "cuda")
        ref_fn, ref = da.setting_call(cfg, plan, layout, rope, small, torch_path=True)
        ref_fn()
        for shape in args.shapes.split(","):
            bsz, length = da.parse_shape(shape)
            prob = da.setting_problem(cfg, plan, layout, bsz, length, "cuda")
            for label, launch in launches.items():
                dlr.launch = launch
                try:
                    check, out = da.setting_call(cfg, plan, layout, rope, small)
                    check()
                    rel = ((out.float() - ref).norm() / ref.norm()).item()
                    fn, _ = da.setting_call(cfg, plan, layout, rope, prob)
                    call, _ = da.time_graph(fn, reps=15)
                    print(f"{ranks:>8} {shape:>8} {label:>24} {call:8.1f} {kernel_us(fn):9.1f} "
                          f"{rel:8.1e}", flush=True)
                finally:
                    dlr.launch = launches["kept"]
            del prob
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
