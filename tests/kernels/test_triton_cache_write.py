"""The fused quantize-on-write kernel against the torch encode and scatter.

Under ``TRITON_INTERPRET=1`` (``conftest.py``) on CPU; on a CUDA machine the
compiled kernel. The cache must hold exactly the bytes of
``layout.encode`` + ``scatter_rows``, untouched slots unchanged.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllm_lowrank.attention.latent_attention import scatter_rows  # noqa: E402
from vllm_lowrank.format.latent import SlotLayout  # noqa: E402
from vllm_lowrank.kernels.triton.cache_write import supports, write_packed_latents  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")

LAYOUTS = {
    "equal-k8v4": dict(k_ranks=(32, 32), v_ranks=(32, 32), k_bits=8, v_bits=4),
    "uneven-k4v3": dict(k_ranks=(24, 40, 64), v_ranks=(16, 48, 8), k_bits=4, v_bits=3),
    "groups-k2v4": dict(k_ranks=(32, 64), v_ranks=(64, 32), k_bits=2, v_bits=4,
                        k_group=16, v_group=32),
    "channel-keys": dict(k_ranks=(32, 16), v_ranks=(24, 24), k_bits=4, v_bits=4,
                         k_channel_tokens=8),
    # the 4x preset's sides: per-channel keys, 2-bit values
    "channel-keys-v2": dict(k_ranks=(64, 64), v_ranks=(64, 64), k_bits=4, v_bits=2,
                            k_channel_tokens=8),
    "padded": dict(k_ranks=(16,), v_ranks=(16,), k_bits=3, v_bits=8, pad_to=52),
    # 2-bit sides of uneven head groups, 24 to 128 channels
    "uneven-k2v2": dict(k_ranks=(32, 64), v_ranks=(40, 128, 24), k_bits=2, v_bits=2),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_write_matches_torch_encode(name, dtype):
    layout = SlotLayout(**LAYOUTS[name])
    assert supports(layout)
    g = torch.Generator().manual_seed(1)
    t, blocks, page = 11, 6, 4
    rk, rv = sum(layout.k_ranks), sum(layout.v_ranks)
    # key latents as a strided view of a wider row (the token-adaptive layers
    # pass key[:, :rk]); a constant group (scale 0) and outliers
    key = (torch.randn(t, rk + 8, generator=g) * 3).to(dtype)
    key[2, :8] = 0.5
    key[5, 3] = 40.0
    value = torch.randn(t, rv, generator=g).to(dtype)
    # block 0 is vLLM's null block: never a token's slot (scatter_rows parks
    # padding rows there)
    slots = page + torch.randperm((blocks - 1) * page, generator=g)[:t].long()
    slots[4] = -1  # padding token
    slots[9] = -1
    cache0 = torch.randint(0, 256, (blocks, 1, page, layout.slot_bytes), generator=g,
                           dtype=torch.uint8)
    ref = cache0.clone()
    scatter_rows(ref, layout.encode(key[:, :rk].float(), value.float()), slots)
    got = cache0.to(DEV)
    write_packed_latents(got, key[:, :rk].to(DEV), value.to(DEV), slots.to(DEV), layout)
    got = got.cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:8]


def test_refuses_raw_side():
    layout = SlotLayout((16,), (16,), 16, 4)
    assert not supports(layout)
    cache = torch.zeros(2, 1, 4, layout.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="packed sides"):
        write_packed_latents(cache, torch.randn(1, 16), torch.randn(1, 16),
                             torch.zeros(1, dtype=torch.long), layout)


# --- token-adaptive layers: the exact slots and the per-channel key groups ---

def _slots(g, n, blocks, page):
    """``n`` distinct slots outside block 0 (vLLM's null block)."""
    return page + torch.randperm((blocks - 1) * page, generator=g)[:n].long()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("staged", [True, False])
def test_exact_write_matches_torch_encode(dtype, staged):
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.kernels.triton.cache_write import supports_exact, write_exact_slots

    rk = 48
    # room for a wider staged latent than this layer's, and padding to a latent slot
    slot = ExactSlot(kv_width=64, head_dim=32, dtype=dtype, bits=8,
                     staged_width=rk if staged else 0, latent_slot_bytes=44, staged_room=56)
    assert supports_exact(slot)
    g = torch.Generator().manual_seed(3)
    t, blocks, page = 13, 5, 8
    key = (torch.randn(t, rk + 64, generator=g) * 2).to(dtype)  # [c_k | k], as the backend
    value = torch.randn(t, 64, generator=g).to(dtype)
    value[3, :32] = -1.25  # a constant head: scale 0
    key[6, rk + 5] = 30.0
    slots = _slots(g, t, blocks, page)
    slots[2] = slots[11] = -1
    cache0 = torch.randint(0, 256, (blocks, 1, page, slot.slot_bytes), generator=g,
                           dtype=torch.uint8)
    stage = key[:, :rk] if staged else None
    ref = cache0.clone()
    scatter_rows(ref, slot.encode(key[:, rk:], value, stage), slots)
    got = cache0.to(DEV)
    write_exact_slots(got, slot, key[:, rk:].to(DEV), value.to(DEV), slots.to(DEV),
                      None if stage is None else stage.to(DEV))
    got = got.cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:8]


