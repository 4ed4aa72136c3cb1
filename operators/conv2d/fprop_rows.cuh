// CvT's stem conv, forward, as row-window GEMMs (mma.sync, SM80-class: serves sm_89 and, built for
// the running GPU, sm_90; the row windows: conv2d/rows_common.cuh). The implicit GEMM's
// fixed-channels iterator reads 8 bytes of x per filter tap (the 7 x 7 / 4 stem at batch 256: 0.286
// ms on an H200 for 77 MB moved). Here each output row is y_row (Q x K) = sum over filter rows r of
// X_r (Q x S*C) . W_r^T (S*C x K) + bias, X_r the window of input row p * stride_h - pad_h + r: one
// GEMM with M = 64 pixels (those from Q on computed and dropped), N = 64 channels, K = R x 32 taps
// (the taps past S * C meet zero weights, and the A fragments' values there are masked to zero, so
// a non-finite x never reaches an output whose window does not cover it).
//
// A CTA: 8 warps, 64 output channels (blockIdx.y), a contiguous run of output rows (blockIdx.x).
// The CTA's weights go to shared memory once (taps past S * C zero) and every warp keeps its B
// fragments in registers for all its rows; each row's R input rows come by cp.async, kStages rows
// ahead. Warp (wm, wn): pixels wm*32 .. +31 (two m-tiles) x channels wn*16 .. +15 (two n-tiles);
// y = acc + bias rounded once, written as tokens (N, P*Q, K).
//
// A kernel's generated .cu (operators/conv2d/spec.py: ConvRowsSpec) defines Cfg:
//   Element                        cutlass::half_t | cutlass::bfloat16_t
//   kR                             filter rows
//   kStages                        output rows in flight (cp.async stages)
//   kWaves                         CTAs per SM the grid is sized for
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "common/device.cuh"
#include "conv2d/abi.h"
#include "conv2d/rows_common.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {
namespace fprop_rows {
using namespace conv_rows;

// The weight tile: 64 channels x R * 32 taps (+ 8: ldmatrix without bank conflicts).
constexpr int weight_row(int r) { return r * kTaps + 8; }

// (the row length for 64 pixels: the warps' m-tiles read windows up to pixel 63 whatever Q is)
inline RowWindow geometry(const cvt_conv_args& a, int ctas) {
  return row_window(a.n, a.p, kMaxQ, a.w, a.c, a.stride_w, a.pad_w, ctas);
}

// The block's weights (K, R, S, C) into the tile: channel k's filter row r at k * weight_row + r * 32,
// taps j < S * C, zeros after.
template <class E, int R>
__device__ __forceinline__ void load_weights(const cvt_conv_args& a, E* tile, int kb) {
  const int taps = int(a.s * a.c);
  const E* w = static_cast<const E*>(a.filter) + int64_t(kb) * kChannels * R * taps;
  for (int i = int(threadIdx.x); i < kChannels * R * kTaps; i += kThreads) {
    const int k = i / (R * kTaps), r = (i / kTaps) % R, j = i % kTaps;
    tile[k * weight_row(R) + r * kTaps + j] = j < taps ? w[(k * R + r) * taps + j] : E(0.f);
  }
}

// The warp's B fragments (channels wn*16 .. +15, every k-step of 16 taps) from the weight tile.
template <class E, int R>
__device__ __forceinline__ void weight_frags(uint32_t (&bf)[2 * R][4], const E* tile, int wn, int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int ks = 0; ks < 2 * R; ++ks)
    ldsm_x4(bf[ks], tile + (wn * 16 + lane % 8 + (lane / 16) * 8) * weight_row(R) + ks * 16 + ((lane / 8) % 2) * 8);
}

// The A fragments' masks of one half (16 taps) of a filter row's 32: a 16-bit half kept where its tap
// is one of the S * C (m[0]: a[0] and a[1], taps 2 (lane % 4) and + 1; m[1]: a[2] and a[3], + 8).
__device__ __forceinline__ void tap_masks(uint32_t (&m)[2][2], int taps, int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int h = 0; h < 2; ++h)
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int t = h * 16 + i * 8 + 2 * (lane % 4);
      m[h][i] = (t < taps ? 0xffffu : 0u) | (t + 1 < taps ? 0xffff0000u : 0u);
    }
}

// acc = the row's GEMM over one stage of input rows: the warp's two m-tiles x two n-tiles.
template <class E, int R>
__device__ __forceinline__ void row_gemm(float (&acc)[2][2][4], const uint32_t (&bf)[2 * R][4],
                                         const uint32_t (&m)[2][2], const RowWindow& g, const E* rows, int wm,
                                         int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int mt = 0; mt < 2; ++mt)
    CUTLASS_PRAGMA_UNROLL
    for (int nt = 0; nt < 2; ++nt)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int ks = 0; ks < 2 * R; ++ks) {
    const E* win = rows + (ks / 2) * g.row_len + (ks % 2) * 16 + (lane / 16) * 8;  // filter row ks / 2
    CUTLASS_PRAGMA_UNROLL
    for (int mt = 0; mt < 2; ++mt) {
      uint32_t af[4];
      ldsm_x4(af, win + (wm * 32 + mt * 16 + lane % 16) * g.step);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) af[i] &= m[ks % 2][i / 2];
      mma<E>(acc[mt][0], af, bf[ks][0], bf[ks][1]);
      mma<E>(acc[mt][1], af, bf[ks][2], bf[ks][3]);
    }
  }
}

