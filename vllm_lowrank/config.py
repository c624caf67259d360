"""The ``--kv-compression-config`` settings: parsing, validation and defaults.

One frozen dataclass, :class:`LowRankConfig`, carries every user-facing knob,
and is the schema: each key's annotation holds its type or choices and a
pydantic ``Field`` with its range and meaning, from which the validation, the
README key table and the CLI help are made. It travels to every vLLM process inside ``VllmConfig.additional_config`` under the
key :data:`ADDITIONAL_CONFIG_KEY`, as a plain JSON dict, so it is part of vLLM's
compile-cache hash and survives process spawning.

Terms used throughout the package:

- *latent*: the rank-``r`` vector ``x @ A`` cached per token instead of the full
  key or value heads.
- *head group* (G-LRD, Palu sec. 3.2.3): ``head_group_size`` consecutive KV
  heads that share one latent. ``head_group_size=1`` is per-head (M-LRD),
  ``head_group_size`` equal to the layer's KV heads is joint (J-LRD). (Not the
  quantization group of GPTQ/AWQ/KIVI: that is ``quant_group_size``.)
- *rank fraction*: the fraction of the K+V cache width kept, ``sum(r_k + r_v) /
  (2 * num_kv_heads * head_dim)`` per layer, before rank rounding.
- *compression ratio* (or *compression*): original KV bytes per token / stored
  bytes per token.

The keys ``ratio`` and ``group_size`` of earlier releases are read as
``rank_fraction`` and ``head_group_size`` with a warning
(:data:`DEPRECATED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import typing
import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from vllm_lowrank.errors import LowRankConfigError
from vllm_lowrank.presets import DEFAULT_PRESET, PRESETS
from vllm_lowrank.presets import expand as expand_preset

ADDITIONAL_CONFIG_KEY = "kv_compression"
"""Key of this plugin's settings inside ``VllmConfig.additional_config``."""

Mode = Literal["none", "lowrank"]
Method = Literal["svd", "whitened", "eigen", "kq", "post_rope", "fisher", "rope_equivariant"]
RankAllocation = Literal["uniform", "energy", "fisher"]
StorageBits = Literal[16, 8, 4, 3, 2]
ExactBits = Literal[16, 8]
KQuantAxis = Literal["token", "channel"]
CalibrationText = Literal["wikipedia", "mix"]
"""Built-in calibration texts (:data:`vllm_lowrank.calibration.text.CALIBRATION_TEXTS`)."""
MODES = get_args(Mode)
METHODS = get_args(Method)
RANK_ALLOCATIONS = get_args(RankAllocation)
STORAGE_BITS = get_args(StorageBits)
EXACT_BITS = get_args(ExactBits)
"""Storage of the token-adaptive mode's exact keys and values (16: model dtype)."""
K_QUANT_AXES = get_args(KQuantAxis)
LOSS_METHODS = ("fisher", "rope_equivariant")
"""Methods whose basis energies are estimated loss increases (the Fisher
metric): the ones ``rank_allocation: "fisher"`` and byte-budget allocation take."""
RANK_MULTIPLE = 8
"""Ranks are rounded to multiples of 8: the tensor-core tile of the GPU kernels
(``tl.dot`` needs K >= 16 on bf16, 8 keeps small heads usable) and whole bytes
for every packed bit width."""
MAX_TOKENS = 1 << 24
"""Static bound on every token count of the config (16M tokens); the sink and
recent windows are also checked against the model's ``max_model_len`` before
the engine starts (:func:`vllm_lowrank.models.adapters.check_model`)."""
MAX_CALIBRATION_TOKENS = 1 << 18
"""Most calibration tokens ``artifact: "auto"`` may ask for: the default text
(the calibration half of the gensim Wikipedia excerpt) gives about 375k tokens
with SmolLM2's tokenizer; a user text is checked when it is read."""


