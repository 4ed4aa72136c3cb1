// cvt_cutlass kernel ABI: the plain-C interface every kernel library exports.
//
// Kernel translation units include no torch headers: they compile anywhere nvcc 13 is, and their
// cache key does not depend on the torch version. The torch binding (cvt_cutlass/csrc) dlopen()s
// each kernel library and calls these entry points with raw pointers, the current stream and a
// workspace taken from PyTorch's caching allocator.
//
// Every library exports cvt_kernel_info_get() and, for its family's argument struct
// cvt_<prefix>_args (declared in operators/<family>/abi.h), the entry points cvt_<prefix>_*:
//   can_implement(args)              the device can run the kernel and the kernel accepts the
//                                    problem; called once per problem shape (the plan cache)
//   workspace_size(args)             bytes of device workspace the launch needs (sizes only)
//   launch(args, workspace, stream)  launch on `stream`; no checks, no device queries, no
//                                    allocation, no synchronisation (the per-call hot path)
#pragma once
#include <stddef.h>
#include <stdint.h>

#define CVT_KERNEL_ABI_VERSION 6

#if defined(_WIN32)
#define CVT_EXPORT __declspec(dllexport)
#else
#define CVT_EXPORT __attribute__((visibility("default")))
#endif

enum cvt_status {
  CVT_OK = 0,
  CVT_ERR_INVALID_PROBLEM = 1,   // the kernel cannot implement this problem (alignment, sizes)
  CVT_ERR_WORKSPACE = 2,         // workspace missing or too small
  CVT_ERR_INIT = 3,              // kernel initialize() failed
  CVT_ERR_LAUNCH = 4,            // the launch failed; cudaGetLastError() was consumed
  CVT_ERR_ARCH = 5,              // the device cannot execute this kernel (checked by can_implement)
  CVT_ERR_SMEM = 6,              // cudaFuncSetAttribute(max dynamic smem) failed
};

// The families and the symbol prefix of their entry points (cvt_<prefix>_launch, ...).
enum cvt_family {
  CVT_FAMILY_GEMM = 1,            // gemm:     Linear forward and dgrad (operators/linear)
  CVT_FAMILY_CONV2D_FPROP = 2,    // conv:     token-embedding conv (operators/conv2d)
  CVT_FAMILY_DWCONV2D = 3,        // conv:     depthwise conv, BatchNorm folded (operators/dwconv)
  CVT_FAMILY_ATTENTION = 4,       // attn:     fused multi-head attention (operators/attention)
  CVT_FAMILY_LAYERNORM = 5,       // norm:     LayerNorm over tokens (operators/layernorm)
  CVT_FAMILY_WGRAD = 6,           // wgrad:    Linear weight gradient (operators/linear)
  CVT_FAMILY_LAYERNORM_BWD = 7,   // normbwd:  LayerNorm backward
  CVT_FAMILY_ATTENTION_BWD = 8,   // attnbwd:  attention backward
  CVT_FAMILY_CONV2D_BWD = 9,      // convbwd:  token-embedding conv dgrad / wgrad
  CVT_FAMILY_DWCONV_BN = 10,      // dwbn:     depthwise conv + BatchNorm, training forward
  CVT_FAMILY_DWCONV_BN_BWD = 11,  // dwbnbwd:  its backward
};

// Deferred column sums (the finishing pass of a kernel's fp32 partial sums: common/reduce.cuh).
// A launch whose args carry a `defer` list appends its finishing segments to it instead of
// launching them; cvt_colsum_flush(list, stream), exported by every library that defers, then
// sums every listed segment in one launch (each with the same algorithm, hence the same bits, as
// its own launch would) and empties the list. The partials must stay allocated until then. A
// launch that finds the list full flushes it first. out_type: CVT_OUT_F32, CVT_OUT_F16, CVT_OUT_BF16.
#define CVT_COLSUM_MAX 24
enum { CVT_OUT_F32 = 0, CVT_OUT_F16 = 1, CVT_OUT_BF16 = 2 };
typedef struct {
  const float* in;
  int64_t rows, ld, cols;  // out[c] = sum over r < rows of in[r * ld + c], c < cols
  void* out;
  int out_type;
} cvt_colsum_seg;
typedef struct {
  cvt_colsum_seg seg[CVT_COLSUM_MAX];
  int count;
} cvt_colsum_list;

// What a kernel library says about itself (checked against the Python spec at load time).
typedef struct {
  int abi_version;
  int family;         // cvt_family
  int min_cc;         // e.g. 80 for the SM80-class path, 90 for sm_90a kernels
  const char* name;   // the procedural name, identical to the Python spec's name
} cvt_kernel_info;

#ifdef __cplusplus
extern "C" {
#endif
typedef const cvt_kernel_info* (*cvt_kernel_info_fn)(void);
typedef int (*cvt_colsum_flush_fn)(cvt_colsum_list* list, void* stream);
#ifdef __cplusplus
}
#endif
