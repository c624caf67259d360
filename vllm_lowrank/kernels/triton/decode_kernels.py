r"""Fused paged decode attention over latent KV (pre-RoPE key rebuild, post-RoPE).

One kernel skeleton, two score modes (selected by ``mode``):

``mode="pre_rope"`` (the default; the math of
:mod:`vllm_lowrank.attention.latent_attention`). Per sequence ``b`` and head
group ``g`` (``G`` KV heads, ``Hg = G * num_heads / num_kv_heads`` query heads)
and per context tile of ``BLOCK_N`` tokens at positions ``p0 .. p0+BLOCK_N-1``::

    C_k  [BLOCK_N, r_k]   key latents of the tile (gathered through the block table)
    K    = C_k @ B_k[g]   [BLOCK_N, G*d]      rebuilt once, on tensor cores (tl.dot)
    K'   = R_i K          RoPE by the *offset* i = t - p0 only   (loop-invariant cos/sin)
    q'   = R_{p0}^T q     RoPE of the query by the tile start    (Hg x d, per tile)
    S    = K' q'^T        [BLOCK_N, Hg]       every query head of the group on one rebuild
    online softmax over the tile, O^T += C_v^T @ P               (value latents: no rebuild)

``R_{p0+i} = R_{p0} R_i`` (rotations compose), so ``q . R_t k = (R_{p0}^T q) . (R_i k)``:
the per-token rotation uses cos/sin of the offsets ``0..BLOCK_N-1`` only, loaded once
per program into registers, and the tile's own rotation moves onto the handful of
query rows. Costs 2 fp32 operations per key element instead of 6 (with the
angle-sum formula) and reads no cos/sin table bytes per token (a per-token table
read is 512 B/token at head_dim 128: more than the latent itself at ratio 0.25).
Valid when the table is ``m_j * (cos(t theta_j), sin(t theta_j))``, which holds for
plain, linear, NTK, Llama-3 and YaRN tables (``m_j = cos[0, j]``, the YaRN mscale;
checked once per table by :func:`rope_is_rotation`); other tables take the exact
per-token path (``ROPE_DIRECT``).

Layout of the rebuilt key inside the kernel: the ``G*d`` columns are permuted into
three sections ``[x1 of every KV head | x2 of every KV head | unrotated rest]``
(``x1``/``x2`` the two members of each RoPE pair: halves for neox, even/odd for
gptj), each padded to a power of two. The same permutation is applied to the query
(so dot products are unchanged) and baked into the packed ``B_k`` sections, so one
code path covers neox, gptj, partial rotary and any ``head_dim`` multiple of 16.
Query head ``h`` of the group only sees the columns of its KV head
(``h // queries_per_kv``): its query row is zero elsewhere.

``mode="post_rope"``: queries ``[B, H, >= max r_k]`` already live in the key latent
basis (head ``i`` uses its first ``r_k[group(i)]`` entries); ``S = C_k q~^T``, no
rebuild, no RoPE; the rest is shared.

Key transform (``transform=`` a
:class:`vllm_lowrank.attention.latent_attention.KeyTransform`, pre-RoPE mode only;
Qwen2 key bias, Qwen3/Gemma-3 QK-norm): between the rebuild and the rotation,
in float32 on the ``[BLOCK_N, G*d]`` rebuilt tile::

    K += bias                       bias [num_kv_heads * head_dim] float32, per column
    K_j <- K_j / sqrt(mean(K_j^2) + eps) * w     per token and KV head j; w [head_dim]

(RMSNorm, Zhang & Sennrich 2019, eq. 4). The mean runs over the whole head: its
columns in both rotary sections and in the rest section (``G = 1``: one row
sum over all three; ``G > 1``: masked row sums per KV head). Bias and weight are
loaded once per program in the permuted column order (``K_BIAS``/``K_NORM``
constexpr flags; off, the kernel compiles as without them).

Sliding window (``window=``, both modes; ``WINDOW`` constexpr flag): the query
of sequence ``b`` (position ``seq_len - 1``) sees keys ``t >= seq_len - window``.
Earlier rows are never read (vLLM may have freed their blocks to the null block,
which can hold anything, NaN included): the tiles start at the first visible key
(tile ``k`` covers ``first + k * BLOCK_N ..``, ``first = max(seq_len - window, 0)``),
so no earlier row is in any tile and the rows need only the end mask of the plain
kernel (a lower mask on ``BLOCK_N``-aligned tiles measured 3-7 % slower on an
H200: more register spills). The splits share these tiles; each has a visible key,
so every split's partial stays finite (an empty split writes ``lse = -inf``).

Token-adaptive mode (TALE; ``sink=``, ``recent=``, both modes; ``SPAN`` constexpr
flag): the first ``sink`` and the last ``recent`` positions of every sequence are
attended exactly elsewhere (from a separate full-precision cache), so the kernel
attends the latent span ``max(sink, seq_len - window) <= t < seq_len - recent``
only: the window machinery with a later start and an earlier end (the tiles
start at the span's first position, rows from its end on are masked in every
load, the splits share the tiles; an empty span processes no tile and gives a
zero row). ``return_lse=True`` (``LSE`` constexpr flag) also returns the
natural-log log-sum-exp of the attended scores per head, ``[B, H]`` float32
(``-inf`` for an empty span), so the caller can merge the two parts: ``out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b)``.
Internally the scores are base 2 (``qk_scale = scale * log2 e``): the stored LSE
is ``ln 2 * (m + log2 l)``, written by the kernel itself (``num_splits=1``) or
by the reduce pass, which merges the splits' base-2 partials.

Quantized cache (``layout=`` a :class:`vllm_lowrank.format.latent.SlotLayout`): the
cache is ``uint8 [num_blocks, 1, block_size, slot_bytes]``; each tile's packed codes
are read once as rows of contiguous bytes (16-byte loads / ``cp.async`` when the
offsets and ranks allow) and unpacked in registers with broadcast shifts and a
reshape (:func:`.tiles.load_codes`). Post-RoPE mode with one fp16 scale/zero per token
and group feeds the centred codes to the dots and applies the scales per token
afterwards (scores ``s_k (codes q~) + z_k sum(q~)``; values through ``P * s_v``
and a running ``sum P z_v``); pre-RoPE mode and grouped scales dequantize the
tile with the tokens' fp16 scale/zero first.

Split-K (flash-decoding): the context of a sequence is cut into ``num_splits``
chunks, each program writes a normalised partial output and its base-2
log-sum-exp; :func:`reduce_splits_kernel` merges them. ``num_splits=1`` writes the
output directly. The default split count minimises a wave model of the launch
(:func:`choose_num_splits`).

Two layouts of the score product (``KernelConfig.transposed``): ``S^T = K' q'^T``
(the rebuilt tile stays in registers as the A operand) or ``S = q' K'^T`` (it
goes through shared memory). Several head groups of equal power-of-two ranks can
share one score tile (``groups_per_program`` 2 or 4: 8 or 16 real query heads in
the 16-wide tile instead of 4), which shares the softmax, the value product and
the per-tile bookkeeping; the defaults per case are measured
(:func:`.decode._default_config`, benchmarks/decode_attention_notes.md in git history).

Uneven ranks: groups are sorted into at most four rank classes (padded
``(r_k, r_v)`` powers of two); one launch serves all classes through a runtime
branch over kernels specialised per class, so a rank-16 group is not computed at
rank 128. Work scheduling: the plain grid (split x group x sequence, the hardware
block scheduler assigns programs).

Output: ``[B, out_width]`` float32, the column layout of
:attr:`vllm_lowrank.factorization.plan.LayerPlan.out_width` (query heads in order,
head ``i`` contributing ``r_v[group(i)]`` columns), exactly what
:func:`vllm_lowrank.attention.latent_attention.decode_attention` returns.

Precision: latents, ``B_k`` (cast to the cache dtype), the rebuilt-and-rotated keys
and the probabilities enter the tensor cores in the cache dtype (bf16 for a bf16
model, as full-KV attention reads bf16 keys) with float32 accumulation; RoPE,
softmax and the accumulators are float32. A float32 cache computes in float32
(tf32 on NVIDIA tensor cores). A quantized cache computes in the query dtype
(bf16/fp16; float32 queries use float32).

The host side (preparation once per layer, launch parameters, the split
reduce) is :class:`vllm_lowrank.kernels.triton.decode.LatentLaunch`.
"""


