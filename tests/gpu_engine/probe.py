"""One vLLM engine on the GPU machine, driven through the scenarios of the GPU
engine tests; prints one ``RESULT {json}`` line. Run as a subprocess (one
engine per process, so every engine starts on a free GPU)::

    python3 -P tests/gpu_engine/probe.py --model small-h128 --config '{"rank_fraction": 0.5}'

Scenarios (greedy, ``ignore_eos``): ``short`` (4 short prompts, one batch),
``mixed`` (10 prompts of 40..1,500 tokens at once: decode and chunked prefill
steps mixed, ``max_num_batched_tokens`` 512), ``hit`` (the longest prompt of
``mixed`` again: a prefix-cache hit). With ``--blocks N`` the cache holds only
``N`` blocks, so ``mixed`` preempts and recomputes. ``repeat`` (4 prompts
of a 50-token pattern repeated 10 times, 48 tokens each): with
``--speculative`` vLLM's n-gram proposer drafts 3 tokens per step from the
repeats, so its verify steps decode several query tokens per request.

``--tensor-parallel-size N``: the engine on ``N`` GPUs (vLLM's ``mp`` executor,
NCCL all-reduce, no NVLink multicast: ``gpu_serving.parallel_args``); the result
adds what every rank reports (``ranks``). ``--weights random``: a seeded random
checkpoint instead of vLLM's dummy weights, which are drawn per rank shard (a
TP=2 engine would serve another model than a TP=1 one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MODELS = {
    # a 2-layer model at the Llama-3-8B attention shape (32 q / 8 KV heads of 128):
    # the CUDA decode kernel's head_dim
    "small-h128": ("llama3-8b-shape", dict(num_hidden_layers=2, hidden_size=4096,
                                           intermediate_size=4096,
                                           max_position_embeddings=8192)),
    # SmolLM2-135M shape (9 q / 3 KV heads of 64): the Triton kernels
    "smollm2-shape": ("smollm2-135m-shape", dict(num_hidden_layers=4)),
}


def _gpu_serving():
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import gpu_serving

    return gpu_serving


def model_dir(name: str) -> str:
    """The GPU recipe's model folder for ``name`` with its overrides applied."""
    base, overrides = MODELS[name]
    return _gpu_serving().model_dir(base, **overrides)


def random_checkpoint(folder: str, seed: int = 0, std: float = 0.02) -> str:
    """A copy of the Llama model folder ``folder`` (config and tokenizer) with
    ``model.safetensors``: bf16 weights drawn from ``N(0, std^2)`` by a CPU
    generator seeded with ``seed`` (norm weights 1), written once (atomically:
    engines started side by side may race). Returns the copy's path."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    dst = f"{folder.rstrip('/')}-random{seed}"
    path = os.path.join(dst, "model.safetensors")
    if os.path.exists(path):
        return dst
    shutil.copytree(folder, dst, dirs_exist_ok=True)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * std).to(torch.bfloat16)

    def ones() -> torch.Tensor:  # a tensor per name: safetensors refuses shared storage
        return torch.ones(hidden, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones()}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(vocab, hidden)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({p + "input_layernorm.weight": ones(),
                  p + "post_attention_layernorm.weight": ones(),
                  p + "self_attn.q_proj.weight": w(q, hidden),
                  p + "self_attn.k_proj.weight": w(kv, hidden),
                  p + "self_attn.v_proj.weight": w(kv, hidden),
                  p + "self_attn.o_proj.weight": w(hidden, q),
                  p + "mlp.gate_proj.weight": w(inter, hidden),
                  p + "mlp.up_proj.weight": w(inter, hidden),
                  p + "mlp.down_proj.weight": w(hidden, inter)})
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(t, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return dst


def prompts(n: int, lengths, salt: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [(i * 7919 + j * 31 + salt) % 30000 + 100
                                  for j in range(lengths[i % len(lengths)])]}
            for i in range(n)]


def _worker_paths(worker) -> tuple[list[str], str]:
    """In a worker (``LLM.collective_rpc``): its latent layers' decoders as
    ``"name: description"`` and the CUDA graph mode it resolved."""
    cc = worker.vllm_config.compilation_config
    paths = sorted({f"{d.name}: {d.describe()}" for layer in cc.static_forward_context.values()
                    if (d := layer.__dict__.get("decoder")) is not None})
    return paths, str(cc.cudagraph_mode)


def engine_paths(llm) -> tuple[list[str], str]:
    """The decoders the latent layers took, over every worker, as ``"name:
    description"`` (:mod:`vllm_lowrank.attention.decoders`), and the CUDA graph
    mode vLLM resolved (the workers' modes joined by ``/`` if they differ)."""
    got = llm.collective_rpc(_worker_paths)
    return sorted({p for paths, _ in got for p in paths}), "/".join(sorted({m for _, m in got}))


SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
               "prompt_lookup_min": 2}


