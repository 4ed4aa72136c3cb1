// Depthwise 3x3 conv + BatchNorm, training forward (operators/dwconv/abi.h: cvt_dwbn_args), three
// kernels: (1) the conv with per-thread (count, mean, M2) merged by Chan's formula into per-block
// partials (no sum of squares: no cancellation over 400k pixels; the q / k / v row kernels sum
// squares of differences from a value of the walk, dwbn_rows.cuh); (2) per channel, the partials
// merged in order: mean, invstd, the running-stat update, scale / shift; (3) the conv again,
// normalised and written with the cls rows copied (recomputing the conv reads x once more instead
// of writing and re-reading an fp32 or rounded conv output). A grouped launch (abi.h: next) runs
// two problems of one shape (DwBnFwd: k and v) or three of two shapes (DwBnFwdQkv: q, then the k / v
// pair) in the same three launches; where q's and the pair's shapes share x (shares_x), the
// statistics and normalization kernels walk q's rows and serve k and v from the same loads
// (dwbn_rows.cuh).
#pragma once
#include "dwconv/dwbn_rows.cuh"
#include "common/pdl.cuh"

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
  // one problem's (a grouped launch: one per problem): the partials of `rows` blocks (0: this
  // shape's statistics pass's; a sharing q / k / v library: its row kernel's), then scale / shift
  static size_t workspace_one(const cvt_dwbn_args& a, int rows = 0) {
    return ((size_t(rows > 0 ? rows : stats_rows(a)) * 3 + 2) * size_t(a.c) * sizeof(float) + 255) / 256 * 256;
  }
  static size_t workspace_size(const cvt_dwbn_args& a) { return group_workspace(a, workspace_one(a)); }
  static int launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream);
};

// q, k and v of one input in one set of launches: q (the first problem) of shape KQ, then the
// k / v pair (a.next, a.next->next) of shape KKV.
// Where the shapes share x (dwbn_common.cuh: shares_x), the statistics and normalization passes
// walk q's rows and serve k and v from the same loads (dwbn_rows.cuh): every problem's partials
// come from that grid (each problem's workspace sized by it), so the statistics are not the bits
// of the single libraries' launches (the conv outputs are).
template <class KQ, class KKV>
struct DwBnFwdQkv {
  static_assert(!std::is_same_v<KQ, KKV>, "q and the k / v pair of one shape: a k / v-style group serves them");
  static constexpr int kFamily = CVT_FAMILY_DWCONV_BN;
  static constexpr bool kShared = shares_x<KQ, KKV>();
  static bool can_implement(const cvt_dwbn_args& a);
  static int shared_rows(const cvt_dwbn_args& a);  // the shared statistics pass's blocks along x
  static size_t shared_workspace_one(const cvt_dwbn_args& a) { return KQ::workspace_one(a, shared_rows(a)); }
  static size_t workspace_size(const cvt_dwbn_args& a) {
    if (!a.next) return KQ::workspace_one(a);
    if constexpr (kShared) return 3 * shared_workspace_one(a);
    else return group_workspace(a, KQ::workspace_one(a), KKV::workspace_one(*a.next), 1);
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

// The item's first nb of kN conv outputs: their own mean and M2 (two exact passes over
// registers), merged into (n, mean, m2).
template <int kN>
__device__ __forceinline__ void merge_outputs(const VecF8 (&acc)[kN], int nb, float& n, VecF8& mean, VecF8& m2) {
  VecF8 mb = zero8(), qb = zero8();
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kN; ++j)
    if (j < nb)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kDwVec; ++e) mb[e] += acc[j][e];
  const float inv_nb = 1.f / float(nb);
  CUTLASS_PRAGMA_UNROLL
  for (int e = 0; e < kDwVec; ++e) mb[e] *= inv_nb;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kN; ++j)
    if (j < nb)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kDwVec; ++e) qb[e] = fmaf(acc[j][e] - mb[e], acc[j][e] - mb[e], qb[e]);
  chan_merge(n, mean, m2, float(nb), mb, qb);
}

// One item of the statistics kernel: the conv at kOut outputs (image, row p, columns q0..) for
// channels 8*c8.., merged into (n, mean, m2).
template <class K>
__device__ __forceinline__ void stats_item(const cvt_dwbn_args& a, const ReduceGrid& r, int it, int c8, float& n,
                                           VecF8& mean, VecF8& m2) {
  using Element = typename K::Element;
  constexpr int kOut = K::kOut;
  const Geo& g = r.g;
  const auto [img, p, q0] = row_item<kOut>(r, it);
  const Element* xb = spatial_tokens<Element>(a.x, a.x_image_stride, img, g);
  VecF8 acc[kOut];
  conv_row<K, kOut>(xb, a.weight, g, p, q0, c8, acc);
  merge_outputs<kOut>(acc, min(kOut, g.Q - q0), n, mean, m2);
}

