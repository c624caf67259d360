"""Presets: measured recipes behind ``{"preset": NAME}``.

A preset is a set of :class:`~vllm_lowrank.config.LowRankConfig` settings
(method, grouping, ranks or a byte-budget allocation, bits, the token-adaptive
exact windows) that was measured as a whole, with the accuracy it gave. Keys the
user gives next to ``preset`` override the preset's
(:meth:`LowRankConfig.from_dict`); the result is validated like any config.

The ``8x`` preset is a byte-budget allocation
(:func:`vllm_lowrank.calibration.allocate.budget_artifact`, target compression
``allocate``): on first start it is computed from the model's ``fisher``
artifact and cached beside it, like ``artifact: "auto"``
(:func:`vllm_lowrank.calibration.cache.load_or_allocate`); later starts load it.

Accuracy figures are from ``benchmarks/README.md`` (SmolLM2-135M-Instruct,
held-out Wikipedia and BBC news windows of 4,096 tokens, generate-style 32-token
steps, block size 32): another model will differ; check yours with
``vllm-lowrank perplexity MODEL --config '{"preset": ...}' --text FILE``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm_lowrank.errors import LowRankConfigError

TALE_CHANNEL_KEYS = {"token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128,
                     "k_quant": "channel", "k_channel_tokens": 32}
"""Token-adaptive mode (TALE sec. 2.2: 32 sink and 128 recent tokens exact) with
keys quantized per channel over 32-token groups (KIVI sec. 3.2): the setting
of the token-adaptive presets."""


POST_ROPE_KEYS_4X = {"post_rope_keys": True, "rank_fraction": 1.0, "head_group_size": 1,
                     "k_bits": 4, "v_bits": 2, **TALE_CHANNEL_KEYS, "k_channel_tokens": 64,
                     "exact_bits": 8}
"""The ``4x`` preset: every key after RoPE at 4 bits per channel over 64-token
groups (KIVI sec. 3.2, scored as stored), values at full rank and 2 bits per token
and KV head with the Hadamard rotation (Palu eq. 8), 32 sink + 128 recent tokens
exact as int8. Of the measured settings that a GPU decodes without a key rebuild,
the one at 4x or more with the lowest worst-domain loss (4.01x, +1.1 % on code;
the J-LRD latent-0.5 recipe it replaced: 5.18x, +3.3 %, decoded by rebuilding
every key); full rank: no calibration (benchmarks/README.md, "Decode without a
key rebuild: post-RoPE keys")."""


MIX_CALIBRATION = {"calibration_text": "mix", "calibration_tokens": 65536}
"""Calibration of the ``8x`` preset: 65,536 tokens of Wikipedia, BBC News and
Shakespeare in turn (no code). Against the 16,384 Wikipedia tokens of the other
presets it lowers the 8x recipe's worst held-out domain (code) from +11.2 % to
+5.0 % and lifts its passkey retrieval from 0.30 to 0.62 (benchmarks/README.md's history in git,
"More calibration tokens"); its first start on a CPU takes about 24 minutes for
SmolLM2-135M (calibration inside the server's worker, bound to one of 2 cores:
1,127 s, against 150 s for the 16,384 Wikipedia tokens)."""


TALE_GPU_PATH = ("token-adaptive: latent span on the Triton wide-group kernel, exact part "
                 "and merge in one Triton kernel, CUDA graphs, batched prefill; 2-6x "
                 "stock vLLM's decode step (H100, Llama-3-8B shape, 1 x 4k / 16 x 4k): "
                 "J-LRD's key rebuild is compute-bound (benchmarks/README.md)")
"""The decode path of the token-adaptive presets on a CUDA device."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """One measured recipe.

    Attributes:
        name: The value of ``preset``.
        settings: ``--kv-compression-config`` keys the preset sets.
        allocate: Target compression ratio (16-bit K+V bytes / stored bytes at
            a 4,096-token context) of a byte-budget allocation made on first
            start; ``None``: no allocation (ranks from ``rank_fraction``).
        measured: Compression ratio and perplexity change as measured, one line.
        gpu_path: The decode path its layers take on a CUDA device, and why.
        block_size: vLLM KV block size it was measured with, used when
            ``--block-size`` is not given (the exact windows round up to whole
            blocks, and 32-token per-channel key groups must divide a block);
            ``None``: vLLM's default.
    """

    name: str
    settings: Mapping[str, Any]
    measured: str
    gpu_path: str
    allocate: float | None = None
    block_size: int | None = None


PRESETS = {p.name: p for p in (
    Preset("2x", {"rank_fraction": 1.0, "head_group_size": 1, "method": "post_rope",
                  "rank_allocation": "uniform", "k_bits": 8, "v_bits": 4},
           "2.46x, +0.1 % wikipedia / +0.6 % bbc (full rank per KV head, post-RoPE latents "
           "(ZACK), Hadamard-rotated 8-bit keys and 4-bit values per token; no calibration)",
           "packed post-RoPE Triton kernel (codes in the dots, no key rebuild), CUDA graphs: "
           "1.01-1.08x / 0.92-0.98x / 0.69x / 0.68-0.74x stock's decode step at 1 x 4k / 16 x 4k / "
           "8 x 32k / 12 x 32k (H100, Llama-3-8B shape)"),
    Preset("lossless", {**POST_ROPE_KEYS_4X, "v_bits": 4},
           "3.25x, +0.0 % wikipedia / +0.1 % bbc / +0.1 % shakespeare / +0.4 % code "
           "(the 4x preset's post-RoPE keys at 4 bits per channel, values at full rank and "
           "4 bits per token and KV head, Hadamard-rotated, 32 sink + 128 recent tokens "
           "exact as int8; no calibration); passkey retrieval 0.80 against 0.84 "
           "uncompressed (1,024 tokens)",
           "the 4x preset's fused kernel (post-RoPE key codes and value latents, no key "
           "rebuild), CUDA graphs: in vLLM 0.87-0.90x stock's decode step at 16 x 4k and "
           "1.77x its throughput at equal KV memory, 1.64x FlashInfer's (H200, Llama-3-8B "
           "shape; benchmarks/README.md, \"GPU serving inside vLLM\")",
           block_size=64),
    Preset("4x", POST_ROPE_KEYS_4X,
           "4.01x, +0.4 % wikipedia / +0.2 % bbc / +0.9 % shakespeare / +1.1 % code "
           "(post-RoPE keys at 4 bits per channel over 64 tokens, values at full rank and "
           "2 bits per token and KV head, Hadamard-rotated, 32 sink + 128 recent tokens "
           "exact as int8; no calibration)",
           "post-RoPE key codes and value latents in one fused kernel (no key rebuild; "
           "the latent span and the exact tokens in one softmax), CUDA graphs: the "
           "mma.sync CUDA kernel for bf16/fp16 models (on an H200 0.39x stock attention's "
           "time per layer at 16 x 32k; in vLLM 0.52x stock's decode step at 8 x 32k, "
           "0.83-0.89x at 16 x 4k, and 2.03x its throughput at equal KV memory, 1.88x "
           "FlashInfer's), the "
           "Triton kernel otherwise (benchmarks/README.md, \"Decode without a key "
           "rebuild: post-RoPE keys\")",
           block_size=64),
    Preset("8x", {"k_bits": 4, "v_bits": 4, **TALE_CHANNEL_KEYS, "recent_tokens": 256,
                  "exact_bits": 8, **MIX_CALIBRATION},
           "8.05x, +0.4 % wikipedia / +2.5 % bbc / +2.4 % shakespeare / +5.0 % code "
           "(byte-budget allocation of ranks and bits per layer from 65,536 tokens of the "
           "calibration mix, int8 exact tokens, 32 sink + 256 recent); passkey retrieval "
           "0.62 against 0.84 uncompressed (1,024 tokens): not for retrieval",
           TALE_GPU_PATH,
           allocate=8.0, block_size=32),
)}
"""Every preset by name. ``lossless`` is the setting of lowest worst-domain loss
measured above 2.5x (+0.4 %, within +0.5 % on all four domains) among those a GPU
decodes without a key rebuild; on (worst-domain perplexity, throughput at equal KV
memory) it dominates the J-LRD latent-0.75 recipe it replaced (4.04x, +0.6 %, under
0.3x FlashInfer's throughput: every decode step rebuilt every key). The ``8x``
preset's ``k_bits``/``v_bits`` stand in for the allocation's per-layer bits, which
replace them."""


DEFAULT_PRESET = "2x"
"""The preset a config with no key but ``mode`` selects (``vllm serve MODEL
--kv-compression lowrank``): of the measured settings the only one that is
accurate (+0.1 % / +0.6 %), needs no calibration and decodes on a GPU at
stock vLLM's speed or faster (1.01-1.08x / 0.92-0.98x / 0.69x / 0.68-0.74x stock's decode
step at 1 x 4k / 16 x 4k / 8 x 32k / 12 x 32k, H100, Llama-3-8B shape;
benchmarks/README.md, "GPU serving inside vLLM"). Ratio 0.5
with 16-bit latents, the earlier default, stores more bytes (2x against
2.46x), loses 24.7 % and decodes 1.55x / 5.0x slower than stock."""


def get_preset(name: Any) -> Preset:
    """The preset called ``name``.

    Raises:
        LowRankConfigError: not a preset name (the message lists them).
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise LowRankConfigError(
            f"preset={name!r} is not a preset; choose one of {sorted(PRESETS)} "
            "(see the README's \"Which setting\" table)")
    return PRESETS[name]


def expand(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with its preset's settings filled in under the keys it gives.

    Args:
        raw: ``--kv-compression-config`` mapping, with or without ``preset``;
            ``{"mode": "lowrank"}`` alone selects :data:`DEFAULT_PRESET`.

    Returns:
        A new dict: the preset's settings updated by ``raw`` (``preset`` kept).

    Raises:
        LowRankConfigError: unknown preset, or (``8x``) a key that its
            allocation chooses itself (``rank_fraction``, ``ranks``, ``k_bits``,
            ``v_bits``, ``rank_allocation``, ``artifact``, ``method``,
            ``post_rope_keys``: its key ranks are cut).
    """
    if set(raw) == {"mode"} and raw["mode"] == "lowrank":
        raw = {**raw, "preset": DEFAULT_PRESET}
    if raw.get("preset") is None:
        return dict(raw)
    preset = get_preset(raw["preset"])
    if preset.allocate is not None:
        fixed = sorted({"rank_fraction", "ranks", "k_bits", "v_bits", "rank_allocation",
                        "artifact", "method", "post_rope_keys"} & set(raw))
        if fixed:
            raise LowRankConfigError(
                f"preset {preset.name!r} allocates ranks and bits per layer on first "
                f"start; drop {fixed} or use another preset")
    return {**preset.settings, **raw}
