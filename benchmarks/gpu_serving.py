"""End-to-end serving speed inside vLLM on a GPU: stock vLLM vs this plugin vs
vLLM's own compressed KV caches, side by side in one run, one engine per
subprocess (so each starts on a free GPU).

Runs on the GPU machine with vLLM's Python engine (``../shared/gpu-vllm``:
Triton attention for stock vLLM, torch-native norms, random "dummy" weights at
the real shapes, which time the same as real ones)::

    source .gpuvllm/env.sh && python3 -P benchmarks/gpu_serving.py \\
        --configs stock,default,g1 --shapes 1x4096,16x4096,8x32768

Two measurements per engine (CUDA graphs, ``FULL_DECODE_ONLY``, no torch.compile):

- ``--shapes BxL``: ``B`` distinct prompts of ``L`` tokens (no prefix
  caching) submitted at once, the engine stepped by hand: prefill time (until
  every request has its first token; chunks of ``--max-num-batched-tokens``)
  and decode step (median of the ``--decode-tokens`` engine steps after that
  which decode all ``B`` requests),
  with the KV memory vLLM chooses (``--gpu-memory-utilization``);
- ``--equal-memory GIB``: the same KV cache bytes for every engine
  (``kv_cache_memory_bytes``), ``--load-prompts`` prompts of ``--load-len``
  tokens plus ``--load-out`` output tokens submitted at once: the sequences that
  fit (vLLM's worst-case capacity: KV tokens / tokens per sequence), the peak
  and mean number of requests it ran at once, and the output tokens per second.
  ``stock-all-memory`` is the exception: stock with the KV memory vLLM sizes,
  every request at once, the load's ceiling for a cache with stock's attention.

``--speculative``: every engine (stock too) with vLLM's n-gram speculative
decoding (3 drafts per step) over prompts that repeat a 64-token pattern, so
the proposer drafts and verify steps decode 4 query tokens per request; rows
add the draft tokens proposed and accepted (dummy weights accept few: compare
the decode step, and tokens/s at the same acceptance).

``--tensor-parallel-size N``: every engine on ``N`` GPUs (:func:`parallel_args`:
vLLM's ``mp`` executor, one worker process per GPU, the engine core still in
this process, so its scheduler stays reachable; an NCCL all-reduce, vLLM's
custom one being a compiled kernel; no NVLink multicast, :data:`NO_MULTICAST`).
``--equal-memory`` is per GPU (vLLM's ``kv_cache_memory_bytes`` is per worker);
``kv_tokens`` counts tokens, each rank holding its KV heads of every token in
its own memory.

Each row names the decoders the latent layers took
(:mod:`vllm_lowrank.attention.decoders`), or for FlashInfer the decode kernel
vLLM chose. The engines run the product as it ships: nothing here replaces a
product function.

Ratios (``*_vs_stock``, column ``ref``) are against the fastest stock backend
with a bf16 cache in the same command (``stock``: TRITON_ATTN, ``stock-flashinfer*``;
not ``stock-all-memory`` nor an FP8 cache); a second table gives every row
against each stock row.

Prints a table per measurement and writes every row to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allocations import alloc_8x_ranks  # noqa: E402

from vllm_lowrank.presets import PRESETS, TALE_CHANNEL_KEYS  # noqa: E402

NO_FI_AUTOTUNE = {"enable_flashinfer_autotune": False}
"""vLLM engine arguments of the FlashInfer configs (see there)."""

JLRD_075_TALE = {"rank_fraction": 0.75, "k_bits": 4, "v_bits": 4, **TALE_CHANNEL_KEYS,
                 "exact_bits": 8}
"""J-LRD latents at 0.75, 4-bit per-channel keys and 4-bit values, 32 sink + 128
recent tokens exact as int8 (the keys rebuilt at each step)."""

CONFIGS = {
    "stock": {},
    # stock vLLM with the KV memory vLLM sizes at --gpu-memory-utilization, not
    # --equal-memory: in the load, every request fits at once. The load's reference
    # for a cache as fast as stock's with unlimited room (no compression can beat
    # it but by attending faster than stock's bf16 kernel)
    "stock-all-memory": {"all_memory": True},
    # stock vLLM on FlashInfer (bf16, and vLLM's FP8 KV cache): FlashInfer's kernels
    # JIT-compile with the machine's nvcc. On the GPU recipe, from
    # `prepare_gpuvllm.sh --flashinfer` (README, "Stock FlashInfer"): flashinfer-python
    # (only these engines see it) and vLLM's Triton cache write in place of its compiled
    # one (benchmarks/gpuvllm_flashinfer.py). Offline and without flashinfer-cubin, vLLM
    # decodes with FlashInfer's own kernels; "-xqa" tells vLLM that cubins are there
    # (VLLM_HAS_FLASHINFER_CUBIN=1), as it assumes where it reaches NVIDIA's
    # artifactory: then it decodes with XQA on SM90 (JIT-compiled as well). vLLM's
    # FlashInfer autotune warm-up is off ("engine"): on the recipe it died there with an
    # illegal memory access (H200, 2026-11-29); it tunes FlashInfer's GEMM/MoE kernels,
    # which this dense bf16 model does not run
    "stock-flashinfer": {"backend": "FLASHINFER", "engine": NO_FI_AUTOTUNE},
    "stock-flashinfer-fp8": {"backend": "FLASHINFER", "kv_cache_dtype": "fp8",
                             "engine": NO_FI_AUTOTUNE},
    "stock-flashinfer-xqa": {"backend": "FLASHINFER", "engine": NO_FI_AUTOTUNE,
                             "env": {"VLLM_HAS_FLASHINFER_CUBIN": "1"}},
    "stock-flashinfer-fp8-xqa": {"backend": "FLASHINFER", "kv_cache_dtype": "fp8",
                                 "engine": NO_FI_AUTOTUNE,
                                 "env": {"VLLM_HAS_FLASHINFER_CUBIN": "1"}},
    # the plugin; artifact "none": no calibration text on the GPU machine (weight
    # SVD of the dummy weights: speed and memory are real, accuracy is not)
    # what `--kv-compression lowrank` alone serves (presets.DEFAULT_PRESET)
    "default": {"compression": {"preset": "2x"}},
    # a config without a preset: the field defaults (J-LRD, ratio 0.5, 16-bit)
    "jlrd": {"compression": {}},
    "g1": {"compression": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "uniform"}},
    "g1-r0.25": {"compression": {"rank_fraction": 0.25, "head_group_size": 1,
                                 "rank_allocation": "uniform"}},
    "g1-fisher": {"compression": {"rank_fraction": 0.5, "head_group_size": 1}},
    "g2": {"compression": {"rank_fraction": 0.5, "head_group_size": 2, "rank_allocation": "uniform"}},
    "g1-k4v4": {"compression": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "uniform",
                                "k_bits": 4, "v_bits": 4}},
    "g1-k8v8": {"compression": {"rank_fraction": 1.0, "head_group_size": 1, "rank_allocation": "uniform",
                                "k_bits": 8, "v_bits": 8}},
    # the 2x preset's bits with post-RoPE latents (ZACK): full rank, no key rebuild
    "pr-k8v4": {"compression": {"rank_fraction": 1.0, "head_group_size": 1, "k_bits": 8, "v_bits": 4,
                                "method": "post_rope", "rank_allocation": "uniform"}},
    "tale-k4v4": {"compression": {"rank_fraction": 0.5, "head_group_size": 1, "rank_allocation": "uniform",
                                  "k_bits": 4, "v_bits": 4, "token_adaptive": True,
                                  "sink_tokens": 32, "recent_tokens": 128}},
    # the presets (vllm_lowrank/presets.py), weight-SVD bases (artifact "none");
    # 8x allocates from a calibration artifact, which the GPU machine cannot make
    "preset-2x": {"compression": {"preset": "2x"}},
    "preset-4x": {"compression": {"preset": "4x"}},
    "preset-lossless": {"compression": {"preset": "lossless"}},
    # `4x` without exact sinks (one exact block fewer per request, +3.1 %)
    "preset-4x-nosink": {"compression": {"preset": "4x", "sink_tokens": 0}},
    # J-LRD latents at 0.5 with per-channel 4-bit keys and 4-bit values, exact sinks and
    # recent tokens (the keys rebuilt at each step: the wide-group kernel)
    "jlrd-0.5-tale": {"compression": {"rank_fraction": 0.5, "k_bits": 4, "v_bits": 4,
                                      **TALE_CHANNEL_KEYS},
                      "block_size": 32},
    # the same at 0.75 with int8 exact tokens (4.04x, +0.6 % on SmolLM2)
    "jlrd-0.75-tale": {"compression": JLRD_075_TALE, "block_size": 32},
    # the 8x preset's settings (without its allocation, which needs calibration
    # text) with its SmolLM2 allocation's ranks stretched to 32 layers of 1,024
    # channels (allocations.py), 4-bit where it allocated 3 or 2 bits (a config
    # cannot give bits per layer); the preset's block size
    "alloc-8x": {"compression": {**PRESETS["8x"].settings, "ranks": alloc_8x_ranks(32, 1024)},
                 "block_size": PRESETS["8x"].block_size},
    # the same at --tensor-parallel-size 2: ranks in multiples of 16 (8 per rank)
    "alloc-8x-tp2": {"compression": {**PRESETS["8x"].settings,
                                     "ranks": alloc_8x_ranks(32, 1024, tp=2)},
                     "block_size": PRESETS["8x"].block_size},
    # the same with key bases that commute with RoPE (weight-only `rope_equivariant`
    # bases): decoded with the queries absorbed, no key rebuild (decode_latent_rope)
    "alloc-8x-re": {"compression": {**PRESETS["8x"].settings, "ranks": alloc_8x_ranks(32, 1024),
                                    "method": "rope_equivariant"},
                    "block_size": PRESETS["8x"].block_size},
    # post-RoPE 4-bit keys and values per token, per KV head (no low rank: the
    # quantization-only peer of issue 50, on the packed kernel)
    "pr-k4v4": {"compression": {"rank_fraction": 1.0, "head_group_size": 1, "k_bits": 4,
                                "v_bits": 4, "method": "post_rope",
                                "rank_allocation": "uniform"}},
    # the same keys, values at rank 512 of 1,024 (64 per KV head): issue 50's last row
    "pr-k4v4-v0.5": {"compression": {"head_group_size": 1, "k_bits": 4, "v_bits": 4,
                                     "method": "post_rope", "rank_allocation": "uniform",
                                     "ranks": {str(i): [1024, 512] for i in range(32)}}},
    # post-RoPE keys as stored codes (4-bit per channel over 32 tokens) beside value
    # latents per KV head, exact sinks and recent tokens: one fused kernel
    # (post_rope_decode.cu for 2/4-bit values, decode_post_rope for 8-bit);
    # "prk-vXrY": values at X bits and rank fraction Y
    **{f"prk-v{vb}r{vr}": {"compression": {
        "post_rope_keys": True, "token_adaptive": True, "sink_tokens": 32,
        "recent_tokens": 128, "k_quant": "channel", "k_channel_tokens": 32, "k_bits": 4,
        "v_bits": vb, "exact_bits": 8, "head_group_size": 1, "rank_allocation": "uniform",
        "rank_fraction": (1 + vr) / 2}, "block_size": 32}
       for vb, vr in ((2, 1.0), (4, 1.0), (4, 0.5), (4, 0.75), (8, 0.5))},
    # latent 0.75 with per-head groups (3.62x, +0.4 % on SmolLM2): per-channel keys
    # on the grid kernel
    "g1-jlrd-0.75-tale": {"compression": {**JLRD_075_TALE, "head_group_size": 1},
                          "block_size": 32},
    # vLLM's own compressed caches (Triton kernels, no calibration; TurboQuant:
    # vLLM picks its backend per layer, its 16-bit boundary layers included)
    "int8_per_token_head": {"kv_cache_dtype": "int8_per_token_head"},
    "int4_per_token_head": {"kv_cache_dtype": "int4_per_token_head"},
    "fp8_per_token_head": {"kv_cache_dtype": "fp8_per_token_head"},
    "turboquant_k8v4": {"kv_cache_dtype": "turboquant_k8v4", "backend": None},
    "turboquant_4bit_nc": {"kv_cache_dtype": "turboquant_4bit_nc", "backend": None},
    "turboquant_3bit_nc": {"kv_cache_dtype": "turboquant_3bit_nc", "backend": None},
}


LLAMA3_70B = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, intermediate_size=28672, max_position_embeddings=131072)
"""Llama-3-70B's widths: hidden 8,192, 64 query / 8 KV heads of 128, MLP 28,672."""

