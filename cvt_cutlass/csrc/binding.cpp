// cvt_cutlass torch binding: loads kernel libraries and launches them on PyTorch tensors.
//
// Registers the private op namespace cvt_cutlass_C. The public ops (torch.ops.cvt_cutlass.*) are
// Python custom ops that choose a kernel, make sure it is built and call into these.
//
// No CUDA header and no libtorch_cuda: the current stream comes from c10's device-generic guard
// interface (Stream::native_handle()), the device guard is c10::DeviceGuard and workspaces are
// at::empty on the tensors' device (PyTorch's caching allocator). Nothing here allocates with
// cudaMalloc, frees or synchronises, so ops can be captured in CUDA graphs.
#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include "cvt_attn_abi.h"
#include "cvt_conv_abi.h"
#include "cvt_kernel_abi.h"
#include "cvt_norm_abi.h"

namespace {

struct LoadedGemm {
  std::string name;
  std::string path;
  int family = 0;
  int min_cc = 0;
  // CVT_FAMILY_GEMM
  cvt_gemm_can_implement_fn can_implement = nullptr;
  cvt_gemm_workspace_size_fn workspace_size = nullptr;
  cvt_gemm_run_fn run = nullptr;
  // CVT_FAMILY_CONV2D_FPROP, CVT_FAMILY_DWCONV2D
  cvt_conv_can_implement_fn conv_can_implement = nullptr;
  cvt_conv_workspace_size_fn conv_workspace_size = nullptr;
  cvt_conv_run_fn conv_run = nullptr;
  // CVT_FAMILY_ATTENTION
  cvt_attn_can_implement_fn attn_can_implement = nullptr;
  cvt_attn_workspace_size_fn attn_workspace_size = nullptr;
  cvt_attn_run_fn attn_run = nullptr;
  // CVT_FAMILY_LAYERNORM
  cvt_norm_can_implement_fn norm_can_implement = nullptr;
  cvt_norm_workspace_size_fn norm_workspace_size = nullptr;
  cvt_norm_run_fn norm_run = nullptr;
};

std::mutex g_mutex;
// Never shrinks and entries never move: a kernel id stays valid for the life of the process.
std::vector<std::unique_ptr<LoadedGemm>> g_kernels;
std::unordered_map<std::string, int64_t> g_by_path;

template <typename Fn>
Fn must_sym(void* handle, const char* sym, const std::string& path) {
  void* p = dlsym(handle, sym);
  TORCH_CHECK(p, "cvt_cutlass: kernel library ", path, " lacks symbol ", sym);
  return reinterpret_cast<Fn>(p);
}

// dlopen a kernel library, check it is the kernel the caller expects, return its id.
int64_t load_kernel(const std::string& path, const std::string& expected_name) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_by_path.find(path);
  if (it != g_by_path.end()) return it->second;
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle, "cvt_cutlass: cannot load kernel library ", path, ": ", dlerror());
  auto info_fn = must_sym<cvt_kernel_info_fn>(handle, "cvt_kernel_info_get", path);
  const cvt_kernel_info* info = info_fn();
  TORCH_CHECK(info && info->abi_version == CVT_KERNEL_ABI_VERSION, "cvt_cutlass: ", path,
              " was built for another kernel ABI version; clear the cache (CVT_CUTLASS_CACHE)");
  TORCH_CHECK(info->family == CVT_FAMILY_GEMM || info->family == CVT_FAMILY_CONV2D_FPROP ||
                  info->family == CVT_FAMILY_DWCONV2D || info->family == CVT_FAMILY_ATTENTION ||
                  info->family == CVT_FAMILY_LAYERNORM,
              "cvt_cutlass: " + path + " is of unknown kernel family " + std::to_string(info->family));
  TORCH_CHECK(expected_name == info->name, "cvt_cutlass: ", path, " holds kernel ", info->name,
              ", expected ", expected_name);
  auto k = std::make_unique<LoadedGemm>();
  k->name = info->name;
  k->path = path;
  k->family = info->family;
  k->min_cc = info->min_cc;
  if (info->family == CVT_FAMILY_GEMM) {
    k->can_implement = must_sym<cvt_gemm_can_implement_fn>(handle, "cvt_gemm_can_implement", path);
    k->workspace_size = must_sym<cvt_gemm_workspace_size_fn>(handle, "cvt_gemm_workspace_size", path);
    k->run = must_sym<cvt_gemm_run_fn>(handle, "cvt_gemm_run", path);
  } else if (info->family == CVT_FAMILY_ATTENTION) {
    k->attn_can_implement = must_sym<cvt_attn_can_implement_fn>(handle, "cvt_attn_can_implement", path);
    k->attn_workspace_size = must_sym<cvt_attn_workspace_size_fn>(handle, "cvt_attn_workspace_size", path);
    k->attn_run = must_sym<cvt_attn_run_fn>(handle, "cvt_attn_run", path);
  } else if (info->family == CVT_FAMILY_LAYERNORM) {
    k->norm_can_implement = must_sym<cvt_norm_can_implement_fn>(handle, "cvt_norm_can_implement", path);
    k->norm_workspace_size = must_sym<cvt_norm_workspace_size_fn>(handle, "cvt_norm_workspace_size", path);
    k->norm_run = must_sym<cvt_norm_run_fn>(handle, "cvt_norm_run", path);
  } else {
    k->conv_can_implement = must_sym<cvt_conv_can_implement_fn>(handle, "cvt_conv_can_implement", path);
    k->conv_workspace_size = must_sym<cvt_conv_workspace_size_fn>(handle, "cvt_conv_workspace_size", path);
    k->conv_run = must_sym<cvt_conv_run_fn>(handle, "cvt_conv_run", path);
  }
  int64_t id = static_cast<int64_t>(g_kernels.size());
  g_kernels.push_back(std::move(k));
  g_by_path.emplace(path, id);
  return id;
}

