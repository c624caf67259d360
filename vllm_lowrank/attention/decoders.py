"""Decoders: the one object per latent attention layer that computes its decode.

A decoder is a kernel family behind one small interface (after vLLM's MLA
backends and FlashInfer's plan/run):

- ``supports(layer, ctx) -> reason | None`` (a class method: no compile, no
  device work) says why the family cannot decode a layer;
- constructing one *prepares* it for its layer, once, after the weights are
  loaded: packed key weights, group tables, RoPE checks and 16-bit copies of
  up-projections live on the decoder, which lives on the layer
  (``layer.decoder``), never in module-level caches;
- ``plan(batch)`` is host arithmetic on the step's batch (the context split):
  no device sync, so CUDA graphs capture the launch it sizes;
- ``run(query, kv_cache, batch, plan, out)`` writes the attention output.

:func:`choose` tries the families of :func:`candidates` in order of speed,
once per layer at start-up: the first that supports the layer, builds, and
agrees with :class:`TorchDecoder` on a random cache (:func:`self_check`; a
kernel that fails to compile for this GPU, or that the installed Triton
compiles wrongly, is never served) is kept, warmed up at the split a CUDA
graph captures, and logged in one line. Nothing at decode time chooses a
kernel.

The families (each decodes what its ``supports`` admits; the math is in
:mod:`vllm_lowrank.attention.latent_attention` and
:mod:`vllm_lowrank.attention.token_adaptive`):

- :class:`CudaDecoder`: the mma.sync CUDA kernel
  (``vllm_lowrank/kernels/cuda/latent_decode.cu``), pre-RoPE 16-bit latents
  with one KV head per group;
- :class:`GridDecoder`, :class:`WideDecoder`, :class:`PackedDecoder`,
  :class:`LatentRopeDecoder`: the Triton kernels of
  :mod:`vllm_lowrank.kernels.triton` through
  :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch`;
- :class:`TokenAdaptiveDecoder`: a token-adaptive layer's latent span on one
  of those, then its exact sink and recent tokens and the merge in one Triton
  kernel (:mod:`vllm_lowrank.kernels.triton.decode_exact`);
- :class:`PostRopeKeysCudaDecoder`: the ``4x`` preset's post-RoPE-keys layers
  (4-bit key codes per channel, full-rank value latents per KV head, int8 exact
  tokens) on the mma.sync CUDA kernel
  (``vllm_lowrank/kernels/cuda/post_rope_decode.cu``);
- :class:`PostRopeKeysDecoder`: a token-adaptive layer with post-RoPE keys in
  one fused Triton kernel (:mod:`vllm_lowrank.kernels.triton.decode_post_rope`);
- :class:`TorchDecoder`: the torch reference, every cache format and device
  (on CUDA eager only, several times slower; served there only with
  ``allow_slow_path``).

Example::

    ctx = DecoderContext(torch.bfloat16, torch.device("cuda"), block_size=16,
                         window=None, max_model_len=4096)
    decoder = choose(layer, ctx)            # at start-up
    batch = DecodeBatch(block_table, seq_lens, max_seq_len=4096, min_seq_len=1)
    decoder.run(query, kv_cache, batch, decoder.plan(batch), out)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import ClassVar

import torch

from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.config import LowRankConfigError, config_from_vllm

logger = logging.getLogger("vllm.lowrank")

SELF_CHECK_TOL = 5e-2
"""Largest relative L2 error of a decoder's output against the float32 torch
path in the start-up self-check. bf16 keys rebuilt in a kernel differ from the
torch path's float32 keys by rounding (about 1e-2 relative at the serving
shapes); a kernel compiled wrongly is off by order 1."""


@dataclasses.dataclass(frozen=True)
class DecoderContext:
    """What a decoder is prepared for, besides its layer.

    Attributes:
        dtype: Query (model) dtype.
        device: Where the layer runs.
        block_size: Tokens per KV block of the layer's cache.
        window: The layer's sliding window, or ``None``.
        max_model_len: Longest sequence (the split a CUDA graph captures).
        cache_dtype: Element dtype of an unquantized latent cache (``None``:
            ``dtype``).
        max_query_len: Query tokens a decode step gives one request: 1, or
            with speculative decoding 1 + the drafts a verify step checks.
    """

    dtype: torch.dtype
    device: torch.device
    block_size: int
    window: int | None
    max_model_len: int
    cache_dtype: torch.dtype | None = None
    max_query_len: int = 1


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The decode sequences of one step: one new token each, or, for a decoder
    that :attr:`~Decoder.takes_query_tokens`, a speculative verify step's few.

    Attributes:
        block_table: ``[B, max_blocks]`` int32 rows of the latent cache's block table.
        seq_lens: ``[B]`` int32 context lengths, this step's tokens included.
        max_seq_len, min_seq_len: Host bounds of ``seq_lens`` (``max_model_len``
            and 0 while a CUDA graph is captured).
        exact_cache: The token-adaptive layer's exact cache (``None`` otherwise),
            this step's token already written.
        exact_block_table: ``[B, max_blocks]`` int32 rows of its block table.
        query_start_loc: ``[B + 1]`` int32 (device) offsets of each sequence's
            query tokens (``None``: one each); token ``t`` of ``q_b`` attends
            the first ``seq_len - (q_b - 1 - t)`` positions.
        max_query_len: Most query tokens of a sequence (host int).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    min_seq_len: int = 0
    exact_cache: torch.Tensor | None = None
    exact_block_table: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    max_query_len: int = 1

    @property
    def size(self) -> int:
        """Sequences in the batch."""
        return self.seq_lens.shape[0]

    def per_token(self, req: torch.Tensor, back: torch.Tensor) -> DecodeBatch:
        """The same query tokens as one-token sequences (:func:`decode_rows`):
        row ``t`` is sequence ``req[t]`` cut to ``seq_len - back[t]`` tokens
        (at least 0), its block-table rows gathered (device ops, no sync).

        Args:
            req: ``[T]`` int64 (device) sequence of each token.
            back: ``[T]`` int32 (device) the sequence's tokens after it.
        """
        return dataclasses.replace(
            self, block_table=self.block_table.index_select(0, req),
            seq_lens=(self.seq_lens.index_select(0, req) - back).clamp_min(0),
            exact_block_table=None if self.exact_block_table is None
            else self.exact_block_table.index_select(0, req),
            query_start_loc=None, max_query_len=1)


def decode_rows(query_start_loc: torch.Tensor, num_decodes: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Host ``(req, back)`` of ``vllm_lowrank.attention.backend.DecodeRows`` for the first
    ``num_decodes`` requests, or ``None`` when each has at most one token.

    A uniform batch (every request ``q`` tokens, CUDA-graph padding requests
    none) gets ``q`` rows per request, padding included (``seq_len 0``: they
    attend nothing), as the captured graph does.

    Args:
        query_start_loc: ``[num_reqs + 1]`` host offsets of each request's
            query tokens.
        num_decodes: Leading decode requests.
    """
    qsl = query_start_loc[:num_decodes + 1].long()
    q = qsl[1:] - qsl[:-1]
    width = int(q.max()) if num_decodes else 0
    if width <= 1:
        return None
    if bool(((q == width) | (q == 0)).all()):
        q = torch.full_like(q, width)
    req = torch.repeat_interleave(torch.arange(num_decodes), q)
    back = torch.cumsum(q, 0)[req] - 1 - torch.arange(req.shape[0])
    return req, back.to(torch.int32)


