"""The Triton RoPE of rebuilt keys (``vllm_lowrank/kernels/triton/rope.py``) against a float64
rotation and the torch path of ``RopeTable.rotate_``.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (``conftest.py``) in
float32; on a CUDA machine in bf16 as well.

    python -P -m pytest tests/kernels/test_triton_rope.py -q
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from vllm_lowrank.attention.rope import RopeTable  # noqa: E402
from vllm_lowrank.kernels.triton.rope import rotate_keys  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")


def table(rotary_dim, neox, max_pos=300):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return RopeTable((1.1 * ang.cos()).float(), (1.1 * ang.sin()).float(), rotary_dim, neox)


def rotate64(keys, positions, rope):
    """Explicit pairwise rotation in float64 (``mscale`` 1.1 in the tables)."""
    x = keys.double().clone()
    out = x.clone()
    half = rope.rotary_dim // 2
    c = rope.cos.double()[positions][None, :, None, :]
    s = rope.sin.double()[positions][None, :, None, :]
    if rope.neox:
        i1, i2 = torch.arange(half), torch.arange(half) + half
    else:
        i1, i2 = 2 * torch.arange(half), 2 * torch.arange(half) + 1
    out[..., i1] = x[..., i1] * c - x[..., i2] * s
    out[..., i2] = x[..., i2] * c + x[..., i1] * s
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_keys_matches_float64(neox, rotary_dim, dtype):
    """Two batch rows of 37 positions (not in order, past 256), 3 heads of 64;
    with ``rotary_dim`` 32 the last 32 dims stay as they were. float32 agrees
    with float64 to 1e-6, bf16 to one rounding; the torch path agrees too."""
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip("bf16 Triton runs on a GPU")
    g = torch.Generator().manual_seed(rotary_dim + neox)
    rope = table(rotary_dim, neox)
    keys = torch.randn(2, 37, 3, 64, generator=g)
    positions = torch.randperm(300, generator=g)[:37]
    ref = rotate64(keys, positions, rope)
    dev_rope = RopeTable(rope.cos.to(DEV), rope.sin.to(DEV), rotary_dim, neox)
    got = rotate_keys(keys.clone().to(DEV, dtype), positions.to(DEV), dev_rope.cos, dev_rope.sin,
                      rotary_dim, neox).double().cpu()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    torch_path = rope.rotate_(keys.clone(), positions)  # CPU: the torch path
    assert (torch_path.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(got[..., rotary_dim:], keys.to(dtype).double()[..., rotary_dim:])


def test_rotate_keys_refuses_strided_heads():
    """A key tensor whose heads are not contiguous is refused, not misread."""
    rope = table(64, True)
    keys = torch.randn(1, 5, 3, 128)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        rotate_keys(keys, torch.arange(5), rope.cos, rope.sin, 64, True)
