"""Build and load the CUDA extension modules (:data:`MODULES`: ``latent_decode.cu`` and
``post_rope_decode.cu`` beside this file, with their shared ``mma_common.cuh``), lazily.

Each module is compiled on first use with ``torch.utils.cpp_extension.load`` (ninja,
``-gencode`` for the current GPU's architecture, e.g. ``sm_90`` on Hopper, ``sm_80`` on
Ampere) into torch's extension cache, and reused afterwards; a decoder builds only the
module it runs (the ``4x`` preset: ``post_rope_decode``), and a module that fails to
build leaves the other's decoder usable. Nothing is built or imported at package
import time.

- :func:`latent_decode_pre_rope` -- fused pre-RoPE decode attention over a bf16/fp16
  latent cache on mma.sync tensor cores (key rebuild, RoPE, online softmax, value
  product), for per-KV-head groups at 16 bits
  (:class:`vllm_lowrank.attention.decoders.CudaDecoder`).
- :func:`post_rope_decode` -- token-adaptive decode of post-RoPE 4-bit per-channel
  key codes and full-rank value latents with int8 exact tokens, the ``4x``
  preset's layers (:class:`vllm_lowrank.attention.decoders.PostRopeKeysCudaDecoder`).

Example::

    from vllm_lowrank.kernels.cuda import ext
    ext.load("latent_decode")                # builds on first use (RuntimeError if it cannot)
    warps, stages, smem = ext.decode_config(64, 64)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

_NAME = "vllm_lowrank_cuda"
MODULES = {"latent_decode": ("latent_decode.cu", "latent_decode.cpp"),
           "post_rope_decode": ("post_rope_decode.cu", "post_rope_decode.cpp")}
"""Extension module name -> its sources beside this file: the kernels (``.cu``, no
torch: nvcc never parses torch's headers) and their torch binding (``.cpp``), which
ninja compiles in parallel."""

_LOADED: dict = {}
_ERRORS: dict = {}


def source_dir() -> Path:
    """The CUDA sources: this package's directory (package data in a wheel, the
    checkout in an editable install)."""
    return Path(__file__).resolve().parent


def load(module: str, verbose: bool = False):
    """Build (first call) and import extension module ``module`` (a :data:`MODULES` key).

    Raises:
        KeyError: ``module`` is not in :data:`MODULES`.
        RuntimeError: no CUDA device, no CUDA toolkit (nvcc / CUDA_HOME), no ninja,
            or one of the module's sources is missing; the message names the fix.
    """
    sources = MODULES[module]
    if module in _LOADED:
        return _LOADED[module]
    if not torch.cuda.is_available():
        raise RuntimeError(
            "vllm_lowrank.kernels.cuda.ext needs a CUDA device (torch.cuda.is_available() is "
            "False); on CPU use SlotLayout.decode with the torch path in "
            "vllm_lowrank.attention.latent_attention")
    if torch.version.cuda is None:
        raise RuntimeError(
            f"this torch ({torch.__version__}) is a CPU build; install a CUDA build of "
            "torch to build vllm_lowrank's CUDA kernels")
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc") or (
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else None)
    if nvcc is None or not os.path.exists(nvcc):
        raise RuntimeError(
            "nvcc not found: install the CUDA toolkit matching torch.version.cuda="
            f"{torch.version.cuda} and put its bin/ on PATH or set CUDA_HOME")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError as exc:
        raise RuntimeError("ninja is required to build vllm_lowrank's CUDA kernels: "
                           "pip install ninja") from exc
    src = source_dir()
    missing = [s for s in sources if not (src / s).exists()]
    if missing:
        raise RuntimeError(
            f"CUDA sources {missing} not found under {src}: the package was installed "
            "without its vllm_lowrank.kernels.cuda data; reinstall vllm-lowrank")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    try:
        _LOADED[module] = build(arch, module, verbose=verbose)
    except Exception as exc:  # compiler errors, wrong toolkit for this GPU, ...
        raise RuntimeError(
            f"building {module_name(module, arch)} from {src} failed "
            f"({type(exc).__name__}: {exc}); check that nvcc supports sm_{arch} and "
            f"matches torch.version.cuda={torch.version.cuda}") from exc
    return _LOADED[module]


def unavailable(module: str) -> str | None:
    """``None`` once extension module ``module`` loads, else why not (one build
    attempt per process and module; a decoder's ``supports`` answer)."""
    if module not in _LOADED and module not in _ERRORS:
        try:
            load(module)
        except RuntimeError as exc:
            _ERRORS[module] = f"CUDA extension unavailable: {exc}"
    return _ERRORS.get(module)


def module_name(module: str, arch: str) -> str:
    """The importable name of ``module`` built for compute capability ``arch``
    (``vllm_lowrank_cuda_post_rope_decode_sm90``): the JIT cache's folder name."""
    return f"{_NAME}_{module}_sm{arch}"


def nvcc_flags(arch: str) -> list[str]:
    """nvcc flags of the module for compute capability ``arch`` (``"90"`` for
    sm_90): the one list used by :func:`load` on a GPU and by the Dockerfile's
    ahead-of-time build."""
    return ["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
            "--use_fast_math"]


def build(arch: str, module: str, verbose: bool = False):
    """Build (or find up to date in ``TORCH_EXTENSIONS_DIR``) and import extension
    module ``module`` as :func:`module_name` ``(module, arch)`` with torch's JIT
    builder; no GPU needed (the Dockerfile builds every module for every arch of
    ``TORCH_CUDA_ARCH_LIST`` this way).

    Raises:
        KeyError: ``module`` is not in :data:`MODULES`.
        Whatever ``torch.utils.cpp_extension.load`` raises (compiler errors).
    """
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=module_name(module, arch),
        sources=[str(source_dir() / s) for s in MODULES[module]],
        extra_cuda_cflags=nvcc_flags(arch), extra_cflags=["-O3"], verbose=verbose)


