// A chain of dependent kernels, each reading the buffer the one before it wrote, launched plainly
// or with programmatic dependent launch (PDL): what PDL saves per kernel boundary on this GPU, in a
// CUDA graph and eagerly, for kernels of a few microseconds (the size of a CvT kernel at batch 1,
// and of the small passes of a training step). Built with nvcc into a shared library by
// .ci/pdl_probe.py, which calls it through ctypes (no torch headers).
#include <cuda_runtime.h>

#include <cstdint>

namespace {

// trigger: 0 none (the dependents start when this grid ends), 1 at the start of each block,
// 2 after each block's work. Every kernel waits for its prerequisite grid before touching memory.
__global__ void chain_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t n, int trigger) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (trigger == 1) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) out[i] = in[i] * 1.0001f + 1.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (trigger == 2) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace

// `count` kernels on `stream`: kernel i reads buffer i % 2 and writes the other; 0, or the first
// failed launch's CUDA error.
extern "C" int run_chain(float* a, float* b, int64_t n, int64_t count, int blocks, int threads, int pdl,
                         int trigger, void* stream) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(blocks));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  float* buf[2] = {a, b};
  for (int64_t i = 0; i < count; ++i) {
    const cudaError_t e = cudaLaunchKernelEx(&cfg, chain_kernel, static_cast<const float*>(buf[i % 2]),
                                             buf[(i + 1) % 2], n, trigger);
    if (e != cudaSuccess) return int(e);
  }
  return 0;
}
