// LayerNorm backward over the C channels of tokens (operators/layernorm/abi.h: cvt_normbwd_args):
// dx in one pass (mean and rstd recomputed from the row in registers; up to two further output
// gradients summed with dy as loaded; a residual branch's gradient, when given, added before the
// store, its rows scaled by per-row factors where given), dweight / dbias as per-block fp32 partials (the block's rows summed in a fixed order)
// summed by one small deterministic pass (common/reduce.cuh): the same bits every run.
//
// Lanes threads own a row, each holding C / (Vec * Lanes) vectors of Vec elements (16 or 8
// bytes: the backward holds x, dy and two partial sums per channel, so C <= 4 vectors per thread).
// With an fp32 residual stream one side is fp32 (as in the forward): ElementX (x, the residual
// gradient and dx) for a layer's LayerNorm, ElementDy (dy and the further output gradients) for
// an embedding's; the weight and its gradients stay in Element. ElementRes, the residual
// gradient's, is ElementX's unless given: a 16-bit one with fp32 x where the gradient of a stream
// that ends in 16 bits (a stage's last layer before the next embedding) comes back 16-bit.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "common/device.cuh"
#include "common/reduce.cuh"
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "layernorm/layernorm_fwd.cuh"  // lanes_sum
#include "common/pdl.cuh"

namespace cvt_kernel {

template <class Element_, int C, int Lanes, int Threads, int Vec, class ElementX_ = Element_,
          class ElementDy_ = Element_, class ElementRes_ = ElementX_>
struct LayerNormBwd {
  static constexpr int kFamily = CVT_FAMILY_LAYERNORM_BWD;
  using Element = Element_;        // weight, dweight, dbias
  using ElementX = ElementX_;      // x, dx
  using ElementDy = ElementDy_;    // dy, dy_more
  using ElementRes = ElementRes_;  // dres
  static constexpr int kC = C;
  static constexpr int kVec = Vec;
  static constexpr int kLanes = Lanes;
  static constexpr int kVecs = kC / (kVec * kLanes);
  static constexpr int kThreads = Threads;
  static constexpr int kRowsPerBlock = kThreads / kLanes;
  static_assert(kC % (kVec * kLanes) == 0 && kVecs <= 4, "the row must split evenly, at most 4 vectors per thread");
  static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0 && kThreads % 32 == 0,
                "lanes: a power of two within a warp; whole warps");
  // Whether the next row is staged in shared memory (LnBwdStage): where its copies of x, dy and
  // the residual gradient fit beside the dweight / dbias sums in the 48 KB of static shared
  // memory (C = 1024 in 16 bits needs 48 KB of staging alone: those kernels load their rows).
  static constexpr bool kStaged =
      kVecs * kThreads * kVec * int(sizeof(ElementX) + sizeof(ElementDy) + sizeof(ElementRes)) +
          2 * kC * int(sizeof(float)) <= 48 * 1024;

  static int blocks_of(const cvt_normbwd_args& p);
  static bool can_implement(const cvt_normbwd_args& p);
  static size_t workspace_size(const cvt_normbwd_args& p) { return size_t(blocks_of(p)) * 2 * kC * sizeof(float); }
  static int launch(const cvt_normbwd_args& p, void* workspace, cudaStream_t stream);
};

// Vector idx of the row at element offset off of base (a T tensor), in fp32; zeros where !ok.
template <class K, class T>
__device__ __forceinline__ cutlass::Array<float, K::kVec> ln_load(const void* base, int64_t off, int idx, bool ok) {
  cutlass::NumericArrayConverter<float, T, K::kVec> to_float;
  cutlass::Array<float, K::kVec> f;
  if (!ok) {
    f.fill(0.f);
    return f;
  }
  return to_float(VecIo<T, K::kVec>::load(static_cast<const T*>(base) + off, idx));
}

// The further output gradients' vector idx of flat row r (packed rows) added to dy in fp32.
template <class K>
__device__ __forceinline__ void ln_add_more_dy(const cvt_normbwd_args& a, int64_t r, int idx, bool ok,
                                               cutlass::Array<float, K::kVec>& dy) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < 2; ++m)
    if (a.dy_more[m]) {
      const cutlass::Array<float, K::kVec> more = ln_load<K, typename K::ElementDy>(a.dy_more[m], r * K::kC, idx, ok);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < K::kVec; ++e) dy[e] += more[e];
    }
}

// dy's vector idx of row (img, row) (flat row r), with the further output gradients added in fp32.
template <class K>
__device__ __forceinline__ cutlass::Array<float, K::kVec> ln_load_dy(const cvt_normbwd_args& a, int64_t img,
                                                                   int64_t row, int64_t r, int idx, bool ok) {
  using Dy = typename K::ElementDy;
  cutlass::Array<float, K::kVec> dy = ln_load<K, Dy>(a.dy, img * a.dy_image_stride + row * a.dy_row_stride, idx, ok);
  ln_add_more_dy<K>(a, r, idx, ok, dy);
  return dy;
}