def _key(meaning: str, *, refused: str | None = None, default_text: str | None = None,
         row: str | None = None, **constraints: Any) -> FieldInfo:
    """The schema of one config key: its ``meaning`` (Markdown; the README key
    table and the CLI help), pydantic ``constraints`` (``ge``, ``le``,
    ``multiple_of``, ...), the message of a value below range (``refused``,
    formatted with ``value``; default: ``KEY=VALUE must be >= LOW``), the
    default as documented where the field's own is not what a user gets
    (``default_text``), and ``row``: the key whose README row it shares."""
    return Field(description=meaning, **constraints, json_schema_extra={
        "refused": refused, "default_text": default_text, "row": row})


@dataclasses.dataclass(frozen=True)
class LowRankConfig:
    """Settings of the latent KV cache: the schema of ``--kv-compression-config``.

    Each key's meaning, type and range live in its annotation (a pydantic
    ``Field``: the one source of the validation in :meth:`validate`, the
    README key table :func:`keys_table` and the CLI help :func:`keys_help`);
    rules that tie keys together are in :meth:`validate`. The semantics:

    Attributes:
        mode: ``"none"`` (stock vLLM) or ``"lowrank"``.
        preset: A measured recipe (:data:`vllm_lowrank.presets.PRESETS`:
            ``"2x"``, ``"lossless"``, ``"4x"``, ``"8x"``) whose settings fill
            the keys the user did not give; ``None``: none. A config with no
            key but ``mode`` (``--kv-compression lowrank`` alone) takes
            :data:`vllm_lowrank.presets.DEFAULT_PRESET`; the field defaults
            below apply to the keys a config without a preset leaves out.
        rank_fraction: Fraction of the K+V cache width kept per layer, in ``(0, 1]``.
            ``1.0`` keeps full rank: identity factors; greedy tokens equal the
            stock engine's in float32, in bf16 they differ by rounding (README).
        head_group_size: KV heads decomposed together (G-LRD). ``None`` means all KV
            heads of the layer (of one tensor-parallel rank's shard); must
            divide the number of KV heads per rank (a group never spans ranks).
        ranks: Optional per-layer override ``{layer_index: (r_k, r_v)}``: total
            key and value latent width of the layer (all tensor-parallel ranks
            together), split evenly over its head groups. Layers not listed
            follow ``rank_fraction``.
        method: Basis of the factorization: ``"svd"`` (weights only), ``"whitened"``
            (activation-aware SVD), ``"eigen"`` (PCA of keys with queries),
            ``"kq"`` (attention-output-aware), ``"post_rope"`` (ZACK: scores in
            the latent space, no key rebuild; ``head_group_size`` 1), ``"fisher"``
            (loss-aware, K-FAC Fisher metric; the default) or
            ``"rope_equivariant"`` (``fisher`` with a key basis that commutes
            with RoPE: complex-linear per frequency across the group's heads). See
            :mod:`vllm_lowrank.factorization.bases`.
        rank_allocation: ``"uniform"`` (same rank everywhere), ``"energy"``
            (one global budget spread by each basis' normalised energy) or
            ``"fisher"`` (one global budget spread by estimated loss increase;
            needs a method of :data:`LOSS_METHODS`).
        artifact: Path of a calibration artifact directory, ``"auto"`` (use the
            cached artifact for this model and settings, calibrating once on the
            default text if there is none) or ``"none"`` (no calibration: weight
            SVD, logged).
        calibration_tokens: Tokens of calibration text for ``artifact="auto"``.
        calibration_text: The built-in text ``artifact="auto"`` calibrates on
            (and a preset's allocation measures its choices on): ``"wikipedia"``
            or ``"mix"`` (Wikipedia, BBC News and Shakespeare in turn;
            :data:`vllm_lowrank.calibration.text.CALIBRATION_TEXTS`).
        k_bits, v_bits: Storage of the key / value latents: 16 (model dtype,
            no quantization) or 8, 4, 3, 2 (per-token asymmetric integers with
            float16 scale/zero, packed; :mod:`vllm_lowrank.format.latent`).
        quant_group_size: Latent channels per scale/zero pair; ``None`` = one
            pair per head group per token. Must be a multiple of 8; ranks are
            then allocated in multiples of it.
        hadamard: Fold a randomised Walsh-Hadamard rotation into the factors of
            quantized sides (Palu eq. 8; not per-channel keys); no run-time cost.
        token_adaptive: TALE mode (sec. 2.2): the first ``sink_tokens`` and
            the last ``recent_tokens`` tokens of every sequence are cached
            exactly as well, and attention reads them exactly; only the
            middle of the context is read from latents. Costs ``(sink +
            recent)`` full KV slots per sequence (counted by vLLM).
        sink_tokens: Attention-sink tokens kept exact (rounded up to whole
            KV blocks: the block is stored anyway); 0 for none.
        recent_tokens: Most recent tokens kept exact (rounded up to whole KV
            blocks), at least 1.
        exact_bits: Storage of the exact tokens' keys and values: 16 (the
            model dtype, bit for bit) or 8 (per-token, per-head int8 with
            float16 scale/zero: half the bytes, +0.0 % perplexity on the
            embedded model when the whole cache is stored so; see
            :class:`~vllm_lowrank.format.exact.ExactSlot`).
        admission_watermark: The token-adaptive mode's admission watermark
            (vLLM's ``--watermark``): ``None`` sets
            :data:`~vllm_lowrank.format.exact.PREEMPTION_WATERMARK` (0.1) when
            the engine's own is 0 (its default); a number sets that one, ``0``
            none. A nonzero ``--watermark`` wins over both.
        k_quant: ``"token"`` (per-token scale/zero, Palu) or ``"channel"``
            (per-channel scale/zero over groups of ``k_channel_tokens`` tokens,
            KIVI sec. 3.2). ``"channel"`` needs quantized keys and
            ``token_adaptive``: a group is quantized once it is complete, from
            latents staged in the exact cache while its tokens are recent.
        k_channel_tokens: Tokens per per-channel key group; must divide the KV
            block size.
        post_rope_keys: Cache every key after RoPE at its full width, one per
            KV head, quantized as ``k_bits`` / ``k_quant`` say, and score it as
            stored: no key basis, no key rebuild, no RoPE at decode (KIVI's
            post-RoPE keys, Liu et al. 2024, sec. 3.2, beside latent values).
            The method's bases and ranks then shape the values only; the key
            width still counts in ``rank_fraction`` (``0.75`` keeps full keys
            and half the value width). Needs ``token_adaptive``.
        allow_slow_path: On a CUDA device, serve layers that no fused kernel
            decodes (a 16-bit side inside a packed slot, or a kernel that
            failed its start-up self-check) on the torch path, eagerly and
            several times slower; ``False`` refuses them with the reason.
        explicit: The keys the user gave (:meth:`from_dict`), whatever their
            value: settings an artifact's allocation fixes replace the others
            and refuse a conflicting explicit one
            (:func:`vllm_lowrank.models.compression.allocation_settings`). Not a
            config key.
    """

    mode: Mode = "none"
    preset: Annotated[str | None, _key(
        "a measured recipe: " + ", ".join(f"`{n}`" for n in PRESETS)
        + " (see \"Which setting\"); the other keys override its settings",
        default_text=f"`{DEFAULT_PRESET}` when the config gives no other key, else none", strict=True)] = None
    rank_fraction: Annotated[float, _key(
        "fraction of the K+V cache width kept, `0 < rank_fraction <= 1` (was `ratio`)",
        refused="rank_fraction={value} is out of range: it is the fraction of the K+V "
                "cache width kept and must satisfy 0 < rank_fraction <= 1 (e.g. 0.5 for 2x)",
        gt=0.0, le=1.0, allow_inf_nan=False, strict=True)] = 0.5
    head_group_size: Annotated[int | None, _key(
        "KV heads decomposed together (G-LRD; was `group_size`): `1` per head, `null` all KV "
        "heads of a layer (J-LRD); with tensor parallelism a group never spans ranks: it must "
        "divide each rank's KV heads, and `null` means all KV heads of the rank's shard",
        refused="head_group_size={value} must be >= 1 (1 = per KV head) or null (all KV "
                "heads of a layer)", ge=1, le=1 << 12, strict=True)] = None
    ranks: Annotated[Mapping[int, tuple[int, int]] | None, _key(
        "per-layer override `{\"layer\": [r_k, r_v]}` (total latent widths of the layer, all "
        "ranks together; must split evenly over the tensor-parallel ranks)")] = None
    method: Annotated[Method, _key(
        "bases: `svd` (weights only), `whitened` (activation-aware SVD), `eigen` (PCA of keys "
        "with queries), `kq` (attention-aware), `post_rope` (ZACK: scores in the latent space, "
        "no key rebuild; needs `head_group_size: 1`; without a calibration artifact only at "
        "full key width, `ranks` may cut the values), `fisher` (loss-aware, K-FAC), "
        "`rope_equivariant` (`fisher` with keys complex-linear per RoPE frequency across "
        "heads)")] = "fisher"
    rank_allocation: Annotated[RankAllocation, _key(
        "`uniform`, `energy` (normalised spectra), `fisher` (estimated loss increase, one "
        "global budget)")] = "fisher"
    artifact: Annotated[str, _key(
        "calibration artifact directory; `\"auto\"`: cached per model, made on first start; "
        "`\"none\"`: weight SVD, no calibration (logged; destroys accuracy). An artifact from "
        "`vllm-lowrank allocate` also fixes ranks, bits per layer and the serving settings it "
        "was allocated for, and the KV block size unless `--block-size` is given",
        refused="artifact must be a directory path, \"auto\" or \"none\"",
        min_length=1, max_length=4096, strict=True)] = "auto"
    calibration_tokens: Annotated[int, _key(
        "tokens of calibration text for `artifact: \"auto\"`",
        refused="calibration_tokens={value} is too small; use >= 512 (default 16384)",
        ge=512, le=MAX_CALIBRATION_TOKENS, strict=True)] = 16384
    calibration_text: Annotated[CalibrationText, _key(
        "built-in text `artifact: \"auto\"` calibrates on: `wikipedia` or `mix` (Wikipedia, BBC "
        "News and Shakespeare in turn; no code)")] = "wikipedia"
    k_bits: Annotated[StorageBits, _key(
        "latent storage: `16` (model dtype) or `8`, `4`, `3`, `2` (packed per-token asymmetric "
        "integers with float16 scale and zero)")] = 16
    v_bits: Annotated[StorageBits, _key("", row="k_bits")] = 16
    quant_group_size: Annotated[int | None, _key(
        "latent channels per scale/zero pair (multiple of 8; ranks are then multiples of it); "
        "`null`: one pair per head group and token",
        refused=f"quant_group_size={{value}} must be a positive multiple of {RANK_MULTIPLE} "
                "(or null: one scale per head group per token)",
        ge=RANK_MULTIPLE, multiple_of=RANK_MULTIPLE, le=1 << 12, strict=True)] = None
    hadamard: Annotated[bool, _key(
        "fold a randomised Walsh-Hadamard rotation into the factors of quantized per-token "
        "sides (Palu eq. 8; no run-time cost)", strict=True)] = True
    token_adaptive: Annotated[bool, _key(
        "TALE mode: the first `sink_tokens` and last `recent_tokens` tokens of every sequence "
        "are also cached exactly and attended exactly; only the middle of the context is read "
        "from latents (see \"Token-adaptive mode\")", strict=True)] = False
    sink_tokens: Annotated[int, _key(
        "exact attention-sink tokens, rounded up to whole KV blocks (`0`: none)",
        refused="sink_tokens={value} must be >= 0 (0: no exact sinks)",
        ge=0, le=MAX_TOKENS, strict=True)] = 4
    recent_tokens: Annotated[int, _key(
        "exact recent tokens, rounded up to whole KV blocks",
        refused="recent_tokens={value} must be >= 1; to turn the exact recent window off, "
                "set token_adaptive to false", ge=1, le=MAX_TOKENS, strict=True)] = 128
    exact_bits: Annotated[ExactBits, _key(
        "storage of the exact tokens' keys and values: `16` (model dtype) or `8` (int8 per "
        "token and head, float16 scale/zero: half their bytes)")] = 16
    admission_watermark: Annotated[float | None, _key(
        "token-adaptive mode: vLLM's admission watermark (`--watermark`, the fraction of KV "
        "blocks kept free when admitting requests), `0 <= admission_watermark < 1`; `null`: "
        "0.1 unless `--watermark` is given (see \"Token-adaptive mode\"); `0` turns it off",
        refused="admission_watermark={value} is out of range: it is a fraction of the KV "
                "blocks, 0 <= admission_watermark < 1 (0: no watermark)",
        ge=0.0, lt=1.0, allow_inf_nan=False, strict=True)] = None
    k_quant: Annotated[KQuantAxis, _key(
        "quantized keys: `token` (per-token scale/zero, Palu) or `channel` (per-channel "
        "scale/zero over groups of `k_channel_tokens` tokens, KIVI; needs `token_adaptive`, "
        "see \"Per-channel keys\")")] = "token"
    k_channel_tokens: Annotated[int, _key(
        "tokens per per-channel key group; must divide the KV block size",
        refused="k_channel_tokens={value} must be >= 1 (tokens per per-channel key group, "
                "a divisor of the KV block size; e.g. 32)", ge=1, le=1 << 12, strict=True)] = 32
    post_rope_keys: Annotated[bool, _key(
        "cache keys after RoPE at full width, quantized per `k_bits`/`k_quant`, and score "
        "them as stored (no key basis or rebuild); bases and ranks then cut the values "
        "only, and the full key width counts in `rank_fraction` (`0.75`: full keys, half "
        "the value width); needs `token_adaptive`", strict=True)] = False
    allow_slow_path: Annotated[bool, _key(
        "on a GPU, serve layers that no fused kernel decodes (a raw 16-bit side in a packed "
        "slot, a kernel that failed its start-up self-check) on the torch path, eagerly; "
        "`false` refuses them, naming the reason", strict=True)] = False
    explicit: frozenset = dataclasses.field(default=frozenset(), compare=False, repr=False,
                                            metadata={"internal": True})

    @property
    def quantized(self) -> bool:
        """True when either side is stored below 16 bits."""
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def rank_multiple(self) -> int:
        """Granularity of ranks (the quantization group when one is set)."""
        return self.quant_group_size or RANK_MULTIPLE

    @property
    def enabled(self) -> bool:
        """True when the latent cache is on."""
        return self.mode == "lowrank"

    @property
    def needs_calibration(self) -> bool:
        """True when the bases depend on calibration activations."""
        return self.method != "svd" or self.rank_allocation != "uniform"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (``ranks`` keys become strings)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if not f.metadata.get("internal")}
        if self.ranks is not None:
            d["ranks"] = {str(k): list(v) for k, v in self.ranks.items()}
        return d

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LowRankConfig:
        """Build and validate a config from a JSON-like mapping.

        Raises:
            LowRankConfigError: unknown key, wrong type or value out of range.
        """
        if not isinstance(raw, Mapping):
            raise LowRankConfigError(
                f"--kv-compression-config must be a JSON object, got "
                f"{type(raw).__name__}; e.g. '{{\"preset\": \"2x\"}}'"
            )
        raw = _renamed(raw)
        known = set(_KEY_NAMES)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise LowRankConfigError(
                f"unknown --kv-compression-config key(s) {unknown}; "
                f"valid keys: {sorted(known)}"
            )
        kwargs = expand_preset(raw)
        if "ranks" in kwargs and kwargs["ranks"] is not None:
            kwargs["ranks"] = _parse_ranks(kwargs["ranks"])
        for key in ("rank_fraction", "admission_watermark"):
            if kwargs.get(key) is not None:
                kwargs[key] = _number(key, kwargs[key])
        for key, value in kwargs.items():
            # JSON numbers are exact: 16.0 is not the integer 16 (pydantic's lax
            # mode would take it, and its strict mode does not apply to choices)
            if key in _integer_keys() and value is not None:
                _integer(key, value)
        cfg = cls(**kwargs, explicit=frozenset(raw))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check every key against its schema (type, choices, range: the
        ``Field`` of its annotation), then the rules that tie keys together
        (model-dependent checks live in
        :func:`vllm_lowrank.models.adapters.check_model`).

        Raises:
            LowRankConfigError: one line naming the key, the offending value
                and what is accepted.
        """
        try:
            _schema().validate_python(
                {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        except ValidationError as e:
            raise _refusal(e.errors()[0]) from None
        if "\x00" in self.artifact:
            raise LowRankConfigError(_field_info("artifact").json_schema_extra["refused"])
        if self.method == "post_rope" and self.head_group_size != 1:
            raise LowRankConfigError(
                "method=\"post_rope\" projects each KV head after RoPE (ZACK) and "
                f"needs head_group_size 1, got {self.head_group_size}; add "
                "\"head_group_size\": 1"
            )
        if self.rank_allocation == "fisher" and self.method not in LOSS_METHODS:
            raise LowRankConfigError(
                f"rank_allocation=\"fisher\" compares energies in loss units, which "
                f"only methods {list(LOSS_METHODS)} produce (got method={self.method!r}); "
                "use rank_allocation \"energy\" or \"uniform\""
            )
        if self.exact_bits != 16 and not self.token_adaptive:
            raise LowRankConfigError(
                f"exact_bits={self.exact_bits} sets how the token-adaptive mode stores its "
                "exact sink and recent tokens; add \"token_adaptive\": true or drop exact_bits")
        if self.admission_watermark is not None and not self.token_adaptive:
            raise LowRankConfigError(
                f"admission_watermark={self.admission_watermark} sets the token-adaptive "
                "mode's admission watermark; add \"token_adaptive\": true or drop it (vLLM's "
                "own --watermark applies to any engine)")
        if self.token_adaptive and self.method == "post_rope":
            raise LowRankConfigError(
                "token_adaptive is not supported with method=\"post_rope\" (its queries "
                "are projected into the latent basis); use another method or set "
                "token_adaptive to false")
        if self.post_rope_keys:
            if not self.token_adaptive:
                raise LowRankConfigError(
                    "post_rope_keys caches keys after RoPE and quantizes them from the "
                    "exact recent tokens of the token-adaptive mode; add "
                    "\"token_adaptive\": true")
            if self.method in ("post_rope", "rope_equivariant"):
                raise LowRankConfigError(
                    f"post_rope_keys keeps keys without a key basis, so method="
                    f"{self.method!r} (a key basis) has nothing to shape; use \"fisher\" "
                    "(values only) or drop post_rope_keys")
            if self.rank_fraction <= 0.5:
                raise LowRankConfigError(
                    f"rank_fraction={self.rank_fraction} is the kept fraction of the K+V "
                    "width, and post_rope_keys keeps the full key width (0.5 of it); use "
                    "rank_fraction > 0.5 (0.75: half the value width)")
        if self.k_quant == "channel" and (self.k_bits == 16 or not self.token_adaptive):
            raise LowRankConfigError(
                "k_quant=\"channel\" quantizes keys per channel over groups of tokens "
                "and needs k_bits < 16 and token_adaptive true (a group is quantized "
                "once complete, from latents staged with the exact recent tokens); "
                f"got k_bits={self.k_bits}, token_adaptive={self.token_adaptive}")
        if self.ranks is not None:
            for layer, pair in self.ranks.items():
                if not all(1 <= r <= MAX_TOKENS for r in pair):
                    raise LowRankConfigError(
                        f"ranks[{layer}]={list(pair)}: each latent width must be a "
                        f"positive integer (at most the layer's K or V width)")


@functools.cache
def _schema() -> TypeAdapter:
    """The pydantic validator of :class:`LowRankConfig`'s annotations."""
    return TypeAdapter(LowRankConfig)