def query_width(layer) -> int:
    """Columns of the queries a decoder of ``layer`` reads: ``head_dim``, or
    the largest key width per KV head in post-RoPE mode."""
    plan = layer.plan
    return max(plan.k_ranks) // plan.group_size if layer.post_rope else plan.shape.head_dim


def _span(layer) -> tuple[int, int]:
    """``(sink, recent)`` positions the latent span of a decode step leaves to
    the exact cache (``(0, 0)`` without token-adaptive mode): the recent window
    plus this step's own token."""
    return (layer.exact.sink, layer.exact.recent + 1) if layer.exact is not None else (0, 0)


class Decoder:
    """A kernel family that decodes one layer (module docstring).

    Args:
        layer: The :class:`~vllm_lowrank.attention.layer.LatentAttention`,
            weights loaded.
        ctx: What it is prepared for.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    takes_query_tokens: bool = False
    """Whether :meth:`run` takes several query tokens per sequence
    (:attr:`DecodeBatch.query_start_loc`); otherwise each token of a verify
    step is a sequence of its own (``vllm_lowrank.attention.backend.DecodeRows``)."""

    def __init__(self, layer, ctx: DecoderContext) -> None:
        self.layer, self.ctx = layer, ctx

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        """Why this family cannot decode ``layer``, or ``None``."""
        raise NotImplementedError

    def plan(self, batch: DecodeBatch):
        """Host-side launch geometry of a step (``None``: nothing to plan)."""
        return None

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, batch: DecodeBatch, plan,
            out: torch.Tensor) -> None:
        """Write the attention of ``query [T, H, query_width]`` into ``out
        [T, layer.out_width]`` (any float dtype); ``T = B`` unless
        ``batch.query_start_loc`` is given."""
        raise NotImplementedError

    def describe(self) -> str:
        """The start-up log line's description."""
        return self.label