SHAPES = {
    # Llama-3-70B's widths with 8 of its 80 layers: 7.65 B parameters (the recipe's
    # 49,152-token vocabulary), 7.1 GiB bf16 per GPU at TP=2; 32 KiB of bf16 K+V per
    # token (16 KiB per rank): speed at 70B width, not a model that needs two GPUs
    "llama3-70b-width-8l": ("llama3-8b-shape", dict(LLAMA3_70B, num_hidden_layers=8)),
    # the whole Llama-3-70B shape: 69.3 B parameters, 129 GiB bf16, more than vLLM
    # gives one H200 (0.9 x 140 GiB); at TP=2 64.5 GiB per GPU, 160 KiB of K+V per
    # token and rank
    "llama3-70b-shape": ("llama3-8b-shape", dict(LLAMA3_70B, num_hidden_layers=80)),
}
"""``--model`` names beyond the recipe's folders: ``name: (recipe folder,
config.json overrides)``."""


def model_dir(name: str, **overrides) -> str:
    """A copy of the GPU recipe's model folder ``name`` (config + tokenizer)
    with ``overrides`` written into its ``config.json`` (the Llama-3-8B shape
    ships ``max_position_embeddings`` 8192; long contexts need more). ``name``
    may be a :data:`SHAPES` entry: its folder with its overrides, then these."""
    import shutil
    import tempfile

    base, shape = SHAPES.get(name, (name, {}))
    overrides = {**shape, **overrides}
    src = os.path.join(os.environ["GPUVLLM_MODELS"], base)
    dst = os.path.join(tempfile.gettempdir(), "vllm_lowrank_models",
                       name + "".join(f"-{k}{v}" for k, v in sorted(overrides.items())))
    if not os.path.exists(os.path.join(dst, "config.json")):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(overrides)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    return dst


