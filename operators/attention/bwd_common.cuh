// What both attention backward kernels (attention/ex41_bwd.cuh, attention/ex88_bwd.cuh) share:
// the rowsum(dout * o) pass they start from, the fp32 dq -> dtype pass of the Hopper one, and the
// checks of a backward problem's strides (operators/attention/abi.h: cvt_attnbwd_args). Ours, not
// the examples': fp32 products, 16-byte loads, any strides along B/L/H.
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/array.h"
#include "attention/abi.h"
#include "common/pdl.cuh"

namespace cvt_kernel {
// zero[0, n) = 0 by every block of the grid together (16-byte stores where aligned, one pass).
__device__ __forceinline__ void zero_by_grid(float* __restrict__ zero, int64_t n) {
  const int64_t blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t t = block * blockDim.x + threadIdx.x, step = blocks * blockDim.x;
  int64_t head = 0;
  if (reinterpret_cast<uintptr_t>(zero) % 16 == 0) {
    const int64_t n4 = n / 4;
    for (int64_t k = t; k < n4; k += step) reinterpret_cast<float4*>(zero)[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    head = n4 * 4;
  }
  for (int64_t k = head + t; k < n; k += step) zero[k] = 0.f;
}

// delta[(b * H + h) * ld + i] = sum_d dout[b, i, h, d] * o[b, i, h, d] (fp32), one row per 8 threads,
// for every row i < ld (0 past Lq: kernels may read a whole last block of rows). With lse_out, the
// forward's lse times lse_scale is copied there too, with ld-row padding of +inf (P = exp(s - inf) =
// 0 past Lq): the forward leaves the caller's padding unwritten, and example 41's backward reads a
// whole block (lse_scale log2(e): the lse in base 2, for kernels that take exp2).
// With zero, its first zero_floats floats are zeroed as well (the main kernel's dq accumulator:
// no memset launch of its own).
template <class E>
__global__ void __launch_bounds__(256) delta_kernel(cvt_attnbwd_args a, float* __restrict__ delta, int64_t ld,
                                                    float* __restrict__ lse_out, float lse_scale,
                                                    float* __restrict__ zero, int64_t zero_floats) {
  pdl_enter();
  using Vec = cutlass::Array<E, 8>;
  if (zero) zero_by_grid(zero, zero_floats);
  const int64_t i = int64_t(blockIdx.x) * 32 + threadIdx.x / 8;
  const int64_t h = blockIdx.y, b = blockIdx.z, bh = b * a.heads + h;
  const int lane = threadIdx.x % 8;
  float acc = 0.f;
  if (i < a.lq) {
    const E* o = static_cast<const E*>(a.o) + b * a.o_stride_b + i * a.o_stride_m + h * a.o_stride_h;
    const E* g = static_cast<const E*>(a.dout) + b * a.do_stride_b + i * a.do_stride_m + h * a.do_stride_h;
    for (int64_t d = lane * 8; d < a.head_dim; d += 64) {
      const Vec ov = *reinterpret_cast<const Vec*>(o + d), gv = *reinterpret_cast<const Vec*>(g + d);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 8; ++e) acc += float(ov[e]) * float(gv[e]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int s = 1; s < 8; s *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s, 8);
  if (lane != 0 || i >= ld) return;
  // A gradient of lse itself adds P * dlse to dS = P * (dP - delta): the same as delta - dlse.
  if (i < a.lq && a.dlse) acc -= a.dlse[bh * a.dlse_stride_bh + i];
  delta[bh * ld + i] = acc;
  if (lse_out) lse_out[bh * ld + i] = i < a.lq ? lse_scale * a.lse[bh * a.lse_stride_bh + i] : INFINITY;
}

// Rows are covered 32 per block: ld must be at least Lq (rows past ld are not written). zero_bytes
// (a multiple of 4) at zero are zeroed by the same launch.
template <class E>
void launch_delta(const cvt_attnbwd_args& a, float* delta, int64_t ld, cudaStream_t stream, float* lse_out,
                  void* zero = nullptr, size_t zero_bytes = 0, float lse_scale = 1.f) {
  dim3 grid(unsigned((ld + 31) / 32), unsigned(a.heads), unsigned(a.batch));
  launch_kernel(delta_kernel<E>, grid, 256, 0, stream, a, delta, ld, lse_out, lse_scale, static_cast<float*>(zero),
                int64_t(zero_bytes / sizeof(float)));
}

// dq[b, i, h, :] = E(acc[((b * H + h) * lq_pad + i) * acc_row + :]), 8 elements per thread (acc_row:
// the accumulator's row stride in floats, D or more, a multiple of 4).
template <class E>
__global__ void __launch_bounds__(256) dq_convert_kernel(cvt_attnbwd_args a, const float* __restrict__ acc,
                                                         int64_t lq_pad, int64_t acc_row) {
  pdl_enter();
  const int64_t vecs = a.head_dim / 8, rows = a.batch * a.heads * a.lq;
  const int64_t t = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (t >= rows * vecs) return;
  const int64_t d = (t % vecs) * 8, row = t / vecs, i = row % a.lq, bh = row / a.lq;
  const int64_t h = bh % a.heads, b = bh / a.heads;
  const float4* src = reinterpret_cast<const float4*>(acc + (bh * lq_pad + i) * acc_row + d);
  const float4 x = src[0], y = src[1];
  cutlass::Array<E, 8> out;
  out[0] = E(x.x); out[1] = E(x.y); out[2] = E(x.z); out[3] = E(x.w);
  out[4] = E(y.x); out[5] = E(y.y); out[6] = E(y.z); out[7] = E(y.w);
  *reinterpret_cast<cutlass::Array<E, 8>*>(static_cast<E*>(a.dq) + b * a.dq_stride_b + i * a.dq_stride_m +
                                            h * a.dq_stride_h + d) = out;
}

// Every stride of a backward problem: 16-byte multiples that fit 32 bits (the kernels index with int).
inline bool bwd_strides_ok(const cvt_attnbwd_args& a) {
  const int64_t lim = INT32_MAX;
  if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0 || a.head_dim % 8) return false;
  if (a.lq > lim || a.lkv > lim || a.batch > 65535 || a.heads > 65535) return false;
  for (int64_t s : {a.q_stride_b, a.q_stride_m, a.q_stride_h, a.k_stride_b, a.k_stride_m, a.k_stride_h,
                    a.v_stride_b, a.v_stride_m, a.v_stride_h, a.o_stride_b, a.o_stride_m, a.o_stride_h,
                    a.do_stride_b, a.do_stride_m, a.do_stride_h, a.dq_stride_b, a.dq_stride_m, a.dq_stride_h,
                    a.dk_stride_b, a.dk_stride_m, a.dk_stride_h, a.dv_stride_b, a.dv_stride_m, a.dv_stride_h})
    if (s < 0 || s > lim || s % 8) return false;
  if (!a.lse || a.lse_stride_bh < a.lq || a.lse_stride_bh % 8) return false;
  if (a.dlse && (a.dlse_stride_bh < a.lq || reinterpret_cast<uintptr_t>(a.dlse) % 4)) return false;
  if (a.batch * a.heads * a.lq * a.head_dim > lim || a.batch * a.heads * a.lkv * a.head_dim > lim) return false;
  for (const void* p : {a.q, a.k, a.v, a.o, a.dout, static_cast<const void*>(a.lse), static_cast<const void*>(a.dq),
                        static_cast<const void*>(a.dk), static_cast<const void*>(a.dv)})
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return a.scale > 0.f;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace cvt_kernel
