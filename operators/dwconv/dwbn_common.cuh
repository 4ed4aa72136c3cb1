// Depthwise 3x3 conv (pad 1, stride 1 or 2) + BatchNorm with batch statistics on NHWC tokens (cls
// rows passed through; operators/dwconv/abi.h): what the training forward (dwbn_fwd.cuh) and
// backward (dwbn_bwd.cuh) share. fp16/bf16 activations, fp32 weights, statistics and accumulation.
//
// Every kernel moves 8 channels per thread (one 16-byte access). The output-centric kernels give a
// thread kOut consecutive conv outputs along W; the reducing kernels run blocks of kCG 8-channel
// groups x kThreads / kCG pixel lanes (threads with the same channels sum in registers, then warp
// shuffles, then warps in a fixed order) into per-block fp32 partial rows.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_runtime.h>
#include "cutlass/array.h"
#include "cutlass/fast_math.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "dwconv/abi.h"
#include "common/device.cuh"

namespace cvt_kernel {

constexpr int kDwVec = 8;  // channels per thread: one 16-byte access
using VecF8 = cutlass::Array<float, kDwVec>;

// The compile-time shape of a dwbn kernel library.
template <class Element_, int Stride, int Out, int Groups, int Threads>
struct DwBnShape {
  using Element = Element_;
  static constexpr int kVec = kDwVec;
  static constexpr int kStride = Stride;
  static constexpr int kOut = Out;          // conv outputs per thread along W (output-centric kernels)
  static constexpr int kCG = Groups;        // 8-channel groups per block of the reducing kernels
  static constexpr int kThreads = Threads;
  static constexpr int kLanes = kThreads / kCG;  // pixel lanes per block
  static constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && 32 % kCG == 0, "channel groups must tile a warp");
  using Vec = cutlass::Array<Element, kVec>;
  using VecF = VecF8;
};

// Tells the occupancy caches (resident_blocks) of a library's reducing kernels apart.
template <class K, int I>
struct KernelTag {};

template <class Element>
__device__ __forceinline__ VecF8 ld8(const Element* p) {
  cutlass::NumericArrayConverter<float, Element, kDwVec> cvt;
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  return cvt(reinterpret_cast<cutlass::Array<Element, kDwVec> const&>(raw));
}
template <class Element>
__device__ __forceinline__ void st8(Element* p, const VecF8& v) {
  cutlass::NumericArrayConverter<Element, float, kDwVec> cvt;
  const cutlass::Array<Element, kDwVec> o = cvt(v);
  *reinterpret_cast<uint4*>(p) = reinterpret_cast<uint4 const&>(o);
}
// st8, returning the stored values read back in fp32 (what a later kernel would load).
template <class Element>
__device__ __forceinline__ VecF8 st8_rounded(Element* p, const VecF8& v) {
  cutlass::NumericArrayConverter<Element, float, kDwVec> cvt;
  cutlass::NumericArrayConverter<float, Element, kDwVec> back;
  const cutlass::Array<Element, kDwVec> o = cvt(v);
  *reinterpret_cast<uint4*>(p) = reinterpret_cast<uint4 const&>(o);
  return back(o);
}
__device__ __forceinline__ VecF8 ldf8(const float* p) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(p)), hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  VecF8 v;
  v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
  return v;
}
__device__ __forceinline__ VecF8 zero8() {
  VecF8 v;
  v.fill(0.f);
  return v;
}

// A grouped launch (abi.h: `next`): up to kDwBnGroupMax problems on one input in one set of
// kernels (CvT's q, k and v projections of one LayerNorm output). Problems [0, first_b) have the
// kernel's first shape K0, those from first_b on its second shape K1 (q at stride 1, k and v at
// stride 2); each problem has its own copy of the single problem's workspace (ws: its byte offset)
// and the grid its shape has when launched alone (so a problem's reductions run in the same order
// as then: the same bits). The reducing kernels: blockIdx.z picks the problem, the blocks have the
// widest shape's threads (a narrower shape runs several of its blocks in one: SubBlock) and the
// grid is the largest of the two shapes', the blocks outside their shape's grid return at once.
// The output-centric kernels run each problem's blocks in turn along x (FlatBlock) at the narrower
// shape's block size (the backward's dgrad with sum_dx: one set of blocks for all the problems).
constexpr int kDwBnGroupMax = 3;
template <class Args>
struct DwBnGroup {
  Args p[kDwBnGroupMax];
  int count;
  int first_b;
  int64_t ws[kDwBnGroupMax];
};

