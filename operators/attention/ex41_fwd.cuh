// Fused multi-head attention forward on CUTLASS example 41 (AttentionKernel of
// examples/41_fused_multi_head_attention/kernel_forward.h, ArchTag Sm80: cp.async + mma.sync; runs
// on sm_89 and sm_90), fp32 softmax and accumulation (operators/attention/abi.h: cvt_attn_args).
//
// q (B, Lq, H, D), k and v (B, Lkv, H, D) in the layout CvT's projections write (unit stride
// along D, no permute copies), CvT's scale as a parameter, any Lq != Lkv. o (B, Lq, H, D) packed;
// lse (B, H, Lq) float in rows padded to 32 (the kernel's layout).
//
// AttentionEx41Fwd<Element, Queries, Keys, MaxK>: queries and keys per block, the largest head dim
// (instantiated with MaxK <= Keys: the output then accumulates in registers). The example's
// directory is on the include path (AttnSpec.include_dirs), with our cuRAND stand-in
// (attention/shim) after every other.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "kernel_forward.h"
#include "attention/abi.h"
#include "common/device.cuh"

namespace cvt_kernel {

template <class Element_, int Queries, int Keys, int MaxK>
struct AttentionEx41Fwd {
  static constexpr int kFamily = CVT_FAMILY_ATTENTION;
  using Element = Element_;
  using Attention = AttentionKernel<Element, cutlass::arch::Sm80, /*isAligned=*/true, Queries, Keys, MaxK,
                                    /*kSupportsDropout=*/false, /*kSupportsBias=*/false>;
  static constexpr int kSmemBytes = int(sizeof(typename Attention::SharedStorage));

  static const void* kernel_fn() { return reinterpret_cast<const void*>(attention_kernel_batched_impl<Attention>); }

  static bool make_params(const cvt_attn_args& a, typename Attention::Params& p) {
    const int64_t lim = INT32_MAX;
    if (a.batch <= 0 || a.heads <= 0 || a.lq <= 0 || a.lkv <= 0 || a.head_dim <= 0) return false;
    if (a.lq > lim || a.lkv > lim || a.head_dim > MaxK || a.head_dim % 8 || a.batch > 65535 || a.heads > 65535)
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

  static bool can_implement(const cvt_attn_args& a) {
    typename Attention::Params p;
    if (!make_params(a, p)) return false;
    if (Attention::kNeedsOutputAccumulatorBuffer) return false;  // instantiated with max_k <= keys per block
    if (reinterpret_cast<uintptr_t>(a.o) % 16) return false;
    return Attention::check_supported(p);
  }

  static size_t workspace_size(const cvt_attn_args&) { return 0; }

  static int launch(const cvt_attn_args& a, void*, cudaStream_t stream) {
    // The dynamic shared-memory limit, raised once per device (CVT_ERR_SMEM for a device id past 63 too).
    if (!smem_ready<AttentionEx41Fwd>(kernel_fn(), kSmemBytes, a.device_id)) return CVT_ERR_SMEM;
    typename Attention::Params p;
    if (!make_params(a, p)) return CVT_ERR_INVALID_PROBLEM;
    attention_kernel_batched_impl<Attention><<<p.getBlocksGrid(), p.getThreadsGrid(), kSmemBytes, stream>>>(p);
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
