// Depthwise 3x3 conv + BatchNorm, training forward (operators/dwconv/abi.h: cvt_dwbn_args), three
// kernels: (1) the conv with per-thread (count, mean, M2) merged by Chan's formula into per-block
// partials (no sum of squares: no cancellation over 400k pixels); (2) per channel, the partials
// merged in order: mean, invstd, the running-stat update, scale / shift; (3) the conv again,
// normalised and written with the cls rows copied (recomputing the conv reads x once more instead
// of writing and re-reading an fp32 or rounded conv output). A grouped launch (abi.h: next) runs
// two problems of one shape (DwBnFwd: k and v) or three of two shapes (DwBnFwdQkv: q, then the k / v
// pair) in the same three launches.
#pragma once
#include "dwconv/dwbn_common.cuh"

namespace cvt_kernel {

// Pix: conv outputs per thread along W; Groups: 8-channel groups per block of the statistics kernel.
template <class Element_, int Stride, int Pix, int Groups, int Threads>
struct DwBnFwd : DwBnShape<Element_, Stride, Pix, Groups, Threads> {
  using Shape = DwBnShape<Element_, Stride, Pix, Groups, Threads>;
  using typename Shape::Element;
  using Shape::kCG;
  using Shape::kOut;
  using Shape::kThreads;
  using Shape::kVec;
  static constexpr int kFamily = CVT_FAMILY_DWCONV_BN;

  static int64_t stats_items(const cvt_dwbn_args& a) { return a.n * a.p * ((a.q + kOut - 1) / kOut); }
  static int stats_rows(const cvt_dwbn_args& a);
  static ReduceGrid stats_grid(const cvt_dwbn_args& a) {
    return out_rows_grid<DwBnFwd>(a, stats_items(a), stats_rows(a));
  }
  static OutGrid norm_grid(const cvt_dwbn_args& a) { return out_grid<DwBnFwd>(a); }
  static bool can_implement(const cvt_dwbn_args& a);
  static size_t workspace_one(const cvt_dwbn_args& a) {  // one problem's (a grouped launch: one per problem)
    return ((size_t(stats_rows(a)) * 3 + 2) * size_t(a.c) * sizeof(float) + 255) / 256 * 256;
  }
  static size_t workspace_size(const cvt_dwbn_args& a) { return group_workspace(a, workspace_one(a)); }
  static int launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream);
};

// q, k and v of one input in one set of launches: q (the first problem) of shape KQ, then the
// k / v pair (a.next, a.next->next) of shape KKV.
template <class KQ, class KKV>
struct DwBnFwdQkv {
  static_assert(!std::is_same_v<KQ, KKV>, "q and the k / v pair of one shape: a k / v-style group serves them");
  static constexpr int kFamily = CVT_FAMILY_DWCONV_BN;
  static bool can_implement(const cvt_dwbn_args& a);
  static size_t workspace_size(const cvt_dwbn_args& a) {
    return a.next ? group_workspace(a, KQ::workspace_one(a), KKV::workspace_one(*a.next), 1) : KQ::workspace_one(a);
  }
  static int launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream);
};

__device__ __forceinline__ void chan_merge(float& na, VecF8& ma, VecF8& qa, float nb, const VecF8& mb,
                                           const VecF8& qb) {
  if (nb == 0.f) return;
  const float n = na + nb, fb = nb / n, fab = na * fb;
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < kDwVec; ++e) {
    const float d = mb[e] - ma[e];
    ma[e] = fmaf(d, fb, ma[e]);
    qa[e] = qa[e] + qb[e] + d * d * fab;
  }
  na = n;
}

__device__ __forceinline__ void chan_merge1(float& na, float& ma, float& qa, float nb, float mb, float qb) {
  if (nb == 0.f) return;
  const float n = na + nb, fb = nb / n, d = mb - ma;
  ma = fmaf(d, fb, ma);
  qa = qa + qb + d * d * (na * fb);
  na = n;
}

// One item of the statistics kernel: the conv at kOut outputs (image, row p, columns q0..) for
// channels 8*c8.., their own mean and M2 (two exact passes over registers), merged into (n, mean, m2).
template <class K>
__device__ __forceinline__ void stats_item(const cvt_dwbn_args& a, const ReduceGrid& r, int it, int c8, float& n,
                                           VecF8& mean, VecF8& m2) {
  using Element = typename K::Element;
  constexpr int kOut = K::kOut, kVec = K::kVec;
  const Geo& g = r.g;
  const auto [img, p, q0] = row_item<kOut>(r, it);
  const Element* xb = spatial_tokens<Element>(a.x, a.x_image_stride, img, g);
  VecF8 acc[kOut];
  conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, acc);
  const int nb = min(kOut, g.Q - q0);
  // the item's own mean and M2 (two exact passes over registers), then merged
  VecF8 mb = zero8(), qb = zero8();
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kOut; ++j)
    if (j < nb)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) mb[e] += acc[j][e];
  const float inv_nb = 1.f / float(nb);
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < kVec; ++e) mb[e] *= inv_nb;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kOut; ++j)
    if (j < nb)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) qb[e] = fmaf(acc[j][e] - mb[e], acc[j][e] - mb[e], qb[e]);
  chan_merge(n, mean, m2, float(nb), mb, qb);
}

