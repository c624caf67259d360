"""Tensor parallelism: each rank's share of a layer's heads, weights, bases and ranks.

vLLM splits attention by heads: with ``--tensor-parallel-size t`` rank ``p``
owns query heads ``[p*H/t, (p+1)*H/t)`` and KV heads ``[p*K/t, (p+1)*K/t)``,
``qkv_proj`` is column-parallel (each rank computes its heads' outputs),
``o_proj`` is row-parallel (each rank multiplies its heads' slice of the
attention output; vLLM all-reduces the sum) and every rank has its own KV
cache. The latent cache follows the same split:

- head groups are formed inside one rank's KV heads, never across ranks
  (``group_size`` must divide ``K/t``; ``null`` means all KV heads *of the
  rank's shard*), so rank ``p`` holds groups ``[p*n, (p+1)*n)`` of the model,
  ``n = K / (t * group_size)``;
- each rank factorizes its own groups from its slice of the full checkpoint
  weights (:func:`local_weights`) with its slice of the bases
  (:func:`local_bases`): ``A`` (the latent columns of the fused projection)
  is column-parallel, the folded ``o_proj`` row-parallel, ``B_k`` local. The
  attention path needs no communication beyond vLLM's own all-reduce;
- every rank must have the same latent widths per layer: vLLM requires
  identical KV cache specs on all ranks, and the row-parallel ``o_proj`` the
  same input width. Ranks are therefore allocated *tied* across ranks: group
  ``j`` of every rank gets the same rank (:func:`tied_spectra`), so all ranks
  build identical :class:`~vllm_lowrank.factorization.plan.LayerPlan` s.

Artifacts are shard-independent: they hold the bases of the full model, and
a rank slices its groups at load time. An artifact therefore serves every
tensor-parallel size ``t`` for which its ``group_size`` divides ``K/t``
(:func:`serving_sizes`); any other size is refused at start-up
(:func:`check_artifact_groups`).

Layer sizes given to vLLM's parallel linear layers are *full* (all ranks),
i.e. ``t`` times the per-rank sizes of the plan (:func:`full_sizes`); loading
copies each rank's local tensors into its local parameters
(:func:`load_local`), bypassing vLLM's loaders, which would slice again.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence

import torch

from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.factorization.plan import AttentionShape


def position() -> tuple[int, int]:
    """``(rank, size)`` of this process in vLLM's tensor-parallel group, or
    ``(0, 1)`` outside an initialised worker (front-end checks, tests)."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return 0, 1
    group = get_tp_group()
    return group.rank_in_group, group.world_size


def full_sizes(*sizes: int) -> list[int]:
    """Per-rank widths -> the full widths vLLM's parallel linear layers take
    (``size * tp``), for the tensor-parallel group of this process."""
    tp = position()[1]
    return [s * tp for s in sizes]


