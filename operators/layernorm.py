"""LayerNorm kernel specs: CvT's LayerNorms over the channels of its tokens.

CvT runs a LayerNorm after every token embedding and two per block (before attention, before
the MLP): 29 of them in CvT-13, on (B, L, C) tokens with C = 64 / 192 / 384 (CvT-W24: 192 / 768
/ 1024). PyTorch's kernel spends one thread block per row, which for 64 channels is mostly idle
(21% of HF's CvT-13 forward at batch 256 on an H200, ``cvt-cutlass bench --op model
--breakdown``). :class:`LayerNormSpec` is our own kernel on CUTLASS's vector types: a group of
``lanes`` threads (a power of two, <= 32) owns one row, each thread holds C / (8 * lanes) 16-byte
vectors in registers, so a row is read once; mean and variance are two exact passes over the
registers (fp32, group shuffles), the output is written once. The channel count is a template
constant (one kernel per C), rows per block = threads / lanes.

The output can start with ``prefix_rows`` rows copied from a (P, C) tensor for every image: CvT's
cls token in front of stage 3's embedding tokens, written by the LayerNorm instead of a
``torch.cat``. Optionally the kernel stores (mean, rstd) per row for a backward pass.

Names follow operators/spec.py: ``cvt_layernorm_fwd_<arch>_<dtype>_blc_c<C>_l<lanes>_b<threads>``.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import ClassVar

from .exports import COLSUM_HELPER, DEVICE_HELPERS, arch_ok, c_exports
from .spec import CUTLASS_ELEMENT, KernelSpec, NameHead, SpecError

LN_MAX_VECS = 16  # 16-byte vectors per thread: C <= 16 * 8 * 32 = 4096
LN_BWD_MAX_VECS = 4  # the backward holds x, dy and two partial sums per channel: C <= 1024


@dataclass(frozen=True)
class LayerNormSpec(KernelSpec):
    """One LayerNorm instantiation: channels fixed at compile time, ``lanes`` threads per row."""

    arch: int
    dtype: str
    channels: int
    lanes: int
    threads: int = 256
    pass_: str = "fwd"
    vec: int = 8  # elements per vector load (8: 16 bytes; the backward may take 4: fewer registers)

    op: ClassVar[str] = "layernorm"
    family: ClassVar[str] = "layernorm"
    PASSES: ClassVar[tuple[str, ...]] = ("fwd", "bwd")

    @property
    def abi_headers(self) -> tuple[str, ...]:  # type: ignore[override]
        if self.pass_ == "bwd":
            return ("cvt_kernel_abi.h", "cvt_norm_bwd_abi.h")
        return ("cvt_kernel_abi.h", "cvt_norm_abi.h")

    layout: ClassVar[str] = "blc"

    def variant(self) -> str:
        return f"c{self.channels}_l{self.lanes}_b{self.threads}" + ("" if self.vec == 8 else f"_v{self.vec}")

    @classmethod
    def from_variant(cls, head: NameHead) -> LayerNormSpec | None:
        m = _LN_VARIANT.fullmatch(head.variant)
        if not m:
            return None
        return cls(head.arch, head.dtype, int(m["c"]), int(m["l"]), int(m["b"]), head.pass_, int(m["v"] or 8))

    @property
    def vecs(self) -> int:
        return self.channels // (self.vec * self.lanes)

    def validate(self) -> None:
        self.check_common()
        if self.lanes not in (1, 2, 4, 8, 16, 32):
            raise SpecError(f"lanes (threads per row) must be a power of two <= 32, got {self.lanes}")
        if self.threads not in (64, 128, 256, 512, 1024):
            raise SpecError(f"threads per block must be 64 ... 1024 (a power of two), got {self.threads}")
        c, v = self.channels, self.vec
        if v not in (4, 8) or (v == 4 and self.pass_ != "bwd"):
            raise SpecError(f"vector width must be 8 elements (4 in the backward), got {v}")
        if c <= 0 or c % 8 or c % (v * self.lanes):
            raise SpecError(f"channels {c} must be a positive multiple of 8 and of {v} * lanes = {v * self.lanes} "
                            f"({2 * v}-byte vectors spread evenly over the row's threads)")
        if self.pass_ == "bwd" and self.vecs > LN_BWD_MAX_VECS:
            raise SpecError(f"the backward holds at most {LN_BWD_MAX_VECS} vectors per thread (C <= "
                            f"{LN_BWD_MAX_VECS * v * self.lanes} with {self.lanes} lanes), got {self.vecs}")
        if self.vecs > LN_MAX_VECS:
            raise SpecError(f"channels {c} with {self.lanes} lanes is {self.vecs} vectors per thread "
                            f"(at most {LN_MAX_VECS}: more lanes, or C <= {LN_MAX_VECS * 8 * 32})")

    def template_values(self) -> dict[str, str]:
        return {"name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "channels": str(self.channels),
                "lanes": str(self.lanes), "threads": str(self.threads), "vec": str(self.vec), "min_cc": str(self.min_cc),
                "arch_ok": arch_ok(self.min_cc), "dtype": self.dtype}

    def source(self) -> str:
        template = LAYERNORM_BWD_TEMPLATE if self.pass_ == "bwd" else LAYERNORM_TEMPLATE
        return string.Template(template).substitute(self.template_values())


_LN_VARIANT = re.compile(r"c(?P<c>\d+)_l(?P<l>\d+)_b(?P<b>\d+)(?:_v(?P<v>4))?")


def channels_supported(c: int) -> bool:
    """Whether some LayerNorm instantiation takes ``c`` channels."""
    return c > 0 and c % 8 == 0 and c // 8 <= 32 * LN_MAX_VECS


def _lane_options(c: int) -> list[int]:
    return [ln for ln in (1, 2, 4, 8, 16, 32) if c % (8 * ln) == 0 and c // (8 * ln) <= LN_MAX_VECS]


def _bwd_options(c: int) -> list[tuple[int, int, int, int]]:
    """(channels per thread (at least 8), -vector, lanes, vector) of every backward split of the row."""
    return [(max(c // ln, 8), -v, ln, v) for ln in (1, 2, 4, 8, 16, 32) for v in (8, 4)
            if c % 8 == 0 and c % (v * ln) == 0 and c // (v * ln) <= LN_BWD_MAX_VECS]


def bwd_channels_supported(c: int) -> bool:
    """Whether some LayerNorm backward instantiation takes ``c`` channels (a multiple of 8 that
    splits into at most 4 vectors over at most 32 threads)."""
    return c > 0 and bool(_bwd_options(c))


def layernorm_heuristic(dtype: str, channels: int, arch: int, pass_: str = "fwd") -> LayerNormSpec:
    """Forward: the most lanes that divide the row evenly in 16-byte vectors (a 64-channel row:
    8 threads of one vector each; 384: 16 threads of 3; 1024: 32 threads of 4). Backward (it
    holds x, dy and two partial sums per channel in registers): the fewest channels per thread,
    at least 8, 8-byte vectors where 16-byte ones would not split the row (192: 16 threads of 3
    x 4; 384: 32 of 3 x 4). 256 threads per block."""
    if not channels_supported(channels):
        raise SpecError(f"no LayerNorm kernel for {channels} channels (a multiple of 8, at most "
                        f"{32 * LN_MAX_VECS * 8})")
    if pass_ != "bwd":
        return LayerNormSpec(arch, dtype, channels, max(_lane_options(channels)), 256, pass_)
    options = _bwd_options(channels)
    if not options:
        raise SpecError(f"no LayerNorm backward kernel for {channels} channels (at most {LN_BWD_MAX_VECS * 8 * 32})")
    _, _, lanes, vec = min(options)
    return LayerNormSpec(arch, dtype, channels, lanes, 256, pass_, vec)


def layernorm_candidates(dtype: str, channels: int, arch: int) -> list[LayerNormSpec]:
    """The sweep's space for one channel count: every even split of the row, 128-512 threads."""
    return [LayerNormSpec(arch, dtype, channels, ln, thr) for ln in _lane_options(channels)
            if ln >= 4 for thr in (128, 256, 512)]