// The block's dweight / dbias partial row (`mine`: dweight's kC sums, then dbias's) from every
// thread's sums for its channels, met in shared memory (s_dw / s_db, zeroed) in a fixed order.
template <class K, class VecF>
__device__ __forceinline__ void block_partials(const VecF (&acc_w)[K::kVecs], const VecF (&acc_b)[K::kVecs], int lane,
                                               float* s_dw, float* s_db, float* mine) {
  // in a fixed order (no atomics: the same bits every run): within a warp by shuffles (row groups
  // kLanes lanes apart), then the warps one after another
  VecF w_sum[K::kVecs], b_sum[K::kVecs];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < K::kVecs; ++v) {
    w_sum[v] = acc_w[v];
    b_sum[v] = acc_b[v];
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = K::kLanes; off < 32; off *= 2)
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < K::kVecs; ++v)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < K::kVec; ++e) {
        w_sum[v][e] += __shfl_xor_sync(0xffffffffu, w_sum[v][e], off);
        b_sum[v][e] += __shfl_xor_sync(0xffffffffu, b_sum[v][e], off);
      }
  __syncthreads();
  const int warp = int(threadIdx.x) / 32;
  const bool leader = int(threadIdx.x) % 32 < K::kLanes;  // the warp's first row group holds its sums
  for (int wp = 0; wp < K::kThreads / 32; ++wp) {
    if (warp == wp && leader)
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < K::kVecs; ++v)
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < K::kVec; ++e) {
          const int c = (v * K::kLanes + lane) * K::kVec + e;
          s_dw[c] += w_sum[v][e];
          s_db[c] += b_sum[v][e];
        }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < K::kC; i += K::kThreads) {
    mine[i] = s_dw[i];
    mine[K::kC + i] = s_db[i];
  }
}

// The block's next rows staged in shared memory by cp.async (raw vectors of x, dy and the
// residual gradient), vector v of thread t at [v][t] (a warp's accesses contiguous), so that a
// thread's loads are in flight while it works on its current row; nothing where !K::kStaged.
template <class K, bool = K::kStaged>
struct LnBwdStage {
  typename VecIo<typename K::ElementX, K::kVec>::Vec x[K::kVecs][K::kThreads];
  typename VecIo<typename K::ElementDy, K::kVec>::Vec dy[K::kVecs][K::kThreads];
  typename VecIo<typename K::ElementRes, K::kVec>::Vec res[K::kVecs][K::kThreads];
};
template <class K>
struct LnBwdStage<K, false> {};

// Vector idx of base (N elements of T) copied to dst by cp.async, zeros where !ok (nothing read).
template <class T, int N>
__device__ __forceinline__ void cp_vec(typename VecIo<T, N>::Vec* dst, const T* base, int64_t idx, bool ok) {
  using Piece = typename VecIo<T, N>::Piece;
  const Piece* src = reinterpret_cast<const Piece*>(ok ? base + idx * N : base);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < VecIo<T, N>::kPieces; ++i) {
    const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(reinterpret_cast<Piece*>(dst) + i));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(to), "l"(ok ? src + i : src),
                 "n"(int(sizeof(Piece))), "r"(ok ? int(sizeof(Piece)) : 0) : "memory");
  }
}

