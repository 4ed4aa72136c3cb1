// Depthwise KxK conv (stride fixed at compile time, padding of the problem, dilation 1) on
// NHWC tokens with BatchNorm folded into fp32 weights and bias (operators/conv2d/abi.h:
// cvt_conv_args, k == c). CvT's conv projections: 3x3, stride 1 for q, 2 for k and v. CUTLASS's
// DepthwiseDirect2dConv accumulates in fp16; this kernel reads fp16/bf16, accumulates in fp32.
//
// One thread computes Pix consecutive outputs along W of one output row for 8 channels (one
// 16-byte access), so the input columns its outputs share are loaded once. Rows in front of each
// image (cls_rows, CvT's stage-3 cls token) are copied from x to y unchanged.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/fast_math.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "conv2d/abi.h"
#include "common/device.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {

template <class Element_, int Stride, int Pix, int Threads, int Kernel>
struct DwConv {
  static constexpr int kFamily = CVT_FAMILY_DWCONV2D;
  using Element = Element_;
  static constexpr int kVec = 8;         // channels per thread: one 16-byte access
  static constexpr int kPix = Pix;       // consecutive outputs along W per thread
  static constexpr int kStride = Stride;
  static constexpr int kR = Kernel, kS = Kernel;
  static constexpr int kCols = (kPix - 1) * kStride + kS;  // input columns the kPix outputs read
  static constexpr int kThreads = Threads;
  using Vec = cutlass::Array<Element, kVec>;
  using VecF = cutlass::Array<float, kVec>;

  static bool can_implement(const cvt_conv_args& p);
  static size_t workspace_size(const cvt_conv_args&) { return 0; }
  static int launch(const cvt_conv_args& p, void*, cudaStream_t stream);
};

// acc[j] = bias of channels 8*c8.. (zero without a bias).
template <class K>
__device__ __forceinline__ void dw_init(typename K::VecF (&acc)[K::kPix], const void* bias, int c8) {
  if (bias) {
    const float4* bp = reinterpret_cast<const float4*>(static_cast<const float*>(bias) + c8 * K::kVec);
    const float4 lo = __ldg(bp), hi = __ldg(bp + 1);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < K::kPix; ++j) {
      acc[j][0] = lo.x; acc[j][1] = lo.y; acc[j][2] = lo.z; acc[j][3] = lo.w;
      acc[j][4] = hi.x; acc[j][5] = hi.y; acc[j][6] = hi.z; acc[j][7] = hi.w;
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < K::kPix; ++j) acc[j].fill(0.f);
  }
}

// xf[u] = x[ih, iw0 + u] for channels 8*c8.. in fp32 (zero outside the image), u < kCols.
template <class K, class TX>
__device__ __forceinline__ void dw_load_row(const TX& X, int ih, int iw0, int W, int c8,
                                            typename K::VecF (&xf)[K::kCols]) {
  cutlass::NumericArrayConverter<float, typename K::Element, K::kVec> to_float;
  CUTLASS_PRAGMA_UNROLL
  for (int u = 0; u < K::kCols; ++u) {
    const int iw = iw0 + u;
    if (iw >= 0 && iw < W) {
      const uint4 raw = __ldg(&X(ih, iw, c8));
      xf[u] = to_float(reinterpret_cast<typename K::Vec const&>(raw));
    } else {
      xf[u].fill(0.f);
    }
  }
}

// y[p, q0 + j] = acc[j] in the activation dtype, j < kPix where q0 + j < Q.
template <class K, class TY>
__device__ __forceinline__ void dw_store(const TY& Y, int p, int q0, int c8, int Q,
                                         const typename K::VecF (&acc)[K::kPix]) {
  cutlass::NumericArrayConverter<typename K::Element, float, K::kVec> to_out;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < K::kPix; ++j) {
    if (q0 + j < Q) {
      typename K::Vec o = to_out(acc[j]);
      Y(p, q0 + j, c8) = reinterpret_cast<uint4 const&>(o);
    }
  }
}

