// Linear ABI (operators/linear): the argument structs of the Linear family's kernel libraries:
// the GEMMs of the forward and the input gradient (cvt_gemm_*), and the
// weight gradient (cvt_wgrad_*).
#pragma once
#include "common/abi.h"

// D = epilogue(A @ B^T), A (M, K) row-major, B (N, K) row-major (as nn.Linear stores weights),
// D (M, N) row-major. Optional operands are null when the epilogue does not use them.
typedef struct {
  int64_t m, n, k;
  const void* a; int64_t lda;     // A rows are lda elements apart
  const void* b; int64_t ldb;     // weight (N, K)
  void* d; int64_t ldd;           // output (M, N)
  const void* bias;               // (N,), contiguous
  const void* c; int64_t ldc;     // residual (M, N)
  void* aux; int64_t ldaux;       // extra store (M, N), e.g. the pre-activation for backward
  int device_id;                  // device the pointers live on (the current device)
  int sm_count;                   // multiprocessors of that device (cached by the caller)
  cvt_colsum_list* defer;         // dgrad's bias-gradient sums deferred to this list, or null (common/abi.h)
  const float* row_scale;         // (M,) per-row scale of the row-scaled epilogues, or null
} cvt_gemm_args;

// Weight gradient: dW (N, K) = dY^T . X and, when db is not null, db (N,) = dY summed over rows: dY (M, N) and
// X (M, K) row-major (rows ldy / ldx elements apart), M = tokens. fp32 accumulation; dW and db
// are written contiguous in dY's dtype. The M (token) dimension is split `splits` ways (0: the
// kernel picks enough splits to fill the GPU); the fp32 partials live in the workspace. With
// row_scale (fp32, (M,)), dY's rows are scaled first (fp32 product, rounded to dY's dtype: drop
// path's backward) and written to dy_scaled ((M, N) contiguous, 16-byte aligned) by the pass that
// also sums db; dW and db are those of the scaled dY, which the caller's later GEMMs read. With
// dy_fp32, dY comes as fp32 rows (an fp32 residual stream's gradient, rows ldy apart): that pass rounds
// them (scaled by row_scale where given) to the 16-bit dtype into dy_scaled, which the GEMM reads.

typedef struct {
  int64_t m, n, k;
  const void* dy; int64_t ldy;   // (M, N)
  const void* x; int64_t ldx;    // (M, K)
  void* dw;                      // (N, K) contiguous
  void* db;                      // (N,) or null
  int splits;                    // 0 = auto
  int device_id;
  int sm_count;
  cvt_colsum_list* defer;        // the finishing column sums deferred to this list, or null (common/abi.h)
  const float* row_scale;        // (M,) per-row scale of dY, or null
  void* dy_scaled;               // (M, N) contiguous: dY scaled by row_scale (with row_scale or dy_fp32)
  int dy_fp32;                   // 1: dY is fp32 (rounded into dy_scaled first), 0: dY is in dW's dtype
} cvt_wgrad_args;

#ifdef __cplusplus
// The dY the GEMM reads: the scaled (or rounded) copy where a row scale or fp32 rows are given.
inline cvt_wgrad_args cvt_wgrad_gemm_view(cvt_wgrad_args p) {
  if (p.row_scale || p.dy_fp32) {
    p.dy = p.dy_scaled;
    p.ldy = p.n;
  }
  return p;
}
#endif
