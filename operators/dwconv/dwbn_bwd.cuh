// Depthwise 3x3 conv + BatchNorm, training backward (operators/dwconv/abi.h: cvt_dwbnbwd_args),
// five kernels, the conv output z recomputed from x where it is needed (nothing but mean / invstd
// is saved): (1) per-block sums of dy and dy * xhat; (2) per channel: dgamma, dbeta and
// dz = A dy + K1 + K2 (z - mean); (3) output-centric over conv output rows: dz written in the
// activation dtype (the rounding torch's BatchNorm backward makes too) and dW[tap] += x * dz from
// that rounded dz (9 taps x 8 channels of fp32 sums per thread, per-block partials); (4)
// input-centric dgrad: a thread owns kIn inputs along W and reads the dz of every output they
// feed, dx[i] = sum_taps w * dz, the cls rows' dx = dy; with sum_dx, one thread sums every
// problem's contributions (q's and the k / v pair's) into one dx; (5) the dW partials summed in
// order (common/reduce.cuh: colsum). A grouped launch (abi.h: next) runs two problems of one
// shape (DwBnBwd: k and v) or three of two shapes (DwBnBwdQkv: q, then the k / v pair) in the same
// five launches; where q's and the pair's shapes share x (shares_x), the sums and the dz + dW
// kernels walk q's rows and serve k and v from the same loads (dwbn_rows.cuh), and a summed dgrad
// walks the input rows with a window of the three problems' dz (bn_dgrad_rows_kernel).
#pragma once
#include "dwconv/dwbn_rows.cuh"
#include "common/reduce.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {

// The blocks of a sharing q / k / v library's row kernels (dwbn_rows.cuh): the sums pass's and
// the dz + dW pass's (0: a shape's own kernels run the pass).
struct RowBlocks {
  int sums = 0, dz = 0;
};

// In: inputs per thread along W of the dgrad kernel (a multiple of the stride); the reducing
// kernels (sums, dz + dW) take In / Stride conv outputs per item, the same input footprint.
// Groups: 8-channel groups per block of the reducing kernels.
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
  static constexpr int kIn = In;  // inputs per thread along W in the dgrad kernel
  static_assert(kIn % kStride == 0 && kOut * kStride == kIn, "inputs per thread: a multiple of the stride");

  static int64_t reduce_items(const cvt_dwbnbwd_args& a) { return a.n * a.p * ((a.q + kOut - 1) / kOut); }
  static int reduce_rows(const cvt_dwbnbwd_args& a);
  static int dz_rows(const cvt_dwbnbwd_args& a);
  static ReduceGrid reduce_grid(const cvt_dwbnbwd_args& a) {
    return out_rows_grid<DwBnBwd>(a, reduce_items(a), reduce_rows(a));
  }
  static ReduceGrid dz_grid(const cvt_dwbnbwd_args& a) {
    return out_rows_grid<DwBnBwd>(a, reduce_items(a), dz_rows(a));
  }
  // Workspace: dz (n, p*q, C) in the activation dtype, then fp32: the reduce partials, the 3 x C
  // coefficients, the dW partials of the dz pass (each 16-byte aligned: C is a multiple of 8).
  struct Layout {
    size_t dz_bytes, part1, coef, part4, total;  // float offsets after dz, total bytes
  };
  // one problem's (a grouped launch: one per problem); rows: the reduce and dz passes' blocks
  // where the row kernels run them (a sharing q / k / v library), else 0: this shape's
  static Layout layout_of(const cvt_dwbnbwd_args& a, RowBlocks rows = {});
  static bool can_implement(const cvt_dwbnbwd_args& a);
  static size_t workspace_size(const cvt_dwbnbwd_args& a) { return group_workspace(a, layout_of(a).total); }
  static int launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream);
};

// The backward of DwBnFwdQkv: q (the first problem) of shape KQ, then the k / v pair of shape KKV.
// Where the shapes share x (dwbn_common.cuh: shares_x), the sums and the dz + dW passes walk q's
// rows and serve k and v from the same loads (dwbn_rows.cuh; every problem's partials from that
// grid): the sums, and the dz, dW and dx that follow from them, are within rounding of the
// single libraries' launches, not their bits; a summed dx comes from a row walk of its own
// (bn_dgrad_rows_kernel), within rounding of the three separate dx's sum.
template <class KQ, class KKV>
struct DwBnBwdQkv {
  static_assert(!std::is_same_v<KQ, KKV>, "q and the k / v pair of one shape: a k / v-style group serves them");
  static constexpr int kFamily = CVT_FAMILY_DWCONV_BN_BWD;
  static constexpr bool kShared = shares_x<KQ, KKV>();
  static bool can_implement(const cvt_dwbnbwd_args& a);
  static RowBlocks shared_rows(const cvt_dwbnbwd_args& a);  // the row kernels' blocks where shared, else {}
  static size_t workspace_size(const cvt_dwbnbwd_args& a) {
    if (!a.next) return KQ::layout_of(a).total;
    const RowBlocks rows = shared_rows(a);
    return group_workspace(a, KQ::layout_of(a, rows).total, KKV::layout_of(*a.next, rows).total, 1);
  }
  static int launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream);
};

