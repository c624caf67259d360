"""vLLM attention backend over the latent KV cache.

vLLM's four-part split: :class:`LatentAttentionBackend` (static descriptor),
:class:`LatentAttentionMetadata` (per-step dataclass),
:class:`LatentAttentionMetadataBuilder` (metadata from vLLM's
``CommonAttentionMetadata``) and :class:`LatentAttentionImpl` (cache write and
attention). The math is in :mod:`vllm_lowrank.attention.latent_attention`.

Dispatch: CPU tensors run the vectorized torch path; on CUDA, decode runs the
fused Triton kernel (:func:`vllm_lowrank.triton_kernels.decode.latent_decode_attention`,
same signature and result as the torch path, key bias / QK-norm and sliding
windows included) and prefill runs the torch path
(rebuild + attention, which runs on CUDA tensors as is).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from vllm.model_executor.layers.attention.attention import get_attention_context

from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.plugin import BACKEND_NAME


class LatentAttentionBackend(AttentionBackend):
    """Backend descriptor of the latent cache (registered as ``LOWRANK_LATENT``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[LatentAttentionImpl]:
        return LatentAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LatentAttentionMetadataBuilder]:
        return LatentAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent width

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclasses.dataclass
class LatentAttentionMetadata:
    """Per-step metadata.

    Attributes:
        num_actual_tokens: Tokens of this step (without padding).
        query_start_loc_cpu: ``[num_reqs + 1]`` int32 host offsets of each
            request's query tokens.
        seq_lens: ``[num_reqs]`` int32 context length after this step (device).
        seq_lens_cpu: Same on the host.
        block_table: ``[num_reqs, max_blocks]`` int32 (device).
        slot_mapping: ``[num_tokens]`` int64 (device).
        decode_reqs: ``[num_decodes]`` int64 indices of one-token requests.
        decode_tokens: ``[num_decodes]`` int64 token index of each of them.
        prefill_reqs: Host indices of the requests with more than one new token.
        max_decode_seq_len: Longest context among decode requests.
        min_decode_seq_len: Shortest context among decode requests.
    """

    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    prefill_reqs: list[int]
    max_decode_seq_len: int
    min_decode_seq_len: int


