"""Device helpers shared by the decode kernels (:mod:`.decode`, :mod:`.decode_wide`).

- latent tile loads: float rows, or packed 8/4/3/2-bit codes with their float16
  scale/zero pairs (:func:`load_latent`; the slot format of
  :class:`vllm_lowrank.format.latent.SlotLayout`), dequantized to the dot dtype;
- the key transforms applied to rebuilt keys before RoPE (key bias, QK-norm);
- the split-K merge of partial outputs by their log-sum-exp (:func:`reduce_splits_kernel`);
- an L2 prefetch hint for the next tile's slots (:func:`prefetch_l2`);
- alignment the compiler can see in values read from memory (:func:`known_multiple`).

Only builtins of ``triton.language`` are used inside the kernels (no ``tl.max`` /
``tl.sum`` / ``tl.zeros`` / ``tl.cdiv``, which are themselves ``@triton.jit``
functions).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def add_pair(a0, a1, b0, b1):
    """Combine of a two-value sum reduction (``tl.reduce((x, y), axis, add_pair)``)."""
    return a0 + b0, a1 + b1


@triton.jit
def centred(x, OFFSET: tl.constexpr, DT: tl.constexpr, F16: tl.constexpr):
    """``x - OFFSET`` in ``DT`` for integer codes ``0 <= x < 256`` (exact).
    ``F16``: through the float16 exponent (``0x6400 | x`` is the float16
    ``1024 + x``): one OR and one subtraction, no integer conversion."""
    if F16:
        y = (x.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        return y - (1024.0 + OFFSET)
    else:
        return (x.to(tl.int32) - OFFSET).to(DT)


@triton.jit
def load_f16_param(ptrs, mask, ALIGNED: tl.constexpr):
    """fp16 values at byte pointers ``ptrs`` (uint8), as float32."""
    if ALIGNED:
        v = tl.load(ptrs.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0)
        return v.to(tl.float32)
    else:
        lo = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptrs + 1, mask=mask, other=0).to(tl.int32)
        bits = (lo | (hi << 8)).to(tl.uint16)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_codes(rows, code_off, r, valid, BITS: tl.constexpr, PAD: tl.constexpr,
                RMULT: tl.constexpr):
    """Unpack the ``PAD`` (>= r) codes of each row: ``rows`` [N] uint8 pointers to
    the slots, ``code_off`` byte offset of the group's codes, ``r`` (a multiple of
    8, and of ``RMULT``) codes stored. Returns int32 [N, PAD] (0 beyond ``r`` and
    on invalid rows).

    Code ``c`` sits at bit ``c * BITS`` of the little-endian stream
    (:func:`vllm_lowrank.format.latent.pack`). Every byte is loaded once, as a row
    of contiguous bytes (vectorizable), and expanded in registers with broadcast
    shifts and a reshape; no ``tl.interleave`` (miscompiled by triton 3.6):

    - 8/4/2 bits: bytes ``[N, PAD*BITS/8]``; byte ``j`` holds codes
      ``j*CPB .. j*CPB+CPB-1`` (``CPB = 8/BITS``) at bits ``0, BITS, ...``:
      ``(byte[:, :, None] >> (BITS * arange(CPB))) & mask`` -> ``[N, PAD/CPB, CPB]``
      -> row-major reshape to ``[N, PAD]``.
    - 3 bits: 8 codes fill 3 bytes (codes straddle bytes); the 3 bytes of each
      octet are loaded as 3 strided tiles ``[N, PAD/8]`` and joined into a 24-bit
      word, then ``(word[:, :, None] >> (3 * arange(8))) & 7`` -> reshape."""
    if BITS == 8:
        c = tl.arange(0, PAD)
        x = tl.load(rows[:, None] + code_off + c[None, :],
                    mask=valid[:, None] & (c[None, :] < r), other=0)
        return x.to(tl.int32)
    elif BITS == 3:
        NOCT: tl.constexpr = PAD // 8
        o = tl.arange(0, NOCT)
        m = valid[:, None] & (o[None, :] < r // 8)
        base = rows[:, None] + code_off + 3 * o[None, :]
        b0 = tl.load(base, mask=m, other=0).to(tl.int32)
        b1 = tl.load(base + 1, mask=m, other=0).to(tl.int32)
        b2 = tl.load(base + 2, mask=m, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)  # [N, NOCT]
        sh = tl.arange(0, 8) * 3
        codes = (word[:, :, None] >> sh[None, None, :]) & 7  # [N, NOCT, 8]
        return tl.reshape(codes, [rows.shape[0], PAD])
    else:
        CPB: tl.constexpr = 8 // BITS
        NB: tl.constexpr = PAD // CPB
        j = tl.arange(0, NB)
        rb = r // CPB  # bytes stored
        if RMULT // CPB > 1:
            rb = tl.multiple_of(rb, RMULT // CPB)
        x = tl.load(rows[:, None] + code_off + j[None, :],
                    mask=valid[:, None] & (j[None, :] < rb), other=0).to(tl.int32)
        sh = tl.arange(0, CPB) * BITS
        codes = (x[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)  # [N, NB, CPB]
        return tl.reshape(codes, [rows.shape[0], PAD])


@triton.jit
def codes_f32(codes, OFFSET: tl.constexpr):
    """``codes - OFFSET`` as float32 for int32 codes ``0 <= c < 2^22``, through
    the exponent bits (``2^23 + c`` is the float with those low mantissa bits):
    exact, and two full-rate ALU/FMA operations instead of one quarter-rate
    integer conversion."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def offset_pair(rows, valid, scale_at, zero_at, OFFSET: tl.constexpr):
    """Per-token ``(scale, zero + OFFSET * scale)`` float32 [N] of the aligned
    float16 pair at byte offsets ``scale_at`` / ``zero_at`` of each slot
    (``rows`` [N] uint8 slot pointers; 0 on invalid rows): the parameters that
    centred codes ``code - OFFSET`` meet after a dot."""
    s = load_f16_param(rows + scale_at, valid, True)
    return s, load_f16_param(rows + zero_at, valid, True) + OFFSET * s


