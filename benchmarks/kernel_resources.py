"""Registers, spills and MMA instructions of the decode kernels on Hopper,
compiled on a machine without a GPU.

Triton compiles a kernel for a target named in a ``GPUTarget``; only the launch
needs a device. This script makes Triton's active driver a stand-in that names
an sm_90 (H100/H200) target and never launches, prepares a
:class:`vllm_lowrank.kernels.triton.decode.LatentLaunch` and calls it on CPU
tensors shaped like a recommended setting's layer (``decode_attention.py``'s
``setting_problem``: Llama-3-8B attention, the preset's slot layout) with each
launch variant of ``decode_attention.SETTINGS_SWEEP`` for the kernel that
setting takes (or ``--variant``), and prints for every variant compiled: the number of
asynchronous warpgroup MMAs (``wgmma.mma_async``, Hopper's tensor-core path)
and of ``mma.sync`` (the Ampere-style path) in the PTX, and ptxas' registers
per thread and spill bytes (``ptxas -v``, the ptxas Triton ships).

``--loads`` also lists each compiled kernel's global tensor loads
(:func:`global_loads`: bytes per thread and access, and whether the software
pipeliner copies them ahead), and ``--bits "K V"`` gives every layer of an
allocation those bits (``gpu_serving.py``'s ``alloc-8x-re`` serves 4/4).

Use it to look at a kernel change's register pressure before spending GPU time
on timing it. The figures come from this machine's Triton, which may differ
from the GPU machine's (3.6 there, ``../shared/gpu-vllm/README.md``): the
timings stay the GPU's.

    .venv/bin/python -P benchmarks/kernel_resources.py --only "J-LRD 0.5" "8x"
    .venv/bin/python -P benchmarks/kernel_resources.py --only "J-LRD 0.5" \\
        --variant '{"wide": true, "heads_per_program": 4, "block_n": 64}'
    .venv/bin/python -P benchmarks/kernel_resources.py --only "8x rope" --bits "4 4" \\
        --loads --variant '{"num_warps": 8, "num_stages": 2, "value_chunk": 512}'

Run it without ``TRITON_INTERPRET`` set (the test suite sets it on CPU).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver

SM90 = GPUTarget("cuda", 90, 32)


class CompileOnlyDriver(DriverBase):
    """Triton's active driver for compiling without a GPU: names ``SM90`` as the
    current target, device 0 and stream 0; launching through it fails (the
    caller catches that: the kernel is compiled and cached by then)."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def __init__(self):  # no CUDA driver to load
        pass

    def get_current_target(self):
        return SM90

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def set_current_device(self, device) -> None:
        pass

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("compile only")

    def get_device_interface(self):
        return torch.cuda

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError("compile only")

    def clear_cache(self, cache) -> None:
        pass

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