// part[block][0..2][c] = (count, mean, M2) of the conv outputs the block saw (shape K's blocks).
template <class K, int W>
__device__ __forceinline__ void stats_block(const cvt_dwbn_args& a, const ReduceGrid& r, float* part) {
  using B = SubBlock<K, W>;
  const B b;
  if (!in_grid(b, r)) return;
  constexpr int kVec = K::kVec, kCG = K::kCG, kThreads = K::kThreads, kLanes = K::kLanes, kWarps = K::kWarps;
  constexpr int kCh = kCG * kVec;
  __shared__ float sh_n[B::kSub][kWarps], sh_m[B::kSub][kWarps * kCh], sh_q[B::kSub][kWarps * kCh];
  float *s_n = sh_n[b.sub], *s_m = sh_m[b.sub], *s_q = sh_q[b.sub];
  const Geo& g = r.g;
  const int lane_c = b.tid % kCG, lane_s = b.tid / kCG;
  const int c8 = int(blockIdx.y) * kCG + lane_c;
  float n = 0.f;
  VecF8 mean = zero8(), m2 = zero8();
  if (c8 < g.C8) {
    const ItemRun run = item_run(r, b.id);
    for (int it = run.begin + lane_s; it < run.end; it += kLanes)
      stats_item<K>(a, r, it, c8, n, mean, m2);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = kCG; off < 32; off *= 2) {
    VecF8 mo, qo;
    const float no = __shfl_xor_sync(0xffffffffu, n, off);
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) {
      mo[e] = __shfl_xor_sync(0xffffffffu, mean[e], off);
      qo[e] = __shfl_xor_sync(0xffffffffu, m2[e], off);
    }
    chan_merge(n, mean, m2, no, mo, qo);
  }
  const int lane = b.tid % 32, warp = b.tid / 32;
  if (lane < kCG) {
    if (lane == 0) s_n[warp] = n;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) {
      s_m[warp * kCh + lane * kVec + e] = mean[e];
      s_q[warp * kCh + lane * kVec + e] = m2[e];
    }
  }
  b.sync();
  const int c0 = int(blockIdx.y) * kCh;
  for (int ch = b.tid; ch < kCh; ch += kThreads) {
    float bn = 0.f, bm = 0.f, bq = 0.f;
    for (int wp = 0; wp < kWarps; ++wp) chan_merge1(bn, bm, bq, s_n[wp], s_m[wp * kCh + ch], s_q[wp * kCh + ch]);
    if (c0 + ch < g.C) {
      float* row = part + int64_t(b.id) * 3 * g.C + c0 + ch;
      row[0] = bn;
      row[g.C] = bm;
      row[2 * g.C] = bq;
    }
  }
}

// The statistics pass of a group (dwbn_common.cuh: DwBnGroup): part: each shape's partials of
// the group's first problem (problem_ws moves them to this block's problem).
template <class K0, class K1>
__global__ void __launch_bounds__(max_threads<K0, K1>()) bn_stats_kernel(DwBnGroup<cvt_dwbn_args> grp,
                                                                        PerShape<ReduceGrid> r,
                                                                        PerShape<float*> part) {
  constexpr int W = max_threads<K0, K1>();
  if (!second_shape(grp)) return stats_block<K0, W>(problem_of(grp), r.s[0], problem_ws(part.s[0], grp));
  if constexpr (!std::is_same_v<K0, K1>) stats_block<K1, W>(problem_of(grp), r.s[1], problem_ws(part.s[1], grp));
}

// The normalisation's scale and shift of channel c from its mean and invstd: ss[c], ss[C + c].
__device__ __forceinline__ void scale_shift(const cvt_dwbn_args& a, int c, float mean, float invstd, float* ss) {
  const float scale = (a.bn_weight ? a.bn_weight[c] : 1.f) * invstd;
  ss[c] = scale;
  ss[a.c + c] = (a.bn_bias ? a.bn_bias[c] : 0.f) - mean * scale;
}

