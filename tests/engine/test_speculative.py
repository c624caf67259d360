"""Speculative decoding over the compressed cache (vLLM's ngram prompt lookup).

A verify step gives a request its last accepted token plus up to three drafts;
the backend decodes them as rows of one decode batch, each causal over the
drafts before it (:class:`vllm_lowrank.attention.backend.DecodeRows`), and
vLLM rewinds the cache past the rejected ones. The prompts repeat a paragraph,
so the n-gram proposer's drafts are mostly accepted and sometimes rejected,
and the longest reaches past the exact sink and recent tokens of the
token-adaptive presets (their latent span is read). Steps of at most 128
tokens: the long prompt's prefill chunks share steps with the others' verify
steps.

Reference: the same engine without speculation (greedy tokens equal up to a
near tie of that engine), and, at ratio 1.0, stock vLLM with speculation.
"""

from __future__ import annotations

import gc

import pytest

from conftest import assert_same_until_tie, calibrated, greedy_with_gaps, make_llm

pytestmark = pytest.mark.slow

SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 2}

PARAGRAPH = ("The river rises in the northern hills, runs south past the old mill and the "
             "stone bridge, and reaches the sea at the harbour town. ")
PROMPTS = [
    PARAGRAPH * 20,  # about 600 tokens: past 32 sink + 256 recent tokens
    "def add(x, y):\n    return x + y\n\n" * 6 + "def sub(x, y):\n",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of France is",
]
MAX_TOKENS = 40


def _run(model_path, compression, block_size, speculation):
    """Greedy tokens, per-step gaps and ``(accepted, drafted)`` draft tokens."""
    # the n-gram proposer imports numba, which breaks a later in-process engine
    llm = make_llm(model_path, compression, in_process=speculation is None,
                   block_size=block_size, speculative_config=speculation,
                   disable_log_stats=speculation is None, max_num_batched_tokens=128)
    tokens, gaps = greedy_with_gaps(llm, PROMPTS, max_tokens=MAX_TOKENS)
    counts = (0, 0)
    if speculation is not None:
        metrics = {m.name: m for m in llm.get_metrics()}
        counts = (metrics["vllm:spec_decode_num_accepted_tokens"].value,
                  metrics["vllm:spec_decode_num_draft_tokens"].value)
    del llm
    gc.collect()
    return tokens, gaps, counts


JLRD_075 = {"rank_fraction": 0.75, "k_bits": 4, "v_bits": 4, "token_adaptive": True,
            "sink_tokens": 32, "recent_tokens": 128, "k_quant": "channel",
            "k_channel_tokens": 32, "exact_bits": 8}
"""J-LRD latents at 0.75, per-channel keys, token-adaptive, int8 exact tokens: the
keys rebuilt at each step, as the ``8x`` preset's (other ranks and bits, left to the
GPU engine tests to keep the suite short). ``lossless`` decodes as ``4x`` does."""


@pytest.mark.parametrize("setting,block_size", [("2x", 32), ("jlrd-0.75", 32), ("4x", 64)])
def test_speculation_keeps_the_greedy_tokens(model_path, setting, block_size):
    config = JLRD_075 if setting == "jlrd-0.75" else {"preset": setting}
    compression = calibrated({"mode": "lowrank", **config})
    ref, ref_gaps, _ = _run(model_path, compression, block_size, None)
    got, _, (accepted, drafted) = _run(model_path, compression, block_size, SPECULATION)
    # drafts accepted (multi-token verify steps ran) and rejected (the rewind ran)
    assert accepted >= 30 and drafted > accepted, (accepted, drafted)
    assert_same_until_tie(got, ref, ref_gaps, at_least=2 * MAX_TOKENS, label=setting)


def test_full_rank_speculation_equals_stock_speculation(model_path):
    compression = calibrated({"mode": "lowrank", "rank_fraction": 1.0})
    ref, ref_gaps, _ = _run(model_path, None, 32, SPECULATION)
    got, _, (accepted, _) = _run(model_path, compression, 32, SPECULATION)
    assert accepted >= 30
    assert_same_until_tie(got, ref, ref_gaps, at_least=2 * MAX_TOKENS, label="ratio 1.0")
