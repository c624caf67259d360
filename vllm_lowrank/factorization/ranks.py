"""Rank allocation under one global budget of latent width.

``energy`` (ZACK sec. 4.2, shared singular-value removal rate): every basis
(layer x K/V x head group) has an energy spectrum ``e_1 >= e_2 >= ...``, the
decrease of its objective per kept component
(:mod:`vllm_lowrank.factorization.bases`). Spectra are normalised to sum to one
so that key (score-space) and value (output-space) objectives are comparable,
then rank is given out in chunks of :data:`~vllm_lowrank.config.RANK_MULTIPLE`
to whichever basis gains the most normalised energy from its next chunk, until
the budget ``ratio * sum(2 * kv_width)`` is spent. Because spectra are
non-increasing, this greedy choice maximises the total kept normalised energy
for the budget, and equalises the removal rate across bases (up to the chunk
granularity). Every basis keeps at least one chunk.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import torch

from vllm_lowrank.config import RANK_MULTIPLE, LowRankConfigError
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan


def _chunk_gains(energy: torch.Tensor, full: int, normalize: bool,
                 multiple: int) -> list[float]:
    """Energy gained by each successive chunk of rank (last chunk may be
    shorter when ``full`` is not a multiple of the chunk), as a fraction of the
    basis' total when ``normalize``."""
    e = energy.double().clamp_min(0)
    total = (float(e.sum()) or 1.0) if normalize else 1.0
    gains = []
    for start in range(0, full, multiple):
        gains.append(float(e[start : start + multiple].sum()) / total)
    return gains


def energy_plans(
    shapes: Mapping[int, AttentionShape],
    group_size: int,
    spectra: Mapping[int, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    ratio: float,
    normalize: bool = True,
    multiple: int = RANK_MULTIPLE,
    full_keys: bool = False,
) -> dict[int, LayerPlan]:
    """Per-layer plans from the greedy energy allocation (module docstring).

    Args:
        shapes: ``{layer: shape}``.
        group_size: KV heads per group.
        spectra: ``{layer: (k_energies, v_energies)}``, one tensor per group.
        ratio: Fraction of the total K+V width to keep.
        normalize: Compare spectra as fractions of each basis' energy
            (``energy``); ``False`` compares raw energies, which is right when
            every objective is in the same unit (``fisher``: loss increase).
        multiple: Rank granularity (chunk size).
        full_keys: Keys keep their full width (``post_rope_keys``): the
            budget left after them goes to the values.

    Returns:
        ``{layer: LayerPlan}``.

    Raises:
        LowRankConfigError: the budget is smaller than one chunk per basis.
    """
    keys = []  # (layer, side, group)
    gains: dict[tuple[int, str, int], list[float]] = {}
    budget = 0
    for layer, shape in shapes.items():
        full = group_size * shape.head_dim
        budget += 2 * shape.kv_width
        k_e, v_e = spectra[layer]
        for side, energies in (("k", k_e), ("v", v_e)):
            for g, e in enumerate(energies):
                key = (layer, side, g)
                keys.append(key)
                gains[key] = _chunk_gains(e, full, normalize, multiple)
    budget = int(ratio * budget)
    ranks = {k: _full(shapes, group_size, k) if full_keys and k[1] == "k"
             else min(multiple, _full(shapes, group_size, k)) for k in keys}
    spent = sum(ranks.values())
    if spent > budget:
        raise LowRankConfigError(
            f"rank_fraction={ratio} leaves {budget} latent columns, fewer than the "
            f"{spent} needed for rank {multiple} in every head group; raise rank_fraction"
        )
    heap = [(-gains[k][1], k, 1) for k in keys
            if len(gains[k]) > 1 and not (full_keys and k[1] == "k")]
    heapq.heapify(heap)
    while heap:
        neg_gain, key, chunk = heapq.heappop(heap)
        full = _full(shapes, group_size, key)
        step = min(multiple, full - ranks[key])
        if spent + step > budget:
            continue
        ranks[key] += step
        spent += step
        if chunk + 1 < len(gains[key]):
            heapq.heappush(heap, (-gains[key][chunk + 1], key, chunk + 1))
    plans = {}
    for layer, shape in shapes.items():
        n = shape.num_kv_heads // group_size
        plans[layer] = LayerPlan(
            shape, group_size,
            tuple(ranks[(layer, "k", g)] for g in range(n)),
            tuple(ranks[(layer, "v", g)] for g in range(n)),
        )
    return plans


def _full(shapes, group_size, key) -> int:
    return group_size * shapes[key[0]].head_dim