// part[block][0..1][c] = (sum dy, sum dy * xhat) over the outputs the block saw (shape K's blocks).
template <class K, int W>
__device__ __forceinline__ void bwd_reduce_block(const cvt_dwbnbwd_args& a, const ReduceGrid& r, float* part) {
  using B = SubBlock<K, W>;
  const B b;
  if (!in_grid(b, r)) return;
  using Element = typename K::Element;
  const Geo& g = r.g;
  constexpr int kVec = K::kVec, kOut = K::kOut, kCG = K::kCG, kLanes = K::kLanes, kWarps = K::kWarps;
  __shared__ float smem[B::kSub][kWarps * 2 * kCG * kVec];
  const int lane_c = b.tid % kCG, lane_s = b.tid / kCG;
  const int c8 = int(blockIdx.y) * kCG + lane_c;
  VecF8 acc2[2] = {zero8(), zero8()};
  if (c8 < g.C8) {
    const ItemRun run = item_run(r, b.id);
    for (int it = run.begin + lane_s; it < run.end; it += kLanes) {
      const auto [img, p, q0] = row_item<kOut>(r, it);
      const Element* xb = spatial_tokens<Element>(a.x, a.x_image_stride, img, g);
      const Element* dyb = spatial_tokens<Element>(a.dy, a.dy_image_stride, img, g);
      VecF8 z[kOut];
      conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, z);
      // the statistics read per item (L1 hits), not held across the loop (registers)
      const VecF8 mean = ldf8(a.mean + c8 * kVec), inv = ldf8(a.invstd + c8 * kVec);
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
  block_sums<K, 2>(b, acc2, part, g.C, smem[b.sub]);
}

// The reducing pass of a group (dwbn_common.cuh: DwBnGroup): part: each shape's partials of the
// group's first problem (problem_ws moves them to this block's problem).
template <class K0, class K1>
__global__ void __launch_bounds__(max_threads<K0, K1>()) bn_bwd_reduce_kernel(DwBnGroup<cvt_dwbnbwd_args> grp,
                                                                             PerShape<ReduceGrid> r,
                                                                             PerShape<float*> part) {
  pdl_enter();
  constexpr int W = max_threads<K0, K1>();
  if (!second_shape(grp)) return bwd_reduce_block<K0, W>(problem_of(grp), r.s[0], problem_ws(part.s[0], grp));
  if constexpr (!std::is_same_v<K0, K1>)
    bwd_reduce_block<K1, W>(problem_of(grp), r.s[1], problem_ws(part.s[1], grp));
}

// ---- q, k and v from one read of x (DwBnBwdQkv::kShared; dwbn_rows.cuh) ----

// A lane's (sum dy, sum dy * xhat) of one problem's two channels, and what xhat needs.
struct PairSums {
  F2 sdy, sdyx, mean, inv;
  template <class Element>
  __device__ __forceinline__ void add(F2 z, uint32_t dy_raw) {  // bwd_reduce_block's operations
    const F2 d = to_v<Element>(dy_raw);
    sdy.x += d.x;
    sdy.y += d.y;
    sdyx.x = fmaf(d.x, (z.x - mean.x) * inv.x, sdyx.x);
    sdyx.y = fmaf(d.y, (z.y - mean.y) * inv.y, sdyx.y);
  }
};

// The dy a walk reads, loaded a group of columns ahead (walk_rows' Ahead): q's two rows at the
// group's columns, k's and v's at its even columns (V: the lane's channels).
template <class Element, class V>
struct DyAhead {
  using Raw = typename Lane<V>::Raw;
  const Element* dy[3];  // each problem's dy at the walk's first output row, column 0, channel c
  int C, Q;
  bool second;
  Raw nq[2][kAhead], nkv[2][kAhead / 2], q[2][kAhead], kv[2][kAhead / 2];
  __device__ __forceinline__ DyAhead(const DwBnGroup<cvt_dwbnbwd_args>& grp, const RowGrid& rg, int img, int p,
                                     int c) {
    const Geo& g = rg.g;
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 3; ++k) {
      const int row = k == 0 ? p * g.Q : (p / 2) * rg.qkv;
      dy[k] = spatial_tokens<Element>(grp.p[k].dy, grp.p[k].dy_image_stride, img, g) + row * g.C + c;
    }
    C = g.C;
    Q = g.Q;
    second = p + 1 < g.P;
  }
  __device__ __forceinline__ void fetch(int col0) {
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kAhead; ++u) {
      const bool in = col0 + u < Q;
      nq[0][u] = in ? ldraw<Raw>(dy[0] + (col0 + u) * C) : Raw(0);
      nq[1][u] = in && second ? ldraw<Raw>(dy[0] + (Q + col0 + u) * C) : Raw(0);
      if (u % 2) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 2; ++k) nkv[k][u / 2] = in ? ldraw<Raw>(dy[1 + k] + ((col0 + u) / 2) * C) : Raw(0);
    }
  }
  __device__ __forceinline__ void shift() {
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kAhead; ++u) {
      q[0][u] = nq[0][u];
      q[1][u] = nq[1][u];
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kAhead / 2; ++i) {
      kv[0][i] = nkv[0][i];
      kv[1][i] = nkv[1][i];
    }
  }
};

// Each problem's part[block][0..1][c] (its workspace copy: part.s[0] q's, part.s[1] the pair's
// shape's) from the rows the block's warps walk.
template <class Element>
__global__ void __launch_bounds__(kRowThreads) bn_bwd_sums_rows_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, RowGrid rg,
                                                                      PerShape<float*> part) {
  pdl_enter();
  __shared__ float sh[3][2][kRowWarps][kWarpCh<F2>];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const Geo& g = rg.g;
  const int c = int(blockIdx.y) * kWarpCh<F2> + 2 * lane;
  PairSums ps[3];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) {
    ps[k].sdy = ps[k].sdyx = make_float2(0.f, 0.f);
    if (c < g.C) {
      ps[k].mean = __ldg(reinterpret_cast<const float2*>(grp.p[k].mean + c));
      ps[k].inv = __ldg(reinterpret_cast<const float2*>(grp.p[k].invstd + c));
    }
  }
  if (c < g.C) {
    const float* const src[3] = {grp.p[0].weight, grp.p[1].weight, grp.p[2].weight};
    const QkvWeights<F2> wt(src, g.C, c);
    const ItemRun run = item_run(rg.items, rg.blocks, int(blockIdx.x));
    for (int it = run.begin + warp; it < run.end; it += kRowWarps) {
      int img, p;
      rg.div_pair(img, p, it);
      p *= 2;
      DyAhead<Element, F2> ahead(grp, rg, img, p, c);
      walk_rows<Element>(spatial_tokens<Element>(grp.p[0].x, grp.p[0].x_image_stride, img, g), g, p, c, wt,
                         [&](int j, int, int u, F2 z, auto&) { ps[0].add<Element>(z, ahead.q[j][u]); },
                         [&](int, int u, F2 zk, F2 zv, auto&) {
                           ps[1].add<Element>(zk, ahead.kv[0][u / 2]);
                           ps[2].add<Element>(zv, ahead.kv[1][u / 2]);
                         },
                         ahead);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) {
    sh[k][0][warp][2 * lane] = ps[k].sdy.x;
    sh[k][0][warp][2 * lane + 1] = ps[k].sdy.y;
    sh[k][1][warp][2 * lane] = ps[k].sdyx.x;
    sh[k][1][warp][2 * lane + 1] = ps[k].sdyx.y;
  }
  __syncthreads();
  constexpr int kCh = kWarpCh<F2>;
  for (int i = int(threadIdx.x); i < 3 * 2 * kCh; i += kRowThreads) {
    const int k = i / (2 * kCh), q = (i / kCh) % 2, ch = i % kCh, cc = int(blockIdx.y) * kCh + ch;
    if (cc >= g.C) continue;
    float v = 0.f;
    for (int wp = 0; wp < kRowWarps; ++wp) v += sh[k][q][wp][ch];
    float* base = k == 0 ? part.s[0] : problem_ws(part.s[1], grp, k);
    base[(int64_t(blockIdx.x) * 2 + q) * g.C + cc] = v;
  }
}

