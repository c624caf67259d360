"""Byte-budget artifacts served by vLLM: per-layer bits and the serving
settings recorded by the allocation (:mod:`vllm_lowrank.calibration.allocate`).

- Bits that differ by layer (8 and 16 bits per side, full rank, per-layer page
  sizes) keep the uncompressed model's greedy tokens, and vLLM's capacity is
  the one computed by hand from those bytes.
- A real allocation (token-adaptive, per-channel keys, one page) is served
  with exactly the recorded ranks and bits, from the artifact alone.
"""

from __future__ import annotations

import gc
import os

import pytest

from conftest import (
    PROMPTS,
    calibrated,
    clear_worker_states,
    greedy_with_gaps,
    make_llm,
    worker_states,
)

pytestmark = pytest.mark.slow

LAYERS, KV_WIDTH = 30, 3 * 64


def _capacity(llm) -> int:
    from vllm_lowrank.metrics import kv_capacity_tokens

    return kv_capacity_tokens(llm.llm_engine.vllm_config.cache_config)


@pytest.fixture(scope="module")
def fisher(model_path):
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.calibration.cache import load_or_calibrate

    return load_or_calibrate(model_path, LowRankConfig.from_dict(calibrated({"mode": "lowrank"})))[0]


@pytest.fixture(scope="module")
def stock(model_path):
    llm = make_llm(model_path)
    tokens, gaps = greedy_with_gaps(llm, PROMPTS, max_tokens=16)
    capacity = _capacity(llm)
    del llm
    gc.collect()
    return tokens, gaps, capacity


def test_per_layer_bits_keep_greedy_tokens_and_capacity(model_path, fisher, stock, tmp_path):
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.calibration.allocate import record_allocation
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.factorization import budget as bud

    cycle = [(8, 16), (16, 8), (8, 8)]
    full = (KV_WIDTH,)  # one head group of 3 KV heads, full rank: the cache holds K, V
    layers = {i: bud.LayerChoice(bud.SideOption(cycle[i % 3][0], full, 0, 0.0),
                                 bud.SideOption(cycle[i % 3][1], full, 0, 0.0))
              for i in range(LAYERS)}
    out = art.Artifact(manifest=dict(fisher.manifest), bases=fisher.bases)
    record_allocation(out, bud.Allocation(layers, {}, 0.0, 0.0),
                      LowRankConfig(mode="lowrank"), {"note": "test"})
    path = str(tmp_path / "bits")
    out.save(path)
    clear_worker_states()
    llm = make_llm(model_path, {"mode": "lowrank", "artifact": path})
    got, _ = greedy_with_gaps(llm, PROMPTS, max_tokens=16)
    capacity = _capacity(llm)
    states = worker_states()
    del llm
    gc.collect()
    built = states[0]["layers"]
    assert [tuple(built[str(i)]["bits"]) for i in range(LAYERS)] == [cycle[i % 3]
                                                                     for i in range(LAYERS)]
    ref, ref_gaps, stock_capacity = stock
    compared = []
    for g, r, gaps in zip(got, ref, ref_gaps):
        n = next((i for i, gap in enumerate(gaps[:16]) if gap < 0.05), 16)
        assert g[:n] == r[:n]
        compared.append(n)
    assert sum(n == 16 for n in compared) >= len(PROMPTS) - 1, compared
    # by hand: an 8-bit side is 192 codes + one float16 scale and zero; 16-bit: 192 x 2 B
    side = {8: KV_WIDTH + 4, 16: 2 * KV_WIDTH}
    stored = sum(side[cycle[i % 3][0]] + side[cycle[i % 3][1]] for i in range(LAYERS))
    original = LAYERS * 2 * KV_WIDTH * 4  # the stock engine's float32 K + V
    assert capacity / stock_capacity == pytest.approx(original / stored, rel=0.03)


def test_allocated_artifact_is_served_as_recorded(model_path, fisher, stock, tmp_path):
    """A real 6x allocation (measured on one calibration window), token-adaptive
    with per-channel keys, at KV blocks of 32: the engine reads every setting
    from the artifact, the block size too (none given), builds the recorded
    ranks and bits with one slot size, and prompts inside the exact recent
    window give the uncompressed tokens."""
    import json

    from vllm_lowrank.calibration.allocate import budget_artifact
    from vllm_lowrank.config import LowRankConfig

    serving = LowRankConfig(mode="lowrank", token_adaptive=True, sink_tokens=32,
                            recent_tokens=128, k_quant="channel", k_bits=8, v_bits=8)
    out, report = budget_artifact(model_path, fisher, serving, ratio=6.0, context=4096,
                                  block_size=32, num_windows=1, choose_knobs=False)
    assert report["compression_ratio"] >= 6.0
    path = str(tmp_path / "alloc")
    out.save(path)
    with open(os.path.join(path, "manifest.json")) as f:
        recorded = json.load(f)["ranks"]
    clear_worker_states()
    llm = make_llm(model_path, {"mode": "lowrank", "artifact": path})
    assert llm.llm_engine.vllm_config.cache_config.block_size == report["block_size"] == 32
    got, _ = greedy_with_gaps(llm, PROMPTS, max_tokens=16)
    states = worker_states()
    del llm
    gc.collect()
    built = states[0]["layers"]
    for i in range(LAYERS):
        assert [built[str(i)]["k_ranks"], built[str(i)]["v_ranks"]] == recorded["layers"][str(i)]
        assert built[str(i)]["bits"] == recorded["bits"][str(i)]
    stored = states[0]["stored_bytes_per_token"]
    slot = stored / LAYERS  # one page: every layer's slot has the same size
    assert slot == int(slot) and slot % 4 == 0
    ref, ref_gaps, _ = stock
    for g, r, gaps in zip(got, ref, ref_gaps):
        n = next((i for i, gap in enumerate(gaps[:16]) if gap < 1e-3), 16)
        assert g[:n] == r[:n]
