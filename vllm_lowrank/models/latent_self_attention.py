"""Self-attention block of a decoder layer, rebuilt around the latent cache.

Replaces a model's own attention module (e.g. vLLM's ``LlamaAttention``) when
compression is on. Forward::

    [q | c_k | c_v] = x @ [W_q; A_k^T; A_v^T]^T        one fused GEMM
    q = RoPE(q)                                         the model's rotary module
    o = LatentAttention(q, c_k, c_v)                    cache latents, attend
    y = o @ W_o'^T                                      value up-projection folded in

Weights are produced at load time by :meth:`LatentSelfAttention.load_factorized`
from the checkpoint's q/k/v/o weights and the layer's bases
(:mod:`vllm_lowrank.factorization.fold`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

from vllm_lowrank.attention.layer import LatentAttention
from vllm_lowrank.factorization import fold
from vllm_lowrank.factorization.bases import GroupBasis, output_aware_basis
from vllm_lowrank.factorization.plan import LayerPlan


class LatentSelfAttention(nn.Module):
    """Latent-cache self-attention of one decoder layer.

    Args:
        plan: Head groups and ranks of the layer.
        rotary: The model's rotary embedding module for this layer.
        scale: Softmax scale.
        qkv_bias: Whether q_proj has a bias (loaded into the fused projection).
        o_bias: Whether o_proj has (or needs, for a folded value bias) a bias.
        cache_config, quant_config: vLLM configs.
        prefix: Module prefix (``model.layers.N.self_attn``).
    """

    def __init__(self, plan: LayerPlan, rotary: nn.Module, scale: float, *,
                 qkv_bias: bool = False, o_bias: bool = False, cache_config=None,
                 quant_config=None, prefix: str = "") -> None:
        super().__init__()
        shape = plan.shape
        self.plan = plan
        self.q_size = shape.num_heads * shape.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            input_size=shape.hidden_size,
            output_sizes=[self.q_size, plan.k_width, plan.v_width],
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=plan.out_width,
            output_size=shape.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary
        self.attn = LatentAttention(plan, scale, rotary, cache_config=cache_config,
                                    quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, hidden]`` at ``positions [T]`` -> ``[T, hidden]``."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, c_k, c_v = qkv.split([self.q_size, self.plan.k_width, self.plan.v_width], dim=-1)
        q, _ = self.rotary_emb(positions, q, None)
        o = self.attn(q, c_k, c_v)
        out, _ = self.o_proj(o)
        return out

    def load_factorized(
        self,
        weights: dict[str, torch.Tensor],
        bases: tuple[Sequence[GroupBasis], Sequence[GroupBasis]] | None,
    ) -> list[str]:
        """Factorize and load this layer's weights.

        Args:
            weights: Checkpoint tensors of the layer by short name: ``q_proj``,
                ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear`` weights) and
                optional ``q_proj.bias``, ``v_proj.bias``, ``o_proj.bias``.
            bases: Calibrated ``(k_bases, v_bases)`` per head group, or ``None``
                for plain weight SVD (Palu eq. 4).

        Returns:
            Names (relative to this module) of the parameters it loaded.
        """
        plan = self.plan
        w_q, w_k, w_v, w_o = (weights[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if bases is None:
            bases = tuple(
                [output_aware_basis(fold.group_projection(plan, w, g))
                 for g in range(plan.num_groups)]
                for w in (w_k, w_v)
            )
        f = fold.layer_factors(plan, bases[0], bases[1], w_k, w_v)
        param = self.qkv_proj.weight
        for shard, w in enumerate((w_q, f.a_k.T, f.a_v.T)):
            param.weight_loader(param, w.to(param.dtype).contiguous(), shard)
        loaded = ["qkv_proj.weight"]
        if self.qkv_proj.bias is not None:
            bias = self.qkv_proj.bias
            zeros_k = torch.zeros(plan.k_width, dtype=bias.dtype)
            zeros_v = torch.zeros(plan.v_width, dtype=bias.dtype)
            for shard, b in enumerate((weights["q_proj.bias"].to(bias.dtype), zeros_k, zeros_v)):
                bias.weight_loader(bias, b, shard)
            loaded.append("qkv_proj.bias")
        with torch.no_grad():
            self.attn.k_up.copy_(f.k_up)
        o_weight = fold.folded_o_proj(plan, w_o, f.v_up)
        p = self.o_proj.weight
        p.weight_loader(p, o_weight.to(p.dtype))
        loaded.append("o_proj.weight")
        if self.o_proj.bias is not None:
            b = torch.zeros(plan.shape.hidden_size, dtype=torch.float32)
            if "o_proj.bias" in weights:
                b += weights["o_proj.bias"].float()
            if "v_proj.bias" in weights:
                b += fold.value_bias_through_o_proj(plan, w_o, weights["v_proj.bias"])
            ob = self.o_proj.bias
            ob.weight_loader(ob, b.to(ob.dtype))
            loaded.append("o_proj.bias")
        return loaded
