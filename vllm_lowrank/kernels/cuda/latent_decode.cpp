// The torch binding of the pre-RoPE latent decode kernel (latent_decode.cu): checks the
// tensors, fills the launch parameters and launches on torch's current stream.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "latent_decode.h"

// (warps per CTA, pipeline stages, dynamic shared memory bytes) of the (r_k, r_v)
// kernel, or (0, 0, 0) when no kernel is compiled for these ranks.
std::vector<int64_t> latent_decode_config(int64_t rk, int64_t rv) {
  int64_t cfg[3] = {0, 0, 0};
  latent_decode::config((int)rk, (int)rv, cfg);
  return {cfg[0], cfg[1], cfg[2]};
}

// See vllm_lowrank/kernels/cuda/ext.py: latent_decode_pre_rope (checks, shapes, dtypes).
void latent_decode_pre_rope(torch::Tensor query, torch::Tensor cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, torch::Tensor bkt, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor out, c10::optional<torch::Tensor> lse,
                            int64_t num_splits, double qk_scale, bool gptj) {
  using namespace latent_decode;
  TORCH_CHECK(query.is_cuda() && query.dim() == 3 && query.size(2) == kHeadDim &&
              query.stride(2) == 1, "query must be CUDA [B, H, 128], last dim contiguous");
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 1 && cache.stride(3) == 1 &&
              cache.scalar_type() == query.scalar_type(),
              "cache must be [num_blocks, 1, block_size, Rk + Rv] in the query dtype, "
              "last dim contiguous");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kHalf,
              "query / cache must be bfloat16 or float16");
  TORCH_CHECK(bkt.dim() == 3 && bkt.size(1) == kHeadDim && bkt.is_contiguous() &&
              bkt.scalar_type() == query.scalar_type(),
              "key weights must be contiguous [num_groups, 128, r_k] in the cache dtype");
  const int64_t B = query.size(0), H = query.size(1), ng = bkt.size(0), rk = bkt.size(2);
  const int64_t page = cache.size(2);
  TORCH_CHECK(ng > 0 && H % ng == 0 && H / ng <= 8, "num_heads must be num_groups x (<= 8)");
  TORCH_CHECK((cache.size(3) - ng * rk) % ng == 0, "cache slot width is not Rk + num_groups * r_v");
  const int64_t rv = (cache.size(3) - ng * rk) / ng;
  TORCH_CHECK(page >= 16 && (page & (page - 1)) == 0, "block_size must be a power of two >= 16");
  TORCH_CHECK(cache.stride(0) * cache.element_size() < (int64_t(1) << 32),
              "cache block stride must be under 4 GiB (the kernel keeps in-block byte offsets in 32 bits)");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1 &&
              seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
              seq_lens.numel() == B, "block_table [B, max_blocks] / seq_lens [B] must be int32");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.dim() == 2 && cos.size(1) == kHeadDim / 2 && cos.sizes() == sin.sizes() &&
              cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0) &&
              cos.stride(0) % 4 == 0 && (uintptr_t)cos.data_ptr() % 16 == 0 &&
              (uintptr_t)sin.data_ptr() % 16 == 0,
              "cos/sin must be float32 [max_pos, 64] with 16-byte aligned rows");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == B &&
              out.size(1) == H * rv, "out must be contiguous float32 [B, H * r_v]");
  TORCH_CHECK(!lse.has_value() || (lse->scalar_type() == torch::kFloat32 && lse->is_contiguous() &&
              lse->numel() == B * H), "lse must be contiguous float32 [B, H]");
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1");
  const c10::cuda::CUDAGuard guard(query.device());
  if (B == 0) return;
  Params p{};
  p.query = query.data_ptr(); p.s_qb = query.stride(0); p.s_qh = query.stride(1);
  p.cache = cache.data_ptr(); p.s_blk = cache.stride(0); p.s_tok = cache.stride(2);
  p.block_table = block_table.data_ptr<int>(); p.s_bt = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.bkt = bkt.data_ptr();
  p.cos = cos.data_ptr<float>(); p.sin = sin.data_ptr<float>();
  p.s_rope = cos.stride(0); p.max_pos = (int)cos.size(0);
  int shift = 0;
  while ((int64_t(1) << shift) < page) ++shift;
  p.page_shift = shift;
  p.heads_per_group = (int)(H / ng); p.num_heads = (int)H; p.num_splits = (int)num_splits;
  p.out_width = (int)(H * rv); p.k_width = (int)(ng * rk);
  p.qk_scale = (float)qk_scale; p.gptj = gptj ? 1 : 0;
  torch::Tensor po, plse;
  if (num_splits > 1) {
    po = torch::empty({B, num_splits, H * rv}, out.options());
    plse = torch::empty({B, num_splits, H}, out.options());
    p.out = po.data_ptr<float>(); p.lse = plse.data_ptr<float>();
  } else {
    p.out = out.data_ptr<float>(); p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  const int device = query.get_device();
  const dim3 grid((unsigned)num_splits, (unsigned)ng, (unsigned)B);
  int64_t cfg[3];
  TORCH_CHECK(config((int)rk, (int)rv, cfg), "no compiled decode kernel for r_k = ", rk,
              ", r_v = ", rv);
  C10_CUDA_CHECK(launch(p, (int)rk, (int)rv, query.scalar_type() == torch::kBFloat16, grid,
                        stream, device));
  if (num_splits > 1) {
    C10_CUDA_CHECK(reduce(po.data_ptr<float>(), plse.data_ptr<float>(), out.data_ptr<float>(),
                          lse.has_value() ? lse->data_ptr<float>() : nullptr, (int)B,
                          (int)num_splits, (int)H, (int)(H * rv), (int)rv, stream));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("latent_decode_config", &latent_decode_config,
        "(warps, stages, smem bytes) of the pre-RoPE decode kernel for (r_k, r_v)");
  m.def("latent_decode_pre_rope", &latent_decode_pre_rope,
        "pre-RoPE decode attention over a bf16/fp16 latent cache (mma.sync)");
}