const LoadedGemm& kernel(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(g_kernels.size()), "cvt_cutlass: bad kernel id " + std::to_string(id));
  return *g_kernels[id];
}

std::string kernel_name(int64_t id) { return kernel(id).name; }

// "[2, 197, 6, 64]" without c10's ostream operator for ArrayRef (messages are built only from
// scalars and std::string, the same way on every path).
std::string dims(at::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

const char* status_text(int st) {
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

// A validated call's launch, the same for every family: on the operands' device (validation
// happened before, so a refusal never runs under the guard), with a workspace from PyTorch's
// caching allocator and the current stream. Returns the library's status.
template <typename Size, typename Run>
int run_with_workspace(const at::Tensor& like, Size&& workspace_size, Run&& run) {
  c10::DeviceGuard guard(like.device());
  const size_t bytes = workspace_size();
  at::Tensor ws;
  if (bytes > 0) ws = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  c10::impl::VirtualGuardImpl impl(like.device().type());
  return run(bytes ? ws.data_ptr() : nullptr, bytes, impl.getStream(like.device()).native_handle());
}

void check_rows(const at::Tensor& t, const char* what, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, std::string("cvt_cutlass: ") + what +
              " must be (" + std::to_string(rows) + ", " + std::to_string(cols) + "), got " + dims(t.sizes()));
  TORCH_CHECK(t.stride(1) == 1 || cols == 1, "cvt_cutlass: ", what, " rows must be contiguous");
}

// D = epilogue(A @ B^T): A (M, K), B (N, K), D (M, N), C (M, N), aux (M, N), bias (N,).
void gemm(int64_t id, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
          const std::optional<at::Tensor>& c, const at::Tensor& d, const std::optional<at::Tensor>& aux) {
  const LoadedGemm& k = kernel(id);
  TORCH_CHECK(k.family == CVT_FAMILY_GEMM, "cvt_cutlass: kernel ", k.name, " is not a GEMM kernel");
  const int64_t m = a.size(0), kk = a.size(1), n = b.size(0);
  check_rows(a, "A", m, kk);
  check_rows(b, "B (weight)", n, kk);
  check_rows(d, "D (output)", m, n);
  const auto dev = a.device();
  const auto dt = a.scalar_type();
  for (const at::Tensor* t : {&b, &d}) {
    TORCH_CHECK(t->device() == dev && t->scalar_type() == dt, "cvt_cutlass: ", k.name,
                ": all operands must share A's device and dtype");
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "cvt_cutlass: bias must be a contiguous (N,) vector");
    TORCH_CHECK(bias->device() == dev && bias->scalar_type() == dt, "cvt_cutlass: bias device/dtype mismatch");
  }
  if (c) {
    check_rows(*c, "C (residual)", m, n);
    TORCH_CHECK(c->device() == dev && c->scalar_type() == dt, "cvt_cutlass: residual device/dtype mismatch");
  }
  if (aux) {
    check_rows(*aux, "aux", m, n);
    TORCH_CHECK(aux->device() == dev && aux->scalar_type() == dt, "cvt_cutlass: aux device/dtype mismatch");
  }

  cvt_gemm_args p{};
  p.m = m; p.n = n; p.k = kk;
  p.a = a.data_ptr(); p.lda = a.stride(0);
  p.b = b.data_ptr(); p.ldb = b.stride(0);
  p.d = d.data_ptr(); p.ldd = d.stride(0);
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.c = c ? c->data_ptr() : nullptr; p.ldc = c ? c->stride(0) : 0;
  p.aux = aux ? aux->data_ptr() : nullptr; p.ldaux = aux ? aux->stride(0) : 0;
  p.device_id = dev.index();
  p.sm_count = 0;  // the kernel library queries and caches it per device

  // TMA and cp.async read 16-byte vectors: every operand must start 16-byte aligned.
  for (const void* ptr : {p.a, p.b, static_cast<const void*>(p.d), p.bias, p.c, static_cast<const void*>(p.aux)})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "cvt_cutlass: kernel ", k.name,
                ": every operand must start 16-byte aligned");
  int st = k.can_implement(&p);
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel " + k.name + " cannot run M=" + std::to_string(m) + " N=" +
              std::to_string(n) + " K=" + std::to_string(kk) + " (lda=" + std::to_string(p.lda) + ", ldd=" +
              std::to_string(p.ldd) + "): " + status_text(st));
  st = run_with_workspace(a, [&] { return k.workspace_size(&p); },
                          [&](void* ws, size_t bytes, void* stream) { return k.run(&p, ws, bytes, stream); });
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel " + k.name + " failed on M=" + std::to_string(m) + " N=" +
              std::to_string(n) + " K=" + std::to_string(kk) + ": " + status_text(st));
}

