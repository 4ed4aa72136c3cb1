// Kernels that build TMA descriptors (the sm_90a GEMM, conv and attention kernels) include this
// before any CUTLASS header. Without CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, CUTLASS looks the
// driver's descriptor encoders up by name (cudaGetDriverEntryPointByVersion) for every descriptor
// of every launch; with it, CUTLASS calls them directly, and these definitions (hidden, like every
// symbol of a kernel library but its ABI) look each one up once. No link against libcuda is needed.
#pragma once
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
namespace cvt_kernel {
template <class Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}
}  // namespace cvt_kernel
extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides, CUtensorMapInterleave il,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const auto fn = cvt_kernel::driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn ? fn(map, type, rank, address, dims, strides, box, element_strides, il, swizzle, l2, oob)
            : CUDA_ERROR_NOT_FOUND;
}
extern "C" CUresult CUDAAPI cuTensorMapEncodeIm2col(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const int* lower, const int* upper, cuuint32_t channels, cuuint32_t pixels,
    const cuuint32_t* element_strides, CUtensorMapInterleave il, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const auto fn = cvt_kernel::driver_entry<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
  return fn ? fn(map, type, rank, address, dims, strides, lower, upper, channels, pixels, element_strides, il,
                 swizzle, l2, oob)
            : CUDA_ERROR_NOT_FOUND;
}
namespace cvt_kernel {
// The driver has the descriptor encoders (checked by can_implement: CUTLASS ignores a failed encode
// in release builds and would launch with a garbage descriptor).
inline bool tma_ready() {
  static const bool ok = driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled") != nullptr;
  return ok;
}
}  // namespace cvt_kernel
