// Depthwise 3x3 conv + BatchNorm, training backward (operators/dwconv/abi.h: cvt_dwbnbwd_args),
// five kernels, the conv output z recomputed from x where it is needed (nothing but mean / invstd
// is saved): (1) per-block sums of dy and dy * xhat; (2) per channel: dgamma, dbeta and
// dz = A dy + K1 + K2 (z - mean); (3) dz written in the activation dtype (the rounding torch's
// BatchNorm backward makes too), the cls rows' dx = dy; (4) input-centric dgrad + wgrad in one
// pass: a thread owns kIn inputs along W and reads the dz of every output they feed:
// dx[i] = sum_taps w * dz, dW[tap] += x[i] * dz (9 taps x 8 channels of fp32 sums per thread,
// per-block partials); (5) the partials summed in order into dW (common/reduce.cuh: colsum). A
// grouped launch (abi.h: next) runs two problems in the same five launches (blockIdx.z).
#pragma once
#include "dwconv/dwbn_common.cuh"
#include "common/reduce.cuh"

namespace cvt_kernel {

// In: inputs per thread along W of the dgrad/wgrad kernel (a multiple of the stride); its
// output-centric kernels take In / Stride outputs, the same input footprint. Groups: 8-channel
// groups per block of the reducing kernels.
template <class Element_, int Stride, int In, int Groups, int Threads>
struct DwBnBwd : DwBnShape<Element_, Stride, In / Stride, Groups, Threads> {
  using Shape = DwBnShape<Element_, Stride, In / Stride, Groups, Threads>;
  using typename Shape::Element;
  using Shape::kCG;
  using Shape::kOut;
  using Shape::kStride;
  using Shape::kThreads;
  using Shape::kVec;
  static constexpr int kFamily = CVT_FAMILY_DWCONV_BN_BWD;
  static constexpr int kIn = In;  // inputs per thread along W in the dgrad/wgrad kernel
  // dz columns those inputs feed (+1 unused at stride 2)
  static constexpr int kOutCols = (kIn + kStride) / kStride + 1;
  static_assert(kIn % kStride == 0 && kOut * kStride == kIn, "inputs per thread: a multiple of the stride");

  static int64_t reduce_items(const cvt_dwbnbwd_args& a) { return a.n * a.p * ((a.q + kOut - 1) / kOut); }
  static int64_t dgrad_items(const cvt_dwbnbwd_args& a) { return a.n * a.h * ((a.w + kIn - 1) / kIn); }
  static int reduce_rows(const cvt_dwbnbwd_args& a);
  static int dgrad_rows(const cvt_dwbnbwd_args& a);
  // Workspace: dz (n, p*q, C) in the activation dtype, then fp32: the reduce partials, the 3 x C
  // coefficients, the dW partials (each 16-byte aligned: C is a multiple of 8).
  struct Layout {
    size_t dz_bytes, part1, coef, part4, total;  // float offsets after dz, total bytes
  };
  static Layout layout_of(const cvt_dwbnbwd_args& a);  // one problem's (a grouped launch: one per problem)
  static bool can_implement(const cvt_dwbnbwd_args& a);
  static size_t workspace_size(const cvt_dwbnbwd_args& a) { return layout_of(a).total * (a.next ? 2 : 1); }
  static int launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream);
};

