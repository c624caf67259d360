"""Passkey retrieval of the presets against the uncompressed model (issue 25).

A 5-digit key hidden at depths 0.1 / 0.3 / 0.5 / 0.7 / 0.9 of a held-out
Wikipedia haystack (:mod:`vllm_lowrank.passkey`), greedy decoding, exact match,
``--cases`` prompts per context length (cycling over the depths), through vLLM's
engine with the frontier's protocol: block size 32, prompts advancing
``--step`` tokens per engine step side by side (what a generating request's
cache sees, which the token-adaptive presets depend on). One engine per
setting and context, each in a fresh subprocess
(:func:`vllm_lowrank.evaluation.run_setting`); the uncompressed model runs in
the same invocation.

    VLLM_CPU_KVCACHE_SPACE=4 .venv/bin/python -P benchmarks/passkey.py \\
        --contexts 1024,2048 --cases 50

Prints one Markdown row per setting and context: accuracy, hits / cases, and
accuracy per depth.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vllm_lowrank.evaluation import run_setting  # noqa: E402
from vllm_lowrank.presets import PRESETS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--presets", default=",".join(PRESETS),
                   help="comma list of preset names (the uncompressed model always runs)")
    p.add_argument("--contexts", default="1024,2048", help="haystack lengths in tokens")
    p.add_argument("--cases", type=int, default=50)
    p.add_argument("--step", type=int, default=32, help="prompt tokens per engine step")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                   help="also a setting given as kv_compression keys (repeatable), e.g. "
                        "'mine={\"artifact\": \"/path/to/allocation\"}'")
    args = p.parse_args()

    from vllm_lowrank.cli import resolve_model

    model = resolve_model(args.model)
    settings = [("uncompressed", None)] + [
        (f"`{name}`", {"mode": "lowrank", "preset": name})
        for name in args.presets.split(",") if name] + [
        (c[:c.index("={")], {"mode": "lowrank", **json.loads(c[c.index("={") + 1:])})
        for c in args.config]
    rows = []
    print("| setting | context | passkey | hits | by depth (0.1 / 0.3 / 0.5 / 0.7 / 0.9) |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        for name, compression in settings:
            res = run_setting({
                "model": model, "compression": compression, "texts": [], "num_windows": 1,
                "window": context, "block_size": args.block_size, "step_tokens": args.step,
                "passkey": {"num_cases": args.cases, "context_tokens": context}})
            pk = res["passkey"]
            hits = round(pk["accuracy"] * pk["cases"])
            depths = " / ".join(f"{v:.2f}" for v in pk["by_depth"].values())
            print(f"| {name} | {context} | {pk['accuracy']:.2f} | {hits}/{pk['cases']} | "
                  f"{depths} |", flush=True)
            rows.append({"setting": name, "context": context, **pk})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