def serving_sizes(num_heads: int, num_kv_heads: int, group_size: int) -> list[int]:
    """Tensor-parallel sizes whose shards hold whole head groups of
    ``group_size`` KV heads (and divide the query and KV heads)."""
    return [t for t in range(1, num_kv_heads + 1)
            if num_heads % t == 0 and num_kv_heads % t == 0
            and (num_kv_heads // t) % group_size == 0]


def check_artifact_groups(manifest: Mapping, path: str, tp_size: int) -> None:
    """Refuse an artifact whose head groups would span tensor-parallel ranks.

    Args:
        manifest: The artifact manifest (full-model geometry, ``group_size``).
        path: Artifact path (for the message).
        tp_size: The served ``--tensor-parallel-size``.

    Raises:
        LowRankConfigError: one line naming the artifact's group size, the TP
            size it would need, the requested one, and the fix.
    """
    model = manifest["model"]
    g, kv, h = int(manifest["group_size"]), model["num_kv_heads"], model["num_heads"]
    if kv % tp_size or (kv // tp_size) % g == 0:
        return  # head divisibility is reported by model_shapes
    sizes = serving_sizes(h, kv, g)
    raise LowRankConfigError(
        f"calibration artifact {path!r} decomposes groups of {g} KV heads, made for "
        f"tensor-parallel size {'/'.join(map(str, sizes))}, but --tensor-parallel-size "
        f"{tp_size} leaves {kv // tp_size} KV heads per rank and a head group cannot "
        f"span ranks; serve it with --tensor-parallel-size {sizes[-1]}, or recalibrate "
        f"with `vllm-lowrank calibrate --head-group-size {kv // tp_size}` (or artifact "
        "\"auto\")"
    )


def rank_config(cfg: LowRankConfig, tp_size: int, local_kv_heads: int) -> LowRankConfig:
    """``cfg`` as one tensor-parallel rank applies it.

    ``head_group_size`` ``null`` keeps meaning "all KV heads of the layer's shard"
    (:func:`~vllm_lowrank.factorization.plan.resolve_group_size` on the shard
    shape). A ``ranks`` override gives whole-layer latent widths, split evenly
    over the ranks.

    Raises:
        LowRankConfigError: ``head_group_size`` does not divide the shard's KV heads,
            or an override does not split evenly over the ranks.
    """
    if tp_size == 1:
        return cfg
    g = cfg.head_group_size
    if g is not None and local_kv_heads % g:
        raise LowRankConfigError(
            f"head_group_size={g} does not divide the {local_kv_heads} KV heads of each "
            f"rank at --tensor-parallel-size {tp_size} (a head group cannot span "
            f"ranks); use a divisor of {local_kv_heads} or null (all heads of a rank)"
        )
    if not cfg.ranks:
        return cfg
    ranks = {}
    for layer, (rk, rv) in cfg.ranks.items():
        if rk % tp_size or rv % tp_size:
            raise LowRankConfigError(
                f"ranks[{layer}] = [{rk}, {rv}] must split evenly over the "
                f"{tp_size} tensor-parallel ranks (each rank caches its own heads)"
            )
        ranks[layer] = (rk // tp_size, rv // tp_size)
    return dataclasses.replace(cfg, ranks=ranks)


def tied_spectra(
    spectra: Mapping[int, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
    groups_per_rank: int,
    normalize: bool,
) -> tuple[dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]], bool]:
    """Spectra for one rank's allocation with ranks tied across ranks.

    Group ``j`` of every rank is one allocation unit: a chunk of rank given to
    it is given to all ``tp`` groups ``p*n + j`` and gains the sum of their
    energies (each first normalised to sum to one when ``normalize``). With
    one rank this is the identity.

    Args:
        spectra: Full-model ``{layer: (k_energies, v_energies)}``, one ``[k]``
            tensor per group of the model.
        groups_per_rank: Head groups of one rank's shard.
        normalize: The allocation compares normalised spectra (``energy``).

    Returns:
        ``(spectra, normalize)`` to pass to
        :func:`~vllm_lowrank.factorization.ranks.energy_plans` with the
        shard shapes: one tensor per group of a rank.
    """
    first = next(iter(spectra.values()))[0]
    tp = len(first) // groups_per_rank
    if tp == 1:
        return {i: (list(k), list(v)) for i, (k, v) in spectra.items()}, normalize

    def tie(energies):
        e = [x.double().clamp_min(0) for x in energies]
        if normalize:
            e = [x / (float(x.sum()) or 1.0) for x in e]
        return [sum(e[p * groups_per_rank + j] for p in range(tp)).float()
                for j in range(groups_per_rank)]

    return {i: (tie(k), tie(v)) for i, (k, v) in spectra.items()}, False


def tied_fixed_ranks(ranks: Sequence[int], groups_per_rank: int, layer: int,
                     source: str) -> tuple[int, ...]:
    """A rank's share of fixed per-group ranks recorded for the full model
    (``source`` names the artifact in the message).

    Raises:
        LowRankConfigError: the ranks differ between ranks' shards (their KV
            cache specs would differ, which vLLM cannot serve).
    """
    shares = [tuple(ranks[p:p + groups_per_rank])
              for p in range(0, len(ranks), groups_per_rank)]
    if len(set(shares)) != 1:
        raise LowRankConfigError(
            f"{source} fixes layer {layer} ranks {list(ranks)}, "
            f"which differ between tensor-parallel ranks ({len(shares)} shards of "
            f"{groups_per_rank} group(s)); every rank must cache the same widths: "
            "serve without tensor parallelism or record tied ranks"
        )
    return shares[0]


def local_bases(bases, groups_per_rank: int, rank: int):
    """This rank's ``(k_bases, v_bases)`` of a layer: groups
    ``[rank*n, (rank+1)*n)`` of the full-model lists (``None`` passes through)."""
    if bases is None:
        return None
    s = slice(rank * groups_per_rank, (rank + 1) * groups_per_rank)
    return tuple(list(side[s]) for side in bases)


def local_weights(weights: Mapping[str, torch.Tensor], shape: AttentionShape,
                  rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice a layer's full checkpoint tensors to one rank's heads.

    Args:
        weights: ``q_proj`` ``[H*d, hidden]``, ``k_proj``/``v_proj``
            ``[K*d, hidden]``, ``o_proj`` ``[hidden, H*d]`` and optional
            ``{q,k,v,o}_proj.bias`` (full model, ``nn.Linear`` orientation).
        shape: The shard's geometry (``H/t`` query and ``K/t`` KV heads).
        rank, size: Tensor-parallel position.

    Returns:
        The same keys with the rank's rows (q/k/v) and columns (o_proj). A
        value bias is not sliced but folded here, for the full model, into
        ``o_proj.bias`` (which vLLM adds once, on rank 0, after the
        all-reduce); ``v_proj.bias`` is dropped.
    """
    if size == 1:
        return dict(weights)
    d = shape.head_dim
    q = slice(rank * shape.num_heads * d, (rank + 1) * shape.num_heads * d)
    kv = slice(rank * shape.kv_width, (rank + 1) * shape.kv_width)
    out = {"q_proj": weights["q_proj"][q], "k_proj": weights["k_proj"][kv],
           "v_proj": weights["v_proj"][kv], "o_proj": weights["o_proj"][:, q]}
    for name, rows in (("q_proj.bias", q), ("k_proj.bias", kv)):
        if name in weights:
            out[name] = weights[name][rows]
    if "o_proj.bias" in weights:
        out["o_proj.bias"] = weights["o_proj.bias"].float()
    if "v_proj.bias" in weights:
        from vllm_lowrank.factorization.fold import value_bias_through_o_proj

        full = types.SimpleNamespace(shape=AttentionShape(
            shape.hidden_size, shape.num_heads * size, shape.num_kv_heads * size, d))
        b = value_bias_through_o_proj(full, weights["o_proj"], weights["v_proj.bias"])
        out["o_proj.bias"] = out.get("o_proj.bias", 0) + b
    return out


def load_local(layer: torch.nn.Module, param: torch.nn.Parameter, tensor: torch.Tensor,
               shard_id: int | None = None) -> None:
    """Load one rank's own tensor into ``param`` of a vLLM parallel linear layer.

    Without tensor parallelism this is the layer's stock ``weight_loader``.
    Otherwise ``tensor`` is already this rank's share and is copied in place:
    output shard ``shard_id`` of a ``MergedColumnParallelLinear`` (rows
    ``sum(output_sizes[:id]) / t`` onward), or the whole local parameter
    (``RowParallelLinear`` weight ``[hidden, in/t]``, replicated biases).

    Raises:
        ValueError: ``tensor`` does not have the local shape.
    """
    if getattr(layer, "tp_size", 1) == 1:
        args = () if shard_id is None else (shard_id,)
        param.weight_loader(param, tensor, *args)
        return
    data = param.data
    if shard_id is not None:
        tp = layer.tp_size
        offset = sum(layer.output_sizes[:shard_id]) // tp
        data = data.narrow(0, offset, layer.output_sizes[shard_id] // tp)
    if tuple(data.shape) != tuple(tensor.shape):
        raise ValueError(f"local shard has shape {tuple(tensor.shape)}, the rank's "
                         f"parameter {tuple(data.shape)}")
    with torch.no_grad():
        data.copy_(tensor)
