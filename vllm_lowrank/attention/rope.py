"""RoPE applied to keys rebuilt from latents.

Keys are cached before RoPE (position-free latents) and rotated at attention
time, so the backend needs the model's own rotation: the same cos/sin table as
vLLM's rotary module (``RotaryEmbedding._compute_cos_sin_cache``, which covers
Llama-3, linear, NTK and YaRN scaling), in float32, shared by all layers that
use the same rotary module.
"""

from __future__ import annotations

import dataclasses

import torch


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
        cache = rotary._compute_cos_sin_cache().float()
        if device is not None:
            cache = cache.to(device)
        cos, sin = cache.chunk(2, dim=-1)
        return cls(cos.contiguous(), sin.contiguous(), int(rotary.rotary_dim),
                   bool(rotary.is_neox_style))

    @property
    def inv_freq_angles(self) -> torch.Tensor:
        """Angle per position of each pair at position 1 (radians), ``[rot/2]``."""
        return torch.atan2(self.sin[1], self.cos[1])

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate the leading ``rotary_dim`` dims of ``x`` (float32).

        Args:
            x: ``[..., P, H, head_dim]`` keys; ``P`` positions.
            positions: ``[P]`` int64 token positions.

        Returns:
            Rotated tensor, same shape, float32.
        """
        x = x.float()
        cos = self.cos.index_select(0, positions)[:, None, :]  # [P, 1, rot/2]
        sin = self.sin.index_select(0, positions)[:, None, :]
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            out = out.flatten(-2)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out


_TABLES: dict[tuple[int, str], RopeTable] = {}


def rope_table_for(rotary, device: torch.device) -> RopeTable:
    """The shared :class:`RopeTable` of ``rotary`` on ``device`` (built once)."""
    key = (id(rotary), str(device))
    table = _TABLES.get(key)
    if table is None:
        table = RopeTable.from_rotary_module(rotary, device)
        _TABLES[key] = table
    return table
