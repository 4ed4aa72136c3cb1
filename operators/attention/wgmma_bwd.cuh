// Fused multi-head attention backward on Hopper's wgmma, ours (sm_90a): head dim 64, fp16 and bf16,
// fp32 accumulation (operators/attention/abi.h: cvt_attnbwd_args). For CvT's long key lengths
// (stage 1: Lq 3136, Lkv 784, one head; stage 2: Lq 784, Lkv 196, three heads).
//
// One CTA per (128-key block, head, image), one CTA an SM: two math warpgroups of 64 keys each and a
// producer warpgroup. K and V stay in shared memory; the queries come 64 at a time through three
// buffers, which the producer's first warp fills by cp.async (a full and an empty mbarrier per
// buffer; two blocks in flight) while the math warpgroups compute: their proxy fences wait for no
// loads, and they meet only each other. In deterministic mode the producer's second warp (one lane,
// the dq warp) issues dq's bulk reduce-adds from the staging tiles the math warpgroups fill (a full
// and an empty mbarrier per tile, two tiles a half) and waits for their turns, so no math thread
// waits for a turn. Per query block, warpgroup w
// (keys 64w..64w+63) works on transposed scores (keys x queries), so P^T and dS^T come out of the
// first GEMMs in the register layout the next ones take as their A operand:
//   S^T = K_w q^T, dP^T = V_w dout^T             wgmma SS, 64 x 64 x 64 each
//   P^T = exp(scale S^T - lse), 0 past Lkv       (2^(scale log2(e) S^T - lse log2(e)), ex2.approx.ftz;
//                                                the delta pass copies lse log2(e), +inf past Lq: P = 0)
//   dv_w += P^T dout                             wgmma RS, issued as soon as P^T is
//   dS^T / scale = P^T (dP^T - delta)            (delta = rowsum(dout * o) - dlse: a pass before;
//                                                the scale goes on dk when stored, dq when staged)
//   dk_w += dS^T q                               wgmma RS
//   dS^T -> shared memory (16-bit), barrier      (every warpgroup's keys; two buffers)
//   dq^T[:, 32h..32h+31] = K^T dS[half h]^T      wgmma SS 64 x 32 x Keys: the warpgroups split the
//                                                64 queries (halves h), each over all the CTA's keys
//   then the next block's S^T and dP^T are issued, and run while dq is staged
// so the tensor cores have the dv / dk GEMMs while dS^T is stored and the warpgroups meet, and the
// next block's S^T and dP^T while dq is staged. (The next block waits for both S^T and dP^T: with a
// wait for S^T alone, its P^T overlapping dP^T, ptxas 13.0 serializes every GEMM of the kernel.)
//   dq reduce-added into an fp32 buffer by one bulk copy per half (cp.reduce.async.bulk .add.f32,
//   issued by the warpgroup's thread 0, or in deterministic mode by the dq warp)
//   of its 32 x 64 values, staged in shared memory in the accumulator's own order (each thread's
//   values as 16-byte chunks, chunk k of every thread before chunk k + 1: four 16-byte stores a
//   thread, no bank conflicts), the buffer's tiles in that order too; the dq pass after the
//   kernel puts them back in rows
// dk and dv (fp32 registers) are stored once at the end. The passes around the kernel are
// attention/bwd_common.cuh's rowsum(dout * o) with the lse copied into padded rows and the fp32
// dq buffer zeroed (one launch) before, dq_rows_kernel's conversion after. dq's sums arrive in
// whatever order the CTAs reach them, or in deterministic mode (the launch's `deterministic`) in
// key-block order: a counter per query block and half, which the dq warp of key block kb's CTA waits
// to read kb before its add and raises once the add is performed (the CTAs of lower key blocks start
// first: they come first in the grid's linear order, as the GPU dispatches them).
//
// Shared memory (Keys 128: ~149 KB): K, V (Keys x 64), three buffers each of q and
// dout (64 x 64) in the K-major 128-byte-swizzled layout wgmma reads, two buffers of dS^T (Keys x
// 64 queries, as two 32-query halves in the 64-byte-swizzled layout), dq staging tiles per half
// (two buffers), lse and delta, the mbarriers.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/numeric_conversion.h"
#include "cute/tensor.hpp"
#include "attention/abi.h"
#include "attention/bwd_common.cuh"
#include "common/mma_sync.cuh"
#include "common/device.cuh"
#include "common/pdl.cuh"

namespace cvt_kernel {
namespace wgmma_bwd {
using namespace cute;

// Keys per CTA (a template parameter, Keys): 128, 64 per math warpgroup (the kernel asserts it; one
// warpgroup, two CTAs an SM, measured slower on the H100 and spilled).
constexpr int kQueries = 64;   // queries per block
constexpr int kDim = 64;       // the head dim served
template <int Keys>
constexpr int kMath = 2 * Keys;  // the math warpgroups' threads, 128 per warpgroup
template <int Keys>  // and a producer warpgroup (a loader warp; a dq lane in deterministic mode)
constexpr int kThreads = kMath<Keys> + 128;
// setmaxnreg: 2 x 128 x math + 128 x producer = 384 x 168, the registers a CTA of 384 threads is
// launched with. With the dq warp (deterministic mode), 232 / 40 spilled 8 bytes in the loader's
// loop (nvcc 13.0); without it, 224 / 56 ran 1-2% slower (H100, batch 128, 2026-12-06).
constexpr uint32_t math_regs(bool ordered) { return ordered ? 224 : 232; }
constexpr uint32_t producer_regs(bool ordered) { return ordered ? 56 : 40; }
constexpr int kHalves = 1;  // the 32-query halves of dq each warpgroup computes (two warpgroups: 64 queries)
constexpr int kDqTile = 32 * kDim;  // floats of one staged dq half (32 queries x 64), in accumulator order
constexpr int kStages = 3;        // buffers of q, dout, lse and delta
constexpr int kDqBufs = 2;  // dq staging buffers per half: block j's while block j - 1's bulk copies read

template <class E, int Rows>
using KMajor = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<Rows>, Int<kDim>>{}));
template <class E>
using Staged = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kQueries>, Int<kDim>, Int<kStages>>{}));
template <class E, int Keys>  // dS^T: (keys, 32 queries, half, buffer)
using DsLayout = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<E>{}, Shape<Int<Keys>, _32, _2, _2>{}));

