r"""RoPE of rebuilt keys, in place, in one launch (the GPU prefill's latent history).

:meth:`vllm_lowrank.attention.rope.RopeTable.rotate_` on a CUDA tensor runs
:func:`rotate_keys`: each program takes ``BLOCK_T`` rows (tokens) and every
head of them, reads the float32 ``cos``/``sin`` rows of their positions once,
and turns each pair ``(x_1, x_2)`` of the rotary dims into ``(x_1 c - x_2 s,
x_2 c + x_1 s)`` (Su et al. 2021, RoFormer, eq. 34) in float32, rounded once
to the keys' dtype; dims past ``rotary_dim`` are left alone. Pairs are
``(j, j + rotary_dim / 2)`` (neox) or ``(2j, 2j + 1)`` (gptj). The torch
path it replaces took some ten kernels per call (the table gathers and
concatenations, the rotate-half copy, a multiply and an ``addcmul``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_prep import pow2


@triton.jit
def _rope_kernel(x_ptr, s_xt, s_xh, pos_ptr, seq, cos_ptr, sin_ptr, s_rope, rows, num_heads,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, NEOX: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < rows
    pos = tl.load(pos_ptr + t % seq, mask=tm, other=0).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    m = tm[:, None] & (j[None, :] < HALF)
    c = tl.load(cos_ptr + pos[:, None] * s_rope + j[None, :], mask=m, other=1.0)
    s = tl.load(sin_ptr + pos[:, None] * s_rope + j[None, :], mask=m, other=0.0)
    if NEOX:
        i1 = j
        i2 = j + HALF
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    row = x_ptr + t.to(tl.int64)[:, None] * s_xt
    for h in range(num_heads):
        p1 = row + h * s_xh + i1[None, :]
        p2 = row + h * s_xh + i2[None, :]
        x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=m)
        tl.store(p2, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=m)


def rotate_keys(keys: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, rotary_dim: int, neox: bool) -> torch.Tensor:
    """RoPE of ``keys`` in place; returns ``keys``.

    Args:
        keys: ``[B, L, G, head_dim]`` (any float dtype; the last two dims
            contiguous, ``B`` and ``L`` flattenable into one row stride).
        positions: ``[L]`` integer positions (the same for every ``b``).
        cos, sin: ``[max_positions, rotary_dim / 2]`` float32 tables, on the
            keys' device, rows contiguous.
        rotary_dim: Leading dims of each head that are rotated (even).
        neox: Half-split pairs (True) or interleaved pairs (False).

    Raises:
        ValueError: a layout the kernel does not address (strides), or tables
            of another width.
    """
    b, length, g, d = keys.shape
    rows = b * length
    if rows == 0:
        return keys
    if keys.stride(-1) != 1 or keys.stride(-2) != d or (b > 1 and keys.stride(0) !=
                                                          length * keys.stride(1)):
        raise ValueError(f"keys need contiguous heads and flattenable rows, got strides "
                         f"{keys.stride()}")
    if cos.shape[-1] != rotary_dim // 2 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin tables [P, {rotary_dim // 2}] with contiguous rows expected, "
                         f"got {tuple(cos.shape)}")
    half = rotary_dim // 2
    block_t = 16
    _rope_kernel[(triton.cdiv(rows, block_t),)](
        keys, keys.stride(1), keys.stride(2), positions, length, cos, sin, cos.stride(0),
        rows, g, HALF=half, HALF_PAD=pow2(half), NEOX=neox, BLOCK_T=block_t, num_warps=4)
    return keys
