"""A soak under overload on the GPU: each config serves a mixed load that
overfills its KV cache, with client aborts, prefix-cache hits and a probe set
run again in the middle, and must lose nothing (issue 54).

Runs on the GPU machine like ``gpu_serving.py``, whose model folder and
``CONFIGS`` it uses (random "dummy" weights at the Llama-3-8B shape, bf16, CUDA
graphs ``FULL_DECODE_ONLY``, Triton attention)::

    source .gpuvllm/env.sh && python3 -P benchmarks/gpu_soak.py
    python3 -P benchmarks/gpu_soak.py --dry-run    # the plan, on any machine

One engine per config, one after another, each in a subprocess of its own
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine core and its scheduler run
in that process, and each engine starts on a free GPU), with prefix caching on
and a small KV cache (vLLM's ``kv_cache_memory_bytes``, sized by :func:`kv_gib`
to hold ``--kv-tokens`` tokens of that config):

1. the probes (:func:`probe_prompts`) run alone, greedy, with the top-2
   log-probabilities: the reference;
2. the soak (:func:`request_mix`): ``--requests`` prompts of 64 to 32,768
   tokens (log-spaced), outputs of 16 to ``--max-out`` tokens, half of those
   longer than 2k tokens starting with one of four shared prefixes (2k to 8k
   tokens), submitted in two halves, each at once: about three times what the
   cache holds, so vLLM preempts and recomputes. About
   one in eight requests is aborted by its client at a random engine step
   (``LLMEngine.abort_request``); the probes are submitted again once half of
   the first half has finished;
3. the checks: every request not aborted finishes with all its tokens
   (``lost``); each probe's tokens equal the reference up to the reference's
   first near tie (``--tie`` nats between the two best log-probabilities;
   batches of other sizes round bf16 differently); once idle no KV block is in
   use (the block pool's free blocks equal its blocks less vLLM's null block)
   and no request is left in the scheduler (``leaked``);
   ``torch.cuda.memory_allocated`` after the second half exceeds the value after
   the first by at most ``--max-growth-mib``; and the load did preempt and did
   hit the prefix cache (``cached_tokens``: vLLM's ``num_cached_tokens`` summed
   over the finished requests), except for token-adaptive configs, whose
   prefix hits under overload are a documented limit (:func:`token_adaptive`).

Prints one markdown table (config, requests, aborted, preemptions, cached
tokens, lost, probe mismatches, leaked blocks, memory growth, wall time,
verdict) and writes the rows to ``--json``. With ``--requests 40 --max-len 16384 --kv-tokens
24000`` one config took 76 s (``default``) to 174 s (``preset-4x``) on an H200,
start-up included (benchmarks/README.md, "GPU soak").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_serving  # noqa: E402

# the default (the 2x preset) and each preset; 8x as gpu_serving's alloc-8x (the
# preset allocates from calibration text, which the GPU machine does not have)
DEFAULT_CONFIGS = "default,preset-lossless,preset-4x,alloc-8x"
PROBE_LENGTHS = (16, 64, 200, 512, 1024, 2048, 4096, 8192)
NUM_PREFIXES = 4


class Request(NamedTuple):
    """One request of the soak.

    Attributes:
        id: vLLM's request id.
        prompt: Token ids.
        max_tokens: Output tokens asked for (``ignore_eos``: all of them come).
        abort_at: The engine step of its half at which the client aborts it
            (``None``: never).
        prefix: Index of the shared prefix it starts with (``None``: none).
    """

    id: str
    prompt: list[int]
    max_tokens: int
    abort_at: int | None
    prefix: int | None


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def request_mix(n: int, seed: int, *, min_len: int = 64, max_len: int = 32768,
                min_out: int = 16, max_out: int = 512, abort_fraction: float = 0.125,
                prefix_fraction: float = 0.5, max_abort_step: int = 120) -> list[Request]:
    """``n`` requests, the same for the same arguments: prompt lengths
    log-spaced from ``min_len`` to ``max_len`` (both included) in a shuffled
    order, outputs uniform in ``[min_out, max_out]``, about ``prefix_fraction``
    of the prompts (those long enough) starting with one of
    :data:`NUM_PREFIXES` prefixes shared by every seed (a quarter of
    ``min(max_len, 8192)`` tokens up to all of it), about ``abort_fraction``
    aborted at a step in ``[1, max_abort_step]``.

    Raises:
        ValueError: ``n < 2`` or an empty length range.
    """
    if n < 2 or not 0 < min_len <= max_len or not 0 < min_out <= max_out:
        raise ValueError(f"need n >= 2 and 0 < min <= max (n={n}, lengths {min_len}..{max_len},"
                         f" outputs {min_out}..{max_out})")
    shared = random.Random(NUM_PREFIXES)
    prefixes = [_tokens(shared, min(max_len, 8192) * (i + 1) // NUM_PREFIXES)
                for i in range(NUM_PREFIXES)]
    rng = random.Random(seed)
    lengths = [round(min_len * (max_len / min_len) ** (i / (n - 1))) for i in range(n)]
    rng.shuffle(lengths)
    mix = []
    for i, length in enumerate(lengths):
        fits = [p for p in range(NUM_PREFIXES) if len(prefixes[p]) + min_len <= length]
        prefix = rng.choice(fits) if fits and rng.random() < prefix_fraction else None
        head = prefixes[prefix] if prefix is not None else []
        mix.append(Request(
            id=f"s{seed}-{i}", prompt=head + _tokens(rng, length - len(head)),
            max_tokens=rng.randint(min_out, max_out),
            abort_at=rng.randint(1, max_abort_step) if rng.random() < abort_fraction else None,
            prefix=prefix))
    return mix


def probe_prompts() -> list[list[int]]:
    """The fixed probe set: one prompt per :data:`PROBE_LENGTHS` entry, token
    ids from a fixed seed."""
    rng = random.Random(54)
    return [_tokens(rng, n) for n in PROBE_LENGTHS]


def probe_mismatches(got: list[list[int]], ref: list[list[int]], gaps: list[list[float]],
                     tie: float) -> tuple[int, int]:
    """``(probes whose tokens differ from ref, tokens compared)``: each probe
    is compared up to the reference's first near tie (a step whose best two
    log-probabilities are less than ``tie`` apart, that step included)."""
    bad = compared = 0
    for g, r, gap in zip(got, ref, gaps, strict=True):
        n = next((i + 1 for i, x in enumerate(gap) if x < tie), len(r))
        bad += g[:n] != r[:n]
        compared += n
    return bad, compared


def _params(max_tokens: int, logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens,
                          logprobs=logprobs)


def kv_gib(model: str, name: str, tokens: int, max_model_len: int) -> float:
    """GiB of KV cache in which config ``name`` holds about ``tokens`` tokens
    and admits at least 1.5 requests of ``max_model_len`` tokens (vLLM's
    worst-case rule, which counts the exact tokens of the token-adaptive
    presets): the plugin's estimate of 1 GiB (:func:`vllm_lowrank.estimate.estimate`),
    scaled. Every config is then overfilled alike by the same load."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.estimate import estimate

    spec = gpu_serving._spec(name)
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "artifact": "none",
                                   **spec.get("compression", {})})
    info = estimate(model, cfg, dtype="bfloat16", kv_cache_gib=1.0,
                    block_size=spec.get("block_size"), context=max_model_len)
    stock = "" if "compression" in spec else "stock_"
    return max(tokens / info[f"{stock}tokens"], 1.5 / info[f"{stock}admitted_sequences"])


