"""Bit packing and per-token quantization against float64 references."""

import pytest
import torch

from vllm_lowrank.format.latent import SlotLayout, dequantize, pack, packed_bytes, quantize, unpack


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 40))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_bytes(40, bits)
    assert torch.equal(unpack(packed, bits, 40), codes.to(torch.int32))


def test_bit_order_is_little_endian():
    assert pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), 4).tolist() == [[0x21, 0x43, 0x65, 0x87]]
    # 3 bits: 8 codes -> 24-bit little-endian word
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    word = sum(int(c) << (3 * k) for k, c in enumerate(codes[0]))
    assert pack(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]


@pytest.mark.parametrize("bits,group", [(8, 16), (4, 32), (3, 8), (2, 64)])
def test_quantize_matches_float64_reference(bits, group):
    x = torch.randn(6, 64) * 3 + 1
    codes, scale, zero = quantize(x, bits, group)
    xg = x.double().view(6, -1, group)
    lo, hi = xg.amin(-1), xg.amax(-1)
    s = ((hi - lo) / (2**bits - 1)).half().double()
    z = lo.half().double()
    ref_codes = torch.round((xg - z[..., None]) / s[..., None]).clamp(0, 2**bits - 1)
    # float32 vs float64 division may differ by one code at exact .5 ties
    assert (codes.view(6, -1, group).double() - ref_codes).abs().max() <= 1
    assert (codes.view(6, -1, group).double() != ref_codes).float().mean() < 0.01
    deq = dequantize(codes, scale, zero, group).double()
    err = (deq - x.double()).view(6, -1, group).abs().amax(-1)
    assert (err <= s * 0.5 + 2e-3 * (hi - lo).abs() + 1e-3).all()


def test_constant_group_is_exact():
    x = torch.full((2, 16), 0.375)
    codes, scale, zero = quantize(x, 2, 8)
    assert torch.equal(dequantize(codes, scale, zero, 8), x)


def test_slot_layout_round_trip():
    layout = SlotLayout((32, 64), (48, 16), 4, 3, None, 16)
    k, v = torch.randn(5, 96), torch.randn(5, 64)
    slots = layout.encode(k, v)
    assert slots.shape == (5, layout.slot_bytes)
    assert layout.slot_bytes == 96 * 4 // 8 + 64 * 3 // 8 + 2 * 2 * (2 + 4)
    dk, dv = layout.decode(slots)
    ref_k = torch.cat([dequantize(*quantize(k[:, :32], 4, 32), 32),
                       dequantize(*quantize(k[:, 32:], 4, 64), 64)], -1)
    ref_v = dequantize(*quantize(v, 3, 16), 16)
    assert torch.equal(dk, ref_k) and torch.equal(dv, ref_v)


@pytest.mark.parametrize("k_ranks,k_group", [((32, 64, 32, 48), None), ((32, 32), 16),
                                             ((24, 40), 8), ((64,), None)])
def test_encode_matches_per_group_quantization(k_ranks, k_group):
    """The one-pass encode of a row of head groups gives the same bytes as
    quantizing and packing each head group on its own, and the one-pass decode
    the same values as dequantizing each on its own (uneven ranks, uneven and
    equal quantization groups)."""
    layout = SlotLayout(k_ranks, (16, 16), 4, 8, k_group, None)
    k, v = torch.randn(7, sum(k_ranks)) * 2, torch.randn(7, 32)
    slots = layout.encode(k, v)
    parts, scales, zeros, values, off = [], [], [], [], 0
    for r in k_ranks:
        c, s, z = quantize(k[:, off:off + r], 4, k_group or r)
        parts.append(pack(c, 4))
        scales.append(s)
        zeros.append(z)
        values.append(dequantize(c, s, z, k_group or r))
        off += r
    dk, dv = layout.decode(slots)
    assert torch.equal(dk, torch.cat(values, -1))
    assert torch.equal(dv, torch.cat([dequantize(*quantize(v[:, :16], 8, 16), 16),
                                      dequantize(*quantize(v[:, 16:], 8, 16), 16)], -1))
    ref_codes = torch.cat(parts, -1)
    assert torch.equal(slots[:, :layout.k_codes_bytes], ref_codes)
    ks = slots[:, layout.k_scale_offset:layout.k_zero_offset].contiguous().view(torch.float16)
    kz = slots[:, layout.k_zero_offset:layout.v_scale_offset].contiguous().view(torch.float16)
    assert torch.equal(ks, torch.cat(scales, -1)) and torch.equal(kz, torch.cat(zeros, -1))
