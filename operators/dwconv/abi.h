// Depthwise conv + BatchNorm ABI (operators/dwconv): the argument structs of the training
// kernels, forward (cvt_dwbn_*) and backward (cvt_dwbnbwd_*). The inference kernel (BatchNorm
// folded) takes cvt_conv_args (operators/conv2d/abi.h).
#pragma once
#include "common/abi.h"
#include "conv2d/abi.h"

// Tokens, as in operators/conv2d/abi.h: image i of x starts at x + i * x_image_stride elements with
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
//
// In parts (SyncBatchNorm: the statistics of several processes' batches; `phase`, 0 by default):
// CVT_DWBN_STATS runs only the statistics pass and writes this call's mean and m2 (the sum of
// squared deviations from it) per channel, nothing else; CVT_DWBN_APPLY normalizes with the
// given mean / invstd (read, not written; running stats untouched). The backward's CVT_DWBN_STATS
// writes only dbn_bias = sum dy and dbn_weight = sum dy * xhat of this call; its CVT_DWBN_APPLY
// writes dx and dweight from the given sums over `count` values per channel (all on the device: no
// host sync between the parts). A part takes no `next`.
//
// Grouped launch: `next`, when not null, is a second problem on the same x with the same sizes,
// stride and cls rows (its own weights, statistics and outputs; CvT's k and v projections of one
// LayerNorm output), run by the same kernel launches. It takes the workspace of two problems
// (workspace_size reports it) and gives each problem the bits of its launch alone. A q / k / v
// library (DwBnFwdQkv / DwBnBwdQkv) takes the chain q -> k -> v: q at its stride, then such a k / v
// pair at another, all on the same x; each problem gets the bits of its own library's launch
// (except dx under the backward's sum_dx, below: the problems' dx summed), unless q runs at
// stride 1 and the pair at stride 2: then the statistics pass, the normalization, the backward's
// sums and its dz + dW pass read x once for the three problems (dwbn_rows.cuh), and the
// statistics and sums, merged in another order, are within fp32 rounding of the single launches'
// (the conv outputs are their bits; what follows from the sums within rounding).
// Read on the host only; the chain's last `next` must be null.

enum { CVT_DWBN_ALL = 0, CVT_DWBN_STATS = 1, CVT_DWBN_APPLY = 2 };

typedef struct cvt_dwbn_args_s {
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
  const struct cvt_dwbn_args_s* next;  // a grouped launch's next problem, or null (see the top)
  int phase;                        // CVT_DWBN_ALL, CVT_DWBN_STATS or CVT_DWBN_APPLY (see the top)
  float* m2;                        // (C,) out in CVT_DWBN_STATS: the sum of squared deviations
} cvt_dwbn_args;

typedef struct cvt_dwbnbwd_args_s {
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
  const struct cvt_dwbnbwd_args_s* next;  // a grouped launch's next problem, or null (see the top)
  int phase;                                  // CVT_DWBN_ALL, CVT_DWBN_STATS or CVT_DWBN_APPLY
  const float* sum_dy;                        // (C,) in CVT_DWBN_APPLY: sum dy over all the batches
  const float* sum_dy_xhat;                   // (C,) likewise, sum dy * xhat
  const float* count;                         // (1,) the values per channel those sums are over
  cvt_colsum_list* defer;                     // dweight's final sums deferred to this list, or null (common/abi.h);
                                              // read from the first problem of a grouped launch
  int sum_dx;                                 // nonzero: every problem's dx summed (fp32, one rounding)
                                              // into the first problem's dx (the others' dx unused; the
                                              // cls rows: the dy rows summed); read from the first problem
} cvt_dwbnbwd_args;