// The shared-memory rows of stats_store: one block's per-warp (count, mean, M2).
template <class K>
struct StatsSmem {
  float n[K::kWarps], m[K::kWarps * K::kCG * kDwVec], q[K::kWarps * K::kCG * kDwVec];
};

// part[block][0..2][c] = (count, mean, M2) of the block's threads' (n, mean, m2): lanes sharing
// channels merged by shuffles, then the warps in order (sm: this block's own).
template <class K, class B>
__device__ __forceinline__ void stats_store(const B& b, float n, VecF8 mean, VecF8 m2, float* part, int C,
                                            StatsSmem<K>& sm) {
  constexpr int kVec = K::kVec, kCG = K::kCG, kThreads = K::kThreads, kWarps = K::kWarps;
  constexpr int kCh = kCG * kVec;
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
    if (lane == 0) sm.n[warp] = n;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) {
      sm.m[warp * kCh + lane * kVec + e] = mean[e];
      sm.q[warp * kCh + lane * kVec + e] = m2[e];
    }
  }
  b.sync();
  const int c0 = int(blockIdx.y) * kCh;
  for (int ch = b.tid; ch < kCh; ch += kThreads) {
    float bn = 0.f, bm = 0.f, bq = 0.f;
    for (int wp = 0; wp < kWarps; ++wp) chan_merge1(bn, bm, bq, sm.n[wp], sm.m[wp * kCh + ch], sm.q[wp * kCh + ch]);
    if (c0 + ch < C) {
      float* row = part + int64_t(b.id) * 3 * C + c0 + ch;
      row[0] = bn;
      row[C] = bm;
      row[2 * C] = bq;
    }
  }
}

// part[block][0..2][c] = (count, mean, M2) of the conv outputs the block saw (shape K's blocks).
template <class K, int W>
__device__ __forceinline__ void stats_block(const cvt_dwbn_args& a, const ReduceGrid& r, float* part) {
  using B = SubBlock<K, W>;
  const B b;
  if (!in_grid(b, r)) return;
  __shared__ StatsSmem<K> sh[B::kSub];
  const int c8 = int(blockIdx.y) * K::kCG + b.tid % K::kCG;
  float n = 0.f;
  VecF8 mean = zero8(), m2 = zero8();
  if (c8 < r.g.C8) {
    const ItemRun run = item_run(r, b.id);
    for (int it = run.begin + b.tid / K::kCG; it < run.end; it += K::kLanes) stats_item<K>(a, r, it, c8, n, mean, m2);
  }
  stats_store<K>(b, n, mean, m2, part, r.g.C, sh[b.sub]);
}

