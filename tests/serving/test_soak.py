"""Soak test (issue 23, item 6): the CPU server at the token-adaptive preset
(latent 0.5, 4-bit per-channel keys, 4-bit values, 32 sink + 128 recent exact
tokens) under a bounded loopback load for ``SOAK_SECONDS`` (default 90; set
it for a longer soak):
concurrent streams read to the end, streams cancelled by the client, chat
requests, oversized prompts. Then: no in-limit request failed, every
oversized one got a 4xx, the KV cache usage is back to idle (no leaked
block), and SIGTERM with a request in flight drains it and exits 0.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
import requests
from server_harness import Server

pytestmark = pytest.mark.slow

PRESET = {"token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128, "k_bits": 4,
          "v_bits": 4, "k_quant": "channel"}
CLIENTS = 4
CONTEXT = 2048
TEXT = ("The committee met on Tuesday to review the budget, and after a long debate "
        "the members agreed to postpone the decision until the next session. ")


def _complete(url: str, rng: random.Random) -> tuple[str, str | None]:
    """One request of a random kind; ``(kind, problem or None)``."""
    kind = rng.choice(["stream", "stream", "cancel", "chat", "oversized"])
    prompt = TEXT * rng.randint(1, 20)  # up to ~600 tokens: past the recent window
    if kind == "oversized":
        r = requests.post(url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": [42] * (CONTEXT + 500), "max_tokens": 4})
        return kind, None if 400 <= r.status_code < 500 else f"status {r.status_code}"
    if kind == "chat":
        r = requests.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "m", "messages": [{"role": "user", "content": prompt[:400]}],
            "max_tokens": 16, "temperature": 0.7, "seed": rng.randint(0, 1000)})
        ok = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        return kind, None if ok else f"status {r.status_code}: {r.text[:200]}"
    max_tokens = rng.randint(8, 48)
    r = requests.post(url + "/v1/completions", stream=True, timeout=300, json={
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0, "stream": True})
    if r.status_code != 200:
        return kind, f"status {r.status_code}: {r.text[:200]}"
    tokens, done = 0, False
    with r:
        for line in r.iter_lines():
            if line == b"data: [DONE]":
                done = True
                break
            if line.startswith(b"data: {"):
                json.loads(line[6:])  # a complete JSON chunk
                tokens += 1
                if kind == "cancel" and tokens >= 3:
                    return kind, None  # the client goes away mid-stream
    if kind == "cancel":
        return kind, None
    return kind, None if done and tokens >= 1 else f"stream ended early ({tokens} chunks)"


def test_token_adaptive_server_under_load(model_path, tmp_path):
    server = Server(model_path, "--kv-compression", "lowrank",
                    "--kv-compression-config", json.dumps(PRESET), "--shutdown-timeout", "60",
                    log_dir=str(tmp_path))
    try:
        assert server.wait_metric("vllm:num_requests_running", lambda v: v == 0, 120) == 0
        idle_usage = server.metric("vllm:kv_cache_usage_perc")
        seconds = float(os.environ.get("SOAK_SECONDS", "90"))
        deadline = time.time() + seconds
        results: list[tuple[str, str | None]] = []
        lock = threading.Lock()

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < deadline:
                try:
                    outcome = _complete(server.url, rng)
                except requests.RequestException as e:
                    outcome = ("error", repr(e))
                with lock:
                    results.append(outcome)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 600)
        failures = [r for r in results if r[1] is not None]
        kinds = {k: sum(1 for r in results if r[0] == k) for k, _ in results}
        assert not failures, (failures[:5], kinds)
        assert {"stream", "cancel", "chat", "oversized"} <= set(kinds), kinds
        assert server.proc.poll() is None, "the server died under load"

        # no leaked block: nothing running, cache usage back to idle
        assert server.wait_metric("vllm:num_requests_running", lambda v: v == 0, 120) == 0
        usage = server.wait_metric("vllm:kv_cache_usage_perc", lambda v: v <= idle_usage, 120)
        assert usage <= idle_usage, (usage, idle_usage, kinds)

        # clean drain: SIGTERM with a request in flight
        result, code = server.sigterm_in_flight(TEXT * 10, 32)
        assert result.get("status") == 200, result
        assert result["body"]["usage"]["completion_tokens"] == 32
        assert code == 0
        print(f"soak: {len(results)} requests in {seconds:.0f} s {kinds}")
    finally:
        server.stop()