def _engine(args, name: str):
    """``gpu_serving``'s engine recipe for config ``name``, with prefix caching
    on and the KV cache of :func:`kv_gib`; ``(engine, GiB of KV cache)``."""
    from vllm import LLM

    spec = gpu_serving._spec(name)
    max_len = args.max_len + args.max_out + 16
    model = gpu_serving.model_dir(args.model, max_position_embeddings=max(8192, max_len))
    gib = kv_gib(model, name, args.kv_tokens, max_len)
    seqs = sorted({1, 2, 4, 8, 16, 32, 64, args.max_num_seqs})
    kw = dict(
        model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_len, seed=0,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=True,
        kv_cache_memory_bytes=int(gib * 2**30),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_config={"backend": spec.get("backend", "TRITON_ATTN")},
        ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"],
                        "gelu_and_mul_sparse": ["native"]},
        compilation_config={"mode": 0, "custom_ops": ["none"],
                            "cudagraph_mode": "FULL_DECODE_ONLY",
                            "cudagraph_capture_sizes": seqs})
    for key in ("block_size", "kv_cache_dtype"):
        if key in spec:
            kw[key] = spec[key]
    if "compression" in spec:
        kw["additional_config"] = {"kv_compression": {"mode": "lowrank", "artifact": "none",
                                                      **spec["compression"]}}
    return LLM(**kw), gib


