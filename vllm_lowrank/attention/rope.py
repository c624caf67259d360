"""RoPE applied to keys rebuilt from latents.

Keys are cached before RoPE (position-free latents) and rotated at attention
time, so the backend needs the model's own rotation: the same cos/sin table as
vLLM's rotary module (:func:`vllm_lowrank.compat.rotary_cos_sin`, which covers
Llama-3, linear, NTK and YaRN scaling), in float32, shared by all layers that
use the same rotary module.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from vllm_lowrank import compat


@dataclasses.dataclass(frozen=True)
class RopeTable:
    """float32 ``cos``/``sin`` tables of one rotary module.

    Attributes:
        cos: ``[max_positions, rotary_dim // 2]`` float32.
        sin: ``[max_positions, rotary_dim // 2]`` float32.
        rotary_dim: Leading dimensions of each head that are rotated.
        neox: True for the half-split (neox) pair layout, False for gptj
            (interleaved pairs).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    neox: bool

    @classmethod
    def from_rotary_module(cls, rotary, device: torch.device | None = None) -> RopeTable:
        """Build from a vLLM ``RotaryEmbedding`` (float32 recomputation of its
        ``cos_sin_cache``, so no bf16 rounding of the angles)."""
        cache = compat.rotary_cos_sin(rotary).float()
        if device is not None:
            cache = cache.to(device)
        cos, sin = cache.chunk(2, dim=-1)
        return cls(cos.contiguous(), sin.contiguous(), int(rotary.rotary_dim),
                   bool(rotary.is_neox_style))

    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        """``P x`` per head (last dim = head_dim): neox ``[-x2, x1]``, gptj
        ``(-x_{2i+1}, x_{2i})`` on the rotary dims, zero on the others."""
        rot = self.rotary_dim
        if rot == x.shape[-1]:  # full rotary: one pass, no zero fill
            if self.neox:
                x1, x2 = x.chunk(2, dim=-1)
                return torch.cat((x2.neg(), x1), dim=-1)
            return torch.stack((x[..., 1::2].neg(), x[..., 0::2]), dim=-1).flatten(-2)
        out = torch.zeros_like(x)
        if self.neox:
            half = rot // 2
            out[..., :half] = -x[..., half:rot]
            out[..., half:rot] = x[..., :half]
        else:
            out[..., 0:rot:2] = -x[..., 1:rot:2]
            out[..., 1:rot:2] = x[..., 0:rot:2]
        return out

    def full_tables(self, head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, s)`` ``[P, head_dim]`` float32 with ``R_t x = x*c + (P x)*s``:
        the pair's cos/sin on both dims of each rotary pair, 1/0 elsewhere."""
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        if self.neox:
            c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        else:
            c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        extra = head_dim - self.rotary_dim
        if extra:
            c = torch.cat([c, c.new_ones(c.shape[0], extra)], -1)
            s = torch.cat([s, s.new_zeros(s.shape[0], extra)], -1)
        return c, s

    def rebuild_rotated(self, latent: torch.Tensor, up: torch.Tensor, positions: torch.Tensor,
                        head_dim: int) -> torch.Tensor:
        """``R_t (latent_t @ up)`` per head: one GEMM, then RoPE as
        ``k*c + rotate_half(k)*s`` in place (fewer passes than a
        split/multiply/cat chain; a second GEMM for the rotate-half was slower
        on CPU, where this GEMM is compute-bound).

        Args:
            latent: ``[B, L, r]`` latents at ``positions`` (float32, or
                bf16/fp16 for a tensor-core GEMM).
            up: ``[r, G * head_dim]`` up-projection, ``latent``'s dtype.
            positions: ``[L]`` int64.
            head_dim: Width of one head.

        Returns:
            ``[B, L, G, head_dim]`` rotated keys in ``latent``'s dtype.
        """
        g = up.shape[1] // head_dim
        b, length = latent.shape[0], latent.shape[1]
        return self.rotate_((latent @ up).view(b, length, g, head_dim), positions)

    def rotate_(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of ``keys [B, L, G, head_dim]`` at ``positions [L]``, in place
        (returns ``keys``): computed against the float32 tables. On CUDA one
        Triton launch (:func:`vllm_lowrank.kernels.triton.rope.rotate_keys`,
        float32 math rounded once to ``keys``' dtype); elsewhere torch, each
        product rounded to ``keys``' dtype (float32, or bf16/fp16 keys)."""
        if keys.is_cuda and keys.is_contiguous():
            from vllm_lowrank.kernels.triton.rope import rotate_keys

            return rotate_keys(keys, positions, self.cos, self.sin, self.rotary_dim, self.neox)
        keys_rh = self.rotate_half(keys)
        c, s = self.full_tables(keys.shape[-1], positions)
        keys.mul_(c[:, None, :])
        keys.addcmul_(keys_rh, s[:, None, :])
        return keys


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""``{rotary module: {device: RopeTable}}``: an entry lives as long as its
module (a new module at a reused address never hits an old table)."""


def rope_table_for(rotary, device: torch.device) -> RopeTable:
    """The shared :class:`RopeTable` of ``rotary`` on ``device`` (built once)."""
    per_device = _TABLES.setdefault(rotary, {})
    table = per_device.get(str(device))
    if table is None:
        table = RopeTable.from_rotary_module(rotary, device)
        per_device[str(device)] = table
    return table
