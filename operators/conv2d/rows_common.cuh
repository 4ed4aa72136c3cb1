// What the stem's row-window kernels (conv2d/fprop_rows.cuh, conv2d/wgrad_rows.cuh) share. For few
// input channels (the stem's 3, padded to 4) the implicit GEMM reads 8 bytes of x per access; these
// kernels read whole input rows instead. For output row (n, p) and filter row r, the S * C taps of
// output pixel q are one contiguous run of the input row ih = p * stride_h - pad_h + r:
//   x[n, ih, q * stride_w - pad_w + s, c] = row[(q * stride_w - pad_w) * C + s * C + c],
// so the im2col matrix of a filter row is a window of that row in shared memory whose rows lie
// stride_w * C elements apart, taps j = s * C + c along them (32 columns: taps j >= S * C are
// computed and dropped, or masked). ldmatrix takes any 16-byte-aligned row addresses, so the
// overlapping windows need no copy (rows 32 bytes apart, as the stem's, cost 2-way bank conflicts).
// A shared input row holds W * C elements behind a margin of pad_w * C zeros, with zeros after it up
// to the last window's end.
//
// rows_fit checks the window's side (stride_w >= 1, pad_w >= 0, C * stride_w and C * pad_w
// multiples of 8: 16-byte window starts; W * C a multiple of 8; S * C <= 32; Q <= 64; K a multiple
// of 64); each kernel's can_implement adds the rest (dilation 1, packed tensors, R of the
// instantiation, its stages within kSmemCap). CvT's stem (C 4, 7 x 7, stride 4, pad 2, Q 56 at
// 224) is the case they are for. operators/conv2d/spec.py: rows_serve / rows_smem_bytes say the same
// in Python.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "common/mma_sync.cuh"

namespace cvt_kernel {
namespace conv_rows {

constexpr int kThreads = 256;   // 8 warps
constexpr int kChannels = 64;   // output channels per CTA (blockIdx.y picks the block)
constexpr int kMaxQ = 64;       // output pixels of a row (up to 4 m-tiles of 16)
constexpr int kTaps = 32;       // columns of a filter row's window
constexpr int kSmemCap = 96 * 1024;  // within sm_89's 99 KB per block

// The input rows' layout in shared memory and the CTAs' share of the output rows (host-computed).
struct RowWindow {
  int rows;            // output rows N * P
  int per_cta, extra;  // output rows per CTA: the first `extra` CTAs take one more
  int margin;          // zeros left of an input row: pad_w * C elements
  int row_len;         // a shared input row, elements (margins included, a multiple of 8)
  int step;            // elements between the windows of neighbouring pixels: stride_w * C
  int psteps;          // 16-pixel steps: ceil(Q / 16)
};

inline RowWindow row_window(int64_t n, int64_t p, int64_t q, int64_t w, int64_t c, int64_t stride_w,
                            int64_t pad_w, int ctas) {
  RowWindow g{};
  g.rows = int(n * p);
  g.per_cta = g.rows / ctas;
  g.extra = g.rows % ctas;
  g.margin = int(pad_w * c);
  g.step = int(stride_w * c);
  g.psteps = int((q + 15) / 16);
  const int last = (g.psteps * 16 - 1) * g.step + kTaps;  // past the last window read (margin included)
  const int need = last > g.margin + int(w * c) ? last : g.margin + int(w * c);
  g.row_len = (need + 7) / 8 * 8;
  return g;
}

inline bool rows_fit(int64_t c, int64_t k, int64_t s, int64_t w, int64_t q, int64_t stride_w, int64_t pad_w) {
  return stride_w >= 1 && pad_w >= 0 && (c * stride_w) % 8 == 0 && (c * pad_w) % 8 == 0 && (w * c) % 8 == 0 &&
         s * c <= kTaps && q <= kMaxQ && k % kChannels == 0;
}

// The first output row of CTA `cta` and how many it takes.
__device__ __forceinline__ int first_row(const RowWindow& g, int cta) {
  return cta * g.per_cta + (cta < g.extra ? cta : g.extra);
}
__device__ __forceinline__ int row_count(const RowWindow& g, int cta) { return g.per_cta + (cta < g.extra ? 1 : 0); }

// Zeros in the margins of `count` shared input rows (the loads never write there).
template <class E>
__device__ __forceinline__ void zero_margins(E* rows, int count, const RowWindow& g, int wc) {
  for (int i = int(threadIdx.x); i < count * g.row_len; i += kThreads) {
    const int col = i % g.row_len;
    if (col < g.margin || col >= g.margin + wc) rows[i] = E(0.f);
  }
}

// Input rows ih = pp * stride_h - pad_h + r, r < R, of image `image` (H rows of wc elements) into
// shared rows by cp.async: their first `used` elements, zeros for the rest of the row and for rows
// outside the image.
template <class E, int R>
__device__ __forceinline__ void load_input_rows(E* rows, const E* image, int h, int wc, int used, int ih0,
                                                const RowWindow& g) {
  const int chunks = wc / 8;
  for (int i = int(threadIdx.x); i < R * chunks; i += kThreads) {
    const int r = i / chunks, e = (i % chunks) * 8, ih = ih0 + r;
    const int take = ih >= 0 && ih < h ? (used - e >= 8 ? 16 : (used > e ? 2 * (used - e) : 0)) : 0;
    cp_async16_head(rows + r * g.row_len + g.margin + e, take ? image + int64_t(ih) * wc + e : image, take);
  }
}

}  // namespace conv_rows
}  // namespace cvt_kernel
