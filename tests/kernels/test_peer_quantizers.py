"""The torch ports of vLLM's KV-cache quantizers (``benchmarks/peer_caches.py``)
against vLLM's own Triton store (and dequant) kernels, bit for bit.

On a machine without CUDA vLLM's kernels run under ``TRITON_INTERPRET=1`` (set
by ``conftest.py``) on CPU tensors. vLLM's CPU build switches its Triton off
(``vllm.triton_utils`` hands out placeholders when Triton has no CPU backend);
this module hands the real ``triton`` to ``vllm.triton_utils`` and (re)imports
vLLM's kernel modules after that (``peer_caches.use_real_triton``, for this
module's tests only), so their ``@triton.jit`` functions run in the interpreter.

    python -P -m pytest tests/kernels/test_peer_quantizers.py -q
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import REPO

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"

triton = pytest.importorskip("triton")
pytest.importorskip("vllm")

import triton.language as tl  # noqa: E402

sys.path.insert(0, str(REPO))
import benchmarks.peer_caches as pc  # noqa: E402



@pytest.fixture(scope="module", autouse=True)
def real_triton_for_vllm():
    """vLLM's kernels in the interpreter (CPU build) for this module's tests
    only (:func:`benchmarks.peer_caches.use_real_triton`), undone afterwards: an
    in-process engine built later (``conftest.make_llm``) would otherwise see
    Triton and run vLLM's model runner V2 with every kernel interpreted."""
    import vllm.triton_utils as tu

    names = ("HAS_TRITON", "triton", "tl", "tldevice")
    saved = {n: getattr(tu, n) for n in names}
    modules = {m: mod for m, mod in sys.modules.items() if m.startswith("vllm.v1.attention.ops")}
    pc.use_real_triton()
    yield
    for n, value in saved.items():
        setattr(tu, n, value)
    for m in [m for m in sys.modules if m.startswith("vllm.v1.attention.ops")]:
        del sys.modules[m]
    sys.modules.update(modules)

DEV = torch.device("cuda" if ON_GPU else "cpu")
NUM_BLOCKS, BLOCK, HEADS = 3, 16, 2

GPU_INT4_READ = pytest.mark.xfail(
    ON_GPU, strict=True,
    reason="on an H200 vLLM's compiled INT4 attention kernel differs from attention over "
           "the port's round trip by up to 0.60 relative (equal in the interpreter; "
           "peer_decode.py's rel column): not explained (benchmarks/README.md, GPU test tiers)")
GPU_TQ_128 = pytest.mark.xfail(
    ON_GPU, strict=True,
    reason="on an H200 vLLM's compiled TurboQuant kernels are not bit-equal to the port's "
           "float16 roundings at head_dim 128 (64 is; equal in the interpreter)")


def _inputs(n: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Keys and values with per-row scales spread over four decades and one
    outlier channel per row (what makes per-token scales matter)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, HEADS, d, generator=g)
    x = x * torch.logspace(-2, 2, n)[None, :, None, None]
    x[:, :, :, 3] *= 8
    x = x.to(dtype).to(DEV)
    return x[0].contiguous(), x[1].contiguous()


def _fp8_as_kernel_casts(x: torch.Tensor) -> torch.Tensor:
    """float32 -> fp8e4nv bytes as the running Triton casts them: on a GPU
    ``cvt.rn.satfinite`` (round to nearest even, what torch's cast does); the
    interpreter's own numpy conversion otherwise (its "RTNE" rounds ties up and
    drops the mantissa carry, so it differs from the GPU in a few percent of
    values)."""
    if ON_GPU:
        return x.float().to(torch.float8_e4m3fn).view(torch.uint8)
    import numpy as np
    from triton.runtime import interpreter as ti

    out = ti._convert_float(x.float().cpu().numpy(), tl.float32, tl.float8e4nv,
                            ti._ir.ROUNDING_MODE.RTNE)
    return torch.from_numpy(out.astype(np.uint8)).to(x.device)


def _assert_fp8_bit_exact_but_cast(got: torch.Tensor, pre: torch.Tensor, port: torch.Tensor):
    """The kernel's fp8 bytes ``got`` are the running Triton's cast of the
    port's pre-cast float32 values ``pre``, bit for bit; the port's own cast
    ``port`` (torch, round to nearest even = the GPU's) is never farther from
    ``pre`` than the kernel's value (it differs only where the interpreter's
    cast is not the nearest)."""
    assert torch.equal(got.view(torch.uint8), _fp8_as_kernel_casts(pre))
    g = got.view(torch.float8_e4m3fn).float()
    assert torch.all((port.float() - pre).abs() <= (g - pre).abs())


