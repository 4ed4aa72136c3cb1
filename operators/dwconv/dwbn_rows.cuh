// q, k and v of one input from one read of x: a q / k / v library whose q runs at stride 1 and
// whose k / v pair runs at stride 2 (shares_x) runs its forward statistics and normalization and
// its backward sums and dz + dW passes with these kernels instead of one set of blocks per problem
// (and its summed dgrad with a walk of its own over the input rows: dwbn_bwd.cuh).
//
// A warp walks two conv output rows of q (image img, rows p and p + 1, p even) across 32 channels
// a lane holds (Lane: two per lane, one 4-byte access per pixel, or one per lane in the dz + dW
// pass, which holds more per channel), a 4 x 3 window of inputs sliding along the rows and the
// three problems' 3 x 3 weights of the lane's channels in registers. k's and v's output (p', q')
// is centred on input (2p', 2q'), q's output (2p', 2q') on the same input, so the walk also
// yields k's and v's row p / 2 at q's even columns (every k / v output has such a q output once:
// P' = ceil(H / 2), Q' = ceil(W / 2)). Each output's taps are summed in conv_row's order (the
// same conv bits as the one-problem kernels). Input columns are loaded kAhead at a time, the next
// group's loads issued before the current group's math.
//
// The reducing kernels keep per-lane sums over each walk (statistics: the walk's values shifted
// by its first value, sums and sums of squares of the differences, merged into the lane's (count,
// mean, M2) by Chan's formula once per walk), then the block's warps in order: per-block partial
// rows laid out as the one-problem kernels write them, so bn_finish_kernel, bn_bwd_finish_kernel
// and the dW column sums take them unchanged. The statistics and sums are therefore merged in
// another order than the one-problem kernels' (within fp32 rounding of them).
#pragma once
#include "dwconv/dwbn_common.cuh"

namespace cvt_kernel {

constexpr int kRowWarps = 2;                     // warps per block (~190 registers a thread: 10 warps an SM)
constexpr int kRowThreads = 32 * kRowWarps;
constexpr int kAhead = 4;                        // input columns loaded together
static_assert(kAhead % 2 == 0, "a group starts at an even column: its even places are k's and v's");

// A lane's channels: two (float2, one 4-byte access per pixel) or one (float, 2 bytes) where a
// kernel holds more per channel (the dz + dW pass).
using F2 = float2;
template <class V>
struct Lane;
template <>
struct Lane<float2> {
  using Raw = uint32_t;
  static constexpr int kCh = 2;
};
template <>
struct Lane<float> {
  using Raw = uint16_t;
  static constexpr int kCh = 1;
};
template <class V>
constexpr int kWarpCh = 32 * Lane<V>::kCh;  // channels per warp

__device__ __forceinline__ F2 vfma(F2 w, F2 x, F2 acc) {
  return make_float2(fmaf(w.x, x.x, acc.x), fmaf(w.y, x.y, acc.y));
}
__device__ __forceinline__ float vfma(float w, float x, float acc) { return fmaf(w, x, acc); }

template <class Element>
__device__ __forceinline__ F2 to_v(uint32_t raw) {
  cutlass::NumericArrayConverter<float, Element, 2> cvt;
  const cutlass::Array<float, 2> v = cvt(reinterpret_cast<cutlass::Array<Element, 2> const&>(raw));
  return make_float2(v[0], v[1]);
}
template <class Element>
__device__ __forceinline__ float to_v(uint16_t raw) {
  return float(reinterpret_cast<Element const&>(raw));
}
template <class Raw, class Element>
__device__ __forceinline__ Raw ldraw(const Element* p) {
  return __ldg(reinterpret_cast<const Raw*>(p));
}
template <class Element>
__device__ __forceinline__ uint32_t ld2raw(const Element* p) {
  return ldraw<uint32_t>(p);
}
template <class Element>
__device__ __forceinline__ void st2(Element* p, F2 v) {
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  cutlass::Array<float, 2> f;
  f[0] = v.x;
  f[1] = v.y;
  const cutlass::Array<Element, 2> o = cvt(f);
  *reinterpret_cast<uint32_t*>(p) = reinterpret_cast<uint32_t const&>(o);
}

// The work of a row kernel: pairs of rows (img, p = 2 * pair) of q's output x 64-channel chunks.
struct RowGrid {
  Geo g;
  int items, blocks, chunks, qkv;  // items: n * ceil(P / 2) (+ the cls rows in the normalization); qkv: the pair's Q
  cutlass::FastDivmod div_pair;
};

template <class Args>
int row_pairs(const Args& q) {
  return int(q.n * ((q.p + 1) / 2));
}

template <class V = F2, class Args>
RowGrid row_grid(const Args& q, const Args& kv, int blocks, int extra_items = 0) {
  const Geo g = geo_of(q);
  return {g, row_pairs(q) + extra_items, blocks, (g.C + kWarpCh<V> - 1) / kWarpCh<V>, int(kv.q),
          cutlass::FastDivmod((g.P + 1) / 2)};
}

// One wave of a reducing row kernel `fn` over all chunks, at most one block per kRowWarps row pairs.
template <class Tag, class V = F2, class Args>
int row_blocks(const Args& a, const void* fn) {
  const int64_t chunks = (a.c + kWarpCh<V> - 1) / kWarpCh<V>;
  const int64_t most = int64_t(sms_of(a)) * resident_blocks<Tag>(fn, kRowThreads, a.device_id) / chunks;
  const int64_t want = (row_pairs(a) + kRowWarps - 1) / kRowWarps;
  const int64_t b = want < most ? want : most;
  return int(b < 1 ? 1 : b);
}

// A lane's channels of the three problems' 3 x 3 weights (tap-major (3, 3, C) fp32).
template <class V>
struct QkvWeights {
  V w[3][9];
  __device__ __forceinline__ QkvWeights(const float* const (&src)[3], int C, int c) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 3; ++k)
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < 9; ++t) w[k][t] = __ldg(reinterpret_cast<const V*>(src[k] + t * C + c));
  }
};

