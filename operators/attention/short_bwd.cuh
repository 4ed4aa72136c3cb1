// Fused multi-head attention backward for short key lengths (Lkv <= 64, head dim <= 64): one CTA per
// (batch, head) holds all of K and V in shared memory and walks the queries 64 rows at a time, so
// nothing is reduced across CTAs: dq is written once per row, dk and dv accumulate in registers
// and are written once (deterministic, no atomics, no workspace). mma.sync (SM80-class): runs on
// sm_89 and sm_90. CvT-13's stage 3 (Lq 197 = 196 tokens + the cls row, Lkv 50, 6 heads of 64).
// (operators/attention/abi.h: cvt_attnbwd_args; o is not read.)
//
// Per 64-query block (4 warps, 16 query rows each):
//   S = q k^T, dP = dout v^T                 (16 x 64 per warp, fp32)
//   P = exp(scale S - lse), 0 past Lkv        (lse = +inf past Lq: P = 0)
//   delta = rowsum(P * dP) - dlse             (every key is here: the same as rowsum(dout * o))
//   dS = P * (dP - delta)
//   dq = scale dS k                           (written from registers)
//   P, dS -> shared memory (16-bit, as the forward's P * V rounds P)
//   dv += P^T dout, dk += dS^T q              (warp w: keys 16w..16w+15; fp32 registers)
// The next block's q and dout load (cp.async) while this one computes; two barriers per block.
// dk = scale dk at the end.
// The tiles, loads and MMAs: attention/short_common.cuh.
//
// AttentionShortBwd<Element, BlocksPerSm>: BlocksPerSm the CTAs per SM the registers are budgeted
// for (2: 255 registers per thread, 3: 168).
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "attention/abi.h"
#include "attention/bwd_common.cuh"
#include "attention/short_common.cuh"
#include "common/device.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {
namespace short_bwd {
using namespace short_kv;

constexpr int kSmemBytes = 8 * kTile * 2;  // k, v, P, dS, and two buffers each of q and dout

// acc (16 x 64) += A^T * B over k rows [0, 16 * chunks) of two tiles: A's columns m0..m0+15 (P or dS,
// rows = queries), B's 64 columns (dout or q, rows = queries): dv += P^T dout, dk += dS^T q.
template <class E>
__device__ __forceinline__ void gemm_tn_rows(float (&acc)[8][4], const E* a_tile, int m0, const E* b_tile,
                                             int chunks, int lane) {
  for (int kc = 0; kc < chunks; ++kc) {
    uint32_t a[4];
    ldsm_x4_t(a, a_tile + (kc * 16 + lane % 8 + (lane / 16) * 8) * kRow + m0 + ((lane / 8) % 2) * 8);
    CUTLASS_PRAGMA_UNROLL
    for (int np = 0; np < kDim / 16; ++np) {
      uint32_t b[4];
      ldsm_x4_t(b, b_tile + (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kRow + np * 16 + (lane / 16) * 8);
      mma<E>(acc[2 * np], a, b[0], b[1]);
      mma<E>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// S -> P and dP -> dS in place for the warp's rows r0 + g and r0 + g + 8 (see the header).
__device__ __forceinline__ void softmax_grad(float (&s)[8][4], float (&dp)[8][4], const cvt_attnbwd_args& a,
                                             const float* lse, const float* dlse, int r0, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  const float sl2 = a.scale * float(M_LOG2E);
  float l2[2], delta[2] = {0.f, 0.f};
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + g + 8 * half;
    l2[half] = r < a.lq ? lse[r] * float(M_LOG2E) : INFINITY;  // rows past Lq: P = 0
  }
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 8; ++nt) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; ++e) {
      const bool key_ok = nt * 8 + c + (e & 1) < a.lkv;
      const float p = key_ok ? exp2f(fmaf(s[nt][e], sl2, -l2[e / 2])) : 0.f;
      s[nt][e] = p;
      delta[e / 2] += p * dp[nt][e];
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    delta[half] += __shfl_xor_sync(0xffffffffu, delta[half], 1);
    delta[half] += __shfl_xor_sync(0xffffffffu, delta[half], 2);
    const int r = r0 + g + 8 * half;
    if (dlse && r < a.lq) delta[half] -= dlse[r];  // a gradient of lse adds P * dlse to dS
  }
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 8; ++nt) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e / 2]);
  }
}

// One warp's 16 query rows of a block (row0: the block's first row): S, dP, P, dS; P and dS to
// shared memory; dq written.
template <class E>
__device__ __forceinline__ void query_rows(const cvt_attnbwd_args& a, const E* cq, const E* cdo, const E* sk,
                                           const E* sv, E* sp, E* sds, const float* lse, const float* dlse, E* dq,
                                           int row0, int warp, int lane) {
  const int r0 = row0 + warp * 16;
  if (r0 >= a.lq) return;  // their rows of sp / sds are past the block's last k-chunk: never read
  float s[8][4] = {}, dp[8][4] = {};
  gemm_rows_nt(s, cq + warp * 16 * kRow, sk, lane);
  gemm_rows_nt(dp, cdo + warp * 16 * kRow, sv, lane);
  softmax_grad(s, dp, a, lse, dlse, r0, lane);
  uint32_t f[4][4];  // P, then dS, rounded to E once: what shared memory holds and the dq GEMM reads
  to_frags<E>(f, s);
  store_smem_frags(sp + warp * 16 * kRow, f, lane);
  to_frags<E>(f, dp);
  store_smem_frags(sds + warp * 16 * kRow, f, lane);
  float acc[8][4] = {};
  gemm_frags_tile(acc, f, sk, lane);
  store_rows(dq, a.dq_stride_m, acc, a.scale, r0, int(a.lq), int(a.head_dim), lane);
}

