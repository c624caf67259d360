"""The token-adaptive mode (TALE) inside real vLLM engines, real model.

At ratio 1.0 the latents are exact too, so whatever the exact window, the
greedy tokens must equal the uncompressed engine's: this checks the second
(exact) cache group end to end: block tables and slot mappings of both groups,
sink blocks kept while the window slides over a 600-token prompt prefilled in
128-token chunks, a prefix-cache hit that needs the sink and window blocks
cached, a branch off that prefix, and preemption with recompute. At ratio 0.5
with ``recent_tokens`` covering the whole context no latent is ever read, and
the tokens again equal the uncompressed engine's.
"""

from __future__ import annotations

import gc

import pytest

from conftest import assert_same_until_tie, greedy_with_gaps, make_llm

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
CHUNK = 128
FULL_RANK_SMALL_WINDOW = {"mode": "lowrank", "ratio": 1.0, "token_adaptive": True,
                          "sink_tokens": 4, "recent_tokens": 32}


def _run(model_path, compression, **kwargs):
    """(tokens, gaps) of the short prompts, a 600-token prompt, its repeat (a
    prefix-cache hit) and a branch off its first 450 tokens; prefix hits."""
    from vllm.inputs import TokensPrompt

    from vllm_lowrank.evaluation import eval_windows

    llm = make_llm(model_path, compression, enable_prefix_caching=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=CHUNK,
                   disable_log_stats=False, **kwargs)
    long_ids = eval_windows(llm.get_tokenizer(), "wikipedia", 1, 600)[0]
    prompts = PROMPTS + [TokensPrompt(prompt_token_ids=long_ids)]
    first = greedy_with_gaps(llm, prompts)
    again = greedy_with_gaps(llm, [TokensPrompt(prompt_token_ids=long_ids),
                                   TokensPrompt(prompt_token_ids=long_ids[:450] + long_ids[:40])])
    hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    del llm
    gc.collect()
    return {"tokens": first[0] + again[0], "gaps": first[1] + again[1], "hits": hits}


@pytest.fixture(scope="module")
def stock(model_path):
    return _run(model_path, None)


def test_full_rank_small_window_equals_uncompressed(model_path, stock):
    got = _run(model_path, FULL_RANK_SMALL_WINDOW)
    assert got["hits"] > 0
    assert_same_until_tie(got["tokens"], stock["tokens"], stock["gaps"], at_least=100)


def test_half_ratio_window_covering_the_context_equals_uncompressed(model_path, stock):
    cfg = {"mode": "lowrank", "ratio": 0.5, "token_adaptive": True, "recent_tokens": 2048}
    got = _run(model_path, cfg)
    assert_same_until_tie(got["tokens"], stock["tokens"], stock["gaps"], at_least=100)


def test_preempted_requests_resume_with_the_same_tokens(model_path, monkeypatch):
    """Requests preempted in the middle of decoding (by the scheduler's own
    preemption routine, called between steps: with the exact group vLLM
    admits conservatively and a small pool does not make it preempt) free
    both groups' blocks and are recomputed; their greedy tokens equal those
    of an undisturbed run."""
    import time

    from vllm.inputs import TokensPrompt

    from vllm_lowrank.evaluation import eval_windows

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in-process
    llm = make_llm(model_path, FULL_RANK_SMALL_WINDOW, block_size=32, max_model_len=512,
                   max_num_batched_tokens=64)
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in eval_windows(llm.get_tokenizer(), "bbc", 4, 200)]
    expected, gaps = greedy_with_gaps(llm, prompts, max_tokens=48)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, preempted = scheduler.schedule, []

    def preempting_schedule(*args, **kwargs):
        decoding = [r for r in scheduler.running if r.num_output_tokens >= 8 + 8 * len(preempted)]
        if decoding and len(preempted) < 3:
            scheduler.running.remove(decoding[0])
            scheduler._preempt_request(decoding[0], time.monotonic())
            preempted.append(decoding[0].request_id)
        return schedule(*args, **kwargs)

    scheduler.schedule = preempting_schedule
    got, _ = greedy_with_gaps(llm, prompts, max_tokens=48)
    del llm
    gc.collect()
    assert len(preempted) == 3
    assert_same_until_tie(got, expected, gaps, at_least=100)