class LatentAttentionMetadataBuilder(AttentionMetadataBuilder[LatentAttentionMetadata]):
    """Splits the batch into one-token (decode) requests, attended in one
    batched call, and multi-token (prefill / chunked-prefill) requests."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> LatentAttentionMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens_cpu = m.seq_lens[: m.num_reqs].to("cpu", non_blocking=False)
        is_decode = q_lens == 1
        decode_reqs = torch.nonzero(is_decode).flatten()
        prefill_reqs = torch.nonzero((q_lens > 1)).flatten().tolist()
        device = m.seq_lens.device
        return LatentAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc_cpu=qsl,
            seq_lens=m.seq_lens[: m.num_reqs],
            seq_lens_cpu=seq_lens_cpu,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            decode_reqs=decode_reqs.to(device),
            decode_tokens=qsl[:-1][decode_reqs].long().to(device),
            prefill_reqs=prefill_reqs,
            max_decode_seq_len=int(seq_lens_cpu[decode_reqs].max()) if len(decode_reqs) else 0,
            min_decode_seq_len=int(seq_lens_cpu[decode_reqs].min()) if len(decode_reqs) else 0,
        )


def _gpu_decode():
    """The fused Triton decode kernel (imported on first CUDA use only)."""
    from vllm_lowrank.triton_kernels.decode import latent_decode_attention

    return latent_decode_attention


def _gpu_supports(layout) -> bool:
    """The Triton kernel reads unquantized caches and packed 8/4/3/2-bit
    sides, for full-attention and sliding-window layers, with plain keys
    ``c_k B_k`` or with a key bias / QK-norm (Qwen2/Qwen3/Gemma-3; applied in
    the kernel before RoPE, ``transform=``). A side kept as raw float16 inside a
    packed slot, and per-channel keys, take the torch path (which runs on CUDA
    tensors too)."""
    from vllm_lowrank.quantization import RAW_BITS

    if layout is None:
        return True
    return RAW_BITS not in (layout.k_bits, layout.v_bits) and not layout.k_per_channel


class LatentAttentionImpl(AttentionImpl[LatentAttentionMetadata]):
    """Writes latents by slot mapping; attends through the block table.

    The layer (:class:`~vllm_lowrank.attention.layer.LatentAttention`) carries the
    plan, the key up-projection ``k_up`` and the RoPE table.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
    ) -> None:
        if alibi_slopes is not None or logits_soft_cap:
            raise NotImplementedError("latent attention supports neither ALiBi nor soft-capping")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("latent attention does not support KV sharing")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Scatter latents ``key [T, 1, Rk]``, ``value [T, 1, Rv]`` into the cache
        (quantized and packed on write when the layer has a slot layout).

        Token-adaptive layers pass ``[c_k | k]`` and ``[c_v | v]``: the latents
        go to this cache, the exact post-RoPE keys and values to the layer's
        exact cache through that group's slot mapping."""
        if layer.exact is None:
            ops.write_latents(kv_cache, key, value, slot_mapping, layer.layout)
            return
        rk, rv = layer.plan.k_width, layer.plan.v_width
        key, value = key.flatten(1), value.flatten(1)
        ops.write_latents(kv_cache, key[:, :rk], value[:, :rv], slot_mapping, layer.layout)
        _, exact, exact_cache, exact_slots = get_attention_context(layer.exact.layer_name)
        per_channel = layer.layout is not None and layer.layout.k_per_channel
        tale.write_exact(exact_cache, exact.slot, key[:, rk:], value[:, rv:], exact_slots,
                         staged=key[:, :rk] if per_channel else None)
        if per_channel:  # key groups completed by this step's tokens
            tale.write_key_groups(kv_cache, exact_cache, exact.slot, slot_mapping, exact_slots,
                                  layer.layout)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: LatentAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, H, d]`` into ``output [T, out_width]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        m = attn_metadata
        if layer.exact is not None:
            return self._forward_token_adaptive(layer, query, kv_cache, m, output)
        plan, k_up = layer.plan, layer.k_up
        rope = layer.rope_table(query.device)
        post_rope, layout = layer.post_rope, layer.layout
        transform, window = layer.key_transform(), self.sliding_window
        if len(m.decode_reqs):
            args = (plan, k_up, rope, self.scale, query.index_select(0, m.decode_tokens),
                    kv_cache, m.block_table.index_select(0, m.decode_reqs),
                    m.seq_lens.index_select(0, m.decode_reqs), m.max_decode_seq_len)
            if query.is_cuda and _gpu_supports(layout):
                out = _gpu_decode()(*args, mode="post_rope" if post_rope else "pre_rope",
                                    layout=layout, transform=transform, window=window)
            else:
                out = ops.decode_attention(*args, post_rope=post_rope, layout=layout,
                                           transform=transform, window=window,
                                           min_seq_len=m.min_decode_seq_len)
            output.index_copy_(0, m.decode_tokens, out.to(output.dtype))
        qsl = m.query_start_loc_cpu
        for r in m.prefill_reqs:
            start, stop = int(qsl[r]), int(qsl[r + 1])
            out = ops.prefill_attention(
                plan, k_up, rope, self.scale, query[start:stop], kv_cache,
                m.block_table[r], int(m.seq_lens_cpu[r]), post_rope, layout,
                transform=transform, window=window,
            )
            output[start:stop] = out.to(output.dtype)
        return output

    def _forward_token_adaptive(self, layer, query, kv_cache, m, output):
        """TALE: the latent middle and the exact sinks/recent tokens, merged by
        log-sum-exp (:mod:`vllm_lowrank.attention.token_adaptive`); output
        ``[T, num_heads * head_dim]``."""
        exact = layer.exact
        exact_meta, _, exact_cache, _ = get_attention_context(exact.layer_name)
        common = dict(sink=exact.sink, recent=exact.recent, exact=exact.slot,
                      layout=layer.layout, transform=layer.key_transform(),
                      window=self.sliding_window)
        weights = (layer.plan, layer.k_up, layer.v_up, layer.rope_table(query.device),
                   self.scale)
        if len(m.decode_reqs):
            rows = m.decode_reqs
            kernel = _gpu_decode() if query.is_cuda and _gpu_supports(layer.layout) else None
            out = tale.decode(*weights, query.index_select(0, m.decode_tokens), kv_cache,
                              m.block_table.index_select(0, rows), exact_cache,
                              exact_meta.block_table.index_select(0, rows),
                              m.seq_lens.index_select(0, rows), m.max_decode_seq_len,
                              latent_decode=kernel, min_seq_len=m.min_decode_seq_len, **common)
            output.index_copy_(0, m.decode_tokens, out.to(output.dtype))
        qsl = m.query_start_loc_cpu
        for r in m.prefill_reqs:
            start, stop = int(qsl[r]), int(qsl[r + 1])
            out = tale.prefill(*weights, query[start:stop], kv_cache, m.block_table[r],
                               exact_cache, exact_meta.block_table[r], int(m.seq_lens_cpu[r]),
                               **common)
            output[start:stop] = out.to(output.dtype)
        return output
