// cvt_cutlass kernel ABI: the plain-C interface every emitted kernel library exports.
//
// Kernel translation units include no torch headers: they compile anywhere nvcc 13 is, and their
// cache key does not depend on the torch version. The torch binding (binding.cpp) dlopen()s each
// kernel library and calls these entry points with raw pointers, the current stream and a
// workspace taken from PyTorch's caching allocator.
//
// Every family exports the same four entry points (cvt_<family>_*):
//   can_implement(args)              the device can run the kernel and CUTLASS accepts the problem;
//                                    called once per problem shape (the binding's plan cache)
//   workspace_size(args)             bytes of device workspace the launch needs (sizes only)
//   launch(args, workspace, stream)  launch on `stream`; no checks, no device queries, no
//                                    allocation, no synchronisation (the per-call hot path)
#pragma once
#include <stddef.h>
#include <stdint.h>

#define CVT_KERNEL_ABI_VERSION 2

#if defined(_WIN32)
#define CVT_EXPORT __declspec(dllexport)
#else
#define CVT_EXPORT __attribute__((visibility("default")))
#endif

enum cvt_status {
  CVT_OK = 0,
  CVT_ERR_INVALID_PROBLEM = 1,   // CUTLASS can_implement() said no (alignment, sizes)
  CVT_ERR_WORKSPACE = 2,         // workspace missing or too small
  CVT_ERR_INIT = 3,              // kernel initialize() failed
  CVT_ERR_LAUNCH = 4,            // the launch failed; cudaGetLastError() was consumed
  CVT_ERR_ARCH = 5,              // the device cannot execute this kernel (checked by can_implement)
  CVT_ERR_SMEM = 6,              // cudaFuncSetAttribute(max dynamic smem) failed
};

enum cvt_family { CVT_FAMILY_GEMM = 1 };

// What a kernel library says about itself (checked against the Python spec at load time).
typedef struct {
  int abi_version;
  int family;         // cvt_family
  int min_cc;         // e.g. 80 for the SM80-class path, 90 for sm_90a kernels
  const char* name;   // the procedural name, identical to the Python spec's name
} cvt_kernel_info;

// D = epilogue(A @ B^T), A (M, K) row-major, B (N, K) row-major (as nn.Linear stores weights),
// D (M, N) row-major. Optional operands are null when the epilogue does not use them.
typedef struct {
  int64_t m, n, k;
  const void* a; int64_t lda;     // A rows are lda elements apart
  const void* b; int64_t ldb;     // weight (N, K)
  void* d; int64_t ldd;           // output (M, N)
  const void* bias;               // (N,), contiguous
  const void* c; int64_t ldc;     // residual (M, N)
  void* aux; int64_t ldaux;       // extra store (M, N), e.g. the pre-activation for backward
  int device_id;                  // device the pointers live on (the current device)
  int sm_count;                   // multiprocessors of that device (cached by the caller)
} cvt_gemm_args;

#ifdef __cplusplus
extern "C" {
#endif
typedef const cvt_kernel_info* (*cvt_kernel_info_fn)(void);
typedef int (*cvt_gemm_can_implement_fn)(const cvt_gemm_args*);
typedef size_t (*cvt_gemm_workspace_size_fn)(const cvt_gemm_args*);
typedef int (*cvt_gemm_launch_fn)(const cvt_gemm_args*, void* workspace, void* stream);
#ifdef __cplusplus
}
#endif
