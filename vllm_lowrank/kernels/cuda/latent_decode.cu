// Pre-RoPE decode attention over a bf16/fp16 latent cache, on mma.sync tensor cores.
//
// The CudaDecoder of vllm_lowrank/attention/decoders.py (mode
// "pre_rope") for: one KV head per head group (G = 1), head_dim 128, full rotary,
// uniform ranks r_k / r_v (multiples of 16, <= 128), an unquantized cache
// [num_blocks, 1, block_size, Rk + Rv] with block_size a power of two >= 16, and no
// key transform / window / token-adaptive span. Same math as the Triton kernel
// (benchmarks/decode_attention_notes.md in git history); per sequence b, KV head g and token t:
//
//   k_t   = c_k[t] @ B_k[g]                  rebuilt key, [128]
//   s_h,t = scale * q_h . R_t k_t            RoPE by the absolute position t
//   o_h   = sum_t softmax_t(s_h) c_v[t]      output in the value latent space
//
// Work decomposition. Grid (split, group, sequence); a CTA of NW warps owns the
// split's 32-token tiles, warp w takes tiles w, w + NW, ... with its own online-
// softmax state (no CTA barrier inside the loop); the NW partial states are merged
// at the end through shared memory. Split partials (normalised output, base-2 LSE)
// are merged by `reduce_kernel`.
//
// Per warp and 32-token tile (two m16 row tiles), all on mma.sync.m16n8k16:
//   1. cp.async streams the tile's key and value latent rows into the warp's own
//      shared-memory stage (rows laid out by RowLayout: unpadded and XOR-swizzled
//      for r = 16/32/64/128; zero-filled past the sequence end), as two groups: the
//      key rows (with the tile start's cos/sin rows) are issued while the previous
//      tile is rebuilt, right after its key fragments were loaded into registers,
//      the value rows after the previous tile's value product (see Cfg).
//   2. Rebuild K = C_k @ B_k in four column chunks of 32 dims: chunk kc holds the
//      n8-tiles {2kc, 2kc+1} (dims 16kc..16kc+15) and their RoPE partners {2kc+8,
//      2kc+9} (dims +64), so each thread holds both members of its rotary pairs
//      in the same accumulator slots (neox pairing; gptj is mapped onto it by
//      permuting B_k's columns and the query the same way on load).
//      A = C_k by ldmatrix; B = B_k^T (smem, [128][r_k], ldmatrix, one .x4 gives
//      a tile and its partner).
//   3. RoPE: R_t = R_{p0} R_i (t = p0 + i, p0 the tile start): the accumulator is
//      rotated by the loop-invariant offset i (cos/sin of i = 0..31, divided by the
//      table's row 0 = mscale, in an 8 KB shared table as f16 pairs) in packed
//      f16x2 arithmetic; the query (scaled, f16, in shared memory) is rotated by
//      R_{p0}^T per chunk from the tile's cos/sin rows (copied with the tile).
//   4. The rotated accumulator of two n8-tiles is the A operand of the score MMA
//      (C layout of m16n8 == A layout of m16n8k16): S[32 x 8] = K' Q'^T, f16
//      operands, the group's query heads padded to n = 8. Queries carry
//      scale * log2(e), scores are base 2.
//   5. Online softmax per head column (max across the 8 row-lanes by shuffles),
//      P -> bf16/f16, transposed by movmatrix into the B operand of
//      O^T[r_v x 8] += V^T P, V^T by ldmatrix.trans from the value stage.
//
// Precision: latents and B_k in the cache dtype (fp32 accumulation); the rebuilt
// key is rounded to f16 (10-bit mantissa, finer than bf16) and rotated in f16x2;
// scores accumulate in fp32; P in the cache dtype; softmax state and O in fp32.
// Keys and scaled queries must stay below 65504 in magnitude (f16 range).
//
// No torch here (the binding is latent_decode.cpp). Registers, spills and SASS:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math -cubin -Xptxas -v \
//        vllm_lowrank/kernels/cuda/latent_decode.cu
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>

#include "latent_decode.h"
#include "mma_common.cuh"

