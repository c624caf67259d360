"""The decode kernels' code loads, compiled for Hopper (sm_90) without a GPU.

The latent codes are the bytes a decode kernel streams; Triton copies a load a
tile ahead (``cp.async``, its software pipeliner) only when each thread reads 4
bytes or more at a time, which it can prove only from alignment it sees. These
tests compile the kernels as the server launches them, through
``benchmarks/kernel_resources.py``'s stand-in driver (a subprocess without the
Triton interpreter), and check in the compiled TTGIR that the code loads are
vectorized and asynchronous.

Which Triton compiles matters: with ``tl.multiple_of`` on the group table's
loaded offsets (before ``tiles.known_multiple``), Triton 3.6, the GPU machine's,
loaded the latent_rope kernel's value codes and the grid kernel's key codes one
byte per thread, synchronously, and these tests fail there; Triton 3.9 (this
project's CPU environment) keeps such hints, so on CPU they guard the layouts
against other regressions only (benchmarks/README.md's history in git, "Alignment the compiler
can see"). On the GPU machine they run against its Triton 3.6.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

LINE = re.compile(r"^\s+load (\S+) (\w+) (\d+) B/thread (async|sync)$")


def compiled_loads(only: str, variant: str, bits: str | None = None) -> list[tuple]:
    """``(shape, dtype, bytes per thread, async)`` of every global tensor load of
    the kernel that ``kernel_resources.py`` compiles for the recommended setting
    ``only`` with launch ``variant`` (JSON)."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    try:
        compiler.get_ptxas(90)
    except RuntimeError as e:  # no ptxas for sm_90 in this Triton
        pytest.skip(str(e))
    cmd = [sys.executable, "-P", str(REPO / "benchmarks" / "kernel_resources.py"),
           "--only", only, "--variant", variant, "--loads"]
    if bits:
        cmd += ["--bits", bits]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [LINE.match(line) for line in proc.stdout.splitlines()]
    loads = [(m[1], m[2], int(m[3]), m[4] == "async") for m in rows if m]
    assert loads, f"no loads listed:\n{proc.stdout[-2000:]}"
    return loads


def test_latent_rope_value_codes_are_vectorized_and_copied_ahead():
    """The served ``alloc-8x-re`` layer (4-bit keys and values, the launch of
    ``launch._latent_rope_config`` on a GPU): the ``[32, 256]`` bytes of value
    codes per tile load 4 bytes per thread, asynchronously."""
    loads = compiled_loads("8x rope", '{"num_warps": 8, "num_stages": 2, "value_chunk": 512}',
                           bits="4 4")
    codes = [x for x in loads if x[0] == "32x256" and x[1] == "i8"]
    assert codes and all(nbytes >= 4 and is_async for _, _, nbytes, is_async in codes), loads


def test_grid_kernel_code_loads_are_vectorized_and_copied_ahead():
    """A head-group-1 token-adaptive setting on the grid kernel: its key and
    value code tiles (``[BLOCK_N, bytes]`` int8) load at least 4 bytes per
    thread, asynchronously."""
    loads = compiled_loads("G=1 0.5", '{"block_n": 32, "num_warps": 4, "num_stages": 3}')
    codes = [x for x in loads if x[1] == "i8" and x[0].startswith("32x")]
    assert len(codes) >= 2, loads
    assert all(nbytes >= 4 and is_async for _, _, nbytes, is_async in codes), loads