// One thread: kPix consecutive outputs along W of one output row, 8 channels. blockIdx.y is the
// image; indices within an image fit in 32 bits (can_implement checks) and are split with
// precomputed fast divisions, so a thread spends its time on loads, not on 64-bit integer math.
template <class K>
__global__ void __launch_bounds__(K::kThreads) dwconv_kernel(cvt_conv_args a, int work, int spatial_items,
                                                             cutlass::FastDivmod div_c8, cutlass::FastDivmod div_qg) {
  pdl_enter();
  using namespace cute;
  using Element = typename K::Element;
  using VecF = typename K::VecF;
  constexpr int kVec = K::kVec, kPix = K::kPix, kStride = K::kStride, kR = K::kR, kS = K::kS;
  const int tid = int(blockIdx.x) * K::kThreads + int(threadIdx.x);
  if (tid >= work) return;
  const int img = int(blockIdx.y);
  const int c8n = int(a.c / kVec);
  int item, c8;
  div_c8(item, c8, tid);
  const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride;
  Element* yb = static_cast<Element*>(a.y) + int64_t(img) * a.y_image_stride;
  if (item >= spatial_items) {  // the rows in front of the image (cls token): copied unchanged
    const int row = item - spatial_items - int(a.cls_rows);  // -cls_rows .. -1
    reinterpret_cast<uint4*>(yb + int64_t(row) * a.k)[c8] =
        __ldg(reinterpret_cast<const uint4*>(xb + int64_t(row) * a.c) + c8);
    return;
  }
  int p, qg;
  div_qg(p, qg, item);
  const int q0 = qg * kPix;
  const int H = int(a.h), W = int(a.w);
  // Images as CuTe tensors of 16-byte vectors: (row, col, channel group), row-major NHWC.
  auto X = make_tensor(make_gmem_ptr(reinterpret_cast<const uint4*>(xb)),
                       make_layout(make_shape(H, W, c8n), make_stride(W * c8n, c8n, Int<1>{})));
  auto Y = make_tensor(make_gmem_ptr(reinterpret_cast<uint4*>(yb)),
                       make_layout(make_shape(int(a.p), int(a.q), c8n), make_stride(int(a.q) * c8n, c8n, Int<1>{})));
  const float* wgt = static_cast<const float*>(a.filter) + c8 * kVec;

  VecF acc[kPix];
  dw_init<K>(acc, a.bias, c8);
  const int iw0 = q0 * kStride - int(a.pad_w);
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kR; ++r) {
    const int ih = p * kStride - int(a.pad_h) + r;
    if (ih < 0 || ih >= H) continue;
    // The row's input vectors first (all loads in flight together), then the math.
    VecF xf[K::kCols];
    dw_load_row<K>(X, ih, iw0, W, c8, xf);
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kS; ++s) {
      const float4* wp = reinterpret_cast<const float4*>(wgt + (r * kS + s) * int(a.c));
      const float4 lo = __ldg(wp), hi = __ldg(wp + 1);
      const float wv[kVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kPix; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kVec; ++v) acc[j][v] = fmaf(wv[v], xf[j * kStride + s][v], acc[j][v]);
      }
    }
  }
  dw_store<K>(Y, p, q0, c8, int(a.q), acc);
}

template <class E, int Stride, int Pix, int Threads, int Kernel>
bool DwConv<E, Stride, Pix, Threads, Kernel>::can_implement(const cvt_conv_args& p) {
  if (p.n <= 0 || p.h <= 0 || p.w <= 0 || p.c <= 0 || p.p <= 0 || p.q <= 0) return false;
  if (p.k != p.c || p.r != kR || p.s != kS || p.stride_h != kStride || p.stride_w != kStride) return false;
  if (p.dilation_h != 1 || p.dilation_w != 1 || p.pad_h < 0 || p.pad_w < 0 || p.cls_rows < 0) return false;
  if (p.p != (p.h + 2 * p.pad_h - kR) / kStride + 1 || p.q != (p.w + 2 * p.pad_w - kS) / kStride + 1) return false;
  // 16-byte accesses: channels, image strides and pointers in multiples of 8 elements.
  if (p.c % kVec || p.x_image_stride % kVec || p.y_image_stride % kVec) return false;
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y) |
       reinterpret_cast<uintptr_t>(p.filter)) % 16) return false;
  if (p.bias && reinterpret_cast<uintptr_t>(p.bias) % 16) return false;
  if (p.x_image_stride < (p.cls_rows + p.h * p.w) * p.c || p.y_image_stride < (p.cls_rows + p.p * p.q) * p.c)
    return false;
  // 32-bit indexing within an image; the batch runs along grid y.
  if ((p.cls_rows + p.h * p.w) * p.c > INT32_MAX || (p.cls_rows + p.p * p.q) * p.c > INT32_MAX) return false;
  if (p.n > 65535) return false;
  return true;
}

template <class E, int Stride, int Pix, int Threads, int Kernel>
int DwConv<E, Stride, Pix, Threads, Kernel>::launch(const cvt_conv_args& p, void*, cudaStream_t stream) {
  const int q_groups = int((p.q + kPix - 1) / kPix);
  const int spatial_items = int(p.p) * q_groups;
  const int c8n = int(p.c / kVec);
  const int work = (spatial_items + int(p.cls_rows)) * c8n;
  dim3 grid((work + kThreads - 1) / kThreads, unsigned(p.n));
  launch_kernel(dwconv_kernel<DwConv>, grid, kThreads, 0, stream, p, work, spatial_items, cutlass::FastDivmod(c8n),
                cutlass::FastDivmod(q_groups));
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
