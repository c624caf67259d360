"""The GPU recipe's patches to vLLM's FlashInfer backend
(``benchmarks/gpuvllm_flashinfer.py``, ``prepare_gpuvllm.sh --flashinfer``): they
apply to vLLM 0.32 and 0.33, and what they put in place of the compiled vLLM ops
writes what those ops write. vLLM's Triton cache write runs on FlashInfer's cache
views in the interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``) on CPU.

    python -P -m pytest tests/kernels/test_gpuvllm_flashinfer.py -q
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, release_sources

pytest.importorskip("triton")
vllm = pytest.importorskip("vllm")

sys.path.insert(0, str(REPO))
import benchmarks.gpuvllm_flashinfer as gf  # noqa: E402
import benchmarks.peer_caches as pc  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_the_patches_take_every_compiled_op_out_of_the_backend(version):
    # 0.32: the installed vLLM (on the GPU recipe, as prepare_gpuvllm.sh --flashinfer
    # patched it); 0.33: its release wheel's sources (fetched once)
    try:
        root = Path(vllm.__file__).parent if version == "0.32" else \
            release_sources("0.33.0") / "vllm"
    except RuntimeError as exc:  # no wheel and no network (the GPU machine)
        pytest.skip(str(exc))
    path = root / gf.BACKEND
    text = path.read_text()
    # the GPU recipe's vLLM (.gpuvllm, prepared with --flashinfer) is patched already
    patched = text if "gpuvllm patch" in text else gf.patch_text(gf.BACKEND, text)
    compile(patched, str(path), "exec")
    assert "torch.ops._C" not in patched and "custom_ops.scaled_fp8_quant(" not in patched
    assert patched.count("gpuvllm patch") == 4  # the import, the helper, two call sites
    with pytest.raises(ValueError, match="vLLM changed"):
        gf.patch_text(gf.BACKEND, patched)  # a target gone


def test_the_query_quantization_is_vllms_static_per_tensor_one():
    ns = {"torch": torch}
    exec(gf._HELPERS.split("\n", 4)[4], ns)  # the helper, without the imports
    x = torch.randn(5, 3 * 128) * 300
    scale = torch.tensor([0.5])
    out, s = ns["_gpuvllm_scaled_fp8_quant"](x, scale)
    assert out.dtype == torch.float8_e4m3fn and out.shape == x.shape and s is scale
    want = (x * 2.0).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.fixture
def cache_write(monkeypatch):
    """vLLM's ``triton_reshape_and_cache_flash`` with the real Triton (CPU build:
    interpreted), told it runs on SM90 (its CUDA branch asks the device)."""
    import vllm.triton_utils as tu

    names = ("HAS_TRITON", "triton", "tl", "tldevice")
    saved = {n: getattr(tu, n) for n in names}
    modules = {m: mod for m, mod in sys.modules.items() if m.startswith("vllm.v1.attention.ops")}
    pc.use_real_triton()
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as mod

    if not ON_GPU:
        monkeypatch.setattr(mod, "_is_supported_kv_cache_dtype", lambda d: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    yield mod.triton_reshape_and_cache_flash
    for n, value in saved.items():
        setattr(tu, n, value)
    for m in [m for m in sys.modules if m.startswith("vllm.v1.attention.ops")]:
        del sys.modules[m]
    sys.modules.update(modules)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_the_triton_cache_write_fills_flashinfers_cache(cache_write, layout, kv_dtype):
    """FlashInfer's ``do_kv_cache_update`` hands the writer views of its
    ``(blocks, heads, block_size, 2 * head_size)`` cache, keys in the first half of
    the last dim: each token's key and value land at its slot (block, offset), FP8
    divided by the layer's scale, padding slots (-1) untouched."""
    dev = torch.device("cuda" if ON_GPU else "cpu")
    blocks, bs, heads, hs, tokens = 3, 16, 2, 64, 7
    qkv = torch.randn(tokens, 4 * heads * hs, device=dev, dtype=torch.bfloat16) * 3
    key = qkv[:, 2 * heads * hs:3 * heads * hs].view(tokens, heads, hs)  # strided, as in vLLM
    value = qkv[:, 3 * heads * hs:].view(tokens, heads, hs)
    dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16
    if layout == "HND":
        cache = torch.zeros(blocks, heads, bs, 2 * hs, device=dev, dtype=dtype)
    else:  # NHD in memory, seen as (blocks, heads, block_size, 2 * hs)
        cache = torch.zeros(blocks, bs, heads, 2 * hs, device=dev, dtype=dtype).transpose(1, 2)
    k_cache, v_cache = cache.transpose(1, 2).split(hs, dim=-1)  # flashinfer.py's views
    slots = torch.tensor([0, 17, 5, -1, 47, 16, 31], device=dev)
    k_scale, v_scale = (torch.tensor([2.0], device=dev), torch.tensor([0.5], device=dev))
    cache_write(key, value, k_cache, v_cache, slots, kv_dtype, k_scale, v_scale)
    want = torch.zeros_like(cache)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k, v = key[t], value[t]
        if kv_dtype == "fp8":  # the kernel's float32 quotient, cast as the running Triton does
            k, v = _fp8_as_kernel_casts(k.float() / 2.0), _fp8_as_kernel_casts(v.float() / 0.5)
        want[s // bs, :, s % bs, :hs], want[s // bs, :, s % bs, hs:] = k, v
    bits = torch.uint8 if kv_dtype == "fp8" else torch.int16
    assert torch.equal(cache.contiguous().view(bits), want.view(bits))  # slot -1: nothing


def _fp8_as_kernel_casts(x: torch.Tensor) -> torch.Tensor:
    """float32 -> fp8e4nv as the running Triton casts it: torch's round to nearest
    even on a GPU (``cvt.rn.satfinite``), the interpreter's numpy conversion on CPU
    (as in test_peer_quantizers.py)."""
    if ON_GPU:
        return x.to(torch.float8_e4m3fn)
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    out = ti._convert_float(x.cpu().numpy(), tl.float32, tl.float8e4nv, ti._ir.ROUNDING_MODE.RTNE)
    return torch.from_numpy(out.astype(np.uint8)).view(torch.float8_e4m3fn).to(x.device)
