"""vLLM attention backend over the latent KV cache.

vLLM's four-part split: :class:`LatentAttentionBackend` (static descriptor),
:class:`LatentAttentionMetadata` (per-step dataclass),
:class:`LatentAttentionMetadataBuilder` (metadata from vLLM's
``CommonAttentionMetadata``) and :class:`LatentAttentionImpl` (cache write and
attention). The math is in :mod:`vllm_lowrank.attention.latent_attention`.

Dispatch: decode runs the layer's decoder, chosen once at start-up
(:mod:`vllm_lowrank.attention.decoders`: a fused GPU kernel, or the torch path
on a CPU); on CUDA all prefill chunks of a step run as one varlen Triton call
(:func:`vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`) over keys
rebuilt once per step; on a CPU prefill runs per request.

Speculative decoding: a verify step gives a request its last accepted token
plus the drafts (up to ``1 + num_speculative_tokens`` query tokens). Such
requests are decodes too (vLLM's spec-as-decode reorder threshold): each of
their tokens is one decode row whose context ends at that token
(:class:`DecodeRows`), so the drafts are attended causally by the same
decoder as any one-token step, never by the prefill path.

CUDA graphs: the builder reads host copies only (no device sync) and the
decode path uses vLLM's persistent buffers (and the builder's own for the
decode rows), so decode-only batches are captured when every layer decodes
with a fused kernel (:func:`~vllm_lowrank.attention.decoders.graph_safe`):
``UNIFORM_SINGLE_TOKEN_DECODE``, or ``UNIFORM_BATCH`` with speculative
decoding.
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
    max_decode_query_len,
)

from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_lowrank.attention import BACKEND_NAME
from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.attention import decoders
from vllm_lowrank.attention.exact_cache import ExactTokensSpec
from vllm_lowrank.config import config_from_vllm


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
class PrefillBatch:
    """The prefill requests of a step, flattened for one batched attention
    call on CUDA (:func:`vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`).

    Request ``n`` (the ``n``-th prefill request, batch row ``num_decodes + n``)
    attends its visible context: positions ``first_key[n] .. seq_len[n] - 1``
    (``first_key = 0``, or the window start of a sliding-window layer), stored
    as rows ``cu_k[n] .. cu_k[n+1]`` of the flat key arrays.

    Attributes:
        cu_q: ``[N + 1]`` int32 (device) offsets of each request's new tokens,
            counted from the first prefill token.
        cu_k: ``[N + 1]`` int32 (device) offsets of each request's keys.
        key_req: ``[S]`` int64 (device) batch row of each key.
        key_pos: ``[S]`` int64 (device) position of each key.
        max_q_len: Longest chunk (host int).
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    key_req: torch.Tensor
    key_pos: torch.Tensor
    max_q_len: int


@dataclasses.dataclass
class DecodeRows:
    """The decode tokens of a step in which some decode request has several
    (speculative decoding's verify step), one decode row per token.

    Row ``t`` (token ``t`` of the step) attends as a one-token decode of
    request ``req[t]`` whose context ends at the token itself: ``seq_len -
    back[t]`` tokens, ``back[t]`` being the request's tokens after ``t``. So
    the drafts see each other causally, and each token sees the same context
    (and, in token-adaptive mode, the same exact/latent split) as a step that
    decoded it alone. The decoders read rows, not requests
    (:meth:`LatentAttentionMetadata.decode_batch`).

    A decoder that takes several query tokens per sequence
    (:attr:`~vllm_lowrank.attention.decoders.Decoder.takes_query_tokens`) gets
    the requests instead, with their query offsets, and reads each cached
    token once for all of a request's rows.

    Attributes:
        req: ``[T]`` int64 (device) request of each row; a view of the
            builder's persistent buffer, so CUDA graphs replay it.
        back: ``[T]`` int32 (device) the request's tokens after the row's.
        max_query_len: Most tokens of a decode request (host int).
    """

    req: torch.Tensor
    back: torch.Tensor
    max_query_len: int


