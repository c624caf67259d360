"""Task accuracy through the running server with lm-evaluation-harness.

The recipe a user follows to check a compressed cache on their own task:
serve the model with the plugin, point lm-evaluation-harness's
``local-completions`` model at the server's ``/v1/completions``, and give it a
task read from a local file. This script does it for the name cloze of
:mod:`vllm_lowrank.cloze` (held-out BBC News: complete a name that appeared
earlier in the article; greedy generation, first word exact match):

1. lm-evaluation-harness (:data:`LM_EVAL_VERSION`) in its own virtualenv
   (``.venv-lmeval``, default; its pins may conflict with vLLM's), installed
   once;
2. the items as JSONL and the task as YAML (:data:`TASK_YAML`) in an output
   folder (``--include_path`` of lm-eval);
3. per setting: ``vllm serve`` with that setting, then ``lm_eval --model
   local-completions --tasks lowrank_name_cloze``; the table gives each
   setting's accuracy, its standard error, and the items on which it differs
   from the uncompressed server (paired).

Usage (the embedded model, CPU, float32)::

    .venv/bin/python -P benchmarks/lm_eval_cloze.py --items 200 \\
        --settings off 2x lossless 4x 8x

With a server already running (``--url http://HOST:PORT/v1 --served-name NAME``)
only that server is evaluated.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

from vllm_lowrank.presets import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM_EVAL_VERSION = "0.4.13"
"""lm-evaluation-harness release the recipe is tested with."""
TASK = "lowrank_name_cloze"
TASK_YAML = """\
task: lowrank_name_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", ".", ","]
  max_gen_toks: 8
  temperature: 0.0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "^\\\\s*([A-Za-z][A-Za-z-]*)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
"""The lm-eval task (``{data}``: the JSONL path). The regex filter is
:func:`vllm_lowrank.cloze.first_word`. Three stop strings: vLLM's API takes
at most four, and lm-eval may add the EOS text."""
SETTINGS = {"off": [], **{name: ["--kv-compression", "lowrank", "--kv-compression-config",
                                  json.dumps({"preset": name})] for name in PRESETS}}
"""``vllm serve`` arguments of each setting: none, or one preset
(:data:`vllm_lowrank.presets.PRESETS`; ``2x`` is the default)."""


def ensure_lm_eval(venv: str) -> str:
    """The ``lm_eval`` executable of ``venv``, created and installed
    (``lm_eval==LM_EVAL_VERSION`` from the package index) if it is missing or
    holds another version.

    Raises:
        RuntimeError: the install failed (pip's output tail attached).
    """
    exe = os.path.join(venv, "bin", "lm_eval")
    py = os.path.join(venv, "bin", "python")
    probe = [py, "-c", "import sys; from importlib.metadata import version; "
             f"import tenacity, aiohttp; sys.exit(version('lm_eval') != '{LM_EVAL_VERSION}')"]
    if os.path.exists(exe) and subprocess.run(probe, capture_output=True).returncode == 0:
        return exe
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    r = subprocess.run([py, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        f"lm_eval[api]=={LM_EVAL_VERSION}"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"installing lm_eval=={LM_EVAL_VERSION} into {venv} failed:\n"
                           + (r.stdout + r.stderr)[-3000:])
    return exe


def write_task(folder: str, items: list[dict]) -> str:
    """Write ``items`` (JSONL) and the task YAML into ``folder``; returns it
    (lm-eval's ``--include_path``)."""
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "name_cloze.jsonl")
    with open(data, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    with open(os.path.join(folder, TASK + ".yaml"), "w") as f:
        f.write(TASK_YAML.format(data=json.dumps(data)))
    return folder


def run_lm_eval(lm_eval: str, include: str, base_url: str, served_name: str, out: str,
                *, limit: int | None = None, concurrent: int = 2) -> dict:
    """``lm_eval --model local-completions`` on the task against
    ``base_url`` (``http://HOST:PORT/v1``), samples logged.

    Returns:
        ``{"acc", "stderr", "samples"}``: lm-eval's exact match and its
        standard error, and per item ``{"doc", "resp", "filtered", "match"}``
        in item order.

    Raises:
        RuntimeError: lm_eval failed (its output tail attached).
    """
    args = [lm_eval, "--model", "local-completions", "--model_args",
            f"base_url={base_url}/completions,model={served_name},tokenized_requests=False,"
            f"tokenizer_backend=None,num_concurrent={concurrent},max_retries=2,timeout=900",
            "--tasks", TASK, "--include_path", include, "--output_path", out,
            "--log_samples", "--batch_size", "1"]
    if limit:
        args += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": os.path.join(out, "hf-datasets")}
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError("lm_eval failed:\n" + (r.stdout + r.stderr)[-4000:])
    results = json.load(open(sorted(glob.glob(f"{out}/**/results_*.json", recursive=True))[-1]))
    res = results["results"][TASK]
    samples = []
    path = sorted(glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True))[-1]
    with open(path) as f:
        for line in f:
            s = json.loads(line)
            samples.append({"doc_id": s["doc_id"], "doc": s["doc"], "resp": s["resps"][0][0],
                            "filtered": s["filtered_resps"][0],
                            "match": float(s["exact_match"])})
    samples.sort(key=lambda s: s["doc_id"])
    return {"acc": res["exact_match,first_word"],
            "stderr": res.get("exact_match_stderr,first_word"), "samples": samples}


