"""Latent attention: the layer, the vLLM backend and the CPU torch path."""

BACKEND_NAME = "LOWRANK_LATENT"
"""Name of the latent attention backend in vLLM's ``AttentionBackendEnum``."""
BACKEND_PATH = "vllm_lowrank.attention.backend.LatentAttentionBackend"