namespace latent_decode {

constexpr int kTile = 32;       // tokens per warp tile
constexpr int kSmemBudget = 220 * 1024;

// Shared-memory rows of one latent section (key or value) of a tile: token row t,
// 16-byte chunk c (8 latent values). Where a row has a power-of-two number of chunks
// (r = 16, 32, 64, 128) the rows are unpadded and chunk c is stored at c ^ swz(t),
// swz(t) = (t >> SHIFT) & MASK, so the 8 rows an ldmatrix 8x8 matrix reads at one
// logical chunk fall in 8 different 16-byte bank groups (row pitches of 32, 64, 128,
// 256 bytes). Other ranks (48, 96) keep a 16-byte pad per row. Unpadded rows keep
// each row's cp.async destination inside its own 128-byte lines: padded 16-byte
// pitches cost about 10 % of the copy rate (H200, 16 x 32k: loads alone 280 -> 254
// us at r = 64, 151 -> 140 us at r = 32; benchmarks/decode_attention_notes.md in git history).
template <int R>
struct RowLayout {
  static constexpr int CH = R / 8;                           // 16-byte chunks per row
  static constexpr bool SWIZZLE = (CH & (CH - 1)) == 0;
  static constexpr int PITCH = SWIZZLE ? R * 2 : (R + 8) * 2;   // bytes per token row
  static constexpr int SHIFT = CH >= 8 ? 0 : CH == 4 ? 1 : 2;   // rows per 128 B: 1, 2, 4
  static constexpr int MASK = CH >= 8 ? 7 : CH - 1;
  // Chunk c of row t sits at byte t * PITCH + 16 * (c ^ swz(t)). swz(t + 16 m) == swz(t)
  // (SHIFT <= 2, MASK <= 7), so the second m16 row tile reuses the first one's order.
  static __host__ __device__ constexpr int swz(int row) { return SWIZZLE ? (row >> SHIFT) & MASK : 0; }
};

// Launch shape per (r_k, r_v): the most warps (16, 8 or 4) whose pipelines fit in
// shared memory, one stage each. A warp's pipeline holds STAGES stages of key +
// value rows and STAGES + 1 slots of cos/sin rows: tile k + STAGES's key rows (and
// its rope rows, one slot ahead of those being read) are issued as soon as tile k's
// key fragments sit in registers, its value rows right after tile k's value product,
// so one stage already gives every copy about a tile of compute to land. Resident
// warps beat prefetch depth (H200, benchmarks/decode_attention_notes.md in git history, 16 x 32k:
// r = 64, 16 warps x 1 stage 296 us, 8 x 2 335; r = 32, 16 x 1 215, 16 x 2 222; with
// the unpadded rows, where 16 x 2 fits at r <= 32: r = 32 194.5 vs 203.7, r = 16 150.3
// vs 158.6); 16 warps cap the registers at 128 (8 bytes of spills at r = 32).
// NW_ / ST_ > 0 override both (experiments).
template <int RK, int RV, int NW_ = 0, int ST_ = 0>
struct Cfg {
  static constexpr int KP = RK + 8;                          // padded B_k^T rows (elements)
  static constexpr int V_OFF = kTile * RowLayout<RK>::PITCH; // value rows inside a stage
  static constexpr int STAGE = V_OFF + kTile * RowLayout<RV>::PITCH;   // key + value rows of a tile
  static constexpr int ROPE = 2 * 64 * 4;                    // cos/sin rows of a tile start
  static constexpr int BK_BYTES = kHeadDim * KP * 2;
  static constexpr int ROT_BYTES = 4 * kTile * 4 * 16;       // [kc][i][c] x uint4
  static constexpr int Q_BYTES = 4 * 32 * 16;                // [kc][lane] x uint4
  static constexpr int FIXED = BK_BYTES + ROT_BYTES + Q_BYTES;
  static constexpr int warp_bytes(int stages) { return stages * STAGE + (stages + 1) * ROPE; }
  static constexpr int NW = NW_ > 0 ? NW_
                           : FIXED + 16 * warp_bytes(1) <= kSmemBudget ? 16
                           : FIXED + 8 * warp_bytes(1) <= kSmemBudget ? 8 : 4;
  static constexpr int STAGES = ST_ > 0 ? ST_ : 1;
  static constexpr int WARP = warp_bytes(STAGES);            // one warp's pipeline
  static constexpr int ROPE_OFF = STAGES * STAGE;            // its rope slots
  static constexpr int PART = NW * 8 * (RV + 2) * 4;         // per-warp (m, l, O) at the end
  static constexpr int PIPE = NW * WARP;
  static constexpr int SMEM = FIXED + (PIPE > PART ? PIPE : PART);
  static_assert(RK % 16 == 0 && RV % 16 == 0 && RK <= 128 && RV <= 128, "ranks");
  static_assert(FIXED + NW * warp_bytes(1) <= kSmemBudget, "shared memory too small for one stage");
  static_assert(SMEM <= 227 * 1024, "shared memory");
};

template <typename T> struct Dt;
template <> struct Dt<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ void mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Dt<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ void mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

using namespace lowrank_mma;  // cp.async, ldmatrix, movmatrix, mma_f16 (mma_common.cuh)

// Position in the kernel's column order (neox pairs (p, p + 64)) -> head dimension.
__device__ __forceinline__ int source_dim(int pos, int gptj) {
  return gptj ? (pos < 64 ? 2 * pos : 2 * (pos - 64) + 1) : pos;
}

// Issue the cp.async copies of one section (key or value latents) of a 32-token
// tile. CH 16-byte chunks per token row (rows under 128 bytes take the L2 line
// hint of cp_async16); CHP = CH rounded up to a power of two lanes per token, so
// instruction i covers tokens i * (32 / CHP) + lane / CHP and a token's half (rows
// 0-15 or 16-31 of the tile, possibly different pages) is known at compile time.
template <int CH>
struct Section {
  static constexpr int CHP = CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : 16;
  static constexpr int TPI = 32 / CHP;  // tokens per instruction
};

// half0 / half1: this lane's first source byte in tile rows 0 and 16 (its token
// row lane / CHP, its chunk, the section's column); dst: the section's first byte in
// the stage (rows laid out by RowLayout<R>). FULL: every row of the tile is inside
// the sequence (no zero fill).
template <int R, bool FULL>
__device__ __forceinline__ void load_section(uint32_t dst, const char* half0, const char* half1,
                                             uint32_t s_tok_b, int lane, int n_valid) {
  constexpr int CH = R / 8, CHP = Section<CH>::CHP, TPI = Section<CH>::TPI;
  using L = RowLayout<R>;
  if (CH != CHP && lane % CHP >= CH) return;
  const int lr = lane / CHP;
  // Row i * TPI + lr with lr < TPI (TPI a power of two): the two terms have disjoint
  // bits, so swz(row) = swz(i * TPI) ^ swz(lr), the first a compile-time constant.
  const int x = (lane % CHP) ^ L::swz(lr);
  const uint32_t base = dst + (uint32_t)(lr * L::PITCH);
#pragma unroll
  for (int i = 0; i < CHP; ++i) {
    const char* src = ((i * TPI < 16) ? half0 : half1) + (uint32_t)((i * TPI) % 16) * s_tok_b;
    const uint32_t d = base + (uint32_t)(i * TPI * L::PITCH + 16 * (x ^ L::swz(i * TPI)));
    cp_async16<(CH * 16 < 128)>(d, src, FULL || i * TPI + lr < n_valid ? 16 : 0);
  }
}

template <int RK, int RV, typename T, int NW_ = 0, int ST_ = 0>
__global__ void __launch_bounds__(Cfg<RK, RV, NW_, ST_>::NW * 32, 1) decode_kernel(const Params p) {
  using C = Cfg<RK, RV, NW_, ST_>;
  constexpr int NW = C::NW, STAGES = C::STAGES, KP = C::KP;
  using LK = RowLayout<RK>;
  using LV = RowLayout<RV>;
  constexpr int KS = RK / 16;   // k-steps of the rebuild
  constexpr int MV = RV / 16;   // m-tiles of O^T
  extern __shared__ __align__(128) uint8_t smem[];
  T* s_bk = reinterpret_cast<T*>(smem);                          // [128][KP]
  uint4* s_rot = reinterpret_cast<uint4*>(smem + C::BK_BYTES);   // [4][32][4]
  uint4* s_q = reinterpret_cast<uint4*>(smem + C::BK_BYTES + C::ROT_BYTES);  // [4][32]
  uint8_t* s_pipe = smem + C::FIXED;

  const int split = blockIdx.x, grp = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, cq = lane & 3;   // fragment row group / column quad
  const int HG = p.heads_per_group;
  const int seq_len = p.seq_lens[b];
  const int n_tiles = (seq_len + kTile - 1) / kTile;
  const int tps = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = min(n_tiles, split * tps);
  const int tile_end = min(n_tiles, tile_begin + tps);

  // ---- prologue: B_k^T and the offset rotation table into shared memory ----
  {
    const T* bk = reinterpret_cast<const T*>(p.bkt) + (int64_t)grp * kHeadDim * RK;
    constexpr int CH = RK / 8;
    for (int e = tid; e < kHeadDim * CH; e += NW * 32) {
      const int row = e / CH, ch = e % CH;
      cp_async16(smem_u32(s_bk + row * KP + ch * 8), bk + row * RK + ch * 8, 16);
    }
    cp_async_commit();
    // Entry (kc, i, c): cos/sin of offset i for the 4 frequencies a thread with
    // column quad c touches in chunk kc: 8 * (2kc + s/2) + 2c + (s & 1), s = 0..3,
    // as f16 pairs {cos s0 s1, sin s0 s1, cos s2 s3, sin s2 s3}; divided by row 0
    // (the table's magnitude, YaRN mscale) because R_{p0} carries it once.
    for (int e = tid; e < 4 * kTile * 4; e += NW * 32) {
      const int c = e & 3, i = (e >> 2) & 31, kc = e >> 7;
      const int pi = min(i, p.max_pos - 1);
      float cs[4], sn[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int f = 8 * (2 * kc + (s >> 1)) + 2 * c + (s & 1);
        const float inv = 1.0f / p.cos[f];
        cs[s] = p.cos[(int64_t)pi * p.s_rope + f] * inv;
        sn[s] = p.sin[(int64_t)pi * p.s_rope + f] * inv;
      }
      s_rot[e] = make_uint4(h2_bits(__floats2half2_rn(cs[0], cs[1])),
                            h2_bits(__floats2half2_rn(sn[0], sn[1])),
                            h2_bits(__floats2half2_rn(cs[2], cs[3])),
                            h2_bits(__floats2half2_rn(sn[2], sn[3])));
    }
  }

  // ---- query, scaled, as f16 pairs in shared memory, per chunk kc and lane (head
  // gr, positions 16kk + 8hh + 2cq + {0, 1}): {kk = kc: hh 0, 1; kk = kc + 4: hh 0, 1}.
  if (warp == 0) {
    const T* qp = reinterpret_cast<const T*>(p.query) + (int64_t)b * p.s_qb +
                  (int64_t)(grp * HG + min(gr, HG - 1)) * p.s_qh;
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      uint32_t w[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int pos = 16 * (kc + 4 * (x >> 1)) + 8 * (x & 1) + 2 * cq;
        const float a = Dt<T>::to_float(qp[source_dim(pos, p.gptj)]) * p.qk_scale;
        const float c = Dt<T>::to_float(qp[source_dim(pos + 1, p.gptj)]) * p.qk_scale;
        w[x] = h2_bits(gr < HG ? __floats2half2_rn(a, c) : __floats2half2_rn(0.f, 0.f));
      }
      s_q[kc * 32 + lane] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }

  // ---- per-warp pipeline over the warp's tiles ----
  const int n_mine = tile_end - tile_begin > warp ? (tile_end - tile_begin - warp + NW - 1) / NW : 0;
  const char* cache = reinterpret_cast<const char*>(p.cache);
  const int* bt_row = p.block_table + (int64_t)b * p.s_bt;
  const int page_mask = (1 << p.page_shift) - 1;
  // Byte strides and in-block offsets as unsigned 32-bit values (the wrapper checks
  // that a block's stride fits): block address = cache + nb * s_blk_b + offset is one
  // 32 x 32 -> 64-bit multiply-add, with no sign extension.
  const uint32_t s_blk_b = (uint32_t)(p.s_blk * (int64_t)sizeof(T));
  const uint32_t s_tok_b = (uint32_t)(p.s_tok * (int64_t)sizeof(T));
  uint8_t* my_pipe = s_pipe + warp * C::WARP;
  const uint32_t pipe_u32 = smem_u32(my_pipe);
  // This lane's source byte offsets inside a 16-token half.
  using SK = Section<RK / 8>;
  using SV = Section<RV / 8>;
  const uint32_t src_k = (uint32_t)(lane / SK::CHP) * s_tok_b +
                         (uint32_t)((grp * RK + (lane % SK::CHP) * 8) * (int)sizeof(T));
  const uint32_t src_v = (uint32_t)(lane / SV::CHP) * s_tok_b +
                         (uint32_t)((p.k_width + grp * RV + (lane % SV::CHP) * 8) * (int)sizeof(T));
  // cos/sin rows of the tile start p0: lanes 0-15 copy cos, 16-31 sin, 16 B each.
  const float* rope_src = (lane < 16 ? p.cos : p.sin) + 4 * (lane & 15);
  const uint32_t dst_rope = (uint32_t)(C::ROPE_OFF + 16 * lane);

  // Two cp.async groups per tile k, committed in this order: K_k (key rows into
  // stage k % STAGES, cos/sin rows into rope slot k % (STAGES + 1)) and V_k (value
  // rows). Tile k + STAGES's K group is issued as soon as tile k's key fragments are
  // in registers, its V group after tile k's value product, so every group has about
  // STAGES tiles of compute to land and `cp.async.wait_group 2 * STAGES - 1` before
  // either use waits for exactly the group needed. Block ids of the two 16-token
  // halves of the next tile to issue are fetched one group ahead (past the sequence
  // end the second half repeats the first; its rows are zero-filled, not read).
  int nb0 = 0, nb1 = 0;
  auto fetch_blocks = [&](int k) {
    if (k < n_mine) {
      const int t0 = (tile_begin + warp + k * NW) * kTile;
      nb0 = bt_row[t0 >> p.page_shift];
      nb1 = t0 + 16 < seq_len ? bt_row[(t0 + 16) >> p.page_shift] : nb0;
    }
  };
  // One section (KEY: key rows + cos/sin rows, else value rows) of tile k.
  auto issue = [&](int k, auto key) {
    constexpr bool KEY = decltype(key)::value;
    constexpr int R = KEY ? RK : RV;
    if (k < n_mine) {
      const int t0 = (tile_begin + warp + k * NW) * kTile;
      const uint32_t src = KEY ? src_k : src_v;
      const char* h0 = cache + ((uint64_t)(uint32_t)nb0 * s_blk_b +
                                ((uint32_t)(t0 & page_mask) * s_tok_b + src));
      const char* h1 = cache + ((uint64_t)(uint32_t)nb1 * s_blk_b +
                                ((uint32_t)((t0 + 16) & page_mask) * s_tok_b + src));
      const uint32_t dst = pipe_u32 + (uint32_t)((k % STAGES) * C::STAGE + (KEY ? 0 : C::V_OFF));
      const int n_valid = seq_len - t0;
      if (n_valid >= kTile)
        load_section<R, true>(dst, h0, h1, s_tok_b, lane, n_valid);
      else
        load_section<R, false>(dst, h0, h1, s_tok_b, lane, n_valid);
      if (KEY)
        cp_async16(pipe_u32 + (uint32_t)((k % (STAGES + 1)) * C::ROPE) + dst_rope,
                   rope_src + (int64_t)min(t0, p.max_pos - 1) * p.s_rope, 16);
    }
    cp_async_commit();
  };
  using KeyTag = std::true_type;
  using ValueTag = std::false_type;

#pragma unroll
  for (int k = 0; k < STAGES; ++k) {
    fetch_blocks(k);
    issue(k, KeyTag{});
    issue(k, ValueTag{});
  }
  fetch_blocks(STAGES);
  cp_async_wait<2 * STAGES>();   // B_k^T landed (the oldest group)
  __syncthreads();               // B_k^T, rotation table and query visible to all warps

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float oacc[MV][4];
#pragma unroll
  for (int i = 0; i < MV; ++i) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;

  // Per-lane ldmatrix addresses of the four 8x8 matrices.
  //   B_k^T x4: rows 8 * (tile + 8 * (lane >= 16)) + lane % 8, k half (lane / 8) & 1
  const uint32_t bk_lane = smem_u32(s_bk) +
      2u * (uint32_t)(((lane & 7) + 64 * (lane >> 4)) * KP + 8 * ((lane >> 3) & 1));
  //   C_k x4 (A operand): token ck_row = (lane % 8) + 8 * ((lane / 8) & 1) (+ 16 mt),
  //   chunk lane / 16 + 2 ks, stored at (lane / 16 + 2 ks) ^ swz = ck_x ^ 2 ks
  //   (lane / 16 < 2, and swz(row + 16 mt) = swz(row)).
  const int ck_row = (lane & 7) + 8 * ((lane >> 3) & 1);
  const uint32_t ck_base = (uint32_t)(ck_row * LK::PITCH);
  const int ck_x = (lane >> 4) ^ LK::swz(ck_row);
  //   V x4.trans (A = V^T): token (lane % 8) + 8 * (lane / 16), chunk (lane / 8) & 1 + 2 mv.
  const int v_row = (lane & 7) + 8 * (lane >> 4);
  const uint32_t v_base = (uint32_t)(C::V_OFF + v_row * LV::PITCH);
  const int v_x = ((lane >> 3) & 1) ^ LV::swz(v_row);
  const uint32_t rot_lane = smem_u32(s_rot) + 16u * (uint32_t)(gr * 4 + cq);

  for (int k = 0; k < n_mine; ++k) {
    cp_async_wait<2 * STAGES - 1>();   // K_k landed
    __syncwarp();
    const uint32_t st = pipe_u32 + (uint32_t)((k % STAGES) * C::STAGE);
    const int t0 = (tile_begin + warp + k * NW) * kTile;

    const float* rope_row = reinterpret_cast<const float*>(my_pipe + C::ROPE_OFF +
                                                           (k % (STAGES + 1)) * C::ROPE);

    // Key latent A fragments of both row tiles.
    uint32_t ck[2][KS][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        ldsm_x4(ck[mt][ks], st + ck_base + (uint32_t)(16 * mt * LK::PITCH + 16 * (ck_x ^ (2 * ks))));

    float sacc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) sacc[mt][0] = sacc[mt][1] = sacc[mt][2] = sacc[mt][3] = 0.f;

#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      // acc[mt][j]: n8-tiles 2kc, 2kc+1 (j = 0, 1) and partners 2kc+8, 2kc+9 (j = 2, 3).
      float acc[2][4][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          uint32_t bf[4];   // {tile 2kc+jj: b0, b1; tile 2kc+8+jj: b0, b1}
          ldsm_x4(bf, bk_lane + 2u * (uint32_t)((16 * kc + 8 * jj) * KP + 16 * ks));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Dt<T>::mma(acc[mt][jj], ck[mt][ks], bf[0], bf[1]);
            Dt<T>::mma(acc[mt][jj + 2], ck[mt][ks], bf[2], bf[3]);
          }
        }
      }
      if (kc == 0) {
        // Every key fragment has fed an MMA, so its ldmatrix is complete: the key
        // rows of this stage are free for tile k + STAGES.
        __syncwarp();
        issue(k + STAGES, KeyTag{});
      }
      // The query's dims of this chunk rotated by R_{p0}^T, p0 = t0 (cos/sin rows
      // from the stage): f16 B fragments {16kc.. : b0, b1; 64+16kc.. : b0, b1}.
      uint32_t qb[4];
      {
        const uint4 qv = s_q[kc * 32 + lane];
        const uint32_t q1s[2] = {qv.x, qv.y}, q2s[2] = {qv.z, qv.w};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int f = 16 * kc + 8 * hh + 2 * cq;
          const float2 cv = *reinterpret_cast<const float2*>(rope_row + f);
          const float2 sv = *reinterpret_cast<const float2*>(rope_row + 64 + f);
          const __half2 cs = __floats2half2_rn(cv.x, cv.y), sn = __floats2half2_rn(sv.x, sv.y);
          const __half2 q1 = bits_h2(q1s[hh]), q2 = bits_h2(q2s[hh]);
          qb[hh] = h2_bits(__hfma2(q1, cs, __hmul2(q2, sn)));
          qb[2 + hh] = h2_bits(__hfma2(q2, cs, __hneg2(__hmul2(q1, sn))));
        }
      }
      // RoPE by the offset of each row, then score MMAs on the rotated tiles.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t alo[4], ahi[4];   // A fragments: dims 16kc.. (x1) and 64+16kc.. (x2)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          uint4 rot;
          const uint32_t ra = rot_lane + 16u * (uint32_t)((kc * kTile + 16 * mt + 8 * rh) * 4);
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(rot.x), "=r"(rot.y), "=r"(rot.z), "=r"(rot.w) : "r"(ra));
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const __half2 cs = bits_h2(jj ? rot.z : rot.x), sn = bits_h2(jj ? rot.w : rot.y);
            const __half2 x1 = __floats2half2_rn(acc[mt][jj][2 * rh], acc[mt][jj][2 * rh + 1]);
            const __half2 x2 = __floats2half2_rn(acc[mt][jj + 2][2 * rh], acc[mt][jj + 2][2 * rh + 1]);
            const __half2 y1 = __hfma2(x1, cs, __hneg2(__hmul2(x2, sn)));
            const __half2 y2 = __hfma2(x1, sn, __hmul2(x2, cs));
            alo[2 * jj + rh] = h2_bits(y1);
            ahi[2 * jj + rh] = h2_bits(y2);
          }
        }
        mma_f16(sacc[mt], alo, qb[0], qb[1]);
        mma_f16(sacc[mt], ahi, qb[2], qb[3]);
      }
    }

    // Rows past the sequence end (last tile only).
    if (t0 + kTile > seq_len) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          if (t0 + 16 * mt + 8 * (x >> 1) + gr >= seq_len) sacc[mt][x] = -INFINITY;
    }

    // Online softmax per head column e (heads 2cq + e), base 2.
    float alpha[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(fmaxf(sacc[0][e], sacc[0][e + 2]), fmaxf(sacc[1][e], sacc[1][e + 2]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run[e], mx);
      alpha[e] = exp2f(m_run[e] - m_new);
      m_run[e] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        sacc[mt][e] = exp2f(sacc[mt][e] - m_new);
        sacc[mt][e + 2] = exp2f(sacc[mt][e + 2] - m_new);
        sum += sacc[mt][e] + sacc[mt][e + 2];
      }
      l_run[e] = l_run[e] * alpha[e] + sum;
    }