// One problem's dz of conv output z (dy: its raw value; dwbn_bwd_finish's coefficients), stored
// rounded to the activation dtype at `to`, and dW[tap] += x at the tap * that rounded dz (the
// window rows r0..r0 + 2): dz_wgrad_block's operations, one channel.
struct DzCoef {
  float A, K1, K2, mean;
};
template <class Element, int R0>
__device__ __forceinline__ void dz_and_dw(float z, uint16_t dy, const DzCoef& cf, Element* to,
                                          const float (&win)[4][3], float (&dw)[9]) {
  float d = fmaf(cf.A, to_v<Element>(dy), fmaf(cf.K2, z - cf.mean, cf.K1));
  const Element r = Element(d);
  *to = r;
  d = float(r);
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < 9; ++t) dw[t] = fmaf(win[R0 + t / 3][t % 3], d, dw[t]);
}

// The dz + dW pass of a sharing group, one channel a lane (dW's 27 sums and the three problems'
// weights in registers): each problem's dz (its workspace copy, packed (n, P * Q, C)) and
// part[block][tap][c] from the rows the block's warps walk.
template <class Element>
__global__ void __launch_bounds__(kRowThreads) bn_dz_wgrad_rows_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, RowGrid rg,
                                                                      PerShape<const float*> coef,
                                                                      PerShape<void*> dz, PerShape<float*> part) {
  pdl_enter();
  __shared__ float sh[3][9][kRowWarps][32];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const Geo& g = rg.g;
  const int c = int(blockIdx.y) * 32 + lane;
  float dw[3][9];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k)
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < 9; ++t) dw[k][t] = 0.f;
  if (c < g.C) {
    const float* const src[3] = {grp.p[0].weight, grp.p[1].weight, grp.p[2].weight};
    const QkvWeights<float> wt(src, g.C, c);
    DzCoef cf[3];
    Element* out[3];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 3; ++k) {
      const float* cb = k == 0 ? coef.s[0] : problem_ws(coef.s[1], grp, k);
      cf[k] = DzCoef{cb[c], cb[g.C + c], cb[2 * g.C + c], grp.p[k].mean[c]};
      out[k] = k == 0 ? static_cast<Element*>(dz.s[0]) : problem_ws(static_cast<Element*>(dz.s[1]), grp, k);
    }
    const int pq = g.P * g.Q, pq_kv = int(grp.p[1].p) * rg.qkv;
    const ItemRun run = item_run(rg.items, rg.blocks, int(blockIdx.x));
    for (int it = run.begin + warp; it < run.end; it += kRowWarps) {
      int img, p;
      rg.div_pair(img, p, it);
      p *= 2;
      DyAhead<Element, float> ahead(grp, rg, img, p, c);
      Element* dq = out[0] + (int64_t(img) * pq + p * g.Q) * g.C + c;
      Element* dk = out[1] + (int64_t(img) * pq_kv + (p / 2) * rg.qkv) * g.C + c;
      Element* dv = out[2] + (int64_t(img) * pq_kv + (p / 2) * rg.qkv) * g.C + c;
      walk_rows<Element>(spatial_tokens<Element>(grp.p[0].x, grp.p[0].x_image_stride, img, g), g, p, c, wt,
                         [&](int j, int q, int u, float z, const float (&win)[4][3]) {
                           if (j == 0) dz_and_dw<Element, 0>(z, ahead.q[0][u], cf[0], dq + q * g.C, win, dw[0]);
                           else dz_and_dw<Element, 1>(z, ahead.q[1][u], cf[0], dq + (g.Q + q) * g.C, win, dw[0]);
                         },
                         [&](int q, int u, float zk, float zv, const float (&win)[4][3]) {
                           dz_and_dw<Element, 0>(zk, ahead.kv[0][u / 2], cf[1], dk + (q / 2) * g.C, win, dw[1]);
                           dz_and_dw<Element, 0>(zv, ahead.kv[1][u / 2], cf[2], dv + (q / 2) * g.C, win, dw[2]);
                         },
                         ahead);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k)
    CUTLASS_PRAGMA_UNROLL
    for (int t = 0; t < 9; ++t) sh[k][t][warp][lane] = dw[k][t];
  __syncthreads();
  for (int i = int(threadIdx.x); i < 3 * 9 * 32; i += kRowThreads) {
    const int k = i / (9 * 32), t = (i / 32) % 9, ch = i % 32, cc = int(blockIdx.y) * 32 + ch;
    if (cc >= g.C) continue;
    float v = 0.f;
    for (int wp = 0; wp < kRowWarps; ++wp) v += sh[k][t][wp][ch];
    float* base = k == 0 ? part.s[0] : problem_ws(part.s[1], grp, k);
    base[(int64_t(blockIdx.x) * 9 + t) * g.C + cc] = v;
  }
}

// The summing dgrad of a sharing group (sum_dx), one warp a pair of input rows (2j, 2j + 1) x the
// warp's channels (V: two a lane, or one; dwbn_rows.cuh's Lane): dx = the three problems'
// transposed convs of their dz (workspace copies, packed (n, P * Q, C)), q's at stride 1, k's and
// v's at stride 2, each output summed in fp32 (q's taps, then k's, then v's, rows then columns),
// rounded once. A window of dz slides along the rows (q's rows 2j - 1..2j + 2, k's and v's rows
// j, j + 1), loaded kAhead columns ahead. rg's items: the row pairs, then the cls rows (dx: the
// three dy's summed).
using DgradLane = F2;  // the dgrad walk's channels a lane: two (F2) or one (float)

template <class Element, class V>
struct DgradWalk {
  using Raw = typename Lane<V>::Raw;
  const Element* q[4];      // dz of q's rows 2j - 1 + R
  const Element* kv[2][2];  // dz of k's / v's rows j + r
  bool vq[4], vkv[2];
  Raw nq[4][kAhead], nkv[2][2][kAhead / 2];  // the next group of columns, raw
  __device__ __forceinline__ void fetch(int w0, const Geo& g, int qkv) {  // q's columns w0 + 1.., k / v's w0 / 2 + 1..
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 4; ++r)
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < kAhead; ++u)
        nq[r][u] = vq[r] && w0 + 1 + u < g.Q ? ldraw<Raw>(q[r] + (w0 + 1 + u) * g.C) : Raw(0);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 2; ++k)
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r)
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kAhead / 2; ++u)
          nkv[k][r][u] = vkv[r] && w0 / 2 + 1 + u < qkv ? ldraw<Raw>(kv[k][r] + (w0 / 2 + 1 + u) * g.C) : Raw(0);
  }
};

