// Stand-in for cuRAND's device header, searched after every real include directory
// (-idirafter): CUTLASS example 41's kernel_forward.h includes <curand_kernel.h> unconditionally
// but uses it only for dropout under HAS_PYTORCH, which cvt_cutlass never defines (its attention
// instantiations have kSupportsDropout = false). Toolkits without cuRAND (e.g. a minimal CUDA 13
// install) then still compile them; where cuRAND exists, its header is found first.
#pragma once

// Example 41's backward names the Philox state in the signatures of functions that dropout uses
// (kApplyDropout = false in every cvt_cutlass instantiation), so the names must exist; calling
// any of them is a bug and traps.
#if defined(__CUDACC__)
struct curandStatePhilox4_32_10_t {
  unsigned int state[16];
};
__device__ inline void curand_init(unsigned long long, unsigned long long, unsigned long long,
                                   curandStatePhilox4_32_10_t*) {
  __trap();
}
__device__ inline void skipahead(unsigned long long, curandStatePhilox4_32_10_t*) { __trap(); }
__device__ inline float4 curand_uniform4(curandStatePhilox4_32_10_t*) {
  __trap();
  return float4{};
}
#endif