// The chain a -> next -> ... as a group: the first `first_b` problems of shape K0 (ws_a bytes of
// workspace each), the rest of shape K1 (ws_b each).
template <class Args>
DwBnGroup<Args> group_of(const Args& a, size_t ws_a, size_t ws_b = 0, int first_b = kDwBnGroupMax) {
  DwBnGroup<Args> g{};
  int64_t off = 0;
  for (const Args* p = &a; p && g.count < kDwBnGroupMax; p = p->next) {
    g.p[g.count] = *p;
    g.p[g.count].next = nullptr;
    g.ws[g.count] = off;
    off += int64_t(g.count < first_b ? ws_a : ws_b);
    ++g.count;
  }
  g.first_b = first_b < g.count ? first_b : g.count;
  return g;
}

// The bytes of a group's workspace: first_b copies of ws_a, the rest ws_b.
template <class Args>
size_t group_workspace(const Args& a, size_t ws_a, size_t ws_b = 0, int first_b = kDwBnGroupMax) {
  size_t total = 0;
  int i = 0;
  for (const Args* p = &a; p && i < kDwBnGroupMax; p = p->next, ++i) total += i < first_b ? ws_a : ws_b;
  return total;
}

// Problem z of the group, by default this block's (blockIdx.z; a copy: its fields are selected
// from those in the parameter space).
template <class Args>
__device__ __forceinline__ Args problem_of(const DwBnGroup<Args>& g, int z = int(blockIdx.z)) {
  return z == 0 ? g.p[0] : z == 1 ? g.p[1] : g.p[2];
}

// Problem z's copy of a workspace pointer.
template <class T, class Args>
__device__ __forceinline__ T* problem_ws(T* base, const DwBnGroup<Args>& g, int z = int(blockIdx.z)) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  const int64_t off = z == 0 ? g.ws[0] : z == 1 ? g.ws[1] : g.ws[2];
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + off);
}

// Whether problem z has the kernel's second shape.
template <class Args>
__device__ __forceinline__ bool second_shape(const DwBnGroup<Args>& g, int z = int(blockIdx.z)) {
  return z >= g.first_b;
}

// An output-centric kernel's block in a grouped launch: its grid's x runs each problem's blocks in
// turn (blocks0 per problem of the first shape, blocks1 of the second; no idle blocks where the
// shapes' work differs); z: the block's problem, block: its index within that problem's.
struct FlatBlock {
  int z, block;
  template <class Args>
  __device__ __forceinline__ FlatBlock(const DwBnGroup<Args>& g, int blocks0, int blocks1) {
    const int x = int(blockIdx.x), head = g.first_b * blocks0;
    const int k = x < head ? x / blocks0 : (x - head) / blocks1;
    z = x < head ? k : g.first_b + k;
    block = x < head ? x - k * blocks0 : x - head - k * blocks1;
  }
};

inline int cdiv(int x, int y) { return (x + y - 1) / y; }
inline unsigned most(int x, int y) { return unsigned(x > y ? x : y); }

template <class K0, class K1>
constexpr int max_threads() {
  return K0::kThreads > K1::kThreads ? K0::kThreads : K1::kThreads;
}

// The block size of a group's output-centric kernels (any size serves them: the narrower shape's,
// whose registers then fill an SM as in its own launch).
template <class K0, class K1>
constexpr int min_threads() {
  return K0::kThreads < K1::kThreads ? K0::kThreads : K1::kThreads;
}