def _spec(name: str) -> dict:
    """The :data:`CONFIGS` entry of ``name``.

    Raises:
        SystemExit: an unknown config (names the known ones).
    """
    if name not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}: choose from {sorted(CONFIGS)}")
    return CONFIGS[name]


SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 2}
"""``--speculative``: vLLM's n-gram prompt lookup."""

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",  # NCCL's NVLink SHARP collectives (multicast objects)
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # vLLM's all-reduce over torch symmetric memory (multimem on Hopper at 4+ GPUs)
    # and FlashInfer's (IPC / multicast buffers): NCCL alone
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
}
"""Environment of every engine: no NVLink multicast, which on the lent machines
can put the host's shared GPUs out of service (the device README's KINDS.md)."""


def parallel_args(tp: int) -> dict:
    """``LLM`` keyword arguments for ``tp`` GPUs (none at 1): vLLM's ``mp``
    executor (a worker process per GPU; the engine core stays where ``LLM`` is
    built when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its custom all-reduce
    off (a compiled kernel the GPU recipe does not carry), so the all-reduce is
    NCCL's (vLLM's PyNccl, else ``torch.distributed``)."""
    if tp == 1:
        return {}
    return dict(tensor_parallel_size=tp, distributed_executor_backend="mp",
                disable_custom_all_reduce=True)


