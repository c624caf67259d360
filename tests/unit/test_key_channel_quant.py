"""Per-channel key quantization over token groups (KIVI-style) in the paged cache.

Checked against float64 references: the quantizer itself; the write path
(a group of ``G`` tokens is quantized once it is complete, from key latents
staged in the exact cache, while partial groups stay unquantized there);
reads at any start/length; and token-adaptive decode over such a cache
against the float64 attention loop. Prefix-cache hits and preemption run in
vLLM engines (``tests/engine/test_token_adaptive_engine.py``).
"""

import pytest
import torch

from test_latent_attention import make_rope
from test_token_adaptive import SCALE, as_stored, make_v_up, reference
from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
from vllm_lowrank.format.latent import SlotLayout, quantize, quantize_channels

G = 8  # tokens per key group
LATENT_BLOCK, EXACT_BLOCK = 32, 16  # vLLM enlarges the latent group's blocks


def channel_reference(x, bits):
    """float64 per-channel quantize/dequantize of ``x [G, W]`` (one group),
    scale and zero rounded to float16 as stored; returns (values, step)."""
    x = x.double()
    lo, hi = x.amin(0), x.amax(0)
    step = ((hi - lo) / (2**bits - 1)).half().double()
    zero = lo.half().double()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.where(step > 0, torch.round((x - zero) / safe), torch.zeros_like(x))
    return codes.clamp(0, 2**bits - 1) * step + zero, step


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_quantize_channels_matches_float64_reference(bits):
    # seeded: unseeded, about 0.5 % of draws failed a bound below (float32
    # against float64 at .5 ties; 2,000 seeds per bit width)
    x = torch.randn(3, G, 40, generator=torch.Generator().manual_seed(bits))
    x[..., 5] *= 40  # an outlier channel gets its own scale
    codes, scale, zero = quantize_channels(x, bits)
    assert codes.shape == x.shape and scale.shape == zero.shape == (3, 40)
    for n in range(3):
        ref, step = channel_reference(x[n], bits)
        got = codes[n].double() * scale[n].double() + zero[n].double()
        # float32 vs float64 division may move a value sitting on a .5 tie
        assert ((got - ref).abs() <= step * 1.001 + 1e-12).all()
        assert ((got - ref).abs() > 1e-9).float().mean() < 0.01
        assert ((got - x[n].double()).abs() <= step * 0.5 + 2e-3 * step.max() + 1e-9).all()


def test_per_channel_beats_per_token_on_outlier_channels():
    """The reason for the mode (KIVI sec. 3): keys with fixed outlier channels."""
    x = torch.randn(64, G, 32)
    x[..., [3, 17]] *= 30
    per_channel = SlotLayout((32,), (8,), 2, 8, k_channel_tokens=G)
    codes, share = per_channel.encode_key_groups(x)
    rows = per_channel.encode(x.reshape(-1, 32), torch.zeros(64 * G, 8)).view(64, G, -1)
    rows[..., :per_channel.k_codes_bytes] = codes
    rows[..., per_channel.k_share_offset:] = share
    err_channel = (per_channel.decode(rows)[0] - x).pow(2).mean()
    per_token = SlotLayout((32,), (8,), 2, 8)
    err_token = (per_token.decode(per_token.encode(x.reshape(-1, 32), torch.zeros(64 * G, 8)))[0]
                 - x.reshape(-1, 32)).pow(2).mean()
    assert err_channel < 0.5 * err_token  # measured: about 4x lower


def make_layer(pad=0):
    shape = AttentionShape(hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=16)
    plan = LayerPlan(shape, 2, k_ranks=(8, 16), v_ranks=(16, 8))
    layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4, k_channel_tokens=G)
    if pad:  # as ModelCompression pads layers to one page size
        layout = SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4, k_channel_tokens=G,
                            pad_to=layout.slot_bytes + pad)
    return plan, layout