// Shape K's blocks inside a grouped launch's blocks of W threads (the widest shape's): W / K::kThreads
// blocks of K side by side (`sub`), each with its own named barrier and shared memory, numbered
// (`id`) as a launch of K alone numbers its blocks along x; `tid`: the thread within its block.
// With one shape W = K::kThreads: the launch's own blocks.
template <class K, int W>
struct SubBlock {
  static constexpr int kSub = W / K::kThreads;
  static_assert(kSub >= 1 && kSub * K::kThreads == W && kSub <= 15, "a block holds whole blocks of each shape");
  int sub, tid, id;
  __device__ __forceinline__ SubBlock()
      : sub(int(threadIdx.x) / K::kThreads), tid(int(threadIdx.x) % K::kThreads), id(int(blockIdx.x) * kSub + sub) {}
  __device__ __forceinline__ void sync() const {  // the block's barrier; several blocks: named barrier 1 + sub
    if constexpr (kSub == 1) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"r"(1 + sub), "n"(K::kThreads) : "memory");
  }
};

// Sizes as 32-bit ints (can_implement: an image's tokens fit 2^31 elements).
struct Geo {
  int H, W, P, Q, C, C8, cls;
};

template <class Args>
Geo geo_of(const Args& a) {
  return Geo{int(a.h), int(a.w), int(a.p), int(a.q), int(a.c), int(a.c / kDwVec), int(a.cls_rows)};
}

// acc[j] = conv at output (p, q0 + j) for channels 8*c8.. in fp32; xb: the image's first spatial token.
// A row's input vectors are loaded together (all in flight), then the math.
template <class K, int kN>
__device__ __forceinline__ void conv_row(const typename K::Element* xb, const float* w, const Geo& g, int p, int q0,
                                         int c8, VecF8 (&acc)[kN]) {
  constexpr int kVec = K::kVec, kStride = K::kStride;
  constexpr int kCols = (kN - 1) * kStride + 3;
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kN; ++j) acc[j].fill(0.f);
  const int iw0 = q0 * kStride - 1;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 3; ++r) {
    const int ih = p * kStride - 1 + r;
    if (ih < 0 || ih >= g.H) continue;
    VecF8 xf[kCols];
    CUTLASS_PRAGMA_UNROLL
    for (int u = 0; u < kCols; ++u) {
      const int iw = iw0 + u;
      if (iw >= 0 && iw < g.W) xf[u] = ld8(xb + (ih * g.W + iw) * g.C + c8 * kVec);
      else xf[u] = zero8();
    }
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 3; ++s) {
      const VecF8 wv = ldf8(w + (r * 3 + s) * g.C + c8 * kVec);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kN; ++j)
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kVec; ++v) acc[j][v] = fmaf(wv[v], xf[j * kStride + s][v], acc[j][v]);
    }
  }
}

// The thread's place in an output-centric elementwise kernel (its problem's blocks x images, any
// block size; `block`: the thread's block among its problem's): its image, item (a conv output
// row segment, or cls row item - spatial) and 8-channel group; false past the work.
__device__ __forceinline__ bool out_item(int work, cutlass::FastDivmod div_c8, int block, int& img, int& item,
                                         int& c8) {
  const int tid = block * int(blockDim.x) + int(threadIdx.x);
  if (tid >= work) return false;
  img = int(blockIdx.y);
  div_c8(item, c8, tid);
  return true;
}

// A conv output item's row p and first column q0 (kOut columns per thread).
template <class K>
__device__ __forceinline__ void out_row(cutlass::FastDivmod div_qg, int item, int& p, int& q0) {
  int qg;
  div_qg(p, qg, item);
  q0 = qg * K::kOut;
}

// A cls row's 8 channels passed through (one 16-byte access).
template <class Element>
__device__ __forceinline__ void copy_row8(const Element* src, Element* dst, int row, int C, int c8) {
  reinterpret_cast<uint4*>(dst + row * C)[c8] = __ldg(reinterpret_cast<const uint4*>(src + row * C) + c8);
}

