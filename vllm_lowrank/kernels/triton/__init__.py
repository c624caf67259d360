"""Triton kernels of vllm-lowrank (installed as ``vllm_lowrank.kernels.triton``).

- :mod:`.decode` -- fused paged decode attention over latent KV:
  :func:`~vllm_lowrank.kernels.triton.decode.latent_decode_attention` (pre-RoPE
  key rebuild with RoPE in registers, or post-RoPE latent scores; bf16/fp16/fp32
  or packed low-bit caches; split-K with a reduce; uneven ranks per head group):
  the host side; the kernels are in :mod:`.decode_kernels`, the cached
  per-plan preparation in :mod:`.decode_prep`.
- :mod:`.launch` -- the decode kernels' launch parameters: per-case defaults
  (measured sweeps), the split wave model, when a group needs the wide kernel.
- :mod:`.decode_wide` -- the same decode for head groups whose key
  up-projection does not fit one program (J-LRD at large ranks): one program
  per KV head, the rank in chunks.
- :mod:`.tiles` -- device helpers shared by both: packed latent loads, key
  transforms, the split-K merge.
- :mod:`.prefill` -- varlen causal prefill of every chunk of a step in one launch
  (:func:`~vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`: rebuilt
  keys, value latents or rebuilt values, bottom-right causal mask, sliding
  windows, a prefix source every query sees: the token-adaptive history).
- :mod:`.rope` -- RoPE of rebuilt keys in place, one launch
  (:func:`~vllm_lowrank.kernels.triton.rope.rotate_keys`).
- :mod:`.cache_write` -- quantize-on-write of packed latents into the paged
  cache, every token and quantization group of a step in one launch
  (:func:`~vllm_lowrank.kernels.triton.cache_write.write_packed_latents`).
- :mod:`.schedule` -- longest-processing-time-first work lists for the persistent
  decode grid (ZACK sec. 5.3), built on the GPU.

Never import this directory as a top-level ``triton_kernels`` package: vLLM
imports OpenAI's package of that name. CPU tests run the kernels under
``TRITON_INTERPRET=1``; benchmarks/decode_attention.py measures them on a GPU.
"""
