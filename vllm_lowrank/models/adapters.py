"""Which architectures the latent cache supports, and the start-up checks.

:data:`~vllm_lowrank.models.architectures.ARCHITECTURES` maps a Hugging Face
architecture name to the class registered in vLLM's ``ModelRegistry``. Each registered class behaves as
vLLM's stock class when compression is off. :func:`check_model` runs in the
front-end process (``EngineArgs.create_engine_config``) so that an unsupported
model or setting is refused before any engine process starts.
"""

from __future__ import annotations

import contextlib

from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.models.architectures import ARCHITECTURES
from vllm_lowrank.presets import get_preset


def supported_list() -> str:
    """Comma-separated supported architecture names."""
    return ", ".join(sorted(ARCHITECTURES))


def check_model(vllm_config, cfg: LowRankConfig) -> None:
    """Refuse models and settings the latent cache cannot serve
    (:func:`_check_model`), with torch on one thread (:func:`one_torch_thread`).
    """
    with one_torch_thread():
        _check_model(vllm_config, cfg)


@contextlib.contextmanager
def one_torch_thread():
    """Run the block's torch work on one thread, then restore the thread count.

    The checks run in vLLM's front-end process, from which vLLM forks its
    engine core on CUDA (``VLLM_WORKER_MULTIPROC_METHOD``'s default; its CPU
    platform spawns). GNU OpenMP is not fork-safe: once a parallel region has
    run in the parent, the child's first one waits forever. An artifact's
    check (every basis loaded and validated, the checkpoint fingerprinted) ran
    such regions, and the engine core then hung in its weight loading (H200,
    ``artifact: PATH``). On one thread torch runs no parallel region, so no
    OpenMP thread team exists to be forked.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_model(vllm_config, cfg: LowRankConfig) -> None:
    """Refuse models and settings the latent cache cannot serve.

    Checks: attention kind (no MLA, no cross-attention), architecture and its
    own limits (:attr:`Architecture.refuse`: soft-capping, bidirectional or
    dual-chunk attention, position-dependent query scaling), weight
    quantization (factorization needs float weights), vLLM's own KV cache dtype,
    head divisibility under tensor parallelism, group size (dividing each
    tensor-parallel rank's KV heads), ``ranks`` overrides splitting evenly over
    the ranks, the ratio giving a non-zero rank under the chosen allocation
    (:func:`check_budget`), for an artifact given by path the whole artifact
    (:func:`check_artifact`; its head groups must not span ranks), and the
    token-adaptive windows against ``max_model_len`` and the KV block size
    (:func:`check_token_windows`, with an allocation's serving settings), no
    first-start allocation (preset ``8x``) under tensor parallelism, and on a
    CUDA device no raw 16-bit side in a packed slot without ``allow_slow_path``
    (no fused kernel reads it).

    Raises:
        LowRankConfigError: with the supported alternatives.
    """
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(model_config, "use_mla", False):
        raise LowRankConfigError(
            f"--kv-compression lowrank cannot serve MLA models ({model_config.model!r}): "
            f"their cache is already a latent; supported: {supported_list()}"
        )
    if getattr(model_config, "is_encoder_decoder", False):
        raise LowRankConfigError(
            f"--kv-compression lowrank cannot serve encoder-decoder models "
            f"({model_config.model!r}): cross-attention caches are not compressed; "
            f"supported: {supported_list()}"
        )
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise LowRankConfigError(
            f"--kv-compression lowrank does not support architecture "
            f"{', '.join(archs) or '(unknown)'} of model {model_config.model!r}; "
            f"supported: {supported_list()}"
        )
    reason = ARCHITECTURES[supported[0]].refuse(hf_config)
    if reason:
        raise LowRankConfigError(
            f"--kv-compression lowrank cannot serve {model_config.model!r} "
            f"({supported[0]}): {reason}; serve it without --kv-compression"
        )
    if vllm_config.quant_config is not None or model_config.quantization:
        raise LowRankConfigError(
            f"--kv-compression lowrank needs unquantized weights to factorize, but "
            f"the model is quantized ({model_config.quantization}); serve the "
            "bf16/fp16 checkpoint"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise LowRankConfigError(
            f"--kv-cache-dtype {cache_dtype} cannot be combined with --kv-compression "
            "lowrank (the latent cache has its own storage); drop --kv-cache-dtype"
        )
    from vllm_lowrank.factorization.plan import resolve_group_size, uniform_plan
    from vllm_lowrank.factorization.shard import rank_config
    from vllm_lowrank.models.compression import mixes_attention_kinds, model_shapes

    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1 and cfg.preset is not None and get_preset(cfg.preset).allocate is not None:
        raise LowRankConfigError(
            f"preset {cfg.preset!r} allocates ranks per layer on first start, which is "
            f"not supported with tensor parallelism ({tp} ranks); allocate offline "
            "(vllm-lowrank allocate) and pass the artifact, or use preset \"4x\"")
    if (str(vllm_config.device_config.device_type) == "cuda" and not cfg.allow_slow_path
            and cfg.quantized and 16 in (cfg.k_bits, cfg.v_bits)):
        raise LowRankConfigError(
            f"k_bits={cfg.k_bits}, v_bits={cfg.v_bits} keeps one side as raw 16-bit values "
            "inside a packed slot, which no fused GPU kernel reads: it would decode on the "
            "torch path (eager, several times slower than stock vLLM); quantize both sides "
            "(e.g. 8) or add \"allow_slow_path\": true")
    shapes = model_shapes(hf_config, tp)
    cfg = rank_config(cfg, tp, shapes[0].num_kv_heads)  # per-rank groups and ranks
    for i, shape in shapes.items():
        resolve_group_size(cfg, shape)
        if cfg.rank_allocation == "uniform" or (cfg.ranks and i in cfg.ranks):
            uniform_plan(cfg, shape, i)
    if cfg.ranks:
        bad = sorted(k for k in cfg.ranks if k not in shapes)
        if bad:
            raise LowRankConfigError(
                f"ranks override names layer(s) {bad}, but the model has layers "
                f"0..{len(shapes) - 1}"
            )
    if cfg.artifact not in ("auto", "none"):
        cfg = check_artifact(vllm_config, cfg).cfg  # with the allocation's serving settings
    else:
        check_budget(cfg, shapes, mixes_attention_kinds(hf_config) or cfg.token_adaptive)
    check_token_windows(cfg, vllm_config.model_config.max_model_len,
                        vllm_config.cache_config.block_size)


def check_budget(cfg: LowRankConfig, shapes, per_layer: bool) -> None:
    """Refuse a ratio whose latent budget cannot give every head group one rank
    chunk under a loss- or energy-aware allocation, before any calibration:
    the allocation is run on flat spectra (the chunk count it needs does not
    depend on the spectra). Uniform allocation is checked by
    :func:`~vllm_lowrank.factorization.plan.uniform_plan`; full rank needs
    no budget.

    Raises:
        LowRankConfigError: the same message as the allocation's at load time.
    """
    import torch

    from vllm_lowrank.factorization.plan import resolve_group_size, uniform_plan
    from vllm_lowrank.factorization.ranks import energy_plans

    free = {i: s for i, s in shapes.items() if not (cfg.ranks and i in cfg.ranks)}
    if cfg.rank_allocation == "uniform" or not free or (cfg.rank_fraction == 1.0 and not cfg.ranks):
        return
    if cfg.artifact == "none":  # no spectra to allocate by: uniform ranks
        for i, s in free.items():
            uniform_plan(cfg, s, i)
        return
    g = resolve_group_size(cfg, next(iter(free.values())))
    spectra = {i: tuple([torch.ones(g * s.head_dim)] * (s.num_kv_heads // g) for _ in "kv")
               for i, s in free.items()}
    for part in ([{i: s} for i, s in free.items()] if per_layer else [free]):
        energy_plans(part, g, {i: spectra[i] for i in part}, cfg.rank_fraction,
                     multiple=cfg.rank_multiple)


def check_token_windows(cfg: LowRankConfig, max_model_len: int, block_size: int) -> None:
    """Token-adaptive windows against the model and the scheduler: the sink and
    recent windows at most ``max_model_len`` tokens, per-channel key groups
    dividing vLLM's KV block size.

    Raises:
        LowRankConfigError: names the window and the limit.
    """
    if not cfg.token_adaptive:
        return
    from vllm_lowrank.format.exact import exact_tokens

    for key in ("sink_tokens", "recent_tokens"):
        value = getattr(cfg, key)
        if value > max_model_len:
            raise LowRankConfigError(
                f"{key}={value} exceeds the model's max_model_len {max_model_len}: no "
                f"sequence has that many tokens; use at most {max_model_len} (or raise "
                "--max-model-len)")
    exact_tokens(cfg, block_size)  # per-channel key groups inside one block


def check_artifact(vllm_config, cfg: LowRankConfig):
    """Validate an artifact given by path in full, in the front-end process.

    Loads it exactly as the worker will (manifest, every basis tensor and its
    shape, the model geometry, group size, the resulting ranks), then compares
    its weight fingerprint with the k/v/o tensors of the checkpoint, read from
    the model folder's safetensors files. Skipped for the fingerprint when the
    weights are not local safetensors (the worker still checks while loading).

    Returns:
        The resolved :class:`~vllm_lowrank.models.compression.ModelCompression`
        (its ``cfg`` carries an allocation's serving settings).

    Raises:
        LowRankConfigError: missing, truncated or damaged files, another model's
            geometry or weights, or settings the artifact cannot serve.
    """
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.models.compression import manifest_shape, model_shapes, resolve

    hf_config = vllm_config.model_config.hf_config
    # geometry first (manifest only): "made for another model" beats a shape error
    art.check_model_matches(
        art.read_manifest(cfg.artifact), cfg.artifact,
        architecture=hf_config.architectures[0], num_layers=hf_config.num_hidden_layers,
        shape=manifest_shape(model_shapes(hf_config, 1)[0]),
    )
    compression = resolve(vllm_config, cfg)
    if vllm_config.load_config.load_format not in ("auto", "safetensors"):
        return compression
    folder = _local_checkpoint(vllm_config.model_config)
    fingerprint = art.checkpoint_fingerprint(folder) if folder else None
    if fingerprint is not None:
        art.check_fingerprint(compression.artifact.manifest, cfg.artifact, fingerprint)
    return compression


def _local_checkpoint(model_config) -> str | None:
    """The folder holding the checkpoint: the model path, or the local Hugging
    Face cache snapshot of a hub id (never downloads); ``None`` if neither."""
    import os

    model = model_config.model
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=model_config.revision,
                                 local_files_only=True,
                                 allow_patterns=["*.safetensors", "*.json"])
    except Exception:  # not cached (yet): the worker checks after downloading
        return None
