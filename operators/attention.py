"""Fused multi-head attention kernel specs (forward, with the logsumexp a backward needs).

Names follow operators/spec.py: ``cvt_attention_fwd_<arch>_<dtype>_blhd_<kernel>_<tile...>``.

:class:`AttnSpec` instantiates CUTLASS's example-41 kernel (``AttentionKernel`` from
``examples/41_fused_multi_head_attention/kernel_forward.h`` in the nvidia-cutlass wheel; ArchTag
Sm80: cp.async + mma.sync, runs on sm_89 and sm_90). It takes CvT's scale (``embed_dim ** -0.5``)
as a parameter, any Lq != Lkv, lengths that are not multiples of 8, and q/k/v in the layout the
projections write: (B, L, H, D) with unit stride along D, no permute copies. The output is
(B, Lq, H, D) packed, i.e. the (B, Lq, C) rows the out-projection reads; the logsumexp is
(B, H, Lq) float in rows padded to 32 (the kernel's layout).

Knobs: queries per block, keys per block, the largest head dim (``max_k``; when it is at most the
keys per block the output accumulates in registers).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .exports import DEVICE_HELPERS, TMA_DRIVER_SHIM, arch_ok, c_exports
from .spec import CUTLASS_ELEMENT, KernelSpec, NameHead, SpecError, triple, xs

EX41_DIR = "examples/41_fused_multi_head_attention"
EX88_SMEM_LIMIT = 227 * 1024 - 2048  # sm_90's per-CTA limit less the pipeline barriers and epilogue staging
LSE_ALIGN = 32  # example 41 pads each (batch, head) logsumexp row to a multiple of 32


@dataclass(frozen=True)
class AttnSpec(KernelSpec):
    """One example-41 (Sm80-class) forward attention instantiation."""

    dtype: str
    queries: int = 64  # queries per block
    keys: int = 64  # keys per block
    max_k: int = 64  # largest head dim this instantiation serves
    arch: int = 89
    kernel: str = "ex41"
    pass_: str = "fwd"

    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_attn_abi.h")
    # The example's directory (relative to the CUTLASS source tree) and our cuRAND stand-in.
    include_dirs: ClassVar[tuple[str, ...]] = (EX41_DIR, "csrc:shim")

    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        return f"{self.kernel}_q{self.queries}_k{self.keys}_d{self.max_k}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> AttnSpec | None:
        m = _ATTN41_VARIANT.fullmatch(head.variant)
        if head.arch != 89 or not m:
            return None
        return cls(head.dtype, int(m["q"]), int(m["k"]), int(m["d"]), 89, "ex41", head.pass_)

    def validate(self) -> None:
        if self.kernel != "ex41" or self.arch != 89:
            raise SpecError("AttnSpec is the example-41 (Sm80-class) kernel: kernel='ex41', arch=89")
        self.check_common()
        if self.queries not in (32, 64, 128) or self.keys not in (32, 64, 128):
            raise SpecError("queries and keys per block must be 32, 64 or 128")
        if self.max_k not in (64, 128, 256) or self.max_k % 8:
            raise SpecError("max_k (largest head dim) must be 64, 128 or 256")
        if self.queries * self.keys > 128 * 64:
            raise SpecError("queries x keys per block above 128 x 64 exceeds the kernel's shared-memory design")

    def serves(self, head_dim: int) -> bool:
        return head_dim <= self.max_k and head_dim % 8 == 0

    def template_values(self) -> dict[str, str]:
        return {"name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "queries": str(self.queries),
                "keys": str(self.keys), "max_k": str(self.max_k), "min_cc": str(self.min_cc),
                "arch_ok": arch_ok(self.min_cc), "dtype": self.dtype}

    def source(self) -> str:
        return string.Template(EX41_TEMPLATE).substitute(self.template_values())


EX88_DIR = "examples/88_hopper_fmha"
EX88_SCHEDULES = {
    "tma": "cutlass::gemm::KernelTma",
    "coop": "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
    "pingpong": "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
}


@dataclass(frozen=True)
class Attn88Spec(KernelSpec):
    """One example-88 (Hopper: TMA + wgmma) forward attention instantiation, sm_90a only.

    The example hard-codes the softmax scale to 1/sqrt(D) when it builds the kernel parameters; our
    launcher overwrites the two scale fields of those parameters afterwards, so CvT's
    ``embed_dim ** -0.5`` costs nothing (no pre-scaled copy of q, no change to the weights). The
    residual mask handles Lkv that is not a multiple of the KV tile. Lq may be any length: the
    example's own check asks Lq % 8 == 0, but with q/k/v/o rows of H*D elements (D % 8 == 0) every
    TMA stride is 16-byte aligned whatever Lq is; TMA zero-fills the rows past Lq on load and clips
    them on store, and the logsumexp store is predicated on Lq (``fmha_epilogue.hpp``), so our
    launcher checks the strides instead of the length.

    Knobs: the tile (queries, keys, head dim); the KV pipeline depth (``stages``, 0 = the example's
    4 or 5); the minimum CTAs per SM the non-warp-specialized kernel is compiled for (``blocks``,
    0 = the example's 2; more caps registers per thread). KV tiles are 64, 128 or 256: tiles fitted
    to CvT's lengths were measured on the H200 (run A4) and lost (64x112 on Lkv = 784: 0.504 ms vs
    0.456 for 64x128; 64x80 on 196: 0.145 vs 0.139 for 64x64), and 64x160 computed wrong results
    (relative error ~1), so only the power-of-two widths the example itself uses are offered."""

    dtype: str
    tile: tuple[int, int, int] = (64, 128, 64)  # (queries, keys, head dim) per CTA
    schedule: str = "tma"
    stages: int = 0
    blocks: int = 0
    pass_: str = "fwd"

    arch: ClassVar[int] = 90
    kernel: ClassVar[str] = "ex88"
    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention"
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_attn_abi.h")
    include_dirs: ClassVar[tuple[str, ...]] = (EX88_DIR,)

    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        opts = (f"_s{self.stages}" if self.stages else "") + (f"_b{self.blocks}" if self.blocks else "")
        return f"ex88_t{xs(self.tile)}_{self.schedule}{opts}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> Attn88Spec | None:
        m = _ATTN88_VARIANT.fullmatch(head.variant)
        if head.arch != 90 or not m:
            return None
        return cls(head.dtype, triple(m["t"]), m["s"], int(m["st"] or 0), int(m["bl"] or 0), head.pass_)

    def smem_bytes(self) -> int:
        """Estimated shared memory of the mainloop: the q tile(s) and the K/V stages."""
        tq, tk, td = self.tile
        ws = self.schedule != "tma"
        stages = self.stages or (5 if ws else 4)
        return 2 * (tq * td * (2 if ws else 1) + stages * tk * td)

    def validate(self) -> None:
        self.check_common()
        if self.schedule not in EX88_SCHEDULES:
            raise SpecError(f"example-88 schedule must be one of {sorted(EX88_SCHEDULES)}")
        tq, tk, td = self.tile
        if tq not in (64, 128) or tk not in (64, 128, 256) or td not in (32, 64, 128, 256):
            raise SpecError("example-88 tile: queries 64/128, keys 64/128/256, head dim 32-256")
        if self.schedule == "tma" and tq != 64:
            raise SpecError("the non-warp-specialized example-88 kernel takes 64 queries per CTA")
        if self.schedule != "tma" and tq != 128:
            raise SpecError("the warp-specialized example-88 kernels take 128 queries per CTA")
        if self.stages and not 2 <= self.stages <= 8:
            raise SpecError(f"example-88 KV stages must be 2-8, got {self.stages}")
        if self.blocks and (self.schedule != "tma" or not 1 <= self.blocks <= 4):
            raise SpecError("blocks per SM (1-4) is a knob of the non-warp-specialized (tma) kernel only")
        if self.smem_bytes() > EX88_SMEM_LIMIT:
            raise SpecError(f"{self.name}: ~{self.smem_bytes() // 1024} KiB of shared memory, over the "
                            f"{EX88_SMEM_LIMIT // 1024} KiB an sm_90 CTA can have; use fewer stages")

    def serves(self, head_dim: int, lq: int = 1) -> bool:
        return head_dim <= self.tile[2] and head_dim % 8 == 0

    def template_values(self) -> dict[str, str]:
        tq, tk, td = self.tile
        opts = ""
        if self.stages:
            opts += f", cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kStagesKV, Int<{self.stages}>>"
        if self.blocks:
            opts += f", cutlass::fmha::kernel::Option<cutlass::fmha::kernel::Tag::kBlocksPerSM, Int<{self.blocks}>>"
        return {"name": self.name, "element": CUTLASS_ELEMENT[self.dtype], "tq": str(tq), "tk": str(tk),
                "td": str(td), "schedule": EX88_SCHEDULES[self.schedule], "options": opts, "min_cc": "90",
                "arch_ok": arch_ok(90), "dtype": self.dtype}

    def source(self) -> str:
        return string.Template(EX88_TEMPLATE).substitute(self.template_values())


_ATTN88_VARIANT = re.compile(r"ex88_t(?P<t>\d+x\d+x\d+)_(?P<s>tma|coop|pingpong)(?:_s(?P<st>\d+))?(?:_b(?P<bl>\d+))?_a8")
_ATTN41_VARIANT = re.compile(r"ex41_q(?P<q>\d+)_k(?P<k>\d+)_d(?P<d>\d+)_a8")


_EX41_SPACE = ((64, 64), (32, 64), (64, 128), (32, 128), (128, 64))


_EX88_SPACE = (((64, 128, 64), "tma"), ((64, 64, 64), "tma"), ((64, 256, 64), "tma"),
               ((128, 64, 64), "coop"), ((128, 128, 64), "coop"), ((128, 64, 64), "pingpong"))


def attn_candidates(dtype: str, head_dim: int, arch: int = 89) -> list:
    """Example-41 instantiations on both paths; on the sm90 path also example-88's."""
    max_k = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    out = [AttnSpec(dtype, q, k, max_k) for q, k in _EX41_SPACE if q * k <= 128 * 64]
    if arch == 90 and head_dim <= 64:
        out += [Attn88Spec(dtype, t, s) for t, s in _EX88_SPACE]
    return out


