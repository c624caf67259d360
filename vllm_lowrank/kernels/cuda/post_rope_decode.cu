// Token-adaptive decode of post-RoPE 4-bit key codes and value latents, on mma.sync.
//
// The PostRopeKeysCudaDecoder of vllm_lowrank/attention/decoders.py: the same math
// as the Triton kernel vllm_lowrank/kernels/triton/decode_post_rope.py with one
// query token per sequence (QT = 1), for the `4x` preset's layers:
//   - keys cached after RoPE at full width (head_dim 128), 4-bit codes quantized per
//     channel over aligned groups of KCT in {32, 64} positions (KIVI, Liu et al.
//     2024, sec. 3.2): the group's float16 scales and zeros ("share" bytes) spread
//     over its KCT slots (vllm_lowrank/format/latent.py, SlotLayout);
//   - values: one KV head per head group (G = 1), RV latent codes per token and head
//     at V_BITS in {2, 4} with one float16 scale/zero per token and head (Palu
//     sec. 3.4), lifted after the softmax by the KV head's [RV, D] lift: RV = 128 (full
//     rank), 64, or 96 at 4 bits (a row's RV * V_BITS / 8 code bytes whole 16-byte
//     chunks). Lanes of row group gr hold 16 value channels each, so below RV = 128 the
//     lanes gr >= RV / 16 multiply codes whose results are dropped: a value rank under
//     128 reads fewer bytes at the value mma count of full rank, so it is never slower;
//   - exact sink and recent tokens int8 per token and head (ExactSlot, bits 8);
//   - at most 8 query heads per KV head, bf16 or fp16 queries.
// Per sequence b (n = seq_len tokens, this step's included), KV head j, query head h:
//
//   latent span L = [S, n - W'),  exact set E = [0, min(S, n)) U [max(S, n - W'), n)
//   (S sinks, W' = recent window + 1, passed as `recent`)
//   s_t   = scale * q_h . k_t          k_t from codes (t in L) or int8 (t in E)
//   p_t   = softmax over L U E (one online softmax per set, merged by their max)
//   o_h   = (sum_{t in L} p_t c_v,t) lift_j + sum_{t in E} p_t v_t
//
// Work decomposition. Grid (split, KV head, sequence), 4 warps per CTA. The tile
// list of a (sequence, KV head) is its latent key groups (KCT positions each, the
// first at S: S is a whole number of blocks and KCT divides the block) then its
// exact set in tiles of EB = 32 positions; split s takes an even share of the list
// (as the Triton kernel), warp w of the CTA takes tiles w, w + 4, ... of it with
// its own softmax states (one for the latent span, one for the exact set) and its
// own 2-stage cp.async pipeline (no CTA barrier in the loop). A tile's copies give
// each row's 16-byte chunks to consecutive lanes of one instruction (a latent row's
// key codes, value codes and value scale/zero chunks: 8 lanes at V_BITS 2; an exact
// row's codes: 16 lanes, its parameters: 4, row addresses shuffled from the lane that
// looked the row up), so L2 sees one request per row and section rather than one per
// 16 bytes: at 16 x 32k that cut L2 tag requests (69 % of peak, the busiest unit) and
// made the kernel 1.21x faster (H200, benchmarks/README.md). A latent row's copies
// carry the .L2::128B hint: a CTA reads one KV head's 64 + 32 bytes of each 864-byte
// slot (`4x`), and L2 then fetches whole lines, which the CTAs of the neighbouring
// heads read soon after: 1.16x faster at 16 x 32k (217 -> 187 us, 50 -> 58 % of the
// copy rate; H200, benchmarks/README.md). The 8 states are
// merged at the end through shared memory, the latent accumulator is lifted with
// 16 mma per warp, and the split's normalised output (or, with several splits, its
// partial and base-2 log-sum-exp for tiles.reduce_splits_kernel) is stored.
// The host picks the split count with launch.choose_num_splits' wave model, one
// CTA step being 4 warps x KCT tokens and Cfg::CTAS CTAs resident per SM:
// PostRopeKeysCudaDecoder.plan. With 2 CTAs (2 warps per scheduler) the kernel was
// latency-bound: at 128 x 2k ncu counted issue active 42 % of cycles, stalls mostly
// on fixed-latency dependencies (19 %), scoreboards (long 14 %, short 11 %) and the
// MIO queue (10 %). So where 3 CTAs' shared memory fits an SM (the `4x` layout: 72 KB
// each, the exact tiles' parameters copied as 4-byte words) the launch bounds ask for
// 3, which caps registers at 168; the exact tiles run in a loop after the latent
// ones, their accumulator live only there, so that the cap costs no spills.
//
// Per latent tile (one key group, KCT rows), per warp, on mma.sync.m16n8k16 (f16
// operands, f32 accumulators; the layouts in mma_common.cuh):
//   1. keys: A = codes [16 tokens x 16 channels], B = the KV head's query heads
//      (n = 8, padded with zero heads). Lane (gr, tc) reads 16 code bytes of rows gr
//      and gr + 8 (channels 32tc .. 32tc + 31); a 32-bit word w of them (channels
//      c .. c + 7, two per byte) gives the f16 pairs {c, c+4}, {c+1, c+5} (w) and
//      {c+2, c+6}, {c+3, c+7} (w >> 8) through the exponent: (w & 0x000F000F) |
//      0x64006400 is the pair 1024 + code (one lop3), less 1024 = the code (one
//      HSUB2); the high nibbles, (w & 0x00F000F0) | 0x54005400 = 64 + code, by the
//      lop3 alone (lo4, hi4). No conversion instruction, nothing unpacked into
//      channel order: the query pairs are permuted the same way, once per CTA.
//   2. per-channel scales folded into the query once per tile: q'_c = q_c scale_c
//      (16 HMUL2 per lane), and the zeros and the high nibbles' base as a per-head
//      bias, bias_h = sum_c q_c zero_c - 64 sum_{c high} q'_c, computed by 16 mma
//      whose A rows are all the zeros (resp. all -64) - exact products, fp32 sums -
//      in two chains independent of the scores', added to them after their mma:
//          s_{h,t} = scale * (q'_h . a_t + bias_h),  a_t = code_t (+ 64, high nibbles)
//   3. online softmax per head column over the KCT rows (max by 3 shuffles; row
//      sums and value-zero sums kept per lane, reduced once at the end).
//   4. values: O^T[RV x 8] += C_v^T [RV x 16 tokens] (P * scale_t) [16 tokens x 8],
//      the probability tile transposed into the B layout by movmatrix, value codes
//      as A through the same exponent trick (pairs of two tokens, byte-permuted by
//      one prmt; fields at bit 4 and up keep their base 64 or 16), the zero term
//      carried as sum_t p_t (zero_t + 2^(b-1) scale_t) and added with the lift's
//      column sums (the Triton kernel's algebra); the codes' centre 2^(b-1) and bases
//      leave once per CTA as (base + 2^(b-1)) S, S = sum_t P_t scale_t summed by one
//      more mma per 16 tokens (A all ones) from the f16 operand the values used, so
//      its rounding cancels (accL[8]).
// Exact tiles: int8 keys as A (the same channel order as the key codes; prmt + lop3 +
// HSUB2 per pair), s = scale * (k_scale_t q . (code - 128) + (k_zero_t + 128 k_scale_t)
// sum(q)); int8 values as A into an output-space accumulator with their per-token
// scales on P (decode_exact.py's algebra).
//
// Roofline (Llama-3-8B attention: 32 query / 8 KV heads of 128, bf16 queries; the
// `4x` preset: KCT 64, V_BITS 2, 8 KV heads, slot 864 B): a latent token reads per
// layer 512 B of key codes, 64 B of key scales/zeros (4 * 1024 / 64), 256 B of value
// codes, 32 B of value scales/zeros = 864 B (4.7x fewer than bf16's 4,096 B; at
// V_BITS 4 or KCT 32: 1,120 B / 928 B; the 64 sink + 129 recent exact tokens add
// 2,080 B each: int8 keys and values and their scales, amortised over the context).
// At the H200's 4.25 TB/s copy rate that is 0.20 ns per token and layer (16 x 32k: 107 us per layer). FLOPs per token and KV head: 2 * 128 * 8
// (scores, n padded to 8) + 2 * 128 * 8 (values) = 4.1 kFLOP, 33 kFLOP per token and
// layer: 38 FLOP/byte, far under the ridge (about 200 FLOP/byte for dense f16
// mma.sync): memory-bound. Instruction budget (benchmarks/README.md, "What reaches
// the bound"): an H200 issues about 1.05e12 warp instructions/s; 0.20 ns per token
// and layer is 213 warp instructions, 26.6 per token and KV head, for issue to keep
// up with 100 % of the copy rate at a perfect issue rate (53 at the 50 % target).
// The Triton kernel issues about 50. This kernel, at the `4x` layout, 16 x 32k (ncu,
// smsp__inst_executed over tokens x KV heads): 19.7 per token and KV head with every
// code centred by an HSUB2/HFMA2, 17.9 with the bases of the fields at bit 4 and up
// left in (the coalesced copies add about 1 by the SASS). Per latent key group and
// warp that is 84 HMMA (16 bias, 32 scores, 32 values, 4 probability sums).
// Unpacking per 16-token x 128-channel key sub-tile, by construction: 2 LDS.128 +
// 8 x (SHF + 4 LOP3 + 2 HADD2) + 8 HMMA; values (V_BITS 2) per 16 tokens: 4 LDS.32 +
// 2 PRMT + 2 SHF + 16 LOP3 + 8 HADD2 + 9 HMMA.
// Measured (H200, benchmarks/README.md, "Decode without a key rebuild"): 58 % of the
// copy rate at 16 x 32k, 45 % at 128 x 2k; issue is not the bound (see above).
//
// Precision: key codes, query and probabilities as f16 (the query's bf16 -> f16
// conversion is exact in f16's normal range), q' = q * scale rounded to f16,
// scores, softmax state and accumulators fp32; the normalised latent accumulator
// is rounded to f16 before the lift (fp32 sums). |q * scale_c| and the lift must
// stay below 65504. A base left in a code is taken out of an fp32 tensor-core sum,
// which keeps about 21 bits of its largest term: at base 64 that costs about 2^-15
// of the result; bases 1024 and 256 (fields at bits 0 and 2) made split counts
// disagree by 2e-4 (tests/kernels/test_cuda_post_rope_decode.py bounds it by 1e-4),
// so those lose their base in f16, exactly, by one HSUB2.
//
// No torch here (the binding is post_rope_decode.cpp). Registers, spills and SASS:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math -cubin -Xptxas -v \
//        vllm_lowrank/kernels/cuda/post_rope_decode.cu
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mma_common.cuh"
#include "post_rope_decode.h"

