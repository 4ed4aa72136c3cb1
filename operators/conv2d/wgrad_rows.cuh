// CvT's stem conv, weight gradient, as row-window GEMMs (mma.sync, SM80-class: serves sm_89 and,
// built for the running GPU, sm_90; the row windows: conv2d/rows_common.cuh). The implicit GEMM
// with 8-byte accesses took 0.195 ms for the 7 x 7 / 4 stem at batch 128 on an H200 (10 GFLOP,
// ~52 TFLOP/s). Here dw[k, r, s, c] = sum over output rows (n, p) of dy_row^T (K x Q) . X_r (Q x
// S*C), X_r the window of input row p * stride_h - pad_h + r.
//
// A CTA: 8 warps, 64 output channels (blockIdx.y), a contiguous run of output rows (blockIdx.x);
// each row's dy (Q x 64, pixels zero-filled up to a multiple of 16) and its R input rows come by
// cp.async, kStages rows ahead. Warp (wm, wn): channels wm*32 .. +31 (two m-tiles) x the n-tiles
// wn*R .. +R-1 of the R x 4 tiles of 8 taps. fp32 accumulators stay in registers across the CTA's
// rows; at the end each CTA writes its partial dw (and db: dy summed over its pixels) to the
// workspace, and the partials are summed in CTA order (common/reduce.cuh): deterministic, no atomics.
//
// A kernel's generated .cu (operators/conv2d/spec.py: ConvRowsWgradSpec) defines Cfg:
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
#include "common/reduce.cuh"
#include "conv2d/abi.h"
#include "conv2d/bwd_geometry.cuh"
#include "conv2d/rows_common.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {
namespace wgrad_rows {
using namespace conv_rows;

constexpr int kDyRow = kChannels + 8;  // shared dy row, elements: 144 bytes, ldmatrix without bank conflicts
constexpr int kDyTile = kMaxQ * kDyRow;

inline RowWindow geometry(const cvt_convbwd_args& a, int ctas) {
  return row_window(a.n, a.p, a.q, a.w, a.c, a.stride_w, a.pad_w, ctas);
}
// One stage: the dy tile, then R input rows (elements).
__host__ __device__ inline int stage_elems(const RowWindow& g, int r) { return kDyTile + r * g.row_len; }

// One output row's dy (64 channels of block kb) and its R input rows into a stage, by cp.async.
template <class E, int R>
__device__ __forceinline__ void load_row(const cvt_convbwd_args& a, const RowWindow& g, E* stage, int row, int kb) {
  const int q_len = int(a.q), wc = int(a.w * a.c), n = row / int(a.p), pp = row % int(a.p);
  const E* dy = static_cast<const E*>(a.dy) + int64_t(row) * a.q * a.k + kb * kChannels;
  for (int i = int(threadIdx.x); i < g.psteps * 16 * (kChannels / 8); i += kThreads) {
    const int q = i / (kChannels / 8), ch = (i % (kChannels / 8)) * 8;
    cp_async16(stage + q * kDyRow + ch, q < q_len ? dy + int64_t(q) * a.k + ch : dy, q < q_len);
  }
  // only the columns some pixel's taps use: pixels past Q (zero dy) read past them, and 0 x Inf
  // there would reach dw (PyTorch's never reads those columns)
  const int64_t taps_end = ((a.q - 1) * a.stride_w - a.pad_w + a.s) * a.c;
  load_input_rows<E, R>(stage + kDyTile, static_cast<const E*>(a.x) + int64_t(n) * a.h * wc, int(a.h), wc,
                        int(taps_end < wc ? taps_end : wc), pp * int(a.stride_h) - int(a.pad_h), g);
}

// acc += dy_row^T . X_r over one stage: the warp's two m-tiles x R n-tiles.
template <class E, int R>
__device__ __forceinline__ void row_gemm(float (&acc)[2][R][4], const RowWindow& g, const E* stage, int wm, int wn,
                                         int lane) {
  const E* rows = stage + kDyTile;
  for (int ks = 0; ks < g.psteps; ++ks) {
    uint32_t af[2][4];
    CUTLASS_PRAGMA_UNROLL
    for (int mt = 0; mt < 2; ++mt)  // A = dy^T: the tile holds pixels x channels (k x m)
      ldsm_x4_t(af[mt], stage + (ks * 16 + lane % 8 + (lane / 16) * 8) * kDyRow + wm * 32 + mt * 16 +
                            ((lane / 8) % 2) * 8);
    const int q = ks * 16 + lane % 8 + ((lane / 8) % 2) * 8;  // this lane's pixel row of the B tiles
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < R; t += 2) {
      // lanes 0-15 address n-tile t, lanes 16-31 n-tile t + 1 (t again past the warp's last)
      const int nt = wn * R + t + ((lane / 16) && t + 1 < R ? 1 : 0), r = nt / 4, col = (nt % 4) * 8;
      uint32_t b[4];
      ldsm_x4_t(b, rows + r * g.row_len + q * g.step + col);
      CUTLASS_PRAGMA_UNROLL
      for (int mt = 0; mt < 2; ++mt) {
        mma<E>(acc[mt][t], af[mt], b[0], b[1]);
        if (t + 1 < R) mma<E>(acc[mt][t + 1], af[mt], b[2], b[3]);
      }
    }
  }
}

