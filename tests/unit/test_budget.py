"""Byte-budget allocation (:mod:`vllm_lowrank.factorization.budget`,
:mod:`vllm_lowrank.calibration.allocate`): the measured objective against float64
loops, byte accounting against the cache's slot layouts, exactness of the
solver against brute force, the budget and monotonicity, the TALE-aware
gradients against plain autograd, and serving settings taken from an artifact.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.factorization import budget as bud
from vllm_lowrank.format.latent import SlotLayout


def _naive_token_quant(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token asymmetric quantization, one scale/zero per row, float16
    parameters, loop over rows (float64)."""
    out = torch.empty_like(y)
    levels = 2**bits - 1
    for t in range(y.shape[0]):
        lo, hi = float(y[t].min()), float(y[t].max())
        scale = float(torch.tensor((hi - lo) / levels).half())
        zero = float(torch.tensor(lo).half())
        for i in range(y.shape[1]):
            q = 0 if scale == 0 else min(max(round((float(y[t, i]) - zero) / scale), 0), levels)
            out[t, i] = q * scale + zero
    return out


def _naive_channel_quant(y: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Per-channel quantization over runs of ``g`` rows, by transposition of
    the per-token loop."""
    return torch.cat([_naive_token_quant(y[s:s + g].T.contiguous(), bits).T
                      for s in range(0, y.shape[0], g)])


def _psd(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return a @ a.T / n


@pytest.mark.parametrize("rank,bits,side,channel", [
    (8, 4, "v", None), (16, 2, "v", None), (8, 3, "k", None), (8, 4, "k", 8),
    (16, 2, "k", 8), (8, 16, "v", None), (16, 8, "v", None)])
def test_side_loss_matches_float64_loop(rank, bits, side, channel):
    gen = torch.Generator().manual_seed(rank * 10 + bits)
    n, t = 16, 32
    c = torch.randn(t, n, generator=gen, dtype=torch.float64) * torch.linspace(2, 0.1, n)
    b = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0] * 1.5
    m = _psd(n, gen)
    storage = bud.Storage(hadamard=False, k_channel_tokens=channel, multiple=8)
    got = bud.side_loss(c.float(), m, b.float(), rank, bits, storage, side=side)
    c = c.float().double()
    stored = c @ b.float().double() if rank == n else c[:, :rank]
    if bits == 16:
        back = stored.half().double()
    elif channel and side == "k":
        back = _naive_channel_quant(stored, bits, channel)
    else:
        back = _naive_token_quant(stored, bits)
    if rank == n:
        # the cache holds k = c B: the error in latent coordinates is dk B^{-1}
        dc = (back - stored) @ torch.linalg.inv(b.float().double())
    else:
        dc = torch.cat([back - stored, -c[:, rank:]], dim=1)
    want = 0.5 * sum(float(dc[i] @ m @ dc[i]) for i in range(t)) / t
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_side_loss_with_hadamard_is_rotation_invariant_reference():
    """With the rotation, the error is measured after undoing it: equal to the
    loop over the rotated latent, rotated back."""
    gen = torch.Generator().manual_seed(3)
    n, t, rank = 16, 24, 8
    c = torch.randn(t, n, generator=gen, dtype=torch.float64)
    m = _psd(n, gen)
    storage = bud.Storage(hadamard=True, multiple=8)
    got = bud.side_loss(c, m, torch.eye(n), rank, 4, storage, side="v", layer=5, group=1)
    from vllm_lowrank.format.latent import hadamard_rotation

    rot = hadamard_rotation(rank, seed=5 * 1000 + 10 * 1 + 1).double()
    y = c[:, :rank] @ rot
    dy = (_naive_token_quant(y, 4) - y) @ rot.T
    dc = torch.cat([dy, -c[:, rank:]], dim=1)
    want = 0.5 * sum(float(dc[i] @ m @ dc[i]) for i in range(t)) / t
    assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("channel,group", [(None, None), (None, 8), (16, None)])
def test_side_bytes_match_slot_layout(channel, group):
    storage = bud.Storage(quant_group=group, k_channel_tokens=channel, multiple=8)
    for kb, vb in itertools.product(bud.BITS, repeat=2):
        for kr, vr in (((8, 16), (24, 8)), ((48,), (16,)), ((16, 32, 48), (48, 16, 32))):
            pc = channel is not None and kb < 16
            want = SlotLayout(kr, vr, kb, vb, group, group,
                              k_channel_tokens=channel if pc else None).natural_bytes
            got = (bud.side_bytes(kr, kb, storage, pc)
                   + bud.side_bytes(vr, vb, storage, False))
            assert got == want, (kb, vb, kr, vr)


def _random_fronts(num_layers: int, seed: int, groups: int = 1):
    """Fronts from random latents and metrics (2 head groups of width 16)."""
    gen = torch.Generator().manual_seed(seed)
    storage = bud.Storage(hadamard=True, k_channel_tokens=8, multiple=8)
    fronts = {}
    for layer in range(num_layers):
        sides = []
        for side in ("k", "v"):
            lat = [torch.randn(32, 16, generator=gen) * torch.linspace(3, 0.1, 16)
                   for _ in range(groups)]
            mets = [torch.diag(torch.rand(16, generator=gen, dtype=torch.float64)
                               * torch.logspace(0, -3, 16, dtype=torch.float64))
                    for _ in range(groups)]
            bases = [torch.eye(16) for _ in range(groups)]
            sides.append(bud.side_options(lat, mets, bases, storage, side=side, layer=layer,
                                          bits_options=(16, 8, 4, 2)))
        fronts[layer] = bud.layer_front(*sides)
    return fronts


def test_front_is_pareto_and_split_is_optimal():
    fronts = _random_fronts(1, 0, groups=2)
    front = fronts[0]
    nbytes = [c.natural_bytes for c in front]
    losses = [c.loss for c in front]
    assert nbytes == sorted(set(nbytes)) and losses == sorted(losses, reverse=True)
    assert len(set(losses)) == len(losses)
    # every (K, V) choice is dominated by a front entry (weakly)
    gen = torch.Generator().manual_seed(0)
    storage = bud.Storage(hadamard=True, k_channel_tokens=8, multiple=8)
    # rebuild the raw per-group tables and check one split by brute force
    lat = [torch.randn(32, 16, generator=gen) for _ in range(2)]
    mets = [torch.eye(16, dtype=torch.float64) * 0.1, torch.eye(16, dtype=torch.float64)]
    opts = bud.side_options(lat, mets, [torch.eye(16)] * 2, storage, side="v",
                            bits_options=(4,))
    for o in opts:
        brute = min(
            sum(bud.side_loss(lat[g], mets[g], torch.eye(16), r, 4, storage, side="v",
                              group=g) for g, r in enumerate(rs))
            for rs in itertools.product((8, 16), repeat=2) if sum(rs) == sum(o.ranks))
        assert o.loss == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("exact", [False, True])
def test_knapsack_is_exact_and_within_budget(exact):
    fronts = _random_fronts(3, 1)
    cost = {i: (lambda c, s: 0.1 * s + 0.01 * sum(c.k.ranks)) for i in fronts} if exact else None
    for budget in (60, 75, 90, 110, 140, 200):
        try:
            a = bud.allocate_bytes(fronts, budget, one_page=False, exact_cost=cost)
        except ValueError:
            a = None
        best = math.inf
        for combo in itertools.product(*fronts.values()):
            slots = {i: c.natural_bytes for i, c in zip(fronts, combo)}
            total = bud.total_bytes(dict(zip(fronts, combo)), slots, cost)
            if total <= budget - 3 / 8:  # the solver rounds each weight up to 1/8 B
                best = min(best, sum(c.loss for c in combo))
        if a is None:
            assert best == math.inf
            continue
        assert a.total_bytes <= budget
        assert a.objective <= best + 1e-12


@pytest.mark.parametrize("one_page", [False, True])
def test_allocation_is_monotone_and_meets_budget(one_page):
    fronts = _random_fronts(4, 2)
    cost = {i: (lambda c, s: 160 / 4096 * (-(-(2 * 64 + sum(c.k.ranks)) * 2 // s) * s))
            for i in fronts}
    last = math.inf
    for budget in range(60, 400, 7):
        try:
            a = bud.allocate_bytes(fronts, budget, one_page=one_page, exact_cost=cost)
        except ValueError as e:
            assert "below the smallest" in str(e)
            continue
        assert a.total_bytes <= budget + 1e-9
        assert a.objective <= last + 1e-12
        last = a.objective
        if one_page:
            assert len(set(a.slot_bytes.values())) == 1
            s = next(iter(a.slot_bytes.values()))
            assert s % 4 == 0 and all(c.natural_bytes <= s for c in a.layers.values())
            assert s == -(-max(c.natural_bytes for c in a.layers.values()) // 4) * 4
    assert last < math.inf


def test_allocation_bytes_are_what_the_cache_allocates():
    """Slot bytes of the allocation == SlotLayout sizes the serving path builds
    (per-layer bits, per-channel keys, one page)."""
    from vllm_lowrank.models.compression import slot_layouts

    fronts = _random_fronts(4, 3)
    a = bud.allocate_bytes(fronts, 180, one_page=True)
    cfg = LowRankConfig(mode="lowrank", token_adaptive=True, k_quant="channel",
                        k_channel_tokens=8, k_bits=4)
    ranks = [(c.k.ranks, c.v.ranks) for c in a.layers.values()]
    bits = [(c.k.bits, c.v.bits) for c in a.layers.values()]
    layouts = slot_layouts(cfg, ranks, bits, one_page=True)
    assert [la.slot_bytes for la in layouts] == list(a.slot_bytes.values())
    assert sum(la.slot_bytes for la in layouts) == a.total_bytes
    assert [la.natural_bytes for la in layouts] == [c.natural_bytes for c in a.layers.values()]


def test_unrotate_is_the_rope_pullback():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from vllm_lowrank.calibration.collect import unrotate_gradient

    t, d = 11, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], 1)
    x = torch.randn(1, 2, t, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, t, d, dtype=torch.float64)
    y, _ = apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    (y * w).sum().backward()
    assert torch.allclose(x.grad[0], unrotate_gradient(w[0], inv, True), atol=1e-12)


def test_far_gradients_reduce_to_plain_gradients(model_path):
    """With no exact tokens every key and value is read from the copy: the
    gradients' second moments equal the K-FAC statistics of plain autograd
    (collect_stats); with everything exact they vanish."""
    from vllm_lowrank.calibration.calibrate import rope_inv_freq, load_hf_model
    from vllm_lowrank.calibration.collect import collect_far_gradients, collect_stats

    model, tok = load_hf_model(model_path)
    model.model.layers = model.model.layers[:3]
    model.config.num_hidden_layers = 3
    windows = [tok.encode("The cat sat on the mat because it was warm and soft. " * 4)[:48]]
    ref = collect_stats(model, windows, gradients=True)
    far = collect_far_gradients(model, windows, sink=0, recent=0,
                                inv_freq=lambda i: rope_inv_freq(model, i))
    for st, (gk, gv) in zip(ref, far):
        for want, got in ((st.gk / st.tokens, gk), (st.gv / st.tokens, gv)):
            assert torch.allclose(got, want, rtol=1e-3, atol=1e-6 * float(want.abs().max()))
    none = collect_far_gradients(model, windows, sink=0, recent=len(windows[0]),
                                 inv_freq=lambda i: rope_inv_freq(model, i))
    assert all(float(g.abs().max()) == 0 for pair in none for g in pair)
    part = collect_far_gradients(model, windows, sink=4, recent=8,
                                 inv_freq=lambda i: rope_inv_freq(model, i))
    assert 0 < float(part[1][1].trace()) < float(far[1][1].trace())


def test_artifact_allocation_settings_apply_and_conflicts_are_refused():
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.models.compression import allocation_settings

    serving = {"token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128,
               "k_quant": "channel", "k_channel_tokens": 32, "quant_group_size": None,
               "hadamard": True}
    a = art.Artifact(manifest={"ranks": {"fixed": True, "layers": {"0": [[8], [16]]},
                                         "bits": {"0": [4, 3]}, "serving": serving}},
                     bases={})
    def given(**keys):  # what the user typed (from_dict records the keys given)
        return LowRankConfig.from_dict({"mode": "lowrank", "artifact": "DIR", **keys})

    cfg, bits = allocation_settings(given(), a, "DIR")
    assert bits == {0: (4, 3)}
    assert cfg.token_adaptive and cfg.sink_tokens == 32 and cfg.k_quant == "channel"
    with pytest.raises(LowRankConfigError, match="fixes K/V bits per layer"):
        allocation_settings(given(v_bits=4), a, "DIR")
    with pytest.raises(LowRankConfigError, match="fixes K/V bits per layer"):
        allocation_settings(given(k_bits=16), a, "DIR")  # explicit, at the default value
    with pytest.raises(LowRankConfigError, match="allocated for recent_tokens=128"):
        allocation_settings(given(recent_tokens=64), a, "DIR")
    with pytest.raises(LowRankConfigError, match="allocated for sink_tokens=32"):
        allocation_settings(given(sink_tokens=4), a, "DIR")  # explicit, at the default value
    assert allocation_settings(given(recent_tokens=128, hadamard=True), a, "DIR")[0] == cfg
    plain = art.Artifact(manifest={"ranks": None}, bases={})
    assert allocation_settings(LowRankConfig(mode="lowrank"), plain, "DIR")[1] is None


@pytest.mark.parametrize("bits", [(), (16, 5), (1,)])
def test_allocation_bits_outside_the_code_widths_are_refused_before_loading(bits):
    """``allocate --bits`` takes a non-empty subset of the widths; anything else
    is refused before the model loads (the model path does not exist)."""
    from types import SimpleNamespace

    from vllm_lowrank.calibration.allocate import budget_artifact

    with pytest.raises(LowRankConfigError, match="must be a non-empty subset"):
        budget_artifact("/nonexistent", SimpleNamespace(manifest={"method": "fisher"}),
                        LowRankConfig(mode="lowrank"), ratio=8.0, bits_options=bits)


def test_side_options_keep_to_the_given_bits():
    """The allocation's per-side choices use only ``bits_options``."""
    torch.manual_seed(0)
    n, t = 16, 64
    c = [torch.randn(t, n, dtype=torch.float64)]
    m = [torch.eye(n, dtype=torch.float64)]
    b = [torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]]
    opts = bud.side_options(c, m, b, bud.Storage(multiple=8), side="v", bits_options=(16, 4))
    assert {o.bits for o in opts} == {16, 4}


