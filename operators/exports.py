"""The plain-C entry points every kernel library exports (csrc/cvt_kernel_abi.h), one text for
all families, and the small device helpers their launchers share.

``can_implement`` checks the device (compute capability) and the problem; the binding calls it
once per problem shape when it builds a plan. ``launch`` does no checks and no device queries:
it is the per-call hot path. The returned text still holds ``${name}`` and ``${min_cc}`` for the
family's template substitution.
"""

from __future__ import annotations

# Device facts a launcher needs, queried once per device (never per launch).
DEVICE_HELPERS = r"""
#include <mutex>
namespace cvt_kernel {
// Multiprocessor count of a device, queried once (persistent tile schedulers size their grid).
inline int sm_count_of(int device) {
  static std::once_flag once[64];
  static int counts[64];
  if (device < 0 || device >= 64) return 0;
  std::call_once(once[device], [device] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 0;  // 0 lets CUTLASS query it itself
    }
    counts[device] = v;
  });
  return counts[device];
}

// Raise a kernel's dynamic shared-memory limit once per device (cudaFuncSetAttribute is per
// device); returns whether the kernel can be launched with `bytes`.
inline bool smem_ready(const void* fn, int bytes, int device) {
  static std::once_flag once[64];
  static bool ok[64];
  if (device < 0 || device >= 64) return false;
  std::call_once(once[device], [&] {
    ok[device] = bytes < (48 << 10) ||
                 cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
    if (!ok[device]) (void)cudaGetLastError();
  });
  return ok[device];
}
}  // namespace cvt_kernel
"""

# The backward kernels' second pass: fp32 partial sums (per block / split / M-tile) summed per column
# in a fixed order (deterministic) and rounded to the output dtype. Included by the kernels that use
# it only, so forward kernels' sources (and cache keys) do not change with it.
COLSUM_HELPER = r"""
namespace cvt_kernel {
// out[c] = sum over r of in[r * ld + c], c < cols: 32 columns per block, 32 row lanes each summing
// rows lane, lane + 32, ... then the lanes' sums added in lane order.
template <class Out>
__global__ void __launch_bounds__(1024) colsum_kernel(const float* __restrict__ in, int64_t rows, int64_t ld,
                                                      int64_t cols, Out* __restrict__ out) {
  __shared__ float part[32][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < cols) {
    #pragma unroll 4
    for (int64_t r = threadIdx.y; r < rows; r += 32) acc += in[r * ld + c];
  }
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 32; ++i) s += part[i][threadIdx.x];
    out[c] = Out(s);
  }
}

// Few rows (a handful of split partials): one thread per column, rows summed in order.
template <class Out>
__global__ void colsum_short_kernel(const float* __restrict__ in, int64_t rows, int64_t ld, int64_t cols,
                                    Out* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r) s += in[r * ld + c];
  out[c] = Out(s);
}

template <class Out>
inline void colsum(const float* in, int64_t rows, int64_t ld, int64_t cols, Out* out, cudaStream_t stream) {
  if (cols <= 0) return;
  if (rows < 64)
    colsum_short_kernel<Out><<<unsigned((cols + 255) / 256), 256, 0, stream>>>(in, rows, ld, cols, out);
  else
    colsum_kernel<Out><<<unsigned((cols + 31) / 32), dim3(32, 32), 0, stream>>>(in, rows, ld, cols, out);
}

// Blocks of `fn` (launched with `threads` threads, no dynamic shared memory) resident per SM, per device.
inline int resident_blocks(const void* fn, int threads, int device) {
  static std::once_flag once[64];
  static int counts[64];
  if (device < 0 || device >= 64) return 1;
  std::call_once(once[device], [&] {
    int v = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, fn, threads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 1;
    }
    counts[device] = v > 0 ? v : 1;
  });
  return counts[device];
}
}  // namespace cvt_kernel
"""