# ------------------------------------------------------------------------------------------
# C++ template
# ------------------------------------------------------------------------------------------
LAYERNORM_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// LayerNorm over C = ${channels} channels of tokens, optional prefix rows (cls token) in front of
// each image's output; ${dtype} in/out, fp32 statistics
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "cvt_norm_abi.h"

namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_LAYERNORM;
using Element = ${element};
constexpr int kC = ${channels};
constexpr int kVec = 8;                             // channels per 16-byte access
constexpr int kLanes = ${lanes};                    // threads per row
constexpr int kVecs = kC / (kVec * kLanes);         // 16-byte vectors per thread
constexpr int kThreads = ${threads};
constexpr int kRowsPerBlock = kThreads / kLanes;
static_assert(kC % (kVec * kLanes) == 0, "the row must split evenly over the lanes");
static_assert(kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two within a warp");
static_assert(kThreads % 32 == 0, "whole warps");
using Vec = cutlass::Array<Element, kVec>;
using VecF = cutlass::Array<float, kVec>;

// Sum over the kLanes threads of a row (every lane of the warp takes part: no thread returns
// before the last shuffle).
__device__ __forceinline__ float row_sum(float v) {
  CUTLASS_PRAGMA_UNROLL
  for (int o = kLanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o, kLanes);
  return v;
}

// Thread (row, lane) holds vectors lane, lane + kLanes, ... of its row: consecutive lanes read
// consecutive 16 bytes. blockIdx.y is the image.
__global__ void __launch_bounds__(kThreads) layernorm_kernel(cvt_norm_args a, int out_rows) {
  const int lane = int(threadIdx.x) % kLanes;
  const int row = int(blockIdx.x) * kRowsPerBlock + int(threadIdx.x) / kLanes;  // output row
  const int img = int(blockIdx.y);
  const int pre = int(a.prefix_rows);
  const bool valid = row < out_rows;
  const bool norm = valid && row >= pre;
  cutlass::NumericArrayConverter<float, Element, kVec> to_float;
  cutlass::NumericArrayConverter<Element, float, kVec> to_out;

  VecF xf[kVecs];
  const uint4* xrow = reinterpret_cast<const uint4*>(static_cast<const Element*>(a.x) + int64_t(img) * a.x_image_stride +
                                                     int64_t(norm ? row - pre : 0) * a.x_row_stride);
  float s = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    if (norm) {
      const uint4 raw = __ldg(xrow + v * kLanes + lane);
      xf[v] = to_float(reinterpret_cast<Vec const&>(raw));
    } else {
      xf[v].fill(0.f);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) s += xf[v][e];
  }
  const float mean = row_sum(s) * (1.f / kC);
  float q = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) {
      const float d = xf[v][e] - mean;
      q = fmaf(d, d, q);
    }
  }
  const float rstd = rsqrtf(row_sum(q) * (1.f / kC) + a.eps);
  if (!valid) return;
  uint4* yrow = reinterpret_cast<uint4*>(static_cast<Element*>(a.y) + int64_t(img) * a.y_image_stride +
                                         int64_t(row) * a.y_row_stride);
  if (!norm) {  // a prefix row: copied
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const Element*>(a.prefix) + int64_t(row) * kC);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) yrow[v * kLanes + lane] = __ldg(src + v * kLanes + lane);
    return;
  }
  const uint4* wp = static_cast<const uint4*>(a.weight);
  const uint4* bp = static_cast<const uint4*>(a.bias);
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    const uint4 wr = __ldg(wp + v * kLanes + lane), br = __ldg(bp + v * kLanes + lane);
    const VecF wf = to_float(reinterpret_cast<Vec const&>(wr)), bf = to_float(reinterpret_cast<Vec const&>(br));
    VecF o;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) o[e] = fmaf((xf[v][e] - mean) * rstd, wf[e], bf[e]);
    const Vec ov = to_out(o);
    yrow[v * kLanes + lane] = reinterpret_cast<uint4 const&>(ov);
  }
  if (a.stats && lane == 0)
    static_cast<float2*>(a.stats)[int64_t(img) * a.rows + (row - pre)] = make_float2(mean, rstd);
}

