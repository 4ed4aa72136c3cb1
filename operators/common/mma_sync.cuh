// SM80-class building blocks the hand-written mma.sync kernels share (the short-key attention
// kernels, the wgmma attention backward's loads, the conv stem's row-window forward and weight
// gradient): 16-byte cp.async copies (zero-filled where not valid), ldmatrix, mma.sync m16n8k16 with fp32
// accumulation (CUTLASS's cutlass::arch::Mma on our registers) and two floats packed as 16-bit pairs.
// sm_80 and later: sm_89 and sm_90 both run them.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/arch/mma_sm80.h"
#include "cutlass/numeric_types.h"

namespace cvt_kernel {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared by cp.async; zero-filled where !valid (nothing is read from src then).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(smem_u32(dst), src, valid);
}

// 16 bytes into shared memory of which the first `bytes` (0 .. 16) come from src, the rest zeros.
__device__ __forceinline__ void cp_async16_head(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// acc += a * (b0, b1): one mma.sync m16n8k16 with fp32 accumulation (a: the A fragment's four
// 32-bit pairs, b0 / b1: the B fragment's two).
template <class E>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using Op = cutlass::arch::Mma<cutlass::gemm::GemmShape<16, 8, 16>, 32, E, cutlass::layout::RowMajor, E,
                                cutlass::layout::ColumnMajor, float, cutlass::layout::RowMajor,
                                cutlass::arch::OpMultiplyAdd>;
  const uint32_t b[2] = {b0, b1};
  auto& acc = *reinterpret_cast<typename Op::FragmentC*>(c);
  Op{}(acc, *reinterpret_cast<const typename Op::FragmentA*>(a), *reinterpret_cast<const typename Op::FragmentB*>(b),
       acc);
}

// Two floats as a pair of 16-bit elements, the first in the low half (the lower column).
template <class E>
__device__ __forceinline__ uint32_t pack(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack<cutlass::bfloat16_t>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack<cutlass::half_t>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace cvt_kernel