// Transposed views of the same bytes (wgmma reads them MN-major).
template <class E>  // (d, q, stage)
using StagedT = decltype(composition(Staged<E>{}, make_layout(Shape<Int<kDim>, Int<kQueries>, Int<kStages>>{},
                                                               Stride<Int<kQueries>, _1, Int<kQueries * kDim>>{})));
template <class E, int Keys>  // (d, keys)
using KT = decltype(composition(KMajor<E, Keys>{}, make_layout(Shape<Int<kDim>, Int<Keys>>{},
                                                               Stride<Int<Keys>, _1>{})));
template <class E, int Keys>  // (q, keys, half, buffer)
using DsT = decltype(composition(DsLayout<E, Keys>{}, make_layout(Shape<_32, Int<Keys>, _2, _2>{},
                                                                  Stride<Int<Keys>, _1, Int<Keys * 32>, Int<Keys * 64>>{})));

template <class E, int Keys>
struct Smem {
  E k[Keys * kDim];
  E v[Keys * kDim];
  E q[kStages * kQueries * kDim];
  E dout[kStages * kQueries * kDim];
  E ds[2 * Keys * kQueries];  // dS^T of two query blocks: one written while the other feeds dq
  float dq[2][kDqBufs][kDqTile];  // dq staging: per 32-query half
  float lse[kStages][kQueries];
  float delta[kStages][kQueries];
  uint64_t full[kStages];   // mbarriers: a stage's rows loaded (the producer warp's 32 lanes arrive)
  uint64_t empty[kStages];  // a stage read (every math thread arrives)
  uint64_t dq_full[2][kDqBufs];   // a dq staging tile written (its warpgroup's 128 threads arrive)
  uint64_t dq_empty[2][kDqBufs];  // a dq staging tile read by its bulk copy (the dq warp arrives)
};
constexpr int kAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes of address

template <class E, int Keys>
struct Mmas {
  using SdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<E, E, float, Shape<_64, _64, _64>, GMMA::Major::K, GMMA::Major::K>()));
  using KV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<E, E, float, Shape<_64, _64, _64>, GMMA::Major::K, GMMA::Major::MN>()));
  using DQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<E, E, float, Shape<_64, _32, Int<Keys>>, GMMA::Major::MN, GMMA::Major::MN>()));
};

// Where things are, as CuTe's layouts above place them (tests/cuda/wgmma_bwd_layouts.cu checks
// these against CuTe): element (r, c) of a (rows x 64) K-major tile with the 128-byte swizzle
// (16-byte chunk c / 8 of row r at chunk (c / 8) ^ (r % 8)); element (key, q) of dS^T (the
// 64-byte swizzle, queries 32 a half); value i of thread t's fp32 accumulator of an m64nN wgmma
// (t: the thread of its warpgroup) at row acc_row(t, i), column acc_col(t, i).
__host__ __device__ constexpr int sw128_offset(int r, int c) { return r * 64 + (((c >> 3) ^ (r & 7)) << 3) + (c & 7); }
template <int Keys>
__host__ __device__ constexpr int ds_offset(int key, int q) {
  return (q >> 5) * (Keys * 32) + key * 32 + ((((q & 31) >> 3) ^ ((key >> 1) & 3)) << 3) + (q & 7);
}
__host__ __device__ constexpr int acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2); }
__host__ __device__ constexpr int acc_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + i % 2; }

// 2^x, flushing results below 2^-126 to 0 (probabilities that small do not matter): one MUFU.EX2.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float2 lds2(uint32_t a) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void sts(uint32_t a, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v)); }
__device__ __forceinline__ void sts4(uint32_t a, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "f"(x), "f"(y), "f"(z), "f"(w));
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// dst[0, bytes) += src (fp32): a bulk copy into this thread's open bulk group (bulk_commit closes it).
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk groups but the newest one have read their shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_last() {
  asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Deterministic mode's turns (one counter per query block and half, zeroed before the launch): the
// CTA of key block `turn` waits until the CTAs of the key blocks before it have added their dq
// (acquire; then a proxy fence: the bulk reduce-add that follows is the async proxy's), and passes
// the turn on once its own adds are performed (the caller waits for them to complete, not only to
// be read; then a gpu-scope release). The dq warp waits and passes (add_dq): the math warpgroups
// only wait for a free staging tile.
__device__ __forceinline__ void wait_turn(const int* counter, int turn) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  } while (v != turn);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void pass_turn(int* counter) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// Rows of a (rows x 64) 16-bit tile at `tile` (shared, 1024-byte aligned), by Threads threads (the
// math warpgroups'), 16 bytes each: thread tid takes chunk tid % 8 of rows tid / 8 + (Threads / 8) m.
// Global rows `stride` elements apart; rows >= valid are zero-filled.
template <int Rows, int Threads, class E>
__device__ __forceinline__ void load_rows(uint32_t tile, const E* g, int64_t stride, int valid, int tid) {
  constexpr int pass = Threads / 8;  // rows per pass, a multiple of 8: each row keeps its swizzle
  const int r = tid / 8, ch = tid % 8;
  const uint32_t dst = tile + 2 * sw128_offset(r, ch * 8);
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < Rows / pass; ++m) {
    const bool in = r + pass * m < valid;
    cp_async16(dst + m * pass * 128, in ? g + (r + pass * m) * stride + ch * 8 : g, in);
  }
}

// The accumulator of an m64nN wgmma, ((2, 2, N / 8), M, N), re-viewed as the A operand of RS wgmmas
// over k = N: ((2, 2, 2), M, N / 16) (two 8-column groups make one 16-wide k step).
template <class Layout>
__device__ __forceinline__ auto acc_as_operand_a(Layout l) {
  auto groups = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(groups), get<2>(l))));
}