// The block's sums of kQ per-channel quantities over its threads that share channels, stored as
// its partial row: part[b.id][q][c] for this block's channel chunk (blockIdx.y). Lanes
// kCG, 2 kCG, ... apart in a warp hold the same channels: shuffles, then the warps in order.
// smem: this block's own (kWarps * kQ * kCG * 8 floats).
template <class K, int kQ, class B>
__device__ __forceinline__ void block_sums(const B& b, VecF8 (&v)[kQ], float* part, int C, float* smem) {
  constexpr int kVec = K::kVec, kCG = K::kCG, kThreads = K::kThreads, kWarps = K::kWarps;
  CUTLASS_PRAGMA_UNROLL
  for (int off = kCG; off < 32; off *= 2)
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kQ; ++q)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) v[q][e] += __shfl_xor_sync(0xffffffffu, v[q][e], off);
  const int lane = b.tid % 32, warp = b.tid / 32;
  constexpr int kCh = kCG * kVec;
  if (lane < kCG)
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kQ; ++q)
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) smem[(warp * kQ + q) * kCh + lane * kVec + e] = v[q][e];
  b.sync();
  const int c0 = int(blockIdx.y) * kCh;
  for (int i = b.tid; i < kQ * kCh; i += kThreads) {
    const int q = i / kCh, ch = i % kCh;
    float s = 0.f;
    for (int wp = 0; wp < kWarps; ++wp) s += smem[(wp * kQ + q) * kCh + ch];
    if (c0 + ch < C) part[(int64_t(b.id) * kQ + q) * C + c0 + ch] = s;
  }
}

// Grid x of a reducing kernel `fn` (Tag: its occupancy cache): one wave over all channel chunks,
// at most one block per kLanes items.
template <class K, class Tag, class Args>
int reduce_blocks(const Args& a, const void* fn, int64_t items) {
  const int64_t sms = sms_of(a);
  const int64_t chunks = (a.c / K::kVec + K::kCG - 1) / K::kCG;
  const int64_t most = sms * resident_blocks<Tag>(fn, K::kThreads, a.device_id) / chunks;
  const int64_t want = (items + K::kLanes - 1) / K::kLanes;
  const int64_t b = want < most ? want : most;
  return int(b < 1 ? 1 : b);
}

// Two problems of a grouped launch read the same x with the same image geometry.
template <class Args>
bool same_image(const Args& a, const Args& b) {
  return a.n == b.n && a.h == b.h && a.w == b.w && a.c == b.c && a.cls_rows == b.cls_rows && a.x == b.x &&
         a.x_image_stride == b.x_image_stride;
}

// A k / v pair's second problem: the same input and conv geometry, the whole op (no part), and it
// ends the chain.
template <class Args>
bool same_input(const Args& a, const Args& b) {
  return same_image(a, b) && a.p == b.p && a.q == b.q && a.stride == b.stride && b.phase == CVT_DWBN_ALL && !b.next;
}

// The grid of one shape's blocks in a reducing kernel (rows x channel chunks) and what they
// divide an item index by: image, then conv output row.
struct ReduceGrid {
  Geo g;
  int items, rows, chunks;
  cutlass::FastDivmod div_img, div_row;
};

// One shape's work in an output-centric kernel (threads x images, any block size) and its
// blocks per problem at the launch's block size.
struct OutGrid {
  Geo g;
  int work, spatial, blocks;
  cutlass::FastDivmod div_c8, div_qg;
};

// A kernel argument per shape of a grouped launch (one shape: only s[0] is read).
template <class T>
struct PerShape {
  T s[2];
};

// Shape K's reducing grid over conv output rows (kOut outputs per item; the forward statistics and
// the backward's reduce), `rows` blocks along x.
template <class K, class Args>
ReduceGrid out_rows_grid(const Args& a, int64_t items, int rows) {
  const Geo g = geo_of(a);
  const int qgroups = (g.Q + K::kOut - 1) / K::kOut;
  return {g, int(items), rows, (g.C8 + K::kCG - 1) / K::kCG, cutlass::FastDivmod(g.P * qgroups),
          cutlass::FastDivmod(qgroups)};
}