// The statistics pass of a group (dwbn_common.cuh: DwBnGroup): part: each shape's partials of
// the group's first problem (problem_ws moves them to this block's problem).
template <class K0, class K1>
__global__ void __launch_bounds__(max_threads<K0, K1>()) bn_stats_kernel(DwBnGroup<cvt_dwbn_args> grp,
                                                                        PerShape<ReduceGrid> r,
                                                                        PerShape<float*> part) {
  pdl_enter();
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
  pdl_enter();
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
  pdl_enter();
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
    launch_kernel(bn_stats_kernel<K0, K1>, dim3(stat_x, most(st.s[0].chunks, st.s[1].chunks), z), W, 0, stream, grp, st,
                  PerShape<float*>{{part, part}});
  launch_kernel(bn_finish_kernel, dim3(unsigned(c + 31) / 32, 1, z), dim3(32, 32), 0, stream, grp,
                PerShape<const float*>{{part, part}}, rows, ss);
  if (a0.phase == CVT_DWBN_STATS) return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  launch_kernel(bn_norm_kernel<K0, K1>, dim3(norm_x, unsigned(a0.n)), kOutThreads, 0, stream, grp, nm,
                PerShape<const float*>{{ss.s[0], ss.s[1]}});
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

// ---- q, k and v from one read of x (DwBnFwdQkv::kShared; dwbn_rows.cuh) ----

// A lane's statistics of one problem over one walk: values shifted by the walk's first value.
struct RowMoments {
  F2 shift, s1, s2;
  int n;
  __device__ __forceinline__ void add(F2 z) {
    if (n == 0) shift = z;
    const float dx = z.x - shift.x, dy = z.y - shift.y;
    s1.x += dx;
    s1.y += dy;
    s2.x = fmaf(dx, dx, s2.x);
    s2.y = fmaf(dy, dy, s2.y);
    ++n;
  }
};

// A lane's running (count, mean, M2) of one problem's two channels.
struct PairStats {
  float n;
  F2 mean, m2;
  __device__ __forceinline__ void merge(const RowMoments& r) {
    if (r.n == 0) return;
    const float nb = float(r.n), inv = 1.f / nb;
    const float mx = r.s1.x * inv, my = r.s1.y * inv;
    float na = n;
    chan_merge1(na, mean.x, m2.x, nb, r.shift.x + mx, fmaxf(r.s2.x - r.s1.x * mx, 0.f));
    chan_merge1(n, mean.y, m2.y, nb, r.shift.y + my, fmaxf(r.s2.y - r.s1.y * my, 0.f));
  }
};

// Each problem's part[block][0..2][c] (its workspace copy) from the rows the block's warps walk.
template <class Element>
__global__ void __launch_bounds__(kRowThreads) bn_stats_rows_kernel(DwBnGroup<cvt_dwbn_args> grp, RowGrid rg,
                                                                   float* part) {
  pdl_enter();
  __shared__ float sh_n[3][kRowWarps], sh_m[3][kRowWarps][kWarpCh<F2>], sh_q[3][kRowWarps][kWarpCh<F2>];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const Geo& g = rg.g;
  const int c = int(blockIdx.y) * kWarpCh<F2> + 2 * lane;
  PairStats st[3];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) st[k] = PairStats{0.f, make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
  if (c < g.C) {
    const float* const src[3] = {grp.p[0].weight, grp.p[1].weight, grp.p[2].weight};
    const QkvWeights<F2> wt(src, g.C, c);
    const ItemRun run = item_run(rg.items, rg.blocks, int(blockIdx.x));
    for (int it = run.begin + warp; it < run.end; it += kRowWarps) {
      int img, p;
      rg.div_pair(img, p, it);
      p *= 2;
      RowMoments m[3] = {};
      walk_rows<Element>(spatial_tokens<Element>(grp.p[0].x, grp.p[0].x_image_stride, img, g), g, p, c, wt,
                         [&](int, int, int, F2 z, auto&) { m[0].add(z); },
                         [&](int, int, F2 zk, F2 zv, auto&) {
                           m[1].add(zk);
                           m[2].add(zv);
                         });
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 3; ++k) st[k].merge(m[k]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) {  // a warp's lanes walked the same rows: one count per warp
    if (lane == 0) sh_n[k][warp] = st[k].n;
    sh_m[k][warp][2 * lane] = st[k].mean.x;
    sh_m[k][warp][2 * lane + 1] = st[k].mean.y;
    sh_q[k][warp][2 * lane] = st[k].m2.x;
    sh_q[k][warp][2 * lane + 1] = st[k].m2.y;
  }
  __syncthreads();
  for (int i = int(threadIdx.x); i < 3 * kWarpCh<F2>; i += kRowThreads) {
    const int k = i / kWarpCh<F2>, ch = i % kWarpCh<F2>, cc = int(blockIdx.y) * kWarpCh<F2> + ch;
    if (cc >= g.C) continue;
    float bn = 0.f, bm = 0.f, bq = 0.f;
    for (int wp = 0; wp < kRowWarps; ++wp) chan_merge1(bn, bm, bq, sh_n[k][wp], sh_m[k][wp][ch], sh_q[k][wp][ch]);
    float* row = problem_ws(part, grp, k) + int64_t(blockIdx.x) * 3 * g.C + cc;
    row[0] = bn;
    row[g.C] = bm;
    row[2 * g.C] = bq;
  }
}

// A problem's scale and shift of channels c, c + 1 (ss: scale (C), then shift (C)).
__device__ __forceinline__ void pair_scale_shift(const float* ss, int C, int c, F2& scale, F2& shift) {
  scale = __ldg(reinterpret_cast<const float2*>(ss + c));
  shift = __ldg(reinterpret_cast<const float2*>(ss + C + c));
}

__device__ __forceinline__ F2 affine(F2 z, F2 scale, F2 shift) {
  return make_float2(fmaf(z.x, scale.x, shift.x), fmaf(z.y, scale.y, shift.y));
}

// y = conv(x) * scale + shift of one walked pair of rows (one warp: rg's items are the row pairs,
// then the cls rows, copied into the three outputs). ss: each problem's scale / shift (its workspace copy).
template <class Element>
__global__ void __launch_bounds__(kRowThreads) bn_norm_rows_kernel(DwBnGroup<cvt_dwbn_args> grp, RowGrid rg,
                                                                  const float* ss) {
  pdl_enter();
  const Geo& g = rg.g;
  const int it = int(blockIdx.x) * kRowWarps + int(threadIdx.x) / 32;
  const int c = int(blockIdx.y) * kWarpCh<F2> + 2 * (int(threadIdx.x) % 32);
  if (it >= rg.items || c >= g.C) return;
  const int spatial = rg.items - int(grp.p[0].n) * g.cls;  // the row pairs, then the cls rows
  if (it >= spatial) {  // a cls row
    const int img = (it - spatial) / g.cls, row = (it - spatial) % g.cls;
    const uint32_t v = ld2raw(static_cast<const Element*>(grp.p[0].x) + int64_t(img) * grp.p[0].x_image_stride +
                              row * g.C + c);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 3; ++k)
      *reinterpret_cast<uint32_t*>(static_cast<Element*>(grp.p[k].y) + int64_t(img) * grp.p[k].y_image_stride +
                                   row * g.C + c) = v;
    return;
  }
  int img, p;
  rg.div_pair(img, p, it);
  p *= 2;
  const float* const src[3] = {grp.p[0].weight, grp.p[1].weight, grp.p[2].weight};
  const QkvWeights<F2> wt(src, g.C, c);
  F2 scale[3], shift[3];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) pair_scale_shift(problem_ws(ss, grp, k), g.C, c, scale[k], shift[k]);
  Element* y[3];
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 3; ++k) {
    const int row = k == 0 ? p * g.Q : (p / 2) * rg.qkv;
    y[k] = static_cast<Element*>(grp.p[k].y) + int64_t(img) * grp.p[k].y_image_stride + (g.cls + row) * g.C + c;
  }
  walk_rows<Element>(spatial_tokens<Element>(grp.p[0].x, grp.p[0].x_image_stride, img, g), g, p, c, wt,
                     [&](int j, int q, int, F2 z, auto&) {
                       st2(y[0] + (j * g.Q + q) * g.C, affine(z, scale[0], shift[0]));
                     },
                     [&](int q, int, F2 zk, F2 zv, auto&) {
                       st2(y[1] + (q / 2) * g.C, affine(zk, scale[1], shift[1]));
                       st2(y[2] + (q / 2) * g.C, affine(zv, scale[2], shift[2]));
                     });
}

