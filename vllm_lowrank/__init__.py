"""vllm-lowrank: a latent (low-rank) KV cache for vLLM.

``vllm serve MODEL --kv-compression lowrank`` factorizes each layer's key and
value projections at load time, caches the rank-r latent per token in vLLM's
paged blocks and computes attention from the latents.
"""

__version__ = "0.1.0"