// Shape K's output-centric work (the forward's normalize): conv output row
// segments plus the cls rows, x 8-channel groups.
template <class K, class Args>
OutGrid out_grid(const Args& a) {
  const Geo g = geo_of(a);
  const int qgroups = (g.Q + K::kOut - 1) / K::kOut, spatial = g.P * qgroups, work = (spatial + g.cls) * g.C8;
  return {g, work, spatial, 0, cutlass::FastDivmod(g.C8), cutlass::FastDivmod(qgroups)};
}

// The launch's grid along x for an output-centric kernel of T threads per block (FlatBlock), the
// shapes' blocks per problem set in o.
template <class Args>
unsigned flat_blocks(const DwBnGroup<Args>& grp, PerShape<OutGrid>& o, int threads) {
  o.s[0].blocks = cdiv(o.s[0].work, threads);
  o.s[1].blocks = cdiv(o.s[1].work, threads);
  return unsigned(grp.first_b * o.s[0].blocks + (grp.count - grp.first_b) * o.s[1].blocks);
}

// Item `it` of a reducing grid over conv output rows (out_rows_grid): its image, output row p and
// first output column q0 (kOut columns per item).
struct RowItem {
  int img, p, q0;
};
template <int kOut>
__device__ __forceinline__ RowItem row_item(const ReduceGrid& r, int it) {
  int img, rem, p, qg;
  r.div_img(img, rem, it);
  r.div_row(p, qg, rem);
  return {img, p, qg * kOut};
}

// Image img's first spatial token of tokens (n, cls + rows, C) at `image_stride` elements per image.
template <class Element>
__device__ __forceinline__ const Element* spatial_tokens(const void* base, int64_t image_stride, int img,
                                                         const Geo& g) {
  return static_cast<const Element*>(base) + int64_t(img) * image_stride + int64_t(g.cls) * g.C;
}

// The items of reducing block `block` (SubBlock id) of grid r: one contiguous run (the runs of
// the r.rows blocks differ in length by at most one), walked kLanes at a time (conv output rows in
// turn: the input rows a block reads next are mostly those it has just read, still in L1).
struct ItemRun {
  int begin, end;
};
__device__ __forceinline__ ItemRun item_run(int items, int blocks, int block) {
  const int per = items / blocks, extra = items % blocks;  // the first `extra` runs take one more
  const int begin = block * per + (block < extra ? block : extra);
  return {begin, begin + per + (block < extra ? 1 : 0)};
}
__device__ __forceinline__ ItemRun item_run(const ReduceGrid& r, int block) { return item_run(r.items, r.rows, block); }

// Whether block b (SubBlock) is in a reducing kernel's grid r.
template <class B>
__device__ __forceinline__ bool in_grid(const B& b, const ReduceGrid& r) {
  return b.id < r.rows && int(blockIdx.y) < r.chunks;
}

template <class K, class Args>
bool common_ok(const Args& a) {
  constexpr int kVec = K::kVec, kStride = K::kStride, kCG = K::kCG;
  if (a.n <= 0 || a.h <= 0 || a.w <= 0 || a.c <= 0 || a.cls_rows < 0 || a.stride != kStride) return false;
  if (a.p != (a.h - 1) / kStride + 1 || a.q != (a.w - 1) / kStride + 1) return false;
  if (a.c % kVec || a.x_image_stride % kVec || a.x_image_stride < (a.cls_rows + a.h * a.w) * a.c) return false;
  if (a.n > 65535 || (a.cls_rows + a.h * a.w) * a.c > INT32_MAX) return false;
  if (a.n * a.h * a.w > INT32_MAX / 2 || (a.c / kVec + kCG - 1) / kCG > 65535) return false;
  if (!a.x || !a.weight || (reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.weight)) % 16)
    return false;
  return true;
}

// A q / k / v library whose q runs at stride 1 and whose k / v pair at stride 2 reads x once for
// the three problems in its forward statistics and normalization and its backward sums and
// dz + dW passes (dwbn_rows.cuh).
template <class KQ, class KKV>
constexpr bool shares_x() {
  return KQ::kStride == 1 && KKV::kStride == 2;
}

}  // namespace cvt_kernel
