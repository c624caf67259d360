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

- Per-channel keys (KIVI, Liu et al. 2024, sec. 3.2; ``k_channel_tokens``):
  the key latents of ``G`` consecutive tokens (an aligned run of positions
  inside one KV block) share one ``scale``/``zero`` per channel, computed
  over those ``G`` tokens (:func:`quantize_channels`). The ``4 * Rk`` bytes of
  a group's parameters are spread over its ``G`` slots (each slot carries a
  share of ``ceil(4 * Rk / G)`` bytes), so vLLM's per-token page layout holds
  them without a separate per-block buffer.

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
    if bits == 8:
        return codes.to(torch.uint8)
    c = codes.to(torch.int32)
    lead = c.shape[:-1]
    # 8 codes -> `bits` bytes: build a 8*bits-bit integer per octet of codes.
    octets = c.reshape(*lead, c.shape[-1] // 8, 8)  # explicit: lead may hold a 0
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (octets.to(torch.int64) << shifts).sum(-1)  # [..., n_oct] < 2^(8*bits)
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = (word[..., None] >> byte_shifts) & 0xFF  # [..., n_oct, bits]
    return out.reshape(*lead, codes.shape[-1] * bits // 8).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., width * bits / 8]`` uint8 -> ``[..., width]``
    int32 codes."""
    nbytes = packed_bytes(width, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} packed bytes, got {packed.shape[-1]}")
    if bits == 8:
        return packed.to(torch.int32)
    lead = packed.shape[:-1]
    b = packed.to(torch.int64).reshape(*lead, nbytes // bits, bits)
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
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
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


def quantize_segments(x: torch.Tensor, bits: int, sizes, index: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` over consecutive channel groups of uneven ``sizes``, in
    one pass (no loop over groups): the same codes, scales and zeros as
    quantizing each group on its own.

    Args:
        x: ``[T, sum(sizes)]`` float latents.
        bits: Code width.
        sizes: Channels of each group, in order.
        index: ``[sum(sizes)]`` int64 group of each channel on ``x``'s device
            (``None``: built here; pass a cached one where the call is captured
            in a CUDA graph, which cannot copy from the host).

    Returns:
        ``(codes [T, width] int32, scale [T, len(sizes)] float16, zero [T,
        len(sizes)] float16)``.
    """
    sizes = tuple(sizes)
    if len(set(sizes)) == 1:
        return quantize(x, bits, sizes[0])
    if index is None:
        index = segment_index(sizes, x.device)
    levels = (1 << bits) - 1
    xf = x.float()
    idx = index.expand(xf.shape[0], -1)
    lo = xf.new_full((xf.shape[0], len(sizes)), float("inf")).scatter_reduce(
        -1, idx, xf, "amin")
    hi = xf.new_full((xf.shape[0], len(sizes)), float("-inf")).scatter_reduce(
        -1, idx, xf, "amax")
    scale = ((hi - lo) / levels).to(torch.float16)
    zero = lo.to(torch.float16)
    s = scale.float()[:, index]
    z = zero.float()[:, index]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round((xf - z) / safe), torch.zeros_like(xf))
    return codes.clamp(0, levels).to(torch.int32), scale, zero


def segment_index(sizes, device) -> torch.Tensor:
    """``[sum(sizes)]`` int64: the group of each channel (:func:`quantize_segments`)."""
    sizes = torch.tensor(tuple(sizes))
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)


