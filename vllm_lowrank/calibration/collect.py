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


def progress(items, what: str):
    """``items`` with a progress bar on stderr (``tqdm``, ``what`` as its label)
    when stderr is a terminal; otherwise (a log, a Kubernetes Job) with an
    INFO line on the ``vllm.lowrank`` logger after each tenth of the items."""
    import sys

    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(items, desc=what, unit="window", leave=False)
    return _logged(list(items), what)


def _logged(items: list, what: str):
    import logging
    import time

    log = logging.getLogger("vllm.lowrank")
    t0 = time.monotonic()
    step = max(1, len(items) // 10)
    for i, item in enumerate(items, 1):
        yield item
        if i % step == 0 or i == len(items):
            log.info("vllm-lowrank: %s %d/%d (%.0f s)", what, i, len(items),
                     time.monotonic() - t0)


@dataclasses.dataclass
class LayerStats:
    """Accumulated statistics of one layer (see module docstring)."""

    sx: torch.Tensor
    sq: torch.Tensor | None = None
    dist: torch.Tensor | None = None
    gk: torch.Tensor | None = None
    gv: torch.Tensor | None = None
    tokens: int = 0


def distance_mass(p: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, L]`` causal probabilities -> ``[H, L]`` mass per distance."""
    b, h, length, _ = p.shape
    m = torch.arange(length, device=p.device)
    delta = (m[:, None] - m[None, :]).clamp_min(0).reshape(-1)
    flat = p.float().sum(0).reshape(h, -1)
    out = torch.zeros(h, length, dtype=torch.float64, device=p.device)
    out.scatter_add_(1, delta.expand(h, -1), flat.double())
    return out


def collect_stats(model, windows: list[list[int]], *, queries: bool = False,
                  gradients: bool = False, query_module: str = "q_proj") -> list[LayerStats]:
    """Run ``model`` on each token window and accumulate :class:`LayerStats`.

    Args:
        model: Hugging Face causal LM with ``model.model.layers[i].self_attn``
            holding ``q_proj``/``k_proj``/``v_proj`` (eager attention), on any
            device and in any float dtype.
        windows: Token id lists (same length).
        queries: Collect ``sq`` and ``dist`` (query moments, attention distances).
        gradients: Collect ``gk`` and ``gv`` (one backward pass per window).
        query_module: Submodule of ``self_attn`` whose output is the pre-RoPE
            query (``q_proj``; ``q_norm`` for models with QK-norm).

    Returns:
        One :class:`LayerStats` per layer, float64 on the model's device.
    """
    cfg = model.config
    device = model.device
    layers = model.model.layers
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    kv_width = num_kv * head_dim
    length = len(windows[0])

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float64, device=device)

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
                st.dist += distance_mass(probs.detach())

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
        for ids in progress(windows, "calibration windows"):
            ids_t = torch.tensor([ids], device=device)
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


def collect_projected(model, windows: list[list[int]],
                      projections: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Project every layer's k/v projection input onto given columns.

    Used to measure how the cache's quantizer treats real latents
    (:mod:`vllm_lowrank.factorization.budget`).

    Args:
        model: Hugging Face causal LM (as for :func:`collect_stats`).
        windows: Token id lists; their positions are concatenated in order.
        projections: ``{layer: [hidden, m]}`` float columns (e.g. the full
            key and value down-projections ``A`` of every head group).

    Returns:
        ``{layer: [sum(len(w)), m]}`` float32 on the CPU, ``x @ projections[layer]``
        for every position of every window.
    """
    device = model.device
    projections = {i: p.to(device, torch.float32) for i, p in projections.items()}
    out: dict[int, list[torch.Tensor]] = {i: [] for i in projections}
    handles = []
    for i, layer in enumerate(model.model.layers):
        if i not in projections:
            continue

        def on_kv_input(_mod, args, i=i):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            out[i].append((x @ projections[i]).cpu())

        handles.append(layer.self_attn.k_proj.register_forward_pre_hook(on_kv_input))
    try:
        with torch.no_grad():
            for ids in progress(windows, "projected windows"):
                model(torch.tensor([ids], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: torch.cat(parts) for i, parts in out.items()}


def collect_far_gradients(model, windows: list[list[int]], *, sink: int, recent: int,
                          inv_freq, neox: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Second moments of the loss gradient with respect to the keys and values
    that a token-adaptive cache reads from latents.

    In the token-adaptive mode a query at position ``s`` reads key/value ``t``
    exactly when ``t < sink`` or ``s - t < recent``, and from the latent cache
    otherwise. Each layer's attention adds a zero perturbation to the keys and
    values that only the latent-read entries see, so the gradient with respect
    to it is the sensitivity of the loss to the latents' errors (the K-FAC output factor ``G`` of
    :func:`collect_stats`, restricted to what the cache approximates). Key
    gradients are rotated back to pre-RoPE coordinates (``R_t^T g``; the
    rotation is orthogonal), where the latents live.

    Args:
        model: Hugging Face Llama-style causal LM (keys go straight from
            ``k_proj`` to RoPE: no QK-norm), on any device and in any float dtype.
        windows: Token id lists (same length).
        sink, recent: Exact positions of the cache (tokens).
        inv_freq: ``inv_freq(layer) -> [rot/2]`` RoPE inverse frequencies.
        neox: RoPE pair layout.

    Returns:
        Per layer ``(gk, gv)``, ``[kv_width, kv_width]`` float64 per-position
        means, on the CPU.

    Raises:
        LowRankConfigError: the model has QK-norm (not supported here).
    """
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import repeat_kv

    from vllm_lowrank.config import LowRankConfigError

    layers = model.model.layers
    if any(hasattr(la.self_attn, "k_norm") for la in layers):
        raise LowRankConfigError("byte-budget allocation with exact tokens supports "
                                 "Llama-style attention without QK-norm")
    leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def far_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                      **kwargs):
        # zero perturbations seen by the latent-read entries only: their
        # gradients are the sensitivities, and every other path stays intact
        dk = torch.zeros_like(key, requires_grad=True)
        dv = torch.zeros_like(value, requires_grad=True)
        leaves[module.layer_idx] = (dk, dv)
        kf, vf = key + dk, value + dv
        n = module.num_key_value_groups
        length = key.shape[2]
        pos = torch.arange(length, device=key.device)
        far = ((pos[:, None] - pos[None, :]) >= recent) & (pos[None, :] >= sink)
        s_near = query @ repeat_kv(key, n).transpose(2, 3)
        s_far = query @ repeat_kv(kf, n).transpose(2, 3)
        # one unpadded window per call: causal by construction (the mask format
        # HF passes to a custom attention function is not relied on)
        s = torch.where(far, s_far, s_near) * scaling
        s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        p = torch.softmax(s.float(), dim=-1).to(query.dtype)
        out = (torch.where(far, p, 0) @ repeat_kv(vf, n)
               + torch.where(far, 0, p) @ repeat_kv(value, n))
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("lowrank_far", far_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("lowrank_far")
    num_kv = layers[0].self_attn.config.num_key_value_heads
    head_dim = layers[0].self_attn.head_dim
    device = model.device
    sums = [tuple(torch.zeros(num_kv * head_dim, num_kv * head_dim, dtype=torch.float64,
                              device=device) for _ in range(2))
            for _ in layers]
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    tokens = 0
    try:
        for ids in progress(windows, "gradient windows"):
            ids_t = torch.tensor([ids], device=device)
            leaves.clear()
            logits = model(ids_t, use_cache=False).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits.float(), ids_t[0, 1:],
                                                     reduction="sum")
            grads = torch.autograd.grad(loss, [t for i in sorted(leaves) for t in leaves[i]])
            for i in sorted(leaves):
                gk, gv = grads[2 * i][0], grads[2 * i + 1][0]  # [kv, T, d]
                gk = unrotate_gradient(gk, inv_freq(i), neox)
                for buf, g in zip(sums[i], (gk, gv)):
                    flat = g.transpose(0, 1).reshape(g.shape[1], -1).double()
                    buf += flat.T @ flat
            tokens += len(ids)
    finally:
        model.set_attn_implementation(previous)
        for p in params:
            p.requires_grad_(True)
    return [((gk / tokens).cpu(), (gv / tokens).cpu()) for gk, gv in sums]


def unrotate_gradient(g: torch.Tensor, inv_freq: torch.Tensor, neox: bool) -> torch.Tensor:
    """``R_t^T g_t`` for ``g [..., T, d]``: the inverse RoPE rotation of each
    position (dimensions past ``2 * len(inv_freq)`` are not rotated)."""
    from vllm_lowrank.factorization.bases import rope_tables

    cos, sin, p = rope_tables(g.shape[-2], inv_freq, g.shape[-1], neox)
    x = g.double()
    # forward y = R x with R = diag(cos) + diag(sin) P; R^T g = g cos + P^T (g sin)
    return x * cos - (x * sin) @ p.T