// dx at input (h, w) from the windows: q's taps of window rows R0 + 2 - r (columns w - 1..w + 1),
// then k's and v's: at even h their row j (tap row 1), at odd h rows j + 1 (tap 0) and j (tap 2);
// at even w their column w / 2 (tap 1), at odd w columns (w + 1) / 2 (tap 0) and (w - 1) / 2 (tap 2).
template <int R0, class V>
__device__ __forceinline__ V dgrad_at(const QkvWeights<V>& wt, const V (&qw)[4][3], const V (&kw)[2][2][2],
                                      const bool (&vq)[4], const bool (&vkv)[2], bool odd_w) {
  V acc{};
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    if (!vq[R0 + 2 - r]) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 3; ++s) acc = vfma(wt.w[0][r * 3 + s], qw[R0 + 2 - r][2 - s], acc);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 2; ++k)
    CUTLASS_PRAGMA_UNROLL
    for (int r = R0 == 0 ? 1 : 0; r < 3; r += 2) {  // even h: tap row 1 (row j); odd: 0 (row j + 1), 2 (row j)
      const int kr = R0 == 0 ? 0 : (r == 0 ? 1 : 0);
      if (!vkv[kr]) continue;
      if (odd_w) {
        acc = vfma(wt.w[1 + k][r * 3], kw[k][kr][1], acc);
        acc = vfma(wt.w[1 + k][r * 3 + 2], kw[k][kr][0], acc);
      } else {
        acc = vfma(wt.w[1 + k][r * 3 + 1], kw[k][kr][0], acc);
      }
    }
  return acc;
}

template <class Element>
__device__ __forceinline__ void st_v(Element* p, F2 v) {
  st2(p, v);
}
template <class Element>
__device__ __forceinline__ void st_v(Element* p, float v) {
  *p = Element(v);
}
__device__ __forceinline__ F2 vadd(F2 a, F2 b) { return make_float2(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ float vadd(float a, float b) { return a + b; }

// A cls row's dx (item i of the cls rows): the three dy rows that pass through, summed in problem order.
template <class Element, class V>
__device__ __forceinline__ void dgrad_cls_row(const DwBnGroup<cvt_dwbnbwd_args>& grp, const Geo& g, int i, int c) {
  using Raw = typename Lane<V>::Raw;
  const int img = i / g.cls, row = i % g.cls;
  V v{};
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k)
    v = vadd(v, to_v<Element>(ldraw<Raw>(static_cast<const Element*>(grp.p[k].dy) +
                                         int64_t(img) * grp.p[k].dy_image_stride + row * g.C + c)));
  st_v<Element>(static_cast<Element*>(grp.p[0].dx) + int64_t(img) * grp.p[0].dx_image_stride + row * g.C + c, v);
}

// The walk along input rows 2j, 2j + 1 (dx0: row 2j's first column at the lane's channels; `second`:
// row 2j + 1 exists), its windows starting at column 0.
template <class Element, class V>
__device__ __forceinline__ void dgrad_walk(DgradWalk<Element, V>& wk, const QkvWeights<V>& wt, Element* dx0,
                                           bool second, const Geo& g, int qkv) {
  using Raw = typename Lane<V>::Raw;
  V qw[4][3], kw[2][2][2];
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 4; ++r) {
    qw[r][1] = V{};  // column -1 after the first move
    qw[r][2] = wk.vq[r] ? to_v<Element>(ldraw<Raw>(wk.q[r])) : V{};  // column 0
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 2; ++k)
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) kw[k][r][1] = wk.vkv[r] ? to_v<Element>(ldraw<Raw>(wk.kv[k][r])) : V{};
  wk.fetch(0, g, qkv);
  for (int w0 = 0; w0 < g.W; w0 += kAhead) {
    Raw cq[4][kAhead], ckv[2][2][kAhead / 2];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 4; ++r)
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < kAhead; ++u) cq[r][u] = wk.nq[r][u];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 2; ++k)
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r)
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kAhead / 2; ++u) ckv[k][r][u] = wk.nkv[k][r][u];
    if (w0 + kAhead < g.W) wk.fetch(w0 + kAhead, g, qkv);
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kAhead; ++u) {
      const int w = w0 + u;
      if (w >= g.W) break;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 4; ++r) {  // q's window moves to columns w - 1..w + 1
        qw[r][0] = qw[r][1];
        qw[r][1] = qw[r][2];
        qw[r][2] = to_v<Element>(cq[r][u]);
      }
      if (u % 2 == 0) {  // k's and v's to columns w / 2, w / 2 + 1 (w0 is even)
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 2; ++k)
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            kw[k][r][0] = kw[k][r][1];
            kw[k][r][1] = to_v<Element>(ckv[k][r][u / 2]);
          }
      }
      st_v<Element>(dx0 + w * g.C, dgrad_at<0>(wt, qw, kw, wk.vq, wk.vkv, u % 2 == 1));
      if (second) st_v<Element>(dx0 + (g.W + w) * g.C, dgrad_at<1>(wt, qw, kw, wk.vq, wk.vkv, u % 2 == 1));
    }
  }
}

