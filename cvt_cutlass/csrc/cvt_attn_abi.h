// cvt_cutlass attention ABI: what the fused multi-head attention kernel libraries export, on top
// of the common part in cvt_kernel_abi.h.
//
// q (B, Lq, H, D), k and v (B, Lkv, H, D): any strides with unit stride along D (CvT's q/k/v
// projections write (B, L, H*D) rows; k and v may share rows of one (B, L, 2*H*D) GEMM output).
// o (B, Lq, H, D) packed; lse (B, H, Lq) float with rows lse_stride_bh apart (>= Lq).
#pragma once
#include "cvt_kernel_abi.h"

#define CVT_FAMILY_ATTENTION 4

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

#ifdef __cplusplus
extern "C" {
#endif
typedef int (*cvt_attn_can_implement_fn)(const cvt_attn_args*);
typedef size_t (*cvt_attn_workspace_size_fn)(const cvt_attn_args*);
typedef int (*cvt_attn_launch_fn)(const cvt_attn_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
