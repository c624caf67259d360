// The host interface of post_rope_decode.cu (its kernels, compiled without torch) for
// the torch binding post_rope_decode.cpp: the launch parameters and two calls. Kept
// apart so that nvcc never parses torch's headers (they took most of the build).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace prk_decode {

constexpr int kD = 128;      // head_dim, and the largest value rank RV
constexpr int kNW = 4;       // warps per CTA
constexpr int kStages = 2;   // pipeline stages per warp
constexpr int kEB = 32;      // exact positions per tile (one per lane)
constexpr int kMaxQ = 8;     // query heads per KV head (the mma's n)

struct Params {
  const void* query;            // [T, H, 128] bf16 / fp16, last dim contiguous
  int64_t s_qb, s_qh;           // element strides
  int q_bf16;
  const uint8_t* cache;         // latent cache [num_blocks, 1, page, slot] uint8
  int64_t s_blk, s_tok;         // byte strides
  const int* block_table;       // [B, max_blocks]
  int64_t s_bt;
  int page;                     // block size of the latent cache (a multiple of KCT)
  const uint8_t* exact;         // exact cache [num_blocks, 1, epage, exact slot] uint8
  int64_t s_eblk, s_etok;
  const int* exact_table;
  int64_t s_ebt;
  int epage;                    // block size of the exact cache
  const int* seq_lens;          // [B]
  const __half* lift_t;         // [num_kv_heads, 128 (d), RV (r)]: lift^T per KV head
  const float* vsum;            // [num_kv_heads, 128]: the lift's column sums
  // latent slot (bytes): value codes, value scales, value zeros, key share region
  int v_codes_off, v_scale_off, v_zero_off, share_off, share;
  int k_width;                  // Rk = num_kv_heads * 128 (the zeros' stream offset / 2)
  // int8 exact slot (bytes)
  int ex_vcodes_off, ex_kscale_off, ex_kzero_off, ex_vscale_off, ex_vzero_off;
  int qpk, num_heads, num_splits;
  int sink, recent;             // recent: the window + 1 (this step's token)
  float qk_scale;               // scale * log2(e)
  void* out;                    // one split: [B, H * 128] (out_kind); else f32 [B, S, H * 128]
  int out_kind;                 // 0 float32, 1 bfloat16, 2 float16
  float* plse;                  // several splits: [B, S, H] base-2 log-sum-exp
};

// Launch the (kct, v_bits, value rank rv) kernel on grid (splits, KV heads, sequences)
// of `stream`: the launch's error, cudaErrorInvalidValue when none is compiled for it.
cudaError_t launch(const Params& p, int kct, int v_bits, int rv, dim3 grid, cudaStream_t stream,
                   int device);

// (warps per CTA, stages per warp, dynamic shared memory bytes, exact positions per
// tile, CTAs resident per SM) of the (kct, v_bits, rv) kernel into `out`; false when
// none is compiled.
bool config(int kct, int v_bits, int rv, int64_t out[5]);

}  // namespace prk_decode
