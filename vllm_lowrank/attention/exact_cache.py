"""Exact cache of the token-adaptive mode: sink and recent tokens at full precision.

TALE (``../shared/papers/tale.md``, sec. 2.2) spends precision where attention
looks most: the first tokens (attention sinks) and the most recent ones stay
exact, the middle of the context is read from the latent cache, and the tokens
being computed always see their own exact keys and values (lazy
approximation). Each latent attention layer in this mode owns one
:class:`~vllm_lowrank.attention.layer.ExactTokenCache`, a second vLLM cache layer whose paged blocks hold
post-RoPE keys and values, ``[k | v]`` (``2 * num_kv_heads * head_dim``
elements of the model dtype per token, or per-head int8 with
``exact_bits: 8``; padded, see below; :class:`~vllm_lowrank.format.exact.ExactSlot`).

Why a vLLM cache group rather than a buffer of our own: vLLM then allocates,
frees, prefix-caches and preempts these blocks like any other, and its capacity
figure counts them. :class:`ExactTokensSpec` is vLLM's ``SlidingWindowSpec``
(window ``recent + 1``: a step starting at position ``s`` keeps
``s - recent .. s - 1``) plus ``sink`` leading tokens; :class:`ExactTokensManager`
is vLLM's sliding-window manager that never frees the sink blocks, and finds a
prefix-cache hit only where the sink blocks are cached too. Per sequence the
group holds at most ``sink + recent`` tokens plus the tokens in flight and one
partly filled block: the bounded extra memory TALE pays.

Every latent token is also written to the latent cache when it is computed;
as it leaves the recent window attention starts reading that latent instead,
so a token's cached representation changes form exactly once. With
per-channel key quantization (``k_quant: "channel"``) an exact slot also stages
the token's key latent ``c_k`` (``[k | v | c_k]``): a group of ``G`` tokens
is quantized per channel, and its key codes written to the latent cache, in
the step that completes it (:func:`vllm_lowrank.attention.token_adaptive.write_key_groups`).
Its tokens are then still in the window (``G <= block <= recent``), so
attention never reads a key latent of an incomplete group.

Page sizes: vLLM's hybrid allocator needs one page size for all groups and
enlarges the block size of groups with smaller pages when the larger page is a
multiple of theirs (otherwise it pads the smaller page, which would waste the
latent cache's savings). The exact slot is therefore padded up to a multiple
of the latent slot (:attr:`~vllm_lowrank.format.exact.ExactSlot.slot_bytes`): the latent group gets an integer
multiple of the block size and loses nothing; the padding costs at most one
latent slot per exact token. Every layer's exact slot also has room for the
widest layer's staged key latent, and the latent specs' head sizes split the
slot bytes, so layers of different ranks still have equal specs: vLLM keeps all
exact caches in one cache group and all latent caches in another (one group per
layer made its scheduler walk 64 groups per request and step at 32 layers,
:meth:`~vllm_lowrank.format.exact.ExactSlot.for_layer`).
"""

from __future__ import annotations

import dataclasses

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec

from vllm_lowrank import compat


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactTokensSpec(SlidingWindowSpec):
    """vLLM cache spec of the exact tokens: a sliding window of
    ``sliding_window = recent + 1`` tokens plus the first ``sink`` tokens
    (``sink`` a multiple of ``block_size``; 0 for none).

    The page holds ``block_size`` slots of ``state_content_bytes`` uint8 each.
    """

    sink: int = 0
    max_request_tokens: int | None = None
    """Most tokens one request has in flight (scheduled, not yet settled):
    ``long_prefill_token_threshold`` times vLLM's concurrent batches, or
    ``None`` when vLLM's per-request chunk is not capped."""

    @property
    def sink_blocks(self) -> int:
        """Leading blocks never freed."""
        return cdiv(self.sink, self.block_size)

    @property
    def num_retained_tokens(self) -> int:
        """0: vLLM's worker keeps every block-table entry of this group.

        vLLM 0.33's model runner (V2, its default on CUDA) nulls, in each
        step's block table of a sliding-window group, the entries wholly below
        ``num_retained_tokens`` tokens before a request's first scheduled one
        (``SlidingWindowSpec.num_retained_tokens``; 0 turns it off). Here that
        would null the sink blocks, which every step reads. vLLM 0.32 does not
        read it."""
        return 0

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """Sliding-window bound plus the sink blocks. A request holds exact
        blocks for its own in-flight tokens only, so with a capped prefill
        chunk (:attr:`max_request_tokens`) the bound uses that cap instead of
        the whole step's token budget (vLLM's default for a sliding window,
        which would reserve a full 8,192-token chunk of exact blocks for every
        request and leave less capacity than the uncompressed cache)."""
        if self.max_request_tokens is not None:
            max_in_flight_tokens = min(max_in_flight_tokens, self.max_request_tokens)
        return super().max_admission_blocks_per_request(
            max_in_flight_tokens, max_model_len) + self.sink_blocks

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """Groupable with exact caches of the same window and sinks only."""
        return all(isinstance(s, ExactTokensSpec) and s.sliding_window == self.sliding_window
                   and s.sink == self.sink for s in kv_cache_specs.values())