template <class E, class Acc, class Out>
__device__ __forceinline__ void to_element(const Acc& acc, Out& out) {
  constexpr int n = decltype(size(acc))::value;
  cutlass::NumericArrayConverter<E, float, n> convert;
  *reinterpret_cast<cutlass::Array<E, n>*>(out.data()) =
      convert(*reinterpret_cast<const cutlass::Array<float, n>*>(acc.data()));
}

// c (=|+=) a b over the k steps of the fragments (zero: the first step overwrites c).
template <class Mma, class A, class B, class C>
__device__ __forceinline__ void wg_gemm(Mma& mma, const A& a, const B& b, C& c, bool zero) {
  mma.accumulate_ = zero ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

// d = a b for one 64 x 64 x 16 step of an SS wgmma (K-major A and B, descriptors da, db) that only
// writes d: CuTe's wgmma reads its accumulators even when told to overwrite them, which keeps a loop-
// carried accumulator's old values alive (registers) or has ptxas serialize the GEMMs.
template <class E, class Acc>
__device__ __forceinline__ void ss_overwrite_64x64x16(uint64_t da, uint64_t db, Acc& d) {
  static_assert(decltype(size(d))::value == 32, "a 64 x 64 fp32 accumulator of one warpgroup");
#define CVT_D8(i) "=f"(d(i)), "=f"(d(i + 1)), "=f"(d(i + 2)), "=f"(d(i + 3)), "=f"(d(i + 4)), "=f"(d(i + 5)), \
                  "=f"(d(i + 6)), "=f"(d(i + 7))
#define CVT_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
                 "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
  static_assert(std::is_same_v<E, cutlass::half_t> || std::is_same_v<E, cutlass::bfloat16_t>, "fp16 or bf16");
  if constexpr (std::is_same_v<E, cutlass::half_t>)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " CVT_REGS
                 : CVT_D8(0), CVT_D8(8), CVT_D8(16), CVT_D8(24) : "l"(da), "l"(db));
  else
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " CVT_REGS
                 : CVT_D8(0), CVT_D8(8), CVT_D8(16), CVT_D8(24) : "l"(da), "l"(db));
#undef CVT_REGS
#undef CVT_D8
}

// c = a b over the k steps of an SS 64 x 64 GEMM's fragments, c only written by its first step.
template <class E, class Mma, class A, class B, class C>
__device__ __forceinline__ void wg_gemm_overwrite(Mma& mma, const A& a, const B& b, C& c) {
  ss_overwrite_64x64x16<E>(uint64_t(a(_0{}, _0{}, 0)), uint64_t(b(_0{}, _0{}, 0)), c);
  mma.accumulate_ = GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 1; k < size<2>(a); ++k) cute::gemm(mma, a(_, _, k), b(_, _, k), c);
}

// What a CTA reads: its (batch, head) bases and where the lse / delta rows are.
template <class E>
struct Ctx {
  const E *q, *k, *v, *dout;
  const float *lse, *delta;  // this (batch, head)'s padded rows
  int lq, lkv, key0;
};

// Query block j's q and dout rows, lse and delta into buffer buf by the producer warp (lane: its
// lane; one cp.async group, committed). The row loop is not unrolled: the producer has 40 or 56 registers.
template <class E, int Keys>
__device__ __forceinline__ void load_block(const cvt_attnbwd_args& a, const Ctx<E>& c, Smem<E, Keys>& sm, int j,
                                           int buf, int lane) {
  const int row0 = j * kQueries, r = lane / 4, ch = 2 * (lane % 4);  // rows r + 8m, 16-byte chunks ch, ch + 1
  const uint32_t q_dst = smem_u32(sm.q + buf * kQueries * kDim), do_dst = smem_u32(sm.dout + buf * kQueries * kDim);
  const uint32_t at0 = 2 * sw128_offset(r, ch * 8), at1 = 2 * sw128_offset(r, ch * 8 + 8);  // rows 8 apart: one swizzle
  const E* q = c.q + (row0 + r) * a.q_stride_m + ch * 8;
  const E* dout = c.dout + (row0 + r) * a.do_stride_m + ch * 8;
#pragma unroll 1
  for (int m = 0; m < kQueries / 8; ++m) {
    const bool in = row0 + r + 8 * m < c.lq;
    const E* qm = in ? q + 8 * m * a.q_stride_m : c.q;
    const E* dm = in ? dout + 8 * m * a.do_stride_m : c.dout;
    cp_async16(q_dst + at0 + m * 8 * 128, qm, in);
    cp_async16(q_dst + at1 + m * 8 * 128, in ? qm + 8 : c.q, in);
    cp_async16(do_dst + at0 + m * 8 * 128, dm, in);
    cp_async16(do_dst + at1 + m * 8 * 128, in ? dm + 8 : c.dout, in);
  }
  // 16 chunks each of lse and delta: the rows are padded to whole blocks
  const float* src = (lane < 16 ? c.lse : c.delta) + row0 + (lane % 16) * 4;
  cp_async16(smem_u32((lane < 16 ? sm.lse[buf] : sm.delta[buf]) + (lane % 16) * 4), src, true);
  cute::cp_async_fence();
}

// The per-query values (the lse in base 2, delta) of this thread's accumulator columns c0 + 8n and
// c0 + 8n + 1, read from shared memory into registers before the GEMM they go with is waited for.
template <int N>
struct Columns {
  float2 v[N];
  __device__ __forceinline__ void load(uint32_t row, int c0) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < N; ++n) v[n] = lds2(row + 4 * (c0 + 8 * n));
  }
};

// S^T -> P^T in place: P = 2^(scale log2(e) S - lse log2(e)) with the lse per column (query); with
// Masked, rows (keys) at or past keys_valid are 0. Values 4n..4n+3: rows r0 and r0 + 8 of columns
// c0 + 8n, + 1.
template <bool Masked, class Acc, int N>
__device__ __forceinline__ void probabilities(Acc& s, const Columns<N>& lse2, float scale_log2, int r0,
                                              int keys_valid) {
  CUTLASS_PRAGMA_UNROLL
  for (int n = 0; n < N; ++n) {
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const bool in = !Masked || r0 + 8 * h < keys_valid;
      s(4 * n + 2 * h) = in ? exp2_ftz(fmaf(s(4 * n + 2 * h), scale_log2, -lse2.v[n].x)) : 0.f;
      s(4 * n + 2 * h + 1) = in ? exp2_ftz(fmaf(s(4 * n + 2 * h + 1), scale_log2, -lse2.v[n].y)) : 0.f;
    }
  }
}

