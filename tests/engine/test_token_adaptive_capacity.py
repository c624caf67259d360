"""Capacity of the token-adaptive mode under vLLM's default scheduler limits.

Every token of a prefill chunk is written to the exact cache for its step, so
vLLM reserves exact blocks for the chunk a request has in flight. With vLLM's
default step budget that reservation (a whole chunk per request) used to leave
less capacity than the uncompressed cache; the plugin now caps the per-request
chunk (:data:`vllm_lowrank.format.exact.PREFILL_CHUNK_TOKENS`) and the exact
group's reservation follows the cap.
"""

from __future__ import annotations

import gc

import pytest

from conftest import make_llm

pytestmark = pytest.mark.slow


def _capacity(model_path, compression=None, **kwargs) -> tuple[int, int, float, int, float]:
    """``(KV tokens, long_prefill_token_threshold, maximum concurrency,
    max_concurrent_batches, watermark)`` of an engine (block size 32, 2,048
    tokens)."""
    from vllm_lowrank.metrics import kv_capacity_tokens

    llm = make_llm(model_path, compression, block_size=32, **kwargs)
    cfg = llm.llm_engine.vllm_config
    out = (kv_capacity_tokens(cfg.cache_config), cfg.scheduler_config.long_prefill_token_threshold,
           cfg.cache_config.kv_cache_max_concurrency, cfg.max_concurrent_batches,
           cfg.scheduler_config.watermark)
    del llm
    gc.collect()
    return out


def _estimated(model_path, compression: dict, batches: int) -> dict:
    """``vllm-lowrank estimate`` for the engines :func:`_capacity` starts
    (float32, 1 GiB of KV cache: ``VLLM_CPU_KVCACHE_SPACE``, 2,048 tokens)."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.estimate import estimate

    return estimate(model_path, LowRankConfig.from_dict(compression), dtype="float32",
                    kv_cache_gib=1.0, block_size=32, context=2048,
                    concurrent_batches=batches)


def test_token_adaptive_capacity_holds_under_default_scheduler_limits(model_path):
    from vllm_lowrank.format.exact import PREEMPTION_WATERMARK, PREFILL_CHUNK_TOKENS

    stock, threshold, stock_concurrency, batches, watermark = _capacity(model_path)
    assert threshold == 0 and watermark == 0.0  # stock vLLM: no per-request cap, no watermark
    config = {"mode": "lowrank", "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4,
              "token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128}
    capped, threshold, concurrency, _, watermark = _capacity(model_path, config)
    assert threshold == PREFILL_CHUNK_TOKENS
    assert watermark == PREEMPTION_WATERMARK
    # the estimate's worst-case concurrency is the one vLLM computes for these engines
    info = _estimated(model_path, config, batches)
    assert info["admitted_sequences"] == pytest.approx(concurrency, abs=0.01)
    assert info["stock_admitted_sequences"] == pytest.approx(stock_concurrency, abs=0.01)
    # and below the pages a prefilled request holds: the reservation for the window and
    # the chunk in flight
    assert info["admitted_sequences"] < info["sequences"]
    # a user's explicit chunk cap and watermark win; 2,048 (the model length) is the old
    # behaviour
    uncapped, threshold, _, _, watermark = _capacity(model_path, config,
                                                     long_prefill_token_threshold=2048,
                                                     watermark=0.25)
    assert threshold == 2048 and watermark == 0.25
    # per request at 2,048 tokens: 4-bit latents (~1/13 of a float32 K+V slot) plus
    # exact blocks for 32 sinks, the 129-token window and the chunk in flight
    assert capped / stock >= 2.0, (capped, stock)
    assert capped / uncapped >= 1.5, (capped, uncapped)


@pytest.mark.isolated  # the engine core runs in this process
def test_layers_of_different_ranks_share_one_cache_group_per_kind(model_path, monkeypatch):
    """Token-adaptive layers whose ranks differ (a byte-budget allocation's
    shape), with per-channel keys (each exact slot stages its layer's key
    latent): vLLM keeps all latent caches in one cache group and all exact
    caches in another. With a group per layer its scheduler walked 2 x 30
    groups of every request at every step, and equal-page groups hold no more
    tokens."""
    from vllm_lowrank.metrics import kv_capacity_tokens

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in-process
    ranks = {str(i): [48 + 16 * (i % 3), 96 - 16 * (i % 3)] for i in range(30)}
    llm = make_llm(model_path, {"mode": "lowrank", "artifact": "none", "ranks": ranks,
                                "k_bits": 4, "v_bits": 4, "token_adaptive": True,
                                "sink_tokens": 32, "recent_tokens": 64, "k_quant": "channel",
                                "k_channel_tokens": 32}, block_size=32)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
    assert kinds == ["ExactTokensSpec", "FullAttentionSpec"], kinds
    assert all(len(g.layer_names) == 30 for g in groups)
    assert kv_capacity_tokens(llm.llm_engine.vllm_config.cache_config) > 0
    del llm
    gc.collect()
