// Dequantize packed low-bit latents inside the latent matmuls of decode attention.
//
// Format: vllm_lowrank/quantization.py (SlotLayout). One token's slot (uint8):
//   [ K codes | V codes | K scales | K zeros | V scales | V zeros ]
// codes packed little-endian at BITS in {8, 4, 3, 2} (8 codes fill BITS bytes),
// scale/zero float16 per quantization group of `qg` channels; value = code*scale+zero.
// Byte offsets are arbitrary (no alignment assumed): every multi-byte quantity is
// assembled from byte loads.
//
// Two kernels, the two products of attention where no RoPE sits between the
// latent and the product (Palu sec. 4 / issue #4):
//   latent_scores: s[b, h, t] = scale * q~[b, h, :r_k] . deq(c_k[b, t])   (post-RoPE mode)
//                  (positions t >= seq_len get -inf, so a softmax can run over max_len)
//   latent_pv:     o[b, h, :r_v] += sum_t p[b, h, t] * deq(c_v[b, t])     (value path)
// Thread mapping (both): a token's row is split into octets of 8 channels; LPT
// consecutive lanes (a power of two, LPT*8 >= rank when rank <= 256) share one token,
// so a warp reads 32/LPT rows with consecutive bytes per row. Each thread decodes its
// octet once and uses it for every query head of the head group (4 per chunk).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 128;
constexpr int kHeadChunk = 4;

struct GroupDesc {   // one row of the int32 [num_groups, 6] table built in cuda_ext.py
  int code_off;      // byte offset of the group's codes in the slot
  int par_base;      // index of the group's first scale/zero pair
  int rank;          // channels (multiple of 8)
  int qg;            // channels per scale/zero pair
  int out_col;       // first output column of the group (latent_pv)
  int pad;
};

__device__ __forceinline__ float load_half_bytes(const uint8_t* p) {
  unsigned short bits = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
  return __half2float(__ushort_as_half(bits));
}

// Decode the 8 codes of octet `o` of a row starting at `codes` (BITS bytes per octet).
template <int BITS>
__device__ __forceinline__ void decode_octet(const uint8_t* __restrict__ codes, int o, int out[8]) {
  const uint8_t* p = codes + o * BITS;
  uint64_t w = 0;
#pragma unroll
  for (int i = 0; i < BITS; ++i) w |= (uint64_t)__ldg(p + i) << (8 * i);
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = (int)((w >> (k * BITS)) & ((1u << BITS) - 1));
}

__device__ __forceinline__ const uint8_t* slot_ptr(const uint8_t* cache, const int* bt_row,
                                                   int t, int page, int64_t s_blk, int64_t s_tok) {
  int blk = __ldg(bt_row + t / page);
  return cache + (int64_t)blk * s_blk + (int64_t)(t % page) * s_tok;
}

template <int BITS>
__device__ __forceinline__ void dequant_octet(const uint8_t* slot, const GroupDesc& gd, int o,
                                              int scale_off, int zero_off, float x[8]) {
  int c[8];
  decode_octet<BITS>(slot + gd.code_off, o, c);
  if (gd.qg % 8 == 0) {  // one scale/zero pair covers the whole octet
    const int pidx = gd.par_base + (o * 8) / gd.qg;
    const float s = load_half_bytes(slot + scale_off + 2 * pidx);
    const float z = load_half_bytes(slot + zero_off + 2 * pidx);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = (float)c[k] * s + z;
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    int pidx = gd.par_base + (o * 8 + k) / gd.qg;
    float s = load_half_bytes(slot + scale_off + 2 * pidx);
    float z = load_half_bytes(slot + zero_off + 2 * pidx);
    x[k] = (float)c[k] * s + z;
  }
}

__host__ __device__ inline int lanes_per_token(int rank) {
  int oct = rank / 8, l = 1;
  while (l < oct && l < 32) l <<= 1;
  return l;
}

