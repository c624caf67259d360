"""Byte-budget allocation: ranks and bits of every layer under one byte budget.

One objective prices every knob that trades cache bytes for accuracy. For
bases of method ``fisher`` (:mod:`vllm_lowrank.factorization.bases`, objective
(1) with ``T = G``, the K-FAC output factor of
:mod:`vllm_lowrank.calibration.collect`), the full-basis latent ``c = x A`` of a
head group has ``B G B^T = diag(e)`` with ``e`` the basis' energies. An error
``dc`` in one token's latent therefore raises the expected next-token loss by
about (Martens & Grosse 2015, eq. 1-3; second order, no cross terms)::

    dL = 1/2 sum_i e_i dc_i^2                                                (1)

Truncating to rank ``r`` is ``dc_i = -c_i`` for ``i >= r``; storing the kept
latent at ``b`` bits adds the quantizer's error. So the price of one side (K or
V) of one head group at rank ``r`` and ``b`` bits is::

    L(r, b) = 1/2 sum_i e_i mean_t (c^_ti - c_ti)^2,   c^_ti = 0 for i >= r   (2)

measured on calibration latents with the cache's own quantizer
(:mod:`vllm_lowrank.format.latent`: per-token groups after the Hadamard rotation
the serving path folds in, or per-channel groups of ``k_channel_tokens``
positions; 16 bits = float16 rounding). At full rank the cache stores the
projection itself (identity basis, :func:`~vllm_lowrank.factorization.bases.factors_for_rank`),
and (2) is evaluated through ``dc = dk B^{-1}``. Summed over layers, sides and
groups, (2) estimates the increase of the mean next-token loss in nats, so
perplexity grows by about ``exp(sum L) - 1``.

Choices: per layer, bits for K and for V (:data:`BITS`) and a rank per head
group and side (multiples of the rank granularity). The bytes are those of the
layer's :class:`~vllm_lowrank.format.latent.SlotLayout` (codes, float16 scales
and zeros, per-channel key shares), which add over the two sides.

Solver: exact. Per side and bits, the best split of a width over head groups
(dynamic programming over groups); per layer, every (K, V) pair reduced to its
Pareto front (bytes, loss); over layers either

- one budget for all slots (a multiple-choice knapsack, dynamic programming
  over bytes), when layers may have slots of different sizes; or
- one slot size ``S`` for every layer (``one_page``: token-adaptive mode and
  hybrid models, where vLLM needs one page size), each layer taking its best
  choice within ``S``, and ``S`` the largest whose total fits the budget.

Either way the feasible set grows with the budget and each solve is exact, so
a larger budget never gives a larger objective (monotone).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from vllm_lowrank.config import STORAGE_BITS

BITS = STORAGE_BITS
"""Storage widths the allocator chooses from (16: float16, no scale/zero)."""


@dataclasses.dataclass(frozen=True)
class Storage:
    """How the cache stores quantized latents (what the measurement emulates).

    Attributes:
        quant_group: Channels per per-token scale/zero pair (``None``: one pair
            per head group and token).
        hadamard: Per-token sides are rotated (randomised Hadamard, Palu eq. 8)
            before quantization, with the serving path's seeds.
        k_channel_tokens: Keys quantized per channel over groups of this many
            positions (KIVI sec. 3.2), or ``None``: per token.
        multiple: Rank granularity (ranks are multiples of it).
    """

    quant_group: int | None = None
    hadamard: bool = True
    k_channel_tokens: int | None = None
    multiple: int = 8

    def rank_options(self, full: int, bits: int) -> list[int]:
        """Ranks allowed for a head group of width ``full`` at ``bits`` (3-bit
        rows in multiples of 16 keep the float16 scales 2-byte aligned)."""
        step = self.multiple if bits != 3 else math.lcm(self.multiple, 16)
        return [r for r in range(step, full + 1, step)]


def _rotation(rank: int, layer: int, group: int, side: str) -> torch.Tensor:
    """The Hadamard rotation the serving path folds into this latent
    (:func:`vllm_lowrank.factorization.fold.rotate_latents`, seed = layer)."""
    from vllm_lowrank.format.latent import latent_rotation

    return latent_rotation(rank, layer, group, side).double()


def _store(y: torch.Tensor, bits: int, storage: Storage, per_channel: bool) -> torch.Tensor:
    """``y`` [T, r] as read back from the cache (float64)."""
    from vllm_lowrank.format.latent import dequantize, quantize, quantize_channels

    if bits == 16:
        return y.to(torch.float16).double()
    if per_channel:
        g = storage.k_channel_tokens
        t = (y.shape[0] // g) * g
        codes, scale, zero = quantize_channels(y[:t].reshape(-1, g, y.shape[1]), bits)
        out = codes.double() * scale.double()[:, None] + zero.double()[:, None]
        return torch.cat([out.reshape(t, -1), y[t:]], dim=0)  # a partial group stays exact
    q = storage.quant_group or y.shape[1]
    codes, scale, zero = quantize(y, bits, q)
    return dequantize(codes, scale, zero, q).double()


def side_loss(latents: torch.Tensor, metric: torch.Tensor, basis_b: torch.Tensor, rank: int,
              bits: int, storage: Storage, *, side: str, layer: int = 0,
              group: int = 0) -> float:
    """Objective (2) of the module docstring for one side of one head group,
    ``1/2 mean_t dc_t M dc_t^T`` with ``dc`` the latent error.

    Args:
        latents: ``[T, n]`` full-basis latents ``x A`` of ``T`` consecutive
            calibration positions (whole windows; per-channel groups are runs
            of ``k_channel_tokens`` rows).
        metric: ``[n, n]`` loss metric ``M`` in latent coordinates:
            ``diag(energy)`` for a fisher basis (eq. 1), or ``B G B^T`` for a
            gradient second moment ``G`` of the projection's output.
        basis_b: ``[n, n]`` the full up-projection ``B`` (used at full rank).
        rank: Kept width ``1 <= rank <= n``.
        bits: Storage width (:data:`BITS`).
        storage: The cache's quantization settings.
        side: ``"k"`` or ``"v"`` (per-channel quantization is for keys only).
        layer, group: Select the serving path's Hadamard seed.

    Returns:
        Estimated increase of the mean next-token loss (nats per token).

    Raises:
        ValueError: ``rank`` outside ``1..n`` or unsupported ``bits``.
    """
    c = latents.double()
    n = c.shape[1]
    if not 1 <= rank <= n:
        raise ValueError(f"rank {rank} outside 1..{n}")
    if bits not in BITS:
        raise ValueError(f"bits={bits} not in {BITS}")
    per_channel = side == "k" and storage.k_channel_tokens is not None and bits < 16
    full = rank == n
    y = c @ basis_b.double() if full else c[:, :rank]  # what the cache stores
    rot = None
    if bits < 16 and storage.hadamard and not per_channel:
        rot = _rotation(rank, layer, group, side).to(y.device)
        y = y @ rot
    dy = _store(y, bits, storage, per_channel) - y
    if rot is not None:
        dy = dy @ rot.T
    if full:
        dc = torch.linalg.solve(basis_b.double().T, dy.T).T  # dc B = dy
    else:
        dc = torch.cat([dy, -c[:, rank:]], dim=1)
    return 0.5 * float(((dc @ metric.double()) * dc).sum(1).mean())


def side_bytes(ranks: Sequence[int], bits: int, storage: Storage, per_channel: bool) -> int:
    """Slot bytes of one side (codes, scales and zeros or the per-channel
    share): the side's part of :attr:`SlotLayout.natural_bytes`, which adds
    over the two sides (computed by a layout holding this side alone)."""
    from vllm_lowrank.format.latent import SlotLayout

    q = storage.quant_group
    return SlotLayout(ranks, (), bits, 16, q, q,
                      k_channel_tokens=storage.k_channel_tokens if per_channel else None
                      ).natural_bytes


@dataclasses.dataclass(frozen=True)
class SideOption:
    """One way to store a side of a layer."""

    bits: int
    ranks: tuple[int, ...]
    nbytes: int
    loss: float


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """The allocation of one layer.

    Attributes:
        k, v: The chosen side options.
        loss: ``k.loss + v.loss`` (nats per token, objective (2)).
        natural_bytes: Slot bytes before any page padding.
    """

    k: SideOption
    v: SideOption

    @property
    def loss(self) -> float:
        return self.k.loss + self.v.loss

    @property
    def natural_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclasses.dataclass
class Allocation:
    """Result of :func:`allocate_bytes`.

    Attributes:
        layers: ``{layer: LayerChoice}``.
        slot_bytes: ``{layer: bytes}`` the cache allocates per token and layer
            (natural size, or the common padded size with ``one_page``).
        total_bytes: Bytes per token over all layers, exact tokens included
            (:func:`total_bytes`).
        objective: Sum of the layers' losses (nats per token).
    """

    layers: dict[int, LayerChoice]
    slot_bytes: dict[int, int]
    total_bytes: float
    objective: float


def side_options(latents: Sequence[torch.Tensor], metrics: Sequence[torch.Tensor],
                 bases_b: Sequence[torch.Tensor], storage: Storage, *, side: str,
                 layer: int = 0, bits_options: Sequence[int] = BITS) -> list[SideOption]:
    """Every (bits, total width) of one side of a layer with its best split over
    head groups (exact: dynamic programming over groups).

    Args:
        latents, metrics, bases_b: Per head group, as in :func:`side_loss`.
        storage: Quantization settings.
        side: ``"k"`` or ``"v"``.
        layer: Layer index (Hadamard seeds).
        bits_options: Widths to consider.

    Returns:
        One :class:`SideOption` per (bits, total width), its loss minimal over
        the per-group splits of that width.
    """
    per_channel_side = side == "k" and storage.k_channel_tokens is not None
    out = []
    for bits in bits_options:
        per_channel = per_channel_side and bits < 16
        best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
        for g, (c, e, b) in enumerate(zip(latents, metrics, bases_b)):
            table = {r: side_loss(c, e, b, r, bits, storage, side=side, layer=layer, group=g)
                     for r in storage.rank_options(c.shape[1], bits)}
            nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
            for w, (loss, ranks) in best.items():
                for r, lr in table.items():
                    cand = (loss + lr, ranks + (r,))
                    if w + r not in nxt or cand[0] < nxt[w + r][0]:
                        nxt[w + r] = cand
            best = nxt
        for w, (loss, ranks) in sorted(best.items()):
            out.append(SideOption(bits, ranks, side_bytes(ranks, bits, storage, per_channel),
                                  loss))
    return out


def layer_front(k_options: Sequence[SideOption], v_options: Sequence[SideOption]
                ) -> list[LayerChoice]:
    """Pareto front of all (K, V) pairs: bytes strictly increasing, loss
    strictly decreasing."""
    pairs = sorted(((k.nbytes + v.nbytes, k.loss + v.loss, i, j)
                    for i, k in enumerate(k_options) for j, v in enumerate(v_options)))
    front, best = [], math.inf
    for nbytes, loss, i, j in pairs:
        if loss < best:
            if front and front[-1].natural_bytes == nbytes:
                front.pop()
            front.append(LayerChoice(k_options[i], v_options[j]))
            best = loss
    return front


def total_bytes(choices: Mapping[int, LayerChoice], slot_bytes: Mapping[int, int],
                exact_cost=None) -> float:
    """Bytes per token over all layers: the latent slots plus each layer's
    amortised exact-token bytes (``exact_cost[layer](choice, slot)``, see
    :func:`allocate_bytes`)."""
    total = float(sum(slot_bytes.values()))
    if exact_cost:
        total += sum(exact_cost[i](choices[i], s) for i, s in slot_bytes.items())
    return total


def allocate_bytes(fronts: Mapping[int, Sequence[LayerChoice]], budget: float, *,
                   one_page: bool, exact_cost=None) -> Allocation:
    """The choice per layer that minimises the summed loss within ``budget``.

    Args:
        fronts: ``{layer: layer_front(...)}``.
        budget: Bytes per token over all layers (latent slots, plus exact
            tokens when ``exact_cost`` is given).
        one_page: Every layer's slot padded to one size ``S`` (rounded up to
            4 bytes, as :func:`vllm_lowrank.format.latent.page_padding` does).
        exact_cost: ``{layer: f(choice, slot_bytes) -> bytes per token}`` of
            the exact tokens of the token-adaptive mode (they depend on the
            latent slot through the exact slot's padding, and on the key width
            staged for per-channel keys), or ``None``.

    Returns:
        The :class:`Allocation`; ``total_bytes <= budget``.

    Raises:
        ValueError: no choice fits the budget (the message gives the minimum).
    """
    layers = sorted(fronts)
    if one_page:
        sizes = sorted({-(-c.natural_bytes // 4) * 4 for i in layers for c in fronts[i]})
        front_bytes = {i: [c.natural_bytes for c in fronts[i]] for i in layers}
        best = None
        for s in sizes:
            # the last front entry within s: the front's loss falls as bytes grow
            at = {i: bisect.bisect_right(front_bytes[i], s) - 1 for i in layers}
            if min(at.values()) < 0:
                continue
            chosen = {i: fronts[i][at[i]] for i in layers}
            served = -(-max(c.natural_bytes for c in chosen.values()) // 4) * 4
            slots = {i: served for i in layers}
            if total_bytes(chosen, slots, exact_cost) <= budget:
                best = (chosen, slots)
        if best is None:
            raise ValueError(f"a budget of {budget:.1f} B per token is below the smallest "
                             "one-page allocation; raise the budget")
        chosen, slots = best
    else:
        chosen, slots = _knapsack(fronts, layers, budget, exact_cost)
    return Allocation(layers=chosen, slot_bytes=slots,
                      total_bytes=total_bytes(chosen, slots, exact_cost),
                      objective=sum(c.loss for c in chosen.values()))


def _knapsack(fronts, layers, budget, exact_cost):
    """Multiple-choice knapsack over whole bytes (exact dynamic programming).
    A layer's weight is its slot plus, with exact tokens, their amortised
    bytes; weights are rounded up to 1/8 byte so the budget is never
    exceeded."""
    unit = 8
    weight = {i: [math.ceil(unit * (c.natural_bytes + (exact_cost[i](c, c.natural_bytes)
                                                       if exact_cost else 0)) - 1e-9)
                  for c in fronts[i]] for i in layers}
    cap = int(math.floor(unit * budget + 1e-9))
    floor = sum(min(w) for w in weight.values())
    if floor > cap:
        raise ValueError(f"a budget of {budget:.1f} B per token is below the smallest "
                         f"allocation ({floor / unit:.1f} B)")
    cap = min(cap, sum(max(w) for w in weight.values()))
    dp = np.zeros(cap + 1)  # best loss with at most `b` units for the layers so far
    picks = []
    for i in layers:
        new = np.full(cap + 1, np.inf)
        arg = np.full(cap + 1, -1, dtype=np.int32)
        for j, (c, w) in enumerate(zip(fronts[i], weight[i])):
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = dp[:cap + 1 - w] + c.loss
            better = cand < new
            new[better], arg[better] = cand[better], j
        dp = new
        picks.append(arg)
    b = int(np.argmin(dp))  # the fewest units reaching the best loss
    chosen = {}
    for i, arg in zip(reversed(layers), reversed(picks)):
        j = int(arg[b])
        chosen[i] = fronts[i][j]
        b -= weight[i][j]
    chosen = dict(sorted(chosen.items()))
    return chosen, {i: c.natural_bytes for i, c in chosen.items()}