def recipe_engine_args(eager: bool, capture_sizes) -> dict:
    """``LLM`` keyword arguments every engine on the GPU recipe needs (its vLLM
    has no compiled ops): torch-native norms, no torch.compile, and CUDA graphs
    of decode-only batches (``FULL_DECODE_ONLY``) at ``capture_sizes`` unless
    ``eager``."""
    return dict(ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"],
                                "gelu_and_mul_sparse": ["native"]},
                enforce_eager=eager,
                compilation_config={"mode": 0, "custom_ops": ["none"],
                                    "cudagraph_mode": "NONE" if eager else "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": sorted(set(capture_sizes))})


def _engine(args, name: str, max_model_len: int, max_num_seqs: int, kv_bytes: int | None):
    from vllm import LLM

    spec = _spec(name)
    kw = dict(
        model=model_dir(args.model, max_position_embeddings=max(8192, max_model_len)),
        load_format="dummy",
        dtype="bfloat16", max_model_len=max_model_len, seed=0, max_num_seqs=max_num_seqs,
        enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        **({} if args.watermark is None else {"watermark": args.watermark}),
        attention_config={"backend": spec.get("backend", "TRITON_ATTN")},  # None: vLLM's choice
        **recipe_engine_args(args.eager, (1, 2, 4, 8, 16, 32, 64, 128, 256, max_num_seqs)),
    )
    kw.update(parallel_args(args.tensor_parallel_size))
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes  # per GPU
    if args.speculative:
        kw.update(speculative_config=SPECULATION, disable_log_stats=False)
    if "block_size" in spec:
        kw["block_size"] = spec["block_size"]
    if "kv_cache_dtype" in spec:
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
    kw.update(spec.get("engine", {}))
    if "compression" in spec:
        kw["additional_config"] = {"kv_compression": {"mode": "lowrank", "artifact": "none",
                                                      **spec["compression"]}}
    return LLM(**kw)


PERIOD = 0
"""Tokens after which every prompt repeats (0: none; 64 with ``--speculative``,
so that the n-gram proposer finds matches)."""


def _prompts(n: int, length: int, salt: int) -> list[dict]:
    period = PERIOD or length
    return [{"prompt_token_ids": [(i * 7919 + (j % period) * 31 + salt * 104729) % 40000 + 100
                                  for j in range(length)]} for i in range(n)]


def _speculation(llm) -> dict:
    """Draft tokens proposed and accepted so far (``--speculative``), else ``{}``."""
    if llm.llm_engine.vllm_config.speculative_config is None:
        return {}
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return dict(drafted=counters.get("vllm:spec_decode_num_draft_tokens"),
                accepted=counters.get("vllm:spec_decode_num_accepted_tokens"))


_REQ = iter(range(10**9))


