// LayerNorm over the C channels of CvT's tokens (B, L, C), with optional prefix rows (the cls
// token) copied in front of each image's output and optional (mean, rstd) per row for the
// backward (operators/layernorm/abi.h: cvt_norm_args). fp16/bf16 weights; x and y in that dtype,
// or one of them fp32 (an fp32 residual stream: ElementIn for a layer's LayerNorm reading it,
// ElementOut for an embedding's starting it; the prefix rows are in ElementOut); fp32 statistics.
//
// A group of Lanes threads (a power of two, <= 32) owns one row; each thread holds C / (8 * Lanes)
// vectors of 8 channels in registers (16 bytes, 32 for fp32), so a row is read once; mean and variance are two exact passes over
// the registers (group shuffles), the output is written once. Rows per block = Threads / Lanes.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "common/device.cuh"
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "layernorm/abi.h"
#include "common/pdl.cuh"

namespace cvt_kernel {

// Sum over the Lanes threads of a row (every lane of the warp takes part: no thread returns
// before the last shuffle).
template <int Lanes>
__device__ __forceinline__ float lanes_sum(float v) {
  CUTLASS_PRAGMA_UNROLL
  for (int o = Lanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o, Lanes);
  return v;
}

// N elements of T as whole loads / stores of up to 16 bytes: 8 x 16-bit one 16-byte access,
// 8 x fp32 two, 4 x 16-bit one 8-byte access. p: element idx * N of the vectors at base.
template <class T, int N>
struct VecIo {
  static constexpr int kBytes = N * int(sizeof(T));
  using Piece = std::conditional_t<(kBytes >= 16), uint4, uint2>;
  static constexpr int kPieces = kBytes / int(sizeof(Piece));
  static_assert(kBytes % int(sizeof(Piece)) == 0 && kBytes >= 8, "whole 8- or 16-byte pieces");
  using Vec = cutlass::AlignedArray<T, N, sizeof(Piece)>;

  static __device__ __forceinline__ cutlass::Array<T, N> load(const T* base, int64_t idx) {
    Vec out;
    const Piece* src = reinterpret_cast<const Piece*>(base + idx * N);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPieces; ++i) reinterpret_cast<Piece*>(&out)[i] = __ldg(src + i);
    return out;
  }
  static __device__ __forceinline__ void store(T* base, int64_t idx, const cutlass::Array<T, N>& v) {
    Vec tmp;
    static_cast<cutlass::Array<T, N>&>(tmp) = v;
    Piece* dst = reinterpret_cast<Piece*>(base + idx * N);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kPieces; ++i) dst[i] = reinterpret_cast<const Piece*>(&tmp)[i];
  }
};

template <class Element_, int C, int Lanes, int Threads, class ElementIn_ = Element_, class ElementOut_ = Element_>
struct LayerNormFwd {
  static constexpr int kFamily = CVT_FAMILY_LAYERNORM;
  using Element = Element_;        // weight and bias
  using ElementIn = ElementIn_;    // x
  using ElementOut = ElementOut_;  // y and the prefix rows
  static constexpr int kC = C;
  static constexpr int kVec = 8;                      // channels per vector (16 bytes for 16-bit types)
  static constexpr int kLanes = Lanes;                // threads per row
  static constexpr int kVecs = kC / (kVec * kLanes);  // 16-byte vectors per thread
  static constexpr int kThreads = Threads;
  static constexpr int kRowsPerBlock = kThreads / kLanes;
  static_assert(kC % (kVec * kLanes) == 0, "the row must split evenly over the lanes");
  static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two within a warp");
  static_assert(kThreads % 32 == 0, "whole warps");

  static bool can_implement(const cvt_norm_args& p);
  static size_t workspace_size(const cvt_norm_args&) { return 0; }
  static int launch(const cvt_norm_args& p, void*, cudaStream_t stream);
};

// This thread's sum of (x - mean)^2 over its vectors of a row (the variance's two-pass form).
template <class K>
__device__ __forceinline__ float centred_squares(const cutlass::Array<float, K::kVec> (&xf)[K::kVecs], float mean) {
  float q = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < K::kVecs; ++v) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < K::kVec; ++e) {
      const float d = xf[v][e] - mean;
      q = fmaf(d, d, q);
    }
  }
  return q;
}

