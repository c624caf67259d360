"""The CPU latent attention path against a naive float64 loop: paged cache with
non-contiguous blocks, uneven ranks per head group, ragged lengths, chunked
prefill over cached context, decode batches, poisoned unused slots."""

import math

import pytest
import torch

from vllm_lowrank.attention import latent_attention as ops
from vllm_lowrank.attention.rope import RopeTable
from vllm_lowrank.factorization.plan import AttentionShape, LayerPlan

BLOCK = 4


def make_rope(dim, rotary_dim, neox, theta=10000.0, max_pos=256):
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return RopeTable(ang.cos().float(), ang.sin().float(), rotary_dim, neox)


def rotate64(x, pos, rope):
    """Explicit float64 RoPE of one head vector."""
    x = x.double().clone()
    rot = rope.rotary_dim
    half = rot // 2
    ang = pos * torch.atan2(rope.sin[1].double(), rope.cos[1].double())
    out = x.clone()
    for i in range(half):
        a, b = (i, i + half) if rope.neox else (2 * i, 2 * i + 1)
        c, s = math.cos(ang[i]), math.sin(ang[i])
        out[a] = x[a] * c - x[b] * s
        out[b] = x[b] * c + x[a] * s
    return out


def reference(plan, k_up, rope, scale, q, latents, q_pos, bias=None, norm=None, window=None):
    """o[token, head] by explicit loops in float64. latents: [L, Rk+Rv];
    ``bias [kv_width]`` added to and ``norm = (weight [d], eps)`` applied to
    each rebuilt key before RoPE; ``window``: keys ``p - window < t <= p``."""
    s = plan.shape
    d = s.head_dim
    rk = plan.k_width
    out = []
    for qi, p in enumerate(q_pos):
        row = []
        for i in range(s.num_heads):
            j = i // s.queries_per_kv
            g = j // plan.group_size
            jl = j - g * plan.group_size
            ko, vo = plan.k_offsets()[g], plan.v_offsets()[g]
            rkg, rvg = plan.k_ranks[g], plan.v_ranks[g]
            bk = k_up[ko:ko + rkg, g * plan.group_width + jl * d: g * plan.group_width + (jl + 1) * d]
            scores = []
            first = 0 if window is None else max(0, p - window + 1)
            for t in range(first, p + 1):
                k = latents[t, ko:ko + rkg].double() @ bk.double()
                if bias is not None:
                    k = k + bias[j * d:(j + 1) * d].double()
                if norm is not None:
                    k = k / torch.sqrt((k * k).mean() + norm[1]) * norm[0].double()
                k = rotate64(k, t, rope)
                scores.append(float(q[qi, i].double() @ k) * scale)
            w = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            vals = latents[first: p + 1, rk + vo: rk + vo + rvg].double()
            row.append(w @ vals)
        out.append(torch.cat(row))
    return torch.stack(out)


