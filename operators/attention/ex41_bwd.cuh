// Fused multi-head attention backward on CUTLASS example 41 (AttentionBackwardKernel of
// examples/41_fused_multi_head_attention/kernel_backward.h, ArchTag Sm80: runs on sm_89 and sm_90),
// fp32 accumulation: dq, dk, dv from q, k, v, o, dout and the forward's logsumexp
// (operators/attention/abi.h: cvt_attnbwd_args).
//
// AttentionEx41Bwd<Element, Queries, Keys, MaxK>: queries and keys per block, the largest head dim.
// Our driver kernel runs the example's per-block work (processBlockIJ) after one rowsum(dout * o)
// pass of ours (attention/bwd_common.cuh), so the key splits (enough blocks to fill the GPU; dq
// summed in fp32 across them) do not each recompute it. The workspace: delta, a copy of lse with
// +inf padding (both (B*H, round_up(Lq, 32)) floats, 256-byte aligned), then the kernel's fp32
// accumulators.
#pragma once
#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/array.h"
#include "kernel_backward.h"
#include "attention/abi.h"
#include "common/device.cuh"
#include "attention/bwd_common.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {

template <class Element_, int Queries, int Keys, int MaxK>
struct AttentionEx41Bwd {
  static constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
  using Element = Element_;
  // Preloading the next GEMM's operands needs the dk/dv accumulators in registers (max_k <= queries).
  static constexpr bool kPreload = MaxK <= Queries;
  using AK = AttentionBackwardKernel<cutlass::arch::Sm80, Element, /*kIsAligned=*/true, /*kApplyDropout=*/false,
                                     kPreload, Queries, Keys, MaxK, /*kKeysQueriesAlignedToBlockSize=*/false,
                                     /*kEnableSplitKeys=*/true>;
  static constexpr int kSmemBytes = int(sizeof(typename AK::SharedStorage));

  static const void* kernel_fn();
  static int key_splits(const cvt_attnbwd_args& a);
  static int64_t delta_ld(const cvt_attnbwd_args& a) { return round_up(a.lq, 32); }
  static bool make_params(const cvt_attnbwd_args& a, typename AK::Params& p);
  static size_t delta_bytes(const cvt_attnbwd_args& a) {
    return size_t(round_up(a.batch * a.heads * delta_ld(a) * 4, 256));
  }
  static bool can_implement(const cvt_attnbwd_args& a) {
    typename AK::Params p;
    return bwd_strides_ok(a) && make_params(a, p) && AK::check_supported(p);
  }
  static size_t workspace_size(const cvt_attnbwd_args& a) {
    typename AK::Params p;
    if (!make_params(a, p)) return 0;
    return 2 * delta_bytes(a) + size_t(p.workspace_size());
  }
  static int launch(const cvt_attnbwd_args& a, void* workspace, cudaStream_t stream);
};

// AK::attention_kernel without its first step: the example has every block (every key split)
// recompute rowsum(dout * o) for all queries of its (batch, head); ours is computed once, before.
template <class K>
__global__ void __launch_bounds__(K::AK::kNumThreads, K::AK::kMinBlocksPerSm)
    ex41_bwd_kernel(typename K::AK::Params p) {
  pdl_enter();
  using AK = typename K::AK;
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

template <class E, int Queries, int Keys, int MaxK>
const void* AttentionEx41Bwd<E, Queries, Keys, MaxK>::kernel_fn() {
  return reinterpret_cast<const void*>(ex41_bwd_kernel<AttentionEx41Bwd>);
}

// Key splits: enough blocks to fill the GPU once (each split adds its dq into an fp32 buffer, in
// the order the splits take its lock); one when asked to be deterministic (one block per head walks
// the key blocks in order).
template <class E, int Queries, int Keys, int MaxK>
int AttentionEx41Bwd<E, Queries, Keys, MaxK>::key_splits(const cvt_attnbwd_args& a) {
  if (a.deterministic) return 1;
  static std::once_flag once[kMaxDevices];
  static int per_sm[kMaxDevices];
  const int dev = a.device_id;
  if (dev < 0 || dev >= kMaxDevices) return 1;
  std::call_once(once[dev], [&] {
    int v = 0;
    if (!smem_ready<AttentionEx41Bwd>(kernel_fn(), kSmemBytes, dev) ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, ex41_bwd_kernel<AttentionEx41Bwd>, int(AK::kNumThreads),
                                                      kSmemBytes) != cudaSuccess) {
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

template <class E, int Queries, int Keys, int MaxK>
bool AttentionEx41Bwd<E, Queries, Keys, MaxK>::make_params(const cvt_attnbwd_args& a, typename AK::Params& p) {
  const int64_t hd = a.heads * a.head_dim;
  // The kernel writes dq/dk/dv rows H*D apart and reads o that way.
  if (a.o_stride_m != hd || a.dq_stride_m != hd || a.dk_stride_m != hd || a.dv_stride_m != hd) return false;
  if (a.head_dim > MaxK) return false;
  p.query_ptr = static_cast<E*>(const_cast<void*>(a.q));
  p.key_ptr = static_cast<E*>(const_cast<void*>(a.k));
  p.value_ptr = static_cast<E*>(const_cast<void*>(a.v));
  p.logsumexp_ptr = const_cast<float*>(a.lse);
  p.output_ptr = static_cast<E*>(const_cast<void*>(a.o));
  p.grad_output_ptr = static_cast<E*>(const_cast<void*>(a.dout));
  p.grad_query_ptr = static_cast<E*>(a.dq);
  p.grad_key_ptr = static_cast<E*>(a.dk);
  p.grad_value_ptr = static_cast<E*>(a.dv);
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

template <class E, int Queries, int Keys, int MaxK>
int AttentionEx41Bwd<E, Queries, Keys, MaxK>::launch(const cvt_attnbwd_args& a, void* workspace,
                                                      cudaStream_t stream) {
  if (!smem_ready<AttentionEx41Bwd>(kernel_fn(), kSmemBytes, a.device_id)) return CVT_ERR_SMEM;
  typename AK::Params p;
  if (!make_params(a, p)) return CVT_ERR_INVALID_PROBLEM;
  float* delta = static_cast<float*>(workspace);
  float* lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(a));
  p.delta_ptr = delta;
  p.logsumexp_ptr = lse;  // the copy with +inf padding: the kernel reads whole blocks of rows
  const size_t accum = size_t(p.workspace_size());
  p.workspace = accum ? reinterpret_cast<float*>(static_cast<char*>(workspace) + 2 * delta_bytes(a)) : nullptr;
  const bool zero = accum && p.should_zero_workspace();  // zeroed by the delta kernel
  launch_delta<E>(a, delta, delta_ld(a), stream, lse, zero ? p.workspace : nullptr, zero ? accum : 0);
  launch_kernel(ex41_bwd_kernel<AttentionEx41Bwd>, p.getBlocksGrid(), p.getThreadsGrid(), kSmemBytes, stream, p);
  return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
}

}  // namespace cvt_kernel