// Thread (row, lane) holds vectors lane, lane + kLanes, ... of its row: consecutive lanes read
// consecutive 16 bytes. blockIdx.y is the image.
template <class K>
__global__ void __launch_bounds__(K::kThreads) layernorm_kernel(cvt_norm_args a, int out_rows) {
  pdl_enter();
  using Element = typename K::Element;
  using In = typename K::ElementIn;
  using Out = typename K::ElementOut;
  constexpr int kC = K::kC, kVec = K::kVec, kLanes = K::kLanes, kVecs = K::kVecs;
  using VecF = cutlass::Array<float, kVec>;
  const int lane = int(threadIdx.x) % kLanes;
  const int row = int(blockIdx.x) * K::kRowsPerBlock + int(threadIdx.x) / kLanes;  // output row
  const int img = int(blockIdx.y);
  const int pre = int(a.prefix_rows);
  const bool valid = row < out_rows;
  const bool norm = valid && row >= pre;
  cutlass::NumericArrayConverter<float, In, kVec> in_to_float;
  cutlass::NumericArrayConverter<float, Element, kVec> to_float;
  cutlass::NumericArrayConverter<Out, float, kVec> to_out;

  VecF xf[kVecs];
  const In* xrow = static_cast<const In*>(a.x) + int64_t(img) * a.x_image_stride +
                   int64_t(norm ? row - pre : 0) * a.x_row_stride;
  float s = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    if (norm) {
      xf[v] = in_to_float(VecIo<In, kVec>::load(xrow, v * kLanes + lane));
    } else {
      xf[v].fill(0.f);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) s += xf[v][e];
  }
  const float mean = lanes_sum<kLanes>(s) * (1.f / kC);
  const float rstd = rsqrtf(lanes_sum<kLanes>(centred_squares<K>(xf, mean)) * (1.f / kC) + a.eps);
  if (!valid) return;
  using OutIo = VecIo<Out, kVec>;
  Out* yrow = static_cast<Out*>(a.y) + int64_t(img) * a.y_image_stride + int64_t(row) * a.y_row_stride;
  if (!norm) {  // a prefix row: copied
    const Out* src = static_cast<const Out*>(a.prefix) + int64_t(row) * kC;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) OutIo::store(yrow, v * kLanes + lane, OutIo::load(src, v * kLanes + lane));
    return;
  }
  using WIo = VecIo<Element, kVec>;
  const Element* wp = static_cast<const Element*>(a.weight);
  const Element* bp = static_cast<const Element*>(a.bias);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    const VecF wf = to_float(WIo::load(wp, v * kLanes + lane)), bf = to_float(WIo::load(bp, v * kLanes + lane));
    VecF o;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) o[e] = fmaf((xf[v][e] - mean) * rstd, wf[e], bf[e]);
    OutIo::store(yrow, v * kLanes + lane, to_out(o));
  }
  if (a.stats && lane == 0)
    static_cast<float2*>(a.stats)[int64_t(img) * a.rows + (row - pre)] = make_float2(mean, rstd);
}

template <class E, int C, int Lanes, int Threads, class I, class O>
bool LayerNormFwd<E, C, Lanes, Threads, I, O>::can_implement(const cvt_norm_args& p) {
  if (p.images <= 0 || p.rows < 0 || p.c != kC || p.prefix_rows < 0) return false;
  if (p.images > 65535 || p.prefix_rows + p.rows > INT32_MAX - kRowsPerBlock) return false;
  if ((p.prefix_rows > 0) != (p.prefix != nullptr)) return false;
  if ((!p.x && p.rows > 0) || !p.y || !p.weight || !p.bias) return false;
  // 8-channel vectors of 16-byte accesses: row and image strides in multiples of 8 elements,
  // pointers 16-byte aligned.
  if (p.x_row_stride < kC || p.y_row_stride < kC || p.x_row_stride % kVec || p.y_row_stride % kVec) return false;
  if (p.x_image_stride % kVec || p.y_image_stride % kVec) return false;
  if (p.images > 1 && (p.x_image_stride < p.rows * p.x_row_stride ||
                       p.y_image_stride < (p.prefix_rows + p.rows) * p.y_row_stride)) return false;
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y) | reinterpret_cast<uintptr_t>(p.weight) |
       reinterpret_cast<uintptr_t>(p.bias) | reinterpret_cast<uintptr_t>(p.prefix)) % 16) return false;
  if (reinterpret_cast<uintptr_t>(p.stats) % 8) return false;
  return true;
}

template <class E, int C, int Lanes, int Threads, class I, class O>
int LayerNormFwd<E, C, Lanes, Threads, I, O>::launch(const cvt_norm_args& p, void*, cudaStream_t stream) {
  const int out_rows = int(p.prefix_rows + p.rows);
  if (out_rows == 0) return CVT_OK;
  dim3 grid((out_rows + kRowsPerBlock - 1) / kRowsPerBlock, unsigned(p.images));
  launch_kernel(layernorm_kernel<LayerNormFwd>, grid, kThreads, 0, stream, p, out_rows);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
