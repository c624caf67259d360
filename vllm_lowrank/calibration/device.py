"""Where a calibration or allocation run computes, and whether it fits there.

``vllm-lowrank calibrate`` and ``allocate`` run the Hugging Face model on
calibration text: on the CPU in float32 by default, or on a GPU
(``--device cuda``) in the model's dtype (``--dtype bfloat16``). Before the
model is loaded, :func:`check_memory` estimates the run's peak memory from the
checkpoint's tensor shapes and the model config and refuses a run that does
not fit, naming the fix, instead of failing minutes later inside torch.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os

import torch

from vllm_lowrank.config import LowRankConfigError

logger = logging.getLogger("vllm.lowrank")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` names of a calibration run and their torch dtypes."""

GIB = 1 << 30
RUNTIME_BYTES = GIB // 2
"""Memory of the process itself (Python, torch, transformers, the tokenizer),
counted once: measured 0.5 GiB of resident memory beyond the tensors on the CPU."""


def resolve_device(name: str) -> torch.device:
    """The torch device of a ``--device`` name (``cpu``, ``cuda``, ``cuda:1``).

    Raises:
        LowRankConfigError: an unknown name, or a CUDA device that is not
            visible.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise LowRankConfigError(
            f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LowRankConfigError(f"--device {name!r}: calibration runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LowRankConfigError(
                f"--device {name}: no CUDA device is visible to torch; use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise LowRankConfigError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (:data:`DTYPES`).

    Raises:
        LowRankConfigError: an unknown name.
    """
    if name not in DTYPES:
        raise LowRankConfigError(f"--dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def checkpoint_parameters(model_path: str) -> int:
    """Number of parameters in the checkpoint's ``*.safetensors`` files, read
    from their headers by ``safetensors`` (no tensor is loaded); 0 where there
    are none. An unreadable file counts nothing (the loader reports it)."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for name in glob.glob(os.path.join(model_path, "*.safetensors")):
        try:
            with safe_open(name, framework="pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
        except (SafetensorError, OSError):
            continue
    return total


def peak_bytes(model_path: str, dtype: torch.dtype, *, window: int,
               gradients: bool) -> int:
    """Estimated peak memory of a calibration run, in bytes: the weights in
    ``dtype``, the float64 statistics of every layer
    (:class:`~vllm_lowrank.calibration.collect.LayerStats`: ``hidden^2 +
    heads * head_dim^2 + heads * window``, plus ``2 * kv_width^2`` with
    ``gradients``) and the activations of one ``window``-token forward pass
    with eager attention (``heads * window^2`` probabilities and a few
    ``window * hidden`` tensors per layer; with ``gradients`` every layer's
    are kept for the backward pass, otherwise one layer's), plus
    :data:`RUNTIME_BYTES`. An estimate: SmolLM2-135M on the CPU in float32
    peaks at 4.4 GiB resident with ``fisher`` (estimate 5.2 GiB) and 1.4 GiB
    with ``kq`` (1.4 GiB); 0 when the config cannot be read.
    """
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = int(cfg.get("intermediate_size") or 4 * hidden)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    size = torch.finfo(dtype).bits // 8
    weights = checkpoint_parameters(model_path) * size
    stats = 8 * layers * (hidden * hidden + heads * head_dim * head_dim + heads * window
                          + (2 * (kv * head_dim) ** 2 if gradients else 0))
    per_layer = (3 * heads * window * window + window * (6 * hidden + 3 * inter)) * size
    activations = per_layer * (layers if gradients else 2)
    return weights + stats + activations + RUNTIME_BYTES


def check_memory(model_path: str, device: torch.device, dtype: torch.dtype, *,
                 window: int, gradients: bool) -> None:
    """Log the run's estimated peak memory (:func:`peak_bytes`) and refuse a
    run that does not fit in the device's free memory (CUDA:
    ``torch.cuda.mem_get_info``; CPU: the available physical memory).

    Raises:
        LowRankConfigError: the estimate exceeds the free memory; the message
            names both and the ways out.
    """
    need = peak_bytes(model_path, dtype, window=window, gradients=gradients)
    if not need:
        logger.info("vllm-lowrank: no memory estimate for %s (not a local folder with "
                    "config.json and *.safetensors); not checked", model_path)
        return
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 0
    logger.info("vllm-lowrank: calibration on %s in %s needs about %.1f GiB (%.1f GiB free)",
                device, str(dtype).removeprefix("torch."), need / GIB, free / GIB)
    if free and need > free:
        fixes = (["--dtype bfloat16"] if dtype == torch.float32 else []) + [
            "--device cpu" if device.type == "cuda" else "--device cuda",
            "a machine with more free memory"]
        raise LowRankConfigError(
            f"calibration on {device} needs about {need / GIB:.1f} GiB, {free / GIB:.1f} GiB "
            f"are free; use {', or '.join(fixes)}")
