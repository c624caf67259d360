r"""Fused paged decode attention over latent KV: the host side.

:func:`latent_decode_attention` is the one entry point. It prepares (once per
plan, layout and device, cached) the group table, the packed key
up-projection and the RoPE check, chooses the launch parameters and the split
(:mod:`.launch`), and launches one of three kernels: the CUDA mma.sync kernel of
:mod:`vllm_lowrank.kernels.cuda.ext` where the call is in its scope
(:func:`cuda_path_blocker`), else the Triton grid or persistent kernel of
:mod:`.decode_kernels` (the math is described there), or, for head groups whose
key tile does not fit one program, the wide-group kernel of :mod:`.decode_wide`
(both read per-channel keys), or, for post-RoPE latents packed per token at 8/4
bits with uniform ranks (:func:`.decode_packed.blocker`), the packed kernel of
:mod:`.decode_packed`, or, in ``latent_rope`` mode (key bases that commute with
RoPE), the kernel of :mod:`.decode_latent_rope`; split partials are merged by
:func:`.tiles.reduce_splits_kernel`.

Example::

    out = latent_decode_attention(plan, k_up, rope, scale, q, kv_cache,
                                  block_table, seq_lens, int(seq_lens.max()))
    # out: [B, plan.out_width] float32
"""

from __future__ import annotations

import math

import torch
import triton

from . import decode_latent_rope, decode_packed
from .decode_kernels import decode_grid_kernel, decode_persistent_kernel
from .decode_prep import (LOG2E, MAX_CLASSES, TL_DTYPES, WEIGHT_CACHE, Prepared, cached_for,
                          interpreting, key_weights, pow2, pow2_divisor, prepare,
                          rope_is_rotation, sm_count)
from .launch import (KernelConfig, _default_config, _gpp_ok, _key_tile_too_large,
                     _latent_rope_config, _packed_config, _wide_config, choose_num_splits,
                     wide_heads_per_program)
from .launch import needs_wide
from .tiles import reduce_splits_kernel


