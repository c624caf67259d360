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
bytes per token)``, times ``block_size``; ``get_kv_cache_config_from_groups``,
in ``vllm/v1/core/kv_cache_utils.py`` in 0.32 and ``kv_cache_planning.py`` in
0.33, the same code). The token-adaptive mode keeps a
second group of exact tokens per sequence; for it the estimate gives the
sequences of ``context`` tokens that fit by pages (latent blocks plus exact
blocks, :func:`resident_sequences`) and the worst case vLLM logs as its
"maximum concurrency" (:func:`admitted_sequences`); vLLM 0.32's scheduler
admits by the blocks free, not by that figure (``kv_cache_max_concurrency`` is
only logged and reported).
"""

from __future__ import annotations

import dataclasses
import math
import types

import torch

from vllm_lowrank.config import LowRankConfig, LowRankConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def estimate(model_path: str, cfg: LowRankConfig, *, dtype: str = "bfloat16",
             kv_cache_gib: float = 1.0, block_size: int | None = None,
             tensor_parallel_size: int = 1,
             context: int = 4096, concurrent_batches: int = 2,
             prefill_chunk: int | None = None, max_num_batched_tokens: int = 8192) -> dict:
    """Bytes per token, compression and capacity of ``cfg`` on ``model_path``.

    Args:
        model_path: Hugging Face model folder (``config.json`` is read).
        cfg: An enabled :class:`~vllm_lowrank.config.LowRankConfig`.
        dtype: KV cache / model dtype name (:data:`DTYPES`).
        kv_cache_gib: KV cache memory per worker, GiB (vLLM's
            ``kv_cache_memory_bytes``; on CPU ``VLLM_CPU_KVCACHE_SPACE``).
        block_size: KV block size, tokens (``None``: the preset's, else the one
            an allocation artifact was allocated for, else vLLM's 16).
        tensor_parallel_size: Workers sharing the KV heads (bytes are per worker).
        context: Tokens per sequence for the sequence count.
        concurrent_batches: vLLM's ``max_concurrent_batches``: 2 with async
            scheduling (vLLM's default on CUDA), 1 without (its CPU engine),
            for :func:`admitted_sequences`.
        prefill_chunk: vLLM's ``long_prefill_token_threshold`` (``None``: what
            the server sets for the token-adaptive mode,
            :func:`~vllm_lowrank.format.exact.prefill_chunk_tokens`).
        max_num_batched_tokens: vLLM's step budget (its default 8,192).

    Returns:
        JSON-safe dict: ``preset``, ``note`` (what stands in for a missing
        artifact, or ``None``), ``layers``, ``original_bytes_per_token`` and
        ``stored_bytes_per_token`` (per worker, all layers, at ``dtype``),
        ``compression_ratio`` (16-bit K+V bytes / latent slot bytes),
        ``sequence_compression_ratio`` (the same over a ``context``-token
        sequence, exact tokens included: the README's preset figures at
        4,096), ``exact_bytes_per_sequence``, ``block_size`` (the KV block
        size assumed, tokens), ``tokens`` and ``stock_tokens``
        (vLLM's count for the latent group and for an uncompressed cache),
        ``sequences`` and ``stock_sequences`` of ``context`` tokens (by bytes),
        ``admitted_sequences`` (vLLM's "maximum concurrency" at ``context``
        tokens, :func:`admitted_sequences`: the worst case it logs) and
        ``stock_admitted_sequences``, and
        ``gpu_path`` (the preset's measured decode path, else where to read it).

    Raises:
        LowRankConfigError: a setting the model cannot serve (as at start-up), an
            unknown ``dtype``, or a size that is not a positive finite number
            (a ``ValueError`` too).
    """
    from transformers import AutoConfig

    from vllm_lowrank.calibration.allocate import default_block_size
    from vllm_lowrank.calibration.cache import NotCached
    from vllm_lowrank.format.exact import ExactSlot
    from vllm_lowrank.models.compression import resolve
    from vllm_lowrank.presets import get_preset

    preset = get_preset(cfg.preset) if cfg.preset is not None else None
    if block_size is None:  # what the engine takes (vllm_lowrank.patches), else vLLM's 16
        block_size = default_block_size(cfg)[0] or 16
    if dtype not in DTYPES:
        raise LowRankConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    sizes = dict(kv_cache_gib=kv_cache_gib, block_size=block_size, context=context,
                 tensor_parallel_size=tensor_parallel_size,
                 concurrent_batches=concurrent_batches,
                 max_num_batched_tokens=max_num_batched_tokens)
    for name, value in sizes.items():
        if not value > 0 or value == math.inf:  # NaN fails the first test
            raise LowRankConfigError(f"{name}={value} must be a positive finite number")
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

    def exact_slots(dt: torch.dtype) -> list[ExactSlot]:  # one per layer, none if no exact
        if comp.exact_tokens is None:
            return []
        return [ExactSlot.for_layer(p, comp.layout(i), dt, comp.exact_tokens,
                                    stage_keys=not comp.post_rope_keys)
                for i, p in comp.plans.items()]

    def exact_bytes(slots: list[ExactSlot]) -> int:  # per sequence, + the token in flight
        if not slots:
            return 0
        return min(comp.exact_tokens.count + 1, context) * sum(x.slot_bytes for x in slots)

    slots = exact_slots(torch_dtype)
    exact_per_seq = exact_bytes(slots)
    seq16 = original16 * context / (stored16 * context + exact_bytes(exact_slots(torch.float16)))
    kv_bytes = int(kv_cache_gib * 2**30)

    def tokens(per_token: int) -> int:
        return kv_bytes // (block_size * per_token) * block_size

    exact = None
    if slots:
        from vllm_lowrank.format.exact import prefill_chunk_tokens

        chunk = prefill_chunk_tokens(cfg, context) if prefill_chunk is None else prefill_chunk
        exact = dict(slot_bytes=max(x.slot_bytes for x in slots),
                     latent_slot_bytes=max(x.latent_slot_bytes for x in slots),
                     sink=comp.exact_tokens.sink, recent=comp.exact_tokens.recent,
                     request_tokens=chunk * concurrent_batches if chunk > 0 else None)
    admitted = admitted_sequences(
        kv_bytes, len(comp.plans), stored // len(comp.plans), block_size, context,
        max_num_batched_tokens * concurrent_batches, exact)
    stock_admitted = admitted_sequences(kv_bytes, len(comp.plans), original // len(comp.plans),
                                        16, context, max_num_batched_tokens * concurrent_batches)

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
        "block_size": block_size,
        "tokens": tokens(stored),
        "stock_tokens": tokens(original),
        "context": context,
        "sequences": resident_sequences(kv_bytes, len(comp.plans), stored // len(comp.plans),
                                        block_size, context, exact),
        "stock_sequences": kv_bytes // (original * context),
        "admitted_sequences": round(admitted, 2),
        "stock_admitted_sequences": round(stock_admitted, 2),
        "concurrent_batches": concurrent_batches,
        "gpu_path": preset.gpu_path if preset is not None else (
            "chosen per layer at start-up and logged ('vllm-lowrank: decode path ...'); "
            "see the README, 'On a GPU'"),
    }


def _pages(kv_bytes: int, num_layers: int, slot_bytes: int, block_size: int, context: int,
           exact: dict | None):
    """``(blocks, latent blocks per request of context tokens, ExactTokensSpec or
    None)`` of the cache :func:`admitted_sequences` describes."""
    from vllm.utils.math_utils import cdiv

    if exact is None:
        return (kv_bytes // (num_layers * block_size * slot_bytes), cdiv(context, block_size),
                None)
    from vllm_lowrank.attention.exact_cache import ExactTokensSpec

    page = block_size * exact["slot_bytes"]
    spec = ExactTokensSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                           dtype=torch.uint8, state_content_bytes=exact["slot_bytes"],
                           sliding_window=exact["recent"] + 1, sink=exact["sink"],
                           max_request_tokens=exact["request_tokens"])
    return (kv_bytes // (num_layers * page), cdiv(context, page // exact["latent_slot_bytes"]),
            spec)


def admitted_sequences(kv_bytes: int, num_layers: int, slot_bytes: int, block_size: int,
                       context: int, max_in_flight_tokens: int,
                       exact: dict | None = None) -> float:
    """vLLM's "maximum concurrency" for requests of ``context`` tokens: the KV
    blocks over the blocks one such request may hold at worst, by the rule it
    logs and reports with (``get_max_concurrency_for_kv_cache_config`` in
    ``vllm/v1/core/kv_cache_utils.py``, the same in 0.32 and 0.33; its
    scheduler admits by the blocks free).

    Without exact tokens one cache group: ``kv_bytes // (num_layers x
    block_size x slot_bytes)`` blocks, ``ceil(context / block_size)`` per request.
    With them (``exact``), the exact group's page (``block_size`` exact slots)
    is every group's: the latent group's blocks hold ``page / latent slot``
    tokens, and the exact group reserves what
    :meth:`~vllm_lowrank.attention.exact_cache.ExactTokensSpec.max_admission_blocks_per_request`
    says (sink blocks, the ``recent + 1`` window and the tokens a request has
    in flight, plus one block for the window's misalignment).

    Args:
        kv_bytes: KV cache bytes per worker.
        num_layers: Attention layers (each holds one page of each block).
        slot_bytes: Bytes per token and layer of the (latent) cache.
        block_size: KV block size, tokens (of the exact group, with ``exact``).
        context: Tokens per request (vLLM's ``max_model_len``).
        max_in_flight_tokens: vLLM's ``max_in_flight_tokens``
            (``max_num_batched_tokens x max_concurrent_batches``).
        exact: ``None``, or a dict with ``slot_bytes``, ``latent_slot_bytes``,
            ``sink``, ``recent`` (tokens) and ``request_tokens`` (the
            per-request in-flight cap, or ``None``).

    Returns:
        Requests that fit at once, float (vLLM logs it as ``x``).
    """
    blocks, latent, spec = _pages(kv_bytes, num_layers, slot_bytes, block_size, context, exact)
    if spec is None:
        return blocks / latent
    return blocks / (latent + spec.max_admission_blocks_per_request(max_in_flight_tokens,
                                                                    context))


def resident_sequences(kv_bytes: int, num_layers: int, slot_bytes: int, block_size: int,
                       context: int, exact: dict | None = None) -> int:
    """Requests of ``context`` tokens whose blocks fit at once once prefilled: what
    the cache holds, page by page (arguments as for :func:`admitted_sequences`).
    Each holds its latent blocks and, with exact tokens, the sink blocks and the
    blocks the ``recent + 1``-token window spans at worst (``ceil(recent /
    block_size) + 1``; no more than the context's): the exact tokens round up
    to whole blocks, so this is below the bytes' count. At a 2k context the
    ``4x`` preset at the Llama-3-8B shape holds 15 blocks (11 latent, 4 exact) of
    the 1,618 that 8 GiB gives: 107 requests (benchmarks/README.md, "GPU serving
    inside vLLM", where 111-114 ran while requests were still short).

    Returns:
        Whole requests.
    """
    from vllm.utils.math_utils import cdiv

    blocks, latent, spec = _pages(kv_bytes, num_layers, slot_bytes, block_size, context, exact)
    if spec is None:
        return blocks // latent
    window = cdiv(exact["recent"], block_size) + 1
    return blocks // (latent + min(spec.sink_blocks + window, cdiv(context, block_size)))
