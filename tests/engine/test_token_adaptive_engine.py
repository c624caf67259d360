"""The token-adaptive mode (TALE) inside real vLLM engines, real model.

At ratio 1.0 the latents are exact too, so whatever the exact window, the
greedy tokens must equal the uncompressed engine's: this checks the second
(exact) cache group end to end: block tables and slot mappings of both groups,
sink blocks kept while the window slides over a 600-token prompt prefilled in
128-token chunks, a prefix-cache hit that needs the sink and window blocks
cached, a branch off that prefix, and preemption with recompute. At ratio 0.5
with ``recent_tokens`` covering the whole context no latent is ever read, and
the tokens again equal the uncompressed engine's. With per-channel 8-bit key
groups (written when a group completes, from latents staged in
the exact cache), a prefix-cache hit and preemption must give the tokens of a
cold, undisturbed run of the same compressed engine.
"""

from __future__ import annotations

import gc

import pytest

from conftest import PROMPTS, assert_same_until_tie, greedy_with_gaps, make_llm

pytestmark = pytest.mark.slow

CHUNK = 128
FULL_RANK_SMALL_WINDOW = {"mode": "lowrank", "rank_fraction": 1.0, "token_adaptive": True,
                          "sink_tokens": 4, "recent_tokens": 32}
CHANNEL_KEYS = {"mode": "lowrank", "rank_fraction": 0.5, "k_bits": 8, "v_bits": 16,
                "token_adaptive": True, "sink_tokens": 4, "recent_tokens": 32,
                "k_quant": "channel", "k_channel_tokens": 32}
"""Per-channel 8-bit keys, 16-bit values, for the tests that compare two runs
of one compressed engine whose batches differ (a prefix hit, a preemption).
Rounding to a code is discontinuous: the float noise of a different batch
composition (with engine multiprocessing, also of when each request reached
the engine) can flip a 4-bit code by a step that moves scores more than a near
tie (seen once in CI, a prefix hit diverging at its 14th token); an 8-bit step
is 17x smaller."""


def _run(model_path, compression, prefix_caching=True, **kwargs):
    """(tokens, gaps) of the short prompts, a 600-token prompt, its repeat (a
    prefix-cache hit) and a branch off its first 450 tokens; prefix hits."""
    from vllm.inputs import TokensPrompt

    from vllm_lowrank.evaluation import eval_windows

    llm = make_llm(model_path, compression, **{
        "enable_prefix_caching": prefix_caching, "enable_chunked_prefill": True,
        "max_num_batched_tokens": CHUNK, "disable_log_stats": False, **kwargs})
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


def test_post_rope_keys_at_full_width_equal_uncompressed(model_path, stock):
    """``post_rope_keys`` at 16 bits and full rank caches the model's own
    post-RoPE keys and values: the key latent is the exact key (no key columns
    in the fused projection), read without a rebuild in both the latent span
    and the chunked prefill, and the tokens equal the uncompressed engine's."""
    got = _run(model_path, {**FULL_RANK_SMALL_WINDOW, "post_rope_keys": True})
    assert got["hits"] > 0
    assert_same_until_tie(got["tokens"], stock["tokens"], stock["gaps"], at_least=100)


def test_half_ratio_window_covering_the_context_equals_uncompressed(model_path, stock):
    cfg = {"mode": "lowrank", "rank_fraction": 0.5, "token_adaptive": True, "recent_tokens": 2048}
    got = _run(model_path, cfg)
    assert_same_until_tie(got["tokens"], stock["tokens"], stock["gaps"], at_least=100)


def test_int8_exact_tokens_cost_little_perplexity(model_path):
    """``exact_bits: 8`` at full rank (latents exact, so only the int8 exact
    window differs from the model): the workers store the window as int8
    (their published settings say so), the perplexity of a 600-token held-out
    window prefilled in 128-token chunks moves (the int8 path is taken: the
    16-bit exact window gives the uncompressed figure) but by under 1 %."""
    from conftest import clear_worker_states, worker_states

    from vllm_lowrank.evaluation import eval_windows, perplexity

    def ppl(compression):
        llm = make_llm(model_path, compression, enable_chunked_prefill=True,
                       max_num_batched_tokens=CHUNK)
        windows = eval_windows(llm.get_tokenizer(), "wikipedia", 1, 600)
        out = perplexity(llm, windows)["ppl"]
        del llm
        gc.collect()
        return out

    stock = ppl(None)
    exact16 = ppl(FULL_RANK_SMALL_WINDOW)
    clear_worker_states()
    exact8 = ppl({**FULL_RANK_SMALL_WINDOW, "exact_bits": 8})
    published = worker_states()[0]["exact_tokens"]
    assert published["bits"] == 8 and published["recent"] >= 32
    assert exact16 == pytest.approx(stock, rel=1e-4)
    assert exact8 != pytest.approx(exact16, rel=1e-6)
    assert abs(exact8 / stock - 1) < 0.01


