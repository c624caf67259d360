"""Token-adaptive attention (TALE) on CPU against a float64 loop.

For a step whose first new token is at ``s``, the reference attends exact keys
and values for ``t < S`` and ``t >= max(S, s - W)`` and latent ones (keys
rebuilt and rotated, values ``c_v B_v``) for the rest, in one softmax. The
caches are poisoned with NaN wherever the other form should be read: latent
rows of exact positions, exact rows of latent positions (vLLM frees those
blocks), so any read of the wrong form shows up as NaN.
"""

import dataclasses
import types

import pytest
import torch

from test_latent_attention import BLOCK, fill, rotate64, setup_case
from vllm_lowrank.attention import token_adaptive as tale
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan
from vllm_lowrank.format.exact import ExactSlot
from vllm_lowrank.attention.rope import RopeTable

SCALE = 0.3


def exact_set(s, sink, recent):
    return lambda t: t < sink or t >= max(sink, s - recent)


def make_v_up(plan):
    v_up = torch.zeros(plan.v_width, plan.shape.kv_width)
    gw = plan.group_width
    for g, (off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks)):
        v_up[off:off + r, g * gw:(g + 1) * gw] = torch.randn(r, gw)
    return v_up


def reference(plan, k_up, v_up, rope, q, lat, k_ex, v_ex, q_pos, is_exact, window=None):
    """``[Q, H, d]`` float64: one softmax over exact and latent keys."""
    s = plan.shape
    d, rk = s.head_dim, plan.k_width
    out = torch.zeros(len(q_pos), s.num_heads, d, dtype=torch.float64)
    for qi, p in enumerate(q_pos):
        for i in range(s.num_heads):
            j = i // s.queries_per_kv
            g = j // plan.group_size
            cols = slice(j * d, (j + 1) * d)
            ko, vo = plan.k_offsets()[g], plan.v_offsets()[g]
            rkg, rvg = plan.k_ranks[g], plan.v_ranks[g]
            first = 0 if window is None else max(0, p - window + 1)
            scores, values = [], []
            for t in range(first, p + 1):
                if is_exact(t):
                    k, v = k_ex[t, cols].double(), v_ex[t, cols].double()
                else:
                    k = rotate64(lat[t, ko:ko + rkg].double() @ k_up[ko:ko + rkg, cols].double(),
                                 t, rope)
                    v = lat[t, rk + vo:rk + vo + rvg].double() @ v_up[vo:vo + rvg, cols].double()
                scores.append(float(q[qi, i].double() @ k) * SCALE)
                values.append(v)
            w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[qi, i] = w @ torch.stack(values)
    return out


def exact_slot(plan, bits=16):
    """float32 exact slots, padded to a multiple of a 100-byte latent slot."""
    return ExactSlot(plan.shape.kv_width, plan.shape.head_dim, torch.float32, bits, 0, 100)


def exact_cache_for(num_blocks, slot):
    return torch.full((num_blocks, 1, BLOCK, slot.slot_bytes), 0xFF, dtype=torch.uint8)


def as_stored(x, bits, head_dim):
    """float64 reference of what an exact slot gives back: ``x`` itself at 16
    bits (float32 here), else per token and head ``q = round((x - zero) /
    scale)`` with float16 ``scale = (max - min) / 255`` and ``zero = min``."""
    x = x.double()
    if bits == 16:
        return x
    h = x.reshape(*x.shape[:-1], -1, head_dim)
    lo, hi = h.amin(-1, keepdim=True), h.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).to(torch.float16).double()
    zero = lo.to(torch.float16).double()
    q = torch.round((h - zero) / scale).clamp(0, 255)
    return (q * scale + zero).reshape(x.shape)