// An NHWC image batch view: (N, H, W, C) with packed pixels; the image stride may exceed H*W*C.
void check_nhwc(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 4, "cvt_cutlass: ", what, " must be a 4-D NHWC view, got ", dims(t.sizes()));
  TORCH_CHECK(t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3),
              "cvt_cutlass: ", what, " must have packed (H, W, C) pixels, got strides ", dims(t.strides()));
}

// y = conv(x, w) + bias on NHWC views. Implicit-GEMM fprop: w (K, R, S, C), bias (K,), in x's
// dtype. Depthwise: w (R, S, C) and bias (C,) in fp32; ``cls_rows`` rows in front of each image
// of x are copied to the rows in front of the same image of y (both views start after them).
void conv2d(int64_t id, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
            const at::Tensor& y, at::IntArrayRef padding, at::IntArrayRef stride, int64_t cls_rows) {
  const LoadedGemm& k = kernel(id);
  const bool dw = k.family == CVT_FAMILY_DWCONV2D;
  TORCH_CHECK(dw || k.family == CVT_FAMILY_CONV2D_FPROP, "cvt_cutlass: kernel ", k.name, " is not a conv kernel");
  TORCH_CHECK(padding.size() == 2 && stride.size() == 2, "cvt_cutlass: padding and stride must have 2 values");
  check_nhwc(x, "x");
  check_nhwc(y, "y");
  const auto dev = x.device();
  TORCH_CHECK(y.device() == dev && y.scalar_type() == x.scalar_type() && w.device() == dev,
              "cvt_cutlass: ", k.name, ": x, w and y must share a device, x and y a dtype");
  const auto wdt = dw ? at::kFloat : x.scalar_type();
  TORCH_CHECK(w.scalar_type() == wdt && w.is_contiguous(), "cvt_cutlass: " + k.name + ": the filter must be contiguous " +
              c10::toString(wdt) + ", got " + c10::toString(w.scalar_type()));
  const int64_t kout = y.size(3);
  int64_t r, s;
  if (dw) {
    TORCH_CHECK(w.dim() == 3 && w.size(2) == x.size(3) && kout == x.size(3),
                "cvt_cutlass: depthwise filter must be (R, S, C) with C = x's and y's channels");
    r = w.size(0); s = w.size(1);
  } else {
    TORCH_CHECK(w.dim() == 4 && w.size(0) == kout && w.size(3) == x.size(3),
                "cvt_cutlass: conv filter must be (K, R, S, C) with K = y's and C = x's channels, got ", dims(w.sizes()));
    r = w.size(1); s = w.size(2);
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == kout && bias->is_contiguous() && bias->device() == dev &&
                    bias->scalar_type() == wdt,
                std::string("cvt_cutlass: bias must be a contiguous (K,) ") + c10::toString(wdt) + " vector on x's device");
  }
  TORCH_CHECK(y.size(0) == x.size(0), "cvt_cutlass: x and y batch sizes differ");
  TORCH_CHECK(cls_rows >= 0 && (cls_rows == 0 || dw), "cvt_cutlass: cls_rows is a depthwise-only option");
  TORCH_CHECK(x.storage_offset() >= cls_rows * x.size(3) && y.storage_offset() >= cls_rows * kout,
              "cvt_cutlass: the views must start after " + std::to_string(cls_rows) + " cls row(s) of their storage");

  cvt_conv_args p{};
  p.n = x.size(0); p.h = x.size(1); p.w = x.size(2); p.c = x.size(3);
  p.k = kout; p.r = r; p.s = s; p.p = y.size(1); p.q = y.size(2);
  p.pad_h = padding[0]; p.pad_w = padding[1]; p.stride_h = stride[0]; p.stride_w = stride[1];
  p.dilation_h = 1; p.dilation_w = 1;
  p.x = x.data_ptr(); p.x_image_stride = x.size(0) > 1 ? x.stride(0) : x.size(1) * x.size(2) * x.size(3) + cls_rows * x.size(3);
  p.filter = w.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.y = y.data_ptr(); p.y_image_stride = y.size(0) > 1 ? y.stride(0) : y.size(1) * y.size(2) * kout + cls_rows * kout;
  p.cls_rows = cls_rows;
  p.device_id = dev.index();
  int st = k.conv_can_implement(&p);
  if (st != CVT_OK) {
    // One preformatted string: the variadic message of a TORCH_CHECK after this library call
    // crashed the process on the H200 (2026-11-21), a plain string did not.
    const std::string msg = "cvt_cutlass: kernel " + k.name + " cannot run x " + dims(x.sizes()) + " (image stride " +
                            std::to_string(p.x_image_stride) + ") -> y " + dims(y.sizes()) + " (image stride " +
                            std::to_string(p.y_image_stride) + "), filter " + dims(w.sizes()) + ", padding " +
                            dims(padding) + ", stride " + dims(stride) + ": " + status_text(st);
    TORCH_CHECK(false, msg);
  }
  st = run_with_workspace(x, [&] { return k.conv_workspace_size(&p); },
                          [&](void* ws, size_t bytes, void* stream) { return k.conv_run(&p, ws, bytes, stream); });
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel ", k.name, " failed on x ", dims(x.sizes()), ": ", status_text(st));
}

