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


def _capacity(model_path, compression=None, **kwargs) -> tuple[int, int]:
    from vllm_lowrank.metrics import kv_capacity_tokens

    llm = make_llm(model_path, compression, block_size=32, **kwargs)
    sched = llm.llm_engine.vllm_config.scheduler_config
    out = kv_capacity_tokens(llm.llm_engine.vllm_config.cache_config), \
        sched.long_prefill_token_threshold
    del llm
    gc.collect()
    return out


def test_token_adaptive_capacity_holds_under_default_scheduler_limits(model_path):
    from vllm_lowrank.format.exact import PREFILL_CHUNK_TOKENS

    stock, threshold = _capacity(model_path)
    assert threshold == 0  # stock vLLM: no per-request cap
    config = {"mode": "lowrank", "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4,
              "token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128}
    capped, threshold = _capacity(model_path, config)
    assert threshold == PREFILL_CHUNK_TOKENS
    # a user's explicit chunk cap wins; 2,048 (the model length) is the old behaviour
    uncapped, threshold = _capacity(model_path, config, long_prefill_token_threshold=2048)
    assert threshold == 2048
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