// part[block][0..1][c] = (sum dy, sum dy * xhat) over the outputs the block saw.
template <class K>
__global__ void __launch_bounds__(K::kThreads) bn_bwd_reduce_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, Geo g, int items,
                                                                    cutlass::FastDivmod div_img,
                                                                    cutlass::FastDivmod div_qg, float* part0) {
  using Element = typename K::Element;
  const cvt_dwbnbwd_args a = problem_of(grp);
  float* part = problem_ws(part0, grp.ws_bytes);
  constexpr int kVec = K::kVec, kOut = K::kOut, kCG = K::kCG, kLanes = K::kLanes, kWarps = K::kWarps;
  __shared__ float smem[kWarps * 2 * kCG * kVec];
  const int lane_c = int(threadIdx.x) % kCG, lane_s = int(threadIdx.x) / kCG;
  const int c8 = int(blockIdx.y) * kCG + lane_c;
  VecF8 acc2[2] = {zero8(), zero8()};
  if (c8 < g.C8) {
    const VecF8 mean = ldf8(a.mean + c8 * kVec), inv = ldf8(a.invstd + c8 * kVec);
    for (int it = int(blockIdx.x) * kLanes + lane_s; it < items; it += int(gridDim.x) * kLanes) {
      int img, rem, p, qg;
      div_img(img, rem, it);
      div_qg(p, qg, rem);
      const int q0 = qg * kOut;
      const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride + int64_t(g.cls) * g.C;
      const Element* dyb = static_cast<const Element*>(a.dy) + int64_t(img) * a.dy_image_stride + int64_t(g.cls) * g.C;
      VecF8 z[kOut];
      conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, z);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kOut; ++j) {
        if (q0 + j >= g.Q) break;
        const VecF8 dy = ld8(dyb + (p * g.Q + q0 + j) * g.C + c8 * kVec);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) {
          acc2[0][e] += dy[e];
          acc2[1][e] = fmaf(dy[e], (z[j][e] - mean[e]) * inv[e], acc2[1][e]);
        }
      }
    }
  }
  block_sums<K, 2>(acc2, part, g.C, smem);
}

// Channel c's coefficients of dz = A dy + K1 + K2 (z - mean) from sum dy and sum dy * xhat over n values.
__device__ __forceinline__ void dz_coefs(const cvt_dwbnbwd_args& a, int c, float sb, float sg, float n, float* coef) {
  const float inv = a.invstd[c];
  const float A = (a.bn_weight ? a.bn_weight[c] : 1.f) * inv;
  coef[c] = A;
  coef[a.c + c] = -A * sb / n;
  coef[2 * a.c + c] = -A * inv * sg / n;
}

// dbeta = sum dy, dgamma = sum dy * xhat (rows summed in a fixed order), and the coefficients of
// dz = A dy + K1 + K2 (z - mean): A = gamma * invstd, K1 = -A dbeta / n, K2 = -A invstd dgamma / n.
// The same for every configuration: not a template.
__global__ void __launch_bounds__(1024) bn_bwd_finish_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, const float* part0,
                                                             int rows, float* coef0) {
  __shared__ float s_b[32][33], s_g[32][33];
  const cvt_dwbnbwd_args a = problem_of(grp);
  const float* part = problem_ws(part0, grp.ws_bytes);
  float* coef = problem_ws(coef0, grp.ws_bytes);
  const int C = int(a.c);
  const int c = int(blockIdx.x) * 32 + int(threadIdx.x);
  if (a.phase == CVT_DWBN_APPLY) {  // the given sums over all the batches
    if (threadIdx.y == 0 && c < C) dz_coefs(a, c, a.sum_dy[c], a.sum_dy_xhat[c], *a.count, coef);
    return;
  }
  float sb = 0.f, sg = 0.f;
  if (c < C)
    for (int r = int(threadIdx.y); r < rows; r += 32) {
      sb += part[int64_t(r) * 2 * C + c];
      sg += part[int64_t(r) * 2 * C + C + c];
    }
  s_b[threadIdx.y][threadIdx.x] = sb;
  s_g[threadIdx.y][threadIdx.x] = sg;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  sb = sg = 0.f;
  for (int i = 0; i < 32; ++i) {
    sb += s_b[i][threadIdx.x];
    sg += s_g[i][threadIdx.x];
  }
  if (a.dbn_bias) a.dbn_bias[c] = sb;
  if (a.dbn_weight) a.dbn_weight[c] = sg;
  if (a.phase != CVT_DWBN_STATS) dz_coefs(a, c, sb, sg, float(double(a.n) * double(a.p) * double(a.q)), coef);
}

