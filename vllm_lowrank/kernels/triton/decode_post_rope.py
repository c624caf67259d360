r"""Token-adaptive decode of post-RoPE keys and value latents, in one kernel.

The layout served (``post_rope_keys`` with ``token_adaptive``; the math of
:mod:`vllm_lowrank.attention.token_adaptive`): the latent cache holds, per
token, every KV head's post-RoPE key as codes quantized per channel over
aligned groups of ``KCT`` tokens (KIVI, Liu et al. 2024, sec. 3.2) and each head
group's value latent ``c_v = x A_v`` as codes quantized per token (Palu sec.
3.4); the exact cache holds the sink and recent tokens' keys and values (model
dtype, or int8 per token and head). Per sequence ``b`` and KV head ``j`` (its
``QPK`` query heads ``q_h``, post-RoPE; head group ``g = j // G``)::

    latent span  L = {S <= t < n - W - 1},   exact set  E = {t < S} U {t >= max(S, n - W - 1)}
    s_{h,t} = scale * q_h . k_{j,t}           k from codes (t in L) or exact (t in E)
    p_{h,t} = softmax over L U E               (one online softmax: no merge)
    o_h     = (sum_{t in L} p c_v,t) B_v[g][:, j]  +  sum_{t in E} p v_{j,t}

Nothing is rebuilt: no key basis exists (the keys are the model's own), and
the value latents are lifted once per program, after the softmax (Palu eq. 6
applied per KV head: ``B_v[g][:, j]`` is ``r_v x d``, loaded once).

Codes enter the tensor-core dots with as little work per element as the
scales allow:

- keys, per channel ``c`` of the tile's group (``scale_c``, ``zero_c``): each
  code is dequantized in the dot's second operand, ``code * scale_c +
  zero_c`` (one fused multiply-add per element; scaling the query once per
  tile instead needs layout conversions, 25 barriers per tile in a version
  measured at a third of this one's speed on an H200, benchmarks/README.md,
  "Decode without a key rebuild");
- values, per token ``t`` (``scale_t``, ``zero_t``): with centred codes ``c' =
  code - 2^(b-1)``, ``sum_t p_t v_t = (p * scale) C' + (sum_t p_t (zero_t +
  2^(b-1) scale_t)) 1`` (the last added to every channel before the lift);
- int8 exact tokens: the same per-token algebra on both sides
  (:mod:`.decode_exact`).

A byte of ``b``-bit codes holds ``8 / b`` channels; the channels ``n, n + 8/b,
...`` of a byte position are one operand (the query and the lift's rows are
loaded strided to match), so nothing is unpacked into channel order. On a GPU
a code becomes a float16 through the exponent (``0x6400 | c`` is ``1024 + c``):
one OR and one subtraction. Operands are float16, softmax and accumulators
float32 (under the Triton interpreter everything is float32).

Work split (flash-decoding): the latent span in tiles of one key group
(``KCT`` positions, aligned), then the exact set in tiles of ``EXACT_BLOCK``
positions; split ``s`` of ``S`` takes an even share of that list, and
:func:`.tiles.reduce_splits_kernel` merges the splits' normalised partials by
their log-sum-exp. A program's cost is its tiles; the split count comes from
the wave model of :func:`.launch.choose_num_splits`.

Roofline (Llama-3-8B shape, 32 query / 8 KV heads of 128, 4-bit keys per
channel over 32 tokens, value rank 64 per head at 4 bits): a latent token reads
512 B of key codes, 128 B of key scales, 256 B of value codes and 32 B of value
scales per layer (928 B, 4.4x fewer than bf16's 4,096), and the dots do 49 kFLOP
(16-row tiles for 4 query heads): 53 FLOP/byte, under the H200's ridge (about
165 FLOP/byte for float16 mma at 4.8 TB/s): memory-bound, 101 us per layer at
16 x 32k at the bandwidth, 203 us at half of it.

Host side: :func:`blocker`, :func:`value_lift`, :func:`merge_head_splits` and
:class:`PostRopeLaunch` (the first three shared with the CUDA kernel of
``vllm_lowrank/kernels/cuda/post_rope_decode.cu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_prep import LOG2E, TL_DTYPES, interpreting, pow2, sm_count
from .launch import choose_num_splits
from .tiles import (add_combine, add_pair, centred, load_latent, max_combine, offset_pair,
                    query_rows, reduce_splits_kernel, tokens_per_program)

EXACT_BLOCK = 32
"""Exact positions per tile (16 under the interpreter)."""

PROGRAMS_PER_SM = 4
"""Resident programs per SM in the split model (small programs, each with its
own softmax state, as the packed kernel)."""

WARPS, STAGES = 2, 2
"""Warps per program and software-pipelining stages on a GPU: 2 warps issue about
a third fewer instructions per token than 4 (the query and scale operands are
replicated across warps; Triton 3.9 for sm_90, ``nvdisasm``), 2.5x faster than
the first version on an H200 (benchmarks/README.md, "Decode without a key
rebuild: post-RoPE keys")."""

KEY_BITS = (4, 2)
VALUE_BITS = (8, 4, 2)
"""Code widths the kernel reads: keys (two or four per byte) and values."""


@triton.jit
def _code(x, n: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, F16: tl.constexpr):
    """Centred codes of field ``n`` of every byte of ``x`` (``BITS``-bit codes)."""
    if BITS == 8:
        return centred(x, 128, DT, F16)
    else:
        return centred((x >> (n * BITS)) & ((1 << BITS) - 1), 1 << (BITS - 1), DT, F16)


@triton.jit
def _key_field(kx, group_ptr, s_at, z_at, n: tl.constexpr, BITS: tl.constexpr,
               DT: tl.constexpr, F16: tl.constexpr):
    """Field ``n`` of the key code bytes ``kx [KB, N]`` dequantized per channel,
    ``DT [KB, N]``: ``code * scale + zero`` with the group's float16 scales and
    zeros of those channels at byte offsets ``s_at + 2 n`` / ``z_at + 2 n`` [KB]
    from its first slot (``group_ptr``)."""
    sc = tl.load((group_ptr + s_at + 2 * n).to(tl.pointer_type(tl.float16)))
    ze = tl.load((group_ptr + z_at + 2 * n).to(tl.pointer_type(tl.float16)))
    code = centred((kx >> (n * BITS)) & ((1 << BITS) - 1), 0, DT, F16)
    return code * sc.to(DT)[:, None] + ze.to(DT)[:, None]


@triton.jit
def post_rope_decode_kernel(
    q_ptr, s_qb, s_qh,
    cache_ptr, s_blk, s_tok, bt_ptr, s_bt,
    ex_ptr, s_eblk, s_etok, ebt_ptr, s_ebt,
    lens_ptr, vup_ptr, vsum_ptr,
    v_codes_off, v_scale_off, v_zero_off, share_off,
    ex_vcodes_off, ex_kscale_off, ex_kzero_off, ex_vscale_off, ex_vzero_off,
    po_ptr, plse_ptr, n_splits, qk_scale, sink, recent, kv_width, k_width, qsl_ptr,
    D: tl.constexpr, QPK: tl.constexpr, Q_PAD: tl.constexpr, G: tl.constexpr,
    RV: tl.constexpr, RV_PAD: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    KCT: tl.constexpr, SHARE: tl.constexpr, EB: tl.constexpr, E_BITS: tl.constexpr,
    PAGE: tl.constexpr, EPAGE: tl.constexpr, DT: tl.constexpr, F16: tl.constexpr,
    SPLIT: tl.constexpr, QT: tl.constexpr,
):
    """One program per ``(split s, KV head j, sequence b)``; see the module
    docstring. Pointers: queries ``[B, H, D]``; the latent cache (uint8,
    strides in bytes) and its block table; the exact cache (``E_BITS`` 16:
    viewed in the model dtype, strides in elements; 8: uint8, bytes) and its
    block table; ``lens [B]``; ``vup [num_kv_heads, RV_PAD, D]`` each KV head's
    value lift ``B_v[g][:, j]`` (zero rows past ``RV``) in ``DT``, ``vsum
    [num_kv_heads, D]`` float32 its column sums. ``SPLIT``: store the
    normalised partial ``[row, s, H * D]`` and its base-2 log-sum-exp ``[row,
    s, H]``; else the output row ``[row, H * D]`` (its dtype).

    ``QT > 1``: sequence ``b`` has up to ``QT`` query tokens, rows ``qsl[b] ..
    qsl[b + 1] - 1`` (a speculative verify step); token ``t`` of ``q_b`` sees
    ``n_t = seq_len - (q_b - 1 - t)`` positions, split into latent span and
    exact set at its own boundary (as a step that decoded it alone). Their
    ``QT x QPK`` query rows share every tile: the latent tiles up to the last
    token's span end, the exact tiles from the first token's tail, each row
    masked to its own sets. ``QT == 1``: row ``b`` (``qsl_ptr`` unused)."""
    s = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2)
    g = j // G
    KC: tl.constexpr = 8 // K_BITS   # key codes per byte
    VC: tl.constexpr = 8 // V_BITS   # value codes per byte
    KB: tl.constexpr = D // KC       # key code bytes of one head
    VB: tl.constexpr = RV_PAD // VC  # value code bytes (padded) of one group
    KOFF: tl.constexpr = 1 << (K_BITS - 1)
    VOFF: tl.constexpr = 1 << (V_BITS - 1)

    # ---- the program's queries, split by code field: q[:, KC * i + n] meets field n
    # (loop-invariant dot operands: the keys are dequantized in the other operand)
    seq_len = tl.load(lens_ptr + b)
    h, hm, tok, row_len, early = query_rows(b, seq_len, qsl_ptr, Q_PAD, QPK, QT)
    row_lat_end = row_len - recent                   # [Q_PAD] each token's own span end
    row_tail = tl.maximum(sink, row_lat_end)         # and exact tail
    heads = j * QPK + h
    qrow = q_ptr + tok * s_qb + heads.to(tl.int64) * s_qh
    kj = tl.arange(0, KB)
    q0 = tl.load(qrow[:, None] + KC * kj[None, :], mask=hm[:, None], other=0.0).to(DT)
    q1 = q0
    q2 = q0
    q3 = q0
    if KC >= 2:
        q1 = tl.load(qrow[:, None] + KC * kj[None, :] + 1, mask=hm[:, None], other=0.0).to(DT)
    if KC == 4:
        q2 = tl.load(qrow[:, None] + 4 * kj[None, :] + 2, mask=hm[:, None], other=0.0).to(DT)
        q3 = tl.load(qrow[:, None] + 4 * kj[None, :] + 3, mask=hm[:, None], other=0.0).to(DT)
    # byte offsets, from a key group's first slot, of this head's float16 scales
    # and zeros (channel c: stream bytes 2c and 2 (Rk + c); SHARE is even, so a
    # half never straddles two slots): computed once, outside the tile loop
    ch = j * D + KC * kj
    s_at = (2 * ch // SHARE) * s_tok + share_off + (2 * ch) % SHARE
    z_at = (2 * (k_width + ch) // SHARE) * s_tok + share_off + (2 * (k_width + ch)) % SHARE

    # ---- the split's tiles: latent span, then exact set
    lat_end = seq_len - recent                       # latent span [sink, lat_end)
    n_lat = tl.where(lat_end > sink, (lat_end - sink + KCT - 1) // KCT, 0)
    tail = tl.maximum(sink, lat_end - early)         # exact tail [tail, seq_len)
    n_sink = tl.minimum(sink, seq_len)
    n_ex = n_sink + tl.maximum(seq_len - tail, 0)
    n_tiles = n_lat + (n_ex + EB - 1) // EB
    per = (n_tiles + n_splits - 1) // n_splits
    t_lo = s * per
    t_hi = tl.minimum(t_lo + per, n_tiles)
    lat_hi = tl.minimum(t_hi, n_lat)

    m_i = tl.full([Q_PAD], float("-inf"), tl.float32)
    l_i = tl.full([Q_PAD], 0.0, tl.float32)
    zl_i = tl.full([Q_PAD], 0.0, tl.float32)    # sum_t p (value zero), latent part
    ze_i = tl.full([Q_PAD], 0.0, tl.float32)    # the same, int8 exact part
    vj = tl.arange(0, VB)
    acc0 = tl.full([Q_PAD, VB], 0.0, tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    c = tl.arange(0, D)
    acc_e = tl.full([Q_PAD, D], 0.0, tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    i = tl.arange(0, KCT)
    v_codes = v_codes_off + g * (RV * V_BITS // 8)
    vmask = vj < RV // VC
    # The group pointer and the value pairs of tile t + 1 are loaded during tile t
    # (gathers the compiler does not pipeline; the packed kernel's carry).
    p0 = tl.where(t_lo < lat_hi, sink + t_lo * KCT, 0)  # position 0: a block every row has
    blk_n = tl.load(bt_row + p0 // PAGE).to(tl.int64)
    gptr_n = cache_ptr + blk_n * s_blk + (p0 % PAGE) * s_tok
    valid_n = (p0 + i < lat_end) & (i * 0 + t_lo < lat_hi)  # (vector compares: the
    # interpreter's masks)
    vs_n, vz_n = offset_pair(gptr_n + i * s_tok, valid_n, v_scale_off + 2 * g,
                              v_zero_off + 2 * g, VOFF)
    for t in range(t_lo, lat_hi):
        p0 = sink + t * KCT                          # a key group's first position
        valid = valid_n
        gptr = gptr_n                                # the group's first slot
        vs, vz = vs_n, vz_n
        rows = gptr + i * s_tok
        # keys: codes dequantized per channel in the dot's second operand
        kx = tl.load(rows[None, :] + j * KB + kj[:, None], mask=valid[None, :], other=0)
        sc = tl.dot(q0, _key_field(kx, gptr, s_at, z_at, 0, K_BITS, DT, F16))
        if KC >= 2:
            sc = tl.dot(q1, _key_field(kx, gptr, s_at, z_at, 1, K_BITS, DT, F16), sc)
        if KC == 4:
            sc = tl.dot(q2, _key_field(kx, gptr, s_at, z_at, 2, K_BITS, DT, F16), sc)
            sc = tl.dot(q3, _key_field(kx, gptr, s_at, z_at, 3, K_BITS, DT, F16), sc)
        # the next tile's group pointer and value pairs
        has_n = t + 1 < lat_hi
        pn = tl.where(has_n, p0 + KCT, 0)
        blk_n = tl.load(bt_row + pn // PAGE).to(tl.int64)
        gptr_n = cache_ptr + blk_n * s_blk + (pn % PAGE) * s_tok
        valid_n = (pn + i < lat_end) & (i * 0 + t + 1 < lat_hi)
        vs_n, vz_n = offset_pair(gptr_n + i * s_tok, valid_n, v_scale_off + 2 * g,
                                  v_zero_off + 2 * g, VOFF)
        if QT == 1:
            sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        else:
            sc = tl.where(valid[None, :] & ((p0 + i)[None, :] < row_lat_end[:, None]),
                          sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        # values: per-token pairs on the probabilities, codes in the dot
        pl, pz = tl.reduce((p, p * vz[None, :]), 1, add_pair)
        l_i = l_i * alpha + pl
        zl_i = zl_i * alpha + pz
        ps = (p * vs[None, :]).to(DT)
        vx = tl.load(rows[:, None] + v_codes + vj[None, :], mask=valid[:, None] & vmask[None, :],
                     other=0)
        acc0 = tl.dot(ps, _code(vx, 0, V_BITS, DT, F16), acc0 * alpha[:, None])
        if VC >= 2:
            acc1 = tl.dot(ps, _code(vx, 1, V_BITS, DT, F16), acc1 * alpha[:, None])
        if VC == 4:
            acc2 = tl.dot(ps, _code(vx, 2, V_BITS, DT, F16), acc2 * alpha[:, None])
            acc3 = tl.dot(ps, _code(vx, 3, V_BITS, DT, F16), acc3 * alpha[:, None])
        m_i = m_new
    # the exact part's scores meet whole heads: its queries, and sum(q) for int8 keys
    q_dt = tl.load(qrow[:, None] + c[None, :], mask=hm[:, None], other=0.0).to(DT)
    q_sum = tl.sum(q_dt.to(tl.float32), 1)

    e = tl.arange(0, EB)
    ebt_row = ebt_ptr + b.to(tl.int64) * s_ebt
    for t in range(tl.maximum(t_lo, n_lat) - n_lat, t_hi - n_lat):
        idx = t * EB + e                             # index into the exact set
        valid = idx < n_ex
        pos = tl.where(idx < n_sink, idx, tail + idx - n_sink)
        blk = tl.load(ebt_row + pos // EPAGE, mask=valid, other=0).to(tl.int64)
        roff = blk * s_eblk + (pos % EPAGE) * s_etok
        if E_BITS == 16:
            k = tl.load(ex_ptr + roff[:, None] + (j * D + c)[None, :], mask=valid[:, None],
                        other=0.0)
            v = tl.load(ex_ptr + roff[:, None] + (kv_width + j * D + c)[None, :],
                        mask=valid[:, None], other=0.0)
            sc = tl.dot(q_dt, tl.trans(k.to(DT)))
        else:
            k, ks, kz = load_latent(ex_ptr, roff, valid, j * D, D, j, ex_kscale_off,
                                    ex_kzero_off, DT, True, 8, D, 0, True, 1, True)
            v, vs, vz = load_latent(ex_ptr, roff, valid, ex_vcodes_off + j * D, D, j,
                                    ex_vscale_off, ex_vzero_off, DT, True, 8, D, 0, True, 1,
                                    True)
            sc = tl.dot(q_dt, tl.trans(k)) * ks[None, :] + q_sum[:, None] * kz[None, :]
        if QT == 1:
            sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        else:  # each row's own exact set: its sinks, its tail, up to its own token
            mine = ((pos[None, :] < sink) | (pos[None, :] >= row_tail[:, None])) & \
                (pos[None, :] < row_len[:, None])
            sc = tl.where(valid[None, :] & mine, sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(sc, 1, max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
        if E_BITS == 16:
            acc_e = tl.dot(p.to(DT), v.to(DT), acc_e * alpha[:, None])
        else:
            ze_i = ze_i * alpha + tl.reduce(p * vz[None, :], 1, add_combine)
            acc_e = tl.dot((p * vs[None, :]).to(DT), v, acc_e * alpha[:, None])
        zl_i = zl_i * alpha
        acc0 = acc0 * alpha[:, None]
        if VC >= 2:
            acc1 = acc1 * alpha[:, None]
        if VC == 4:
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
        m_i = m_new

    # ---- epilogue: normalise, lift the latent part, store
    seen = l_i > 0.0
    inv_l = 1.0 / tl.where(seen, l_i, 1.0)
    vrow = vup_ptr + j.to(tl.int64) * RV_PAD * D
    o = (acc_e + ze_i[:, None]) * inv_l[:, None]
    vsum = tl.load(vsum_ptr + j.to(tl.int64) * D + c)
    o += (zl_i * inv_l)[:, None] * vsum[None, :]
    w0 = tl.load(vrow + (VC * vj)[:, None] * D + c[None, :])
    o = tl.dot((acc0 * inv_l[:, None]).to(DT), w0, o)
    if VC >= 2:
        w1 = tl.load(vrow + (VC * vj + 1)[:, None] * D + c[None, :])
        o = tl.dot((acc1 * inv_l[:, None]).to(DT), w1, o)
    if VC == 4:
        w2 = tl.load(vrow + (4 * vj + 2)[:, None] * D + c[None, :])
        o = tl.dot((acc2 * inv_l[:, None]).to(DT), w2, o)
        w3 = tl.load(vrow + (4 * vj + 3)[:, None] * D + c[None, :])
        o = tl.dot((acc3 * inv_l[:, None]).to(DT), w3, o)
    num_heads = tl.num_programs(1) * QPK
    col = heads[:, None] * D + c[None, :]
    if SPLIT:
        bs = tok * n_splits + s  # [Q_PAD]
        lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(po_ptr + bs[:, None] * num_heads * D + col, o, mask=hm[:, None])
        tl.store(plse_ptr + bs * num_heads + heads, lse2, mask=hm)
    else:
        tl.store(po_ptr + tok[:, None] * num_heads * D + col,
                 o.to(po_ptr.dtype.element_ty), mask=hm[:, None])


def value_lift(plan, v_up: torch.Tensor, rv_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each KV head's value lift ``B_v[g][:, j]`` (Palu eq. 6 per KV head) out of the
    block-diagonal ``v_up [Rv, num_kv_heads * head_dim]``: ``(lift [num_kv_heads,
    rv_pad, head_dim] float32`` (zero rows past the value rank), ``vsum
    [num_kv_heads, head_dim] float32`` its column sums, the lift of the value zero
    term). One value rank for every group (:func:`blocker`'s scope)."""
    sh = plan.shape
    d, rv, gw = sh.head_dim, plan.v_ranks[0], plan.group_width
    lift = torch.zeros(sh.num_kv_heads, rv_pad, d, device=v_up.device)
    for jh in range(sh.num_kv_heads):
        g, jl = divmod(jh, plan.group_size)
        off = plan.v_offsets()[g]
        lift[jh, :rv] = v_up[off:off + rv, g * gw + jl * d:g * gw + (jl + 1) * d].float()
    return lift, lift.sum(1).contiguous()


def head_columns(num_heads: int, head_dim: int, device) -> torch.Tensor:
    """``[num_heads * head_dim]`` int32: the query head of each output column."""
    return torch.arange(num_heads * head_dim, device=device, dtype=torch.int32) // head_dim


def merge_head_splits(po: torch.Tensor, plse: torch.Tensor, out: torch.Tensor,
                      head_of_col: torch.Tensor, num_heads: int) -> None:
    """Merge the split partials of whole heads into ``out [B, H * head_dim]``
    (:func:`.tiles.reduce_splits_kernel`): ``po [B, S, H * head_dim]`` float32
    normalised partials, ``plse [B, S, H]`` their base-2 log-sum-exp,
    ``head_of_col`` from :func:`head_columns`."""
    bsz, num_splits, width = po.shape
    reduce_splits_kernel[(bsz, triton.cdiv(width, 128))](
        po, plse, out, head_of_col, num_splits, width, num_heads, plse,
        S_PAD=pow2(num_splits, 2), BLOCK_C=128, LSE=False, H_PAD=pow2(num_heads, 2),
        num_warps=4)


def blocker(plan, layout, exact_slot, *, post_rope: bool, window: int | None,
            block_size: int) -> str | None:
    """Why a token-adaptive layer cannot take :func:`post_rope_decode_kernel`,
    or ``None``.

    Its scope: keys cached after RoPE at full width (``post_rope_keys``),
    quantized per channel (:data:`KEY_BITS`, groups of ``k_channel_tokens``
    positions dividing the block); value latents at :data:`VALUE_BITS` with one
    scale/zero pair per token and head group, one value rank for every group
    (at most ``head_dim``, at least ``16 * 8 / v_bits`` channels); ``head_dim``
    a power of two in 16..256; at most 16 query heads per KV head; exact slots
    at 16 bits or int8; no sliding window."""
    sh = plan.shape
    d = sh.head_dim
    if not post_rope or not plan.full_keys:
        return "keys are not cached after RoPE at full width"
    if window is not None:
        return "sliding window"
    if layout is None or not layout.k_per_channel:
        return "keys not quantized per channel"
    if layout.k_bits not in KEY_BITS or layout.v_bits not in VALUE_BITS:
        return f"bits ({layout.k_bits}, {layout.v_bits}) not in {KEY_BITS} x {VALUE_BITS}"
    if block_size % layout.k_channel_tokens or layout.k_channel_tokens < 16:
        return (f"key groups of {layout.k_channel_tokens} tokens: not at least 16 and a "
                f"divisor of the block size {block_size}")
    if layout.k_channel_tokens & (layout.k_channel_tokens - 1):
        return "key group size not a power of two"
    if any(q != r for q, r in zip(layout.v_groups, layout.v_ranks)):
        return "grouped value scales"
    if len(set(plan.v_ranks)) != 1:
        return "uneven value ranks"
    rv = plan.v_ranks[0]
    if rv > d or pow2(rv, 1) * layout.v_bits < 128:
        return f"value rank {rv}: more than head_dim or fewer than 16 code bytes"
    if not (16 <= d <= 256 and d & (d - 1) == 0):
        return "head_dim not a power of two in 16..256"
    if sh.queries_per_kv > 16:
        return "more than 16 query heads per KV head"
    if exact_slot.bits == 16 and exact_slot.kv_width * exact_slot.dtype.itemsize % 2:
        return "exact slot"
    if layout.slot_bytes % 2 or layout.v_scale_offset % 2 or layout.v_zero_offset % 2:
        return "odd slot or value scale offsets"
    return None


class PostRopeLaunch:
    """The fused token-adaptive decode of one post-RoPE-keys layer, prepared once.

    Args:
        plan, layout: The layer's plan and slot layout (in :func:`blocker`'s scope).
        exact_slot: Its :class:`~vllm_lowrank.format.exact.ExactSlot`.
        v_up: ``[Rv, num_kv_heads * head_dim]`` float block-diagonal value
            up-projection.
        scale: Softmax scale.
        sink, recent: The exact sink tokens and recent window ``W`` (the
            latent span ends ``W + 1`` positions before the sequence's end).
        dtype: Query (model) dtype.
        block_size: Tokens per KV block configured (each cache's own block size,
            read at each call, may be a multiple of it: vLLM enlarges the blocks
            of the cache group with the smaller pages).

    Raises:
        ValueError: a layer outside :func:`blocker`'s scope.
    """

    def __init__(self, plan, layout, exact_slot, v_up: torch.Tensor, *, scale: float,
                 sink: int, recent: int, dtype: torch.dtype, block_size: int) -> None:
        why = blocker(plan, layout, exact_slot, post_rope=True, window=None,
                      block_size=block_size)
        if why is not None:
            raise ValueError(f"the post-RoPE-keys decode kernel cannot run this layer: {why}")
        sh = plan.shape
        d, rv = sh.head_dim, plan.v_ranks[0]
        self.plan, self.layout, self.exact_slot = plan, layout, exact_slot
        self.sink, self.recent = int(sink), int(recent) + 1
        self.qk_scale = float(scale) * LOG2E
        self.dtype, self.block_size = dtype, block_size
        f32 = interpreting()
        self.dt = torch.float32 if f32 else torch.float16
        rv_pad = pow2(rv, 16)
        lift, self.vsum = value_lift(plan, v_up, rv_pad)
        self.lift = lift.to(self.dt).contiguous()
        lay = exact_slot.int8_layout
        self.ex_offs = ((0, 0, 0, 0, 0) if lay is None else
                        (lay.v_codes_offset, lay.k_scale_offset, lay.k_zero_offset,
                         lay.v_scale_offset, lay.v_zero_offset))
        self.consts = dict(
            D=d, QPK=sh.queries_per_kv,
            G=plan.group_size, RV=rv, RV_PAD=rv_pad, K_BITS=layout.k_bits,
            V_BITS=layout.v_bits, KCT=layout.k_channel_tokens, SHARE=layout.k_share_bytes,
            EB=16 if f32 else EXACT_BLOCK, E_BITS=exact_slot.bits, DT=TL_DTYPES[self.dt],
            F16=not f32,
            num_warps=WARPS, num_stages=1 if f32 else STAGES)

    def num_splits(self, bsz: int, max_seq_len: int, device) -> int:
        """Context splits per sequence and KV head for a call on ``bsz``
        sequences whose longest has ``max_seq_len`` tokens (host arithmetic)."""
        return choose_num_splits(bsz, self.plan.shape.num_kv_heads, max_seq_len,
                                 self.layout.k_channel_tokens, sm_count(torch.device(device)),
                                 PROGRAMS_PER_SM)

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 exact_cache: torch.Tensor, exact_block_table: torch.Tensor,
                 seq_lens: torch.Tensor, num_splits: int, out: torch.Tensor,
                 query_start_loc: torch.Tensor | None = None,
                 max_query_len: int = 1) -> torch.Tensor:
        """Decode one new token per sequence, or a verify step's few, into ``out``.

        Args:
            query: ``[T, H, head_dim]`` post-RoPE queries (``T = B`` without
                ``query_start_loc``).
            kv_cache: ``uint8 [num_blocks, 1, block_size, slot_bytes]`` latent cache.
            block_table: ``[B, max_blocks]`` int32 rows of its block table.
            exact_cache: ``uint8 [num_blocks, 1, block_size, exact slot bytes]``,
                this token already written; exact_block_table: its rows.
            seq_lens: ``[B]`` int32, this token included (0: a CUDA graph's
                padding row, which gets zeros).
            num_splits: From :meth:`num_splits`.
            out: ``[T, H * head_dim]`` (contiguous rows), any float dtype.
            query_start_loc: ``[B + 1]`` int32 (device) offsets of each
                sequence's query rows (a speculative verify step), at most
                ``max_query_len`` each; token ``t`` of ``q_b`` decodes as if
                alone at ``seq_len - (q_b - 1 - t)``. ``None``: one per sequence.

        Returns:
            ``out``.
        """
        sh = self.plan.shape
        bsz = query.shape[0]
        qt = tokens_per_program(query_start_loc, max_query_len)
        query = query if query.stride(-1) == 1 else query.contiguous()
        ex = exact_cache.view(self.dtype) if self.exact_slot.bits == 16 else exact_cache
        split = num_splits > 1
        if split:
            po = torch.empty(bsz, num_splits, sh.num_heads * sh.head_dim,
                             device=query.device, dtype=torch.float32)
            plse = torch.empty(bsz, num_splits, sh.num_heads, device=query.device,
                               dtype=torch.float32)
        else:
            po, plse = out, out
        lay = self.layout
        consts = dict(self.consts, Q_PAD=max(16, triton.next_power_of_2(qt * self.consts["QPK"])))
        post_rope_decode_kernel[(num_splits, sh.num_kv_heads, seq_lens.shape[0])](
            query, query.stride(0), query.stride(1),
            kv_cache, kv_cache.stride(0), kv_cache.stride(2), block_table, block_table.stride(0),
            ex, ex.stride(0), ex.stride(2), exact_block_table, exact_block_table.stride(0),
            seq_lens, self.lift, self.vsum,
            lay.v_codes_offset, lay.v_scale_offset, lay.v_zero_offset, lay.k_share_offset,
            *self.ex_offs,
            po, plse, num_splits, self.qk_scale, self.sink, self.recent, sh.kv_width,
            self.plan.k_width, seq_lens if query_start_loc is None else query_start_loc,
            SPLIT=split, QT=qt, PAGE=kv_cache.shape[2], EPAGE=exact_cache.shape[2], **consts)
        if split:
            if getattr(self, "_hoc", None) is None or self._hoc.device != query.device:
                self._hoc = head_columns(sh.num_heads, sh.head_dim, query.device)
            merge_head_splits(po, plse, out, self._hoc, sh.num_heads)
        return out