namespace prk_decode {
using namespace lowrank_mma;

template <int KCT, int VBITS, int RV>
struct Cfg {
  static constexpr int NM = KCT / 16;                // m16 sub-tiles of a key group
  static constexpr int VB = RV * VBITS / 8;          // value code bytes per token and head
  static constexpr int VG = RV / 16;                 // row groups gr holding value channels
  // a latent row's 16-byte chunks (key codes, value codes, value scale, value zero) and
  // the lanes one copy instruction gives a row (NC rounded up to 8 or 16)
  static constexpr int NC = 4 + VB / 16 + 2;
  static constexpr int NCP = NC <= 8 ? 8 : 16;
  static constexpr int RPI = 32 / NCP;               // rows per copy instruction
  // latent stage: [KCT][64] key codes | [KCT][VB] value codes, VPAD bytes of padding
  // after every VROWS rows | [KCT][32] value scale chunk, value zero chunk | [512] the
  // group's scales then zeros of this head. The padding spreads the rows 2tc (resp.
  // 2tc + 1, 2tc + 8, 2tc + 9) that one value-code load reads (lanes gr < VG: 2 VBITS
  // bytes each from the row's start) over the 128-byte bank window in the fewest
  // wavefronts their bytes allow: 32 bytes at VB 32 and 64; none at VB 16 and 48,
  // whose rows alone spread (with 32, the rows of tc 0 and 3 at VB 16, of every tc at
  // VB 48, start in one bank: rank 96 at 4 bits ran 2 % slower than rank 128).
  static constexpr int VROWS = RPI;
  static constexpr int VPAD = VB == 16 || VB == 48 ? 0 : 32;
  static constexpr int L_V = KCT * 64;
  static constexpr int L_VS = L_V + KCT * VB + (KCT / VROWS) * VPAD;
  __host__ __device__ static constexpr int vrow(int r) { return r * VB + (r / VROWS) * VPAD; }
  static constexpr int L_SH = L_VS + KCT * 32;
  static constexpr int LAT_STAGE = L_SH + 512;
  // exact stage: [32][128] key codes | [32][128] value codes | [32][16] the 4-byte words
  // holding the key scale, key zero, value scale, value zero of this head
  static constexpr int E_V = kEB * 128;
  static constexpr int E_P = 2 * kEB * 128;
  static constexpr int EX_STAGE = E_P + kEB * 16;
  static constexpr int STAGE = LAT_STAGE > EX_STAGE ? LAT_STAGE : EX_STAGE;
  static constexpr int PIPE = kNW * kStages * STAGE;
  // epilogue: per warp 6 x 8 stats + two [8][128] accumulators (f32); then the merged
  // latent accumulator [8][136] f16, the output base [8][128] f32, M and L [8] each
  static constexpr int WARP_F = 48 + 2 * kMaxQ * kD;
  static constexpr int M_BL = kNW * WARP_F * 4;
  static constexpr int BL_PITCH = kD + 8;
  static constexpr int M_OB = M_BL + kMaxQ * BL_PITCH * 2;
  static constexpr int M_ST = M_OB + kMaxQ * kD * 4;
  static constexpr int MERGE = M_ST + 2 * kMaxQ * 4;
  static constexpr int SMEM = PIPE > MERGE ? PIPE : MERGE;
  // CTAs resident per SM: 3 where their shared memory fits beside each other (228 KB
  // per SM, 1 KB of it reserved per CTA), registers then capped at 168 per thread
  static constexpr int CTAS = 3 * (SMEM + 1024) <= 228 * 1024 ? 3 : 2;
  static_assert(KCT == 32 || KCT == 64, "key groups of 32 or 64 positions");
  static_assert(VBITS == 2 || VBITS == 4, "2- or 4-bit values");
  static_assert(RV % 16 == 0 && RV >= 64 && RV <= kD && VB % 16 == 0,
                "value ranks of 64 to 128 whose code rows are whole 16-byte chunks");
  static_assert(STAGE % 128 == 0, "stage alignment");
  static_assert(RPI == VROWS, "a copy step of RPI rows is a whole padding group");
  static_assert(SMEM <= 113 * 1024, "two CTAs per SM");
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}
// (x & MASK) | BASE: a bit field of the two 16-bit halves of x placed in the mantissa of
// the f16 pairs BASE (one lop3).
template <uint32_t MASK, uint32_t BASE>
__device__ __forceinline__ uint32_t put_field(uint32_t x) {
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(y) : "r"(x), "n"(MASK), "n"(BASE));
  return y;
}
__device__ __forceinline__ uint32_t hsub2c(uint32_t x, float c) {   // x - c (both halves)
  return h2_bits(__hsub2(bits_h2(x), __float2half2_rn(c)));
}
__device__ __forceinline__ uint32_t hmul2(uint32_t x, uint32_t y) {
  return h2_bits(__hmul2(bits_h2(x), bits_h2(y)));
}
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  return h2_bits(__floats2half2_rn(lo, hi));
}
// Codes as f16 pairs: a b-bit field at bit s of each 16-bit half, put into the mantissa
// of an f16 whose unit in the last place is 2^-s (one lop3), reads 2^(10 - s) + code
// exactly. Fields at s >= 4 are used so, "biased": their base (64 or 16) is taken out
// once per tile (keys: an mma of the query against the bases; values: the
// probability sum times the base). Fields at s < 4 (bases 1024, 256) lose the base by
// one HSUB2 instead: taken out of fp32 sums it would cost about 2^-11 of the result
// (tensor-core fp32 accumulation keeps about 21 bits); 64 costs about 2^-15.
//   4-bit codes (channel 2k in the low nibble of byte k, bytes 0 and 2 of x):
//   lo4 = low nibble, hi4 = 64 + high nibble.
__device__ __forceinline__ uint32_t lo4(uint32_t x) {
  return hsub2c(put_field<0x000F000Fu, 0x64006400u>(x), 1024.f);
}
__device__ __forceinline__ uint32_t hi4(uint32_t x) { return put_field<0x00F000F0u, 0x54005400u>(x); }
constexpr uint32_t kNegHiBase4 = 0xD400D400u;   // {-64, -64}
//   2-bit field F (bits 2F, 2F + 1 of bytes 0 and 2): code (F = 0, 1), 2^(10 - 2F) + code
//   (F = 2, 3: bases 64, 16).
template <int F>
__device__ __forceinline__ uint32_t c2(uint32_t x) {
  const uint32_t y = put_field<(0x00030003u << (2 * F)), (0x64006400u - 0x08000800u * F)>(x);
  return F < 2 ? hsub2c(y, float(1024 >> (2 * F))) : y;
}
// The base left in accumulator row group f of the values (f = 2 (mt & 1) + (x >> 1) for
// 2-bit codes, 2 (x >> 1) for 4-bit: rows gr + 8 hold the high nibbles).
__device__ __forceinline__ constexpr float value_base(int f) { return f >= 2 ? float(1024 >> (2 * f)) : 0.f; }
// Centred int8 codes (byte selected into bytes 0 and 2 by `sel` from a, b), offset 128.
__device__ __forceinline__ uint32_t c8(uint32_t a, uint32_t b, uint32_t sel) {
  return hsub2c(put_field<0x00FF00FFu, 0x64006400u>(prmt(a, b, sel)), 1152.f);
}
__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}
__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// bf16 pair -> f16 pair (exact in f16's normal range).
__device__ __forceinline__ uint32_t bf2_to_h2(uint32_t x) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  return pack_h2(f.x, f.y);
}