// dz (n, p*q, C) packed, kOut outputs x 8 channels per thread; the cls rows: dx = dy.
template <class K>
__global__ void __launch_bounds__(K::kThreads) bn_dz_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, Geo g, const float* coef0,
                                                            typename K::Element* dz0, int work, int spatial,
                                                            cutlass::FastDivmod div_c8, cutlass::FastDivmod div_qg) {
  using Element = typename K::Element;
  const cvt_dwbnbwd_args a = problem_of(grp);
  const float* coef = problem_ws(coef0, grp.ws_bytes);
  Element* dz = problem_ws(dz0, grp.ws_bytes);
  constexpr int kVec = K::kVec, kOut = K::kOut;
  int img, item, c8;
  if (!out_item<K>(work, div_c8, img, item, c8)) return;
  const Element* dyb = static_cast<const Element*>(a.dy) + int64_t(img) * a.dy_image_stride;
  if (item >= spatial)  // a cls row: its gradient passes through
    return copy_row8(dyb, static_cast<Element*>(a.dx) + int64_t(img) * a.dx_image_stride, item - spatial, g.C, c8);
  int p, q0;
  out_row<K>(div_qg, item, p, q0);
  const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride + int64_t(g.cls) * g.C;
  VecF8 z[kOut];
  conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, z);
  const VecF8 A = ldf8(coef + c8 * kVec), K1 = ldf8(coef + g.C + c8 * kVec), K2 = ldf8(coef + 2 * g.C + c8 * kVec);
  const VecF8 mean = ldf8(a.mean + c8 * kVec);
  Element* dzb = dz + int64_t(img) * g.P * g.Q * g.C;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kOut; ++j) {
    if (q0 + j >= g.Q) break;
    const int off = (p * g.Q + q0 + j) * g.C + c8 * kVec;
    const VecF8 dy = ld8(dyb + g.cls * g.C + off);
    VecF8 o;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) o[e] = fmaf(A[e], dy[e], fmaf(K2[e], z[j][e] - mean[e], K1[e]));
    st8(dzb + off, o);
  }
}

// One item of the dgrad/wgrad kernel, input-centric: the thread's kIn inputs (image img, row ih,
// columns iw0..) feed outputs oh = (ih + 1 - r) / S and ow = (iw + 1 - s) / S where those divide;
// u = ow - (iw0 / S - 1) indexes the dz columns loaded. dx stored, the dW sums kept in dw.
template <class K>
__device__ __forceinline__ void dgrad_wgrad_item(const cvt_dwbnbwd_args& a, const Geo& g,
                                                 const typename K::Element* dz, int it,
                                                 const cutlass::FastDivmod& div_img,
                                                 const cutlass::FastDivmod& div_wg, int c8, VecF8 (&dw)[9]) {
  using Element = typename K::Element;
  constexpr int kVec = K::kVec, kStride = K::kStride, kIn = K::kIn, kOutCols = K::kOutCols;
  int img, rem, ih, wg;
  div_img(img, rem, it);
  div_wg(ih, wg, rem);
  const int iw0 = wg * kIn;
  const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride + int64_t(g.cls) * g.C;
  const Element* dzb = dz + int64_t(img) * g.P * g.Q * g.C;
  VecF8 xf[kIn], dx[kIn];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kIn; ++j) {
    xf[j] = iw0 + j < g.W ? ld8(xb + (ih * g.W + iw0 + j) * g.C + c8 * kVec) : zero8();
    dx[j].fill(0.f);
  }
  const int ow_lo = iw0 / kStride - 1;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    const int t = ih + 1 - r;
    if (t < 0 || t % kStride) continue;
    const int oh = t / kStride;
    if (oh >= g.P) continue;
    VecF8 d[kOutCols];
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kOutCols; ++u) {
      const int ow = ow_lo + u;
      if (ow >= 0 && ow < g.Q) d[u] = ld8(dzb + (oh * g.Q + ow) * g.C + c8 * kVec);
      else d[u] = zero8();
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 3; ++s) {
      const VecF8 wv = ldf8(a.weight + (r * 3 + s) * g.C + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kIn; ++j) {
        if ((j + 1 - s + kStride) % kStride) continue;  // folded at compile time
        const int u = (j + 1 - s + kStride) / kStride;
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) {
          dx[j][e] = fmaf(wv[e], d[u][e], dx[j][e]);
          dw[r * 3 + s][e] = fmaf(xf[j][e], d[u][e], dw[r * 3 + s][e]);
        }
      }
    }
  }
  Element* dxb = static_cast<Element*>(a.dx) + int64_t(img) * a.dx_image_stride + int64_t(g.cls) * g.C;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kIn; ++j)
    if (iw0 + j < g.W) st8(dxb + (ih * g.W + iw0 + j) * g.C + c8 * kVec, dx[j]);
}

