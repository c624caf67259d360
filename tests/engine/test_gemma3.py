"""The real Gemma-3-270M through vLLM (issue 7): one KV head, head_dim 256,
QK-norm between k_proj and RoPE (applied to rebuilt keys), sliding-window
attention on 5 of 6 layers (vLLM's ``SlidingWindowSpec`` over latent slots,
blocks freed as they leave the window) with its own RoPE theta, BOS-prefixed
prompts.

- ratio 1.0 gives the stock engine's greedy tokens, for short prompts and for a
  1,100-token prompt prefilled in 256-token chunks (windowed attention over
  cached context, then decode past the 512-token window) and its prefix-cache
  hit;
- ratio 0.5 (Fisher bases and ranks, calibrated here on 1,024 tokens): every
  layer of both kinds gets the same latent width (vLLM's hybrid manager needs
  one page size), K and V split it unevenly, and vLLM's KV capacity grows by
  the ratio of original to latent bytes.
"""

from __future__ import annotations

import gc

import pytest

from conftest import (
    assert_same_until_tie,
    clear_worker_states,
    greedy_with_gaps,
    make_llm,
    worker_states,
)

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Water boils at a temperature of"]
STEPS = 24
CHUNK = 256


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from vllm_lowrank import embedded

    return embedded.prepare("gemma3-270m")


def _run(path: str, compression: dict | None) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm_lowrank import metrics
    from vllm_lowrank.evaluation import eval_windows

    clear_worker_states()
    llm = make_llm(path, compression, enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=CHUNK)
    long_ids = eval_windows(llm.get_tokenizer(), "wikipedia", 1, 1100)[0]
    out = {"capacity": metrics.kv_capacity_tokens(llm.llm_engine.vllm_config.cache_config),
           "short": greedy_with_gaps(llm, PROMPTS, STEPS, ignore_eos=True),
           "long": greedy_with_gaps(llm, [TokensPrompt(prompt_token_ids=long_ids)], STEPS,
                                    ignore_eos=True),
           "long_hit": greedy_with_gaps(llm, [TokensPrompt(prompt_token_ids=long_ids)],
                                        STEPS, ignore_eos=True),
           "bos": long_ids[0] == llm.get_tokenizer().bos_token_id}
    states = worker_states()
    out["state"] = states[0] if states else None
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def runs(gemma_path):
    return {name: _run(gemma_path, c) for name, c in (
        ("stock", None), ("full", {"rank_fraction": 1.0}),
        ("half", {"rank_fraction": 0.5, "calibration_tokens": 1024}))}


def test_windows_start_with_bos(runs):
    assert runs["stock"]["bos"]


def test_ratio_one_matches_stock_engine(runs):
    stock, full = runs["stock"], runs["full"]
    for key, n in (("short", len(PROMPTS)), ("long", 1), ("long_hit", 1)):
        (ref, gaps), (got, _) = stock[key], full[key]
        assert_same_until_tie(got, ref, gaps, n * STEPS // 2, key)
    assert stock["long"][0] == stock["long_hit"][0]
    assert full["capacity"] == stock["capacity"]


def test_half_ratio_capacity_follows_latent_bytes(runs, gemma_path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(gemma_path)
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    state = runs["half"]["state"]
    assert state is not None and state["method"] == "fisher"
    layers = state["layers"]
    widths = {sum(l["k_ranks"]) + sum(l["v_ranks"]) for l in layers.values()}
    assert len(widths) == 1  # one latent width (page size) for both layer kinds
    assert any(l["k_ranks"] != l["v_ranks"] for l in layers.values())  # not uniform
    original = len(layers) * 2 * config.num_key_value_heads * config.head_dim
    stored = len(layers) * widths.pop()
    assert runs["half"]["capacity"] / runs["stock"]["capacity"] == pytest.approx(
        original / stored, rel=0.03)
    assert state["compression_ratio"] == pytest.approx(original / stored)
