"""Byte formats of the caches, shared by the writers, the readers (torch path and
kernels), the allocator and the benchmarks.

- :mod:`.latent`: the packed low-bit latent slot
  (:class:`~vllm_lowrank.format.latent.SlotLayout`): per-token and per-channel
  quantization, bit packing, page padding.
- :mod:`.exact`: the token-adaptive mode's exact tokens (which tokens,
  :class:`~vllm_lowrank.format.exact.ExactTokens`; how a slot stores them,
  :class:`~vllm_lowrank.format.exact.ExactSlot`).
"""