// One online-softmax step of a warp's state for heads 2tc + e (e = 0, 1) over the
// scores sc of NM m16 row tiles (base 2, -inf where masked): the new running maxima
// m (column maxima over the 8 row lanes by 3 shuffles), mu the maxima the tile's
// probabilities are taken against (0 for a column with nothing seen yet), and the
// sums l, z and the accumulator rescaled by alpha = 2^(m_old - mu).
template <int NM, int NA>
__device__ __forceinline__ void online_softmax_step(const float (&sc)[NM][4], float (&m)[2],
                                                    float (&l)[2], float (&z)[2],
                                                    float (&acc)[NA][4], float (&mu)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int r = 0; r < NM; ++r)
#pragma unroll
    for (int x = 0; x < 4; ++x) mx[x & 1] = fmaxf(mx[x & 1], sc[r][x]);
  float alpha[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 4));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 8));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 16));
    const float m_new = fmaxf(m[e], mx[e]);
    mu[e] = m_new == -INFINITY ? 0.f : m_new;
    alpha[e] = exp2f(m[e] - mu[e]);
    m[e] = m_new;
    l[e] *= alpha[e];
    z[e] *= alpha[e];
  }
#pragma unroll
  for (int mt = 0; mt < NA; ++mt) {
    acc[mt][0] *= alpha[0]; acc[mt][1] *= alpha[1];
    acc[mt][2] *= alpha[0]; acc[mt][3] *= alpha[1];
  }
}