def attn_heuristic(dtype: str, head_dim: int, lq: int, arch: int = 89):
    """Before a sweep: example 88's 64x128 TMA tile on the sm90 path where it applies (the best
    tile of the example's own runner on an H200 for CvT-13's stage 1), example 41 otherwise."""
    if arch == 90 and head_dim <= 64 and head_dim % 8 == 0:
        return Attn88Spec(dtype, (64, 128, 64), "tma")
    max_k = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    return AttnSpec(dtype, 64 if lq >= 64 else 32, 64, max_k)


EX88_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// fused multi-head attention forward (CUTLASS example 88, Hopper TMA + wgmma), ${dtype}, fp32 softmax and accumulation
""" + TMA_DRIVER_SHIM.replace("$", "$$") + r"""#include <cmath>
#include <cstdint>
#include <mutex>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/cluster_launch.hpp"
#include "collective/fmha_fusion.hpp"
#include "kernel/fmha_kernel_builder.hpp"
#include "cvt_attn_abi.h"
""" + DEVICE_HELPERS + r"""
namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_ATTENTION;
using Element = ${element};
using TileShape = Shape<_${tq}, _${tk}, _${td}>;
using StrideQKVO = cute::tuple<int, _1, cute::tuple<int, int>>;  // (L, D, (B, H))
using StrideLSE = cute::tuple<_1, cute::tuple<int, int>>;       // (L, (B, H))
using Kernel = typename cutlass::fmha::kernel::FmhaBuilder<
    Element, float, float, TileShape, StrideQKVO, StrideQKVO, StrideQKVO,
    cutlass::fmha::collective::ResidualFusion, ${schedule}${options}>::Kernel;