def _serve(model: str, setting: str, log_dir: str):
    from vllm_lowrank.local_server import LocalServer

    # a fixed KV cache size: vLLM's CPU worker otherwise wants 92 % of the
    # machine's memory free at start-up
    server = LocalServer(model, ["--served-model-name", "m", "--dtype", "float32",
                                 "--max-model-len", "2048", "--kv-cache-memory-bytes", "2G",
                                 *SETTINGS[setting]], log_dir=log_dir, name=setting,
                         env={k: v for k, v in os.environ.items()
                              if k != "VLLM_CPU_KVCACHE_SPACE"})  # it would override
    server.wait_ready(1800)
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="folder or embedded alias")
    p.add_argument("--settings", nargs="+", default=["off", "2x"], choices=sorted(SETTINGS))
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--context-words", type=int, default=600)
    p.add_argument("--url", default=None, help="evaluate this running server (…/v1) only")
    p.add_argument("--served-name", default="m")
    p.add_argument("--venv", default=os.path.join(ROOT, ".venv-lmeval"))
    p.add_argument("--out", default=None, help="folder for data, logs, lm-eval output")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    from vllm_lowrank.calibration.text import bbc_news
    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.cloze import name_cloze_items

    out = args.out or tempfile.mkdtemp(prefix="lm_eval_cloze-")
    docs = list(bbc_news())
    items = name_cloze_items(docs[:len(docs) // 2], args.items,
                             context_words=args.context_words)
    include = write_task(os.path.join(out, "task"), items)
    lm_eval = ensure_lm_eval(args.venv)
    print(f"{len(items)} items, lm_eval {LM_EVAL_VERSION}, output in {out}", flush=True)
    rows = {}
    if args.url:
        rows["server"] = run_lm_eval(lm_eval, include, args.url, args.served_name,
                                     os.path.join(out, "server"))
    else:
        model = resolve_model(args.model)
        for setting in args.settings:
            server = _serve(model, setting, out)
            try:
                rows[setting] = run_lm_eval(lm_eval, include, server.url + "/v1", "m",
                                            os.path.join(out, setting))
            finally:
                server.stop()
            print(f"{setting}: {rows[setting]['acc']:.3f}", flush=True)
    base = rows.get("off")
    print(f"\n| setting | name cloze (n={len(items)}) | +/- | differs from off "
          "(right / wrong) |\n|---|---|---|---|")
    for name, r in rows.items():
        diff = ""
        if base is not None and name != "off":
            pairs = list(zip(base["samples"], r["samples"]))
            gain = sum(b["match"] < x["match"] for b, x in pairs)
            loss = sum(b["match"] > x["match"] for b, x in pairs)
            diff = f"{gain} / {loss}"
        se = r["stderr"] if isinstance(r["stderr"], float) else \
            math.sqrt(r["acc"] * (1 - r["acc"]) / len(items))
        print(f"| {name} | {r['acc']:.3f} | {se:.3f} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {"acc": v["acc"], "stderr": v["stderr"]} for k, v in rows.items()},
                      f, indent=1)


if __name__ == "__main__":
    main()
