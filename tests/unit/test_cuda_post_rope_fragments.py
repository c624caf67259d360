"""The register mappings of ``vllm_lowrank/kernels/cuda/post_rope_decode.cu``,
emulated lane by lane on the CPU: the bit tricks (``prmt``, ``lop3``, the f16
exponent ``0x6400``), the mma.sync m16n8k16 fragment layouts (PTX ISA) and
``movmatrix``, applied as the kernel applies them to one warp's tiles, must give
the plain products: key scores with the per-channel scales folded into the query
and the zeros as an mma bias, 2- and 4-bit value codes under the transposed
probabilities, int8 exact keys and values, and the lift. This checks the design
of the channel and token orders on a machine without a GPU, and the
kernel's walk over a cache (tile list, byte offsets, warp states, merges)
reproduces the torch path; it mirrors the
kernel's code by hand (keep the two in step), and the kernel itself is tested on
a GPU (``tests/kernels/test_cuda_post_rope_decode.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from post_rope_case import make_case, reference

D, NW, EB = 128, 4, 32
"""head_dim, warps per CTA and exact positions per tile of the kernel."""


def prmt(a, b, sel):
    bs = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(bs[(sel >> (4 * n)) & 7] << (8 * n) for n in range(4))


def h2(lo, hi):  # float pair -> f16 bits word
    return int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16)


def unh2(w):
    return (
        float(np.uint16(w & 0xFFFF).view(np.float16)),
        float(np.uint16(w >> 16).view(np.float16)),
    )


def or6400(x, mask):
    return (x & mask) | 0x64006400


def hsub(x, c):
    lo, hi = unh2(x)
    return h2(lo - c, hi - c)


def hfma(x, m, c):
    lo, hi = unh2(x)
    return h2(lo * m + c, hi * m + c)


def hmul(x, y):
    a, b = unh2(x)
    c, d = unh2(y)
    return h2(a * c, b * d)


def lo4(x):
    return hsub(or6400(x, 0x000F000F), 1032)


def hi4(x):
    return hfma(or6400(x, 0x00F000F0), 1 / 16, -72)


def c2(x, F):
    y = or6400(x, 0x00030003 << (2 * F))
    return hsub(y, 1026) if F == 0 else hfma(y, 1 / 4**F, -(1024 / 4**F) - 2)


def c8(a, b, sel):
    return hsub(or6400(prmt(a, b, sel), 0x00FF00FF), 1152)


def w32(bts, off):
    return (
        int(bts[off]) | int(bts[off + 1]) << 8 | int(bts[off + 2]) << 16 | int(bts[off + 3]) << 24
    )


def mma(C, A, B):
    """C [32 lanes][4] += A B with PTX m16n8k16 fragments: A[lane] 4 words, B[lane] 2 words."""
    Am = np.zeros((16, 16))
    Bm = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        a = [unh2(w) for w in A[lane]]
        Am[gr, 2 * tc : 2 * tc + 2] = a[0]
        Am[gr + 8, 2 * tc : 2 * tc + 2] = a[1]
        Am[gr, 2 * tc + 8 : 2 * tc + 10] = a[2]
        Am[gr + 8, 2 * tc + 8 : 2 * tc + 10] = a[3]
        b = [unh2(w) for w in B[lane]]
        Bm[2 * tc : 2 * tc + 2, gr] = b[0]
        Bm[2 * tc + 8 : 2 * tc + 10, gr] = b[1]
    D = Am @ Bm
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        C[lane][0] += D[gr, 2 * tc]
        C[lane][1] += D[gr, 2 * tc + 1]
        C[lane][2] += D[gr + 8, 2 * tc]
        C[lane][3] += D[gr + 8, 2 * tc + 1]


def movmatrix(words):  # words[lane]: row gr cols 2tc, 2tc+1 -> transposed
    M = np.zeros((8, 8), dtype=object)
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        lo, hi = words[lane] & 0xFFFF, words[lane] >> 16
        M[gr, 2 * tc] = lo
        M[gr, 2 * tc + 1] = hi
    out = []
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        out.append(int(M[2 * tc, gr]) | int(M[2 * tc + 1, gr]) << 16)
    return out


def test_fragment_mappings_reproduce_the_products():
    rng = np.random.default_rng(0)
    QPK = 4
    q = (
        (rng.standard_normal((8, 128)) * (np.arange(8) < QPK)[:, None])
        .astype(np.float16)
        .astype(float)
    )
    # ---- query fragments
    qf = [[[0, 0] for _ in range(8)] for _ in range(32)]
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        for i in range(4):
            c = 32 * tc + 8 * i
            hw = [h2(q[gr, c + 2 * x], q[gr, c + 2 * x + 1]) for x in range(4)]
            qf[lane][2 * i] = [prmt(hw[0], hw[2], 0x5410), prmt(hw[0], hw[2], 0x7632)]
            qf[lane][2 * i + 1] = [prmt(hw[1], hw[3], 0x5410), prmt(hw[1], hw[3], 0x7632)]

    # ---- key tile: 16 tokens, 4-bit codes per channel, per-channel scale/zero
    codes = rng.integers(0, 16, (16, 128))
    sc = (rng.random(128) * 0.5 + 0.01).astype(np.float16).astype(float)
    ze = (rng.standard_normal(128)).astype(np.float16).astype(float)
    kbytes = np.zeros((16, 64), dtype=np.uint8)
    for t in range(16):
        for b in range(64):
            kbytes[t, b] = codes[t, 2 * b] | (codes[t, 2 * b + 1] << 4)
    shb = np.concatenate(
        [sc.astype(np.float16).view(np.uint8), ze.astype(np.float16).view(np.uint8)]
    )
    bias = [[0.0] * 4 for _ in range(32)]
    qs = [[None] * 8 for _ in range(32)]
    A_z = [[None] * 4 for _ in range(32)]
    for s_ in range(8):
        Az, As, B = [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            i, e = s_ // 2, s_ % 2
            sw = [w32(shb, 64 * tc + 16 * i + 4 * x) for x in range(4)]
            zw = [w32(shb, 256 + 64 * tc + 16 * i + 4 * x) for x in range(4)]
            sp = [
                [prmt(sw[0], sw[2], 0x5410), prmt(sw[0], sw[2], 0x7632)],
                [prmt(sw[1], sw[3], 0x5410), prmt(sw[1], sw[3], 0x7632)],
            ]
            zp = [
                [prmt(zw[0], zw[2], 0x5410), prmt(zw[0], zw[2], 0x7632)],
                [prmt(zw[1], zw[3], 0x5410), prmt(zw[1], zw[3], 0x7632)],
            ]
            qs[lane][s_] = [hmul(qf[lane][s_][0], sp[e][0]), hmul(qf[lane][s_][1], sp[e][1])]
            Az.append([zp[e][0], zp[e][0], zp[e][1], zp[e][1]])
            s8a, s8b = hmul(sp[e][0], 0x48004800), hmul(sp[e][1], 0x48004800)
            As.append([s8a, s8a, s8b, s8b])
            B.append(qf[lane][s_])
        mma(bias, Az, B)
        mma(bias, As, B)
    acc = [list(x) for x in bias]
    for i in range(4):
        A1, A2, B1, B2 = [], [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            x0 = w32(kbytes[gr], 16 * tc + 4 * i)
            x1 = w32(kbytes[gr + 8], 16 * tc + 4 * i)
            A1.append([lo4(x0), lo4(x1), hi4(x0), hi4(x1)])
            B1.append(qs[lane][2 * i])
            x0 >>= 8
            x1 >>= 8
            A2.append([lo4(x0), lo4(x1), hi4(x0), hi4(x1)])
            B2.append(qs[lane][2 * i + 1])
        mma(acc, A1, B1)
        mma(acc, A2, B2)
    keys = codes * sc + ze
    want = keys @ q.T  # [16 tokens, 8 heads]
    got = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        got[gr, 2 * tc], got[gr, 2 * tc + 1], got[gr + 8, 2 * tc], got[gr + 8, 2 * tc + 1] = acc[
            lane
        ]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3  # q * scale in f16

    # ---- value tile: P [16 tokens x 8 heads] * vs, codes V bits, acc [128 ch x 8]
    for VB in (2, 4):
        vcodes = rng.integers(0, 1 << VB, (16, 128))
        per = 8 // VB
        vbytes = np.zeros((16, 128 // per), dtype=np.uint8)
        for t in range(16):
            for b in range(128 // per):
                vbytes[t, b] = sum(int(vcodes[t, per * b + f]) << (VB * f) for f in range(per))
        P = rng.random((16, 8)).astype(np.float16).astype(float)
        pb0 = movmatrix(
            [
                h2(P[lane >> 2, 2 * (lane & 3)], P[lane >> 2, 2 * (lane & 3) + 1])
                for lane in range(32)
            ]
        )
        pb1 = movmatrix(
            [
                h2(P[(lane >> 2) + 8, 2 * (lane & 3)], P[(lane >> 2) + 8, 2 * (lane & 3) + 1])
                for lane in range(32)
            ]
        )
        accL = [[[0.0] * 4 for _ in range(32)] for _ in range(8)]
        A = [[None] * 32 for _ in range(8)]
        nbyte = 128 * VB // 8
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            rows = [2 * tc, 2 * tc + 1, 2 * tc + 8, 2 * tc + 9]
            if VB == 4:
                for wi in range(2):
                    wa, wb, wc, wd = [w32(vbytes[r], 8 * gr + 4 * wi) for r in rows]
                    for hh in range(2):
                        u = prmt(wa, wb, 0x7632 if hh else 0x5410)
                        v = prmt(wc, wd, 0x7632 if hh else 0x5410)
                        for sub in range(2):
                            mt = 4 * wi + 2 * hh + sub
                            A[mt][lane] = [lo4(u), hi4(u), lo4(v), hi4(v)]
                            u >>= 8
                            v >>= 8
            else:
                wa, wb, wc, wd = [w32(vbytes[r], 4 * gr) for r in rows]
                for hh in range(2):
                    u = prmt(wa, wb, 0x7632 if hh else 0x5410)
                    v = prmt(wc, wd, 0x7632 if hh else 0x5410)
                    for sub in range(2):
                        beta = 2 * hh + sub
                        A[2 * beta][lane] = [c2(u, 0), c2(u, 1), c2(v, 0), c2(v, 1)]
                        A[2 * beta + 1][lane] = [c2(u, 2), c2(u, 3), c2(v, 2), c2(v, 3)]
                        u >>= 8
                        v >>= 8
        for mt in range(8):
            mma(accL[mt], A[mt], [[pb0[l], pb1[l]] for l in range(32)])
        got = np.zeros((8, 128))
        for mt in range(8):
            for lane in range(32):
                gr, tc = lane >> 2, lane & 3
                for x in range(4):
                    h = 2 * tc + (x & 1)
                    ch = 16 * gr + 2 * mt + (x >> 1)
                    got[h, ch] = accL[mt][lane][x]
        want = P.T @ (vcodes - (1 << (VB - 1)))
        assert np.abs(got - want).max() == 0, VB

    # ---- exact keys (int8) and values
    ecodes = rng.integers(0, 256, (16, 128))
    eb = ecodes.astype(np.uint8)
    acc = [[0.0] * 4 for _ in range(32)]
    for i in range(4):
        A1, A2, B1, B2 = [], [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            w0 = [w32(eb[gr], 32 * tc + 4 * x) for x in range(8)]
            w1 = [w32(eb[gr + 8], 32 * tc + 4 * x) for x in range(8)]
            A1.append(
                [
                    c8(w0[2 * i], w0[2 * i + 1], 0x0400),
                    c8(w1[2 * i], w1[2 * i + 1], 0x0400),
                    c8(w0[2 * i], w0[2 * i + 1], 0x0501),
                    c8(w1[2 * i], w1[2 * i + 1], 0x0501),
                ]
            )
            A2.append(
                [
                    c8(w0[2 * i], w0[2 * i + 1], 0x0602),
                    c8(w1[2 * i], w1[2 * i + 1], 0x0602),
                    c8(w0[2 * i], w0[2 * i + 1], 0x0703),
                    c8(w1[2 * i], w1[2 * i + 1], 0x0703),
                ]
            )
            B1.append(qf[lane][2 * i])
            B2.append(qf[lane][2 * i + 1])
        mma(acc, A1, B1)
        mma(acc, A2, B2)
    want = (ecodes - 128) @ q.T
    got = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        got[gr, 2 * tc], got[gr, 2 * tc + 1], got[gr + 8, 2 * tc], got[gr + 8, 2 * tc + 1] = acc[
            lane
        ]
    assert np.abs(got - want).max() == 0
    P = rng.random((16, 8)).astype(np.float16).astype(float)
    pb0 = movmatrix(
        [h2(P[lane >> 2, 2 * (lane & 3)], P[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(32)]
    )
    pb1 = movmatrix(
        [
            h2(P[(lane >> 2) + 8, 2 * (lane & 3)], P[(lane >> 2) + 8, 2 * (lane & 3) + 1])
            for lane in range(32)
        ]
    )
    accE = [[[0.0] * 4 for _ in range(32)] for _ in range(8)]
    for mt in range(8):
        Am = []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            ta, tb, tcc, td = [
                [w32(eb[r], 16 * gr + 4 * x) for x in range(4)]
                for r in (2 * tc, 2 * tc + 1, 2 * tc + 8, 2 * tc + 9)
            ]
            wi, by = mt >> 1, 2 * (mt & 1)
            s0, s1 = ((4 + by) << 8) | by, ((5 + by) << 8) | (by + 1)
            Am.append(
                [
                    c8(ta[wi], tb[wi], s0),
                    c8(ta[wi], tb[wi], s1),
                    c8(tcc[wi], td[wi], s0),
                    c8(tcc[wi], td[wi], s1),
                ]
            )
        mma(accE[mt], Am, [[pb0[l], pb1[l]] for l in range(32)])
    got = np.zeros((8, 128))
    for mt in range(8):
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            for x in range(4):
                got[2 * tc + (x & 1), 16 * gr + 2 * mt + (x >> 1)] = accE[mt][lane][x]
    assert np.abs(got - P.T @ (ecodes - 128)).max() == 0

    # ---- lift: O[d, h] = sum_r liftT[d, r] BL[h, r]
    liftT = rng.standard_normal((128, 128)).astype(np.float16)
    BL = rng.standard_normal((8, 128)).astype(np.float16)
    out = np.zeros((8, 128))
    for mtd in range(8):
        o = [[0.0] * 4 for _ in range(32)]
        for ks in range(8):
            A, B = [], []
            for lane in range(32):
                gr, tc = lane >> 2, lane & 3
                d0, r0 = 16 * mtd + gr, 16 * ks + 2 * tc
                f = lambda d, r: h2(liftT[d, r], liftT[d, r + 1])
                A.append([f(d0, r0), f(d0 + 8, r0), f(d0, r0 + 8), f(d0 + 8, r0 + 8)])
                B.append([h2(BL[gr, r0], BL[gr, r0 + 1]), h2(BL[gr, r0 + 8], BL[gr, r0 + 9])])
            mma(o, A, B)
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            for x in range(4):
                out[2 * tc + (x & 1), 16 * mtd + gr + 8 * (x >> 1)] = o[lane][x]
    want = BL.astype(float) @ liftT.astype(float).T
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-6


# ---------------------------------------------------------------------------------
# The kernel's walk over a cache, tile by tile (float64): its tile list and split
# share, the bytes its copies read (slot offsets, the key group's share stream,
# exact positions through the block tables), each warp's two softmax states, the
# CTA merge, the lift, the split merge.
# ---------------------------------------------------------------------------------


def f16(buf, off):
    return float(np.frombuffer(bytes(buf[off : off + 2]), dtype=np.float16)[0])


def kernel_walk(
    q,
    cache,
    table,
    exact,
    etable,
    lens,
    lift_t,
    vsum,
    layout,
    lay8,
    *,
    sink,
    recent,
    scale,
    splits,
    kv,
    qpk,
):
    """The kernel's tile list, copies (byte offsets) and algebra, in numpy (float64)."""
    kct, vbits = layout.k_channel_tokens, layout.v_bits
    VB = D * vbits // 8
    voff = 1 << (vbits - 1)
    cache = cache.numpy().reshape(cache.shape[0], cache.shape[2], -1)
    exact = exact.numpy().reshape(exact.shape[0], exact.shape[2], -1)
    page, epage = cache.shape[1], exact.shape[1]
    share, share_off, k_width = layout.k_share_bytes, layout.k_share_offset, sum(layout.k_ranks)
    qk = scale * 1.4426950408889634
    H = kv * qpk
    po = np.zeros((len(lens), splits, H * D))
    plse = np.full((len(lens), splits, H), -np.inf)
    for b, n in enumerate(lens):
        rec = recent + 1
        lat_end = n - rec
        n_lat = (lat_end - sink + kct - 1) // kct if lat_end > sink else 0
        tail = max(sink, lat_end)
        n_sink = min(sink, n)
        n_ex = n_sink + max(n - tail, 0)
        n_tiles = n_lat + (n_ex + EB - 1) // EB
        per = (n_tiles + splits - 1) // splits
        for s in range(splits):
            t_lo = min(s * per, n_tiles)
            t_hi = min(t_lo + per, n_tiles)
            for j in range(kv):
                qh = q[b, j * qpk : (j + 1) * qpk].astype(np.float64)  # [qpk, 128]
                states = []
                for w in range(NW):
                    mL = np.full(qpk, -np.inf)
                    lL = np.zeros(qpk)
                    zL = np.zeros(qpk)
                    aL = np.zeros((qpk, D))
                    mE = np.full(qpk, -np.inf)
                    lE = np.zeros(qpk)
                    zE = np.zeros(qpk)
                    aE = np.zeros((qpk, D))
                    t = t_lo + w
                    while t < t_hi:
                        if t < n_lat:
                            p0 = sink + t * kct
                            blk = int(table[b, p0 // page])
                            r0 = p0 % page
                            grp = cache[
                                blk, r0 : r0 + kct
                            ]  # the group's slots (rows past lat_end zeroed)
                            rows = np.arange(kct)
                            valid = p0 + rows < lat_end
                            grp = grp * valid[:, None]

                            # share: stream byte o in slot o // share at share_off + o % share
                            def stream(o):
                                return grp_full[
                                    o // share, share_off + o % share : share_off + o % share + 2
                                ]

                            grp_full = cache[blk, r0 : r0 + kct]
                            sc = np.array(
                                [
                                    np.frombuffer(bytes(stream(2 * (j * D + c))), np.float16)[0]
                                    for c in range(D)
                                ],
                                dtype=np.float64,
                            )
                            ze = np.array(
                                [
                                    np.frombuffer(
                                        bytes(stream(2 * (k_width + j * D + c))), np.float16
                                    )[0]
                                    for c in range(D)
                                ],
                                dtype=np.float64,
                            )
                            kb = grp[:, j * 64 : (j + 1) * 64].astype(np.int64)
                            codes = np.stack([kb & 15, kb >> 4], -1).reshape(kct, D)
                            s_ = (qh @ (((codes - 8) * sc + ze + 8 * sc)).T) * qk  # [qpk, kct]
                            s_ = np.where(valid[None], s_, -np.inf)
                            vsv = np.array(
                                [f16(grp[r], layout.v_scale_offset + 2 * j) for r in rows]
                            )
                            vzv = (
                                np.array([f16(grp[r], layout.v_zero_offset + 2 * j) for r in rows])
                                + voff * vsv
                            )
                            vbts = grp[
                                :,
                                layout.v_codes_offset
                                + j * VB : layout.v_codes_offset
                                + (j + 1) * VB,
                            ].astype(np.int64)
                            per_b = 8 // vbits
                            vc = (
                                np.stack(
                                    [
                                        (vbts >> (vbits * f)) & ((1 << vbits) - 1)
                                        for f in range(per_b)
                                    ],
                                    -1,
                                ).reshape(kct, D)
                                - voff
                            )
                            m_new = np.maximum(mL, s_.max(1))
                            mu = np.where(m_new == -np.inf, 0, m_new)
                            al = np.exp2(mL - mu)
                            mL = m_new
                            p = np.exp2(s_ - mu[:, None])
                            lL = lL * al + p.sum(1)
                            zL = zL * al + p @ vzv
                            aL = aL * al[:, None] + (p * vsv[None]) @ vc
                        else:
                            idx = (t - n_lat) * EB + np.arange(EB)
                            valid = idx < n_ex
                            pos = np.where(idx < n_sink, idx, tail + idx - n_sink)
                            rowsb = np.zeros((EB, exact.shape[2]), dtype=np.uint8)
                            for r in range(EB):
                                if valid[r]:
                                    rowsb[r] = exact[
                                        int(etable[b, pos[r] // epage]), pos[r] % epage
                                    ]
                            kc = rowsb[:, j * D : (j + 1) * D].astype(np.float64) - 128
                            vc = (
                                rowsb[
                                    :,
                                    lay8.v_codes_offset + j * D : lay8.v_codes_offset + (j + 1) * D,
                                ].astype(np.float64)
                                - 128
                            )
                            ks = np.array(
                                [f16(rowsb[r], lay8.k_scale_offset + 2 * j) for r in range(EB)]
                            )
                            kz = (
                                np.array(
                                    [f16(rowsb[r], lay8.k_zero_offset + 2 * j) for r in range(EB)]
                                )
                                + 128 * ks
                            )
                            vs = np.array(
                                [f16(rowsb[r], lay8.v_scale_offset + 2 * j) for r in range(EB)]
                            )
                            vz = (
                                np.array(
                                    [f16(rowsb[r], lay8.v_zero_offset + 2 * j) for r in range(EB)]
                                )
                                + 128 * vs
                            )
                            s_ = ((qh @ kc.T) * ks[None] + qh.sum(1)[:, None] * kz[None]) * qk
                            s_ = np.where(valid[None], s_, -np.inf)
                            m_new = np.maximum(mE, s_.max(1))
                            mu = np.where(m_new == -np.inf, 0, m_new)
                            al = np.exp2(mE - mu)
                            mE = m_new
                            p = np.exp2(s_ - mu[:, None])
                            lE = lE * al + p.sum(1)
                            zE = zE * al + p @ vz
                            aE = aE * al[:, None] + (p * vs[None]) @ vc
                        t += NW
                    states.append((mL, lL, zL, aL, mE, lE, zE, aE))
                M = np.max([np.maximum(st[0], st[4]) for st in states], 0)
                L = np.zeros(qpk)
                ZL = np.zeros(qpk)
                ZE = np.zeros(qpk)
                AL = np.zeros((qpk, D))
                AE = np.zeros((qpk, D))
                for mL, lL, zL, aL, mE, lE, zE, aE in states:
                    with np.errstate(invalid="ignore"):
                        al = np.where(M == -np.inf, 0, np.exp2(mL - M))
                        ae = np.where(M == -np.inf, 0, np.exp2(mE - M))
                    L += al * lL + ae * lE
                    ZL += al * zL
                    ZE += ae * zE
                    AL += al[:, None] * aL
                    AE += ae[:, None] * aE
                inv = np.where(L > 0, 1 / np.where(L > 0, L, 1), 0)
                o = (
                    (AE + ZE[:, None]) * inv[:, None]
                    + (ZL * inv)[:, None] * vsum[j][None]
                    + (AL * inv[:, None]) @ lift_t[j].T
                )
                for h in range(qpk):
                    po[b, s, (j * qpk + h) * D : (j * qpk + h + 1) * D] = o[h]
                    plse[b, s, j * qpk + h] = M[h] + np.log2(L[h]) if L[h] > 0 else -np.inf
    mx = plse.max(1, keepdims=True)
    mx = np.where(mx == -np.inf, 0, mx)
    wgt = np.exp2(plse - mx)  # [B, S, H]
    wcol = np.repeat(wgt, D, axis=2)
    den = wcol.sum(1)
    return (wcol * po).sum(1) / np.where(den > 0, den, 1)


@pytest.mark.parametrize(
    "lens,kct,page,lat_page,v_bits,qpk,sink,recent,splits",
    [
        ([1, 100, 193, 194, 257, 300, 0, 700], 64, 64, None, 2, 4, 64, 128, 3),
        ([70, 193, 450, 0, 777], 64, 64, 128, 4, 3, 64, 128, 2),
        ([1, 129, 130, 161, 500], 32, 64, None, 2, 3, 64, 64, 4),
        ([65, 66, 300], 32, 64, None, 4, 8, 0, 64, 1),
    ],
)
def test_the_kernels_tile_walk_reproduces_the_torch_path(
    lens, kct, page, lat_page, v_bits, qpk, sink, recent, splits
):
    from vllm_lowrank.kernels.cuda import ext

    kv = 4
    plan, layout, slot, cache, exact, tables, v_up, q = make_case(
        lens,
        kct=kct,
        page=page,
        v_bits=v_bits,
        qpk=qpk,
        sink=sink,
        recent=recent,
        kv_heads=kv,
        lat_page=lat_page,
    )
    lift_t, vsum = ext.post_rope_lift(plan, v_up)
    scale = D**-0.5
    got = kernel_walk(
        q.float().numpy(),
        cache,
        tables[0],
        exact,
        tables[1],
        lens,
        lift_t.float().numpy(),
        vsum.numpy(),
        layout,
        slot.int8_layout,
        sink=sink,
        recent=recent,
        scale=scale,
        splits=splits,
        kv=kv,
        qpk=qpk,
    )
    want = reference(
        plan,
        layout,
        slot,
        cache,
        exact,
        tables,
        v_up,
        q,
        lens,
        sink=sink,
        recent=recent,
        scale=scale,
    ).numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3  # the f16 lift
    for b, n in enumerate(lens):
        if n == 0:
            assert np.all(got[b] == 0)