@dataclasses.dataclass
class LatentAttentionMetadata:
    """Per-step metadata. The batch is reordered by vLLM (``reorder_batch_threshold``
    1, or ``1 + num_speculative_tokens`` with speculative decoding): the first
    ``num_decodes`` requests are decodes (one new token, or a verify step's
    few: :class:`DecodeRows`), the rest are prefill chunks.

    Attributes:
        num_actual_tokens: Tokens of this step (with CUDA-graph padding).
        num_decodes: Decode requests (padding requests of a CUDA graph
            included: they have ``seq_len 0`` and write nothing).
        query_start_loc_cpu: ``[num_reqs + 1]`` int32 host offsets of each
            request's query tokens.
        query_start_loc: The same on the device (vLLM's persistent buffer).
        seq_lens: ``[num_reqs]`` int32 context length after this step (device;
            a slice of vLLM's persistent buffer, so CUDA graphs replay it).
        seq_lens_cpu: Same on the host (no device sync: vLLM's host copy);
            with speculative decoding an upper bound (vLLM assumes the last
            step's drafts accepted), exact for prefill requests.
        block_table: ``[num_reqs, max_blocks]`` int32 (device, persistent).
        slot_mapping: ``[num_tokens]`` int64 (device, persistent).
        max_decode_seq_len: Upper bound of the decode requests' lengths (host;
            ``max_model_len`` while a CUDA graph is captured, so the graph
            stays valid for every length).
        min_decode_seq_len: Lower bound of the same (host; 0 under capture).
        prefill: The flattened prefill requests on CUDA, else ``None``.
        tale_spans: Token-adaptive layers' flattened prefill chunks, made by
            the first such layer of the step and shared by the others
            (:func:`~vllm_lowrank.attention.token_adaptive.prefill_spans`,
            keyed by ``(sink, recent, key group)``).
        key_group_ends: The step's tokens that end a per-channel key group,
            per group size (:func:`~vllm_lowrank.attention.token_adaptive.key_group_ends`;
            made by the first layer of a long step that needs them).
        rows: The decode tokens as rows when a decode request has several,
            else ``None`` (one row per decode request).
        row_batch: The decode rows' batch (:meth:`decode_batch`, block tables
            gathered per row), made by the first layer of the step that needs it.
        speculative: Speculative decoding is on (``seq_lens_cpu`` of decode
            requests are upper bounds).
    """

    num_actual_tokens: int
    num_decodes: int
    query_start_loc_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_decode_seq_len: int
    min_decode_seq_len: int
    prefill: PrefillBatch | None = None
    tale_spans: dict = dataclasses.field(default_factory=dict)
    key_group_ends: dict = dataclasses.field(default_factory=dict)
    rows: DecodeRows | None = None
    row_batch: decoders.DecodeBatch | None = None
    speculative: bool = False

    @property
    def prefill_reqs(self) -> range:
        """Batch rows of the prefill requests."""
        return range(self.num_decodes, self.query_start_loc_cpu.shape[0] - 1)

    @property
    def num_decode_tokens(self) -> int:
        """Leading tokens that decode: one per decode request, or one per row."""
        return self.num_decodes if self.rows is None else self.rows.req.shape[0]

    def decode_batch(self, exact_cache: torch.Tensor | None = None,
                     exact_block_table: torch.Tensor | None = None,
                     query_tokens: bool = False) -> decoders.DecodeBatch:
        """The decode tokens (:attr:`num_decode_tokens`) as a
        :class:`~vllm_lowrank.attention.decoders.DecodeBatch`: one sequence per
        token (:class:`DecodeRows`), or with ``query_tokens`` (a decoder that
        takes several per sequence) one per request with its query offsets.

        Args:
            exact_cache, exact_block_table: A token-adaptive layer's exact
                cache and its group's ``[num_reqs, max_blocks]`` block table.
            query_tokens: The decoder takes several query tokens per sequence.
        """
        nd = self.num_decodes
        batch = decoders.DecodeBatch(
            self.block_table[:nd], self.seq_lens[:nd], self.max_decode_seq_len,
            self.min_decode_seq_len, exact_cache=exact_cache,
            exact_block_table=None if exact_block_table is None else exact_block_table[:nd])
        if self.rows is None:
            return batch
        if query_tokens:
            return dataclasses.replace(batch, query_start_loc=self.query_start_loc[:nd + 1],
                                       max_query_len=self.rows.max_query_len)
        # one gather per step: every layer of the group reads the same block
        # tables (token-adaptive layers: the one exact-cache group's too)
        if self.row_batch is None:
            self.row_batch = batch.per_token(self.rows.req, self.rows.back)
        return dataclasses.replace(self.row_batch, exact_cache=exact_cache)