def _slots(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:n].to(DEV)


# ---------------------------------------------------------------------------------
# int8 / fp8 per token and head
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_head_store_bit_exact(kind, dtype):
    from vllm.platforms import current_platform
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    d, n = 64, 11
    cd = torch.int8 if kind.startswith("int8") else current_platform.fp8_dtype()
    k, v = _inputs(n, d, dtype)
    slots = _slots(n)
    kc = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, d, dtype=cd, device=DEV)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, dtype=torch.float32, device=DEV)
    vs = torch.zeros_like(ks)
    triton_reshape_and_cache_flash_per_token_head_quant(k, v, kc, vc, ks, vs, slots,
                                                        get_kv_quant_mode(kind))
    for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
        codes, scale = pc.per_token_head_store(x, cd)
        got_codes = cache.view(-1, HEADS, d)[slots]
        got_scale = scales.view(-1, HEADS)[slots]
        assert torch.equal(got_scale.view(torch.int32), scale.view(torch.int32))
        if cd == torch.int8:
            assert torch.equal(got_codes, codes)
        else:
            pre = pc.per_token_head_prequant(x, cd)
            assert torch.equal(codes, pre.to(cd))
            _assert_fp8_bit_exact_but_cast(got_codes, pre, codes)
            continue
        # and the round trip is what the attention kernel multiplies out
        assert torch.equal(pc.per_token_head_load(got_codes, got_scale),
                           pc.per_token_head_load(codes, scale))


