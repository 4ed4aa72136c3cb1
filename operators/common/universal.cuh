// The launch of a CUTLASS 3.x universal kernel (GemmUniversal / ConvUniversal) once its
// shared-memory attribute is set (smem_ready): the kernel's workspace, its params, the device
// adapter's run on `stream` (GEMMs: with programmatic dependent launch when kPdl). A run that fails
// leaves no sticky error behind; the status says which step failed.
#pragma once
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "common/abi.h"

namespace cvt_kernel {

// init_workspace false: the caller has already prepared the workspace as initialize_workspace
// would (a kernel launched before this one zeroed it).
template <class Kernel, class Adapter, bool kPdl = false>
int run_universal(const typename Kernel::Arguments& args, void* workspace, cudaStream_t stream,
                  bool init_workspace = true) {
  if (init_workspace && Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    return CVT_ERR_INIT;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  cutlass::Status st;
  if constexpr (kPdl)
    st = Adapter::run(params, stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/true);
  else
    st = Adapter::run(params, stream);
  if (st != cutlass::Status::kSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
