"""CPU decode throughput, compression off vs on, measured side by side.

Batch of ``--batch`` requests with ``--prompt-tokens``-token prompts (held-out
real text), greedy, ``--decode-tokens`` new tokens each. Decode tokens/s =
batch x decode_tokens / (time(prompt + decode) - time(prompt only)), each
setting in its own engine (fresh subprocess), same prompts, prefix caching
off, ``VLLM_CPU_KVCACHE_SPACE`` 2 GiB unless set. Prints a markdown table.

    .venv/bin/python -P benchmarks/throughput.py            # off vs ratio 0.5
    .venv/bin/python -P benchmarks/throughput.py --ratios 0.5 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r'''
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_lowrank.evaluation import eval_windows
from vllm_lowrank.metrics import kv_capacity_tokens

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    kw = dict(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=spec["prompt_tokens"] + spec["decode_tokens"] + 8,
              enable_prefix_caching=False, max_num_seqs=spec["batch"], seed=0)
    if spec["compression"]:
        kw["additional_config"] = {"kv_compression": spec["compression"]}
    llm = LLM(**kw)
    windows = eval_windows(llm.get_tokenizer(), "bbc", 3 * spec["batch"], spec["prompt_tokens"])
    def run(prompts, n):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t
    b = spec["batch"]
    run(windows[:b], 2)  # warm-up (first shapes are slow on CPU)
    prefill = run(windows[b:2 * b], 1)
    full = run(windows[2 * b:], 1 + spec["decode_tokens"])
    cc = llm.llm_engine.vllm_config.cache_config
    print("RESULT " + json.dumps({"prefill_s": prefill, "full_s": full,
          "kv_tokens": kv_capacity_tokens(cc)}))
'''


def measure(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    try:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        proc = subprocess.run([sys.executable, "-P", f.name, json.dumps(spec)],
                              capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(proc.stderr[-3000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    from vllm_lowrank.cli import resolve_model

    model = resolve_model(args.model)
    rows = []
    for ratio in [None, *args.ratios]:
        comp = None if ratio is None else {"mode": "lowrank", "rank_fraction": ratio}
        r = measure({"model": model, "compression": comp, "batch": args.batch,
                     "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "dtype": args.dtype})
        decode_s = r["full_s"] - r["prefill_s"]
        rows.append(("off" if ratio is None else f"lowrank ratio {ratio}", r["kv_tokens"],
                     args.batch * args.prompt_tokens / r["prefill_s"],
                     args.batch * args.decode_tokens / decode_s))
        print(f"done {rows[-1]}", file=sys.stderr, flush=True)
    base = rows[0][3]
    print(f"\nCPU decode throughput: batch {args.batch}, {args.prompt_tokens}-token prompts, "
          f"{args.decode_tokens} decode tokens, dtype {args.dtype}, {os.cpu_count()} cores")
    print("| setting | KV capacity (tokens) | prefill tok/s | decode tok/s | decode vs off |")
    print("|---|---|---|---|---|")
    for name, cap, pre, dec in rows:
        print(f"| {name} | {cap:,} | {pre:.0f} | {dec:.1f} | {dec / base:.2f}x |")


if __name__ == "__main__":
    main()
