// Attention ABI (operators/attention): the argument structs of the fused multi-head attention
// kernel libraries, forward (cvt_attn_*) and backward (cvt_attnbwd_*).
#pragma once
#include "common/abi.h"

// Forward.
// q (B, Lq, H, D), k and v (B, Lkv, H, D): any strides with unit stride along D (CvT's q/k/v
// projections write (B, L, H*D) rows; k and v may share rows of one (B, L, 2*H*D) GEMM output).
// o (B, Lq, H, D) packed; lse (B, H, Lq) float with rows lse_stride_bh apart (>= Lq).

typedef struct {
  int64_t batch, heads, lq, lkv, head_dim;
  const void* q; int64_t q_stride_b, q_stride_m, q_stride_h;   // elements
  const void* k; int64_t k_stride_b, k_stride_m, k_stride_h;
  const void* v; int64_t v_stride_b, v_stride_m, v_stride_h;
  void* o;                                                     // (B, Lq, H, D) packed
  float* lse; int64_t lse_stride_bh;                           // (B*H, Lq) rows, lse_stride_bh apart
  float scale;                                                 // softmax(scale * q k^T)
  int device_id;
  int sm_count;
} cvt_attn_args;

// Backward, from the forward's q (B, Lq, H, D), k, v (B, Lkv, H, D), its output o (B, Lq, H, D) and
// logsumexp lse (B, H, Lq) float (natural log, rows lse_stride_bh apart), and the output gradient
// dout (B, Lq, H, D) (and, when lse itself is used, its gradient dlse): dq, dk, dv, each with its
// own strides (unit stride along D everywhere). The softmax scale is the forward's.
// fp32 accumulation; the examples' launchers' workspace holds the rowsum(dout * o) vector and, where the
// kernel needs them, fp32 accumulators (the short-key kernel needs none: workspace 0).

typedef struct {
  int64_t batch, heads, lq, lkv, head_dim;
  const void* q; int64_t q_stride_b, q_stride_m, q_stride_h;      // elements
  const void* k; int64_t k_stride_b, k_stride_m, k_stride_h;
  const void* v; int64_t v_stride_b, v_stride_m, v_stride_h;
  const void* o; int64_t o_stride_b, o_stride_m, o_stride_h;
  const void* dout; int64_t do_stride_b, do_stride_m, do_stride_h;
  const float* lse; int64_t lse_stride_bh;                        // (B*H, Lq) rows, lse_stride_bh apart
  const float* dlse; int64_t dlse_stride_bh;                      // the gradient of lse, alike, or null
  void* dq; int64_t dq_stride_b, dq_stride_m, dq_stride_h;
  void* dk; int64_t dk_stride_b, dk_stride_m, dk_stride_h;
  void* dv; int64_t dv_stride_b, dv_stride_m, dv_stride_h;
  float scale;                                                    // the forward's softmax(scale * q k^T)
  int device_id;
  int sm_count;
  int deterministic;  // nonzero: the same bits every run (example 41 with one key split: dq summed over
                      // the key blocks in order by one block; our wgmma kernel: dq added in key-block
                      // order by turn counters; example 88's kernels, whose dq is reduce-added with
                      // atomics, refuse it)
} cvt_attnbwd_args;