class TorchDecoder(Decoder):
    """The torch path: :func:`~vllm_lowrank.attention.latent_attention.decode_attention`,
    or for token-adaptive layers :func:`~vllm_lowrank.attention.token_adaptive.decode`.
    Every cache format and device; the reference of :func:`self_check`."""

    name = "torch"
    label = "torch path"

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        return None

    def run(self, query, kv_cache, batch, plan, out) -> None:
        layer = self.layer
        common = dict(layout=layer.layout, transform=layer.key_transform(),
                      window=self.ctx.window)
        args = (layer.plan, layer.k_up, layer.rope_table(query.device), layer.impl.scale)
        if layer.exact is None:
            res = ops.decode_attention(*args, query, kv_cache, batch.block_table,
                                       batch.seq_lens, batch.max_seq_len,
                                       post_rope=layer.post_rope,
                                       min_seq_len=batch.min_seq_len, **common)
            out.copy_(res)
            return
        tale.decode(layer.plan, layer.k_up, layer.v_up, *args[2:], query, kv_cache,
                    batch.block_table, batch.exact_cache, batch.exact_block_table,
                    batch.seq_lens, batch.max_seq_len, sink=layer.exact.sink,
                    recent=layer.exact.recent, exact=layer.exact.slot,
                    mode="post_rope" if layer.post_rope else "pre_rope",
                    min_seq_len=batch.min_seq_len, out=out, **common)


class CudaDecoder(Decoder):
    """The mma.sync CUDA kernel of ``vllm_lowrank/kernels/cuda/latent_decode.cu``
    (:func:`vllm_lowrank.kernels.cuda.ext.latent_decode_pre_rope`): pre-RoPE,
    16-bit latents, one KV head per group, ``head_dim`` 128."""

    name = "cuda"
    label = "CUDA kernel (mma.sync, pre-RoPE, 16-bit latents)"

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        from vllm_lowrank.kernels.cuda.ext import DECODE_RANKS
        from vllm_lowrank.kernels.triton.decode_prep import interpreting, rope_is_rotation

        plan, sh, bs = layer.plan, layer.plan.shape, ctx.block_size
        rope = layer.rope_table(ctx.device) if ctx.device.type == "cuda" else None
        checks = (
            (ctx.device.type == "cuda" and not interpreting(), "not on a CUDA device"),
            (layer.decode_mode() == "pre_rope", f"{layer.decode_mode()} mode"),
            (layer.layout is None, "quantized cache"),
            (layer.key_transform() is None, "key transform"),
            (ctx.window is None or ctx.window >= ctx.max_model_len, "sliding window"),
            (layer.exact is None, "token-adaptive span"),
            (plan.group_size == 1, "group_size != 1"),
            (sh.head_dim == 128, "head_dim != 128"),
            (plan.heads_per_group <= 8, "more than 8 query heads per group"),
            ((ctx.cache_dtype or ctx.dtype) in (torch.bfloat16, torch.float16)
             and ctx.cache_dtype in (None, ctx.dtype), "cache/query dtype not bf16/fp16"),
            (bs >= 16 and bs & (bs - 1) == 0, "block_size not a power of two >= 16"),
            (len(set(plan.k_ranks)) == 1 and len(set(plan.v_ranks)) == 1, "uneven ranks"),
            (plan.k_ranks[0] in DECODE_RANKS and plan.v_ranks[0] in DECODE_RANKS,
             f"ranks not in {DECODE_RANKS}"),
        )
        for ok, why in checks:
            if not ok:
                return why
        if rope.rotary_dim != sh.head_dim:
            return "partial rotary"
        cos, sin = rope.cos, rope.sin
        if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride(-1) != 1 \
                or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0) \
                or cos.stride(0) % 4 or cos.data_ptr() % 16 or sin.data_ptr() % 16:
            return "cos/sin tables not float32 with 16-byte aligned rows"
        if not rope_is_rotation(rope):
            return "rope table is not a rotation table"
        from vllm_lowrank.kernels.cuda import ext

        return ext.unavailable("latent_decode")

    def __init__(self, layer, ctx: DecoderContext) -> None:
        from vllm_lowrank.kernels.cuda import ext

        super().__init__(layer, ctx)
        self.rope = layer.rope_table(ctx.device)
        self.weights = ext.pack_key_weights_t(layer.plan, layer.k_up, self.rope.neox, ctx.dtype)
        self.tokens_per_step = 32 * ext.decode_config(layer.plan.k_ranks[0],
                                                      layer.plan.v_ranks[0])[0]

    def plan(self, batch: DecodeBatch) -> int:
        from vllm_lowrank.kernels.triton.decode_prep import sm_count
        from vllm_lowrank.kernels.triton.launch import choose_num_splits

        return choose_num_splits(batch.size, self.layer.plan.num_groups, batch.max_seq_len,
                                 self.tokens_per_step, sm_count(self.ctx.device), 1)

    def run(self, query, kv_cache, batch, plan, out) -> None:
        from vllm_lowrank.kernels.cuda import ext

        res = ext.latent_decode_pre_rope(query, kv_cache, batch.block_table, batch.seq_lens,
                                         self.weights, self.rope, self.layer.impl.scale,
                                         num_splits=plan)
        out.copy_(res)