template <int KCT, int VBITS, int RV>
__global__ void __launch_bounds__(kNW * 32, Cfg<KCT, VBITS, RV>::CTAS) post_rope_decode_kernel(const Params p) {
  using C = Cfg<KCT, VBITS, RV>;
  constexpr int NM = C::NM, VB = C::VB;
  constexpr float VOFF = float(1 << (VBITS - 1));   // the value codes' centre
  extern __shared__ __align__(128) uint8_t smem[];

  const int split = blockIdx.x, j = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, tc = lane & 3;
  const int n = p.seq_lens[b];

  // ---- the tile list (decode_post_rope.py's, QT = 1) and this split's share
  const int lat_end = n - p.recent;                  // latent span [sink, lat_end)
  const int n_lat = lat_end > p.sink ? (lat_end - p.sink + KCT - 1) / KCT : 0;
  const int tail = max(p.sink, lat_end);             // exact tail [tail, n)
  const int n_sink = min(p.sink, n);
  const int n_ex = n_sink + max(n - tail, 0);
  const int n_tiles = n_lat + (n_ex + kEB - 1) / kEB;
  const int per = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t_lo = min(split * per, n_tiles);
  const int t_hi = min(t_lo + per, n_tiles);
  const int my_tiles = t_lo + warp < t_hi ? (t_hi - t_lo - warp + kNW - 1) / kNW : 0;

  // ---- query pairs of head gr (zero past qpk), channels 32tc .. 32tc + 31, in the key
  // codes' order: k-step s = 2i + e takes piece i (channels c = 32tc + 8i ..):
  // qf[s][0] = {c + 2e, c + 2e + 4}, qf[s][1] = {c + 2e + 1, c + 2e + 5}
  uint32_t qf[8][2];
  float qsum0, qsum1;   // sum_c q_c of heads 2tc, 2tc + 1 (the int8 keys' zero term)
  {
    const bool hv = gr < p.qpk;
    const int head = j * p.qpk + (hv ? gr : 0);
    const uint8_t* qp = reinterpret_cast<const uint8_t*>(p.query) +
                        ((int64_t)b * p.s_qb + (int64_t)head * p.s_qh) * 2 + 64 * tc;
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 v = hv ? __ldg(reinterpret_cast<const uint4*>(qp + 16 * i)) : make_uint4(0, 0, 0, 0);
      uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        if (p.q_bf16) h[x] = bf2_to_h2(h[x]);
        const float2 f = __half22float2(bits_h2(h[x]));
        part += f.x + f.y;
      }
      qf[2 * i][0] = prmt(h[0], h[2], 0x5410);
      qf[2 * i][1] = prmt(h[0], h[2], 0x7632);
      qf[2 * i + 1][0] = prmt(h[1], h[3], 0x5410);
      qf[2 * i + 1][1] = prmt(h[1], h[3], 0x7632);
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);   // head gr's sum, in its 4 lanes
    qsum0 = __shfl_sync(0xffffffffu, part, 8 * tc);       // head 2tc: lane 4 * 2tc
    qsum1 = __shfl_sync(0xffffffffu, part, 8 * tc + 4);   // head 2tc + 1
  }

  // ---- loop-invariant byte offsets
  // this lane's 16-byte chunk of the group's parameter stream [scales (Rk) | zeros (Rk)]
  // float16: lanes 0-15 the scales of channels 128j + 8 lane .., lanes 16-31 the
  // zeros; stream byte o lives in slot o / share at share_off + o % share (share is
  // a multiple of 16: a chunk never straddles two slots)
  const int o_sh = lane < 16 ? 2 * (j * kD) + 16 * lane : 2 * (p.k_width + j * kD) + 16 * (lane - 16);
  const int64_t sh_src = (int64_t)(o_sh / p.share) * p.s_tok + p.share_off + o_sh % p.share;
  const int vs_at = p.v_scale_off + 2 * j, vz_at = p.v_zero_off + 2 * j;
  const int ek_at = p.ex_kscale_off + 2 * j, ekz_at = p.ex_kzero_off + 2 * j;
  const int evs_at = p.ex_vscale_off + 2 * j, evz_at = p.ex_vzero_off + 2 * j;

  uint8_t* my_pipe = smem + warp * kStages * C::STAGE;
  // this lane's value-code bytes: channels 16 gr .. 16 gr + 15 (row group 0's where gr
  // holds none: results dropped, see the top)
  const int v_lane = C::vrow(2 * tc) + (gr < C::VG ? gr : 0) * (2 * VBITS);
  // this lane's latent copies: chunk cp_chunk of rows cp_row + RPI i, from byte cp_src of
  // the row to cp_dst + i cp_step of the stage. A row's chunks go to consecutive lanes
  // of one instruction, so its key codes are one L2 request, not one per 16 bytes.
  const int cp_chunk = lane % C::NCP, cp_row = lane / C::NCP;
  int cp_src, cp_dst, cp_step;
  if (cp_chunk < 4) {
    cp_src = j * 64 + 16 * cp_chunk;
    cp_dst = cp_row * 64 + 16 * cp_chunk;
    cp_step = C::RPI * 64;
  } else if (cp_chunk < C::NC - 2) {   // vrow(cp_row + RPI i) = vrow(cp_row) + i vrow(RPI)
    cp_src = p.v_codes_off + j * VB + 16 * (cp_chunk - 4);
    cp_dst = C::L_V + C::vrow(cp_row) + 16 * (cp_chunk - 4);
    cp_step = C::vrow(C::RPI);
  } else {
    const bool zero = cp_chunk == C::NC - 1;
    cp_src = (zero ? vz_at : vs_at) & ~15;
    cp_dst = C::L_VS + cp_row * 32 + (zero ? 16 : 0);
    cp_step = C::RPI * 32;
  }
  // this lane's exact copies: chunk lane % 16 of a row's key codes (0-7) and value codes
  // (8-15); parameter chunk lane % 4 (key scale, key zero, value scale, value zero)
  const int ex_c = lane & 15;
  const int ex_src = ex_c < 8 ? j * kD + 16 * ex_c : p.ex_vcodes_off + j * kD + 16 * (ex_c - 8);
  const int ex_dst = ex_c < 8 ? 16 * ex_c : C::E_V + 16 * (ex_c - 8);
  const int ep_at = (lane & 3) == 0 ? ek_at : (lane & 3) == 1 ? ekz_at : (lane & 3) == 2 ? evs_at : evz_at;
  const int ep_src = ep_at & ~3;
  auto tile_of = [&](int k) { return t_lo + warp + k * kNW; };
  // block of the warp's k-th tile when it is a latent group (else 0)
  auto lat_block = [&](int k) -> int {
    const int t = tile_of(k);
    if (k >= my_tiles || t >= n_lat) return 0;
    return __ldg(p.block_table + (int64_t)b * p.s_bt + (p.sink + t * KCT) / p.page);
  };
  // cp.async copies of the warp's k-th tile into stage k % kStages (one commit group,
  // empty past the warp's last tile); rows past the span / exact set zero-filled
  auto issue = [&](int k, int blk) {
    if (k < my_tiles) {
      const int t = tile_of(k);
      const uint32_t st = smem_u32(my_pipe + (k % kStages) * C::STAGE);
      if (t < n_lat) {
        const int p0 = p.sink + t * KCT;
        const uint8_t* base = p.cache + (int64_t)blk * p.s_blk +
                              (int64_t)(p0 % p.page) * p.s_tok;
#pragma unroll
        for (int i = 0; i < KCT / C::RPI; ++i) {
          const int r = cp_row + C::RPI * i;
          if (cp_chunk < C::NC)   // whole 128-byte lines into L2 (the other heads' CTAs read them)
            cp_async16<true>(st + cp_dst + i * cp_step, base + (int64_t)r * p.s_tok + cp_src,
                             p0 + r < lat_end ? 16 : 0);
        }
        cp_async16(st + C::L_SH + 16 * lane, base + sh_src, 16);
      } else {
        // lane r finds row r of the tile (exact-set index e0 + r); its chunks are then
        // copied by consecutive lanes (shuffled row addresses): 16 lanes a row for the
        // key and value codes, 4 for the parameter chunks
        const int e0 = (t - n_lat) * kEB, idx = e0 + lane;
        const bool valid = idx < n_ex;
        const int pos = idx < n_sink ? idx : tail + idx - n_sink;
        const int eblk = valid ? __ldg(p.exact_table + (int64_t)b * p.s_ebt + pos / p.epage) : 0;
        const unsigned long long row = reinterpret_cast<unsigned long long>(
            p.exact + (int64_t)eblk * p.s_eblk + (int64_t)(valid ? pos % p.epage : 0) * p.s_etok);
#pragma unroll
        for (int i = 0; i < kEB / 2; ++i) {
          const int r = 2 * i + (lane >> 4);
          const auto* rp = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, row, r));
          cp_async16(st + ex_dst + r * 128, rp + ex_src, e0 + r < n_ex ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < kEB / 8; ++i) {
          const int r = 8 * i + (lane >> 2);
          const auto* rp = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, row, r));
          cp_async4(st + C::E_P + r * 16 + 4 * (lane & 3), rp + ep_src, e0 + r < n_ex ? 4 : 0);
        }
      }
    }
    cp_async_commit();
  };

  // ---- softmax states (heads 2tc + e) and accumulators [8 m-tiles of 16 channels]
  // channel of accumulator element (mt, x) of lane (gr, tc): 16 gr + 2 mt + (x >> 1)
  float mL[2] = {-INFINITY, -INFINITY}, lL[2] = {0.f, 0.f}, zL[2] = {0.f, 0.f};
  float mE[2] = {-INFINITY, -INFINITY}, lE[2] = {0.f, 0.f}, zE[2] = {0.f, 0.f};
  // accL[8]: the probability sum S = sum_t p_t scale_t of the value codes' bases
  float accL[9][4];
