"""What differs between the supported architectures: one table.

Every supported model is vLLM's own causal LM class whose attention module is
replaced at construction by :class:`~vllm_lowrank.models.latent_self_attention.LatentSelfAttention`
(:mod:`vllm_lowrank.models.causal_lm`). Per Hugging Face architecture name,
:data:`ARCHITECTURES` records which vLLM classes those are and how to read the
attention settings (RoPE parameters, QK-norm, biases, sliding window, softmax
scale) from the arguments vLLM passes to its own attention constructor, so the
latent module computes exactly what the stock one does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """How one layer's attention differs from plain Llama attention.

    Attributes:
        rope_parameters: The layer's RoPE parameters (``config.rope_parameters``,
            or the per-layer-type entry for Gemma-3), or ``None``.
        max_position: Positions the RoPE table covers.
        qkv_bias: q/k/v projections carry biases.
        o_bias: o_proj carries a bias.
        qk_norm: ``None``, ``"rms"`` (per-head RMSNorm ``x * w``; Qwen3) or
            ``"gemma"`` (``x * (1 + w)``; Gemma-3), applied to queries and keys
            between the projection and RoPE.
        norm_eps: Epsilon of the QK-norm.
        scale: Softmax scale; ``None`` means ``head_dim ** -0.5``.
        sliding_window: Tokens a query sees (itself included) on a
            sliding-window layer, or ``None`` for full attention.
    """

    rope_parameters: dict | None
    max_position: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    scale: float | None = None
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One supported architecture.

    Attributes:
        model: ``"module:Class"`` of vLLM's causal LM.
        attention: ``"module:Class"`` of vLLM's attention module it builds per
            layer (replaced, exact class only).
        settings: ``(constructor arguments, layer index) -> AttentionSettings``;
            the arguments are those vLLM passed to ``attention``, with its
            defaults filled in.
        refuse: ``hf_config -> reason`` for configurations of this architecture
            the latent cache cannot serve, or ``None``.
    """

    model: str
    attention: str
    settings: Callable[[dict[str, Any], int], AttentionSettings]
    refuse: Callable[[Any], str | None] = lambda config: None


def _layer_window(config, layer: int) -> int | None:
    """``config.sliding_window`` on layers whose ``layer_types`` entry is
    ``"sliding_attention"`` (the Llama/Mistral/Gemma-3 convention)."""
    types = getattr(config, "layer_types", None)
    if types and types[layer] == "sliding_attention":
        return config.sliding_window
    return None


def _llama(a: dict[str, Any], layer: int) -> AttentionSettings:
    config = a["config"]
    return AttentionSettings(
        rope_parameters=getattr(config, "rope_parameters", None),
        max_position=a["max_position_embeddings"],
        qkv_bias=a["bias"], o_bias=a["bias_o_proj"],
        sliding_window=_layer_window(config, layer),
    )


def _qwen2(a: dict[str, Any], layer: int) -> AttentionSettings:
    return AttentionSettings(
        rope_parameters=a["rope_parameters"], max_position=a["max_position"],
        qkv_bias=True, qk_norm="rms" if a["qk_norm"] else None, norm_eps=a["rms_norm_eps"],
    )


def _qwen3(a: dict[str, Any], layer: int) -> AttentionSettings:
    return AttentionSettings(
        rope_parameters=a["rope_parameters"], max_position=a["max_position"],
        qkv_bias=a["qkv_bias"], qk_norm="rms", norm_eps=a["rms_norm_eps"],
        sliding_window=a["per_layer_sliding_window"],
    )


def _gemma3(a: dict[str, Any], layer: int) -> AttentionSettings:
    config = a["config"]
    kind = config.layer_types[layer]
    return AttentionSettings(
        rope_parameters=config.rope_parameters[kind],
        max_position=a["max_position_embeddings"],
        qkv_bias=config.attention_bias, o_bias=config.attention_bias,
        qk_norm="gemma", norm_eps=config.rms_norm_eps,
        scale=config.query_pre_attn_scalar ** -0.5,
        sliding_window=_layer_window(config, layer),
    )


def _not_causal(config) -> str | None:
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return "bidirectional (encoder-only) attention has no KV cache to compress"
    return None


def _qwen_refuse(config) -> str | None:
    if getattr(config, "dual_chunk_attention_config", None):
        return "dual-chunk attention is not supported by the latent cache"
    return _not_causal(config)


def _mistral_refuse(config) -> str | None:
    if getattr(config, "llama_4_scaling", None):
        return "Llama-4 position-dependent query scaling is not supported by the latent cache"
    return _not_causal(config)


def _gemma3_refuse(config) -> str | None:
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping is not supported by the latent cache"
    return _not_causal(config)


_M = "vllm.model_executor.models"
ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        f"{_M}.llama:LlamaForCausalLM", f"{_M}.llama:LlamaAttention", _llama, _not_causal),
    "MistralForCausalLM": Architecture(
        f"{_M}.mistral:MistralForCausalLM", f"{_M}.mistral:MistralAttention", _llama,
        _mistral_refuse),
    "Qwen2ForCausalLM": Architecture(
        f"{_M}.qwen2:Qwen2ForCausalLM", f"{_M}.qwen2:Qwen2Attention", _qwen2, _qwen_refuse),
    "Qwen3ForCausalLM": Architecture(
        f"{_M}.qwen3:Qwen3ForCausalLM", f"{_M}.qwen3:Qwen3Attention", _qwen3, _qwen_refuse),
    "Gemma3ForCausalLM": Architecture(
        f"{_M}.gemma3:Gemma3ForCausalLM", f"{_M}.gemma3:Gemma3Attention", _gemma3,
        _gemma3_refuse),
}
"""Supported Hugging Face architecture names (Gemma-3: the text-only model)."""


def load(path: str):
    """Import ``"module:Class"``."""
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
