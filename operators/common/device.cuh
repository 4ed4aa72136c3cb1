// Device facts a kernel library's launcher needs, queried once per device (never per launch), and
// the templates behind the exported entry points of every kernel library.
//
// Each kernel library is its own shared object with hidden symbols, so these statics are per
// library; the Tag template parameter makes them per kernel inside a library too (a library that
// launches several __global__ functions raises each one's limits separately).
#pragma once
#include <cuda_runtime.h>

#include <mutex>

#include "common/abi.h"

namespace cvt_kernel {

constexpr int kMaxDevices = 64;

// Multiprocessor count of a device, queried once (persistent tile schedulers size their grid).
inline int sm_count_of(int device) {
  static std::once_flag once[kMaxDevices];
  static int counts[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 0;
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

// The SMs a launch plans its grid for: the arguments' sm_count where set, else the device's, else
// 132 (an H100 SXM's).
template <class Args>
inline int sms_of(const Args& a) {
  const int s = a.sm_count > 0 ? a.sm_count : sm_count_of(a.device_id);
  return s > 0 ? s : 132;
}

// Raise the dynamic shared-memory limit of the kernel `fn` (identified by Tag) once per device
// (cudaFuncSetAttribute is per device); returns whether it can be launched with `bytes`.
template <class Tag>
inline bool smem_ready(const void* fn, int bytes, int device) {
  static std::once_flag once[kMaxDevices];
  static bool ok[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return false;
  std::call_once(once[device], [&] {
    ok[device] = bytes < (48 << 10) ||
                 cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
    if (!ok[device]) (void)cudaGetLastError();
  });
  return ok[device];
}

// Blocks of the kernel `fn` (identified by Tag, launched with `threads` threads and no dynamic
// shared memory) resident per SM, per device.
template <class Tag>
inline int resident_blocks(const void* fn, int threads, int device) {
  static std::once_flag once[kMaxDevices];
  static int counts[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return 1;
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

// Whether the device can run code of a kernel path: SM80-class code (min_cc 80) runs on any
// sm_80+, sm_90a code (wgmma, TMA; min_cc 90) on compute capability 9.0 only. CVT_OK, or the
// status can_implement returns.
inline int device_runs(int device, int min_cc) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_ARCH;
  }
  const bool ok = min_cc == 90 ? (major == 9 && minor == 0) : (major * 10 + minor >= min_cc);
  return ok ? CVT_OK : CVT_ERR_ARCH;
}

// Launches `fn(params)` with thread-block clusters of `cluster` CTAs (sm_90; CUTLASS's
// ClusterLauncher would also set a function attribute on every launch): one kernel parameter, the
// params struct by value. CVT_OK, or CVT_ERR_LAUNCH with the error cleared.
template <class Params>
inline int launch_cluster(const void* fn, Params& params, dim3 grid, dim3 block, int smem_bytes, dim3 cluster,
                          cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  void* kernel_params[] = {&params};
  if (cudaLaunchKernelExC(&config, fn, kernel_params) != cudaSuccess) {
    (void)cudaGetLastError();
    return CVT_ERR_LAUNCH;
  }
  return CVT_OK;
}

// ---- the exported entry points, for a kernel type K with static can_implement(args),
// workspace_size(args), launch(args, workspace, stream) and a kFamily constant. A kernel's
// generated .cu defines the four extern "C" functions of its family's prefix with these.
template <class K>
inline const cvt_kernel_info* kernel_info(int min_cc, const char* name) {
  static const cvt_kernel_info info = {CVT_KERNEL_ABI_VERSION, K::kFamily, min_cc, name};
  return &info;
}

template <class K, class Args>
inline int can_implement_on_device(const Args* a, int min_cc) {
  const int st = device_runs(a->device_id, min_cc);
  if (st != CVT_OK) return st;
  return K::can_implement(*a) ? CVT_OK : CVT_ERR_INVALID_PROBLEM;
}

template <class K, class Args>
inline int launch_on(const Args* a, void* workspace, void* stream) {
  return K::launch(*a, workspace, static_cast<cudaStream_t>(stream));
}

}  // namespace cvt_kernel
