"""Accuracy measured through vLLM itself (the serving path).

- :func:`perplexity`: exp(mean negative log-likelihood) of held-out text,
  from vLLM's ``prompt_logprobs`` over non-overlapping token windows. Prefill
  attention reads the latents back from the paged cache, so these figures
  measure the compressed cache.
- :func:`run_setting`: one engine per setting, in a fresh subprocess, so
  settings never share process state.

Texts: see :mod:`vllm_lowrank.calibration.text` (Wikipedia (gensim excerpt)
held-out split, BBC News); calibration never sees them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

TEXTS = ("wikipedia", "bbc", "shakespeare", "code")
"""Held-out evaluation domains (:data:`vllm_lowrank.calibration.text.HELD_OUT`)."""


def eval_windows(tokenizer, text: str, num_windows: int, window: int) -> list[list[int]]:
    """Held-out token windows of ``text``: a domain of :data:`TEXTS`
    (``wikipedia``: the articles kept out of calibration, ``bbc``,
    ``shakespeare``, ``code``), or the path of a user's own ``.txt`` /
    ``.jsonl`` file (:func:`~vllm_lowrank.calibration.text.read_text_file`).

    Raises:
        LowRankConfigError: an unreadable file, or too little text for the windows.
    """
    from vllm_lowrank.calibration import text as texts

    if text in texts.HELD_OUT:
        docs = texts.HELD_OUT[text]()
    else:
        docs = texts.read_text_file(text, "evaluation text")
    return texts.token_windows(tokenizer, docs, num_windows, window)


def perplexity(llm, windows: list[list[int]]) -> dict[str, float]:
    """Perplexity of ``windows`` under ``llm`` (a ``vllm.LLM``).

    Every token but the first of each window is predicted; returns
    ``{"ppl", "nll", "tokens"}``.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params,
                        use_tqdm=False)
    return nll_summary(zip(windows, outs))


def nll_summary(scored) -> dict[str, float]:
    """``{"ppl", "nll", "tokens"}`` over ``(window, output)`` pairs: ``window``
    a list of token ids, ``output`` its vLLM output with ``prompt_logprobs``;
    every token but the first of each window is counted (natural log)."""
    nll, count = 0.0, 0
    for window, out in scored:
        for tok, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= entry[tok].logprob
            count += 1
    return {"ppl": math.exp(nll / count), "nll": nll, "tokens": count}


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of one :func:`run_setting` spec.

    Every request of a compressed setting advances at most a fixed number of
    tokens per engine step, however many requests run: ``step_tokens`` when
    given, else :data:`~vllm_lowrank.format.exact.PREFILL_CHUNK_TOKENS` (the
    prefill chunk a token-adaptive server sets where chunks rebuild keys; the
    same for every setting, so that settings compare at one step). The step's
    token budget is that times the requests side by side, because vLLM 0.32's
    scheduler drops ``long_prefill_token_threshold`` while a single request is
    eligible (``Scheduler.schedule``: "nobody to starve"). Without the budget, one
    window (``--tokens`` equal to ``--window``) was prefilled in one step, in
    which every token sees only exact keys: a token-adaptive setting measured
    no loss at all (``vllm-lowrank perplexity smollm2-135m --tokens 4096
    --window 4096 --config '{"preset": "4x"}'`` gave the uncompressed 18.985).
    """
    from vllm_lowrank.format.exact import PREFILL_CHUNK_TOKENS

    longest = max(spec["window"], (spec.get("passkey") or {}).get("context_tokens", 0))
    kwargs = dict(model=spec["model"], dtype=spec.get("dtype", "float32"),
                  max_model_len=longest + 16, enforce_eager=True,
                  enable_prefix_caching=False, seed=0)
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    step = spec.get("step_tokens") or (PREFILL_CHUNK_TOKENS if spec.get("compression")
                                       is not None else None)
    if step:
        side_by_side = max(spec["num_windows"], (spec.get("passkey") or {}).get("num_cases", 1))
        kwargs.update(enable_chunked_prefill=True, long_prefill_token_threshold=step,
                      max_num_batched_tokens=max(step * side_by_side, 16))
    if spec.get("compression") is not None:
        kwargs["additional_config"] = {"kv_compression": spec["compression"]}
    return kwargs


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run inside a subprocess: build the engine, measure, return results."""
    import time

    from vllm import LLM

    kwargs = engine_kwargs(spec)
    t0 = time.time()
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    result: dict[str, Any] = {"init_s": time.time() - t0}
    from vllm_lowrank.metrics import kv_capacity_tokens

    cache_config = llm.llm_engine.vllm_config.cache_config
    result["kv_blocks"] = cache_config.num_gpu_blocks
    result["kv_tokens"] = kv_capacity_tokens(cache_config)
    if spec.get("compression") is not None:
        from vllm_lowrank import metrics

        states = metrics.read_states(os.environ.get(metrics.STATE_DIR_ENV, ""))
        if states:  # latent bytes per token / original, all layers of this worker
            result["stored_fraction"] = (states[0]["stored_bytes_per_token"]
                                         / states[0]["original_bytes_per_token"])
            result["layers"] = states[0]["layers"]  # ranks and widths as built
    for text in spec["texts"]:
        windows = eval_windows(tok, text, spec["num_windows"], spec["window"])
        t1 = time.time()
        result[text] = perplexity(llm, windows)
        result[text]["seconds"] = time.time() - t1
    if spec.get("passkey"):
        from vllm_lowrank.passkey import passkey_accuracy

        result["passkey"] = passkey_accuracy(llm, **spec["passkey"])
    del llm  # shuts the engine down here, not at interpreter exit
    gc.collect()
    return result