#pragma unroll
    for (int mv = 0; mv < MV; ++mv) {
      oacc[mv][0] *= alpha[0]; oacc[mv][1] *= alpha[1];
      oacc[mv][2] *= alpha[0]; oacc[mv][3] *= alpha[1];
    }
    cp_async_wait<2 * STAGES - 1>();   // V_k landed
    __syncwarp();
    // P^T as B operand: movmatrix turns [token x head] 8x8 blocks into [head x token].
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t pb0 = movmatrix_t(Dt<T>::pack(sacc[mt][0], sacc[mt][1]));
      const uint32_t pb1 = movmatrix_t(Dt<T>::pack(sacc[mt][2], sacc[mt][3]));
#pragma unroll
      for (int mv = 0; mv < MV; ++mv) {
        uint32_t va[4];
        ldsm_x4_t(va, st + v_base + (uint32_t)(16 * mt * LV::PITCH + 16 * (v_x ^ (2 * mv))));
        Dt<T>::mma(oacc[mv], va, pb0, pb1);
      }
    }
    __syncwarp();   // every lane is done with the value rows before they are refilled
    issue(k + STAGES, ValueTag{});
    fetch_blocks(k + STAGES + 1);
  }
  cp_async_wait<0>();

  // ---- merge the warps' states: l over the 8 row lanes, then across warps ----
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
  }
  __syncthreads();   // all warps left the pipeline: its smem becomes the merge buffer
  float* part = reinterpret_cast<float*>(s_pipe);   // [NW][8 heads][RV + 2] (m, l, O)
  {
    float* mine = part + warp * 8 * (RV + 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int h = 2 * cq + e;
      if (gr == 0) {
        mine[h * (RV + 2) + RV] = m_run[e];
        mine[h * (RV + 2) + RV + 1] = l_run[e];
      }
#pragma unroll
      for (int mv = 0; mv < MV; ++mv) {
        mine[h * (RV + 2) + 16 * mv + gr] = oacc[mv][e];
        mine[h * (RV + 2) + 16 * mv + 8 + gr] = oacc[mv][2 + e];
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < HG * RV; e += NW * 32) {
    const int h = e / RV, j = e % RV;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, part[(w * 8 + h) * (RV + 2) + RV]);
    float l = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float* pw = part + (w * 8 + h) * (RV + 2);
        const float sc = exp2f(pw[RV] - mx);
        l += sc * pw[RV + 1];
        o += sc * pw[j];
      }
    }
    const float res = l > 0.f ? o / l : 0.f;
    const int head = grp * HG + h;
    const int64_t col = (int64_t)head * RV + j;
    if (p.num_splits > 1) {
      const int64_t row = (int64_t)b * p.num_splits + split;
      p.out[row * p.out_width + col] = res;
      if (j == 0) p.lse[row * p.num_heads + head] = l > 0.f ? mx + __log2f(l) : -INFINITY;
    } else {
      p.out[(int64_t)b * p.out_width + col] = res;
      if (j == 0 && p.lse != nullptr)
        p.lse[(int64_t)b * p.num_heads + head] =
            l > 0.f ? (mx + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
  }
}

