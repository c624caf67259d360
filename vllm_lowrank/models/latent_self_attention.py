"""Self-attention block of a decoder layer, rebuilt around the latent cache.

Replaces a model's own attention module (e.g. vLLM's ``LlamaAttention``) when
compression is on. Forward (pre-RoPE latents, the default)::

    [q | c_k | c_v] = x @ [W_q; A_k^T; A_v^T]^T        one fused GEMM (+ q bias)
    q = RoPE(norm_q(q))                                 norm_q: QK-norm or identity
    o = LatentAttention(q, c_k, c_v)                    cache latents, attend; keys
                                                        k = RoPE(norm_k(c_k B_k + b_k))
    y = o @ W_o'^T                                      value up-projection folded in

The key bias ``b_k`` (Qwen2) and the key norm (Qwen3, Gemma-3) are applied to
the rebuilt key, not to the latent: both are exact whatever the rank, and the
norm, being nonlinear, cannot be folded into ``A_k``.

Token-adaptive mode (``token_adaptive``, TALE sec. 2.2)::

    [q | k | v | c_k | c_v] = x @ [W_q; W_k; W_v; A_k^T; A_v^T]^T   (+ q, k biases)
    q, k = RoPE(norm_q(q)), RoPE(norm_k(k))
    o = LatentAttention(q, c_k, c_v, k, v)      latents and exact k, v both cached;
                                                sinks + recent tokens read exactly
    y = o @ W_o^T                               the model's own o_proj (B_v applied
                                                in attention, to the latent part)

Post-RoPE keys (``post_rope_keys``, token-adaptive only): the latent cache keeps
the exact post-RoPE keys themselves, quantized (KIVI sec. 3.2), and the value
latents of the head groups::

    [q | k | v | c_v] = x @ [W_q; W_k; W_v; A_v^T]^T
    q, k = RoPE(norm_q(q)), RoPE(norm_k(k))
    o = LatentAttention(q, k, c_v, k, v)        the key "latent" is the key itself

Post-RoPE latents (``method="post_rope"``, ZACK sec. 4; one KV head per group)::

    [q | k | c_v] = x @ [W_q; W_k; A_v^T]^T
    q, k = RoPE(norm_q(q)), RoPE(norm_k(k))
    c_k[j] = k[j] @ P_j,   q~[i] = q[i] @ P_j     P_j = B_k[j]^T [d, r_j]  (KV head j of i)
    o = LatentAttention(q~, c_k, c_v)                   scores q~ . c_k: no key rebuild

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
from vllm_lowrank.factorization.bases import GroupBasis, output_aware_basis, rope_equivariant_basis
from vllm_lowrank.factorization.plan import LayerPlan
from vllm_lowrank.factorization.shard import full_sizes, load_local


class LatentSelfAttention(nn.Module):
    """Latent-cache self-attention of one decoder layer.

    Args:
        plan: Head groups and ranks of the layer.
        rotary: The model's rotary embedding module for this layer.
        scale: Softmax scale.
        qkv_bias: Whether q/k/v_proj have biases (the query bias is loaded
            into the fused projection, the key bias into the key rebuild, the
            value bias folded into o_proj's).
        o_bias: Whether o_proj has (or needs, for a folded value bias) a bias.
        qk_norm: Per-head norm of queries and keys before RoPE: ``None``,
            ``"rms"`` (vLLM ``RMSNorm``) or ``"gemma"`` (``GemmaRMSNorm``);
            its weights load as ``q_norm.weight`` / ``k_norm.weight``.
        norm_eps: Epsilon of that norm.
        sliding_window: Tokens each query sees on a sliding-window layer
            (``None``: full attention).
        post_rope: Cache post-RoPE key latents (needs ``head_group_size`` 1).
        post_rope_keys: Cache the post-RoPE keys themselves at full width
            (needs ``exact_tokens``): no key latent in the projection.
        rope_equivariant: The key bases commute with RoPE (``rope_equivariant``
            artifact; :meth:`LatentAttention.decode_mode`).
        layout: Packed low-bit slot layout (:mod:`vllm_lowrank.format.latent`),
            or ``None``.
        hadamard_seed: Seed of the Hadamard rotation folded into quantized
            sides, or ``None`` for no rotation.
        exact_tokens: :class:`~vllm_lowrank.format.exact.ExactTokens` of the
            token-adaptive mode, or ``None``.
        cache_config, quant_config: vLLM configs.
        prefix: Module prefix (``model.layers.N.self_attn``).

    Buffers (post-RoPE only):
        k_down: ``[num_kv_heads, head_dim, r_max]`` float32 per-KV-head key
            projections ``P_j``, zero-padded to the largest rank.
        k_cols: ``[Rk]`` int64 columns of the flattened ``[num_kv_heads * r_max]``
            projection output that hold real latents.
    """

    def __init__(self, plan: LayerPlan, rotary: nn.Module, scale: float, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: str | None = None,
                 norm_eps: float = 1e-6, sliding_window: int | None = None,
                 post_rope: bool = False, post_rope_keys: bool = False, layout=None,
                 hadamard_seed: int | None = None,
                 exact_tokens=None, rope_equivariant: bool = False,
                 cache_config=None, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        shape = plan.shape
        self.plan = plan
        self.post_rope = post_rope
        self.post_rope_keys = post_rope_keys
        self.layout = layout
        self.hadamard_seed = hadamard_seed
        self.token_adaptive = exact_tokens is not None
        if post_rope_keys and (not self.token_adaptive or not plan.full_keys):
            raise ValueError("post-RoPE keys need the token-adaptive mode and full key ranks")
        self.q_size = shape.num_heads * shape.head_dim
        # the key latent's columns in the fused projection (none with post-RoPE keys:
        # the exact keys are the latent)
        self.k_size = shape.kv_width if post_rope else 0 if post_rope_keys else plan.k_width
        # exact keys and values come out of the projection too (token-adaptive)
        self.exact_sizes = [shape.kv_width] * 2 if self.token_adaptive else []
        if post_rope:
            if plan.group_size != 1:
                raise ValueError("post-RoPE latents need one KV head per group")
            r_max = max(plan.k_ranks)
            self.register_buffer("k_down", torch.zeros(
                shape.num_kv_heads, shape.head_dim, r_max, dtype=torch.float32),
                persistent=False)
            cols = [j * r_max + c for j, r in enumerate(plan.k_ranks) for c in range(r)]
            self.register_buffer("k_cols", torch.tensor(cols, dtype=torch.int64),
                                 persistent=False)
        self.qkv_proj = MergedColumnParallelLinear(
            input_size=shape.hidden_size,
            output_sizes=full_sizes(self.q_size, *self.exact_sizes,
                                    *[self.k_size] * bool(self.k_size), plan.v_width),
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=full_sizes(self.q_size if self.token_adaptive else plan.out_width)[0],
            output_size=shape.hidden_size,
            bias=o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary
        self.q_norm = self.k_norm = None
        norm_offset = 0.0
        if qk_norm is not None:
            from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

            # the norm class and what it adds to its weight (Gemma: x * (1 + w))
            norm, norm_offset = {"rms": (RMSNorm, 0.0), "gemma": (GemmaRMSNorm, 1.0)}[qk_norm]
            self.q_norm = norm(shape.head_dim, eps=norm_eps)
            self.k_norm = norm(shape.head_dim, eps=norm_eps)
        keys_rotated = post_rope or post_rope_keys  # cached after the norm, bias and RoPE
        self.attn = LatentAttention(plan, scale, rotary, post_rope=keys_rotated,
                                    rope_equivariant=rope_equivariant, layout=layout,
                                    key_norm=None if keys_rotated else self.k_norm,
                                    key_norm_offset=norm_offset,
                                    key_bias=qkv_bias and not keys_rotated,
                                    sliding_window=sliding_window,
                                    exact_tokens=exact_tokens,
                                    cache_config=cache_config, quant_config=quant_config,
                                    prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                **_: object) -> torch.Tensor:
        """``hidden_states [T, hidden]`` at ``positions [T]`` -> ``[T, hidden]``
        (extra keyword arguments some decoder layers pass are ignored)."""
        qkv, _ = self.qkv_proj(hidden_states)
        if self.token_adaptive:
            if self.post_rope_keys:
                q, k, v, c_v = qkv.split([self.q_size, *self.exact_sizes, self.plan.v_width],
                                         dim=-1)
            else:
                q, k, v, c_k, c_v = qkv.split(
                    [self.q_size, *self.exact_sizes, self.k_size, self.plan.v_width], dim=-1)
            if self.q_norm is not None:
                q, k = self._per_head(self.q_norm, q), self._per_head(self.k_norm, k)
            q, k = self.rotary_emb(positions, q, k)
            if self.post_rope_keys:
                c_k = k
            out, _ = self.o_proj(self.attn(q, c_k, c_v, k, v))
            return out
        q, k, c_v = qkv.split([self.q_size, self.k_size, self.plan.v_width], dim=-1)
        if self.q_norm is not None:
            q = self._per_head(self.q_norm, q)
        if self.post_rope:
            if self.k_norm is not None:
                k = self._per_head(self.k_norm, k)
            q, k = self.rotary_emb(positions, q, k)
            q, c_k = self._project(q, k)
        else:
            q, _ = self.rotary_emb(positions, q, None)
            c_k = k
        o = self.attn(q, c_k, c_v)
        out, _ = self.o_proj(o)
        return out

    def _per_head(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm`` over each head of ``x [T, heads * head_dim]``."""
        d = self.plan.shape.head_dim
        return norm(x.view(*x.shape[:-1], -1, d)).view(x.shape)

    def _project(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE projection: ``q [T, H*d]``, ``k [T, kv_width]`` ->
        (``q~ [T, H * r_max]`` zero-padded per head, ``c_k [T, Rk]``)."""
        s = self.plan.shape
        t = q.shape[0]
        down = self.k_down.to(q.dtype)
        q_lat = torch.einsum("tjqd,jdr->tjqr",
                             q.view(t, s.num_kv_heads, s.queries_per_kv, s.head_dim), down)
        c_k = torch.einsum("tjd,jdr->tjr", k.view(t, s.num_kv_heads, s.head_dim), down)
        c_k = c_k.reshape(t, -1).index_select(1, self.k_cols)
        return q_lat.reshape(t, -1), c_k

    def load_factorized(
        self,
        weights: dict[str, torch.Tensor],
        bases: tuple[Sequence[GroupBasis], Sequence[GroupBasis]] | None,
    ) -> list[str]:
        """Factorize and load this layer's weights.

        Args:
            weights: Checkpoint tensors of the layer by short name: ``q_proj``,
                ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear`` weights) and
                optional ``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias``,
                ``o_proj.bias``; under tensor parallelism this rank's heads only
                (:func:`~vllm_lowrank.factorization.shard.local_weights`).
            bases: Calibrated ``(k_bases, v_bases)`` per head group (of this
                rank), or ``None`` for plain weight SVD (Palu eq. 4; for a
                ``rope_equivariant`` layer the keys' weight-only basis of that
                structure, :func:`~vllm_lowrank.factorization.bases.rope_equivariant_basis`
                without statistics).

        Returns:
            Names (relative to this module) of the parameters it loaded.
        """
        plan = self.plan
        w_q, w_k, w_v, w_o = (weights[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if bases is None:
            def key_basis(w):
                if self.attn.rope_equivariant:
                    return rope_equivariant_basis(w, None, None, head_dim=plan.shape.head_dim,
                                                  neox=self.attn._rotary.is_neox_style)
                return output_aware_basis(w)

            bases = tuple(
                [basis(fold.group_projection(plan, w, g)) for g in range(plan.num_groups)]
                for w, basis in ((w_k, key_basis), (w_v, output_aware_basis))
            )
        f = fold.layer_factors(plan, bases[0], bases[1], w_k, w_v)
        if self.layout is not None and self.hadamard_seed is not None:
            # per-channel keys keep their channels: a rotation would spread an
            # outlier channel's range over every channel (KIVI sec. 3.2); post-RoPE
            # keys are the model's own, read by unrotated queries
            k_rotated = (self.layout.k_bits < 16 and not self.layout.k_per_channel
                         and not self.post_rope_keys)
            sides = ("k" if k_rotated else "") + ("v" if self.layout.v_bits < 16 else "")
            f = fold.rotate_latents(plan, f, sides, self.hadamard_seed)
        param = self.qkv_proj.weight
        if self.post_rope:  # keys stay full until RoPE; their projection P_j = B_k^T
            with torch.no_grad():
                self.k_down.zero_()
                d = plan.shape.head_dim
                for j, (off, r) in enumerate(zip(plan.k_offsets(), plan.k_ranks)):
                    self.k_down[j, :, :r] = f.k_up[off:off + r, j * d:(j + 1) * d].T
        key_weight = w_k.float() if self.post_rope else f.a_k.T
        exact = (w_k, w_v) if self.token_adaptive else ()
        key_latent = (key_weight,) if self.k_size else ()
        for shard, w in enumerate((w_q, *exact, *key_latent, f.a_v.T)):
            load_local(self.qkv_proj, param, w.to(param.dtype).contiguous(), shard)
        loaded = ["qkv_proj.weight"]
        if self.qkv_proj.bias is not None:
            bias = self.qkv_proj.bias
            k_bias = weights.get("k_proj.bias")
            if k_bias is None or not self.post_rope:  # pre-RoPE: added at the rebuild
                k_bias_here = torch.zeros(self.k_size, dtype=bias.dtype)
            else:
                k_bias_here = k_bias.to(bias.dtype)
            zeros_v = torch.zeros(plan.v_width, dtype=bias.dtype)
            exact_biases = ()
            if self.token_adaptive:  # exact keys get their bias; the value bias is in o_proj's
                kv = plan.shape.kv_width
                exact_biases = (torch.zeros(kv, dtype=bias.dtype) if k_bias is None
                                else k_bias.to(bias.dtype), torch.zeros(kv, dtype=bias.dtype))
            key_bias = (k_bias_here,) if self.k_size else ()
            for shard, b in enumerate((weights["q_proj.bias"].to(bias.dtype), *exact_biases,
                                       *key_bias, zeros_v)):
                load_local(self.qkv_proj, bias, b, shard)
            loaded.append("qkv_proj.bias")
            if k_bias is not None and not self.attn.post_rope:
                with torch.no_grad():
                    self.attn.k_bias.copy_(k_bias.float())
        if not self.attn.post_rope:
            with torch.no_grad():
                self.attn.k_up.copy_(f.k_up)
        if self.token_adaptive:  # B_v is applied in attention, o_proj stays the model's
            with torch.no_grad():
                self.attn.v_up.copy_(f.v_up)
            o_weight = w_o
        else:
            o_weight = fold.folded_o_proj(plan, w_o, f.v_up)
        p = self.o_proj.weight
        load_local(self.o_proj, p, o_weight.to(p.dtype))
        loaded.append("o_proj.weight")
        if self.o_proj.bias is not None:
            b = torch.zeros(plan.shape.hidden_size, dtype=torch.float32)
            if "o_proj.bias" in weights:
                b += weights["o_proj.bias"].float()
            if "v_proj.bias" in weights:
                b += fold.value_bias_through_o_proj(plan, w_o, weights["v_proj.bias"])
            ob = self.o_proj.bias
            load_local(self.o_proj, ob, b.to(ob.dtype))
            loaded.append("o_proj.bias")
        return loaded