@pytest.mark.parametrize("one_page", [False, True])
def test_loss_target_gives_the_cheapest_allocation_within_it(one_page):
    from vllm_lowrank.calibration.allocate import solve

    fronts = _random_fronts(4, 4)
    cfg = LowRankConfig(mode="lowrank")
    widths = {i: 32 for i in fronts}
    top = bud.allocate_bytes(fronts, 10_000, one_page=one_page)
    low = bud.allocate_bytes(fronts, 60 if not one_page else 64, one_page=one_page)
    target = (top.objective + low.objective) / 2
    a = solve(fronts, cfg, widths, head_dim=16, context=4096, block_size=32, one_page=one_page,
              max_loss=target)
    assert a.objective <= target
    cheaper = bud.allocate_bytes(fronts, a.total_bytes - 1, one_page=one_page)
    assert cheaper.objective > target
    with pytest.raises(LowRankConfigError, match="raise the perplexity budget"):
        solve(fronts, cfg, widths, head_dim=16, context=4096, block_size=32, one_page=one_page,
              max_loss=top.objective / 2)


def test_serving_config_refuses_bits_and_allows_channel_keys():
    from vllm_lowrank.calibration.allocate import serving_config

    cfg = serving_config({"token_adaptive": True, "k_quant": "channel"})
    assert cfg.token_adaptive and cfg.k_quant == "channel"
    with pytest.raises(LowRankConfigError, match="chooses k_bits and v_bits"):
        serving_config({"k_bits": 4})


