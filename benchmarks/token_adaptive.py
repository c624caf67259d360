"""Token-adaptive mode (TALE) against plain latents at equal bytes per token.

Generate-style protocol at a 4k context: every held-out window (and every
passkey prompt) advances ``--step`` tokens per engine step, side by side, so
each predicted token sees the cache as a generating request would (the sinks
and its most recent tokens exact in TALE mode, everything older as latents),
not its whole window in one prefill. Perplexity from vLLM's prompt
log-probabilities; passkey: a 5-digit key at 5 depths of a 4k held-out
haystack, exact match. One engine per setting, in a fresh subprocess.

Bytes per token (relative to the 16-bit K+V of the same token): the latent
slot, plus for TALE ``(sink + recent) / context`` full slots (the exact
tokens of one sequence of ``context`` tokens, sinks and window rounded up to
whole blocks). The plain setting at "equal bytes" gets the ratio that makes
its latent slot that large. "vLLM KV tokens" is vLLM's own capacity figure
(``max_concurrency x max_model_len``): in TALE mode it also reserves exact slots
for a whole prefill chunk per request (README, token-adaptive mode).

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python -P benchmarks/token_adaptive.py

Prints a markdown table; ``--json PATH`` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5])
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--recent", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size (vLLM's CPU attention needs a multiple of 32)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--texts", nargs="+", default=["wikipedia", "bbc"])
    p.add_argument("--step", type=int, default=32, help="tokens per request per step")
    p.add_argument("--passkey-cases", type=int, default=20)
    p.add_argument("--skip-plain", action="store_true",
                   help="only the equal-bytes plain setting, not the one at the same ratio")
    p.add_argument("--only", default=None,
                   help="only the settings whose name contains this (and the baseline)")
    p.add_argument("--json", default=None, help="write (and resume from) every number")
    args = p.parse_args()

    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.evaluation import run_setting
    from vllm_lowrank.format.exact import exact_tokens

    model = resolve_model(args.model)
    block = args.block_size
    exact = exact_tokens(LowRankConfig(token_adaptive=True, sink_tokens=args.sink,
                                       recent_tokens=args.recent), block)
    overhead = exact.count / args.context  # full slots per token, one sequence
    settings: list[tuple[str, dict | None, float]] = [("uncompressed", None, 1.0)]
    for r in args.ratios:
        settings.append((f"latent {r}", {"mode": "lowrank", "rank_fraction": r}, r))
        equal = round(r + overhead, 3)
        settings.append((f"latent {equal} (equal bytes)", {"mode": "lowrank", "ratio": equal},
                         equal))
        settings.append((f"TALE: latent {r} + sink {exact.sink} + recent {exact.recent}",
                         {"mode": "lowrank", "rank_fraction": r, "token_adaptive": True,
                          "sink_tokens": exact.sink, "recent_tokens": exact.recent}, r + overhead))
    passkey = ({"num_cases": args.passkey_cases, "context_tokens": args.context - 16}
               if args.passkey_cases else None)
    if args.only:
        settings = [s for s in settings if s[0] == "uncompressed" or args.only in s[0]]
    if args.skip_plain:
        settings = [s for s in settings if not s[0].startswith("latent ") or "equal" in s[0]]
    rows, results = [], {}
    if args.json and os.path.exists(args.json):  # resume: settings measured before
        with open(args.json) as f:
            results = json.load(f)
    for name, compression, nominal in settings:
        spec = {"model": model, "compression": compression, "texts": args.texts,
                "num_windows": args.windows, "window": args.context, "passkey": passkey,
                "block_size": block, "step_tokens": args.step}
        if name not in results:
            results[name] = run_setting(spec)
        elif passkey and "passkey" not in results[name]:  # resume: add the passkey row
            results[name]["passkey"] = run_setting({**spec, "texts": []})["passkey"]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        r = results[name]
        stored = r.get("stored_fraction")
        if stored is not None and compression and compression.get("token_adaptive"):
            stored += overhead
        rows.append((name, stored if stored is not None else nominal, r))
        print(f"done: {name}", flush=True)
    base = results["uncompressed"]
    print(f"\n{args.model}, {args.windows} x {args.context} held-out tokens per text, "
          f"{args.step} tokens per request per step, block size {block}\n")
    head = " | ".join(f"{t} ppl" for t in args.texts)
    print(f"| setting | bytes / token (vs 16-bit K+V) | vLLM KV tokens | {head} | passkey |")
    print("|---|---|---|" + "---|" * len(args.texts) + "---|")
    for name, stored, r in rows:
        cells = []
        for t in args.texts:
            ppl, ref = r[t]["ppl"], base[t]["ppl"]
            cells.append(f"{ppl:.3f}" + ("" if r is base else f" ({100 * (ppl / ref - 1):+.1f} %)"))
        pk = r.get("passkey")
        pk_cell = f"{pk['accuracy']:.2f} ({round(pk['accuracy'] * pk['cases'])}/{pk['cases']})" if pk else "-"
        print(f"| {name} | {stored:.3f} ({1 / stored:.2f}x) | {r['kv_tokens']:,} | "
              f"{' | '.join(cells)} | {pk_cell} |")


if __name__ == "__main__":
    main()
