"""The CUDA post-RoPE-keys decoder on a machine without a GPU: its scope
(:func:`vllm_lowrank.kernels.cuda.ext.post_rope_scope`), its place among the
decoders, its value lift, and (where nvcc is installed) that its kernel compiles
for sm_90a without spilling. The kernel itself is tested on a GPU
(``tests/kernels/test_cuda_post_rope_decode.py``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import types

import pytest
import torch

from vllm_lowrank.attention import decoders
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.format.latent import SlotLayout
from vllm_lowrank.kernels.cuda import ext

D = 128


def layer_4x(kv=8, qpk=4, kct=64, v_bits=2, v_rank=D, exact_bits=8, k_bits=4, group=1):
    shape = AttentionShape(qpk * kv * D, qpk * kv, kv, D)
    plan = LayerPlan(shape, group, (group * D,) * (kv // group), (v_rank,) * (kv // group))
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, k_bits, v_bits, k_channel_tokens=kct)
    slot = ExactSlot(shape.kv_width, D, torch.bfloat16, exact_bits, 0, layout.slot_bytes)
    return plan, layout, slot


def test_the_4x_layout_is_in_scope():
    for kct in (32, 64):
        for v_bits in (2, 4):
            plan, layout, slot = layer_4x(kct=kct, v_bits=v_bits)
            assert ext.post_rope_scope(plan, layout, slot, block_size=64, sink=64) is None


@pytest.mark.parametrize("v_bits,v_rank", [(2, 64), (4, 64), (4, 96)])
def test_lower_value_ranks_are_in_scope(v_bits, v_rank):
    """Values below full rank keep the CUDA kernel (a lower value rank must not
    fall back to the slower Triton one): ranks whose code rows are whole 16-byte
    chunks."""
    plan, layout, slot = layer_4x(v_bits=v_bits, v_rank=v_rank)
    assert ext.post_rope_scope(plan, layout, slot, block_size=64, sink=64) is None


@pytest.mark.parametrize("change,reason", [
    (dict(kct=16), "key groups of 16"),
    (dict(v_bits=8), "8-bit values"),
    (dict(v_rank=32), "value ranks [32]"),
    (dict(v_rank=96, v_bits=2), "value ranks [96]"),
    (dict(exact_bits=16), "16-bit exact"),
    (dict(k_bits=2), "4-bit per channel"),
    (dict(qpk=16), "8 query heads"),
    (dict(group=2), "head groups"),
    (dict(kv=2), "16-byte aligned"),   # 2 KV heads: a 216-byte slot
])
def test_scope_reasons(change, reason):
    plan, layout, slot = layer_4x(**change)
    why = ext.post_rope_scope(plan, layout, slot, block_size=64, sink=64)
    assert why is not None and reason in why, why


def test_scope_needs_groups_dividing_the_block_and_the_sink():
    plan, layout, slot = layer_4x(kct=64)
    assert "dividing" in ext.post_rope_scope(plan, layout, slot, block_size=32, sink=64)
    assert "dividing" in ext.post_rope_scope(plan, layout, slot, block_size=64, sink=32)


def test_the_decoder_is_tried_first_and_refuses_off_cuda():
    plan, layout, slot = layer_4x()
    layer = types.SimpleNamespace(plan=plan, layout=layout, post_rope=True,
                                  exact=types.SimpleNamespace(sink=64, recent=128, slot=slot))
    fams = decoders.candidates(layer)
    assert fams[:2] == (decoders.PostRopeKeysCudaDecoder, decoders.PostRopeKeysDecoder)
    assert not decoders.PostRopeKeysCudaDecoder.takes_query_tokens
    ctx = decoders.DecoderContext(torch.bfloat16, torch.device("cpu"), 64, None, 4096)
    assert decoders.PostRopeKeysCudaDecoder.supports(layer, ctx) == "not on a CUDA device"
    no_span = types.SimpleNamespace(plan=plan, layout=layout, post_rope=True, exact=None)
    assert "token-adaptive" in decoders.PostRopeKeysCudaDecoder.supports(no_span, ctx)


def test_speculative_decoding_keeps_the_triton_kernel():
    """Verify steps of several query tokens per request: the Triton decoder reads
    the cache once per request (``takes_query_tokens``), the CUDA one would read it
    once per token, so the CUDA decoder steps aside (host checks: no GPU needed)."""
    plan, layout, slot = layer_4x()
    layer = types.SimpleNamespace(plan=plan, layout=layout, post_rope=True,
                                  exact=types.SimpleNamespace(sink=64, recent=128, slot=slot))
    cuda = torch.device("cuda")
    spec = decoders.DecoderContext(torch.bfloat16, cuda, 64, None, 4096, max_query_len=4)
    assert decoders.PostRopeKeysDecoder.supports(layer, spec) is None
    assert decoders.PostRopeKeysDecoder.takes_query_tokens
    assert "speculative" in decoders.PostRopeKeysCudaDecoder.supports(layer, spec)
    plain = decoders.DecoderContext(torch.bfloat16, cuda, 64, None, 4096)
    assert "speculative" not in (decoders.PostRopeKeysCudaDecoder.supports(layer, plain) or "")


def test_lift_is_each_kv_heads_block_transposed():
    plan, _, _ = layer_4x(kv=2, qpk=2)
    v_up = torch.randn(plan.v_width, plan.shape.kv_width)
    lift_t, vsum = ext.post_rope_lift(plan, v_up)
    assert lift_t.shape == (2, D, D) and lift_t.dtype == torch.float16
    for j in range(2):
        block = v_up[j * D:(j + 1) * D, j * D:(j + 1) * D]
        assert torch.allclose(lift_t[j].float(), block.T, atol=1e-2, rtol=1e-3)
        assert torch.allclose(vsum[j], block.sum(0), atol=1e-5, rtol=1e-5)


def test_lift_below_full_rank_is_rank_wide():
    """At value rank 64 the lift is ``[kv, 128, 64]``: each KV head's ``[64, 128]``
    block of ``v_up`` transposed (the kernel's lift reads ``r < Rv`` only)."""
    plan, _, _ = layer_4x(kv=2, qpk=2, v_rank=64)
    v_up = torch.zeros(plan.v_width, plan.shape.kv_width)
    for j, off in enumerate(plan.v_offsets()):
        v_up[off:off + 64, j * D:(j + 1) * D] = torch.randn(64, D)
    lift_t, vsum = ext.post_rope_lift(plan, v_up)
    assert lift_t.shape == (2, D, 64)
    for j in range(2):
        block = v_up[64 * j:64 * (j + 1), j * D:(j + 1) * D]
        assert torch.allclose(lift_t[j].float(), block.T, atol=1e-2, rtol=1e-3)
        assert torch.allclose(vsum[j], block.sum(0), atol=1e-4, rtol=1e-5)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if shutil.os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
def test_kernel_compiles_for_sm90a_without_spills(tmp_path):
    """ptxas' resource report of every compiled variant: no spill stores or loads,
    at most 255 registers (two CTAs of 128 threads per SM need at most 256), and
    the ``4x`` preset's variant (key groups of 64, 2-bit values, rank 128) at most 168, which
    keeps three CTAs resident per SM."""
    src = ext.source_dir() / "post_rope_decode.cu"
    res = subprocess.run(
        [_nvcc(), "-gencode=arch=compute_90a,code=sm_90a",
         "-O3", "-std=c++17", "--use_fast_math", "-cubin", "-Xptxas", "-v",
         "-o", str(tmp_path / "k.cubin"), str(src)],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = res.stderr
    assert len(re.findall(r"Compiling entry function", report)) == 10, report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), report
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 255, regs
    entries = re.findall(r"post_rope_decode_kernelILi(\d+)ELi(\d)ELi(\d+)E[^\n]*\n[^\n]*\n"
                         r"[^\n]*?Used (\d+) registers", report)
    regs_of = {(int(k), int(v), int(rv)): int(r) for k, v, rv, r in entries}
    assert regs_of[(64, 2, 128)] <= 168, regs_of