# db of the backward kernels whose mainloop cannot reduce an operand (the SM90 Linear wgrad, the conv
# wgrad): one deterministic pass over dY (M, N) row-major: per chunk of rows, fp32 column sums, then
# colsum adds the chunks in order. Included after COLSUM_HELPER by the kernels that use it.
ROWSUM_HELPER = r"""
namespace cvt_kernel {
// Per chunk, each thread sums 8 adjacent columns (16-byte loads; N % 8 == 0, 16-byte rows) over the
// chunk's rows lane, lane + lanes, ...; the lanes' sums are added in lane order into an fp32 partial
// row per chunk.
constexpr int kSumThreads = 256;
template <class T>
__global__ void __launch_bounds__(kSumThreads) rowsum_partials(const T* __restrict__ dy, int64_t m, int64_t n,
                                                               int64_t ldy, int64_t chunk_rows, int groups,
                                                               float* __restrict__ part) {
  __shared__ float sums[kSumThreads][9];
  const int lanes = kSumThreads / groups, g = int(threadIdx.x) % groups, lane = int(threadIdx.x) / groups;
  const int64_t col = (int64_t(blockIdx.x) * groups + g) * 8;
  const int64_t r0 = int64_t(blockIdx.y) * chunk_rows, r1 = r0 + chunk_rows < m ? r0 + chunk_rows : m;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (lane < lanes && col < n) {
    #pragma unroll 4
    for (int64_t r = r0 + lane; r < r1; r += lanes) {
      // one 16-byte load into registers (a T* into a local uint4 put it on the stack for half_t)
      const cutlass::Array<T, 8> e = *reinterpret_cast<const cutlass::Array<T, 8>*>(dy + r * ldy + col);
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += float(e[i]);
    }
  }
  #pragma unroll
  for (int i = 0; i < 8; ++i) sums[threadIdx.x][i] = acc[i];
  __syncthreads();
  if (lane != 0 || col >= n) return;
  for (int l = 1; l < lanes; ++l) {
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += sums[l * groups + g][i];
  }
  #pragma unroll
  for (int i = 0; i < 8; ++i) part[int64_t(blockIdx.y) * n + col + i] = acc[i];
}

struct RowSumPlan {
  int groups, col_blocks;
  int64_t chunks, chunk_rows;
};
// ~4 blocks per SM, at least 16 rows per lane.
inline RowSumPlan rowsum_plan(int64_t m, int64_t n, int sms) {
  RowSumPlan r;
  const int64_t all_groups = n / 8;
  r.groups = int(all_groups < kSumThreads ? all_groups : kSumThreads);
  r.col_blocks = int((all_groups + r.groups - 1) / r.groups);
  const int64_t lanes = kSumThreads / r.groups;
  const int64_t want = (4 * int64_t(sms) + r.col_blocks - 1) / r.col_blocks;
  const int64_t most = (m + 16 * lanes - 1) / (16 * lanes);
  r.chunks = want < most ? want : most;
  if (r.chunks < 1) r.chunks = 1;
  r.chunk_rows = (m + r.chunks - 1) / r.chunks;
  r.chunks = (m + r.chunk_rows - 1) / r.chunk_rows;
  return r;
}

// Bytes of fp32 partials rowsum() needs.
inline size_t rowsum_workspace(int64_t m, int64_t n, int sms) { return size_t(rowsum_plan(m, n, sms).chunks * n) * sizeof(float); }

// out (N,) = dy (M, N) summed over rows, in a fixed order; `part` holds rowsum_workspace() bytes.
template <class T>
inline void rowsum(const T* dy, int64_t m, int64_t n, int64_t ldy, int sms, float* part, T* out, cudaStream_t stream) {
  const RowSumPlan r = rowsum_plan(m, n, sms);
  rowsum_partials<T><<<dim3(unsigned(r.col_blocks), unsigned(r.chunks)), kSumThreads, 0, stream>>>(
      dy, m, n, ldy, r.chunk_rows, r.groups, part);
  colsum(part, r.chunks, n, n, out, stream);
}
}  // namespace cvt_kernel
"""