@functools.cache
def _field_info(name: str) -> FieldInfo | None:
    """The schema ``Field`` of a config key (``None`` for ``mode`` and
    ``explicit``)."""
    hint = typing.get_type_hints(LowRankConfig, include_extras=True)[name]
    return next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, FieldInfo)),
                None)


@functools.cache
def _integer_keys() -> frozenset[str]:
    """The keys whose values are integers: an ``int`` (or ``int | None``)
    annotation, or a choice among integers (``k_bits``)."""
    def integral(hint) -> bool:
        args = get_args(hint)
        if typing.get_origin(hint) is Literal:
            return all(type(a) is int for a in args)
        return hint is int or int in args
    return frozenset(name for name, hint in typing.get_type_hints(LowRankConfig).items()
                     if integral(hint))


def _refusal(error: Mapping[str, Any]) -> LowRankConfigError:
    """One line for the first error of the schema: the key, the value and what
    the key accepts (its ``refused`` message for a value below range, its
    choices, its maximum)."""
    key = error["loc"][0]
    value = error["input"]
    kind = error["type"]
    ctx = error.get("ctx") or {}
    info = _field_info(key)
    extra = (info.json_schema_extra if info is not None else None) or {}
    if kind == "literal_error":
        choices = list(get_args(typing.get_type_hints(LowRankConfig)[key]))
        return LowRankConfigError(f"{key}={value!r} is not supported; choose one of {choices}")
    if kind == "bool_type":
        return LowRankConfigError(f"{key} must be true or false, got {value!r:.40}")
    if kind in ("int_type", "float_type", "string_type", "finite_number"):
        what = {"int_type": "an integer", "float_type": "a number", "finite_number":
                "a finite number", "string_type": "a string"}[kind]
        return LowRankConfigError(f"{key} must be {what}, got {value!r:.40}")
    if kind in ("less_than_equal", "less_than") and key != "rank_fraction":
        default = getattr(LowRankConfig, key)
        bound = f"at most {ctx['le']} is accepted" if "le" in ctx else \
            f"it must be below {ctx.get('lt')}"
        return LowRankConfigError(f"{key}={value} is too large; {bound} (default "
                                  f"{'none' if default is None else default})")
    if extra.get("refused"):
        return LowRankConfigError(extra["refused"].format(value=value))
    return LowRankConfigError(f"{key}={value!r:.40}: {error['msg']}")