def write_rows(exact_cache, slot, table, k_ex, v_ex, positions):
    pos = torch.tensor(positions, dtype=torch.long)
    slots = table[pos // BLOCK].long() * BLOCK + pos % BLOCK
    tale.write_exact(exact_cache, slot, k_ex[pos], v_ex[pos], slots)


def poison_latents(cache, table, positions):
    for t in positions:
        cache[int(table[t // BLOCK]), 0, t % BLOCK] = float("nan")


def sequence(plan, cache, exact_cache, slot, table, exact_table, n, s, sink, recent):
    """Random latents and exact K/V for positions ``< n``, written in the form
    each position must be read in at a step starting at ``s``; the exact K/V
    returned are the float64 reference of their stored form."""
    kvw, d = plan.shape.kv_width, plan.shape.head_dim
    lat = torch.randn(n, plan.k_width + plan.v_width)
    k_ex, v_ex = torch.randn(n, kvw), torch.randn(n, kvw)
    is_exact = exact_set(s, sink, recent)
    fill(cache, table, lat)
    poison_latents(cache, table, [t for t in range(n) if is_exact(t)])
    write_rows(exact_cache, slot, exact_table, k_ex, v_ex, [t for t in range(n) if is_exact(t)])
    return lat, as_stored(k_ex, slot.bits, d), as_stored(v_ex, slot.bits, d), is_exact


def decode_batch(plan, cache, exact_cache, slot, lens, sink, recent):
    """Three sequences on disjoint, shuffled blocks; exact blocks only where
    exact positions are (the rest of the exact table is the NaN null block 0)."""
    perm, exact_perm = torch.randperm(24), torch.randperm(39) + 1
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    exact_tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    used = used_exact = 0
    cases = []
    for b, n in enumerate(lens):
        nb = -(-n // BLOCK)
        tables[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        is_exact = exact_set(n - 1, sink, recent)
        for blk in range(nb):
            if any(is_exact(t) for t in range(blk * BLOCK, min(n, (blk + 1) * BLOCK))):
                exact_tables[b, blk] = int(exact_perm[used_exact])
                used_exact += 1
        cases.append(sequence(plan, cache, exact_cache, slot, tables[b], exact_tables[b], n,
                              n - 1, sink, recent))
    return tables, exact_tables, cases


def reblock(cache, tables, lens, block):
    """The same rows in a cache of ``block``-token blocks: each sequence's
    positions ``< lens[b]`` copied from ``cache`` (``BLOCK``-token blocks, rows
    of ``tables``) onto shuffled blocks; every other row poisoned (NaN, or
    0xFF bytes). Returns ``(cache, tables)``."""
    per = -(-max(lens) // block)
    width = cache.shape[-1]
    poison = 0xFF if cache.dtype == torch.uint8 else float("nan")
    out = torch.full((len(lens) * per, 1, block, width), poison, dtype=cache.dtype)
    out_tables = torch.randperm(len(lens) * per).view(len(lens), per).to(torch.int32)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        rows = cache.view(-1, width)[tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK]
        out.view(-1, width)[out_tables[b, pos // block].long() * block + pos % block] = rows
    return out, out_tables


@pytest.mark.parametrize("window,bits", [(None, 16), (12, 16), (None, 8), (12, 8)])
def test_decode_batch_matches_reference(window, bits):
    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    slot = exact_slot(plan, bits)
    exact_cache = exact_cache_for(40, slot)
    sink, recent, lens = 4, 8, [5, 30, 19]
    tables, exact_tables, cases = decode_batch(plan, cache, exact_cache, slot, lens, sink, recent)
    q = torch.randn(3, 8, 16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = tale.decode(plan, k_up, v_up, rope, SCALE, q, cache, tables, exact_cache, exact_tables,
                      lens_t, max(lens), sink=sink, recent=recent, exact=slot,
                      window=window, min_seq_len=min(lens))
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        lat, k_ex, v_ex, is_exact = cases[b]
        ref = reference(plan, k_up, v_up, rope, q[b:b + 1], lat, k_ex, v_ex, [n - 1], is_exact,
                        window)
        assert torch.allclose(out[b].view(8, 16).double(), ref[0], rtol=1e-4, atol=1e-5)


def test_tokens_change_form_exactly_once_as_they_age():
    """One sequence decoded step by step: at every step each position is read
    in the form the TALE rule gives (the wrong form is NaN), so a position is
    exact until the step starting at ``t + recent + 1`` and latent from then on."""
    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    sink, recent, n_max = 4, 8, 26
    table = torch.randperm(24)[:7].to(torch.int32)
    exact_table = torch.randperm(7).to(torch.int32) + 1
    kvw, slot = plan.shape.kv_width, exact_slot(plan)
    lat = torch.randn(n_max, plan.k_width + plan.v_width)
    k_ex, v_ex = torch.randn(n_max, kvw), torch.randn(n_max, kvw)
    became_latent = {}
    for n in range(1, n_max + 1):
        is_exact = exact_set(n - 1, sink, recent)
        cache.fill_(float("nan"))
        exact_cache = exact_cache_for(8, slot)
        fill(cache, table, lat[:n])
        poison_latents(cache, table, [t for t in range(n) if is_exact(t)])
        write_rows(exact_cache, slot, exact_table, k_ex, v_ex,
                   [t for t in range(n) if is_exact(t)])
        q = torch.randn(1, 8, 16)
        out = tale.decode(plan, k_up, v_up, rope, SCALE, q, cache, table[None], exact_cache,
                          exact_table[None], torch.tensor([n]), n, sink=sink, recent=recent,
                          exact=slot)
        ref = reference(plan, k_up, v_up, rope, q, lat, k_ex, v_ex, [n - 1], is_exact)
        assert torch.allclose(out.view(8, 16).double(), ref[0], rtol=1e-4, atol=1e-5), n
        for t in range(n):
            if not is_exact(t):
                became_latent.setdefault(t, n)
            else:
                assert t not in became_latent, f"position {t} became exact again at length {n}"
    assert became_latent == {t: t + recent + 2 for t in range(sink, n_max - recent - 1)}


@pytest.mark.parametrize("window,bits", [(None, 16), (9, 16), (9, 8)])
def test_prefill_chunk_sees_its_own_tokens_exactly(window, bits, monkeypatch):
    """A 9-token chunk after 20 cached tokens: its queries see sinks, the last
    ``recent`` history tokens and the whole chunk exactly, older history as
    latents (query chunking exercised)."""
    monkeypatch.setattr(tale, "QUERY_CHUNK", 4)
    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    slot = exact_slot(plan, bits)
    exact_cache = exact_cache_for(12, slot)
    sink, recent, n, s = 4, 8, 29, 20
    table = torch.tensor([7, 2, 19, 11, 3, 5, 21, 0], dtype=torch.int32)
    exact_table = torch.tensor([5, 0, 0, 3, 9, 1, 10, 11], dtype=torch.int32)  # 1, 2: freed
    exact_cache[0] = 0xFF  # null block: NaN bytes
    lat, k_ex, v_ex, is_exact = sequence(plan, cache, exact_cache, slot, table, exact_table,
                                         n, s, sink, recent)
    q = torch.randn(n - s, 8, 16)
    out = tale.prefill(plan, k_up, v_up, rope, SCALE, q, cache, table, exact_cache, exact_table,
                       n, sink=sink, recent=recent, exact=slot, window=window)
    ref = reference(plan, k_up, v_up, rope, q, lat, k_ex, v_ex, list(range(s, n)), is_exact,
                    window)
    assert torch.allclose(out.view(-1, 8, 16).double(), ref, rtol=1e-4, atol=1e-5)


def test_all_exact_when_recent_covers_the_context():
    """``recent`` >= the context: no latent is read (all latents NaN) and the
    result is plain attention over the exact keys and values."""
    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    slot = exact_slot(plan)
    exact_cache = exact_cache_for(8, slot)
    table = torch.tensor([3, 1, 4, 6], dtype=torch.int32)
    n = 15
    lat, k_ex, v_ex, is_exact = sequence(plan, cache, exact_cache, slot, table, table, n, n - 1,
                                         4, 64)
    assert all(is_exact(t) for t in range(n))
    q = torch.randn(1, 8, 16)
    out = tale.decode(plan, k_up, v_up, rope, SCALE, q, cache, table[None], exact_cache,
                      table[None], torch.tensor([n]), n, sink=4, recent=64, exact=slot)
    k = k_ex.view(n, 4, 16).repeat_interleave(2, dim=1).transpose(0, 1).double()
    v = v_ex.view(n, 4, 16).repeat_interleave(2, dim=1).transpose(0, 1).double()
    w = torch.softmax((q[0].double()[:, None, :] @ k.transpose(1, 2)) * SCALE, dim=-1)
    assert torch.allclose(out.view(8, 16).double(), (w @ v)[:, 0], rtol=1e-5, atol=1e-6)


def test_values_up_in_a_16_bit_dtype_matches_float64():
    """The fused decode lifts the latent outputs with 16-bit GEMMs: per query
    head, ``o_i B_v[g][:, j]`` in bfloat16 (returned as bfloat16) matches a
    float64 loop to bfloat16's precision, for two head groups of unequal ranks;
    float32 (the torch path's dtype) matches it to float32's."""
    torch.manual_seed(3)
    shape = AttentionShape(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32)
    plan = LayerPlan(shape, 2, (16, 24), (40, 24))
    v_up = make_v_up(plan)
    lat = torch.randn(5, plan.out_width)
    d, qpk = shape.head_dim, shape.queries_per_kv
    ref = torch.zeros(5, shape.num_heads, d, dtype=torch.float64)
    col = 0
    for g, (off, r) in enumerate(zip(plan.v_offsets(), plan.v_ranks)):
        for hi in range(plan.heads_per_group):
            i = g * plan.heads_per_group + hi
            j = i // qpk
            o = lat[:, col + hi * r:col + (hi + 1) * r].double()
            ref[:, i] = o @ v_up[off:off + r, j * d:(j + 1) * d].double()
        col += plan.heads_per_group * r
    got16 = tale.values_up(plan, v_up, lat, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert (got16.double() - ref).norm() / ref.norm() < 1e-2
    got32 = tale.values_up(plan, v_up, lat)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-5)


def test_merge_equals_one_softmax():
    torch.manual_seed(1)
    s = torch.randn(3, 10, dtype=torch.float64)
    v = torch.randn(10, 5, dtype=torch.float64)
    a, b = slice(0, 4), slice(4, 10)
    parts = [(torch.softmax(s[:, x], -1) @ v[x], torch.logsumexp(s[:, x], -1)) for x in (a, b)]
    got = tale.merge(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    assert torch.allclose(got, torch.softmax(s, -1) @ v)
    empty = tale.merge(parts[0][0], torch.full((3,), float("-inf"), dtype=torch.float64),
                       parts[1][0], parts[1][1])
    assert torch.allclose(empty, parts[1][0])


def test_decode_with_the_fused_kernel_matches_reference():
    """On CUDA a token-adaptive layer decodes with a
    :class:`~vllm_lowrank.attention.decoders.TokenAdaptiveDecoder`: its latent
    span (+ log-sum-exp) on a Triton latent kernel, then the exact part, the
    value up-projection and the merge in the token-adaptive Triton kernel; same
    result as the float64 loop (without CUDA: both kernels in the Triton
    interpreter, the family built directly, as choosing one needs a GPU)."""
    pytest.importorskip("triton")
    from decoder_layer import StandInLayer, triton_family
    from vllm_lowrank.attention import decoders

    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    slot = exact_slot(plan)
    exact_cache = exact_cache_for(40, slot)
    sink, recent, lens = 4, 8, [5, 30, 19]
    tables, exact_tables, cases = decode_batch(plan, cache, exact_cache, slot, lens, sink, recent)
    q = torch.randn(3, 8, 16)
    # the exact kernel reads blocks of a power of two >= 16 tokens (vLLM's on a GPU)
    cache, tables = reblock(cache, tables, lens, 16)
    exact_cache, exact_tables = reblock(exact_cache, exact_tables, lens, 16)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = StandInLayer(plan, k_up=k_up.to(dev), v_up=v_up.to(dev), rope=rope, scale=SCALE,
                         exact=types.SimpleNamespace(sink=sink, recent=recent, slot=slot))
    ctx = decoders.DecoderContext(torch.float32, dev, 16, None, 1024)
    family = triton_family(layer, ctx)
    assert family in decoders.TOKEN_ADAPTIVE_FAMILIES
    decoder = decoders.choose(layer, ctx) if dev.type == "cuda" else family(layer, ctx)
    assert type(decoder) is family
    batch = decoders.DecodeBatch(tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                                 max(lens), min(lens), exact_cache=exact_cache.to(dev),
                                 exact_block_table=exact_tables.to(dev))
    out = torch.full((3, 8 * 16), float("nan"), device=dev)
    decoder.run(q.to(dev), cache.to(dev), batch, decoder.plan(batch), out)
    for b, n in enumerate(lens):
        lat, k_ex, v_ex, is_exact = cases[b]
        ref = reference(plan, k_up, v_up, rope, q[b:b + 1], lat, k_ex, v_ex, [n - 1], is_exact)
        # the kernel's float32 dots run on tensor cores (TF32, ~1e-3 relative)
        assert torch.allclose(out[b].cpu().view(8, 16).double(), ref[0], rtol=1e-2, atol=1e-2)


def test_int8_exact_slot_round_trips_per_head():
    """An 8-bit exact slot gives back the float64 per-head reference
    quantization of keys and values (error at most half a step), the staged
    key latents bit for bit, and is padded to a multiple of the latent slot."""
    torch.manual_seed(3)
    kvw, d, rk = 64, 16, 24
    k, v = torch.randn(5, kvw) * 3, torch.randn(5, kvw)
    k[:, 5] += 40  # an outlier channel in one head only
    staged = torch.randn(5, rk).to(torch.bfloat16)
    slot = ExactSlot(kvw, d, torch.bfloat16, 8, rk, 60)
    # [k | v]: 2 x (64 codes + 4 heads x (scale, zero) float16) + 24 bfloat16
    assert slot.kv_bytes == 2 * (64 + 4 * 4) and slot.slot_bytes == 240
    rows = slot.encode(k, v, staged)
    assert rows.shape == (5, 240) and rows.dtype == torch.uint8
    got_k, got_v = slot.decode(rows)
    for got, x in ((got_k, k), (got_v, v)):
        ref = as_stored(x, 8, d)
        step = (x.view(5, 4, d).amax(-1) - x.view(5, 4, d).amin(-1)) / 255
        assert torch.allclose(got.double(), ref, atol=1e-5)
        assert ((got - x).abs().view(5, 4, d) <= step[..., None] / 2 + 1e-3).all()
    assert torch.equal(slot.staged(rows), staged.float())
    wide = ExactSlot(kvw, d, torch.bfloat16, 16, rk, 60)
    assert wide.slot_bytes == 360  # 4 * 64 + 48 = 304 -> 6 latent slots
    assert torch.equal(torch.cat(wide.decode(wide.encode(k, v)), -1),
                       torch.cat((k, v), -1).to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="exact_bits=4"):
        ExactSlot(kvw, d, torch.bfloat16, 4)
    # room for a wider layer's staged latent: that layer's slot size, its own
    # staged latents still where they were
    roomy = ExactSlot(kvw, d, torch.bfloat16, 8, rk, 60, staged_room=rk + 30)
    assert roomy.slot_bytes == ExactSlot(kvw, d, torch.bfloat16, 8, rk + 30, 60).slot_bytes == 300
    rows = roomy.encode(k, v, staged)
    assert torch.equal(roomy.staged(rows), staged.float())
    assert torch.equal(rows[:, :slot.slot_bytes - 60], slot.encode(k, v, staged)[:, :180])


def test_exact_slots_of_layers_with_different_ranks_have_one_size():
    """Token-adaptive layers of different key ranks, per-channel keys (each
    exact slot stages its layer's key latent): one exact slot size for all
    (the widest layer's), so that vLLM keeps them in one cache group."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.format.exact import exact_tokens
    from vllm_lowrank.models.compression import ModelCompression

    shape = AttentionShape(hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=16)
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "k_bits": 4, "v_bits": 4,
                                   "token_adaptive": True, "k_quant": "channel",
                                   "sink_tokens": 32, "recent_tokens": 32})
    plans = {0: LayerPlan(shape, 4, (16,), (48,)), 1: LayerPlan(shape, 4, (40,), (24,)),
             2: LayerPlan(shape, 4, (24,), (40,))}
    c = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None,
                         exact_tokens=exact_tokens(cfg, 32))
    assert c.exact_tokens.staged_room == 40
    own = {ExactSlot.for_layer(p, c.layout(i), torch.bfloat16,
                               dataclasses.replace(c.exact_tokens, staged_room=0)).slot_bytes
           for i, p in plans.items()}
    assert len(own) > 1  # without the room: one size per key rank
    sizes = {ExactSlot.for_layer(p, c.layout(i), torch.bfloat16, c.exact_tokens).slot_bytes
             for i, p in plans.items()}
    assert sizes == {max(own)}


@pytest.mark.parametrize("bits", [16, 8])
def test_batched_prefill_matches_reference(bits):
    """Every prefill chunk of a step in one batched call (the CUDA path; the
    varlen kernel runs in the Triton interpreter without CUDA), behind a decode
    request it must skip: a prompt inside the sinks, chunks after a long
    history (latent span non-empty), a whole prompt, a short chunk; each
    request's tokens equal the float64 loop's."""
    pytest.importorskip("triton")
    plan, k_up, rope, cache = setup_case()
    v_up = make_v_up(plan)
    slot = exact_slot(plan, bits)
    exact_cache = exact_cache_for(40, slot)
    sink, recent = 4, 8
    chunks = [(5, 5), (30, 6), (19, 19), (27, 3)]  # (length after the step, new tokens)
    perm, exact_perm = torch.randperm(24), torch.randperm(39) + 1
    tables = torch.zeros(len(chunks) + 1, 8, dtype=torch.int32)  # row 0: the decode
    exact_tables = torch.zeros(len(chunks) + 1, 8, dtype=torch.int32)
    used, cases = 0, []
    for r, (n, q_len) in enumerate(chunks, start=1):
        nb = -(-n // BLOCK)
        tables[r, :nb] = perm[used:used + nb].to(torch.int32)
        exact_tables[r, :nb] = exact_perm[used:used + nb].to(torch.int32)
        used += nb
        cases.append(sequence(plan, cache, exact_cache, slot, tables[r], exact_tables[r], n,
                              n - q_len, sink, recent))
    qsl = torch.tensor([0, 1] + [1 + sum(q for _, q in chunks[:i + 1])
                                 for i in range(len(chunks))], dtype=torch.int32)
    seq_lens = torch.tensor([10] + [n for n, _ in chunks], dtype=torch.int32)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spans = tale.prefill_spans(qsl, seq_lens, 1, sink, recent, 1, dev)
    q = torch.randn(int(qsl[-1]), 8, 16)
    out = torch.full((int(qsl[-1]) - 1, 8 * 16), float("nan"), device=dev)
    rope_dev = RopeTable(rope.cos.to(dev), rope.sin.to(dev), rope.rotary_dim, rope.neox)
    tale.prefill_batched(plan, k_up.to(dev), v_up.to(dev), rope_dev, SCALE, q[1:].to(dev),
                         cache.to(dev), tables.to(dev), exact_cache.to(dev),
                         exact_tables.to(dev), spans, out, exact=slot)
    out = out.cpu()
    tol = 1e-2 if dev.type == "cuda" else 1e-5  # TF32 tensor-core dots on a GPU
    for r, (n, q_len) in enumerate(chunks):
        lat, k_ex, v_ex, is_exact = cases[r]
        start = int(qsl[r + 1]) - 1
        ref = reference(plan, k_up, v_up, rope, q[start + 1:start + 1 + q_len], lat, k_ex, v_ex,
                        list(range(n - q_len, n)), is_exact)
        got = out[start:start + q_len].view(q_len, 8, 16).double()
        assert torch.allclose(got, ref, rtol=tol, atol=tol), (r, (got - ref).abs().max())


def test_prefill_spans_widen_the_latent_reads_to_whole_key_groups():
    """With 4-token key groups, a latent span ``6 <= t < 17`` is read as
    positions 4..19 and the attended rows are the span; the exact set is the
    sinks, the ``W`` tokens before the chunk and the chunk."""
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    spans = tale.prefill_spans(qsl, torch.tensor([28]), 0, 6, 8, 4, torch.device("cpu"))
    assert spans.lat_pos.tolist() == list(range(4, 20))
    assert spans.lat_key_pos.tolist() == list(range(6, 17))
    assert spans.lat_pos[spans.lat_keep].tolist() == list(range(6, 17))
    assert spans.cu_lat.tolist() == [0, 11]
    assert spans.ex_pos.tolist() == list(range(6)) + list(range(17, 28))
    assert spans.cu_ex.tolist() == [0, 17] and spans.cu_q.tolist() == [0, 3]


def test_exact_spec_keeps_its_sink_blocks_in_the_block_table():
    """The exact-token spec asks vLLM's worker (0.33's model runner V2) to
    null no block-table entry below the window: its sink blocks stay readable
    however far the window has moved. Its admission bound still counts the
    window and the sinks."""
    from vllm_lowrank.attention.exact_cache import ExactTokensSpec

    spec = ExactTokensSpec(block_size=16, num_kv_heads=1, head_size=8, head_size_v=8,
                           dtype=torch.uint8, state_content_bytes=32, sliding_window=65,
                           sink=32)
    assert spec.num_retained_tokens == 0
    assert spec.sink_blocks == 2
    window_only = dataclasses.replace(spec, sink=0)
    assert spec.max_admission_blocks_per_request(256, 4096) == \
        window_only.max_admission_blocks_per_request(256, 4096) + 2
