"""Stock vLLM's FLASHINFER backend on the GPU machine's recipe (``../shared/gpu-vllm``),
for ``prepare_gpuvllm.sh --flashinfer``.

The recipe carries vLLM's Python sources without its compiled module. FlashInfer's own
kernels JIT-compile with the machine's nvcc, but vLLM's FlashInfer backend calls two
compiled vLLM ops that the recipe has not got (vLLM 0.32 and 0.33 alike,
``vllm/v1/attention/backends/flashinfer.py``):

- ``FlashInferImpl.do_kv_cache_update`` writes the KV cache with
  ``torch.ops._C_cache_ops.reshape_and_cache_flash`` (every step, every layer);
- ``FlashInferImpl.maybe_quant_query`` quantizes the query to FP8 with
  ``custom_ops.scaled_fp8_quant``, i.e. ``torch.ops._C.static_scaled_fp8_quant``
  (with ``--kv-cache-dtype fp8`` on SM90, for FlashInfer's FP8 prefill only: the
  decode query stays bf16).

:data:`PATCHES` replace them in the staged copy of that one file: the cache write with
vLLM's own Triton kernel ``triton_reshape_and_cache_flash`` (the one the ``TRITON_ATTN``
backend writes with; same arguments, and it addresses the cache through its strides,
so FlashInfer's HND views go through it unchanged), the query quantization with its
torch equivalent (``x * (1 / scale)``, clamped to the FP8 range: static per-tensor, the
only case this call site uses). FlashInfer's attention kernels are untouched. Nothing
in the project changes.

    python3 benchmarks/gpuvllm_flashinfer.py <staged>/vllm    # prints one line per patch
"""

from __future__ import annotations

import sys
from pathlib import Path

FLASHINFER_PINS = {"0.32": "0.7.0.post1", "0.33": "0.7.2.post1"}
"""``flashinfer-python`` as each vLLM release pins it (``Requires-Dist`` of the
``vllm-0.32.0`` / ``vllm-0.33.0`` x86_64 wheels on PyPI; the CPU wheel in ``.venv``
names none)."""

BACKEND = "v1/attention/backends/flashinfer.py"

_HELPERS = '''from vllm import _custom_ops as custom_ops
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (  # gpuvllm patch
    triton_reshape_and_cache_flash as _gpuvllm_cache_write,
)


def _gpuvllm_scaled_fp8_quant(input, scale):  # gpuvllm patch: no compiled vllm._C
    """vLLM's static per-tensor FP8 quantization (scaled_fp8_quant with a scale)."""
    fp8 = torch.float8_e4m3fn
    big = torch.finfo(fp8).max
    out = (input.float() * (1.0 / scale.float())).clamp_(-big, big).to(fp8)
    return out, scale
'''

PATCHES = [
    (BACKEND, "from vllm import _custom_ops as custom_ops\n", _HELPERS),
    (BACKEND, "            torch.ops._C_cache_ops.reshape_and_cache_flash(\n",
     "            _gpuvllm_cache_write(  # gpuvllm patch: vLLM's Triton cache write\n"),
    (BACKEND, "            query_quantized, _ = custom_ops.scaled_fp8_quant(\n",
     "            query_quantized, _ = _gpuvllm_scaled_fp8_quant(  # gpuvllm patch\n"),
]
"""``(file under vllm/, old text, new text)``: each old text must occur exactly once."""


def patch_text(rel: str, text: str, patches: list = PATCHES) -> str:
    """``text`` (vLLM's ``rel``) with every patch of ``patches`` for ``rel`` applied.

    Raises:
        ValueError: a target text missing or not unique (vLLM changed).
    """
    for target, old, new in patches:
        if target != rel:
            continue
        if text.count(old) != 1:
            raise ValueError(f"gpuvllm patch: {text.count(old)} copies of "
                             f"{old.strip()!r} in {rel} (want 1: vLLM changed)")
        text = text.replace(old, new, 1)
    return text


def main(root: str, patches: list = PATCHES) -> None:
    """Apply ``patches`` to the staged vLLM sources under ``root``, one line per patch;
    exits non-zero when a file is already patched or a target text moved."""
    base = Path(root)
    for rel in sorted({p[0] for p in patches}):
        path = base / rel
        text = path.read_text()
        if "gpuvllm patch" in text:
            sys.exit(f"{rel} is already patched")
        try:
            path.write_text(patch_text(rel, text, patches))
        except ValueError as exc:
            sys.exit(str(exc))
        for target, old, _ in patches:
            if target == rel:
                print(f"patched: {rel}: {old.strip()[:60]}")


if __name__ == "__main__":
    main(sys.argv[1])