# ---------------------------------------------------------------------------------
# int4 per token and head (RHT + asymmetric nibbles, zero point in the scale)
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_int4_store_bit_exact(dtype, d):
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4, single_rht

    n = 9
    k, v = _inputs(n, d, dtype, seed=2)
    slots = _slots(n)
    kc = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, d // 2, dtype=torch.uint8, device=DEV)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, dtype=torch.float32, device=DEV)
    vs = torch.zeros_like(ks)
    reshape_and_cache_int4(k, v, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs)
    for x, cache, scales in ((k, kc, ks), (v, vc, vs)):
        codes, packed = pc.int4_store(single_rht(x.float()).to(x.dtype))
        got = cache.view(-1, HEADS, d // 2)[slots]
        got_codes = torch.stack([got & 0xF, got >> 4], dim=-1).reshape(n, HEADS, d)
        assert torch.equal(got_codes, codes)
        assert torch.equal(scales.view(-1, HEADS)[slots].view(torch.int32),
                           packed.view(torch.int32))


@GPU_INT4_READ
def test_int4_roundtrip_matches_attention_kernel():
    """vLLM's INT4 attention kernel over its own cache equals attention over
    the port's round-tripped keys and values (the read side of the port)."""
    from vllm.v1.attention.ops.int4_per_token_head import (
        reshape_and_cache_int4,
        unified_attention_int4,
    )

    d, n, q_per_kv = 64, 20, 3
    k, v = _inputs(n, d, torch.float32, seed=3)
    k, v = k / 10, v / 10
    q = torch.randn(n, HEADS * q_per_kv, d, generator=torch.Generator().manual_seed(4)).to(DEV)
    kc = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, d // 2, dtype=torch.uint8, device=DEV)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, dtype=torch.float32, device=DEV)
    vs = torch.zeros_like(ks)
    slots = torch.arange(n, device=DEV)  # blocks 0 and 1 of one sequence
    reshape_and_cache_int4(k, v, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs)
    out = torch.zeros_like(q)
    scale = d ** -0.5
    unified_attention_int4(
        q.clone(), kc, vc, out, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=DEV),
        max_seqlen_q=n, seqused_k=torch.tensor([n], dtype=torch.int32, device=DEV),
        max_seqlen_k=n, softmax_scale=scale, window_size=(-1, -1),
        block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEV), softcap=0.0,
        sinks=None,
        alibi_slopes=None, use_alibi_sqrt=False, qq_bias=None, output_scale=None,
        mm_prefix_range=None, k_scale_cache=ks, v_scale_cache=vs)
    kh, vh = pc.roundtrip("int4_per_token_head", k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kh.transpose(0, 1)[None], vh.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    raw = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    tol = (2e-3, 1e-2) if ON_GPU else (2e-5, 1e-4)  # tf32 tensor-core dots on a GPU
    assert torch.allclose(out, ref, atol=tol[0], rtol=tol[1]), (out - ref).abs().max()
    assert (out - raw).abs().max() > 100 * (out - ref).abs().max()  # 4-bit noise is seen


# ---------------------------------------------------------------------------------
# TurboQuant (FP8 or Lloyd-Max keys, uniform values)
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["turboquant_k8v4", "turboquant_4bit_nc",
                                  "turboquant_k3v4_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=GPU_TQ_128)])
def test_turboquant_store_and_dequant_bit_exact(kind, d):
    from vllm.v1.attention.ops.triton_turboquant_decode import _tq_full_dequant_kv
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    n = 10
    k, v = _inputs(n, d, torch.bfloat16, seed=5)
    k = k / 10  # FP8 keys (k8v4) are cast without a scale: stay inside +-448
    cfg = pc.tq_config(kind, d)
    H, centroids, midpoints = pc.tq_tables(cfg, DEV)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, cfg.slot_size_aligned, dtype=torch.uint8,
                        device=DEV)
    slots = torch.arange(n, dtype=torch.int32, device=DEV)  # one sequence from slot 0
    triton_turboquant_store(k, v, cache, slots, H, midpoints, mse_bits=cfg.key_mse_bits,
                            key_packed_size=cfg.key_packed_size,
                            value_quant_bits=cfg.value_quant_bits, key_fp8=cfg.key_fp8)
    # their bulk dequant (continuation prefill): rotated keys and values, fp16
    k_out = torch.zeros(1, HEADS, n, d, dtype=torch.float16, device=DEV)
    v_out = torch.zeros_like(k_out)
    bt = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEV)
    _tq_full_dequant_kv[(n, HEADS)](
        cache, bt, centroids, k_out, v_out, k_out.stride(0), k_out.stride(1),
        k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
        cache.stride(0), cache.stride(1), cache.stride(2), bt.stride(0),
        HEAD_DIM=d, BLOCK_SIZE=BLOCK, NUM_KV_HEADS=HEADS,
        MSE_BYTES=(d * cfg.key_mse_bits + 7) // 8, KPS=cfg.key_packed_size,
        VQB=cfg.value_quant_bits, VAL_DATA_BYTES=(d * cfg.value_quant_bits + 7) // 8,
        MSE_BITS=cfg.key_mse_bits, KEY_FP8=int(cfg.key_fp8),
        BLOCK_D=triton.next_power_of_2(d), NORM_CORRECTION=int(cfg.norm_correction),
        FP8_E4B15=0)
    stored = pc.tq_key_store(k, cfg, H, midpoints)
    k_rot = pc.tq_key_load_rotated(stored, cfg, centroids)
    v_hat = pc.tq_value_load(*pc.tq_value_store(v, cfg.value_quant_bits))
    flat = cache.view(-1, HEADS, cfg.slot_size_aligned)[:n]
    if cfg.key_fp8:  # the kernel's key bytes are the cast of the raw keys
        _assert_fp8_bit_exact_but_cast(flat[..., :d], k.float(), stored[0])
    else:
        assert torch.equal(k_out[0].transpose(0, 1), k_rot.to(torch.float16))
    assert torch.equal(v_out[0].transpose(0, 1), v_hat.to(torch.float16))
    # the stored norm / value scale and minimum bytes, exactly
    vb = cfg.key_packed_size + (d * cfg.value_quant_bits + 7) // 8
    _, sc16, zr16 = pc.tq_value_store(v, cfg.value_quant_bits)
    assert torch.equal(flat[..., vb:vb + 4].contiguous().view(torch.float16),
                       torch.stack([sc16, zr16], -1))
    if not cfg.key_fp8:
        _, norm16 = pc.tq_key_store(k, cfg, H, midpoints)
        nb = (d * cfg.key_mse_bits + 7) // 8
        assert torch.equal(flat[..., nb:nb + 2].contiguous().view(torch.float16)[..., 0],
                           norm16)


