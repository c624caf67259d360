"""Per-model compression state: resolved at model construction, applied at
weight loading. Shared by every architecture adapter.

At construction (:func:`resolve`): the layer plans (groups and ranks) must be
known, because module sizes and the KV cache spec depend on them. They come from

1. an artifact given by path (its bases, and its spectra for rank allocation);
2. ``artifact="auto"``: the cached artifact for this model and settings
   (:mod:`vllm_lowrank.calibration.cache`), made on first use by calibrating on
   the default text (and, for a preset that allocates, its byte-budget
   allocation), or
3. ``artifact="none"``: no calibration, plain weight SVD with uniform ranks
   (logged; it badly hurts accuracy on real models).

At load (:class:`vllm_lowrank.models.weight_loader.WeightInterceptor`): the
checkpoint's q/k/v/o weights are held back from vLLM's stock loader, each layer
is factorized and loaded as soon as its four weights have arrived, and the
fingerprint of the k/v/o weights is checked against the artifact's.

Under tensor parallelism every rank resolves plans for its own shard of KV
heads (head groups never span ranks, ranks are tied across ranks so that all
ranks build the same plans) and factorizes its slice of the full checkpoint
weights with its slice of the full-model artifact
(:mod:`vllm_lowrank.factorization.shard`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.calibration.cache import load_or_allocate, load_or_calibrate
from vllm_lowrank.config import LOSS_METHODS, LowRankConfig, LowRankConfigError
from vllm_lowrank.factorization import shard
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan, uniform_plan
from vllm_lowrank.factorization.ranks import energy_plans
from vllm_lowrank.format.exact import ExactTokens, exact_tokens
from vllm_lowrank.presets import get_preset

logger = logging.getLogger("vllm.lowrank")

@dataclasses.dataclass
class ModelCompression:
    """What the model needs from the plugin.

    Attributes:
        cfg: The settings in force.
        plans: ``{layer: LayerPlan}``.
        artifact: Calibrated bases, or ``None`` for weight SVD.
        artifact_path: Where the artifact came from (for messages).
        exact_tokens: What the token-adaptive mode keeps at full rank
            (:func:`vllm_lowrank.format.exact.exact_tokens`), or ``None`` when it is off.
        bits: ``{layer: (k_bits, v_bits)}`` fixed by a byte-budget allocation
            (:mod:`vllm_lowrank.calibration.allocate`), or ``None``: the
            config's bits everywhere.
        one_page: vLLM needs one page size (token-adaptive mode, hybrid
            models): slots are padded to one size; ``None``: inferred.
    """

    cfg: LowRankConfig
    plans: dict[int, LayerPlan]
    artifact: art.Artifact | None
    artifact_path: str | None
    exact_tokens: ExactTokens | None = None
    bits: dict[int, tuple[int, int]] | None = None
    one_page: bool | None = None

    def __post_init__(self) -> None:
        """Give ``exact_tokens`` the model's widest staged key latent
        (:attr:`~vllm_lowrank.format.exact.ExactTokens.staged_room`)."""
        if self.exact_tokens is not None:
            room = max((p.k_width for i, p in self.plans.items()
                        if (lay := self.layout(i)) is not None and lay.k_per_channel),
                       default=0) if not self.post_rope_keys else 0
            self.exact_tokens = dataclasses.replace(self.exact_tokens, staged_room=room)

    @property
    def post_rope(self) -> bool:
        """True when keys are cached as post-RoPE latents (``post_rope`` bases).

        Without an artifact that needs keys at full width in every layer: their
        basis is then the identity, which commutes with RoPE, while weight-SVD key
        bases of a lower rank do not. Values may be cut (``ranks``): their bases
        never meet RoPE, and such a layer decodes on the post-RoPE kernels rather
        than rebuilding every key (`triton-packed`, not `triton-grid`)."""
        if self.artifact is not None:
            return self.artifact.manifest["method"] == "post_rope"
        return self.cfg.method == "post_rope" and all(p.full_keys for p in self.plans.values())

    @property
    def post_rope_keys(self) -> bool:
        """True when keys are cached after RoPE at full width, with no key
        basis (``post_rope_keys``; the bases shape the values only)."""
        return self.cfg.post_rope_keys

    @property
    def rope_equivariant(self) -> bool:
        """True when the key bases commute with RoPE (a ``rope_equivariant``
        artifact, or that method without one: its weight-only basis): decode
        may absorb the queries
        (:meth:`~vllm_lowrank.attention.layer.LatentAttention.decode_mode`)."""
        method = self.artifact.manifest["method"] if self.artifact else self.cfg.method
        return method == "rope_equivariant"

    def bases(self, layer: int):
        """``(k_bases, v_bases)`` of ``layer`` or ``None`` (weight SVD)."""
        return None if self.artifact is None else self.artifact.bases[layer]

    @functools.cached_property
    def _layouts(self):
        """``{layer: SlotLayout}`` (:func:`slot_layouts`), or ``None``."""
        layouts = slot_layouts(self.cfg, [(p.k_ranks, p.v_ranks) for p in self.plans.values()],
                               None if self.bits is None else [self.bits[i] for i in self.plans],
                               self.one_page)
        return None if layouts is None else dict(zip(self.plans, layouts))

    def layout(self, layer: int):
        """:class:`~vllm_lowrank.format.latent.SlotLayout` of ``layer``'s packed
        slot (padded as :func:`slot_layouts` says), or ``None`` when latents are
        stored unquantized."""
        return None if self._layouts is None else self._layouts[layer]

    def layer_bits(self, layer: int) -> tuple[int, int]:
        """``(k_bits, v_bits)`` of ``layer`` (16: stored in the model dtype)."""
        return self.bits[layer] if self.bits is not None else (self.cfg.k_bits, self.cfg.v_bits)

    def bytes_per_token(self, dtype_bytes: int) -> tuple[int, int]:
        """(original, stored) KV bytes per token over this worker's layers, for
        a cache whose unquantized elements take ``dtype_bytes`` (scales and
        zero points of quantized slots included)."""
        original = stored = 0
        for i, p in self.plans.items():
            original += 2 * p.shape.kv_width * dtype_bytes
            layout = self.layout(i)
            stored += layout.slot_bytes if layout else (p.k_width + p.v_width) * dtype_bytes
        return original, stored

    @property
    def full_rank(self) -> bool:
        """True when every group of every layer keeps its full K and V width:
        the factors are the identity basis (the model's own projections), no
        basis of an artifact or SVD is used."""
        return all(p.k_width == p.v_width == p.shape.kv_width for p in self.plans.values())

    @property
    def bases_source(self) -> str:
        """What made the factors: ``"identity"`` at full rank, else the
        artifact's method, else ``"svd"`` (weight SVD without calibration)."""
        if self.full_rank:
            return "identity"
        return self.artifact.manifest["method"] if self.artifact else "svd"

    def summary(self, dtype_bytes: int) -> dict:
        """What is in force, for metrics and logs (JSON-safe).

        Args:
            dtype_bytes: Bytes per cached element (the KV cache dtype).

        Returns:
            ``enabled``, ``configured_rank_fraction``, ``method``
            (:attr:`bases_source`), ``artifact`` (the artifact's
            :attr:`~vllm_lowrank.calibration.artifact.Artifact.digest`, or
            ``"none"``; never its path),
            ``layers`` (``{layer: {"k_ranks": [...], "v_ranks": [...],
            "kv_width": int, "bits": [k_bits, v_bits]}}``, the bits in force in
            that layer: an allocation's per-layer choice, else the config's),
            ``original_bytes_per_token``, ``stored_bytes_per_token`` and
            ``compression_ratio`` (original / stored), over this worker's
            layers (latent slots only), and ``exact_tokens`` (``{"sink",
            "recent", "bits"}`` of the token-adaptive mode, or ``None``).
        """
        original, stored = self.bytes_per_token(dtype_bytes)
        return {
            "enabled": True,
            "configured_rank_fraction": self.cfg.rank_fraction,
            "method": self.bases_source,
            "artifact": self.artifact.digest if self.artifact else "none",
            "layers": {i: {"k_ranks": list(p.k_ranks), "v_ranks": list(p.v_ranks),
                           "kv_width": p.shape.kv_width, "bits": list(self.layer_bits(i))}
                       for i, p in self.plans.items()},
            "original_bytes_per_token": original,
            "stored_bytes_per_token": stored,
            "compression_ratio": original / stored,
            "exact_tokens": (None if self.exact_tokens is None else  # what is kept, not
                             {k: getattr(self.exact_tokens, k)  # how slots are padded
                              for k in ("sink", "recent", "bits")}),
        }

    def describe(self) -> str:
        plans = list(self.plans.values())
        k = sum(p.k_width for p in plans) / len(plans)
        v = sum(p.v_width for p in plans) / len(plans)
        original, stored = self.bytes_per_token(2)
        source = ("none needed (full rank: identity bases)" if self.full_rank
                  else self.artifact_path or "weight SVD (no calibration)")
        if self.bits is not None:
            mean = [sum(b[s] for b in self.bits.values()) / len(self.bits) for s in (0, 1)]
            bits = f", K/V bits per layer (mean {mean[0]:.1f}/{mean[1]:.1f})"
        else:
            bits = (f", K/V latents at {self.cfg.k_bits}/{self.cfg.v_bits} bits"
                    if self.cfg.quantized else "")
        return (f"{len(plans)} layers, mean latent width K {k:.1f} / V {v:.1f}{bits}, "
                f"compression ratio {original / stored:.2f}x (vs 16-bit K/V), "
                f"bases from {source}")


def model_shapes(hf_config, tp_size: int = 1) -> dict[int, AttentionShape]:
    """Per-layer head geometry of one tensor-parallel shard.

    Raises:
        LowRankConfigError: heads do not divide by ``tp_size``.
    """
    num_heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if num_heads % tp_size or num_kv % tp_size:
        raise LowRankConfigError(
            f"tensor parallel size {tp_size} must divide the {num_heads} query and "
            f"{num_kv} KV heads for the latent cache (a head group never spans ranks)"
        )
    shape = AttentionShape(hf_config.hidden_size, num_heads // tp_size,
                           num_kv // tp_size, head_dim)
    return {i: shape for i in range(hf_config.num_hidden_layers)}


def manifest_shape(shape: AttentionShape) -> dict[str, int]:
    return {"hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}


def resolve(vllm_config, cfg: LowRankConfig, *, create_artifacts: bool = True
            ) -> ModelCompression:
    """Plans and bases for the model being constructed.

    Args:
        vllm_config: vLLM's config (read: ``model_config.hf_config`` and
            ``.model``, ``parallel_config.tensor_parallel_size``,
            ``cache_config.block_size``).
        cfg: The plugin settings.
        create_artifacts: Calibrate / allocate an ``artifact: "auto"`` artifact
            that is not cached (false: raise
            :class:`~vllm_lowrank.calibration.cache.NotCached`).

    Raises:
        LowRankConfigError: unusable artifact, bad ranks, or a geometry the
            settings cannot serve.
        NotCached: see ``create_artifacts``.
    """
    hf_config = vllm_config.model_config.hf_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    shapes = model_shapes(hf_config, tp)
    cfg = shard.rank_config(cfg, tp, shapes[0].num_kv_heads)
    exact = exact_tokens(cfg, vllm_config.cache_config.block_size)
    artifact, path = None, None
    if cfg.rank_fraction == 1.0 and not cfg.ranks and cfg.artifact in ("auto", "none"):
        # Full rank everywhere: every group uses its exact identity basis, so no
        # calibration is needed (and none is run).
        plans = {i: uniform_plan(cfg, s, i) for i, s in shapes.items()}
        return ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None,
                                exact_tokens=exact)
    if cfg.artifact == "auto" and cfg.needs_calibration:
        # "all KV heads" under tensor parallelism: all heads of one rank's shard
        auto_cfg = cfg if tp == 1 or cfg.head_group_size else dataclasses.replace(
            cfg, head_group_size=shapes[0].num_kv_heads)
        artifact, path = load_or_calibrate(vllm_config.model_config.model, auto_cfg,
                                           create=create_artifacts)
        if cfg.preset is not None and get_preset(cfg.preset).allocate is not None:
            artifact, path = load_or_allocate(vllm_config.model_config.model, cfg, artifact,
                                              path, vllm_config.cache_config.block_size,
                                              create=create_artifacts)
    elif cfg.artifact not in ("auto", "none"):
        path = cfg.artifact
        artifact = art.load_artifact(path)
    if artifact is not None:
        full_shape = model_shapes(hf_config, 1)[0]
        art.check_model_matches(
            artifact.manifest, path,
            architecture=hf_config.architectures[0],
            num_layers=hf_config.num_hidden_layers,
            shape=manifest_shape(full_shape),
        )
        shard.check_artifact_groups(artifact.manifest, path, tp)
        if cfg.head_group_size is not None and cfg.head_group_size != artifact.group_size:
            raise LowRankConfigError(
                f"head_group_size={cfg.head_group_size} differs from the artifact's "
                f"{artifact.group_size} ({path}); drop head_group_size or recalibrate"
            )
        cfg = dataclasses.replace(cfg, head_group_size=artifact.group_size)
        cfg, bits = allocation_settings(cfg, artifact, path)
        exact = exact_tokens(cfg, vllm_config.cache_config.block_size)
    else:
        logger.warning("vllm-lowrank: no calibration artifact; using plain weight SVD "
                       "with uniform ranks (artifact=%r, method=%r). Expect a large "
                       "accuracy loss; calibrate for real use.", cfg.artifact, cfg.method)
        bits = None
    per_layer = mixes_attention_kinds(hf_config) or cfg.token_adaptive
    plans = layer_plans(cfg, shapes, artifact, per_layer=per_layer)
    return ModelCompression(cfg=cfg, plans=plans, artifact=artifact, artifact_path=path,
                            exact_tokens=exact, bits=bits, one_page=per_layer)


def allocation_settings(cfg: LowRankConfig, artifact: art.Artifact, path: str):
    """The settings and per-layer bits of an artifact's byte-budget allocation
    (:mod:`vllm_lowrank.calibration.allocate`), or ``(cfg, None)`` without one.

    The allocation was solved for particular serving settings (exact tokens,
    per-channel keys, Hadamard, quantization groups); they are taken from the
    artifact. A setting the user gave (:attr:`LowRankConfig.explicit`, even at
    its default value) with another value is refused, as are ``k_bits`` /
    ``v_bits`` (the artifact fixes bits per layer).

    Raises:
        LowRankConfigError: a conflicting setting.
    """
    stored = artifact.manifest.get("ranks") or {}
    if "bits" not in stored:
        return cfg, None
    if cfg.post_rope_keys:
        raise LowRankConfigError(
            f"{path} is a byte-budget allocation, which cuts key ranks; post_rope_keys "
            "keeps every key at full width: drop post_rope_keys or use a calibration "
            "artifact without an allocation")
    if {"k_bits", "v_bits"} & cfg.explicit:
        raise LowRankConfigError(
            f"{path} fixes K/V bits per layer (a byte-budget allocation); drop "
            f"k_bits/v_bits (got {cfg.k_bits}/{cfg.v_bits}) or use another artifact")
    serving = stored["serving"]
    for key, value in serving.items():
        given = getattr(cfg, key)
        if key in cfg.explicit and given != value:
            raise LowRankConfigError(
                f"{path} was allocated for {key}={value!r}; drop {key} (got {given!r}) "
                "or allocate again with it")
    bits = {int(i): (int(b[0]), int(b[1])) for i, b in stored["bits"].items()}
    return dataclasses.replace(cfg, **serving), bits


def slot_layouts(cfg: LowRankConfig, ranks: Sequence[tuple[Sequence[int], Sequence[int]]],
                 bits: Sequence[tuple[int, int]] | None = None, one_page: bool | None = None):
    """Packed slot layout of every layer, or ``None`` when ``cfg`` stores
    latents unquantized and no per-layer ``bits`` are given.

    When vLLM needs one page size (``one_page``; ``None``: inferred as "every
    layer has the same latent width", the token-adaptive mode and hybrid
    models) but the slots' natural sizes differ (a K/V split or bits that
    differ by layer, per-channel key shares), every slot is padded to the
    largest (:func:`~vllm_lowrank.format.latent.page_padding`).

    Args:
        cfg: The settings (bits, quantization groups, per-channel keys).
        ranks: ``(k_ranks, v_ranks)`` per head group, one pair per layer.
        bits: ``(k_bits, v_bits)`` per layer (a byte-budget allocation), or
            ``None``: ``cfg.k_bits`` / ``cfg.v_bits`` everywhere. Per-channel
            keys (``cfg.k_quant``) apply to the layers whose keys are quantized.
        one_page: Pad every slot to one size (see above).

    Returns:
        ``[SlotLayout]`` in the order of ``ranks``, or ``None``.
    """
    if not cfg.quantized and bits is None:
        return None
    from vllm_lowrank.format.latent import SlotLayout, page_padding

    q = cfg.quant_group_size
    bits = list(bits) if bits is not None else [(cfg.k_bits, cfg.v_bits)] * len(ranks)

    def make(k, v, b, pad_to=None):
        channel = cfg.k_channel_tokens if cfg.k_quant == "channel" and b[0] < 16 else None
        return SlotLayout(k, v, b[0], b[1], q, q, k_channel_tokens=channel, pad_to=pad_to)

    if one_page is None:
        one_page = len({sum(k) + sum(v) for k, v in ranks}) == 1
    pad = page_padding([make(k, v, b).slot_bytes for (k, v), b in zip(ranks, bits)], one_page)
    return [make(k, v, b, pad) for (k, v), b in zip(ranks, bits)]


def mixes_attention_kinds(hf_config) -> bool:
    """True when the model has layers of more than one attention kind (e.g.
    Gemma-3: sliding-window and full attention, ``config.layer_types``).

    vLLM's hybrid KV cache manager then keeps one block-table group per kind
    and needs every layer's page to be the same size: layers with different
    latent widths would each get a group of their own with pages padded to the
    widest layer (measured on Gemma-3-270M at ratio 0.5 with free allocation:
    1.19x the stock capacity instead of 2x). So such models get the same latent
    width in every layer (:func:`layer_plans` with ``per_layer``), and the
    allocation only chooses the K/V and head-group split inside each layer.
    """
    return len(set(getattr(hf_config, "layer_types", None) or [])) > 1


def record_ranks(artifact: art.Artifact, plans: dict[int, LayerPlan], cfg: LowRankConfig,
                 fixed: bool = False) -> None:
    """Write the allocation for ``cfg`` into the artifact's manifest (``ranks``:
    ratio, allocation, per-layer ``[k_ranks, v_ranks]`` per head group). With
    ``fixed`` it is served as is; otherwise it documents what ``cfg.rank_fraction``
    gives and serving re-derives it from the spectra for any ratio."""
    artifact.manifest["ranks"] = {
        "ratio": cfg.rank_fraction, "allocation": cfg.rank_allocation, "fixed": fixed,
        "layers": {str(i): [list(p.k_ranks), list(p.v_ranks)] for i, p in plans.items()},
    }


def allocate(cfg: LowRankConfig, shapes: dict[int, AttentionShape],
             artifact: art.Artifact | None, per_layer: bool = False) -> dict[int, LayerPlan]:
    """Layer plans for ``cfg`` (public alias of the resolver's allocation step)."""
    return layer_plans(cfg, shapes, artifact, per_layer)


def layer_plans(cfg: LowRankConfig, shapes: dict[int, AttentionShape],
                artifact: art.Artifact | None, per_layer: bool = False) -> dict[int, LayerPlan]:
    """Plans of every layer: ``ranks`` overrides, an artifact's fixed
    allocation, or the ``rank_allocation`` of ``cfg`` over one global budget
    (``per_layer``: one budget per layer, so every layer gets the same width;
    see :func:`mixes_attention_kinds`)."""
    fixed = {i: uniform_plan(cfg, s, i) for i, s in shapes.items()
             if cfg.ranks and i in cfg.ranks}
    stored = artifact.manifest.get("ranks") if artifact is not None else None
    if stored and stored.get("fixed"):
        # An allocation chosen at calibration time (e.g. a byte-budget search):
        # served as recorded, whatever the ratio.
        g = artifact.group_size
        n, where = next(iter(shapes.values())).num_kv_heads // g, artifact_path_hint(artifact)
        return {i: LayerPlan(s, g, *(shard.tied_fixed_ranks(r, n, i, where)
                                     for r in stored["layers"][str(i)]))
                for i, s in shapes.items()}
    free = {i: s for i, s in shapes.items() if i not in fixed}
    if cfg.rank_allocation != "uniform" and artifact is not None and free:
        if cfg.rank_allocation == "fisher" and artifact.manifest["method"] not in LOSS_METHODS:
            raise LowRankConfigError(
                f"rank_allocation=\"fisher\" needs an artifact calibrated with a method "
                f"of {list(LOSS_METHODS)}; {artifact_path_hint(artifact)} used "
                f"{artifact.manifest['method']!r}"
            )
        n = next(iter(free.values())).num_kv_heads // artifact.group_size
        spectra, normalize = shard.tied_spectra(  # identity without tensor parallelism
            {i: s for i, s in artifact.spectra().items() if i in free}, n,
            cfg.rank_allocation == "energy")
        budgets = [{i: s} for i, s in free.items()] if per_layer else [free]
        allocated = {}
        for part in budgets:
            allocated.update(energy_plans(part, artifact.group_size,
                                          {i: spectra[i] for i in part}, cfg.rank_fraction,
                                          normalize=normalize, multiple=cfg.rank_multiple,
                                          full_keys=cfg.post_rope_keys))
    else:
        if cfg.rank_allocation != "uniform" and free:
            logger.warning("vllm-lowrank: energy rank allocation needs a calibration "
                           "artifact; using uniform ranks")
        allocated = {i: uniform_plan(cfg, s, i) for i, s in free.items()}
    return {i: (fixed.get(i) or allocated[i]) for i in shapes}


def artifact_path_hint(artifact: art.Artifact) -> str:
    return f"the artifact of {artifact.manifest['model'].get('id')!r}"
