"""What a setting stores per token and how many tokens fit, without an engine.

:func:`estimate` resolves a ``--kv-compression-config`` for a model folder the
way the server does (presets, ranks, bits, slot layouts, the token-adaptive
exact slots; :func:`vllm_lowrank.models.compression.resolve`) from its
``config.json`` alone: no weights are loaded, nothing is calibrated. Where the
server would calibrate or allocate on first start and no cached artifact
exists, the estimate says so (uniform ranks of the same rank fraction stand in for a
calibrated rank allocation; an allocation preset reports its target only).

The token count is vLLM's for one KV cache group: ``kv_cache_bytes`` over the
bytes every layer stores per token (``num_blocks = bytes // (block_size x
bytes per token)``, times ``block_size``). The token-adaptive mode keeps a
second group of exact tokens per sequence; for it the estimate gives the
sequences of ``context`` tokens that fit (latent slots plus exact slots).
"""

from __future__ import annotations

import dataclasses
import types

import torch

from vllm_lowrank.config import LowRankConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def estimate(model_path: str, cfg: LowRankConfig, *, dtype: str = "bfloat16",
             kv_cache_gib: float = 1.0, block_size: int | None = None,
             tensor_parallel_size: int = 1,
             context: int = 4096) -> dict:
    """Bytes per token, compression and capacity of ``cfg`` on ``model_path``.

    Args:
        model_path: Hugging Face model folder (``config.json`` is read).
        cfg: An enabled :class:`~vllm_lowrank.config.LowRankConfig`.
        dtype: KV cache / model dtype name (:data:`DTYPES`).
        kv_cache_gib: KV cache memory per worker, GiB (vLLM's
            ``kv_cache_memory_bytes``; on CPU ``VLLM_CPU_KVCACHE_SPACE``).
        block_size: KV block size, tokens (``None``: the preset's, else vLLM's 16).
        tensor_parallel_size: Workers sharing the KV heads (bytes are per worker).
        context: Tokens per sequence for the sequence count.

    Returns:
        JSON-safe dict: ``preset``, ``note`` (what stands in for a missing
        artifact, or ``None``), ``layers``, ``original_bytes_per_token`` and
        ``stored_bytes_per_token`` (per worker, all layers, at ``dtype``),
        ``compression_ratio`` (16-bit K+V bytes / latent slot bytes),
        ``sequence_compression_ratio`` (the same over a ``context``-token
        sequence, exact tokens included: the README's preset figures at
        4,096), ``exact_bytes_per_sequence``, ``tokens`` and ``stock_tokens``
        (vLLM's count for the latent group and for an uncompressed cache),
        ``sequences`` and ``stock_sequences`` of ``context`` tokens, and
        ``gpu_path`` (the preset's measured decode path, else where to read it).

    Raises:
        LowRankConfigError: a setting the model cannot serve (as at start-up).
        ValueError: unknown ``dtype``, or non-positive sizes.
    """
    from transformers import AutoConfig

    from vllm_lowrank.calibration.cache import NotCached
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.models.compression import resolve
    from vllm_lowrank.presets import get_preset

    preset = get_preset(cfg.preset) if cfg.preset is not None else None
    if block_size is None:
        block_size = (preset.block_size if preset is not None else None) or 16
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
    if kv_cache_gib <= 0 or block_size < 1 or context < 1 or tensor_parallel_size < 1:
        raise ValueError("kv_cache_gib, block_size, context and tensor_parallel_size must "
                         "be positive")
    torch_dtype = DTYPES[dtype]
    hf = AutoConfig.from_pretrained(model_path)
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_config=hf, model=model_path),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tensor_parallel_size),
        cache_config=types.SimpleNamespace(block_size=block_size))
    note = None
    try:
        comp = resolve(vllm_config, cfg, create_artifacts=False)
    except NotCached as missing:
        if preset is not None and preset.allocate is not None:
            return {"preset": cfg.preset, "note": (
                f"ranks and bits are allocated on the first start (target "
                f"{preset.allocate:g}x; cached in {missing.args[0]}): start the server once "
                f"or run `vllm-lowrank allocate`, then estimate again"),
                "compression_ratio": None, "gpu_path": preset.gpu_path}
        note = (f"no calibration artifact cached ({missing.args[0]}): uniform ranks at "
                f"rank fraction {cfg.rank_fraction} stand in for the calibrated allocation of the same rank fraction")
        comp = resolve(vllm_config, dataclasses.replace(cfg, artifact="none",
                                                        rank_allocation="uniform"))
    elem = torch_dtype.itemsize
    original, stored = comp.bytes_per_token(elem)
    original16, stored16 = comp.bytes_per_token(2)

    def exact_bytes(dt: torch.dtype) -> int:  # per sequence, + the token in flight
        if comp.exact_tokens is None:
            return 0
        count = min(comp.exact_tokens.count + 1, context)
        return count * sum(
            ExactSlot.for_layer(p, comp.layout(i), dt, comp.exact_tokens).slot_bytes
            for i, p in comp.plans.items())

    exact_per_seq = exact_bytes(torch_dtype)
    seq16 = original16 * context / (stored16 * context + exact_bytes(torch.float16))
    kv_bytes = int(kv_cache_gib * 2**30)

    def tokens(per_token: int) -> int:
        return kv_bytes // (block_size * per_token) * block_size

    return {
        "preset": cfg.preset,
        "note": note,
        "layers": {i: {"k_ranks": list(p.k_ranks), "v_ranks": list(p.v_ranks),
                       "bits": list(comp.layer_bits(i))} for i, p in comp.plans.items()},
        "dtype": dtype,
        "original_bytes_per_token": original,
        "stored_bytes_per_token": stored,
        "compression_ratio": original16 / stored16,
        "sequence_compression_ratio": seq16,
        "exact_bytes_per_sequence": exact_per_seq,
        "kv_cache_bytes": kv_bytes,
        "tokens": tokens(stored),
        "stock_tokens": tokens(original),
        "context": context,
        "sequences": kv_bytes // (stored * context + exact_per_seq),
        "stock_sequences": kv_bytes // (original * context),
        "gpu_path": preset.gpu_path if preset is not None else (
            "chosen per layer at start-up and logged ('vllm-lowrank: decode path ...'); "
            "see the README, 'On a GPU'"),
    }