# ---------------------------------------------------------------------------------
# UltraQuant (FP4 E2M1 + UE8M0 group scales, Hadamard-rotated keys)
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_ultraquant_store_bit_exact(d):
    from vllm.v1.attention.ops.ultraquant.format import (
        k_scales_offset,
        n_groups,
        slot_size,
        v_codes_offset,
        v_scales_offset,
    )
    from vllm.v1.attention.ops.ultraquant.reference import (
        ultraquant_dequant,
        ultraquant_encode,
    )
    from vllm.v1.attention.ops.ultraquant.triton_dequant import ultraquant_full_dequant_kv
    from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store

    n = 10
    k, v = _inputs(n, d, torch.bfloat16, seed=6)
    cache = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, slot_size(d), dtype=torch.uint8,
                        device=DEV)
    ultraquant_store(k, v, cache, torch.arange(n, device=DEV))
    flat = cache.view(-1, HEADS, slot_size(d))[:n]
    g = n_groups(d)
    ek = ultraquant_encode(pc.uq_rotate(k), rotate=False)
    ev = ultraquant_encode(v.float(), rotate=False)
    assert torch.equal(flat[..., :d // 2], ek.codes_packed)
    assert torch.equal(flat[..., k_scales_offset(d):k_scales_offset(d) + g], ek.scale_bytes)
    assert torch.equal(flat[..., v_codes_offset(d):v_codes_offset(d) + d // 2],
                       ev.codes_packed)
    assert torch.equal(flat[..., v_scales_offset(d):v_scales_offset(d) + g], ev.scale_bytes)
    # their dequant kernel: rotated keys and values (exact in bf16: code x 2^e)
    k_out = torch.zeros(1, HEADS, n, d, dtype=torch.bfloat16, device=DEV)
    v_out = torch.zeros_like(k_out)
    ultraquant_full_dequant_kv(cache, torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEV),
                               k_out, v_out, n)
    assert torch.equal(k_out[0].transpose(0, 1).float(), ultraquant_dequant(ek, d))
    assert torch.equal(v_out[0].transpose(0, 1).float(), ultraquant_dequant(ev, d))
    # the port's round trip is that dequant, rotated back
    k_hat, v_hat = pc.uq_roundtrip(k, v)
    assert torch.equal(k_hat, pc.uq_rotate(ultraquant_dequant(ek, d)))
    assert torch.equal(v_hat, ultraquant_dequant(ev, d))


def test_ultraquant_reference_rotation_differs_from_kernel_only_in_rounding():
    """vLLM's reference rotates with ``x @ H.T`` (one matmul), the kernel with a
    butterfly: the port uses the kernel's; both are the same orthonormal map."""
    from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix

    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(7))
    H = hadamard_matrix(64, x.device, torch.float32)
    assert torch.allclose(pc.uq_rotate(x), x @ H.T, atol=1e-5)
    assert torch.allclose(pc.uq_rotate(pc.uq_rotate(x)), x, atol=1e-5)


# ---------------------------------------------------------------------------------
# bytes per token, from vLLM's page-size code
# ---------------------------------------------------------------------------------
def test_slot_bytes_from_vllm_specs():
    # SmolLM2-135M: 3 KV heads, head_dim 64; per token and layer, K and V
    assert pc.slot_bytes("int8_per_token_head", 3, 64) == 3 * (2 * 64 + 2 * 4)
    assert pc.slot_bytes("int4_per_token_head", 3, 64) == 3 * (2 * 32 + 2 * 4)
    assert pc.slot_bytes("turboquant_k8v4", 3, 64) == 3 * (64 + 32 + 4)
    assert pc.slot_bytes("turboquant_3bit_nc", 3, 64) == 3 * (24 + 2 + 24 + 4)
    assert pc.slot_bytes("ultraquant_4bit", 3, 64) == 3 * (32 + 2 + 32 + 2)
    assert pc.slot_bytes("nvfp4", 3, 64) == 2 * 3 * (32 + 4)
    # TurboQuant / UltraQuant keep the first and last two of 30 layers at 16 bits
    assert pc.skipped_layers("turboquant_4bit_nc", 30) == {0, 1, 28, 29}
    assert pc.skipped_layers("int4_per_token_head", 30) == set()
    full, alloc = pc.bytes_per_token("turboquant_4bit_nc", 30, 3, 64)
    assert (full, alloc) == (30 * 768, 4 * 768 + 26 * 210)


def test_unsupported_formats_refuse():
    with pytest.raises(NotImplementedError, match="FlashInfer"):
        pc.roundtrip("nvfp4", torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
