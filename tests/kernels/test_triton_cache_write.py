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
from vllm_lowrank.triton_kernels.cache_write import supports, write_packed_latents  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")

LAYOUTS = {
    "equal-k8v4": dict(k_ranks=(32, 32), v_ranks=(32, 32), k_bits=8, v_bits=4),
    "uneven-k4v3": dict(k_ranks=(24, 40, 64), v_ranks=(16, 48, 8), k_bits=4, v_bits=3),
    "groups-k2v4": dict(k_ranks=(32, 64), v_ranks=(64, 32), k_bits=2, v_bits=4,
                        k_group=16, v_group=32),
    "channel-keys": dict(k_ranks=(32, 16), v_ranks=(24, 24), k_bits=4, v_bits=4,
                         k_channel_tokens=8),
    "padded": dict(k_ranks=(16,), v_ranks=(16,), k_bits=3, v_bits=8, pad_to=52),
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