// o = softmax(scale * q k^T) v per (batch, head), lse = its logsumexp. q (B, Lq, H, D), k and v
// (B, Lkv, H, D) with unit stride along D; o (B, Lq, H, D) packed; lse (B, H, Lq) float whose
// (batch, head) rows are lse.stride(1) apart (the kernel's padded layout).
void attention(int64_t id, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
               const at::Tensor& lse, double scale) {
  const LoadedGemm& kern = kernel(id);
  TORCH_CHECK(kern.family == CVT_FAMILY_ATTENTION, "cvt_cutlass: kernel ", kern.name, " is not an attention kernel");
  for (const at::Tensor* t : {&q, &k, &v, &o}) {
    TORCH_CHECK(t->dim() == 4 && t->stride(3) == 1, "cvt_cutlass: q, k, v, o must be (B, L, H, D) with unit stride along D");
    TORCH_CHECK(t->device() == q.device() && t->scalar_type() == q.scalar_type(),
                "cvt_cutlass: q, k, v, o must share a device and dtype");
  }
  const int64_t b = q.size(0), lq = q.size(1), h = q.size(2), d = q.size(3), lkv = k.size(1);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && k.size(2) == h && v.size(2) == h && k.size(3) == d &&
                  v.size(3) == d && v.size(1) == lkv,
              "cvt_cutlass: q ", dims(q.sizes()), ", k ", dims(k.sizes()), ", v ", dims(v.sizes()), " do not match");
  TORCH_CHECK(o.sizes() == q.sizes() && o.is_contiguous(), "cvt_cutlass: o must be a contiguous ", dims(q.sizes()));
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == b && lse.size(1) == h && lse.size(2) == lq && lse.stride(2) == 1 &&
                  lse.stride(0) == h * lse.stride(1) && lse.scalar_type() == at::kFloat && lse.device() == q.device(),
              "cvt_cutlass: lse must be a float (B, H, Lq) view with packed padded rows");
  cvt_attn_args p{};
  p.batch = b; p.heads = h; p.lq = lq; p.lkv = lkv; p.head_dim = d;
  p.q = q.data_ptr(); p.q_stride_b = q.stride(0); p.q_stride_m = q.stride(1); p.q_stride_h = q.stride(2);
  p.k = k.data_ptr(); p.k_stride_b = k.stride(0); p.k_stride_m = k.stride(1); p.k_stride_h = k.stride(2);
  p.v = v.data_ptr(); p.v_stride_b = v.stride(0); p.v_stride_m = v.stride(1); p.v_stride_h = v.stride(2);
  p.o = o.data_ptr();
  p.lse = lse.data_ptr<float>(); p.lse_stride_bh = lse.stride(1);
  p.scale = static_cast<float>(scale);
  p.device_id = q.device().index();
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.o)})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "cvt_cutlass: kernel ", kern.name,
                ": q, k, v and o must start 16-byte aligned");
  int st = kern.attn_can_implement(&p);
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel ", kern.name, " cannot run q ", dims(q.sizes()), " (strides ", dims(q.strides()),
              "), k ", dims(k.sizes()), " (strides ", dims(k.strides()), "): ", status_text(st));
  st = run_with_workspace(q, [&] { return kern.attn_workspace_size(&p); },
                          [&](void* ws, size_t bytes, void* stream) { return kern.attn_run(&p, ws, bytes, stream); });
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel ", kern.name, " failed on q ", dims(q.sizes()), ": ", status_text(st));
}

