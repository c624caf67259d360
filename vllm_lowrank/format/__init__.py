"""Byte formats of the caches, shared by the writers, the readers (torch path and
kernels), the allocator and the benchmarks.

- :mod:`.exact`: the token-adaptive mode's exact tokens (which tokens,
  :class:`~vllm_lowrank.format.exact.ExactTokens`; how a slot stores them,
  :class:`~vllm_lowrank.format.exact.ExactSlot`).

The latent slot format is :class:`vllm_lowrank.quantization.SlotLayout`.
"""
