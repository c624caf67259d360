"""CUDA sources of vllm-lowrank (installed as ``vllm_lowrank.csrc``, package
data, so that :mod:`vllm_lowrank.cuda_ext` builds them from a wheel as from a
source checkout)."""
