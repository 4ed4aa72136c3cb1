// The weight gradients' pass over dY's rows before their GEMM (wgrad_sm80.cuh, wgrad_sm90.cuh;
// operators/linear/abi.h: cvt_wgrad_args): db's per-chunk partial rows into `part` (none where
// null), and where asked dY's rows scaled by row_scale and / or rounded from fp32 into dy_scaled,
// the copy the GEMM then reads (common/reduce.cuh: rowsum_partials).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "common/reduce.cuh"
#include "linear/abi.h"

namespace cvt_kernel {

// Whether the row pass can serve p's dY options with Element dW: a scaled or rounded copy needs
// somewhere 16-byte aligned to go, and fp32 rows a 16-bit Element to be rounded to.
template <class Element>
inline bool wgrad_rows_ok(const cvt_wgrad_args& p) {
  if (p.dy_fp32 && sizeof(Element) != 2) return false;
  if (!(p.row_scale || p.dy_fp32)) return true;
  return p.dy_scaled != nullptr && reinterpret_cast<uintptr_t>(p.dy_scaled) % 16 == 0;
}

// The row pass (see above), clearing `zero` (zero_words words) on the way where given; returns
// the colsum segment that finishes db.
template <class Element>
inline ColsumSegment<Element> wgrad_rows(const cvt_wgrad_args& p, int sms, float* part, cudaStream_t stream,
                                         uint32_t* zero = nullptr, int64_t zero_words = 0) {
  const RowScaleOut copy{p.row_scale, p.row_scale || p.dy_fp32 ? p.dy_scaled : nullptr};
  Element* db = static_cast<Element*>(p.db);
  if (p.dy_fp32)
    return rowsum_partials_of<Element, float>(static_cast<const float*>(p.dy), p.m, p.n, p.ldy, sms, part, db,
                                              stream, zero, zero_words, copy);
  return rowsum_partials_of<Element, Element>(static_cast<const Element*>(p.dy), p.m, p.n, p.ldy, sms, part, db,
                                              stream, zero, zero_words, copy);
}

}  // namespace cvt_kernel
