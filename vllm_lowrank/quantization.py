"""Low-bit latents: per-token asymmetric integer quantization and bit packing.

Format (the contract between the cache writer, the CPU path and the CUDA/Triton
kernels):

- A latent row ``x`` (one token, one side K or V) is split into groups of
  ``group`` consecutive channels. Each group stores ``scale = (max - min) /
  (2^bits - 1)`` and ``zero = min`` as float16, and codes
  ``q = clamp(round((x - zero) / scale), 0, 2^bits - 1)``; the value read back is
  ``q * scale + zero`` (Palu sec. 3.4: per-token asymmetric integer
  quantization; a constant group gets ``scale = 0`` and is exact).
- Codes are packed little-endian into a byte stream per row: code ``k``
  occupies bits ``[k * bits, (k + 1) * bits)``. For ``bits`` in ``{8, 4, 2}``
  a byte holds ``8 / bits`` codes (code ``k`` in bits ``(k % (8/bits)) * bits`` of
  byte ``k // (8/bits)``); for 3 bits, 8 codes fill 3 bytes. Row widths are
  multiples of 8 (ranks are), so rows end on a byte boundary.

All functions take and return torch tensors; ``pack``/``unpack`` are exact
inverses on codes in range.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (8, 4, 3, 2)


def packed_bytes(width: int, bits: int) -> int:
    """Bytes of one packed row of ``width`` codes.

    Raises:
        ValueError: unsupported ``bits`` or ``width`` not a multiple of 8.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not in {SUPPORTED_BITS}")
    if width % 8:
        raise ValueError(f"packed width {width} must be a multiple of 8")
    return width * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., width]`` (values ``0..2^bits-1``) into
    ``[..., width * bits / 8]`` uint8."""
    packed_bytes(codes.shape[-1], bits)
    c = codes.to(torch.int32)
    lead = c.shape[:-1]
    # 8 codes -> `bits` bytes: build a 8*bits-bit integer per octet of codes.
    octets = c.reshape(*lead, -1, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (octets.to(torch.int64) << shifts).sum(-1)  # [..., n_oct] < 2^(8*bits)
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF  # [..., n_oct, bits]
    return out.reshape(*lead, -1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., width * bits / 8]`` uint8 -> ``[..., width]``
    int32 codes."""
    nbytes = packed_bytes(width, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} packed bytes, got {packed.shape[-1]}")
    lead = packed.shape[:-1]
    b = packed.to(torch.int64).reshape(*lead, -1, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1)  # [..., n_oct]
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, width).to(torch.int32)


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token, per-channel-group asymmetric quantization.

    Args:
        x: ``[..., width]`` float latents; ``width % group == 0``.
        bits: Code width.
        group: Channels per scale/zero pair.

    Returns:
        ``(codes [..., width] int32, scale [..., width/group] float16,
        zero [..., width/group] float16)``.
    """
    if x.shape[-1] % group:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of group {group}")
    levels = (1 << bits) - 1
    g = x.float().reshape(*x.shape[:-1], -1, group)
    lo = g.amin(-1)
    hi = g.amax(-1)
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    s = scale.float()[..., None]
    z = zero.float()[..., None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round((g - z) / safe), torch.zeros_like(g))
    codes = codes.clamp(0, levels).to(torch.int32).reshape(x.shape)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int) -> torch.Tensor:
    """``codes * scale + zero`` per channel group, float32 ``[..., width]``."""
    c = codes.float().reshape(*codes.shape[:-1], -1, group)
    out = c * scale.float()[..., None] + zero.float()[..., None]
    return out.reshape(codes.shape)
