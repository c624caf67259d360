"""Llama-family adapter: vLLM's ``LlamaForCausalLM`` with latent attention.

With compression off the class is vLLM's own (same modules, same loader). With
compression on, every decoder layer's ``LlamaAttention`` is replaced through
vLLM's ``attn_layer_type`` constructor hook by a
:class:`~vllm_lowrank.models.latent_self_attention.LatentSelfAttention`, and
``load_weights`` factorizes the attention weights of each layer as it arrives.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable

import torch

from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from vllm_lowrank import metrics
from vllm_lowrank.config import config_from_vllm
from vllm_lowrank.models import compression as comp
from vllm_lowrank.models.latent_self_attention import LatentSelfAttention

logger = logging.getLogger("vllm.lowrank")

_BUILDING: list[comp.ModelCompression] = []


@contextlib.contextmanager
def _building(c: comp.ModelCompression):
    _BUILDING.append(c)
    try:
        yield
    finally:
        _BUILDING.pop()


def _latent_llama_attention(*, config, hidden_size, num_heads, num_kv_heads,
                            max_position_embeddings=8192, quant_config=None, bias=False,
                            bias_o_proj=False, cache_config=None, prefix="",
                            attn_type=None) -> LatentSelfAttention:
    """Signature of vLLM's ``LlamaAttention``; builds the latent block."""
    c = _BUILDING[-1]
    layer = extract_layer_index(prefix)
    plan = c.plans[layer]
    head_dim = plan.shape.head_dim
    rotary = get_rope(head_dim, max_position=max_position_embeddings,
                      rope_parameters=getattr(config, "rope_parameters", None),
                      is_neox_style=True)
    return LatentSelfAttention(
        plan, rotary, head_dim**-0.5, qkv_bias=bias,
        o_bias=bias_o_proj or bias, post_rope=c.post_rope, layout=c.layout(layer),
        hadamard_seed=layer if c.cfg.hadamard else None, cache_config=cache_config,
        quant_config=quant_config, prefix=prefix,
    )


class LowRankLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` that builds latent attention when
    ``additional_config["kv_compression"]`` enables it."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        cfg = config_from_vllm(vllm_config)
        self._lowrank = None
        if not cfg.enabled:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            return
        c = comp.resolve(vllm_config, cfg)
        logger.info("vllm-lowrank: %s", c.describe())
        layer_type = functools.partial(LlamaDecoderLayer,
                                       attn_layer_type=_latent_llama_attention)
        with _building(c):
            super().__init__(vllm_config=vllm_config, prefix=prefix,
                             layer_type=layer_type, **kwargs)
        self._lowrank = c
        metrics.publish(self)  # what is in force here, for /metrics (vllm_lowrank.metrics)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._lowrank is None:
            return super().load_weights(weights)
        modules = {
            extract_layer_index(name): (name, m)
            for name, m in self.named_modules()
            if isinstance(m, LatentSelfAttention)
        }
        interceptor = comp.WeightInterceptor(self._lowrank, modules)
        loaded = set(super().load_weights(interceptor.filter(weights)))
        return loaded | interceptor.finish()