// dP^T -> dS^T / scale in place: P (dP - delta), delta per column (the softmax scale is applied to
// dk when it is stored and to dq when it is staged).
template <class Acc, int N>
__device__ __forceinline__ void score_grads(const Acc& p, Acc& dp, const Columns<N>& delta) {
  CUTLASS_PRAGMA_UNROLL
  for (int n = 0; n < N; ++n) {
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      dp(4 * n + 2 * h) = p(4 * n + 2 * h) * (dp(4 * n + 2 * h) - delta.v[n].x);
      dp(4 * n + 2 * h + 1) = p(4 * n + 2 * h + 1) * (dp(4 * n + 2 * h + 1) - delta.v[n].y);
    }
  }
}

template <class E>
__device__ __forceinline__ uint32_t pair_bits(E lo, E hi) {
  return uint32_t(reinterpret_cast<const uint16_t&>(lo)) | (uint32_t(reinterpret_cast<const uint16_t&>(hi)) << 16);
}

// This warpgroup's dS^T (keys 64w + r0 (+ 8), columns c0 + 8n (+ 1)) into shared memory, two
// adjacent queries (one 32-bit store) at a time.
template <int Keys, class Frag>
__device__ __forceinline__ void store_ds(const Frag& ds, uint32_t base, int key0, int c0) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(ds); i += 2) {
    const int key = key0 + 8 * ((i / 2) % 2), q = c0 + 8 * (i / 4);
    sts(base + 2 * ds_offset<Keys>(key, q), pair_bits(ds(i), ds(i + 1)));
  }
}

// Where a CTA's dq goes: its (batch, head)'s fp32 tiles (one per query block and half), and in
// deterministic mode its turn counters (two per query block, one per half; else null).
struct DqOut {
  float* tiles;
  int* turns;
};

// dq^T of this warpgroup's half w scaled into its staging tile of block `block`'s buffer, in
// accumulator order (thread t's values 4k..4k+3 at floats 4 (128 k + t): dq_rows_kernel's order).
template <class Acc>
__device__ __forceinline__ void write_dq(const Acc& dq, float scale, uint32_t tile, int t) {
  static_assert(kHalves == 1, "one staging tile a warpgroup");
  static_assert(decltype(size<0>(dq))::value * 128 == kDqTile, "16 values a thread");
  const uint32_t base = tile + 16 * t;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < 4; ++k)
    sts4(base + k * 128 * 16, scale * dq(4 * k, 0, 0), scale * dq(4 * k + 1, 0, 0), scale * dq(4 * k + 2, 0, 0),
         scale * dq(4 * k + 3, 0, 0));
  cutlass::arch::fence_view_async_shared();  // visible to the bulk copy (the async proxy)
}

// Default mode: dq^T of this warpgroup's half staged (write_dq), then reduce-added into out's tile
// by the warpgroup's thread 0 (one bulk group a block). The staging tile must be free: meet() has
// waited for the bulk copies that read it.
template <class Acc, class Sm>
__device__ __forceinline__ void reduce_dq(const Acc& dq, float scale, Sm& sm, int block, DqOut out, int w, int t) {
  const uint32_t tile = smem_u32(sm.dq[w][block % kDqBufs]);
  write_dq(dq, scale, tile, t);
  named_sync(2 + w, 128);
  if (t != 0) return;
  bulk_reduce_add(out.tiles + int64_t(2 * block + w) * kDqTile, tile, kDqTile * 4);
  bulk_commit();
}

// Deterministic mode: dq^T of this warpgroup's half w (64 d x 32 queries: value i at d = acc_row,
// query = acc_col) staged (write_dq) into block `block`'s buffer once the dq warp's bulk copy has read
// the block two before from it; then the warpgroup's threads arrive on the tile's full barrier
// (add_dq takes it).
template <class Acc, class Sm>
__device__ __forceinline__ void stage_dq(const Acc& dq, float scale, Sm& sm, int block, int w, int t) {
  const int buf = block % kDqBufs;
  if (block >= kDqBufs) cutlass::arch::ClusterBarrier::wait(&sm.dq_empty[w][buf], (block / kDqBufs - 1) & 1);
  write_dq(dq, scale, smem_u32(sm.dq[w][buf]), t);
  cutlass::arch::ClusterBarrier::arrive(&sm.dq_full[w][buf]);
}

// Deterministic mode's dq warp (one lane of the producer warpgroup): each query block's two staged
// halves into the fp32 tiles by one bulk reduce-add each, each after its turn (one bulk group a
// block); the turns are passed once the adds are performed, then the staging tiles freed (freeing
// them once read, before the adds land, measured no faster: stage 1 +31.5% over the default kernel
// against +27% on another H100, 2026-12-06). The math warpgroups never wait for turns. (Its spin
// issues one load per L2 round trip: no backoff.)
template <class Sm>
__device__ __forceinline__ void add_dq(Sm& sm, int blocks, DqOut out) {
  for (int j = 0; j < blocks; ++j) {
    const int buf = j % kDqBufs;
    int* turns = out.turns + 2 * j;  // the block's two halves' counters
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      cutlass::arch::ClusterBarrier::wait(&sm.dq_full[h][buf], (j / kDqBufs) & 1);
      wait_turn(turns + h, int(blockIdx.x));
      bulk_reduce_add(out.tiles + int64_t(2 * j + h) * kDqTile, smem_u32(sm.dq[h][buf]), kDqTile * 4);
    }
    bulk_commit();
    bulk_wait_all();  // performed, not only read: the next key block's CTA adds after these
    pass_turn(turns);
    pass_turn(turns + 1);
    cutlass::arch::ClusterBarrier::arrive(&sm.dq_empty[0][buf]);
    cutlass::arch::ClusterBarrier::arrive(&sm.dq_empty[1][buf]);
  }
}