bool can_implement(const cvt_norm_args& p) {
  if (p.images <= 0 || p.rows < 0 || p.c != kC || p.prefix_rows < 0) return false;
  if (p.images > 65535 || p.prefix_rows + p.rows > INT32_MAX - kRowsPerBlock) return false;
  if ((p.prefix_rows > 0) != (p.prefix != nullptr)) return false;
  if ((!p.x && p.rows > 0) || !p.y || !p.weight || !p.bias) return false;
  // 16-byte accesses: row and image strides in multiples of 8 elements, pointers 16-byte aligned.
  if (p.x_row_stride < kC || p.y_row_stride < kC || p.x_row_stride % kVec || p.y_row_stride % kVec) return false;
  if (p.x_image_stride % kVec || p.y_image_stride % kVec) return false;
  if (p.images > 1 && (p.x_image_stride < p.rows * p.x_row_stride ||
                       p.y_image_stride < (p.prefix_rows + p.rows) * p.y_row_stride)) return false;
  if ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y) | reinterpret_cast<uintptr_t>(p.weight) |
       reinterpret_cast<uintptr_t>(p.bias) | reinterpret_cast<uintptr_t>(p.prefix)) % 16) return false;
  if (reinterpret_cast<uintptr_t>(p.stats) % 8) return false;
  return true;
}

