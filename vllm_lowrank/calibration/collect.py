"""Calibration statistics from running a Hugging Face model on real text.

Per attention layer, accumulated over all calibration tokens (float64):

- ``sx`` ``[hidden, hidden]``: second moment ``X^T X`` of the k/v projection
  input (the whitening of SVD-LLM / Palu appendix K).
- ``sq`` ``[num_heads, head_dim, head_dim]``: pre-RoPE second moment of each
  query head (the query side of the K Q^T objective).
- ``dist`` ``[num_heads, window]``: attention mass at each query-key distance,
  ``sum_m p[m, m - delta]`` (the RoPE angle distribution the keys are seen at).

The model runs with eager attention so the probabilities are observable; hooks
read them layer by layer, so memory stays at one layer's ``heads x L x L``.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class LayerStats:
    """Accumulated statistics of one layer (see module docstring)."""

    sx: torch.Tensor
    sq: torch.Tensor
    dist: torch.Tensor
    tokens: int = 0


def _distance_mass(p: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, L]`` causal probabilities -> ``[H, L]`` mass per distance."""
    b, h, length, _ = p.shape
    m = torch.arange(length)
    delta = (m[:, None] - m[None, :]).clamp_min(0).reshape(-1)
    flat = p.float().sum(0).reshape(h, -1)
    out = torch.zeros(h, length, dtype=torch.float64)
    out.scatter_add_(1, delta.expand(h, -1), flat.double())
    return out


def collect_stats(model, windows: list[list[int]], query_module: str = "q_proj") -> list[LayerStats]:
    """Run ``model`` on each token window and accumulate :class:`LayerStats`.

    Args:
        model: Hugging Face causal LM with ``model.model.layers[i].self_attn``
            holding ``q_proj``/``k_proj`` (eager attention, float32).
        windows: Token id lists (same length).
        query_module: Submodule of ``self_attn`` whose output is the pre-RoPE
            query (``q_proj``; ``q_norm`` for models with QK-norm).

    Returns:
        One :class:`LayerStats` per layer.
    """
    cfg = model.config
    layers = model.model.layers
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    length = len(windows[0])
    stats = [
        LayerStats(
            sx=torch.zeros(cfg.hidden_size, cfg.hidden_size, dtype=torch.float64),
            sq=torch.zeros(num_heads, head_dim, head_dim, dtype=torch.float64),
            dist=torch.zeros(num_heads, length, dtype=torch.float64),
        )
        for _ in layers
    ]
    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        st = stats[i]

        def on_kv_input(_mod, args, st=st):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            st.sx += x.T @ x
            st.tokens += x.shape[0]

        def on_query(_mod, _args, out, st=st):
            q = out.detach().reshape(-1, num_heads, head_dim).double()
            st.sq += torch.einsum("thi,thj->hij", q, q)

        def on_attention(_mod, _args, out, st=st):
            probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if probs is None:
                raise RuntimeError("calibration needs eager attention probabilities")
            st.dist += _distance_mass(probs.detach())

        handles.append(attn.k_proj.register_forward_pre_hook(on_kv_input))
        handles.append(getattr(attn, query_module).register_forward_hook(on_query))
        handles.append(attn.register_forward_hook(on_attention))
    try:
        with torch.no_grad():
            for ids in windows:
                model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats
