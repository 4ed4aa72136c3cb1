// cvt_cutlass weight-gradient ABI: what the Linear wgrad kernel libraries export, on top of the
// common part in cvt_kernel_abi.h (status codes, kernel info).
//
// dW (N, K) = dY^T . X and, when db is not null, db (N,) = dY summed over rows: dY (M, N) and
// X (M, K) row-major (rows ldy / ldx elements apart), M = tokens. fp32 accumulation; dW and db
// are written contiguous in dY's dtype. The M (token) dimension is split `splits` ways (0: the
// kernel picks enough splits to fill the GPU); the fp32 partials live in the workspace.
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_WGRAD 6

typedef struct {
  int64_t m, n, k;
  const void* dy; int64_t ldy;   // (M, N)
  const void* x; int64_t ldx;    // (M, K)
  void* dw;                      // (N, K) contiguous
  void* db;                      // (N,) or null
  int splits;                    // 0 = auto
  int device_id;
  int sm_count;
} cvt_wgrad_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_wgrad_can_implement_fn)(const cvt_wgrad_args*);
typedef size_t (*cvt_wgrad_workspace_size_fn)(const cvt_wgrad_args*);
typedef int (*cvt_wgrad_launch_fn)(const cvt_wgrad_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