// rows [0, valid) of scale times a 64 x 64 fp32 accumulator (row = key, column = d) to dst (16-bit,
// rows stride apart), two adjacent columns per store.
template <class E, class Acc>
__device__ __forceinline__ void store_kv(const Acc& acc, float scale, E* dst, int64_t stride, int valid, int t) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int r = acc_row(t, i), d = acc_col(t, i);
    if (r < valid)
      *reinterpret_cast<uint32_t*>(dst + r * stride + d) = pair_bits(E(scale * acc(i)), E(scale * acc(i + 1)));
  }
}

template <class E, int Keys>
__device__ __forceinline__ Smem<E, Keys>& smem_of(char* raw) {
  return *reinterpret_cast<Smem<E, Keys>*>((reinterpret_cast<uintptr_t>(raw) + kAlign - 1) & ~uintptr_t(kAlign - 1));
}

template <class E, int Keys>
__device__ __forceinline__ Ctx<E> context(const cvt_attnbwd_args& a, const float* lse, const float* delta,
                                          int64_t lq_pad) {
  const int64_t b = blockIdx.z, h = blockIdx.y, bh = b * a.heads + h;
  const int key0 = blockIdx.x * Keys;
  return {static_cast<const E*>(a.q) + b * a.q_stride_b + h * a.q_stride_h,
          static_cast<const E*>(a.k) + b * a.k_stride_b + h * a.k_stride_h + key0 * a.k_stride_m,
          static_cast<const E*>(a.v) + b * a.v_stride_b + h * a.v_stride_h + key0 * a.v_stride_m,
          static_cast<const E*>(a.dout) + b * a.do_stride_b + h * a.do_stride_h,
          lse + bh * lq_pad, delta + bh * lq_pad, int(a.lq), int(a.lkv), key0};
}

// The GEMMs of one warpgroup: its MMAs and their shared-memory operands (descriptors).
template <class E, int Keys>
struct WgGemms {
  using M = Mmas<E, Keys>;
  typename M::SdP sdp;
  typename M::KV kv;
  typename M::DQ dq;
  decltype(sdp.get_thread_slice(0).partition_fragment_A(make_tensor(make_smem_ptr((E*)nullptr), KMajor<E, 64>{}))) k, v;
  decltype(sdp.get_thread_slice(0).partition_fragment_B(make_tensor(make_smem_ptr((E*)nullptr), Staged<E>{}))) q, dout;
  decltype(kv.get_thread_slice(0).partition_fragment_B(make_tensor(make_smem_ptr((E*)nullptr), StagedT<E>{}))) qt, doutt;
  decltype(dq.get_thread_slice(0).partition_fragment_A(make_tensor(make_smem_ptr((E*)nullptr), KT<E, Keys>{}))) kt;
  decltype(dq.get_thread_slice(0).partition_fragment_B(
      make_tensor(make_smem_ptr((E*)nullptr), DsT<E, Keys>{}))) ds;  // (.., half, buffer)

  __device__ WgGemms(Smem<E, Keys>& sm, int w, int t) {
    auto s = sdp.get_thread_slice(t);
    auto k_ = kv.get_thread_slice(t);
    auto d = dq.get_thread_slice(t);
    k = s.partition_fragment_A(make_tensor(make_smem_ptr(sm.k + w * 64 * kDim), KMajor<E, 64>{}));
    v = s.partition_fragment_A(make_tensor(make_smem_ptr(sm.v + w * 64 * kDim), KMajor<E, 64>{}));
    q = s.partition_fragment_B(make_tensor(make_smem_ptr(sm.q), Staged<E>{}));
    dout = s.partition_fragment_B(make_tensor(make_smem_ptr(sm.dout), Staged<E>{}));
    qt = k_.partition_fragment_B(make_tensor(make_smem_ptr(sm.q), StagedT<E>{}));
    doutt = k_.partition_fragment_B(make_tensor(make_smem_ptr(sm.dout), StagedT<E>{}));
    kt = d.partition_fragment_A(make_tensor(make_smem_ptr(sm.k), KT<E, Keys>{}));
    ds = d.partition_fragment_B(make_tensor(make_smem_ptr(sm.ds), DsT<E, Keys>{}));
  }

  // acc(_, _, n) = K^T dS^T of query half h0 + n (all of the CTA's keys) from dS^T buffer buf.
  template <class Acc>
  __device__ __forceinline__ void dq_halves(Acc& acc, int h0, int buf) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kHalves; ++n) {
      auto half = acc(_, _, n);  // (MMA, M): back to (MMA, M, N = 1) for the GEMM
      auto out = make_tensor(half.data(), append(half.layout(), Layout<_1, _0>{}));
      wg_gemm(dq, kt, ds(_, _, _, h0 + n, buf), out, true);
    }
  }
};

// The S^T and dP^T GEMMs of the query block in stage st (one wgmma group each).
template <class E, int Keys, class Acc>
__device__ __forceinline__ void issue_scores(WgGemms<E, Keys>& g, Acc& acc_s, Acc& acc_dp, int st) {
  warpgroup_fence_operand(acc_s);
  warpgroup_fence_operand(acc_dp);
  warpgroup_arrive();
  wg_gemm_overwrite<E>(g.sdp, g.k, g.q(_, _, _, st), acc_s);
  warpgroup_commit_batch();
  wg_gemm_overwrite<E>(g.sdp, g.v, g.dout(_, _, _, st), acc_dp);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc_s);
  warpgroup_fence_operand(acc_dp);
}

// dq^T of this warpgroup's query halves from dS^T buffer buf (one wgmma group).
template <class E, int Keys, class Acc>
__device__ __forceinline__ void issue_dq(WgGemms<E, Keys>& g, Acc& acc_dq, int w, int buf) {
  warpgroup_fence_operand(acc_dq);
  warpgroup_arrive();
  g.dq_halves(acc_dq, w * kHalves, buf);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc_dq);
}

