"""Serving load test on CPU: compression off vs ratio 0.5 vs ratio 0.25.

For each setting, one ``vllm serve`` of the embedded model (SmolLM2-135M,
float32, eager) on 127.0.0.1 with the same small KV cache (``--kv-cache-mib``,
default 256 MiB, passed as vLLM's ``--kv-cache-memory-bytes``; the equivalent
``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only, and is removed from the
servers' environment because it would override the flag), then
``--requests`` completion requests sent at once (all concurrent), each a
``--prompt-tokens``-token window of held-out real text (BBC News,
``eval_windows``) as token ids, greedy, ``--max-tokens`` new tokens with
``ignore_eos``. More requests are sent than even the most compressed cache
holds, so every run is memory-bound. While the load runs the client scrapes
vLLM's ``/metrics`` every ``--scrape-interval`` s for
``vllm:num_requests_running`` (peak concurrent running sequences),
``vllm:kv_cache_usage_perc`` and ``vllm:num_preemptions``.

Reported per setting: KV capacity and achieved compression ratio, per token of
the latent cache and per sequence with the exact tokens (from the server's
``vllm_lowrank_*`` metrics), completed and failed requests (a failure
is a non-200 answer, a transport error, a short completion, or a request still
open at the ``--run-timeout``), preemptions, peak running sequences, peak KV
usage, wall time, request and output-token throughput, p50/p99 end-to-end
latency (submission to last byte; all requests are submitted at t=0, so latency
includes queueing).

Bounded: loopback only, ``--requests`` requests per run, each run cut at
``--run-timeout`` seconds (default 360). Prints a markdown table.

    .venv/bin/python -P benchmarks/serve_load.py
    .venv/bin/python -P benchmarks/serve_load.py --requests 48 --ratios 0.5
    .venv/bin/python -P benchmarks/serve_load.py --ratios --presets 2x lossless 4x 8x
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import tempfile
import time

from vllm_lowrank.local_server import LocalServer, metric_totals


def start(model: str, extra: list[str], name: str, kv_cache_bytes: int, max_model_len: int,
          max_num_seqs: int, max_batched_tokens: int, timeout: float = 900) -> LocalServer:
    """A ready ``vllm serve`` for one setting (served as ``m``, float32, eager),
    its KV cache set in bytes; ``max_num_seqs`` / ``max_batched_tokens`` of 0 leave
    vLLM's own scheduler defaults (the flag is not passed); ``VLLM_CPU_KVCACHE_SPACE`` is removed from its
    environment because it would override ``--kv-cache-memory-bytes``.

    Raises:
        RuntimeError: the server exits before it is ready (log tail attached).
        TimeoutError: not ready within ``timeout`` seconds.
    """
    scheduler = ([f"--max-num-seqs={max_num_seqs}"] if max_num_seqs else []) + (
        [f"--max-num-batched-tokens={max_batched_tokens}"] if max_batched_tokens else [])
    server = LocalServer(
        model, ["--served-model-name", "m", "--dtype", "float32", "--enforce-eager",
                "--max-model-len", str(max_model_len), *scheduler,
                "--kv-cache-memory-bytes", str(kv_cache_bytes), *extra],
        log_dir=tempfile.gettempdir(), name=f"serve-load-{name}",
        env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"})
    server.wait_ready(timeout)
    return server


async def _one(session, url: str, prompt: list[int], max_tokens: int, t0: float) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            payload = await r.read()
            if r.status != 200:
                return {"ok": False, "error": f"HTTP {r.status}: {payload[:200]!r}"}
            usage = json.loads(payload)["usage"]
            ok = usage["completion_tokens"] == max_tokens
            return {"ok": ok, "latency": time.perf_counter() - t0,
                    "tokens": usage["completion_tokens"],
                    "error": None if ok else f"short completion {usage}"}
    except Exception as e:  # transport errors count as failures
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


async def _scrape(session, url: str, interval: float, peaks: dict, stop: asyncio.Event):
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as r:
                m = metric_totals(await r.text())
            peaks["running"] = max(peaks["running"], m.get("vllm:num_requests_running", 0))
            peaks["usage"] = max(peaks["usage"], m.get("vllm:kv_cache_usage_perc", 0))
            peaks["scrapes"] += 1
        except Exception:  # a missed scrape is only a missed sample
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def _load(url: str, prompts: list[list[int]], max_tokens: int, interval: float,
                run_timeout: float) -> dict:
    import aiohttp

    peaks = {"running": 0.0, "usage": 0.0, "scrapes": 0}
    stop = asyncio.Event()
    limits = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=limits, timeout=timeout) as session:
        scraper = asyncio.create_task(_scrape(session, url, interval, peaks, stop))
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(_one(session, url, p, max_tokens, t0)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=run_timeout)
        wall = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        stop.set()
        await scraper
    results = [t.result() for t in done]
    results += [{"ok": False, "error": "still open at --run-timeout"} for _ in pending]
    return {"results": results, "wall": wall, **peaks}


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def run_setting(name: str, extra: list[str], model: str, prompts: list[list[int]],
                args) -> dict:
    """Start the server for one setting, load it, stop it; the table row."""
    print(f"[{name}] starting server ...", file=sys.stderr, flush=True)
    server = start(model, extra, name.replace(" ", "-"), args.kv_cache_mib * 2**20,
                    args.prompt_tokens + args.max_tokens + 16, args.max_num_seqs,
                    args.max_batched_tokens)
    try:
        # warm-up outside the measurement (first shapes are slow on CPU)
        asyncio.run(_load(server.url, [prompts[0][:64]], 4, 10.0, 300))
        before = metric_totals(server.metrics_text())
        print(f"[{name}] ready; {len(prompts)} requests ...", file=sys.stderr, flush=True)
        load = asyncio.run(_load(server.url, prompts, args.max_tokens, args.scrape_interval,
                                 args.run_timeout))
        after = metric_totals(server.metrics_text())
    finally:
        code = server.stop()
    ok = [r for r in load["results"] if r["ok"]]
    errors = [r["error"] for r in load["results"] if not r["ok"]]
    if errors:
        print(f"[{name}] {len(errors)} failures, first: {errors[0]}", file=sys.stderr)
    latencies = [r["latency"] for r in ok]
    row = {
        "setting": name,
        "enabled": int(after.get("vllm_lowrank_compression_enabled", 0)),
        "capacity": int(after.get("vllm_lowrank_kv_cache_capacity_tokens", 0)),
        "kv_ratio": after.get("vllm_lowrank_kv_compression_ratio", 1.0),
        "seq_ratio": after.get("vllm_lowrank_sequence_compression_ratio", 1.0),
        "completed": len(ok),
        "failed": len(errors),
        "preemptions": int(after.get("vllm:num_preemptions_total", 0)
                           - before.get("vllm:num_preemptions_total", 0)),
        "peak_running": int(load["running"]),
        "peak_usage": load["usage"],
        "scrapes": load["scrapes"],
        "wall": load["wall"],
        "req_s": len(ok) / load["wall"],
        "out_tok_s": sum(r["tokens"] for r in ok) / load["wall"],
        "p50": _percentile(latencies, 50),
        "p99": _percentile(latencies, 99),
        "exit_code": code,
    }
    print(f"[{name}] {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="folder or embedded alias")
    p.add_argument("--ratios", type=float, nargs="*", default=[0.5, 0.25])
    p.add_argument("--presets", nargs="*", default=[],
                   help="presets to serve as well (2x, lossless, 4x, 8x)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1008,
                   help="1008 + 16 output tokens = 8 whole 128-token CPU blocks")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=256,
                   help="KV cache memory of every server, MiB (--kv-cache-memory-bytes)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="vLLM --max-num-seqs; 0: vLLM's default (flag not passed)")
    p.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="vLLM --max-num-batched-tokens (tokens per engine step); large "
                        "enough that admission, not the step budget, is limited by memory; "
                        "0: vLLM's default (flag not passed)")
    p.add_argument("--scrape-interval", type=float, default=0.5, help="seconds")
    p.add_argument("--run-timeout", type=float, default=360, help="seconds per setting")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    if min(args.requests, args.prompt_tokens, args.max_tokens, args.kv_cache_mib) < 1:
        p.error("--requests, --prompt-tokens, --max-tokens and --kv-cache-mib must be >= 1")

    from transformers import AutoTokenizer

    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.evaluation import eval_windows

    model = resolve_model(args.model)
    prompts = eval_windows(AutoTokenizer.from_pretrained(model), "bbc", args.requests,
                           args.prompt_tokens)
    settings = [("off", [])] + [
        (f"lowrank ratio {r}", ["--kv-compression", "lowrank",
                                "--kv-compression-config", json.dumps({"rank_fraction": r})])
        for r in args.ratios] + [
        (f"preset {name}", ["--kv-compression", "lowrank",
                            "--kv-compression-config", json.dumps({"preset": name})])
        for name in args.presets]
    rows = [run_setting(name, extra, model, prompts, args) for name, extra in settings]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)

    base = rows[0]["peak_running"] or 1
    print(f"\nServing load test, {datetime.date.today().isoformat()}: {args.requests} "
          f"concurrent requests x {args.prompt_tokens}-token prompts (BBC News) + "
          f"{args.max_tokens} output tokens, float32, KV cache {args.kv_cache_mib} MiB "
          f"(--kv-cache-memory-bytes), --max-num-seqs {args.max_num_seqs or '(vLLM default)'}, "
          f"--max-num-batched-tokens {args.max_batched_tokens or '(vLLM default)'}, {os.cpu_count()} CPU "
          f"cores, /metrics scraped every {args.scrape_interval} s\n")
    print("| setting | KV capacity (tokens) | KV compression | per sequence | completed | failed | "
          "preemptions | peak running seqs | vs off | peak KV usage | wall (s) | req/s | "
          "output tok/s | p50 latency (s) | p99 latency (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['capacity']:,} | {r['kv_ratio']:.2f}x | "
              f"{r['seq_ratio']:.2f}x | {r['completed']} | "
              f"{r['failed']} | {r['preemptions']} | {r['peak_running']} | "
              f"{r['peak_running'] / base:.2f}x | {100 * r['peak_usage']:.0f}% | "
              f"{r['wall']:.0f} | {r['req_s']:.2f} | {r['out_tok_s']:.1f} | {r['p50']:.1f} | "
              f"{r['p99']:.1f} |")


if __name__ == "__main__":
    main()