class TritonDecoder(Decoder):
    """A Triton kernel family of :mod:`vllm_lowrank.kernels.triton`, prepared as
    a :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch` (the layer's
    latent span only, for token-adaptive layers: see :class:`TokenAdaptiveDecoder`)."""

    kernel: ClassVar[str] = ""

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        from vllm_lowrank.format.latent import RAW_BITS
        from vllm_lowrank.kernels.triton.decode import choose_kernel

        if ctx.device.type != "cuda":
            return "not on a CUDA device"
        layout = layer.layout
        if layout is not None and RAW_BITS in (layout.k_bits, layout.v_bits):
            return "a raw 16-bit side inside a packed slot"
        rotary = layer.plan.shape.head_dim if layer.post_rope else \
            layer.rope_table(ctx.device).rotary_dim
        try:
            kernel = choose_kernel(layer.plan, layout, layer.decode_mode(), ctx.block_size,
                                   rotary, window=ctx.window, sink=_span(layer)[0])
        except ValueError as exc:
            return str(exc)
        return None if kernel == cls.kernel else f"the layer takes the {kernel} kernel"

    def __init__(self, layer, ctx: DecoderContext) -> None:
        from vllm_lowrank.kernels.triton.decode import LatentLaunch

        super().__init__(layer, ctx)
        sink, recent = _span(layer)
        self.launch = LatentLaunch(
            layer.plan, layer.layout, mode=layer.decode_mode(), scale=layer.impl.scale,
            dtype=ctx.dtype, device=ctx.device, block_size=ctx.block_size,
            k_up=None if layer.post_rope else layer.k_up,
            rope=None if layer.post_rope else layer.rope_table(ctx.device),
            cache_dtype=ctx.cache_dtype, transform=layer.key_transform(), window=ctx.window,
            sink=sink, recent=recent)
        self.takes_query_tokens = self.launch.takes_query_tokens and layer.exact is None

    def plan(self, batch: DecodeBatch) -> int:
        return self.launch.geometry(batch.size, batch.max_seq_len)[0]

    def span(self, query, kv_cache, batch, plan):
        """``(out [B, out_width] float32, lse [B, H])`` of the latent span."""
        return self.launch(query, kv_cache, batch.block_table, batch.seq_lens,
                           batch.max_seq_len, num_splits=plan, return_lse=True)

    def run(self, query, kv_cache, batch, plan, out) -> None:
        out.copy_(self.launch(query, kv_cache, batch.block_table, batch.seq_lens,
                              batch.max_seq_len, num_splits=plan,
                              query_start_loc=batch.query_start_loc,
                              max_query_len=batch.max_query_len))


class GridDecoder(TritonDecoder):
    """The grid kernel (:mod:`vllm_lowrank.kernels.triton.decode_kernels`)."""

    name, kernel = "triton-grid", "grid"
    label = "Triton kernel"


class WideDecoder(TritonDecoder):
    """The wide-group kernel (:mod:`vllm_lowrank.kernels.triton.decode_wide`)."""

    name, kernel = "triton-wide", "wide"
    label = "wide-group Triton kernel (the rank in chunks, 1 to 4 KV heads per program)"


class PackedDecoder(TritonDecoder):
    """The packed post-RoPE kernel (:mod:`vllm_lowrank.kernels.triton.decode_packed`)."""

    name, kernel = "triton-packed", "packed"
    label = "packed post-RoPE Triton kernel (codes in the dots)"


class LatentRopeDecoder(TritonDecoder):
    """The RoPE-equivariant latent kernel
    (:mod:`vllm_lowrank.kernels.triton.decode_latent_rope`)."""

    name, kernel = "triton-latent-rope", "latent_rope"
    label = "RoPE-equivariant latent Triton kernel (queries absorbed, no key rebuild)"


TRITON_FAMILIES = (PackedDecoder, LatentRopeDecoder, WideDecoder, GridDecoder)


