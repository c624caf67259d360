"""Triton kernels of vllm-lowrank.

- :mod:`.decode` -- the host side of the latent decode kernels:
  :class:`~vllm_lowrank.kernels.triton.decode.LatentLaunch`, a layer's decode
  prepared once (kernel choice, launch parameters, group tables, packed key
  weights), then per call the context split, the launch and the split reduce;
  the kernels: :mod:`.decode_kernels` (the grid kernel: pre-RoPE key rebuild
  with RoPE in registers, or post-RoPE latent scores; bf16/fp16/fp32 or packed
  low-bit caches; uneven ranks per head group), :mod:`.decode_wide` (head groups
  whose key up-projection does not fit one program), :mod:`.decode_packed`
  (post-RoPE latents packed per token: codes in the dots),
  :mod:`.decode_latent_rope` (key bases that commute with RoPE: queries
  absorbed, no key rebuild); :mod:`.decode_prep` the per-plan tables.
- :mod:`.decode_exact` -- the exact part of a token-adaptive decode step and
  its merge with the latent part.
- :mod:`.decode_post_rope` -- token-adaptive decode of post-RoPE keys and value
  latents in one kernel.
- :mod:`.launch` -- launch parameters: per-case defaults (measured sweeps), the
  split wave model, when a group needs the wide kernel.
- :mod:`.tiles` -- device helpers shared by the decode kernels: packed latent
  loads, key transforms, the split-K reduce.
- :mod:`.prefill` -- varlen causal prefill of every chunk of a step in one launch
  (:func:`~vllm_lowrank.kernels.triton.prefill.latent_prefill_attention`: rebuilt
  keys, value latents or rebuilt values, bottom-right causal mask, sliding
  windows, a prefix source every query sees: the token-adaptive history).
- :mod:`.rope` -- RoPE of rebuilt keys in place, one launch
  (:func:`~vllm_lowrank.kernels.triton.rope.rotate_keys`).
- :mod:`.cache_write` -- quantize-on-write of packed latents into the paged
  cache, every token and quantization group of a step in one launch
  (:func:`~vllm_lowrank.kernels.triton.cache_write.write_packed_latents`).

CPU tests run the kernels under ``TRITON_INTERPRET=1``;
``benchmarks/decode_attention.py`` measures the decoders on a GPU.
"""