def ptxas_resources(ptx: str) -> str:
    """``ptxas -v``'s registers and spill line for ``ptx`` on sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        r = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o",
                            "/dev/null"], capture_output=True, text=True, check=False)
    info = [line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
            if "registers" in line or "spill" in line]
    return "; ".join(info) or r.stderr.strip()[-200:]


def describe(compiled) -> str:
    """One line: MMA instruction counts and ptxas resources of a compiled kernel."""
    ptx = compiled.asm["ptx"]
    return (f"wgmma {ptx.count('wgmma.mma_async')}, mma.sync {ptx.count('mma.sync')} | "
            f"{ptxas_resources(ptx)}")


LOAD_RE = re.compile(r"(tt\.load|ttg\.async_copy_global_to_local) .*?: "
                     r"tensor<([0-9x]+)x!tt\.ptr<(\w+)>, (#\w+)")
BLOCKED_RE = re.compile(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([0-9, ]+)\].*?"
                        r"order = \[([0-9, ]+)\]", re.M)
ELEMENT_BYTES = {"i8": 1, "i16": 2, "f16": 2, "bf16": 2, "i32": 4, "f32": 4, "i64": 8}


def global_loads(ttgir: str) -> list[dict]:
    """The tensor loads from global memory in a compiled kernel's TTGIR, each
    once: ``shape`` (e.g. ``"32x256"``), ``dtype`` (``"i8"`` for packed
    codes), ``vector_bytes`` (bytes one thread reads per access: the blocked
    layout's elements per thread along its fastest dimension; 0 for other
    layouts) and ``async`` (copied ahead into shared memory by the software
    pipeliner, ``cp.async``; Triton does so only for accesses of 4 bytes or
    more)."""
    layouts = {name: ([int(x) for x in spt.split(",")], [int(x) for x in order.split(",")])
               for name, spt, order in BLOCKED_RE.findall(ttgir)}
    seen, out = set(), []
    for op, shape, dtype, layout in LOAD_RE.findall(ttgir):
        spt, order = layouts.get(layout, ([0], [0]))
        row = {"shape": shape, "dtype": dtype,
               "vector_bytes": spt[order[0]] * ELEMENT_BYTES.get(dtype, 0),
               "async": op.startswith("ttg.async")}
        key = tuple(row.values())
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def compiled_since(fn, before: set) -> list:
    """Kernels of the JIT function ``fn`` compiled since ``before`` (its cache keys)."""
    out = []
    for entry in fn.device_caches.values():
        out += [ck for key, ck in entry[0].items() if key not in before]
    return out


def cache_keys(fn) -> set:
    return {key for entry in fn.device_caches.values() for key in entry[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None,
                   help="recommended settings whose label contains one of these (default all)")
    p.add_argument("--variant", action="append", default=None,
                   help="a KernelConfig as JSON (repeatable); default: the sweep's variants")
    p.add_argument("--bits", default=None, metavar="\"K V\"",
                   help="key and value bits of every layer of an allocation (e.g. \"4 4\", "
                        "as gpu_serving.py's alloc-8x-re serves); default the allocation's")
    p.add_argument("--loads", action="store_true",
                   help="also list each kernel's global tensor loads (global_loads)")
    args = p.parse_args()
    driver.set_active(CompileOnlyDriver())
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import decode_attention as da  # noqa: PLC0415 (after the driver: it imports the kernels)
    from vllm_lowrank.kernels.triton import (decode_kernels, decode_latent_rope, decode_packed,
                                             decode_wide)
    from vllm_lowrank.kernels.triton.decode import KernelConfig, LatentLaunch
    from vllm_lowrank.kernels.triton.launch import PACKED_CONFIG

    kernels = {"wide": decode_wide.wide_decode_kernel, "grid": decode_kernels.decode_grid_kernel,
               "packed": decode_packed.packed_decode_kernel,
               "latent_rope": decode_latent_rope.latent_rope_decode_kernel}
    rope = da.llama3_rope(1024, "cpu")
    print(f"triton {triton.__version__}, target sm_90; per variant: MMA instructions in the "
          "PTX | ptxas registers and spills")
    bits = tuple(int(x) for x in args.bits.split()) if args.bits else None
    for label, cfg, layers in da.selected_settings(args.only, bits):
        plan, layout, _ = max(layers, key=lambda x: x[2])  # an allocation's most common layer
        length = 300
        prob = da.setting_problem(cfg, plan, layout, 2, length, "cpu")
        kind = da.setting_kernel(cfg, plan, layout, rope, prob)
        # no "default": on CPU tensors the launch defaults are the interpreter's
        # (the sweep holds the GPU defaults); the packed kernel: its GPU launch
        block_n, warps, stages, _ = PACKED_CONFIG
        packed = {"packed": True, "block_n": block_n, "num_warps": warps, "num_stages": stages}
        variants = [json.loads(v) for v in args.variant] if args.variant else \
            da.SETTINGS_SWEEP.get(kind, [packed])
        for v in variants:
            fn = kernels["wide" if v.get("wide") else kind]
            before = cache_keys(fn)
            mode = da.setting_mode(cfg)
            try:
                launch = LatentLaunch(
                    plan, layout, mode=mode, scale=da.HEAD_DIM ** -0.5, dtype=prob["q"].dtype,
                    device="cpu", block_size=prob["page"],
                    k_up=None if mode == "post_rope" else prob["k_up"],
                    rope=None if mode == "post_rope" else rope,
                    config=KernelConfig(**v) if v else None,
                    sink=cfg.sink_tokens if cfg.token_adaptive else 0,
                    recent=cfg.recent_tokens + 1 if cfg.token_adaptive else 0)
                launch(prob["q"], prob["cache"], prob["bt"], prob["lens"], length)
            except Exception as exc:  # noqa: BLE001 (the stand-in driver cannot launch)
                if not compiled_since(fn, before):
                    print(f"{label}: {v or 'default'}: {type(exc).__name__}: {exc}"[:300])
                    continue
            for ck in compiled_since(fn, before):
                print(f"{label}: {fn.__name__} {v or 'default'}: {describe(ck)}", flush=True)
                if args.loads:
                    for ld in global_loads(ck.asm["ttgir"]):
                        print(f"    load {ld['shape']} {ld['dtype']} {ld['vector_bytes']} B/thread"
                              f" {'async' if ld['async'] else 'sync'}", flush=True)


if __name__ == "__main__":
    main()
