// The Linear input gradient on the SM80-class GEMM: dX = dY . W (A = dY (M, N), B = the (N, K)
// weight read as a row-major K x N operand), times GELU' at the saved pre-activation or times the
// derivative the forward saved, and the bias-gradient row reduction, in its epilogue when the EVT
// asks. Cfg as for GemmSm80
// (linear/gemm_sm80.cuh), plus kReducesBias: CUTLASS's row-reduction visitor adds with fp32
// atomics, so dbias is summed in fp32 in the workspace's tail (zeroed first, passed as p.bias) and
// rounded into p.aux after the GEMM.
#pragma once
#include "linear/dgelu.cuh"
#include "linear/gemm_sm80.cuh"

namespace cvt_kernel {

template <class Element>
__global__ void round_dbias(const float* acc, Element* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = Element(acc[i]);
}

template <class Cfg>
struct DgradSm80 : GemmSm80<Cfg> {
  using Base = GemmSm80<Cfg>;
  using Element = typename Base::Element;
  static constexpr bool kReducesBias = Cfg::kReducesBias;

  static size_t gemm_workspace(const cvt_gemm_args& p) {
    return (Base::Gemm::get_workspace_size(Base::make_arguments(p)) + 255) / 256 * 256;
  }
  static size_t workspace_size(const cvt_gemm_args& p) {
    return gemm_workspace(p) + (kReducesBias ? size_t(p.n) * sizeof(float) : 0);
  }

  static int launch(const cvt_gemm_args& p0, void* workspace, cudaStream_t stream) {
    if (!smem_ready<typename Base::GemmKernel>(Base::kernel_fn(), Base::kSmemBytes, p0.device_id))
      return CVT_ERR_SMEM;
    cvt_gemm_args p = p0;
    float* dbias_acc = nullptr;
    if constexpr (kReducesBias) {  // the visitor's fp32 atomics land here (Fusion::arguments reads p.bias)
      dbias_acc = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p0));
      if (cudaMemsetAsync(dbias_acc, 0, size_t(p.n) * sizeof(float), stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return CVT_ERR_INIT;
      }
      p.bias = dbias_acc;
    }
    const int rc = Base::run(p, workspace, stream);
    if (rc != CVT_OK) return rc;
    if constexpr (kReducesBias)
      round_dbias<Element><<<unsigned((p.n + 255) / 256), 256, 0, stream>>>(dbias_acc, static_cast<Element*>(p0.aux),
                                                                            int(p.n));
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