def prefill_tokens_bound(batch: int, length: int, chunk: int) -> int:
    """At most how many tokens a request decodes before the last of ``batch``
    prompts of ``length`` tokens has its first token: one per engine step, and
    chunked prefill ends within ``ceil(batch * length / chunk) + batch`` steps
    (``chunk``: ``--max-num-batched-tokens``)."""
    return -(-batch * length // chunk) + batch


def _load(llm, prompts, max_tokens: int) -> dict:
    """Submit ``prompts`` at once, each asking for ``max_tokens``, and step the
    engine until all finish. Returns ``wall_s``; ``peak_running`` and
    ``mean_running``, the largest and the mean number of requests vLLM's
    scheduler held running after a step (the concurrency it admitted, which its
    worst-case capacity figure ``fit_seqs`` bounds from below);
    ``queued_running``, the mean over the steps after which requests were still
    waiting (``None`` if none were): the concurrency the KV memory sustains
    while the queue is not empty; ``preemptions`` (requests vLLM preempted,
    to be recomputed), ``steps`` and ``mixed_steps`` (steps that scheduled some
    prefill tokens: not replayed from a decode-only CUDA graph) and ``mixed_s``,
    the seconds those steps took (the rest of ``wall_s`` is decode-only steps).
    In process only (this script sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a step
    returns when its GPU work is done)."""
    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    for p in prompts:
        engine.add_request(f"r{next(_REQ)}", p, sp)
    running, queued = [], []
    counts = dict(preemptions=0, mixed_steps=0)
    mixed_s = 0.0
    preempt, schedule = scheduler._preempt_request, scheduler.schedule

    def counted_preempt(*a, **kw):
        counts["preemptions"] += 1
        return preempt(*a, **kw)

    def counted_schedule(*a, **kw):
        out = schedule(*a, **kw)
        counts["mixed_steps"] += out.total_num_scheduled_tokens > len(out.num_scheduled_tokens)
        return out

    scheduler._preempt_request, scheduler.schedule = counted_preempt, counted_schedule
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            mixed, t = counts["mixed_steps"], time.perf_counter()
            engine.step()
            if counts["mixed_steps"] > mixed:  # this step scheduled prefill tokens
                mixed_s += time.perf_counter() - t
            running.append(len(scheduler.running))
            if len(scheduler.waiting):
                queued.append(running[-1])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        del scheduler._preempt_request, scheduler.schedule  # the class's methods again
    return dict(wall_s=wall, peak_running=max(running),
                mean_running=sum(running) / len(running),
                queued_running=sum(queued) / len(queued) if queued else None,
                steps=len(running), mixed_s=mixed_s, **counts)


def _stepped(llm, prompts, max_tokens: int) -> tuple[float, float]:
    """Submit ``prompts`` at once, each asking for ``max_tokens``, and step the
    engine: ``(prefill_s, decode_ms)``, the time until every request has its
    first token, and the median time of the engine steps that decode every
    request (all started, none finished).

    Requests that finish their prefill early decode while the later ones
    prefill, so ``max_tokens`` must cover those tokens too
    (:func:`prefill_tokens_bound`) for full-batch steps to follow the last first
    token. (Before 2026-11-27 every request asked for ``--decode-tokens``
    tokens, so at long context most had finished by then: "8 x 32k" steps
    decoded about half the batch.)

    With ``--tensor-parallel-size`` > 1 the GPUs belong to the worker
    processes and ``torch.cuda.synchronize`` here waits for none of their work:
    a step is timed until the engine core has the outputs it waits for (with
    async scheduling, those of the step before), so the median is the steady
    step time of the pipeline, stock and plugin alike."""
    import statistics

    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
    for p in prompts:
        engine.add_request(f"r{next(_REQ)}", p, sp)
    started: set = set()
    finished: set = set()
    prefill_s, steps = None, []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        full = prefill_s is not None and not finished  # every request decodes this step
        t = time.perf_counter()
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                finished.add(out.request_id)
        torch.cuda.synchronize()
        now = time.perf_counter()
        if prefill_s is None:
            if len(started) == len(prompts):
                prefill_s = now - t0
        elif full:
            steps.append(now - t)
    return prefill_s, 1000 * statistics.median(steps[1:-1] or steps)


def _profile(llm, prompts, path: str, steps: int = 8, prefill_skip: int = 8,
             prefill_steps: int = 4) -> None:
    """Write the GPU kernels of ``prefill_steps`` engine steps of the prefill of
    ``prompts`` (after ``prefill_skip`` steps, so that a chunked prefill has
    history; none when the prefill is over by then) and of ``steps`` decode
    steps to ``path``: two tables by self device time (CUDA graph replays
    included: CUPTI records the kernels a graph launches), each headed by its
    steps' wall time (against the table's self CUDA total: the GPU's idle time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    engine = llm.llm_engine
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    bound = prefill_tokens_bound(len(prompts), len(prompts[0]["prompt_token_ids"]), chunk)
    sp = SamplingParams(temperature=0, max_tokens=steps + 4 + bound, ignore_eos=True)
    for p in prompts:
        engine.add_request(f"r{next(_REQ)}", p, sp)
    started: set = set()

    def prefill_step():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)

    for _ in range(prefill_skip):
        if len(started) < len(prompts):
            prefill_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as pre:
        for _ in range(prefill_steps):
            if len(started) < len(prompts):
                prefill_step()
        torch.cuda.synchronize()
    pre_s = time.perf_counter() - t0
    while len(started) < len(prompts):
        prefill_step()
    engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as dec:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    dec_s = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        head = f"{len(prompts)} requests x {len(prompts[0]['prompt_token_ids'])} tokens"
        for what, prof in ((f"{head}, prefill steps {prefill_skip} .. "
                            f"{prefill_skip + prefill_steps - 1} ({pre_s:.3f} s)", pre),
                           (f"{head}, {steps} decode steps ({dec_s:.3f} s)", dec)):
            f.write(what + "\n")
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30,
                                              max_name_column_width=90) + "\n")


def _worker_paths(worker) -> dict:
    """In a worker (``LLM.collective_rpc``): the names and descriptions of its
    latent layers' decoders and the CUDA graph mode it resolved."""
    cc = worker.vllm_config.compilation_config
    decs = [d for layer in cc.static_forward_context.values()
            if (d := layer.__dict__.get("decoder")) is not None]
    return dict(names=sorted({d.name for d in decs}),
                whys=sorted({d.describe()[:160] for d in decs}),
                graphs=str(cc.cudagraph_mode).split(".")[-1])


def _paths(llm) -> dict:
    """The decoders of the latent layers (their names, e.g. ``triton-grid``,
    and descriptions, :mod:`vllm_lowrank.attention.decoders`) and the CUDA
    graph mode vLLM resolved, over every worker (with the ``mp`` executor the
    layers live in the worker processes, not in this one)."""
    got = llm.collective_rpc(_worker_paths)
    return dict(path="/".join(sorted({n for g in got for n in g["names"]})) or "stock",
                why="; ".join(sorted({w for g in got for w in g["whys"]})),
                graphs="/".join(sorted({g["graphs"] for g in got})))


def _capacity(llm) -> int:
    """vLLM's group-aware KV capacity in tokens (what it logs as "KV cache
    size"); blocks x block size would count the token-adaptive mode's pool in
    exact-token blocks and understate it."""
    from vllm_lowrank.metrics import kv_capacity_tokens

    return kv_capacity_tokens(llm.llm_engine.vllm_config.cache_config)


def run_one(args) -> list[dict]:
    """One engine (``args.one``), every shape, or the equal-memory load."""
    import torch

    rows = []
    name = args.one
    base = dict(config=name, device=torch.cuda.get_device_name(), tp=args.tensor_parallel_size)
    if args.mode == "shapes":
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        extra = {(b, length): 1 + args.decode_tokens
                 + prefill_tokens_bound(b, length, args.max_num_batched_tokens)
                 for b, length in shapes}  # tokens each request generates
        max_len = max(length + extra[b, length] for b, length in shapes) + 16
        t0 = time.perf_counter()
        llm = _engine(args, name, max_len, max(b for b, _ in shapes), None)
        base["startup_s"] = round(time.perf_counter() - t0, 1)
        base["kv_tokens"] = _capacity(llm)
        base.update(_paths(llm))
        _load(llm, _prompts(2, 64, 99), 4)  # warm-up: compiles, graphs
        for salt, (b, length) in enumerate(shapes):
            row = dict(base, batch=b, context=length)
            if b * (length + extra[b, length]) > base["kv_tokens"]:
                rows.append(dict(row, error="does not fit the KV cache"))
                continue
            try:
                pre, step = _stepped(llm, _prompts(b, length, salt), extra[b, length])
                rows.append(dict(row, prefill_s=round(pre, 3), decode_ms=round(step, 2),
                                 **_speculation(llm)))
            except Exception as exc:  # noqa: BLE001 (reported in the table)
                rows.append(dict(row, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                break
        if args.profile:
            b, length = shapes[-1]
            _profile(llm, _prompts(b, length, 77), os.path.join(args.profile, f"{name}.txt"))
    else:
        kv_bytes = None if _spec(name).get("all_memory") else int(args.equal_memory * 2**30)
        per_seq = args.load_len + args.load_out
        t0 = time.perf_counter()
        llm = _engine(args, name, per_seq + 16, args.max_num_seqs, kv_bytes)
        base["startup_s"] = round(time.perf_counter() - t0, 1)
        cap = _capacity(llm)
        # warm-up at the load's shape (prompts of --load-len prefilled side by side,
        # then decoded): the Triton kernels the load uses compile here, not inside
        # its timing. With the short warm-up alone, a cold machine timed the
        # plugin's compiles: alloc-8x-re 3,381 tok/s cold against 3,993 warm
        # (H200, benchmarks/README.md, "Quantize-on-write").
        _load(llm, _prompts(2, 64, 99), 4)
        _load(llm, _prompts(min(16, args.load_prompts), args.load_len, 98), 4)
        got = _load(llm, _prompts(args.load_prompts, args.load_len, 7), args.load_out)
        rows.append(dict(base, kv_gib=args.equal_memory if kv_bytes else "all", kv_tokens=cap,
                         fit_seqs=cap // per_seq,
                         **{k: round(v, 2) if isinstance(v, float) else v
                            for k, v in got.items()},
                         out_tok_s=round(args.load_prompts * args.load_out / got["wall_s"], 1),
                         **_speculation(llm)))
    if args.tensor_parallel_size > 1:  # stop the workers (their GPUs free) before os._exit
        llm.llm_engine.engine_core.shutdown()
    return rows


def _table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def uses_flashinfer(name: str) -> bool:
    """Config ``name`` runs vLLM's FlashInfer attention backend."""
    return CONFIGS[name].get("backend") == "FLASHINFER"


def is_stock(name: str) -> bool:
    """A stock vLLM row: ``stock`` or ``stock-*`` (TRITON_ATTN, FlashInfer, FP8 KV)."""
    return name == "stock" or name.startswith("stock-")


def is_reference(name: str) -> bool:
    """A row the ratio columns may take as reference: stock vLLM with a bf16 cache at
    the same KV memory, any attention backend. Not ``stock-all-memory`` (vLLM sizes
    its memory) nor an FP8 cache (a compressed cache, like ours: it is compared in
    the "vs each stock row" table instead)."""
    spec = CONFIGS.get(name, {})
    return is_stock(name) and not spec.get("all_memory") and "kv_cache_dtype" not in spec


def references(rows: list[dict], metric: str, key=lambda r: None,
               lower_is_better: bool = False) -> dict:
    """``{key(row): row}``: for each group of rows (by ``key``: a shape, or none),
    the fastest :func:`is_reference` row that has ``metric``."""
    best: dict = {}
    for r in rows:
        if not is_reference(r.get("config", "")) or r.get(metric) is None:
            continue
        k, old = key(r), best.get(key(r))
        if old is None or (r[metric] < old[metric] if lower_is_better
                           else r[metric] > old[metric]):
            best[k] = r
    return best


def vs_each_stock(rows: list[dict], metric: str, key=lambda r: None,
                  label=lambda r: r["config"]) -> str:
    """A table of every row's ``metric`` over each stock row's (same group by
    ``key``), one column per stock config that ran (``stock-all-memory`` too)."""
    stocks = list(dict.fromkeys(r["config"] for r in rows
                                if is_stock(r["config"]) and r.get(metric) is not None))
    by = {(key(r), r["config"]): r for r in rows if r.get(metric) is not None}
    out = []
    for r in rows:
        if r.get(metric) is None:
            continue
        row = {"config": label(r), metric: r[metric]}
        for s in stocks:
            ref = by.get((key(r), s))
            if ref and ref[metric]:
                row[f"vs {s}"] = round(r[metric] / ref[metric], 2)
        out.append(row)
    return _table(out, ["config", metric] + [f"vs {s}" for s in stocks])


def prebuild(env: dict) -> None:
    """Build every CUDA extension module once, outside every engine's time: one
    process per module, side by side (an engine that needs a module which failed to
    build logs why and takes a Triton decoder)."""
    from vllm_lowrank.kernels.cuda.ext import MODULES

    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-P", "-c", "from vllm_lowrank.kernels.cuda "
                               f"import ext; ext.load({m!r})"], env=env) for m in MODULES]
    codes = [p.wait() for p in procs]
    print(f"CUDA extension modules {list(MODULES)} ready in {time.time() - t0:.0f} s "
          f"(exit codes {codes})", flush=True)


