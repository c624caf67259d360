"""The register mappings of ``vllm_lowrank/kernels/cuda/post_rope_decode.cu``,
emulated lane by lane on the CPU: the bit tricks (``prmt``, ``lop3``, the f16
exponent ``0x6400``), the mma.sync m16n8k16 fragment layouts (PTX ISA) and
``movmatrix``, applied as the kernel applies them to one warp's tiles, must give
the plain products: key scores with the per-channel scales folded into the query
and the zeros as an mma bias, 2- and 4-bit value codes under the transposed
probabilities, int8 exact keys and values, and the lift. This checks the design
of the channel and token orders on a machine without a GPU; it mirrors the
kernel's code by hand (keep the two in step), and the kernel itself is tested on
a GPU (``tests/kernels/test_cuda_post_rope_decode.py``)."""

from __future__ import annotations

import numpy as np

def prmt(a, b, sel):
    bs = [(a >> (8*i)) & 0xFF for i in range(4)] + [(b >> (8*i)) & 0xFF for i in range(4)]
    return sum(bs[(sel >> (4*n)) & 7] << (8*n) for n in range(4))
def h2(lo, hi):  # float pair -> f16 bits word
    return int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16)
def unh2(w):
    return (float(np.uint16(w & 0xFFFF).view(np.float16)), float(np.uint16(w >> 16).view(np.float16)))
def or6400(x, mask): return (x & mask) | 0x64006400
def hsub(x, c): lo, hi = unh2(x); return h2(lo - c, hi - c)
def hfma(x, m, c): lo, hi = unh2(x); return h2(lo*m + c, hi*m + c)
def hmul(x, y): a, b = unh2(x); c, d = unh2(y); return h2(a*c, b*d)
def lo4(x): return hsub(or6400(x, 0x000F000F), 1032)
def hi4(x): return hfma(or6400(x, 0x00F000F0), 1/16, -72)
def c2(x, F):
    y = or6400(x, 0x00030003 << (2*F))
    return hsub(y, 1026) if F == 0 else hfma(y, 1/4**F, -(1024/4**F) - 2)
def c8(a, b, sel): return hsub(or6400(prmt(a, b, sel), 0x00FF00FF), 1152)
def w32(bts, off): return int(bts[off]) | int(bts[off+1]) << 8 | int(bts[off+2]) << 16 | int(bts[off+3]) << 24

def mma(C, A, B):
    """C [32 lanes][4] += A B with PTX m16n8k16 fragments: A[lane] 4 words, B[lane] 2 words."""
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        a = [unh2(w) for w in A[lane]]
        Am[gr, 2*tc:2*tc+2] = a[0]; Am[gr+8, 2*tc:2*tc+2] = a[1]
        Am[gr, 2*tc+8:2*tc+10] = a[2]; Am[gr+8, 2*tc+8:2*tc+10] = a[3]
        b = [unh2(w) for w in B[lane]]
        Bm[2*tc:2*tc+2, gr] = b[0]; Bm[2*tc+8:2*tc+10, gr] = b[1]
    D = Am @ Bm
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        C[lane][0] += D[gr, 2*tc]; C[lane][1] += D[gr, 2*tc+1]
        C[lane][2] += D[gr+8, 2*tc]; C[lane][3] += D[gr+8, 2*tc+1]
def movmatrix(words):  # words[lane]: row gr cols 2tc, 2tc+1 -> transposed
    M = np.zeros((8, 8), dtype=object)
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        lo, hi = words[lane] & 0xFFFF, words[lane] >> 16
        M[gr, 2*tc] = lo; M[gr, 2*tc+1] = hi
    out = []
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        out.append(int(M[2*tc, gr]) | int(M[2*tc+1, gr]) << 16)
    return out


