"""Tensor parallelism inside vLLM's engine on two GPUs (skipped without two CUDA
devices and the GPU recipe's models). On the two-GPU machine, from the project
root::

    source .gpuvllm/env.sh && python3 -P -m pytest -q tests/gpu_engine/test_gpu_engine_tp.py

Each engine runs in its own ``probe.py`` process at ``--tensor-parallel-size 2``:
vLLM's ``mp`` executor (a worker process per GPU), NCCL all-reduce through
torch (vLLM's custom all-reduce, a compiled kernel, off), no NVLink multicast
(``gpu_serving.NO_MULTICAST``). The model is the 2-layer Llama-3-8B attention
shape (32 query / 8 KV heads of 128: 4 KV heads per rank). Checks, as the
one-GPU tests (``test_gpu_engine.py``) make them:

- the default, each preset (``8x`` as its storage with fixed ranks: the GPU
  machine cannot calibrate) and the other decoder families serve through CUDA
  graphs, chunked prefill mixed with decode, a prefix-cache hit, and preemption
  with a cache of few blocks (the tokens of the unpreempted run);
- each rank's KV capacity is its KV memory over the bytes it stores per token
  (what its worker reports), within 3 %; both ranks store the same;
- at ratio 1.0 in float32 the greedy tokens and log-probabilities equal the
  uncompressed TP=2 engine's and the TP=1 engine's (a seeded random checkpoint:
  vLLM's dummy weights are drawn per rank shard, so at TP=2 they are another
  model than at TP=1), up to the first near tie.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from test_gpu_engine import (SETTINGS, TIE16, _check_run, _float32_steps_agree, _same_until_tie,
                             probe)
from vllm_lowrank.presets import PRESETS, expand

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from allocations import alloc_8x_ranks  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif("GPUVLLM_MODELS" not in os.environ,
                       reason="needs the GPU recipe (source .gpuvllm/env.sh)"),
]

TP = 2
MODEL = "small-h128"
LAYERS, KV_HEADS, HEAD_DIM = 2, 8, 128  # probe.MODELS["small-h128"]

TP_SETTINGS = {
    **{name: (SETTINGS[name], None) for name in (
        "default", "preset-4x", "preset-lossless", "jlrd-0.75-tale", "jlrd", "g1-uniform",
        "post-rope-keys")},
    # the 8x preset's recipe with its SmolLM2 allocation's ranks stretched to these
    # layers (multiples of 16: 8 per rank) and its block size; its own allocation
    # needs calibration text, which the GPU machine has not
    "alloc-8x": ({**PRESETS["8x"].settings, "ranks": alloc_8x_ranks(LAYERS, 1024, tp=TP)},
                 PRESETS["8x"].block_size),
}
"""``name: (compression config, KV block size or None)`` at TP=2."""

PRESET_SETTINGS = ["default", "preset-4x", "preset-lossless", "alloc-8x"]


def _tp_probe(setting: str | None, **kw) -> dict:
    config, block_size = TP_SETTINGS[setting] if setting else (None, None)
    return probe(MODEL, config, tp=TP, block_size=block_size, **kw)


@pytest.mark.parametrize("setting", list(TP_SETTINGS))
def test_setting_serves_at_tp2(setting):
    """CUDA graphs, chunked prefill mixed with decode and a prefix-cache hit at
    TP=2; each rank holds its KV bytes over its own stored bytes per token
    (token-adaptive settings hold exact tokens besides: not checked here)."""
    out = _tp_probe(setting)
    _check_run(out)
    if setting in PRESET_SETTINGS:  # the others as at TP=1: graphs where the decoder allows
        assert "FULL" in out["cudagraph_mode"], out["cudagraph_mode"]
    assert out["paths"], "no latent layer reported a decoder"
    ranks = out["ranks"]
    assert [r["tp"] for r in ranks] == list(range(TP)), ranks
    assert len({r["stored_bytes_per_token"] for r in ranks}) == 1, ranks
    if expand(TP_SETTINGS[setting][0]).get("token_adaptive"):
        return
    per_rank = out["kv_bytes"] / ranks[0]["stored_bytes_per_token"]
    assert out["kv_tokens"] == pytest.approx(per_rank, rel=0.03), (out["kv_tokens"], ranks)


def test_stock_tp2_capacity_is_per_rank():
    """Stock vLLM at TP=2: each rank caches its 4 KV heads of every token in
    its own KV memory (bf16)."""
    out = _tp_probe(None)
    _check_run(out)
    per_token = LAYERS * 2 * (KV_HEADS // TP) * HEAD_DIM * 2
    assert out["kv_tokens"] == pytest.approx(out["kv_bytes"] / per_token, rel=0.03)


@pytest.mark.parametrize("setting", PRESET_SETTINGS)
def test_preemption_recomputes_the_same_tokens_at_tp2(setting):
    """A cache too small for the 10 prompts of 40..1,500 tokens + 24 generated of
    ``mixed`` (about 6,500 tokens, besides the exact windows of token-adaptive
    settings): requests are preempted, recomputed, and give the tokens of the
    roomy run. Token-adaptive settings get about 3,072 tokens by vLLM's count
    (1.5 requests of ``max_model_len``, so the engine starts); the others the
    one-GPU test's 260 blocks of 16 (the scheduler is the same at any TP size:
    with 192 blocks the default's run was never preempted, H200 x2)."""
    base = _tp_probe(setting)
    blocks = (round(base["num_gpu_blocks"] * 3072 / base["kv_tokens"])
              if expand(TP_SETTINGS[setting][0]).get("token_adaptive") else 260)
    tight = _tp_probe(setting, blocks=blocks)
    assert tight["preemptions"] > 0
    _check_run(tight, expect_hit=False)
    for got, ref in zip(tight["mixed"], base["mixed"]):
        _same_until_tie(got, ref, TIE16)


FULL_RANK = {"rank_fraction": 1.0, "head_group_size": 1}


def _float32(config, tp: int) -> dict:
    return probe(MODEL, config, dtype="float32", tp=tp, weights="random")


def test_stock_tp2_equals_stock_tp1():
    """The reference of the next test: with the same checkpoint stock vLLM
    gives the same float32 greedy tokens at TP=2 as at TP=1 (the all-reduce
    sums in another order: log-probabilities within 1e-4 nats)."""
    assert _float32_steps_agree(_float32(None, TP), _float32(None, 1), 1e-4) >= 15


def test_full_rank_float32_greedy_equals_stock_tp2_and_tp1():
    """At ratio 1.0 in float32 the TP=2 plugin engine computes stock attention
    up to float32 rounding: its tokens and log-probabilities equal stock TP=2's
    (1e-5 nats, as at TP=1) and the TP=1 plugin engine's (1e-4: the all-reduce
    order), up to the first top-2 gap under 1e-6 nats."""
    full2 = _float32(FULL_RANK, TP)
    assert _float32_steps_agree(full2, _float32(None, TP), 1e-5) >= 15
    assert _float32_steps_agree(full2, _float32(FULL_RANK, 1), 1e-4) >= 15
