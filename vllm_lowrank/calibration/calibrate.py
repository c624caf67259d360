"""Calibrate bases for a model: statistics on real text -> artifact.

``calibrate_model`` loads the Hugging Face checkpoint (eager attention; float32
on the CPU by default, or on a GPU in a 16-bit dtype: :mod:`.device`),
collects :mod:`~vllm_lowrank.calibration.collect` statistics on calibration text
and solves, for every layer, side and head group, the closed form of
:mod:`vllm_lowrank.factorization.bases` for the chosen ``method``.
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.calibration import text as texts
from vllm_lowrank.calibration.collect import LayerStats, collect_stats
from vllm_lowrank.calibration.device import check_memory, resolve_device, resolve_dtype
from vllm_lowrank.config import LOSS_METHODS, METHODS, LowRankConfigError
from vllm_lowrank.factorization.bases import (
    GroupBasis,
    output_aware_basis,
    pca_basis,
    rope_equivariant_basis,
    rope_query_metric,
    value_output_metric,
)

logger = logging.getLogger("vllm.lowrank")

CALIBRATION_VERSION = 1
"""Bumped whenever the statistics, closed forms or default text change
(invalidates cached ``artifact="auto"`` results)."""
WINDOW = 1024
"""Tokens per calibration window: distances up to 1023 inform the RoPE metric."""


def load_hf_model(model_path: str, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32):
    """Hugging Face causal LM (eager attention) on ``device`` in ``dtype``, and
    its tokenizer.

    Raises:
        LowRankConfigError: the path is not a loadable checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation="eager"
        )
    except (OSError, ValueError) as e:
        raise LowRankConfigError(f"cannot load {model_path!r} for calibration: {e}") from None
    model.to(device).eval()
    return model, tok


def load_for_calibration(model_path: str, device: str, dtype: str, *,
                         gradients: bool):
    """:func:`load_hf_model` after the checks of :mod:`.device`: the device
    exists and the run's estimated memory fits.

    Args:
        model_path: Hugging Face checkpoint directory.
        device: ``--device`` name (``cpu``, ``cuda``, ``cuda:N``).
        dtype: ``--dtype`` name (``float32``, ``bfloat16``, ``float16``).
        gradients: The run does backward passes (``fisher`` statistics,
            allocation): its activations count for every layer.

    Raises:
        LowRankConfigError: unknown device or dtype, no such GPU, too little
            memory, or an unloadable checkpoint.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    check_memory(model_path, dev, dt, window=WINDOW, gradients=gradients)
    return load_hf_model(model_path, device=dev, dtype=dt)


def rope_inv_freq(model, layer: int) -> torch.Tensor | None:
    """``[rot/2]`` float32 RoPE inverse frequencies of ``layer`` from the Hugging
    Face rotary module: one table (Llama, Qwen, Mistral) or one per layer type
    (Gemma-3: ``{layer_type}_inv_freq``); ``None`` without a rotary module."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        return None
    types = getattr(model.config, "layer_types", None)
    table = getattr(rotary, f"{types[layer]}_inv_freq", None) if types else None
    if table is None:
        table = rotary.inv_freq
    return table.detach().float()


def _to_cpu(b: GroupBasis) -> GroupBasis:
    return GroupBasis(a=b.a.cpu(), b=b.b.cpu(), energy=b.energy.cpu())


