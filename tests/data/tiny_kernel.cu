// The smallest kernel library the build tests compile (tests/test_build.py): one kernel and the
// library's info record.
#include "common/abi.h"

__global__ void k(float* x) { x[threadIdx.x] = 1.f; }

extern "C" CVT_EXPORT const cvt_kernel_info* cvt_kernel_info_get(void) {
  static const cvt_kernel_info info = {CVT_KERNEL_ABI_VERSION, CVT_FAMILY_GEMM, 80, "tiny"};
  return &info;
}
