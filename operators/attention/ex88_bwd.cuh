// Fused multi-head attention backward on CUTLASS example 88's Hopper mainloop (TMA + wgmma,
// warp-specialized), built for sm_90a, fp16 and bf16, fp32 accumulation
// (operators/attention/abi.h: cvt_attnbwd_args): rowsum(dout * o) -> zero the fp32 dq -> main
// kernel (dk, dv stored, dq reduce-added with TMA) -> dq converted to the element type.
//
// AttentionEx88Bwd<Element, TileQ, TileK, HeadDim>: each CTA owns TileK keys (two math
// warpgroups of half each) and walks the queries TileQ at a time. The example ships this mainloop
// for fp16 only; our copy of it (attention/ex88/fmha_collective_bwd_tma_warpspecialized.hpp, one
// line changed) compiles for bf16 as well. The rowsum and dq passes are ours
// (attention/bwd_common.cuh). dq is reduce-added with fp32 atomics: not bitwise deterministic.
// The example's directory is on the include path (Attn88BwdSpec.include_dirs).
//
// The workspace: delta ((B*H, round_up(Lq, 8)) floats, 256-byte aligned), then the fp32 dq
// accumulator (B, H, round_up(Lq, 8), D).
#pragma once
#include "common/tma_driver.cuh"  // before any CUTLASS header

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/array.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"
#include "collective/fmha_fusion.hpp"
#include "attention/ex88/fmha_collective_bwd_tma_warpspecialized.hpp"
#include "collective/fmha_epilogue_bwd.hpp"
#include "kernel/fmha_kernel_tma_warpspecialized.hpp"
#include "kernel/fmha_tile_scheduler.hpp"
#include "attention/abi.h"
#include "common/device.cuh"
#include "attention/bwd_common.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {

template <class Element_, int TileQ, int TileK, int HeadDim>
struct AttentionEx88Bwd {
  static constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
  using Element = Element_;
  using TileShape = cute::Shape<cute::Int<TileQ>, cute::Int<TileK>, cute::Int<HeadDim>>;
  using Fusion = cutlass::fmha::collective::FusionBwdAdapter<cutlass::fmha::collective::ResidualFusion>;
  using Mainloop = cutlass::fmha::collective::FmhaBwdMainloopTmaWarpSpecialized<Element, float, TileShape, Fusion>;
  using Epilogue = cutlass::fmha::collective::FmhaBwdEpilogueKV<Element, float, typename Mainloop::TileShapePV>;
  using Fmha = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<
      Mainloop, Epilogue, cutlass::fmha::kernel::TileSchedulerBwdAdapter<cutlass::fmha::kernel::IndividualTileScheduler>>;
  using S4 = cute::tuple<int, int, int, cute::_1>;  // (B, H, L, D) strides
  using S3 = cute::tuple<int, int, cute::_1>;       // (B, H, L) strides

  static const void* kernel_fn() { return reinterpret_cast<const void*>(cutlass::device_kernel<Fmha>); }
  static int64_t lq_pad(const cvt_attnbwd_args& a) { return round_up(a.lq, 8); }  // TMA: 16-byte rows of fp32
  static size_t delta_bytes(const cvt_attnbwd_args& a) {
    return size_t(round_up(a.batch * a.heads * lq_pad(a) * 4, 256));
  }
  static size_t dq_acc_bytes(const cvt_attnbwd_args& a) {
    return size_t(a.batch * a.heads * lq_pad(a) * a.head_dim * 4);
  }

  static typename Fmha::Arguments make_arguments(const cvt_attnbwd_args& a, float* delta, float* dq_acc) {
    using cute::_1;
    const int b = int(a.batch), h = int(a.heads), lq = int(a.lq), lkv = int(a.lkv), d = int(a.head_dim);
    const int lp = int(lq_pad(a)), ls = int(a.lse_stride_bh);
    auto s4 = [](int64_t sb, int64_t sh, int64_t sm) { return S4{int(sb), int(sh), int(sm), _1{}}; };
    cutlass::KernelHardwareInfo hw;
    hw.device_id = a.device_id;
    hw.sm_count = a.sm_count > 0 ? a.sm_count : sm_count_of(a.device_id);
    return typename Fmha::Arguments{
        cute::make_tuple(b, h, lq, lkv, d),
        {static_cast<const Element*>(a.q), s4(a.q_stride_b, a.q_stride_h, a.q_stride_m),
         static_cast<const Element*>(a.k), s4(a.k_stride_b, a.k_stride_h, a.k_stride_m),
         static_cast<const Element*>(a.v), s4(a.v_stride_b, a.v_stride_h, a.v_stride_m),
         static_cast<const Element*>(a.dout), s4(a.do_stride_b, a.do_stride_h, a.do_stride_m),
         a.lse, S3{h * ls, ls, _1{}},
         delta, S3{h * lp, lp, _1{}},
         dq_acc, S4{h * lp * d, lp * d, d, _1{}}},
        {static_cast<Element*>(a.dk), s4(a.dk_stride_b, a.dk_stride_h, a.dk_stride_m),
         static_cast<Element*>(a.dv), s4(a.dv_stride_b, a.dv_stride_h, a.dv_stride_m)},
        hw};
  }

  static bool can_implement(const cvt_attnbwd_args& a) {
    if (a.deterministic || !bwd_strides_ok(a) || !tma_ready()) return false;  // dq: atomics
    if (a.batch * a.heads * lq_pad(a) * a.head_dim > INT32_MAX) return false;
    // The mainloop's own check also asks Lq % 8 == 0; TMA needs no alignment of the length itself
    // (rows past Lq load as zeros and contribute nothing; dq's are clipped), so only the head dim remains.
    return a.head_dim <= HeadDim;
  }

  static size_t workspace_size(const cvt_attnbwd_args& a) { return delta_bytes(a) + dq_acc_bytes(a); }

  static int launch(const cvt_attnbwd_args& a, void* workspace, cudaStream_t stream) {
    if (!smem_ready<AttentionEx88Bwd>(kernel_fn(), int(Fmha::SharedStorageSize), a.device_id)) return CVT_ERR_SMEM;
    float* delta = static_cast<float*>(workspace);
    float* dq_acc = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(a));
    launch_delta<Element>(a, delta, lq_pad(a), stream, nullptr, dq_acc, dq_acc_bytes(a));  // dq_acc zeroed there
    typename Fmha::Params params = Fmha::to_underlying_arguments(make_arguments(a, delta, dq_acc), nullptr);
    // The example derives the softmax scale from the head dim; CvT's is embed_dim ** -0.5.
    params.mainloop.scale_softmax = a.scale;
    params.mainloop.scale_softmax_log2 = a.scale * float(M_LOG2E);
    if (launch_params(params, stream) != CVT_OK) return CVT_ERR_LAUNCH;
    const int64_t threads = a.batch * a.heads * a.lq * (a.head_dim / 8);
    launch_kernel(dq_convert_kernel<Element>, unsigned((threads + 255) / 256), 256, 0, stream, a, dq_acc, lq_pad(a),
                  a.head_dim);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }

  // The main kernel, launched directly with a 1x1x1 cluster.
  static int launch_params(typename Fmha::Params& params, cudaStream_t stream) {
    return launch_cluster(kernel_fn(), params, Fmha::get_grid_shape(params), Fmha::get_block_shape(),
                          int(Fmha::SharedStorageSize), dim3(1, 1, 1), stream);
  }
};

}  // namespace cvt_kernel
