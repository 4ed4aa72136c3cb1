// cvt_cutlass conv ABI: what the conv2d (implicit-GEMM fprop) and depthwise-conv kernel
// libraries export, on top of the common part in cvt_kernel_abi.h (status codes, kernel info).
//
// Tensors are NHWC, which is CvT's token layout: tokens (B, H*W, C) are images (B, H, W, C).
// Pixel (h, w) of image i of x lives at x + i * x_image_stride + (h * W + w) * C elements;
// packed images have x_image_stride = H*W*C, CvT's stage-3 tokens (a cls row in front) have
// (1 + H*W)*C with x pointing at the first spatial row.
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_CONV2D_FPROP 2  // y = conv2d(x, w) + bias; w (K, R, S, C) in x's dtype
#define CVT_FAMILY_DWCONV2D 3      // y = depthwise_conv2d(x, w) + bias; w (R, S, C), bias (C,), fp32

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

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_conv_can_implement_fn)(const cvt_conv_args*);
typedef size_t (*cvt_conv_workspace_size_fn)(const cvt_conv_args*);
typedef int (*cvt_conv_launch_fn)(const cvt_conv_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