def setup_case(neox=True, rotary_dim=16, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    shape = AttentionShape(hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=16)
    plan = LayerPlan(shape, 2, k_ranks=(8, 16), v_ranks=(16, 8))
    k_up = torch.zeros(plan.k_width, shape.kv_width)
    k_up[:8, :32] = torch.randn(8, 32)
    k_up[8:, 32:] = torch.randn(16, 32)
    rope = make_rope(16, rotary_dim, neox)
    num_blocks = 24
    cache = torch.full((num_blocks, 1, BLOCK, plan.k_width + plan.v_width), float("nan"),
                       dtype=dtype)
    return plan, k_up, rope, cache


def fill(cache, block_table_row, latents):
    n = latents.shape[0]
    pos = torch.arange(n)
    slots = block_table_row[pos // BLOCK].long() * BLOCK + pos % BLOCK
    ops.write_latents(cache, latents[:, :24], latents[:, 24:], slots)


@pytest.mark.parametrize("neox,rotary_dim", [(True, 16), (False, 16), (True, 8)])
def test_decode_batch_matches_reference(neox, rotary_dim):
    plan, k_up, rope, cache = setup_case(neox, rotary_dim)
    lens = [5, 13, 9]
    perm = torch.randperm(24)
    tables = torch.zeros(3, 6, dtype=torch.int32)
    lat = {}
    used = 0
    for b, n in enumerate(lens):
        nb = (n + BLOCK - 1) // BLOCK
        tables[b, :nb] = perm[used:used + nb].to(torch.int32)  # non-contiguous blocks
        used += nb
        lat[b] = torch.randn(n, plan.k_width + plan.v_width)
        fill(cache, tables[b], lat[b])
    q = torch.randn(3, 8, 16)
    out = ops.decode_attention(plan, k_up, rope, 0.25, q, cache, tables,
                               torch.tensor(lens, dtype=torch.int32), max(lens))
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        ref = reference(plan, k_up, rope, 0.25, q[b:b + 1], lat[b], [n - 1])
        assert torch.allclose(out[b:b + 1].double(), ref, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_over_cached_context():
    plan, k_up, rope, cache = setup_case()
    n, ctx = 14, 6  # 6 tokens cached by an earlier chunk (or a prefix-cache hit)
    table = torch.tensor([7, 2, 19, 11], dtype=torch.int32)
    lat = torch.randn(n, plan.k_width + plan.v_width)
    fill(cache, table, lat)
    q = torch.randn(n - ctx, 8, 16)
    old = ops.PREFILL_QUERY_CHUNK
    ops.PREFILL_QUERY_CHUNK = 3  # exercise query chunking
    try:
        out = ops.prefill_attention(plan, k_up, rope, 0.3, q, cache, table, n)
    finally:
        ops.PREFILL_QUERY_CHUNK = old
    ref = reference(plan, k_up, rope, 0.3, q, lat, list(range(ctx, n)))
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_write_latents_skips_padding_and_casts():
    plan, _, _, _ = setup_case()
    cache = torch.zeros(4, 1, BLOCK, 40, dtype=torch.bfloat16)
    k = torch.randn(3, 24)
    v = torch.randn(3, 16)
    ops.write_latents(cache, k, v, torch.tensor([5, -1, 14]))
    assert torch.equal(cache[1, 0, 1], torch.cat([k[0], v[0]]).to(torch.bfloat16))
    assert torch.equal(cache[3, 0, 2], torch.cat([k[2], v[2]]).to(torch.bfloat16))
    assert int((cache != 0).any(-1).sum()) == 2  # the -1 slot wrote nothing


def test_rope_table_matches_vllm_rotary():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        _check_rope_against_vllm(get_rope)


def _check_rope_against_vllm(get_rope):
    for neox in (True, False):
        rotary = get_rope(64, max_position=128, rope_parameters={"rope_theta": 1e5, "rope_type": "default"},
                          is_neox_style=neox, dtype=torch.float32)
        table = RopeTable.from_rotary_module(rotary)
        pos = torch.randint(0, 128, (7,))
        k = torch.randn(7, 3, 64)
        ref, _ = rotary.forward_native(pos, k.reshape(7, -1).clone(), None)
        ours = table.rotate_(k.view(1, 7, 3, 64).clone(), pos)  # the attention path's RoPE
        assert torch.allclose(ours.reshape(7, -1), ref, atol=1e-5)


def test_post_rope_decode_and_prefill_score_in_latent_space():
    torch.manual_seed(3)
    shape = AttentionShape(hidden_size=32, num_heads=6, num_kv_heads=3, head_dim=16)
    plan = LayerPlan(shape, 1, k_ranks=(8, 16, 8), v_ranks=(8, 8, 16))
    rope = make_rope(16, 16, True)
    cache = torch.full((24, 1, BLOCK, plan.k_width + plan.v_width), float("nan"))
    n = 11
    table = torch.tensor([5, 17, 2], dtype=torch.int32)
    lat = torch.randn(n, plan.k_width + plan.v_width)
    pos = torch.arange(n)
    slots = table[pos // BLOCK].long() * BLOCK + pos % BLOCK
    ops.write_latents(cache, lat[:, :32], lat[:, 32:], slots)
    q = torch.randn(n, 6, 16)  # padded to max rank 16; head i uses r_k[group]
    ref = []
    for t in range(n):
        row = []
        for i in range(6):
            g = i // 2
            ko, rk = plan.k_offsets()[g], plan.k_ranks[g]
            vo, rv = plan.v_offsets()[g], plan.v_ranks[g]
            s = (lat[: t + 1, ko:ko + rk].double() @ q[t, i, :rk].double()) * 0.2
            row.append(torch.softmax(s, 0) @ lat[: t + 1, 32 + vo:32 + vo + rv].double())
        ref.append(torch.cat(row))
    ref = torch.stack(ref)
    out = ops.prefill_attention(plan, torch.zeros(0, 48), rope, 0.2, q, cache, table, n,
                                post_rope=True)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)
    dec = ops.decode_attention(plan, torch.zeros(0, 48), rope, 0.2, q[-1:], cache, table[None],
                               torch.tensor([n], dtype=torch.int32), n, post_rope=True)
    assert torch.allclose(dec.double(), ref[-1:], rtol=1e-4, atol=1e-5)


def _transform(plan, seed=1):
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(plan.shape.kv_width, generator=g)
    weight = 1 + 0.5 * torch.randn(plan.shape.head_dim, generator=g)
    return ops.KeyTransform(bias=bias, norm_weight=weight, norm_eps=1e-6), bias, (weight, 1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_key_bias_norm_and_window_decode(window):
    """Qwen2 key bias, Qwen3/Gemma QK-norm and a sliding window in decode; the
    blocks wholly before every window hold NaN, as vLLM's freed (null) blocks
    may, and must not leak into any output."""
    plan, k_up, rope, cache = setup_case()
    transform, bias, norm = _transform(plan)
    lens = [5, 13, 11]
    perm = torch.randperm(23) + 1  # block 0: the poisoned "null" block
    tables = torch.zeros(3, 6, dtype=torch.int32)
    lat, used = {}, 0
    for b, n in enumerate(lens):
        nb = (n + BLOCK - 1) // BLOCK
        tables[b, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        lat[b] = torch.randn(n, plan.k_width + plan.v_width)
        fill(cache, tables[b], lat[b])
        if window is not None:  # free the blocks before the window
            tables[b, :max(0, n - window) // BLOCK] = 0
    q = torch.randn(3, 8, 16)
    out = ops.decode_attention(plan, k_up, rope, 0.25, q, cache, tables,
                               torch.tensor(lens, dtype=torch.int32), max(lens),
                               transform=transform, window=window, min_seq_len=min(lens))
    assert torch.isfinite(out).all()
    for b, n in enumerate(lens):
        ref = reference(plan, k_up, rope, 0.25, q[b:b + 1], lat[b], [n - 1], bias, norm, window)
        assert torch.allclose(out[b:b + 1].double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_key_bias_norm_and_window_chunked_prefill(window):
    plan, k_up, rope, cache = setup_case()
    transform, bias, norm = _transform(plan, seed=2)
    n, ctx = 17, 9
    table = torch.tensor([7, 2, 19, 11, 5], dtype=torch.int32)
    lat = torch.randn(n, plan.k_width + plan.v_width)
    fill(cache, table, lat)
    if window is not None:  # vLLM frees blocks wholly before the chunk's first window
        table[:(ctx - window + 1) // BLOCK] = 0
    q = torch.randn(n - ctx, 8, 16)
    old = ops.PREFILL_QUERY_CHUNK
    ops.PREFILL_QUERY_CHUNK = 3
    try:
        out = ops.prefill_attention(plan, k_up, rope, 0.3, q, cache, table, n,
                                    transform=transform, window=window)
    finally:
        ops.PREFILL_QUERY_CHUNK = old
    ref = reference(plan, k_up, rope, 0.3, q, lat, list(range(ctx, n)), bias, norm, window)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_transform", [False, True])
def test_context_keys_in_bf16_match_a_float64_loop(with_transform):
    """The batched prefill's key rebuild (``context_keys``) in float32 and in
    bf16 (the dtype the GPU prefill passes: the GEMM on the tensor cores, keys
    rounded to bf16 before RoPE) against explicit float64 keys: float32 to
    1e-5; bf16 within four bf16 roundings (of the latents, of ``k_up``, of
    the GEMM's output and of RoPE's: 4 x 2^-9 of the key norm), the roundings
    stock vLLM's bf16 ``k_proj`` and RoPE make too."""
    plan, k_up, rope, _ = setup_case(neox=False, rotary_dim=16)
    transform, bias, norm = _transform(plan) if with_transform else (None, None, None)
    torch.manual_seed(3)
    n = 40
    lat = torch.randn(n, plan.k_width + plan.v_width)
    pos = torch.arange(100, 100 + n)
    d = plan.shape.head_dim
    want = torch.empty(n, plan.shape.num_kv_heads, d, dtype=torch.float64)
    for t in range(n):
        for j in range(plan.shape.num_kv_heads):
            g, jl = divmod(j, plan.group_size)
            ko, rk = plan.k_offsets()[g], plan.k_ranks[g]
            col = g * plan.group_width + jl * d
            k = lat[t, ko:ko + rk].double() @ k_up[ko:ko + rk, col:col + d].double()
            if bias is not None:
                k = k + bias[j * d:(j + 1) * d].double()
                k = k / torch.sqrt((k * k).mean() + norm[1]) * norm[0].double()
            want[t, j] = rotate64(k, int(pos[t]), rope)
    scale = want.norm(dim=-1, keepdim=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 4 * 2.0 ** -9)):
        got = ops.context_keys(plan, k_up, rope, lat, pos, False, transform, dtype=dtype)
        assert got.dtype == dtype and got.shape == want.shape
        err = ((got.double() - want).abs() / scale).max().item()
        assert err < tol, (dtype, err)


@pytest.mark.parametrize("slot_bytes", [312, 2808, 30, 6])
def test_gather_slots_reads_the_same_bytes_in_words(slot_bytes):
    """``gather_slots`` (8- or 4-byte words where they divide the slot, bytes
    otherwise) returns exactly the slots byte indexing returns, also from a
    cache that is a strided view (every other block of a larger buffer)."""
    from vllm_lowrank.attention.latent_attention import gather_slots

    g = torch.Generator().manual_seed(slot_bytes)
    raw = torch.randint(0, 256, (12, 1, 4, slot_bytes), dtype=torch.uint8, generator=g)
    for cache in (raw, raw[::2]):
        blocks = torch.randint(0, cache.shape[0], (3, 5), generator=g)
        offsets = torch.randint(0, 4, (3, 5), generator=g)
        got = gather_slots(cache, blocks, offsets)
        assert got.dtype == torch.uint8 and torch.equal(got, cache[blocks, 0, offsets])
