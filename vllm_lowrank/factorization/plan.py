"""Latent layout of one model: head groups and ranks per layer.

A :class:`LayerPlan` fixes, for one attention layer, how its KV heads are
grouped and the key / value latent width of each group. Everything else (the
cache page size, the fused projection sizes, the kernels' tile loops) is derived
from it, never stored twice.

Cache slot layout of one token (one vLLM "head slot" of width ``Rk + Rv``)::

    [ c_k[g=0] (r_k[0]) | c_k[g=1] | ... | c_v[g=0] (r_v[0]) | c_v[g=1] | ... ]

Attention output layout (input of the folded ``o_proj``): query heads in order,
head ``i`` contributing ``r_v[group(i)]`` columns, where
``group(i) = (i // (num_heads // num_kv_heads)) // group_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vllm_lowrank.config import RANK_MULTIPLE, LowRankConfig, LowRankConfigError


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Head geometry of one attention layer (of one tensor-parallel shard).

    Attributes:
        hidden_size: Width of the layer input ``x``.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of one head.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_width(self) -> int:
        """Width of all K (or all V) heads of the layer."""
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Head groups and ranks of one layer.

    Attributes:
        shape: The layer's head geometry.
        group_size: KV heads per group (G-LRD); divides ``shape.num_kv_heads``.
        k_ranks: Key latent width per group.
        v_ranks: Value latent width per group.
    """

    shape: AttentionShape
    group_size: int
    k_ranks: tuple[int, ...]
    v_ranks: tuple[int, ...]

    def __post_init__(self):
        n = self.num_groups
        if len(self.k_ranks) != n or len(self.v_ranks) != n:
            raise LowRankConfigError(
                f"expected {n} key and value ranks (one per head group), got "
                f"{len(self.k_ranks)} and {len(self.v_ranks)}"
            )
        full = self.group_width
        for side, ranks in (("key", self.k_ranks), ("value", self.v_ranks)):
            for r in ranks:
                if not 1 <= r <= full:
                    raise LowRankConfigError(
                        f"{side} rank {r} is out of range: a head group of "
                        f"{self.group_size} KV head(s) x {self.shape.head_dim} "
                        f"allows 1..{full}"
                    )

    @property
    def num_groups(self) -> int:
        return self.shape.num_kv_heads // self.group_size

    @property
    def group_width(self) -> int:
        """Full (uncompressed) K or V width of one group: ``group_size * head_dim``."""
        return self.group_size * self.shape.head_dim

    @property
    def heads_per_group(self) -> int:
        """Query heads attending to one group's latent."""
        return self.group_size * self.shape.queries_per_kv

    @property
    def k_width(self) -> int:
        """Key latent width of the layer, ``Rk = sum(k_ranks)``."""
        return sum(self.k_ranks)

    @property
    def full_keys(self) -> bool:
        """True when the keys keep their full width (``Rk == kv_width``): the key
        basis is then the identity, which commutes with RoPE."""
        return self.k_width == self.shape.kv_width

    @property
    def v_width(self) -> int:
        """Value latent width of the layer, ``Rv = sum(v_ranks)``."""
        return sum(self.v_ranks)

    @property
    def out_width(self) -> int:
        """Attention output width (input of the folded o_proj)."""
        return self.heads_per_group * self.v_width

    def k_offsets(self) -> list[int]:
        """Start column of each group's key latent inside the slot."""
        return _offsets(self.k_ranks)

    def v_offsets(self) -> list[int]:
        """Start column of each group's value latent, relative to ``Rk``."""
        return _offsets(self.v_ranks)


def _offsets(ranks: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for r in ranks:
        out.append(acc)
        acc += r
    return out


def resolve_group_size(cfg: LowRankConfig, shape: AttentionShape) -> int:
    """``cfg.head_group_size`` checked against the layer, ``None`` -> all KV heads.

    Raises:
        LowRankConfigError: the group size does not divide the KV heads.
    """
    g = cfg.head_group_size or shape.num_kv_heads
    if shape.num_kv_heads % g:
        raise LowRankConfigError(
            f"head_group_size={g} does not divide the {shape.num_kv_heads} KV heads of "
            f"the layer; use a divisor of {shape.num_kv_heads} (or null for all)"
        )
    return g


def round_rank(width: float, full: int, multiple: int = RANK_MULTIPLE) -> int:
    """Round a latent width to a multiple of ``multiple`` (default
    :data:`RANK_MULTIPLE`), within ``[multiple, full]`` (``full`` itself is
    always allowed).

    Raises:
        LowRankConfigError: the width rounds to zero.
    """
    if width >= full:
        return full
    r = int(round(width / multiple)) * multiple
    if r <= 0:
        raise LowRankConfigError(
            f"the rank fraction gives rank {width:.1f} < {multiple / 2} for a head "
            f"group of width {full}, which rounds to rank 0; raise rank_fraction or "
            "head_group_size"
        )
    return min(r, full)


def uniform_plan(
    cfg: LowRankConfig, shape: AttentionShape, layer_index: int
) -> LayerPlan:
    """Same rank for K and V and every group: ``rank_fraction * group_width`` (or the
    layer's ``ranks`` override, split evenly over the groups). With
    ``post_rope_keys`` the keys keep the full group width and the values get
    what is left of ``rank_fraction`` of the K+V width: ``(2 rank_fraction - 1)
    group_width``.

    Raises:
        LowRankConfigError: invalid group size or override (with
            ``post_rope_keys``, a key rank other than the full width; on a
            quantized side, a rank per group that is not a multiple of
            ``cfg.rank_multiple``, whole bytes of packed codes).
    """
    g = resolve_group_size(cfg, shape)
    n = shape.num_kv_heads // g
    full = g * shape.head_dim
    if cfg.ranks and layer_index in cfg.ranks:
        rk_total, rv_total = cfg.ranks[layer_index]
        for side, total, bits in (("r_k", rk_total, cfg.k_bits), ("r_v", rv_total, cfg.v_bits)):
            if total % n or not 1 <= total // n <= full:
                raise LowRankConfigError(
                    f"ranks[{layer_index}] {side}={total} must be a multiple of the "
                    f"{n} head group(s) with 1..{full} per group"
                )
            if bits < 16 and (total // n) % cfg.rank_multiple:
                raise LowRankConfigError(
                    f"ranks[{layer_index}] {side}={total} gives {total // n} per head "
                    f"group (per tensor-parallel rank), not a multiple of "
                    f"{cfg.rank_multiple}: {bits}-bit codes are packed in whole bytes per "
                    f"group; use a multiple of {cfg.rank_multiple * n}"
                )
        if cfg.post_rope_keys and rk_total != n * full:
            raise LowRankConfigError(
                f"ranks[{layer_index}] r_k={rk_total}: post_rope_keys keeps every key at "
                f"full width, so r_k must be {n * full} (the layer's key width)")
        return LayerPlan(shape, g, (rk_total // n,) * n, (rv_total // n,) * n)
    if cfg.post_rope_keys:
        rv = round_rank((2 * cfg.rank_fraction - 1) * full, full, cfg.rank_multiple)
        return LayerPlan(shape, g, (full,) * n, (rv,) * n)
    r = round_rank(cfg.rank_fraction * full, full, cfg.rank_multiple)
    return LayerPlan(shape, g, (r,) * n, (r,) * n)