def run_setting(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one setting in a fresh Python process.

    Args:
        spec: ``model``, ``compression`` (the ``kv_compression`` dict or
            ``None``), ``texts``, ``num_windows``, ``window``, optional ``dtype``,
            ``passkey`` (kwargs of
            :func:`vllm_lowrank.passkey.passkey_accuracy`), ``block_size``
            and ``step_tokens``: process every window at most this many
            tokens per engine step (vLLM's ``long_prefill_token_threshold``;
            the windows advance side by side), so each predicted token sees
            the cache as a generating request would, not its whole window
            in one prefill (what the token-adaptive mode's exact recent
            tokens need to be measured fairly). Passkey prompts advance the
            same way.

    Raises:
        RuntimeError: the subprocess failed (the tail of its output, vLLM's
            log included, is in the message).
    """
    return in_subprocess("vllm_lowrank.evaluation:_worker", spec,
                         what=f"evaluation of {spec.get('compression')}")


def _output_tail(text: str) -> str:
    """A subprocess's output, shortened: from its last traceback (60 lines), or
    its last 40 lines."""
    lines = text.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    return "\n".join(lines[starts[-1]:][:60] if starts else lines[-40:])


def in_subprocess(worker: str, spec: dict[str, Any], *, what: str, path: str | None = None,
                  timeout: float | None = None) -> dict[str, Any]:
    """``worker(spec)`` in a fresh Python process, its JSON result returned:
    ``worker`` is ``"module:function"``, importable with ``path`` (if given)
    first on ``sys.path``; vLLM's CPU KV space defaults to 2 GiB there.

    Raises:
        RuntimeError: the subprocess failed or ran past ``timeout`` seconds
            (``what``, then the tail of its output, vLLM's log included).
    """
    module, function = worker.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        out_path = os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        code = ("import json,os,sys\n"
                + (f"sys.path.insert(0, {path!r})\n" if path else "")
                + f"from {module} import {function}\n"
                "if __name__ == '__main__':\n"
                f"    r = {function}(json.load(open({spec_path!r})))\n"
                f"    with open({out_path!r}, 'w') as f:\n"
                "        json.dump(r, f)\n"
                # vLLM's CPU build sometimes aborts in its own teardown
                # ("terminate called without an active exception") after the
                # engine is gone; the result is on disk by then.
                "    os._exit(0)\n")
        try:
            proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env={**os.environ, "VLLM_CPU_KVCACHE_SPACE":
                                       os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
        except subprocess.TimeoutExpired as e:  # the output so far says where it was
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) \
                else e.stdout or ""
            raise RuntimeError(f"{what} ran past {timeout:g} s; its last output:\n"
                               f"{_output_tail(out)}") from None
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"{what} failed:\n{_output_tail(proc.stdout)}")
        with open(out_path) as f:
            return json.load(f)