DECODE_HEAD_DIM = 128
DECODE_RANKS = (16, 32, 48, 64, 96, 128)
"""Key and value ranks with a compiled :func:`latent_decode_pre_rope` kernel (any
pair; the list in ``vllm_lowrank/kernels/cuda/latent_decode.cu``, ``LATENT_DECODE_RANKS``)."""

_DECODE_CFG: dict = {}


def decode_config(r_k: int, r_v: int) -> tuple[int, int, int]:
    """``(warps per CTA, pipeline stages, shared memory bytes)`` of the pre-RoPE
    decode kernel for ranks ``(r_k, r_v)``; ``(0, 0, 0)`` if none is compiled.
    Each CTA runs its warps' 32-token tiles concurrently, so a split-count model
    should count ``32 * warps`` tokens per CTA step."""
    key = (int(r_k), int(r_v))
    if key not in _DECODE_CFG:
        _DECODE_CFG[key] = tuple(load("latent_decode").latent_decode_config(*key))
    return _DECODE_CFG[key]


def pack_key_weights_t(plan, k_up: torch.Tensor, neox: bool, dtype: torch.dtype) -> torch.Tensor:
    """``B_k^T`` per head group for :func:`latent_decode_pre_rope`:
    ``[num_groups, 128, r_k]`` in ``dtype``, contiguous.

    Row ``p`` of group ``g`` is the key up-projection column of head dimension
    ``p`` (neox), or of ``2p`` for ``p < 64`` and ``2(p - 64) + 1`` above (gptj), so
    the two members of every rotary pair sit 64 rows apart in both styles.

    Args:
        plan: LayerPlan with ``group_size == 1``, ``head_dim == 128`` and one key
            rank ``r_k`` for every group.
        k_up: ``[Rk, num_kv_heads * 128]`` float key up-projection (block-diagonal).
        neox: Rotary pair layout (False: gptj, interleaved pairs).
        dtype: Cache dtype (bfloat16 or float16).

    Raises:
        ValueError: group size, head dim or uneven key ranks outside this layout.
    """
    d = plan.shape.head_dim
    if plan.group_size != 1 or d != DECODE_HEAD_DIM or len(set(plan.k_ranks)) != 1:
        raise ValueError("pack_key_weights_t needs group_size 1, head_dim 128 and one key "
                         f"rank for all groups (got {plan.group_size}, {d}, {plan.k_ranks})")
    r = plan.k_ranks[0]
    if tuple(k_up.shape) != (plan.k_width, plan.shape.num_kv_heads * d):
        raise ValueError(f"k_up is {tuple(k_up.shape)}, expected "
                         f"{(plan.k_width, plan.shape.num_kv_heads * d)}")
    pos = torch.arange(d, device=k_up.device)
    src = pos if neox else torch.where(pos < d // 2, 2 * pos, 2 * (pos - d // 2) + 1)
    blocks = k_up.reshape(plan.num_groups, r, plan.num_groups, d)
    diag = blocks[torch.arange(plan.num_groups), :, torch.arange(plan.num_groups)]  # [ng, r, d]
    return diag[:, :, src].transpose(1, 2).to(dtype).contiguous()


def latent_decode_pre_rope(query, kv_cache, block_table, seq_lens, key_weights_t, rope, scale,
                           *, num_splits: int = 1, out: torch.Tensor | None = None,
                           return_lse: bool = False):
    """Pre-RoPE decode attention over a paged bf16/fp16 latent cache (one CUDA
    kernel, plus a merge kernel when ``num_splits > 1``).

    Per sequence ``b``, KV head ``g`` and query head ``h`` of ``g``:
    ``o[b, h] = sum_t softmax_t(scale * q[b, h] . R_t (c_k[t] @ B_k[g])) c_v[t]``
    over ``t < seq_lens[b]`` (``R_t``: RoPE at position ``t`` from ``rope``), in
    the value latent space: the contract of
    :class:`vllm_lowrank.kernels.triton.decode.LatentLaunch` for
    ``group_size == 1``, ``head_dim == 128``, full rotary, uniform ranks.

    Args:
        query: ``[B, H, 128]`` post-RoPE queries, the cache dtype.
        kv_cache: ``[num_blocks, 1, block_size, Rk + Rv]`` bfloat16 or float16,
            last dim contiguous; block_size a power of two >= 16. Group ``g``'s key
            latent is columns ``g*r_k .. (g+1)*r_k``, its value latent
            ``Rk + g*r_v ..``.
        block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32, >= 1.
        key_weights_t: ``[num_groups, 128, r_k]`` from :func:`pack_key_weights_t`.
        rope: :class:`~vllm_lowrank.attention.rope.RopeTable` on the device,
            ``rotary_dim == 128``, a rotation table (``rope_is_rotation``).
        scale: Softmax scale.
        num_splits: Context splits per (sequence, group), >= 1.
        out: Optional ``[B, H * r_v]`` float32 contiguous output buffer.
        return_lse: Also return the natural log-sum-exp of the scaled scores.

    Returns:
        ``[B, H * r_v]`` float32 (head ``i``'s ``r_v`` columns in order), and with
        ``return_lse`` the pair ``(out, lse [B, H] float32)``.

    Raises:
        ValueError: shapes, dtypes, ranks or table outside the scope above.
        RuntimeError: the extension cannot be built (see :func:`load`).

    Scores use f16 keys and queries (10-bit mantissa): rebuilt keys and
    ``scale * log2(e) * q`` must stay below 65504 in magnitude.
    """
    if query.dim() != 3 or query.shape[-1] != DECODE_HEAD_DIM:
        raise ValueError(f"query must be [B, H, 128], got {tuple(query.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != query.dtype:
        raise ValueError(f"query and kv_cache must share bf16 or fp16, got {query.dtype} "
                         f"and {kv_cache.dtype}")
    if key_weights_t.dim() != 3 or key_weights_t.shape[1] != DECODE_HEAD_DIM:
        raise ValueError("key_weights_t must be [num_groups, 128, r_k]")
    ng, r_k = key_weights_t.shape[0], key_weights_t.shape[2]
    slot = kv_cache.shape[-1]
    if (slot - ng * r_k) % ng or slot <= ng * r_k:
        raise ValueError(f"kv_cache slot {slot} is not num_groups * (r_k + r_v)")
    r_v = (slot - ng * r_k) // ng
    if r_k not in DECODE_RANKS or r_v not in DECODE_RANKS:
        raise ValueError(f"no compiled kernel for r_k={r_k}, r_v={r_v} (ranks {DECODE_RANKS})")
    if rope.rotary_dim != DECODE_HEAD_DIM:
        raise ValueError(f"rotary_dim must be 128, got {rope.rotary_dim}")
    page = kv_cache.shape[2]
    if page < 16 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {page}")
    if int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    bsz, heads = query.shape[0], query.shape[1]
    if heads % ng or heads // ng > 8:
        raise ValueError(f"{heads} query heads over {ng} groups: at most 8 per group")
    if out is None:
        out = torch.empty(bsz, heads * r_v, device=query.device, dtype=torch.float32)
    lse = torch.empty(bsz, heads, device=query.device, dtype=torch.float32) \
        if return_lse else None
    query = query if query.stride(-1) == 1 else query.contiguous()
    load("latent_decode").latent_decode_pre_rope(
        query, kv_cache, block_table, seq_lens, key_weights_t, rope.cos, rope.sin, out, lse,
        int(num_splits), float(scale) * 1.4426950408889634, not rope.neox)
    return (out, lse) if return_lse else out


POST_ROPE_KEY_GROUPS = (32, 64)
POST_ROPE_VALUE_BITS = (2, 4)
POST_ROPE_VALUE_RANKS = {2: (64, 128), 4: (64, 96, 128)}
"""Key group sizes (``k_channel_tokens``), value code widths and, per width, value
ranks per KV head with a compiled :func:`post_rope_decode` kernel
(``vllm_lowrank/kernels/cuda/post_rope_decode.cu``: a rank's code row must be whole
16-byte chunks, so 2-bit values skip rank 96)."""

_POST_ROPE_CFG: dict = {}


def post_rope_config(k_channel_tokens: int, v_bits: int, v_rank: int) -> tuple[int, int]:
    """``(warps per CTA, CTAs resident per SM)`` of the :func:`post_rope_decode` kernel
    for key groups of ``k_channel_tokens`` and ``v_bits``-bit values of rank ``v_rank``
    per KV head: each warp takes its own tiles, and 3 CTAs stay resident where their
    shared memory fits (the ``4x`` layout), else 2; the split model's constants.

    Raises:
        RuntimeError: the extension cannot be built (:func:`load`), or no kernel is
            compiled for the triple.
    """
    key = (int(k_channel_tokens), int(v_bits), int(v_rank))
    if key not in _POST_ROPE_CFG:
        cfg = load("post_rope_decode").post_rope_config(*key)
        _POST_ROPE_CFG[key] = (int(cfg[0]), int(cfg[4]))
    return _POST_ROPE_CFG[key]


def post_rope_scope(plan, layout, exact_slot, *, block_size: int, sink: int) -> str | None:
    """Why :func:`post_rope_decode` cannot decode a token-adaptive post-RoPE-keys
    layer, or ``None`` (host checks only, no build).

    Its scope (anything else keeps the Triton kernel of
    :mod:`vllm_lowrank.kernels.triton.decode_post_rope`): keys after RoPE at full
    width, 4 bits per channel over groups of :data:`POST_ROPE_KEY_GROUPS` tokens that
    divide the block size and the sink (the caches' blocks may be any multiple of
    it: vLLM enlarges the latent cache's); values per KV head (``group_size`` 1) at
    :data:`POST_ROPE_VALUE_BITS`, one rank for every KV head out of
    :data:`POST_ROPE_VALUE_RANKS`, one scale/zero per token and head;
    ``head_dim`` 128; at most 8 query heads per KV head; int8 exact tokens; slots
    and the regions the kernel copies 16-byte aligned.

    Args:
        plan: The layer's :class:`~vllm_lowrank.factorization.plan.LayerPlan`.
        layout: Its :class:`~vllm_lowrank.format.latent.SlotLayout`.
        exact_slot: Its :class:`~vllm_lowrank.format.exact.ExactSlot`.
        block_size: Tokens per KV block configured.
        sink: Exact sink tokens.
    """
    sh = plan.shape
    if not plan.full_keys:
        return "keys are not cached after RoPE at full width"
    if layout is None or not layout.k_per_channel or layout.k_bits != 4:
        return "keys not 4-bit per channel"
    kct = layout.k_channel_tokens
    if kct not in POST_ROPE_KEY_GROUPS or block_size % kct or sink % kct:
        return (f"key groups of {kct} tokens: not in {POST_ROPE_KEY_GROUPS} or not dividing "
                f"the block size {block_size} and the sink {sink}")
    if layout.v_bits not in POST_ROPE_VALUE_BITS:
        return f"{layout.v_bits}-bit values: not in {POST_ROPE_VALUE_BITS}"
    if sh.head_dim != DECODE_HEAD_DIM:
        return f"head_dim {sh.head_dim} != {DECODE_HEAD_DIM}"
    if plan.group_size != 1:
        return "value head groups of several KV heads"
    ranks = POST_ROPE_VALUE_RANKS[layout.v_bits]
    if len(set(plan.v_ranks)) != 1 or plan.v_ranks[0] not in ranks:
        return (f"value ranks {sorted(set(plan.v_ranks))} per KV head: not one of {ranks} "
                f"at {layout.v_bits} bits")
    if any(q != r for q, r in zip(layout.v_groups, layout.v_ranks)):
        return "values without one scale per token and head"
    if sh.queries_per_kv > 8:
        return "more than 8 query heads per KV head"
    if exact_slot.bits != 8:
        return f"{exact_slot.bits}-bit exact tokens (int8 only)"
    if (layout.slot_bytes % 16 or layout.v_codes_offset % 16 or layout.k_share_offset % 16
            or layout.k_share_bytes % 16 or exact_slot.slot_bytes % 16):
        return "slot regions not 16-byte aligned"
    return None


def post_rope_lift(plan, v_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head's value lift for :func:`post_rope_decode`: ``(lift_t, vsum)``,
    ``lift_t [num_kv_heads, 128 (d), Rv (r)]`` float16 contiguous (``B_v[j]^T``, ``Rv``
    the value rank per KV head) and ``vsum [num_kv_heads, 128]`` float32, the float32
    column sums ``sum_r B_v[j][r, d]`` (the lift of the value zero term; as
    :class:`~vllm_lowrank.kernels.triton.decode_post_rope.PostRopeLaunch`).

    Args:
        plan: LayerPlan in :func:`post_rope_scope`'s scope (``group_size`` 1, one
            value rank of :data:`POST_ROPE_VALUE_RANKS`).
        v_up: ``[Rv, num_kv_heads * 128]`` block-diagonal value up-projection.
    """
    from vllm_lowrank.kernels.triton.decode_post_rope import value_lift

    lift, vsum = value_lift(plan, v_up, plan.v_ranks[0])
    return lift.transpose(1, 2).to(torch.float16).contiguous(), vsum


def post_rope_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     exact_cache: torch.Tensor, exact_block_table: torch.Tensor,
                     seq_lens: torch.Tensor, lift_t: torch.Tensor, vsum: torch.Tensor, *,
                     layout, exact_slot, sink: int, recent: int, scale: float,
                     num_splits: int, out: torch.Tensor,
                     head_of_col: torch.Tensor | None = None) -> torch.Tensor:
    """Token-adaptive decode of a post-RoPE-keys layer, one query token per
    sequence, into ``out`` (one CUDA kernel, plus
    :func:`~vllm_lowrank.kernels.triton.tiles.reduce_splits_kernel` when
    ``num_splits > 1``).

    The math of :func:`vllm_lowrank.attention.token_adaptive.decode` (mode
    ``post_rope``): per sequence ``b`` of ``n = seq_lens[b]`` tokens, the latent span
    ``sink <= t < n - recent - 1`` from the 4-bit key codes and value latents, the
    exact set (sinks and ``t >= max(sink, n - recent - 1)``) from the int8 exact
    cache, one softmax over both, value latents lifted by ``lift_t``
    (``vllm_lowrank/kernels/cuda/post_rope_decode.cu`` has the algebra and the
    roofline). A row with ``seq_lens[b] == 0`` (CUDA-graph padding) gets zeros.

    Args:
        query: ``[B, H, 128]`` post-RoPE queries, bfloat16 or float16 (rows are
            copied contiguous if their strides are not multiples of 8).
        kv_cache: ``uint8 [num_blocks, 1, page, slot]`` latent cache (``page`` a
            multiple of the key group); block_table: ``[B, max_blocks]`` int32.
        exact_cache: ``uint8 [num_blocks, 1, epage, exact slot]``, this step's
            token written; exact_block_table: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` int32, this step's token included.
        lift_t, vsum: From :func:`post_rope_lift`.
        layout, exact_slot: The layer's SlotLayout and ExactSlot (in
            :func:`post_rope_scope`'s scope).
        sink, recent: Exact sink tokens and recent window ``W``.
        scale: Softmax scale.
        num_splits: Context splits per (sequence, KV head), >= 1.
        out: ``[B, H * 128]`` contiguous, float32, bfloat16 or float16.
        head_of_col: ``[H * 128]`` int32 on the device, the query head of each
            output column (the split merge's,
            :func:`~vllm_lowrank.kernels.triton.decode_post_rope.head_columns`);
            made here when ``None``.

    Returns:
        ``out``.

    Raises:
        ValueError: a layout outside :func:`post_rope_scope`'s scope.
        RuntimeError: the extension cannot be built (:func:`load`), or the
            kernel's own checks (shapes, dtypes, alignment) fail.
    """
    if (not layout.k_per_channel or layout.k_bits != 4
            or layout.k_channel_tokens not in POST_ROPE_KEY_GROUPS
            or layout.v_bits not in POST_ROPE_VALUE_BITS or exact_slot.bits != 8
            or lift_t.shape[-1] not in POST_ROPE_VALUE_RANKS[layout.v_bits]):
        raise ValueError("post_rope_decode cannot decode this layer: keys "
                         f"{layout.k_bits}-bit per channel over {layout.k_channel_tokens} "
                         f"tokens, {layout.v_bits}-bit values of rank {lift_t.shape[-1]}, "
                         f"{exact_slot.bits}-bit exact tokens (post_rope_scope says what "
                         "it reads)")
    if int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if query.stride(-1) != 1 or query.stride(0) % 8 or query.stride(1) % 8 \
            or query.data_ptr() % 16:
        query = query.contiguous()
    bsz, heads = seq_lens.shape[0], query.shape[1]
    lay8 = exact_slot.int8_layout
    offs = [layout.v_codes_offset, layout.v_scale_offset, layout.v_zero_offset,
            layout.k_share_offset, layout.k_share_bytes, sum(layout.k_ranks),
            lay8.v_codes_offset, lay8.k_scale_offset, lay8.k_zero_offset, lay8.v_scale_offset,
            lay8.v_zero_offset, int(sink), int(recent) + 1, layout.k_channel_tokens,
            layout.v_bits, heads // lift_t.shape[0]]
    qk_scale = float(scale) * 1.4426950408889634
    mod = load("post_rope_decode")
    if num_splits == 1:
        mod.post_rope_decode(query, kv_cache, block_table, exact_cache, exact_block_table,
                             seq_lens, lift_t, vsum, out, None, offs, 1, qk_scale)
        return out
    from vllm_lowrank.kernels.triton.decode_post_rope import head_columns, merge_head_splits

    width = heads * DECODE_HEAD_DIM
    po = torch.empty(bsz, num_splits, width, device=query.device, dtype=torch.float32)
    plse = torch.empty(bsz, num_splits, heads, device=query.device, dtype=torch.float32)
    mod.post_rope_decode(query, kv_cache, block_table, exact_cache, exact_block_table, seq_lens,
                         lift_t, vsum, po, plse, offs, int(num_splits), qk_scale)
    if head_of_col is None:
        head_of_col = head_columns(heads, DECODE_HEAD_DIM, query.device)
    merge_head_splits(po, plse, out, head_of_col, heads)
    return out
