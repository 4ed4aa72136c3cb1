// CvT's stem conv, weight gradient, as row-window GEMMs (mma.sync, SM80-class: serves sm_89 and,
// built for the running GPU, sm_90). For few input channels (the stem's 3, padded to 4) the implicit
// GEMM reads 8 bytes of x per access and runs far below the GPU's rates (the 7 x 7 / 4 stem at batch
// 128: 0.195 ms on an H200 for 10 GFLOP, ~52 TFLOP/s). Here the im2col matrix is never formed: for
// output row (n, p) and filter row r, the S * C taps of output pixel q are one contiguous run of the
// input row ih = p * stride_h - pad_h + r,
//   x[n, ih, q * stride_w - pad_w + s, c] = row[(q * stride_w - pad_w) * C + s * C + c],
// so dw[k, r, s, c] = sum over (n, p, q) of dy[n, p, q, k] * row_r(n, p)[q * stride_w * C + j - pad_w * C]
// (j = s * C + c): per output row a GEMM dy_row^T (K x Q) . X_r (Q x S*C) whose B operand is a window
// of an input row in shared memory, its rows stride_w * C elements apart (ldmatrix takes any
// 16-byte-aligned row addresses, so the overlapping windows cost nothing to form).
//
// A CTA: 8 warps, 64 output channels (blockIdx.y picks them), a contiguous run of output rows
// (n, p) (blockIdx.x); each row's dy (Q x 64, pixels zero-filled up to a multiple of 16) and its R
// input rows (zeros outside the image and in the margins) come by cp.async, kStages rows ahead.
// Warp (wm, wn): channels wm*32 .. +31 (two m-tiles) x the n-tiles wn*R .. +R-1 of the R x 4 tiles
// of 8 taps (taps j >= S*C are computed and dropped). fp32 accumulators stay in registers across the
// CTA's rows; at the end each CTA writes its partial dw (and db: dy summed over its pixels) to the
// workspace, and the partials are summed in CTA order (common/reduce.cuh): deterministic, no atomics.
//
// Serves: dilation 1, C * stride_w and C * pad_w multiples of 8 (16-byte window starts), W * C a
// multiple of 8, S * C <= 32, Q <= 64, K a multiple of 64, R = Cfg::kR, and the stages within
// kSmemCap. CvT's stem (C 4, 7 x 7, stride 4, pad 2, Q 56 at 224) is the case it is for.
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
#include "common/mma_sync.cuh"
#include "common/reduce.cuh"
#include "conv2d/abi.h"
#include "conv2d/bwd_geometry.cuh"