# Kernels that build TMA descriptors (the sm_90a GEMM, conv and attention kernels) include this
# first. Without CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, CUTLASS looks the driver's descriptor
# encoders up by name (cudaGetDriverEntryPointByVersion) for every descriptor of every launch;
# with it, CUTLASS calls them directly, and these definitions (hidden, like every symbol of a
# kernel library but its ABI) look each one up once. No link against libcuda is needed.
TMA_DRIVER_SHIM = r"""#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
namespace cvt_kernel {
template <class Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}
}  // namespace cvt_kernel
extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const cuuint32_t* box, const cuuint32_t* element_strides, CUtensorMapInterleave il,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const auto fn = cvt_kernel::driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn ? fn(map, type, rank, address, dims, strides, box, element_strides, il, swizzle, l2, oob)
            : CUDA_ERROR_NOT_FOUND;
}
extern "C" CUresult CUDAAPI cuTensorMapEncodeIm2col(
    CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address, const cuuint64_t* dims,
    const cuuint64_t* strides, const int* lower, const int* upper, cuuint32_t channels, cuuint32_t pixels,
    const cuuint32_t* element_strides, CUtensorMapInterleave il, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  static const auto fn = cvt_kernel::driver_entry<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
  return fn ? fn(map, type, rank, address, dims, strides, lower, upper, channels, pixels, element_strides, il,
                 swizzle, l2, oob)
            : CUDA_ERROR_NOT_FOUND;
}
namespace cvt_kernel {
// The driver has the descriptor encoders (checked by can_implement: CUTLASS ignores a failed encode
// in release builds and would launch with a garbage descriptor).
inline bool tma_ready() {
  static const bool ok = driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled") != nullptr;
  return ok;
}
}  // namespace cvt_kernel
"""

# The device test of each path: SM80-class code runs on any sm_80+; sm_90a code (wgmma, TMA)
# only on compute capability 9.0 exactly.
ARCH_OK = {80: "major * 10 + minor >= 80", 90: "major == 9 && minor == 0"}


def c_exports(family: str, var: str) -> str:
    """``family``: "gemm", "conv", "attn" or "norm" (symbols ``cvt_<family>_*``, argument type
    ``cvt_<family>_args``); ``var``: the argument's name. The text keeps the placeholders
    ``${name}``, ``${min_cc}`` and ``${arch_ok}`` (:func:`arch_ok`) for the family's template."""
    args = f"cvt_{family}_args"
    return (
        '\nextern "C" {\n'
        "CVT_EXPORT const cvt_kernel_info* cvt_kernel_info_get(void) {\n"
        '  static const cvt_kernel_info info = {CVT_KERNEL_ABI_VERSION, cvt_kernel::kFamily, ${min_cc}, "${name}"};\n'
        "  return &info;\n"
        "}\n"
        f"CVT_EXPORT int cvt_{family}_can_implement(const {args}* {var}) {{\n"
        "  int major = 0, minor = 0;\n"
        f"  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, {var}->device_id) != cudaSuccess ||\n"
        f"      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, {var}->device_id) != cudaSuccess) {{\n"
        "    (void)cudaGetLastError();\n"
        "    return CVT_ERR_ARCH;\n"
        "  }\n"
        "  if (!(${arch_ok})) return CVT_ERR_ARCH;\n"
        f"  return cvt_kernel::can_implement(*{var}) ? CVT_OK : CVT_ERR_INVALID_PROBLEM;\n"
        "}\n"
        f"CVT_EXPORT size_t cvt_{family}_workspace_size(const {args}* {var}) "
        f"{{ return cvt_kernel::workspace_size(*{var}); }}\n"
        f"CVT_EXPORT int cvt_{family}_launch(const {args}* {var}, void* workspace, void* stream) {{\n"
        f"  return cvt_kernel::launch(*{var}, workspace, static_cast<cudaStream_t>(stream));\n"
        "}\n"
        '}  // extern "C"\n'
    )


def arch_ok(min_cc: int) -> str:
    """The C condition on ``major``/``minor`` under which a kernel of ``min_cc`` runs."""
    return ARCH_OK[min_cc]
