"""The schema of an artifact's ``manifest.json``, and the checks of its tensors.

An artifact is data from outside the process (a shared volume, a download):
nothing in it is used before it passed these checks, and a failure names the
field. :func:`check_manifest` and :func:`check_allocation` (``ranks``) cover every
field the plugin reads:

- ``format_version`` (read first, :func:`vllm_lowrank.calibration.artifact.read_manifest`),
  ``method`` (one of :data:`~vllm_lowrank.config.METHODS`), ``group_size``
  (dividing ``model.num_kv_heads``);
- ``model``: ``architecture``, ``fingerprint`` (strings), ``num_layers``,
  ``hidden_size``, ``num_heads``, ``num_kv_heads`` (dividing ``num_heads``),
  ``head_dim`` (bounded positive integers);
- ``ranks`` (``null`` or an object): ``ratio`` (``null`` or in ``(0, 1]``),
  ``allocation``, ``fixed`` (boolean), ``layers`` (one entry per layer, keys
  ``^[0-9]+$``, ``[k_ranks, v_ranks]`` with one rank per head group in
  ``1..group_size * head_dim``), and for a byte-budget allocation ``bits``
  (one ``[k_bits, v_bits]`` per layer from
  :data:`~vllm_lowrank.config.STORAGE_BITS`) and ``serving`` (keys from
  :data:`SERVING_KEYS`, each valid as a
  ``--kv-compression-config`` setting; a key missing from an artifact made
  before it existed keeps the config's value).

:func:`check_basis` checks one basis: shapes against the model, every value
finite, energies non-negative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_lowrank.config import (
    METHODS,
    RANK_MULTIPLE,
    RANK_ALLOCATIONS,
    STORAGE_BITS,
    LowRankConfig,
    LowRankConfigError,
)
from vllm_lowrank.inputs import layer_map

MAX_DIM = 1 << 20
"""Bound on every geometry integer of a manifest (layers, widths, heads)."""
ALLOCATIONS = (*RANK_ALLOCATIONS, "bytes")
"""``ranks.allocation`` values: a config's allocation, or a byte budget."""

_MODEL_STRINGS = ("architecture", "fingerprint")
_MODEL_INTEGERS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")

SERVING_KEYS = ("token_adaptive", "sink_tokens", "recent_tokens", "exact_bits", "k_quant",
                "k_channel_tokens", "quant_group_size", "hadamard")
"""Settings an allocation assumes and records; serving takes them from the artifact."""


def _refuse(path: str, field: str, problem: str) -> LowRankConfigError:
    return LowRankConfigError(
        f"calibration artifact {path!r}: manifest.json has a missing or invalid {field!r} "
        f"({problem}); the artifact is damaged or not made by this plugin; re-run "
        "`vllm-lowrank calibrate`")


def _integer(value: Any, path: str, field: str, low: int = 1, high: int = MAX_DIM) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(path, field, f"must be an integer in {low}..{high}, got {value!r:.40}")
    return value


def check_manifest(manifest: Mapping[str, Any], path: str) -> None:
    """Refuse a manifest that does not follow the schema (module docstring).

    Raises:
        LowRankConfigError: names the first bad field and what it must be.
    """
    if manifest.get("method") not in METHODS:
        raise _refuse(path, "method", f"must be one of {list(METHODS)}, "
                      f"got {manifest.get('method')!r:.40}")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise _refuse(path, "model", "must be an object")
    for key in _MODEL_STRINGS:
        if not isinstance(model.get(key), str) or not model[key]:
            raise _refuse(path, f"model.{key}", f"must be a non-empty string, got "
                          f"{model.get(key)!r:.40}")
    for key in _MODEL_INTEGERS:
        _integer(model.get(key), path, f"model.{key}")
    if model["num_heads"] % model["num_kv_heads"]:
        raise _refuse(path, "model.num_kv_heads", f"({model['num_kv_heads']}) must divide "
                      f"model.num_heads ({model['num_heads']})")
    group_size = _integer(manifest.get("group_size"), path, "group_size")
    if model["num_kv_heads"] % group_size:
        raise _refuse(path, "group_size", f"({group_size}) must divide model.num_kv_heads "
                      f"({model['num_kv_heads']})")
    if not isinstance(manifest.get("calibration", {}), dict):
        raise _refuse(path, "calibration", "must be an object")


