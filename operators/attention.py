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