// acc += a16 b (wgmma RS, one group): a16 holds an accumulator's 16-bit values, read by the
// tensor cores until the group completes (the caller fences it after the wait).
template <class Mma, class Frag, class B, class Acc>
__device__ __forceinline__ void issue_rs(Mma& mma, Frag& a16, const B& b, Acc& acc) {
  warpgroup_fence_operand(a16);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  wg_gemm(mma, make_tensor(a16.data(), acc_as_operand_a(a16.layout())), b, acc, false);
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// What a warpgroup carries from one query block to the next: dv and dk, and the block's S^T and
// dP^T (issued at the end of the block before, in flight). Only wgmma writes dv and dk once a
// GEMM is in flight, and S^T / dP^T's first k step only writes them (ss_overwrite_64x64x16):
// else ptxas serializes the GEMMs.
template <class E, int Keys>
struct Carried {
  using Acc = decltype(partition_fragment_C(typename Mmas<E, Keys>::SdP{}, Shape<_64, _64>{}));
  Acc s, dp, dv, dk;
};

template <class E, int Keys>
using DqAcc = decltype(partition_fragment_C(typename Mmas<E, Keys>::DQ{}, Shape<_64, Int<32 * kHalves>>{}));

// Block j's rows landed (this lane's cp.async groups but the newest `pending`), visible to wgmma (the
// async proxy): the lane arrives on the stage's full barrier.
template <int Pending, class E, int Keys>
__device__ __forceinline__ void signal_loaded(Smem<E, Keys>& sm, int j) {
  cute::cp_async_wait<Pending>();
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::ClusterBarrier::arrive(&sm.full[j % kStages]);
}

// The producer warp: every query block's rows into the stages, a stage refilled once both math
// warpgroups have read it (its empty barrier); block j - 1 is signalled once block j's loads are
// issued, so two blocks' loads are in flight.
template <class E, int Keys>
__device__ __forceinline__ void produce(const cvt_attnbwd_args& a, const Ctx<E>& c, Smem<E, Keys>& sm, int blocks,
                                       int lane) {
  for (int j = 0; j < blocks; ++j) {
    if (j >= kStages) cutlass::arch::ClusterBarrier::wait(&sm.empty[j % kStages], (j / kStages - 1) & 1);
    load_block(a, c, sm, j, j % kStages, lane);
    if (j > 0) signal_loaded<1>(sm, j - 1);
  }
  signal_loaded<0>(sm, blocks - 1);
}

// Block j's rows loaded (its full barrier's phase).
template <class E, int Keys>
__device__ __forceinline__ void wait_loaded(Smem<E, Keys>& sm, int j) {
  cutlass::arch::ClusterBarrier::wait(&sm.full[j % kStages], (j / kStages) & 1);
}

// The math warpgroups meet: every thread's dS^T stores visible to wgmma (the async proxy) before
// either warpgroup's dq GEMM reads them; in default mode also the dq staging tiles written next
// free (thread 0's bulk copies that read them done: the last block's may still run, two buffers a
// half). In deterministic mode the dq warp frees them (stage_dq waits).
template <int Keys, bool Ordered>
__device__ __forceinline__ void meet(int t) {
  cutlass::arch::fence_view_async_shared();
  if (!Ordered && t == 0) bulk_wait_read_all_but_last();
  named_sync(1, kMath<Keys>);
}

// Query block j (stage j % kStages) of one warpgroup, entered with its S^T and dP^T in flight (see
// the header): P^T (dv issued), dS^T (dk issued), dS^T stored; the warpgroups meet; the block's
// dq^T and the next block's S^T and dP^T issued (after the last block: of a stage that holds an
// older block or nothing yet, results never read), dq staged (and in default mode reduce-added) while
// the latter run. (dS^T is stored before the dk GEMM that reads its registers is issued: PTX leaves
// any access to them undefined until the wait.)
template <bool Ordered, class E, int Keys>
__device__ __forceinline__ void query_block(const cvt_attnbwd_args& a, WgGemms<E, Keys>& g,
                                            Smem<E, Keys>& sm, Carried<E, Keys>& r, int j, int blocks,
                                            DqOut out, int keys_valid, int w, int tid) {
  const int t = tid % 128, st = j % kStages, r0 = acc_row(t, 0), c0 = acc_col(t, 0);
  constexpr int cols = decltype(size(r.s))::value / 4;
  Columns<cols> lse2, delta;
  lse2.load(smem_u32(sm.lse[st]), c0);
  delta.load(smem_u32(sm.delta[st]), c0);
  warpgroup_wait<0>();  // S^T and dP^T (a wait for S^T alone here, ptxas 13.0 serializes every GEMM)
  warpgroup_fence_operand(r.s);
  warpgroup_fence_operand(r.dp);
  if (keys_valid >= 64)
    probabilities<false>(r.s, lse2, a.scale * float(M_LOG2E), r0, keys_valid);
  else
    probabilities<true>(r.s, lse2, a.scale * float(M_LOG2E), r0, keys_valid);
  Tensor p16 = make_tensor_like<E>(r.s), ds16 = make_tensor_like<E>(r.dp);
  to_element<E>(r.s, p16);
  issue_rs(g.kv, p16, g.doutt(_, _, _, st), r.dv);
  score_grads(r.s, r.dp, delta);
  to_element<E>(r.dp, ds16);
  store_ds<Keys>(ds16, smem_u32(sm.ds + (j & 1) * Keys * kQueries), 64 * w + r0, c0);  // before the GEMM reads them
  issue_rs(g.kv, ds16, g.qt(_, _, _, st), r.dk);
  meet<Keys, Ordered>(t);  // both warpgroups' dS^T stored (default mode: block j - 2's dq staging read)
  DqAcc<E, Keys> acc_dq;
  issue_dq(g, acc_dq, w, j & 1);
  if (j + 1 < blocks) wait_loaded(sm, j + 1);
  issue_scores(g, r.s, r.dp, (j + 1) % kStages);
  warpgroup_wait<2>();  // dq^T (and dv, dk: P^T and dS^T's registers are free, block j's stage read)
  warpgroup_fence_operand(acc_dq);
  warpgroup_fence_operand(p16);
  warpgroup_fence_operand(ds16);
  // every thread releases its own reads of the stage (lse, delta): a first lane arriving for its warp
  // after __syncwarp orders them as well by PTX's memory model, but compute-sanitizer's racecheck
  // reports those reads against the producer's next loads (H100, 2026-11-28)
  cutlass::arch::ClusterBarrier::arrive(&sm.empty[st]);
  if constexpr (Ordered)
    stage_dq(acc_dq, a.scale, sm, j, w, t);
  else
    reduce_dq(acc_dq, a.scale, sm, j, out, w, t);
}

// The math warpgroups' part of a CTA (w: the warpgroup, tid: the thread of both).
template <bool Ordered, class E, int Keys>
__device__ __forceinline__ void compute(const cvt_attnbwd_args& a, const Ctx<E>& c, Smem<E, Keys>& sm, int blocks,
                                        DqOut out, int w, int tid) {
  const int t = tid % 128;
  WgGemms<E, Keys> g(sm, w, t);
  Carried<E, Keys> r;
  clear(r.dv);  // zeroed before any GEMM is in flight (the fences keep the stores there)
  clear(r.dk);
  warpgroup_fence_operand(r.dv);
  warpgroup_fence_operand(r.dk);
  const int keys_valid = c.lkv - c.key0 - 64 * w;  // this warpgroup's keys below Lkv (may be <= 0)
  wait_loaded(sm, 0);
  issue_scores(g, r.s, r.dp, 0);
  for (int j = 0; j < blocks; ++j) query_block<Ordered>(a, g, sm, r, j, blocks, out, keys_valid, w, tid);
  warpgroup_wait<0>();
  warpgroup_fence_operand(r.s);
  warpgroup_fence_operand(r.dp);
  warpgroup_fence_operand(r.dv);
  warpgroup_fence_operand(r.dk);
  if (!Ordered && t == 0) bulk_wait_all();  // (deterministic mode: the dq warp's)
  const int64_t b = blockIdx.z, h = blockIdx.y, key = c.key0 + 64 * w;
  store_kv(r.dk, a.scale, static_cast<E*>(a.dk) + b * a.dk_stride_b + h * a.dk_stride_h + key * a.dk_stride_m,
           a.dk_stride_m, keys_valid, t);
  store_kv(r.dv, 1.f, static_cast<E*>(a.dv) + b * a.dv_stride_b + h * a.dv_stride_h + key * a.dv_stride_m,
           a.dv_stride_m, keys_valid, t);
}

// One CTA: keys [Keys blockIdx.x, +Keys) of head blockIdx.y of image blockIdx.z (see the header):
// two math warpgroups and a producer warpgroup, whose first warp loads the query blocks (and whose
// second warp's first lane adds dq in deterministic mode). Ordered
// (deterministic mode): dq added in key-block order by the turn counters (zeroed); else turns is
// not read and the order checks compile away.
template <class E, int Keys, bool Ordered>
__global__ void __launch_bounds__(kThreads<Keys>, 1)
    bwd_kernel(cvt_attnbwd_args a, const float* lse, const float* delta, float* dq_acc, int* turns, int64_t lq_pad) {
  pdl_enter();
  static_assert(Keys == 128, "two math warpgroups and a producer: one CTA an SM");
  extern __shared__ char smem_raw[];
  Smem<E, Keys>& sm = smem_of<E, Keys>(smem_raw);
  const int tid = threadIdx.x, w = tid / 128;
  const Ctx<E> c = context<E, Keys>(a, lse, delta, lq_pad);
  const int blocks = (c.lq + kQueries - 1) / kQueries;
  if (w < 2) {  // K and V by the math warpgroups
    load_rows<Keys, kMath<Keys>>(smem_u32(sm.k), c.k, a.k_stride_m, c.lkv - c.key0, tid);
    load_rows<Keys, kMath<Keys>>(smem_u32(sm.v), c.v, a.v_stride_m, c.lkv - c.key0, tid);
  }
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      cutlass::arch::ClusterBarrier::init(&sm.full[st], 32);
      cutlass::arch::ClusterBarrier::init(&sm.empty[st], kMath<Keys>);
    }
    if constexpr (Ordered)
      for (int h = 0; h < 2; ++h)
        for (int buf = 0; buf < kDqBufs; ++buf) {
          cutlass::arch::ClusterBarrier::init(&sm.dq_full[h][buf], 128);
          cutlass::arch::ClusterBarrier::init(&sm.dq_empty[h][buf], 1);
        }
    cutlass::arch::fence_barrier_init();
  }
  cute::cp_async_fence();
  cute::cp_async_wait<0>();
  cutlass::arch::fence_view_async_shared();
  __syncthreads();  // K, V and the barriers ready; no CTA-wide barrier after this
  const int64_t bh = int64_t(blockIdx.z) * a.heads + blockIdx.y;
  const DqOut out{dq_acc + bh * lq_pad * kDim, Ordered ? turns + bh * 2 * blocks : nullptr};
  if (w == 2) {  // the producer warpgroup: the loader warp (and in deterministic mode the dq warp's first lane)
    cutlass::arch::warpgroup_reg_dealloc<producer_regs(Ordered)>();
    if (tid % 128 < 32) produce(a, c, sm, blocks, tid % 32);
    if (Ordered && tid % 128 == 32) add_dq(sm, blocks, out);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<math_regs(Ordered)>();
  compute<Ordered>(a, c, sm, blocks, out, w, tid);
}