// One thread per channel and row lane (32 x 32): the partials merged in a fixed order, then the
// statistics, the running-stat update and the normalisation's scale / shift. The same for every
// configuration: not a template.
__global__ void __launch_bounds__(1024) bn_finish_kernel(DwBnGroup<cvt_dwbn_args> grp, PerShape<const float*> part,
                                                         PerShape<int> rows_of, PerShape<float*> ss_of) {
  __shared__ float s_n[32][33], s_m[32][33], s_q[32][33];
  const cvt_dwbn_args a = problem_of(grp);
  const bool second = second_shape(grp);
  const int rows = second ? rows_of.s[1] : rows_of.s[0];
  const float* part_ = problem_ws(second ? part.s[1] : part.s[0], grp);
  float* ss = problem_ws(second ? ss_of.s[1] : ss_of.s[0], grp);
  const int C = int(a.c);
  const int c = int(blockIdx.x) * 32 + int(threadIdx.x);
  if (a.phase == CVT_DWBN_APPLY) {  // the given statistics: only the scale / shift
    if (threadIdx.y == 0 && c < C) scale_shift(a, c, a.mean[c], a.invstd[c], ss);
    return;
  }
  float n = 0.f, m = 0.f, q = 0.f;
  if (c < C)
    for (int r = int(threadIdx.y); r < rows; r += 32) {
      const float* row = part_ + int64_t(r) * 3 * C + c;
      chan_merge1(n, m, q, row[0], row[C], row[2 * C]);
    }
  s_n[threadIdx.y][threadIdx.x] = n;
  s_m[threadIdx.y][threadIdx.x] = m;
  s_q[threadIdx.y][threadIdx.x] = q;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  n = m = q = 0.f;
  for (int i = 0; i < 32; ++i) chan_merge1(n, m, q, s_n[i][threadIdx.x], s_m[i][threadIdx.x], s_q[i][threadIdx.x]);
  a.mean[c] = m;
  if (a.phase == CVT_DWBN_STATS) {
    a.m2[c] = q;
    return;
  }
  const double count = double(a.n) * double(a.p) * double(a.q);
  const float var = q / float(count);
  const float invstd = 1.f / sqrtf(var + a.eps);
  a.invstd[c] = invstd;
  if (a.running_mean) {
    const float f = a.momentum;
    a.running_mean[c] = (1.f - f) * a.running_mean[c] + f * m;
    a.running_var[c] = (1.f - f) * a.running_var[c] + f * float(double(q) / (count - 1.0));
  }
  scale_shift(a, c, m, invstd, ss);
}

// y = conv(x) * scale + shift, kOut outputs along W x 8 channels per thread; the cls rows copied.
template <class K>
__device__ __forceinline__ void norm_block(const cvt_dwbn_args& a, const OutGrid& o, int block, const float* ss) {
  using Element = typename K::Element;
  constexpr int kVec = K::kVec, kOut = K::kOut;
  const Geo& g = o.g;
  int img, item, c8;
  if (!out_item(o.work, o.div_c8, block, img, item, c8)) return;
  const Element* xb = static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride;
  Element* yb = static_cast<Element*>(a.y) + int64_t(img) * a.y_image_stride;
  if (item >= o.spatial) return copy_row8(xb, yb, item - o.spatial, g.C, c8);  // a cls row
  int p, q0;
  out_row<K>(o.div_qg, item, p, q0);
  VecF8 acc[kOut];
  conv_row<K, kOut>(xb + g.cls * g.C, a.weight, g, p, q0, c8, acc);
  const VecF8 scale = ldf8(ss + c8 * kVec), shift = ldf8(ss + g.C + c8 * kVec);
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kOut; ++j) {
    if (q0 + j >= g.Q) break;
    VecF8 v;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) v[e] = fmaf(acc[j][e], scale[e], shift[e]);
    st8(yb + (g.cls + p * g.Q + q0 + j) * g.C + c8 * kVec, v);
  }
}

template <class K0, class K1>
__global__ void __launch_bounds__(min_threads<K0, K1>()) bn_norm_kernel(DwBnGroup<cvt_dwbn_args> grp,
                                                                       PerShape<OutGrid> o,
                                                                       PerShape<const float*> ss) {
  const FlatBlock f(grp, o.s[0].blocks, o.s[1].blocks);
  if (!second_shape(grp, f.z))
    return norm_block<K0>(problem_of(grp, f.z), o.s[0], f.block, problem_ws(ss.s[0], grp, f.z));
  if constexpr (!std::is_same_v<K0, K1>)
    norm_block<K1>(problem_of(grp, f.z), o.s[1], f.block, problem_ws(ss.s[1], grp, f.z));
}