size_t workspace_size(const cvt_norm_args&) { return 0; }

int launch(const cvt_norm_args& p, void*, cudaStream_t stream) {
  const int out_rows = int(p.prefix_rows + p.rows);
  if (out_rows == 0) return CVT_OK;
  dim3 grid((out_rows + kRowsPerBlock - 1) / kRowsPerBlock, unsigned(p.images));
  layernorm_kernel<<<grid, kThreads, 0, stream>>>(p, out_rows);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("norm", "p")


LAYERNORM_BWD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// LayerNorm backward over C = ${channels} channels: dx in one pass (mean and rstd recomputed from
// the row in registers), dweight / dbias as per-block fp32 partials + one small sum; ${dtype}
#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>
#include "cutlass/array.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "cvt_norm_bwd_abi.h"
""" + DEVICE_HELPERS + COLSUM_HELPER + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_LAYERNORM_BWD;
using Element = ${element};
constexpr int kC = ${channels};
constexpr int kVec = ${vec};
constexpr int kLanes = ${lanes};
constexpr int kVecs = kC / (kVec * kLanes);
constexpr int kThreads = ${threads};
constexpr int kRowsPerBlock = kThreads / kLanes;
static_assert(kC % (kVec * kLanes) == 0 && kVecs <= 4, "the row must split evenly, at most 4 vectors per thread");
using Vec = cutlass::Array<Element, kVec>;
using Raw = std::conditional_t<kVec == 8, uint4, uint2>;  // one vector as loaded: 16 or 8 bytes
using VecF = cutlass::Array<float, kVec>;

__device__ __forceinline__ float row_sum(float v) {
  CUTLASS_PRAGMA_UNROLL
  for (int o = kLanes / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o, kLanes);
  return v;
}

__device__ __forceinline__ VecF load(const void* base, int64_t off, int idx, bool ok) {
  cutlass::NumericArrayConverter<float, Element, kVec> to_float;
  VecF f;
  if (!ok) {
    f.fill(0.f);
    return f;
  }
  const Raw raw = __ldg(reinterpret_cast<const Raw*>(static_cast<const Element*>(base) + off) + idx);
  return to_float(reinterpret_cast<Vec const&>(raw));
}

// Blocks stride over all rows together (every lane of a warp takes part in every shuffle); each
// thread keeps fp32 sums of dy * xhat and dy for its channels, merged per block in shared memory.
__global__ void __launch_bounds__(kThreads) ln_bwd_kernel(cvt_normbwd_args a, float* partial) {
  __shared__ float s_dw[kC], s_db[kC];
  for (int i = threadIdx.x; i < kC; i += kThreads) s_dw[i] = s_db[i] = 0.f;
  const int lane = int(threadIdx.x) % kLanes, rloc = int(threadIdx.x) / kLanes;
  const int64_t total = a.images * a.rows;
  VecF w[kVecs], acc_w[kVecs], acc_b[kVecs];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v) {
    w[v] = load(a.weight, 0, v * kLanes + lane, true);
    acc_w[v].fill(0.f);
    acc_b[v].fill(0.f);
  }
  cutlass::NumericArrayConverter<Element, float, kVec> to_out;
  for (int64_t base = int64_t(blockIdx.x) * kRowsPerBlock; base < total; base += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t r = base + rloc;
    const bool ok = r < total;
    const int64_t img = ok ? r / a.rows : 0, row = ok ? r % a.rows : 0;
    VecF x[kVecs], dy[kVecs];
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      x[v] = load(a.x, img * a.x_image_stride + row * a.x_row_stride, v * kLanes + lane, ok);
      dy[v] = load(a.dy, img * a.dy_image_stride + row * a.dy_row_stride, v * kLanes + lane, ok);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) s += x[v][e];
    }
    const float mean = row_sum(s) * (1.f / kC);
    float q = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) q = fmaf(x[v][e] - mean, x[v][e] - mean, q);
    const float rstd = rsqrtf(row_sum(q) * (1.f / kC) + a.eps);
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
    const float m1 = row_sum(s1) * (1.f / kC), m2 = row_sum(s2) * (1.f / kC);
    if (!ok) continue;
    Raw* out = reinterpret_cast<Raw*>(static_cast<Element*>(a.dx) + r * kC);
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      VecF o;
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) o[e] = rstd * (dy[v][e] * w[v][e] - m1 - x[v][e] * m2);
      const Vec ov = to_out(o);
      out[v * kLanes + lane] = reinterpret_cast<Raw const&>(ov);
    }
  }
  __syncthreads();
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVecs; ++v)
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) {
      const int c = (v * kLanes + lane) * kVec + e;
      atomicAdd(&s_dw[c], acc_w[v][e]);
      atomicAdd(&s_db[c], acc_b[v][e]);
    }
  __syncthreads();
  float* mine = partial + int64_t(blockIdx.x) * 2 * kC;
  for (int i = threadIdx.x; i < kC; i += kThreads) {
    mine[i] = s_dw[i];
    mine[kC + i] = s_db[i];
  }
}

// One wave of blocks (as many as stay resident), so the partials' sum is short.
int blocks_of(const cvt_normbwd_args& p) {
  const int64_t rows = p.images * p.rows;
  int64_t sms = p.sm_count > 0 ? p.sm_count : sm_count_of(p.device_id);
  if (sms <= 0) sms = 132;
  const int64_t want = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t most = sms * resident_blocks(reinterpret_cast<const void*>(&ln_bwd_kernel), kThreads, p.device_id);
  return int(want < most ? (want < 1 ? 1 : want) : most);
}

bool can_implement(const cvt_normbwd_args& p) {
  if (p.images <= 0 || p.rows <= 0 || p.c != kC || !p.x || !p.dy || !p.weight || !p.dx || !p.dweight || !p.dbias)
    return false;
  if (p.x_row_stride % kVec || p.dy_row_stride % kVec || p.x_image_stride % kVec || p.dy_image_stride % kVec)
    return false;
  if (p.x_row_stride < kC || p.dy_row_stride < kC) return false;
  const uintptr_t ptrs = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.dy) |
                         reinterpret_cast<uintptr_t>(p.weight) | reinterpret_cast<uintptr_t>(p.dx);
  return ptrs % 16 == 0;
}

size_t workspace_size(const cvt_normbwd_args& p) { return size_t(blocks_of(p)) * 2 * kC * sizeof(float); }

int launch(const cvt_normbwd_args& p, void* workspace, cudaStream_t stream) {
  const int blocks = blocks_of(p);
  float* partial = static_cast<float*>(workspace);
  ln_bwd_kernel<<<blocks, kThreads, 0, stream>>>(p, partial);
  colsum(partial, blocks, 2 * kC, kC, static_cast<Element*>(p.dweight), stream);
  colsum(partial + kC, blocks, 2 * kC, kC, static_cast<Element*>(p.dbias), stream);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("normbwd", "p")
