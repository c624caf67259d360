"""Calibration statistics from running a Hugging Face model on real text.

Per attention layer, accumulated over all calibration tokens (float64):

- ``sx`` ``[hidden, hidden]``: second moment ``X^T X`` of the k/v projection
  input (the whitening of SVD-LLM / Palu appendix K).
- ``sq`` ``[num_heads, head_dim, head_dim]``: pre-RoPE second moment of each
  query head (the query side of the K Q^T objective).
- ``dist`` ``[num_heads, window]``: attention mass at each query-key distance,
  ``sum_m p[m, m - delta]`` (the RoPE angle distribution the keys are seen at).
- ``gk``, ``gv`` ``[kv_width, kv_width]`` (``gradients=True``): second moment
  of the gradient of the summed next-token loss with respect to the k_proj and
  v_proj outputs, the output factor of the K-FAC approximation of the Fisher
  information (Martens & Grosse 2015, eq. 1-3): the expected loss increase
  from a projection error ``E`` is about ``tr(S_x E G E^T) / 2`` per token with
  ``S_x``, ``G`` the per-token means.

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
    sq: torch.Tensor | None = None
    dist: torch.Tensor | None = None
    gk: torch.Tensor | None = None
    gv: torch.Tensor | None = None
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


def collect_stats(model, windows: list[list[int]], *, queries: bool = False,
                  gradients: bool = False, query_module: str = "q_proj") -> list[LayerStats]:
    """Run ``model`` on each token window and accumulate :class:`LayerStats`.

    Args:
        model: Hugging Face causal LM with ``model.model.layers[i].self_attn``
            holding ``q_proj``/``k_proj``/``v_proj`` (eager attention, float32).
        windows: Token id lists (same length).
        queries: Collect ``sq`` and ``dist`` (query moments, attention distances).
        gradients: Collect ``gk`` and ``gv`` (one backward pass per window).
        query_module: Submodule of ``self_attn`` whose output is the pre-RoPE
            query (``q_proj``; ``q_norm`` for models with QK-norm).

    Returns:
        One :class:`LayerStats` per layer.
    """
    cfg = model.config
    layers = model.model.layers
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    kv_width = num_kv * head_dim
    length = len(windows[0])

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float64)

    stats = [
        LayerStats(
            sx=zeros(cfg.hidden_size, cfg.hidden_size),
            sq=zeros(num_heads, head_dim, head_dim) if queries else None,
            dist=zeros(num_heads, length) if queries else None,
            gk=zeros(kv_width, kv_width) if gradients else None,
            gv=zeros(kv_width, kv_width) if gradients else None,
        )
        for _ in layers
    ]

    def second_moment(buf: torch.Tensor, t: torch.Tensor) -> None:
        t = t.detach().reshape(-1, buf.shape[0]).double()
        buf += t.T @ t

    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        st = stats[i]

        def on_kv_input(_mod, args, st=st):
            second_moment(st.sx, args[0])
            st.tokens += args[0].reshape(-1, args[0].shape[-1]).shape[0]

        handles.append(attn.k_proj.register_forward_pre_hook(on_kv_input))
        if queries:
            def on_query(_mod, _args, out, st=st):
                q = out.detach().reshape(-1, num_heads, head_dim).double()
                st.sq += torch.einsum("thi,thj->hij", q, q)

            def on_attention(_mod, _args, out, st=st):
                probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                if probs is None:
                    raise RuntimeError("calibration needs eager attention probabilities")
                st.dist += _distance_mass(probs.detach())

            handles.append(getattr(attn, query_module).register_forward_hook(on_query))
            handles.append(attn.register_forward_hook(on_attention))
        if gradients:
            for proj, name in ((attn.k_proj, "gk"), (attn.v_proj, "gv")):
                def on_output(_mod, _args, out, buf=getattr(st, name)):
                    out.register_hook(lambda g, buf=buf: second_moment(buf, g))

                handles.append(proj.register_forward_hook(on_output))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        for ids in windows:
            ids_t = torch.tensor([ids])
            if not gradients:
                with torch.no_grad():
                    model(ids_t, use_cache=False)
                continue
            embeds = model.get_input_embeddings()(ids_t).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids_t[0, 1:],
                                                     reduction="sum")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.requires_grad_(True)
    return stats