// grid (ceil(max_len / tokens_per_block), num_groups, B), block kThreads.
template <int BITS>
__global__ void latent_scores_kernel(
    const float* __restrict__ q, int64_t s_qb, int64_t s_qh,
    const uint8_t* __restrict__ cache, int64_t s_blk, int64_t s_tok, int page,
    const int* __restrict__ block_table, int64_t s_bt, const int* __restrict__ seq_lens,
    const GroupDesc* __restrict__ groups, int scale_off, int zero_off,
    int heads_per_group, int max_len, int tokens_per_block, float scale,
    float* __restrict__ out /* [B, H, max_len] */) {
  const int b = blockIdx.z, g = blockIdx.y;
  const GroupDesc gd = groups[g];
  const int len = seq_lens[b];
  const int lpt = lanes_per_token(gd.rank);
  const int tok_per_pass = kThreads / lpt;
  const int sub = threadIdx.x % lpt, row = threadIdx.x / lpt;
  const int n_oct = gd.rank / 8;
  const int t0 = blockIdx.x * tokens_per_block;
  const int t1 = min(t0 + tokens_per_block, max_len);
  const int* bt_row = block_table + (int64_t)b * s_bt;
  const int H = gridDim.y * heads_per_group;
  float* out_b = out + (int64_t)b * H * max_len;

  for (int h0 = 0; h0 < heads_per_group; h0 += kHeadChunk) {
    // Every thread loops the same number of times (warp shuffles below).
    for (int tb = t0; tb < t1; tb += tok_per_pass) {
      const int t = tb + row;
      const bool live = t < t1 && t < len;
      float acc[kHeadChunk];
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j) acc[j] = 0.f;
      if (live) {
        const uint8_t* slot = slot_ptr(cache, bt_row, t, page, s_blk, s_tok);
        for (int o = sub; o < n_oct; o += lpt) {
          float x[8];
          dequant_octet<BITS>(slot, gd, o, scale_off, zero_off, x);
#pragma unroll
          for (int j = 0; j < kHeadChunk; ++j) {
            const int h = h0 + j;
            if (h < heads_per_group) {
              const float* qh = q + (int64_t)b * s_qb + (int64_t)(g * heads_per_group + h) * s_qh + o * 8;
#pragma unroll
              for (int k = 0; k < 8; ++k) acc[j] += __ldg(qh + k) * x[k];
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j)
        for (int m = lpt / 2; m > 0; m >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], m);
      if (sub == 0 && t < t1) {
#pragma unroll
        for (int j = 0; j < kHeadChunk; ++j) {
          const int h = h0 + j;
          if (h < heads_per_group)
            out_b[(int64_t)(g * heads_per_group + h) * max_len + t] =
                live ? acc[j] * scale : -INFINITY;
        }
      }
    }
  }
}

// grid (ceil(max_len / tokens_per_block), num_groups, B), block kThreads.
// out must be zero-filled: blocks add their chunk's contribution with atomics.
template <int BITS>
__global__ void latent_pv_kernel(
    const float* __restrict__ p, int64_t s_pb, int64_t s_ph,
    const uint8_t* __restrict__ cache, int64_t s_blk, int64_t s_tok, int page,
    const int* __restrict__ block_table, int64_t s_bt, const int* __restrict__ seq_lens,
    const GroupDesc* __restrict__ groups, int scale_off, int zero_off,
    int heads_per_group, int tokens_per_block, int out_width, float* __restrict__ out) {
  const int b = blockIdx.z, g = blockIdx.y;
  const GroupDesc gd = groups[g];
  const int len = seq_lens[b];
  const int lpt = lanes_per_token(gd.rank);
  const int tok_per_pass = kThreads / lpt;
  const int sub = threadIdx.x % lpt, row = threadIdx.x / lpt;
  const int lane = threadIdx.x % 32;
  const int n_oct = gd.rank / 8;
  const int t0 = blockIdx.x * tokens_per_block;
  const int t1 = min(t0 + tokens_per_block, len);
  if (t0 >= t1) return;  // whole block: no shuffles are skipped by part of a warp
  const int* bt_row = block_table + (int64_t)b * s_bt;

  for (int h0 = 0; h0 < heads_per_group; h0 += kHeadChunk) {
    for (int ob = 0; ob < n_oct; ob += lpt) {  // octet passes (rank > 8 * lpt)
      const int o = ob + sub;
      float acc[kHeadChunk][8];
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[j][k] = 0.f;
      if (o < n_oct) {
        for (int t = t0 + row; t < t1; t += tok_per_pass) {
          const uint8_t* slot = slot_ptr(cache, bt_row, t, page, s_blk, s_tok);
          float x[8];
          dequant_octet<BITS>(slot, gd, o, scale_off, zero_off, x);
#pragma unroll
          for (int j = 0; j < kHeadChunk; ++j) {
            const int h = h0 + j;
            if (h < heads_per_group) {
              const float pw = __ldg(p + (int64_t)b * s_pb + (int64_t)(g * heads_per_group + h) * s_ph + t);
#pragma unroll
              for (int k = 0; k < 8; ++k) acc[j][k] += pw * x[k];
            }
          }
        }
      }
      // Reduce over the tokens of a warp (lanes with equal `sub`), then one atomic
      // per (warp, channel, head).
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j)
#pragma unroll
        for (int k = 0; k < 8; ++k)
          for (int m = 16; m >= lpt; m >>= 1) acc[j][k] += __shfl_xor_sync(0xffffffffu, acc[j][k], m);
      if (lane < lpt && o < n_oct) {
#pragma unroll
        for (int j = 0; j < kHeadChunk; ++j) {
          const int h = h0 + j;
          if (h < heads_per_group) {
            float* dst = out + (int64_t)b * out_width + gd.out_col + h * gd.rank + o * 8;
#pragma unroll
            for (int k = 0; k < 8; ++k) atomicAdd(dst + k, acc[j][k]);
          }
        }
      }
    }
  }
}

void check_common(const torch::Tensor& cache, const torch::Tensor& block_table,
                  const torch::Tensor& seq_lens, const torch::Tensor& groups) {
  TORCH_CHECK(cache.is_cuda() && cache.scalar_type() == torch::kUInt8 && cache.dim() == 4,
              "cache must be a CUDA uint8 [num_blocks, 1, block_size, slot_bytes] tensor");
  TORCH_CHECK(cache.stride(3) == 1, "cache must be contiguous in its last dimension");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
              "block_table must be int32 with a contiguous last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(groups.scalar_type() == torch::kInt32 && groups.is_contiguous() &&
              groups.dim() == 2 && groups.size(1) == 6, "groups must be int32 [G, 6]");
}

