// Loaded kernel libraries: dlopen once, keep the ABI entry points, hand out stable ids.
//
// Part of the binding's single translation unit (binding.cpp includes it). No CUDA header: the
// kernel libraries own every CUDA call, the binding passes pointers, sizes, a workspace and the
// current stream.
#pragma once
#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

// The kernel ABI (operators/common/abi.h) and each family's argument structs (operators/<family>/abi.h).
#include "attention/abi.h"
#include "common/abi.h"
#include "conv2d/abi.h"
#include "dwconv/abi.h"
#include "layernorm/abi.h"
#include "linear/abi.h"

namespace cvt {

// "[2, 197, 6, 64]" without c10's ostream operator for ArrayRef: every message is built from
// scalars and std::string (a variadic TORCH_CHECK with integers after a kernel-library call
// crashed the process on the H200, 2026-11-21; preformatted strings did not).
inline std::string dims(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

inline const char* status_text(int st) {
  switch (st) {
    case CVT_OK: return "ok";
    case CVT_ERR_INVALID_PROBLEM: return "CUTLASS cannot implement this problem (sizes/alignment)";
    case CVT_ERR_WORKSPACE: return "workspace too small";
    case CVT_ERR_INIT: return "kernel initialisation failed";
    case CVT_ERR_LAUNCH: return "kernel launch failed";
    case CVT_ERR_ARCH: return "the device cannot run this kernel";
    case CVT_ERR_SMEM: return "cannot raise the shared-memory limit (device too small?)";
    default: return "unknown status";
  }
}

// Each kernel family's name in counters and reports and the symbol prefix of its entry points,
// indexed by CVT_FAMILY_* (null where no family has the number).
struct FamilyInfo {
  const char* name;
  const char* prefix;
};
inline constexpr FamilyInfo kFamilies[] = {
    {nullptr, nullptr},
    {"gemm", "cvt_gemm_"},                  // CVT_FAMILY_GEMM
    {"conv2d", "cvt_conv_"},                // CVT_FAMILY_CONV2D_FPROP
    {"dwconv", "cvt_conv_"},                // CVT_FAMILY_DWCONV2D
    {"attention", "cvt_attn_"},             // CVT_FAMILY_ATTENTION
    {"layernorm", "cvt_norm_"},             // CVT_FAMILY_LAYERNORM
    {"wgrad", "cvt_wgrad_"},                // CVT_FAMILY_WGRAD
    {"layernorm_bwd", "cvt_normbwd_"},      // CVT_FAMILY_LAYERNORM_BWD
    {"attention_bwd", "cvt_attnbwd_"},      // CVT_FAMILY_ATTENTION_BWD
    {"conv2d_bwd", "cvt_convbwd_"},         // CVT_FAMILY_CONV2D_BWD
    {"dwconv_bn", "cvt_dwbn_"},             // CVT_FAMILY_DWCONV_BN
    {"dwconv_bn_bwd", "cvt_dwbnbwd_"},      // CVT_FAMILY_DWCONV_BN_BWD
};
constexpr int kFamilyCount = static_cast<int>(sizeof(kFamilies) / sizeof(kFamilies[0]));
static_assert(kFamilyCount == CVT_FAMILY_DWCONV_BN_BWD + 1, "one entry per kernel family");

inline const char* family_name(int family) {
  return family > 0 && family < kFamilyCount ? kFamilies[family].name : nullptr;
}

inline const char* family_prefix(int family) {
  return family > 0 && family < kFamilyCount ? kFamilies[family].prefix : nullptr;
}

struct Kernel {
  std::string name;
  std::string part;  // "cvt_kernel::<op>_<pass>" (the name's first two fields): the profiler scope of its launches
  int family = 0;
  void* can_implement_fn = nullptr;
  void* workspace_size_fn = nullptr;
  void* launch_fn = nullptr;
  void* colsum_flush_fn = nullptr;  // cvt_colsum_flush, exported by the libraries that defer column sums

  // Typed calls: Args is the family's cvt_*_args (the caller checked `family`).
  template <class Args>
  int can_implement(const Args& a) const {
    return reinterpret_cast<int (*)(const Args*)>(can_implement_fn)(&a);
  }
  template <class Args>
  size_t workspace_size(const Args& a) const {
    return reinterpret_cast<size_t (*)(const Args*)>(workspace_size_fn)(&a);
  }
  template <class Args>
  int launch(const Args& a, void* workspace, void* stream) const {
    return reinterpret_cast<int (*)(const Args*, void*, void*)>(launch_fn)(&a, workspace, stream);
  }
  int colsum_flush(cvt_colsum_list* list, void* stream) const {
    return reinterpret_cast<cvt_colsum_flush_fn>(colsum_flush_fn)(list, stream);
  }
};

inline std::mutex g_kernels_mutex;
// Never shrinks and entries never move: a kernel id stays valid for the life of the process.
inline std::vector<std::unique_ptr<Kernel>> g_kernels;
inline std::unordered_map<std::string, int64_t> g_kernels_by_path;

inline void* must_sym(void* handle, const std::string& sym, const std::string& path) {
  void* p = dlsym(handle, sym.c_str());
  TORCH_CHECK(p, "cvt_cutlass: kernel library " + path + " lacks symbol " + sym);
  return p;
}

// "cvt_kernel::linear_wgrad" for "cvt_linear_wgrad_sm90a_...": the kernel-name grammar's op and pass.
inline std::string part_of(const std::string& name) {
  const size_t op = name.find('_'), pass = name.find('_', op + 1);  // "cvt_", "<op>_"
  if (op == std::string::npos || pass == std::string::npos) return "cvt_kernel::" + name;
  return "cvt_kernel::" + name.substr(op + 1, name.find('_', pass + 1) - op - 1);
}

// The entry points of an opened kernel library, checked to be the kernel the caller expects.
inline std::unique_ptr<Kernel> describe(void* handle, const std::string& path, const std::string& expected_name) {
  auto info_fn = reinterpret_cast<cvt_kernel_info_fn>(must_sym(handle, "cvt_kernel_info_get", path));
  const cvt_kernel_info* info = info_fn();
  TORCH_CHECK(info && info->abi_version == CVT_KERNEL_ABI_VERSION,
              "cvt_cutlass: " + path + " was built for another kernel ABI version; it is rebuilt on the next build");
  const char* prefix = family_prefix(info->family);
  TORCH_CHECK(prefix, "cvt_cutlass: " + path + " is of unknown kernel family " + std::to_string(info->family));
  TORCH_CHECK(expected_name == info->name,
              "cvt_cutlass: " + path + " holds kernel " + std::string(info->name) + ", expected " + expected_name);
  auto k = std::make_unique<Kernel>();
  k->name = info->name;
  k->part = part_of(k->name);
  k->family = info->family;
  k->can_implement_fn = must_sym(handle, std::string(prefix) + "can_implement", path);
  k->workspace_size_fn = must_sym(handle, std::string(prefix) + "workspace_size", path);
  k->launch_fn = must_sym(handle, std::string(prefix) + "launch", path);
  k->colsum_flush_fn = dlsym(handle, "cvt_colsum_flush");  // optional
  return k;
}

// dlopen a kernel library, check it is the kernel the caller expects, return its id.
inline int64_t load_kernel(const std::string& path, const std::string& expected_name) {
  std::lock_guard<std::mutex> lock(g_kernels_mutex);
  auto it = g_kernels_by_path.find(path);
  if (it != g_kernels_by_path.end()) return it->second;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle, "cvt_cutlass: cannot load kernel library " + path + ": " + std::string(dlerror()));
  try {
    auto k = describe(handle, path, expected_name);
    const int64_t id = static_cast<int64_t>(g_kernels.size());
    g_kernels.push_back(std::move(k));
    g_kernels_by_path.emplace(path, id);
    return id;
  } catch (...) {
    dlclose(handle);  // a rebuilt library at the same path must not find this one mapped
    throw;
  }
}

inline const Kernel& kernel(int64_t id) {
  std::lock_guard<std::mutex> lock(g_kernels_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(g_kernels.size()), "cvt_cutlass: bad kernel id " + std::to_string(id));
  return *g_kernels[id];
}

inline const Kernel& kernel_of_family(int64_t id, std::initializer_list<int> families, const char* what) {
  const Kernel& k = kernel(id);
  for (int f : families)
    if (k.family == f) return k;
  TORCH_CHECK(false, "cvt_cutlass: kernel " + k.name + " is not " + what + " kernel");
  return k;
}

}  // namespace cvt