namespace cvt_kernel {
namespace wgrad_rows {

constexpr int kThreads = 256;          // 8 warps: 2 along the block's channels x 4 along the taps
constexpr int kChannels = 64;          // output channels per CTA
constexpr int kMaxQ = 64;              // output pixels of a row (zero rows up to a multiple of 16)
constexpr int kTaps = 32;              // columns per filter row: S * C <= 32 (the rest dropped)
constexpr int kDyRow = kChannels + 8;  // shared dy row, elements: 144 bytes, ldmatrix without bank conflicts
constexpr int kDyTile = kMaxQ * kDyRow;
constexpr int kSmemCap = 96 * 1024;    // within sm_89's 99 KB per block

// A launch's geometry (host-computed).
struct Geom {
  int rows;            // output rows N * P
  int per_cta, extra;  // rows per CTA: the first `extra` CTAs take one more
  int margin;          // zeros left of an input row in shared memory: pad_w * C elements
  int row_len;         // a shared input row, elements (margins included, a multiple of 8)
  int stage;           // one stage, elements: the dy tile, then R input rows
  int ksteps;          // 16-pixel steps: ceil(Q / 16)
  int step;            // elements between the windows of neighbouring pixels: stride_w * C
};

inline Geom geometry(const cvt_convbwd_args& a, int r, int ctas) {
  Geom g{};
  g.rows = int(a.n * a.p);
  g.per_cta = g.rows / ctas;
  g.extra = g.rows % ctas;
  g.margin = int(a.pad_w * a.c);
  g.ksteps = int((a.q + 15) / 16);
  g.step = int(a.stride_w * a.c);
  const int last = (g.ksteps * 16 - 1) * g.step + kTaps;  // past the last window read (margin included)
  const int need = last > g.margin + int(a.w * a.c) ? last : g.margin + int(a.w * a.c);
  g.row_len = (need + 7) / 8 * 8;
  g.stage = kDyTile + r * g.row_len;
  return g;
}

// One output row's dy (64 channels of block kb) and R input rows into a stage, by cp.async.
template <class E, int R>
__device__ __forceinline__ void load_row(const cvt_convbwd_args& a, const Geom& g, E* stage, int row, int kb) {
  const int n = row / int(a.p), pp = row % int(a.p), q_len = int(a.q), wc = int(a.w * a.c);
  const E* dy = static_cast<const E*>(a.dy) + int64_t(row) * a.q * a.k + kb * kChannels;
  for (int i = int(threadIdx.x); i < g.ksteps * 16 * (kChannels / 8); i += kThreads) {
    const int q = i / (kChannels / 8), ch = (i % (kChannels / 8)) * 8;
    cp_async16(stage + q * kDyRow + ch, q < q_len ? dy + int64_t(q) * a.k + ch : dy, q < q_len);
  }
  const E* x = static_cast<const E*>(a.x) + int64_t(n) * a.h * wc;
  E* rows = stage + kDyTile + g.margin;
  const int chunks = wc / 8;
  for (int i = int(threadIdx.x); i < R * chunks; i += kThreads) {
    const int r = i / chunks, e = (i % chunks) * 8, ih = pp * int(a.stride_h) - int(a.pad_h) + r;
    const bool in = ih >= 0 && ih < int(a.h);
    cp_async16(rows + r * g.row_len + e, in ? x + int64_t(ih) * wc + e : x, in);
  }
}

// acc += dy_row^T . X_r over one stage: the warp's two m-tiles x R n-tiles.
template <class E, int R>
__device__ __forceinline__ void row_gemm(float (&acc)[2][R][4], const Geom& g, const E* stage, int wm, int wn,
                                         int lane) {
  const E* rows = stage + kDyTile;
  for (int ks = 0; ks < g.ksteps; ++ks) {
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
    wgrad_rows_kernel(const cvt_convbwd_args a, const Geom g, float* part_w, float* part_b) {
  extern __shared__ __align__(16) char smem_raw[];
  E* smem = reinterpret_cast<E*>(smem_raw);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, wm = warp / 4, wn = warp % 4;
  const int kb = int(blockIdx.y), cta = int(blockIdx.x);
  const int begin = cta * g.per_cta + (cta < g.extra ? cta : g.extra);
  const int count = g.per_cta + (cta < g.extra ? 1 : 0);
  const int wc = int(a.w * a.c);
  for (int s = 0; s < kStages; ++s)  // the margins: zeros, never written by the loads
    for (int i = int(threadIdx.x); i < R * g.row_len; i += kThreads) {
      const int col = i % g.row_len;
      if (col < g.margin || col >= g.margin + wc) smem[s * g.stage + kDyTile + i] = E(0.f);
    }
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < count) load_row<E, R>(a, g, smem + s * g.stage, begin + s, kb);
    cp_async_commit();
  }
  float acc[2][R][4] = {};
  float db = 0.f;  // channel threadIdx.x % 64, pixels threadIdx.x / 64 + 4 i of the CTA's rows
  for (int i = 0; i < count; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // row i is in for every thread; every warp is done with the stage refilled below
    const int ahead = i + kStages - 1;
    if (ahead < count) load_row<E, R>(a, g, smem + (ahead % kStages) * g.stage, begin + ahead, kb);
    cp_async_commit();
    const E* stage = smem + (i % kStages) * g.stage;
    if (part_b)
      for (int q = int(threadIdx.x) / kChannels; q < int(a.q); q += kThreads / kChannels)
        db += float(stage[q * kDyRow + int(threadIdx.x) % kChannels]);
    row_gemm<E, R>(acc, g, stage, wm, wn, lane);
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
  static int smem_bytes(const cvt_convbwd_args& p) {
    return kStages * wgrad_rows::geometry(p, kR, 1).stage * int(sizeof(Element));
  }
  static size_t round256(size_t b) { return (b + 255) / 256 * 256; }
  static size_t part_w_bytes(const cvt_convbwd_args& p) {
    return round256(size_t(ctas_of(p)) * size_t(p.k * p.r * p.s * p.c) * sizeof(float));
  }

  static bool can_implement(const cvt_convbwd_args& p) {
    if (!convbwd_geometry_ok(p) || !p.x || !p.dw || p.r != kR) return false;
    if ((p.stride_w * p.c) % 8 || (p.pad_w * p.c) % 8 || (p.w * p.c) % 8 || p.s * p.c > wgrad_rows::kTaps) return false;
    if (p.q > wgrad_rows::kMaxQ || p.k % wgrad_rows::kChannels || p.n * p.p > INT32_MAX) return false;
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
    const wgrad_rows::Geom g = wgrad_rows::geometry(p, kR, ctas);
    float* part_w = static_cast<float*>(workspace);
    float* part_b = p.db ? reinterpret_cast<float*>(static_cast<char*>(workspace) + part_w_bytes(p)) : nullptr;
    wgrad_rows::wgrad_rows_kernel<Element, kR, kStages, 2>
        <<<dim3(unsigned(ctas), unsigned(p.k / wgrad_rows::kChannels)), wgrad_rows::kThreads, smem_bytes(p),
           stream>>>(p, g, part_w, part_b);
    const int64_t dw_size = p.k * p.r * p.s * p.c;
    ColsumSegment<Element> db;
    if (p.db) db = {part_b, ctas, p.k, p.k, static_cast<Element*>(p.db)};
    colsum2<Element>({part_w, ctas, dw_size, dw_size, static_cast<Element*>(p.dw)}, db, stream);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