#pragma unroll
  for (int mt = 0; mt < 9; ++mt)
#pragma unroll
    for (int x = 0; x < 4; ++x) accL[mt][x] = 0.f;

  issue(0, lat_block(0));
  issue(1, lat_block(1));
  int blk_next = lat_block(2);

  // A warp's tiles ascend: its latent key groups, then its exact tiles, each in a loop
  // of its own so that the exact accumulator is live only in the second (at 3 CTAs per
  // SM registers are capped at 168).
  auto landed = [&](int k) {
    cp_async_wait<kStages - 1>();   // tile k landed (this lane's copies) ...
    __syncwarp();                   // ... and every lane's
    return my_pipe + (k % kStages) * C::STAGE;
  };
  auto refill = [&](int k) {
    __syncwarp();   // every lane is done with the stage before it is refilled
    issue(k + kStages, blk_next);
    blk_next = lat_block(k + kStages + 1);
  };
  int k = 0;
  for (; k < my_tiles && tile_of(k) < n_lat; ++k) {
    const uint8_t* st = landed(k);
    const int t = tile_of(k);
    {
      // =================== a latent key group: positions p0 .. p0 + KCT - 1
      const int p0 = p.sink + t * KCT;
      uint32_t qs[8][2];                    // q * scale (f16 pairs, the key order)
      // sum_c q_c zero_c - 64 sum_{c high nibble} q'_c of heads 2tc, 2tc + 1 (the high
      // nibbles' f16 base), in two chains of 8 mma (e = 0, 1)
      float bz[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const uint32_t neg_base[4] = {0u, 0u, kNegHiBase4, kNegHiBase4};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 s = lds128(st + C::L_SH + 64 * tc + 16 * i);
        const uint4 z = lds128(st + C::L_SH + 256 + 64 * tc + 16 * i);
        const uint32_t sp[2][2] = {{prmt(s.x, s.z, 0x5410), prmt(s.x, s.z, 0x7632)},
                                   {prmt(s.y, s.w, 0x5410), prmt(s.y, s.w, 0x7632)}};
        const uint32_t zp[2][2] = {{prmt(z.x, z.z, 0x5410), prmt(z.x, z.z, 0x7632)},
                                   {prmt(z.y, z.w, 0x5410), prmt(z.y, z.w, 0x7632)}};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int s_ = 2 * i + e;
          qs[s_][0] = hmul2(qf[s_][0], sp[e][0]);
          qs[s_][1] = hmul2(qf[s_][1], sp[e][1]);
          const uint32_t az[4] = {zp[e][0], zp[e][0], zp[e][1], zp[e][1]};
          mma_f16(bz[e], az, qf[s_][0], qf[s_][1]);
          mma_f16(bz[e], neg_base, qs[s_][0], qs[s_][1]);
        }
      }
      // scores of the KCT rows, base 2
      float sc[NM][4];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        const uint4 w0 = lds128(st + (16 * m + gr) * 64 + 16 * tc);
        const uint4 w1 = lds128(st + (16 * m + gr + 8) * 64 + 16 * tc);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};   // independent of the zero term's chains
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t x0 = word(w0, i), x1 = word(w1, i);
          uint32_t a[4] = {lo4(x0), lo4(x1), hi4(x0), hi4(x1)};
          mma_f16(acc, a, qs[2 * i][0], qs[2 * i][1]);
          x0 >>= 8;
          x1 >>= 8;
          const uint32_t a2[4] = {lo4(x0), lo4(x1), hi4(x0), hi4(x1)};
          mma_f16(acc, a2, qs[2 * i + 1][0], qs[2 * i + 1][1]);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x)
          sc[m][x] = p0 + 16 * m + gr + 8 * (x >> 1) < lat_end
                         ? (acc[x] + bz[0][x] + bz[1][x]) * p.qk_scale : -INFINITY;
      }
      // online softmax of the latent state
      float mu[2];
      online_softmax_step<NM, 9>(sc, mL, lL, zL, accL, mu);
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        // P * value scale of rows gr, gr + 8, transposed into the B layout
        const int r0 = 16 * m + gr, r1 = r0 + 8;
        const float vs0 = half_at(st + C::L_VS + r0 * 32 + (vs_at & 15));
        const float vs1 = half_at(st + C::L_VS + r1 * 32 + (vs_at & 15));
        const float vz0 = half_at(st + C::L_VS + r0 * 32 + 16 + (vz_at & 15)) + VOFF * vs0;
        const float vz1 = half_at(st + C::L_VS + r1 * 32 + 16 + (vz_at & 15)) + VOFF * vs1;
        float pr[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) pr[x] = exp2f(sc[m][x] - mu[x & 1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          lL[e] += pr[e] + pr[e + 2];
          zL[e] += pr[e] * vz0 + pr[e + 2] * vz1;
        }
        const uint32_t pb0 = movmatrix_t(pack_h2(pr[0] * vs0, pr[1] * vs0));
        const uint32_t pb1 = movmatrix_t(pack_h2(pr[2] * vs1, pr[3] * vs1));
        {   // S += sum of the tile's P * scale as the mma sees it (A: ones)
          const uint32_t ones[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
          mma_f16(accL[8], ones, pb0, pb1);
        }
        // value codes of tokens 2tc, 2tc + 1 (k 2tc..) and 2tc + 8, 2tc + 9 (k 2tc + 8..):
        // lane gr's bytes of each row, channels 16 gr .. 16 gr + 15
        // (rows 2tc + k of sub-tile m sit at vrow(2tc) + vrow(16 m + k): 2tc + 1 shares
        // 2tc's padding group, and 16 m, 8 are multiples of VROWS)
        const uint8_t* vrow = st + C::L_V + v_lane + C::vrow(16 * m);
        if (VBITS == 4) {
          const uint2 ta = *reinterpret_cast<const uint2*>(vrow);
          const uint2 tb = *reinterpret_cast<const uint2*>(vrow + C::vrow(1));
          const uint2 tc8 = *reinterpret_cast<const uint2*>(vrow + C::vrow(8));
          const uint2 td = *reinterpret_cast<const uint2*>(vrow + C::vrow(9));
#pragma unroll
          for (int wi = 0; wi < 2; ++wi) {
            const uint32_t wa = wi ? ta.y : ta.x, wb = wi ? tb.y : tb.x;
            const uint32_t wc = wi ? tc8.y : tc8.x, wd = wi ? td.y : td.x;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              uint32_t u = prmt(wa, wb, hh ? 0x7632 : 0x5410);   // bytes 2hh, 2hh+1 of a, b
              uint32_t v = prmt(wc, wd, hh ? 0x7632 : 0x5410);
#pragma unroll
              for (int sub = 0; sub < 2; ++sub) {
                // byte 4wi + 2hh + sub: channels 2 mt (low nibble, rows gr) and 2 mt + 1
                const int mt = 4 * wi + 2 * hh + sub;
                const uint32_t a[4] = {lo4(u), hi4(u), lo4(v), hi4(v)};
                mma_f16(accL[mt], a, pb0, pb1);
                u >>= 8;
                v >>= 8;
              }
            }
          }
        } else {
          const uint32_t wa = *reinterpret_cast<const uint32_t*>(vrow);
          const uint32_t wb = *reinterpret_cast<const uint32_t*>(vrow + C::vrow(1));
          const uint32_t wc = *reinterpret_cast<const uint32_t*>(vrow + C::vrow(8));
          const uint32_t wd = *reinterpret_cast<const uint32_t*>(vrow + C::vrow(9));
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            uint32_t u = prmt(wa, wb, hh ? 0x7632 : 0x5410);
            uint32_t v = prmt(wc, wd, hh ? 0x7632 : 0x5410);
#pragma unroll
            for (int sub = 0; sub < 2; ++sub) {
              // byte beta = 2hh + sub: channels 4 beta + f, f = 0..3 -> m-tiles 2 beta
              // (fields 0, 1: rows gr, gr + 8) and 2 beta + 1 (fields 2, 3)
              const int beta = 2 * hh + sub;
              const uint32_t a0[4] = {c2<0>(u), c2<1>(u), c2<0>(v), c2<1>(v)};
              mma_f16(accL[2 * beta], a0, pb0, pb1);
              const uint32_t a1[4] = {c2<2>(u), c2<3>(u), c2<2>(v), c2<3>(v)};
              mma_f16(accL[2 * beta + 1], a1, pb0, pb1);
              u >>= 8;
              v >>= 8;
            }
          }
        }
      }
    }
    refill(k);
  }
  float accE[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt)