// dq in the caller's strides (E) from the fp32 buffer's tiles in accumulator order (write_dq): one
// CTA per (query block, head, image), its two halves' 16-byte chunks read in order and put in rows
// in shared memory (value m of thread t's chunk k: d = 16 (t / 32) + (t % 32) / 4 + 8 (m / 2), query
// 32 half + 8 k + 2 (t % 4) + m % 2, as acc_row / acc_col place them), then written 8 elements a store.
template <class E>
__global__ void __launch_bounds__(256) dq_rows_kernel(cvt_attnbwd_args a, const float* __restrict__ acc,
                                                      int64_t lq_pad) {
  pdl_enter();
  __shared__ float rows[kQueries][kDim + 4];
  const int64_t bh = int64_t(blockIdx.z) * a.heads + blockIdx.y, q0 = int64_t(blockIdx.x) * kQueries;
  const float4* src = reinterpret_cast<const float4*>(acc + (bh * lq_pad + q0) * kDim);
  for (int v = threadIdx.x; v < kQueries * kDim / 4; v += 256) {
    const float4 x = src[v];
    const int half = v / (kDqTile / 4), k = v / 128 % 4, t = v % 128;
    const int d = acc_row(t, 0), q = 32 * half + 8 * k + acc_col(t, 0);
    rows[q][d] = x.x;
    rows[q + 1][d] = x.y;
    rows[q][d + 8] = x.z;
    rows[q + 1][d + 8] = x.w;
  }
  __syncthreads();
  for (int v = threadIdx.x; v < kQueries * kDim / 8; v += 256) {
    const int r = v / (kDim / 8), d0 = v % (kDim / 8) * 8;
    if (q0 + r >= a.lq) continue;
    cutlass::Array<E, 8> out;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 8; ++e) out[e] = E(rows[r][d0 + e]);
    *reinterpret_cast<cutlass::Array<E, 8>*>(static_cast<E*>(a.dq) + blockIdx.z * a.dq_stride_b +
                                              (q0 + r) * a.dq_stride_m + blockIdx.y * a.dq_stride_h + d0) = out;
  }
}

}  // namespace wgmma_bwd