bool fits(const cvt_attn_args& a) {
  const int64_t lim = INT32_MAX;
  if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0) return false;
  if (a.lq > lim || a.lkv > lim || a.batch > 65535 || a.heads > 65535) return false;
  for (int64_t s : {a.q_stride_b, a.q_stride_m, a.q_stride_h, a.k_stride_b, a.k_stride_m, a.k_stride_h,
                    a.v_stride_b, a.v_stride_m, a.v_stride_h})
    if (s > lim || s % 8) return false;  // TMA: 16-byte strides
  if (a.batch * a.lq * a.heads * a.head_dim > lim || !a.lse || a.lse_stride_bh < a.lq) return false;
  return true;
}

typename Kernel::Arguments make_arguments(const cvt_attn_args& a) {
  const int b = int(a.batch), h = int(a.heads), lq = int(a.lq), lkv = int(a.lkv), d = int(a.head_dim);
  StrideQKVO dq = make_stride(int(a.q_stride_m), _1{}, make_stride(int(a.q_stride_b), int(a.q_stride_h)));
  StrideQKVO dk = make_stride(int(a.k_stride_m), _1{}, make_stride(int(a.k_stride_b), int(a.k_stride_h)));
  StrideQKVO dv = make_stride(int(a.v_stride_m), _1{}, make_stride(int(a.v_stride_b), int(a.v_stride_h)));
  StrideQKVO dout = make_stride(h * d, _1{}, make_stride(lq * h * d, d));  // o packed (B, Lq, H, D)
  StrideLSE dlse = make_stride(_1{}, make_stride(int(a.lse_stride_bh) * h, int(a.lse_stride_bh)));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device_id;
  hw.sm_count = a.sm_count > 0 ? a.sm_count : sm_count_of(a.device_id);
  return typename Kernel::Arguments{
      cute::make_tuple(b, h, lq, lkv, d),
      {static_cast<const Element*>(a.q), dq, static_cast<const Element*>(a.k), dk,
       static_cast<const Element*>(a.v), dv},
      {static_cast<Element*>(a.o), dout, a.lse, dlse},
      hw};
}

bool can_implement(const cvt_attn_args& a) {
  if (!fits(a) || !tma_ready()) return false;
  if ((reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.k) | reinterpret_cast<uintptr_t>(a.v) |
       reinterpret_cast<uintptr_t>(a.o)) % 16)
    return false;
  // The example's own check also asks Lq % 8 == 0; with the strides checked in fits() (all 16-byte
  // multiples) TMA needs no alignment of the length itself, so only the head-dim rules remain.
  return a.head_dim <= ${td} && a.head_dim % 8 == 0;
}

size_t workspace_size(const cvt_attn_args& a) { return Kernel::get_workspace_size(make_arguments(a)); }

