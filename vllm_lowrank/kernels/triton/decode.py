r"""Fused paged decode attention over latent KV: the host side of the Triton kernels.

:class:`LatentLaunch` prepares, once per layer (at start-up, after the weights
are loaded), everything a decode call of that layer reads besides the step's
queries, cache and block table: the kernel (:func:`choose_kernel`: the grid
kernel of :mod:`.decode_kernels`, the wide-group kernel of :mod:`.decode_wide`,
the packed post-RoPE kernel of :mod:`.decode_packed` or the RoPE-equivariant
latent kernel of :mod:`.decode_latent_rope`), its launch parameters
(:mod:`.launch`), the group tables and packed key weights (:mod:`.decode_prep`)
and its constant arguments. A call only picks the context split (host
arithmetic on the batch size and the longest sequence), launches, and merges
the split partials (:func:`.tiles.reduce_splits_kernel`).

The attention computed (per sequence, head group and query head) is that of
:func:`vllm_lowrank.attention.latent_attention.decode_attention` with the same
arguments; its module docstring has the derivation.

Example::

    launch = LatentLaunch(plan, layout, mode="pre_rope", k_up=k_up, rope=rope,
                          scale=d ** -0.5, dtype=torch.bfloat16, device=q.device,
                          block_size=16)
    out = launch(q, kv_cache, block_table, seq_lens, int(seq_lens.max()))
    # out: [B, plan.out_width] float32
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from . import decode_latent_rope, decode_packed
from .decode_kernels import decode_grid_kernel
from .decode_prep import (LOG2E, TL_DTYPES, interpreting, pack_key_weights, pow2,
                          pow2_divisor, prepare, rope_is_rotation, sm_count)
from .decode_wide import PER_LAYER_ARGS
from .launch import (KernelConfig, _default_config, _gpp_ok, _key_tile_too_large,
                     _latent_rope_config, _packed_config, _wide_config, choose_num_splits,
                     wide_heads_per_program)
from .tiles import reduce_splits_kernel

KERNELS = {
    "grid": "Triton kernel",
    "wide": "wide-group Triton kernel (the rank in chunks, 1 to 4 KV heads per program)",
    "packed": "packed post-RoPE Triton kernel (codes in the dots)",
    "latent_rope": "RoPE-equivariant latent Triton kernel (queries absorbed, no key rebuild)",
}
"""The Triton decode kernels, by the name :func:`choose_kernel` returns, with
the label the start-up log line gives them."""

MODES = ("pre_rope", "post_rope", "latent_rope")


class DecodeArgs(NamedTuple):
    """The runtime arguments of one call of the grid, wide-group and latent-RoPE
    kernels, in the kernels' order: groups of related arguments as tuples, then
    the slot layout's offsets as scalars (the arguments the wide-group and
    latent-RoPE kernels do not specialize on, :data:`.decode_wide.PER_LAYER_ARGS`,
    the last fields, in that order). Strides in elements of the tensor (bytes
    for a uint8 cache), offsets in bytes of a slot."""

    n_splits: int
    """Context splits per sequence (1: the kernel writes ``out`` itself)."""
    qk_scale: float
    """Softmax scale times ``log2 e`` (the kernels' scores are base 2)."""
    query: tuple
    """``(q [B, H, *], stride(0), stride(1))``."""
    pages: tuple
    """``(kv_cache, block stride, slot stride, block_table, its row stride,
    seq_lens)``."""
    keys: tuple
    """``(packed key bases or the latent-RoPE frequency table, group stride,
    section stride, column maps, cos, sin, RoPE row stride, RoPE rows)``."""
    groups: tuple
    """``(group table [8, num_groups] int32, num_groups)``."""
    outs: tuple
    """``(split partials or out, their LSE or lse, out, out_width, num_heads)``."""
    norm: tuple
    """``(key bias, key norm weight, head_dim, norm eps)`` (the key transform)."""
    span: tuple
    """``(window, sink, recent)`` (0 for none)."""
    k_scale_off: int
    k_zero_off: int
    v_scale_off: int
    v_zero_off: int
    share_off: int
    """Per-channel key parameters' offset (0 without them)."""
    rk_total: int
    """Key channels of the layer (the sum of its key ranks)."""
    share: int
    """Per-channel key parameter bytes per slot."""


assert DecodeArgs._fields[-len(PER_LAYER_ARGS):] == PER_LAYER_ARGS


def choose_kernel(plan, layout, mode: str, block_size: int, rotary_dim: int,
                  config: KernelConfig | None = None, window: int | None = None,
                  sink: int = 0, slot_stride: int | None = None) -> str:
    """Which Triton kernel decodes a layer (a key of :data:`KERNELS`):

    - ``"wide"`` (:mod:`.decode_wide`): pre-RoPE groups whose key
      up-projection tile exceeds one program (:func:`.launch.needs_wide`);
    - ``"packed"`` (:mod:`.decode_packed`): in :func:`.decode_packed.blocker`'s scope;
    - ``"latent_rope"`` (:mod:`.decode_latent_rope`): ``latent_rope`` mode, always;
    - ``"grid"`` (:mod:`.decode_kernels`): everything else.

    Args:
        plan, layout, mode: As for :class:`LatentLaunch`.
        block_size: Tokens per KV block of the layer's cache.
        rotary_dim: Rotated channels per head (``head_dim`` in ``post_rope`` mode).
        config: :class:`.launch.KernelConfig` whose ``wide`` / ``packed`` force or
            forbid a kernel (``None``: the heuristic).
        window, sink: The layer's sliding window (``None``: none) and exact sink
            tokens (the ``latent_rope`` kernel's scope).
        slot_stride: Elements (bytes) per cache slot (``None``: the layout's).

    Raises:
        ValueError: no Triton kernel reads the layer (per-channel keys outside
            ``pre_rope`` mode, a block size that their token groups do not
            divide), or a kernel forced by ``config`` cannot: the message says why.
    """
    cfg = config or KernelConfig()
    per_channel = layout is not None and layout.k_per_channel
    if per_channel and block_size % layout.k_channel_tokens:
        raise ValueError(f"block_size {block_size} is not a multiple of the per-channel "
                         f"key group ({layout.k_channel_tokens} tokens)")
    if mode == "latent_rope":
        why = decode_latent_rope.blocker(plan, layout, window=window, sink=sink)
        if why is not None:
            raise ValueError(f"the RoPE-equivariant latent kernel cannot run this layer: {why}")
        return "latent_rope"
    if cfg.wide is not None:
        wide = cfg.wide
    else:
        wide = mode == "pre_rope" and _key_tile_too_large(
            prepare(plan, layout, rotary_dim, True, "cpu"))
    if per_channel and mode != "pre_rope":
        raise ValueError("per-channel keys are read in pre_rope mode only")
    if wide and mode != "pre_rope":
        raise ValueError("the wide-group kernel rebuilds keys: pre_rope mode only")
    stride = slot_stride if slot_stride is not None else (
        layout.slot_bytes if layout is not None else plan.k_width + plan.v_width)
    packed_why = decode_packed.blocker(plan, layout, mode, stride, block_size)
    if cfg.packed and packed_why:
        raise ValueError(f"the packed post-RoPE kernel cannot run this layer: {packed_why}")
    if wide:
        return "wide"
    return "packed" if packed_why is None and cfg.packed is not False else "grid"


class LatentLaunch:
    """The Triton decode of one latent layer, prepared once.

    Args:
        plan: :class:`~vllm_lowrank.factorization.plan.LayerPlan` of the layer.
        layout: :class:`~vllm_lowrank.format.latent.SlotLayout` of a packed
            cache, or ``None`` (latents in the cache dtype).
        mode: ``"pre_rope"`` (rebuild keys, RoPE), ``"post_rope"`` (queries in
            the key latent basis, ``[B, H, >= max r_k]``) or ``"latent_rope"``
            (the attention of ``pre_rope`` for a ``k_up`` that commutes with
            RoPE: the queries absorbed into the key latent,
            :mod:`.decode_latent_rope`).
        scale: Softmax scale.
        dtype: Query (model) dtype: bf16, fp16 or fp32.
        device: Where the layer runs.
        block_size: Tokens per KV block configured (the cache's own block size,
            read at each call, may be a multiple of it: vLLM enlarges the blocks of
            a cache group whose pages are smaller than another group's).
        k_up: ``[Rk, num_kv_heads * head_dim]`` float block-diagonal key
            up-projection (``pre_rope`` and ``latent_rope``).
        rope: :class:`~vllm_lowrank.attention.rope.RopeTable` on ``device``
            (``pre_rope`` and ``latent_rope``).
        cache_dtype: Element dtype of an unquantized cache (``None``: ``dtype``).
        transform: :class:`~vllm_lowrank.attention.latent_attention.KeyTransform`
            of rebuilt keys (``pre_rope`` only): key bias, then per-head RMSNorm
            (Zhang & Sennrich 2019, eq. 4), both before RoPE.
        window: Sliding window (keys ``t >= seq_len - window``), or ``None``.
        sink, recent: Token-adaptive span (TALE): only ``max(sink, seq_len -
            window) <= t < seq_len - recent`` is attended (``0, 0``: everything);
            positions outside it are never read.
        config: :class:`.launch.KernelConfig` launch overrides (``None``: the
            measured defaults).

    Raises:
        ValueError: a mode, transform, window or span outside the kernels'
            scope, or a layer no Triton kernel reads (:func:`choose_kernel`).
    """

    def __init__(self, plan, layout, *, mode: str, scale: float, dtype: torch.dtype,
                 device, block_size: int, k_up: torch.Tensor | None = None, rope=None,
                 cache_dtype: torch.dtype | None = None, transform=None,
                 window: int | None = None, sink: int = 0, recent: int = 0,
                 config: KernelConfig | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if transform is not None and mode != "pre_rope":
            raise ValueError("transform= (key bias / QK-norm) applies to rebuilt keys: "
                             "pre_rope mode only (post-RoPE latents are cached transformed; "
                             "a key bias or norm breaks the latent rotation of latent_rope)")
        if window is not None and int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if sink < 0 or recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as tensors name it: cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        sh = plan.shape
        self.plan, self.layout, self.mode = plan, layout, mode
        self.device, self.block_size = device, block_size
        self.window = None if window is None else int(window)
        self.sink, self.recent = int(sink), int(recent)
        self.qk_scale = float(scale) * LOG2E
        self.cfg = cfg = config or KernelConfig()
        quant = layout is not None
        dt = dtype if quant else (cache_dtype or dtype)
        if dt not in TL_DTYPES:
            raise ValueError(f"unsupported compute dtype {dt}")
        if interpreting():
            # Triton's CPU interpreter multiplies bf16/fp16 dot operands wrongly
            # (triton 3.9: raw bits); compute in float32 there. Loads, conversions
            # and the kernel structure are the same.
            dt = torch.float32
        self.dt = dt
        self.cache_dtype = cache_dtype or dtype
        self.rotary_dim = rotary_dim = rope.rotary_dim if mode != "post_rope" else sh.head_dim
        neox = rope.neox if mode != "post_rope" else True
        self.prep = prep = prepare(plan, layout, rotary_dim, neox, device)
        self.kernel = choose_kernel(plan, layout, mode, block_size, rotary_dim, cfg, window,
                                    sink)
        self._key_side(k_up, rope, transform, dtype, rotary_dim, neox)
        if self.kernel == "packed":
            self.dflt = _packed_config(device)
        elif self.kernel == "latent_rope":
            self.dflt = _latent_rope_config(prep, device)
        elif self.kernel == "wide":
            self.dflt = _wide_config(plan, prep, device)
        else:
            self.dflt = _default_config(plan, prep, mode, device, quant)
        chan = quant and layout.k_per_channel
        if self.kernel != "grid" or chan:
            gpp = 1
        else:
            gpp = cfg.groups_per_program if cfg.groups_per_program is not None \
                else self.dflt["groups_per_program"]
        if gpp not in (1, 2, 4) or (gpp > 1 and not _gpp_ok(plan, prep, gpp)):
            raise ValueError(f"groups_per_program={gpp} needs equal power-of-two ranks in "
                             f"every group and num_groups % {gpp} == 0")
        self.gpp = gpp
        self._common = self._constexprs(chan)
        self._geometry_cache: dict = {}

    # -- preparation -------------------------------------------------------------

    def _key_side(self, k_up, rope, transform, dtype, rotary_dim: int, neox: bool) -> None:
        """The key weights (packed ``B_k``, or the latent_rope absorption and
        frequency table), RoPE tables and key transform tensors of the launch."""
        plan, device, sh = self.plan, self.device, self.plan.shape
        kd = sh.num_kv_heads * sh.head_dim
        placeholder_f = torch.zeros(1, device=device, dtype=torch.float32)
        self.k_bias = self.k_norm = placeholder_f
        self.norm_eps = 0.0
        self.has_bias = transform is not None and transform.bias is not None
        self.has_norm = transform is not None and transform.norm_weight is not None
        if self.has_bias:
            self.k_bias = transform.bias.to(device=device, dtype=torch.float32).contiguous()
            if self.k_bias.numel() != kd:
                raise ValueError(f"key bias has {self.k_bias.numel()} entries, expected "
                                 f"num_kv_heads * head_dim = {kd}")
        if self.has_norm:
            self.k_norm = transform.norm_weight.to(device=device,
                                                   dtype=torch.float32).contiguous()
            if self.k_norm.numel() != sh.head_dim:
                raise ValueError(f"norm weight has {self.k_norm.numel()} entries, expected "
                                 f"head_dim = {sh.head_dim}")
            self.norm_eps = float(transform.norm_eps)
        self.absorb = None
        if self.mode == "latent_rope":
            absorb_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
            self.absorb, self.weights = decode_latent_rope.absorption(plan, k_up, rope,
                                                                      absorb_dtype)
            self.cos, self.sin = rope.cos, rope.sin
            self.rope_direct, self.s_rope, self.max_pos = False, rope.cos.stride(0), \
                rope.cos.shape[0]
        elif self.mode == "pre_rope":
            if rope.cos.device != device:
                raise ValueError("rope tables must be on the layer's device")
            self.weights = pack_key_weights(plan, k_up, self.prep, self.dt)
            self.cos, self.sin = rope.cos, rope.sin
            self.rope_direct = not rope_is_rotation(rope)
            self.s_rope, self.max_pos = rope.cos.stride(0), rope.cos.shape[0]
        else:
            self.weights = torch.zeros(1, device=device, dtype=self.dt)
            self.cos = self.sin = placeholder_f
            self.rope_direct, self.s_rope, self.max_pos = False, 0, 0

    def _constexprs(self, chan: bool) -> dict:
        """The kernels' compile-time arguments that do not depend on the call."""
        plan, layout, prep, cfg, dflt = self.plan, self.layout, self.prep, self.cfg, self.dflt
        sh, quant = plan.shape, layout is not None
        if quant:
            k_qg = 0 if chan or all(q == r for q, r in zip(layout.k_groups, layout.k_ranks)) \
                else layout.k_groups[0]
            v_qg = 0 if all(q == r for q, r in zip(layout.v_groups, layout.v_ranks)) \
                else layout.v_groups[0]
            if k_qg and len(set(layout.k_groups)) > 1 or v_qg and len(set(layout.v_groups)) > 1:
                raise ValueError("mixed per-group quantization group sizes are not supported")
            aligned = layout.slot_bytes % 2 == 0 and layout.k_scale_offset % 2 == 0
            self.q_offs = (layout.k_scale_offset, layout.k_zero_offset, layout.v_scale_offset,
                           layout.v_zero_offset)
            k_bits, v_bits = layout.k_bits, layout.v_bits
            if self.gpp > 1 and v_qg == 0 and self.mode == "pre_rope":
                # Dequantized value tile of the GPP groups' contiguous segment: one
                # scale/zero pair per group = per RV_PAD channels. (Post-RoPE mode
                # keeps V_QG = 0: per-group pairs applied after the dot.)
                v_qg = prep.classes[0][1]
        else:
            k_qg = v_qg = 0
            aligned = True
            self.q_offs = (0, 0, 0, 0)
            k_bits = v_bits = 16
        # Largest power of two (<= 16 bytes' worth) dividing every group offset: an
        # alignment hint for vector loads.
        elem = 1 if quant else self.cache_dtype.itemsize
        off_mult = 16 // elem
        while off_mult > 1 and any(o % off_mult for o in prep.offsets):
            off_mult //= 2
        # Largest power of two dividing every rank (a hint for the rank masks): 8 for
        # float caches (16 bytes of bf16), up to 64 for packed ones; 1 if a rank is
        # not a multiple of 8.
        ranks = plan.k_ranks + plan.v_ranks
        rank_mult = 64 if quant else 8
        while rank_mult > 8 and any(r % rank_mult for r in ranks):
            rank_mult //= 2
        if any(r % 8 for r in ranks):
            off_mult = rank_mult = 1
        self.slot = layout.slot_bytes if quant else plan.k_width + plan.v_width
        return dict(
            MODE=0 if self.mode == "pre_rope" else 1, ROPE_DIRECT=self.rope_direct,
            TRANS=cfg.transposed if cfg.transposed is not None else dflt["transposed"],
            HG=plan.heads_per_group, HG_PAD=pow2(self.gpp * plan.heads_per_group),
            QPK=sh.queries_per_kv, GPP=self.gpp,
            C1=prep.c1, C3=prep.c3, CW=prep.cw,
            DT=TL_DTYPES[self.dt],
            QUANT=quant, K_BITS=k_bits, V_BITS=v_bits, K_QG=k_qg, V_QG=v_qg,
            ALIGNED=aligned, OFF_MULT=off_mult, RANK_MULT=rank_mult,
            RANKS=prep.classes, K_BIAS=self.has_bias, K_NORM=self.has_norm,
            SPAN=self.sink > 0 or self.recent > 0, K_CHAN=chan,
            KCT=layout.k_channel_tokens if chan else 1,
            SHARE=layout.k_share_bytes if chan else 1,
            num_warps=cfg.num_warps or dflt["num_warps"],
            num_stages=cfg.num_stages or dflt["num_stages"],
        )

    # -- per call ----------------------------------------------------------------

    def geometry(self, bsz: int, max_seq_len: int) -> tuple[int, int, int]:
        """``(num_splits, heads_per_program, block_n)`` of a call on ``bsz``
        sequences whose longest has ``max_seq_len`` tokens: host arithmetic
        only (a CUDA graph captured at ``max_model_len`` keeps its split)."""
        key = (bsz, max_seq_len)
        hit = self._geometry_cache.get(key)
        if hit is not None:
            return hit
        plan, cfg, dflt, sh = self.plan, self.cfg, self.dflt, self.plan.shape
        hpp = 1
        if self.kernel == "wide":
            hpp = (math.gcd(cfg.heads_per_program, plan.group_size) if cfg.heads_per_program
                   else wide_heads_per_program(bsz, plan.num_groups, plan.group_size,
                                               sh.queries_per_kv, self.prep.rv_max_pad))
        block_n = dflt["block_n"]
        if hpp > 1 and self.device.type == "cuda":  # larger tiles spill (H100: 64 is 3-4x slower)
            block_n = min(block_n, 32)
        block_n = cfg.block_n or block_n
        if self.kernel == "latent_rope" and self.layout is not None and \
                self.layout.k_per_channel:
            block_n = self.layout.k_channel_tokens  # one per-channel key group per tile
        use_window = self.window is not None and self.window < max_seq_len
        # A window bounds the tiles per sequence (plus one partial tile), so does
        # the latent span (its tiles start at its first position).
        eff_len = min(max_seq_len, self.window + block_n) if use_window else max_seq_len
        if self.sink or self.recent:
            eff_len = max(1, min(eff_len, max_seq_len - self.sink - self.recent))
        units = sh.num_kv_heads // hpp if self.kernel == "wide" else plan.num_groups // self.gpp
        pps = cfg.programs_per_sm or dflt["programs_per_sm"]
        splits = choose_num_splits(bsz, units, eff_len, block_n, sm_count(self.device), pps,
                                   256 if hpp > 1 else 64)
        if len(self._geometry_cache) < 4096:
            self._geometry_cache[key] = (splits, hpp, block_n)
        return splits, hpp, block_n

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, *, num_splits: int | None = None,
                 return_lse: bool = False, out: torch.Tensor | None = None,
                 query_start_loc: torch.Tensor | None = None, max_query_len: int = 1):
        """Decode attention of one new token per sequence, or (the packed
        kernel, :attr:`takes_query_tokens`) of a speculative verify step's few.

        Args:
            query: ``[B, H, head_dim]`` post-RoPE queries (``pre_rope``,
                ``latent_rope``), or ``[B, H, >= max(k_ranks)]`` latent-basis
                queries (``post_rope``), the layer's dtype.
            kv_cache: ``[num_blocks, 1, block_size, Rk + Rv]`` in the cache dtype,
                or ``uint8 [num_blocks, 1, block_size, layout.slot_bytes]``;
                contiguous last dimension.
            block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32 (>= 1).
            max_seq_len: ``max(seq_lens)`` as a host int (sizes the split).
            num_splits: Context splits per sequence and group (``None``: the
                wave model of :func:`.launch.choose_num_splits`).
            return_lse: Also return the log-sum-exp of the attended scores.
            out: Optional ``[B, out_width]`` float32 output buffer.
            query_start_loc: ``[B + 1]`` int32 (device) offsets of each
                sequence's query rows in ``query [T, H, ..]`` (``None``: one
                row per sequence); token ``t`` of ``q_b`` attends the first
                ``seq_len - (q_b - 1 - t)`` positions. ``out`` is then ``[T,
                out_width]``.
            max_query_len: Most query rows of a sequence (host int).

        Returns:
            ``[B, plan.out_width]`` float32; with ``return_lse`` the pair ``(out,
            lse)``, ``lse [B, num_heads]`` float32 natural log (``-inf`` where
            the span is empty).

        Raises:
            ValueError: ``query_start_loc`` for a launch that does not
                :attr:`takes_query_tokens`.
        """
        plan, sh, device = self.plan, self.plan.shape, query.device
        bsz, num_heads, _ = query.shape
        self._check_call(query, kv_cache)
        if query_start_loc is not None and not self.takes_query_tokens:
            raise ValueError(f"the {self.kernel} kernel decodes one query token per sequence")
        splits, hpp, block_n = self.geometry(seq_lens.shape[0], max_seq_len)
        num_splits = int(num_splits or splits)
        split = num_splits > 1
        use_window = self.window is not None and self.window < max_seq_len
        if self.mode == "latent_rope":
            query = decode_latent_rope.absorbed_queries(plan, self.absorb, query)
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
        window = self.window if use_window else 0
        if self.kernel == "packed":
            decode_packed.launch(
                plan, self.layout, query, kv_cache, block_table, seq_lens,
                qk_scale=self.qk_scale, num_splits=num_splits, block_n=block_n,
                num_warps=self._common["num_warps"], num_stages=self._common["num_stages"],
                po=po, plse=plse, window=window, sink=self.sink, recent=self.recent,
                use_window=use_window, use_span=self._common["SPAN"],
                return_lse=return_lse, interpreting=interpreting(),
                query_start_loc=query_start_loc, max_query_len=max_query_len)
            return self._merge(out, lse, po, plse, num_splits, return_lse)
        # the cache's own block size: vLLM may give a layer's cache a multiple of the
        # configured one (one page size for the latent and exact caches)
        common = dict(self._common, BLOCK_N=block_n, SPLIT=split, LSE=bool(return_lse),
                      WINDOW=use_window, PAGE=kv_cache.shape[2],
                      SLOT_MULT=pow2_divisor(kv_cache.stride(2), kv_cache.stride(0)))
        w = self.weights
        args = DecodeArgs(
            n_splits=num_splits, qk_scale=self.qk_scale,
            query=(query, query.stride(0), query.stride(1)),
            pages=(kv_cache, kv_cache.stride(0), kv_cache.stride(2),
                   block_table, block_table.stride(0), seq_lens),
            keys=(w, w.stride(0) if w.dim() == 4 else 0, w.stride(1) if w.dim() == 4 else 0,
                  self.prep.maps, self.cos, self.sin, self.s_rope, self.max_pos),
            groups=(self.prep.group_table, plan.num_groups),
            outs=(po, plse, out, plan.out_width, num_heads),
            norm=(self.k_bias, self.k_norm, sh.head_dim, self.norm_eps),
            span=(window, self.sink, self.recent),
            k_scale_off=self.q_offs[0], k_zero_off=self.q_offs[1],
            v_scale_off=self.q_offs[2], v_zero_off=self.q_offs[3],
            share_off=self.layout.k_share_offset if common["K_CHAN"] else 0,
            rk_total=sum(plan.k_ranks), share=common["SHARE"],
        )
        if self.kernel == "wide":
            self._launch_wide(args, common, hpp, bsz)
        elif self.kernel == "latent_rope":
            vc = min(self.cfg.value_chunk or self.dflt["value_chunk"], self.prep.rv_max_pad)
            v_qg = common["V_QG"]
            if v_qg and (vc % v_qg or v_qg & (v_qg - 1)):
                vc = self.prep.rv_max_pad  # a chunk must start on a scale group: one chunk
            decode_latent_rope.launch(plan, args, common, vc, bsz)
        else:
            decode_grid_kernel[(num_splits, plan.num_groups // self.gpp, bsz)](*args, **common)
        return self._merge(out, lse, po, plse, num_splits, return_lse)

    @property
    def takes_query_tokens(self) -> bool:
        """Whether a call may give a sequence several query tokens
        (``query_start_loc``): the packed kernel without a window or span."""
        return self.kernel == "packed" and self.window is None and not self._common["SPAN"]

    def _check_call(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Shape, dtype and stride checks of a call against what was prepared
        (host metadata only): the kernels index the cache with the slot width,
        element size and stride alignment fixed at preparation.

        Raises:
            ValueError: naming the mismatch.
        """
        plan = self.plan
        if query.shape[1] != plan.shape.num_heads:
            raise ValueError(f"query has {query.shape[1]} heads, plan expects "
                             f"{plan.shape.num_heads}")
        if self.mode == "post_rope" and query.shape[-1] < max(plan.k_ranks):
            raise ValueError("post_rope queries need >= max(k_ranks) columns")
        want = torch.uint8 if self.layout is not None else self.cache_dtype
        if kv_cache.dtype != want:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype}, prepared for {want}")
        if kv_cache.shape[-1] != self.slot or kv_cache.shape[2] % self.block_size:
            raise ValueError(f"kv_cache slot width {kv_cache.shape[-1]} / block size "
                             f"{kv_cache.shape[2]}: prepared for {self.slot} and a multiple "
                             f"of {self.block_size}")
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in its last dimension")

    def _launch_wide(self, args: DecodeArgs, common: dict, hpp: int, bsz: int) -> None:
        """Launch :func:`.decode_wide.wide_decode_kernel` with the arguments of
        the grid kernel (same pointers, tables and split-K buffers): ``hpp`` KV
        heads per program (:func:`.launch.wide_heads_per_program`), the
        rank-chunk loop outside the KV-head loop when ``hpp > 1`` (each latent
        chunk dequantized once per tile; ``KernelConfig.chunk_outer=False`` or
        QK-norm: inside)."""
        from .decode_wide import wide_decode_kernel

        plan, prep, cfg = self.plan, self.prep, self.cfg
        sh = plan.shape
        half, rest = self.rotary_dim // 2, sh.head_dim - self.rotary_dim
        k_qg = common["K_QG"]
        rc = cfg.rank_chunk or self.dflt["rank_chunk"]
        if k_qg and (k_qg & (k_qg - 1)):
            rc = prep.rk_max_pad  # a chunk must start on a group boundary: one chunk
        rc = min(max(rc, k_qg), prep.rk_max_pad)
        chunk_outer = (cfg.chunk_outer is not False) and hpp > 1 and not common["K_NORM"]
        # Alignment hints for float caches only: they vectorize the latent loads,
        # 1.12-1.13x on the 16-bit J-LRD setting; on packed caches they made the
        # 4x preset 7-8 % slower (more spills) and the others 1-2 % faster (H200,
        # benchmarks/README.md's history in git, "Alignment the compiler can see").
        quant = common["QUANT"]
        wide_decode_kernel[(args.n_splits, sh.num_kv_heads // hpp, bsz)](
            *args,
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

    def _merge(self, out, lse, po, plse, num_splits: int, return_lse: bool):
        """Merge the split partials into ``out`` (and ``lse``) with
        :func:`.tiles.reduce_splits_kernel` when ``num_splits > 1``; return the
        call's result."""
        if num_splits > 1:
            block_c = 128
            bsz, num_heads = out.shape[0], self.plan.shape.num_heads
            reduce_splits_kernel[(bsz, triton.cdiv(self.plan.out_width, block_c))](
                po, plse, out, self.prep.head_of_col, num_splits, self.plan.out_width,
                num_heads, lse if return_lse else plse, S_PAD=pow2(num_splits, 2),
                BLOCK_C=block_c, LSE=bool(return_lse), H_PAD=pow2(num_heads, 2), num_warps=4)
        return (out, lse) if return_lse else out