template <class E, int BlocksPerSm>
__global__ void __launch_bounds__(kThreads, BlocksPerSm) short_bwd_kernel(cvt_attnbwd_args a) {
  pdl_enter();
  extern __shared__ __align__(16) char smem[];
  E* sk = reinterpret_cast<E*>(smem);
  E *sv = sk + kTile, *sp = sv + kTile, *sds = sp + kTile, *sq = sds + kTile, *sdo = sq + 2 * kTile;
  const int64_t bh = blockIdx.x, b = bh / a.heads, h = bh % a.heads;
  const int lq = int(a.lq), lkv = int(a.lkv), d = int(a.head_dim);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const E* q = static_cast<const E*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
  const E* dout = static_cast<const E*>(a.dout) + b * a.do_stride_b + h * a.do_stride_h;
  load_tile(sk, static_cast<const E*>(a.k) + b * a.k_stride_b + h * a.k_stride_h, a.k_stride_m, lkv, d);
  load_tile(sv, static_cast<const E*>(a.v) + b * a.v_stride_b + h * a.v_stride_h, a.v_stride_m, lkv, d);
  load_tile(sq, q, a.q_stride_m, lq, d);
  load_tile(sdo, dout, a.do_stride_m, lq, d);
  cp_async_commit();
  const float* lse = a.lse + bh * a.lse_stride_bh;
  const float* dlse = a.dlse ? a.dlse + bh * a.dlse_stride_bh : nullptr;
  E* dq = static_cast<E*>(a.dq) + b * a.dq_stride_b + h * a.dq_stride_h;
  float dk[8][4] = {}, dv[8][4] = {};
  const int blocks = (lq + kQueries - 1) / kQueries;
  for (int blk = 0; blk < blocks; ++blk) {
    const int buf = blk & 1, row0 = blk * kQueries, next = row0 + kQueries;
    cp_async_wait<0>();  // this block's rows are in
    __syncthreads();     // ... for every thread, and the last block's reads of P, dS and the other buffers are done
    if (blk + 1 < blocks) {  // the next block's rows into the other buffers, while this one computes
      load_tile(sq + (buf ^ 1) * kTile, q + next * a.q_stride_m, a.q_stride_m, lq - next, d);
      load_tile(sdo + (buf ^ 1) * kTile, dout + next * a.do_stride_m, a.do_stride_m, lq - next, d);
      cp_async_commit();
    }
    const E *cq = sq + buf * kTile, *cdo = sdo + buf * kTile;
    query_rows(a, cq, cdo, sk, sv, sp, sds, lse, dlse, dq, row0, warp, lane);
    __syncthreads();
    const int chunks = (min(kQueries, lq - row0) + 15) / 16;
    gemm_tn_rows(dv, sp, warp * 16, cdo, chunks, lane);
    gemm_tn_rows(dk, sds, warp * 16, cq, chunks, lane);
  }
  store_rows(static_cast<E*>(a.dk) + b * a.dk_stride_b + h * a.dk_stride_h, a.dk_stride_m, dk, a.scale, warp * 16,
             lkv, d, lane);
  store_rows(static_cast<E*>(a.dv) + b * a.dv_stride_b + h * a.dv_stride_h, a.dv_stride_m, dv, 1.f, warp * 16, lkv,
             d, lane);
}

}  // namespace short_bwd

template <class Element_, int BlocksPerSm>
struct AttentionShortBwd {
  static constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
  using Element = Element_;

  static const void* kernel_fn() {
    return reinterpret_cast<const void*>(short_bwd::short_bwd_kernel<Element, BlocksPerSm>);
  }
  // bwd_strides_ok also checks o, which this kernel does not read (the op passes the forward's
  // packed output: never refused for it).
  static bool can_implement(const cvt_attnbwd_args& a) {
    return bwd_strides_ok(a) && a.lkv <= short_bwd::kKeys && a.head_dim <= short_bwd::kDim &&
           a.batch * a.heads <= INT32_MAX;
  }
  static size_t workspace_size(const cvt_attnbwd_args&) { return 0; }
  static int launch(const cvt_attnbwd_args& a, void*, cudaStream_t stream) {
    if (!smem_ready<AttentionShortBwd>(kernel_fn(), short_bwd::kSmemBytes, a.device_id)) return CVT_ERR_SMEM;
    launch_kernel(short_bwd::short_bwd_kernel<Element, BlocksPerSm>, unsigned(a.batch * a.heads), short_bwd::kThreads,
                  short_bwd::kSmemBytes, stream, a);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
