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
RAW_BITS = 16
"""A side stored at 16 bits is kept as raw float16 values (no scale/zero)."""


def packed_bytes(width: int, bits: int) -> int:
    """Bytes of one packed row of ``width`` codes (``bits=16``: raw float16).

    Raises:
        ValueError: unsupported ``bits`` or ``width`` not a multiple of 8.
    """
    if bits == RAW_BITS:
        return 2 * width
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not in {SUPPORTED_BITS + (RAW_BITS,)}")
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


def hadamard_rotation(width: int, seed: int = 0) -> torch.Tensor:
    """Randomised block Walsh-Hadamard rotation ``R`` (``[width, width]``, float32,
    orthogonal), for folding into factors (Palu eq. 8: ``A R``, ``R^T B``).

    For a power-of-two width, ``R = D H / sqrt(width)`` with ``H`` the Sylvester
    Hadamard matrix and ``D`` a random +-1 diagonal (seeded). Other widths (our
    ranks are multiples of 8) use a block-diagonal ``R`` whose blocks are such
    rotations of the largest power of two dividing ``width``: each block mixes
    its channels fully, and every block has the same size, so no channel is
    left unrotated.
    """
    block = width & -width  # largest power of two dividing width
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (width,), generator=g, dtype=torch.float64) * 2 - 1
    r = torch.block_diag(*([h / block**0.5] * (width // block)))
    return (signs[:, None] * r).float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int) -> torch.Tensor:
    """``codes * scale + zero`` per channel group, float32 ``[..., width]``."""
    c = codes.float().reshape(*codes.shape[:-1], -1, group)
    out = c * scale.float()[..., None] + zero.float()[..., None]
    return out.reshape(codes.shape)


class SlotLayout:
    """Byte layout of one token's slot in a quantized latent cache.

    A slot (one vLLM head slot, ``slot_bytes`` uint8) holds, in order::

        [ K codes | V codes | K scales | K zeros | V scales | V zeros ]

    - K codes: for each head group ``g`` in order, its ``k_ranks[g]`` codes
      packed at ``k_bits`` (:func:`pack`); V codes likewise at ``v_bits``.
    - Scales and zeros: float16, one pair per quantization group; a head group
      of rank ``r`` has ``r // q`` quantization groups of ``q`` channels, where
      ``q = k_group or r`` (``None``: one pair per head group per token, Palu's
      per-token quantization). Groups of all head groups are concatenated in
      head-group order.

    Args:
        k_ranks, v_ranks: Latent width per head group.
        k_bits, v_bits: Code widths (:data:`SUPPORTED_BITS`, or 16 for raw
            float16 values without scale/zero).
        k_group, v_group: Channels per scale/zero pair (``None`` = whole head
            group); must divide every rank of its side.

    Raises:
        ValueError: unsupported bits or a group that does not divide a rank.
    """

    def __init__(self, k_ranks, v_ranks, k_bits: int, v_bits: int,
                 k_group: int | None = None, v_group: int | None = None) -> None:
        self.k_ranks, self.v_ranks = tuple(k_ranks), tuple(v_ranks)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.k_groups = self._groups(self.k_ranks, k_group)
        self.v_groups = self._groups(self.v_ranks, v_group)
        self.k_codes_bytes = sum(packed_bytes(r, k_bits) for r in self.k_ranks)
        self.v_codes_bytes = sum(packed_bytes(r, v_bits) for r in self.v_ranks)
        self.k_params = 0 if k_bits == RAW_BITS else sum(
            r // q for r, q in zip(self.k_ranks, self.k_groups))
        self.v_params = 0 if v_bits == RAW_BITS else sum(
            r // q for r, q in zip(self.v_ranks, self.v_groups))
        # Byte offsets of the six regions.
        self.v_codes_offset = self.k_codes_bytes
        self.k_scale_offset = self.k_codes_bytes + self.v_codes_bytes
        self.k_zero_offset = self.k_scale_offset + 2 * self.k_params
        self.v_scale_offset = self.k_zero_offset + 2 * self.k_params
        self.v_zero_offset = self.v_scale_offset + 2 * self.v_params
        self.slot_bytes = self.v_zero_offset + 2 * self.v_params

    @staticmethod
    def _groups(ranks, group):
        out = []
        for r in ranks:
            q = group or r
            if r % q:
                raise ValueError(f"quantization group {q} does not divide rank {r}")
            out.append(q)
        return tuple(out)

    def _side(self, x, ranks, groups, bits):
        if bits == RAW_BITS:
            empty = x.new_zeros(*x.shape[:-1], 0, dtype=torch.float16)
            return x.to(torch.float16).contiguous().view(torch.uint8), empty, empty
        codes, params_s, params_z, off = [], [], [], 0
        for r, q in zip(ranks, groups):
            c, s, z = quantize(x[..., off:off + r], bits, q)
            codes.append(pack(c, bits))
            params_s.append(s)
            params_z.append(z)
            off += r
        return (torch.cat(codes, -1), torch.cat(params_s, -1), torch.cat(params_z, -1))

    def encode(self, k_latent: torch.Tensor, v_latent: torch.Tensor) -> torch.Tensor:
        """Quantize and pack ``[T, Rk]``, ``[T, Rv]`` latents into ``[T, slot_bytes]`` uint8."""
        kc, ks, kz = self._side(k_latent, self.k_ranks, self.k_groups, self.k_bits)
        vc, vs, vz = self._side(v_latent, self.v_ranks, self.v_groups, self.v_bits)
        as_bytes = [t.contiguous().view(torch.uint8) for t in (ks, kz, vs, vz)]
        return torch.cat([kc, vc, *as_bytes], dim=-1)

    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode` up to quantization: ``[..., slot_bytes]``
        uint8 -> (``[..., Rk]``, ``[..., Rv]``) float32."""
        def side(codes_off, ranks, groups, bits, s_off, z_off, n_params):
            if bits == RAW_BITS:
                nb = 2 * sum(ranks)
                return slots[..., codes_off:codes_off + nb].contiguous().view(
                    torch.float16).float()
            scale = slots[..., s_off:s_off + 2 * n_params].contiguous().view(torch.float16)
            zero = slots[..., z_off:z_off + 2 * n_params].contiguous().view(torch.float16)
            parts, byte, p = [], codes_off, 0
            for r, q in zip(ranks, groups):
                nb = packed_bytes(r, bits)
                c = unpack(slots[..., byte:byte + nb], bits, r)
                parts.append(dequantize(c, scale[..., p:p + r // q], zero[..., p:p + r // q], q))
                byte += nb
                p += r // q
            return torch.cat(parts, -1)

        k = side(0, self.k_ranks, self.k_groups, self.k_bits, self.k_scale_offset,
                 self.k_zero_offset, self.k_params)
        v = side(self.v_codes_offset, self.v_ranks, self.v_groups, self.v_bits,
                 self.v_scale_offset, self.v_zero_offset, self.v_params)
        return k, v
