"""GPU kernels of vllm-lowrank: :mod:`.triton` (Triton, every decode and prefill
kernel but one) and :mod:`.cuda` (the CUDA C++ pre-RoPE decode kernel, built on
first use). Nothing here is imported at package import time; the attention
layer reaches the kernels through :mod:`vllm_lowrank.attention.decoders`."""
