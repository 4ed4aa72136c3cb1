// LayerNorm ABI (operators/layernorm): the argument structs of the LayerNorm kernel libraries,
// forward (cvt_norm_*) and backward (cvt_normbwd_*).
#pragma once
#include "common/abi.h"

// Forward: LayerNorm over the channels of CvT's tokens. Row r of image i of x lives at
// x + i * x_image_stride + r * x_row_stride elements (channels contiguous). The output y has
// prefix_rows + rows rows per image: rows 0 .. prefix_rows-1 are copied from `prefix` (the same
// (prefix_rows, C) rows for every image: CvT's cls token put in front of the embedding's tokens,
// no torch.cat), the rest are LayerNorm(x) with the (C,) weight and bias in x's dtype.
// Statistics in fp32; `stats`, when not null, receives (mean, rstd) per normalised row as
// float2 at stats + (i * rows + r) (what a backward pass needs).

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

// Backward. For y = LayerNorm(x) * weight + bias over the C channels of each row: dx (images, rows, C)
// contiguous, and dweight, dbias (C,) in x's dtype, from dy and x (row r of image i at
// i * image_stride + r * row_stride elements, channels contiguous). Each row's mean and rstd are
// recomputed from x in registers (the row is read anyway); dweight / dbias are per-block fp32
// partial sums in the workspace, summed by a second small pass. dres, when not null, is another
// gradient of x (a residual branch's, laid out as dx) added to dx in fp32 before the one rounding;
// dres_scale, when not null, holds an fp32 factor per row (images * rows) that dres's row is
// multiplied by first (drop path's scale on an fp32 residual stream's gradient). dx_branch, when
// not null, receives dx a second time in the weight's dtype, each row multiplied by
// dx_branch_scale's factor first where that is not null (on an fp32 residual stream: the 16-bit
// gradient of the branch that adds into x, drop path's scale applied, one rounding).
// dy_more[i], when not null, are further gradients of y (the output feeds several ops), packed
// (images, rows, C) rows, summed with dy in fp32 as they are loaded.

typedef struct {
  int64_t images, rows, c;
  const void* x; int64_t x_image_stride, x_row_stride;
  const void* dy; int64_t dy_image_stride, dy_row_stride;
  const void* weight;               // (C,)
  void* dx;                         // (images, rows, C) contiguous
  const void* dres;                 // (images, rows, C) contiguous, added to dx, or null
  const float* dres_scale;          // (images * rows) fp32 factors of dres's rows, or null
  void* dx_branch;                  // (images, rows, C) contiguous, the weight's dtype, or null
  const float* dx_branch_scale;     // (images * rows) fp32 factors of dx_branch's rows, or null
  const void* dy_more[2];           // (images, rows, C) contiguous, summed with dy, or null
  void* dweight;                    // (C,)
  void* dbias;                      // (C,)
  float eps;
  int device_id;
  int sm_count;
  cvt_colsum_list* defer;           // the dweight / dbias sums deferred to this list, or null (common/abi.h)
} cvt_normbwd_args;
