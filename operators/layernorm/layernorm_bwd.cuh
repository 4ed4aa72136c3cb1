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

// dy's vector idx of row (img, row) (flat row r), with the further output gradients added in fp32.
template <class K>
__device__ __forceinline__ cutlass::Array<float, K::kVec> ln_load_dy(const cvt_normbwd_args& a, int64_t img,
                                                                   int64_t row, int64_t r, int idx, bool ok) {
  using Dy = typename K::ElementDy;
  cutlass::Array<float, K::kVec> dy = ln_load<K, Dy>(a.dy, img * a.dy_image_stride + row * a.dy_row_stride, idx, ok);
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < 2; ++m)
    if (a.dy_more[m]) {
      const cutlass::Array<float, K::kVec> more = ln_load<K, Dy>(a.dy_more[m], r * K::kC, idx, ok);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < K::kVec; ++e) dy[e] += more[e];
    }
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

// Blocks stride over all rows together (every lane of a warp takes part in every shuffle); each
// thread keeps fp32 sums of dy * xhat and dy for its channels, merged per block in shared memory.
template <class K>
__global__ void __launch_bounds__(K::kThreads) ln_bwd_kernel(cvt_normbwd_args a, float* partial) {
  using Element = typename K::Element;
  using X = typename K::ElementX;
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
  cutlass::NumericArrayConverter<X, float, kVec> to_out;
  cutlass::NumericArrayConverter<Element, float, kVec> to_branch;
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerBlock; base < total; base += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t r = base + rloc;
    const bool ok = r < total;
    const int64_t img = ok ? r / a.rows : 0, row = ok ? r % a.rows : 0;
    VecF x[kVecs], dy[kVecs];
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      x[v] = ln_load<K, X>(a.x, img * a.x_image_stride + row * a.x_row_stride, v * kLanes + lane, ok);
      dy[v] = ln_load_dy<K>(a, img, row, r, v * kLanes + lane, ok);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) s += x[v][e];
    }
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
    if (!ok) continue;
    X* out = static_cast<X*>(a.dx) + r * kC;
    const float rs = a.dres_scale != nullptr ? a.dres_scale[r] : 1.f;  // the residual gradient's row factor
    const float bs = a.dx_branch_scale != nullptr ? a.dx_branch_scale[r] : 1.f;  // the branch copy's
    Element* branch = a.dx_branch != nullptr ? static_cast<Element*>(a.dx_branch) + r * kC : nullptr;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      const VecF res =  // zeros without one
          ln_load<K, typename K::ElementRes>(a.dres, r * kC, v * kLanes + lane, a.dres != nullptr);
      VecF o;
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) o[e] = fmaf(rstd, dy[v][e] * w[v][e] - m1 - x[v][e] * m2, res[e] * rs);
      VecIo<X, kVec>::store(out, v * kLanes + lane, to_out(o));
      if (a.dx_branch != nullptr) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < kVec; ++e) o[e] *= bs;
        VecIo<Element, kVec>::store(branch, v * kLanes + lane, to_branch(o));
      }
    }
  }
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
  ln_bwd_kernel<LayerNormBwd><<<blocks, kThreads, 0, stream>>>(p, partial);
  colsum2_or_defer<Element>({partial, blocks, 2 * kC, kC, static_cast<Element*>(p.dweight)},
                            {partial + kC, blocks, 2 * kC, kC, static_cast<Element*>(p.dbias)}, p.defer, stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