def _launch_wide(plan, prep: Prepared, args: tuple, common: dict, dflt: dict,
                 cfg: KernelConfig, hpp: int, rotary_dim: int, num_splits: int, bsz: int):
    """Launch :func:`.decode_wide.wide_decode_kernel` with the arguments prepared
    for the grid kernel (same pointers, tables and split-K buffers): ``hpp`` KV
    heads per program (:func:`.launch.wide_heads_per_program`), the rank-chunk
    loop outside the KV-head loop when ``hpp > 1`` (each latent chunk
    dequantized once per tile; ``KernelConfig.chunk_outer=False`` or QK-norm:
    inside)."""
    from .decode_wide import wide_decode_kernel

    sh = plan.shape
    half, rest = rotary_dim // 2, sh.head_dim - rotary_dim
    k_qg = common["K_QG"]
    rc = cfg.rank_chunk or dflt["rank_chunk"]
    if k_qg and (k_qg & (k_qg - 1)):
        rc = prep.rk_max_pad  # a chunk must start on a group boundary: one chunk
    rc = min(max(rc, k_qg), prep.rk_max_pad)
    (n_splits, ng, query, s_qb, s_qh, cache, s_blk, s_tok, table, s_bt, lens,
     weights, s_wg, s_wsec, maps, cos, sin, s_rope, _max_pos, gt, *rest_args) = args
    chunk_outer = (cfg.chunk_outer is not False) and hpp > 1 and not common["K_NORM"]
    # Alignment hints for float caches only: they vectorize the latent loads,
    # 1.12-1.13x on the 16-bit J-LRD setting; on packed caches they made the
    # 4x preset 7-8 % slower (more spills) and the others 1-2 % faster (H200,
    # benchmarks/README.md, "Alignment the compiler can see").
    quant = common["QUANT"]
    wide_decode_kernel[(num_splits, sh.num_kv_heads // hpp, bsz)](
        n_splits, query, s_qb, s_qh, cache, s_blk, s_tok, table, s_bt, lens,
        weights, s_wg, s_wsec, maps, cos, sin, s_rope, gt, ng, *rest_args, common["SHARE"],
        G=plan.group_size, HPP=hpp, QPK=sh.queries_per_kv,
        HG_PAD=pow2(hpp * sh.queries_per_kv),
        HALF=half, H1=pow2(half), REST=rest, H3=pow2(rest) if rest else 0, CW=prep.cw,
        RC=rc, RV_PAD=prep.rv_max_pad, BLOCK_N=common["BLOCK_N"],
        PAGE=common["PAGE"], DT=common["DT"], QUANT=common["QUANT"],
        K_BITS=common["K_BITS"], V_BITS=common["V_BITS"], K_QG=k_qg, V_QG=common["V_QG"],
        ALIGNED=common["ALIGNED"], SPLIT=common["SPLIT"], K_BIAS=common["K_BIAS"],
        K_NORM=common["K_NORM"], WINDOW=common["WINDOW"], SPAN=common["SPAN"],
        LSE=common["LSE"], K_CHAN=common["K_CHAN"], KCT=common["KCT"],
        CHUNK_OUTER=chunk_outer, OFF_MULT=1 if quant else common["OFF_MULT"],
        RANK_MULT=1 if quant else common["RANK_MULT"],
        SLOT_MULT=1 if quant else common["SLOT_MULT"],
        num_warps=common["num_warps"],
        num_stages=common["num_stages"])


_CUDA_STATE: dict = {}


def cuda_path_blocker(plan, rope, query, kv_cache, block_table, seq_lens, max_seq_len, *,
                      layout=None, schedule=None, mode="pre_rope", config=None, out=None,
                      transform=None, window=None, sink=0, recent=0) -> str | None:
    """Why a :func:`latent_decode_attention` call cannot take the CUDA kernel
    (:func:`vllm_lowrank.kernels.cuda.ext.latent_decode_pre_rope`), or ``None`` if it can.

    Its scope: a CUDA device outside the Triton interpreter; ``pre_rope`` mode,
    default launch (no ``config``, no ``schedule``); an unquantized bf16/fp16 cache
    with ``block_size`` a power of two >= 16 and a block stride under 4 GiB, and
    queries of the same dtype; one KV head per group, ``head_dim`` 128, full
    rotary from a rotation table
    (:func:`rope_is_rotation`); one key rank and one value rank for all groups,
    both in :data:`vllm_lowrank.kernels.cuda.ext.DECODE_RANKS`; at most 8 query heads per
    group; no key transform, sliding window (shorter than ``max_seq_len``) or
    token-adaptive span; int32 block table and sequence lengths; ``out``
    contiguous float32 if given."""
    sh = plan.shape
    checks = (
        (query.device.type == "cuda" and not interpreting(), "not on a CUDA device"),
        (mode == "pre_rope", f"{mode} mode"),
        (config is None and schedule is None, "explicit Triton launch config or schedule"),
        (layout is None, "quantized cache"),
        (transform is None, "key transform"),
        (window is None or int(window) >= max_seq_len, "sliding window"),
        (int(sink) == 0 and int(recent) == 0, "token-adaptive span"),
        (query.dim() == 3 and query.shape[1] == sh.num_heads
         and kv_cache.shape[-1] == plan.k_width + plan.v_width,
         "query heads or cache slot width do not match the plan"),
        (plan.group_size == 1, "group_size != 1"),
        (sh.head_dim == 128, "head_dim != 128"),
        (plan.heads_per_group <= 8, "more than 8 query heads per group"),
        (kv_cache.dtype in (torch.bfloat16, torch.float16) and query.dtype == kv_cache.dtype,
         "cache/query dtype not bf16/fp16 or different"),
        (kv_cache.dim() == 4 and kv_cache.shape[2] >= 16
         and kv_cache.shape[2] & (kv_cache.shape[2] - 1) == 0,
         "block_size not a power of two >= 16"),
        (kv_cache.stride(0) * kv_cache.element_size() < 2 ** 32,
         "cache block stride of 4 GiB or more"),
        (len(set(plan.k_ranks)) == 1 and len(set(plan.v_ranks)) == 1, "uneven ranks"),
        (block_table.dtype == torch.int32 and block_table.stride(-1) == 1
         and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous(),
         "block_table / seq_lens not int32 (contiguous last dim)"),
        (out is None or (out.is_contiguous() and out.dtype == torch.float32),
         "out not contiguous float32"),
    )
    for ok, why in checks:
        if not ok:
            return why
    from vllm_lowrank.kernels.cuda.ext import DECODE_RANKS

    if plan.k_ranks[0] not in DECODE_RANKS or plan.v_ranks[0] not in DECODE_RANKS:
        return f"ranks ({plan.k_ranks[0]}, {plan.v_ranks[0]}) not in {DECODE_RANKS}"
    if rope is None or rope.rotary_dim != sh.head_dim:
        return "partial rotary"
    cos, sin = rope.cos, rope.sin
    if cos.device != query.device or cos.dtype != torch.float32 or sin.dtype != torch.float32 \
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0) \
            or cos.stride(0) % 4 or cos.data_ptr() % 16 or sin.data_ptr() % 16:
        return "cos/sin tables not float32 on the device with 16-byte aligned rows"
    if not rope_is_rotation(rope):
        return "rope table is not a rotation table"
    return None