#pragma unroll
    for (int x = 0; x < 4; ++x) accE[mt][x] = 0.f;
  for (; k < my_tiles; ++k) {
    const uint8_t* st = landed(k);
    const int t = tile_of(k);
    {
      // =================== exact tile: exact-set indices e0 .. e0 + 31, int8
      const int e0 = (t - n_lat) * kEB;
      float sc[2][4];
      float vsr[2][2], vzr[2][2];   // value scale / zero + 128 scale of rows gr, gr + 8
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        const uint8_t* k0 = st + (16 * m + gr) * 128 + 32 * tc;
        const uint8_t* k1 = k0 + 8 * 128;
        const uint4 r0a = lds128(k0), r0b = lds128(k0 + 16), r1a = lds128(k1), r1b = lds128(k1 + 16);
        const uint32_t w0[8] = {r0a.x, r0a.y, r0a.z, r0a.w, r0b.x, r0b.y, r0b.z, r0b.w};
        const uint32_t w1[8] = {r1a.x, r1a.y, r1a.z, r1a.w, r1b.x, r1b.y, r1b.z, r1b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {   // piece i: channels c0..c3 in word 2i, c4..c7 in 2i + 1
          const uint32_t a[4] = {c8(w0[2 * i], w0[2 * i + 1], 0x0400), c8(w1[2 * i], w1[2 * i + 1], 0x0400),
                                 c8(w0[2 * i], w0[2 * i + 1], 0x0501), c8(w1[2 * i], w1[2 * i + 1], 0x0501)};
          mma_f16(acc, a, qf[2 * i][0], qf[2 * i][1]);
          const uint32_t a2[4] = {c8(w0[2 * i], w0[2 * i + 1], 0x0602), c8(w1[2 * i], w1[2 * i + 1], 0x0602),
                                  c8(w0[2 * i], w0[2 * i + 1], 0x0703), c8(w1[2 * i], w1[2 * i + 1], 0x0703)};
          mma_f16(acc, a2, qf[2 * i + 1][0], qf[2 * i + 1][1]);
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 16 * m + gr + 8 * hr;
          const uint8_t* pr = st + C::E_P + r * 16;
          const float ks = half_at(pr + (ek_at & 3));
          const float kz = half_at(pr + 4 + (ekz_at & 3)) + 128.f * ks;
          vsr[m][hr] = half_at(pr + 8 + (evs_at & 3));
          vzr[m][hr] = half_at(pr + 12 + (evz_at & 3)) + 128.f * vsr[m][hr];
          const bool ok = e0 + r < n_ex;
          sc[m][2 * hr] = ok ? (acc[2 * hr] * ks + kz * qsum0) * p.qk_scale : -INFINITY;
          sc[m][2 * hr + 1] = ok ? (acc[2 * hr + 1] * ks + kz * qsum1) * p.qk_scale : -INFINITY;
        }
      }
      float mu[2];
      online_softmax_step<2, 8>(sc, mE, lE, zE, accE, mu);
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        float pr[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) pr[x] = exp2f(sc[m][x] - mu[x & 1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          lE[e] += pr[e] + pr[e + 2];
          zE[e] += pr[e] * vzr[m][0] + pr[e + 2] * vzr[m][1];
        }
        const uint32_t pb0 = movmatrix_t(pack_h2(pr[0] * vsr[m][0], pr[1] * vsr[m][0]));
        const uint32_t pb1 = movmatrix_t(pack_h2(pr[2] * vsr[m][1], pr[3] * vsr[m][1]));
        const uint8_t* vrow = st + C::E_V + (16 * m + 2 * tc) * 128 + 16 * gr;
        const uint4 ta = lds128(vrow), tb = lds128(vrow + 128);
        const uint4 tc8 = lds128(vrow + 8 * 128), td = lds128(vrow + 9 * 128);
#pragma unroll
        for (int mt = 0; mt < 8; ++mt) {
          // channels 16 gr + 2 mt (rows gr) and + 1 (rows gr + 8): word mt / 2, bytes
          // 2 (mt % 2) and 2 (mt % 2) + 1
          const int wi = mt >> 1, by = 2 * (mt & 1);
          const uint32_t sel0 = ((4 + by) << 8) | by, sel1 = ((5 + by) << 8) | (by + 1);
          const uint32_t wa = word(ta, wi), wb = word(tb, wi), wc = word(tc8, wi), wd = word(td, wi);
          const uint32_t a[4] = {c8(wa, wb, sel0), c8(wa, wb, sel1), c8(wc, wd, sel0), c8(wc, wd, sel1)};
          mma_f16(accE[mt], a, pb0, pb1);
        }
      }
    }
    refill(k);
  }
  cp_async_wait<0>();

  // ---- row sums over the 8 row lanes, then the warps' states through shared memory
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      lL[e] += __shfl_xor_sync(0xffffffffu, lL[e], o);
      zL[e] += __shfl_xor_sync(0xffffffffu, zL[e], o);
      lE[e] += __shfl_xor_sync(0xffffffffu, lE[e], o);
      zE[e] += __shfl_xor_sync(0xffffffffu, zE[e], o);
    }
  }
  __syncthreads();   // every warp left its pipeline: shared memory becomes the merge buffer
  float* part = reinterpret_cast<float*>(smem);
  {
    float* mine = part + warp * C::WARP_F;   // [6][8] stats | accL [8][128] | accE [8][128]
    if (gr == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = 2 * tc + e;
        mine[0 * 8 + h] = mL[e]; mine[1 * 8 + h] = lL[e]; mine[2 * 8 + h] = zL[e];
        mine[3 * 8 + h] = mE[e]; mine[4 * 8 + h] = lE[e]; mine[5 * 8 + h] = zE[e];
      }
    }
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int h = 2 * tc + (x & 1), ch = 16 * gr + 2 * mt + (x >> 1);
        // the value codes' bases out (value_base)
        const int f = VBITS == 4 ? 2 * (x >> 1) : 2 * (mt & 1) + (x >> 1);
        mine[48 + h * kD + ch] = accL[mt][x] - (value_base(f) + VOFF) * accL[8][x & 1];
        mine[48 + kMaxQ * kD + h * kD + ch] = accE[mt][x];
      }
  }
  __syncthreads();
  __half* s_bl = reinterpret_cast<__half*>(smem + C::M_BL);   // [8][BL_PITCH] latent acc / L
  float* s_ob = reinterpret_cast<float*>(smem + C::M_OB);      // [8][128] exact part + zeros
  float* s_st = reinterpret_cast<float*>(smem + C::M_ST);      // M [8], L [8]
  {
    const int c = tid;   // channel (kNW * 32 == 128)
    const float vs = p.vsum[(int64_t)j * kD + c];
    for (int h = 0; h < kMaxQ; ++h) {
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < kNW; ++w)
        M = fmaxf(M, fmaxf(part[w * C::WARP_F + h], part[w * C::WARP_F + 24 + h]));
      float L = 0.f, ZL = 0.f, ZE = 0.f, AL = 0.f, AE = 0.f;
      if (M != -INFINITY && h < p.qpk) {
#pragma unroll
        for (int w = 0; w < kNW; ++w) {
          const float* pw = part + w * C::WARP_F;
          const float al = exp2f(pw[h] - M), ae = exp2f(pw[24 + h] - M);
          L += al * pw[8 + h] + ae * pw[32 + h];
          ZL += al * pw[16 + h];
          ZE += ae * pw[40 + h];
          AL += al * pw[48 + h * kD + c];
          AE += ae * pw[48 + kMaxQ * kD + h * kD + c];
        }
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      s_bl[h * C::BL_PITCH + c] = __float2half_rn(AL * inv);
      s_ob[h * kD + c] = (AE + ZE) * inv + ZL * inv * vs;
      if (c == 0) {
        s_st[h] = M;
        s_st[8 + h] = L;
      }
    }
  }
  __syncthreads();

  // ---- the lift, O[d x heads] = lift^T [d x r] (acc / L)^T [r x heads], 2 RV / 16 mma
  // per warp (channels r >= RV of the accumulator never read), and the store
  const int H = p.num_heads;
  const bool several = p.num_splits > 1;
  const __half* lt = p.lift_t + (int64_t)j * kD * RV;
  for (int mtd = warp; mtd < 8; mtd += kNW) {
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    const int d0 = 16 * mtd + gr;
#pragma unroll
    for (int ks = 0; ks < RV / 16; ++ks) {
      const int r0 = 16 * ks + 2 * tc;
      const uint32_t a[4] = {__ldg(reinterpret_cast<const unsigned int*>(lt + d0 * RV + r0)),
                             __ldg(reinterpret_cast<const unsigned int*>(lt + (d0 + 8) * RV + r0)),
                             __ldg(reinterpret_cast<const unsigned int*>(lt + d0 * RV + r0 + 8)),
                             __ldg(reinterpret_cast<const unsigned int*>(lt + (d0 + 8) * RV + r0 + 8))};
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(s_bl + gr * C::BL_PITCH + r0);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(s_bl + gr * C::BL_PITCH + r0 + 8);
      mma_f16(o, a, b0, b1);
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int d = d0 + 8 * (x >> 1), h = 2 * tc + (x & 1);
      if (h >= p.qpk) continue;
      const float v = o[x] + s_ob[h * kD + d];
      const int64_t col = (int64_t)(j * p.qpk + h) * kD + d;
      if (several) {
        reinterpret_cast<float*>(p.out)[((int64_t)b * p.num_splits + split) * H * kD + col] = v;
      } else {
        const int64_t at = (int64_t)b * H * kD + col;
        if (p.out_kind == 0) reinterpret_cast<float*>(p.out)[at] = v;
        else if (p.out_kind == 1) reinterpret_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
        else reinterpret_cast<__half*>(p.out)[at] = __float2half_rn(v);
      }
    }
  }
  if (several && tid < p.qpk) {
    const float M = s_st[tid], L = s_st[8 + tid];
    p.plse[((int64_t)b * p.num_splits + split) * H + j * p.qpk + tid] =
        L > 0.f ? M + __log2f(L) : -INFINITY;
  }
}

}  // namespace prk_decode

