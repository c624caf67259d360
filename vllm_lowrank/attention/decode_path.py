"""Which implementation decodes a latent attention layer, chosen once at start-up.

Three implementations compute the same decode attention from the latent cache:

- ``cuda``: the mma.sync kernel of ``csrc/latent_decode.cu``
  (:func:`vllm_lowrank.kernels.cuda.ext.latent_decode_pre_rope`), for per-KV-head groups
  with one rank per layer and 16-bit latents
  (:func:`~vllm_lowrank.kernels.triton.decode.cuda_path_blocker` says why not);
- ``triton``: :func:`~vllm_lowrank.kernels.triton.decode.latent_decode_attention`
  (any grouping, uneven ranks, packed 8/4/3/2-bit per-token sides, per-channel
  keys, key bias /
  QK-norm, sliding windows, the token-adaptive span; groups whose key tile does
  not fit one program run its wide-group variant,
  :mod:`vllm_lowrank.kernels.triton.decode_wide`; post-RoPE latents packed at
  8/4 bits per token with uniform ranks, the ``2x`` preset's format, run
  :mod:`vllm_lowrank.kernels.triton.decode_packed`; layers whose key bases
  commute with RoPE, :meth:`~vllm_lowrank.attention.layer.LatentAttention.decode_mode`
  ``"latent_rope"``, run :mod:`vllm_lowrank.kernels.triton.decode_latent_rope`);
- ``torch``: :func:`~vllm_lowrank.attention.latent_attention.decode_attention`
  (every cache format, every device; on CUDA slower and never captured in a
  CUDA graph).

:func:`choose_decode_path` picks the first that admits the layer and, on a
random two-sequence cache, agrees with the torch path (a start-up self-check:
a kernel that fails to compile for this GPU, or that the installed Triton
compiles wrongly, is never served), logs one line per layer configuration,
and caches the choice on the layer. :func:`graph_safe_decode` tells the
metadata builder whether decode steps may be captured in CUDA graphs.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import NamedTuple

import torch

from vllm_lowrank.config import LowRankConfigError, config_from_vllm

logger = logging.getLogger("vllm.lowrank")

SELF_CHECK_TOL = 5e-2
"""Largest relative L2 error (and absolute log-sum-exp error, nats) of a fused
kernel against the float32 torch path in the start-up self-check. bf16 keys
rebuilt in the kernel differ from the torch path's float32 keys by rounding
(about 1e-2 relative at the serving shapes, benchmarks/README.md); a kernel
compiled wrongly is off by order 1."""


class DecodePath(NamedTuple):
    """Which implementation decodes a layer, and why.

    ``name``: ``"cuda"`` (the CUDA kernel of :mod:`vllm_lowrank.kernels.cuda.ext`),
    ``"triton"`` (:mod:`vllm_lowrank.kernels.triton.decode`) or ``"torch"``
    (:func:`~vllm_lowrank.attention.latent_attention.decode_attention`, which
    runs on CUDA tensors too, slower, and cannot be captured in a CUDA graph).
    """

    name: str
    reason: str


_LOGGED_PATHS: set = set()


def fused_decode():
    """:func:`~vllm_lowrank.kernels.triton.decode.latent_decode_attention`
    (imported on first CUDA use only)."""
    from vllm_lowrank.kernels.triton.decode import latent_decode_attention

    return latent_decode_attention


def fused_supports(layout) -> bool:
    """Whether the fused kernels read this cache format: unquantized caches,
    packed 8/4/3/2-bit per-token (or channel-grouped) sides and per-channel keys
    (KIVI; the wide-group Triton kernel). A side kept as raw float16 inside a
    packed slot takes the torch path."""
    from vllm_lowrank.format.latent import RAW_BITS

    return layout is None or RAW_BITS not in (layout.k_bits, layout.v_bits)


def self_check(layer, backend: str, dtype: torch.dtype, device: torch.device,
               block_size: int, max_model_len: int, kw: dict) -> float:
    """Disagreement of a fused kernel with the torch path on this layer's real
    factors and a random cache: four sequences (two spanning three blocks past
    the exact sink and recent tokens, two of at most five tokens), shuffled
    blocks, latents ~ N(0, 1) (packed by the layer's layout), queries ~ N(0, 1)
    in ``dtype``; the kernel attends the first two alone and all four (the
    wide-group kernel runs one KV head per program for the first batch and
    several for the second:
    :func:`~vllm_lowrank.kernels.triton.launch.wide_heads_per_program`).

    Args:
        layer: The :class:`~vllm_lowrank.attention.layer.LatentAttention`.
        backend: ``"cuda"`` or ``"triton"`` (``latent_decode_attention``'s).
        kw: The serving call's keyword arguments (mode, layout, transform,
            window, sink, recent).

    Returns:
        The larger of the relative L2 error of the outputs and, with a
        token-adaptive span, the largest absolute log-sum-exp error (nats).

    Raises:
        Whatever the kernel raises (compilation, resources).
    """
    from vllm_lowrank.attention import latent_attention as ops

    plan, layout = layer.plan, layer.layout
    sink, recent = kw["sink"], kw["recent"]
    span = sink > 0 or recent > 0
    n1 = min(max_model_len, sink + recent + 2 * block_size + 3)
    lens = [n1, min(n1, 5), max(1, n1 - 2), min(n1, 3)]
    g = torch.Generator().manual_seed(0)
    per = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per) + 1
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    for r, start in enumerate(itertools.accumulate([0] + per[:-1])):
        table[r, :per[r]] = order[start:start + per[r]]
    lat = torch.randn(num_blocks * block_size, plan.k_width + plan.v_width, generator=g)
    if layout is None:
        rows = lat.to(dtype)
    else:
        rows = layout.encode_complete(lat[:, :plan.k_width], lat[:, plan.k_width:])
    cache = rows.view(num_blocks, 1, block_size, -1).to(device)
    post_rope = kw["mode"] == "post_rope"
    width = max(plan.k_ranks) if post_rope else plan.shape.head_dim
    q = torch.randn(len(lens), plan.shape.num_heads, width, generator=g).to(device, dtype)
    table, seq = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    rope = layer.rope_table(device)
    scale = plan.shape.head_dim ** -0.5
    ref = ops.decode_attention(plan, layer.k_up, rope, scale, q.float(), cache, table, seq,
                               n1, post_rope=post_rope, layout=layout,
                               transform=kw["transform"], window=kw["window"],
                               min_seq_len=min(lens), sink=sink, recent=recent,
                               return_lse=span)
    ref = ref if span else (ref, None)
    err = 0.0
    for n in (2, len(lens)):
        got = fused_decode()(plan, layer.k_up, rope, scale, q[:n], cache, table[:n], seq[:n],
                             n1, backend=backend, return_lse=span, **kw)
        got = got if span else (got, None)
        want = ref[0][:n].float()
        err = max(err, ((got[0] - want).norm() / want.norm().clamp_min(1e-30)).item())
        if span:
            fin = torch.isfinite(ref[1][:n])
            if not torch.equal(fin, torch.isfinite(got[1])):
                return math.inf
            if fin.any():
                err = max(err, (got[1][fin] - ref[1][:n][fin]).abs().max().item())
    return err if math.isfinite(err) else math.inf


def choose_decode_path(layer, dtype: torch.dtype, device: torch.device,
                       block_size: int, window: int | None, max_model_len: int) -> DecodePath:
    """The one place that decides a layer's decode path (once per layer, at
    start-up, before any CUDA graph is captured): the CUDA kernel where
    :func:`~vllm_lowrank.kernels.triton.decode.cuda_path_blocker` admits the
    layer and the extension builds, else the Triton kernel (its wide-group
    variant where a head group's key tile is too large for one program) where
    :func:`fused_supports` the cache format, else the torch path. A fused
    kernel is taken only if it runs and passes :func:`self_check` (within
    :data:`SELF_CHECK_TOL`); it then runs once more on a one-token dummy batch
    with the split of ``max_model_len`` (the launch a CUDA graph captures), so
    that everything it caches (packed key weights, group tables, the RoPE
    check, compiled code) is built before any capture.
    Logs one line per distinct layer configuration (a warning when a kernel was
    refused).

    Args:
        layer: The :class:`~vllm_lowrank.attention.layer.LatentAttention`.
        dtype: Model (query) dtype; device: where it runs.
        block_size: Tokens per KV block of the layer's cache.
        window: The layer's sliding window, or ``None``.
        max_model_len: Longest sequence.
    """
    if device.type != "cuda":
        return DecodePath("torch", "not on a CUDA device")
    from vllm_lowrank.kernels.triton import decode as dec

    if not fused_supports(layer.layout):
        return _logged(layer, DecodePath(
            "torch", "the fused kernels do not read a raw 16-bit side inside a packed "
                     "slot"))
    plan, layout = layer.plan, layer.layout
    rope = layer.rope_table(device)
    span = dict(sink=layer.exact.sink, recent=layer.exact.recent + 1) \
        if layer.exact is not None else dict(sink=0, recent=0)
    kw = dict(mode=layer.decode_mode(), layout=layout,
              transform=layer.key_transform(), window=window, **span)
    width = max(plan.k_ranks) if layer.post_rope else plan.shape.head_dim
    q = torch.zeros(1, plan.shape.num_heads, width, dtype=dtype, device=device)
    slot = layout.slot_bytes if layout is not None else plan.k_width + plan.v_width
    cache = torch.zeros(1, 1, block_size, slot, device=device,
                        dtype=torch.uint8 if layout is not None else dtype)
    one = torch.ones(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    why = dec.cuda_path_blocker(plan, rope, q, cache, table, one, max_model_len, **kw) \
        or dec._cuda_unavailable()
    rotary_dim = plan.shape.head_dim if layer.post_rope else rope.rotary_dim
    try:
        kernel = dec.TRITON_KERNELS[dec.triton_kernel(plan, layout, kw["mode"], cache,
                                                      rotary_dim)]
    except ValueError as exc:  # no Triton kernel reads it: the self-check refuses it
        kernel = f"Triton kernel ({exc})"
    candidates = [("triton", f"{kernel}; outside the CUDA kernel's scope: {why}")]
    if why is None:
        candidates = [("cuda", "in the CUDA kernel's scope"), ("triton", kernel)]
    # batches of 1 and 4 one-token rows: both grids of the wide-group kernel
    warm = [(plan, layer.k_up, rope, 1.0, q.expand(n, -1, -1).contiguous(), cache,
             table.expand(n, -1).contiguous(), one.expand(n).contiguous(), max_model_len)
            for n in (1, 4)]
    return first_agreeing(layer, candidates, dtype, device, block_size, max_model_len, kw,
                          warm)


def first_agreeing(layer, candidates, dtype: torch.dtype, device: torch.device,
                   block_size: int, max_model_len: int, kw: dict, warm: list) -> DecodePath:
    """The first of ``candidates`` (``[(backend, reason)]``, ``"cuda"`` or
    ``"triton"``) that runs, passes :func:`self_check` and then runs the warm-up
    calls ``fused_decode()(*args, ...)`` for each ``args`` of ``warm`` (the
    launches a CUDA graph captures, with the split of ``max_model_len``: compiled
    and their tables built now, before any capture); else the torch path, logged
    as a warning with every candidate's reason for refusal. Logs the choice
    (:func:`_logged`)."""
    refused = []
    for name, reason in candidates:
        try:
            err = self_check(layer, name, dtype, device, block_size, max_model_len, kw)
            if err <= SELF_CHECK_TOL:
                for args in warm:
                    fused_decode()(*args, backend=name, return_lse=layer.exact is not None,
                                   **kw)
        except Exception as exc:  # noqa: BLE001 (compilation, resources: not served)
            first_line = (str(exc).splitlines() or [""])[0][:200]
            refused.append(f"{name}: {type(exc).__name__}: {first_line}")
            continue
        if err <= SELF_CHECK_TOL:
            if refused:
                reason = f"{reason} ({'; '.join(refused)})"
            return _logged(layer, DecodePath(name, reason))
        refused.append(f"{name}: disagrees with the torch path (error {err:.2g} > "
                       f"{SELF_CHECK_TOL})")
    return _logged(layer, DecodePath("torch", "; ".join(refused)), warn=True)


def decode_path(layer, dtype: torch.dtype, device: torch.device, vllm_config) -> DecodePath:
    """``layer.decode_path``, chosen on first use by :func:`choose_decode_path`
    (and published to ``/metrics``, :func:`vllm_lowrank.metrics.record_decode_path`).

    Raises:
        LowRankConfigError: the torch path on a CUDA device without
            ``allow_slow_path`` (the message says why no fused kernel serves it).
    """
    path = layer.__dict__.get("decode_path")
    if path is None:
        from vllm_lowrank import metrics

        path = choose_decode_path(layer, dtype, device, vllm_config.cache_config.block_size,
                                  layer.sliding_window, vllm_config.model_config.max_model_len)
        if (device.type == "cuda" and path.name == "torch"
                and not config_from_vllm(vllm_config).allow_slow_path):
            raise LowRankConfigError(
                f"{layer.layer_name} would decode on the torch path on this GPU (eager, "
                f"several times slower than stock vLLM): {path.reason}. Choose a setting "
                "the fused kernels read (README, \"On a GPU\") or add "
                "\"allow_slow_path\": true to serve it anyway")
        layer.__dict__["decode_path"] = path
        metrics.record_decode_path(layer.layer_name, path.name)
    return path


def graph_safe_decode(vllm_config, device: torch.device) -> bool:
    """True when every latent attention layer of the model decodes with a
    fused GPU kernel (:func:`decode_path`: no host sync, fixed launch shapes for
    a fixed batch), so decode steps may be captured in CUDA graphs. Token-
    adaptive layers qualify too: their exact part is one fixed-grid Triton
    launch per batch (:mod:`vllm_lowrank.kernels.triton.decode_exact`; with a
    sliding window a fixed-shape torch computation,
    :func:`~vllm_lowrank.attention.token_adaptive.exact_attention`) and their
    per-channel key groups are written without a host sync in decode steps
    (:func:`~vllm_lowrank.attention.token_adaptive.write_key_groups`). Layers on
    the torch path are not: vLLM then runs decode eagerly. Chooses every
    layer's path (warming its kernel) as a side effect, before any capture."""
    # LatentAttention layers are the ones carrying a plan (this module sits below
    # attention.layer, which imports the backend)
    layers = [layer for layer in vllm_config.compilation_config.static_forward_context.values()
              if getattr(layer, "plan", None) is not None and hasattr(layer, "exact")]
    dtype = vllm_config.model_config.dtype
    paths = [decode_path(layer, dtype, device, vllm_config) for layer in layers]
    return all(path.name != "torch" for path in paths)


def _logged(layer, path: DecodePath, warn: bool = False) -> DecodePath:
    plan = layer.plan
    layout = layer.layout
    key = (path, plan.group_size, plan.shape.head_dim,
           None if layout is None else (layout.k_bits, layout.v_bits, layout.k_per_channel),
           layer.exact is not None)
    if key not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(key)
        bits = "16-bit" if layout is None else f"K{layout.k_bits}/V{layout.v_bits}"
        (logger.warning if warn else logger.info)(
            "vllm-lowrank: decode path %s for layers with head groups of %d KV heads, %s "
            "latents%s: %s", path.name, plan.group_size, bits,
            ", token-adaptive" if layer.exact is not None else "", path.reason)
    return path
