// Deterministic reductions the backward kernels share: fp32 partial sums (per block / split /
// M-tile) summed per column in a fixed order and rounded to the output dtype (colsum; colsum2 sums
// two such matrices in one launch; colsum2_or_defer appends them to a list that colsum_flush sums
// in one launch, with the same bits), and one
// pass over dY (M, N) that sums its rows (rowsum: the bias gradient of the kernels whose mainloop
// cannot reduce an operand, the SM90 Linear wgrad and the conv wgrad).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/abi.h"
#include "cutlass/array.h"
#include "cutlass/numeric_types.h"

namespace cvt_kernel {

// Column sums of up to two fp32 matrices in one launch (a kernel's weight and bias gradients):
// segment i is out_i[c] = sum over r < rows_i of in_i[r * ld_i + c], c < cols_i; its blocks follow
// the blocks of the segment before it.
template <class Out>
struct ColsumSegment {
  const float* in = nullptr;
  int64_t rows = 0, ld = 0, cols = 0;
  Out* out = nullptr;
};
template <class Out>
struct ColsumJob {
  ColsumSegment<Out> seg[2];
  unsigned first_blocks = 0;  // blocks of segment 0
};

// The segment of this block and the block's index within it.
template <class Out>
__device__ __forceinline__ const ColsumSegment<Out>& colsum_segment(const ColsumJob<Out>& job, unsigned& block) {
  block = blockIdx.x;
  if (block < job.first_blocks) return job.seg[0];
  block -= job.first_blocks;
  return job.seg[1];
}

// The two summation orders every column sum here uses (the grouped launch below too: the same
// bits). Column c of a (32, 32) block, 32 row lanes (threadIdx.y) each summing rows lane,
// lane + 32, ... then the lanes' sums added in lane order; valid where threadIdx.y == 0. Every
// thread of the block must call it (it synchronizes).
__device__ __forceinline__ float column_sum_lanes(const float* in, int64_t rows, int64_t ld, int64_t cols, int64_t c,
                                                  float (&part)[32][33]) {
  float acc = 0.f;
  if (c < cols) {
    #pragma unroll 4
    for (int64_t r = threadIdx.y; r < rows; r += 32) acc += in[r * ld + c];
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  float sum = 0.f;
  if (threadIdx.y == 0) {
    #pragma unroll
    for (int i = 0; i < 32; ++i) sum += part[i][threadIdx.x];
  }
  return sum;
}

// Few rows (a handful of split partials): one thread per column, rows summed in order. The loads
// go out 8 rows at a time before their adds (in the same order): a thread's rows are otherwise one
// memory latency each (a stage-2 wgrad's 16 slabs, H100, 2026-12-06: ~25 us a flush).
__device__ __forceinline__ float column_sum_in_order(const float* in, int64_t rows, int64_t ld, int64_t c) {
  constexpr int kBatch = 8;
  float sum = 0.f;
  int64_t r = 0;
  for (; r + kBatch <= rows; r += kBatch) {
    float v[kBatch];
    #pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = in[(r + i) * ld + c];
    #pragma unroll
    for (int i = 0; i < kBatch; ++i) sum += v[i];
  }
  for (; r < rows; ++r) sum += in[r * ld + c];
  return sum;
}

// 32 columns per block: column_sum_lanes.
template <class Out>
__global__ void __launch_bounds__(1024) colsum_kernel(const ColsumJob<Out> job) {
  __shared__ float part[32][33];
  unsigned block;
  const ColsumSegment<Out>& s = colsum_segment(job, block);
  const int64_t c = int64_t(block) * 32 + threadIdx.x;
  const float sum = column_sum_lanes(s.in, s.rows, s.ld, s.cols, c, part);
  if (threadIdx.y == 0 && c < s.cols) s.out[c] = Out(sum);
}

// One thread per column: column_sum_in_order.
template <class Out>
__global__ void colsum_short_kernel(const ColsumJob<Out> job) {
  unsigned block;
  const ColsumSegment<Out>& s = colsum_segment(job, block);
  const int64_t c = int64_t(block) * blockDim.x + threadIdx.x;
  if (c < s.cols) s.out[c] = Out(column_sum_in_order(s.in, s.rows, s.ld, c));
}

// Both segments in one launch where they take the same kernel (few rows: one thread per column;
// else 32 row lanes), two launches where not, so a segment's sums run in the order they would
// alone. A segment without columns is skipped; one without rows writes zeros.
template <class Out>
inline void colsum2(ColsumSegment<Out> a, ColsumSegment<Out> b, cudaStream_t stream) {
  if (a.cols <= 0) a = {};
  if (b.cols <= 0) b = {};
  if (!a.cols) std::swap(a, b);
  if (!a.cols) return;
  const bool short_rows = a.rows < 64;
  if (b.cols && (b.rows < 64) != short_rows) {
    colsum2<Out>(a, {}, stream);
    colsum2<Out>(b, {}, stream);
    return;
  }
  const int64_t per_block = short_rows ? 256 : 32;
  ColsumJob<Out> job{{a, b}, unsigned((a.cols + per_block - 1) / per_block)};
  const unsigned blocks = job.first_blocks + unsigned((b.cols + per_block - 1) / per_block);
  if (short_rows)
    colsum_short_kernel<Out><<<blocks, 256, 0, stream>>>(job);
  else
    colsum_kernel<Out><<<blocks, dim3(32, 32), 0, stream>>>(job);
}

template <class Out>
inline void colsum(const float* in, int64_t rows, int64_t ld, int64_t cols, Out* out, cudaStream_t stream) {
  colsum2<Out>({in, rows, ld, cols, out}, {}, stream);
}

// ------------------------------------------------------------------------------------ deferred
// Column sums deferred to a cvt_colsum_list (common/abi.h) and summed by one launch for the list:
// a segment of few rows (< 64) one thread per column as colsum_short_kernel, else 32 columns per
// block with 32 row lanes as colsum_kernel: each segment's bits are those of its own colsum2.
template <class Out>
constexpr int out_type_of() {
  if constexpr (std::is_same_v<Out, float>) return CVT_OUT_F32;
  else if constexpr (std::is_same_v<Out, cutlass::half_t>) return CVT_OUT_F16;
  else {
    static_assert(std::is_same_v<Out, cutlass::bfloat16_t>, "column sums go to fp32, fp16 or bf16");
    return CVT_OUT_BF16;
  }
}

struct ColsumMany {
  cvt_colsum_seg seg[CVT_COLSUM_MAX];
  unsigned first_block[CVT_COLSUM_MAX + 1];  // segment i's blocks: [first_block[i], first_block[i + 1])
  int count;
};
constexpr int kManyShortCols = 1024;  // columns per block of a few-row segment (one per thread)

__device__ __forceinline__ void store_as(const cvt_colsum_seg& s, int64_t c, float v) {
  if (s.out_type == CVT_OUT_F32) static_cast<float*>(s.out)[c] = v;
  else if (s.out_type == CVT_OUT_F16) static_cast<cutlass::half_t*>(s.out)[c] = cutlass::half_t(v);
  else static_cast<cutlass::bfloat16_t*>(s.out)[c] = cutlass::bfloat16_t(v);
}

__global__ void __launch_bounds__(1024) colsum_many_kernel(const ColsumMany job) {
  __shared__ float part[32][33];
  int i = 0;
  while (i + 1 < job.count && blockIdx.x >= job.first_block[i + 1]) ++i;
  const cvt_colsum_seg& s = job.seg[i];
  const unsigned block = blockIdx.x - job.first_block[i];
  if (s.rows < 64) {  // colsum_short_kernel's order
    const int64_t c = int64_t(block) * kManyShortCols + threadIdx.y * 32 + threadIdx.x;
    if (c < s.cols) store_as(s, c, column_sum_in_order(s.in, s.rows, s.ld, c));
    return;
  }
  const int64_t c = int64_t(block) * 32 + threadIdx.x;  // colsum_kernel's order
  const float sum = column_sum_lanes(s.in, s.rows, s.ld, s.cols, c, part);
  if (threadIdx.y == 0 && c < s.cols) store_as(s, c, sum);
}

// Every segment of `list` summed by one launch; the list emptied. Returns a cvt_status.
inline int colsum_flush(cvt_colsum_list* list, cudaStream_t stream) {
  if (!list || list->count <= 0) return CVT_OK;
  ColsumMany job{};
  job.count = list->count;
  unsigned blocks = 0;
  for (int i = 0; i < list->count; ++i) {
    const cvt_colsum_seg& s = list->seg[i];
    job.seg[i] = s;
    job.first_block[i] = blocks;
    const int64_t per = s.rows < 64 ? kManyShortCols : 32;
    blocks += unsigned((s.cols + per - 1) / per);
  }
  job.first_block[list->count] = blocks;
  list->count = 0;
  if (!blocks) return CVT_OK;
  colsum_many_kernel<<<blocks, dim3(32, 32), 0, stream>>>(job);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

// colsum2, or its segments appended to `defer` when given (a full list flushed first). A segment
// without columns is skipped; one without rows writes zeros (as colsum2).
template <class Out>
inline void colsum2_or_defer(ColsumSegment<Out> a, ColsumSegment<Out> b, cvt_colsum_list* defer,
                             cudaStream_t stream) {
  if (!defer) return colsum2<Out>(a, b, stream);
  for (const ColsumSegment<Out>& s : {a, b}) {
    if (s.cols <= 0) continue;
    if (defer->count == CVT_COLSUM_MAX) colsum_flush(defer, stream);
    defer->seg[defer->count++] = {s.in, s.rows, s.ld, s.cols, s.out, out_type_of<Out>()};
  }
}

// Per chunk, each thread sums 8 adjacent columns (16-byte loads of T; N % 8 == 0, 16-byte rows) over
// the chunk's rows lane, lane + lanes, ...; the lanes' sums are added in lane order into an fp32
// partial row per chunk (none where part is null). `zero` (zero_words 32-bit words, or null) is
// cleared by the grid on the way: a kernel launched after this one needs it zeroed (the SM90 wgrad's
// stream-K barrier flags). With `rs` (fp32, (M,)), each row is first scaled by rs[row] (fp32
// product, rounded to T: what PyTorch's mul of T rows by fp32 scales gives). Where `scaled` is given
// ((M, N) contiguous T), the rows, scaled or not, are written there and summed as rounded. dY may
// come wider than T (In = float: an fp32 residual stream's gradient, read as two 16-byte loads): it
// is rounded to T once (after the scale), so `scaled` must be given then.
constexpr int kSumThreads = 256;
template <class In, class T>
__device__ __forceinline__ cutlass::Array<T, 8> scaled_row8(const In* __restrict__ dy, int64_t r, int64_t ldy,
                                                            int64_t col, int64_t n, const float* __restrict__ rs,
                                                            T* __restrict__ scaled) {
  cutlass::Array<T, 8> e;
  if constexpr (std::is_same_v<In, T>) {
    // one 16-byte load into registers (a T* into a local uint4 put it on the stack for half_t)
    e = *reinterpret_cast<const cutlass::Array<T, 8>*>(dy + r * ldy + col);
    if (rs) {
      const float s = rs[r];
      #pragma unroll
      for (int i = 0; i < 8; ++i) e[i] = T(float(e[i]) * s);
    }
  } else {  // fp32 rows: two 16-byte loads, each element rounded to T once (after the scale)
    static_assert(sizeof(In) == 4, "wider rows are fp32");
    using Load = cutlass::AlignedArray<In, 4>;
    const float s = rs ? rs[r] : 1.f;
    #pragma unroll
    for (int c = 0; c < 2; ++c) {
      const Load in = reinterpret_cast<const Load*>(dy + r * ldy + col)[c];
      #pragma unroll
      for (int i = 0; i < 4; ++i) e[c * 4 + i] = T(float(in[i]) * s);
    }
  }
  if (scaled) *reinterpret_cast<cutlass::Array<T, 8>*>(scaled + r * n + col) = e;
  return e;
}

template <class In, class T>
__global__ void __launch_bounds__(kSumThreads) rowsum_partials(const In* __restrict__ dy, int64_t m, int64_t n,
                                                               int64_t ldy, int64_t chunk_rows, int groups,
                                                               float* __restrict__ part, uint32_t* __restrict__ zero,
                                                               int64_t zero_words, const float* __restrict__ rs,
                                                               T* __restrict__ scaled) {
  __shared__ float sums[kSumThreads][9];
  if (zero) {
    const int64_t first = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * kSumThreads + threadIdx.x;
    for (int64_t i = first; i < zero_words; i += int64_t(gridDim.x) * gridDim.y * kSumThreads) zero[i] = 0u;
  }
  const int lanes = kSumThreads / groups, g = int(threadIdx.x) % groups, lane = int(threadIdx.x) / groups;
  const int64_t col = (int64_t(blockIdx.x) * groups + g) * 8;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows, r1 = r0 + chunk_rows < m ? r0 + chunk_rows : m;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (lane < lanes && col < n) {
    #pragma unroll 4
    for (int64_t r = r0 + lane; r < r1; r += lanes) {
      const cutlass::Array<T, 8> e = scaled_row8<In, T>(dy, r, ldy, col, n, rs, scaled);
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += float(e[i]);
    }
  }
  if (!part) return;  // the scaling pass alone (uniform over the grid: no barrier is left waiting)
  #pragma unroll
  for (int i = 0; i < 8; ++i) sums[threadIdx.x][i] = acc[i];
  __syncthreads();
  if (lane != 0 || col >= n) return;
  for (int l = 1; l < lanes; ++l) {
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += sums[l * groups + g][i];
  }
  #pragma unroll
  for (int i = 0; i < 8; ++i) part[int64_t(blockIdx.y) * n + col + i] = acc[i];
}

struct RowSumPlan {
  int groups, col_blocks;
  int64_t chunks, chunk_rows;
};
// ~4 blocks per SM, at least 16 rows per lane.
inline RowSumPlan rowsum_plan(int64_t m, int64_t n, int sms) {
  RowSumPlan r;
  const int64_t all_groups = n / 8;
  r.groups = int(all_groups < kSumThreads ? all_groups : kSumThreads);
  r.col_blocks = int((all_groups + r.groups - 1) / r.groups);
  const int64_t lanes = kSumThreads / r.groups;
  const int64_t want = (4 * int64_t(sms) + r.col_blocks - 1) / r.col_blocks;
  const int64_t most = (m + 16 * lanes - 1) / (16 * lanes);
  r.chunks = want < most ? want : most;
  if (r.chunks < 1) r.chunks = 1;
  r.chunk_rows = (m + r.chunks - 1) / r.chunks;
  r.chunks = (m + r.chunk_rows - 1) / r.chunk_rows;
  return r;
}

// Bytes of fp32 partials the row-sum partials need.
inline size_t rowsum_workspace(int64_t m, int64_t n, int sms) { return size_t(rowsum_plan(m, n, sms).chunks * n) * sizeof(float); }

// The per-chunk partial rows of dy (M, N) into `part` (rowsum_workspace() bytes, or null: no
// sums), clearing `zero` (zero_words words) on the way when given, dy's rows (scaled by `rs` where
// given) written to `scaled` as T where given; returns the colsum segment that finishes the sum.
// dy of In = float with T 16-bit: the rows rounded to T (see rowsum_partials).
struct RowScaleOut {
  const float* rs = nullptr;  // (M,) fp32, or null
  void* scaled = nullptr;     // (M, N) contiguous, T
};
template <class T, class In = T>
inline ColsumSegment<T> rowsum_partials_of(const In* dy, int64_t m, int64_t n, int64_t ldy, int sms, float* part,
                                           T* out, cudaStream_t stream, uint32_t* zero = nullptr,
                                           int64_t zero_words = 0, RowScaleOut scale = {}) {
  const RowSumPlan r = rowsum_plan(m, n, sms);
  rowsum_partials<In, T><<<dim3(unsigned(r.col_blocks), unsigned(r.chunks)), kSumThreads, 0, stream>>>(
      dy, m, n, ldy, r.chunk_rows, r.groups, part, zero_words > 0 ? zero : nullptr, zero_words, scale.rs,
      static_cast<T*>(scale.scaled));
  return {part, r.chunks, n, n, out};
}

}  // namespace cvt_kernel
