// What the short-key attention kernels (attention/short_fwd.cuh, attention/short_bwd.cuh) share:
// Lkv <= 64 and head dim <= 64, so one CTA holds every key and value of a (batch, head) in shared
// memory as 64 x 64 tiles (rows of 72 elements: ldmatrix reads them without bank conflicts); 4
// warps of 16 query rows each; mma.sync m16n8k16 with fp32 accumulation (SM80-class: sm_89 and
// sm_90), ldmatrix, cp.async loads that zero-fill rows past the length and columns past D (the
// instructions: common/mma_sync.cuh).
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "common/mma_sync.cuh"

namespace cvt_kernel {
namespace short_kv {

constexpr int kKeys = 64;            // keys held per CTA (Lkv <= kKeys)
constexpr int kDim = 64;             // head dim held (D <= kDim, D % 8 == 0)
constexpr int kQueries = 64;         // query rows per block: 4 warps of 16
constexpr int kThreads = 128;
constexpr int kRow = kDim + 8;       // shared-memory row, elements: 144 bytes, ldmatrix without bank conflicts
constexpr int kTile = 64 * kRow;     // one 64-row tile

// rows [0, 64) of a (rows, D) matrix with rows `stride` elements apart into a tile; rows >= valid_rows
// and columns >= d are zeros.
template <class E>
__device__ __forceinline__ void load_tile(E* tile, const E* src, int64_t stride, int valid_rows, int d) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 64 * (kDim / 8) / kThreads; ++i) {
    const int c = int(threadIdx.x) + i * kThreads, row = c / (kDim / 8), col = (c % (kDim / 8)) * 8;
    const bool ok = row < valid_rows && col < d;
    cp_async16(tile + row * kRow + col, ok ? src + row * stride + col : src, ok);
  }
}

// acc (16 x 64: 8 n-tiles of 8) += A (16 rows of a tile, row-major, k = 64 along the row) * B^T, B a
// tile of 64 rows (n) with k along the row (k^T, v^T in S = q k^T and dP = dout v^T).
template <class E>
__device__ __forceinline__ void gemm_rows_nt(float (&acc)[8][4], const E* a_rows, const E* b_tile, int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < kDim / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_rows + (lane % 16) * kRow + kk * 16 + (lane / 16) * 8);
    CUTLASS_PRAGMA_UNROLL
    for (int np = 0; np < kKeys / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, b_tile + (np * 16 + lane % 8 + (lane / 16) * 8) * kRow + kk * 16 + ((lane / 8) % 2) * 8);
      mma<E>(acc[2 * np], a, b[0], b[1]);
      mma<E>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// A 16 x 64 accumulator with keys along its columns (P or dS), rounded to E, as the A fragments of
// its four 16-key chunks: f[kk] = rows g / g + 8 at keys 16 kk + c, c + 1, then at 16 kk + 8 + c, c + 1.
template <class E>
__device__ __forceinline__ void to_frags(uint32_t (&f)[4][4], const float (&r)[8][4]) {
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    f[kk][0] = pack<E>(r[2 * kk][0], r[2 * kk][1]);
    f[kk][1] = pack<E>(r[2 * kk][2], r[2 * kk][3]);
    f[kk][2] = pack<E>(r[2 * kk + 1][0], r[2 * kk + 1][1]);
    f[kk][3] = pack<E>(r[2 * kk + 1][2], r[2 * kk + 1][3]);
  }
}

// out (16 x 64) += f (16 x 64 keys as A fragments) * b (a tile of keys x D): dq = dS k in the
// backward, o = P v in the forward.
template <class E>
__device__ __forceinline__ void gemm_frags_tile(float (&out)[8][4], const uint32_t (&f)[4][4], const E* b_tile,
                                                int lane) {
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    CUTLASS_PRAGMA_UNROLL
    for (int np = 0; np < kDim / 16; ++np) {
      uint32_t b[4];
      ldsm_x4_t(b, b_tile + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * kRow + np * 16 + (lane / 16) * 8);
      mma<E>(out[2 * np], f[kk], b[0], b[1]);
      mma<E>(out[2 * np + 1], f[kk], b[2], b[3]);
    }
  }
}

// Rows r0 + g and r0 + g + 8 of a 16 x 64 accumulator, times `scale`, to global rows `stride` apart
// (rows >= rows_valid and columns >= d are not written).
template <class E>
__device__ __forceinline__ void store_rows(E* dst, int64_t stride, const float (&acc)[8][4], float scale, int r0,
                                           int rows_valid, int d, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + g + 8 * half;
    if (r >= rows_valid) continue;
    CUTLASS_PRAGMA_UNROLL
    for (int nt = 0; nt < 8; ++nt) {
      if (nt * 8 + c >= d) continue;
      *reinterpret_cast<uint32_t*>(dst + r * stride + nt * 8 + c) =
          pack<E>(acc[nt][2 * half] * scale, acc[nt][2 * half + 1] * scale);
    }
  }
}

// The fragments' rows g and g + 8 into rows of a shared tile (keys along the row).
template <class E>
__device__ __forceinline__ void store_smem_frags(E* rows, const uint32_t (&f)[4][4], int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
  CUTLASS_PRAGMA_UNROLL
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    *reinterpret_cast<uint32_t*>(rows + g * kRow + kk * 16 + c) = f[kk][0];
    *reinterpret_cast<uint32_t*>(rows + (g + 8) * kRow + kk * 16 + c) = f[kk][1];
    *reinterpret_cast<uint32_t*>(rows + g * kRow + kk * 16 + 8 + c) = f[kk][2];
    *reinterpret_cast<uint32_t*>(rows + (g + 8) * kRow + kk * 16 + 8 + c) = f[kk][3];
  }
}

}  // namespace short_kv
}  // namespace cvt_kernel
