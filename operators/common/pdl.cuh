// Programmatic dependent launch (PDL, sm_90) for the project's own kernels.
//
// A kernel launched by launch_kernel() below may be scheduled while the kernel before it on the
// stream is still running (once every block of that kernel has executed
// griddepcontrol.launch_dependents or exited). So each such kernel starts with pdl_enter():
// griddepcontrol.wait blocks until the previous grid has completed and its memory is visible
// (before any read or write of memory that kernel touches), then griddepcontrol.launch_dependents
// lets the next kernel be scheduled in turn. What overlaps is the next kernel's launch and block
// scheduling with this one's last wave, never its memory accesses. Both instructions are no-ops
// in a kernel launched without PDL and below sm_90.
//
// Libraries built for sm_90 / sm_90a launch with PDL (host code sees __CUDA_ARCH_LIST__, the one
// target each library is built for); CVT_CUTLASS_PDL=0 in the environment launches them plainly
// (the same code: an A/B of the launch attribute alone). It does not reach the GEMMs whose names
// end in _pdl (CUTLASS's own PDL, common/universal.cuh), which launch with it either way.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace cvt_kernel {

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH_LIST__) && __CUDA_ARCH_LIST__ >= 900
constexpr bool kPdlTarget = true;
#else
constexpr bool kPdlTarget = false;
#endif

// Whether this library launches with PDL: its target is sm_90+ and CVT_CUTLASS_PDL is not "0"
// (read once per library).
inline bool pdl_on() {
  static const bool on = [] {
    const char* v = std::getenv("CVT_CUTLASS_PDL");
    return kPdlTarget && !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL where pdl_on(); the kernel must begin
// with pdl_enter(). The launch's error is left for cudaPeekAtLastError / cudaGetLastError.
template <class... P, class... A>
inline void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_on() ? 1 : 0;
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

}  // namespace cvt_kernel