def _cuda_unavailable() -> str | None:
    """``None`` once the CUDA extension has loaded; else the build error (kept,
    and warned about once, so later calls fall back to Triton at no cost)."""
    if "error" not in _CUDA_STATE:
        from vllm_lowrank.kernels.cuda import ext as cuda_ext

        try:
            cuda_ext.load()
            _CUDA_STATE["error"] = None
        except RuntimeError as exc:
            _CUDA_STATE["error"] = f"CUDA extension unavailable: {exc}"
            import warnings

            warnings.warn(_CUDA_STATE["error"] + "; using the Triton decode kernel",
                          RuntimeWarning, stacklevel=3)
    return _CUDA_STATE["error"]


def _cuda_decode(plan, k_up, rope, scale, query, kv_cache, block_table, seq_lens,
                 max_seq_len, num_splits, out, return_lse):
    from vllm_lowrank.kernels.cuda import ext as cuda_ext

    weights = cached_for(WEIGHT_CACHE, k_up, ("cuda", plan, rope.neox, kv_cache.dtype),
                          lambda: cuda_ext.pack_key_weights_t(plan, k_up, rope.neox,
                                                              kv_cache.dtype))
    if num_splits is None:
        warps = cuda_ext.decode_config(plan.k_ranks[0], plan.v_ranks[0])[0]
        num_splits = choose_num_splits(query.shape[0], plan.num_groups, max_seq_len,
                                       32 * warps, sm_count(query.device), 1)
    return cuda_ext.latent_decode_pre_rope(query, kv_cache, block_table, seq_lens, weights,
                                           rope, scale, num_splits=num_splits, out=out,
                                           return_lse=return_lse)


_PLACEHOLDERS: dict = {}


