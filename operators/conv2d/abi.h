// Conv ABI (operators/conv2d): the argument structs of the token-embedding conv's kernel
// libraries, forward (cvt_conv_*, which the depthwise conv of operators/dwconv shares) and
// backward (cvt_convbwd_*).
#pragma once
#include "common/abi.h"

// libraries export.
//
// Forward. Tensors are NHWC, which is CvT's token layout: tokens (B, H*W, C) are images (B, H, W, C).
// Pixel (h, w) of image i of x lives at x + i * x_image_stride + (h * W + w) * C elements;
// packed images have x_image_stride = H*W*C, CvT's stage-3 tokens (a cls row in front) have
// (1 + H*W)*C with x pointing at the first spatial row.

typedef struct {
  int64_t n, h, w, c;               // input images
  int64_t k, r, s;                  // output channels, filter height and width
  int64_t p, q;                     // output height and width
  int64_t pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w;
  const void* x; int64_t x_image_stride;
  const void* filter;
  const void* bias;                 // (K,) or null
  void* y; int64_t y_image_stride;
  int64_t cls_rows;                 // depthwise: rows in front of each image's spatial tokens,
                                    // copied from x to y unchanged (CvT's cls token); else 0
  int device_id;
  int sm_count;
} cvt_conv_args;

// Backward. For y = conv2d(x, w) + bias with x (N, H, W, C), w (K, R, S, C), y (N, P, Q, K), all packed
// NHWC / KRSC in one 16-bit dtype, and dy the gradient of y:
//   dgrad kernels (name cvt_conv2d_dgrad_*): dx (N, H, W, C) = the transposed conv of dy with w;
//   wgrad kernels (cvt_conv2d_wgrad_*): dw (K, R, S, C) = dy^T . im2col(x), the GEMM-K = N*P*Q
//   dimension split `splits` ways (0: the kernel picks enough splits to fill the GPU) into fp32
//   partials in the workspace, summed in split order; and, when db is not null, db (K,) = dy
//   summed over N*P*Q by a deterministic pass in the same launch.
// fp32 accumulation; outputs written contiguous in dy's dtype.

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
