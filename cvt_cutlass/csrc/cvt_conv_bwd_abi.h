// cvt_cutlass conv-backward ABI: what the token-embedding conv's dgrad and wgrad kernel libraries
// export, on top of the common part in cvt_kernel_abi.h (status codes, kernel info).
//
// For y = conv2d(x, w) + bias with x (N, H, W, C), w (K, R, S, C), y (N, P, Q, K), all packed
// NHWC / KRSC in one 16-bit dtype, and dy the gradient of y:
//   dgrad kernels (name cvt_conv2d_dgrad_*): dx (N, H, W, C) = the transposed conv of dy with w;
//   wgrad kernels (cvt_conv2d_wgrad_*): dw (K, R, S, C) = dy^T . im2col(x), the GEMM-K = N*P*Q
//   dimension split `splits` ways (0: the kernel picks enough splits to fill the GPU) into fp32
//   partials in the workspace, summed in split order; and, when db is not null, db (K,) = dy
//   summed over N*P*Q by a deterministic pass in the same launch.
// fp32 accumulation; outputs written contiguous in dy's dtype.
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_CONV2D_BWD 9

typedef struct {
  int64_t n, h, w, c;               // input images
  int64_t k, r, s;                  // output channels, filter height and width
  int64_t p, q;                     // output height and width
  int64_t pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w;
  const void* dy;                   // (N, P, Q, K)
  const void* x;                    // (N, H, W, C): wgrad
  const void* filter;               // (K, R, S, C): dgrad
  void* dx;                         // (N, H, W, C): dgrad
  void* dw;                         // (K, R, S, C): wgrad
  void* db;                         // (K,) or null: wgrad
  int splits;                       // wgrad: GEMM-K splits, 0 = auto
  int device_id;
  int sm_count;
} cvt_convbwd_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_convbwd_can_implement_fn)(const cvt_convbwd_args*);
typedef size_t (*cvt_convbwd_workspace_size_fn)(const cvt_convbwd_args*);
typedef int (*cvt_convbwd_launch_fn)(const cvt_convbwd_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