class TokenAdaptiveDecoder(Decoder):
    """A token-adaptive layer (TALE): its latent span on a Triton family, then
    :func:`~vllm_lowrank.attention.token_adaptive.values_up` (in the model
    dtype, ``B_v`` copied to it once here) and the exact sink and recent tokens
    merged by log-sum-exp in one Triton kernel
    (:func:`~vllm_lowrank.kernels.triton.decode_exact.exact_merge_decode`)."""

    name = "token-adaptive"
    span_family: ClassVar[type[TritonDecoder]] = GridDecoder

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        if layer.exact is None:
            return "not a token-adaptive layer"
        if ctx.window is not None:
            return "sliding window (the exact part's kernel attends no window)"
        d = layer.plan.shape.head_dim
        if not (16 <= d <= 256 and d & (d - 1) == 0):
            return "head_dim not a power of two in 16..256"
        if layer.exact.slot.bits == 16 and layer.exact.slot.dtype != ctx.dtype:
            return "16-bit exact slots in another dtype than the queries"
        return cls.span_family.supports(layer, ctx)

    def __init__(self, layer, ctx: DecoderContext) -> None:
        super().__init__(layer, ctx)
        self.span_decoder = self.span_family(layer, ctx)
        self.v_up = layer.v_up.to(ctx.dtype)

    @property
    def label(self) -> str:  # type: ignore[override]
        return (f"token-adaptive: latent span on the {self.span_decoder.label}, exact part "
                "and merge in one Triton kernel")

    def plan(self, batch: DecodeBatch) -> int:
        return self.span_decoder.plan(batch)

    def run(self, query, kv_cache, batch, plan, out) -> None:
        from vllm_lowrank.kernels.triton.decode_exact import exact_merge_decode

        layer = self.layer
        lat, lat_lse = self.span_decoder.span(query, kv_cache, batch, plan)
        exact_merge_decode(layer.plan, layer.impl.scale, query, batch.exact_cache,
                           layer.exact.slot, batch.exact_block_table, batch.seq_lens,
                           layer.exact.sink, layer.exact.recent,
                           tale.values_up(layer.plan, self.v_up, lat), lat_lse, out)


class PostRopeKeysDecoder(Decoder):
    """A token-adaptive layer with post-RoPE keys (``post_rope_keys``): the
    latent span (key codes per channel, value latents) and the exact tokens
    in one online softmax, the value latents lifted once per program, in one
    Triton kernel (:mod:`vllm_lowrank.kernels.triton.decode_post_rope`)."""

    name = "post-rope-keys"
    label = ("post-RoPE key codes and value latents, latent span and exact tokens in one "
             "Triton kernel")
    takes_query_tokens = True

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        from vllm_lowrank.kernels.triton.decode_post_rope import blocker

        if layer.exact is None:
            return "not a token-adaptive layer"
        if ctx.device.type != "cuda":
            return "not on a CUDA device"
        return blocker(layer.plan, layer.layout, layer.exact.slot, post_rope=layer.post_rope,
                       window=ctx.window, block_size=ctx.block_size)

    def __init__(self, layer, ctx: DecoderContext) -> None:
        from vllm_lowrank.kernels.triton.decode_post_rope import PostRopeLaunch

        super().__init__(layer, ctx)
        exact = layer.exact
        self.launch = PostRopeLaunch(layer.plan, layer.layout, exact.slot, layer.v_up,
                                     scale=layer.impl.scale, sink=exact.sink,
                                     recent=exact.recent, dtype=ctx.dtype,
                                     block_size=ctx.block_size)

    def plan(self, batch: DecodeBatch) -> int:
        return self.launch.num_splits(batch.size, batch.max_seq_len, self.ctx.device)

    def run(self, query, kv_cache, batch, plan, out) -> None:
        self.launch(query, kv_cache, batch.block_table, batch.exact_cache,
                    batch.exact_block_table, batch.seq_lens, plan, out,
                    query_start_loc=batch.query_start_loc, max_query_len=batch.max_query_len)