namespace prk_decode {

template <int KCT, int VBITS, int RV>
cudaError_t launch_variant(const Params& p, dim3 grid, cudaStream_t stream, int device) {
  using C = Cfg<KCT, VBITS, RV>;
  static uint64_t attr_done = 0;   // the >48 KB dynamic shared memory opt-in, per device
  if (!(attr_done >> device & 1)) {
    const cudaError_t err = cudaFuncSetAttribute(
        post_rope_decode_kernel<KCT, VBITS, RV>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        C::SMEM);
    if (err != cudaSuccess) return err;
    attr_done |= uint64_t(1) << device;
  }
  post_rope_decode_kernel<KCT, VBITS, RV><<<grid, kNW * 32, C::SMEM, stream>>>(p);
  return cudaGetLastError();
}

// Every compiled (KCT, VBITS, RV): key groups of 32 or 64, 2-bit values at rank 64 or
// 128, 4-bit values at rank 64, 96 or 128.
#define PRK_VARIANTS(X)                                                        \
  X(32, 2, 64) X(32, 2, 128) X(32, 4, 64) X(32, 4, 96) X(32, 4, 128)           \
  X(64, 2, 64) X(64, 2, 128) X(64, 4, 64) X(64, 4, 96) X(64, 4, 128)

cudaError_t launch(const Params& p, int kct, int v_bits, int rv, dim3 grid, cudaStream_t stream,
                   int device) {
#define PRK_LAUNCH(K, V, R) \
  if (kct == K && v_bits == V && rv == R) return launch_variant<K, V, R>(p, grid, stream, device);
  PRK_VARIANTS(PRK_LAUNCH)
#undef PRK_LAUNCH
  return cudaErrorInvalidValue;
}

bool config(int kct, int v_bits, int rv, int64_t out[5]) {
#define POST_ROPE_CFG(K, V, R)                                                 \
  if (kct == K && v_bits == V && rv == R) {                                    \
    out[0] = kNW; out[1] = kStages; out[2] = Cfg<K, V, R>::SMEM; out[3] = kEB; \
    out[4] = Cfg<K, V, R>::CTAS;                                               \
    return true;                                                               \
  }
  PRK_VARIANTS(POST_ROPE_CFG)
#undef POST_ROPE_CFG
  return false;
}

}  // namespace prk_decode
