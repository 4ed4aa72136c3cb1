// cvt_cutlass ABI of the depthwise conv + BatchNorm in training mode (CvT's conv projection while
// training), on top of cvt_kernel_abi.h (status codes, kernel info).
//
// Tokens, as in cvt_conv_abi.h: image i of x starts at x + i * x_image_stride elements with
// cls_rows rows (CvT's stage-3 cls token) in front of its H*W spatial rows; channels contiguous,
// C per row. The conv is 3x3, pad 1, the stride fixed by the kernel (1 for q, 2 for k and v), its
// weight (3, 3, C) fp32 (tap-major: w[r][s][c]); BatchNorm uses the batch statistics of the conv
// output over N*P*Q pixels per channel.
//
// Forward (family 10): y = BN(conv(x)) with the cls rows copied from x; mean and invstd (C,) fp32
// written for the backward; running_mean / running_var (C,) fp32, when given, updated in place as
// nn.BatchNorm2d does (r = (1 - momentum) * r + momentum * stat, the variance unbiased: n / (n - 1)).
// Backward (family 11): dx (the cls rows: dy's), dweight (3, 3, C) fp32 and, when given, the
// BatchNorm's dweight / dbias (C,) fp32, from dy, x and the forward's mean / invstd (the conv is
// recomputed, nothing else is saved). Every reduction is per-block fp32 partials summed in a fixed
// order: the same inputs give the same bits.
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_DWCONV_BN 10
#define CVT_FAMILY_DWCONV_BN_BWD 11

typedef struct {
  int64_t n, h, w, c;               // images, input height / width, channels
  int64_t p, q;                     // output height / width
  int64_t stride, cls_rows;
  const void* x; int64_t x_image_stride;
  const float* weight;              // (3, 3, C)
  const float* bn_weight;           // (C,) or null (affine=False)
  const float* bn_bias;             // (C,) or null
  float* running_mean;              // (C,) updated in place, or null (track_running_stats=False)
  float* running_var;               // (C,) likewise
  void* y; int64_t y_image_stride;  // (n, cls_rows + p*q, C)
  float* mean;                      // (C,) out: the batch mean
  float* invstd;                    // (C,) out: 1 / sqrt(biased batch variance + eps)
  float momentum;                   // the running-stat factor (the caller resolves momentum=None)
  float eps;
  int device_id;
  int sm_count;
} cvt_dwbn_args;

typedef struct {
  int64_t n, h, w, c, p, q, stride, cls_rows;
  const void* x; int64_t x_image_stride;
  const void* dy; int64_t dy_image_stride;    // (n, cls_rows + p*q, C)
  const float* weight;                        // (3, 3, C)
  const float* bn_weight;                     // (C,) or null
  const float* mean;                          // (C,) the forward's
  const float* invstd;                        // (C,) the forward's
  void* dx; int64_t dx_image_stride;          // (n, cls_rows + h*w, C)
  float* dweight;                             // (3, 3, C)
  float* dbn_weight;                          // (C,) or null
  float* dbn_bias;                            // (C,) or null
  int device_id;
  int sm_count;
} cvt_dwbnbwd_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_dwbn_can_implement_fn)(const cvt_dwbn_args*);
typedef size_t (*cvt_dwbn_workspace_size_fn)(const cvt_dwbn_args*);
typedef int (*cvt_dwbn_launch_fn)(const cvt_dwbn_args*, void* workspace, void* stream);
typedef int (*cvt_dwbnbwd_can_implement_fn)(const cvt_dwbnbwd_args*);
typedef size_t (*cvt_dwbnbwd_workspace_size_fn)(const cvt_dwbnbwd_args*);
typedef int (*cvt_dwbnbwd_launch_fn)(const cvt_dwbnbwd_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