class PostRopeKeysCudaDecoder(Decoder):
    """A ``4x``-preset-style post-RoPE-keys layer on the mma.sync CUDA kernel
    (``vllm_lowrank/kernels/cuda/post_rope_decode.cu``,
    :func:`vllm_lowrank.kernels.cuda.ext.post_rope_decode`): 4-bit key codes per
    channel over 32 or 64 tokens, 2- or 4-bit value latents per KV head (rank 128,
    64, or 96 at 4 bits: a lower rank reads fewer bytes at full rank's mma count),
    int8 exact tokens, ``head_dim`` 128; the latent span and the exact set in one
    kernel, split partials merged by log-sum-exp. One query token per sequence:
    with speculative decoding the layer keeps :class:`PostRopeKeysDecoder`, which
    reads the cache once for all of a verify step's tokens (this kernel would read
    it once per token, a 4-token step about 2.2x the Triton kernel's time at its
    measured 1.8x speed-up); outside its scope
    (:func:`~vllm_lowrank.kernels.cuda.ext.post_rope_scope`) too."""

    name = "post-rope-keys-cuda"
    label = ("post-RoPE key codes and value latents, latent span and exact tokens in one "
             "CUDA kernel (mma.sync)")
    takes_query_tokens = False

    @classmethod
    def supports(cls, layer, ctx: DecoderContext) -> str | None:
        from vllm_lowrank.kernels.cuda.ext import post_rope_scope, unavailable
        from vllm_lowrank.kernels.triton.decode_prep import interpreting

        why = PostRopeKeysDecoder.supports(layer, ctx)  # its scope is within the Triton one's
        if why is not None:
            return why
        if ctx.max_query_len > 1:
            return (f"speculative decoding: the Triton kernel reads the cache once for a "
                    f"verify step's {ctx.max_query_len} query tokens, this one once per token")
        if interpreting():
            return "not on a CUDA device"
        if ctx.dtype not in (torch.bfloat16, torch.float16):
            return f"queries in {ctx.dtype}, not bf16/fp16"
        why = post_rope_scope(layer.plan, layer.layout, layer.exact.slot,
                              block_size=ctx.block_size, sink=layer.exact.sink)
        if why is not None:
            return why
        return unavailable("post_rope_decode")

    def __init__(self, layer, ctx: DecoderContext) -> None:
        from vllm_lowrank.kernels.cuda import ext
        from vllm_lowrank.kernels.triton.decode_post_rope import head_columns

        super().__init__(layer, ctx)
        self.lift_t, self.vsum = ext.post_rope_lift(layer.plan, layer.v_up.to(ctx.device))
        warps, self.ctas_per_sm = ext.post_rope_config(layer.layout.k_channel_tokens,
                                                       layer.layout.v_bits,
                                                       layer.plan.v_ranks[0])
        self.tokens_per_step = warps * layer.layout.k_channel_tokens
        sh = layer.plan.shape
        self.head_of_col = head_columns(sh.num_heads, sh.head_dim, ctx.device)

    def plan(self, batch: DecodeBatch) -> int:
        from vllm_lowrank.kernels.triton.decode_prep import sm_count
        from vllm_lowrank.kernels.triton.launch import choose_num_splits

        return choose_num_splits(batch.size, self.layer.plan.shape.num_kv_heads,
                                 batch.max_seq_len, self.tokens_per_step,
                                 sm_count(self.ctx.device), self.ctas_per_sm)

    def run(self, query, kv_cache, batch, plan, out) -> None:
        from vllm_lowrank.kernels.cuda import ext

        layer = self.layer
        ext.post_rope_decode(query, kv_cache, batch.block_table, batch.exact_cache,
                             batch.exact_block_table, batch.seq_lens, self.lift_t, self.vsum,
                             layout=layer.layout, exact_slot=layer.exact.slot,
                             sink=layer.exact.sink, recent=layer.exact.recent,
                             scale=layer.impl.scale, num_splits=plan, out=out,
                             head_of_col=self.head_of_col)


def _token_adaptive(family: type[TritonDecoder]) -> type[TokenAdaptiveDecoder]:
    """The :class:`TokenAdaptiveDecoder` whose latent span runs on ``family``."""
    return type(f"TokenAdaptive{family.__name__}", (TokenAdaptiveDecoder,),
                {"span_family": family, "name": f"token-adaptive+{family.name}",
                 "__doc__": TokenAdaptiveDecoder.__doc__})


TOKEN_ADAPTIVE_FAMILIES = tuple(_token_adaptive(f) for f in TRITON_FAMILIES)


def candidates(layer) -> tuple[type[Decoder], ...]:
    """The families that may decode ``layer``, fastest first (the torch path last)."""
    if layer.exact is not None:
        return (PostRopeKeysCudaDecoder, PostRopeKeysDecoder, *TOKEN_ADAPTIVE_FAMILIES,
                TorchDecoder)
    return (CudaDecoder, *TRITON_FAMILIES, TorchDecoder)


def random_batch(layer, ctx: DecoderContext, seed: int = 0):
    """Inputs of :func:`self_check`: four sequences (two spanning three blocks
    past the exact sink and recent tokens, two of at most five tokens) over
    shuffled blocks, latents ~ N(0, 1) packed by the layer's layout (every
    per-channel key group complete), exact keys and values ~ N(0, 1) for a
    token-adaptive layer (its latent cache in blocks of twice the configured
    size, as vLLM may give it), queries ~ N(0, 1) in the model dtype.

    Returns:
        ``(query [4, H, query_width], kv_cache, batch)`` on ``ctx.device``.
    """
    plan, layout = layer.plan, layer.layout
    sink, recent = _span(layer)
    bs = ctx.block_size
    n1 = min(ctx.max_model_len, sink + recent + 2 * bs + 3)
    lens = [n1, min(n1, 5), max(1, n1 - 2), min(n1, 3)]
    g = torch.Generator().manual_seed(seed)

    def paged(page: int) -> tuple[torch.Tensor, int]:
        """A block table of ``lens`` over shuffled blocks of ``page`` tokens."""
        per = [math.ceil(n / page) for n in lens]
        num_blocks = sum(per) + 1
        order = torch.randperm(num_blocks, generator=g)
        table = torch.zeros(len(lens), max(per), dtype=torch.int32)
        for r, start in enumerate(itertools.accumulate([0] + per[:-1])):
            table[r, :per[r]] = order[start:start + per[r]]
        return table, num_blocks

    # A token-adaptive layer's latent cache gets blocks of three times the
    # configured size: vLLM enlarges the blocks of the group with the smaller
    # pages (one page size for the latent and the exact cache) by the ratio of
    # the slots, not always a power of two (3 for the `4x` preset at the
    # Llama-3-8B shape), and a decoder must read each cache's own block size.
    page = 3 * bs if layer.exact is not None else bs
    table, num_blocks = paged(page)
    lat = torch.randn(num_blocks * page, plan.k_width + plan.v_width, generator=g)
    if layout is None:
        rows = lat.to(ctx.cache_dtype or ctx.dtype)
    else:
        rows = layout.encode_complete(lat[:, :plan.k_width], lat[:, plan.k_width:])
    dev = ctx.device
    cache = rows.view(num_blocks, 1, page, -1).to(dev)
    q = torch.randn(len(lens), plan.shape.num_heads, query_width(layer), generator=g)
    exact_cache = exact_table = None
    if layer.exact is not None:
        slot = layer.exact.slot
        exact_table, exact_blocks = paged(bs)
        kv = torch.randn(exact_blocks * bs, 2, plan.shape.kv_width, generator=g)
        staged = torch.randn(exact_blocks * bs, plan.k_width, generator=g) \
            if slot.staged_width else None
        exact_cache = slot.encode(kv[:, 0], kv[:, 1], staged).view(exact_blocks, 1, bs, -1)
        exact_cache, exact_table = exact_cache.to(dev), exact_table.to(dev)
    batch = DecodeBatch(table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                        max_seq_len=n1, min_seq_len=min(lens), exact_cache=exact_cache,
                        exact_block_table=exact_table)
    return q.to(dev, ctx.dtype), cache, batch


