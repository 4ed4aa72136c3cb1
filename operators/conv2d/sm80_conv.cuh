// The CUTLASS 2.x headers of the SM80-class conv kernels (fprop_sm80.cuh, dgrad_sm80.cuh,
// wgrad_sm80.cuh): implicit-GEMM convolution kernels and their device wrapper, the
// LinearCombination epilogue, the conv ABI and the shared device helpers. One list, in an order
// CUTLASS compiles (cutlass.h first).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "conv2d/abi.h"
#include "common/device.cuh"

namespace cvt_kernel {

// Launches a CUTLASS 2.x implicit-GEMM conv kernel directly (ImplicitGemmConvolution's
// initialize/run set the shared-memory attribute on every call): the attribute once per device,
// then the kernel on `stream`. `semaphore`: the serial split-K semaphores in the workspace, or null.
template <class ConvKernel>
int launch_sm80_conv(const typename ConvKernel::Arguments& arguments, void* semaphore, int device_id,
                     cudaStream_t stream) {
  constexpr int kSmem = int(sizeof(typename ConvKernel::SharedStorage));
  if (!smem_ready<ConvKernel>(reinterpret_cast<const void*>(cutlass::Kernel<ConvKernel>), kSmem, device_id))
    return CVT_ERR_SMEM;
  typename ConvKernel::Params params(arguments, static_cast<int*>(semaphore));
  typename ConvKernel::ThreadblockSwizzle swizzle;
  dim3 grid = swizzle.get_grid_shape(params.grid_tiled_shape);
  dim3 block(ConvKernel::kThreadCount, 1, 1);
  cutlass::Kernel<ConvKernel><<<grid, block, kSmem, stream>>>(params);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
