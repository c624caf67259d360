"""Latent attention: the layer, the vLLM backend and the CPU torch path."""