#define DISPATCH_BITS(bits, ...)                                  \
  switch (bits) {                                                 \
    case 8: { constexpr int BITS = 8; __VA_ARGS__; break; }       \
    case 4: { constexpr int BITS = 4; __VA_ARGS__; break; }       \
    case 3: { constexpr int BITS = 3; __VA_ARGS__; break; }       \
    case 2: { constexpr int BITS = 2; __VA_ARGS__; break; }       \
    default: TORCH_CHECK(false, "bits must be 8, 4, 3 or 2, got ", bits); \
  }

}  // namespace

torch::Tensor latent_scores(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, torch::Tensor groups, int64_t bits,
                            int64_t scale_off, int64_t zero_off, int64_t heads_per_group,
                            int64_t max_len, double scale, int64_t tokens_per_block) {
  check_common(cache, block_table, seq_lens, groups);
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1,
              "q must be CUDA float32 [B, H, width] with a contiguous last dimension");
  const c10::cuda::CUDAGuard guard(q.device());
  const int B = q.size(0), H = q.size(1);
  const int G = groups.size(0);
  TORCH_CHECK(H == G * heads_per_group, "H != num_groups * heads_per_group");
  auto out = torch::empty({B, H, max_len}, q.options());
  if (B == 0 || max_len == 0) return out;
  dim3 grid((max_len + tokens_per_block - 1) / tokens_per_block, G, B);
  auto stream = at::cuda::getCurrentCUDAStream();
  DISPATCH_BITS(bits, latent_scores_kernel<BITS><<<grid, kThreads, 0, stream>>>(
      q.data_ptr<float>(), q.stride(0), q.stride(1), cache.data_ptr<uint8_t>(),
      cache.stride(0), cache.stride(2), (int)cache.size(2), block_table.data_ptr<int>(),
      block_table.stride(0), seq_lens.data_ptr<int>(),
      reinterpret_cast<const GroupDesc*>(groups.data_ptr<int>()), (int)scale_off,
      (int)zero_off, (int)heads_per_group, (int)max_len, (int)tokens_per_block,
      (float)scale, out.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor latent_pv(torch::Tensor p, torch::Tensor cache, torch::Tensor block_table,
                        torch::Tensor seq_lens, torch::Tensor groups, int64_t bits,
                        int64_t scale_off, int64_t zero_off, int64_t heads_per_group,
                        int64_t out_width, int64_t tokens_per_block) {
  check_common(cache, block_table, seq_lens, groups);
  TORCH_CHECK(p.is_cuda() && p.scalar_type() == torch::kFloat32 && p.dim() == 3 && p.stride(2) == 1,
              "p must be CUDA float32 [B, H, L] with a contiguous last dimension");
  const c10::cuda::CUDAGuard guard(p.device());
  const int B = p.size(0), H = p.size(1), L = p.size(2);
  const int G = groups.size(0);
  TORCH_CHECK(H == G * heads_per_group, "H != num_groups * heads_per_group");
  auto out = torch::zeros({B, out_width}, p.options());
  if (B == 0 || L == 0) return out;
  dim3 grid((L + tokens_per_block - 1) / tokens_per_block, G, B);
  auto stream = at::cuda::getCurrentCUDAStream();
  DISPATCH_BITS(bits, latent_pv_kernel<BITS><<<grid, kThreads, 0, stream>>>(
      p.data_ptr<float>(), p.stride(0), p.stride(1), cache.data_ptr<uint8_t>(),
      cache.stride(0), cache.stride(2), (int)cache.size(2), block_table.data_ptr<int>(),
      block_table.stride(0), seq_lens.data_ptr<int>(),
      reinterpret_cast<const GroupDesc*>(groups.data_ptr<int>()), (int)scale_off,
      (int)zero_off, (int)heads_per_group, (int)tokens_per_block, (int)out_width,
      out.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// csrc/latent_decode.cu
std::vector<int64_t> latent_decode_config(int64_t rk, int64_t rv);
void latent_decode_pre_rope(torch::Tensor query, torch::Tensor cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, torch::Tensor bkt, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor out, c10::optional<torch::Tensor> lse,
                            int64_t num_splits, double qk_scale, bool gptj);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("latent_scores", &latent_scores,
        "post-RoPE scores: scale * q~ . dequant(K latents), -inf past seq_len");
  m.def("latent_pv", &latent_pv, "value path: sum_t p[b,h,t] * dequant(V latents)");
  m.def("latent_decode_config", &latent_decode_config,
        "(warps, stages, smem bytes) of the pre-RoPE decode kernel for (r_k, r_v)");
  m.def("latent_decode_pre_rope", &latent_decode_pre_rope,
        "pre-RoPE decode attention over a bf16/fp16 latent cache (mma.sync)");
}