def _flashinfer_missing(name: str, env: dict) -> str | None:
    """Why config ``name`` (the FlashInfer backend) cannot start on the GPU recipe
    (``GPUVLLM_SITE`` set by ``.gpuvllm/env.sh``), or ``None``."""
    if not uses_flashinfer(name) or not env.get("GPUVLLM_SITE"):
        return None
    site = env.get("GPUVLLM_FLASHINFER_SITE", "")
    if not os.path.isdir(os.path.join(site, "flashinfer")):
        return ("no flashinfer-python: install .gpuvllm-flashinfer, then source "
                "/tmp/gpuvllm_flashinfer/env.sh (benchmarks/README.md, Stock FlashInfer)")
    backend = os.path.join(env["GPUVLLM_SITE"], "vllm/v1/attention/backends/flashinfer.py")
    if not os.path.exists(backend) or "gpuvllm patch" not in open(backend).read():
        return ("vLLM's FlashInfer backend calls compiled ops: rebuild .gpuvllm with "
                "benchmarks/prepare_gpuvllm.sh --flashinfer")
    return None


def engine_env(env: dict, name: str) -> dict:
    """The environment of config ``name``'s engine: its spec's ``env``; for the
    FlashInfer backend, ``$GPUVLLM_FLASHINFER_SITE`` after ``PYTHONPATH``, so only
    FlashInfer's engines see flashinfer-python (vLLM changes other paths when it is
    importable) and every other engine runs as it did before."""
    spec = CONFIGS[name]
    out = dict(env, **spec.get("env", {}))
    site = env.get("GPUVLLM_FLASHINFER_SITE")
    if uses_flashinfer(name) and site:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    return out


