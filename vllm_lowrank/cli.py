"""``vllm-lowrank`` command line: model preparation, calibration, perplexity.

Subcommands:

- ``prepare-model [NAME]``: convert an embedded model once, print its folder.
- ``calibrate MODEL --output DIR``: write a calibration artifact.
- ``allocate MODEL --output DIR (--compression X | --bytes-per-token N | --ppl-increase P)``:
  byte-budget allocation of ranks and bits, written as an artifact
  (:mod:`vllm_lowrank.calibration.allocate`).
- ``perplexity MODEL --config JSON [--config JSON ...]``: baseline and compressed
  perplexity through vLLM on held-out real text, as a table.
- ``inspect ARTIFACT [--json]``: what an artifact holds (model, method,
  calibration, per-layer ranks and bits, serving settings, bytes per token).

``MODEL`` is a Hugging Face folder or an embedded model alias
(``smollm2-135m``, ``gemma3-270m``). Every subcommand checks its numbers (in
argparse) and its paths (:func:`check_model`, :func:`check_output`) before it
loads or converts anything; bad input prints one ``vllm-lowrank: error:`` line
and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from vllm_lowrank.config import (
    LOSS_METHODS,
    MAX_CALIBRATION_TOKENS,
    MAX_TOKENS,
    METHODS,
    STORAGE_BITS,
    LowRankConfig,
    LowRankConfigError,
    parse_config_text,
)

MAX_KV_HEADS = 1024
"""Largest ``--head-group-size`` / ``--tensor-parallel-size`` accepted."""
MAX_BLOCK_SIZE = 1 << 16
"""Largest KV block size accepted (vLLM's are 16 to 256 tokens)."""
MAX_RATIO = 1000.0
"""Largest ``allocate --compression`` accepted."""
MAX_BYTES = float(1 << 40)
"""Largest ``allocate --bytes-per-token`` accepted."""
MAX_GIB = float(1 << 20)
"""Largest ``estimate --kv-cache-gib`` accepted (1 PiB)."""


def resolve_model(arg: str) -> str:
    """A model folder from a path or an embedded alias (converted on demand)."""
    from vllm_lowrank import embedded

    if arg in embedded.MODELS:
        return embedded.prepare(arg)
    return arg


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model(arg: str) -> None:
    """``MODEL`` of a subcommand, checked without loading weights: an embedded
    alias, a folder whose ``config.json`` transformers reads, or (not a local
    path) a Hugging Face Hub id whose config can be fetched.

    Raises:
        LowRankConfigError: none of these (a missing path, a file, a folder
            without a readable ``config.json``), naming the fix.
    """
    from vllm_lowrank import embedded
    from vllm_lowrank.inputs import MAX_CONFIG_BYTES, check_directory, check_regular_file

    if arg in embedded.MODELS:
        return
    fix = (f"give a Hugging Face model folder (with config.json) or an embedded model "
           f"({', '.join(sorted(embedded.MODELS))})")
    if os.path.lexists(arg) or not _HUB_ID.fullmatch(arg):
        check_directory(arg, "model", fix)
        check_regular_file(os.path.join(arg, "config.json"), "model config", MAX_CONFIG_BYTES)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(arg)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())
        raise LowRankConfigError(f"model {arg!r} cannot be read: {reason[:300]}; {fix}") from None


