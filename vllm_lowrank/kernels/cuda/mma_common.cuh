// Device helpers shared by the CUDA decode kernels of this directory
// (latent_decode.cu, post_rope_decode.cu): cp.async copies, ldmatrix / movmatrix,
// the f16 m16n8k16 mma.sync and half2 <-> 32-bit register views (sm_80+).
//
// Fragment layouts of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for
// mma.m16n8k16"), lane = 4 * gr + tc (gr = lane / 4, tc = lane % 4):
//   A (16 x 16, row): a0 (row gr, cols 2tc, 2tc+1), a1 (row gr+8, same cols),
//                     a2 (row gr, cols 2tc+8, 2tc+9), a3 (row gr+8, cols 2tc+8, 2tc+9)
//   B (16 x 8, col):  b0 (rows 2tc, 2tc+1, col gr), b1 (rows 2tc+8, 2tc+9, col gr)
//   C (16 x 8, f32):  c0, c1 (row gr, cols 2tc, 2tc+1), c2, c3 (row gr+8, same cols)
// Each 32-bit register holds the lower column (A) / row (B) in its low half.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace lowrank_mma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes 0 zero-fills without reading.
// L2_LINE: ask L2 to fetch the whole aligned 128-byte line around src (the
// `.L2::128B` prefetch-size hint), for sections narrower than a line, whose
// neighbours (the adjacent KV heads' latents of the same token) the CTAs of those
// heads read at about the same time: DRAM then serves whole lines instead of
// 32/64-byte pieces (H200, 16 x 32k, r = 32: 223 -> 209 us). Off for sections of
// a line or more (r >= 64): there it gained nothing (307 -> 305-306 us at 16 x 32k,
// r = 64; benchmarks/decode_attention_notes.md in git history).
template <bool L2_LINE = false>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  if (L2_LINE)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
// 4-byte global -> shared copy (through L1); src_bytes 0 zero-fills without reading.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// Transpose of an 8 x 8 matrix of 16-bit elements held one row pair per lane
// (C layout of rows 0-7, cols 2tc, 2tc+1 packed): lane (gr, tc) receives
// elements (2tc, gr) and (2tc + 1, gr), the B layout of the transposed block.
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// D += A B, f16 operands, f32 accumulators (layouts above).
__device__ __forceinline__ void mma_f16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t h2_bits(__half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __half2 bits_h2(uint32_t v) { return *reinterpret_cast<__half2*>(&v); }

}  // namespace lowrank_mma
