"""Method x ratio accuracy table through vLLM, plus passkey retrieval.

For each basis method (artifacts calibrated once on the calibration split of
the Wikipedia (gensim excerpt) text and cached) and each ratio: perplexity from
vLLM's prompt log-probabilities on held-out text (odd-index Wikipedia articles
and BBC News, never used for calibration), and passkey retrieval (a 5-digit key
at 5 depths of a 4k-token held-out haystack, exact match). One engine per
setting, in a fresh subprocess; the uncompressed model first.

    .venv/bin/python -P benchmarks/accuracy.py                       # full table (hours on 2 cores)
    .venv/bin/python -P benchmarks/accuracy.py --methods fisher --ratios 0.5 --passkey-cases 20

Prints a markdown table; ``--json PATH`` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ALLOCATION = {"svd": "uniform", "whitened": "energy", "eigen": "energy", "kq": "energy",
              "post_rope": "energy", "fisher": "fisher"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=list(ALLOCATION))
    p.add_argument("--ratios", type=float, nargs="+", default=[0.75, 0.5])
    p.add_argument("--uniform", action="store_true",
                   help="also run every method with uniform ranks")
    p.add_argument("--texts", nargs="+", default=["wikipedia", "bbc"])
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens per text")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--passkey-cases", type=int, default=20)
    p.add_argument("--passkey-tokens", type=int, default=4096)
    p.add_argument("--calibration-tokens", type=int, default=16384)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.evaluation import run_setting
    from vllm_lowrank.calibration.cache import load_or_calibrate

    model = resolve_model(args.model)
    passkey = ({"num_cases": args.passkey_cases, "context_tokens": args.passkey_tokens}
               if args.passkey_cases else None)
    settings: list[tuple[str, dict | None]] = [("uncompressed", None)]
    for method in args.methods:
        group = {"head_group_size": 1} if method == "post_rope" else {}
        cfg = LowRankConfig(mode="lowrank", method=method,
                            calibration_tokens=args.calibration_tokens, **group)
        t0 = time.time()
        _, artifact = load_or_calibrate(model, cfg)
        print(f"artifact {method}: {artifact} ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
        allocations = [ALLOCATION[method]] + (["uniform"] if args.uniform and
                                              ALLOCATION[method] != "uniform" else [])
        for ratio in args.ratios:
            for alloc in allocations:
                settings.append((f"{method} / {alloc}", {
                    "mode": "lowrank", "rank_fraction": ratio, "artifact": artifact,
                    "method": method, "rank_allocation": alloc, **group}))
    rows, base = [], {}
    for name, comp in settings:
        t0 = time.time()
        r = run_setting({"model": model, "compression": comp, "texts": args.texts,
                         "num_windows": max(1, args.tokens // args.window),
                         "window": args.window, "passkey": passkey})
        r["name"], r["compression"], r["seconds"] = name, comp, time.time() - t0
        if comp is None:
            base = r
        rows.append(r)
        print(f"done {name} {comp and comp['ratio']}: "
              + " ".join(f"{t}={r[t]['ppl']:.3f}" for t in args.texts)
              + (f" passkey={r['passkey']['accuracy']:.2f}" if passkey else "")
              + f" ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print(f"\nAccuracy through vLLM ({model}, float32), {args.tokens} held-out tokens per "
          f"text in {args.window}-token windows; passkey: {args.passkey_cases} cases, "
          f"{args.passkey_tokens}-token haystack, depths 0.1..0.9")
    head = "| method / rank allocation | ratio | capacity x | " + " | ".join(
        f"{t} ppl (delta)" for t in args.texts) + (" | passkey |" if passkey else " |")
    print(head)
    print("|" + "---|" * (3 + len(args.texts) + (1 if passkey else 0)))
    for r in rows:
        ratio = "1.00" if r["compression"] is None else f"{r['compression']['ratio']:.2f}"
        cells = []
        for t in args.texts:
            ppl = r[t]["ppl"]
            delta = "" if r is base else f" ({100 * (ppl / base[t]['ppl'] - 1):+.1f}%)"
            cells.append(f"{ppl:.3f}{delta}")
        pk = f" {r['passkey']['accuracy']:.2f} |" if passkey else ""
        print(f"| {r['name']} | {ratio} | {r['kv_tokens'] / base['kv_tokens']:.2f} | "
              + " | ".join(cells) + f" |{pk}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    main()
