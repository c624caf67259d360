r"""Pre-RoPE decode for head groups whose key up-projection is too wide for one program.

:mod:`.decode` keeps a head group's whole key up-projection ``B_k[g]`` (per RoPE
section ``pad(r_k) x pad(G * rotary_dim / 2)``) in one program for the whole
context. Past :data:`.launch.TRITON_MAX_KEY_TILE` elements that no longer fits
in shared memory: the default J-LRD grouping of Llama-3-8B (8 KV heads of 128,
one group) at ratio 0.5 has rank 512, i.e. 512 x 512 per section. This kernel
splits such a group across programs, one per KV head (or, with enough
sequences to fill the GPU, several: ``HPP``), and its rank across a
loop. Per sequence ``b``, KV head ``j`` (``jj``-th of head group ``g``) and
context tile of ``BLOCK_N`` positions ``t``::

    K_j  = sum_c C_k[:, c:c+RC] @ B_k[g][c:c+RC, columns of head jj]   [BLOCK_N, d]
    K_j  <- key bias / QK-norm (optional), then RoPE by the absolute position t
    S    = q_j K_j^T                      [QPK, BLOCK_N]  the KV head's query heads
    online softmax (base 2); O += P @ C_v  [QPK, r_v]     the group's value latents

(the math of :func:`vllm_lowrank.attention.latent_attention.decode_attention`,
Palu eq. 3-6 per head). Shared memory holds one ``[BLOCK_N, RC]`` latent chunk,
``[RC, pad(d/2)]`` weight chunks and the ``[BLOCK_N, pad(r_v)]`` value tile, so
every grouping and rank runs. The price: a group's latents are read once per KV
head (``G`` times; the repeats mostly hit L2), ``B_k`` is re-read from L2 for
every tile, and the cos/sin rows are read per token (any RoPE table, rotation
or not). Pre-RoPE decode of wide groups costs ``2 r G d`` multiply-adds per
token and group whatever the kernel (benchmarks/README.md, "GPU serving inside
vLLM"), so wide groups are compute-bound on a GPU in any case.

With ``HPP > 1`` KV heads per program (up to the whole group) a program
rebuilds its KV heads one after the other into one score tile of their query
heads and reads and multiplies the value latents once per tile instead of once
per KV head (:func:`.launch.wide_heads_per_program` decides how many); with
``CHUNK_OUTER`` each rank chunk of the key latents is dequantized once per tile
and multiplied by each of the ``HPP`` heads' weight chunks in turn.

Caches: float (bf16/fp16/fp32) rows, or packed per-token 8/4/3/2-bit sides with
one scale/zero pair per row and group or per power-of-two channel group
(:func:`.tiles.load_latent`), and per-channel keys (KIVI: scale/zero per
channel and group of positions, :func:`.tiles.load_channel_keys`, as the grid
kernel reads them). Windows and the token-adaptive latent span bound
the tiles as in :mod:`.decode`; the partial outputs and their base-2
log-sum-exp have :mod:`.decode`'s split-K format and are merged by
:func:`.tiles.reduce_splits_kernel`. The host side is
:class:`vllm_lowrank.kernels.triton.decode.LatentLaunch`, which
chooses this kernel (``KernelConfig.wide``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (add_combine, group_row, key_bias, known_multiple, load_channel_keys,
                    load_latent, max_combine, split_tiles, transform_keys)


PER_LAYER_ARGS = ("k_scale_off", "k_zero_off", "v_scale_off", "v_zero_off", "share_off",
                  "rk_total", "share")
"""Runtime arguments that differ between the layers of one model when ranks
differ per layer (a byte-budget allocation): not specialized on (Triton would
otherwise compile one variant per divisibility pattern, dozens of minutes-long
compiles at start-up for the ``8x`` preset's 32 layers). Scalars, not a tuple:
Triton specializes a tuple's elements whatever ``do_not_specialize`` says
(3.6, 3.9). The slot and block strides keep their alignment hints (a few values
per model: the code loads' vector width depends on them)."""


@triton.jit
def _key_chunk(cache_ptr, row, pos, valid, bt_row, s_blk, p0, last, k_off, kpar, rk, rc,
               k_scale_off, k_zero_off, s_tok, share_off, rk_total, share, DT: tl.constexpr,
               QUANT: tl.constexpr, K_BITS: tl.constexpr, RC: tl.constexpr,
               K_QG: tl.constexpr, ALIGNED: tl.constexpr, K_CHAN: tl.constexpr,
               KCT: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Key latent channels ``rc .. rc + RC - 1`` of a tile's rows, dequantized to
    ``DT`` ``[BLOCK_N, RC]`` (0 past the rank ``rk``): per-channel keys
    (:func:`.tiles.load_channel_keys`), packed per-token codes or float rows
    (:func:`.tiles.load_latent`)."""
    if K_CHAN:
        ck = load_channel_keys(cache_ptr, row, pos, valid, bt_row, s_blk, p0, last,
                               k_off + (rc * K_BITS) // 8, rk - rc, (k_off * 8) // K_BITS + rc,
                               s_tok, share_off, rk_total, share, DT, K_BITS, RC, KCT, BLOCK_N,
                               PAGE)
    else:
        if QUANT:
            coff = k_off + (rc * K_BITS) // 8
            par = kpar
            if K_QG > 0:
                par = kpar + rc // K_QG
        else:
            coff = k_off + rc
            par = kpar
        ck, _, _ = load_latent(cache_ptr, row, valid, coff, rk - rc, par, k_scale_off,
                               k_zero_off, DT, QUANT, K_BITS, RC, K_QG, ALIGNED, 1, False)
    return ck


@triton.jit
def _score_head(sc, k1, k2, k3, ci, si, q1, q2, q3, head_kv, u, DT: tl.constexpr,
                HPP: tl.constexpr, H3: tl.constexpr):
    """``sc + q K^T`` for the program's ``u``-th KV head: its (partial) key
    sections ``k1``/``k2`` [BLOCK_N, H1] float32 (the two members of each RoPE
    pair) rotated by ``ci``/``si`` (Su et al. 2021, eq. 34), ``k3`` the unrotated rest;
    with ``HPP > 1`` only that head's query rows of ``q*`` score."""
    kr1 = (k1 * ci - k2 * si).to(DT)
    kr2 = (k2 * ci + k1 * si).to(DT)
    if HPP == 1:
        qa = q1
        qb = q2
        qc = q3
    else:  # this KV head's query rows only
        mine = (head_kv == u)[:, None]
        qa = tl.where(mine, q1, tl.zeros_like(q1))
        qb = tl.where(mine, q2, tl.zeros_like(q2))
        qc = tl.where(mine, q3, tl.zeros_like(q3))
    sc = tl.dot(qa, tl.trans(kr1), sc)
    sc = tl.dot(qb, tl.trans(kr2), sc)
    if H3 > 0:
        sc = tl.dot(qc, tl.trans(k3.to(DT)), sc)
    return sc


@triton.jit(do_not_specialize=PER_LAYER_ARGS)
def wide_decode_kernel(
    n_splits, qk_scale, query, pages, keys, groups, outs, norm, span,
    k_scale_off, k_zero_off, v_scale_off, v_zero_off, share_off, rk_total, share,
    G: tl.constexpr, HPP: tl.constexpr, QPK: tl.constexpr, HG_PAD: tl.constexpr,
    HALF: tl.constexpr, H1: tl.constexpr, REST: tl.constexpr, H3: tl.constexpr,
    CW: tl.constexpr, RC: tl.constexpr, RV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DT: tl.constexpr,
    QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_QG: tl.constexpr, V_QG: tl.constexpr, ALIGNED: tl.constexpr,
    SPLIT: tl.constexpr, K_BIAS: tl.constexpr, K_NORM: tl.constexpr,
    WINDOW: tl.constexpr, SPAN: tl.constexpr, LSE: tl.constexpr,
    K_CHAN: tl.constexpr, KCT: tl.constexpr, CHUNK_OUTER: tl.constexpr,
    OFF_MULT: tl.constexpr, RANK_MULT: tl.constexpr, SLOT_MULT: tl.constexpr,
):
    """Grid ``(n_splits, num_kv_heads / HPP, B)``: split ``s`` of sequence ``b``
    for ``HPP`` KV heads (a divisor of ``G``) of one head group, rebuilt one after the
    other per tile (the rank in chunks of ``RC``) into one ``[HG_PAD, BLOCK_N]``
    score tile of their ``HPP * QPK`` query heads (with ``HPP > 1`` each KV
    head's query rows masked to its keys), then one softmax and one value
    product ``P @ C_v``. ``w_ptr``: :func:`.decode_prep.pack_key_weights`
    (``[num_groups, 3, pad(r_k), CW]``, head ``jj``'s rotary columns at ``jj *
    HALF ..``, its rest at ``jj * REST ..``); ``maps_ptr``/``gt_ptr``:
    :class:`.decode_prep.Prepared`'s maps and group table. ``HALF``/``REST``:
    rotary half and unrotated rest of one head (``H1``/``H3`` their power-of-two
    pads, ``H3 = 0`` without a rest); ``RC``: rank chunk (a multiple of ``K_QG``
    when that is > 0). ``K_CHAN``: per-channel keys over groups of ``KCT``
    positions, parameters in ``share`` bytes per slot from ``share_off``
    (:func:`.tiles.load_channel_keys`; ``rk_total``: key channels of the
    layer). ``OFF_MULT``, ``RANK_MULT``, ``SLOT_MULT``: powers of two that
    divide every group's offsets, every rank, and the slot and block strides
    (host-checked alignment, as in :func:`.decode_kernels.decode_grid_kernel`)."""
    q_ptr, s_qb, s_qh = query
    cache_ptr, s_blk, s_tok, bt_ptr, s_bt, seq_lens_ptr = pages
    w_ptr, s_wg, s_wsec, maps_ptr, cos_ptr, sin_ptr, s_rope, _max_pos = keys
    gt_ptr, num_groups = groups
    po_ptr, plse_ptr, out_ptr, out_width, num_heads = outs
    kb_ptr, kn_ptr, head_dim, norm_eps = norm
    window, sink, recent = span
    s = tl.program_id(0)
    kv0 = tl.program_id(1) * HPP  # first KV head of the program
    b = tl.program_id(2)
    g = kv0 // G
    jj0 = kv0 % G  # its index in head group g
    k_off, v_off, rk, rv, kpar, vpar, ocol = group_row(gt_ptr, num_groups, g)
    if OFF_MULT > 1:  # alignment (host-checked) that vectorizes the latent loads
        k_off = known_multiple(k_off, OFF_MULT)
        v_off = known_multiple(v_off, OFF_MULT)
    if RANK_MULT > 1:
        rk = known_multiple(rk, RANK_MULT)
        rv = known_multiple(rv, RANK_MULT)

    seq_len = tl.load(seq_lens_ptr + b)
    first, end, t_lo, t_hi = split_tiles(seq_len, s, n_splits, window, sink, recent,
                                         BLOCK_N, WINDOW, SPAN)

    HG: tl.constexpr = HPP * QPK
    h = tl.arange(0, HG_PAD)
    hm = h < HG
    head_kv = tl.where(hm, h // QPK, -1)  # KV head (in the program) of each query row
    qrow = q_ptr + b.to(tl.int64) * s_qb + (kv0 * QPK + h).to(tl.int64) * s_qh
    p = tl.arange(0, H1)
    pvalid = p < HALF
    src1 = tl.load(maps_ptr + 0 * CW + p, mask=pvalid, other=0)
    src2 = tl.load(maps_ptr + 1 * CW + p, mask=pvalid, other=0)
    pair = tl.load(maps_ptr + 6 * CW + p, mask=pvalid, other=0)
    qm = hm[:, None] & pvalid[None, :]
    q1 = tl.load(qrow[:, None] + src1[None, :], mask=qm, other=0.0).to(DT)  # [HG_PAD, H1]
    q2 = tl.load(qrow[:, None] + src2[None, :], mask=qm, other=0.0).to(DT)
    if H3 > 0:
        e = tl.arange(0, H3)
        evalid = e < REST
        src3 = tl.load(maps_ptr + 2 * CW + e, mask=evalid, other=-1)
        q3 = tl.load(qrow[:, None] + src3[None, :], mask=hm[:, None] & evalid[None, :],
                     other=0.0).to(DT)
    else:
        e = p
        evalid = pvalid
        src3 = src1
        q3 = q1
    wg = w_ptr + g.to(tl.int64) * s_wg
    rr = tl.arange(0, RC)
    if K_BIAS or K_NORM:
        inv_hd = 1.0 / head_dim.to(tl.float32)
        zero_h = p * 0
        nw1 = src1 * 0.0  # bias without a norm: unused placeholders of the norm's shapes
        nw2 = nw1
        nw3 = src3 * 0.0
        if K_NORM:
            nw1 = tl.load(kn_ptr + src1, mask=pvalid, other=0.0)
            nw2 = tl.load(kn_ptr + src2, mask=pvalid, other=0.0)
            if H3 > 0:
                nw3 = tl.load(kn_ptr + src3, mask=evalid, other=0.0)

    i = tl.arange(0, BLOCK_N)
    m_i = tl.full([HG_PAD], float("-inf"), tl.float32)
    l_i = tl.full([HG_PAD], 0.0, tl.float32)
    acc = tl.full([HG_PAD, RV_PAD], 0.0, tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for t in range(t_lo, t_hi):
        p0 = first + t * BLOCK_N
        pos = p0 + i
        valid = pos < end  # rows from the end on are never loaded (null blocks)
        last = tl.minimum(p0 + BLOCK_N, end) - 1
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        row = tl.multiple_of(blk * s_blk + (pos % PAGE).to(tl.int64) * s_tok,
                             SLOT_MULT)  # [BLOCK_N]
        rm = valid[:, None] & pvalid[None, :]
        ci = tl.load(cos_ptr + pos[:, None] * s_rope + pair[None, :], mask=rm, other=0.0)
        si = tl.load(sin_ptr + pos[:, None] * s_rope + pair[None, :], mask=rm, other=0.0)
        sc = tl.full([HG_PAD, BLOCK_N], 0.0, tl.float32)
        if CHUNK_OUTER:
            # each latent chunk loaded (dequantized) once per tile for the program's
            # HPP KV heads; RoPE and the scores are linear in the key, so each
            # chunk's partial keys are rotated and scored on their own (the bias
            # too, once per tile; QK-norm needs whole keys: not here)
            for rc in range(0, rk, RC):
                ck = _key_chunk(cache_ptr, row, pos, valid, bt_row, s_blk, p0, last, k_off,
                                kpar, rk, rc, k_scale_off, k_zero_off, s_tok, share_off,
                                rk_total, share, DT, QUANT, K_BITS, RC, K_QG, ALIGNED,
                                K_CHAN, KCT, BLOCK_N, PAGE)
                wrow = wg + (rc + rr)[:, None] * CW
                for u in tl.static_range(HPP):
                    jj = jj0 + u
                    c1 = jj * HALF + p
                    w1 = tl.load(wrow + c1[None, :], mask=pvalid[None, :], other=0.0)
                    w2 = tl.load(wrow + s_wsec + c1[None, :], mask=pvalid[None, :], other=0.0)
                    k1 = tl.dot(ck, w1)
                    k2 = tl.dot(ck, w2)
                    if H3 > 0:
                        c3 = jj * REST + e
                        w3 = tl.load(wrow + 2 * s_wsec + c3[None, :], mask=evalid[None, :],
                                     other=0.0)
                        k3 = tl.dot(ck, w3)
                    else:
                        k3 = k1
                    sc = _score_head(sc, k1, k2, k3, ci, si, q1, q2, q3, head_kv, u, DT, HPP,
                                     H3)
            if K_BIAS:  # the bias as one more (constant) key part, rotated by position
                for u in tl.static_range(HPP):
                    kb1, kb2, kb3 = key_bias(kb_ptr, kv0 + u, head_dim, src1, src2, src3,
                                             zero_h, e * 0, pvalid, 1, H3, K_BIAS)
                    z1 = tl.zeros([BLOCK_N, H1], tl.float32)
                    k3 = z1
                    if H3 > 0:
                        k3 = tl.zeros([BLOCK_N, H3], tl.float32) + kb3[None, :]
                    sc = _score_head(sc, z1 + kb1[None, :], z1 + kb2[None, :], k3, ci, si,
                                     q1, q2, q3, head_kv, u, DT, HPP, H3)
        else:
            for u in tl.static_range(HPP):
                jj = jj0 + u
                c1 = jj * HALF + p
                c3 = jj * REST + e
                k1 = tl.full([BLOCK_N, H1], 0.0, tl.float32)
                k2 = k1
                if H3 > 0:
                    k3 = tl.full([BLOCK_N, H3], 0.0, tl.float32)
                else:
                    k3 = k1  # no unrotated rest: a placeholder
                for rc in range(0, rk, RC):
                    ck = _key_chunk(cache_ptr, row, pos, valid, bt_row, s_blk, p0, last, k_off,
                                    kpar, rk, rc, k_scale_off, k_zero_off, s_tok, share_off,
                                    rk_total, share, DT, QUANT, K_BITS, RC, K_QG, ALIGNED,
                                    K_CHAN, KCT, BLOCK_N, PAGE)
                    wrow = wg + (rc + rr)[:, None] * CW
                    w1 = tl.load(wrow + c1[None, :], mask=pvalid[None, :], other=0.0)
                    w2 = tl.load(wrow + s_wsec + c1[None, :], mask=pvalid[None, :], other=0.0)
                    k1 = tl.dot(ck, w1, k1)
                    k2 = tl.dot(ck, w2, k2)
                    if H3 > 0:
                        w3 = tl.load(wrow + 2 * s_wsec + c3[None, :], mask=evalid[None, :],
                                     other=0.0)
                        k3 = tl.dot(ck, w3, k3)
                if K_BIAS or K_NORM:
                    kb1, kb2, kb3 = key_bias(kb_ptr, kv0 + u, head_dim, src1, src2, src3,
                                             zero_h, e * 0, pvalid, 1, H3, K_BIAS)
                    k1, k2, k3 = transform_keys(k1, k2, k3, kb1, kb2, kb3, nw1, nw2, nw3,
                                                zero_h, e * 0, inv_hd, norm_eps, H3, 1, K_BIAS,
                                                K_NORM)
                sc = _score_head(sc, k1, k2, k3, ci, si, q1, q2, q3, head_kv, u, DT, HPP, H3)
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(pr, 1, add_combine)
        cv, _, _ = load_latent(cache_ptr, row, valid, v_off, rv, vpar, v_scale_off,
                               v_zero_off, DT, QUANT, V_BITS, RV_PAD, V_QG, ALIGNED, RANK_MULT,
                               False)
        acc = tl.dot(pr.to(DT), cv, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    c = tl.arange(0, RV_PAD)
    cols = ocol + (jj0 * QPK + h)[:, None] * rv + c[None, :]
    om = hm[:, None] & (c[None, :] < rv)
    heads = kv0 * QPK + h
    if SPLIT:
        bs = b.to(tl.int64) * n_splits + s
        tl.store(po_ptr + bs * out_width + cols, o, mask=om)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + bs * num_heads + heads, lse, mask=hm)
    else:
        tl.store(out_ptr + b.to(tl.int64) * out_width + cols, o, mask=om)
        if LSE:
            lse_n = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                             float("-inf"))
            tl.store(plse_ptr + b.to(tl.int64) * num_heads + heads, lse_n, mask=hm)
