"""Byte-budget allocation of a calibrated model: measure, solve, write an artifact.

``budget_artifact`` takes a ``fisher`` artifact, runs the model on calibration
text to get real latents, prices every (rank, bits) choice of every layer with
objective (2) of :mod:`vllm_lowrank.factorization.budget` under the cache's own
quantizer, solves for a target (bytes per token, a compression ratio, or an
estimated perplexity increase) and returns the artifact with the allocation
recorded as fixed: ranks and bits per layer, plus the serving settings the
allocation assumed (exact tokens, per-channel keys, Hadamard, quantization
groups). ``vllm serve MODEL --kv-compression lowrank --kv-compression-config
'{"artifact": DIR}'`` then serves exactly that (:func:`vllm_lowrank.models.compression.resolve`).

Global knobs (Hadamard on or off, per-channel or per-token keys, and in the
token-adaptive mode the given recent window or twice it) are chosen by solving
once per combination and keeping the smallest objective. The exact tokens'
bytes are charged to the budget at the stated context length (at
``exact_bits``); their benefit enters through the TALE-aware metric, which
counts only the attention entries read from latents. The sink count and
``exact_bits`` are an input.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.calibration.schema import SERVING_KEYS
from vllm_lowrank.config import LOSS_METHODS, LowRankConfig, LowRankConfigError
from vllm_lowrank.factorization import budget as bud

logger = logging.getLogger("vllm.lowrank")



def serving_config(raw: Mapping[str, Any]) -> LowRankConfig:
    """The settings an allocation assumes, from a ``--kv-compression-config``
    mapping without bits (the allocation chooses them per layer).

    Raises:
        LowRankConfigError: ``k_bits``/``v_bits`` given, or a bad setting.
    """
    if {"k_bits", "v_bits"} & set(raw):
        raise LowRankConfigError("the allocation chooses k_bits and v_bits per layer; "
                                 "drop them from the settings")
    # validation of k_quant "channel" wants quantized keys: placeholder bits
    return LowRankConfig.from_dict({"mode": "lowrank", **raw, "k_bits": 8, "v_bits": 8})


def calibration_latents(model, windows: list[list[int]], artifact: art.Artifact):
    """Full-basis latents of every layer, side and head group on calibration text.

    Args:
        model: The Hugging Face model; windows: token ids of the calibration
            windows; artifact: its bases.

    Returns:
        ``{layer: (k_latents, v_latents)}``, lists of ``[T, n]`` float32 per
        head group (``T = num_windows * WINDOW`` consecutive positions).
    """
    from vllm_lowrank.calibration.collect import collect_projected

    cols = {i: torch.cat([b.a for side in bases for b in side], dim=1)
            for i, bases in artifact.bases.items()}
    lat = collect_projected(model, windows, cols)
    out = {}
    for i, (kb, vb) in artifact.bases.items():
        parts = torch.split(lat[i], [b.a.shape[1] for b in (*kb, *vb)], dim=1)
        out[i] = (list(parts[:len(kb)]), list(parts[len(kb):]))
    return out


def loss_metrics(model, windows: list[list[int]], artifact: art.Artifact, exact):
    """Objective metrics ``M`` (:func:`~vllm_lowrank.factorization.budget.side_loss`)
    per layer, side and head group.

    Without exact tokens (``exact`` ``None``): ``diag(energy)`` of the fisher
    bases (eq. 1). With exact tokens (an
    :class:`~vllm_lowrank.format.exact.ExactTokens`): ``B G B^T`` with ``G`` the gradient
    second moment of the keys and values read from latents only
    (:func:`~vllm_lowrank.calibration.collect.collect_far_gradients`): the
    calibration Fisher is dominated by what the exact tokens already cover
    (attention sinks, nearby tokens).
    """
    if exact is None:
        return {i: tuple([torch.diag(b.energy.double()) for b in side] for side in bases)
                for i, bases in artifact.bases.items()}
    from vllm_lowrank.calibration.calibrate import rope_inv_freq
    from vllm_lowrank.calibration.collect import collect_far_gradients

    grads = collect_far_gradients(model, windows, sink=exact.sink,
                                  recent=exact.recent, inv_freq=lambda i: rope_inv_freq(model, i))
    out = {}
    for i, bases in artifact.bases.items():
        sides = []
        for side, g in zip(bases, grads[i]):
            ms = []
            for j, b in enumerate(side):
                n = b.b.shape[1]
                blk = g[j * n:(j + 1) * n, j * n:(j + 1) * n]
                bb = b.b.double()
                ms.append(bb @ blk @ bb.T)
            sides.append(ms)
        out[i] = tuple(sides)
    return out


def layer_fronts(artifact: art.Artifact, latents, metrics, storage: bud.Storage,
                 bits_options=bud.BITS, device: torch.device | str = "cpu"
                 ) -> dict[int, list[bud.LayerChoice]]:
    """``{layer: Pareto front}`` of (K, V) choices under ``storage``; the
    losses of every (rank, bits) are computed on ``device``, one layer's
    latents there at a time (a GPU takes an 8B model's thousands of
    ``[T, n] x [n, n]`` float64 products in seconds rather than an hour)."""
    fronts = {}
    for i, (kb, vb) in artifact.bases.items():
        sides = []
        for s, (side, bases) in enumerate((("k", kb), ("v", vb))):
            sides.append(bud.side_options([c.to(device) for c in latents[i][s]],
                                          [m.to(device) for m in metrics[i][s]],
                                          [b.b.to(device) for b in bases], storage, side=side,
                                          layer=i, bits_options=bits_options))
        fronts[i] = bud.layer_front(*sides)
    return fronts


def exact_costs(cfg: LowRankConfig, kv_widths: dict[int, int], head_dim: int, context: int,
                block_size: int):
    """``{layer: f(choice, slot)}``: amortised bytes per token of the exact
    tokens in a 16-bit deployment (``None`` without ``token_adaptive``): their
    slots (:class:`~vllm_lowrank.format.exact.ExactSlot`, stored at
    ``cfg.exact_bits``) times their share of a ``context``-token sequence."""
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.format.exact import exact_tokens

    exact = exact_tokens(cfg, block_size)
    if exact is None:
        return None
    share = exact.count / context

    def cost(kvw):
        def f(choice, slot):
            staged = sum(choice.k.ranks) if (cfg.k_quant == "channel"
                                              and choice.k.bits < 16) else 0
            return share * ExactSlot(kvw, head_dim, torch.float16, exact.bits, staged,
                                     slot).slot_bytes
        return f

    return {i: cost(w) for i, w in kv_widths.items()}


def solve(fronts, cfg: LowRankConfig, kv_widths: dict[int, int], *, head_dim: int,
          context: int, block_size: int, one_page: bool, bytes_per_token: float | None = None,
          max_loss: float | None = None) -> bud.Allocation:
    """The allocation for a byte target, or the cheapest one whose objective is
    at most ``max_loss`` nats (exactly one of the two).

    Raises:
        LowRankConfigError: no allocation meets the target.
    """
    costs = exact_costs(cfg, kv_widths, head_dim, context, block_size)
    if (bytes_per_token is None) == (max_loss is None):
        raise ValueError("give exactly one of bytes_per_token and max_loss")
    try:
        if bytes_per_token is not None:
            return bud.allocate_bytes(fronts, bytes_per_token, one_page=one_page,
                                      exact_cost=costs)
        # the objective falls as the budget grows: bisect on bytes
        hi = float(sum(f[-1].natural_bytes for f in fronts.values())) * 4
        top = bud.allocate_bytes(fronts, hi, one_page=one_page, exact_cost=costs)
        if top.objective > max_loss:
            raise LowRankConfigError(
                f"no allocation reaches an estimated loss of {max_loss:.4f} nats "
                f"(best {top.objective:.4f}); raise the perplexity budget")
        lo = 0.0
        best = top
        while hi - lo > 0.5:
            mid = (lo + hi) / 2
            try:
                a = bud.allocate_bytes(fronts, mid, one_page=one_page, exact_cost=costs)
            except ValueError:
                lo = mid
                continue
            if a.objective <= max_loss:
                hi, best = mid, a
            else:
                lo = mid
        return best
    except ValueError as e:
        raise LowRankConfigError(str(e)) from None


def budget_artifact(model_path: str, artifact: art.Artifact, cfg: LowRankConfig, *,
                    ratio: float | None = None, bytes_per_token: float | None = None,
                    ppl_increase: float | None = None, context: int = 4096,
                    block_size: int = 32, num_windows: int = 4, one_page: bool | None = None,
                    choose_knobs: bool = True,
                    documents: list[str] | None = None, device: str = "cpu",
                    dtype: str = "float32", bits_options=bud.BITS
                    ) -> tuple[art.Artifact, dict]:
    """Allocate ranks and bits for a target and record them in a copy of ``artifact``.

    Args:
        model_path: Hugging Face checkpoint the artifact was calibrated for.
        artifact: A ``fisher`` artifact (its energies are in loss units).
        cfg: Serving settings the allocation assumes (:data:`SERVING_KEYS`);
            ``k_quant: "channel"`` allows per-channel keys, ``hadamard`` the
            rotation, and ``choose_knobs`` tries the alternatives too.
        ratio: Target compression ratio (16-bit K+V bytes / allocated bytes per token).
        bytes_per_token: Target bytes per token over all layers.
        ppl_increase: Target estimated perplexity increase (fraction, e.g.
            0.05): the fewest bytes whose objective is at most ``log(1 + p)``.
        context: Tokens per sequence over which the exact tokens are amortised.
        block_size: vLLM KV block size (exact tokens round up to whole blocks;
            per-channel key groups must divide it).
        num_windows: Calibration windows (of 1024 tokens) to measure on.
        documents: Calibration text (default: the built-in
            :data:`~vllm_lowrank.calibration.text.DEFAULT_CALIBRATION_TEXT`).
        one_page: One slot size for every layer (default: with
            ``token_adaptive``, where vLLM needs one page size).
        choose_knobs: Also try Hadamard flipped, per-token keys and (token-adaptive
            mode) twice the recent window, and keep the best objective
            (:func:`exact_window_variants`, :func:`knob_variants`).
        device, dtype: Where and in which dtype the model runs on the
            calibration text (:mod:`~vllm_lowrank.calibration.device`); the
            losses of every choice are measured on ``device`` too
            (:func:`layer_fronts`), the allocation is solved on the CPU.
        bits_options: Code widths a side may be stored at (a subset of
            :data:`~vllm_lowrank.factorization.budget.BITS`).

    Returns:
        ``(artifact with manifest["ranks"] fixed, report dict)``.

    Raises:
        LowRankConfigError: not a fisher artifact, no or several targets, a
            target no allocation meets, bits outside ``BITS``, or a device or
            dtype the run cannot use.
    """
    from vllm_lowrank.calibration.calibrate import load_for_calibration

    bits_options = tuple(sorted(set(bits_options), reverse=True))
    if not bits_options or not set(bits_options) <= set(bud.BITS):
        raise LowRankConfigError(f"bits {list(bits_options)} must be a non-empty subset of "
                                 f"{list(bud.BITS)}")
    if artifact.manifest["method"] not in LOSS_METHODS:
        raise LowRankConfigError(
            f"byte-budget allocation needs an artifact calibrated with a method of "
            f"{list(LOSS_METHODS)} "
            f"(its energies are loss increases); got {artifact.manifest['method']!r}")
    if sum(x is not None for x in (ratio, bytes_per_token, ppl_increase)) != 1:
        raise LowRankConfigError("give exactly one target: ratio, bytes_per_token or "
                                 "ppl_increase")
    m = artifact.manifest["model"]
    kv_width = m["num_kv_heads"] * m["head_dim"]
    kv_widths = {i: kv_width for i in artifact.bases}
    original = sum(4 * w for w in kv_widths.values())  # 16-bit K + V
    if ratio is not None:
        if ratio <= 1:
            raise LowRankConfigError(f"ratio={ratio} must be > 1 (a compression ratio)")
        bytes_per_token = original / ratio
    one_page = cfg.token_adaptive if one_page is None else one_page
    from vllm_lowrank.calibration import text as texts
    from vllm_lowrank.calibration.calibrate import WINDOW

    model, tok = load_for_calibration(model_path, device, dtype, gradients=True)
    windows = texts.token_windows(
        tok, documents if documents is not None else texts.calibration_documents(),
        num_windows, WINDOW)
    latents = calibration_latents(model, windows, artifact)
    from vllm_lowrank.format.exact import exact_tokens

    results = []
    for window in exact_window_variants(cfg, choose_knobs):
        metrics = loss_metrics(model, windows, artifact, exact_tokens(window, block_size))
        for v in knob_variants(window, choose_knobs):
            storage = bud.Storage(quant_group=v.quant_group_size, hadamard=v.hadamard,
                                  k_channel_tokens=(v.k_channel_tokens if v.k_quant == "channel"
                                                    else None),
                                  multiple=v.rank_multiple)
            fronts = layer_fronts(artifact, latents, metrics, storage, bits_options,
                                  device=model.device)
            knobs = {k: getattr(v, k) for k in SERVING_KEYS}
            try:
                a = solve(fronts, v, kv_widths, head_dim=m["head_dim"], context=context,
                          block_size=block_size, one_page=one_page,
                          bytes_per_token=bytes_per_token,
                          max_loss=None if ppl_increase is None else math.log1p(ppl_increase))
            except LowRankConfigError as e:
                logger.info("vllm-lowrank: %s: %s", knobs, e)
                continue
            results.append((a.objective if ppl_increase is None else a.total_bytes, a, v))
            logger.info("vllm-lowrank: %s: objective %.4f nats at %.1f B", knobs, a.objective,
                        a.total_bytes)
    if not results:
        raise LowRankConfigError("no allocation meets the target with these settings; "
                                 "raise the budget")
    _, alloc, chosen = min(results, key=lambda r: r[0])
    out = art.Artifact(manifest=dict(artifact.manifest), bases=artifact.bases)
    report = {
        "target": {"ratio": ratio, "bytes_per_token": bytes_per_token,
                   "ppl_increase": ppl_increase},
        "context": context, "block_size": block_size, "bits_options": list(bits_options),
        "bytes_per_token": alloc.total_bytes,
        "compression_ratio": original / alloc.total_bytes,
        "objective_nats": alloc.objective,
        "estimated_ppl_increase": math.expm1(alloc.objective),
        "calibration_tokens": num_windows * 1024,
    }
    record_allocation(out, alloc, chosen, report)
    return out, report


def allocated_block_size(artifact: str | None) -> int | None:
    """The KV block size (tokens) a byte-budget allocation artifact was solved
    for (``manifest["ranks"]["budget"]["block_size"]``, written by
    :func:`budget_artifact`): its exact tokens are rounded up to whole blocks
    of it, so its bytes per token hold at that block size. ``None`` for
    ``"auto"``/``"none"``, an artifact without an allocation, or one that
    cannot be read (the engine's model check reports that, naming the
    problem)."""
    if artifact in (None, "auto", "none"):
        return None
    try:
        budget = (art.read_manifest(artifact).get("ranks") or {}).get("budget") or {}
    except LowRankConfigError:
        return None
    size = budget.get("block_size") if isinstance(budget, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def default_block_size(cfg: LowRankConfig) -> tuple[int | None, str | None]:
    """The KV block size (tokens) ``cfg`` is served with when the user gives no
    ``--block-size``, and where it comes from: the preset's, as measured
    (``"preset"``); else the one a byte-budget allocation artifact was solved for
    (``"artifact"``, :func:`allocated_block_size`); else ``(None, None)``: vLLM's
    own. The one rule of the engine (:mod:`vllm_lowrank.patches`) and of
    ``vllm-lowrank estimate``."""
    from vllm_lowrank.presets import get_preset

    if cfg.preset is not None and (size := get_preset(cfg.preset).block_size) is not None:
        return size, "preset"
    if (size := allocated_block_size(cfg.artifact)) is not None:
        return size, "artifact"
    return None, None


def exact_window_variants(cfg: LowRankConfig, choose: bool) -> list[LowRankConfig]:
    """The exact recent windows an allocation tries: ``cfg``'s, and with
    ``choose`` (token-adaptive mode) twice as many recent tokens. Each needs
    its own TALE-aware metric (the latent-read entries differ), and the
    objective compares them: a longer window moves the most sensitive latent
    reads (the nearest tokens) to exact storage, at its bytes."""
    out = [cfg]
    if choose and cfg.token_adaptive:
        out.append(dataclasses.replace(cfg, recent_tokens=2 * cfg.recent_tokens))
    return out


def knob_variants(cfg: LowRankConfig, choose: bool) -> list[LowRankConfig]:
    """``cfg`` and, with ``choose``, Hadamard flipped and (where per-channel
    keys are allowed) per-token keys: every combination."""
    variants = [cfg]
    if choose:
        variants += [dataclasses.replace(cfg, hadamard=not cfg.hadamard)]
        if cfg.k_quant == "channel":
            variants += [dataclasses.replace(v, k_quant="token") for v in list(variants)]
    return variants


def record_allocation(artifact: art.Artifact, alloc: bud.Allocation, cfg: LowRankConfig,
                      report: dict) -> None:
    """Write ``alloc`` into ``artifact.manifest["ranks"]`` as a fixed allocation
    with per-layer bits and the serving settings it assumes."""
    artifact.manifest["ranks"] = {
        "ratio": None, "allocation": "bytes", "fixed": True,
        "layers": {str(i): [list(c.k.ranks), list(c.v.ranks)]
                   for i, c in alloc.layers.items()},
        "bits": {str(i): [c.k.bits, c.v.bits] for i, c in alloc.layers.items()},
        "serving": {k: getattr(cfg, k) for k in SERVING_KEYS},
        "budget": report,
    }