// y[i] = [prefix; LayerNorm(x[i])] per image: x (B, L, C) and y (B, P + L, C) with unit stride
// along C; weight, bias (C,) and prefix (P, C) contiguous, in x's dtype; stats, if given, a
// contiguous float (B, L, 2) that receives (mean, rstd) per row.
void layer_norm(int64_t id, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                const std::optional<at::Tensor>& prefix, const at::Tensor& y, const std::optional<at::Tensor>& stats,
                double eps) {
  const LoadedGemm& k = kernel(id);
  TORCH_CHECK(k.family == CVT_FAMILY_LAYERNORM, "cvt_cutlass: kernel " + k.name + " is not a LayerNorm kernel");
  TORCH_CHECK(x.dim() == 3 && y.dim() == 3 && x.stride(2) == 1 && y.stride(2) == 1,
              "cvt_cutlass: x and y must be (B, L, C) with unit stride along C, got x " + dims(x.sizes()) + ", y " +
                  dims(y.sizes()));
  const int64_t bsz = x.size(0), rows = x.size(1), c = x.size(2);
  const int64_t pre = prefix ? prefix->size(0) : 0;
  TORCH_CHECK(y.size(0) == bsz && y.size(1) == pre + rows && y.size(2) == c,
              "cvt_cutlass: y must be (B, P + L, C) = [" + std::to_string(bsz) + ", " + std::to_string(pre + rows) +
                  ", " + std::to_string(c) + "], got " + dims(y.sizes()));
  const auto dev = x.device();
  const auto dt = x.scalar_type();
  for (const at::Tensor* t : {&w, &b, &y}) {
    TORCH_CHECK(t->device() == dev && t->scalar_type() == dt, "cvt_cutlass: " + k.name +
                ": weight, bias, prefix and y must share x's device and dtype");
  }
  TORCH_CHECK(w.dim() == 1 && b.dim() == 1 && w.size(0) == c && b.size(0) == c && w.is_contiguous() &&
                  b.is_contiguous(), "cvt_cutlass: weight and bias must be contiguous (C,) vectors");
  if (prefix) {
    TORCH_CHECK(prefix->dim() == 2 && prefix->size(1) == c && prefix->is_contiguous() && prefix->device() == dev &&
                    prefix->scalar_type() == dt, "cvt_cutlass: prefix must be a contiguous (P, C) tensor like x");
  }
  if (stats) {
    TORCH_CHECK(stats->dim() == 3 && stats->size(0) == bsz && stats->size(1) == rows && stats->size(2) == 2 &&
                    stats->is_contiguous() && stats->scalar_type() == at::kFloat && stats->device() == dev,
                "cvt_cutlass: stats must be a contiguous float (B, L, 2) tensor on x's device");
  }
  cvt_norm_args p{};
  p.images = bsz; p.rows = rows; p.c = c;
  p.x = x.data_ptr(); p.x_row_stride = x.stride(1); p.x_image_stride = bsz > 1 ? x.stride(0) : rows * x.stride(1);
  p.weight = w.data_ptr(); p.bias = b.data_ptr();
  p.prefix = prefix ? prefix->data_ptr() : nullptr; p.prefix_rows = pre;
  p.y = y.data_ptr(); p.y_row_stride = y.stride(1); p.y_image_stride = bsz > 1 ? y.stride(0) : (pre + rows) * y.stride(1);
  p.stats = stats ? stats->data_ptr() : nullptr;
  p.eps = static_cast<float>(eps);
  p.device_id = dev.index();
  int st = k.norm_can_implement(&p);
  if (st != CVT_OK) {
    const std::string msg = "cvt_cutlass: kernel " + k.name + " cannot run x " + dims(x.sizes()) + " (strides " +
                            dims(x.strides()) + ") -> y " + dims(y.sizes()) + " (strides " + dims(y.strides()) +
                            ") with " + std::to_string(pre) + " prefix row(s): " + status_text(st);
    TORCH_CHECK(false, msg);
  }
  st = run_with_workspace(x, [&] { return k.norm_workspace_size(&p); },
                          [&](void* ws, size_t bytes, void* stream) { return k.norm_run(&p, ws, bytes, stream); });
  TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel " + k.name + " failed on x " + dims(x.sizes()) + ": " + status_text(st));
}