// Input-centric dgrad + wgrad: a thread owns kIn inputs along W and reads the dz of every output
// they feed; dx written, per-block dW partials part[block][tap][c].
template <class K>
__global__ void __launch_bounds__(K::kThreads) bn_dgrad_wgrad_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, Geo g,
                                                                     const typename K::Element* dz0, int items,
                                                                     cutlass::FastDivmod div_img,
                                                                     cutlass::FastDivmod div_wg, float* part0) {
  const cvt_dwbnbwd_args a = problem_of(grp);
  const typename K::Element* dz = problem_ws(dz0, grp.ws_bytes);
  float* part = problem_ws(part0, grp.ws_bytes);
  constexpr int kVec = K::kVec, kCG = K::kCG, kLanes = K::kLanes, kWarps = K::kWarps;
  __shared__ float smem[kWarps * 9 * kCG * kVec];
  const int lane_c = int(threadIdx.x) % kCG, lane_s = int(threadIdx.x) / kCG;
  const int c8 = int(blockIdx.y) * kCG + lane_c;
  VecF8 dw[9];
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < 9; ++t) dw[t].fill(0.f);
  if (c8 < g.C8) {
    for (int it = int(blockIdx.x) * kLanes + lane_s; it < items; it += int(gridDim.x) * kLanes)
      dgrad_wgrad_item<K>(a, g, dz, it, div_img, div_wg, c8, dw);
  }
  block_sums<K, 9>(dw, part, g.C, smem);
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::reduce_rows(const cvt_dwbnbwd_args& a) {
  return reduce_blocks<DwBnBwd, KernelTag<DwBnBwd, 1>>(
      a, reinterpret_cast<const void*>(&bn_bwd_reduce_kernel<DwBnBwd>), reduce_items(a));
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::dgrad_rows(const cvt_dwbnbwd_args& a) {
  return reduce_blocks<DwBnBwd, KernelTag<DwBnBwd, 2>>(
      a, reinterpret_cast<const void*>(&bn_dgrad_wgrad_kernel<DwBnBwd>), dgrad_items(a));
}

template <class E, int Stride, int In, int Groups, int Threads>
auto DwBnBwd<E, Stride, In, Groups, Threads>::layout_of(const cvt_dwbnbwd_args& a) -> Layout {
  Layout l;
  l.dz_bytes = (size_t(a.n * a.p * a.q * a.c) * sizeof(Element) + 255) / 256 * 256;
  l.part1 = 0;
  l.coef = size_t(reduce_rows(a)) * 2 * a.c;
  l.part4 = l.coef + 3 * size_t(a.c);
  l.total = (l.dz_bytes + (l.part4 + size_t(dgrad_rows(a)) * 9 * a.c) * sizeof(float) + 255) / 256 * 256;
  return l;
}

template <class E, int Stride, int In, int Groups, int Threads>
bool DwBnBwd<E, Stride, In, Groups, Threads>::can_implement(const cvt_dwbnbwd_args& a) {
  if (a.next && !(same_input(a, *a.next) && a.dy_image_stride == a.next->dy_image_stride &&
                  a.dx_image_stride == a.next->dx_image_stride && can_implement(*a.next)))
    return false;
  if (a.phase < CVT_DWBN_ALL || a.phase > CVT_DWBN_APPLY || (a.phase != CVT_DWBN_ALL && a.next)) return false;
  const bool outs = a.phase == CVT_DWBN_STATS ? a.dbn_weight && a.dbn_bias : a.dx && a.dweight;
  const bool sums = a.phase != CVT_DWBN_APPLY || (a.sum_dy && a.sum_dy_xhat && a.count);
  if (!common_ok<DwBnBwd>(a) || !a.dy || !outs || !sums || !a.mean || !a.invstd || a.n * a.p * a.q < 2)
    return false;
  if (a.dy_image_stride % kVec || a.dy_image_stride < (a.cls_rows + a.p * a.q) * a.c) return false;
  if (a.dx_image_stride % kVec || a.dx_image_stride < (a.cls_rows + a.h * a.w) * a.c) return false;
  const uintptr_t ptrs = reinterpret_cast<uintptr_t>(a.dy) | reinterpret_cast<uintptr_t>(a.dx) |
                         reinterpret_cast<uintptr_t>(a.mean) | reinterpret_cast<uintptr_t>(a.invstd);
  return ptrs % 16 == 0;
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream) {
  const Geo g = geo_of(a);
  const Layout l = layout_of(a);
  Element* dz = static_cast<Element*>(workspace);
  float* fws = reinterpret_cast<float*>(static_cast<char*>(workspace) + l.dz_bytes);
  const int chunks = (g.C8 + kCG - 1) / kCG;
  const int qgroups = (g.Q + kOut - 1) / kOut, spatial = g.P * qgroups;
  const int rows1 = reduce_rows(a), rows4 = dgrad_rows(a);
  const DwBnGroup<cvt_dwbnbwd_args> grp = group_of(a, l.total);
  const unsigned z = unsigned(grp.count);
  if (a.phase != CVT_DWBN_APPLY)
    bn_bwd_reduce_kernel<DwBnBwd><<<dim3(rows1, chunks, z), kThreads, 0, stream>>>(
        grp, g, int(reduce_items(a)), cutlass::FastDivmod(spatial), cutlass::FastDivmod(qgroups), fws + l.part1);
  bn_bwd_finish_kernel<<<dim3((g.C + 31) / 32, 1, z), dim3(32, 32), 0, stream>>>(grp, fws + l.part1, rows1,
                                                                                fws + l.coef);
  if (a.phase == CVT_DWBN_STATS) return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  const int work = (spatial + g.cls) * g.C8;
  bn_dz_kernel<DwBnBwd><<<dim3((work + kThreads - 1) / kThreads, unsigned(a.n), z), kThreads, 0, stream>>>(
      grp, g, fws + l.coef, dz, work, spatial, cutlass::FastDivmod(g.C8), cutlass::FastDivmod(qgroups));
  const int wgroups = (g.W + kIn - 1) / kIn;
  bn_dgrad_wgrad_kernel<DwBnBwd><<<dim3(rows4, chunks, z), kThreads, 0, stream>>>(
      grp, g, dz, int(dgrad_items(a)), cutlass::FastDivmod(g.H * wgroups), cutlass::FastDivmod(wgroups), fws + l.part4);
  // the dW partials of every problem summed in order, one launch
  const float* part4_next = reinterpret_cast<const float*>(reinterpret_cast<const char*>(fws + l.part4) + l.total);
  ColsumSegment<float> dw_next;
  if (a.next) dw_next = {part4_next, rows4, 9 * a.c, 9 * a.c, a.next->dweight};
  colsum2_or_defer<float>({fws + l.part4, rows4, 9 * a.c, 9 * a.c, a.dweight}, dw_next, a.defer, stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