def quantize_channels(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel asymmetric quantization over a group of tokens (KIVI's key
    quantization, Liu et al. 2024, sec. 3.2).

    Args:
        x: ``[..., G, width]`` float latents of ``G`` tokens.
        bits: Code width.

    Returns:
        ``(codes [..., G, width] int32, scale [..., width] float16,
        zero [..., width] float16)``: ``scale = (max - min) / (2^bits - 1)``
        and ``zero = min`` over the ``G`` tokens of each channel.
    """
    t = x.float().transpose(-1, -2)  # [..., width, G]: a channel is a "group"
    codes, scale, zero = quantize(t, bits, t.shape[-1])
    return codes.transpose(-1, -2), scale[..., 0], zero[..., 0]


def latent_rotation(width: int, layer: int, group: int, side: str) -> torch.Tensor:
    """The :func:`hadamard_rotation` folded into head group ``group``'s ``side``
    (``"k"`` or ``"v"``) latent of layer ``layer`` (seed ``1000 layer + 10 group
    + [side == "v"]``): the one rule shared by the weight folding and the
    byte-budget allocator, which must see the same rotation."""
    return hadamard_rotation(width, seed=layer * 1000 + 10 * group + (side == "v"))


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
    c = codes.float().reshape(*codes.shape[:-1], codes.shape[-1] // group, group)
    out = c * scale.float()[..., None] + zero.float()[..., None]
    return out.reshape(codes.shape)


def dequantize_segments(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, sizes,
                        index: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_segments`: ``codes [..., sum(sizes)]`` with one
    ``scale``/``zero`` ``[..., len(sizes)]`` per consecutive group of ``sizes``
    channels -> float32 ``[..., sum(sizes)]``, in one pass (``index``: as for
    :func:`quantize_segments`; ``None`` with uneven sizes builds it here)."""
    sizes = tuple(sizes)
    if len(set(sizes)) == 1:
        return dequantize(codes, scale, zero, sizes[0])
    if index is None:
        index = segment_index(sizes, codes.device)
    return codes.float() * scale.float()[..., index] + zero.float()[..., index]


def page_padding(natural_bytes, one_page: bool) -> int | None:
    """Slot size that gives every layer of a model one page size, or ``None``.

    Where vLLM needs one page size for all layers (the token-adaptive mode and
    hybrid models), layers whose natural slot sizes differ (different K/V
    splits once K and V are stored differently, per-channel key shares, or
    bits per layer) are padded to the largest, rounded up to 4 bytes. Layers
    in one cache group of per-layer sizes (``one_page`` false) are left alone.

    Args:
        natural_bytes: Unpadded :attr:`SlotLayout.slot_bytes` of each layer.
        one_page: vLLM needs one page size.
    """
    sizes = set(natural_bytes)
    if one_page and len(sizes) > 1:
        return -(-max(sizes) // 4) * 4
    return None


class SlotLayout:
    """Byte layout of one token's slot in a quantized latent cache.

    A slot (one vLLM head slot, ``slot_bytes`` uint8) holds, in order::

        [ K codes | V codes | K scales | K zeros | V scales | V zeros | K share ]

    - K codes: for each head group ``g`` in order, its ``k_ranks[g]`` codes
      packed at ``k_bits`` (:func:`pack`); V codes likewise at ``v_bits``.
    - Scales and zeros: float16, one pair per quantization group; a head group
      of rank ``r`` has ``r // q`` quantization groups of ``q`` channels, where
      ``q = k_group or r`` (``None``: one pair per head group per token, Palu's
      per-token quantization). Groups of all head groups are concatenated in
      head-group order.
    - With per-channel keys (``k_channel_tokens = G``) the K scales and zeros
      are not per token: the ``G`` slots of an aligned group of positions
      together hold ``[K scales (Rk) | K zeros (Rk)]`` float16, slot ``i`` of
      the group bytes ``[i * share, (i + 1) * share)`` in its "K share"
      region (``share = ceil(4 * Rk / G)``). They are written once the group is
      complete (:meth:`encode_key_groups`); :meth:`encode` leaves the K codes
      and share of a token zero.

    Args:
        k_ranks, v_ranks: Latent width per head group.
        k_bits, v_bits: Code widths (:data:`SUPPORTED_BITS`, or 16 for raw
            float16 values without scale/zero).
        k_group, v_group: Channels per scale/zero pair (``None`` = whole head
            group); must divide every rank of its side.
        k_channel_tokens: ``G``: quantize keys per channel over aligned
            groups of ``G`` tokens instead of per token (``None``: per token).
        pad_to: Total slot bytes, zero padding at the end (``None``: none).
            Layers of one vLLM cache group with equal latent widths but
            different K/V splits get different natural sizes once K and V are
            stored differently; padding gives them one page size.

    Raises:
        ValueError: unsupported bits, a group that does not divide a rank, or
            per-channel keys stored at 16 bits.
    """

    def __init__(self, k_ranks, v_ranks, k_bits: int, v_bits: int,
                 k_group: int | None = None, v_group: int | None = None,
                 k_channel_tokens: int | None = None, pad_to: int | None = None) -> None:
        self.k_ranks, self.v_ranks = tuple(k_ranks), tuple(v_ranks)
        self.k_bits, self.v_bits = k_bits, v_bits
        if k_channel_tokens is not None and (k_bits == RAW_BITS or k_channel_tokens < 1):
            raise ValueError("per-channel keys need k_bits < 16 and k_channel_tokens >= 1")
        self.k_channel_tokens = k_channel_tokens
        self.k_groups = self._groups(self.k_ranks, k_group)
        self.v_groups = self._groups(self.v_ranks, v_group)
        self.k_codes_bytes = sum(packed_bytes(r, k_bits) for r in self.k_ranks)
        self.v_codes_bytes = sum(packed_bytes(r, v_bits) for r in self.v_ranks)
        self.k_params = 0 if k_bits == RAW_BITS or k_channel_tokens else sum(
            r // q for r, q in zip(self.k_ranks, self.k_groups))
        self.v_params = 0 if v_bits == RAW_BITS else sum(
            r // q for r, q in zip(self.v_ranks, self.v_groups))
        # Byte offsets of the six regions.
        self.v_codes_offset = self.k_codes_bytes
        self.k_scale_offset = self.k_codes_bytes + self.v_codes_bytes
        self.k_zero_offset = self.k_scale_offset + 2 * self.k_params
        self.v_scale_offset = self.k_zero_offset + 2 * self.k_params
        self.v_zero_offset = self.v_scale_offset + 2 * self.v_params
        self.k_share_offset = self.v_zero_offset + 2 * self.v_params
        rk = sum(self.k_ranks)
        self.k_share_bytes = -(-4 * rk // k_channel_tokens) if k_channel_tokens else 0
        self.natural_bytes = self.k_share_offset + self.k_share_bytes
        self.slot_bytes = max(self.natural_bytes, pad_to or 0)
        self._index: dict = {}  # (quantization group sizes, device) -> segment_index

    @property
    def k_per_channel(self) -> bool:
        """True when keys are quantized per channel over token groups."""
        return self.k_channel_tokens is not None

    @staticmethod
    def _groups(ranks, group):
        out = []
        for r in ranks:
            q = group or r
            if r % q:
                raise ValueError(f"quantization group {q} does not divide rank {r}")
            out.append(q)
        return tuple(out)

    def _segment_index(self, sizes: tuple[int, ...], device) -> torch.Tensor | None:
        """:func:`segment_index` of ``sizes`` on ``device``, made once per layout
        (a call captured in a CUDA graph cannot copy it from the host); ``None``
        for equal sizes, which need none."""
        if len(set(sizes)) == 1:
            return None
        key = (sizes, device)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = segment_index(sizes, device)
        return index

    def quant_group_sizes(self, side: str) -> tuple[int, ...]:
        """Channels of each per-token quantization group of ``side`` (``"k"`` or
        ``"v"``), in slot order: every head group's ``rank / group`` groups in
        turn (one scale/zero pair each)."""
        ranks, groups = ((self.k_ranks, self.k_groups) if side == "k"
                         else (self.v_ranks, self.v_groups))
        return tuple(q for r, q in zip(ranks, groups) for _ in range(r // q))

    def _side(self, x, side, bits):
        if bits == RAW_BITS:
            empty = x.new_zeros(*x.shape[:-1], 0, dtype=torch.float16)
            return x.to(torch.float16).contiguous().view(torch.uint8), empty, empty
        # One pass over the row (ranks are multiples of 8, so the packed groups
        # are consecutive bytes).
        sizes = self.quant_group_sizes(side)
        lead = x.shape[:-1]
        c, s, z = quantize_segments(x.reshape(-1, x.shape[-1]), bits, sizes,
                                    self._segment_index(sizes, x.device))
        return (pack(c, bits).reshape(*lead, -1), s.reshape(*lead, -1), z.reshape(*lead, -1))

    def encode(self, k_latent: torch.Tensor, v_latent: torch.Tensor) -> torch.Tensor:
        """Quantize and pack ``[T, Rk]``, ``[T, Rv]`` latents into ``[T, slot_bytes]``
        uint8 (per-channel keys: K codes and share left zero, see
        :meth:`encode_key_groups`)."""
        vc, vs, vz = self._side(v_latent, "v", self.v_bits)
        if self.k_per_channel:
            kc = vc.new_zeros(*vc.shape[:-1], self.k_codes_bytes)
            ks = kz = vs.new_zeros(*vs.shape[:-1], 0)
        else:
            kc, ks, kz = self._side(k_latent, "k", self.k_bits)
        as_bytes = [t.contiguous().view(torch.uint8) for t in (ks, kz, vs, vz)]
        tail = vc.new_zeros(*vc.shape[:-1], self.slot_bytes - self.k_share_offset)
        return torch.cat([kc, vc, *as_bytes, tail], dim=-1)  # K share and padding

    def encode_complete(self, k_latent: torch.Tensor, v_latent: torch.Tensor) -> torch.Tensor:
        """:meth:`encode` of ``[T, Rk]``, ``[T, Rv]`` latents at positions ``0 ..
        T - 1`` with every per-channel key group complete: the K codes and shares
        are filled as :meth:`encode_key_groups` writes them (what a cache holds
        once its groups are complete).

        Raises:
            ValueError: per-channel keys and ``T`` not a multiple of
                ``k_channel_tokens``.
        """
        slots = self.encode(k_latent, v_latent)
        if not self.k_per_channel:
            return slots
        g = self.k_channel_tokens
        if k_latent.shape[0] % g:
            raise ValueError(f"{k_latent.shape[0]} rows are not whole groups of {g} tokens")
        codes, share = self.encode_key_groups(k_latent.reshape(-1, g, k_latent.shape[-1]))
        groups = slots.view(-1, g, slots.shape[-1])
        groups[..., :self.k_codes_bytes] = codes
        groups[..., self.k_share_offset:self.natural_bytes] = share
        return slots

    def encode_key_groups(self, k_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel keys of complete token groups.

        Args:
            k_latent: ``[N, G, Rk]`` key latents of ``N`` groups of ``G =
                k_channel_tokens`` consecutive positions.

        Returns:
            ``(codes [N, G, k_codes_bytes], share [N, G, k_share_bytes])``
            uint8: the bytes of the K codes region and of the K share region of
            each of the group's slots.
        """
        n, g, rk = k_latent.shape
        codes, scale, zero = quantize_channels(k_latent, self.k_bits)
        packed = pack(codes, self.k_bits)  # head groups are consecutive channels
        params = torch.cat((scale, zero), dim=-1).contiguous().view(torch.uint8)  # [N, 4 Rk]
        params = torch.nn.functional.pad(params, (0, g * self.k_share_bytes - 4 * rk))
        return packed, params.view(n, g, self.k_share_bytes)

    def decode(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode` (and :meth:`encode_key_groups`) up to
        quantization: ``[..., slot_bytes]`` uint8 -> (``[..., Rk]``, ``[..., Rv]``)
        float32. With per-channel keys ``slots`` is ``[..., L, slot_bytes]``
        with ``L`` a multiple of ``G`` starting at a group boundary."""
        if slots.numel() == 0:  # e.g. a decode batch with no latent span
            lead = slots.shape[:-1]
            return (slots.new_zeros(*lead, sum(self.k_ranks), dtype=torch.float32),
                    slots.new_zeros(*lead, sum(self.v_ranks), dtype=torch.float32))
        def side(name, codes_off, width, bits, s_off, z_off, n_params):
            if bits == RAW_BITS:
                return slots[..., codes_off:codes_off + 2 * width].contiguous().view(
                    torch.float16).float()
            scale = slots[..., s_off:s_off + 2 * n_params].contiguous().view(torch.float16)
            zero = slots[..., z_off:z_off + 2 * n_params].contiguous().view(torch.float16)
            # One pass over the side (ranks are multiples of 8, so the head groups'
            # packed codes are consecutive bytes), whatever the number of groups.
            codes = unpack(slots[..., codes_off:codes_off + packed_bytes(width, bits)], bits,
                           width)
            sizes = self.quant_group_sizes(name)
            return dequantize_segments(codes, scale, zero, sizes,
                                       self._segment_index(sizes, slots.device))

        if self.k_per_channel:
            k = self._decode_key_groups(slots)
        else:
            k = side("k", 0, sum(self.k_ranks), self.k_bits, self.k_scale_offset,
                     self.k_zero_offset, self.k_params)
        v = side("v", self.v_codes_offset, sum(self.v_ranks), self.v_bits, self.v_scale_offset,
                 self.v_zero_offset, self.v_params)
        return k, v

    def _decode_key_groups(self, slots: torch.Tensor) -> torch.Tensor:
        """Per-channel keys of ``slots [..., L, slot_bytes]`` (whole groups)."""
        g, rk = self.k_channel_tokens, sum(self.k_ranks)
        lead, length = slots.shape[:-2], slots.shape[-2]
        if length % g:
            raise ValueError(f"{length} slots are not whole groups of {g} tokens")
        groups = slots.reshape(*lead, length // g, g, -1)
        share = groups[..., self.k_share_offset:self.natural_bytes].reshape(
            *lead, length // g, -1)
        params = share[..., :4 * rk].contiguous().view(torch.float16).float()
        scale, zero = params[..., None, :rk], params[..., None, rk:]  # [..., n, 1, Rk]
        codes = unpack(groups[..., :self.k_codes_bytes], self.k_bits, rk)
        return (codes.float() * scale + zero).reshape(*lead, length, rk)