from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (add_combine, group_row, key_bias, known_multiple, load_channel_keys,
                    load_latent, load_pair, max_combine, split_tiles, transform_keys)

# ----------------------------------------------------------------------------------
# Device code
# ----------------------------------------------------------------------------------
@triton.jit
def _per_head(v0, v1, v2, v3, h, HG: tl.constexpr, GPP: tl.constexpr, TRANS: tl.constexpr):
    """Per-token values ``v_j`` [N] of the ``GPP`` groups as a score-shaped tile:
    ``[N, HG_PAD]`` (``TRANS``) or ``[HG_PAD, N]``, query head ``h`` taking its
    group's ``v_{h // HG}`` (padding heads take ``v0``; GPP = 1: a broadcastable
    ``[N, 1]`` / ``[1, N]``)."""
    if TRANS:
        out = v0[:, None]
        if GPP > 1:
            out = tl.where((h // HG == 1)[None, :], v1[:, None], out)
        if GPP > 2:
            out = tl.where((h // HG == 2)[None, :], v2[:, None], out)
            out = tl.where((h // HG == 3)[None, :], v3[:, None], out)
    else:
        out = v0[None, :]
        if GPP > 1:
            out = tl.where((h // HG == 1)[:, None], v1[None, :], out)
        if GPP > 2:
            out = tl.where((h // HG == 2)[:, None], v2[None, :], out)
            out = tl.where((h // HG == 3)[:, None], v3[None, :], out)
    return out


@triton.jit
def _group_keys_scores(sc, ck, w1, w2, w3, qa, qb, q3, ci, si, j, h,
                       HG: tl.constexpr, C3: tl.constexpr, TRANS: tl.constexpr,
                       DT: tl.constexpr, GPP: tl.constexpr,
                       kb1, kb2, kb3, nw1, nw2, nw3, kvh1, kvh3, inv_hd, norm_eps,
                       G: tl.constexpr, K_BIAS: tl.constexpr, K_NORM: tl.constexpr):
    """Rebuild one group's keys for the tile, rotate by the offsets, add its query
    heads' scores to ``sc`` (other columns of the query tile are zeroed).
    ``K_BIAS``/``K_NORM``: bias and QK-norm before the rotation
    (:func:`transform_keys`; the ``kb*``, ``nw*``, ``kvh*``, ``inv_hd`` and
    ``norm_eps`` arguments are unused otherwise)."""
    k1 = tl.dot(ck, w1)  # [BLOCK_N, C1] f32
    k2 = tl.dot(ck, w2)
    if K_BIAS or K_NORM:
        k3t = k1
        if C3 > 0:
            k3t = tl.dot(ck, w3)
        k1, k2, k3t = transform_keys(k1, k2, k3t, kb1, kb2, kb3, nw1, nw2, nw3, kvh1, kvh3,
                                      inv_hd, norm_eps, C3, G, K_BIAS, K_NORM)
    kr1 = (k1 * ci - k2 * si).to(DT)
    kr2 = (k2 * ci + k1 * si).to(DT)
    if GPP > 1:
        mine = (h // HG == j)[None, :]
        qa = tl.where(mine, qa, 0.0)
        qb = tl.where(mine, qb, 0.0)
        if C3 > 0:
            q3 = tl.where(mine, q3, 0.0)
    if TRANS:
        # S^T = K' q'^T: the rebuilt tile is the A operand (registers).
        sc = tl.dot(kr1, qa.to(DT), sc)
        sc = tl.dot(kr2, qb.to(DT), sc)  # [BLOCK_N, HG_PAD]
        if C3 > 0:
            if K_BIAS or K_NORM:
                k3 = k3t.to(DT)
            else:
                k3 = tl.dot(ck, w3).to(DT)
            sc = tl.dot(k3, q3.to(DT), sc)
    else:
        # S = q' K'^T: the rebuilt tile goes through shared memory as B.
        sc = tl.dot(tl.trans(qa.to(DT)), tl.trans(kr1), sc)
        sc = tl.dot(tl.trans(qb.to(DT)), tl.trans(kr2), sc)  # [HG_PAD, BLOCK_N]
        if C3 > 0:
            if K_BIAS or K_NORM:
                k3 = k3t.to(DT)
            else:
                k3 = tl.dot(ck, w3).to(DT)
            sc = tl.dot(tl.trans(q3.to(DT)), tl.trans(k3), sc)
    return sc


@triton.jit
def _group_latent_scores(sc, ck, qk, ks, j, h, HG: tl.constexpr, TRANS: tl.constexpr,
                         DT: tl.constexpr, GPP: tl.constexpr, KPOST: tl.constexpr):
    """Post-RoPE mode: one group's scores ``q~ . c_k`` added to ``sc``. ``KPOST``:
    ``ck`` holds the centred integer codes and ``ks`` [N] the tokens' scales; the
    dot's result is scaled per token (the zero points are added by the caller)."""
    if GPP > 1:
        qk = tl.where((h // HG == j)[None, :], qk, 0.0)
    if KPOST:
        if TRANS:
            sc += tl.dot(ck, qk.to(DT)) * ks[:, None]
        else:
            sc += tl.dot(tl.trans(qk.to(DT)), tl.trans(ck)) * ks[None, :]
    elif TRANS:
        sc = tl.dot(ck, qk.to(DT), sc)
    else:
        sc = tl.dot(tl.trans(qk.to(DT)), tl.trans(ck), sc)
    return sc


@triton.jit
def _attend_chunk(
    b, g, s, n_splits, qk_scale, query, pages, keys, groups, outs, norm, span,
    k_scale_off, k_zero_off, v_scale_off, v_zero_off, share_off, rk_total,
    MODE: tl.constexpr, ROPE_DIRECT: tl.constexpr,
    TRANS: tl.constexpr, HG: tl.constexpr, HG_PAD: tl.constexpr, QPK: tl.constexpr,
    C1: tl.constexpr, C3: tl.constexpr, CW: tl.constexpr,
    RK_PAD: tl.constexpr, RV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DT: tl.constexpr,
    QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_QG: tl.constexpr, V_QG: tl.constexpr, ALIGNED: tl.constexpr,
    SPLIT: tl.constexpr, OFF_MULT: tl.constexpr, RANK_MULT: tl.constexpr,
    SLOT_MULT: tl.constexpr, GPP: tl.constexpr,
    K_BIAS: tl.constexpr, K_NORM: tl.constexpr, WINDOW: tl.constexpr,
    SPAN: tl.constexpr, LSE: tl.constexpr,
    K_CHAN: tl.constexpr, KCT: tl.constexpr, SHARE: tl.constexpr,
):
    """One work item: sequence ``b``, head groups ``g .. g+GPP-1``, split ``s``.

    ``GPP`` (groups per program, 1/2/4; > 1 only for equal power-of-two ranks)
    puts the query heads of several groups into one score tile: softmax, the
    value product, the tile bookkeeping and the offset cos/sin are shared, and
    the value latents of the groups are one contiguous load.

    Post-RoPE mode, packed sides with one scale/zero pair per row and group
    (``*_QG = 0``): the (centred) codes enter the dots and the scales are applied
    per token afterwards, which keeps per-element work to the unpacking: keys
    ``S = s_k * (codes_k q~) + z_k * sum(q~)``; values
    ``O = (P * s_v) codes_v + sum_t P z_v`` (the last sum kept per (token slot,
    head) like the softmax denominator). Pre-RoPE mode and grouped scales
    dequantize the tiles (measured on an H200: post-scaling the values in the
    pre-RoPE kernel was 5-15 % slower, at 255 registers).

    ``OFF_MULT``, ``RANK_MULT``, ``SLOT_MULT``: powers of two that divide every
    group offset, every rank, and the slot and block strides (host-checked;
    :func:`.tiles.known_multiple` makes them visible to the compiler, which then
    vectorizes the code loads and copies them a tile ahead).

    Per-channel keys (``K_CHAN``, KIVI sec. 3.2; pre-RoPE, ``GPP = 1``): the
    key tile is dequantized with its group's per-channel scale/zero pairs
    (:func:`.tiles.load_channel_keys`: ``KCT`` positions per group, ``SHARE``
    parameter bytes per slot from ``share_off``, ``rk_total`` key channels in
    the layer).

    Visible keys: ``t < seq_len``; ``WINDOW``: also ``t >= seq_len - window``;
    ``SPAN`` (token-adaptive mode): ``max(sink, seq_len - window) <= t <
    seq_len - recent`` (``window`` only with ``WINDOW``). ``LSE`` without
    ``SPLIT``: also store the natural log-sum-exp of the scaled scores per head
    into ``plse_ptr`` ``[B, num_heads]`` (``-inf`` for an empty span)."""
    q_ptr, s_qb, s_qh = query
    cache_ptr, s_blk, s_tok, bt_ptr, s_bt, seq_lens_ptr = pages
    w_ptr, s_wg, s_wsec, maps_ptr, cos_ptr, sin_ptr, s_rope, max_pos = keys
    gt_ptr, num_groups = groups
    po_ptr, plse_ptr, out_ptr, out_width, num_heads = outs
    kb_ptr, kn_ptr, head_dim, norm_eps = norm
    window, sink, recent = span
    KPOST: tl.constexpr = QUANT and MODE == 1 and K_QG == 0
    VPOST: tl.constexpr = QUANT and MODE == 1 and V_QG == 0
    # Group table rows (see .decode_prep.Prepared.group_table).
    k_off, v_off, rk, rv, kpar, vpar, ocol = group_row(gt_ptr, num_groups, g)
    if OFF_MULT > 1:
        # Offsets are sums of ranks (multiples of 8): lets the compiler emit
        # 16-byte vector loads / cp.async for the latent rows.
        k_off = known_multiple(k_off, OFF_MULT)
        v_off = known_multiple(v_off, OFF_MULT)
    if RANK_MULT > 1:
        # Every rank is a multiple of RANK_MULT (host-checked; 8 for float caches):
        # the rank masks are then constant over RANK_MULT channels (packed: over
        # RANK_MULT * bits / 8 bytes), which keeps the masked loads vectorized.
        rk = known_multiple(rk, RANK_MULT)
        rv = known_multiple(rv, RANK_MULT)
    if GPP > 1:
        k_off1 = tl.load(gt_ptr + 0 * num_groups + g + 1)
        kpar1 = tl.load(gt_ptr + 4 * num_groups + g + 1)
        if OFF_MULT > 1:
            k_off1 = known_multiple(k_off1, OFF_MULT)
    if GPP > 2:
        k_off2 = tl.load(gt_ptr + 0 * num_groups + g + 2)
        k_off3 = tl.load(gt_ptr + 0 * num_groups + g + 3)
        kpar2 = tl.load(gt_ptr + 4 * num_groups + g + 2)
        kpar3 = tl.load(gt_ptr + 4 * num_groups + g + 3)
        if OFF_MULT > 1:
            k_off2 = known_multiple(k_off2, OFF_MULT)
            k_off3 = known_multiple(k_off3, OFF_MULT)
    # Value latents of the GPP groups are one contiguous row segment of
    # GPP * RV_PAD channels (packed: with V_QG > 0 their scale/zero pairs are
    # contiguous too, and the host passes V_QG = RV_PAD for one pair per group in
    # pre-RoPE mode; with VPOST each group's pair is loaded on its own).

    seq_len = tl.load(seq_lens_ptr + b)
    # Keys at positions first <= t < end only (WINDOW: first = seq_len - window;
    # SPAN: first >= sink, end = seq_len - recent). The tiles start at the first
    # visible key: nothing before it is in any tile, so the rows need only the
    # end mask, as in the plain kernel (measured on an H200: a second, lower mask
    # on BLOCK_N-aligned tiles cost 3-7 %); each tile has a visible key, so the
    # running max is finite after the first; an empty span has no tiles.
    first, end, t_lo, t_hi = split_tiles(seq_len, s, n_splits, window, sink, recent,
                                         BLOCK_N, WINDOW, SPAN)

    h = tl.arange(0, HG_PAD)
    hmask = h < GPP * HG
    qrow = q_ptr + b.to(tl.int64) * s_qb + (g * HG + h).to(tl.int64) * s_qh  # [HG_PAD]
    i = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, RK_PAD)
    kvh_of_col = (h % HG) // QPK  # KV head (within its group) of each query column

    if MODE == 0:
        # Packed B_k sections [RK_PAD, C1] (x1, x2) and [RK_PAD, C3] (rest).
        c1 = tl.arange(0, C1)
        c3 = tl.arange(0, CW)
        wg = w_ptr + g.to(tl.int64) * s_wg
        w1 = tl.load(wg + rr[:, None] * CW + c1[None, :])
        w2 = tl.load(wg + s_wsec + rr[:, None] * CW + c1[None, :])
        w3 = w1
        if C3 > 0:
            w3 = tl.load(wg + 2 * s_wsec + rr[:, None] * CW + c3[None, :])
        if GPP > 1:
            w1_1 = tl.load(wg + s_wg + rr[:, None] * CW + c1[None, :])
            w2_1 = tl.load(wg + s_wg + s_wsec + rr[:, None] * CW + c1[None, :])
            w3_1 = w1_1
            if C3 > 0:
                w3_1 = tl.load(wg + s_wg + 2 * s_wsec + rr[:, None] * CW + c3[None, :])
        if GPP > 2:
            w1_2 = tl.load(wg + 2 * s_wg + rr[:, None] * CW + c1[None, :])
            w2_2 = tl.load(wg + 2 * s_wg + s_wsec + rr[:, None] * CW + c1[None, :])
            w1_3 = tl.load(wg + 3 * s_wg + rr[:, None] * CW + c1[None, :])
            w2_3 = tl.load(wg + 3 * s_wg + s_wsec + rr[:, None] * CW + c1[None, :])
            w3_2 = w1_2
            w3_3 = w1_3
            if C3 > 0:
                w3_2 = tl.load(wg + 2 * s_wg + 2 * s_wsec + rr[:, None] * CW + c3[None, :])
                w3_3 = tl.load(wg + 3 * s_wg + 2 * s_wsec + rr[:, None] * CW + c3[None, :])
        # maps: [0]=src dim sec0, [1]=src dim sec1, [2]=src dim sec2, [3..5]=kv head, [6]=pair
        src1 = tl.load(maps_ptr + 0 * CW + c1)
        src2 = tl.load(maps_ptr + 1 * CW + c1)
        kvh1 = tl.load(maps_ptr + 3 * CW + c1)
        pair = tl.load(maps_ptr + 6 * CW + c1)
        pvalid = pair >= 0
        qm1 = (kvh1[:, None] == kvh_of_col[None, :]) & hmask[None, :] & pvalid[:, None]
        q1 = tl.load(qrow[None, :] + src1[:, None], mask=qm1, other=0.0).to(tl.float32)
        q2 = tl.load(qrow[None, :] + src2[:, None], mask=qm1, other=0.0).to(tl.float32)
        q3 = q1
        if C3 > 0:
            src3 = tl.load(maps_ptr + 2 * CW + c3)
            kvh3 = tl.load(maps_ptr + 5 * CW + c3)
            qm3 = (kvh3[:, None] == kvh_of_col[None, :]) & hmask[None, :] & (src3 >= 0)[:, None]
            q3 = tl.load(qrow[None, :] + src3[:, None], mask=qm3, other=0.0).to(tl.float32)
        if C3 == 0:  # no rest section: placeholders
            src3 = src1
            kvh3 = kvh1
        if K_BIAS or K_NORM:
            # Loop-invariant per-column bias (per group) and norm weight.
            inv_hd = 1.0 / head_dim.to(tl.float32)
            kb1_0, kb2_0, kb3_0 = key_bias(kb_ptr, g, head_dim, src1, src2, src3, kvh1,
                                            kvh3, pvalid, HG // QPK, C3, K_BIAS)
            if GPP > 1:
                kb1_1, kb2_1, kb3_1 = key_bias(kb_ptr, g + 1, head_dim, src1, src2, src3,
                                                kvh1, kvh3, pvalid, HG // QPK, C3, K_BIAS)
            if GPP > 2:
                kb1_2, kb2_2, kb3_2 = key_bias(kb_ptr, g + 2, head_dim, src1, src2, src3,
                                                kvh1, kvh3, pvalid, HG // QPK, C3, K_BIAS)
                kb1_3, kb2_3, kb3_3 = key_bias(kb_ptr, g + 3, head_dim, src1, src2, src3,
                                                kvh1, kvh3, pvalid, HG // QPK, C3, K_BIAS)
            nw1 = q1
            nw2 = q1
            nw3 = q1
            if K_NORM:
                nw1 = tl.load(kn_ptr + src1, mask=pvalid, other=0.0)
                nw2 = tl.load(kn_ptr + src2, mask=pvalid, other=0.0)
                if C3 > 0:
                    nw3 = tl.load(kn_ptr + src3, mask=src3 >= 0, other=0.0)
        else:  # plain keys: unused placeholders (no code)
            inv_hd = qk_scale
            kb1_0 = q1
            kb2_0 = q1
            kb3_0 = q1
            kb1_1 = q1
            kb2_1 = q1
            kb3_1 = q1
            kb1_2 = q1
            kb2_2 = q1
            kb3_2 = q1
            kb1_3 = q1
            kb2_3 = q1
            kb3_3 = q1
            nw1 = q1
            nw2 = q1
            nw3 = q1
        if not ROPE_DIRECT:
            # cos/sin of the offsets 0..BLOCK_N-1, loop-invariant; 1/m removes the
            # table's magnitude (YaRN mscale) from the per-tile query rotation.
            inv_m = 1.0 / tl.load(cos_ptr + pair, mask=pvalid, other=1.0)
            om = (i[:, None] < max_pos) & pvalid[None, :]
            ci = tl.load(cos_ptr + i[:, None] * s_rope + pair[None, :], mask=om, other=0.0)
            si = tl.load(sin_ptr + i[:, None] * s_rope + pair[None, :], mask=om, other=0.0)
    else:
        qk = tl.load(qrow[None, :] + rr[:, None], mask=hmask[None, :] & (rr[:, None] < rk),
                     other=0.0).to(tl.float32)  # [RK_PAD, HG_PAD]
        if KPOST:
            # sum_c q~[c, h] of the operand the dot sees: the zero points' term.
            qs = tl.reduce(qk.to(DT).to(tl.float32), 0, add_combine)  # [HG_PAD]

    m_i = tl.full([HG_PAD], float("-inf"), tl.float32)
    # Row sums kept per (token slot, head) and reduced once at the end: no
    # cross-warp reduction per tile for the denominator.
    if TRANS:
        l2 = tl.full([BLOCK_N, HG_PAD], 0.0, tl.float32)
        acc = tl.full([GPP * RV_PAD, HG_PAD], 0.0, tl.float32)  # O^T
    else:
        l2 = tl.full([HG_PAD, BLOCK_N], 0.0, tl.float32)
        acc = tl.full([HG_PAD, GPP * RV_PAD], 0.0, tl.float32)  # O
    if VPOST:
        z2 = l2  # sum of P * (value zero point), per (token slot, head)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for t in range(t_lo, t_hi):
        if WINDOW or SPAN:
            # Rows past the span's end are never loaded (their blocks may be
            # vLLM's null block): zero latents, -inf scores, zero probabilities.
            p0 = first + t * BLOCK_N
            pos = p0 + i
            valid = pos < end
        else:
            p0 = t * BLOCK_N
            pos = p0 + i
            valid = pos < seq_len
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        row = tl.multiple_of(blk * s_blk + (pos % PAGE).to(tl.int64) * s_tok,
                             SLOT_MULT)  # [BLOCK_N]
        if TRANS:
            sc = tl.full([BLOCK_N, HG_PAD], 0.0, tl.float32)
        else:
            sc = tl.full([HG_PAD, BLOCK_N], 0.0, tl.float32)
        if K_CHAN:  # per-channel keys (one head group per program)
            last = tl.minimum(p0 + BLOCK_N, end) - 1
            ck = load_channel_keys(cache_ptr, row, pos, valid, bt_row, s_blk, p0, last, k_off,
                                   rk, (k_off * 8) // K_BITS, s_tok, share_off, rk_total, SHARE,
                                   DT, K_BITS, RK_PAD, KCT, BLOCK_N, PAGE)
            ks0 = 0.0
            kz0 = 0.0
        else:
            ck, ks0, kz0 = load_latent(cache_ptr, row, valid, k_off, rk, kpar, k_scale_off,
                                        k_zero_off, DT, QUANT, K_BITS, RK_PAD, K_QG, ALIGNED,
                                        RANK_MULT, KPOST)
        ks1 = ks0
        kz1 = kz0
        ks2 = ks0
        kz2 = kz0
        ks3 = ks0
        kz3 = kz0
        if GPP > 1:
            ck1, ks1, kz1 = load_latent(cache_ptr, row, valid, k_off1, rk, kpar1, k_scale_off,
                                         k_zero_off, DT, QUANT, K_BITS, RK_PAD, K_QG, ALIGNED,
                                         RANK_MULT, KPOST)
        if GPP > 2:
            ck2, ks2, kz2 = load_latent(cache_ptr, row, valid, k_off2, rk, kpar2, k_scale_off,
                                         k_zero_off, DT, QUANT, K_BITS, RK_PAD, K_QG, ALIGNED,
                                         RANK_MULT, KPOST)
            ck3, ks3, kz3 = load_latent(cache_ptr, row, valid, k_off3, rk, kpar3, k_scale_off,
                                         k_zero_off, DT, QUANT, K_BITS, RK_PAD, K_QG, ALIGNED,
                                         RANK_MULT, KPOST)
        # The GPP groups' value codes are one contiguous load; with VPOST each
        # group has its own pair per row (indices vpar, vpar + 1, ...).
        cv, vs0, vz0 = load_latent(cache_ptr, row, valid, v_off, GPP * rv, vpar, v_scale_off,
                                    v_zero_off, DT, QUANT, V_BITS, GPP * RV_PAD, V_QG, ALIGNED,
                                    RANK_MULT, VPOST)
        vs1 = vs0
        vz1 = vz0
        vs2 = vs0
        vz2 = vz0
        vs3 = vs0
        vz3 = vz0
        if VPOST:  # the other groups' pairs, zero points for centred codes
            if GPP > 1:
                vs1, vz1 = load_pair(cache_ptr + row, valid, vpar + 1, v_scale_off,
                                      v_zero_off, ALIGNED)
                vz1 = vz1 + (1 << (V_BITS - 1)) * vs1
            if GPP > 2:
                vs2, vz2 = load_pair(cache_ptr + row, valid, vpar + 2, v_scale_off,
                                      v_zero_off, ALIGNED)
                vs3, vz3 = load_pair(cache_ptr + row, valid, vpar + 3, v_scale_off,
                                      v_zero_off, ALIGNED)
                vz2 = vz2 + (1 << (V_BITS - 1)) * vs2
                vz3 = vz3 + (1 << (V_BITS - 1)) * vs3
        if MODE == 0:
            if ROPE_DIRECT:
                tm = valid[:, None] & pvalid[None, :]
                ci = tl.load(cos_ptr + pos[:, None] * s_rope + pair[None, :], mask=tm, other=0.0)
                si = tl.load(sin_ptr + pos[:, None] * s_rope + pair[None, :], mask=tm, other=0.0)
                qa = q1
                qb = q2
            else:
                # Tile rotation on the query; the keys get the offset rotation
                # with the pinned cos/sin (measured: re-reading them per tile, or
                # rotating in packed bf16/fp16, costs more than it saves).
                cp = tl.load(cos_ptr + p0 * s_rope + pair, mask=pvalid, other=0.0) * inv_m
                sp = tl.load(sin_ptr + p0 * s_rope + pair, mask=pvalid, other=0.0) * inv_m
                qa = q1 * cp[:, None] + q2 * sp[:, None]
                qb = q2 * cp[:, None] - q1 * sp[:, None]
            sc = _group_keys_scores(sc, ck, w1, w2, w3, qa, qb, q3, ci, si, 0, h,
                                    HG, C3, TRANS, DT, GPP,
                                    kb1_0, kb2_0, kb3_0, nw1, nw2, nw3, kvh1, kvh3,
                                    inv_hd, norm_eps,
                                    HG // QPK, K_BIAS, K_NORM)
            if GPP > 1:
                sc = _group_keys_scores(sc, ck1, w1_1, w2_1, w3_1, qa, qb, q3, ci, si, 1, h,
                                        HG, C3, TRANS, DT, GPP,
                                        kb1_1, kb2_1, kb3_1, nw1, nw2, nw3, kvh1, kvh3,
                                        inv_hd, norm_eps,
                                        HG // QPK, K_BIAS, K_NORM)
            if GPP > 2:
                sc = _group_keys_scores(sc, ck2, w1_2, w2_2, w3_2, qa, qb, q3, ci, si, 2, h,
                                        HG, C3, TRANS, DT, GPP,
                                        kb1_2, kb2_2, kb3_2, nw1, nw2, nw3, kvh1, kvh3,
                                        inv_hd, norm_eps,
                                        HG // QPK, K_BIAS, K_NORM)
                sc = _group_keys_scores(sc, ck3, w1_3, w2_3, w3_3, qa, qb, q3, ci, si, 3, h,
                                        HG, C3, TRANS, DT, GPP,
                                        kb1_3, kb2_3, kb3_3, nw1, nw2, nw3, kvh1, kvh3,
                                        inv_hd, norm_eps,
                                        HG // QPK, K_BIAS, K_NORM)
        else:
            sc = _group_latent_scores(sc, ck, qk, ks0, 0, h, HG, TRANS, DT, GPP, KPOST)
            if GPP > 1:
                sc = _group_latent_scores(sc, ck1, qk, ks1, 1, h, HG, TRANS, DT, GPP, KPOST)
            if GPP > 2:
                sc = _group_latent_scores(sc, ck2, qk, ks2, 2, h, HG, TRANS, DT, GPP, KPOST)
                sc = _group_latent_scores(sc, ck3, qk, ks3, 3, h, HG, TRANS, DT, GPP, KPOST)
            if KPOST:
                kz = _per_head(kz0, kz1, kz2, kz3, h, HG, GPP, TRANS)
                if TRANS:
                    sc += kz * qs[None, :]
                else:
                    sc += kz * qs[:, None]
        if TRANS:
            sc = tl.where(valid[:, None], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(sc, 0, max_combine))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[None, :])
            l2 = l2 * alpha[None, :] + p
            acc = acc * alpha[None, :]
            if VPOST:
                z2 = z2 * alpha[None, :] + p * _per_head(vz0, vz1, vz2, vz3, h, HG, GPP, TRANS)
                p = p * _per_head(vs0, vs1, vs2, vs3, h, HG, GPP, TRANS)
            acc = tl.dot(tl.trans(cv), p.to(DT), acc)  # [GPP * RV_PAD, HG_PAD]
        else:
            sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l2 = l2 * alpha[:, None] + p
            acc = acc * alpha[:, None]
            if VPOST:
                z2 = z2 * alpha[:, None] + p * _per_head(vz0, vz1, vz2, vz3, h, HG, GPP, TRANS)
                p = p * _per_head(vs0, vs1, vs2, vs3, h, HG, GPP, TRANS)
            acc = tl.dot(p.to(DT), cv, acc)  # [HG_PAD, GPP * RV_PAD]
        m_i = m_new

    if TRANS:
        l_i = tl.reduce(l2, 0, add_combine)
        has = l_i > 0.0
        if VPOST:
            acc = acc + tl.reduce(z2, 0, add_combine)[None, :]
        o = acc / tl.where(has, l_i, 1.0)[None, :]
    else:
        l_i = tl.reduce(l2, 1, add_combine)
        has = l_i > 0.0
        if VPOST:
            acc = acc + tl.reduce(z2, 1, add_combine)[:, None]
        o = tl.trans(acc / tl.where(has, l_i, 1.0)[:, None])  # [GPP * RV_PAD, HG_PAD]
    # Row r of O^T is channel r % RV_PAD of group r // RV_PAD; column h is query
    # head h of the program; keep the diagonal blocks (a head's own group).
    rvv = tl.arange(0, GPP * RV_PAD)
    cols = ocol + h[None, :] * rv + (rvv % RV_PAD)[:, None]  # [GPP * RV_PAD, HG_PAD]
    om2 = ((rvv % RV_PAD)[:, None] < rv) & hmask[None, :] & \
        ((rvv // RV_PAD)[:, None] == (h // HG)[None, :])
    if SPLIT:
        bs = b.to(tl.int64) * n_splits + s
        tl.store(po_ptr + bs * out_width + cols, o, mask=om2)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(plse_ptr + bs * num_heads + g * HG + h, lse, mask=hmask)
    else:
        tl.store(out_ptr + b.to(tl.int64) * out_width + cols, o, mask=om2)
        if LSE:
            # Natural-log LSE of the scaled scores (m_i, l_i are base 2: x ln 2).
            lse_n = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                             float("-inf"))
            tl.store(plse_ptr + b.to(tl.int64) * num_heads + g * HG + h, lse_n, mask=hmask)


@triton.jit
def decode_grid_kernel(
    n_splits, qk_scale, query, pages, keys, groups, outs, norm, span,
    k_scale_off, k_zero_off, v_scale_off, v_zero_off, share_off, rk_total, share,
    MODE: tl.constexpr, ROPE_DIRECT: tl.constexpr,
    TRANS: tl.constexpr, HG: tl.constexpr, HG_PAD: tl.constexpr, QPK: tl.constexpr,
    C1: tl.constexpr, C3: tl.constexpr, CW: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DT: tl.constexpr,
    QUANT: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    K_QG: tl.constexpr, V_QG: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr,
    OFF_MULT: tl.constexpr, RANK_MULT: tl.constexpr, SLOT_MULT: tl.constexpr,
    GPP: tl.constexpr, RANKS: tl.constexpr,
    K_BIAS: tl.constexpr, K_NORM: tl.constexpr, WINDOW: tl.constexpr,
    SPAN: tl.constexpr, LSE: tl.constexpr,
    K_CHAN: tl.constexpr, KCT: tl.constexpr, SHARE: tl.constexpr,
):
    """Plain grid: ``(num_splits, num_groups / GPP, B)``, one work item per program.

    Runtime arguments (grouped as :class:`.decode.DecodeArgs` builds them):
    ``query (q_ptr, s_qb, s_qh)``; ``pages (cache_ptr, s_blk, s_tok, bt_ptr,
    s_bt, seq_lens_ptr)`` the latent cache, its block table and the sequence
    lengths; ``keys (w_ptr, s_wg, s_wsec, maps_ptr, cos_ptr, sin_ptr, s_rope,
    max_pos)`` the packed key bases, column maps and RoPE table; ``groups
    (gt_ptr, num_groups)`` the group table; ``outs (po_ptr, plse_ptr, out_ptr,
    out_width, num_heads)``; ``norm (kb_ptr, kn_ptr, head_dim, norm_eps)`` the
    key transform; ``span (window, sink, recent)``; then the slot layout's
    offsets as scalars (``share``: unused here, the ``SHARE`` constexpr).
    ``RANKS``: the ``(RK_PAD, RV_PAD)`` of each rank class (one to four; the
    group table's row 7 names a group's class), one specialisation of
    :func:`_attend_chunk` per class behind a runtime branch."""
    s = tl.program_id(0)
    g = tl.program_id(1) * GPP
    b = tl.program_id(2)
    if len(RANKS) == 1:
        cls = 0
    else:
        gt_ptr, num_groups = groups
        cls = tl.load(gt_ptr + 7 * num_groups + g)
    for c in tl.static_range(len(RANKS)):
        if cls == c:
            _attend_chunk(
                b, g, s, n_splits, qk_scale, query, pages, keys, groups, outs, norm, span,
                k_scale_off, k_zero_off, v_scale_off, v_zero_off, share_off, rk_total,
                MODE, ROPE_DIRECT, TRANS, HG, HG_PAD, QPK, C1, C3, CW, RANKS[c][0], RANKS[c][1],
                BLOCK_N, PAGE, DT, QUANT, K_BITS, V_BITS, K_QG, V_QG, ALIGNED, SPLIT, OFF_MULT,
                RANK_MULT, SLOT_MULT, GPP, K_BIAS, K_NORM, WINDOW, SPAN, LSE, K_CHAN, KCT, SHARE)
