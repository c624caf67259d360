// The host interface of latent_decode.cu (its kernels, compiled without torch) for
// the torch binding latent_decode.cpp: the launch parameters and three calls. Kept
// apart so that nvcc never parses torch's headers (they took most of the build).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace latent_decode {

constexpr int kHeadDim = 128;

struct Params {
  const void* query;            // [B, H, 128] cache dtype
  int64_t s_qb, s_qh;
  const void* cache;            // [num_blocks, 1, page, Rk + Rv] cache dtype
  int64_t s_blk, s_tok;         // element strides
  const int* block_table;       // [B, max_blocks]
  int64_t s_bt;
  const int* seq_lens;          // [B]
  const void* bkt;              // [num_groups, 128, r_k] cache dtype: B_k^T, gptj-permuted
  const float* cos;             // [max_pos, 64]
  const float* sin;
  int64_t s_rope;
  int max_pos;
  float* out;                   // no split: [B, out_width]; split: partials [B, S, out_width]
  float* lse;                   // no split: [B, H] natural log or null; split: [B, S, H] base 2
  int page_shift;               // log2(block_size)
  int heads_per_group;          // <= 8
  int num_heads;
  int num_splits;
  int out_width;
  int k_width;                  // Rk (first value column)
  float qk_scale;               // scale * log2(e)
  int gptj;
};

// Launch the (r_k, r_v) kernel for bf16 (else fp16) latents on grid (splits, head
// groups, sequences) of `stream`: the launch's error, cudaErrorInvalidValue when no
// kernel is compiled for the pair.
cudaError_t launch(const Params& p, int rk, int rv, bool bf16, dim3 grid, cudaStream_t stream,
                   int device);

// (warps per CTA, pipeline stages, dynamic shared memory bytes) of the (r_k, r_v)
// kernel into `out`; false when none is compiled.
bool config(int rk, int rv, int64_t out[3]);

// Merge `num_splits` partials po [B, S, out_width] / plse [B, S, H] (base-2 log-sum-exp)
// into out [B, out_width] and, if not null, lse [B, H] (natural log).
cudaError_t reduce(const float* po, const float* plse, float* out, float* lse, int batch,
                   int num_splits, int num_heads, int out_width, int rv, cudaStream_t stream);

}  // namespace latent_decode