// Row r's vectors of this thread (lane) staged into st (zeros past the last row), one cp.async group.
template <class K>
__device__ __forceinline__ void ln_stage_row(const cvt_normbwd_args& a, int64_t r, int64_t total, int lane,
                                             LnBwdStage<K>& st) {
  if constexpr (K::kStaged) {
    const int t = int(threadIdx.x);
    const bool ok = r < total;
    const int64_t img = ok ? r / a.rows : 0, row = ok ? r % a.rows : 0;
    using X = typename K::ElementX;
    using Dy = typename K::ElementDy;
    using Res = typename K::ElementRes;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < K::kVecs; ++v) {
      const int idx = v * K::kLanes + lane;
      cp_vec<X, K::kVec>(&st.x[v][t], static_cast<const X*>(a.x) + img * a.x_image_stride + row * a.x_row_stride, idx,
                         ok);
      cp_vec<Dy, K::kVec>(&st.dy[v][t], static_cast<const Dy*>(a.dy) + img * a.dy_image_stride + row * a.dy_row_stride,
                          idx, ok);
      if (a.dres != nullptr) cp_vec<Res, K::kVec>(&st.res[v][t], static_cast<const Res*>(a.dres) + r * K::kC, idx, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
}

// This thread's vectors of row r in fp32, from the staged copies (st) or, where !K::kStaged, from
// global memory: x, dy with the further output gradients added (read here, not staged), and the
// residual gradient (zeros without one).
template <class K>
__device__ __forceinline__ void ln_take_row(const cvt_normbwd_args& a, const LnBwdStage<K>& st, int64_t r, bool ok,
                                            int lane, cutlass::Array<float, K::kVec> (&x)[K::kVecs],
                                            cutlass::Array<float, K::kVec> (&dy)[K::kVecs],
                                            cutlass::Array<float, K::kVec> (&res)[K::kVecs]) {
  if constexpr (!K::kStaged) {
    const int64_t img = ok ? r / a.rows : 0, row = ok ? r % a.rows : 0;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < K::kVecs; ++v) {
      const int idx = v * K::kLanes + lane;
      x[v] = ln_load<K, typename K::ElementX>(a.x, img * a.x_image_stride + row * a.x_row_stride, idx, ok);
      dy[v] = ln_load_dy<K>(a, img, row, r, idx, ok);
      res[v] = ln_load<K, typename K::ElementRes>(a.dres, r * K::kC, idx, ok && a.dres != nullptr);
    }
  } else {
    cutlass::NumericArrayConverter<float, typename K::ElementX, K::kVec> x_to_f;
    cutlass::NumericArrayConverter<float, typename K::ElementDy, K::kVec> dy_to_f;
    cutlass::NumericArrayConverter<float, typename K::ElementRes, K::kVec> res_to_f;
    const int t = int(threadIdx.x);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < K::kVecs; ++v) {
      x[v] = x_to_f(st.x[v][t]);
      dy[v] = dy_to_f(st.dy[v][t]);
      if (a.dres != nullptr) res[v] = res_to_f(st.res[v][t]);
      else res[v].fill(0.f);
      ln_add_more_dy<K>(a, r, v * K::kLanes + lane, ok, dy[v]);
    }
  }
}

// Row r's dx = rstd (dy w - m1 - xhat m2) + the residual gradient (its rows scaled by dres_scale
// where given), and the branch copy (dx scaled by dx_branch_scale's row, in the compute dtype)
// where asked; x holds xhat.
template <class K>
__device__ __forceinline__ void ln_store_row(const cvt_normbwd_args& a, int64_t r, int lane, float rstd, float m1,
                                             float m2, const cutlass::Array<float, K::kVec> (&w)[K::kVecs],
                                             const cutlass::Array<float, K::kVec> (&x)[K::kVecs],
                                             const cutlass::Array<float, K::kVec> (&dy)[K::kVecs],
                                             const cutlass::Array<float, K::kVec> (&res)[K::kVecs]) {
  using X = typename K::ElementX;
  using Element = typename K::Element;
  cutlass::NumericArrayConverter<X, float, K::kVec> to_out;
  cutlass::NumericArrayConverter<Element, float, K::kVec> to_branch;
  X* out = static_cast<X*>(a.dx) + r * K::kC;
  const float rs = a.dres_scale != nullptr ? a.dres_scale[r] : 1.f;
  const float bs = a.dx_branch_scale != nullptr ? a.dx_branch_scale[r] : 1.f;
  Element* branch = a.dx_branch != nullptr ? static_cast<Element*>(a.dx_branch) + r * K::kC : nullptr;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < K::kVecs; ++v) {
    cutlass::Array<float, K::kVec> o;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < K::kVec; ++e) o[e] = fmaf(rstd, dy[v][e] * w[v][e] - m1 - x[v][e] * m2, res[v][e] * rs);
    VecIo<X, K::kVec>::store(out, v * K::kLanes + lane, to_out(o));
    if (branch != nullptr) {
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < K::kVec; ++e) o[e] *= bs;
      VecIo<Element, K::kVec>::store(branch, v * K::kLanes + lane, to_branch(o));
    }
  }
}

