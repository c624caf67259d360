"""Exact tokens of the token-adaptive mode: which tokens, and their slot format.

TALE (``../shared/papers/tale.md``, sec. 2.2) keeps the first (sink) and the
most recent tokens of every sequence exact; :class:`ExactTokens` says how many
and at which precision, :class:`ExactSlot` how one token's post-RoPE key and
value (and, with per-channel keys, its staged key latent) are laid out in a
slot of the exact cache (:mod:`vllm_lowrank.attention.exact_cache`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_lowrank.config import EXACT_BITS, LowRankConfig, LowRankConfigError
from vllm_lowrank.format.latent import SlotLayout


PREFILL_CHUNK_TOKENS = 128
"""vLLM's per-request prefill chunk (``long_prefill_token_threshold``) that the
token-adaptive mode sets when the user did not: every token of a chunk is
written to the exact cache for the step, so the chunk bounds the exact blocks a
request holds and vLLM reserves (sink + recent + chunk tokens), which keeps
the capacity gain under vLLM's default 8,192-token step budget. 128 rather than
256: 31-33 % more KV capacity for the J-LRD latent-0.75 and ``4x`` recipes and 1.5-1.8x
the concurrent sequences in the CPU load test (more preemptions, wall time within
its run-to-run spread); on a GPU, 1.67x the prefill time of 16 x 4k prompts when
prefill ran one request at a time (benchmarks/README.md's history in git, "The presets under load").
Prefill is now batched across requests, but every chunk still rebuilds its
request's latent history, so prefill work grows as context^2 / chunk: 6.7x stock's
prefill time at 8 x 32k for the ``8x`` allocation on an H100 (benchmarks/README.md,
"the ``8x`` allocation inside vLLM"). A request alone in the scheduler still
prefills in whole-budget chunks. Settings with ``post_rope_keys`` take
:data:`POST_ROPE_PREFILL_CHUNK_TOKENS` instead (:func:`prefill_chunk_tokens`)."""

POST_ROPE_PREFILL_CHUNK_TOKENS = 2048
"""The prefill chunk of settings with ``post_rope_keys`` (the ``lossless`` and
``4x`` presets): their chunks read the history's key codes as stored and
rebuild no key, so a longer chunk costs little, and 128-token chunks cost
throughput. H200, Llama-3-8B shape, 8 GiB of KV cache, 128 requests of 1,024 +
1,024 tokens: ``4x`` 2.03-2.05x stock ``TRITON_ATTN``'s output tokens/s at 2,048
against 1.86x at 128, ``lossless`` 1.77x against 1.66x, as many requests
running; at 16 x 4k prompts ``4x`` took 1.36x stock's prefill time against 1.81x
(benchmarks/README.md, "GPU serving inside vLLM"). vLLM's worst-case
concurrency figure then counts a 2,048-token chunk in flight per request in
exact blocks, which a prefilled request does not hold
(:func:`vllm_lowrank.estimate.estimate`: ``sequences`` against ``admitted``)."""


def prefill_chunk_tokens(cfg: LowRankConfig, max_model_len: int | None) -> int:
    """The per-request prefill chunk (vLLM's ``long_prefill_token_threshold``)
    that the token-adaptive mode sets when the user did not, in tokens:
    :data:`POST_ROPE_PREFILL_CHUNK_TOKENS` with ``post_rope_keys``, else
    :data:`PREFILL_CHUNK_TOKENS` (each chunk rebuilds its request's latent
    history); 0, vLLM's own (no cap), when the mode is off or ``max_model_len``
    (``None``: unknown) is shorter than that chunk. The one rule of the server
    (:mod:`vllm_lowrank.patches`) and of :func:`vllm_lowrank.estimate.estimate`."""
    if not (cfg.enabled and cfg.token_adaptive):
        return 0
    chunk = POST_ROPE_PREFILL_CHUNK_TOKENS if cfg.post_rope_keys else PREFILL_CHUNK_TOKENS
    return chunk if max_model_len is None or max_model_len >= chunk else 0


PREEMPTION_WATERMARK = 0.1
"""vLLM's admission watermark (``--watermark``: the fraction of KV blocks kept
free when admitting waiting or preempted requests) that the token-adaptive
mode sets when the user did not. vLLM admits a request when its prompt fits and
preempts (to recompute) when running requests outgrow the cache; in this mode a
recompute prefills in :data:`PREFILL_CHUNK_TOKENS`-token chunks, each
rebuilding the request's latent history, and holds its blocks for that many
steps, so preemptions cascade. 256 requests of 1,024 + 1,024 tokens at 8 GiB of
KV cache (``alloc-8x-re``, Llama-3-8B shape, H200): 902 preemptions and 1,698
output tokens/s without a watermark, 55 and 3,201 with 0.1 (stock vLLM: 2,764
tokens/s beside the default); 128 requests, which fit without preemption, are
admitted alike (benchmarks/README.md's history in git, "Under overload")."""


def exact_tokens(cfg: LowRankConfig, block_size: int) -> ExactTokens | None:
    """:class:`ExactTokens` of the token-adaptive mode: sink and recent tokens
    rounded up to whole blocks of ``block_size`` tokens (their blocks are stored
    whole anyway) and ``cfg.exact_bits``; ``None`` when ``cfg.token_adaptive``
    is off.

    Raises:
        LowRankConfigError: per-channel key groups that do not divide the block.
    """
    if not cfg.token_adaptive:
        return None
    if cfg.k_quant == "channel" and block_size % cfg.k_channel_tokens:
        raise LowRankConfigError(
            f"k_channel_tokens={cfg.k_channel_tokens} must divide the KV block size "
            f"{block_size} (a per-channel key group lies inside one block); use a "
            f"divisor of {block_size} or change --block-size")
    return ExactTokens(-(-cfg.sink_tokens // block_size) * block_size,
                       -(-cfg.recent_tokens // block_size) * block_size, cfg.exact_bits)


@dataclasses.dataclass(frozen=True)
class ExactTokens:
    """What the token-adaptive mode keeps at full rank, per sequence.

    Attributes:
        sink: Leading tokens, a whole number of KV blocks.
        recent: Most recent tokens, a whole number of KV blocks.
        bits: Storage of their keys and values (:data:`EXACT_BITS`; 16 = the
            model dtype).
        staged_room: Key-latent elements every layer's exact slot has room
            for: the widest ``Rk`` of the layers that stage their key latents
            (per-channel keys), 0 if none does. One exact slot size for every
            layer puts all exact caches in one vLLM cache group
            (:meth:`ExactSlot.for_layer`).
    """

    sink: int
    recent: int
    bits: int = 16
    staged_room: int = 0

    @property
    def count(self) -> int:
        """Tokens held per sequence, in-flight tokens aside (``sink + recent``)."""
        return self.sink + self.recent


@dataclasses.dataclass(frozen=True)
class ExactSlot:
    """Byte layout of one exact-cache slot::

        [ k | v | c_k (staged) | padding ]

    - ``bits=16``: ``k`` and ``v`` are ``kv_width`` elements of ``dtype`` each
      (post-RoPE keys), bit for bit what the model computed.
    - ``bits=8``: ``k`` and ``v`` are per-token, per-head asymmetric int8
      codes with one float16 scale/zero pair per head and side (the packed
      format of :class:`~vllm_lowrank.format.latent.SlotLayout`, ``head_dim``
      channels per group). On the embedded model this storage costs +0.0 %
      perplexity when applied to the whole cache (``../shared/notes/baselines.md``,
      row q2) and halves the bytes of the exact tokens.
    - ``c_k``: ``staged_width`` elements of ``dtype`` (per-channel key
      quantization, :func:`vllm_lowrank.attention.token_adaptive.write_key_groups`),
      kept in the model dtype at both settings: they are quantized again, per
      channel, once their group is complete.
    - Room for ``staged_room`` staged elements (at least ``staged_width``),
      then padding up to a multiple of ``latent_slot_bytes`` (see the module
      docstring).

    Args:
        kv_width: ``num_kv_heads * head_dim``.
        head_dim: Channels per head (the int8 scale group).
        dtype: Model dtype.
        bits: :data:`~vllm_lowrank.config.EXACT_BITS`.
        staged_width: ``Rk`` staged key-latent elements, or 0.
        latent_slot_bytes: Bytes of the owning layer's latent slot.
        staged_room: Staged elements the slot has room for (a model's widest
            ``staged_width``, :attr:`ExactTokens.staged_room`).

    Raises:
        ValueError: ``bits`` not in ``EXACT_BITS``, or ``head_dim`` not
            dividing ``kv_width``.
    """

    kv_width: int
    head_dim: int
    dtype: torch.dtype
    bits: int = 16
    staged_width: int = 0
    latent_slot_bytes: int = 1
    staged_room: int = 0

    @classmethod
    def for_layer(cls, plan, layout, dtype: torch.dtype, exact: ExactTokens,
                  stage_keys: bool = True) -> ExactSlot:
        """The exact slot of a latent layer with ``plan`` (a
        :class:`~vllm_lowrank.factorization.plan.LayerPlan`) and slot
        ``layout`` (``None``: latents in ``dtype``) in a model keeping ``exact``
        tokens: staged key latents when its keys are quantized per channel,
        room for the model's widest (``exact.staged_room``), padded to the
        latent slot. Layers of one latent slot size then have one exact slot
        size: with per-layer sizes vLLM made a cache group per layer, and its
        scheduler walked every group of every request at every step (64
        groups at Llama-3-8B's 32 layers; at 107 sequences a decode step took
        57.8 ms, the GPU busy for 32.8 of them, H200, benchmarks/README.md,
        "One cache group per kind"). ``stage_keys`` false: the layer's key latents
        are its exact post-RoPE keys (``post_rope_keys``), so a per-channel group
        is quantized from the exact keys and nothing is staged."""
        latent_bytes = (layout.slot_bytes if layout is not None else
                        (plan.k_width + plan.v_width) * dtype.itemsize)
        staged = plan.k_width if stage_keys and layout is not None and layout.k_per_channel \
            else 0
        return cls(plan.shape.kv_width, plan.shape.head_dim, dtype, exact.bits, staged,
                   latent_bytes, exact.staged_room)

    def __post_init__(self) -> None:
        if self.bits not in EXACT_BITS:
            raise ValueError(f"exact_bits={self.bits} not in {EXACT_BITS}")
        if self.kv_width % self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} does not divide kv_width {self.kv_width}")

    @functools.cached_property
    def int8_layout(self):
        """The :class:`~vllm_lowrank.format.latent.SlotLayout` of ``[k | v]`` at
        ``bits=8`` (one group per head and side: ``head_dim`` codes, one float16
        scale/zero pair per token), else ``None``."""
        if self.bits == 16:
            return None
        heads = (self.head_dim,) * (self.kv_width // self.head_dim)
        return SlotLayout(heads, heads, self.bits, self.bits)

    @property
    def kv_bytes(self) -> int:
        """Bytes of ``[k | v]`` (with their scales and zeros)."""
        if self.int8_layout is not None:
            return self.int8_layout.natural_bytes
        return 2 * self.kv_width * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes of the whole slot, padding included."""
        raw = self.kv_bytes + max(self.staged_width, self.staged_room) * self.dtype.itemsize
        return -(-raw // self.latent_slot_bytes) * self.latent_slot_bytes

    def encode(self, key: torch.Tensor, value: torch.Tensor,
               staged: torch.Tensor | None = None) -> torch.Tensor:
        """``key``/``value`` ``[T, kv_width]`` and ``staged`` ``[T,
        staged_width]`` (or ``None``) -> ``[T, slot_bytes]`` uint8 rows."""
        if self.int8_layout is not None:
            parts = [self.int8_layout.encode(key, value)]
        else:
            parts = [torch.cat((key, value), -1).to(self.dtype).contiguous().view(torch.uint8)]
        if staged is not None:
            parts.append(staged.to(self.dtype).contiguous().view(torch.uint8))
        rows = torch.cat(parts, dim=-1)
        return torch.nn.functional.pad(rows, (0, self.slot_bytes - rows.shape[-1]))

    def decode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., slot_bytes]`` uint8 -> ``(k, v)``, each ``[..., kv_width]`` float32."""
        if self.int8_layout is not None:
            return self.int8_layout.decode(rows[..., :self.kv_bytes])
        kv = rows[..., :self.kv_bytes].clone().view(self.dtype).float()  # clone: aligned
        return kv[..., :self.kv_width], kv[..., self.kv_width:]

    def staged(self, rows: torch.Tensor) -> torch.Tensor:
        """The key latents a per-channel key group is quantized from, of
        ``[..., slot_bytes]`` rows, float32: the staged ones ``[...,
        staged_width]``, or without staged latents (post-RoPE keys, whose latent
        is the key) the exact keys ``[..., kv_width]`` as stored."""
        if not self.staged_width:
            return self.decode(rows)[0]
        stop = self.kv_bytes + self.staged_width * self.dtype.itemsize
        return rows[..., self.kv_bytes:stop].clone().view(self.dtype).float()
