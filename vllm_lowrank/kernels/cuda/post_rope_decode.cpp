// The torch binding of the post-RoPE-keys decode kernel (post_rope_decode.cu): checks
// the tensors, fills the launch parameters and launches on torch's current stream.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "post_rope_decode.h"

// (warps per CTA, stages per warp, dynamic shared memory bytes, exact positions per
// tile, CTAs resident per SM) of the (kct, v_bits, value rank rv) kernel; an error when
// none is compiled.
std::vector<int64_t> post_rope_config(int64_t kct, int64_t v_bits, int64_t rv) {
  int64_t cfg[5];
  TORCH_CHECK(prk_decode::config((int)kct, (int)v_bits, (int)rv, cfg),
              "no compiled post-RoPE-keys kernel for key groups of ", kct, ", ", v_bits,
              "-bit values and value rank ", rv);
  return std::vector<int64_t>(cfg, cfg + 5);
}

// See vllm_lowrank/kernels/cuda/ext.py: post_rope_decode (the Python checks, shapes,
// and the merge of the split partials). layout: [v_codes_off, v_scale_off, v_zero_off,
// share_off, share, k_width, ex_vcodes_off, ex_kscale_off, ex_kzero_off, ex_vscale_off,
// ex_vzero_off, sink, recent (window + 1), kct, v_bits, qpk].
void post_rope_decode(torch::Tensor query, torch::Tensor cache, torch::Tensor block_table,
                      torch::Tensor exact, torch::Tensor exact_table, torch::Tensor seq_lens,
                      torch::Tensor lift_t, torch::Tensor vsum, torch::Tensor out,
                      c10::optional<torch::Tensor> plse, std::vector<int64_t> layout,
                      int64_t num_splits, double qk_scale) {
  using namespace prk_decode;
  TORCH_CHECK(layout.size() == 16, "layout must hold 16 integers");
  TORCH_CHECK(query.is_cuda() && query.dim() == 3 && query.size(2) == kD && query.stride(2) == 1 &&
              query.stride(0) % 8 == 0 && query.stride(1) % 8 == 0 &&
              reinterpret_cast<uintptr_t>(query.data_ptr()) % 16 == 0,
              "query must be CUDA [T, H, 128] with 16-byte aligned rows");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 || query.scalar_type() == torch::kHalf,
              "query must be bfloat16 or float16");
  TORCH_CHECK(cache.scalar_type() == torch::kUInt8 && cache.dim() == 4 && cache.stride(3) == 1 &&
              cache.stride(2) % 16 == 0 && cache.stride(0) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0,
              "latent cache must be uint8 [num_blocks, 1, block_size, slot] with 16-byte aligned slots");
  TORCH_CHECK(exact.scalar_type() == torch::kUInt8 && exact.dim() == 4 && exact.stride(3) == 1 &&
              exact.stride(2) % 16 == 0 && exact.stride(0) % 16 == 0 &&
              reinterpret_cast<uintptr_t>(exact.data_ptr()) % 16 == 0,
              "exact cache must be uint8 [num_blocks, 1, block_size, slot] with 16-byte aligned slots");
  const int64_t B = seq_lens.numel(), H = query.size(1);
  TORCH_CHECK(query.size(0) == B, "one query row per sequence");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1 &&
              exact_table.scalar_type() == torch::kInt32 && exact_table.stride(1) == 1 &&
              seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "block tables [B, max_blocks] and seq_lens [B] must be int32");
  const int64_t nkv = lift_t.size(0), qpk = layout[15];
  TORCH_CHECK(lift_t.scalar_type() == torch::kHalf && lift_t.is_contiguous() && lift_t.dim() == 3 &&
              lift_t.size(1) == kD, "lift_t must be contiguous f16 [num_kv_heads, 128, value rank]");
  const int64_t rv = lift_t.size(2);   // the value rank
  TORCH_CHECK(vsum.scalar_type() == torch::kFloat32 && vsum.is_contiguous() && vsum.numel() == nkv * kD,
              "vsum must be contiguous f32 [num_kv_heads, 128]");
  TORCH_CHECK(qpk >= 1 && qpk <= kMaxQ && H == nkv * qpk, "num_heads must be num_kv_heads x (<= 8)");
  TORCH_CHECK(num_splits >= 1, "num_splits must be >= 1");
  TORCH_CHECK(out.is_contiguous() && out.is_cuda(), "out must be contiguous");
  if (num_splits > 1) {
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.numel() == B * num_splits * H * kD &&
                plse.has_value() && plse->scalar_type() == torch::kFloat32 && plse->is_contiguous() &&
                plse->numel() == B * num_splits * H,
                "with several splits out is f32 [B, S, H * 128] and plse f32 [B, S, H]");
  } else {
    TORCH_CHECK(out.numel() == B * H * kD, "out must be [B, H * 128]");
  }
  int out_kind = 0;
  if (out.scalar_type() == torch::kBFloat16) out_kind = 1;
  else if (out.scalar_type() == torch::kHalf) out_kind = 2;
  else TORCH_CHECK(out.scalar_type() == torch::kFloat32, "out must be float32, bfloat16 or float16");
  const c10::cuda::CUDAGuard guard(query.device());
  if (B == 0) return;
  Params p{};
  p.query = query.data_ptr(); p.s_qb = query.stride(0); p.s_qh = query.stride(1);
  p.q_bf16 = query.scalar_type() == torch::kBFloat16;
  p.cache = cache.data_ptr<uint8_t>(); p.s_blk = cache.stride(0); p.s_tok = cache.stride(2);
  p.block_table = block_table.data_ptr<int>(); p.s_bt = block_table.stride(0);
  const int64_t page = cache.size(2), epage = exact.size(2);
  // vLLM enlarges the latent cache's blocks to the exact cache's page (an integer
  // multiple of the configured block size, not always a power of two)
  TORCH_CHECK(page > 0 && epage > 0 && page % layout[13] == 0,
              "the latent cache's block size must be a multiple of the key group");
  p.page = (int)page;
  p.epage = (int)epage;
  p.exact = exact.data_ptr<uint8_t>(); p.s_eblk = exact.stride(0); p.s_etok = exact.stride(2);
  p.exact_table = exact_table.data_ptr<int>(); p.s_ebt = exact_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int>();
  p.lift_t = reinterpret_cast<const __half*>(lift_t.data_ptr<at::Half>());
  p.vsum = vsum.data_ptr<float>();
  p.v_codes_off = (int)layout[0]; p.v_scale_off = (int)layout[1]; p.v_zero_off = (int)layout[2];
  p.share_off = (int)layout[3]; p.share = (int)layout[4]; p.k_width = (int)layout[5];
  p.ex_vcodes_off = (int)layout[6]; p.ex_kscale_off = (int)layout[7]; p.ex_kzero_off = (int)layout[8];
  p.ex_vscale_off = (int)layout[9]; p.ex_vzero_off = (int)layout[10];
  p.sink = (int)layout[11]; p.recent = (int)layout[12];
  const int64_t kct = layout[13], v_bits = layout[14];
  TORCH_CHECK(p.share > 0 && p.share % 16 == 0 && p.share_off % 16 == 0 && p.v_codes_off % 16 == 0,
              "key share and value codes must be 16-byte aligned");
  TORCH_CHECK(page % kct == 0 && p.sink % kct == 0, "key groups must tile the block and the sinks");
  p.qpk = (int)qpk; p.num_heads = (int)H; p.num_splits = (int)num_splits;
  p.qk_scale = (float)qk_scale;
  p.out = out.data_ptr(); p.out_kind = out_kind;
  p.plse = num_splits > 1 ? plse->data_ptr<float>() : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  const int device = query.get_device();
  const dim3 grid((unsigned)num_splits, (unsigned)nkv, (unsigned)B);
  post_rope_config(kct, v_bits, rv);   // the variant exists
  C10_CUDA_CHECK(launch(p, (int)kct, (int)v_bits, (int)rv, grid, stream, device));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("post_rope_decode", &post_rope_decode,
        "token-adaptive decode of post-RoPE 4-bit key codes and value latents (mma.sync)");
  m.def("post_rope_config", &post_rope_config,
        "(warps, stages, shared memory bytes, exact tile rows, CTAs per SM) of a variant");
}