template <class Element, class V>
__global__ void __launch_bounds__(kRowThreads) bn_dgrad_rows_kernel(DwBnGroup<cvt_dwbnbwd_args> grp, RowGrid rg,
                                                                   PerShape<const void*> dz) {
  pdl_enter();
  const Geo& g = rg.g;
  const int it = int(blockIdx.x) * kRowWarps + int(threadIdx.x) / 32;
  const int c = int(blockIdx.y) * kWarpCh<V> + Lane<V>::kCh * (int(threadIdx.x) % 32);
  if (it >= rg.items || c >= g.C) return;
  const cvt_dwbnbwd_args& a = grp.p[0];
  const int spatial = rg.items - int(a.n) * g.cls;
  if (it >= spatial) return dgrad_cls_row<Element, V>(grp, g, it - spatial, c);
  int img, j;
  rg.div_pair(img, j, it);
  const int pkv = int(grp.p[1].p);
  DgradWalk<Element, V> wk;
  const Element* dzq = static_cast<const Element*>(dz.s[0]) + int64_t(img) * g.P * g.Q * g.C + c;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 4; ++r) {
    const int row = 2 * j - 1 + r;
    wk.vq[r] = row >= 0 && row < g.P;
    wk.q[r] = dzq + int64_t(wk.vq[r] ? row : 0) * g.Q * g.C;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 2; ++r) wk.vkv[r] = j + r < pkv;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 2; ++k) {
    const Element* base = problem_ws(static_cast<const Element*>(dz.s[1]), grp, 1 + k) +
                          int64_t(img) * pkv * rg.qkv * g.C + c;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) wk.kv[k][r] = base + int64_t(wk.vkv[r] ? j + r : 0) * rg.qkv * g.C;
  }
  const float* const src[3] = {grp.p[0].weight, grp.p[1].weight, grp.p[2].weight};
  const QkvWeights<V> wt(src, g.C, c);
  Element* dx0 = static_cast<Element*>(a.dx) + int64_t(img) * a.dx_image_stride + (g.cls + 2 * j * g.W) * g.C + c;
  dgrad_walk<Element, V>(wk, wt, dx0, 2 * j + 1 < g.H, g, rg.qkv);
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
__global__ void __launch_bounds__(1024) bn_bwd_finish_kernel(DwBnGroup<cvt_dwbnbwd_args> grp,
                                                             PerShape<const float*> part_of, PerShape<int> rows_of,
                                                             PerShape<float*> coef_of) {
  pdl_enter();
  __shared__ float s_b[32][33], s_g[32][33];
  const cvt_dwbnbwd_args a = problem_of(grp);
  const bool second = second_shape(grp);
  const int rows = second ? rows_of.s[1] : rows_of.s[0];
  const float* part = problem_ws(second ? part_of.s[1] : part_of.s[0], grp);
  float* coef = problem_ws(second ? coef_of.s[1] : coef_of.s[0], grp);
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

// dW[r][s] += x[p*S - 1 + r][q*S - 1 + s] * dz[p][q] for kN outputs (p, q0 + j) of channels 8*c8..
// (dz zero past the row's end); a row's input vectors loaded together, as conv_row does.
template <class K, int kN>
__device__ __forceinline__ void wgrad_row(const typename K::Element* xb, const Geo& g, int p, int q0, int c8,
                                          const VecF8 (&dz)[kN], VecF8 (&dw)[9]) {
  constexpr int kVec = K::kVec, kStride = K::kStride;
  constexpr int kCols = (kN - 1) * kStride + 3;
  const int iw0 = q0 * kStride - 1;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    const int ih = p * kStride - 1 + r;
    if (ih < 0 || ih >= g.H) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kCols; ++u) {  // one input column at a time: the taps it meets
      const int iw = iw0 + u;
      if (iw < 0 || iw >= g.W) continue;
      const VecF8 xf = ld8(xb + (ih * g.W + iw) * g.C + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kN; ++j) {
        const int s = u - j * kStride;  // folded at compile time
        if (s < 0 || s > 2) continue;
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kVec; ++v) dw[r * 3 + s][v] = fmaf(xf[v], dz[j][v], dw[r * 3 + s][v]);
      }
    }
  }
}

// dz = A dy + K1 + K2 (z - mean) of the block's conv output rows, written packed (n, p*q, C) in the
// activation dtype, and the dW sums over them from that rounded dz (torch's BatchNorm backward
// hands its conv backward the rounded dz too): per-block partials part[block][tap][c].
template <class K, int W>
__device__ __forceinline__ void dz_wgrad_block(const cvt_dwbnbwd_args& a, const ReduceGrid& r, const float* coef,
                                               typename K::Element* dz, float* part) {
  using B = SubBlock<K, W>;
  const B b;
  if (!in_grid(b, r)) return;
  using Element = typename K::Element;
  const Geo& g = r.g;
  constexpr int kVec = K::kVec, kOut = K::kOut, kCG = K::kCG, kLanes = K::kLanes, kWarps = K::kWarps;
  __shared__ float smem[B::kSub][kWarps * 9 * kCG * kVec];
  const int lane_c = b.tid % kCG, lane_s = b.tid / kCG;
  const int c8 = int(blockIdx.y) * kCG + lane_c;
  VecF8 dw[9];
  CUTLASS_PRAGMA_UNROLL
  for (int t = 0; t < 9; ++t) dw[t].fill(0.f);
  if (c8 < g.C8) {
    const ItemRun run = item_run(r, b.id);
    for (int it = run.begin + lane_s; it < run.end; it += kLanes) {
      const auto [img, p, q0] = row_item<kOut>(r, it);
      const Element* xb = spatial_tokens<Element>(a.x, a.x_image_stride, img, g);
      const Element* dyb = spatial_tokens<Element>(a.dy, a.dy_image_stride, img, g);
      Element* dzb = dz + int64_t(img) * g.P * g.Q * g.C;
      VecF8 d[kOut];
      conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, d);
      // the coefficients read per item (L1 hits): not held across the loop beside the dW sums
      const VecF8 A = ldf8(coef + c8 * kVec), K1 = ldf8(coef + g.C + c8 * kVec), K2 = ldf8(coef + 2 * g.C + c8 * kVec);
      const VecF8 mean = ldf8(a.mean + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kOut; ++j) {
        if (q0 + j >= g.Q) {
          d[j] = zero8();
          continue;
        }
        const int off = (p * g.Q + q0 + j) * g.C + c8 * kVec;
        const VecF8 dy = ld8(dyb + off);
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) d[j][e] = fmaf(A[e], dy[e], fmaf(K2[e], d[j][e] - mean[e], K1[e]));
        d[j] = st8_rounded(dzb + off, d[j]);
      }
      wgrad_row<K, kOut>(xb, g, p, q0, c8, d, dw);
    }
  }
  block_sums<K, 9>(b, dw, part, g.C, smem[b.sub]);
}

template <class K0, class K1>
__global__ void __launch_bounds__(max_threads<K0, K1>()) bn_dz_wgrad_kernel(DwBnGroup<cvt_dwbnbwd_args> grp,
                                                                           PerShape<ReduceGrid> r,
                                                                           PerShape<const float*> coef,
                                                                           PerShape<void*> dz, PerShape<float*> part) {
  pdl_enter();
  using E0 = typename K0::Element;
  using E1 = typename K1::Element;
  constexpr int W = max_threads<K0, K1>();
  if (!second_shape(grp))
    return dz_wgrad_block<K0, W>(problem_of(grp), r.s[0], problem_ws(coef.s[0], grp),
                                 problem_ws(static_cast<E0*>(dz.s[0]), grp), problem_ws(part.s[0], grp));
  if constexpr (!std::is_same_v<K0, K1>)
    dz_wgrad_block<K1, W>(problem_of(grp), r.s[1], problem_ws(coef.s[1], grp),
                          problem_ws(static_cast<E1*>(dz.s[1]), grp), problem_ws(part.s[1], grp));
}