def test_layers_of_equal_width_get_one_slot_size():
    """Per-channel key shares depend on the key width, so layers with the same
    latent width but different K/V splits are padded to one slot size (vLLM
    needs one page size); layers of different widths are left alone."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.models.compression import ModelCompression

    shape = AttentionShape(hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=16)
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "k_bits": 4, "v_bits": 2,
                                   "token_adaptive": True, "k_quant": "channel"})
    equal = {0: LayerPlan(shape, 4, (16,), (48,)), 1: LayerPlan(shape, 4, (40,), (24,))}
    c = ModelCompression(cfg=cfg, plans=equal, artifact=None, artifact_path=None)
    natural = [SlotLayout(p.k_ranks, p.v_ranks, 4, 2, k_channel_tokens=32).slot_bytes
               for p in equal.values()]
    assert natural[0] != natural[1]
    sizes = {c.layout(i).slot_bytes for i in equal}
    assert sizes == {-(-max(natural) // 4) * 4}
    assert c.bytes_per_token(2)[1] == 2 * sizes.pop()
    unequal = {0: LayerPlan(shape, 4, (16,), (48,)), 1: LayerPlan(shape, 4, (40,), (40,))}
    c = ModelCompression(cfg=cfg, plans=unequal, artifact=None, artifact_path=None)
    assert [c.layout(i).slot_bytes for i in unequal] == [
        SlotLayout(p.k_ranks, p.v_ranks, 4, 2, k_channel_tokens=32).slot_bytes
        for p in unequal.values()]


class PagedSequence:
    """One sequence written step by step through the real write path into a
    latent cache (blocks of 32) and an exact cache (blocks of 16, slots
    ``[k | v | c_k]``), both on shuffled non-contiguous blocks."""

    def __init__(self, plan, layout, n_max, exact_bits=16):
        torch.manual_seed(0)
        kvw = plan.shape.kv_width
        self.plan, self.layout = plan, layout
        self.slot = ExactSlot(kvw, plan.shape.head_dim, torch.float32, exact_bits,
                              plan.k_width, layout.slot_bytes)
        self.lat = torch.randn(n_max, plan.k_width + plan.v_width)
        self.lat[:, 3] *= 25  # outlier key channel
        self.k_ex, self.v_ex = torch.randn(n_max, kvw), torch.randn(n_max, kvw)
        self.cache = torch.full((12, 1, LATENT_BLOCK, layout.slot_bytes), 0, dtype=torch.uint8)
        self.exact = torch.full((20, 1, EXACT_BLOCK, self.slot.slot_bytes), 0xFF,
                                dtype=torch.uint8)
        # block 0 is vLLM's null block: no request owns it
        self.table = (1 + torch.randperm(11))[: -(-n_max // LATENT_BLOCK)].to(torch.int32)
        self.exact_table = (1 + torch.randperm(19))[: -(-n_max // EXACT_BLOCK)].to(torch.int32)
        self.n = 0

    def slots(self, table, block, pos):
        return table[pos // block].long() * block + pos % block

    def step(self, count, padding=0, host_ends=False):
        """Write the next ``count`` tokens (plus ``padding`` slots of -1);
        ``host_ends``: the completed key groups given as the step's group-end
        tokens computed from host metadata (the backend's long-step path)."""
        pos = torch.arange(self.n, self.n + count)
        pad = torch.full((padding,), -1, dtype=torch.long)
        lat_slots = torch.cat((self.slots(self.table, LATENT_BLOCK, pos), pad))
        ex_slots = torch.cat((self.slots(self.exact_table, EXACT_BLOCK, pos), pad))
        rk = self.plan.k_width
        lat = torch.cat((self.lat[pos], torch.randn(padding, self.lat.shape[1])))
        k_ex = torch.cat((self.k_ex[pos], torch.randn(padding, self.k_ex.shape[1])))
        v_ex = torch.cat((self.v_ex[pos], torch.randn(padding, self.v_ex.shape[1])))
        # the backend's order (LatentAttentionImpl.do_kv_cache_update)
        ops.write_latents(self.cache, lat[:, :rk], lat[:, rk:], lat_slots, self.layout)
        tale.write_exact(self.exact, self.slot, k_ex, v_ex, ex_slots, staged=lat[:, :rk])
        ends = None
        if host_ends:
            ends = tale.key_group_ends(torch.tensor([0, count]), torch.tensor([self.n + count]),
                                       self.layout.k_channel_tokens, "cpu")
        tale.write_key_groups(self.cache, self.exact, self.slot, lat_slots, ex_slots,
                              self.layout, ends)
        self.n += count

    def reference_latents(self, n):
        """float64 latents of positions ``< n`` (whole groups) as stored."""
        rk = self.plan.k_width
        k = torch.cat([channel_reference(self.lat[s:s + G, :rk], 4)[0] for s in range(0, n, G)])
        v = []
        for off, r in zip(self.plan.v_offsets(), self.plan.v_ranks):
            x = self.lat[:n, rk + off:rk + off + r]
            c, sc, z = quantize(x, 4, r)
            v.append(c.double() * sc.double() + z.double())
        return torch.cat([k] + v, dim=-1)


@pytest.mark.parametrize("path", ["graph-safe", "host sync", "host ends"])
@pytest.mark.parametrize("pad", [0, 6])
def test_groups_are_quantized_once_complete_and_read_back(pad, path, monkeypatch):
    """The three write paths: without a host sync (every step here is short),
    and the long-step (prefill) path, forced by a zero token limit, with the
    completed groups found by a host sync or given as the step's group-end
    tokens (:func:`token_adaptive.key_group_ends`)."""
    if path != "graph-safe":
        monkeypatch.setattr(tale, "GRAPH_SAFE_TOKENS", 0)
    plan, layout = make_layer(pad)
    seq = PagedSequence(plan, layout, 96)
    rk = plan.k_width
    for count, padding in [(5, 2), (1, 0), (1, 0), (13, 3), (7, 0), (1, 1), (20, 0), (1, 0),
                           (30, 0), (3, 0)]:
        seq.step(count, padding, host_ends=path == "host ends")
        n, complete = seq.n, seq.n // G * G
        if complete:
            got = ops.gather_latents(seq.cache, seq.table[None], complete, layout)[0].double()
            ref = seq.reference_latents(complete)
            assert torch.allclose(got[:, :rk], ref[:, :rk], atol=1e-5, rtol=0), n
            assert torch.allclose(got[:, rk:], ref[:, rk:], atol=1e-4, rtol=0), n
            # an unaligned read returns the same rows
            part = ops.gather_latents(seq.cache, seq.table[None], complete - 3, layout,
                                      start=3)[0].double()
            assert torch.equal(part, got[3:complete - 3])
        # an empty read (every sequence of a decode batch too short for latents)
        for lay in (layout, SlotLayout(plan.k_ranks, plan.v_ranks, 4, 4)):
            empty = ops.gather_latents(seq.cache, seq.table[None].expand(3, -1), 16, lay,
                                       start=16)
            assert empty.shape == (3, 0, plan.k_width + plan.v_width)
        # the partial group: key codes not written yet, its latents staged exactly
        for t in range(complete, n):
            row = seq.cache[int(seq.table[t // LATENT_BLOCK]), 0, t % LATENT_BLOCK]
            assert not row[:layout.k_codes_bytes].any()
            ex = seq.exact[int(seq.exact_table[t // EXACT_BLOCK]), 0, t % EXACT_BLOCK]
            assert torch.equal(seq.slot.staged(ex), seq.lat[t, :rk])
        # the null blocks that padding and non-final tokens rewrite keep their content
        assert not seq.cache[0].any() and bool((seq.exact[0] == 0xFF).all())


@pytest.mark.parametrize("n,sink,recent,pad,exact_bits", [
    (90, 16, 16, 0, 16), (61, 0, 32, 0, 16), (40, 16, 16, 0, 16), (90, 16, 16, 6, 16),
    (90, 16, 16, 0, 8)])
def test_token_adaptive_decode_over_channel_quantized_keys(n, sink, recent, pad, exact_bits):
    """TALE decode at the last position of a sequence written step by step:
    the latent span reads only complete groups and matches the float64 loop
    over the stored (dequantized) latents and the exact tokens (int8 exact
    tokens: their float64 reference dequantization; the staged key latents
    stay float32 either way)."""
    plan, layout = make_layer(pad)
    seq = PagedSequence(plan, layout, n, exact_bits)
    for count in [7, 9, 1, 16, 3] + [1] * n:
        if seq.n + count > n:
            count = n - seq.n
        if count:
            seq.step(count)
    torch.manual_seed(1)
    k_up = torch.zeros(plan.k_width, plan.shape.kv_width)
    k_up[:8, :32], k_up[8:, 32:] = torch.randn(8, 32), torch.randn(16, 32)
    v_up, rope = make_v_up(plan), make_rope(16, 16, True)
    q = torch.randn(1, 8, 16)
    out = tale.decode(plan, k_up, v_up, rope, SCALE, q, seq.cache, seq.table[None],
                      seq.exact, seq.exact_table[None], torch.tensor([n]), n, sink=sink,
                      recent=recent, exact=seq.slot, layout=layout, min_seq_len=n)
    complete = n // G * G
    lat = torch.full((n, seq.lat.shape[1]), float("nan"), dtype=torch.float64)
    lat[:complete] = seq.reference_latents(complete)
    is_exact = lambda t: t < sink or t >= max(sink, n - 1 - recent)  # noqa: E731
    assert all(is_exact(t) for t in range(complete, n))  # partial group: never latent
    d = plan.shape.head_dim
    ref = reference(plan, k_up, v_up, rope, q, lat, as_stored(seq.k_ex, exact_bits, d),
                    as_stored(seq.v_ex, exact_bits, d), [n - 1], is_exact)
    assert torch.allclose(out.view(8, 16).double(), ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [1, 8, 32])
def test_key_group_ends_match_a_loop_over_the_steps_tokens(group):
    """The step's group-end tokens from host metadata (decodes, a chunked
    prefill and a prefill from 0) against a loop over every token's position."""
    qsl = torch.tensor([0, 1, 4, 40, 105], dtype=torch.int32)
    seq_lens = torch.tensor([33, 10, 64, 65])
    ends = tale.key_group_ends(qsl, seq_lens, group, "cpu")
    ref, i = [], 0
    for r in range(len(seq_lens)):
        q = int(qsl[r + 1] - qsl[r])
        for p in range(int(seq_lens[r]) - q, int(seq_lens[r])):
            if p % group == group - 1:
                ref.append(i)
            i += 1
    assert ends.tolist() == ref and ends.dtype == torch.int64
