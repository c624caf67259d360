"""The ``8x`` preset's measured allocation, scaled to the Llama-3-8B attention
shape, for the GPU benchmarks (the GPU machine has no calibration text, so it
cannot allocate; these are the ranks and bits it would serve).

No imports beyond the standard library: ``decode_attention.py`` (kernel timings)
and ``gpu_serving.py`` (inside vLLM) both load it.
"""

from __future__ import annotations

ALLOC_8X_SMOLLM2 = (
    (32, 32, 4, 8), (16, 88, 3, 4), (32, 96, 3, 3), (8, 88, 4, 4), (16, 88, 3, 4),
    (16, 88, 3, 4), (16, 88, 3, 4), (24, 72, 4, 4), (32, 72, 3, 4), (32, 72, 3, 4),
    (32, 96, 3, 3), (32, 96, 3, 3), (32, 96, 3, 3), (32, 96, 3, 3), (40, 64, 4, 3),
    (40, 64, 4, 3), (32, 80, 4, 3), (40, 64, 4, 3), (48, 48, 4, 3), (40, 64, 4, 3),
    (40, 64, 4, 3), (48, 48, 4, 3), (40, 64, 4, 3), (32, 80, 4, 3), (40, 64, 4, 3),
    (64, 48, 3, 3), (48, 88, 4, 2), (32, 96, 3, 3), (40, 64, 4, 3), (40, 64, 4, 3))
"""The ``8x`` preset's allocation on SmolLM2-135M-Instruct (what it allocates on
first start from the default ``fisher`` artifact, block size 32; manifest
``ranks.layers`` / ``ranks.bits``): per layer ``(key rank, value rank, key bits,
value bits)`` of its one head group of 3 KV heads x 64 channels (192 per side)."""

SMOLLM2_WIDTH = 192
"""K (or V) channels per layer of SmolLM2-135M: 3 KV heads x 64."""


def scale_rank(rank: int, width: int, multiple: int = 8) -> int:
    """A SmolLM2 latent width scaled to a layer of ``width`` K (or V) channels,
    in multiples of ``multiple`` (at least one)."""
    return max(multiple, multiple * round(rank * width / SMOLLM2_WIDTH / multiple))


def alloc_8x_ranks(num_layers: int, width: int, tp: int = 1) -> dict[str, list[int]]:
    """``ranks`` config override (``{"layer": [r_k, r_v]}``) of the ``8x``
    allocation stretched over ``num_layers`` layers of ``width`` channels per
    side: layer ``i`` takes SmolLM2's layer ``i * 30 // num_layers``. In
    multiples of ``8 * tp``: each of ``tp`` tensor-parallel ranks caches its
    share, and packed latents need multiples of 8 (a share of 84 is refused)."""
    n = len(ALLOC_8X_SMOLLM2)
    out = {}
    for i in range(num_layers):
        kr, vr, _, _ = ALLOC_8X_SMOLLM2[i * n // num_layers]
        out[str(i)] = [scale_rank(kr, width, 8 * tp), scale_rank(vr, width, 8 * tp)]
    return out