// A group's three passes (dwbn_common.cuh: DwBnGroup): a0 a problem of shape K0, a1 of shape K1
// (a0 again for a one-shape group); each problem's workspace: the partials, then scale / shift.
template <class K0, class K1>
int dwbn_fwd_group(const DwBnGroup<cvt_dwbn_args>& grp, const cvt_dwbn_args& a0, const cvt_dwbn_args& a1,
                   void* workspace, cudaStream_t stream) {
  constexpr int W = max_threads<K0, K1>();
  const PerShape<ReduceGrid> st{{K0::stats_grid(a0), K1::stats_grid(a1)}};
  PerShape<OutGrid> nm{{K0::norm_grid(a0), K1::norm_grid(a1)}};
  constexpr int kOutThreads = min_threads<K0, K1>();
  const unsigned norm_x = flat_blocks(grp, nm, kOutThreads);
  const PerShape<int> rows{{st.s[0].rows, st.s[1].rows}};
  const unsigned stat_x = most(cdiv(rows.s[0], W / K0::kThreads), cdiv(rows.s[1], W / K1::kThreads));
  const int64_t c = a0.c;
  float* part = static_cast<float*>(workspace);
  const PerShape<float*> ss{{part + int64_t(rows.s[0]) * 3 * c, part + int64_t(rows.s[1]) * 3 * c}};
  const unsigned z = unsigned(grp.count);
  if (a0.phase != CVT_DWBN_APPLY)
    bn_stats_kernel<K0, K1><<<dim3(stat_x, most(st.s[0].chunks, st.s[1].chunks), z), W, 0, stream>>>(
        grp, st, PerShape<float*>{{part, part}});
  bn_finish_kernel<<<dim3(unsigned(c + 31) / 32, 1, z), dim3(32, 32), 0, stream>>>(
      grp, PerShape<const float*>{{part, part}}, rows, ss);
  if (a0.phase == CVT_DWBN_STATS) return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  bn_norm_kernel<K0, K1><<<dim3(norm_x, unsigned(a0.n)), kOutThreads, 0, stream>>>(
      grp, nm, PerShape<const float*>{{ss.s[0], ss.s[1]}});
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

template <class E, int Stride, int Pix, int Groups, int Threads>
int DwBnFwd<E, Stride, Pix, Groups, Threads>::stats_rows(const cvt_dwbn_args& a) {
  return reduce_blocks<DwBnFwd, KernelTag<DwBnFwd, 0>>(
      a, reinterpret_cast<const void*>(&bn_stats_kernel<DwBnFwd, DwBnFwd>), stats_items(a));
}

template <class E, int Stride, int Pix, int Groups, int Threads>
bool DwBnFwd<E, Stride, Pix, Groups, Threads>::can_implement(const cvt_dwbn_args& a) {
  if (a.next && !(same_input(a, *a.next) && a.y_image_stride == a.next->y_image_stride && can_implement(*a.next)))
    return false;
  if (a.phase < CVT_DWBN_ALL || a.phase > CVT_DWBN_APPLY || (a.phase != CVT_DWBN_ALL && a.next)) return false;
  if (a.phase == CVT_DWBN_STATS) return common_ok<DwBnFwd>(a) && a.mean && a.m2;
  if (!common_ok<DwBnFwd>(a) || !a.y || !a.mean || !a.invstd) return false;
  if (a.n * a.p * a.q < 2) return false;  // the unbiased variance needs two values (nn.BatchNorm2d raises)
  if (a.y_image_stride % kVec || a.y_image_stride < (a.cls_rows + a.p * a.q) * a.c) return false;
  if (reinterpret_cast<uintptr_t>(a.y) % 16) return false;
  if ((a.running_mean == nullptr) != (a.running_var == nullptr)) return false;
  return true;
}

template <class E, int Stride, int Pix, int Groups, int Threads>
int DwBnFwd<E, Stride, Pix, Groups, Threads>::launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream) {
  return dwbn_fwd_group<DwBnFwd, DwBnFwd>(group_of(a, workspace_one(a)), a, a, workspace, stream);
}

template <class KQ, class KKV>
bool DwBnFwdQkv<KQ, KKV>::can_implement(const cvt_dwbn_args& a) {
  if (!a.next || !a.next->next || a.phase != CVT_DWBN_ALL) return false;
  cvt_dwbn_args q = a;
  q.next = nullptr;
  return same_image(a, *a.next) && KQ::can_implement(q) && KKV::can_implement(*a.next);
}

template <class KQ, class KKV>
int DwBnFwdQkv<KQ, KKV>::launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream) {
  return dwbn_fwd_group<KQ, KKV>(group_of(a, KQ::workspace_one(a), KKV::workspace_one(*a.next), 1), a, *a.next,
                                 workspace, stream);
}

}  // namespace cvt_kernel