// dx[j] += sum over taps w * dz for the kIn inputs (row ih, columns iw0 + j) of one problem at
// stride kStride: input iw feeds outputs oh = (ih + 1 - r) / S, ow = (iw + 1 - s) / S where those
// divide (iw0 a multiple of S; u = ow - (iw0 / S - 1) indexes the dz columns loaded).
template <class Element, int kStride, int kIn>
__device__ __forceinline__ void dgrad_add(const float* w, const Element* dzb, int P, int Q, int C, int ih, int iw0,
                                          int c8, VecF8 (&dx)[kIn]) {
  static_assert(kIn % kStride == 0, "inputs per thread: a multiple of the stride");
  constexpr int kVec = kDwVec, kOutCols = (kIn + kStride) / kStride + 1;
  const int ow_lo = iw0 / kStride - 1;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    const int t = ih + 1 - r;
    if (t < 0 || t % kStride) continue;
    const int oh = t / kStride;
    if (oh >= P) continue;
    VecF8 d[kOutCols];
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kOutCols; ++u) {
      const int ow = ow_lo + u;
      d[u] = ow >= 0 && ow < Q ? ld8(dzb + (oh * Q + ow) * C + c8 * kVec) : zero8();
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 3; ++s) {
      const VecF8 wv = ldf8(w + (r * 3 + s) * C + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kIn; ++j) {
        if ((j + 1 - s + kStride) % kStride) continue;  // folded at compile time
        const int u = (j + 1 - s + kStride) / kStride;
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) dx[j][e] = fmaf(wv[e], d[u][e], dx[j][e]);
      }
    }
  }
}

// A summing dgrad's inputs per thread: q's, made a multiple of the k / v pair's stride.
template <class K0, class K1>
constexpr int sum_in() {
  return K0::kIn % K1::kStride ? K0::kIn * K1::kStride : K0::kIn;
}

// A later problem of a chain as can_implement sees it: with the first problem's sum_dx it writes
// no dx of its own (the launch passes none), checked as if it wrote the first problem's.
inline cvt_dwbnbwd_args summed_into(const cvt_dwbnbwd_args& p, const cvt_dwbnbwd_args& first) {
  cvt_dwbnbwd_args c = p;
  if (first.sum_dx) c.dx = first.dx;
  return c;
}

// Problem z of a group at shape K: dgrad_add of its dz (img's) into dx.
template <class K, int kIn>
__device__ __forceinline__ void dgrad_problem(const DwBnGroup<cvt_dwbnbwd_args>& grp, const void* dz0, int z, int img,
                                              int ih, int iw0, int c8, VecF8 (&dx)[kIn]) {
  using Element = typename K::Element;
  if constexpr (kIn % K::kStride == 0) {
    const cvt_dwbnbwd_args a = problem_of(grp, z);
    const int P = int(a.p), Q = int(a.q), C = int(a.c);
    const Element* dzb = problem_ws(static_cast<const Element*>(dz0), grp, z) + int64_t(img) * P * Q * C;
    dgrad_add<Element, K::kStride, kIn>(a.weight, dzb, P, Q, C, ih, iw0, c8, dx);
  } else {
    __trap();  // instantiated for the other shape's blocks, never run: a problem must not add nothing
  }
}

// The dgrad, input-centric over (n, h, w / kIn groups) items plus the cls rows: problem z's dx
// (cls rows: its dy), or with `sum` every problem's dx summed in fp32 into problem 0's dx (cls
// rows: the dy's summed), rounded once.
template <class K0, class K1, int kIn>
__device__ __forceinline__ void dgrad_block(const DwBnGroup<cvt_dwbnbwd_args>& grp, const OutGrid& o, int block,
                                            int z, bool sum, PerShape<const void*> dz) {
  using Element = typename K0::Element;
  constexpr int kVec = K0::kVec;
  const Geo& g = o.g;
  int img, item, c8;
  if (!out_item(o.work, o.div_c8, block, img, item, c8)) return;
  const cvt_dwbnbwd_args a = problem_of(grp, z);
  Element* dxb = static_cast<Element*>(a.dx) + int64_t(img) * a.dx_image_stride;
  const int last = sum ? grp.count : z + 1;
  if (item >= o.spatial) {  // a cls row: the sum of the dy rows that pass through
    VecF8 v = zero8();
    for (int k = sum ? 0 : z; k < last; ++k) {
      const cvt_dwbnbwd_args pk = problem_of(grp, k);
      const VecF8 dy = ld8(static_cast<const Element*>(pk.dy) + int64_t(img) * pk.dy_image_stride +
                           int64_t(item - o.spatial) * g.C + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) v[e] += dy[e];
    }
    return st8(dxb + (item - o.spatial) * g.C + c8 * kVec, v);
  }
  int ih, wg;
  o.div_qg(ih, wg, item);
  const int iw0 = wg * kIn;
  VecF8 dx[kIn];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kIn; ++j) dx[j].fill(0.f);
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kDwBnGroupMax; ++k) {
    if (k < (sum ? 0 : z) || k >= last) continue;
    if (k < grp.first_b) dgrad_problem<K0, kIn>(grp, dz.s[0], k, img, ih, iw0, c8, dx);
    else if constexpr (!std::is_same_v<K0, K1>) dgrad_problem<K1, kIn>(grp, dz.s[1], k, img, ih, iw0, c8, dx);
  }
  dxb += int64_t(g.cls) * g.C;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kIn; ++j)
    if (iw0 + j < g.W) st8(dxb + (ih * g.W + iw0 + j) * g.C + c8 * kVec, dx[j]);
}

