r"""Decode attention over RoPE-equivariant key latents: queries absorbed, no key rebuild.

The case: a layer calibrated with ``method: "rope_equivariant"``
(:func:`vllm_lowrank.factorization.bases.rope_equivariant_basis`). Its key
up-projection ``B`` (``[r, G d]`` per head group) is complex-linear per RoPE
frequency: latent channels come in pairs ``(2l, 2l + 1)`` that rebuild only
frequency ``f_l`` of the group's heads, so for every position ``t``

    R_t B^T = B^T R~_t      (R~_t turns pair l by theta_{f_l} t)

and the score of query head ``h`` (KV head ``j``, post-RoPE query ``q'_h``) is

    q'_h . R_t B_j^T c_t = (B_j q'_h) . (R~_t c_t) = q~_h . (R~_t c_t)

with ``q~_h = B_j q'_h`` (``[r]``, computed once per step by
:func:`absorbed_queries`) and ``c_t`` the cached (pre-RoPE) key latent,
dequantized as the other kernels do. Per tile the kernel turns the latent
pairs by the RoPE table (``cos/sin[t, f_l]``) and takes ``[HG, r] x [r, N]``
dots on the tensor cores: ``2 r`` multiply-adds per cached token and query
head, against ``r G d`` per token and KV head for a key rebuild (the wide
kernel: 45-72 TFLOP/s of rebuild on an H100, benchmarks/README.md). This is
the decode of multi-head latent attention (DeepSeek-V2, sec. 2.1.2, "absorb"
``W^{UK}`` into the query), made possible for RoPE by the basis' structure
(TransMLA's RoRoPE, Meng et al. 2025, sec. 4.2, is the real-orthogonal case).

Values are as in the other kernels: ``P @ C_v`` per query head in the value
latent space, one head group per program, all its ``HG`` query heads in one
score tile (per-token packed values: the codes in the dot and the scales folded
into ``P``, :mod:`.decode_packed`'s algebra). Every key pair of the group is in
one tile (:func:`_pair_codes`: the two channels of a pair arrive as two
operands, so each tile takes two dots of depth ``r / 2``), and what does not
change from tile to tile is read or computed once before the tile loop: the
absorbed queries, the pairs' RoPE frequencies and, for per-channel keys (KIVI,
one token group per tile), the byte offsets of the group's parameters; a tile
that lies in one block addresses its slots as one pointer plus 32-bit offsets.
Earlier versions looped over key chunks inside the tile loop, re-reading
those operands and waiting on a chain of dependent loads per chunk (this one is
1.54-1.58x faster on an H200, benchmarks/README.md's history in git, "Fewer instructions per
tile"). Split-K, windows and the token-adaptive span share
:func:`.tiles.split_tiles` and the reduce pass with the other kernels; the
output format is theirs (``[B, out_width]`` float32). Its first version ran at
1.8-2.3x the wide kernel's speed on the ``8x`` storage (H200,
benchmarks/README.md's history in git, "Decode without a key rebuild").

Host side: :func:`blocker` and :func:`launch`, called by
:class:`vllm_lowrank.kernels.triton.decode.LatentLaunch` with
``mode="latent_rope"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_prep import interpreting, pow2
from .decode_wide import PER_LAYER_ARGS
from .tiles import (add_combine, group_row, known_multiple, load_f16_param, load_latent,
                    load_nibbles, max_combine, prefetch_l2, share_half, share_offsets,
                    split_tiles)

PREFETCH_LINES = tl.constexpr(4)
"""128-byte lines of each slot that a per-channel-key tile asks L2 to fetch for
the next tile (``min(128 k, slot bytes - 1)``, so any slot up to 512 bytes is
covered whole: the ~8x storage's are 400, every layer's padded to the largest).
One tile ahead beat two and four (H200, benchmarks/README.md's history in git, "An L2 prefetch
of the next tile")."""


@triton.jit
def _pair_codes(base, rows_t, code_off, lp, um, BITS: tl.constexpr):
    """Codes (or float latents) of latent pairs ``lp`` [P] of each token,
    transposed: ``(re, im)`` ``[P, N]`` float32 (``base + rows_t`` ``[1, N]``
    the slots, ``code_off`` the group's first code element or byte, ``um`` the
    mask ``[P, N]``; offsets are summed before the pointer, in 32 bits where
    ``rows_t`` is). Pair ``l`` is channels ``2l, 2l + 1``: 2 float elements or
    2 bytes (8-bit); in the packed formats it lies in a storage unit of
    ``PPU`` whole pairs, one byte (4-bit: one pair, the low nibble its real
    channel; 2-bit: two pairs) or a 24-bit word of 3 bytes (3-bit: four pairs),
    at bits ``2 k BITS`` (real) and ``(2 k + 1) BITS`` (imaginary) for the
    unit's ``k``-th pair. A unit holding several pairs is read once per pair
    (L1 hits), so every pair of the group comes out of one tile."""
    if BITS == 16 or BITS == 8:
        x = base + (rows_t + (code_off + 2 * lp)[:, None])
        re = tl.load(x, mask=um, other=0).to(tl.float32)
        im = tl.load(x + 1, mask=um, other=0).to(tl.float32)
    else:
        PPU: tl.constexpr = 4 if BITS == 3 else (2 if BITS == 2 else 1)
        UNIT_BYTES: tl.constexpr = 3 if BITS == 3 else 1
        x = base + (rows_t + (code_off + UNIT_BYTES * (lp // PPU))[:, None])
        w = tl.load(x, mask=um, other=0).to(tl.int32)
        if BITS == 3:
            w = w | (tl.load(x + 1, mask=um, other=0).to(tl.int32) << 8) | \
                (tl.load(x + 2, mask=um, other=0).to(tl.int32) << 16)
        sh = (2 * BITS * (lp % PPU))[:, None]
        re = ((w >> sh) & ((1 << BITS) - 1)).to(tl.float32)
        im = ((w >> (sh + BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    return re, im


@triton.jit(do_not_specialize=PER_LAYER_ARGS)
def latent_rope_decode_kernel(
    n_splits, qk_scale, query, pages, keys, groups, outs, span,
    k_scale_off, k_zero_off, v_scale_off, v_zero_off, share_off, rk_total, share,
    HG: tl.constexpr, HG_PAD: tl.constexpr, PAIRS: tl.constexpr, VC: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DT: tl.constexpr,
    QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    V_QG: tl.constexpr, ALIGNED: tl.constexpr, OFF_MULT: tl.constexpr,
    RANK_MULT: tl.constexpr, SLOT_MULT: tl.constexpr,
    SPLIT: tl.constexpr, WINDOW: tl.constexpr, SPAN: tl.constexpr, LSE: tl.constexpr,
    K_CHAN: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid ``(n_splits, num_groups * n_vc, B)``: split ``s`` of sequence ``b``
    for the ``HG`` query heads of head group ``g = pid(1) // n_vc`` and value
    channels ``VC * (pid(1) % n_vc) ..`` (``VC`` per program: every program
    scores the whole key latent; ``n_vc = ceil(max(r_v) / VC)``).
    ``q_ptr``: absorbed queries ``[B, H, >= r_k]``; ``fr_ptr``: int32
    ``[rk_total / 2]``, the RoPE frequency of each latent pair of the layer
    (group ``g``'s pairs from its first key channel / 2); ``cos/sin``: the
    RoPE table ``[max_pos, rot/2]`` (row stride ``s_rope``). Keys: float rows
    (``QUANT`` false), packed per token with one scale/zero pair per token and
    group, or per channel (``K_CHAN``: each ``BLOCK_N``-position tile is one
    complete token group, its first slot holding the start of the group's
    parameter stream, :func:`.tiles.load_channel_keys`). ``OFF_MULT``,
    ``RANK_MULT``, ``SLOT_MULT``: powers of two that divide every group's code
    offset, every rank, and the slot and block strides (alignment hints,
    checked on the host). ``PREFETCH`` (per-channel keys, GPU only): each tile
    first asks L2 for the slots of the next tile of its split
    (:func:`.tiles.prefetch_l2`), whose loads then wait on L2 rather than HBM
    (the kernel runs one program per SM and stalls on its global loads). Other
    arguments as :func:`.decode_wide.wide_decode_kernel`."""
    q_ptr, s_qb, s_qh = query
    cache_ptr, s_blk, s_tok, bt_ptr, s_bt, seq_lens_ptr = pages
    fr_ptr, _s_wg, _s_wsec, _maps, cos_ptr, sin_ptr, s_rope, _max_pos = keys
    gt_ptr, num_groups = groups
    po_ptr, plse_ptr, out_ptr, out_width, num_heads = outs
    window, sink, recent = span
    s = tl.program_id(0)
    n_vc = tl.num_programs(1) // num_groups
    g = tl.program_id(1) // n_vc
    v0 = (tl.program_id(1) % n_vc) * VC  # first value channel of the program
    b = tl.program_id(2)
    k_off, v_off, rk, rv, kpar, vpar, ocol = group_row(gt_ptr, num_groups, g)
    # alignment (host-checked) that vectorizes the value codes' loads and lets
    # them be copied ahead asynchronously (1.10-1.14x the kernel's speed, H200)
    if OFF_MULT > 1:
        v_off = known_multiple(v_off, OFF_MULT)
    if RANK_MULT > 1:
        rv = known_multiple(rv, RANK_MULT)
    ch0 = k_off  # first key channel of the group (float cache: elements)
    if QUANT:
        ch0 = (k_off * 8) // K_BITS
    seq_len = tl.load(seq_lens_ptr + b)
    first, end, t_lo, t_hi = split_tiles(seq_len, s, n_splits, window, sink, recent,
                                         BLOCK_N, WINDOW, SPAN)
    h = tl.arange(0, HG_PAD)
    hm = h < HG
    heads = g * HG + h
    # loop-invariant operands, read once: the absorbed queries split into the
    # real and imaginary channels of every latent pair, and the pairs' RoPE
    # frequencies (the tile loop then issues only the tile's own loads)
    lp = tl.arange(0, PAIRS)
    pm = 2 * lp < rk
    qrow = q_ptr + b.to(tl.int64) * s_qb + heads.to(tl.int64) * s_qh
    qm = hm[:, None] & pm[None, :]
    q_re = tl.load(qrow[:, None] + 2 * lp[None, :], mask=qm, other=0.0).to(DT)
    q_im = tl.load(qrow[:, None] + 2 * lp[None, :] + 1, mask=qm, other=0.0).to(DT)
    fr = tl.load(fr_ptr + ch0 // 2 + lp, mask=pm, other=0)
    i = tl.arange(0, BLOCK_N)
    # Per-channel keys: each tile is one token group, inside one block (the
    # page a multiple of the group, which decode.triton_kernel checks): its
    # slots are one pointer plus 32-bit offsets, and its parameter stream's
    # byte offsets from the group's first slot are the same for every tile.
    if K_CHAN:
        sr_lo, sr_hi = share_offsets(2 * (ch0 + 2 * lp), s_tok, share_off, share)
        si_lo, si_hi = share_offsets(2 * (ch0 + 2 * lp + 1), s_tok, share_off, share)
        zr_lo, zr_hi = share_offsets(2 * (rk_total + ch0 + 2 * lp), s_tok, share_off, share)
        zi_lo, zi_hi = share_offsets(2 * (rk_total + ch0 + 2 * lp + 1), s_tok, share_off, share)
    m_i = tl.full([HG_PAD], float("-inf"), tl.float32)
    l_i = tl.full([HG_PAD], 0.0, tl.float32)
    z_i = tl.full([HG_PAD], 0.0, tl.float32)  # sum_t p z_v (per-token value zero points)
    # per-token values (one scale/zero pair per token and group): codes in the dot,
    # the scales applied to the probabilities (decode_packed's algebra)
    V_POST: tl.constexpr = QUANT and V_QG == 0
    # 4-bit per-token values: the low and the high nibbles of the code bytes (the
    # even and the odd channels) go to two dots, so no tile is interleaved
    V_SPLIT: tl.constexpr = V_POST and V_BITS == 4 and VC >= 32  # each dot's N >= 16
    if V_SPLIT:
        acc = tl.full([HG_PAD, VC // 2], 0.0, tl.float32)
        acc_hi = tl.full([HG_PAD, VC // 2], 0.0, tl.float32)
    else:
        acc = tl.full([HG_PAD, VC], 0.0, tl.float32)
        acc_hi = tl.full([HG_PAD, 16], 0.0, tl.float32)  # unused
    v_col = v_off + v0  # the program's value channels in the slot (float cache: elements)
    v_par = vpar
    if QUANT:
        v_col = v_off + (v0 * V_BITS) // 8
        if V_QG > 0:
            v_par = vpar + v0 // V_QG
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for t in range(t_lo, t_hi):
        p0 = first + t * BLOCK_N
        pos = p0 + i
        valid = pos < end  # rows from the end on are never loaded (null blocks)
        if K_CHAN:
            blk0 = tl.load(bt_row + p0 // PAGE).to(tl.int64)
            base = cache_ptr + tl.multiple_of(blk0 * s_blk + (p0 % PAGE) * s_tok, SLOT_MULT)
            row = tl.multiple_of(i * s_tok, SLOT_MULT)
        else:
            blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
            base = cache_ptr
            row = blk * s_blk + (pos % PAGE).to(tl.int64) * s_tok  # [BLOCK_N]
        if PREFETCH:  # K_CHAN: the next tile lies in one block too
            if t + 1 < t_hi:
                pn = p0 + BLOCK_N
                blk_n = tl.load(bt_row + pn // PAGE).to(tl.int64)
                lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * 128, s_tok - 1)
                prefetch_l2(cache_ptr + blk_n * s_blk + (pn % PAGE) * s_tok
                            + (i * s_tok)[:, None] + lines[None, :])
        um = pm[:, None] & valid[None, :]
        re, im = _pair_codes(base, row[None, :], k_off, lp, um, K_BITS)
        if K_CHAN:  # base: the group's first slot
            re = re * share_half(base, sr_lo, sr_hi, pm)[:, None] + \
                share_half(base, zr_lo, zr_hi, pm)[:, None]
            im = im * share_half(base, si_lo, si_hi, pm)[:, None] + \
                share_half(base, zi_lo, zi_hi, pm)[:, None]
        elif QUANT:
            ks = load_f16_param(base + row + k_scale_off + 2 * kpar, valid, ALIGNED)
            kz = load_f16_param(base + row + k_zero_off + 2 * kpar, valid, ALIGNED)
            re = re * ks[None, :] + kz[None, :]
            im = im * ks[None, :] + kz[None, :]
        ci = tl.load(cos_ptr + pos[None, :] * s_rope + fr[:, None], mask=um, other=0.0)
        si = tl.load(sin_ptr + pos[None, :] * s_rope + fr[:, None], mask=um, other=0.0)
        # (Re + i Im) e^{i phi}: the latent pairs at position t after RoPE
        sc = tl.dot(q_re, (re * ci - im * si).to(DT))
        sc = tl.dot(q_im, (re * si + im * ci).to(DT), sc)
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(pr, 1, add_combine)
        if V_SPLIT:
            ev, od, vs, vz = load_nibbles(base, row, valid, v_col, rv - v0, v_par, v_scale_off,
                                          v_zero_off, DT, VC // 2, ALIGNED, RANK_MULT)
            z_i = z_i * alpha + tl.reduce(pr * vz[None, :], 1, add_combine)
            ps = (pr * vs[None, :]).to(DT)
            acc = tl.dot(ps, ev, acc * alpha[:, None])
            acc_hi = tl.dot(ps, od, acc_hi * alpha[:, None])
        else:
            cv, vs, vz = load_latent(base, row, valid, v_col, rv - v0, v_par, v_scale_off,
                                     v_zero_off, DT, QUANT, V_BITS, VC, V_QG, ALIGNED,
                                     RANK_MULT, V_POST)
            if V_POST:
                z_i = z_i * alpha + tl.reduce(pr * vz[None, :], 1, add_combine)
                acc = tl.dot((pr * vs[None, :]).to(DT), cv, acc * alpha[:, None])
            else:
                acc = tl.dot(pr.to(DT), cv, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0.0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    o = acc * inv_l[:, None]
    if V_POST:
        o += (z_i * inv_l)[:, None]
    if V_SPLIT:  # o: the even channels, o_hi the odd ones
        c = v0 + 2 * tl.arange(0, VC // 2)
        o_hi = acc_hi * inv_l[:, None] + (z_i * inv_l)[:, None]
    else:
        c = v0 + tl.arange(0, VC)
        o_hi = acc_hi
    cols = ocol + h[:, None] * rv + c[None, :]
    om = hm[:, None] & (c[None, :] < rv)
    if SPLIT:
        dst = po_ptr + (b.to(tl.int64) * n_splits + s) * out_width
    else:
        dst = out_ptr + b.to(tl.int64) * out_width
    tl.store(dst + cols, o, mask=om)
    if V_SPLIT:
        tl.store(dst + cols + 1, o_hi, mask=hm[:, None] & (c[None, :] + 1 < rv))
    if SPLIT:
        bs = b.to(tl.int64) * n_splits + s
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + bs * num_heads + heads, lse, mask=hm & (h * 0 + v0 == 0))
    elif LSE:  # once per head: by the program of the first value channels
        lse_n = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                         float("-inf"))
        tl.store(plse_ptr + b.to(tl.int64) * num_heads + heads, lse_n,
                 mask=hm & (h * 0 + v0 == 0))


def absorption(plan, k_up: torch.Tensor, rope,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, freq)`` of a RoPE-equivariant layer (computed once per layer, when
    its launch is prepared: a host copy of ``k_up`` for the structure check).

    Args:
        plan: The layer's plan; k_up: ``[Rk, num_kv_heads * head_dim]`` float
            block-diagonal key up-projection; rope: its
            :class:`~vllm_lowrank.attention.rope.RopeTable` (RoPE over the
            whole head, either pair layout).
        dtype: Of ``w``.

    Returns:
        ``w`` ``[num_kv_heads, max(k_ranks), head_dim]`` ``dtype``: KV head ``j``'s
        rows of its group's ``B`` (zero past the group's rank); ``freq``
        int32 ``[Rk / 2]``: the RoPE frequency of each latent pair (groups in
        order).

    Raises:
        ValueError: the basis is not complex-linear per frequency
            (:func:`~vllm_lowrank.factorization.bases.latent_frequencies`), or
            RoPE does not rotate the whole head.
    """
    from vllm_lowrank.factorization.bases import latent_frequencies

    sh = plan.shape
    if rope.rotary_dim != sh.head_dim:
        raise ValueError("RoPE-equivariant latents need RoPE over the whole head")
    d, gs, gw = sh.head_dim, plan.group_size, plan.group_width
    w = torch.zeros(sh.num_kv_heads, max(plan.k_ranks), d, device=k_up.device)
    freqs = []
    for g, (off, r) in enumerate(zip(plan.k_offsets(), plan.k_ranks)):
        block = k_up[off:off + r, g * gw:(g + 1) * gw].float()
        freqs.append(latent_frequencies(block.cpu(), d, rope.neox))
        w[g * gs:(g + 1) * gs, :block.shape[0]] = block.view(-1, gs, d).transpose(0, 1)
    return w.to(dtype), torch.cat(freqs).to(device=k_up.device, dtype=torch.int32)


def absorbed_queries(plan, w: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``q~_h = B_j q'_h`` for every query head: ``[B, H, max(k_ranks)]`` in
    ``w``'s dtype from post-RoPE queries ``[B, H, head_dim]`` (``w`` from
    :func:`absorption`). The kernel rounds them to the model dtype on load, so
    a 16-bit model gets them from one 16-bit GEMM (float32 accumulation): the
    values the kernel reads up to the rounding of ``w``, without the float32
    copy of the queries and a float32 GEMM per layer."""
    sh = plan.shape
    q = query.to(w.dtype).view(query.shape[0], sh.num_kv_heads, sh.queries_per_kv, sh.head_dim)
    return torch.einsum("bjqd,jrd->bjqr", q, w).reshape(query.shape[0], sh.num_heads, -1)


def blocker(plan, layout, *, window: int | None = None, sink: int = 0) -> str | None:
    """Why a ``latent_rope`` call cannot take this kernel, or ``None``.

    Its scope: every key rank even (whole pairs); at most 64 query heads per
    group (one score tile); keys as float rows, packed per token with one
    scale/zero pair per token and group (8/4/3/2 bits), or per channel over
    token groups that each tile covers exactly (no sliding window, ``sink`` a
    multiple of the group: the token-adaptive presets' 32 sink tokens in
    32-token groups)."""
    if any(r % 2 for r in plan.k_ranks):
        return "odd key rank"
    if plan.heads_per_group > 64:
        return "more than 64 query heads per group"
    if layout is None:
        return None
    if layout.k_per_channel:
        if window is not None:
            return "per-channel keys under a sliding window"
        if sink % layout.k_channel_tokens:
            return f"sink {sink} not a multiple of the {layout.k_channel_tokens}-token key groups"
        return None
    if layout.k_bits != 16 and any(q != r for q, r in zip(layout.k_groups, layout.k_ranks)):
        return "grouped per-token key scales"
    return None


def launch(plan, args, common: dict, value_chunk: int, bsz: int) -> None:
    """Launch :func:`latent_rope_decode_kernel` with the
    :class:`.decode.DecodeArgs` and constexprs that :class:`.decode.LatentLaunch`
    prepared for the other kernels (the absorbed queries in place of the
    queries, the frequency table in place of the key weights; no key
    transform); ``value_chunk`` value channels per program (a power of two, a
    multiple of the value quantization group). Every key pair of a group is in
    one tile (``PAIRS``: the largest key rank's pairs, a power of two of at
    least 16, the dots' smallest K)."""
    hg = plan.heads_per_group
    n_vc = triton.cdiv(max(plan.v_ranks), value_chunk)
    latent_rope_decode_kernel[(args.n_splits, plan.num_groups * n_vc, bsz)](
        args.n_splits, args.qk_scale, args.query, args.pages, args.keys, args.groups,
        args.outs, args.span, *(getattr(args, name) for name in PER_LAYER_ARGS),
        HG=hg, HG_PAD=pow2(hg, 16), PAIRS=pow2(max(plan.k_ranks) // 2, 16), VC=value_chunk,
        BLOCK_N=common["BLOCK_N"], PAGE=common["PAGE"], DT=common["DT"],
        QUANT=common["QUANT"], K_BITS=common["K_BITS"], V_BITS=common["V_BITS"],
        V_QG=common["V_QG"], ALIGNED=common["ALIGNED"], OFF_MULT=common["OFF_MULT"],
        RANK_MULT=common["RANK_MULT"], SLOT_MULT=common["SLOT_MULT"],
        SPLIT=common["SPLIT"], WINDOW=common["WINDOW"], SPAN=common["SPAN"],
        LSE=common["LSE"], K_CHAN=common["K_CHAN"],
        PREFETCH=common["K_CHAN"] and not interpreting(),
        num_warps=common["num_warps"], num_stages=common["num_stages"])