def _manager_class():
    """:class:`ExactTokensManager`, defined on first use (vLLM's manager
    module is heavy and imported lazily by the plugin entry point)."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    class ExactTokensManager(SlidingWindowManager):
        """vLLM's sliding-window manager that keeps the sink blocks.

        - Blocks leave when the window passes them, except the first
          ``spec.sink_blocks``.
        - A prefix-cache hit must also find the sink blocks cached; if it
          does not, the hit is empty (everything is recomputed: correct, just
          less reuse). Sink blocks are always marked for caching.
        """

        def __init__(self, kv_cache_spec: ExactTokensSpec, **kwargs) -> None:
            super().__init__(kv_cache_spec, **kwargs)
            self.sink_blocks = kv_cache_spec.sink_blocks

        def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                                  num_prompt_tokens: int | None = None) -> None:
            skipped = self.get_num_skipped_tokens(processed_computed_tokens)
            blocks = self.req_to_blocks.get(request_id, [])
            end = min(skipped // self.block_size, len(blocks))
            compat.remove_blocks_in_range(self, request_id, self.sink_blocks, end)

        def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                       total_computed_tokens, *args, **kwargs) -> int:
            """vLLM's count, plus the evictable sink blocks of a prefix hit
            that the sliding-window count leaves out (they are kept)."""
            n = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                   total_computed_tokens, *args, **kwargs)
            if request_id in self.num_cached_block or not new_computed_blocks:
                return n
            return n + compat.num_evictable_blocks(self, self._skipped_sinks(
                new_computed_blocks, total_computed_tokens))

        def add_local_computed_blocks(self, request_id, new_computed_blocks,
                                      num_local_computed_tokens,
                                      num_external_computed_tokens) -> None:
            """vLLM's, then the sink blocks of the hit, which the sliding-window
            logic replaced by null blocks, are put back (and touched)."""
            super().add_local_computed_blocks(request_id, new_computed_blocks,
                                              num_local_computed_tokens,
                                              num_external_computed_tokens)
            sinks = self._skipped_sinks(new_computed_blocks,
                                        num_local_computed_tokens + num_external_computed_tokens)
            if self.enable_caching:
                self.block_pool.touch(sinks)
            blocks = self.req_to_blocks[request_id]
            for i, block in enumerate(sinks):
                blocks[i] = block

        def _skipped_sinks(self, new_computed_blocks, computed_tokens: int) -> list:
            """Hit blocks among the sinks that the window would skip."""
            skipped = self.get_num_skipped_tokens(computed_tokens) // self.block_size
            sinks = list(new_computed_blocks[:min(self.sink_blocks, skipped)])
            if any(b.is_null for b in sinks):
                raise RuntimeError("vllm-lowrank: a prefix-cache hit without its sink blocks "
                                   "(vLLM's scheduler changed how window hits are computed)")
            return sinks

        @classmethod
        def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec,
                                 use_eagle, *args, **kwargs):
            """vLLM caches only the blocks a window hit can use; the sink
            blocks are needed by every hit, so they are always cached."""
            mask = super().reachable_block_mask(start_block, end_block, alignment_tokens,
                                                kv_cache_spec, use_eagle, *args, **kwargs)
            if mask is not None:
                for i in range(start_block, min(end_block, kv_cache_spec.sink_blocks)):
                    mask[i - start_block] = True
            return mask

        @classmethod
        def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids,
                                   block_pool, kv_cache_spec, drop_eagle_block,
                                   alignment_tokens, dcp_world_size=1, pcp_world_size=1):
            computed, hit = super().find_longest_cache_hit(
                block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                drop_eagle_block, alignment_tokens, dcp_world_size, pcp_world_size)
            sinks = min(kv_cache_spec.sink_blocks, len(computed[0]))
            if not sinks:
                return computed, hit
            hashes = resolve_block_hashes(
                block_hashes, block_pool.hash_block_size, kv_cache_spec.block_size,
                supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
                alignment_tokens=alignment_tokens)
            for i in range(sinks):
                if not computed[0][i].is_null:
                    continue
                cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
                if cached is None:
                    return tuple([] for _ in kv_cache_group_ids), 0
                for blocks, block in zip(computed, cached):
                    blocks[i] = block
            return computed, hit

    return ExactTokensManager


_REGISTERED = False


def register_spec() -> None:
    """Register :class:`ExactTokensSpec` with its manager in vLLM's
    ``KVCacheSpecRegistry`` (idempotent; vLLM's built-in specs are registered
    first, since the registry fills itself only while empty)."""
    global _REGISTERED
    if _REGISTERED:
        return
    compat.register_kv_cache_spec(ExactTokensSpec, _manager_class())
    _REGISTERED = True