def repeated(n: int, period: int = 50, times: int = 10) -> list[dict]:
    return [{"prompt_token_ids": [(i * 104729 + j * 613) % 30000 + 100
                                  for j in range(period)] * times} for i in range(n)]


def greedy(llm, batch, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    out = []
    for o in llm.generate(batch, sp, use_tqdm=False):
        steps = [sorted((x.logprob for x in lp.values()), reverse=True)
                 for lp in o.outputs[0].logprobs]
        out.append({"tokens": list(o.outputs[0].token_ids),
                    "gaps": [s[0] - s[1] for s in steps],
                    "top": [s[0] for s in steps],
                    "finite": all(abs(v) < 1e30 for s in steps for v in s)})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small-h128")
    p.add_argument("--config", default="null", help="compression config JSON or null")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--blocks", type=int, default=None)
    p.add_argument("--speculative", action="store_true", help="n-gram speculative decoding")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=None, help="KV block size (vLLM's)")
    p.add_argument("--weights", choices=["dummy", "random"], default="dummy",
                   help="vLLM's dummy weights, or a seeded random checkpoint (the same "
                        "model at every tensor-parallel size)")
    args = p.parse_args()
    gpu_serving = _gpu_serving()
    os.environ.update(gpu_serving.NO_MULTICAST)  # the workers inherit it
    from vllm import LLM

    config = json.loads(args.config)
    folder = model_dir(args.model)
    if args.weights == "random":
        folder = random_checkpoint(folder)
    kw = dict(model=folder, load_format="dummy" if args.weights == "dummy" else "safetensors",
              dtype=args.dtype, seed=0,
              max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512,
              enable_prefix_caching=True, enable_chunked_prefill=True,
              kv_cache_memory_bytes=args.kv_bytes, kv_cache_dtype=args.kv_cache_dtype,
              # vLLM still checks free memory against this at start-up: keep it
              # low (the largest probe model, small-h128, holds about 3 GB of
              # weights beside its 1 GiB cache), so that several test engines
              # can share the GPU
              gpu_memory_utilization=0.1,
              attention_config={"backend": "TRITON_ATTN"}, disable_log_stats=False,
              **gpu_serving.recipe_engine_args(args.eager, (1, 2, 4, 8, 16)))
    kw.update(gpu_serving.parallel_args(args.tensor_parallel_size))
    if args.blocks:
        kw["num_gpu_blocks_override"] = args.blocks
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.speculative:
        kw["speculative_config"] = SPECULATION
    if config is not None:
        kw["additional_config"] = {"kv_compression": {"mode": "lowrank", "artifact": "none",
                                                      **config}}
    result = {"tp": args.tensor_parallel_size, "kv_bytes": args.kv_bytes}
    llm = None
    try:
        llm = LLM(**kw)
        from vllm_lowrank import metrics

        cc = llm.llm_engine.vllm_config.cache_config
        result["kv_tokens"] = metrics.kv_capacity_tokens(cc)  # per rank: each caches its heads
        result["num_gpu_blocks"] = cc.num_gpu_blocks
        states = metrics.read_states(os.environ.get(metrics.STATE_DIR_ENV, ""))
        state = metrics.aggregate(states)
        result["compression_ratio"] = state["compression_ratio"] if state else 1.0
        # what each rank caches per token (bytes of all its layers): none without compression
        result["ranks"] = sorted(({"tp": s["parallel"]["tp"],
                                   "stored_bytes_per_token": s["stored_bytes_per_token"],
                                   "original_bytes_per_token": s["original_bytes_per_token"]}
                                  for s in states if s.get("enabled")), key=lambda r: r["tp"])
        result["paths"], result["cudagraph_mode"] = engine_paths(llm)
        result["short"] = greedy(llm, prompts(4, [7, 12, 5, 20]), 16)
        lengths = [40, 1500, 300, 900, 75, 1200, 600, 150, 1000, 450]
        result["mixed"] = greedy(llm, prompts(10, lengths, salt=1), 24)
        result["hit"] = greedy(llm, [prompts(10, lengths, salt=1)[1]], 24)
        result["repeat"] = greedy(llm, repeated(4), 48)
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        result["prefix_hits"] = counters.get("vllm:prefix_cache_hits", 0)
        result["preemptions"] = counters.get("vllm:num_preemptions", 0)
        result["accepted"] = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
        result["drafted"] = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    except Exception as exc:  # noqa: BLE001 (the test reports it)
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
    if llm is not None and args.tensor_parallel_size > 1:
        try:  # the workers free their GPUs before os._exit
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 (the result is what matters)
            print(f"shutdown: {exc!r}", file=sys.stderr)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