def _placeholder(device, dtype) -> torch.Tensor:
    """A one-element zero tensor for kernel arguments a mode does not read (the
    key weights and RoPE tables of post-RoPE decode), made once per device and
    dtype: a fresh ``torch.zeros`` per call is a fill kernel in every layer's
    CUDA graph."""
    key = (str(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, device=device, dtype=dtype)
    return _PLACEHOLDERS[key]


TRITON_KERNELS = {
    "grid": "Triton kernel",
    "wide": "wide-group Triton kernel (the rank in chunks, 1 to 4 KV heads per program)",
    "packed": "packed post-RoPE Triton kernel (codes in the dots)",
    "latent_rope": "RoPE-equivariant latent Triton kernel (queries absorbed, no key rebuild)",
}
"""The Triton decode kernels, by the name :func:`triton_kernel` returns, with
the label the start-up log line gives them."""


def triton_kernel(plan, layout, mode: str, kv_cache, rotary_dim: int,
                  config: KernelConfig | None = None, schedule=None,
                  prep: Prepared | None = None, window: int | None = None,
                  sink: int = 0) -> str:
    """Which Triton kernel :func:`latent_decode_attention` launches for a call
    (the one decision, also used for the start-up log line):

    - ``"wide"`` (:mod:`.decode_wide`): pre-RoPE groups whose key
      up-projection tile exceeds one program
      (:func:`.launch.needs_wide`);
    - ``"packed"`` (:mod:`.decode_packed`): in :func:`.decode_packed.blocker`'s
      scope, on the plain grid;
    - ``"latent_rope"`` (:mod:`.decode_latent_rope`): ``latent_rope`` mode, always;
    - ``"grid"`` (:mod:`.decode_kernels`): everything else.

    Args:
        plan, layout, mode, kv_cache: As for :func:`latent_decode_attention`
            (only the cache's strides and block size are read).
        rotary_dim: Rotated channels per head (``head_dim`` in ``post_rope``
            mode).
        config: :class:`.launch.KernelConfig` whose ``wide`` / ``packed`` force
            or forbid a kernel (``None``: the heuristic).
        schedule: ``None`` or the longest-first schedule (grid kernel only).
        prep: The call's :class:`.decode_prep.Prepared` (computed on the CPU when
            ``None``).
        window, sink: The call's sliding window (``None``: none) and sink
            tokens (the ``latent_rope`` kernel's scope,
            :func:`.decode_latent_rope.blocker`).

    Raises:
        ValueError: a kernel forced by ``config`` cannot run this call, or
            per-channel keys with ``post_rope``, a schedule or a block size that
            their token groups do not divide: the message says why.
    """
    cfg = config or KernelConfig()
    per_channel = layout is not None and layout.k_per_channel
    if mode == "latent_rope":
        why = decode_latent_rope.blocker(plan, layout, window=window, sink=sink)
        if why is None and schedule is not None:
            why = "it runs on the plain grid (schedule=None)"
        if why is None and per_channel and kv_cache.shape[2] % layout.k_channel_tokens:
            why = (f"block_size {kv_cache.shape[2]} is not a multiple of the per-channel "
                   f"key group ({layout.k_channel_tokens} tokens)")
        if why is not None:
            raise ValueError(f"the RoPE-equivariant latent kernel cannot run this call: {why}")
        return "latent_rope"
    if cfg.wide is not None:
        wide = cfg.wide
    else:
        wide = mode == "pre_rope" and (
            needs_wide(plan, layout, rotary_dim) if prep is None
            else _key_tile_too_large(prep))
    if per_channel and mode != "pre_rope":
        raise ValueError("per-channel keys are read in pre_rope mode only")
    if per_channel and schedule is not None:
        raise ValueError("per-channel keys run on the plain grid (schedule=None)")
    if per_channel and kv_cache.shape[2] % layout.k_channel_tokens:
        raise ValueError(f"block_size {kv_cache.shape[2]} is not a multiple of the "
                         f"per-channel key group ({layout.k_channel_tokens} tokens)")
    if wide and mode != "pre_rope":
        raise ValueError("the wide-group kernel rebuilds keys: pre_rope mode only")
    if wide and schedule is not None:
        raise ValueError("the wide-group kernel runs on the plain grid (schedule=None)")
    packed_why = decode_packed.blocker(plan, layout, mode, kv_cache) if schedule is None \
        else "LPT schedule"
    if cfg.packed and packed_why:
        raise ValueError(f"the packed post-RoPE kernel cannot run this call: {packed_why}")
    if wide:
        return "wide"
    return "packed" if packed_why is None and cfg.packed is not False else "grid"


def latent_decode_attention(plan, k_up, rope, scale, query, kv_cache, block_table,
                            seq_lens, max_seq_len, *, layout=None, num_splits=None,
                            schedule=None, mode: str = "pre_rope",
                            config: KernelConfig | None = None,
                            out: torch.Tensor | None = None,
                            transform=None, window: int | None = None, sink: int = 0,
                            recent: int = 0, return_lse: bool = False,
                            backend: str = "auto"):
    """Decode attention (one new token per sequence) from a paged latent cache.

    Same meaning and return value as
    :func:`vllm_lowrank.attention.latent_attention.decode_attention`.

    Args:
        plan: :class:`~vllm_lowrank.factorization.plan.LayerPlan` of the layer.
        k_up: ``[Rk, num_kv_heads * head_dim]`` float key up-projection,
            block-diagonal over head groups (unused in ``post_rope`` mode).
        rope: :class:`~vllm_lowrank.attention.rope.RopeTable` on the same device
            (unused in ``post_rope`` mode).
        scale: Softmax scale.
        query: ``[B, H, head_dim]`` post-RoPE queries (``pre_rope``), or
            ``[B, H, >= max(k_ranks)]`` latent-basis queries (``post_rope``);
            bf16, fp16 or fp32.
        kv_cache: ``[num_blocks, 1, block_size, Rk + Rv]`` in the model dtype, or
            ``uint8 [num_blocks, 1, block_size, layout.slot_bytes]`` when ``layout``
            is given. The last dimension must be contiguous.
        block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32 (>= 1).
        max_seq_len: ``max(seq_lens)`` as a host int (sizes the split).
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` of a packed cache
            (with per-channel keys: ``pre_rope`` mode on the plain grid, every
            key group in the attended span complete, ``block_size`` a multiple
            of ``k_channel_tokens``).
        num_splits: Context splits per sequence and group (``None``: heuristic;
            1: no reduce pass).
        schedule: ``None`` for the plain grid; ``"lpt"`` or a
            :class:`~vllm_lowrank.kernels.triton.schedule.DecodeSchedule` for the
            longest-first persistent grid.
        mode: ``"pre_rope"`` (rebuild keys, RoPE), ``"post_rope"``, or
            ``"latent_rope"``: the same attention as ``pre_rope`` for a
            ``k_up`` that commutes with RoPE (``rope_equivariant`` bases), the
            queries absorbed into the key latent
            (:mod:`.decode_latent_rope`; ``query`` as in ``pre_rope``).
        config: Launch parameter overrides (benchmarks).
        out: Optional ``[B, out_width]`` float32 output buffer.
        transform: :class:`~vllm_lowrank.attention.latent_attention.KeyTransform`
            or ``None`` (``pre_rope`` mode only; a ``ValueError`` otherwise):
            ``bias`` ``[num_kv_heads * head_dim]`` added to each rebuilt key,
            then per-head RMSNorm ``k / sqrt(mean(k^2) + norm_eps) * norm_weight``
            (``norm_weight [head_dim]``; mean over the whole head: both rotary
            halves and the unrotated rest; Zhang & Sennrich 2019, eq. 4), both
            before RoPE (Qwen2 key bias, Qwen3/Gemma-3 QK-norm). Computed in
            float32 from the float32 rebuild.
        window: Sliding window or ``None``: sequence ``b`` (query at position
            ``seq_lens[b] - 1``) sees keys ``t >= seq_lens[b] - window`` only.
            Earlier positions are never read (their blocks may be null blocks
            holding garbage or NaN): the tiles start at the window's first
            position and the splits share them. ``window >= max_seq_len`` runs
            the plain kernel.
        sink, recent: Token-adaptive mode (TALE), host ints ``>= 0``, the same
            for every sequence: only the latent span ``max(sink, seq_lens[b] -
            window) <= t < seq_lens[b] - recent`` is attended (the first ``sink``
            and the last ``recent`` positions are attended exactly elsewhere and
            merged by log-sum-exp, see ``return_lse``). Positions outside the
            span are never read, like those before a window (the tiles start at
            the span's first position; rows from its end on are masked). A
            sequence with an empty span (``seq_lens[b] <= sink + recent``, or a
            window inside the recent part) gets a zero output row. ``0, 0``
            runs the plain kernel.
        return_lse: Also return the log-sum-exp of the attended scores.
        backend: ``"auto"`` (default): the CUDA kernel of
            :func:`vllm_lowrank.kernels.cuda.ext.latent_decode_pre_rope` when the call is
            in its scope (see :func:`cuda_path_blocker`) and the extension builds,
            else this module's Triton kernel; ``"triton"``: always Triton;
            ``"cuda"``: the CUDA kernel, a ``ValueError`` naming the reason if
            the call is outside its scope.

    Returns:
        ``[B, plan.out_width]`` float32; with ``return_lse`` the pair ``(out,
        lse)``, ``lse [B, num_heads]`` float32 ``log sum_t exp(scale * q . k_t)``
        over the attended positions, natural log (``-inf`` where the span is
        empty). The same as
        :func:`vllm_lowrank.attention.latent_attention.decode_attention` with the
        same arguments.
    """
    if mode not in ("pre_rope", "post_rope", "latent_rope"):
        raise ValueError(f"mode must be 'pre_rope', 'post_rope' or 'latent_rope', got {mode!r}")
    if backend not in ("auto", "triton", "cuda"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'cuda', got {backend!r}")
    if backend != "triton":
        why = cuda_path_blocker(plan, rope, query, kv_cache, block_table, seq_lens, max_seq_len,
                                layout=layout, schedule=schedule, mode=mode, config=config,
                                out=out, transform=transform, window=window, sink=sink,
                                recent=recent)
        if why is None:
            why = _cuda_unavailable()
        if why is None:
            return _cuda_decode(plan, k_up, rope, scale, query, kv_cache, block_table,
                                seq_lens, max_seq_len, num_splits, out, return_lse)
        if backend == "cuda":
            raise ValueError(f"backend='cuda' cannot run this call: {why}")
    cfg = config or KernelConfig()
    device = query.device
    bsz, num_heads, _ = query.shape
    sh = plan.shape
    if num_heads != sh.num_heads:
        raise ValueError(f"query has {num_heads} heads, plan expects {sh.num_heads}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    quant = layout is not None
    if quant and kv_cache.dtype != torch.uint8:
        raise ValueError("a quantized layout needs a uint8 cache")
    if not quant and kv_cache.shape[-1] != plan.k_width + plan.v_width:
        raise ValueError(f"kv_cache slot width {kv_cache.shape[-1]} != Rk + Rv = "
                         f"{plan.k_width + plan.v_width}")
    if quant and kv_cache.shape[-1] != layout.slot_bytes:
        raise ValueError(f"kv_cache slot {kv_cache.shape[-1]} B != layout.slot_bytes "
                         f"{layout.slot_bytes}")
    if quant:
        dt_torch = query.dtype
    else:
        dt_torch = kv_cache.dtype
    if dt_torch not in TL_DTYPES:
        raise ValueError(f"unsupported compute dtype {dt_torch}")
    if interpreting():
        # Triton's CPU interpreter multiplies bf16/fp16 dot operands wrongly
        # (triton 3.9: raw bits); compute in float32 there. Loads, conversions
        # and the kernel structure are the same.
        dt_torch = torch.float32

    if transform is not None and mode != "pre_rope":
        raise ValueError("transform= (key bias / QK-norm) applies to rebuilt keys: "
                         "pre_rope mode only (post-RoPE latents are cached transformed; "
                         "a key bias or norm breaks the latent rotation of latent_rope)")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    use_window = window is not None and int(window) < max_seq_len
    sink, recent = int(sink), int(recent)
    if sink < 0 or recent < 0:
        raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
    use_span = sink > 0 or recent > 0
    k_bias = transform is not None and transform.bias is not None
    k_norm = transform is not None and transform.norm_weight is not None
    kd = sh.num_kv_heads * sh.head_dim
    kb = kn = None
    if k_bias:
        kb = transform.bias.to(device=device, dtype=torch.float32).contiguous()
        if kb.numel() != kd:
            raise ValueError(f"key bias has {kb.numel()} entries, expected "
                             f"num_kv_heads * head_dim = {kd}")
    if k_norm:
        kn = transform.norm_weight.to(device=device, dtype=torch.float32).contiguous()
        if kn.numel() != sh.head_dim:
            raise ValueError(f"norm weight has {kn.numel()} entries, expected "
                             f"head_dim = {sh.head_dim}")
    norm_eps = float(transform.norm_eps) if k_norm else 0.0

    rotary_dim = rope.rotary_dim if mode != "post_rope" else sh.head_dim
    neox = rope.neox if mode != "post_rope" else True
    prep = prepare(plan, layout, rotary_dim, neox, device)
    if mode == "latent_rope":
        absorb, weights = decode_latent_rope.absorption(
            plan, k_up, rope, query.dtype if query.dtype in (torch.bfloat16, torch.float16)
            else torch.float32)
        query = decode_latent_rope.absorbed_queries(plan, absorb, query)
        cos, sin = rope.cos, rope.sin
        rope_direct, s_rope, max_pos = False, cos.stride(0), cos.shape[0]
    elif mode == "pre_rope":
        weights = key_weights(plan, k_up, prep, dt_torch, rotary_dim, neox)
        cos, sin = rope.cos, rope.sin
        if cos.device != device:
            raise ValueError("rope tables must be on the query's device")
        rope_direct = not rope_is_rotation(rope)
        s_rope, max_pos = cos.stride(0), cos.shape[0]
    else:
        weights = _placeholder(device, dt_torch)
        cos = sin = _placeholder(device, torch.float32)
        rope_direct, s_rope, max_pos = False, 0, 0
        if query.shape[-1] < max(plan.k_ranks):
            raise ValueError("post_rope queries need >= max(k_ranks) columns")

    kernel = triton_kernel(plan, layout, mode, kv_cache, rotary_dim, cfg, schedule, prep,
                           window if use_window else None, sink)
    wide, packed = kernel == "wide", kernel == "packed"
    latent_rope = kernel == "latent_rope"
    if packed:
        dflt = _packed_config(device)
    elif latent_rope:
        dflt = _latent_rope_config(prep, device)
    elif wide:
        dflt = _wide_config(plan, prep, device)
    else:
        dflt = _default_config(plan, prep, mode, device, quant)
    hpp = 1
    if wide:
        hpp = (math.gcd(cfg.heads_per_program, plan.group_size) if cfg.heads_per_program else
               wide_heads_per_program(bsz, plan.num_groups, plan.group_size, sh.queries_per_kv,
                                      prep.rv_max_pad))
    if hpp > 1 and device.type == "cuda":  # larger tiles spill (H100 sweep: 64 is 3-4x slower)
        dflt = dict(dflt, block_n=min(dflt["block_n"], 32))
    block_n = cfg.block_n or dflt["block_n"]
    if latent_rope and layout is not None and layout.k_per_channel:
        block_n = layout.k_channel_tokens  # one per-channel key group per tile
    num_warps = cfg.num_warps or dflt["num_warps"]
    num_stages = cfg.num_stages or dflt["num_stages"]
    trans = cfg.transposed if cfg.transposed is not None else dflt["transposed"]
    pps = cfg.programs_per_sm or dflt["programs_per_sm"]
    n_sm = sm_count(device)
    ng = plan.num_groups
    hg = plan.heads_per_group
    chan = layout is not None and layout.k_per_channel
    if wide or packed or chan or latent_rope:
        gpp = 1
    elif cfg.groups_per_program is not None:
        gpp = cfg.groups_per_program
    else:  # the LPT work list has one head group per item
        gpp = 1 if schedule is not None else dflt["groups_per_program"]
    if gpp not in (1, 2, 4) or (gpp > 1 and not _gpp_ok(plan, prep, gpp)):
        raise ValueError(f"groups_per_program={gpp} needs equal power-of-two ranks in "
                         f"every group and num_groups % {gpp} == 0")
    if schedule is not None and gpp != 1:
        raise ValueError("the LPT schedule runs one head group per item "
                         "(groups_per_program=1)")
    if num_splits is None:
        if schedule is not None and not isinstance(schedule, str):
            num_splits = schedule.num_splits
        else:
            # A window bounds the tiles per sequence (plus one partial tile), so
            # does the latent span (its tiles start at its first position).
            eff_len = min(max_seq_len, int(window) + block_n) if use_window else max_seq_len
            if use_span:
                eff_len = max(1, min(eff_len, max_seq_len - sink - recent))
            units = sh.num_kv_heads // hpp if wide else ng // gpp
            num_splits = choose_num_splits(bsz, units, eff_len, block_n, n_sm, pps,
                                           256 if hpp > 1 else 64)
    num_splits = int(num_splits)
    split = num_splits > 1
    query = query if query.stride(-1) == 1 else query.contiguous()
    if out is None:
        out = torch.empty(bsz, plan.out_width, device=device, dtype=torch.float32)
    lse = torch.empty(bsz, num_heads, device=device, dtype=torch.float32) \
        if return_lse else None
    if split:
        po = torch.empty(bsz, num_splits, plan.out_width, device=device,
                         dtype=torch.float32)
        plse = torch.empty(bsz, num_splits, num_heads, device=device, dtype=torch.float32)
    else:
        po = out
        plse = lse if return_lse else out  # the kernel stores the final LSE there

    if packed:
        decode_packed.launch(
            plan, layout, query, kv_cache, block_table, seq_lens,
            qk_scale=float(scale) * LOG2E, num_splits=num_splits, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages, po=po, plse=plse,
            window=int(window) if use_window else 0, sink=sink, recent=recent,
            use_window=use_window, use_span=use_span, return_lse=return_lse,
            interpreting=interpreting())
        return _merge_splits(plan, prep, out, lse, po, plse, num_splits, return_lse)
    classes = list(prep.classes) + [(16, 16)] * (MAX_CLASSES - len(prep.classes))
    if quant:
        k_qg = 0 if chan or all(q == r for q, r in zip(layout.k_groups, layout.k_ranks)) \
            else layout.k_groups[0]
        v_qg = 0 if all(q == r for q, r in zip(layout.v_groups, layout.v_ranks)) \
            else layout.v_groups[0]
        if k_qg and len(set(layout.k_groups)) > 1 or v_qg and len(set(layout.v_groups)) > 1:
            raise ValueError("mixed per-group quantization group sizes are not supported")
        aligned = layout.slot_bytes % 2 == 0 and layout.k_scale_offset % 2 == 0 \
            and kv_cache.stride(0) % 2 == 0 and kv_cache.stride(2) % 2 == 0
        q_offs = (layout.k_scale_offset, layout.k_zero_offset, layout.v_scale_offset,
                  layout.v_zero_offset)
        k_bits, v_bits = layout.k_bits, layout.v_bits
        if gpp > 1 and v_qg == 0 and mode == "pre_rope":
            # Dequantized value tile of the GPP groups' contiguous segment: one
            # scale/zero pair per group = per RV_PAD channels. (Post-RoPE mode
            # keeps V_QG = 0: per-group pairs applied after the dot.)
            v_qg = classes[0][1]
    else:
        k_qg = v_qg = 0
        aligned = True
        q_offs = (0, 0, 0, 0)
        k_bits = v_bits = 16
    # Largest power of two (<= 16 bytes' worth) dividing every group offset: an
    # alignment hint for vector loads.
    elem = 1 if quant else kv_cache.element_size()
    offs = prep.offsets
    off_mult = 16 // elem
    while off_mult > 1 and any(o % off_mult for o in offs):
        off_mult //= 2
    # Largest power of two dividing every rank (a hint for the rank masks): 8 for
    # float caches (16 bytes of bf16), up to 64 for packed ones (a rank-64 group
    # of 8-bit codes is one 64-byte row segment); 1 if a rank is not a multiple of 8.
    ranks = plan.k_ranks + plan.v_ranks
    rank_mult = 64 if quant else 8
    while rank_mult > 8 and any(r % rank_mult for r in ranks):
        rank_mult //= 2
    if any(r % 8 for r in ranks):
        off_mult = rank_mult = 1
    common = dict(
        MODE=0 if mode == "pre_rope" else 1, ROPE_DIRECT=rope_direct,
        TRANS=trans,
        HG=hg, HG_PAD=pow2(gpp * hg), QPK=sh.queries_per_kv, GPP=gpp,
        C1=prep.c1, C3=prep.c3, CW=prep.cw,
        BLOCK_N=block_n, PAGE=kv_cache.shape[2], DT=TL_DTYPES[dt_torch],
        QUANT=quant, K_BITS=k_bits, V_BITS=v_bits, K_QG=k_qg, V_QG=v_qg,
        ALIGNED=aligned, SPLIT=split, OFF_MULT=off_mult, RANK_MULT=rank_mult,
        SLOT_MULT=pow2_divisor(kv_cache.stride(2), kv_cache.stride(0)),
        NUM_CLS=len(prep.classes), K_BIAS=k_bias, K_NORM=k_norm, WINDOW=use_window,
        SPAN=use_span, LSE=bool(return_lse), K_CHAN=chan,
        KCT=layout.k_channel_tokens if chan else 1, SHARE=layout.k_share_bytes if chan else 1,
        RK0=classes[0][0], RV0=classes[0][1], RK1=classes[1][0], RV1=classes[1][1],
        RK2=classes[2][0], RV2=classes[2][1], RK3=classes[3][0], RV3=classes[3][1],
        num_warps=num_warps, num_stages=num_stages,
    )
    args = (
        num_splits, ng,
        query, query.stride(0), query.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(2),
        block_table, block_table.stride(0), seq_lens,
        weights, weights.stride(0) if weights.dim() == 4 else 0,
        weights.stride(1) if weights.dim() == 4 else 0,
        prep.maps, cos, sin, s_rope, max_pos, prep.group_table,
        *q_offs,
        po, plse, out, plan.out_width, num_heads, float(scale) * LOG2E,
        kb if k_bias else cos, kn if k_norm else cos, sh.head_dim, norm_eps,
        int(window) if use_window else 0, sink, recent,
        layout.k_share_offset if chan else 0, sum(plan.k_ranks),
    )
    if wide:
        _launch_wide(plan, prep, args, common, dflt, cfg, hpp, rotary_dim, num_splits, bsz)
    elif latent_rope:
        vc = min(cfg.value_chunk or dflt["value_chunk"], prep.rv_max_pad)
        if v_qg and (vc % v_qg or v_qg & (v_qg - 1)):
            vc = prep.rv_max_pad  # a chunk must start on a scale group: one chunk
        decode_latent_rope.launch(plan, args, common, vc, num_splits, bsz)
    elif schedule is None:
        decode_grid_kernel[(num_splits, ng // gpp, bsz)](*args, **common)
    else:
        from vllm_lowrank.kernels.triton.schedule import DecodeSchedule, build_lpt_schedule

        if not isinstance(schedule, DecodeSchedule):
            if schedule != "lpt":
                raise ValueError(f"unknown schedule {schedule!r}")
            # Cost model only (items are cut by the kernel): windowed sequences
            # cost their window, token-adaptive ones their latent span.
            cost_lens = seq_lens.clamp(max=int(window) + block_n) if use_window else seq_lens
            if use_span:
                cost_lens = (cost_lens - sink - recent).clamp(min=0)
            schedule = build_lpt_schedule(plan, cost_lens, num_splits, block_n,
                                          num_workers=None, device=device)
        if schedule.num_splits != num_splits:
            raise ValueError("schedule was built for a different num_splits")
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        decode_persistent_kernel[(schedule.num_workers,)](
            schedule.items, schedule.items.numel(), counter, *args, **common)
    return _merge_splits(plan, prep, out, lse, po, plse, num_splits, return_lse)


def _merge_splits(plan, prep: Prepared, out, lse, po, plse, num_splits: int,
                  return_lse: bool):
    """Merge the split partials into ``out`` (and ``lse``) with
    :func:`.tiles.reduce_splits_kernel` when ``num_splits > 1``; return the call's
    result."""
    if num_splits > 1:
        block_c = 128
        bsz, num_heads = out.shape[0], plan.shape.num_heads
        reduce_splits_kernel[(bsz, triton.cdiv(plan.out_width, block_c))](
            po, plse, out, prep.head_of_col, num_splits, plan.out_width, num_heads,
            lse if return_lse else plse, S_PAD=pow2(num_splits, 2), BLOCK_C=block_c,
            LSE=bool(return_lse), H_PAD=pow2(num_heads, 2), num_warps=4)
    return (out, lse) if return_lse else out