class LatentAttentionMetadataBuilder(AttentionMetadataBuilder[LatentAttentionMetadata]):
    """Splits the reordered batch into decode requests (one new token, or up
    to ``1 + num_speculative_tokens`` with speculative decoding), attended in
    one batched call, and prefill / chunked-prefill requests, attended in one
    batched call on CUDA. Reads host copies only (no device sync); decode-only
    batches can be captured in CUDA graphs (``UNIFORM_SINGLE_TOKEN_DECODE``, or
    ``UNIFORM_BATCH`` with speculative decoding) when
    :func:`~vllm_lowrank.attention.decoders.graph_safe` holds."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # spec-as-decode: a verify step's requests are decodes (1 without speculation)
        self.reorder_batch_threshold = max_decode_query_len(vllm_config)
        self.window = getattr(kv_cache_spec, "sliding_window", None)
        self.max_model_len = vllm_config.model_config.max_model_len
        # a verify step's context lengths on the host are upper bounds (vLLM
        # assumes every draft of the last step accepted)
        self.max_rejected = self.reorder_batch_threshold - 1
        self.row_buffers = None
        if self.reorder_batch_threshold > 1:  # persistent: CUDA graphs replay them
            n = vllm_config.scheduler_config.max_num_batched_tokens
            self.row_buffers = (torch.zeros(n, dtype=torch.int64, device=device),
                                torch.zeros(n, dtype=torch.int32, device=device))
        # the exact-token group's metadata serves its block table only; token-adaptive
        # layers flatten their own prefill spans (LatentAttentionMetadata.tale_spans)
        self.batch_prefill = (device.type == "cuda"
                              and not isinstance(kv_cache_spec, ExactTokensSpec)
                              and not config_from_vllm(vllm_config).token_adaptive)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        device = torch.device(vllm_config.device_config.device)
        if device.type == "cuda" and decoders.graph_safe(vllm_config, device):
            if max_decode_query_len(vllm_config) > 1:
                return AttentionCGSupport.UNIFORM_BATCH
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> LatentAttentionMetadata:
        meta = self.build(0, common_attn_metadata)
        meta.max_decode_seq_len = self.max_model_len
        meta.min_decode_seq_len = 0
        return meta

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> LatentAttentionMetadata:
        m = common_attn_metadata
        num_decodes, num_prefills, _, _ = split_decodes_and_prefills(
            m, decode_threshold=self.reorder_batch_threshold)
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1]
        seq_lens_cpu = m.seq_lens_cpu_upper_bound
        if seq_lens_cpu is None:  # not provided by this runner: one sync
            seq_lens_cpu = m.seq_lens[: m.num_reqs].cpu()
        seq_lens_cpu = seq_lens_cpu[: m.num_reqs]
        dec = seq_lens_cpu[:num_decodes]
        rows = None
        if self.row_buffers is not None and num_decodes:
            host = decoders.decode_rows(qsl, num_decodes)
            if host is not None:
                n = host[0].shape[0]
                rows = DecodeRows(*(buf[:n].copy_(h, non_blocking=True)
                                    for buf, h in zip(self.row_buffers, host)),
                                  max_query_len=int((qsl[1:num_decodes + 1]
                                                     - qsl[:num_decodes]).max()))
                dec = dec[host[0]] - host[1]
            dec = (dec - self.max_rejected).clamp_min(0)
        prefill = None
        if num_prefills and self.batch_prefill:
            prefill = prefill_batch(qsl, seq_lens_cpu, num_decodes, self.window, self.device)
        return LatentAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_decodes=num_decodes,
            query_start_loc_cpu=qsl,
            query_start_loc=m.query_start_loc[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs],
            seq_lens_cpu=seq_lens_cpu,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            max_decode_seq_len=min(int(m.max_seq_len), self.max_model_len) if num_decodes else 0,
            min_decode_seq_len=int(dec.min()) if num_decodes else 0,
            prefill=prefill,
            rows=rows,
            speculative=self.max_rejected > 0,
        )


def prefill_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_decodes: int,
                  window: int | None, device) -> PrefillBatch:
    """Flatten the prefill requests of a reordered batch (host arithmetic, one
    host-to-device copy per tensor, no sync).

    Args:
        query_start_loc: ``[num_reqs + 1]`` host offsets of each request's
            new tokens.
        seq_lens: ``[num_reqs]`` host context lengths after this step.
        num_decodes: Leading one-token requests (not flattened).
        window: Sliding window of the layers, or ``None``.
        device: Where the tensors go.
    """
    qsl = query_start_loc.long()
    q_lens = qsl[num_decodes + 1:] - qsl[num_decodes:-1]
    seq = seq_lens[num_decodes:].long()
    first_key = torch.zeros_like(seq)
    if window is not None:
        first_key = (seq - q_lens - window + 1).clamp(min=0)
    key_req, key_pos, cu_k = ops.flat_ranges(first_key, seq - first_key)
    return PrefillBatch(
        cu_q=(qsl[num_decodes:] - qsl[num_decodes]).to(torch.int32).to(device, non_blocking=True),
        cu_k=cu_k.to(torch.int32).to(device, non_blocking=True),
        key_req=(key_req + num_decodes).to(device, non_blocking=True),
        key_pos=key_pos.to(device, non_blocking=True),
        max_q_len=int(q_lens.max()),
    )


def batched_prefill(plan, k_up: torch.Tensor, rope, scale: float, query: torch.Tensor,
                    kv_cache: torch.Tensor, block_table: torch.Tensor, batch: PrefillBatch,
                    out: torch.Tensor, *, post_rope: bool = False, layout=None,
                    transform=None, window: int | None = None) -> torch.Tensor:
    """Every prefill chunk of a step in one varlen call: read the chunks'
    visible contexts back from the cache (one gather through the block table,
    dequantized when packed), rebuild and rotate their keys
    (:func:`~vllm_lowrank.attention.latent_attention.context_keys`, in the
    query dtype), attend with
    :func:`~vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`.

    Args:
        query: ``[T, H, d]`` the prefill tokens' queries (post-RoPE mode:
            ``[T, H, >= max r_k]``), in request order.
        block_table: ``[num_reqs, max_blocks]`` (rows indexed by
            ``batch.key_req``).
        batch: From :func:`prefill_batch`.
        out: ``[T, out_width]``, written in place.

    Returns:
        ``out``: the same values as
        :func:`~vllm_lowrank.attention.latent_attention.prefill_attention` per
        request, up to the precision of the query dtype.
    """
    from vllm_lowrank.kernels.triton import prefill as kernel

    block_size = kv_cache.shape[2]
    blocks = block_table[batch.key_req, batch.key_pos // block_size].long()
    lat = ops.gather_slots(kv_cache, blocks, batch.key_pos % block_size)
    if layout is not None:
        lat = torch.cat(layout.decode(lat), dim=-1)
    lat = lat.to(query.dtype)  # once, for the keys' rebuild and the values
    keys = ops.context_keys(plan, k_up, rope, lat, batch.key_pos, post_rope, transform,
                            dtype=query.dtype)
    values = lat[:, plan.k_width:]
    if post_rope:
        query = query[..., :keys.shape[-1]]
    return kernel.latent_prefill_attention(
        query, keys, values, kernel.head_table(plan, query.device), batch.cu_q, batch.cu_k,
        batch.max_q_len, scale, out, max_rank_v=max(plan.v_ranks), window=window)


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
        from vllm.config import get_current_vllm_config

        self.vllm_config = get_current_vllm_config()

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
                         staged=key[:, :rk] if exact.slot.staged_width else None)
        if per_channel:  # key groups completed by this step's tokens
            ends = None
            m = get_attention_context(layer.layer_name)[0]
            fused = tale.fused_key_groups(kv_cache, layer.layout, exact.slot)
            if not fused and isinstance(m, LatentAttentionMetadata) and \
                    m.num_actual_tokens > tale.GRAPH_SAFE_TOKENS and not m.speculative:
                g = layer.layout.k_channel_tokens
                if g not in m.key_group_ends:
                    m.key_group_ends[g] = tale.key_group_ends(
                        m.query_start_loc_cpu, m.seq_lens_cpu, g, kv_cache.device)
                ends = m.key_group_ends[g]
            tale.write_key_groups(kv_cache, exact_cache, exact.slot, slot_mapping, exact_slots,
                                  layer.layout, ends)

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
        """Attention of ``query [T, H, d]`` into ``output [T, out_width]``.

        Paths: decode (the first ``num_decodes`` tokens) in one call of the
        layer's decoder (:mod:`vllm_lowrank.attention.decoders`); prefill on CUDA
        in one batched varlen call (:func:`batched_prefill`), on CPU one torch
        call per request (torch's CPU flash kernel). Token-adaptive layers:
        :meth:`_forward_token_adaptive`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output
        m = attn_metadata
        if layer.exact is not None:
            return self._forward_token_adaptive(layer, query, kv_cache, m, output)
        self._decode(layer, query, kv_cache, m, output)
        if m.prefill is not None:
            self._prefill_batched(layer, query, kv_cache, m, output)
            return output
        qsl = m.query_start_loc_cpu
        for r in m.prefill_reqs:
            start, stop = int(qsl[r]), int(qsl[r + 1])
            out = ops.prefill_attention(
                layer.plan, layer.k_up, layer.rope_table(query.device), self.scale,
                query[start:stop], kv_cache, m.block_table[r], int(m.seq_lens_cpu[r]),
                layer.post_rope, layer.layout, transform=layer.key_transform(),
                window=self.sliding_window,
            )
            output[start:stop] = out.to(output.dtype)
        return output

    def _decode(self, layer, query, kv_cache, m, output, exact_cache=None,
                exact_block_table=None) -> None:
        """The step's decode tokens (the first ``m.num_decode_tokens``) through
        the layer's decoder (chosen on first use), into ``output``."""
        if not m.num_decodes:
            return
        decoder = decoders.for_layer(layer, self.vllm_config, query.device)
        batch = m.decode_batch(exact_cache, exact_block_table, decoder.takes_query_tokens)
        n = m.num_decode_tokens
        decoder.run(query[:n], kv_cache, batch, decoder.plan(batch), output[:n])

    def _prefill_batched(self, layer, query, kv_cache, m, output) -> None:
        """The step's prefill chunks in one call (:func:`batched_prefill`)."""
        start = int(m.query_start_loc_cpu[m.num_decodes])
        stop = int(m.query_start_loc_cpu[-1])
        batched_prefill(layer.plan, layer.k_up, layer.rope_table(query.device), self.scale,
                        query[start:stop], kv_cache, m.block_table, m.prefill,
                        output[start:stop], post_rope=layer.post_rope, layout=layer.layout,
                        transform=layer.key_transform(), window=self.sliding_window)

    def _forward_token_adaptive(self, layer, query, kv_cache, m, output):
        """TALE: the latent middle and the exact sinks/recent tokens, merged by
        log-sum-exp (:mod:`vllm_lowrank.attention.token_adaptive`); output
        ``[T, num_heads * head_dim]``. Decode requests in one call; prefill
        chunks in one batched call on CUDA (no sliding window), else one
        request at a time."""
        exact = layer.exact
        exact_meta, _, exact_cache, _ = get_attention_context(exact.layer_name)
        common = dict(sink=exact.sink, recent=exact.recent, exact=exact.slot,
                      layout=layer.layout, transform=layer.key_transform(),
                      window=self.sliding_window)
        post_rope = dict(post_rope=layer.post_rope)
        weights = (layer.plan, layer.k_up, layer.v_up, layer.rope_table(query.device),
                   self.scale)
        nd = m.num_decodes
        self._decode(layer, query, kv_cache, m, output, exact_cache, exact_meta.block_table)
        qsl = m.query_start_loc_cpu
        if len(m.prefill_reqs) and query.device.type == "cuda" and self.sliding_window is None:
            layout = layer.layout
            group = layout.k_channel_tokens if layout is not None and layout.k_per_channel else 1
            key = (exact.sink, exact.recent, group)
            if key not in m.tale_spans:
                m.tale_spans[key] = tale.prefill_spans(qsl, m.seq_lens_cpu, nd, *key,
                                                       query.device)
            start, stop = int(qsl[nd]), int(qsl[-1])
            tale.prefill_batched(*weights, query[start:stop], kv_cache, m.block_table,
                                 exact_cache, exact_meta.block_table, m.tale_spans[key],
                                 output[start:stop],
                                 exact=exact.slot, layout=layout,
                                 transform=common["transform"], **post_rope)
            return output
        for r in m.prefill_reqs:
            start, stop = int(qsl[r]), int(qsl[r + 1])
            out = tale.prefill(*weights, query[start:stop], kv_cache, m.block_table[r],
                               exact_cache, exact_meta.block_table[r], int(m.seq_lens_cpu[r]),
                               **common, **post_rope)
            output[start:stop] = out.to(output.dtype)
        return output