def report(rows: list[dict]) -> str:
    """The tables of ``rows`` (every engine's), after adding to each row its ratios
    to the fastest stock backend with a bf16 cache in ``rows`` (:func:`references`;
    per shape in the ``shapes`` mode) and that row's name (``ref``)."""
    out = []
    shape_rows = [r for r in rows if r["mode"] == "shapes"]
    if shape_rows:
        shape = lambda r: (r.get("batch"), r.get("context"))  # noqa: E731
        refs = references(shape_rows, "decode_ms", shape, lower_is_better=True)
        for r in shape_rows:
            ref = refs.get(shape(r))
            if ref and "decode_ms" in r:
                r["ref"] = ref["config"]
                r["decode_vs_stock"] = round(r["decode_ms"] / ref["decode_ms"], 2)
                r["prefill_vs_stock"] = round(r["prefill_s"] / ref["prefill_s"], 2)
        out.append("ratios vs the fastest stock backend (bf16 KV) at each shape: " + (", ".join(
            f"{b}x{c} {ref['config']}" for (b, c), ref in refs.items()) or "none ran"))
        out.append(_table(shape_rows, ["config", "tp", "path", "graphs", "startup_s", "batch",
                                       "context", "kv_tokens", "prefill_s", "prefill_vs_stock",
                                       "decode_ms", "decode_vs_stock", "ref", "drafted",
                                       "accepted", "error"]))
        out.append("decode step vs each stock row (lower: faster):")
        out.append(vs_each_stock(shape_rows, "decode_ms", shape,
                                 lambda r: f"{r['config']} {r.get('batch')}x{r.get('context')}"))
    load_rows = [r for r in rows if r["mode"] == "load"]
    if load_rows:
        ref = references(load_rows, "out_tok_s").get(None)
        for r in load_rows:
            if ref and "out_tok_s" in r:
                r["ref"] = ref["config"]
                r["tok_s_vs_stock"] = round(r["out_tok_s"] / ref["out_tok_s"], 2)
                r["fit_vs_stock"] = round(r["fit_seqs"] / max(1, ref["fit_seqs"]), 2)
                if r.get("queued_running") and ref.get("queued_running"):
                    r["queued_vs_stock"] = round(r["queued_running"] / ref["queued_running"], 2)
        out.append(f"ratios vs {ref['config'] if ref else 'none (no stock row ran)'} "
                   "(the fastest stock backend, bf16 KV)")
        out.append(_table(load_rows, ["config", "tp", "startup_s", "kv_gib", "kv_tokens",
                                      "fit_seqs",
                                      "fit_vs_stock", "peak_running", "mean_running",
                                      "queued_running", "queued_vs_stock", "preemptions",
                                      "steps", "mixed_steps", "mixed_s", "out_tok_s",
                                      "tok_s_vs_stock",
                                      "ref", "wall_s", "drafted", "accepted", "error"]))
        out.append("output tokens/s vs each stock row:")
        out.append(vs_each_stock(load_rows, "out_tok_s"))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b-shape",
                   help=f"a folder of the GPU recipe's models or one of {sorted(SHAPES)}")
    p.add_argument("--configs", default="stock,default,g1")
    p.add_argument("--shapes", default="1x4096,16x4096,64x4096,1x32768,8x32768")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--equal-memory", type=float, default=0.0,
                   help="GiB of KV cache per GPU for the equal-memory load (0: skip)")
    p.add_argument("--load-prompts", type=int, default=256)
    p.add_argument("--load-len", type=int, default=4096)
    p.add_argument("--load-out", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="vLLM's per-request prefill chunk (0: vLLM's default, or the "
                        "plugin's for token-adaptive settings)")
    p.add_argument("--watermark", type=float, default=None,
                   help="vLLM's --watermark (default: vLLM's, or what the plugin sets)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs per engine (vLLM's mp executor, NCCL all-reduce)")
    p.add_argument("--speculative", action="store_true",
                   help="n-gram speculative decoding (3 drafts) in every engine, over "
                        "prompts that repeat every 64 tokens")
    p.add_argument("--timeout", type=int, default=420, help="seconds per engine")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write each engine's stdout and stderr to DIR/<config>-<mode>.log")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile 4 prefill and 8 decode steps at the last shape; "
                        "kernel tables written to DIR/<config>.txt")
    p.add_argument("--no-prebuild", action="store_true",
                   help="do not build the CUDA extension first (no config takes the cuda path)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="shapes", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.profile and args.tensor_parallel_size > 1:
        p.error("--profile traces this process's GPU work: with --tensor-parallel-size > 1 "
                "the model runs in worker processes")
    os.environ.update(NO_MULTICAST)  # before any engine or subprocess starts
    global PERIOD
    PERIOD = 64 if args.speculative else 0
    if args.one:
        print("ROWS " + json.dumps(run_one(args)), flush=True)
        os._exit(0)  # vLLM's engine threads may otherwise delay the exit
    for name in args.configs.split(","):
        _spec(name)  # unknown names fail here, before any engine starts
    modes = ["shapes"] if args.shapes else []
    if args.equal_memory:
        modes.append("load")
    rows = []
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if not args.no_prebuild and any("compression" in _spec(n)
                                    for n in args.configs.split(",")):
        prebuild(env)
    for mode in modes:
        for name in args.configs.split(","):
            cmd = [sys.executable, "-P", __file__, *sys.argv[1:], "--one", name, "--mode", mode]
            t0 = time.time()
            missing = _flashinfer_missing(name, env)
            if missing:
                rows.append(dict(config=name, mode=mode, error=missing))
                print(json.dumps(rows[-1]), flush=True)
                continue
            try:
                res = subprocess.run(cmd, env=engine_env(env, name), capture_output=True,
                                     text=True, timeout=args.timeout)
                stdout, stderr = res.stdout, res.stderr
                out = [line for line in stdout.splitlines() if line.startswith("ROWS ")]
                if out:
                    got = json.loads(out[-1][5:])
                else:
                    tail = (stderr or stdout).strip().splitlines()[-3:]
                    got = [dict(config=name, error=" / ".join(tail)[-400:])]
            except subprocess.TimeoutExpired as exc:
                stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                                  for x in (exc.stdout, exc.stderr))
                jit = (" (FlashInfer JIT-compiles its kernels in a machine's first engine of "
                       "each KV dtype: about 165 s of start-up on an H200)"
                       if uses_flashinfer(name) else "")
                got = [dict(config=name, error=f"timeout after {args.timeout} s{jit}")]
            if args.log_dir:
                os.makedirs(args.log_dir, exist_ok=True)
                with open(os.path.join(args.log_dir, f"{name}-{mode}.log"), "w") as f:
                    f.write(stdout + "\n--- stderr ---\n" + stderr)
            # the decode kernel vLLM's FlashInfer backend resolved (its log line)
            fi = re.search(r"decode_backend=([\w-]+)", stdout + stderr)
            for r in got:
                r["mode"] = mode
                r["engine_s"] = round(time.time() - t0, 1)
                if fi and r.get("path") == "stock":
                    r["path"] = f"flashinfer {fi.group(1)}"
            rows += got
            print(json.dumps(got), flush=True)
            if args.json:  # after every engine: a later timeout keeps the rows so far
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(report(rows))
    if args.json:  # again, with the ratio columns
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