DEPRECATED_KEYS = {"ratio": "rank_fraction", "group_size": "head_group_size"}
"""Config keys of earlier releases and their names now: ``ratio`` (a kept
fraction, but ``allocate --ratio`` and the metrics meant a compression factor)
and ``group_size`` (KV heads per decomposition group, not a quantization
group). Read with a warning for one release."""


def _renamed(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """``raw`` with deprecated keys (:data:`DEPRECATED_KEYS`) under their new
    names, warning once per key (``FutureWarning`` and the ``vllm.lowrank`` log).

    Raises:
        LowRankConfigError: a key given under both its old and its new name.
    """
    old = [k for k in DEPRECATED_KEYS if k in raw]
    if not old:
        return raw
    out = dict(raw)
    for key in old:
        new = DEPRECATED_KEYS[key]
        if new in raw:
            raise LowRankConfigError(
                f"--kv-compression-config gives both {key!r} and {new!r}; {key!r} is the "
                f"old name of {new!r}: keep only {new!r}")
        out[new] = out.pop(key)
        message = (f"--kv-compression-config key {key!r} is deprecated and will be removed "
                   f"in the next release; use {new!r} (same meaning)")
        warnings.warn(message, FutureWarning, stacklevel=3)
        logging.getLogger("vllm.lowrank").warning("vllm-lowrank: %s", message)
    return out


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LowRankConfigError(
            f"{key}={value!r} is not supported; choose one of {list(choices)}"
        )


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LowRankConfigError(f"{key} must be a number, got {value!r:.40}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise LowRankConfigError(f"{key} must be a finite number, got {value!r:.40}")
    return number


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LowRankConfigError(f"{key} must be an integer, got {value!r:.40}")
    return value


def _parse_ranks(raw: Any) -> dict[int, tuple[int, int]]:
    from vllm_lowrank.inputs import layer_map

    if not isinstance(raw, Mapping):
        raise LowRankConfigError(
            "ranks must be an object {\"<layer>\": [r_k, r_v]}, e.g. "
            "{\"0\": [64, 128]}"
        )
    out: dict[int, tuple[int, int]] = {}
    for layer, value in layer_map(dict(raw), "ranks").items():
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise LowRankConfigError(
                f"ranks[\"{layer}\"] must be a pair of integers [r_k, r_v], got {value!r:.60}"
            )
        out[layer] = (int(value[0]), int(value[1]))
    return out


def parse_config_text(text: str) -> dict[str, Any]:
    """Parse ``--kv-compression-config``: inline JSON or a path to a JSON file
    (read and parsed within the limits of :mod:`vllm_lowrank.inputs`).

    Raises:
        LowRankConfigError: unreadable, non-regular, oversized or binary file,
            malformed, too deep or out-of-range JSON (with position).
    """
    from vllm_lowrank.inputs import MAX_CONFIG_BYTES, parse_json, read_text

    stripped = text.strip()
    source = "inline JSON"
    if not stripped.startswith("{"):
        if not os.path.lexists(stripped):
            raise LowRankConfigError(
                f"--kv-compression-config {text[:80]!r} is neither inline JSON (it must "
                "start with '{') nor an existing JSON file"
            )
        source = stripped
        stripped = read_text(stripped, "--kv-compression-config file", MAX_CONFIG_BYTES)
    elif len(stripped) > MAX_CONFIG_BYTES:
        raise LowRankConfigError(
            f"--kv-compression-config inline JSON is {len(stripped)} characters, more "
            f"than the {MAX_CONFIG_BYTES} accepted")
    value = parse_json(stripped, f"--kv-compression-config ({source})")
    if not isinstance(value, dict):
        raise LowRankConfigError(
            f"--kv-compression-config ({source}) must be a JSON object, got "
            f"{type(value).__name__}"
        )
    return value


_KEY_NAMES = tuple(f.name for f in dataclasses.fields(LowRankConfig)
                   if not f.metadata.get("internal"))
"""Every ``--kv-compression-config`` key, in order (``mode`` included)."""


def config_keys() -> tuple[tuple[tuple[str, ...], str, str], ...]:
    """The documented keys, in order, one row per meaning: ``(names, meaning
    (Markdown), default (Markdown))``, read from each key's schema ``Field``
    (keys with ``row`` join that key's row). The one source of the README's
    key table (:func:`keys_table`) and of the CLI help (:func:`keys_help`)."""
    rows: dict[str, list] = {}
    for name in _KEY_NAMES:
        info = _field_info(name)
        if info is None:
            continue
        extra = info.json_schema_extra or {}
        if extra.get("row"):
            rows[extra["row"]][0].append(name)
            continue
        default = extra.get("default_text") or f"`{json.dumps(getattr(LowRankConfig, name))}`"
        rows[name] = [[name], info.description, default]
    return tuple((tuple(names), meaning, default) for names, meaning, default in rows.values())


def keys_table() -> str:
    """The README's Markdown table of the config keys (:func:`config_keys`)."""
    rows = ["| key | meaning | default |", "|---|---|---|"]
    for names, meaning, default in config_keys():
        keys = ", ".join(f"`{n}`" for n in names)
        rows.append(f"| {keys} | {meaning} | {default} |")
    return "\n".join(rows) + "\n"


def keys_help() -> str:
    """The config keys as one line of plain text (``--kv-compression-config``
    help), from :func:`config_keys`."""
    parts = [f"{', '.join(names)}: {meaning}; default {default}".replace("`", "")
             for names, meaning, default in config_keys()]
    return "; ".join(parts)


def config_from_additional(additional_config: Mapping[str, Any] | None) -> LowRankConfig:
    """The plugin settings carried by ``VllmConfig.additional_config``.

    Missing key means compression off. A config is parsed and validated once
    per process (every layer, the backend and the decoders ask for it): later
    calls with the same settings return the same object.

    Raises:
        LowRankConfigError: the stored settings are invalid.
    """
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        return LowRankConfig()
    if isinstance(raw, str):
        # `--additional-config '{"kv_compression": "lowrank"}'` shorthand.
        _choice("kv_compression", raw, MODES)
        raw = {"mode": raw}
    try:
        key = json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError):  # not JSON: parse it as given (and refuse it there)
        return _config(dict(raw))
    return _parsed(key)


@functools.lru_cache(maxsize=64)
def _parsed(raw_json: str) -> LowRankConfig:
    """:func:`_config` of a canonical JSON settings object (the cache of
    :func:`config_from_additional`)."""
    return _config(json.loads(raw_json))


def _config(raw: dict) -> LowRankConfig:
    raw = dict(raw)
    raw.setdefault("mode", "lowrank")
    return LowRankConfig.from_dict(raw)


def config_from_vllm(vllm_config: Any) -> LowRankConfig:
    """Shorthand for ``config_from_additional(vllm_config.additional_config)``."""
    return config_from_additional(getattr(vllm_config, "additional_config", None))