def test_fragment_mappings_reproduce_the_products():
    rng = np.random.default_rng(0)
    QPK = 4
    q = (rng.standard_normal((8, 128)) * (np.arange(8) < QPK)[:, None]).astype(np.float16).astype(float)
    # ---- query fragments
    qf = [[[0, 0] for _ in range(8)] for _ in range(32)]
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        for i in range(4):
            c = 32*tc + 8*i
            hw = [h2(q[gr, c+2*x], q[gr, c+2*x+1]) for x in range(4)]
            qf[lane][2*i] = [prmt(hw[0], hw[2], 0x5410), prmt(hw[0], hw[2], 0x7632)]
            qf[lane][2*i+1] = [prmt(hw[1], hw[3], 0x5410), prmt(hw[1], hw[3], 0x7632)]

    # ---- key tile: 16 tokens, 4-bit codes per channel, per-channel scale/zero
    codes = rng.integers(0, 16, (16, 128))
    sc = (rng.random(128) * 0.5 + 0.01).astype(np.float16).astype(float)
    ze = (rng.standard_normal(128)).astype(np.float16).astype(float)
    kbytes = np.zeros((16, 64), dtype=np.uint8)
    for t in range(16):
        for b in range(64):
            kbytes[t, b] = codes[t, 2*b] | (codes[t, 2*b+1] << 4)
    shb = np.concatenate([sc.astype(np.float16).view(np.uint8), ze.astype(np.float16).view(np.uint8)])
    bias = [[0.0]*4 for _ in range(32)]
    qs = [[None]*8 for _ in range(32)]
    A_z = [[None]*4 for _ in range(32)]
    for s_ in range(8):
        Az, As, B = [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            i, e = s_ // 2, s_ % 2
            sw = [w32(shb, 64*tc + 16*i + 4*x) for x in range(4)]
            zw = [w32(shb, 256 + 64*tc + 16*i + 4*x) for x in range(4)]
            sp = [[prmt(sw[0], sw[2], 0x5410), prmt(sw[0], sw[2], 0x7632)], [prmt(sw[1], sw[3], 0x5410), prmt(sw[1], sw[3], 0x7632)]]
            zp = [[prmt(zw[0], zw[2], 0x5410), prmt(zw[0], zw[2], 0x7632)], [prmt(zw[1], zw[3], 0x5410), prmt(zw[1], zw[3], 0x7632)]]
            qs[lane][s_] = [hmul(qf[lane][s_][0], sp[e][0]), hmul(qf[lane][s_][1], sp[e][1])]
            Az.append([zp[e][0], zp[e][0], zp[e][1], zp[e][1]])
            s8a, s8b = hmul(sp[e][0], 0x48004800), hmul(sp[e][1], 0x48004800)
            As.append([s8a, s8a, s8b, s8b]); B.append(qf[lane][s_])
        mma(bias, Az, B); mma(bias, As, B)
    acc = [list(x) for x in bias]
    for i in range(4):
        A1, A2, B1, B2 = [], [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            x0 = w32(kbytes[gr], 16*tc + 4*i); x1 = w32(kbytes[gr+8], 16*tc + 4*i)
            A1.append([lo4(x0), lo4(x1), hi4(x0), hi4(x1)]); B1.append(qs[lane][2*i])
            x0 >>= 8; x1 >>= 8
            A2.append([lo4(x0), lo4(x1), hi4(x0), hi4(x1)]); B2.append(qs[lane][2*i+1])
        mma(acc, A1, B1); mma(acc, A2, B2)
    keys = codes * sc + ze
    want = keys @ q.T   # [16 tokens, 8 heads]
    got = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        got[gr, 2*tc], got[gr, 2*tc+1], got[gr+8, 2*tc], got[gr+8, 2*tc+1] = acc[lane]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-3  # q * scale in f16

    # ---- value tile: P [16 tokens x 8 heads] * vs, codes V bits, acc [128 ch x 8]
    for VB in (2, 4):
        vcodes = rng.integers(0, 1 << VB, (16, 128))
        per = 8 // VB
        vbytes = np.zeros((16, 128 // per), dtype=np.uint8)
        for t in range(16):
            for b in range(128 // per):
                vbytes[t, b] = sum(int(vcodes[t, per*b + f]) << (VB*f) for f in range(per))
        P = rng.random((16, 8)).astype(np.float16).astype(float)
        pb0 = movmatrix([h2(P[lane >> 2, 2*(lane & 3)], P[lane >> 2, 2*(lane & 3)+1]) for lane in range(32)])
        pb1 = movmatrix([h2(P[(lane >> 2)+8, 2*(lane & 3)], P[(lane >> 2)+8, 2*(lane & 3)+1]) for lane in range(32)])
        accL = [[[0.0]*4 for _ in range(32)] for _ in range(8)]
        A = [[None]*32 for _ in range(8)]
        nbyte = 128 * VB // 8
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            rows = [2*tc, 2*tc+1, 2*tc+8, 2*tc+9]
            if VB == 4:
                for wi in range(2):
                    wa, wb, wc, wd = [w32(vbytes[r], 8*gr + 4*wi) for r in rows]
                    for hh in range(2):
                        u = prmt(wa, wb, 0x7632 if hh else 0x5410); v = prmt(wc, wd, 0x7632 if hh else 0x5410)
                        for sub in range(2):
                            mt = 4*wi + 2*hh + sub
                            A[mt][lane] = [lo4(u), hi4(u), lo4(v), hi4(v)]
                            u >>= 8; v >>= 8
            else:
                wa, wb, wc, wd = [w32(vbytes[r], 4*gr) for r in rows]
                for hh in range(2):
                    u = prmt(wa, wb, 0x7632 if hh else 0x5410); v = prmt(wc, wd, 0x7632 if hh else 0x5410)
                    for sub in range(2):
                        beta = 2*hh + sub
                        A[2*beta][lane] = [c2(u, 0), c2(u, 1), c2(v, 0), c2(v, 1)]
                        A[2*beta+1][lane] = [c2(u, 2), c2(u, 3), c2(v, 2), c2(v, 3)]
                        u >>= 8; v >>= 8
        for mt in range(8):
            mma(accL[mt], A[mt], [[pb0[l], pb1[l]] for l in range(32)])
        got = np.zeros((8, 128))
        for mt in range(8):
            for lane in range(32):
                gr, tc = lane >> 2, lane & 3
                for x in range(4):
                    h = 2*tc + (x & 1); ch = 16*gr + 2*mt + (x >> 1)
                    got[h, ch] = accL[mt][lane][x]
        want = P.T @ (vcodes - (1 << (VB - 1)))
        assert np.abs(got - want).max() == 0, VB

    # ---- exact keys (int8) and values
    ecodes = rng.integers(0, 256, (16, 128))
    eb = ecodes.astype(np.uint8)
    acc = [[0.0]*4 for _ in range(32)]
    for i in range(4):
        A1, A2, B1, B2 = [], [], [], []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            w0 = [w32(eb[gr], 32*tc + 4*x) for x in range(8)]; w1 = [w32(eb[gr+8], 32*tc + 4*x) for x in range(8)]
            A1.append([c8(w0[2*i], w0[2*i+1], 0x0400), c8(w1[2*i], w1[2*i+1], 0x0400), c8(w0[2*i], w0[2*i+1], 0x0501), c8(w1[2*i], w1[2*i+1], 0x0501)])
            A2.append([c8(w0[2*i], w0[2*i+1], 0x0602), c8(w1[2*i], w1[2*i+1], 0x0602), c8(w0[2*i], w0[2*i+1], 0x0703), c8(w1[2*i], w1[2*i+1], 0x0703)])
            B1.append(qf[lane][2*i]); B2.append(qf[lane][2*i+1])
        mma(acc, A1, B1); mma(acc, A2, B2)
    want = (ecodes - 128) @ q.T
    got = np.zeros((16, 8))
    for lane in range(32):
        gr, tc = lane >> 2, lane & 3
        got[gr, 2*tc], got[gr, 2*tc+1], got[gr+8, 2*tc], got[gr+8, 2*tc+1] = acc[lane]
    assert np.abs(got - want).max() == 0
    P = rng.random((16, 8)).astype(np.float16).astype(float)
    pb0 = movmatrix([h2(P[lane >> 2, 2*(lane & 3)], P[lane >> 2, 2*(lane & 3)+1]) for lane in range(32)])
    pb1 = movmatrix([h2(P[(lane >> 2)+8, 2*(lane & 3)], P[(lane >> 2)+8, 2*(lane & 3)+1]) for lane in range(32)])
    accE = [[[0.0]*4 for _ in range(32)] for _ in range(8)]
    for mt in range(8):
        Am = []
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            ta, tb, tcc, td = [[w32(eb[r], 16*gr + 4*x) for x in range(4)] for r in (2*tc, 2*tc+1, 2*tc+8, 2*tc+9)]
            wi, by = mt >> 1, 2*(mt & 1)
            s0, s1 = ((4+by) << 8) | by, ((5+by) << 8) | (by+1)
            Am.append([c8(ta[wi], tb[wi], s0), c8(ta[wi], tb[wi], s1), c8(tcc[wi], td[wi], s0), c8(tcc[wi], td[wi], s1)])
        mma(accE[mt], Am, [[pb0[l], pb1[l]] for l in range(32)])
    got = np.zeros((8, 128))
    for mt in range(8):
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            for x in range(4):
                got[2*tc + (x & 1), 16*gr + 2*mt + (x >> 1)] = accE[mt][lane][x]
    assert np.abs(got - P.T @ (ecodes - 128)).max() == 0

    # ---- lift: O[d, h] = sum_r liftT[d, r] BL[h, r]
    liftT = rng.standard_normal((128, 128)).astype(np.float16)
    BL = rng.standard_normal((8, 128)).astype(np.float16)
    out = np.zeros((8, 128))
    for mtd in range(8):
        o = [[0.0]*4 for _ in range(32)]
        for ks in range(8):
            A, B = [], []
            for lane in range(32):
                gr, tc = lane >> 2, lane & 3
                d0, r0 = 16*mtd + gr, 16*ks + 2*tc
                f = lambda d, r: h2(liftT[d, r], liftT[d, r+1])
                A.append([f(d0, r0), f(d0+8, r0), f(d0, r0+8), f(d0+8, r0+8)])
                B.append([h2(BL[gr, r0], BL[gr, r0+1]), h2(BL[gr, r0+8], BL[gr, r0+9])])
            mma(o, A, B)
        for lane in range(32):
            gr, tc = lane >> 2, lane & 3
            for x in range(4):
                out[2*tc + (x & 1), 16*mtd + gr + 8*(x >> 1)] = o[lane][x]
    want = BL.astype(float) @ liftT.astype(float).T
    assert np.abs(out - want).max() / np.abs(want).max() < 1e-6