def _run(engine, requests: list[Request], probes: list[list[int]], probe_tokens: int,
         ) -> tuple[dict, set[str], list[list[int]]]:
    """Submit ``requests`` at once and step until all finish, aborting each
    at its ``abort_at`` step; the probes (if any) are submitted once half of
    the requests have finished. Returns ``(finished outputs by id, aborted
    ids, probe tokens)``."""
    for r in requests:
        engine.add_request(r.id, {"prompt_token_ids": r.prompt}, _params(r.max_tokens))
    aborts = {r.id: r.abort_at for r in requests if r.abort_at is not None}
    finished, aborted, step = {}, set(), 0
    probes_in = not probes
    while engine.has_unfinished_requests() or not probes_in:  # probes go in at half way
        step += 1
        due = [i for i, at in aborts.items() if at <= step and i not in finished]
        if due:
            engine.abort_request(due)
            aborted.update(due)
        aborts = {i: at for i, at in aborts.items() if at > step}
        if not probes_in and len(finished) + len(aborted) >= len(requests) // 2:
            for k, p in enumerate(probes):
                engine.add_request(f"probe-{k}", {"prompt_token_ids": p},
                                   _params(probe_tokens, logprobs=2))
            probes_in = True
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    got = [list(finished[f"probe-{k}"].outputs[0].token_ids) for k in range(len(probes))]
    return finished, aborted, got


def token_adaptive(name: str) -> bool:
    """Whether config ``name`` keeps exact sink and recent tokens (``token_adaptive``).
    Its prefix-cache hits need the exact window's blocks at the prefix's end, which
    vLLM frees once prefill passes them and evicts first under overload (README.md,
    "Limits"): a soak of such a config that hits no prefix still passes, and says so."""
    from vllm_lowrank.presets import expand

    compression = gpu_serving.CONFIGS[name].get("compression")
    return bool(compression) and bool(expand(compression).get("token_adaptive"))


