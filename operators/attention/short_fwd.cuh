// Fused multi-head attention forward for short key lengths (Lkv <= 64, head dim <= 64): each CTA
// takes 64 query rows of one (batch, head) with all of its keys and values in shared memory, so the
// softmax sees whole rows (no running rescale) and no key tile is mostly padding. mma.sync
// (SM80-class): runs on sm_89 and sm_90. CvT-13's stage 3 (Lq 197 = 196 tokens + the cls row,
// Lkv 50, 6 heads of 64). (operators/attention/abi.h: cvt_attn_args.)
//
// Per warp (16 query rows): S = q k^T (fp32), keys past Lkv masked, P = exp(scale (S - max)),
// o = (P v) / rowsum(P) with P rounded to the element type for the MMA, lse = scale max + log(rowsum).
// o (B, Lq, H, D) packed; lse rows lse_stride_bh apart (any stride >= Lq; none written when null).
// The tiles, loads and MMAs: attention/short_common.cuh.
//
// AttentionShortFwd<Element, BlocksPerSm>: the CTAs per SM the registers are budgeted for.
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "attention/abi.h"
#include "attention/short_common.cuh"
#include "common/device.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {
namespace short_fwd {
using namespace short_kv;

// S -> unnormalized P in place for the warp's rows g and g + 8; inv: 1 / rowsum(P), lse per row.
__device__ __forceinline__ void softmax_rows(float (&s)[8][4], float (&inv)[2], float (&lse)[2], float scale,
                                             int lkv, int lane) {
  const int c = 2 * (lane % 4);
  const float sl2 = scale * float(M_LOG2E);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 8; ++nt) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; ++e) {
      if (nt * 8 + c + (e & 1) >= lkv) s[nt][e] = -INFINITY;
      m[e / 2] = fmaxf(m[e / 2], s[nt][e]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {  // key 0 is in every row's quad: the maxima are finite
    m[half] = fmaxf(m[half], __shfl_xor_sync(0xffffffffu, m[half], 1));
    m[half] = fmaxf(m[half], __shfl_xor_sync(0xffffffffu, m[half], 2));
  }
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 8; ++nt) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = exp2f((s[nt][e] - m[e / 2]) * sl2);
      l[e / 2] += s[nt][e];
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    inv[half] = 1.f / l[half];
    lse[half] = m[half] * scale + logf(l[half]);
  }
}

template <class E, int BlocksPerSm>
__global__ void __launch_bounds__(kThreads, BlocksPerSm) short_fwd_kernel(cvt_attn_args a) {
  pdl_enter();
  __shared__ __align__(16) E smem[3 * kTile];
  E *sk = smem, *sv = smem + kTile, *sq = smem + 2 * kTile;
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads;
  const int lq = int(a.lq), lkv = int(a.lkv), d = int(a.head_dim), row0 = int(blockIdx.y) * kQueries;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  load_tile(sk, static_cast<const E*>(a.k) + b * a.k_stride_b + h * a.k_stride_h, a.k_stride_m, lkv, d);
  load_tile(sv, static_cast<const E*>(a.v) + b * a.v_stride_b + h * a.v_stride_h, a.v_stride_m, lkv, d);
  load_tile(sq, static_cast<const E*>(a.q) + b * a.q_stride_b + h * a.q_stride_h + row0 * a.q_stride_m,
            a.q_stride_m, lq - row0, d);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int r0 = row0 + warp * 16;
  if (r0 >= lq) return;  // no barrier follows
  float s[8][4] = {}, o[8][4] = {}, inv[2], lse[2];
  gemm_rows_nt(s, sq + warp * 16 * kRow, sk, lane);
  softmax_rows(s, inv, lse, a.scale, lkv, lane);
  uint32_t pf[4][4];
  to_frags<E>(pf, s);
  gemm_frags_tile(o, pf, sv, lane);
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 8; ++nt) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; ++e) o[nt][e] *= inv[e / 2];
  }
  const int64_t hd = a.heads * a.head_dim;
  store_rows(static_cast<E*>(a.o) + b * a.lq * hd + h * a.head_dim, hd, o, 1.f, r0, lq, d, lane);
  if (a.lse && lane % 4 == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + lane / 4 + 8 * half;
      if (r < lq) a.lse[bh * a.lse_stride_bh + r] = lse[half];
    }
  }
}

}  // namespace short_fwd

template <class Element_, int BlocksPerSm>
struct AttentionShortFwd {
  static constexpr int kFamily = CVT_FAMILY_ATTENTION;
  using Element = Element_;

  static bool can_implement(const cvt_attn_args& a) {
    const int64_t lim = INT32_MAX;
    if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0 || a.head_dim % 8) return false;
    if (a.lkv > short_kv::kKeys || a.head_dim > short_kv::kDim || a.lq > lim || a.batch * a.heads > lim) return false;
    if ((a.lq + short_kv::kQueries - 1) / short_kv::kQueries > 65535) return false;
    for (int64_t s : {a.q_stride_b, a.q_stride_m, a.q_stride_h, a.k_stride_b, a.k_stride_m, a.k_stride_h, a.v_stride_b,
                      a.v_stride_m, a.v_stride_h})
      if (s < 0 || s % 8) return false;  // 16-byte rows
    for (const void* p : {a.q, a.k, a.v, static_cast<const void*>(a.o)})
      if (reinterpret_cast<uintptr_t>(p) % 16) return false;
    return (!a.lse || a.lse_stride_bh >= a.lq) && a.scale > 0.f;  // the row max is max(S): scale > 0
  }
  static size_t workspace_size(const cvt_attn_args&) { return 0; }
  static int launch(const cvt_attn_args& a, void*, cudaStream_t stream) {
    const dim3 grid(unsigned(a.batch * a.heads), unsigned((a.lq + short_kv::kQueries - 1) / short_kv::kQueries));
    launch_kernel(short_fwd::short_fwd_kernel<Element, BlocksPerSm>, grid, short_kv::kThreads, 0, stream, a);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
