// cvt_cutlass LayerNorm-backward ABI, on top of cvt_kernel_abi.h (status codes, kernel info).
//
// For y = LayerNorm(x) * weight + bias over the C channels of each row: dx (images, rows, C)
// contiguous, and dweight, dbias (C,) in x's dtype, from dy and x (row r of image i at
// i * image_stride + r * row_stride elements, channels contiguous). Each row's mean and rstd are
// recomputed from x in registers (the row is read anyway); dweight / dbias are per-block fp32
// partial sums in the workspace, summed by a second small pass.
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_LAYERNORM_BWD 7

typedef struct {
  int64_t images, rows, c;
  const void* x; int64_t x_image_stride, x_row_stride;
  const void* dy; int64_t dy_image_stride, dy_row_stride;
  const void* weight;               // (C,)
  void* dx;                         // (images, rows, C) contiguous
  void* dweight;                    // (C,)
  void* dbias;                      // (C,)
  float eps;
  int device_id;
  int sm_count;
} cvt_normbwd_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_normbwd_can_implement_fn)(const cvt_normbwd_args*);
typedef size_t (*cvt_normbwd_workspace_size_fn)(const cvt_normbwd_args*);
typedef int (*cvt_normbwd_launch_fn)(const cvt_normbwd_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
