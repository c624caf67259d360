"""The latent attention layer: vLLM ``Attention`` whose cache holds latents.

It reuses vLLM's ``Attention`` registration (static forward context, custom-op
dispatch, cache binding) and changes three things:

- the backend is always :class:`~vllm_lowrank.attention.backend.LatentAttentionBackend`;
- :meth:`get_kv_cache_spec` describes one head slot of ``Rk + Rv`` elements per
  token, so vLLM allocates only the latent bytes (ranks may differ per layer:
  vLLM groups such layers in one ``UniformTypeKVCacheSpecs``); sliding-window
  layers use vLLM's ``SlidingWindowSpec`` with the same latent slot, so vLLM
  frees their blocks once they leave the window;
- :meth:`forward` takes the query and the two latents and returns the attention
  output in the value latent space (``[T, out_width]``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

from vllm_lowrank import compat
from vllm_lowrank.attention.backend import LatentAttentionBackend
from vllm_lowrank.attention.exact_cache import ExactTokensSpec
from vllm_lowrank.attention.latent_attention import KeyTransform
from vllm_lowrank.attention.rope import RopeTable, rope_table_for
from vllm_lowrank.factorization.plan import LayerPlan
from vllm_lowrank.format.exact import ExactSlot


class LatentAttention(Attention):
    """Attention over a paged latent cache.

    Args:
        plan: Head groups and ranks of this layer.
        scale: Softmax scale (``head_dim ** -0.5`` for Llama).
        rotary: The model's rotary module (its cos/sin table rotates the
            rebuilt keys).
        post_rope: Queries and cached keys are post-RoPE latents (no rebuild):
            per KV head, ``r_k / group_size`` wide each (ZACK's projected keys
            with one KV head per group, or ``post_rope_keys``: the keys
            themselves, ``head_dim`` wide, in groups of any size).
        rope_equivariant: The key up-projection was calibrated to commute
            with RoPE (``method: "rope_equivariant"``); decode then absorbs the
            queries where the loaded factors allow (:meth:`decode_mode`).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` of packed
            low-bit latents, or ``None`` to cache them in the model dtype.
        key_norm: The model's per-head key norm module (QK-norm), applied to
            rebuilt keys before RoPE, or ``None``.
        key_norm_offset: Added to the norm's weight to give its multiplier
            (``1.0`` for Gemma's ``x * (1 + w)``, ``0.0`` for ``x * w``).
        key_bias: Rebuilt keys get the k_proj bias (buffer ``k_bias``).
        sliding_window: Tokens each query sees (itself included), or ``None``.
        exact_tokens: :class:`~vllm_lowrank.format.exact.ExactTokens`
            of the token-adaptive mode (TALE), or ``None``. The layer then owns an
            :class:`~vllm_lowrank.attention.layer.ExactTokenCache`
            (``exact``), :meth:`forward` also takes the exact post-RoPE keys and
            values, and the output is per-head values ``[T, num_heads *
            head_dim]`` for the model's own ``o_proj``
            (:mod:`vllm_lowrank.attention.token_adaptive`).
        cache_config, quant_config, prefix: As for vLLM's ``Attention``.

    Buffers:
        k_up: ``[Rk, num_kv_heads * head_dim]`` float32 block-diagonal key
            up-projection, filled at weight loading.
        k_bias: ``[num_kv_heads * head_dim]`` float32 key bias (empty without
            ``key_bias``), filled at weight loading.
        v_up: ``[Rv, num_kv_heads * head_dim]`` float32 block-diagonal value
            up-projection (token-adaptive mode only; empty otherwise).
    """

    def __init__(self, plan: LayerPlan, scale: float, rotary, *, post_rope: bool = False,
                 rope_equivariant: bool = False, layout=None, key_norm=None,
                 key_norm_offset: float = 0.0,
                 key_bias: bool = False,
                 sliding_window: int | None = None,
                 exact_tokens=None, cache_config=None,
                 quant_config=None, prefix: str = "") -> None:
        shape = plan.shape
        # Post-RoPE queries arrive in each KV head's key basis (the identity for
        # post-RoPE keys), padded to the largest key width per KV head.
        query_size = max(plan.k_ranks) // plan.group_size if post_rope else shape.head_dim
        super().__init__(
            num_heads=shape.num_heads,
            head_size=query_size,
            scale=scale,
            num_kv_heads=shape.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=sliding_window,
            prefix=prefix,
            attn_backend=LatentAttentionBackend,
        )
        self.plan = plan
        self.post_rope = post_rope
        self.rope_equivariant = rope_equivariant
        self._decode_mode: str | None = None
        self.layout = layout
        self.register_buffer(
            "k_up", torch.zeros(0 if post_rope else plan.k_width, shape.kv_width,
                                dtype=torch.float32),
            persistent=False,
        )
        self.register_buffer(
            "k_bias", torch.zeros(shape.kv_width if key_bias else 0, dtype=torch.float32),
            persistent=False)
        # Plain attributes, not submodules: the rotary module is shared across
        # layers, and the key norm belongs to (and loads into) the attention block.
        self.__dict__["_rotary"] = rotary
        self.__dict__["_key_norm"] = key_norm
        self._key_norm_offset = key_norm_offset
        self._key_transform: KeyTransform | None = None
        self.register_buffer(
            "v_up", torch.zeros(plan.v_width if exact_tokens is not None else 0, shape.kv_width,
                                dtype=torch.float32), persistent=False)
        self.exact = None
        if exact_tokens is not None:
            slot = ExactSlot.for_layer(plan, layout, self.kv_cache_torch_dtype, exact_tokens,
                                       stage_keys=not post_rope)
            # a plain attribute: vLLM finds the cache layer by its name
            self.__dict__["exact"] = ExactTokenCache(
                slot, exact_tokens.sink, exact_tokens.recent, prefix=f"{prefix}.exact")

    @property
    def out_width(self) -> int:
        """Width of :meth:`forward`'s output: value latents per query head, or
        ``num_heads * head_dim`` in the token-adaptive mode."""
        if self.exact is not None:
            return self.plan.shape.num_heads * self.plan.shape.head_dim
        return self.plan.out_width

    def rope_table(self, device: torch.device) -> RopeTable:
        """float32 RoPE table of this layer's rotary module on ``device``."""
        return rope_table_for(self._rotary, device)

    def key_transform(self) -> KeyTransform | None:
        """What is applied to a rebuilt key before RoPE (bias, QK-norm), or
        ``None`` when nothing is (always in post-RoPE mode, whose cached keys
        are already normed). Built on the first call, which comes after weight
        loading (the norm's weight is loaded after construction), then reused
        at every step."""
        norm = self._key_norm
        if norm is None and not self.k_bias.numel():
            return None
        if self._key_transform is None:
            self._key_transform = KeyTransform(
                bias=self.k_bias if self.k_bias.numel() else None,
                norm_weight=None if norm is None else norm.weight.float() + self._key_norm_offset,
                norm_eps=0.0 if norm is None else float(norm.variance_epsilon))
        return self._key_transform

    def decode_mode(self) -> str:
        """How the fused decode kernels read this layer's key latents, decided
        on the first call (after weight loading):

        - ``"post_rope"``: post-RoPE latents (ZACK), queries in the latent basis;
        - ``"latent_rope"``: a ``rope_equivariant`` layer whose loaded ``k_up``
          is complex-linear per RoPE frequency in every head group, with RoPE
          over the whole head, no key bias or QK-norm (both act on rebuilt
          keys) and a cache format in the kernel's scope
          (:func:`vllm_lowrank.kernels.triton.decode_latent_rope.blocker`):
          queries absorbed, latent pairs turned;
        - ``"pre_rope"``: everything else (keys rebuilt, then RoPE). A
          ``rope_equivariant`` layer lands here when its factors lost the
          structure (full rank: the identity basis; a Hadamard rotation of the
          key latents), and computes the same attention.
        """
        if self._decode_mode is None:
            mode = "post_rope" if self.post_rope else "pre_rope"
            if mode == "pre_rope" and self.rope_equivariant and self.key_transform() is None \
                    and self._rotary.rotary_dim == self.plan.shape.head_dim:
                from vllm_lowrank.kernels.triton.decode_latent_rope import absorption, blocker

                sink = self.exact.sink if self.exact is not None else 0
                if blocker(self.plan, self.layout, window=self.sliding_window, sink=sink) is None:
                    try:  # the structure check (the decoder computes its tables again)
                        absorption(self.plan, self.k_up, self.rope_table(self.k_up.device))
                        mode = "latent_rope"
                    except ValueError:
                        pass
            self._decode_mode = mode
        return self._decode_mode

    def get_kv_cache_spec(self, vllm_config) -> KVCacheSpec:
        """One head slot per token holding ``[c_k | c_v]``: ``Rk + Rv`` elements
        of the model dtype, or ``layout.slot_bytes`` uint8 when quantized (vLLM's
        ``state_content_bytes``: packed codes plus float16 scales/zeros; the
        head sizes then split the slot's bytes in two, whatever the ranks, so
        that layers of one slot size have equal specs and vLLM keeps them in
        one cache group, :meth:`~vllm_lowrank.format.exact.ExactSlot.for_layer`)."""
        quantized = self.layout is not None
        k_size, v_size = self.plan.k_width, self.plan.v_width
        if quantized:
            k_size = self.layout.slot_bytes // 2
            v_size = self.layout.slot_bytes - k_size
        slot = dict(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=k_size,
            head_size_v=v_size,
            dtype=torch.uint8 if quantized else self.kv_cache_torch_dtype,
            state_content_bytes=self.layout.slot_bytes if quantized else None,
        )
        if self.sliding_window is not None:
            return SlidingWindowSpec(sliding_window=self.sliding_window, **slot)
        return FullAttentionSpec(**slot)

    def forward(self, query: torch.Tensor, k_latent: torch.Tensor, v_latent: torch.Tensor,
                k_exact: torch.Tensor | None = None,
                v_exact: torch.Tensor | None = None) -> torch.Tensor:
        """Cache the latents (and exact keys/values), attend, return
        ``[T, out_width]``.

        Args:
            query: ``[T, num_heads * head_dim]`` post-RoPE queries (post-RoPE
                mode: ``[T, num_heads * max(k_ranks)]`` latent queries).
            k_latent: ``[T, Rk]`` key latents (pre-RoPE, or post-RoPE).
            v_latent: ``[T, Rv]`` value latents.
            k_exact, v_exact: ``[T, num_kv_heads * head_dim]`` post-RoPE keys
                and values (token-adaptive mode only). They travel to the
                backend appended to the latents (``[c_k | k]``, ``[c_v | v]``).
        """
        num_tokens = query.shape[0]
        output = torch.empty(num_tokens, self.out_width, dtype=query.dtype,
                             device=query.device)
        query = query.view(-1, self.num_heads, self.head_size)
        if self.exact is not None:
            k_latent = torch.cat((k_latent, k_exact), dim=-1)
            v_latent = torch.cat((v_latent, v_exact), dim=-1)
        key = k_latent.view(num_tokens, 1, -1)
        value = v_latent.view(num_tokens, 1, -1)
        if self.use_direct_call:
            from vllm.model_executor.layers.attention.attention import (
                unified_attention_with_output,
                unified_kv_cache_update,
            )

            dep = unified_kv_cache_update(key, value, self.layer_name)
            unified_attention_with_output(query, key, value, output, self.layer_name,
                                          kv_cache_dummy_dep=dep)
        else:
            encoded = compat.encode_layer_name(self.layer_name)
            dep = torch.ops.vllm.unified_kv_cache_update(key, value, encoded)
            torch.ops.vllm.unified_attention_with_output(
                query, key, value, output, encoded, kv_cache_dummy_dep=dep
            )
        return output


class ExactTokenCache(nn.Module, AttentionLayerBase):
    """The exact-token cache layer of one latent attention layer.

    Registered in vLLM's static forward context under ``prefix`` (its own
    cache group, block table and slot mapping); it has no weights and no
    forward. The latent attention backend writes and reads it.

    Args:
        slot: Layout of one slot (:class:`ExactSlot`).
        sink: Sink tokens (rounded up to whole blocks by the caller).
        recent: Recent tokens kept exact.
        prefix: Layer name (``...self_attn.attn.exact``).

    Attributes:
        kv_cache: ``[num_blocks, 1, block_size, slot.slot_bytes]`` uint8, bound by vLLM.
    """

    def __init__(self, slot: ExactSlot, sink: int, recent: int, prefix: str) -> None:
        super().__init__()
        self.slot = slot
        self.sink = sink
        self.recent = recent
        self.layer_name = prefix
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        """:class:`ExactTokensSpec` with window ``recent + 1``, the sinks and
        the per-request prefill cap of the scheduler."""
        cap = vllm_config.scheduler_config.long_prefill_token_threshold
        return ExactTokensSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            head_size=self.slot.kv_width,
            head_size_v=self.slot.kv_width,
            dtype=torch.uint8,
            state_content_bytes=self.slot.slot_bytes,
            sliding_window=self.recent + 1,
            sink=self.sink,
            max_request_tokens=cap * vllm_config.max_concurrent_batches if cap > 0 else None,
        )

    def get_attn_backend(self):
        """The latent backend: its metadata builder gives this group's block
        table and slot mapping."""
        return LatentAttentionBackend

    def forward(self):  # pragma: no cover - never called
        raise RuntimeError("ExactTokenCache is read and written by the latent backend")