// The CTA's partial dw (K x R*S*C, its 64 channels) from the warps' accumulators.
template <int R>
__device__ __forceinline__ void store_partial(const cvt_convbwd_args& a, float* part, const float (&acc)[2][R][4],
                                              int kb, int wm, int wn, int lane) {
  const int taps = int(a.s * a.c), rsc = int(a.r) * taps;
  CUTLASS_PRAGMA_UNROLL
  for (int mt = 0; mt < 2; ++mt) {
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < R; ++t) {
      const int nt = wn * R + t, r = nt / 4, j = (nt % 4) * 8 + 2 * (lane % 4);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int k = kb * kChannels + wm * 32 + mt * 16 + lane / 4 + 8 * (e / 2), jj = j + e % 2;
        if (jj < taps) part[int64_t(k) * rsc + r * taps + jj] = acc[mt][t][e];
      }
    }
  }
}

// part_w: (gridDim.x, K * R * S * C) fp32 partials; part_b: (gridDim.x, K) or null.
template <class E, int R, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    wgrad_rows_kernel(const cvt_convbwd_args a, const RowWindow g, float* part_w, float* part_b) {
  pdl_enter();
  extern __shared__ __align__(16) char smem_raw[];
  E* smem = reinterpret_cast<E*>(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wm = warp / 4, wn = warp % 4;
  const int kb = int(blockIdx.y), cta = int(blockIdx.x), stage = stage_elems(g, R);
  const int begin = first_row(g, cta), count = row_count(g, cta);
  for (int s = 0; s < kStages; ++s) zero_margins(smem + s * stage + kDyTile, R, g, int(a.w * a.c));
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) load_row<E, R>(a, g, smem + s * stage, begin + s, kb);
    cp_async_commit();
  }
  float acc[2][R][4] = {};
  float db = 0.f;  // channel threadIdx.x % 64, pixels threadIdx.x / 64 + 4 i of the CTA's rows
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // row i is in for every thread; every warp is done with the stage refilled below
    const int ahead = i + kStages - 1;
    if (ahead < count) load_row<E, R>(a, g, smem + (ahead % kStages) * stage, begin + ahead, kb);
    cp_async_commit();
    const E* st = smem + (i % kStages) * stage;
    if (part_b)
      for (int q = int(threadIdx.x) / kChannels; q < int(a.q); q += kThreads / kChannels)
        db += float(st[q * kDyRow + int(threadIdx.x) % kChannels]);
    row_gemm<E, R>(acc, g, st, wm, wn, lane);
  }
  store_partial<R>(a, part_w + int64_t(cta) * a.k * a.r * a.s * a.c, acc, kb, wm, wn, lane);
  if (!part_b) return;
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: their memory sums db
  float* red = reinterpret_cast<float*>(smem_raw);
  red[threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.x < kChannels) {
    const int t = int(threadIdx.x);
    part_b[int64_t(cta) * a.k + kb * kChannels + t] = red[t] + red[t + 64] + red[t + 128] + red[t + 192];
  }
}

}  // namespace wgrad_rows