// y's row `row` (Q pixels x the warp's 16 channels) = acc + bias, rounded once.
template <class E>
__device__ __forceinline__ void store_row(const cvt_conv_args& a, const float (&acc)[2][2][4],
                                          const float (&bias)[2][2], int row, int kb, int wm, int wn, int lane) {
  E* y = static_cast<E*>(a.y) + int64_t(row) * a.q * a.k + kb * kChannels + wn * 16 + 2 * (lane % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int mt = 0; mt < 2; ++mt)
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int q = wm * 32 + mt * 16 + lane / 4 + 8 * half;
      if (q >= int(a.q)) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int nt = 0; nt < 2; ++nt)
        *reinterpret_cast<uint32_t*>(y + int64_t(q) * a.k + nt * 8) =
            pack<E>(acc[mt][nt][2 * half] + bias[nt][0], acc[mt][nt][2 * half + 1] + bias[nt][1]);
    }
}

template <class E, int R, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    fprop_rows_kernel(const cvt_conv_args a, const RowWindow g) {
  pdl_enter();
  extern __shared__ __align__(16) char smem_raw[];
  E* tile = reinterpret_cast<E*>(smem_raw);
  E* stages = tile + kChannels * weight_row(R);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wm = warp / 4, wn = warp % 4;
  const int kb = int(blockIdx.y), cta = int(blockIdx.x), stage = R * g.row_len, wc = int(a.w * a.c);
  const int begin = first_row(g, cta), count = row_count(g, cta);
  auto load = [&](int i) {
    const int row = begin + i, n = row / int(a.p), pp = row % int(a.p);
    load_input_rows<E, R>(stages + (i % kStages) * stage, static_cast<const E*>(a.x) + int64_t(n) * a.h * wc,
                          int(a.h), wc, wc, pp * int(a.stride_h) - int(a.pad_h), g);
  };
  zero_margins(stages, kStages * R, g, wc);
  load_weights<E, R>(a, tile, kb);
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) load(s);
    cp_async_commit();
  }
  float bias[2][2];  // the warp's channels this thread writes
  const E* b = static_cast<const E*>(a.bias) + kb * kChannels + wn * 16 + 2 * (lane % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int nt = 0; nt < 2; ++nt) bias[nt][0] = float(b[nt * 8]), bias[nt][1] = float(b[nt * 8 + 1]);
  __syncthreads();  // the weight tile is in
  uint32_t bf[2 * R][4], masks[2][2];
  weight_frags<E, R>(bf, tile, wn, lane);
  tap_masks(masks, int(a.s * a.c), lane);
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // row i is in for every thread; every warp is done with the stage refilled below
    if (i + kStages - 1 < count) load(i + kStages - 1);
    cp_async_commit();
    float acc[2][2][4];
    row_gemm<E, R>(acc, bf, masks, g, stages + (i % kStages) * stage, wm, lane);
    store_row<E>(a, acc, bias, begin + i, kb, wm, wn, lane);
  }
}

}  // namespace fprop_rows

template <class Cfg>
struct FpropRows {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_FPROP;
  using Element = typename Cfg::Element;
  static constexpr int kR = Cfg::kR, kStages = Cfg::kStages, kWaves = Cfg::kWaves;

  static const void* kernel_fn() {
    return reinterpret_cast<const void*>(fprop_rows::fprop_rows_kernel<Element, kR, kStages, 2>);
  }
  // CTAs along the output rows: kWaves per SM over the channel blocks.
  static int ctas_of(const cvt_conv_args& p) {
    const int64_t rows = p.n * p.p, blocks = p.k / conv_rows::kChannels;
    const int64_t c = (int64_t(kWaves) * sms_of(p) + blocks - 1) / blocks;
    return int(c < 1 ? 1 : (c > rows ? rows : c));
  }
  static int64_t smem_bytes(const cvt_conv_args& p) {
    const int64_t row_len = fprop_rows::geometry(p, 1).row_len;
    return (conv_rows::kChannels * fprop_rows::weight_row(kR) + kStages * kR * row_len) * int64_t(sizeof(Element));
  }

  static bool can_implement(const cvt_conv_args& p) {
    if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.k <= 0 || p.r != kR || p.s <= 0 || p.p <= 0 || p.q <= 0)
      return false;
    if (p.dilation_h != 1 || p.dilation_w != 1 || p.cls_rows != 0 || !p.bias || p.stride_h < 1 || p.pad_h < 0 ||
        p.stride_w < 1 || p.pad_w < 0)
      return false;
    if (p.p != (p.h + 2 * p.pad_h - p.r) / p.stride_h + 1 || p.q != (p.w + 2 * p.pad_w - p.s) / p.stride_w + 1)
      return false;
    if (p.x_image_stride != p.h * p.w * p.c || p.y_image_stride != p.p * p.q * p.k || p.n * p.p > INT32_MAX)
      return false;
    if (!conv_rows::rows_fit(p.c, p.k, p.s, p.w, p.q, p.stride_w, p.pad_w)) return false;
    const uintptr_t ptrs = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y);
    return ptrs % 16 == 0 && smem_bytes(p) <= conv_rows::kSmemCap;
  }

  static size_t workspace_size(const cvt_conv_args&) { return 0; }

  static int launch(const cvt_conv_args& p, void*, cudaStream_t stream) {
    if (!smem_ready<FpropRows>(kernel_fn(), conv_rows::kSmemCap, p.device_id)) return CVT_ERR_SMEM;
    const int ctas = ctas_of(p);
    launch_kernel(fprop_rows::fprop_rows_kernel<Element, kR, kStages, 2>,
                  dim3(unsigned(ctas), unsigned(p.k / conv_rows::kChannels)), conv_rows::kThreads, int(smem_bytes(p)),
                  stream, p, fprop_rows::geometry(p, ctas));
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