def test_channel_keys_prefix_hits_equal_a_cold_run(model_path):
    """The repeat reads per-channel key groups written by the first request
    (whole blocks only are shared) and gives the tokens of an engine without
    prefix caching. Which tokens are read exactly depends on where a step
    starts (lazy approximation), so both engines advance every request 32
    tokens per step: chunk boundaries fall on multiples of 32 whether or not a
    prefix hit skipped the first blocks. Block size 32: the latent group's
    blocks are exact slot / latent slot (about 17) times larger, vLLM's hybrid
    allocator matching the exact group's page size, so the 600-token prompt
    fills one latent block."""
    steps = dict(block_size=32, long_prefill_token_threshold=32, max_num_batched_tokens=256)
    hit = _run(model_path, CHANNEL_KEYS, **steps)
    cold = _run(model_path, CHANNEL_KEYS, prefix_caching=False, **steps)
    assert hit["hits"] > 0
    assert_same_until_tie(hit["tokens"], cold["tokens"], cold["gaps"], at_least=100)


def _preempt_three(llm, preempted):
    """Make the scheduler preempt three decoding requests, one at a time
    (after 8, 16, 24 output tokens), recording ``(prompt token ids, outputs
    so far)``."""
    import time

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule

    def preempting_schedule(*args, **kwargs):
        decoding = [r for r in scheduler.running if r.num_output_tokens >= 8 + 8 * len(preempted)]
        if decoding and len(preempted) < 3:
            scheduler.running.remove(decoding[0])
            preempted.append((list(decoding[0].prompt_token_ids),
                              decoding[0].num_output_tokens))
            scheduler._preempt_request(decoding[0], time.monotonic())
        return schedule(*args, **kwargs)

    scheduler.schedule = preempting_schedule
    return lambda: setattr(scheduler, "schedule", schedule)


@pytest.mark.isolated  # the engine core runs in this process
def test_channel_keys_preempted_request_resumes_like_a_new_one(model_path, monkeypatch):
    """A preempted request is recomputed from its prompt and the tokens it had
    generated, which rewrites its per-channel key groups. Its continuation
    must equal that of a new request whose prompt is those tokens (at ratio
    0.5 the earlier tokens differ from an undisturbed run's, because a
    recomputed chunk reads more tokens exactly than one-token decode steps
    did). Every request advances at most 32 tokens per step, so chunk
    boundaries (and with them the exact/latent split) agree in both."""
    from vllm.inputs import TokensPrompt

    from vllm_lowrank.evaluation import eval_windows

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in-process
    llm = make_llm(model_path, CHANNEL_KEYS, block_size=32, max_model_len=512,
                   enable_prefix_caching=False, long_prefill_token_threshold=32,
                   max_num_batched_tokens=256,
                   async_scheduling=False)  # no token in flight at preemption
    prompts = eval_windows(llm.get_tokenizer(), "bbc", 4, 200)
    preempted = []
    restore = _preempt_three(llm, preempted)
    got, _ = greedy_with_gaps(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts],
                              max_tokens=48)
    restore()
    assert len(preempted) == 3
    rows = [prompts.index(prompt) for prompt, _ in preempted]
    # submitted together: vLLM lifts the per-request step limit for a lone request
    new = [TokensPrompt(prompt_token_ids=prompts[i] + got[i][:done])
           for i, (_, done) in zip(rows, preempted)]
    toks, g = greedy_with_gaps(llm, new, max_tokens=48 - min(d for _, d in preempted))
    resumed = [got[i][done:] for i, (_, done) in zip(rows, preempted)]
    expected = [t[:48 - done] for t, (_, done) in zip(toks, preempted)]
    gaps = [x[:48 - done] for x, (_, done) in zip(g, preempted)]
    del llm
    gc.collect()
    assert_same_until_tie(resumed, expected, gaps, at_least=40)


@pytest.mark.isolated  # the engine core runs in this process
def test_preempted_requests_resume_with_the_same_tokens(model_path, monkeypatch):
    """Requests preempted in the middle of decoding (by the scheduler's own
    preemption routine, called between steps: with the exact group vLLM
    admits conservatively and a small pool does not make it preempt) free
    both groups' blocks and are recomputed; their greedy tokens equal those
    of an undisturbed run."""
    from vllm.inputs import TokensPrompt

    from vllm_lowrank.evaluation import eval_windows

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in-process
    llm = make_llm(model_path, FULL_RANK_SMALL_WINDOW, block_size=32, max_model_len=512,
                   max_num_batched_tokens=64)
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in eval_windows(llm.get_tokenizer(), "bbc", 4, 200)]
    expected, gaps = greedy_with_gaps(llm, prompts, max_tokens=48)
    preempted = []
    _preempt_three(llm, preempted)
    got, _ = greedy_with_gaps(llm, prompts, max_tokens=48)
    del llm
    gc.collect()
    assert len(preempted) == 3
    assert_same_until_tie(got, expected, gaps, at_least=100)
