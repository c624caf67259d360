"""Triton kernels of vllm-lowrank (installed as ``vllm_lowrank.triton_kernels``)."""