def text_config(path: str):
    """The text model's Hugging Face config of the model folder ``path`` (a
    multimodal checkpoint's ``text_config``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config()


def check_output(path: str) -> None:
    """``--output`` of ``calibrate``/``allocate``: a new directory, an empty
    one, or an artifact to replace, in a folder that can be written (the
    artifact is written beside it, then renamed).

    Raises:
        LowRankConfigError: a file, a directory holding other files (writing
            would delete them), or a folder that cannot be written.
    """
    from vllm_lowrank.calibration.artifact import MANIFEST
    from vllm_lowrank.inputs import check_directory, check_writable_directory

    if os.path.lexists(path):
        check_directory(path, "--output")
        if os.listdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
            raise LowRankConfigError(
                f"--output {path!r} is a directory with other files in it, not an artifact; "
                "writing the artifact would replace it: give a new directory")
    check_writable_directory(os.path.dirname(os.path.abspath(path)), "the folder of --output")


def _number(kind: type, low: float, high: float, *, above: bool = False):
    """An argparse ``type``: a finite ``kind`` (``int`` or ``float``) at least
    ``low`` (more than it with ``above``) and at most ``high``; anything else
    is one ``vllm-lowrank: error:`` line naming the flag and the range."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low)
                and value <= high):
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: give {'more than' if above else 'at least'} "
                f"{low:g} and at most {high:g}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``vllm-lowrank: error:`` line
    (exit status 2), like every other refusal of the command line."""

    def error(self, message: str):
        print(f"vllm-lowrank: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _prepare(args) -> None:
    from vllm_lowrank import embedded
    from vllm_lowrank.inputs import check_writable_directory

    if args.cache_dir is not None:
        check_writable_directory(args.cache_dir, "--cache-dir")
    path = embedded.prepare(args.name, args.cache_dir)
    if args.calibrate:
        from vllm_lowrank.calibration.cache import load_or_calibrate

        cfg = LowRankConfig(mode="lowrank")
        _, artifact_path = load_or_calibrate(path, cfg)
        print(f"default calibration artifact: {artifact_path}", file=sys.stderr)
    print(path)


def check_calibration_tokens(tokens: int, user_text: bool) -> None:
    """``calibrate --tokens``: at least 512, at most what the default text gives
    (:data:`~vllm_lowrank.config.MAX_CALIBRATION_TOKENS`) or, with ``--text``,
    :data:`~vllm_lowrank.config.MAX_TOKENS` (a short text is refused when it is
    read).

    Raises:
        LowRankConfigError: out of range.
    """
    high = MAX_TOKENS if user_text else MAX_CALIBRATION_TOKENS
    if not 512 <= tokens <= high:
        raise LowRankConfigError(
            f"--tokens {tokens} is out of range: use 512..{high} calibration tokens "
            f"(default {LowRankConfig.calibration_tokens})")


def _text_flags(parser) -> None:
    """``--text FILE`` / ``--corpus NAME`` (one of them) of ``calibrate`` and
    ``allocate``."""
    from vllm_lowrank.calibration.text import CALIBRATION_TEXTS, DEFAULT_CALIBRATION_TEXT

    group = parser.add_mutually_exclusive_group()
    group.add_argument("--text", default=None,
                       help="calibration text: .txt, or .jsonl with a \"text\" field "
                            f"(default: the built-in {DEFAULT_CALIBRATION_TEXT} text)")
    group.add_argument("--corpus", choices=sorted(CALIBRATION_TEXTS), default=None,
                       help="a built-in calibration text: wikipedia (the default: the "
                            "calibration split of the Wikipedia excerpt) or mix (Wikipedia, BBC "
                            "News and Shakespeare in turn, the parts evaluation never reads; no "
                            "code; better perplexity off Wikipedia, worse passkey retrieval)")


def _device_flags(parser) -> None:
    """``--device`` / ``--dtype`` of ``calibrate`` and ``allocate``
    (:mod:`vllm_lowrank.calibration.device`)."""
    from vllm_lowrank.calibration.device import DTYPES

    parser.add_argument("--device", default="cpu",
                        help="where the model runs on the calibration text: cpu (default), "
                             "cuda or cuda:N; the run's memory is estimated and checked "
                             "before the model loads")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="the model's dtype for the run (default float32; bfloat16 "
                             "halves the weights' memory on a GPU)")


def _calibration_text(args) -> tuple[list[str] | None, str | None]:
    """``(documents, description)`` of ``--text FILE`` or ``--corpus NAME``;
    ``(None, None)`` for the default text
    (:data:`~vllm_lowrank.calibration.text.DEFAULT_CALIBRATION_TEXT`)."""
    from vllm_lowrank.calibration import text as texts

    if args.text:
        return texts.read_text_file(args.text), f"user text {args.text}"
    if args.corpus and args.corpus != texts.DEFAULT_CALIBRATION_TEXT:
        return texts.calibration_documents(args.corpus), texts.CALIBRATION_TEXTS[args.corpus]
    return None, None


def _calibrate(args) -> None:
    check_calibration_tokens(args.tokens, bool(args.text))
    check_output(args.output)
    if args.rank_allocation is None:
        args.rank_allocation = "fisher" if args.method in LOSS_METHODS else "energy"
    from vllm_lowrank.calibration.calibrate import calibrate_model

    documents, description = _calibration_text(args)
    from transformers import AutoConfig

    from vllm_lowrank.factorization.plan import AttentionShape
    from vllm_lowrank.models.compression import (
        allocate,
        manifest_shape,
        mixes_attention_kinds,
        record_ranks,
    )

    cfg = LowRankConfig.from_dict({"mode": "lowrank", "method": args.method,
                                   "rank_fraction": args.rank_fraction,
                                   "rank_allocation": args.rank_allocation,
                                   "head_group_size": args.head_group_size})
    check_model(args.model)
    path = resolve_model(args.model)
    text = text_config(path)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if args.head_group_size is not None and kv_heads % args.head_group_size:
        raise LowRankConfigError(
            f"--head-group-size {args.head_group_size} does not divide the model's {kv_heads} "
            f"KV heads; give a divisor of {kv_heads}")
    artifact = calibrate_model(path, method=args.method,
                               group_size=args.head_group_size, num_tokens=args.tokens,
                               documents=documents, text_description=description,
                               device=args.device, dtype=args.dtype)
    m = artifact.manifest["model"]
    shape = AttentionShape(**{k: m[k] for k in manifest_shape(AttentionShape(0, 0, 0, 0))})
    per_layer = mixes_attention_kinds(AutoConfig.from_pretrained(path))
    record_ranks(artifact, allocate(cfg, {i: shape for i in range(m["num_layers"])},
                                    artifact, per_layer), cfg)
    artifact.save(args.output)
    cal = artifact.manifest["calibration"]
    print(f"wrote {args.output}: method {args.method}, group size "
          f"{artifact.group_size}, {cal['tokens']} calibration tokens, {cal['seconds']} s "
          f"on {cal['device']} in {cal['dtype']}")


def _allocate(args) -> None:
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.calibration.allocate import budget_artifact, serving_config
    from vllm_lowrank.calibration.cache import load_or_calibrate

    check_output(args.output)
    cfg = serving_config(parse_config_text(args.config) if args.config else {})
    artifact = None
    if args.artifact != "auto":
        from vllm_lowrank.inputs import check_directory

        check_directory(args.artifact, "--artifact", "give a fisher artifact's directory "
                        "(`vllm-lowrank calibrate --method fisher --output DIR`) or auto")
        artifact = art.load_artifact(args.artifact)
    documents = _calibration_text(args)[0]
    check_model(args.model)
    path = resolve_model(args.model)
    if artifact is None:
        artifact, _ = load_or_calibrate(path, cfg, device=args.device, dtype=args.dtype)
    out, report = budget_artifact(
        path, artifact, cfg, ratio=args.compression, bytes_per_token=args.bytes_per_token,
        ppl_increase=None if args.ppl_increase is None else args.ppl_increase / 100,
        context=args.context, block_size=args.block_size, num_windows=args.windows,
        choose_knobs=not args.fixed_knobs, documents=documents,
        device=args.device, dtype=args.dtype, bits_options=args.bits)
    out.save(args.output)
    serving = out.manifest["ranks"]["serving"]
    print(f"wrote {args.output}: {report['bytes_per_token']:.1f} B per token "
          f"({report['compression_ratio']:.2f}x at {args.context} tokens), estimated loss "
          f"+{report['objective_nats']:.4f} nats; serving settings {json.dumps(serving)}")


def _perplexity(args) -> None:
    from vllm_lowrank.calibration.text import read_text_file
    from vllm_lowrank.evaluation import TEXTS, run_setting

    for text in args.text:  # a user's file is checked before any engine starts
        if text not in TEXTS:
            read_text_file(text, "evaluation text")
    settings = [None] if not args.no_baseline else []
    for text in args.config:
        raw = parse_config_text(text)
        raw.setdefault("mode", "lowrank")
        LowRankConfig.from_dict(raw)
        settings.append(raw)
    check_model(args.model)
    model = resolve_model(args.model)
    positions = getattr(text_config(model), "max_position_embeddings", None)
    if positions is not None and args.window + 16 > positions:
        raise LowRankConfigError(
            f"--window {args.window} does not fit the model's {positions} positions "
            f"(max_position_embeddings, 16 kept spare); give at most {positions - 16}")
    num_windows = max(1, args.tokens // args.window)
    rows = []
    base = {}
    for setting in settings:
        r = run_setting({"model": model, "compression": setting, "texts": args.text,
                         "num_windows": num_windows, "window": args.window,
                         "dtype": args.dtype})
        label = "uncompressed" if setting is None else json.dumps(
            {k: v for k, v in setting.items() if k != "mode"})
        if setting is None:
            base = {t: r[t]["ppl"] for t in args.text}
        cells = []
        for t in args.text:
            ppl = r[t]["ppl"]
            delta = f" ({100 * (ppl / base[t] - 1):+.1f}%)" if base and setting is not None else ""
            cells.append(f"{ppl:.3f}{delta}")
        rows.append((label, r["kv_tokens"], cells))
        print(f"done: {label} kv_tokens={r['kv_tokens']} "
              + " ".join(f"{t}={r[t]['ppl']:.3f}" for t in args.text), file=sys.stderr)
    ref_tokens = rows[0][1] if settings and settings[0] is None else None
    print(f"\nperplexity over {num_windows} x {args.window} held-out tokens per text "
          f"({model}, dtype {args.dtype})")
    head = "| setting | KV tokens | capacity x | " + " | ".join(args.text) + " |"
    print(head)
    print("|" + "---|" * (3 + len(args.text)))
    for label, tokens, cells in rows:
        cap = f"{tokens / ref_tokens:.2f}" if ref_tokens else "-"
        print(f"| {label} | {tokens} | {cap} | " + " | ".join(cells) + " |")


def describe_artifact(path: str) -> dict:
    """What the artifact at ``path`` holds, JSON-safe (validated like serving
    loads it): ``path``, ``digest``, ``model`` (id, architecture, layers,
    fingerprint, attention shape), ``method``, ``group_size``, ``calibration``,
    ``plugin_version``; with a fixed allocation also ``allocation``,
    ``layers`` (``{layer: {"k_ranks", "v_ranks", "k_bits", "v_bits"}}``),
    ``serving`` and ``latent_bytes_per_token`` (all layers' latent slots,
    unpadded; exact tokens of the token-adaptive mode not included),
    ``bf16_kv_bytes_per_token`` and ``compression`` (their ratio); without one,
    ``ranks: null`` (serving derives them from ``rank_fraction`` and
    ``rank_allocation``).

    Raises:
        LowRankConfigError: not a valid artifact.
    """
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.format.latent import RAW_BITS, SlotLayout

    artifact = art.load_artifact(path)
    m = artifact.manifest
    model = m["model"]
    out = {"path": path, "digest": artifact.digest, "model": dict(model),
           "method": m["method"], "group_size": m["group_size"],
           "calibration": m.get("calibration"), "plugin_version": m.get("plugin_version"),
           "ranks": None}
    ranks = m.get("ranks") or {}
    if not ranks.get("fixed"):
        return out
    serving = ranks.get("serving") or {}
    bits = ranks.get("bits") or {}
    layers, stored = {}, 0
    for layer, (k_ranks, v_ranks) in sorted(ranks["layers"].items(), key=lambda kv: int(kv[0])):
        kb, vb = bits.get(layer, (RAW_BITS, RAW_BITS))
        layers[layer] = {"k_ranks": list(k_ranks), "v_ranks": list(v_ranks),
                         "k_bits": kb, "v_bits": vb}
        if (kb, vb) == (RAW_BITS, RAW_BITS):
            stored += 2 * (sum(k_ranks) + sum(v_ranks))
        else:
            group = serving.get("quant_group_size")
            channel = serving.get("k_channel_tokens") \
                if serving.get("k_quant") == "channel" and kb != RAW_BITS else None
            stored += SlotLayout(k_ranks, v_ranks, kb, vb, group, group, channel).natural_bytes
    original = 2 * 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"]
    out.update(ranks={"allocation": ranks.get("allocation"), "ratio": ranks.get("ratio")},
               layers=layers, serving=serving, latent_bytes_per_token=stored,
               bf16_kv_bytes_per_token=original, compression=original / stored)
    return out


def _inspect(args) -> None:
    from vllm_lowrank.inputs import check_directory

    check_directory(args.artifact, "artifact", "give the artifact's directory (what "
                    "`vllm-lowrank calibrate` or `allocate` wrote with --output)")
    info = describe_artifact(args.artifact)
    if args.json:
        print(json.dumps(info, indent=1))
        return
    model = info["model"]
    print(f"artifact   {info['path']} ({info['digest']}, vllm-lowrank "
          f"{info['plugin_version']})")
    print(f"model      {model['id']} ({model['architecture']}, {model['num_layers']} layers, "
          f"{model['num_kv_heads']} KV heads of {model['head_dim']}, fingerprint "
          f"{model['fingerprint']})")
    print(f"bases      method {info['method']}, head groups of {info['group_size']} KV heads, "
          f"calibration {json.dumps(info['calibration'], sort_keys=True)}")
    if info["ranks"] is None:
        print("ranks      chosen at serve time from ratio and rank_allocation")
        return
    print(f"allocation {info['ranks']['allocation']} (ratio {info['ranks']['ratio']}); "
          f"serving {json.dumps(info['serving'], sort_keys=True)}")
    print(f"bytes      {info['latent_bytes_per_token']} latent bytes per token against "
          f"{info['bf16_kv_bytes_per_token']} of bf16 K/V: {info['compression']:.2f}x "
          f"(exact tokens not included)")
    print("| layer | K ranks | V ranks | K bits | V bits |")
    print("|---|---|---|---|---|")
    for layer, e in info["layers"].items():
        print(f"| {layer} | {e['k_ranks']} | {e['v_ranks']} | {e['k_bits']} | {e['v_bits']} |")


def _estimate(args) -> None:
    from vllm_lowrank.estimate import estimate

    given = parse_config_text(args.config) if args.config else {}
    cfg = LowRankConfig.from_dict({"mode": "lowrank", **given})
    check_model(args.model)
    info = estimate(resolve_model(args.model), cfg, dtype=args.dtype,
                    kv_cache_gib=args.kv_cache_gib, block_size=args.block_size,
                    tensor_parallel_size=args.tensor_parallel_size, context=args.context,
                    concurrent_batches=args.concurrent_batches)
    if args.json:
        print(json.dumps(info, indent=1))
        return
    print(f"setting    {json.dumps(given)} -> preset {info['preset']}")
    if info.get("note"):
        print(f"note       {info['note']}")
    if info["compression_ratio"] is None:
        print(f"GPU path   {info['gpu_path']}")
        return
    print(f"bytes      {info['stored_bytes_per_token']} stored per token (all layers of one "
          f"worker, {info['dtype']}) against {info['original_bytes_per_token']} uncompressed; "
          f"exact tokens {info['exact_bytes_per_sequence']} per sequence")
    print(f"ratio      {info['compression_ratio']:.2f}x latent slots vs 16-bit K/V; "
          f"{info['sequence_compression_ratio']:.2f}x over a {info['context']}-token "
          f"sequence, exact tokens included")
    print(f"capacity   {info['tokens']:,} tokens ({info['stock_tokens']:,} uncompressed) "
          f"in {args.kv_cache_gib:g} GiB; {info['sequences']:,} sequences of "
          f"{info['context']} tokens ({info['stock_sequences']:,} uncompressed)")
    print(f"admitted   {info['admitted_sequences']:g} requests of {info['context']} tokens at "
          f"once by vLLM's worst-case rule, its logged maximum concurrency "
          f"({info['stock_admitted_sequences']:g} uncompressed; "
          f"{info['concurrent_batches']} batches in flight; its scheduler admits by the "
          f"blocks free)")
    print(f"GPU path   {info['gpu_path']}")


def _deprecated_flag(parser, old: str, new: str, kind) -> None:
    """Accept ``old`` as a hidden alias of the option ``new`` (same destination),
    printing one warning line when it is used (one release, then removed)."""

    class Deprecated(argparse.Action):
        def __call__(self, parser_, namespace, value, option_string=None):
            print(f"vllm-lowrank: warning: {old} is deprecated and will be removed in the "
                  f"next release; use {new} (same meaning)", file=sys.stderr)
            setattr(namespace, self.dest, value)

    parser.add_argument(old, type=kind, dest=new.lstrip("-").replace("-", "_"),
                        action=Deprecated, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="vllm-lowrank", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare-model", help="convert an embedded model once, print its folder")
    s.add_argument("name", nargs="?", default="smollm2-135m")
    s.add_argument("--cache-dir", default=None)
    s.add_argument("--calibrate", action="store_true",
                   help="also make the default artifact used by artifact=\"auto\"")
    s.set_defaults(func=_prepare)

    s = sub.add_parser("calibrate", help="calibrate bases and write an artifact")
    s.add_argument("model", help="Hugging Face folder or embedded alias")
    s.add_argument("--output", required=True, help="artifact directory to write")
    s.add_argument("--method", choices=METHODS, default=LowRankConfig.method)
    s.add_argument("--head-group-size", type=_number(int, 1, MAX_KV_HEADS), default=None,
                   help="KV heads per head group (default: all KV heads of a layer); the "
                        "artifact serves tensor-parallel sizes N whose KV heads "
                        "per TP rank (KV heads / N) are a multiple of it")
    _deprecated_flag(s, "--group-size", "--head-group-size", _number(int, 1, MAX_KV_HEADS))
    s.add_argument("--tokens", type=int, default=LowRankConfig.calibration_tokens)
    s.add_argument("--rank-fraction", type=float, default=LowRankConfig.rank_fraction,
                   help="rank fraction whose rank allocation is recorded in the manifest "
                        "(serving re-derives it for any other rank fraction)")
    _deprecated_flag(s, "--ratio", "--rank-fraction", float)
    s.add_argument("--rank-allocation", default=None,
                   help="allocation recorded in the manifest (default: fisher for "
                        "method fisher, else energy)")
    _text_flags(s)
    _device_flags(s)
    s.set_defaults(func=_calibrate)

    s = sub.add_parser("allocate", help="byte-budget allocation of ranks and bits -> artifact")
    s.add_argument("model", help="Hugging Face folder or embedded alias")
    s.add_argument("--output", required=True, help="artifact directory to write")
    s.add_argument("--artifact", default="auto",
                   help="fisher artifact to start from (default: the cached default)")
    target = s.add_mutually_exclusive_group(required=True)
    ratio = _number(float, 1, MAX_RATIO, above=True)
    target.add_argument("--compression", type=ratio,
                        help="compression ratio (16-bit K+V bytes / stored bytes), > 1")
    _deprecated_flag(target, "--ratio", "--compression", ratio)
    target.add_argument("--bytes-per-token", type=_number(float, 0, MAX_BYTES, above=True),
                        help="bytes per token, all layers")
    target.add_argument("--ppl-increase", type=_number(float, 0, 1000, above=True),
                        help="estimated perplexity increase in percent (objective budget)")
    s.add_argument("--config", default=None,
                   help="serving settings the allocation assumes (JSON or path): "
                        "token_adaptive, sink_tokens, recent_tokens, k_quant, "
                        "k_channel_tokens, quant_group_size, hadamard")
    s.add_argument("--context", type=_number(int, 1, MAX_TOKENS), default=4096,
                   help="tokens per sequence that amortise the exact tokens")
    s.add_argument("--block-size", type=_number(int, 1, MAX_BLOCK_SIZE), default=32,
                   help="vLLM KV block size")
    s.add_argument("--windows", type=_number(int, 1, MAX_TOKENS // 1024), default=4,
                   help="1024-token calibration windows")
    s.add_argument("--bits", type=int, nargs="+", default=list(STORAGE_BITS),
                   choices=STORAGE_BITS, metavar="BITS",
                   help=f"code widths a side may be stored at (default: all of "
                        f"{' '.join(map(str, STORAGE_BITS))})")
    _text_flags(s)
    _device_flags(s)
    s.add_argument("--fixed-knobs", action="store_true",
                   help="keep hadamard, k_quant and recent_tokens as given (default: also "
                        "try the other hadamard/k_quant and twice the recent window)")
    s.set_defaults(func=_allocate)

    s = sub.add_parser("perplexity", help="baseline vs compressed perplexity through vLLM")
    s.add_argument("model", help="Hugging Face folder or embedded alias")
    s.add_argument("--config", action="append", default=[],
                   help="a --kv-compression-config (JSON or path); repeatable")
    s.add_argument("--text", nargs="+", default=["wikipedia"],
                   help="wikipedia (held out from calibration), bbc, shakespeare, code "
                        "(Python's standard library), or your own .txt / .jsonl file "
                        "(a \"text\" field per line); several allowed")
    s.add_argument("--tokens", type=_number(int, 1, MAX_TOKENS), default=16384,
                   help="tokens per text")
    s.add_argument("--window", type=_number(int, 2, MAX_TOKENS), default=1024,
                   help="tokens per window (at most the model's context)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--no-baseline", action="store_true")
    s.set_defaults(func=_perplexity)

    s = sub.add_parser("estimate", help="bytes per token, compression and tokens that fit, "
                                        "without loading weights")
    s.add_argument("model", help="Hugging Face folder or embedded alias")
    s.add_argument("--config", default=None,
                   help="a --kv-compression-config (JSON or path); none: the default preset")
    s.add_argument("--kv-cache-gib", "--gpu-memory-gib", dest="kv_cache_gib",
                   type=_number(float, 0, MAX_GIB, above=True), default=1.0,
                   help="KV cache memory per worker, GiB (vLLM's kv_cache_memory_bytes; "
                        "VLLM_CPU_KVCACHE_SPACE on CPU)")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    s.add_argument("--block-size", type=_number(int, 1, MAX_BLOCK_SIZE), default=None,
                   help="KV block size (default: the preset's, or the one an allocation "
                        "artifact was allocated for, else 16)")
    s.add_argument("--tensor-parallel-size", type=_number(int, 1, MAX_KV_HEADS), default=1)
    s.add_argument("--context", type=_number(int, 1, MAX_TOKENS), default=4096,
                   help="tokens per sequence")
    s.add_argument("--concurrent-batches", type=_number(int, 1, 64), default=2,
                   help="vLLM's batches in flight: 2 with async scheduling (its default on "
                        "CUDA), 1 without (CPU)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_estimate)

    s = sub.add_parser("inspect", help="what an artifact holds (ranks, bits, bytes per token)")
    s.add_argument("artifact", help="artifact directory")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(func=_inspect)
    return p


def _log_to_stderr() -> None:
    """Show the plugin's INFO lines (memory estimate, progress) on stderr
    while vLLM's own logger is not configured (``calibrate`` and ``allocate``
    do not import vLLM; once it is imported its handler prints them)."""
    import logging

    log = logging.getLogger("vllm.lowrank")
    if any(getattr(h, "lowrank_cli", False) for h in log.handlers):
        return
    class Stderr(logging.StreamHandler):  # the current sys.stderr at each record
        stream = property(lambda _self: sys.stderr, lambda _self, _value: None)

    handler = Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(lambda _record: not logging.getLogger("vllm").handlers)
    handler.lowrank_cli = True
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        args.func(args)
    except LowRankConfigError as e:
        print(f"vllm-lowrank: error: {e}", file=sys.stderr)
        sys.exit(2)