def check_allocation(manifest: Mapping[str, Any], path: str) -> None:
    """Refuse a ``ranks`` entry that does not follow the schema (module
    docstring); the rest of ``manifest`` passed :func:`check_manifest`. Run
    after the model geometry was compared, so that an artifact of another
    model is refused as such rather than for its per-layer entries.

    Raises:
        LowRankConfigError: names the first bad field and what it must be.
    """
    ranks = manifest.get("ranks")
    if ranks is not None:
        _check_ranks(ranks, path, manifest["model"], manifest["group_size"])


def _check_ranks(ranks: Any, path: str, model: Mapping[str, Any], group_size: int) -> None:
    if not isinstance(ranks, dict):
        raise _refuse(path, "ranks", "must be null or an object")
    known = {"ratio", "allocation", "fixed", "layers", "bits", "serving", "budget"}
    unknown = sorted(set(ranks) - known)
    if unknown:
        raise _refuse(path, f"ranks.{unknown[0]}", f"is not a known field ({sorted(known)})")
    ratio = ranks.get("ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0 < ratio <= 1):
        raise _refuse(path, "ranks.ratio", f"must be null or a number in (0, 1], got {ratio!r:.40}")
    if ranks.get("allocation") not in ALLOCATIONS:
        raise _refuse(path, "ranks.allocation", f"must be one of {list(ALLOCATIONS)}, got "
                      f"{ranks.get('allocation')!r:.40}")
    if not isinstance(ranks.get("fixed"), bool):
        raise _refuse(path, "ranks.fixed", f"must be true or false, got {ranks.get('fixed')!r:.40}")
    if ranks.get("budget") is not None and not isinstance(ranks["budget"], dict):
        raise _refuse(path, "ranks.budget", "must be an object")
    layers = _per_layer(ranks.get("layers"), path, "ranks.layers", model["num_layers"])
    groups = model["num_kv_heads"] // group_size
    full = group_size * model["head_dim"]
    for layer, entry in layers.items():
        field = f"ranks.layers.{layer}"
        if not isinstance(entry, list) or len(entry) != 2:
            raise _refuse(path, field, "must be [k_ranks, v_ranks]")
        for side, side_ranks in zip("kv", entry):
            if not isinstance(side_ranks, list) or len(side_ranks) != groups:
                raise _refuse(path, f"{field}.{side}", f"must list {groups} rank(s), one per "
                              "head group")
            for r in side_ranks:
                _integer(r, path, f"{field}.{side}", 1, full)
    if "bits" not in ranks and "serving" not in ranks:
        return
    if not ranks["fixed"]:
        raise _refuse(path, "ranks.fixed", "must be true when bits are recorded (a "
                      "byte-budget allocation is served as recorded)")
    bits = _per_layer(ranks.get("bits"), path, "ranks.bits", model["num_layers"])
    for layer, pair in bits.items():
        if (not isinstance(pair, list) or len(pair) != 2
                or any(isinstance(b, bool) or b not in STORAGE_BITS for b in pair)):
            raise _refuse(path, f"ranks.bits.{layer}", f"must be [k_bits, v_bits] from "
                          f"{list(STORAGE_BITS)}, got {pair!r:.40}")
    _check_serving(ranks.get("serving"), path)
    multiple = ranks["serving"].get("quant_group_size") or RANK_MULTIPLE
    for layer, pair in bits.items():
        for side, side_bits, side_ranks in zip("kv", pair, layers[layer]):
            if side_bits < 16 and any(r % multiple for r in side_ranks):
                raise _refuse(path, f"ranks.layers.{layer}.{side}",
                              f"ranks {side_ranks} stored at {side_bits} bits must be "
                              f"multiples of {multiple} (the packed quantization group)")


def _per_layer(raw: Any, path: str, field: str, num_layers: int) -> dict[int, Any]:
    """``{layer: entry}`` covering exactly layers ``0..num_layers-1``."""
    if raw is None:
        raise _refuse(path, field, "is missing")
    try:
        entries = layer_map(raw, field)
    except LowRankConfigError as e:
        raise _refuse(path, field, str(e)) from None
    if sorted(entries) != list(range(num_layers)):
        raise _refuse(path, field, f"must have one entry per layer 0..{num_layers - 1}, has "
                      f"{sorted(entries)[:8]}")
    return entries


def _check_serving(serving: Any, path: str) -> None:

    if not isinstance(serving, dict):
        raise _refuse(path, "ranks.serving", "must be an object of the settings the "
                      "allocation assumed")
    for key in sorted(set(serving) - set(SERVING_KEYS)):
        raise _refuse(path, f"ranks.serving.{key}", f"not a serving setting; those are "
                      f"{list(SERVING_KEYS)}")
    try:  # placeholder bits: per-channel keys need quantized keys (the bits are per layer)
        LowRankConfig.from_dict({"mode": "lowrank", **serving, "k_bits": 8, "v_bits": 8})
    except LowRankConfigError as e:
        raise _refuse(path, "ranks.serving", str(e)) from None


def check_basis(path: str, key: str, a: torch.Tensor, b: torch.Tensor, energy: torch.Tensor,
                hidden: int, width: int) -> None:
    """Refuse a basis whose shapes do not fit the model, with a non-finite value
    or a negative energy.

    Args:
        path: The artifact (for messages).
        key: Tensor name prefix, e.g. ``"l3.k0"``.
        a, b, energy: ``[hidden, k]``, ``[k, width]``, ``[k]`` with
            ``1 <= k <= width``.
        hidden: The model's hidden size.
        width: The head group's K or V width (``group_size * head_dim``).

    Raises:
        LowRankConfigError: names the tensor.
    """
    k = energy.shape[0] if energy.dim() == 1 else -1
    if not 1 <= k <= width or a.shape != (hidden, k) or b.shape != (k, width):
        raise LowRankConfigError(
            f"calibration artifact {path!r}: {key} has shapes {tuple(a.shape)} / "
            f"{tuple(b.shape)} / {tuple(energy.shape)} (a / b / e), expected "
            f"({hidden}, k) / (k, {width}) / (k,) with 1 <= k <= {width} for this model; "
            "re-run `vllm-lowrank calibrate`")
    for name, t in (("a", a), ("b", b), ("e", energy)):
        if not t.is_floating_point():
            raise LowRankConfigError(
                f"calibration artifact {path!r}: tensor {key}.{name} is {t.dtype}, not "
                "floating point; the artifact is damaged; re-run `vllm-lowrank calibrate`")
        if not bool(torch.isfinite(t).all()):
            raise LowRankConfigError(
                f"calibration artifact {path!r}: tensor {key}.{name} has non-finite values "
                "(NaN or infinity); the artifact is damaged; re-run `vllm-lowrank calibrate`")
    if bool((energy < 0).any()):
        raise LowRankConfigError(
            f"calibration artifact {path!r}: tensor {key}.e has negative energies "
            f"(min {float(energy.min()):.3g}); energies are removed objective and never "
            "negative; re-run `vllm-lowrank calibrate`")


def check_fixed_ranks(manifest: Mapping[str, Any], bases: Mapping[int, Any], path: str) -> None:
    """Refuse a fixed allocation that keeps more components of a basis than the
    artifact stores (full width excepted: it uses the identity basis).

    Args:
        manifest: A manifest that passed :func:`check_manifest`.
        bases: ``{layer: (k_bases, v_bases)}`` as loaded.
        path: The artifact (for messages).

    Raises:
        LowRankConfigError: names the layer and side.
    """
    ranks = manifest.get("ranks")
    if not ranks or not ranks["fixed"]:
        return
    for layer, entry in layer_map(ranks["layers"], "ranks.layers").items():
        for s, (side, side_ranks) in enumerate(zip("kv", entry)):
            for g, r in enumerate(side_ranks):
                basis = bases[layer][s][g]
                if basis.energy.shape[0] < r < basis.full_width:
                    raise _refuse(path, f"ranks.layers.{layer}.{side}",
                                  f"keeps rank {r} of group {g}, but its basis has only "
                                  f"{basis.energy.shape[0]} components")