// The raw current stream as the binding sees it (tests compare it with torch's).
int64_t current_stream_handle(const at::Tensor& like) {
  c10::impl::VirtualGuardImpl impl(like.device().type());
  return reinterpret_cast<int64_t>(impl.getStream(like.device()).native_handle());
}

}  // namespace

TORCH_LIBRARY(cvt_cutlass_C, m) {
  m.def("load_kernel(str path, str name) -> int", &load_kernel);
  m.def("kernel_name(int id) -> str", &kernel_name);
  m.def("gemm(int kernel, Tensor a, Tensor b, Tensor? bias, Tensor? c, Tensor(d!) d, Tensor(e!)? aux) -> ()");
  m.def("current_stream_handle(Tensor like) -> int");
  m.def("conv2d(int kernel, Tensor x, Tensor w, Tensor? bias, Tensor(y!) y, int[] padding, int[] stride, "
        "int cls_rows) -> ()");
  m.def("attention(int kernel, Tensor q, Tensor k, Tensor v, Tensor(o!) o, Tensor(l!) lse, float scale) -> ()");
  m.def("layer_norm(int kernel, Tensor x, Tensor w, Tensor b, Tensor? prefix, Tensor(y!) y, Tensor(s!)? stats, "
        "float eps) -> ()");
}

TORCH_LIBRARY_IMPL(cvt_cutlass_C, CUDA, m) {
  m.impl("gemm", &gemm);
  m.impl("current_stream_handle", &current_stream_handle);
  m.impl("conv2d", &conv2d);
  m.impl("attention", &attention);
  m.impl("layer_norm", &layer_norm);
}