def _rows(batch: DecodeBatch, n: int) -> DecodeBatch:
    """The first ``n`` sequences of ``batch``."""
    return dataclasses.replace(
        batch, block_table=batch.block_table[:n], seq_lens=batch.seq_lens[:n],
        exact_block_table=None if batch.exact_block_table is None
        else batch.exact_block_table[:n])


def _verify_step(batch: DecodeBatch, q_lens: list[int]) -> tuple[DecodeBatch, DecodeBatch]:
    """A speculative verify step over the first ``len(q_lens)`` sequences of
    ``batch``, ``q_lens[b]`` query tokens each: ``(per sequence, per token)``,
    the batch with ``query_start_loc`` and the same tokens as one-token rows
    (:meth:`DecodeBatch.per_token`)."""
    n, dev = len(q_lens), batch.seq_lens.device
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    req, back = (x.to(dev) for x in decode_rows(qsl, n))
    sub = _rows(batch, n)
    return dataclasses.replace(sub, query_start_loc=qsl.to(dev),
                               max_query_len=max(q_lens)), sub.per_token(req, back)


def self_check(decoder: Decoder, reference: Decoder) -> float:
    """Disagreement of ``decoder`` with ``reference`` (the torch path) on its
    layer's real factors and :func:`random_batch`: the relative L2 error of the
    outputs (float32), the largest over the first two sequences alone, all four
    (the wide-group kernel runs one KV head per program for the first and several
    for the second) and, for a decoder that :attr:`~Decoder.takes_query_tokens`,
    a verify step of 3 and 2 query tokens on the first two (against the torch
    path's one-token rows). ``inf`` for a non-finite output.

    Raises:
        Whatever the kernel raises (compilation, resources).
    """
    ctx, width = decoder.ctx, decoder.layer.out_width
    q, cache, batch = random_batch(decoder.layer, ctx)
    cases = [(q[:n], _rows(batch, n), _rows(batch, n)) for n in (2, q.shape[0])]
    if decoder.takes_query_tokens:
        verify, rows = _verify_step(batch, [3, 2])
        qv = torch.randn(rows.size, *q.shape[1:], generator=torch.Generator().manual_seed(1))
        cases.append((qv.to(q), verify, rows))
    err = 0.0
    for query, sub, rows in cases:
        want = torch.empty(query.shape[0], width, device=ctx.device)
        reference.run(query.float(), cache, rows, reference.plan(rows), want)
        got = torch.full((query.shape[0], width), float("nan"), device=ctx.device)
        decoder.run(query, cache, sub, decoder.plan(sub), got)
        if not torch.isfinite(got).all():
            return math.inf
        err = max(err, ((got - want).norm() / want.norm().clamp_min(1e-30)).item())
    return err


def _warm(decoder: Decoder) -> None:
    """Run ``decoder`` on one-token batches of 1 and 4 sequences with the split
    of ``max_model_len`` (the launches a CUDA graph captures): compiled now,
    before any capture."""
    ctx, layer = decoder.ctx, decoder.layer
    q, cache, batch = random_batch(layer, ctx)
    for n in (1, 4):
        one = torch.ones(n, dtype=torch.int32, device=ctx.device)
        rows = dataclasses.replace(_rows(batch, 1), max_seq_len=ctx.max_model_len,
                                   min_seq_len=0, seq_lens=one,
                                   block_table=batch.block_table[:1].expand(n, -1).contiguous())
        if rows.exact_block_table is not None:
            rows = dataclasses.replace(
                rows, exact_block_table=batch.exact_block_table[:1].expand(n, -1).contiguous())
        out = torch.empty(n, layer.out_width, device=ctx.device, dtype=ctx.dtype)
        decoder.run(q[:1].expand(n, -1, -1).contiguous(), cache, rows, decoder.plan(rows), out)


