"""The accuracy frontier: perplexity increase vs achieved compression ratio.

Every setting is served by vLLM with this plugin and measured with the
generate-style protocol of ``benchmarks/token_adaptive.py`` (held-out windows
of ``--context`` tokens advancing ``--step`` tokens per request per engine
step, side by side, so each predicted token sees the cache as a generating
request would). One engine per setting, in a fresh subprocess.

The quantization-only peers are configurations of the same cache at full rank
(``ratio 1.0``: identity bases, the cached latents are the model's own pre-RoPE
keys and values; no calibration): int8 per token (groups of 64 channels), and
KIVI-style int4 / int2 (keys per channel over 32-token groups, values per token
in groups of 64, the last 128 tokens exact: KIVI's full-precision residual,
Liu et al. 2024, sec. 3.3). KIVI quantizes post-RoPE keys; these peers quantize
pre-RoPE keys (KVQuant's finding: pre-RoPE per-channel is the better of the
two). An fp8 peer is not offered by the cache (see ``../shared/notes/baselines.md``:
fp8 e4m3 costs +0.7 % at 2x, int8 +0.0 %).

Compression ratio = 16-bit K+V bytes per token / bytes vLLM allocates per
token in a 16-bit deployment: the latent slot of every layer (codes, scales and
zeros, per-channel key scales included) plus, with exact tokens, ``(sink +
recent) / context`` exact slots (keys, values, the staged key latent of
per-channel keys, padding to a multiple of the latent slot), from the ranks the
workers actually built (:func:`allocated_bytes`).

    VLLM_CPU_KVCACHE_SPACE=2 .venv/bin/python -P benchmarks/frontier.py --json frontier.json

The table gives each text's perplexity change, their mean and the worst
text. ``--texts`` takes any of the four held-out domains
(:data:`vllm_lowrank.evaluation.TEXTS`: ``wikipedia bbc shakespeare code``;
default the first two).

vLLM's own compressed caches (``--kv-cache-dtype`` int8/fp8/int4 per token and
head, TurboQuant, UltraQuant; kind ``vllm``) are added from the JSON that
``benchmarks/peer_caches.py --json`` writes (``--peers``): simulated storage in
a Hugging Face float32 model on the same held-out windows (vLLM's CPU build
cannot store these formats), perplexity changes against that run's own
uncompressed baseline, bytes per token from vLLM's slot sizes. ``--rows``
reads rows of our settings saved earlier (``--save-rows``) instead of
re-running their engines.

Prints a markdown table; ``--json`` writes (and resumes from) every number,
``--plot`` draws the frontier (PNG, matplotlib: ``pip install 'vllm-lowrank[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os

from vllm_lowrank.calibration.text import DEFAULT_CALIBRATION_TEXT as DEFAULT_TEXT

KIVI = {"rank_fraction": 1.0, "quant_group_size": 64, "hadamard": False, "token_adaptive": True,
        "sink_tokens": 0, "recent_tokens": 128, "k_quant": "channel", "k_channel_tokens": 32}
TALE = {"token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128, "k_quant": "channel",
        "k_channel_tokens": 32}

SETTINGS: dict[str, tuple[str, dict | None]] = {
    # name: (kind, compression)
    "uncompressed": ("peer", None),
    "int8 per token (g64)": ("peer", {"rank_fraction": 1.0, "k_bits": 8, "v_bits": 8,
                                      "quant_group_size": 64, "hadamard": False}),
    "KIVI-style int4 (+128 recent)": ("peer", {**KIVI, "k_bits": 4, "v_bits": 4}),
    "KIVI-style int2 (+128 recent)": ("peer", {**KIVI, "k_bits": 2, "v_bits": 2}),
    "latent 0.75, K4 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.75, "k_bits": 4, "v_bits": 4}),
    "latent 0.5, K4 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4}),
    # J-LRD latents at 0.75 with int8 exact tokens (half their bytes), and a little
    # less rank: the >= 4x at <= 1 % on every domain target of issue 25
    "latent 0.75, K4 per channel, V4, sink 32 + recent 128 int8": (
        "ours", {**TALE, "rank_fraction": 0.75, "k_bits": 4, "v_bits": 4, "exact_bits": 8}),
    "latent 0.7, K4 per channel, V4, sink 32 + recent 128 int8": (
        "ours", {**TALE, "rank_fraction": 0.7, "k_bits": 4, "v_bits": 4, "exact_bits": 8}),
    "latent 0.5, K4 per channel, V4, sink 32 + recent 128 int8": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4, "exact_bits": 8}),
    "latent 0.5, K2 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 2, "v_bits": 4}),
    "latent 0.5, K4 per channel, V2, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 4, "v_bits": 2}),
    "latent 0.375, K4 per channel, V2, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.375, "k_bits": 4, "v_bits": 2}),
    "latent 0.5, K2 per channel, V2, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 2, "v_bits": 2}),
    "latent 0.25, K4 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "rank_fraction": 0.25, "k_bits": 4, "v_bits": 4}),
    # byte-budget allocation (ranks and bits per layer), sink 32 + recent 128
    "allocated 8x, sink 32 + recent 128": ("ours", {"allocate": 8.0, **TALE}),
    "allocated 8x, sink 32 + recent 64": ("ours", {"allocate": 8.0, **TALE, "recent_tokens": 64}),
    "allocated 6x, sink 32 + recent 128": ("ours", {"allocate": 6.0, **TALE}),
    # the exact tokens stored as int8 per token and head (half their bytes)
    "allocated 8x, sink 32 + recent 128 int8": ("ours", {"allocate": 8.0, **TALE,
                                                          "exact_bits": 8}),
    "allocated 8x, sink 32 + recent 256 int8": ("ours", {"allocate": 8.0, **TALE,
                                                          "recent_tokens": 256,
                                                          "exact_bits": 8}),
    "allocated 8x, sink 32 + recent 512 int8": ("ours", {"allocate": 8.0, **TALE,
                                                          "recent_tokens": 512,
                                                          "exact_bits": 8}),
    # the allocator also choosing Hadamard, per-channel/per-token keys and the window
    "allocated 8x, int8 exact, knobs chosen": ("ours", {"allocate": 8.0, **TALE, "exact_bits": 8,
                                                        "choose_knobs": True}),
    # the 8x recipe with the allocation's code widths limited to 4 bits and up
    # (`allocate --bits 16 8 4`): rank, not 2-3-bit codes, pays for the bytes
    "allocated 8x, sink 32 + recent 256 int8, bits >= 4": (
        "ours", {"allocate": 8.0, **TALE, "recent_tokens": 256, "exact_bits": 8,
                 "bits": [16, 8, 4]}),
    # the 8x recipe and J-LRD latents at 0.5 with key bases that commute with RoPE:
    # the GPU decodes them with the queries absorbed, no key rebuild (decode_latent_rope)
    "allocated 8x, sink 32 + recent 256 int8, rope_equivariant": (
        "ours", {"allocate": 8.0, **TALE, "recent_tokens": 256, "exact_bits": 8,
                 "method": "rope_equivariant"}),
    "latent 0.5, K4 per channel, V4, sink 32 + recent 128, rope_equivariant": (
        "ours", {**TALE, "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4,
                 "method": "rope_equivariant"}),
    # full-rank post-RoPE latents per KV head (the `2x` preset's format, no key
    # rebuild: the packed GPU kernel) with 4-bit keys: quantization only
    "post-RoPE full rank, K4/V4 per token": ("ours", {"preset": "2x", "k_bits": 4}),
    # full rank (pre-RoPE), per-channel 4-bit keys (KIVI) and Hadamard-rotated 2-bit values
    "full rank, K4 per channel, V2 Hadamard, sink 32 + recent 128": (
        "ours", {**KIVI, "k_bits": 4, "v_bits": 2, "hadamard": True, "sink_tokens": 32}),
    # post-RoPE keys (KIVI's per-channel codes, no key basis: the GPU scores them as
    # stored) beside value latents on Fisher bases; exact sinks and recent tokens
    **{f"post-RoPE keys K{kb}/{ct} per channel, values {name}V{vb}{grp}, int8 exact": (
        "ours", {**TALE, "post_rope_keys": True, "rank_fraction": rf, "k_bits": kb,
                 "v_bits": vb, "exact_bits": 8, "k_channel_tokens": ct, **extra})
       for kb, ct, rf, name, vb, grp, extra in (
           (4, 32, 0.75, "latent 0.5 ", 4, "", {}),
           (4, 32, 0.75, "latent 0.5 ", 4, " G=1", {"head_group_size": 1}),
           (4, 32, 0.875, "latent 0.75 ", 4, "", {}),
           (4, 64, 0.875, "latent 0.75 ", 4, "", {}),
           (4, 32, 1.0, "full rank ", 4, " G=1", {"head_group_size": 1}),
           (4, 32, 1.0, "full rank ", 2, "", {}),
           (4, 32, 1.0, "full rank ", 2, " G=1", {"head_group_size": 1}),
           (4, 64, 1.0, "full rank ", 2, " G=1", {"head_group_size": 1}),
           (4, 64, 1.0, "full rank ", 4, " G=1", {"head_group_size": 1}),
           (2, 32, 1.0, "full rank ", 4, " G=1", {"head_group_size": 1}),
       )},
    # the presets as a user selects them (vllm_lowrank/presets.py)
    **{f"preset {name}": ("ours", {"preset": name}) for name in ("2x", "lossless", "4x", "8x")},
    # `4x` with its exact windows fitted to its 64-token blocks (the sink block holds 64
    # tokens whatever `sink_tokens` is; a window of recent + 1 tokens spans
    # ceil(recent / 64) + 1 blocks): the KV memory a sequence holds on the GPU
    "4x recipe, sink 64 + recent 128": ("ours", {"preset": "4x", "sink_tokens": 64}),
    "4x recipe, sink 64 + recent 64": ("ours", {"preset": "4x", "sink_tokens": 64,
                                                "recent_tokens": 64}),
    # no sink block (the exact windows alone: one 64-token block fewer per sequence)
    "4x recipe, no sink, recent 128": ("ours", {"preset": "4x", "sink_tokens": 0}),
    "4x recipe, no sink, recent 192": ("ours", {"preset": "4x", "sink_tokens": 0,
                                                "recent_tokens": 192}),
    # per-head groups (G = 1), the grouping the GPU decodes fastest (benchmarks/README.md)
    "G=1 latent 0.75, K4 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "head_group_size": 1, "rank_fraction": 0.75, "k_bits": 4, "v_bits": 4}),
    "G=1 latent 0.5, K4 per channel, V4, sink 32 + recent 128": (
        "ours", {**TALE, "head_group_size": 1, "rank_fraction": 0.5, "k_bits": 4, "v_bits": 4}),
    "G=1 latent 0.5, 16-bit, sink 32 + recent 128": (
        "ours", {**TALE, "head_group_size": 1, "rank_fraction": 0.5, "k_quant": "token"}),
}


def selected(name: str, only: list[str] | None) -> bool:
    """Whether ``--only`` selects the setting ``name``: every setting when
    ``only`` is ``None``; a string that is a setting's whole name selects that
    setting alone (so a name that is a prefix of others, such as "allocated 8x,
    sink 32 + recent 256 int8", does not select them); any other string, every
    setting whose name contains it."""
    if only is None:
        return True
    return any(o == name if o in SETTINGS else o in name for o in only)


def corpus_tag(corpus: str, tokens: int | None) -> str:
    """The part of a cached artifact's name that names its calibration text
    and, when not the default count, its tokens (``mix-65536t``)."""
    return corpus + (f"-{tokens}t" if tokens else "")


def corpus_artifact(model: str, corpus: str, tokens: int | None = None,
                    method: str = "fisher") -> str:
    """A ``method`` artifact of ``model`` calibrated on the built-in text ``corpus``
    (:data:`vllm_lowrank.calibration.text.CALIBRATION_TEXTS`) over ``tokens``
    tokens (``None``: the default count), made once and cached under the
    plugin's cache root; what ``vllm-lowrank calibrate MODEL --corpus CORPUS
    [--tokens N] [--method METHOD]`` writes."""
    from vllm_lowrank.calibration.cache import cache_root

    path = os.path.join(cache_root(), "artifacts",
                        f"{method}-{os.path.basename(model)}-{corpus_tag(corpus, tokens)}")
    if not os.path.isdir(path):
        from vllm_lowrank.cli import main as cli

        cli(["calibrate", model, "--corpus", corpus, "--output", path, "--method", method]
            + (["--tokens", str(tokens)] if tokens else []))
    return path


def allocation_artifact(model: str, cfg: dict, context: int, block: int,
                        corpus: str = DEFAULT_TEXT, tokens: int | None = None) -> str:
    """The byte-budget artifact of a setting ``{"allocate": ratio, **serving}``
    (:func:`vllm_lowrank.calibration.allocate.budget_artifact` from the
    model's default artifact of the setting's ``method`` (``fisher`` unless
    given), or with ``corpus`` other than the default text from
    :func:`corpus_artifact` (over ``tokens`` calibration tokens) and measured on
    that text; cached under the plugin's cache root)."""
    from vllm_lowrank.calibration import text as texts
    from vllm_lowrank.calibration.allocate import budget_artifact, serving_config
    from vllm_lowrank.calibration.artifact import load_artifact
    from vllm_lowrank.calibration.cache import cache_root, load_or_calibrate
    from vllm_lowrank.config import LowRankConfig

    method = cfg.get("method", "fisher")
    serving = {k: v for k, v in cfg.items()
               if k not in ("allocate", "choose_knobs", "bits", "method")}
    name = f"alloc-{os.path.basename(model)}-{cfg['allocate']}x-{context}-{block}-" + "-".join(
        f"{k}{v}" for k, v in sorted(serving.items())) + ("-chosen" if cfg.get("choose_knobs")
                                                         else "")
    if "bits" in cfg:
        name += "-bits" + "".join(map(str, cfg["bits"]))
    if method != "fisher":
        name += f"-{method}"
    if corpus != DEFAULT_TEXT:
        name += f"-{corpus_tag(corpus, tokens)}"
    path = os.path.join(cache_root(), "artifacts", name)
    if not os.path.isdir(path):
        settings = serving_config(serving)
        if corpus == DEFAULT_TEXT:
            artifact, _ = load_or_calibrate(model, LowRankConfig(mode="lowrank", method=method))
            documents = None
        else:
            artifact = load_artifact(corpus_artifact(model, corpus, tokens, method))
            documents = texts.calibration_documents(corpus)
        out, _ = budget_artifact(model, artifact, settings, ratio=cfg["allocate"],
                                 context=context, block_size=block,
                                 choose_knobs=cfg.get("choose_knobs", False),
                                 documents=documents,
                                 **({"bits_options": cfg["bits"]} if "bits" in cfg else {}))
        out.save(path)
    return path


def setting_block(cfg: dict | None, given: int | None) -> int:
    """The KV block size a setting is measured with: ``given`` (``--block-size``)
    when set; else 32 (vLLM's CPU attention needs a multiple of 32), raised to the
    setting's preset block size and to its per-channel key groups
    (``k_channel_tokens`` must divide the block): 64 for the ``4x`` preset and the
    settings with key groups of 64 tokens."""
    if given:
        return given
    if not cfg or "allocate" in cfg:  # allocations: the TALE settings, groups of 32
        return 32
    from vllm_lowrank.presets import PRESETS, expand

    full = expand({"mode": "lowrank", **cfg})
    preset = PRESETS.get(full.get("preset"))
    block = max(32, preset.block_size or 32) if preset is not None else 32
    if full.get("k_quant") == "channel":
        block = max(block, full.get("k_channel_tokens") or 0)
    return block


def compression_of(model: str, cfg: dict | None, context: int, block: int,
                   corpus: str = DEFAULT_TEXT, tokens: int | None = None) -> dict | None:
    """The ``kv_compression`` settings a setting is served with (calibrated on
    ``corpus``: the default artifact for the default text)."""
    if cfg is None:
        return None
    if "allocate" in cfg:
        return {"mode": "lowrank",
                "artifact": allocation_artifact(model, cfg, context, block, corpus, tokens)}
    if corpus != DEFAULT_TEXT:
        return {"mode": "lowrank", **cfg,
                "artifact": corpus_artifact(model, corpus, tokens, cfg.get("method", "fisher"))}
    return {"mode": "lowrank", **cfg}


def allocated_bytes(layers: dict, cfg: dict, head_dim: int, context: int,
                    block: int, serving: dict | None = None) -> tuple[int, float]:
    """(16-bit K+V bytes, allocated bytes) per token over all layers.

    Args:
        layers: ``{layer: {"k_ranks", "v_ranks", "kv_width"}}`` as the workers
            built them (evaluation result ``layers``); their slots are laid out
            (and padded to one size) as the plugin lays them out
            (:func:`vllm_lowrank.models.compression.slot_layouts`).
        cfg: The ``kv_compression`` settings.
        serving: For an allocated setting, the serving settings its artifact
            records (``manifest["ranks"]["serving"]``: the allocator may have
            chosen some of them).
        head_dim: The model's head dimension (the int8 exact slot's scale group).
        context: Tokens per sequence (amortises the exact tokens).
        block: KV block size (sinks and window round up to whole blocks).
    """
    import torch

    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.calibration.allocate import serving_config
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.format.exact import exact_tokens
    from vllm_lowrank.models.compression import slot_layouts
    from vllm_lowrank.presets import PRESETS

    if "allocate" in cfg:  # serving settings as recorded
        settings = serving_config(serving)
    else:  # a preset's settings filled in
        settings = LowRankConfig.from_dict({"mode": "lowrank", **cfg})
    # an allocation's bits differ by layer: as the workers built them
    allocated = "allocate" in cfg or (settings.preset is not None
                                      and PRESETS[settings.preset].allocate is not None)
    bits = [tuple(la["bits"]) for la in layers.values()] if allocated else None
    ranks = [(la["k_ranks"], la["v_ranks"]) for la in layers.values()]
    layouts = (slot_layouts(settings, ranks, bits, one_page=settings.token_adaptive)
               or [None] * len(ranks))
    exact = exact_tokens(settings, block)
    original, allocated = 0, 0.0
    for layer, layout in zip(layers.values(), layouts):
        kvw, rk, rv = layer["kv_width"], sum(layer["k_ranks"]), sum(layer["v_ranks"])
        original += 2 * kvw * 2
        slot = layout.slot_bytes if layout is not None else 2 * (rk + rv)
        allocated += slot
        if exact is not None:
            staged = rk if layout is not None and layout.k_per_channel \
                and not settings.post_rope_keys else 0
            allocated += (exact.count / context * ExactSlot(
                kvw, head_dim, torch.float16, exact.bits, staged, slot).slot_bytes)
    return original, allocated


VLLM_PREFIX = "vLLM --kv-cache-dtype "
VLLM_LABELS = {"int8_per_token_head": "int8 pth", "fp8_per_token_head": "fp8 pth",
               "int4_per_token_head": "int4 pth", "turboquant_k8v4": "TQ k8v4",
               "turboquant_4bit_nc": "TQ 4bit", "turboquant_k3v4_nc": "TQ k3v4",
               "turboquant_3bit_nc": "TQ 3bit", "ultraquant_4bit": "UQ 4bit",
               "nvfp4": "nvfp4", "nvfp4_4over6": "nvfp4 4/6"}

# plot families: (label, marker, colour); one Pareto front each
FAMILIES = {
    "ours": ("vllm-lowrank (latents)", "o", "tab:blue"),
    "peer": ("our cache, full rank (int8, KIVI-style)", "s", "tab:gray"),
    "per_token_head": ("vLLM int8/fp8/int4 per token-head (sim.)", "D", "tab:red"),
    "turboquant": ("vLLM TurboQuant (sim.)", "^", "tab:orange"),
    "ultraquant": ("vLLM UltraQuant (sim.)", "v", "tab:purple"),
    "nvfp4": ("vLLM NVFP4 (sim.)", "P", "tab:brown"),
}


def family(row: dict) -> str:
    if row["kind"] != "vllm":
        return row["kind"]
    dtype = row["name"][len(VLLM_PREFIX):].split(" ")[0]
    return ("per_token_head" if dtype.endswith("per_token_head") else
            "turboquant" if dtype.startswith("turboquant") else
            "ultraquant" if dtype.startswith("ultraquant") else "nvfp4")


def peer_rows(path: str, texts: list[str], windows: int, context: int) -> list[dict]:
    """Rows of vLLM's own caches from ``benchmarks/peer_caches.py --json``: the
    first ``windows`` windows per text, changes against that file's baseline."""
    with open(path) as f:
        res = json.load(f)
    have = [k for k in res if k.startswith("uncompressed|")]
    key = next(k for k in have if int(k.split("|")[1].split("x")[0]) >= windows
               and k.endswith(f"x{context}"))
    suffix = key.split("|")[1]

    def ppl(r, t):
        w = r[t].get("windows")
        if w is None:  # written without per-window numbers: all windows
            return r[t]["ppl"]
        nll, n = sum(a for a, _ in w[:windows]), sum(b for _, b in w[:windows])
        return math.exp(nll / n)

    base = res[key]
    rows = []
    for k, r in res.items():
        dtype, sfx = k.split("|")
        if sfx != suffix or dtype == "uncompressed":
            continue
        ppls = [ppl(r, t) for t in texts]
        deltas = [100 * (p / ppl(base, t) - 1) for p, t in zip(ppls, texts)]
        rows.append({"name": f"{VLLM_PREFIX}{dtype} (simulated)", "kind": "vllm",
                     "ratio": r["bytes_16bit"] / r["bytes"], "ppl": ppls, "deltas": deltas,
                     "delta": sum(deltas) / len(deltas),
                     "base_ppl": [ppl(base, t) for t in texts]})
    return rows


def _label(name: str) -> str:
    """Short plot label: ``int8``, ``KIVI-4``, ``r0.5 K4c/V4``, ``alloc 8x W256 int8``
    (recent window if not 128, int8 exact tokens), ``TQ k8v4`` (vLLM's own)."""
    if name.startswith(VLLM_PREFIX):
        return VLLM_LABELS[name[len(VLLM_PREFIX):].split(" ")[0]]
    kind, cfg = SETTINGS[name.split(" [")[0]]
    if kind == "peer":
        return name.split(" (")[0].replace("-style int", "-").replace(" per token", "")
    if "allocate" in cfg:
        window = cfg.get("recent_tokens", 128)
        return (f"alloc {cfg['allocate']:g}x" + (f" W{window}" if window != 128 else "")
                + (" int8" if cfg.get("exact_bits") == 8 else "")
                + (" chosen" if cfg.get("choose_knobs") else ""))
    k = f"K{cfg['k_bits']}" + ("c" if cfg.get("k_quant") == "channel" else "")
    return f"r{cfg['rank_fraction']} {k}/V{cfg['v_bits']}"


def pareto(points: list[dict]) -> list[dict]:
    """The points no other point beats on both axes (more compression at an
    equal or lower perplexity change), by increasing compression."""
    front = [p for p in points if not any(
        q is not p and q["ratio"] >= p["ratio"] and q["delta"] <= p["delta"]
        and (q["ratio"] > p["ratio"] or q["delta"] < p["delta"]) for q in points)]
    return sorted(front, key=lambda p: p["ratio"])


def plot(rows: list[dict], path: str, title: str, ylim: tuple[float, float] = (-1.0, 15.0)
         ) -> None:
    """Perplexity increase (mean over texts, %) vs compression ratio, PNG: one
    marker per family, each family's Pareto front as a line, points above
    ``ylim`` drawn at the edge with their value, the target lines, the
    uncompressed point; labels placed greedily where they overlap nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = ylim
    fig, ax = plt.subplots(figsize=(11, 6.5))
    ax.set_ylim(lo, hi + 0.6)
    xmax = max(r["ratio"] for r in rows) * 1.06
    ax.set_xlim(0.8, xmax)
    ax.axhline(0, color="black", lw=0.5)
    targets = []
    for y, x0, text, color in ((2, 4, "target: >= 4x at <= +2 %", "tab:green"),
                               (5, 8, "target: >= 8x at <= +5 %", "tab:olive")):
        ax.axhline(y, color=color, lw=0.7, ls=":")
        ax.plot([x0, xmax], [y, y], color=color, lw=1.6, ls="--")
        ax.axvline(x0, color=color, lw=0.7, ls=":")
        targets.append(ax.text(x0 + 0.05, y + 0.15, text, color=color, fontsize=8))
    ax.scatter([1.0], [0.0], marker="*", s=140, color="black", zorder=5,
               label="uncompressed (16-bit K+V)")
    placed = []  # label boxes (display coordinates) already drawn
    renderer = fig.canvas.get_renderer()
    labelled = []
    for fam, (legend, marker, color) in FAMILIES.items():
        pts = [r for r in rows if family(r) == fam and r["ratio"] > 1]
        if not pts:
            continue
        shown = [min(r["delta"], hi) for r in pts]
        clipped = [r["delta"] > hi for r in pts]
        ax.scatter([r["ratio"] for r, c in zip(pts, clipped) if not c],
                   [y for y, c in zip(shown, clipped) if not c], marker=marker, color=color,
                   s=36, label=legend, zorder=4)
        if any(clipped):
            ax.scatter([r["ratio"] for r, c in zip(pts, clipped) if c], [hi] * sum(clipped),
                       marker=marker, facecolors="none", edgecolors=color, s=36, zorder=4)
        front = pareto(pts)
        ax.plot([p["ratio"] for p in front], [min(p["delta"], hi) for p in front],
                color=color, lw=1.2, alpha=0.8, zorder=3)
        for r in pts:
            text = _label(r["name"]) + (f" ({r['delta']:+.0f} %)" if r["delta"] > hi else "")
            labelled.append((r["ratio"], min(r["delta"], hi), text, color))
    legend = ax.legend(fontsize=7.5, loc="upper right", bbox_to_anchor=(1.0, 0.96))
    fig.canvas.draw()
    from matplotlib.text import Text

    placed += [t.get_window_extent(renderer) for t in targets]
    placed.append(legend.get_window_extent(renderer))

    offsets = [(5, 3), (5, -9), (-5, 3), (-5, -9), (5, 10), (-5, 10), (5, -16), (-5, -16),
               (14, 20), (-14, 20), (14, -26), (-14, -26), (8, 32), (-8, 32), (8, -38),
               (-8, -38), (20, 44), (-20, 44), (20, -50), (-20, -50), (30, 0), (-30, 0),
               (10, 58), (-10, 58), (10, -64), (-10, -64)]
    points = [ax.transData.transform((x, y)) for x, y, _, _ in labelled]
    for x, y, text, color in sorted(labelled):
        best = None
        for dx, dy in offsets:
            far = abs(dx) > 6 or abs(dy) > 12
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                            fontsize=6.5, color=color, ha="left" if dx > 0 else "right",
                            va="center", arrowprops=dict(arrowstyle="-", color=color, lw=0.4)
                            if far else None)
            t.update_positions(renderer)  # the offset text's place, before drawing
            box = Text.get_window_extent(t, renderer).expanded(1.04, 1.2)
            hits = sum(box.overlaps(o) for o in placed) + sum(
                box.contains(px, py) for px, py in points)
            if best is None or hits < best[0]:
                if best is not None:
                    best[1].remove()
                best = (hits, t, box)
            else:
                t.remove()
            if hits == 0:
                break
        placed.append(best[2])
    ax.text(xmax * 0.995, hi + 0.3, f"points above +{hi:g} % drawn at the edge (hollow), "
            "value in the label", ha="right", va="center", fontsize=7, color="dimgray")
    ax.set_xlabel("compression ratio (16-bit K+V bytes / allocated bytes per token)")
    ax.set_ylabel("perplexity increase, mean of the two texts (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size of every setting (vLLM's CPU attention needs a "
                        "multiple of 32); default: each setting's own (setting_block)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--windows", type=int, default=1, help="windows per text")
    p.add_argument("--texts", nargs="+", default=["wikipedia", "bbc"])
    p.add_argument("--step", type=int, default=32, help="tokens per request per step")
    p.add_argument("--only", nargs="+", default=None,
                   help="only the settings named by one of these (and the baseline): a "
                        "setting's whole name selects it alone, any other string every "
                        "setting whose name contains it")
    p.add_argument("--json", default=None, help="write (and resume from) every number")
    p.add_argument("--plot", default=None, help="write the frontier plot (PNG) here")
    p.add_argument("--peers", default=None,
                   help="JSON of benchmarks/peer_caches.py --json: add vLLM's own caches")
    p.add_argument("--rows", default=None,
                   help="rows of our settings saved by --save-rows: print and plot them "
                        "instead of running engines")
    p.add_argument("--save-rows", default=None, help="write the rows of this run here")
    p.add_argument("--gpu", default=None,
                   help="JSON of benchmarks/gpu_serving.py --json with an --equal-memory "
                        "load: adds each setting's output tokens/s vs stock at equal KV "
                        "memory (GPU_CONFIGS names which gpu_serving config serves it)")
    p.add_argument("--corpus", default=DEFAULT_TEXT,
                   help="calibration text of our settings (a name of "
                        "vllm_lowrank.calibration.text.CALIBRATION_TEXTS); rows are named "
                        "with it unless it is the default text")
    p.add_argument("--calibration-tokens", type=int, default=None,
                   help="calibration tokens of the --corpus artifact (default: calibrate's)")
    args = p.parse_args()
    if args.calibration_tokens and args.corpus == DEFAULT_TEXT:
        p.error(f"--calibration-tokens sets the size of a --corpus artifact; the default text "
                f"({DEFAULT_TEXT}) serves the cached default artifact: pass --corpus mix")

    rows = load_rows(args.rows) if args.rows else measure_rows(args)
    if args.save_rows:
        with open(args.save_rows, "w") as f:
            json.dump(rows, f, indent=1)
    if args.peers:
        rows += peer_rows(args.peers, args.texts, args.windows, args.context)
    title = (f"{args.model}, {args.windows} x {args.context} held-out tokens per text, "
             f"{args.step}-token steps, block size "
             f"{args.block_size or '32 (64 where key groups span 64 tokens)'}"
             + ("; vLLM's caches simulated (same windows)" if args.peers else ""))
    print(f"\n{title}\n")
    head = " | ".join(f"{t} ppl" for t in args.texts)
    gpu = gpu_ratios(args.gpu) if args.gpu else None
    print(f"| setting | kind | bytes / token (of 16-bit K+V) | compression ratio | {head} "
          "| mean change | worst domain |" + (" GPU tok/s vs stock |" if gpu else ""))
    print("|---|---|---|---|" + "---|" * len(args.texts) + "---|---|" + ("---|" if gpu else ""))
    for row in sorted(rows, key=lambda x: x["ratio"]):
        base = row["kind"] == "peer" and row["ratio"] == 1.0
        cells = [f"{q:.3f}" + ("" if base else f" ({d:+.1f} %)")
                 for q, d in zip(row["ppl"], row["deltas"])]
        mean = "" if base else f"{row['delta']:+.1f} %"
        worst = "" if base else f"{max(row['deltas']):+.1f} %"
        extra = ""
        if gpu is not None:
            ratio = gpu.get(GPU_CONFIGS.get(row["name"], ""))
            extra = f" {ratio:.2f} |" if ratio is not None else " |"
        print(f"| {row['name']} | {row['kind']} | {1 / row['ratio']:.3f} | {row['ratio']:.2f}x | "
              f"{' | '.join(cells)} | {mean} | {worst} |{extra}")
    if args.plot:
        plot(rows, args.plot, title)
        print(f"\nplot: {args.plot}")


GPU_CONFIGS = {
    "uncompressed": "stock",
    "preset 2x": "default",
    "preset lossless": "preset-lossless",
    "preset 4x": "preset-4x",
    "4x recipe, no sink, recent 128": "preset-4x-nosink",
    "post-RoPE full rank, K4/V4 per token": "pr-k4v4",
    "post-RoPE keys K4/32 per channel, values full rank V2 G=1, int8 exact": "prk-v2r1.0",
    "post-RoPE keys K4/32 per channel, values full rank V4 G=1, int8 exact": "prk-v4r1.0",
    "post-RoPE keys K4/32 per channel, values latent 0.5 V4 G=1, int8 exact": "prk-v4r0.5",
    "latent 0.5, K4 per channel, V4, sink 32 + recent 128": "jlrd-0.5-tale",
}
"""Frontier setting -> the ``benchmarks/gpu_serving.py`` config that serves the same
storage at the Llama-3-8B shape (dummy weights), for ``--gpu``."""


def gpu_ratios(path: str) -> dict[str, float]:
    """``{gpu_serving config: output tokens/s over stock's}`` of the equal-memory
    load rows in a ``gpu_serving.py --json`` file (stock of the same file)."""
    with open(path) as f:
        rows = [r for r in json.load(f) if r.get("mode") == "load" and "out_tok_s" in r]
    stock = next((r["out_tok_s"] for r in rows if r["config"] == "stock"), None)
    if stock is None:
        raise SystemExit(f"{path} has no stock row of an --equal-memory load")
    return {r["config"]: r["out_tok_s"] / stock for r in rows}


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        rows = json.load(f)
    for r in rows:
        r["delta"] = sum(r["deltas"]) / len(r["deltas"])
    return rows


def measure_rows(args) -> list[dict]:
    """Run (or resume from ``--json``) every selected setting through vLLM."""
    from vllm_lowrank.cli import resolve_model
    from vllm_lowrank.evaluation import run_setting

    model = resolve_model(args.model)
    import transformers

    from vllm_lowrank.calibration.artifact import read_manifest
    from vllm_lowrank.models.compression import model_shapes

    head_dim = model_shapes(transformers.AutoConfig.from_pretrained(model))[0].head_dim
    names = [n for n in SETTINGS if n == "uncompressed" or selected(n, args.only)]
    results = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)

    def key(name: str) -> str:  # results and rows: named with a non-default corpus
        ours = SETTINGS[name][0] == "ours"
        tokens = f", {args.calibration_tokens} tokens" if args.calibration_tokens else ""
        return f"{name} [{args.corpus}{tokens} calibration]" \
            if ours and args.corpus != DEFAULT_TEXT else name

    for name in names:
        if key(name) in results:
            continue
        kind, cfg = SETTINGS[name]
        corpus = args.corpus if kind == "ours" else DEFAULT_TEXT
        if corpus != DEFAULT_TEXT and cfg.get("preset") == "8x":
            continue  # allocates from the default artifact: the "allocated 8x" rows instead
        block = setting_block(cfg, args.block_size)
        spec = {"model": model,
                "compression": compression_of(model, cfg, args.context, block,
                                              corpus, args.calibration_tokens),
                "texts": args.texts, "num_windows": args.windows, "window": args.context,
                "passkey": None, "block_size": block, "step_tokens": args.step}
        results[key(name)] = run_setting(spec)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(f"done: {name}", flush=True)
    base = results["uncompressed"]
    rows = []
    for name in names:
        kind, cfg = SETTINGS[name]
        if key(name) not in results:
            continue
        r = results[key(name)]
        if cfg is None:
            ratio = 1.0
        else:
            serving = None
            block = setting_block(cfg, args.block_size)
            if "allocate" in cfg:
                path = allocation_artifact(model, cfg, args.context, block,
                                           args.corpus if kind == "ours" else DEFAULT_TEXT,
                                           args.calibration_tokens)
                serving = read_manifest(path)["ranks"]["serving"]
            original, allocated = allocated_bytes(r["layers"], cfg, head_dim, args.context,
                                                  block, serving)
            ratio = original / allocated
        deltas = [100 * (r[t]["ppl"] / base[t]["ppl"] - 1) for t in args.texts]
        rows.append({"name": key(name), "kind": kind, "ratio": ratio,
                     "ppl": [r[t]["ppl"] for t in args.texts], "deltas": deltas,
                     "delta": sum(deltas) / len(deltas)})
    return rows


if __name__ == "__main__":
    main()