template <class K0, class K1>
__global__ void __launch_bounds__(min_threads<K0, K1>()) bn_dgrad_kernel(DwBnGroup<cvt_dwbnbwd_args> grp,
                                                                        PerShape<OutGrid> o, PerShape<const void*> dz) {
  pdl_enter();
  if (grp.p[0].sum_dx) return dgrad_block<K0, K1, sum_in<K0, K1>()>(grp, o.s[0], int(blockIdx.x), 0, true, dz);
  const FlatBlock f(grp, o.s[0].blocks, o.s[1].blocks);
  if (!second_shape(grp, f.z)) return dgrad_block<K0, K1, K0::kIn>(grp, o.s[0], f.block, f.z, false, dz);
  if constexpr (!std::is_same_v<K0, K1>) dgrad_block<K0, K1, K1::kIn>(grp, o.s[1], f.block, f.z, false, dz);
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::reduce_rows(const cvt_dwbnbwd_args& a) {
  return reduce_blocks<DwBnBwd, KernelTag<DwBnBwd, 1>>(
      a, reinterpret_cast<const void*>(&bn_bwd_reduce_kernel<DwBnBwd, DwBnBwd>), reduce_items(a));
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::dz_rows(const cvt_dwbnbwd_args& a) {
  return reduce_blocks<DwBnBwd, KernelTag<DwBnBwd, 2>>(
      a, reinterpret_cast<const void*>(&bn_dz_wgrad_kernel<DwBnBwd, DwBnBwd>), reduce_items(a));
}

// The dgrad's work at kIn inputs per thread along W: input row segments plus the cls rows, x
// 8-channel groups (blocks: flat_blocks sets them).
template <int kIn>
OutGrid dgrad_out_grid(const cvt_dwbnbwd_args& a) {
  const Geo g = geo_of(a);
  const int wgroups = (g.W + kIn - 1) / kIn, spatial = g.H * wgroups, work = (spatial + g.cls) * g.C8;
  return {g, work, spatial, 0, cutlass::FastDivmod(g.C8), cutlass::FastDivmod(wgroups)};
}

template <class E, int Stride, int In, int Groups, int Threads>
auto DwBnBwd<E, Stride, In, Groups, Threads>::layout_of(const cvt_dwbnbwd_args& a, RowBlocks rows) -> Layout {
  Layout l;
  l.dz_bytes = (size_t(a.n * a.p * a.q * a.c) * sizeof(Element) + 255) / 256 * 256;
  l.part1 = 0;
  l.coef = size_t(rows.sums > 0 ? rows.sums : reduce_rows(a)) * 2 * a.c;
  l.part4 = l.coef + 3 * size_t(a.c);
  const int rows4 = rows.dz > 0 ? rows.dz : dz_rows(a);
  l.total = (l.dz_bytes + (l.part4 + size_t(rows4) * 9 * a.c) * sizeof(float) + 255) / 256 * 256;
  return l;
}

template <class E, int Stride, int In, int Groups, int Threads>
bool DwBnBwd<E, Stride, In, Groups, Threads>::can_implement(const cvt_dwbnbwd_args& a) {
  if (a.next && !(same_input(a, *a.next) && a.dy_image_stride == a.next->dy_image_stride &&
                  a.dx_image_stride == a.next->dx_image_stride && can_implement(summed_into(*a.next, a))))
    return false;
  if (a.phase < CVT_DWBN_ALL || a.phase > CVT_DWBN_APPLY || (a.phase != CVT_DWBN_ALL && (a.next || a.sum_dx)))
    return false;
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

// A shape's workspace pointers for the group's first problem (problem_ws moves them per problem).
template <class K>
struct BwdPointers {
  void* dz;
  float *part1, *coef, *part4;
  int rows1, rows4;
  size_t part4_bytes;  // part4's offset in a problem's workspace
  BwdPointers(const cvt_dwbnbwd_args& a, void* workspace, RowBlocks shared = {}) {
    const typename K::Layout l = K::layout_of(a, shared);
    float* fws = reinterpret_cast<float*>(static_cast<char*>(workspace) + l.dz_bytes);
    dz = workspace;
    part1 = fws + l.part1;
    coef = fws + l.coef;
    part4 = fws + l.part4;
    part4_bytes = l.dz_bytes + l.part4 * sizeof(float);
    rows1 = shared.sums > 0 ? shared.sums : K::reduce_rows(a);
    rows4 = shared.dz > 0 ? shared.dz : K::dz_rows(a);
  }
};

// Each problem's dW partials summed in order into its dweight: one launch, or deferred (the list).
template <class K0, class K1>
void dweight_sums(const DwBnGroup<cvt_dwbnbwd_args>& grp, const BwdPointers<K0>& w0, const BwdPointers<K1>& w1,
                  const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream) {
  cvt_colsum_list own{};
  cvt_colsum_list* list = a.defer ? a.defer : &own;
  for (int i = 0; i < grp.count; ++i) {
    const bool second = i >= grp.first_b;
    const float* part = reinterpret_cast<const float*>(static_cast<const char*>(workspace) + grp.ws[i] +
                                                       (second ? w1.part4_bytes : w0.part4_bytes));
    if (list->count == CVT_COLSUM_MAX) colsum_flush(list, stream);
    cvt_colsum_seg& seg = list->seg[list->count++];
    seg.in = part;
    seg.rows = second ? w1.rows4 : w0.rows4;
    seg.ld = seg.cols = 9 * grp.p[i].c;
    seg.out = grp.p[i].dweight;
    seg.out_type = out_type_of<float>();
  }
  if (list == &own) colsum_flush(list, stream);
}

// The reducing passes of a group's own shapes (a0 / a1 as in dwbn_fwd_group): the sums (`dz`
// false) or the dz + dW pass.
template <class K0, class K1>
void launch_reducing(const DwBnGroup<cvt_dwbnbwd_args>& grp, const cvt_dwbnbwd_args& a0, const cvt_dwbnbwd_args& a1,
                     const BwdPointers<K0>& w0, const BwdPointers<K1>& w1, bool dz, cudaStream_t stream) {
  constexpr int W = max_threads<K0, K1>(), sub0 = W / K0::kThreads, sub1 = W / K1::kThreads;
  const unsigned z = unsigned(grp.count);
  if (!dz) {
    const PerShape<ReduceGrid> red{{K0::reduce_grid(a0), K1::reduce_grid(a1)}};
    const dim3 grid(most(cdiv(w0.rows1, sub0), cdiv(w1.rows1, sub1)), most(red.s[0].chunks, red.s[1].chunks), z);
    launch_kernel(bn_bwd_reduce_kernel<K0, K1>, grid, W, 0, stream, grp, red, PerShape<float*>{{w0.part1, w1.part1}});
    return;
  }
  const PerShape<ReduceGrid> dzg{{K0::dz_grid(a0), K1::dz_grid(a1)}};
  const dim3 grid(most(cdiv(w0.rows4, sub0), cdiv(w1.rows4, sub1)), most(dzg.s[0].chunks, dzg.s[1].chunks), z);
  launch_kernel(bn_dz_wgrad_kernel<K0, K1>, grid, W, 0, stream, grp, dzg, PerShape<const float*>{{w0.coef, w1.coef}},
                PerShape<void*>{{w0.dz, w1.dz}}, PerShape<float*>{{w0.part4, w1.part4}});
}

// The same passes of a sharing q / k / v group, by its row kernels (dwbn_rows.cuh).
template <class K0, class K1>
void launch_rows(const DwBnGroup<cvt_dwbnbwd_args>& grp, const cvt_dwbnbwd_args& a0, const cvt_dwbnbwd_args& a1,
                 const BwdPointers<K0>& w0, const BwdPointers<K1>& w1, bool dz, cudaStream_t stream) {
  using Element = typename K0::Element;
  if (!dz) {
    const RowGrid rg = row_grid(a0, a1, w0.rows1);
    launch_kernel(bn_bwd_sums_rows_kernel<Element>, dim3(unsigned(rg.blocks), unsigned(rg.chunks)), kRowThreads, 0,
                  stream, grp, rg, PerShape<float*>{{w0.part1, w1.part1}});
    return;
  }
  const RowGrid rg = row_grid<float>(a0, a1, w0.rows4);
  launch_kernel(bn_dz_wgrad_rows_kernel<Element>, dim3(unsigned(rg.blocks), unsigned(rg.chunks)), kRowThreads, 0,
                stream, grp, rg, PerShape<const float*>{{w0.coef, w1.coef}}, PerShape<void*>{{w0.dz, w1.dz}},
                PerShape<float*>{{w0.part4, w1.part4}});
}

// The dgrad pass of a group: one set of blocks summing every problem's dx (sum_dx), or each
// problem's blocks in turn.
template <class K0, class K1, bool Shared = false>
void launch_dgrad(const DwBnGroup<cvt_dwbnbwd_args>& grp, const cvt_dwbnbwd_args& a0, const cvt_dwbnbwd_args& a1,
                  const BwdPointers<K0>& w0, const BwdPointers<K1>& w1, cudaStream_t stream) {
  if constexpr (Shared) {
    if (a0.sum_dx) {  // a sharing group's summed dx: the row walk
      using V = DgradLane;
      const RowGrid rg = row_grid<V>(a0, a1, 0, int(a0.n * a0.cls_rows));
      launch_kernel(bn_dgrad_rows_kernel<typename K0::Element, V>,
                    dim3(unsigned(cdiv(rg.items, kRowWarps)), unsigned(rg.chunks)), kRowThreads, 0, stream, grp, rg,
                    PerShape<const void*>{{w0.dz, w1.dz}});
      return;
    }
  }
  const bool sum = a0.sum_dx != 0;  // one set of dgrad blocks, at sum_in's inputs per thread
  PerShape<OutGrid> dg{{sum ? dgrad_out_grid<sum_in<K0, K1>()>(a0) : dgrad_out_grid<K0::kIn>(a0),
                        dgrad_out_grid<K1::kIn>(a1)}};
  constexpr int kOutThreads = min_threads<K0, K1>();
  const unsigned dg_x = sum ? unsigned(dg.s[0].blocks = cdiv(dg.s[0].work, kOutThreads))
                            : flat_blocks(grp, dg, kOutThreads);
  launch_kernel(bn_dgrad_kernel<K0, K1>, dim3(dg_x, unsigned(a0.n)), kOutThreads, 0, stream, grp, dg,
                PerShape<const void*>{{w0.dz, w1.dz}});
}

// A group's five passes (dwbn_common.cuh: DwBnGroup), a0 / a1 as in dwbn_fwd_group. Shared: a
// sharing q / k / v group (DwBnBwdQkv::kShared), its sums and dz + dW passes by the row kernels
// of `shared` blocks.
template <class K0, class K1, bool Shared = false>
int dwbn_bwd_group(const DwBnGroup<cvt_dwbnbwd_args>& grp, const cvt_dwbnbwd_args& a0, const cvt_dwbnbwd_args& a1,
                   void* workspace, cudaStream_t stream, RowBlocks shared = {}) {
  const BwdPointers<K0> w0(a0, workspace, shared);
  const BwdPointers<K1> w1(a1, workspace, shared);
  const unsigned z = unsigned(grp.count);
  if constexpr (Shared) launch_rows(grp, a0, a1, w0, w1, false, stream);
  else if (a0.phase != CVT_DWBN_APPLY) launch_reducing(grp, a0, a1, w0, w1, false, stream);
  launch_kernel(bn_bwd_finish_kernel, dim3(unsigned(a0.c + 31) / 32, 1, z), dim3(32, 32), 0, stream, grp,
                PerShape<const float*>{{w0.part1, w1.part1}}, PerShape<int>{{w0.rows1, w1.rows1}},
                PerShape<float*>{{w0.coef, w1.coef}});
  if (a0.phase == CVT_DWBN_STATS) return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  if constexpr (Shared) launch_rows(grp, a0, a1, w0, w1, true, stream);
  else launch_reducing(grp, a0, a1, w0, w1, true, stream);
  launch_dgrad<K0, K1, Shared>(grp, a0, a1, w0, w1, stream);
  dweight_sums(grp, w0, w1, a0, workspace, stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

template <class E, int Stride, int In, int Groups, int Threads>
int DwBnBwd<E, Stride, In, Groups, Threads>::launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream) {
  return dwbn_bwd_group<DwBnBwd, DwBnBwd>(group_of(a, layout_of(a).total), a, a, workspace, stream);
}

template <class KQ, class KKV>
bool DwBnBwdQkv<KQ, KKV>::can_implement(const cvt_dwbnbwd_args& a) {
  if (!a.next || !a.next->next || a.phase != CVT_DWBN_ALL) return false;
  static_assert(std::is_same_v<typename KQ::Element, typename KKV::Element>, "one activation dtype");
  cvt_dwbnbwd_args q = a;
  q.next = nullptr;
  cvt_dwbnbwd_args v = summed_into(*a.next->next, a), k = summed_into(*a.next, a);
  k.next = &v;
  return same_image(a, *a.next) && a.dx_image_stride == a.next->dx_image_stride && KQ::can_implement(q) &&
         KKV::can_implement(k);
}

template <class KQ, class KKV>
RowBlocks DwBnBwdQkv<KQ, KKV>::shared_rows(const cvt_dwbnbwd_args& a) {
  using Element = typename KQ::Element;
  if constexpr (kShared)
    return {row_blocks<KernelTag<DwBnBwdQkv, 0>>(a, reinterpret_cast<const void*>(&bn_bwd_sums_rows_kernel<Element>)),
            row_blocks<KernelTag<DwBnBwdQkv, 1>, float>(
                a, reinterpret_cast<const void*>(&bn_dz_wgrad_rows_kernel<Element>))};
  else
    return {};
}

template <class KQ, class KKV>
int DwBnBwdQkv<KQ, KKV>::launch(const cvt_dwbnbwd_args& a, void* workspace, cudaStream_t stream) {
  const cvt_dwbnbwd_args& kv = *a.next;
  const RowBlocks rows = shared_rows(a);
  const auto grp = group_of(a, KQ::layout_of(a, rows).total, KKV::layout_of(kv, rows).total, 1);
  return dwbn_bwd_group<KQ, KKV, kShared>(grp, a, kv, workspace, stream, rows);
}

}  // namespace cvt_kernel