KEY_GROUPS = {
    # k ranks, v ranks, k bits, G, latent page, exact page
    "k4-g8": ((32, 16), (24, 24), 4, 8, 16, 8),
    "k2-g4": ((24,), (16,), 2, 4, 8, 16),
    "k3-g16-three-programs": ((96, 72), (40,), 3, 16, 32, 16),  # 168 channels
    "k8-g32-odd-share": ((40,), (8,), 8, 32, 32, 32),  # 5 share bytes: halves straddle slots
    "k4-g64-share-padding": ((24,), (8,), 4, 64, 64, 128),  # 2 x 64 bytes for 96: 32 zero
}


POST_ROPE_KEY_GROUPS = {
    # post-RoPE keys: the key latent is the exact key (64 channels), nothing staged
    "post-rope-k4-g8-int8-exact": ((32, 32), (16, 16), 4, 8, 16, 8, 8),
    "post-rope-k2-g16-16bit-exact": ((64,), (24,), 2, 16, 16, 32, 16),
}


@pytest.mark.parametrize("name", sorted(KEY_GROUPS) + sorted(POST_ROPE_KEY_GROUPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_group_write_matches_torch(name, dtype):
    """Sequences at random lengths, each with its latent and exact slots on
    shuffled blocks; one step writes the last token of each (a decode step)
    or the last ``2 G + 3`` (a prefill chunk), plus padding tokens. Only the
    tokens that end a group write anything; the torch path of
    ``token_adaptive.write_key_groups`` is the reference. Post-RoPE keys
    (``post_rope_keys``) stage nothing: the groups are quantized from the exact
    keys, int8 or 16-bit."""
    from vllm_lowrank.attention import token_adaptive as tale
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.kernels.triton.cache_write import supports_key_groups, write_key_groups

    post_rope = name in POST_ROPE_KEY_GROUPS
    k_ranks, v_ranks, bits, grp, page, epage, *exact_bits = (
        POST_ROPE_KEY_GROUPS if post_rope else KEY_GROUPS)[name]
    layout = SlotLayout(k_ranks, v_ranks, bits, 4, k_channel_tokens=grp)
    rk = sum(k_ranks)
    slot = ExactSlot(kv_width=64, head_dim=32, dtype=dtype, bits=exact_bits[0] if post_rope
                     else 8, staged_width=0 if post_rope else rk,
                     latent_slot_bytes=layout.slot_bytes)
    assert supports_key_groups(layout, slot)
    g = torch.Generator().manual_seed(7)
    lens = [grp * 3, grp * 2 + 1, grp * 4 - 1, grp, 5 * grp + 2]
    nb = [-(-n // page) + 1 for n in lens]
    nbe = [-(-n // epage) + 1 for n in lens]
    cache0 = torch.randint(0, 256, (sum(nb) + 1, 1, page, layout.slot_bytes), generator=g,
                           dtype=torch.uint8)
    exact = torch.randint(0, 256, (sum(nbe) + 1, 1, epage, slot.slot_bytes), generator=g,
                          dtype=torch.uint8)
    lat_perm, ex_perm = torch.randperm(sum(nb), generator=g) + 1, \
        torch.randperm(sum(nbe), generator=g) + 1
    for step in ("decode", "prefill"):
        lat_slots, ex_slots = [], []
        used = used_e = 0
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            lat = lat_perm[used:used + nb[b]][pos // page] * page + pos % page
            ex = ex_perm[used_e:used_e + nbe[b]][pos // epage] * epage + pos % epage
            used, used_e = used + nb[b], used_e + nbe[b]
            # every position's key latent staged (the earlier steps wrote them)
            tale.write_exact(exact, slot, (torch.randn(n, 64, generator=g) * 3).to(dtype),
                             torch.randn(n, 64, generator=g).to(dtype), ex,
                             None if post_rope else
                             (torch.randn(n, rk, generator=g) * 3).to(dtype))
            take = 1 if step == "decode" else min(n, 2 * grp + 3)
            lat_slots.append(lat[n - take:])
            ex_slots.append(ex[n - take:])
        pad = torch.full((3,), -1, dtype=torch.long)
        lat_t = torch.cat([*lat_slots, pad])
        ex_t = torch.cat([*ex_slots, pad])
        ref = cache0.clone()
        tale.write_key_groups(ref, exact, slot, lat_t, ex_t, layout)  # CPU: the torch path
        assert not torch.equal(ref, cache0)  # some group ended in this step
        got = cache0.to(DEV)
        write_key_groups(got, exact.to(DEV), slot, lat_t.to(DEV), ex_t.to(DEV), layout)
        got = got.cpu()
        assert torch.equal(got, ref), (step, (got != ref).nonzero()[:8])
