"""CUDA dequant + latent-matmul kernels (``csrc/latent_dequant.cu``), built lazily.

The extension is compiled on first use with ``torch.utils.cpp_extension.load``
(ninja, ``-gencode`` for the current GPU's architecture, e.g. ``sm_90`` on Hopper,
``sm_80`` on Ampere) into torch's extension cache, and reused afterwards. Nothing
is built or imported at package import time.

Kernels (quantized cache of :class:`vllm_lowrank.quantization.SlotLayout`):

- :func:`latent_scores` -- post-RoPE mode scores ``scale * q~ . deq(c_k)``, where no
  RoPE sits between the latent and the product;
- :func:`latent_pv` -- the value path ``sum_t p_t deq(c_v[t])`` (output stays in the
  value latent space, as in the fused Triton kernel);
- :func:`post_rope_decode` -- the two composed around a float32 softmax (a reference
  decode path for the post-RoPE mode on a quantized cache).

Example::

    from vllm_lowrank import cuda_ext
    s = cuda_ext.latent_scores(q_lat, cache_u8, block_table, seq_lens, max_len,
                               plan, layout, scale)       # [B, H, max_len]
    o = cuda_ext.latent_pv(s.softmax(-1), cache_u8, block_table, seq_lens,
                           plan, layout)                   # [B, out_width]
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

_EXT = None
_NAME = "vllm_lowrank_cuda"
_SOURCES = ("latent_dequant.cu",)


def source_dir() -> Path:
    """``csrc/`` of the source checkout (next to the ``vllm_lowrank`` package)."""
    return Path(__file__).resolve().parents[1] / "csrc"


def load(verbose: bool = False):
    """Build (first call) and import the extension.

    Raises:
        RuntimeError: no CUDA device, no CUDA toolkit (nvcc / CUDA_HOME), no ninja,
            or the ``csrc/`` sources are missing; the message names the fix.
    """
    global _EXT
    if _EXT is not None:
        return _EXT
    if not torch.cuda.is_available():
        raise RuntimeError(
            "vllm_lowrank.cuda_ext needs a CUDA device (torch.cuda.is_available() is "
            "False); on CPU use SlotLayout.decode with the torch path in "
            "vllm_lowrank.attention.latent_attention")
    if torch.version.cuda is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) is a CPU build; install a CUDA build of "
            "torch to build vllm_lowrank's CUDA kernels")
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc") or (
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None)
    if nvcc is None or not os.path.exists(nvcc):
        raise RuntimeError(
            "nvcc not found: install the CUDA toolkit matching torch.version.cuda="
            f"{torch.version.cuda} and put its bin/ on PATH or set CUDA_HOME")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as exc:
        raise RuntimeError("ninja is required to build vllm_lowrank's CUDA kernels: "
                           "pip install ninja") from exc
    src = source_dir()
    missing = [s for s in _SOURCES if not (src / s).exists()]
    if missing:
        raise RuntimeError(
            f"CUDA sources {missing} not found under {src}: the kernels build from a "
            "source checkout (pip install -e .); reinstall from the repository")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    flags = ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
             "--use_fast_math"]
    try:
        _EXT = cpp_extension.load(
            name=f"{_NAME}_sm{arch}", sources=[str(src / s) for s in _SOURCES],
            extra_cuda_cflags=flags, extra_cflags=["-O3"], verbose=verbose)
    except Exception as exc:  # compiler errors, wrong toolkit for this GPU, ...
        raise RuntimeError(
            f"building {_NAME} from {src} failed ({type(exc).__name__}: {exc}); check "
            "that nvcc supports sm_" + arch + " and matches torch.version.cuda="
            f"{torch.version.cuda}") from exc
    return _EXT


def group_table(plan, layout, side: str) -> torch.Tensor:
    """int32 ``[num_groups, 6]`` rows ``(code byte offset, first scale/zero index,
    rank, channels per scale/zero, first output column, 0)`` of ``side`` 'k' or 'v'."""
    from vllm_lowrank.quantization import packed_bytes

    if side == "k":
        ranks, groups, bits, off = plan.k_ranks, layout.k_groups, layout.k_bits, 0
    else:
        ranks, groups, bits, off = plan.v_ranks, layout.v_groups, layout.v_bits, \
            layout.v_codes_offset
    if tuple(ranks) != tuple(layout.k_ranks if side == "k" else layout.v_ranks):
        raise ValueError("layout ranks do not match the plan")
    rows, par = [], 0
    hg = plan.heads_per_group
    for r, q, vo in zip(ranks, groups, plan.v_offsets()):
        rows.append([off, par, r, q, hg * vo if side == "v" else 0, 0])
        off += packed_bytes(r, bits)
        par += r // q
    return torch.tensor(rows, dtype=torch.int32)


_TABLES: dict = {}


def _table(plan, layout, side, device):
    key = (plan, layout.k_ranks, layout.v_ranks, layout.k_bits, layout.v_bits,
           layout.k_groups, layout.v_groups, side, str(device))
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = group_table(plan, layout, side).to(device)
    return t


def latent_scores(q, kv_cache, block_table, seq_lens, max_seq_len, plan, layout, scale,
                  tokens_per_block: int = 128):
    """``[B, H, max_seq_len]`` float32 scores ``scale * q~[b, h, :r_k] . deq(c_k[b, t])``;
    ``-inf`` at ``t >= seq_len``. ``q``: ``[B, H, >= max r_k]`` latent-basis queries."""
    ext = load()
    return ext.latent_scores(
        q.float().contiguous(), kv_cache, block_table, seq_lens,
        _table(plan, layout, "k", q.device), layout.k_bits, layout.k_scale_offset,
        layout.k_zero_offset, plan.heads_per_group, int(max_seq_len), float(scale),
        tokens_per_block)


def latent_pv(p, kv_cache, block_table, seq_lens, plan, layout, tokens_per_block: int = 256):
    """``[B, out_width]`` float32 ``sum_t p[b, h, t] deq(c_v[b, t])`` in the output
    column layout of the plan (``p``: ``[B, H, >= max seq_len]``)."""
    ext = load()
    return ext.latent_pv(
        p.float().contiguous(), kv_cache, block_table, seq_lens,
        _table(plan, layout, "v", p.device), layout.v_bits, layout.v_scale_offset,
        layout.v_zero_offset, plan.heads_per_group, plan.out_width, tokens_per_block)


def post_rope_decode(q, kv_cache, block_table, seq_lens, max_seq_len, plan, layout, scale):
    """Post-RoPE decode on a quantized cache: CUDA scores, float32 softmax, CUDA
    value path. ``[B, out_width]`` float32."""
    s = latent_scores(q, kv_cache, block_table, seq_lens, max_seq_len, plan, layout, scale)
    return latent_pv(torch.softmax(s, dim=-1), kv_cache, block_table, seq_lens, plan, layout)
