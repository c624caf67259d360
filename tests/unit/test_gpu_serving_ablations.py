"""``benchmarks/gpu_serving.py``'s ablated configs (``CONFIG@no-latent-kernel``,
``CONFIG@no-decode``): names are checked before any engine starts, and each
ablation replaces exactly its part of the decode by zeroing that part's output.
The engines themselves run on the GPU machine only."""

from __future__ import annotations

import pytest
import torch

from conftest import benchmark_module
from vllm_lowrank.attention import decode_path, token_adaptive
from vllm_lowrank.kernels.triton import decode_latent_rope


@pytest.fixture(scope="module")
def serving():
    return benchmark_module("gpu_serving")


def test_ablated_names_resolve_to_their_config(serving):
    for ablation in serving.ABLATIONS:
        assert serving._spec(f"alloc-8x-re@{ablation}") is serving.CONFIGS["alloc-8x-re"]
    assert serving._spec("preset-4x@no-decode") is serving.CONFIGS["preset-4x"]


@pytest.mark.parametrize("name, why", [
    ("alloc-8x-re@no-kernel", "unknown config"),
    ("no-such-config", "unknown config"),
    ("stock@no-decode", "token_adaptive"),             # stock has no plugin decode
    ("default@no-decode", "token_adaptive"),           # the 2x preset is not token-adaptive
    ("preset-4x@no-latent-kernel", "rope_equivariant"),  # its layers take the wide kernel
])
def test_names_that_cannot_run_are_refused(serving, name, why):
    with pytest.raises(SystemExit, match=why):
        serving._spec(name)


def test_no_latent_kernel_zeroes_the_kernels_outputs_only(serving, monkeypatch):
    # restored after the test: _ablate rebinds these module attributes
    monkeypatch.setattr(decode_latent_rope, "launch", decode_latent_rope.launch)
    monkeypatch.setattr(decode_path, "self_check", decode_path.self_check)
    decode = token_adaptive.decode
    serving._ablate("alloc-8x-re@no-latent-kernel")
    args = [torch.ones(3)] * 24 + [torch.ones(2, 5), torch.ones(2, 4), torch.ones(2, 7)]
    query = args[2] = torch.ones(4)
    decode_latent_rope.launch(None, tuple(args), {}, 64, 1, 2)
    assert all(float(t.abs().sum()) == 0 for t in args[24:27])  # po, plse, out
    assert float(query.sum()) == 4  # nothing else written
    assert decode_path.self_check() == 0.0
    assert token_adaptive.decode is decode


def test_no_decode_zeroes_the_token_adaptive_output(serving, monkeypatch):
    monkeypatch.setattr(token_adaptive, "decode", token_adaptive.decode)
    launch = decode_latent_rope.launch
    serving._ablate("alloc-8x-re@no-decode")
    out = torch.ones(3, 8)
    token_adaptive.decode(None, None, None, None, 1.0, torch.ones(3, 2, 4), out=out, sink=32)
    assert float(out.abs().sum()) == 0
    assert decode_latent_rope.launch is launch
