// The attention kernels' global -> shared copies (short_common.cuh, wgmma_bwd.cuh): a generic
// pointer's shared-window address and 16 bytes by cp.async, zero-filled where !valid (nothing is
// read from src then).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace cvt_kernel {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(smem_u32(dst), src, valid);
}

}  // namespace cvt_kernel