// The three passes of a sharing q / k / v group: every problem's workspace holds the row
// kernel's partials, then its scale / shift.
template <class KQ, class KKV>
int dwbn_fwd_qkv_shared(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream) {
  static_assert(std::is_same_v<typename KQ::Element, typename KKV::Element>, "one activation dtype");
  using Lib = DwBnFwdQkv<KQ, KKV>;
  using Element = typename KQ::Element;
  const size_t ws = Lib::shared_workspace_one(a);
  const DwBnGroup<cvt_dwbn_args> grp = group_of(a, ws, ws, 1);
  const int rows = Lib::shared_rows(a);
  const RowGrid st = row_grid(a, *a.next, rows);
  const RowGrid nm = row_grid(a, *a.next, 0, int(a.n * a.cls_rows));
  const int64_t c = a.c;
  float* part = static_cast<float*>(workspace);
  float* ss = part + int64_t(rows) * 3 * c;
  launch_kernel(bn_stats_rows_kernel<Element>, dim3(unsigned(rows), unsigned(st.chunks)), kRowThreads, 0, stream, grp,
                st, part);
  launch_kernel(bn_finish_kernel, dim3(unsigned(c + 31) / 32, 1, 3), dim3(32, 32), 0, stream, grp,
                PerShape<const float*>{{part, part}}, PerShape<int>{{rows, rows}}, PerShape<float*>{{ss, ss}});
  launch_kernel(bn_norm_rows_kernel<Element>, dim3(unsigned(cdiv(nm.items, kRowWarps)), unsigned(nm.chunks)),
                kRowThreads, 0, stream, grp, nm, ss);
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
int DwBnFwdQkv<KQ, KKV>::shared_rows(const cvt_dwbn_args& a) {
  if constexpr (kShared)
    return row_blocks<KernelTag<DwBnFwdQkv, 0>>(
        a, reinterpret_cast<const void*>(&bn_stats_rows_kernel<typename KQ::Element>));
  else
    return KQ::stats_rows(a);
}

template <class KQ, class KKV>
int DwBnFwdQkv<KQ, KKV>::launch(const cvt_dwbn_args& a, void* workspace, cudaStream_t stream) {
  if constexpr (kShared) return dwbn_fwd_qkv_shared<KQ, KKV>(a, workspace, stream);
  else
    return dwbn_fwd_group<KQ, KKV>(group_of(a, KQ::workspace_one(a), KKV::workspace_one(*a.next), 1), a, *a.next,
                                   workspace, stream);
}

}  // namespace cvt_kernel