_LOGGED: set = set()


def choose(layer, ctx: DecoderContext) -> Decoder:
    """The decoder of ``layer``, chosen once (module docstring): the first of
    :func:`candidates` that supports the layer, builds and passes
    :func:`self_check` within :data:`SELF_CHECK_TOL`, warmed up (:func:`_warm`);
    else :class:`TorchDecoder`, logged as a warning with every family's reason.
    Logs one line per distinct layer configuration."""
    reference = TorchDecoder(layer, ctx)
    refused = []
    for family in candidates(layer):
        if family is TorchDecoder:
            break
        why = family.supports(layer, ctx)
        if why is not None:
            refused.append(f"{family.name}: {why}")
            continue
        try:
            decoder = family(layer, ctx)
            err = self_check(decoder, reference)
            if err <= SELF_CHECK_TOL:
                _warm(decoder)
        except Exception as exc:  # noqa: BLE001 (compilation, resources: not served)
            first_line = (str(exc).splitlines() or [""])[0][:200]
            refused.append(f"{family.name}: {type(exc).__name__}: {first_line}")
            continue
        if err <= SELF_CHECK_TOL:
            return _logged(layer, decoder, decoder.describe())
        refused.append(f"{family.name}: disagrees with the torch path (error {err:.2g} > "
                       f"{SELF_CHECK_TOL})")
    why = "not on a CUDA device" if ctx.device.type != "cuda" else "; ".join(refused)
    return _logged(layer, reference, why, warn=ctx.device.type == "cuda")


def _logged(layer, decoder: Decoder, reason: str, warn: bool = False) -> Decoder:
    plan, layout = layer.plan, layer.layout
    key = (decoder.name, reason, plan.group_size, plan.shape.head_dim,
           None if layout is None else (layout.k_bits, layout.v_bits, layout.k_per_channel),
           layer.exact is not None)
    if key not in _LOGGED:
        _LOGGED.add(key)
        bits = "16-bit" if layout is None else f"K{layout.k_bits}/V{layout.v_bits}"
        (logger.warning if warn else logger.info)(
            "vllm-lowrank: decoder %s for layers with head groups of %d KV heads, %s "
            "latents%s: %s", decoder.name, plan.group_size, bits,
            ", token-adaptive" if layer.exact is not None else "", reason)
    return decoder


def for_layer(layer, vllm_config, device: torch.device) -> Decoder:
    """``layer.decoder``, chosen on first use by :func:`choose` (and published to
    ``/metrics``, :func:`vllm_lowrank.metrics.record_decode_path`).

    Raises:
        LowRankConfigError: the torch path on a CUDA device without
            ``allow_slow_path`` (the message says why no fused kernel serves it).
    """
    decoder = layer.__dict__.get("decoder")
    if decoder is None:
        from vllm_lowrank import metrics

        from vllm.v1.attention.backend import max_decode_query_len

        ctx = DecoderContext(vllm_config.model_config.dtype, device,
                             vllm_config.cache_config.block_size, layer.sliding_window,
                             vllm_config.model_config.max_model_len,
                             max_query_len=max_decode_query_len(vllm_config))
        decoder = choose(layer, ctx)
        if (device.type == "cuda" and decoder.name == "torch"
                and not config_from_vllm(vllm_config).allow_slow_path):
            raise LowRankConfigError(
                f"{layer.layer_name} would decode on the torch path on this GPU (eager, "
                "several times slower than stock vLLM): no fused kernel serves it (the "
                "start-up log line says why). Choose a setting the fused kernels read "
                "(README, \"Which setting\") or add \"allow_slow_path\": true to serve it "
                "anyway")
        layer.__dict__["decoder"] = decoder
        metrics.record_decode_path(layer.layer_name, decoder.name)
    return decoder


def graph_safe(vllm_config, device: torch.device) -> bool:
    """True when every latent attention layer of the model decodes with a fused
    GPU kernel (no host sync, fixed launch shapes for a fixed batch), so decode
    steps may be captured in CUDA graphs; the torch path is not. Chooses every
    layer's decoder (warming its kernels) as a side effect, before any capture."""
    layers = [layer for layer in vllm_config.compilation_config.static_forward_context.values()
              if getattr(layer, "plan", None) is not None and hasattr(layer, "exact")]
    return all(for_layer(layer, vllm_config, device).name != "torch" for layer in layers)
