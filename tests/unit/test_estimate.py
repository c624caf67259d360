"""``vllm-lowrank estimate``: bytes per token, compression and capacity from a
model's ``config.json``, checked against independent arithmetic (slot sizes
from the head geometry) and, in ``test_server.py``, against the capacity a
served engine reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import RECIPE_8B
from transformers import AutoConfig

from vllm_lowrank.config import LowRankConfig
from vllm_lowrank.estimate import estimate


def _cfg(**keys) -> LowRankConfig:
    return LowRankConfig.from_dict({"mode": "lowrank", **keys})


def test_default_preset_bytes_and_tokens_from_the_head_geometry(model_path):
    hf = AutoConfig.from_pretrained(model_path)
    kv_heads = hf.num_key_value_heads
    width = kv_heads * (hf.hidden_size // hf.num_attention_heads)
    # 8-bit keys, 4-bit values, one float16 scale and zero per head and side
    slot = width + width // 2 + kv_heads * 2 * 2 * 2
    info = estimate(model_path, _cfg(), dtype="float32", kv_cache_gib=0.5, block_size=16)
    assert info["preset"] == "2x" and info["note"] is None
    assert info["stored_bytes_per_token"] == hf.num_hidden_layers * slot
    assert info["original_bytes_per_token"] == hf.num_hidden_layers * 2 * width * 4
    assert info["compression_ratio"] == pytest.approx(2 * width * 2 / slot)
    per_block = 16 * hf.num_hidden_layers * slot
    assert info["tokens"] == (2**29 // per_block) * 16
    assert info["sequences"] == 2**29 // (hf.num_hidden_layers * slot * 4096)


def test_token_adaptive_preset_counts_its_exact_tokens(model_path):
    info = estimate(model_path, _cfg(preset="4x"), dtype="bfloat16")
    assert info["exact_bytes_per_sequence"] > 0
    # the exact tokens lower the whole-sequence ratio below the latent slots'
    assert info["sequence_compression_ratio"] < info["compression_ratio"]
    long = estimate(model_path, _cfg(preset="4x"), dtype="bfloat16", context=1 << 20)
    assert long["sequence_compression_ratio"] == pytest.approx(info["compression_ratio"],
                                                               rel=0.01)


def test_nothing_is_calibrated_or_allocated(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOWRANK_CACHE", str(tmp_path))
    info = estimate(model_path, _cfg(rank_fraction=0.5), dtype="bfloat16")
    assert "uniform ranks" in info["note"] and info["compression_ratio"] == pytest.approx(2.0)
    alloc = estimate(model_path, _cfg(preset="8x"), dtype="bfloat16")
    assert alloc["compression_ratio"] is None and "allocated on the first start" in alloc["note"]
    assert not any(tmp_path.rglob("*"))  # no artifact (or lock) was written


def test_cli_prints_json(model_path):
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-lowrank")
    out = subprocess.run([cli, "estimate", model_path, "--config", '{"preset": "2x"}', "--json",
                          "--kv-cache-gib", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout)
    assert info["kv_cache_bytes"] == 2 * 2**30 and info["tokens"] > info["stock_tokens"]


@pytest.mark.parametrize("context", [2048, 2000, 4096, 100])
def test_token_adaptive_sequences_count_whole_blocks(tmp_path, context):
    """``sequences`` for the ``4x`` preset (Llama-3-8B shape, 8 GiB): the pages
    over the blocks a prefilled request holds, counted by a loop over its token
    positions: its latent blocks, and the distinct blocks of its 32 sink tokens
    and its 129 newest (the window: 3 blocks of 64 wherever it ends); at 2k
    the figures of benchmarks/README.md ("GPU serving inside vLLM": pages of
    165,888 bytes, 11 latent and 4 exact blocks, about 108 requests)."""
    (tmp_path / "config.json").write_text(json.dumps(RECIPE_8B))
    info = estimate(str(tmp_path), _cfg(preset="4x"), dtype="bfloat16", kv_cache_gib=8,
                    context=context)
    block, layers = info["block_size"], RECIPE_8B["num_hidden_layers"]
    exact_tokens = min(64 + 128 + 1, context)  # the sink rounded up to its 64-token block
    page = block * info["exact_bytes_per_sequence"] // (exact_tokens * layers)
    latent_blocks = -(-context // (page // (info["stored_bytes_per_token"] // layers)))
    exact_blocks = len({p // block for p in range(min(32, context))}
                       | {p // block for p in range(max(0, context - 129), context)})
    pages = 8 * 2**30 // (layers * page)
    assert info["sequences"] == pages // (latent_blocks + exact_blocks)
    if context == 2048:
        assert (page, pages, latent_blocks, exact_blocks) == (165_888, 1618, 11, 4)
        assert info["sequences"] == 107