template <class Cfg>
struct WgradRows {
  static constexpr int kFamily = CVT_FAMILY_CONV2D_BWD;
  using Element = typename Cfg::Element;
  static constexpr int kR = Cfg::kR, kStages = Cfg::kStages, kWaves = Cfg::kWaves;

  static const void* kernel_fn() {
    return reinterpret_cast<const void*>(wgrad_rows::wgrad_rows_kernel<Element, kR, kStages, 2>);
  }
  // CTAs along the output rows: p.splits if set, else kWaves per SM over the channel blocks.
  static int ctas_of(const cvt_convbwd_args& p) {
    const int64_t rows = p.n * p.p, blocks = p.k / wgrad_rows::kChannels;
    int64_t c = p.splits > 0 ? p.splits : (int64_t(kWaves) * sms_of(p) + blocks - 1) / blocks;
    return int(c < 1 ? 1 : (c > rows ? rows : c));
  }
  static int64_t smem_bytes(const cvt_convbwd_args& p) {
    return int64_t(kStages) * wgrad_rows::stage_elems(wgrad_rows::geometry(p, 1), kR) * int64_t(sizeof(Element));
  }
  static size_t round256(size_t b) { return (b + 255) / 256 * 256; }
  static size_t part_w_bytes(const cvt_convbwd_args& p) {
    return round256(size_t(ctas_of(p)) * size_t(p.k * p.r * p.s * p.c) * sizeof(float));
  }

  static bool can_implement(const cvt_convbwd_args& p) {
    if (!convbwd_geometry_ok(p) || !p.x || !p.dw || p.r != kR) return false;
    if (!conv_rows::rows_fit(p.c, p.k, p.s, p.w, p.q, p.stride_w, p.pad_w) || p.n * p.p > INT32_MAX) return false;
    const uintptr_t ptrs = reinterpret_cast<uintptr_t>(p.dy) | reinterpret_cast<uintptr_t>(p.x);
    return ptrs % 16 == 0 && smem_bytes(p) <= wgrad_rows::kSmemCap;
  }

  static size_t workspace_size(const cvt_convbwd_args& p) {
    return part_w_bytes(p) + (p.db ? round256(size_t(ctas_of(p)) * size_t(p.k) * sizeof(float)) : 0);
  }

  // The row kernel (CTA i writes its partial dw and db), then both sets of partials summed in CTA
  // order by one launch: all on `stream`, no atomics (deterministic).
  static int launch(const cvt_convbwd_args& p, void* workspace, cudaStream_t stream) {
    if (!workspace) return CVT_ERR_WORKSPACE;
    if (!smem_ready<WgradRows>(kernel_fn(), wgrad_rows::kSmemCap, p.device_id)) return CVT_ERR_SMEM;
    const int ctas = ctas_of(p);
    const conv_rows::RowWindow g = wgrad_rows::geometry(p, ctas);
    float* part_w = static_cast<float*>(workspace);
    float* part_b = p.db ? reinterpret_cast<float*>(static_cast<char*>(workspace) + part_w_bytes(p)) : nullptr;
    launch_kernel(wgrad_rows::wgrad_rows_kernel<Element, kR, kStages, 2>,
                  dim3(unsigned(ctas), unsigned(p.k / wgrad_rows::kChannels)), wgrad_rows::kThreads, int(smem_bytes(p)),
                  stream, p, g, part_w, part_b);
    const int64_t dw_size = p.k * p.r * p.s * p.c;
    ColsumSegment<Element> db;
    if (p.db) db = {part_b, ctas, p.k, p.k, static_cast<Element*>(p.db)};
    colsum2<Element>({part_w, ctas, dw_size, dw_size, static_cast<Element*>(p.dw)}, db, stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