// The conv of window rows R0..R0 + 2, columns 0..2 with weights w (rows outside the image skipped,
// columns outside it zero): conv_row's order.
template <int R0, class V>
__device__ __forceinline__ V conv3(const V (&w)[9], const V (&win)[4][3], const bool (&valid)[4]) {
  V acc{};
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    if (!valid[R0 + r]) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 3; ++s) acc = vfma(w[r * 3 + s], win[R0 + r][s], acc);
  }
  return acc;
}

// What a walk loads beside x: nothing (the forward kernels).
struct NoAhead {
  __device__ __forceinline__ void fetch(int) {}
  __device__ __forceinline__ void shift() {}
};

// Walks q's output rows p (even) and p + 1 (where p + 1 < P) of image xb (spatial tokens) at
// the lane's channels from c over input rows p - 1..p + 2: calls out(j, col, u, zq, win) for q's
// output (p + j, col) and kv(col, u, zk, zv, win) at every even col (k's and v's output (p / 2,
// col / 2)); u: col's place in its group of kAhead columns; win: the window (input rows p - 1..
// p + 2, columns col - 1..col + 1). `ahead` loads what the callbacks read besides x one
// group ahead as well: ahead.fetch(col0) for the group from col0, ahead.shift() as a group starts.
template <class Element, class V, class Out, class Kv, class Ahead = NoAhead>
__device__ __forceinline__ void walk_rows(const Element* xb, const Geo& g, int p, int c, const QkvWeights<V>& wt,
                                          Out&& out, Kv&& kv, Ahead&& ahead = NoAhead{}) {
  using Raw = typename Lane<V>::Raw;
  const Element* rows[4];
  bool valid[4];
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 4; ++r) {
    const int ih = p - 1 + r;
    valid[r] = ih >= 0 && ih < g.H;
    rows[r] = xb + int64_t(valid[r] ? ih : 0) * g.W * g.C + c;
  }
  const bool second = p + 1 < g.P;
  V win[4][3];
  Raw next[4][kAhead];
  auto fetch = [&](int col0) {  // input columns col0..col0 + kAhead - 1
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 4; ++r)
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < kAhead; ++u)
        next[r][u] = valid[r] && col0 + u < g.W ? ldraw<Raw>(rows[r] + (col0 + u) * g.C) : Raw(0);
  };
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 4; ++r) {
    win[r][0] = V{};
    win[r][1] = V{};  // column -1 after the first move
    win[r][2] = valid[r] ? to_v<Element>(ldraw<Raw>(rows[r])) : V{};  // column 0
  }
  fetch(1);
  ahead.fetch(0);
  for (int q0 = 0; q0 < g.Q; q0 += kAhead) {
    Raw cur[4][kAhead];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 4; ++r)
      CUTLASS_PRAGMA_UNROLL
      for (int u = 0; u < kAhead; ++u) cur[r][u] = next[r][u];
    ahead.shift();
    if (q0 + kAhead < g.Q) {
      fetch(q0 + kAhead + 1);
      ahead.fetch(q0 + kAhead);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kAhead; ++u) {
      const int q = q0 + u;
      if (q >= g.Q) break;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 4; ++r) {  // the window moves to columns q - 1..q + 1
        win[r][0] = win[r][1];
        win[r][1] = win[r][2];
        win[r][2] = to_v<Element>(cur[r][u]);
      }
      out(0, q, u, conv3<0>(wt.w[0], win, valid), win);
      if (second) out(1, q, u, conv3<1>(wt.w[0], win, valid), win);
      if (u % 2 == 0) kv(q, u, conv3<0>(wt.w[1], win, valid), conv3<0>(wt.w[2], win, valid), win);  // q0 is even
    }
  }
}

}  // namespace cvt_kernel