def run_one(args) -> dict:
    """The soak of config ``args.one`` (in this process's engine)."""
    import torch

    name = args.one
    t0 = time.perf_counter()
    llm, gib = _engine(args, name)
    row = dict(config=name, device=torch.cuda.get_device_name(),
               startup_s=round(time.perf_counter() - t0, 1), kv_gib=round(gib, 2),
               kv_tokens=gpu_serving._capacity(llm))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    longest = args.max_len + args.max_out
    if row["kv_tokens"] < longest:
        return dict(row, error=f"{row['kv_tokens']} KV tokens cannot hold one request of "
                               f"{longest}: raise --kv-tokens")
    probes = probe_prompts()
    solo = llm.generate([{"prompt_token_ids": p} for p in probes],
                        _params(args.probe_tokens, logprobs=2), use_tqdm=False)
    ref = [list(o.outputs[0].token_ids) for o in solo]
    tops = [[sorted((x.logprob for x in step.values()), reverse=True)
             for step in o.outputs[0].logprobs] for o in solo]
    gaps = [[t[0] - t[1] for t in probe] for probe in tops]

    preemptions = [0]
    preempt = scheduler._preempt_request

    def counted(*a, **kw):
        preemptions[0] += 1
        return preempt(*a, **kw)

    scheduler._preempt_request = counted
    halves = [request_mix(args.requests // 2, seed, max_len=args.max_len, max_out=args.max_out)
              for seed in (1, 2)]
    memory, lost, aborted, cached, got = [], 0, 0, 0, None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for h, half in enumerate(halves):
        finished, gone, probe_out = _run(engine, half, probes if h == 0 else [],
                                         args.probe_tokens)
        got = got or probe_out
        aborted += len(gone)
        cached += sum(out.num_cached_tokens or 0 for out in finished.values())
        lost += sum(r.id not in gone and (r.id not in finished or len(
            finished[r.id].outputs[0].token_ids) != r.max_tokens) for r in half)
        torch.cuda.synchronize()
        memory.append(torch.cuda.memory_allocated())
    wall = time.perf_counter() - t0
    del scheduler._preempt_request
    bad, compared = probe_mismatches(got, ref, gaps, args.tie)
    leaked = (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) + len(scheduler.requests)
    growth = (memory[1] - memory[0]) / 2**20
    failures = [what for what, failed in (
        (f"{lost} lost", lost), (f"{bad} probe mismatches", bad), (f"{leaked} leaked", leaked),
        (f"memory +{growth:.1f} MiB", growth > args.max_growth_mib),
        ("no preemption: lower --kv-tokens", not preemptions[0]),
        ("no prefix-cache hit", not cached and not token_adaptive(name))) if failed]
    passed = "pass" + (" (no prefix-cache hit: token-adaptive, README Limits)"
                       if not cached else "")
    return dict(row, requests=sum(map(len, halves)), aborted=aborted,
                preemptions=preemptions[0], cached_tokens=cached, lost=lost,
                probe_mismatches=bad,
                probe_tokens_compared=compared, leaked_blocks=leaked,
                memory_growth_mib=round(growth, 1), wall_s=round(wall, 1),
                verdict=passed if not failures else "FAIL: " + ", ".join(failures))


def _plan(args) -> str:
    """What a run would do (``--dry-run``): configs and the request mix."""
    lines = [f"configs: {args.configs} (one engine each, KV cache for about "
             f"{args.kv_tokens:,} tokens, prefix caching, CUDA graphs)"]
    for seed in (1, 2):
        mix = request_mix(args.requests // 2, seed, max_len=args.max_len, max_out=args.max_out)
        lengths = [len(r.prompt) for r in mix]
        lines.append(
            f"half {seed}: {len(mix)} requests, prompts {min(lengths)}..{max(lengths)} tokens "
            f"({sum(lengths):,} in all), outputs {min(r.max_tokens for r in mix)}.."
            f"{max(r.max_tokens for r in mix)}, {sum(r.abort_at is not None for r in mix)} "
            f"aborted, {sum(r.prefix is not None for r in mix)} with a shared prefix")
    lines.append(f"probes: {len(PROBE_LENGTHS)} prompts of {PROBE_LENGTHS} tokens, "
                 f"{args.probe_tokens} greedy tokens each, alone and mid-soak")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b-shape")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="gpu_serving.py's config names, comma-separated")
    p.add_argument("--requests", type=int, default=48, help="soak requests per config")
    p.add_argument("--max-len", type=int, default=32768, help="longest prompt, tokens")
    p.add_argument("--max-out", type=int, default=512, help="longest output, tokens")
    p.add_argument("--kv-tokens", type=int, default=48000,
                   help="tokens the KV cache holds, sized per config (small: each half of "
                        "the soak is about three times as many)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="the fraction of GPU memory vLLM checks is free at start-up (the KV "
                        "cache is sized by --kv-tokens): low, so that soaks share one GPU")
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--tie", type=float, default=0.05,
                   help="nats: a probe step whose two best log-probabilities are closer "
                        "ends its comparison")
    p.add_argument("--max-growth-mib", type=float, default=16.0)
    p.add_argument("--timeout", type=int, default=600, help="seconds per engine")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in args.configs.split(","):
        gpu_serving._spec(name)  # unknown names fail here, before any engine starts
    if args.dry_run:
        print(_plan(args))
        return
    if args.one:
        print("ROW " + json.dumps(run_one(args)), flush=True)
        os._exit(0)  # vLLM's engine threads may otherwise delay the exit
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    gpu_serving.prebuild(env)
    rows = []
    for name in args.configs.split(","):
        t0 = time.time()
        try:
            res = subprocess.run([sys.executable, "-P", __file__, *sys.argv[1:], "--one", name],
                                 env=env, capture_output=True, text=True, timeout=args.timeout)
            out = [line for line in res.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(out[-1][4:]) if out else dict(
                config=name, error=" / ".join((res.stderr or res.stdout).strip()
                                              .splitlines()[-3:])[-400:])
        except subprocess.TimeoutExpired:
            row = dict(config=name, error=f"timeout after {args.timeout} s")
        row["engine_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(gpu_serving._table(rows, [
        "config", "kv_gib", "kv_tokens", "requests", "aborted", "preemptions",
        "cached_tokens", "lost",
        "probe_mismatches", "leaked_blocks", "memory_growth_mib", "wall_s", "verdict", "error"]))


if __name__ == "__main__":
    main()
