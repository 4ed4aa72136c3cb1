// The Linear input gradient on the SM90 GEMM: dX = dY . W (A = dY (M, N), B = the (N, K) weight
// read as a row-major K x N operand), times GELU' at the saved pre-activation (dgelu_dbias:
// cuBLASLt's DGELU_BGRAD) or times the derivative the forward saved (dgelu_saved_dbias, an fp16
// C), and the bias-gradient row reduction, in its epilogue when the EVT asks.
// Cfg as for GemmSm90 (linear/gemm_sm90.cuh), plus kReducesBias: the EVT ends in a row reduction
// that writes fp32 dbias partials.
#pragma once
#include "linear/gemm_sm90.cuh"  // first: the TMA driver shim precedes every CUTLASS header

#include "common/reduce.cuh"
#include "linear/dgelu.cuh"

namespace cvt_kernel {

// dX = dY . W. With kReducesBias the EVT's row-reduction node (CUTLASS's Sm90RowReduction without
// its final pass, whose last-CTA serial sum over thousands of M-tiles was most of the kernel's
// time) writes one fp32 partial dbias row per M-tile into the workspace's tail, passed as p.bias;
// a column sum over the M-tiles in fixed order (deterministic) rounds it into p.aux.
template <class Cfg>
struct DgradSm90 : GemmSm90<Cfg> {
  using Base = GemmSm90<Cfg>;
  using Element = typename Base::Element;
  static constexpr bool kReducesBias = Cfg::kReducesBias;
  static constexpr int64_t kTileM = cute::size<0>(typename Base::TileShape{});
  static constexpr int64_t kTileN = cute::size<1>(typename Base::TileShape{});

  // The M-tiles' partial dbias rows: (ceil(M / tile M), N rounded up to tile N) fp32.
  static int64_t dbias_rows(const cvt_gemm_args& p) { return (p.m + kTileM - 1) / kTileM; }
  static int64_t dbias_ld(const cvt_gemm_args& p) { return (p.n + kTileN - 1) / kTileN * kTileN; }
  static size_t gemm_workspace(const cvt_gemm_args& p) {
    return (Base::Gemm::get_workspace_size(Base::make_arguments(p)) + 255) / 256 * 256;
  }
  static size_t workspace_size(const cvt_gemm_args& p) {
    return gemm_workspace(p) + (kReducesBias ? size_t(dbias_rows(p) * dbias_ld(p)) * sizeof(float) : 0);
  }

  static int launch(const cvt_gemm_args& p0, void* workspace, cudaStream_t stream) {
    cvt_gemm_args p = p0;
    float* partials = nullptr;
    if constexpr (kReducesBias) {
      partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + gemm_workspace(p0));
      p.bias = partials;  // the row-reduction node's output (Fusion::arguments)
    }
    const int rc = Base::launch(p, workspace, stream);
    if (rc != CVT_OK || !kReducesBias) return rc;
    colsum2_or_defer<Element>({partials, dbias_rows(p), dbias_ld(p), p.n, static_cast<Element*>(p0.aux)}, {}, p0.defer,
                              stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