// 128 keys per CTA (two math warpgroups and a producer, one CTA an SM).
template <class Element_>
struct AttentionWgmmaBwd {
  static constexpr int Keys = 128;
  static constexpr int kFamily = CVT_FAMILY_ATTENTION_BWD;
  using Element = Element_;
  static constexpr int kSmemBytes = int(sizeof(wgmma_bwd::Smem<Element, Keys>)) + wgmma_bwd::kAlign;

  template <bool Ordered>
  struct Mode {};  // smem_ready's once-per-device flag of each instantiation
  template <bool Ordered>
  static const void* kernel_fn() {
    return reinterpret_cast<const void*>(wgmma_bwd::bwd_kernel<Element, Keys, Ordered>);
  }
  template <bool Ordered>
  static bool ready(const cvt_attnbwd_args& a) {
    return smem_ready<Mode<Ordered>>(kernel_fn<Ordered>(), kSmemBytes, a.device_id);
  }
  static int64_t lq_pad(const cvt_attnbwd_args& a) { return round_up(a.lq, wgmma_bwd::kQueries); }
  static size_t rows_bytes(const cvt_attnbwd_args& a) { return size_t(round_up(a.batch * a.heads * lq_pad(a) * 4, 256)); }
  static size_t dq_acc_bytes(const cvt_attnbwd_args& a) {
    return size_t(a.batch * a.heads * lq_pad(a) * wgmma_bwd::kDim * 4);
  }
  // deterministic mode's turn counters: two per (image, head, query block), after the dq buffer
  static size_t turns_bytes(const cvt_attnbwd_args& a) {
    return a.deterministic ? size_t(round_up(a.batch * a.heads * (lq_pad(a) / wgmma_bwd::kQueries) * 2 * 4, 256)) : 0;
  }
  static size_t workspace_size(const cvt_attnbwd_args& a) {
    return 2 * rows_bytes(a) + dq_acc_bytes(a) + turns_bytes(a);
  }

  // Head dim 64 exactly (the tiles' rows are 128 bytes). dq is reduce-added in the order CTAs reach
  // a query block, or, when the launch asks to be deterministic, in key-block order (turn counters).
  static bool can_implement(const cvt_attnbwd_args& a) {
    return bwd_strides_ok(a) && a.head_dim == wgmma_bwd::kDim && a.lq <= INT32_MAX - 64;
  }

  // delta and the padded lse (one pass that zeroes the dq buffer too) -> the main kernel -> dq.
  static int launch(const cvt_attnbwd_args& a, void* workspace, cudaStream_t stream) {
    if (!(a.deterministic ? ready<true>(a) : ready<false>(a))) return CVT_ERR_SMEM;
    char* ws = static_cast<char*>(workspace);
    float* delta = reinterpret_cast<float*>(ws);
    float* lse = reinterpret_cast<float*>(ws + rows_bytes(a));
    float* dq_acc = reinterpret_cast<float*>(ws + 2 * rows_bytes(a));
    int* turns = a.deterministic ? reinterpret_cast<int*>(ws + 2 * rows_bytes(a) + dq_acc_bytes(a)) : nullptr;
    launch_delta<Element>(a, delta, lq_pad(a), stream, lse, dq_acc, dq_acc_bytes(a) + turns_bytes(a), float(M_LOG2E));
    // key blocks along x: in deterministic mode a CTA waits for those of lower key blocks of its
    // (head, image), which the GPU starts first (CUDA does not promise the order; FA3's deterministic
    // backward relies on the same)
    const dim3 grid(unsigned((a.lkv + Keys - 1) / Keys), unsigned(a.heads), unsigned(a.batch));
    if (a.deterministic)
      launch_kernel(wgmma_bwd::bwd_kernel<Element, Keys, true>, grid, wgmma_bwd::kThreads<Keys>, kSmemBytes, stream, a,
                    lse, delta, dq_acc, turns, lq_pad(a));
    else
      launch_kernel(wgmma_bwd::bwd_kernel<Element, Keys, false>, grid, wgmma_bwd::kThreads<Keys>, kSmemBytes, stream, a,
                    lse, delta, dq_acc, nullptr, lq_pad(a));
    const dim3 tiles(unsigned(lq_pad(a) / wgmma_bwd::kQueries), unsigned(a.heads), unsigned(a.batch));
    launch_kernel(wgmma_bwd::dq_rows_kernel<Element>, tiles, 256, 0, stream, a, dq_acc, lq_pad(a));
    return cudaPeekAtLastError() == cudaSuccess ? CVT_OK : CVT_ERR_LAUNCH;
  }
};

}  // namespace cvt_kernel