@pytest.mark.parametrize("exact_bits,kv_bytes", [(16, 2 * 192 * 2), (8, 2 * (192 + 3 * 4))])
def test_exact_tokens_are_charged_at_their_stored_bytes(exact_bits, kv_bytes):
    """Exact tokens cost ``(sink + recent) / context`` of their slot: ``[k | v]``
    (float16, or int8 codes plus a float16 scale/zero per head and side),
    the staged key latents of per-channel keys (float16), padded up to a
    multiple of the latent slot. SmolLM2's geometry: 3 KV heads of 64."""
    from vllm_lowrank.calibration.allocate import exact_costs

    cfg = LowRankConfig(mode="lowrank", token_adaptive=True, sink_tokens=32, recent_tokens=128,
                        k_bits=4, k_quant="channel", exact_bits=exact_bits)
    cost = exact_costs(cfg, {0: 192}, 64, context=4096, block_size=32)[0]
    k = bud.SideOption(bits=3, ranks=(48,), nbytes=30, loss=0.0)
    v = bud.SideOption(bits=4, ranks=(56,), nbytes=30, loss=0.0)
    staged = 2 * 48
    slot = 60
    padded = -(-(kv_bytes + staged) // slot) * slot
    assert cost(bud.LayerChoice(k, v), slot) == pytest.approx(160 / 4096 * padded)
    k16 = bud.SideOption(bits=16, ranks=(48,), nbytes=96, loss=0.0)  # nothing staged
    assert cost(bud.LayerChoice(k16, v), 1) == pytest.approx(160 / 4096 * kv_bytes)
    assert exact_costs(LowRankConfig(mode="lowrank"), {0: 192}, 64, 4096, 32) is None


def test_knob_choices_cover_every_combination():
    """With knob choice the allocator solves for the given recent window and
    twice it (token-adaptive mode only), each with Hadamard on/off and, where
    per-channel keys are allowed, per-token keys too; without it, once."""
    from vllm_lowrank.calibration.allocate import (exact_window_variants, knob_variants,
                                                   serving_config)

    cfg = serving_config({"token_adaptive": True, "recent_tokens": 128, "k_quant": "channel",
                          "exact_bits": 8})
    windows = exact_window_variants(cfg, True)
    assert [w.recent_tokens for w in windows] == [128, 256]
    assert all(w.exact_bits == 8 and w.sink_tokens == cfg.sink_tokens for w in windows)
    assert exact_window_variants(cfg, False) == [cfg]
    plain = serving_config({})
    assert exact_window_variants(plain, True) == [plain]
    combos = {(v.hadamard, v.k_quant) for v in knob_variants(cfg, True)}
    assert combos == {(True, "channel"), (False, "channel"), (True, "token"), (False, "token")}
    assert knob_variants(cfg, False) == [cfg]
    assert {v.hadamard for v in knob_variants(plain, True)} == {True, False}