def layer_bases(
    method: str,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    w_o: torch.Tensor,
    stats: LayerStats | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    inv_freq: torch.Tensor | None,
    neox: bool = True,
) -> tuple[list[GroupBasis], list[GroupBasis]]:
    """Bases of one layer for every head group (methods: module docstring of
    :mod:`vllm_lowrank.factorization.bases`).

    Args:
        method: One of :data:`~vllm_lowrank.config.METHODS`.
        w_k, w_v: ``[num_kv_heads * head_dim, hidden]`` (``nn.Linear`` weights).
        w_o: ``[hidden, num_heads * head_dim]``.
        stats: Calibration statistics (unused for ``svd``); second moments are
            used per token.
        inv_freq: ``[rot/2]`` RoPE inverse frequencies (``kq``, ``post_rope``).
        neox: RoPE pair layout.

    Returns:
        ``(k_bases, v_bases)``, one per head group.

    Raises:
        LowRankConfigError: ``post_rope`` with more than one KV head per group.
    """
    qpk = num_heads // num_kv_heads
    d = head_dim
    gw = group_size * d
    groups = range(num_kv_heads // group_size)

    def cols(w, g):  # [hidden, gw] projection of group g
        return w[g * gw:(g + 1) * gw].float().T

    def block(m, g):  # rows/columns of group g of a [kv_width, kv_width] matrix
        return m[g * gw:(g + 1) * gw, g * gw:(g + 1) * gw]

    if method == "svd":
        return tuple([output_aware_basis(cols(w, g)) for g in groups] for w in (w_k, w_v))
    sx = stats.sx / stats.tokens
    if method == "whitened":
        return tuple([output_aware_basis(cols(w, g), sx) for g in groups] for w in (w_k, w_v))
    if method == "rope_equivariant":
        if inv_freq is None or 2 * inv_freq.numel() != head_dim:
            raise LowRankConfigError(
                "method rope_equivariant needs RoPE over the whole head "
                f"(head_dim {head_dim}, rotary dims "
                f"{0 if inv_freq is None else 2 * inv_freq.numel()}); use method \"fisher\"")
        return (
            [rope_equivariant_basis(cols(w_k, g), sx, block(stats.gk, g) / stats.tokens,
                                    head_dim=d, neox=neox) for g in groups],
            [output_aware_basis(cols(w_v, g), sx, block(stats.gv, g) / stats.tokens)
             for g in groups])
    if method == "fisher":
        return tuple(
            [output_aware_basis(cols(w, g), sx, block(gm, g) / stats.tokens) for g in groups]
            for w, gm in ((w_k, stats.gk), (w_v, stats.gv))
        )
    # Per KV head j: summed pre-RoPE second moment of the query heads reading it.
    sq = [stats.sq[j * qpk:(j + 1) * qpk].sum(0) / stats.tokens for j in range(num_kv_heads)]
    if method == "kq":
        k_t = [sum(rope_query_metric(stats.sq[i] / stats.tokens, inv_freq, stats.dist[i], neox)
                   for i in range(j * qpk, (j + 1) * qpk)) for j in range(num_kv_heads)]
        v_t = [value_output_metric([w_o[:, i * d:(i + 1) * d].T.float()
                                    for i in range(j * qpk, (j + 1) * qpk)])
               for j in range(num_kv_heads)]
        return tuple(
            [output_aware_basis(cols(w, g), sx,
                                torch.block_diag(*t[g * group_size:(g + 1) * group_size]))
             for g in groups]
            for w, t in ((w_k, k_t), (w_v, v_t))
        )
    values = [pca_basis(cols(w_v, g).double().T @ sx @ cols(w_v, g).double(), cols(w_v, g))
              for g in groups]
    if method == "eigen":
        keys = []
        for g in groups:
            wg = cols(w_k, g).double()
            q = torch.block_diag(*sq[g * group_size:(g + 1) * group_size])
            keys.append(pca_basis(wg.T @ sx @ wg + q, cols(w_k, g)))
        return keys, values
    if method == "post_rope":
        if group_size != 1:
            raise LowRankConfigError(
                "method post_rope projects each KV head after RoPE (ZACK); it needs "
                f"head_group_size 1, got {group_size}"
            )
        uniform = torch.ones(WINDOW, dtype=torch.float64, device=w_k.device)
        keys = []
        for g in groups:
            wg = cols(w_k, g).double()
            m = rope_query_metric(wg.T @ sx @ wg + sq[g], inv_freq, uniform, neox)
            keys.append(pca_basis(m, cols(w_k, g)))
        return keys, values
    raise LowRankConfigError(f"method={method!r} is not one of {list(METHODS)}")


def calibrate_model(
    model_path: str,
    *,
    method: str = "kq",
    group_size: int | None = None,
    num_tokens: int = 16384,
    documents: list[str] | None = None,
    text_description: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> art.Artifact:
    """Calibrate every layer of ``model_path``.

    Args:
        model_path: Hugging Face checkpoint directory.
        method: One of :data:`~vllm_lowrank.config.METHODS`.
        group_size: KV heads per group (``None``: all of a layer).
        num_tokens: Calibration tokens (rounded down to whole windows of
            :data:`WINDOW`).
        documents: Calibration texts; default: the built-in
            :data:`~vllm_lowrank.calibration.text.DEFAULT_CALIBRATION_TEXT`.
        text_description: Recorded in the manifest for user texts.
        device: Where the model runs and the bases are solved (``cpu``,
            ``cuda``, ``cuda:N``); statistics and solves stay float64.
        dtype: The model's dtype for the run (``float32``, ``bfloat16``,
            ``float16``); recorded in the manifest.

    Returns:
        The artifact (not yet saved), its tensors on the CPU.

    Raises:
        LowRankConfigError: unknown method, device or dtype, too little memory
            (:func:`~vllm_lowrank.calibration.device.check_memory`), unloadable
            model, too little text.
    """
    if method not in METHODS:
        raise LowRankConfigError(f"method={method!r} is not one of {list(METHODS)}")
    t0 = time.time()
    model, tok = load_for_calibration(model_path, device, dtype,
                                      gradients=method in LOSS_METHODS)
    cfg = model.config
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    g = group_size or num_kv
    if num_kv % g:
        raise LowRankConfigError(f"group_size={g} does not divide {num_kv} KV heads")
    num_windows = max(1, num_tokens // WINDOW)
    if documents is None:
        documents = texts.calibration_documents()
        text_description = texts.CALIBRATION_TEXTS[texts.DEFAULT_CALIBRATION_TEXT]
    stats = None
    if method != "svd":
        windows = texts.token_windows(tok, documents, num_windows, WINDOW)
        stats = collect_stats(model, windows,
                              queries=method in ("kq", "eigen", "post_rope"),
                              gradients=method in LOSS_METHODS)
    state = dict(model.state_dict())
    layers = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        layers[i] = layer_bases(
            method, state[p + "k_proj.weight"], state[p + "v_proj.weight"],
            state[p + "o_proj.weight"], None if stats is None else stats[i],
            num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
            group_size=g, inv_freq=rope_inv_freq(model, i),
        )
        layers[i] = tuple([_to_cpu(b) for b in side] for side in layers[i])
    manifest = art.new_manifest(
        model_id=getattr(cfg, "_name_or_path", None) or model_path,
        architecture=cfg.architectures[0],
        shape={"hidden_size": cfg.hidden_size, "num_heads": num_heads,
               "num_kv_heads": num_kv, "head_dim": head_dim},
        num_layers=cfg.num_hidden_layers,
        fingerprint=art.model_fingerprint(state.items()),
        method=method,
        group_size=g,
        calibration={
            "text": text_description or "user text",
            "tokens": 0 if stats is None else num_windows * WINDOW,
            "window": WINDOW,
            "seconds": round(time.time() - t0, 1),
            "device": str(model.device),
            "dtype": dtype,
            "calibration_version": CALIBRATION_VERSION,
        },
    )
    logger.info("vllm-lowrank: calibrated %s (%s, group %d) on %s in %.1f s", model_path,
                method, g, model.device, time.time() - t0)
    return art.Artifact(manifest=manifest, bases=layers)