int launch(const cvt_attn_args& a, void* workspace, cudaStream_t stream) {
  if (a.device_id < 0 || a.device_id >= 64) return CVT_ERR_SMEM;
  static std::once_flag attr_once[64];
  static cudaError_t attr_status[64];
  std::call_once(attr_once[a.device_id], [&] {
    attr_status[a.device_id] = cudaSuccess;
    if (Kernel::SharedStorageSize >= (48 << 10)) {
      attr_status[a.device_id] = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      int(Kernel::SharedStorageSize));
      if (attr_status[a.device_id] != cudaSuccess) (void)cudaGetLastError();
    }
  });
  if (attr_status[a.device_id] != cudaSuccess) return CVT_ERR_SMEM;
  auto args = make_arguments(a);
  if (Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess) return CVT_ERR_INIT;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  // The example derives the softmax scale from the head dim; CvT's is embed_dim ** -0.5.
  params.mainloop.scale_softmax = a.scale;
  params.mainloop.scale_softmax_log2 = a.scale * float(M_LOG2E);
  dim3 const block = Kernel::get_block_shape();
  dim3 const grid = Kernel::get_grid_shape(params);
  dim3 cluster(cute::size<0>(typename Kernel::ClusterShape{}), cute::size<1>(typename Kernel::ClusterShape{}),
               cute::size<2>(typename Kernel::ClusterShape{}));
  // Launched directly: CUTLASS's ClusterLauncher sets a function attribute on every launch.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = int(Kernel::SharedStorageSize);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  void* kernel_params[] = {&params};
  if (cudaLaunchKernelExC(&config, reinterpret_cast<void const*>(cutlass::device_kernel<Kernel>), kernel_params) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return CVT_OK;
}
}  // namespace cvt_kernel
"""

EX88_TEMPLATE += c_exports("attn", "a")

EX41_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// fused multi-head attention forward (CUTLASS example 41, Sm80-class), ${dtype}, fp32 softmax and accumulation
#include <cstdint>
#include <mutex>
#include <cuda_runtime.h>
#include "kernel_forward.h"
#include "cvt_attn_abi.h"

namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_ATTENTION;
using Element = ${element};
using Attention = AttentionKernel<Element, cutlass::arch::Sm80, /*isAligned=*/true, ${queries}, ${keys}, ${max_k},
                                  /*kSupportsDropout=*/false, /*kSupportsBias=*/false>;
constexpr int kSmemBytes = int(sizeof(typename Attention::SharedStorage));
const void* const kKernelFn = reinterpret_cast<const void*>(attention_kernel_batched_impl<Attention>);

bool make_params(const cvt_attn_args& a, typename Attention::Params& p) {
  const int64_t lim = INT32_MAX;
  if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0) return false;
  if (a.lq > lim || a.lkv > lim || a.head_dim > ${max_k} || a.head_dim % 8 || a.batch > 65535 || a.heads > 65535)
    return false;
  if (a.q_stride_m > lim || a.k_stride_m > lim || a.v_stride_m > lim || a.q_stride_h > lim ||
      a.k_stride_h > lim || a.v_stride_h > lim)
    return false;
  // The kernel writes o packed (B, Lq, H, D) and lse rows padded to 32.
  if (a.lse && a.lse_stride_bh != (a.lq + 31) / 32 * 32) return false;
  p.query_ptr = static_cast<Element*>(const_cast<void*>(a.q));
  p.key_ptr = static_cast<Element*>(const_cast<void*>(a.k));
  p.value_ptr = static_cast<Element*>(const_cast<void*>(a.v));
  p.output_ptr = static_cast<Element*>(a.o);
  p.output_accum_ptr = nullptr;
  p.logsumexp_ptr = a.lse;
  p.scale = a.scale;
  p.num_batches = int32_t(a.batch);
  p.num_heads = int32_t(a.heads);
  p.head_dim = int32_t(a.head_dim);
  p.head_dim_value = int32_t(a.head_dim);
  p.num_queries = int32_t(a.lq);
  p.num_keys = int32_t(a.lkv);
  p.q_strideM = int32_t(a.q_stride_m);
  p.k_strideM = int32_t(a.k_stride_m);
  p.v_strideM = int32_t(a.v_stride_m);
  p.q_strideH = int32_t(a.q_stride_h);
  p.k_strideH = int32_t(a.k_stride_h);
  p.v_strideH = int32_t(a.v_stride_h);
  p.q_strideB = a.q_stride_b;
  p.k_strideB = a.k_stride_b;
  p.v_strideB = a.v_stride_b;
  p.o_strideM = int32_t(a.heads * a.head_dim);
  return true;
}

bool can_implement(const cvt_attn_args& a) {
  typename Attention::Params p;
  if (!make_params(a, p)) return false;
  if (Attention::kNeedsOutputAccumulatorBuffer) return false;  // instantiated with max_k <= keys per block
  if (reinterpret_cast<uintptr_t>(a.o) % 16) return false;
  return Attention::check_supported(p);
}

size_t workspace_size(const cvt_attn_args&) { return 0; }

int launch(const cvt_attn_args& a, void*, cudaStream_t stream) {
  if (a.device_id < 0 || a.device_id >= 64) return CVT_ERR_SMEM;
  // Raise the dynamic shared-memory limit once per device (cudaFuncSetAttribute is per device).
  static std::once_flag attr_once[64];
  static cudaError_t attr_status[64];
  std::call_once(attr_once[a.device_id], [&] {
    attr_status[a.device_id] = cudaSuccess;
    if (kSmemBytes > 0xc000) {
      attr_status[a.device_id] =
          cudaFuncSetAttribute(kKernelFn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      if (attr_status[a.device_id] != cudaSuccess) (void)cudaGetLastError();
    }
  });
  if (attr_status[a.device_id] != cudaSuccess) return CVT_ERR_SMEM;
  typename Attention::Params p;
  if (!make_params(a, p)) return CVT_ERR_INVALID_PROBLEM;
  attention_kernel_batched_impl<Attention><<<p.getBlocksGrid(), p.getThreadsGrid(), kSmemBytes, stream>>>(p);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("attn", "a")


# ----------------------------------------------------------------------------- backward
# The rowsum(dout * o) pass both backward kernels start from, and the fp32 dq -> dtype pass of the
# Hopper one. Ours (not the examples'): fp32 products, 16-byte loads, any strides along B/L/H.
ATTN_BWD_HELPERS = r"""
namespace cvt_kernel {
// delta[(b * H + h) * ld + i] = sum_d dout[b, i, h, d] * o[b, i, h, d] (fp32), one row per 8 threads,
// for every row i < ld (0 past Lq: kernels may read a whole last block of rows). With lse_out, the
// forward's lse is copied there too, with ld-row padding of +inf (P = exp(s - inf) = 0 past Lq):
// the forward leaves the caller's padding unwritten, and example 41's backward reads a whole block.
template <class E>
__global__ void __launch_bounds__(256) delta_kernel(cvt_attnbwd_args a, float* __restrict__ delta, int64_t ld,
                                                    float* __restrict__ lse_out) {
  using Vec = cutlass::Array<E, 8>;
  const int64_t i = int64_t(blockIdx.x) * 32 + threadIdx.x / 8;
  const int64_t h = blockIdx.y, b = blockIdx.z, bh = b * a.heads + h;
  const int lane = threadIdx.x % 8;
  float acc = 0.f;
  if (i < a.lq) {
    const E* o = static_cast<const E*>(a.o) + b * a.o_stride_b + i * a.o_stride_m + h * a.o_stride_h;
    const E* g = static_cast<const E*>(a.dout) + b * a.do_stride_b + i * a.do_stride_m + h * a.do_stride_h;
    for (int64_t d = lane * 8; d < a.head_dim; d += 64) {
      const Vec ov = *reinterpret_cast<const Vec*>(o + d), gv = *reinterpret_cast<const Vec*>(g + d);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 8; ++e) acc += float(ov[e]) * float(gv[e]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int s = 1; s < 8; s *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s, 8);
  if (lane != 0 || i >= ld) return;
  // A gradient of lse itself adds P * dlse to dS = P * (dP - delta): the same as delta - dlse.
  if (i < a.lq && a.dlse) acc -= a.dlse[bh * a.dlse_stride_bh + i];
  delta[bh * ld + i] = acc;
  if (lse_out) lse_out[bh * ld + i] = i < a.lq ? a.lse[bh * a.lse_stride_bh + i] : INFINITY;
}

// Rows are covered 32 per block: ld must be at least Lq (rows past ld are not written).
template <class E>
void launch_delta(const cvt_attnbwd_args& a, float* delta, int64_t ld, cudaStream_t stream, float* lse_out = nullptr) {
  dim3 grid(unsigned((ld + 31) / 32), unsigned(a.heads), unsigned(a.batch));
  delta_kernel<E><<<grid, 256, 0, stream>>>(a, delta, ld, lse_out);
}

// dq[b, i, h, :] = E(acc[((b * H + h) * lq_pad + i) * D + :]), 8 elements per thread.
template <class E>
__global__ void __launch_bounds__(256) dq_convert_kernel(cvt_attnbwd_args a, const float* __restrict__ acc,
                                                         int64_t lq_pad) {
  const int64_t vecs = a.head_dim / 8, rows = a.batch * a.heads * a.lq;
  const int64_t t = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (t >= rows * vecs) return;
  const int64_t d = (t % vecs) * 8, row = t / vecs, i = row % a.lq, bh = row / a.lq;
  const int64_t h = bh % a.heads, b = bh / a.heads;
  const float4* src = reinterpret_cast<const float4*>(acc + (bh * lq_pad + i) * a.head_dim + d);
  const float4 x = src[0], y = src[1];
  cutlass::Array<E, 8> out;
  out[0] = E(x.x); out[1] = E(x.y); out[2] = E(x.z); out[3] = E(x.w);
  out[4] = E(y.x); out[5] = E(y.y); out[6] = E(y.z); out[7] = E(y.w);
  *reinterpret_cast<cutlass::Array<E, 8>*>(static_cast<E*>(a.dq) + b * a.dq_stride_b + i * a.dq_stride_m +
                                            h * a.dq_stride_h + d) = out;
}

// Every stride of a backward problem: 16-byte multiples that fit 32 bits (the kernels index with int).
inline bool bwd_strides_ok(const cvt_attnbwd_args& a) {
  const int64_t lim = INT32_MAX;
  if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0 || a.head_dim % 8) return false;
  if (a.lq > lim || a.lkv > lim || a.batch > 65535 || a.heads > 65535) return false;
  for (int64_t s : {a.q_stride_b, a.q_stride_m, a.q_stride_h, a.k_stride_b, a.k_stride_m, a.k_stride_h,
                    a.v_stride_b, a.v_stride_m, a.v_stride_h, a.o_stride_b, a.o_stride_m, a.o_stride_h,
                    a.do_stride_b, a.do_stride_m, a.do_stride_h, a.dq_stride_b, a.dq_stride_m, a.dq_stride_h,
                    a.dk_stride_b, a.dk_stride_m, a.dk_stride_h, a.dv_stride_b, a.dv_stride_m, a.dv_stride_h})
    if (s < 0 || s > lim || s % 8) return false;
  if (!a.lse || a.lse_stride_bh < a.lq || a.lse_stride_bh % 8) return false;
  if (a.dlse && (a.dlse_stride_bh < a.lq || reinterpret_cast<uintptr_t>(a.dlse) % 4)) return false;
  if (a.batch * a.heads * a.lq * a.head_dim > lim || a.batch * a.heads * a.lkv * a.head_dim > lim) return false;
  for (const void* p : {a.q, a.k, a.v, a.o, a.dout, static_cast<const void*>(a.lse), static_cast<const void*>(a.dq),
                        static_cast<const void*>(a.dk), static_cast<const void*>(a.dv)})
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return a.scale > 0.f;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace cvt_kernel
"""

EX41_BWD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// fused multi-head attention backward (CUTLASS example 41, Sm80-class), ${dtype}, fp32 accumulation:
// dq, dk, dv from q, k, v, o, dout and the forward's logsumexp
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/array.h"
#include "kernel_backward.h"
#include "cvt_attn_bwd_abi.h"
""" + DEVICE_HELPERS + ATTN_BWD_HELPERS + r"""
namespace cvt_kernel {
constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
using Element = ${element};
// Preloading the next GEMM's operands needs the dk/dv accumulators in registers (max_k <= queries).
constexpr bool kPreload = ${max_k} <= ${queries};
using AK = AttentionBackwardKernel<cutlass::arch::Sm80, Element, /*kIsAligned=*/true, /*kApplyDropout=*/false,
                                   kPreload, ${queries}, ${keys}, ${max_k}, /*kKeysQueriesAlignedToBlockSize=*/false,
                                   /*kEnableSplitKeys=*/true>;
constexpr int kSmemBytes = int(sizeof(typename AK::SharedStorage));

// AK::attention_kernel without its first step: the example has every block (every key split)
// recompute rowsum(dout * o) for all queries of its (batch, head); ours is computed once, before.
__global__ void __launch_bounds__(AK::kNumThreads, AK::kMinBlocksPerSm) bwd_kernel(typename AK::Params p) {
  if (!p.advance_to_block()) return;
  extern __shared__ char smem_buffer[];
  auto& shared_storage = *reinterpret_cast<typename AK::SharedStorage*>(smem_buffer);
  const uint16_t thread_id = threadIdx.x;
  uint8_t warp_id = warp_uniform(thread_id / 32);
  const uint8_t lane_id = thread_id % 32;
  int32_t key_start = p.split_key_device() * AK::kBlockSizeJ;
  if (key_start >= p.num_keys) return;
  if (AK::kPrologueQK)
    AK::template prologueQkNextIteration<true>(shared_storage, p, AK::getQueryStart(p, key_start), key_start, warp_id,
                                               lane_id);
  typename AK::OutputFragments output_frags;
  curandStatePhilox4_32_10_t rng_state_init;  // dropout off: never read
  for (; key_start < p.num_keys; key_start += p.num_splits_key_device() * AK::kBlockSizeJ) {
    output_frags.clear();
    for (int32_t shifted = AK::getQueryStart(p, key_start); shifted < AK::getQueryStartShift(p) + AK::getQueryEnd(p);
         shifted += AK::kBlockSizeI) {
      warp_id = warp_uniform(warp_id);  // the example's register-pressure trick, kept
      int32_t query_start = shifted;
      if (query_start >= p.num_queries) query_start = query_start % AK::getQueryEnd(p);
      AK::template processBlockIJ<false>(shared_storage, output_frags, p, query_start, key_start, rng_state_init,
                                         warp_id, lane_id);
    }
    if (AK::kOutputInRF)
      AK::template writeFragsToGmem<false>(shared_storage, output_frags, p, key_start, warp_id, lane_id);
    else if (AK::getQueryStart(p, key_start) >= p.num_queries)
      AK::template zfillGradKV<false>(p, key_start, warp_id, lane_id);
    __syncthreads();
  }
}

// Key splits: enough blocks to fill the GPU once (each split adds its dq into an fp32 buffer).
int key_splits(const cvt_attnbwd_args& a) {
  static std::once_flag once[64];
  static int per_sm[64];
  const int dev = a.device_id;
  if (dev < 0 || dev >= 64) return 1;
  std::call_once(once[dev], [&] {
    int v = 0;
    if (!smem_ready(reinterpret_cast<const void*>(bwd_kernel), kSmemBytes, dev) ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, bwd_kernel, int(AK::kNumThreads), kSmemBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 1;
    }
    per_sm[dev] = v > 0 ? v : 1;
  });
  const int64_t sms = a.sm_count > 0 ? a.sm_count : sm_count_of(dev);
  const int64_t want = (sms * per_sm[dev] + a.batch * a.heads - 1) / (a.batch * a.heads);
  const int64_t most = (a.lkv + AK::kBlockSizeJ - 1) / AK::kBlockSizeJ;
  return int(std::max<int64_t>(1, std::min<int64_t>(want, most)));
}

int64_t delta_ld(const cvt_attnbwd_args& a) { return round_up(a.lq, 32); }

bool make_params(const cvt_attnbwd_args& a, typename AK::Params& p) {
  const int64_t hd = a.heads * a.head_dim;
  // The kernel writes dq/dk/dv rows H*D apart and reads o that way.
  if (a.o_stride_m != hd || a.dq_stride_m != hd || a.dk_stride_m != hd || a.dv_stride_m != hd) return false;
  if (a.head_dim > ${max_k}) return false;
  p.query_ptr = static_cast<Element*>(const_cast<void*>(a.q));
  p.key_ptr = static_cast<Element*>(const_cast<void*>(a.k));
  p.value_ptr = static_cast<Element*>(const_cast<void*>(a.v));
  p.logsumexp_ptr = const_cast<float*>(a.lse);
  p.output_ptr = static_cast<Element*>(const_cast<void*>(a.o));
  p.grad_output_ptr = static_cast<Element*>(const_cast<void*>(a.dout));
  p.grad_query_ptr = static_cast<Element*>(a.dq);
  p.grad_key_ptr = static_cast<Element*>(a.dk);
  p.grad_value_ptr = static_cast<Element*>(a.dv);
  p.scale = a.scale;
  p.head_dim = p.head_dim_value = int32_t(a.head_dim);
  p.num_queries = int32_t(a.lq);
  p.num_keys = int32_t(a.lkv);
  p.num_heads = int32_t(a.heads);
  p.num_batches = int32_t(a.batch);
  p.q_strideM = int32_t(a.q_stride_m); p.k_strideM = int32_t(a.k_stride_m); p.v_strideM = int32_t(a.v_stride_m);
  p.gO_strideM = int32_t(a.do_stride_m);
  p.q_strideH = int32_t(a.q_stride_h); p.k_strideH = int32_t(a.k_stride_h); p.v_strideH = int32_t(a.v_stride_h);
  p.o_strideH = a.o_stride_h; p.gO_strideH = a.do_stride_h;
  p.q_strideB = a.q_stride_b; p.k_strideB = a.k_stride_b; p.v_strideB = a.v_stride_b;
  p.o_strideB = a.o_stride_b; p.gO_strideB = a.do_stride_b;
  p.gQ_strideB = a.dq_stride_b; p.gK_strideB = a.dk_stride_b; p.gV_strideB = a.dv_stride_b;
  p.gQ_strideH = a.dq_stride_h; p.gK_strideH = a.dk_stride_h; p.gV_strideH = a.dv_stride_h;
  p.lse_strideB = delta_ld(a) * a.heads;  // launch() points the kernel at the padded copy in the workspace
  p.lse_strideH = delta_ld(a);
  p.delta_strideB = delta_ld(a) * a.heads;
  p.delta_strideH = delta_ld(a);
  p.num_splits_key = int16_t(key_splits(a));
  return true;
}

// The workspace: delta, the padded lse copy (both (B*H, delta_ld) floats), then the kernel's fp32 accumulators.
size_t delta_bytes(const cvt_attnbwd_args& a) { return size_t(round_up(a.batch * a.heads * delta_ld(a) * 4, 256)); }

bool can_implement(const cvt_attnbwd_args& a) {
  typename AK::Params p;
  return bwd_strides_ok(a) && make_params(a, p) && AK::check_supported(p);
}

size_t workspace_size(const cvt_attnbwd_args& a) {
  typename AK::Params p;
  if (!make_params(a, p)) return 0;
  return 2 * delta_bytes(a) + size_t(p.workspace_size());
}

int launch(const cvt_attnbwd_args& a, void* workspace, cudaStream_t stream) {
  if (!smem_ready(reinterpret_cast<const void*>(bwd_kernel), kSmemBytes, a.device_id)) return CVT_ERR_SMEM;
  typename AK::Params p;
  if (!make_params(a, p)) return CVT_ERR_INVALID_PROBLEM;
  float* delta = static_cast<float*>(workspace);
  float* lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(a));
  p.delta_ptr = delta;
  p.logsumexp_ptr = lse;  // the copy with +inf padding: the kernel reads whole blocks of rows
  const size_t accum = size_t(p.workspace_size());
  p.workspace = accum ? reinterpret_cast<float*>(static_cast<char*>(workspace) + 2 * delta_bytes(a)) : nullptr;
  if (accum && p.should_zero_workspace() && cudaMemsetAsync(p.workspace, 0, accum, stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  launch_delta<Element>(a, delta, delta_ld(a), stream, lse);
  bwd_kernel<<<p.getBlocksGrid(), p.getThreadsGrid(), kSmemBytes, stream>>>(p);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("attnbwd", "a")


EX88_BWD_TEMPLATE = r"""// Generated by cvt_cutlass for kernel ${name}. Do not edit.
// fused multi-head attention backward (CUTLASS example 88's Hopper mainloop: TMA + wgmma, warp-specialized),
// ${dtype}, fp32 accumulation: rowsum(dout * o) -> zero the fp32 dq -> main kernel (dk, dv stored, dq
// reduce-added with TMA) -> dq converted to ${dtype}
""" + TMA_DRIVER_SHIM.replace("$", "$$") + r"""#include <cmath>
#include <cstdint>
#include <cuda_runtime.h>
#include "cutlass/cutlass.h"
#include "cutlass/array.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"
#include "collective/fmha_fusion.hpp"
${mainloop}
#include "collective/fmha_epilogue_bwd.hpp"
#include "kernel/fmha_kernel_tma_warpspecialized.hpp"
#include "kernel/fmha_tile_scheduler.hpp"
#include "cvt_attn_bwd_abi.h"
""" + DEVICE_HELPERS + ATTN_BWD_HELPERS + r"""
namespace cvt_kernel {
using namespace cute;
constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
using Element = ${element};
using TileShape = Shape<_${tq}, _${tk}, _${td}>;  // (queries, keys, head dim) per CTA
using Fusion = cutlass::fmha::collective::FusionBwdAdapter<cutlass::fmha::collective::ResidualFusion>;
using Mainloop = cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, Fusion>;
using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV<Element, float, typename Mainloop::TileShapePV>;
using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
    Mainloop, Epilogue, cutlass::fmha::kernel::TileSchedulerBwdAdapter<cutlass::fmha::kernel::IndividualTileScheduler>>;
using S4 = cute::tuple<int, int, int, _1>;  // (B, H, L, D) strides

int64_t lq_pad(const cvt_attnbwd_args& a) { return round_up(a.lq, 8); }  // TMA: 16-byte rows of fp32
size_t delta_bytes(const cvt_attnbwd_args& a) { return size_t(round_up(a.batch * a.heads * lq_pad(a) * 4, 256)); }
size_t dq_acc_bytes(const cvt_attnbwd_args& a) { return size_t(a.batch * a.heads * lq_pad(a) * a.head_dim * 4); }

typename Kernel::Arguments make_arguments(const cvt_attnbwd_args& a, float* delta, float* dq_acc) {
  const int b = int(a.batch), h = int(a.heads), lq = int(a.lq), lkv = int(a.lkv), d = int(a.head_dim);
  const int lp = int(lq_pad(a)), ls = int(a.lse_stride_bh);
  auto s4 = [](int64_t sb, int64_t sh, int64_t sm) { return S4{int(sb), int(sh), int(sm), _1{}}; };
  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device_id;
  hw.sm_count = a.sm_count > 0 ? a.sm_count : sm_count_of(a.device_id);
  return typename Kernel::Arguments{
      cute::make_tuple(b, h, lq, lkv, d),
      {static_cast<const Element*>(a.q), s4(a.q_stride_b, a.q_stride_h, a.q_stride_m),
       static_cast<const Element*>(a.k), s4(a.k_stride_b, a.k_stride_h, a.k_stride_m),
       static_cast<const Element*>(a.v), s4(a.v_stride_b, a.v_stride_h, a.v_stride_m),
       static_cast<const Element*>(a.dout), s4(a.do_stride_b, a.do_stride_h, a.do_stride_m),
       a.lse, cute::tuple<int, int, _1>{h * ls, ls, _1{}},
       delta, cute::tuple<int, int, _1>{h * lp, lp, _1{}},
       dq_acc, S4{h * lp * d, lp * d, d, _1{}}},
      {static_cast<Element*>(a.dk), s4(a.dk_stride_b, a.dk_stride_h, a.dk_stride_m),
       static_cast<Element*>(a.dv), s4(a.dv_stride_b, a.dv_stride_h, a.dv_stride_m)},
      hw};
}

bool can_implement(const cvt_attnbwd_args& a) {
  if (!bwd_strides_ok(a) || !tma_ready()) return false;
  if (a.batch * a.heads * lq_pad(a) * a.head_dim > INT32_MAX) return false;
  // The mainloop's own check also asks Lq % 8 == 0; TMA needs no alignment of the length itself
  // (rows past Lq load as zeros and contribute nothing; dq's are clipped), so only the head dim remains.
  return a.head_dim <= ${td};
}

size_t workspace_size(const cvt_attnbwd_args& a) { return delta_bytes(a) + dq_acc_bytes(a); }

int launch(const cvt_attnbwd_args& a, void* workspace, cudaStream_t stream) {
  const void* fn = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
  if (!smem_ready(fn, int(Kernel::SharedStorageSize), a.device_id)) return CVT_ERR_SMEM;
  float* delta = static_cast<float*>(workspace);
  float* dq_acc = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(a));
  if (cudaMemsetAsync(dq_acc, 0, dq_acc_bytes(a), stream) != cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  launch_delta<Element>(a, delta, lq_pad(a), stream);
  typename Kernel::Params params = Kernel::to_underlying_arguments(make_arguments(a, delta, dq_acc), nullptr);
  // The example derives the softmax scale from the head dim; CvT's is embed_dim ** -0.5.
  params.mainloop.scale_softmax = a.scale;
  params.mainloop.scale_softmax_log2 = a.scale * float(M_LOG2E);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = int(Kernel::SharedStorageSize);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  void* kernel_params[] = {&params};
  if (cudaLaunchKernelExC(&config, fn, kernel_params) != cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  const int64_t threads = a.batch * a.heads * a.lq * (a.head_dim / 8);
  dq_convert_kernel<Element><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(a, dq_acc, lq_pad(a));
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}
}  // namespace cvt_kernel
""" + c_exports("attnbwd", "a")


# ----------------------------------------------------------------------------- backward specs
@dataclass(frozen=True)
class AttnBwdSpec(KernelSpec):
    """One example-41 (Sm80-class) attention backward instantiation: runs on sm_89 and sm_90.

    Our driver runs the example's per-block work (``processBlockIJ``) after one rowsum(dout * o)
    pass of ours, so the key splits (enough blocks to fill the GPU; dq summed in fp32 across
    them) do not each recompute it. Knobs: queries and keys per block, the largest head dim."""

    dtype: str
    queries: int = 64
    keys: int = 64
    max_k: int = 64
    pass_: str = "bwd"

    arch: ClassVar[int] = 89
    kernel: ClassVar[str] = "ex41"
    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("bwd",)
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_attn_bwd_abi.h")
    include_dirs: ClassVar[tuple[str, ...]] = (EX41_DIR, "csrc:shim")
    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        return f"ex41_q{self.queries}_k{self.keys}_d{self.max_k}_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> AttnBwdSpec | None:
        m = _ATTN41_VARIANT.fullmatch(head.variant)
        if head.arch != 89 or not m:
            return None
        return cls(head.dtype, int(m["q"]), int(m["k"]), int(m["d"]), head.pass_)

    def validate(self) -> None:
        self.check_common()
        if self.queries not in (64, 128) or self.keys not in (64, 128):
            raise SpecError("backward queries and keys per block must be 64 or 128")
        if self.max_k not in (64, 128, 256):
            raise SpecError("max_k (largest head dim) must be 64, 128 or 256")

    def serves(self, head_dim: int) -> bool:
        return head_dim <= self.max_k and head_dim % 8 == 0

    def source(self) -> str:
        return string.Template(EX41_BWD_TEMPLATE).substitute(
            name=self.name, element=CUTLASS_ELEMENT[self.dtype], queries=self.queries, keys=self.keys,
            max_k=self.max_k, min_cc=self.min_cc, arch_ok=arch_ok(self.min_cc), dtype=self.dtype)


@dataclass(frozen=True)
class Attn88BwdSpec(KernelSpec):
    """One example-88 (Hopper) attention backward instantiation, sm_90a only, fp16 and bf16.

    The example ships this mainloop for fp16 only; it is written for any 16-bit element, and
    bf16 is instantiated here the same way (tested against float64 on the GPU). Our launcher
    runs its own rowsum(dout * o) pass (fp32 products), zeroes the fp32 dq buffer, runs the
    example's kernel with CvT's scale written into its parameters (the example derives
    1/sqrt(D)), and converts dq with its own pass into the caller's strides. Each CTA owns
    ``tile[1]`` keys (two math warpgroups of half each) and walks the queries ``tile[0]`` at a
    time; dk and dv are stored by TMA, dq is reduce-added by TMA (fp32 atomics: not bitwise
    deterministic, like cuDNN's and flash-attention's backward)."""

    dtype: str
    tile: tuple[int, int, int] = (64, 128, 64)  # (queries, keys, head dim) per CTA
    pass_: str = "bwd"

    arch: ClassVar[int] = 90
    kernel: ClassVar[str] = "ex88"
    op: ClassVar[str] = "attention"
    family: ClassVar[str] = "attention_bwd"
    PASSES: ClassVar[tuple[str, ...]] = ("bwd",)
    abi_headers: ClassVar[tuple[str, ...]] = ("cvt_kernel_abi.h", "cvt_attn_bwd_abi.h")
    include_dirs: ClassVar[tuple[str, ...]] = (EX88_DIR,)
    layout: ClassVar[str] = "blhd"

    def variant(self) -> str:
        return f"ex88_t{xs(self.tile)}_coop_a8"

    @classmethod
    def from_variant(cls, head: NameHead) -> Attn88BwdSpec | None:
        m = _ATTN88_BWD_VARIANT.fullmatch(head.variant)
        if head.arch != 90 or not m:
            return None
        return cls(head.dtype, triple(m["t"]), head.pass_)

    def validate(self) -> None:
        self.check_common()
        tq, tk, td = self.tile
        if tq not in (64, 128) or tk != 128 or td not in (32, 64, 128):
            raise SpecError("example-88 backward tile: queries 64/128, keys 128 (two warpgroups of 64), "
                            "head dim 32/64/128")

    def serves(self, head_dim: int, lq: int = 1) -> bool:
        return head_dim <= self.tile[2] and head_dim % 8 == 0

    def source(self) -> str:
        tq, tk, td = self.tile
        return string.Template(EX88_BWD_TEMPLATE).substitute(
            name=self.name, element=CUTLASS_ELEMENT[self.dtype], tq=tq, tk=tk, td=td, min_cc=90,
            arch_ok=arch_ok(90), dtype=self.dtype, mainloop=hopper_bwd_mainloop())


# CUTLASS 4.2's Hopper backward mainloop assigns a float expression to a fragment of Element: that
# compiles for half_t (implicitly constructible from float), not for bfloat16_t (explicit), which is
# why the example is fp16 only. The emitted source carries the header with this one line fixed.
EX88_BWD_MAINLOOP = "collective/fmha_collective_bwd_tma_warpspecialized.hpp"
_EX88_BF16_FIX = ("acc_DS(i) = acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i));",
                  "acc_DS(i) = Element(acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i)));")


def hopper_bwd_mainloop() -> str:
    """The example-88 backward mainloop header, read from the installed CUTLASS, with the bf16 fix
    applied (its relative includes made relative to the example's directory, which is on the
    include path). Raises SpecError if the header no longer has the line the fix expects."""
    import cutlass_library

    path = Path(cutlass_library.source_path) / EX88_DIR / EX88_BWD_MAINLOOP
    text = path.read_text()
    old, new = _EX88_BF16_FIX
    if text.count(old) != 1:
        raise SpecError(f"{path}: the bf16 fix expects exactly one line {old!r}; this CUTLASS differs")
    text = text.replace(old, new).replace("#pragma once", "")
    text = text.replace('#include "../collective/', '#include "collective/').replace('#include "../kernel/',
                                                                                        '#include "kernel/')
    return f"// ---- {EX88_BWD_MAINLOOP} (CUTLASS {EX88_DIR}), bf16 fix applied\n{text}\n// ---- end\n"


_ATTN88_BWD_VARIANT = re.compile(r"ex88_t(?P<t>\d+x\d+x\d+)_coop_a8")
_EX41_BWD_SPACE = ((64, 64), (64, 128), (128, 64), (128, 128))
_EX88_BWD_QUERIES = (64, 128)


def _max_k(head_dim: int) -> int:
    return 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)


def attn_bwd_candidates(dtype: str, head_dim: int, arch: int = 89) -> list:
    """Backward instantiations for a head dim: example 41's on both paths, example 88's on sm90."""
    out: list = [AttnBwdSpec(dtype, q, k, _max_k(head_dim)) for q, k in _EX41_BWD_SPACE]
    if arch == 90 and head_dim <= 128:
        td = 32 if head_dim <= 32 else (64 if head_dim <= 64 else 128)
        out += [Attn88BwdSpec(dtype, (tq, 128, td)) for tq in _EX88_BWD_QUERIES]
    return out


def attn_bwd_heuristic(dtype: str, head_dim: int, arch: int = 89):
    """Before a sweep: example 88's 64x128 tile on the sm90 path for head dims up to 128, example
    41's 64x64 block otherwise (the examples' own choices for head dim 64)."""
    cands = attn_bwd_candidates(dtype, head_dim, arch)
    return cands[len(_EX41_BWD_SPACE)] if arch == 90 and head_dim <= 128 else cands[0]