// Blocks stride over all rows together (every lane of a warp takes part in every shuffle); each
// thread keeps fp32 sums of dy * xhat and dy for its channels, merged per block in shared memory.
template <class K>
__global__ void __launch_bounds__(K::kThreads) ln_bwd_kernel(cvt_normbwd_args a, float* partial) {
  pdl_enter();
  using Element = typename K::Element;
  constexpr int kC = K::kC, kVec = K::kVec, kLanes = K::kLanes, kVecs = K::kVecs, kThreads = K::kThreads;
  constexpr int kRowsPerBlock = K::kRowsPerBlock;
  using VecF = cutlass::Array<float, kVec>;
  __shared__ float s_dw[kC], s_db[kC];
  for (int i = threadIdx.x; i < kC; i += kThreads) s_dw[i] = s_db[i] = 0.f;
  const int lane = int(threadIdx.x) % kLanes, rloc = int(threadIdx.x) / kLanes;
  const int64_t total = a.images * a.rows;
  VecF w[kVecs], acc_w[kVecs], acc_b[kVecs];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    w[v] = ln_load<K, Element>(a.weight, 0, v * kLanes + lane, true);
    acc_w[v].fill(0.f);
    acc_b[v].fill(0.f);
  }
  __shared__ LnBwdStage<K> st;  // (a thread reads only its own copies: no block barrier)
  const int64_t stride = int64_t(gridDim.x) * kRowsPerBlock;
  ln_stage_row<K>(a, int64_t(blockIdx.x) * kRowsPerBlock + rloc, total, lane, st);
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerBlock; base < total; base += stride) {
    const int64_t r = base + rloc;
    const bool ok = r < total;
    VecF x[kVecs], dy[kVecs], res[kVecs];  // res: the residual gradient (zeros without one)
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    ln_take_row<K>(a, st, r, ok, lane, x, dy, res);
    ln_stage_row<K>(a, r + stride, total, lane, st);  // the next row's loads in flight during this row's math
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) s += x[v][e];
    const float mean = lanes_sum<kLanes>(s) * (1.f / kC);
    float q = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) q = fmaf(x[v][e] - mean, x[v][e] - mean, q);
    const float rstd = rsqrtf(lanes_sum<kLanes>(q) * (1.f / kC) + a.eps);
    float s1 = 0.f, s2 = 0.f;  // sum(g), sum(g * xhat) with g = dy * w
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) {
        x[v][e] = (x[v][e] - mean) * rstd;  // xhat from here on
        const float g = dy[v][e] * w[v][e];
        s1 += g;
        s2 = fmaf(g, x[v][e], s2);
        acc_w[v][e] = fmaf(dy[v][e], x[v][e], acc_w[v][e]);
        acc_b[v][e] += dy[v][e];
      }
    const float m1 = lanes_sum<kLanes>(s1) * (1.f / kC), m2 = lanes_sum<kLanes>(s2) * (1.f / kC);
    if (ok) ln_store_row<K>(a, r, lane, rstd, m1, m2, w, x, dy, res);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // (the staged row past the last)
  block_partials<K>(acc_w, acc_b, lane, s_dw, s_db, partial + int64_t(blockIdx.x) * 2 * kC);
}

// One wave of blocks (as many as stay resident), so the partials' sum is short.
template <class E, int C, int Lanes, int Threads, int Vec, class X, class Dy, class R>
int LayerNormBwd<E, C, Lanes, Threads, Vec, X, Dy, R>::blocks_of(const cvt_normbwd_args& p) {
  const int64_t rows = p.images * p.rows;
  const int64_t sms = sms_of(p);
  const int64_t want = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const void* fn = reinterpret_cast<const void*>(&ln_bwd_kernel<LayerNormBwd>);
  const int64_t most = sms * resident_blocks<LayerNormBwd>(fn, kThreads, p.device_id);
  return int(want < most ? (want < 1 ? 1 : want) : most);
}

template <class E, int C, int Lanes, int Threads, int Vec, class X, class Dy, class R>
bool LayerNormBwd<E, C, Lanes, Threads, Vec, X, Dy, R>::can_implement(const cvt_normbwd_args& p) {
  if (p.images <= 0 || p.rows <= 0 || p.c != kC || !p.x || !p.dy || !p.weight || !p.dx || !p.dweight || !p.dbias)
    return false;
  if (p.x_row_stride % kVec || p.dy_row_stride % kVec || p.x_image_stride % kVec || p.dy_image_stride % kVec)
    return false;
  if (p.x_row_stride < kC || p.dy_row_stride < kC) return false;
  const uintptr_t ptrs = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dy) |
                         reinterpret_cast<uintptr_t>(p.weight) | reinterpret_cast<uintptr_t>(p.dx) |
                         reinterpret_cast<uintptr_t>(p.dres) | reinterpret_cast<uintptr_t>(p.dy_more[0]) |
                         reinterpret_cast<uintptr_t>(p.dx_branch) |
                         reinterpret_cast<uintptr_t>(p.dy_more[1]);
  return ptrs % 16 == 0;
}

template <class E, int C, int Lanes, int Threads, int Vec, class X, class Dy, class R>
int LayerNormBwd<E, C, Lanes, Threads, Vec, X, Dy, R>::launch(const cvt_normbwd_args& p, void* workspace,
                                                           cudaStream_t stream) {
  const int blocks = blocks_of(p);
  float* partial = static_cast<float*>(workspace);
  launch_kernel(ln_bwd_kernel<LayerNormBwd>, blocks, kThreads, 0, stream, p, partial);
  colsum2_or_defer<Element>({partial, blocks, 2 * kC, kC, static_cast<Element*>(p.dweight)},
                            {partial + kC, blocks, 2 * kC, kC, static_cast<Element*>(p.dbias)}, p.defer, stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