// Merge split partials: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) per head;
// grid (B, H), one thread per value column of the head (r_v columns).
__global__ void reduce_kernel(const float* __restrict__ po, const float* __restrict__ plse,
                              float* __restrict__ out, float* __restrict__ lse, int num_splits,
                              int num_heads, int out_width, int rv) {
  const int b = blockIdx.x, head = blockIdx.y;
  const int64_t base = (int64_t)b * num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, plse[(base + s) * num_heads + head]);
  for (int j = threadIdx.x; j < rv; j += blockDim.x) {
    float den = 0.f, num = 0.f;
    if (mx != -INFINITY) {
      for (int s = 0; s < num_splits; ++s) {
        const float w = exp2f(plse[(base + s) * num_heads + head] - mx);
        den += w;
        if (w > 0.f) num += w * po[(base + s) * out_width + (int64_t)head * rv + j];
      }
    }
    out[(int64_t)b * out_width + (int64_t)head * rv + j] = den > 0.f ? num / den : 0.f;
    if (j == 0 && lse != nullptr)
      lse[(int64_t)b * num_heads + head] =
          den > 0.f ? (mx + __log2f(den)) * 0.6931471805599453f : -INFINITY;
  }
}

}  // namespace latent_decode

namespace latent_decode {

// Ranks with a compiled kernel (each a multiple of 16, <= 128); others take the
// Triton path (vllm_lowrank/kernels/cuda/ext.py: DECODE_RANKS).
#define LATENT_DECODE_RANKS(X, RK) X(RK, 16) X(RK, 32) X(RK, 48) X(RK, 64) X(RK, 96) X(RK, 128)
#define LATENT_DECODE_ALL(X)                                                        \
  LATENT_DECODE_RANKS(X, 16) LATENT_DECODE_RANKS(X, 32) LATENT_DECODE_RANKS(X, 48) \
  LATENT_DECODE_RANKS(X, 64) LATENT_DECODE_RANKS(X, 96) LATENT_DECODE_RANKS(X, 128)

template <int RK, int RV, typename T>
cudaError_t launch_variant(const Params& p, dim3 grid, cudaStream_t stream, int device) {
  using C = Cfg<RK, RV>;
  // The >48 KB dynamic shared memory opt-in, once per device and kernel.
  static uint64_t attr_done = 0;
  if (!(attr_done >> device & 1)) {
    const cudaError_t err = cudaFuncSetAttribute(
        decode_kernel<RK, RV, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (err != cudaSuccess) return err;
    attr_done |= uint64_t(1) << device;
  }
  decode_kernel<RK, RV, T><<<grid, C::NW * 32, C::SMEM, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch(int rk, int rv, const Params& p, dim3 grid, cudaStream_t stream, int device) {
#define LATENT_DECODE_CASE(RK, RV) \
  if (rk == RK && rv == RV) return launch_variant<RK, RV, T>(p, grid, stream, device);
  LATENT_DECODE_ALL(LATENT_DECODE_CASE)
#undef LATENT_DECODE_CASE
  return cudaErrorInvalidValue;
}

cudaError_t launch(const Params& p, int rk, int rv, bool bf16, dim3 grid, cudaStream_t stream,
                   int device) {
  return bf16 ? dispatch<__nv_bfloat16>(rk, rv, p, grid, stream, device)
              : dispatch<__half>(rk, rv, p, grid, stream, device);
}

bool config(int rk, int rv, int64_t out[3]) {
#define LATENT_DECODE_CFG(RK, RV)                                                     \
  if (rk == RK && rv == RV) {                                                         \
    out[0] = Cfg<RK, RV>::NW; out[1] = Cfg<RK, RV>::STAGES; out[2] = Cfg<RK, RV>::SMEM; \
    return true;                                                                      \
  }
  LATENT_DECODE_ALL(LATENT_DECODE_CFG)
#undef LATENT_DECODE_CFG
  return false;
}

cudaError_t reduce(const float* po, const float* plse, float* out, float* lse, int batch,
                   int num_splits, int num_heads, int out_width, int rv, cudaStream_t stream) {
  reduce_kernel<<<dim3((unsigned)batch, (unsigned)num_heads), (unsigned)((rv + 31) / 32 * 32), 0,
                  stream>>>(po, plse, out, lse, num_splits, num_heads, out_width, rv);
  return cudaGetLastError();
}

}  // namespace latent_decode
