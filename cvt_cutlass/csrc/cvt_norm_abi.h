// cvt_cutlass norm ABI: what the LayerNorm kernel libraries export, on top of the common part in
// cvt_kernel_abi.h (status codes, kernel info).
//
// LayerNorm over the channels of CvT's tokens. Row r of image i of x lives at
// x + i * x_image_stride + r * x_row_stride elements (channels contiguous). The output y has
// prefix_rows + rows rows per image: rows 0 .. prefix_rows-1 are copied from `prefix` (the same
// (prefix_rows, C) rows for every image: CvT's cls token put in front of the embedding's tokens,
// no torch.cat), the rest are LayerNorm(x) with the (C,) weight and bias in x's dtype.
// Statistics in fp32; `stats`, when not null, receives (mean, rstd) per normalised row as
// float2 at stats + (i * rows + r) (what a backward pass needs).
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_LAYERNORM 5

typedef struct {
  int64_t images, rows, c;
  const void* x; int64_t x_image_stride, x_row_stride;
  const void* weight;               // (C,), x's dtype
  const void* bias;                 // (C,), x's dtype
  const void* prefix;               // (prefix_rows, C), x's dtype, or null when prefix_rows == 0
  int64_t prefix_rows;
  void* y; int64_t y_image_stride, y_row_stride;
  void* stats;                      // (images * rows) float2 (mean, rstd), or null
  float eps;
  int device_id;
  int sm_count;
} cvt_norm_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_norm_can_implement_fn)(const cvt_norm_args*);
typedef size_t (*cvt_norm_workspace_size_fn)(const cvt_norm_args*);
typedef int (*cvt_norm_launch_fn)(const cvt_norm_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