@triton.jit
def load_pair(rows, valid, par, scale_off, zero_off, ALIGNED: tl.constexpr):
    """Scale and zero point ``par`` of each row (``rows`` [N] uint8 slot pointers),
    float32 [N] each (0 on invalid rows)."""
    sc = load_f16_param(rows + scale_off + 2 * par, valid, ALIGNED)
    ze = load_f16_param(rows + zero_off + 2 * par, valid, ALIGNED)
    return sc, ze


@triton.jit
def load_latent(cache_ptr, row_off, valid, col_off, r, par_base, scale_off, zero_off,
                 DT: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr,
                 PAD: tl.constexpr, QG: tl.constexpr, ALIGNED: tl.constexpr,
                 RMULT: tl.constexpr, POST: tl.constexpr):
    """``(x, scale, zero)``: the latent tile ``x`` [N, PAD] in ``DT`` and, for a
    post-scaled packed side (``POST``), the rows' scale and zero point [N] float32.

    ``POST`` (packed, one pair per row and group, ``QG = 0``): ``x`` holds the
    centred codes ``code - 2^(BITS-1)`` (integers in ``[-128, 127]``: exact in
    bf16/fp16/fp32 and tf32), ``zero`` the matching ``zero + 2^(BITS-1) * scale``,
    so that latent = ``x * scale + zero`` is applied after the dot. Centring keeps
    the products in the dot as small as the latents (uncentred codes are all
    positive: their sum nearly cancels against the zero-point term, which
    magnified the rounding of the probabilities and the accumulation, measured
    rel. error 1.3e-2 at 8 x 128k). Invalid rows get scale = zero = 0 (their
    centred codes are -2^(BITS-1); callers multiply them by 0 or by a zero
    probability). Otherwise ``x`` is the dequantized (or float) latent tile and
    ``scale``/``zero`` are unused zeros; ``x`` is zero on invalid rows and, for a
    float cache, beyond rank ``r``.

    Float cache: ``row_off``/``col_off`` in elements. Quantized cache: in bytes;
    ``par_base`` is the group's first scale/zero index, ``QG`` channels per
    scale/zero pair (0: one pair per row, one head group). A power-of-two ``QG``
    loads the ``[N, PAD/QG]`` pairs once and broadcasts them over
    ``[N, PAD/QG, QG]``; any other ``QG`` gathers one pair per element."""
    c = tl.arange(0, PAD)
    sc_out = tl.full([valid.shape[0]], 0.0, tl.float32)
    ze_out = sc_out
    if POST:
        rows = cache_ptr + row_off
        x = codes_f32(load_codes(rows, col_off, r, valid, BITS, PAD, RMULT),
                       1 << (BITS - 1))
        sc_out, ze_out = load_pair(rows, valid, par_base, scale_off, zero_off, ALIGNED)
        ze_out = ze_out + (1 << (BITS - 1)) * sc_out
    elif QUANT:
        rows = cache_ptr + row_off
        codes = codes_f32(load_codes(rows, col_off, r, valid, BITS, PAD, RMULT), 0)
        if QG == 0:
            sc, ze = load_pair(rows, valid, par_base, scale_off, zero_off, ALIGNED)
            x = codes * sc[:, None] + ze[:, None]
        elif (QG & (QG - 1)) == 0:
            NQ: tl.constexpr = PAD // QG
            qi = tl.arange(0, NQ)
            pm = valid[:, None] & (qi[None, :] * QG < r)
            pidx = 2 * (par_base + qi)
            sc = load_f16_param(rows[:, None] + scale_off + pidx[None, :], pm, ALIGNED)
            ze = load_f16_param(rows[:, None] + zero_off + pidx[None, :], pm, ALIGNED)
            x3 = tl.reshape(codes, [rows.shape[0], NQ, QG]) * sc[:, :, None] + ze[:, :, None]
            x = tl.reshape(x3, [rows.shape[0], PAD])
        else:
            pm = valid[:, None] & (c[None, :] < r)
            pidx = 2 * (par_base + c // QG)
            sc = load_f16_param(rows[:, None] + scale_off + pidx[None, :], pm, ALIGNED)
            ze = load_f16_param(rows[:, None] + zero_off + pidx[None, :], pm, ALIGNED)
            x = codes * sc + ze
        # No select on the tile: invalid rows have zero codes and parameters (masked
        # loads), so they are 0; channels c >= r of a valid row hold the zero point
        # (QG = 0) but only meet zero-padded operands (query columns >= r_k, B_k
        # rows >= r_k) or output columns that are never stored (>= r_v).
    else:
        x = tl.load(cache_ptr + row_off[:, None] + col_off + c[None, :],
                    mask=valid[:, None] & (c[None, :] < r), other=0.0)
    return x.to(DT), sc_out, ze_out


@triton.jit
def load_nibbles(cache_ptr, row_off, valid, col_off, r, par, scale_off, zero_off,
                 DT: tl.constexpr, HALF: tl.constexpr, ALIGNED: tl.constexpr,
                 RMULT: tl.constexpr):
    """4-bit per-token codes (one scale/zero pair per row) split by nibble:
    ``(even, odd, scale, zero)``. ``even``/``odd`` ``[N, HALF]`` in ``DT``:
    the centred codes ``code - 8`` of channels ``2j`` (low nibble of byte ``j``)
    and ``2j + 1`` (high nibble), read as one row of ``HALF`` contiguous bytes
    and never interleaved; ``scale`` and ``zero + 8 * scale`` ``[N]`` float32,
    so that latent = ``code * scale + zero`` after the dot (:func:`load_latent`'s
    ``POST`` algebra; invalid rows get zero parameters). ``row_off``/``col_off``
    in bytes; ``r`` (a multiple of 8 and of ``RMULT``) codes are stored, bytes
    past ``r / 2`` read as code 0."""
    rows = cache_ptr + row_off
    j = tl.arange(0, HALF)
    rb = r // 2
    if RMULT // 2 > 1:
        rb = tl.multiple_of(rb, RMULT // 2)
    x = tl.load(rows[:, None] + col_off + j[None, :],
                mask=valid[:, None] & (j[None, :] < rb), other=0).to(tl.int32)
    even = codes_f32(x & 15, 8).to(DT)
    odd = codes_f32(x >> 4, 8).to(DT)
    sc, ze = load_pair(rows, valid, par, scale_off, zero_off, ALIGNED)
    return even, odd, sc, ze + 8 * sc


@triton.jit
def prefetch_l2(ptrs):
    """Hint the L2 cache to fetch the line of every address in ``ptrs`` (PTX
    ``prefetch.global.L2``: no result, no fault on any address; the returned
    zeros only keep the call). GPU only: the Triton interpreter cannot run
    inline PTX, so callers guard it with a constexpr."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                     [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def known_multiple(x, M: tl.constexpr):
    """``x`` (an int32 scalar that the host has checked to be a multiple of
    ``M``) as ``x // M * M``: the same value, which the compiler's alignment
    analysis sees as a multiple of ``M``. ``tl.multiple_of`` on a value loaded
    from memory (the group table's offsets and ranks) leaves no trace in the
    compiled kernel; through this form the loads addressed from ``x`` are
    vectorized and the software pipeliner copies them asynchronously
    (``cp.async``), which it does only for loads of 32 bits or more per thread
    (Triton 3.6, sm_90; benchmarks/README.md's history in git, "Alignment the compiler can
    see")."""
    return x // M * M


@triton.jit
def group_row(gt_ptr, num_groups, g):
    """Head group ``g``'s row of the group table (int32 ``[8, num_groups]``,
    :class:`vllm_lowrank.kernels.triton.decode_prep.Prepared`): ``(k_off, v_off, r_k,
    r_v, k_par, v_par, out_col)``: the key and value latents' offsets in a slot
    (elements, or bytes in a packed slot), the ranks, the first scale/zero pair
    of each side, the first output column."""
    k_off = tl.load(gt_ptr + 0 * num_groups + g)
    v_off = tl.load(gt_ptr + 1 * num_groups + g)
    rk = tl.load(gt_ptr + 2 * num_groups + g)
    rv = tl.load(gt_ptr + 3 * num_groups + g)
    kpar = tl.load(gt_ptr + 4 * num_groups + g)
    vpar = tl.load(gt_ptr + 5 * num_groups + g)
    ocol = tl.load(gt_ptr + 6 * num_groups + g)
    return k_off, v_off, rk, rv, kpar, vpar, ocol


def tokens_per_program(query_start_loc, max_query_len: int) -> int:
    """``QT`` of :func:`query_rows` (host): 1 without ``query_start_loc`` (one
    query token per sequence), else the power of two that holds
    ``max_query_len`` tokens, at least 2."""
    return 1 if query_start_loc is None else max(2, triton.next_power_of_2(max_query_len))


@triton.jit
def query_rows(b, seq_len, qsl_ptr, R: tl.constexpr, HPR: tl.constexpr, QT: tl.constexpr):
    """The ``R`` query rows of sequence ``b``'s tile: row ``r`` is head ``h = r
    % HPR`` of the program's ``HPR`` (``QT == 1``: ``h = r``) of query token
    ``r // HPR``. ``QT > 1`` (a speculative verify step): the sequence has
    ``q_b = qsl[b + 1] - qsl[b] <= QT`` tokens, rows ``qsl[b] ..`` of the
    queries, and token ``t`` sees the first ``seq_len - (q_b - 1 - t)``
    positions (causal over the drafts). Returns ``(h, valid, tok, row_len,
    early)``: ``[R]`` head in the program, row in use, int64 query / output
    row, context length of the row's token; ``early = q_b - 1`` (``0`` for
    ``QT == 1``, where ``row_len`` is ``seq_len``)."""
    r = tl.arange(0, R)
    if QT == 1:
        return r, r < HPR, b.to(tl.int64) + 0 * r, seq_len + 0 * r, 0
    else:
        q_first = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_first
        t_of = r // HPR
        return (r - t_of * HPR, (t_of < q_len) & (r < QT * HPR),
                (q_first + t_of).to(tl.int64), seq_len - (q_len - 1 - t_of),
                tl.maximum(q_len - 1, 0))


@triton.jit
def split_tiles(seq_len, s, n_splits, window, sink, recent, BLOCK_N: tl.constexpr,
                WINDOW: tl.constexpr, SPAN: tl.constexpr):
    """``(first, end, t_lo, t_hi)``: a sequence of ``seq_len`` tokens attends
    positions ``first <= t < end`` (``WINDOW``: ``t >= seq_len - window``;
    ``SPAN``, the token-adaptive latent span: ``t >= sink``, ``end = seq_len -
    recent``; otherwise ``0 .. seq_len``), cut into tiles of ``BLOCK_N``
    positions from ``first`` (tile ``k`` covers ``first + k * BLOCK_N ..``);
    split ``s`` of ``n_splits`` takes tiles ``t_lo <= k < t_hi`` (flash-decoding's
    even cut; empty when there are fewer tiles than splits)."""
    first = seq_len * 0
    end = seq_len
    if WINDOW:
        first = tl.maximum(seq_len - window, 0)
    if SPAN:
        first = tl.maximum(first, sink)
        end = seq_len - recent
    n_tiles = tl.where(end > first, (end - first + BLOCK_N - 1) // BLOCK_N, 0)
    per = (n_tiles + n_splits - 1) // n_splits
    t_lo = s * per
    return first, end, t_lo, tl.minimum(t_lo + per, n_tiles)


@triton.jit
def share_offsets(o, s_tok, share_off, share):
    """Byte offsets, from a token group's first slot, of bytes ``o`` and ``o + 1``
    [PAD] of the group's parameter stream: stream byte ``o`` is byte
    ``share_off + o % share`` of the group's slot ``o // share`` (an odd
    ``share`` splits a float16 over two slots). ``share`` may be a runtime value
    or a constexpr. One integer division per element (byte ``o + 1`` follows
    from byte ``o``): a division by a runtime value is some twenty
    instructions, so kernels compute these once, outside their tile loop."""
    slot = o // share
    at = o - slot * share
    lo = slot * s_tok + share_off + at
    hi = tl.where(at + 1 == share, lo - at + s_tok, lo + 1)  # o + 1 opens the next slot
    return lo, hi


@triton.jit
def share_half(group_ptr, lo, hi, mask):
    """The float16 whose bytes are at ``group_ptr + lo`` and ``group_ptr + hi``
    (:func:`share_offsets`; ``group_ptr`` the group's first slot, uint8), as
    float32 [PAD]."""
    a = tl.load(group_ptr + lo, mask=mask, other=0).to(tl.int32)
    b = tl.load(group_ptr + hi, mask=mask, other=0).to(tl.int32)
    return (a | (b << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _share_half(cache_ptr, base, o, s_tok, share_off, share, mask):
    """float16 at bytes ``o, o + 1`` [PAD] of a token group's parameter stream
    (``base``: byte offset of the group's first slot), as float32 [PAD]
    (:func:`share_offsets`, :func:`share_half`)."""
    lo, hi = share_offsets(o, s_tok, share_off, share)
    return share_half(cache_ptr + base, lo, hi, mask)


@triton.jit
def load_channel_keys(cache_ptr, row_off, pos, valid, bt_row, s_blk, p0, last, code_off, r,
                      ch0, s_tok, share_off, rk_total, share, DT: tl.constexpr,
                      BITS: tl.constexpr, PAD: tl.constexpr, KCT: tl.constexpr,
                      BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Per-channel quantized key latents (KIVI sec. 3.2; the layout of
    :class:`vllm_lowrank.format.latent.SlotLayout` with ``k_channel_tokens``):
    channels ``ch0 .. ch0 + PAD - 1`` of a tile's rows, the consecutive positions
    ``pos = p0 + arange(BLOCK_N)`` (``row_off`` [BLOCK_N] their slots' byte
    offsets, ``valid`` [BLOCK_N], ``last``: the last valid position), dequantized
    to ``DT`` [BLOCK_N, PAD] (0 on invalid rows and channels ``>= r``).

    Codes are per token (``code_off``: byte offset of channel ``ch0``'s code in
    the slot); scale and zero are per channel and per aligned group of ``KCT``
    positions (inside one KV block: ``KCT`` divides ``PAGE``), stored as the
    group's stream ``[scales (rk_total) | zeros (rk_total)]`` float16 spread over
    its ``KCT`` slots, ``share`` bytes each from ``share_off`` (runtime or
    constexpr): channel ``c``'s
    scale is stream bytes ``2c, 2c + 1``, its zero ``2 (rk_total + c)``, ``+ 1``.
    The tile's rows fall in at most ``ceil(BLOCK_N / KCT) + 1`` groups: each
    group's ``[PAD]`` parameters are loaded once (its first slot found through
    the block table ``bt_row``) and selected per row, instead of a gather per
    element."""
    codes = codes_f32(load_codes(cache_ptr + row_off, code_off, r, valid, BITS, PAD, 1), 0)
    c = tl.arange(0, PAD)
    cm = c < r
    o_s = 2 * (ch0 + c)
    o_z = 2 * (rk_total + ch0 + c)
    g0 = p0 - p0 % KCT  # first position of the tile's first group
    gi = (pos - g0) // KCT  # [BLOCK_N] group of each row, counted from g0
    NGT: tl.constexpr = (BLOCK_N + KCT - 1) // KCT + 1
    sc = tl.zeros([BLOCK_N, PAD], tl.float32)
    ze = tl.zeros([BLOCK_N, PAD], tl.float32)
    for j in tl.static_range(NGT):
        gp = g0 + j * KCT
        live = (gp <= last) & (gp < p0 + BLOCK_N)  # a group some row of the tile is in
        blk = tl.load(bt_row + gp // PAGE, mask=live, other=0).to(tl.int64)
        base = blk * s_blk + (gp % PAGE).to(tl.int64) * s_tok
        m = cm & (c * 0 + gp <= last) & (c * 0 + gp < p0 + BLOCK_N)  # (vector compares: the
        # interpreter's masks)
        hit = (gi == j)[:, None]
        sc = tl.where(hit, _share_half(cache_ptr, base, o_s, s_tok, share_off, share, m)[None, :],
                      sc)
        ze = tl.where(hit, _share_half(cache_ptr, base, o_z, s_tok, share_off, share, m)[None, :],
                      ze)
    return (codes * sc + ze).to(DT)


@triton.jit
def transform_keys(k1, k2, k3, kb1, kb2, kb3, nw1, nw2, nw3, kvh1, kvh3, inv_hd, norm_eps,
                    C3: tl.constexpr, G: tl.constexpr, K_BIAS: tl.constexpr,
                    K_NORM: tl.constexpr):
    """Key bias and per-head RMSNorm of a rebuilt (unrotated) key tile.

    ``k1``/``k2`` [N, C1] float32 are the two RoPE sections (column ``c`` of KV
    head ``kvh1[c]``), ``k3`` [N, CW] the unrotated rest (KV head ``kvh3[c]``;
    ignored when ``C3 == 0``); padding columns (``kvh = -1``) are zero and stay
    zero. ``kb*`` are the bias values of each column, ``nw*`` the norm weights
    (0 on padding columns). RMSNorm (Zhang & Sennrich 2019, eq. 4) per token and
    KV head over the whole head (both rotary halves and the rest)::

        k <- k / sqrt(sum(k^2) * inv_hd + norm_eps) * w      (inv_hd = 1 / head_dim)

    applied after the bias, before RoPE (the torch path's ``KeyTransform``)."""
    if K_BIAS:
        k1 = k1 + kb1[None, :]
        k2 = k2 + kb2[None, :]
        if C3 > 0:
            k3 = k3 + kb3[None, :]
    if K_NORM:
        sq = k1 * k1 + k2 * k2  # same KV head per column in both rotary sections
        if G == 1:
            ss = tl.reduce(sq, 1, add_combine)
            if C3 > 0:
                ss += tl.reduce(k3 * k3, 1, add_combine)
            rs = tl.rsqrt(ss * inv_hd + norm_eps)[:, None]  # [N, 1]
            k1 = k1 * rs * nw1[None, :]
            k2 = k2 * rs * nw2[None, :]
            if C3 > 0:
                k3 = k3 * rs * nw3[None, :]
        else:
            r1 = sq * 0.0
            r3 = k3 * 0.0
            for j in tl.static_range(G):
                m1 = (kvh1 == j)[None, :]
                ss = tl.reduce(tl.where(m1, sq, 0.0), 1, add_combine)
                if C3 > 0:
                    m3 = (kvh3 == j)[None, :]
                    ss += tl.reduce(tl.where(m3, k3 * k3, 0.0), 1, add_combine)
                rs = tl.rsqrt(ss * inv_hd + norm_eps)[:, None]
                r1 = tl.where(m1, rs, r1)
                if C3 > 0:
                    r3 = tl.where(m3, rs, r3)
            k1 = k1 * r1 * nw1[None, :]
            k2 = k2 * r1 * nw2[None, :]
            if C3 > 0:
                k3 = k3 * r3 * nw3[None, :]
    return k1, k2, k3


@triton.jit
def key_bias(kb_ptr, grp, head_dim, src1, src2, src3, kvh1, kvh3, pvalid, G: tl.constexpr,
              C3: tl.constexpr, K_BIAS: tl.constexpr):
    """Bias of head group ``grp`` per packed key column: ``(kb1, kb2, kb3)``
    float32 ``[C1]``, ``[C1]``, ``[CW]`` from ``bias [num_kv_heads * head_dim]``
    (column of KV head ``kvh`` and dimension ``src``; 0 on padding columns).
    Without ``K_BIAS``: zeros of the same shapes (a norm without a bias)."""
    if K_BIAS:
        kb1 = tl.load(kb_ptr + (grp * G + kvh1) * head_dim + src1, mask=pvalid, other=0.0)
        kb2 = tl.load(kb_ptr + (grp * G + kvh1) * head_dim + src2, mask=pvalid, other=0.0)
        kb3 = kb1
        if C3 > 0:
            kb3 = tl.load(kb_ptr + (grp * G + kvh3) * head_dim + src3, mask=src3 >= 0,
                          other=0.0)
    else:
        kb1 = src1 * 0.0
        kb2 = kb1
        kb3 = src3 * 0.0
    return kb1, kb2, kb3


@triton.jit
def reduce_splits_kernel(po_ptr, plse_ptr, out_ptr, head_of_col_ptr, n_splits, out_width,
                   num_heads, lse_ptr, S_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
                   LSE: tl.constexpr, H_PAD: tl.constexpr):
    """Merge the split partials: ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``.

    ``LSE``: the column block 0 of each sequence also stores the merged natural
    log-sum-exp per head, ``lse [B, num_heads] = ln 2 * (M + log2 sum_s 2^(lse_s - M))``
    (``-inf`` where every split is empty)."""
    b = tl.program_id(0)
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < out_width
    hd = tl.load(head_of_col_ptr + c, mask=cm, other=0)
    sp = tl.arange(0, S_PAD)
    sm = sp < n_splits
    base = b.to(tl.int64) * n_splits + sp  # [S_PAD]
    lse = tl.load(plse_ptr + base[:, None] * num_heads + hd[None, :],
                  mask=sm[:, None] & cm[None, :], other=float("-inf"))
    mx = tl.reduce(lse, 0, max_combine)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx[None, :])
    o = tl.load(po_ptr + base[:, None] * out_width + c[None, :],
                mask=sm[:, None] & cm[None, :] & (w > 0.0), other=0.0)
    num = tl.reduce(w * o, 0, add_combine)
    den = tl.reduce(w, 0, add_combine)
    tl.store(out_ptr + b.to(tl.int64) * out_width + c, num / tl.where(den > 0.0, den, 1.0),
             mask=cm)
    if LSE:
        if cb == 0:
            hh = tl.arange(0, H_PAD)
            hm = hh < num_heads
            lh = tl.load(plse_ptr + base[:, None] * num_heads + hh[None, :],
                         mask=sm[:, None] & hm[None, :], other=float("-inf"))
            mh = tl.reduce(lh, 0, max_combine)
            mh = tl.where(mh == float("-inf"), 0.0, mh)
            dh = tl.reduce(tl.exp2(lh - mh[None, :]), 0, add_combine)
            lse_h = tl.where(dh > 0.0,
                             (mh + tl.log2(tl.where(dh > 0.0, dh, 1.0))) * 0.6931471805599453,
                             float("-inf"))
            tl.store(lse_ptr + b.to(tl.int64) * num_heads + hh, lse_h, mask=hm)
