"""Perplexity of real weights through the GPU decoders against the CPU path, on
the same held-out windows: does a setting lose the same on a GPU as on the CPU
where its accuracy was measured?

Protocol: teacher-forced decode. The windows of every domain advance side by
side one token per engine step (vLLM's ``long_prefill_token_threshold`` of 1,
:func:`vllm_lowrank.evaluation.engine_kwargs`), so every token after a
window's first is scored by a step in which its request is a decode (one query
token): the layer's decoder (``decode_layers`` in the rows), with the sinks and
recent tokens exact and the rest read from latents, as a generating request
sees its cache. Both columns run the same dtype (default bf16, what the CUDA
decoders serve); each row also gives its change against stock on its own device.

The GPU machine has no model hub, no text, and maybe not the ``gguf`` and
``accelerate`` packages that ``transformers`` needs to read a GGUF; a call carries at
most 64 MiB. So the CPU packs the embedded model's GGUF in parts, the token windows
and those two packages (:data:`CONVERT_PACKAGES`); the GPU joins and converts them::

    # here (CPU): pack, the artifacts, then the CPU column
    .venv/bin/python -P benchmarks/gpu_perplexity.py pack gpurun/ppl
    .venv/bin/python -P benchmarks/gpu_perplexity.py calibrate gpurun/ppl/artifacts --configs 8x
    .venv/bin/python -P benchmarks/gpu_perplexity.py run --model smollm2-135m --windows gpurun/ppl/windows.json \
        --configs stock,2x,4x,lossless,8x --artifact-dir gpurun/ppl/artifacts --json gpurun/ppl/cpu.json
    # GPU machine: one call per part and per artifact, each copying what it carried
    # to /tmp/ppl (a path carried in one call is gone in the next; /tmp stays while
    # the machine is warm), e.g. carry [".../part-00"]: mkdir -p /tmp/ppl && cp -a gpurun/ppl/*.part-* /tmp/ppl/
    # then carry [".gpuvllm", "gpurun/ppl/windows.json", "gpurun/ppl/site"]:
    source .gpuvllm/env.sh && cp -a gpurun/ppl/windows.json gpurun/ppl/site /tmp/ppl/ && \
      python3 -P benchmarks/gpu_perplexity.py convert /tmp/ppl /tmp/smollm2 && \
      python3 -P benchmarks/gpu_perplexity.py run --model /tmp/smollm2 --windows /tmp/ppl/windows.json \
        --configs stock,2x,4x --artifact-dir /tmp/ppl/artifacts --json $OUT/gpu.json
    # either machine
    python -P benchmarks/gpu_perplexity.py compare gpurun/ppl/cpu.json gpu.json

Configs are preset names (``2x``, ``4x``, ``lossless``, ``8x``), ``stock``, or a
``--kv-compression-config`` JSON object. Settings that read a calibration
artifact (``8x``, J-LRD latents) on the GPU need it carried: ``--artifact-dir``.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import sys
import tempfile

PART_MIB = 47
"""Largest GGUF part, so that one call carries a part beside the work tree."""

CONVERT_PACKAGES = ("gguf", "accelerate")
"""Pure-Python packages ``transformers`` needs to dequantize a GGUF (the ``data``
extra's), packed into ``site/`` for ``convert``."""


def split_file(path: str, out_dir: str, part_bytes: int) -> dict:
    """Write ``path`` to ``out_dir`` as ``NAME.part-NN`` files of at most
    ``part_bytes`` bytes; returns the manifest (name, size, BLAKE2b digest, parts)."""
    from vllm_lowrank.embedded import file_digest

    name = os.path.basename(path)
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            part = f"{name}.part-{len(parts):02d}"
            with open(os.path.join(out_dir, part), "wb") as g:
                g.write(chunk)
            parts.append(part)
    return {"name": name, "bytes": os.path.getsize(path), "blake2b": file_digest(path),
            "parts": parts}


def join_file(manifest: dict, folder: str, out_path: str) -> str:
    """Join the parts of ``manifest`` (from :func:`split_file`) found in
    ``folder`` into ``out_path``.

    Raises:
        FileNotFoundError: a part is missing (not carried yet).
        ValueError: the joined file's size or digest differs from the manifest's.
    """
    from vllm_lowrank.embedded import file_digest

    with open(out_path, "wb") as g:
        for part in manifest["parts"]:
            with open(os.path.join(folder, part), "rb") as f:
                shutil.copyfileobj(f, g)
    if (os.path.getsize(out_path) != manifest["bytes"]
            or file_digest(out_path) != manifest["blake2b"]):
        raise ValueError(f"{out_path}: joined parts differ from the packed file "
                         f"(blake2b {manifest['blake2b'][:12]}...): re-carry the parts")
    return out_path


def compression_of(config: str, artifact_dir: str | None) -> dict | None:
    """The ``kv_compression`` dict of a ``--configs`` entry (``None``: stock).
    A preset with a folder ``artifact_dir/NAME`` reads that artifact; an
    allocation preset's (``8x``, which refuses ``artifact`` beside ``preset``)
    is served as an artifact of ``vllm-lowrank allocate``: on its own, since it
    fixes ranks, bits and the serving settings it was allocated for, and the
    engine gives it the KV block size it was allocated at
    (:func:`vllm_lowrank.calibration.allocate.allocated_block_size`), as a preset gets its own."""
    if config == "stock":
        return None
    if config.startswith("{"):
        return {"mode": "lowrank", **json.loads(config)}
    out = {"mode": "lowrank", "preset": config}
    path = os.path.join(artifact_dir, config) if artifact_dir else None
    if path and os.path.isdir(path):
        from vllm_lowrank.presets import get_preset

        if get_preset(config).allocate:
            return {"mode": "lowrank", "artifact": path}
        out["artifact"] = path
    return out


def domain_nll(outputs, windows: dict[str, list[list[int]]]) -> dict[str, dict]:
    """Negative log-likelihood, token count and perplexity per domain from
    vLLM outputs with ``prompt_logprobs`` (one per window, in the order of
    ``windows``' domains and windows)."""
    from vllm_lowrank.evaluation import nll_summary

    rows, i = {}, 0
    for domain, ws in windows.items():
        rows[domain] = nll_summary(zip(ws, outputs[i:i + len(ws)]))
        i += len(ws)
    return rows


def _worker(spec: dict) -> dict:
    """One engine (run in a fresh process): every window side by side."""
    import time

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_lowrank import metrics
    from vllm_lowrank.evaluation import engine_kwargs

    windows = spec["windows"]
    flat = [w for ws in windows.values() for w in ws]
    kw = engine_kwargs({"model": spec["model"], "dtype": spec["dtype"],
                        "window": max(len(w) for w in flat), "num_windows": len(flat),
                        "step_tokens": 1, "compression": spec["compression"]})
    kw["max_num_seqs"] = len(flat)
    if torch.cuda.is_available():
        from gpu_serving import recipe_engine_args

        kw.update(recipe_engine_args(False, (1, 2, 4, 8, len(flat))),
                  attention_config={"backend": "TRITON_ATTN"},
                  gpu_memory_utilization=spec["gpu_memory_utilization"])
    t0 = time.time()
    llm = LLM(**kw)
    t1 = time.time()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in flat], params,
                        use_tqdm=False)
    row = {"domains": domain_nll(outs, windows), "seconds": time.time() - t0,
           "startup_s": round(t1 - t0, 1), "run_s": round(time.time() - t1, 1),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    view = metrics.aggregate(metrics.read_states(os.environ.get(metrics.STATE_DIR_ENV, "")))
    if view:  # layers per decoder, as the engine chose them
        row["decode_layers"] = view["decode_layers"]
    del llm  # shuts the engine's processes down before this one exits
    gc.collect()
    return row


def run(args) -> None:
    """Every config in its own process; rows to ``--json``."""
    from vllm_lowrank.embedded import MODELS, prepare
    from vllm_lowrank.evaluation import in_subprocess

    model = prepare(args.model) if args.model in MODELS else args.model
    with open(args.windows) as f:
        windows = json.load(f)["windows"]
    rows = []
    for config in args.configs.split(","):
        spec = {"model": model, "dtype": args.dtype, "windows": windows,
                "compression": compression_of(config, args.artifact_dir),
                "gpu_memory_utilization": args.gpu_memory_utilization}
        try:
            result = in_subprocess("gpu_perplexity:_worker", spec, what=config,
                                   path=os.path.dirname(os.path.abspath(__file__)),
                                   timeout=args.timeout)
        except RuntimeError as e:
            rows.append({"config": config, "error": str(e)})
            print(e, flush=True)
            continue
        row = {"config": config, "compression": spec["compression"], "dtype": args.dtype,
               **result}
        rows.append(row)
        print(config, {d: round(v["ppl"], 4) for d, v in row["domains"].items()},
              row.get("decode_layers"),
              f"{row['seconds']:.0f} s (start-up {row['startup_s']:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def compare(a_path: str, b_path: str) -> str:
    """Markdown table of two ``run`` JSON files (A: CPU, B: GPU): perplexity on
    each, B against A, and each row's change against stock on its own device."""
    a = {r["config"]: r for r in json.load(open(a_path)) if "domains" in r}
    b = {r["config"]: r for r in json.load(open(b_path)) if "domains" in r}
    lines = ["| config | domain | A decoders | B decoders | A ppl | B ppl | B vs A "
             "| A vs stock | B vs stock |", "|---|---|---|---|---|---|---|---|---|"]
    for config in [c for c in a if c in b]:
        for domain, ra in a[config]["domains"].items():
            rb = b[config]["domains"][domain]
            cells = [config, domain, _names(a[config]), _names(b[config]),
                     f"{ra['ppl']:.4f}", f"{rb['ppl']:.4f}",
                     f"{100 * (rb['ppl'] / ra['ppl'] - 1):+.2f} %"]
            for side in (a, b):
                stock = side.get("stock", {}).get("domains", {}).get(domain)
                own = side[config]["domains"][domain]
                cells.append(f"{100 * (own['ppl'] / stock['ppl'] - 1):+.2f} %" if stock
                             else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _names(row: dict) -> str:
    layers = row.get("decode_layers") or {}
    return "/".join(sorted(layers)) or "stock"


def pack(args) -> None:
    """The GGUF in parts, the token windows and :data:`CONVERT_PACKAGES`, in ``out``."""
    import importlib

    from transformers import AutoTokenizer

    from vllm_lowrank.embedded import MODELS, gguf_path, prepare
    from vllm_lowrank.evaluation import eval_windows

    os.makedirs(args.out, exist_ok=True)
    model = MODELS[args.model]
    with tempfile.TemporaryDirectory() as work:
        manifest = split_file(gguf_path(model, work), args.out, PART_MIB << 20)
    tok = AutoTokenizer.from_pretrained(prepare(args.model))
    windows = {d: eval_windows(tok, d, args.num_windows, args.window)
               for d in args.domains.split(",")}
    with open(os.path.join(args.out, "windows.json"), "w") as f:
        json.dump({"model": args.model, "gguf": manifest, "add_bos": model.add_bos,
                   "windows": windows}, f)
    site = os.path.join(args.out, "site")
    shutil.rmtree(site, ignore_errors=True)
    for name in CONVERT_PACKAGES:
        package = os.path.dirname(importlib.import_module(name).__file__)
        # with its dist-info: transformers reads the version from the metadata
        # (no metadata: "N/A", which packaging refuses as a version)
        for path in [package, *glob.glob(os.path.join(os.path.dirname(package),
                                                      f"{name}-*.dist-info"))]:
            shutil.copytree(path, os.path.join(site, os.path.basename(path)),
                            ignore=shutil.ignore_patterns("__pycache__"))
    print(f"{args.out}: {len(manifest['parts'])} parts of <= {PART_MIB} MiB "
          f"({manifest['bytes'] >> 20} MiB), {sum(map(len, windows.values()))} windows "
          f"of {args.window} tokens, packages {', '.join(CONVERT_PACKAGES)}")


def calibrate(args) -> None:
    """The calibration artifact of each preset in ``--configs`` (from the
    cache, else calibrated on this machine as ``artifact: "auto"`` does), copied to
    ``out/NAME`` for ``run --artifact-dir``: both columns then read the same bases
    (for an allocation preset such as ``8x``, its allocated artifact at the
    preset's block size, as the engine computes it on first start)."""
    from vllm_lowrank.calibration.cache import load_or_allocate, load_or_calibrate
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.embedded import MODELS, prepare
    from vllm_lowrank.presets import get_preset

    model = prepare(args.model) if args.model in MODELS else args.model
    for name in args.configs.split(","):
        cfg = LowRankConfig.from_dict({"mode": "lowrank", "preset": name})
        base, path = load_or_calibrate(model, cfg)
        preset = get_preset(name)
        if preset.allocate:  # the allocation the engine computes at the preset's block size
            _, path = load_or_allocate(model, cfg, base, path, preset.block_size)
        shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
        shutil.copytree(path, os.path.join(args.out, name))
        print(f"{args.out}/{name}: {cfg.method} bases of {path}", flush=True)


def convert(packed: str, out_dir: str) -> None:
    """Join the packed GGUF and convert it to a bf16 folder in ``out_dir``."""
    sys.path.append(os.path.join(packed, "site"))  # CONVERT_PACKAGES, if the machine lacks them
    from vllm_lowrank.embedded import convert_gguf

    with open(os.path.join(packed, "windows.json")) as f:
        meta = json.load(f)
    with tempfile.TemporaryDirectory() as work:
        path = join_file(meta["gguf"], packed, os.path.join(work, meta["gguf"]["name"]))
        convert_gguf(path, out_dir, add_bos=meta["add_bos"])
    print(f"{out_dir}: {meta['model']} converted", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="the GGUF in parts, windows and packages (CPU)")
    a.add_argument("out")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--domains", default="wikipedia,bbc,shakespeare,code")
    a.add_argument("--num-windows", type=int, default=1)
    a.add_argument("--window", type=int, default=1024)
    k = sub.add_parser("calibrate", help="presets' calibration artifacts for --artifact-dir")
    k.add_argument("out")
    k.add_argument("--model", default="smollm2-135m")
    k.add_argument("--configs", default="8x")
    c = sub.add_parser("convert", help="join and convert the packed GGUF (GPU machine)")
    c.add_argument("packed")
    c.add_argument("out")
    r = sub.add_parser("run", help="perplexity per config on this machine's device")
    r.add_argument("--model", required=True, help="embedded model name or HF folder")
    r.add_argument("--windows", required=True)
    r.add_argument("--configs", default="stock,2x,4x")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--artifact-dir", default=None)
    r.add_argument("--timeout", type=int, default=1800, help="seconds per engine")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="each engine's share of GPU memory (several runs may share a GPU)")
    r.add_argument("--json", default=None)
    m = sub.add_parser("compare", help="table of a CPU and a GPU run")
    m.add_argument("a")
    m.add_argument("b")
    args = p.parse_args()
    if args.cmd == "pack":
        pack(args)
    elif args.cmd == "calibrate":
        calibrate(args)
    elif args.cmd == "convert":
        convert(args.packed, args.out)
    elif args.cmd == "run":
        run(args)
    else:
        print(compare(args.a, args.b))


if __name__ == "__main__":
    main()
