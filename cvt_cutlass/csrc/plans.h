// The hot path's plan cache, counters, launch helper and the two calls back into Python.
//
// A public op (torch.ops.cvt_cutlass.<op>) validates and chooses a kernel once per problem: its
// CUDA implementation builds a Key from everything the choice depends on (op, every tensor's
// dtype, device, sizes and strides, the string/int arguments), looks it up here, and on a miss
// calls the op's Python planner (cvt_cutlass_C::<op>_plan, registered by cvt_cutlass.ops.<op>:
// argument checks, kernel selection, build on first use), then prepares the kernel's arguments
// and asks the kernel library whether it can run them. A hit only fills in the data pointers and
// launches. What no kernel serves goes to the op's Python fallback (cvt_cutlass_C::<op>_fallback:
// counted, logged once, strict mode raises).
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/TensorUtils.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels.h"
#include "side_stream.h"

namespace cvt {

// What a planner answers besides a kernel id.
constexpr int64_t kPlanFallback = -1;  // no kernel serves this problem: the Python fallback runs
constexpr int64_t kPlanEmpty = -2;     // valid, nothing to compute (an empty output)

// ------------------------------------------------------------------------------------ counters
// The differentiable ops (each has an Autograd kernel) come first, then the backward ops.
enum Op : int {
  kLinear, kLinearGeluAux, kConv2d, kDwconv, kAttention, kLayerNorm, kMlp, kDwconvBnTrain, kCvtLayer,
  kDwconvBnStats, kDwconvBnApply,
  kLinearDgrad, kLinearWgrad, kLayerNormBackward, kAttentionBackward, kConv2dBackward, kDwconvBnBackward,
  kCvtLayerBackward, kDwconvBnBackwardSums, kDwconvBnBackwardApply, kOpCount
};
inline const char* const kOpNames[kOpCount] = {"linear", "linear_gelu_aux", "conv2d_nhwc", "dwconv_tokens",
                                               "attention", "layer_norm_tokens", "mlp", "dwconv_bn_train",
                                               "cvt_layer", "dwconv_bn_stats", "dwconv_bn_apply",
                                               "linear_dgrad", "linear_wgrad",
                                               "layer_norm_tokens_backward", "attention_backward",
                                               "conv2d_nhwc_backward", "dwconv_bn_backward", "cvt_layer_backward",
                                               "dwconv_bn_backward_sums", "dwconv_bn_backward_apply"};
// Kernel calls per (op, selection source: 0 = tuned table, 1 = heuristic).
inline std::array<std::array<std::atomic<int64_t>, 2>, kOpCount> g_calls{};

inline void count_call(Op op, int64_t source) {
  g_calls[op][source ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}

// Host time inside the kernel libraries' launch entry points (their params, TMA descriptors and
// launch API calls), per kernel family: (calls, nanoseconds). What an op call spends around it
// (plan lookup, allocations, the dispatcher) is the rest of its host time.
inline std::array<std::array<std::atomic<int64_t>, 2>, kFamilyCount> g_library_host{};

inline void count_library_host(int family, std::chrono::steady_clock::duration took) {
  if (family < 0 || family >= kFamilyCount) return;
  g_library_host[family][0].fetch_add(1, std::memory_order_relaxed);
  g_library_host[family][1].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(took).count(),
                                      std::memory_order_relaxed);
}

// Host time inside the composite ops' implementations (the layer op's forward and backward:
// everything from entry to return, the kernel libraries' time included), per op: (calls, ns).
inline std::array<std::array<std::atomic<int64_t>, 2>, kOpCount> g_op_host{};

// Adds the time from construction to destruction to g_op_host[op].
class OpHostTimer {
 public:
  explicit OpHostTimer(Op op) : op_(op), t0_(std::chrono::steady_clock::now()) {}
  ~OpHostTimer() {
    g_op_host[op_][0].fetch_add(1, std::memory_order_relaxed);
    g_op_host[op_][1].fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count(),
        std::memory_order_relaxed);
  }
  OpHostTimer(const OpHostTimer&) = delete;
  OpHostTimer& operator=(const OpHostTimer&) = delete;

 private:
  Op op_;
  std::chrono::steady_clock::time_point t0_;
};

// ------------------------------------------------------------------------------------ keys
struct Key {
  c10::SmallVector<int64_t, 64> v;
  explicit Key(Op op) { v.push_back(op); }
  void add(int64_t x) { v.push_back(x); }
  void add(const at::Tensor& t) {
    if (!t.defined()) return v.push_back(-1);
    v.push_back(static_cast<int64_t>(t.scalar_type()));
    v.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    v.push_back(t.dim());
    for (int64_t s : t.sizes()) v.push_back(s);
    for (int64_t s : t.strides()) v.push_back(s);
  }
  void add(const std::optional<at::Tensor>& t) { t ? add(*t) : v.push_back(-2); }
  void add(c10::string_view s) {
    v.push_back(static_cast<int64_t>(s.size()));
    for (char c : s) v.push_back(c);
  }
  bool operator==(const Key& o) const { return v.size() == o.v.size() && std::equal(v.begin(), v.end(), o.v.begin()); }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t x : k.v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// ------------------------------------------------------------------------------------ cache
// Plans of one op family; readers share a lock, a miss takes it exclusively to insert. Plans are
// immutable once inserted and held by shared_ptr, so clear() never pulls one from under a call.
template <class Plan>
class PlanCache {
 public:
  std::shared_ptr<const Plan> find(const Key& k) const {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = map_.find(k);
    return it == map_.end() ? nullptr : it->second;
  }
  std::shared_ptr<const Plan> insert(Key k, std::shared_ptr<const Plan> p) {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (map_.size() >= kMaxPlans) map_.clear();  // a bound for programs that never repeat a shape
    return map_.emplace(std::move(k), std::move(p)).first->second;
  }
  void clear() {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    map_.clear();
  }
  size_t size() const {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    return map_.size();
  }

 private:
  static constexpr size_t kMaxPlans = 1 << 16;
  mutable std::shared_mutex mutex_;
  std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> map_;
};

// What a plan holds for one kernel launch: the kernel id (or kPlanFallback / kPlanEmpty), where
// the choice came from (0 table, 1 heuristic), the kernel, its ABI argument struct (sizes and
// strides; the pointers are refilled per call) and its workspace bytes. ShapedPlan adds the
// output's sizes.
template <class Args>
struct KernelPlan {
  int64_t code = kPlanFallback;
  int64_t source = 0;
  const Kernel* kernel = nullptr;
  Args args{};
  size_t workspace = 0;
};
template <class Args>
struct ShapedPlan : KernelPlan<Args> {
  std::vector<int64_t> out_sizes;
};

// Every family registers its cache's clear() and size() here (the kernel path or the selection
// tables changed: plans must be made again).
struct CacheHooks {
  std::vector<std::function<void()>> clear;
  std::vector<std::function<size_t()>> size;
};
inline CacheHooks& cache_hooks() {
  static CacheHooks hooks;
  return hooks;
}
template <class Plan>
PlanCache<Plan>& register_cache(PlanCache<Plan>& cache) {
  cache_hooks().clear.push_back([&cache] { cache.clear(); });
  cache_hooks().size.push_back([&cache] { return cache.size(); });
  return cache;
}

// ------------------------------------------------------------------------------------ plan time
// What a plan asks the kernel library (can_implement, workspace_size) depends on sizes and
// strides, not on where the data is: plans are made with this aligned stand-in for every pointer
// and shapes of meta tensors, so a first call's misaligned pointer never decides a plan (its
// calls are checked one by one) and making a plan allocates nothing on the GPU.
inline void* const kPlanPointer = reinterpret_cast<void*>(uintptr_t{1} << 20);

template <class P>
void plan_pointer(P*& p) {
  if (p) p = static_cast<P*>(kPlanPointer);
}

// A tensor's data pointer, or the stand-in for a meta tensor (a plan's outputs).
inline void* ptr_of(const at::Tensor& t) { return t.is_meta() ? kPlanPointer : t.data_ptr(); }

inline at::Tensor meta_like(at::IntArrayRef sizes, const at::Tensor& like) {
  return at::empty(sizes, like.options().device(at::kMeta));
}

// ------------------------------------------------------------------------------------ checks
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool aligned16(const at::Tensor& t) { return aligned16(t.data_ptr()); }
inline bool aligned16(const std::optional<at::Tensor>& t) { return !t || aligned16(t->data_ptr()); }

using OptT = std::optional<at::Tensor>;

// t where it is defined, else none (an autograd gradient or an op's output that may be absent).
inline OptT if_defined(const at::Tensor& t) { return t.defined() ? OptT(t) : OptT(); }

// Views of the 1-D `flat` shaped by `shapes` (shapes_of's list), in order: one as_strided each
// (one dispatcher call per tensor instead of a narrow and a view: a CvT-13 step makes ~700 of
// these views). `flat` is a fresh concatenation or its gradient, 1-D with unit stride; another
// layout is copied first (the views are then of the copy).
inline std::vector<at::Tensor> views_of(const at::Tensor& flat_in, at::IntArrayRef shapes) {
  const at::Tensor flat = flat_in.dim() == 1 && flat_in.stride(0) == 1 ? flat_in : flat_in.reshape({-1}).contiguous();
  std::vector<at::Tensor> out;
  out.reserve(shapes.size());
  int64_t offset = flat.storage_offset();
  std::vector<int64_t> strides;
  for (size_t k = 0; k < shapes.size(); k += 1 + shapes[k]) {
    const at::IntArrayRef sizes = shapes.slice(k + 1, static_cast<size_t>(shapes[k]));
    strides.assign(sizes.size(), 1);
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
    out.push_back(flat.as_strided(sizes, strides, offset));
    offset += c10::multiply_integers(sizes);
  }
  return out;
}


// Outputs a caller may give an op (views of its buffer: 16-byte aligned, contiguous, of the
// output's size and dtype, e.g. the layer op's weight gradients in one buffer), else new ones;
// given() copies a result computed elsewhere (a fallback) into the caller's.
inline at::Tensor given(const OptT& to, const at::Tensor& t) {
  if (!to || t.is_same(*to)) return t;
  to->copy_(t);
  return *to;
}

// ------------------------------------------------------------------------------------ launch
// The device of a call's operands, made current for its allocations and launch (a guard only
// when it is not the current one), with its current stream. Outputs and workspaces come from
// PyTorch's caching allocator directly (empty_generic: no trip through the dispatcher).
class OnDevice {
 public:
  explicit OnDevice(const at::Tensor& like) : dev_(like.device()) {
    if (impl().getDevice() != dev_) guard_.emplace(dev_);
    stream_ = impl().getStream(dev_).native_handle();
  }
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const {
    return at::Tensor(at::detail::empty_generic(sizes, allocator(), keys(), dtype, std::nullopt));
  }
  at::Tensor empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) const {
    return at::Tensor(at::detail::empty_strided_generic(sizes, strides, allocator(), keys(), dtype));
  }
  void* stream() const { return stream_; }

 private:
  static const c10::impl::VirtualGuardImpl& impl() {
    static const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    return cuda;
  }
  static c10::Allocator* allocator() {
    static c10::Allocator* a = c10::GetAllocator(c10::DeviceType::CUDA);
    return a;
  }
  static c10::DispatchKeySet keys() { return c10::DispatchKeySet(c10::DispatchKey::CUDA); }

  c10::Device dev_;
  std::optional<c10::DeviceGuard> guard_;
  void* stream_ = nullptr;
};

// A torch-profiler scope around a kernel library's launches (kernels.h, Kernel::part): the
// profiler gives the kernels' device time to it. `name` must outlive the profile (the kernels'
// names and literals do). With no profiler active it costs a check of its callbacks.
class PartScope {
 public:
  explicit PartScope(const char* name) : scope_(at::RecordScope::FUNCTION) {
    if (scope_.isActive()) scope_.before(name);
  }

 private:
  at::RecordFunction scope_;
};

// ------------------------------------------------------------------------------------ deferred sums
// The finishing column sums of the kernels launched in a scope (the layer op's backward), summed
// by one launch at its end (operators/common/abi.h: cvt_colsum_list): launch() below hands the
// list to every library whose ABI takes one and keeps the workspaces holding their partials (the
// whole workspace: the depthwise backward's also holds its dz, and the SM90 weight gradient's
// parallel slabs their fp32 partials, up to 9.4 MB for a stage-2 MLP weight, so a layer backward's
// peak grows by those until the flush; +0.05 GiB on CvT-13's training step at batch 128, and with
// the slabs the step's peak stayed at 6.11-6.17 GiB, H100, 2026-12-06).
// flush() runs the sums through a library that deferred some; a scope left by an exception drops
// them with the results that needed them.
class DeferredSums {
 public:
  cvt_colsum_list* list() { return &list_; }
  void keep(at::Tensor ws) { keep_.push_back(std::move(ws)); }
  void deferred_by(const Kernel& k) {
    if (list_.count > 0 && !flusher_) {
      TORCH_CHECK(k.colsum_flush_fn, "cvt_cutlass: kernel " + k.name + " deferred column sums but cannot flush them");
      flusher_ = &k;
    }
  }
  void flush(void* stream) {
    if (list_.count > 0) {
      PartScope scope("cvt_kernel::colsum_flush");
      const int st = flusher_->colsum_flush(&list_, stream);
      TORCH_CHECK(st == CVT_OK, "cvt_cutlass: the deferred column sums failed: " + std::string(status_text(st)));
    }
    settle_side();  // a side stream's workspaces among keep_: its later work waits for the sums first
    keep_.clear();
  }

 private:
  cvt_colsum_list list_{};
  std::vector<at::Tensor> keep_;
  const Kernel* flusher_ = nullptr;
};

// The scope's list (set by a ThreadScope on this thread), or null: sums run where they are launched.
inline thread_local DeferredSums* t_deferred_sums = nullptr;
// Whether the layer op's backward defers (on by default; off to compare the two, bitwise equal).
inline std::atomic<bool> g_defer_sums{true};

// The most column-sum segments one launch defers: 3, the depthwise backward's group of q, k and v
// (operators/dwconv/dwbn_common.cuh: kDwBnGroupMax; a weight or LayerNorm gradient's colsum2 adds 2).
inline constexpr int kMostSegmentsPerLaunch = 3;

template <class Args, class = void>
struct TakesDefer : std::false_type {};
template <class Args>
struct TakesDefer<Args, std::void_t<decltype(std::declval<Args&>().defer)>> : std::true_type {};

// The launch of a validated plan, the same for every family: a workspace from the caching
// allocator, the current stream; inside a deferring scope, the column sums of the ABIs that take a
// `defer` list go to the scope's. Returns the library's status.
template <class Args>
int launch(const Kernel& k, const Args& args, size_t workspace_bytes, const OnDevice& on) {
  at::Tensor ws;
  if (workspace_bytes > 0) ws = on.empty({static_cast<int64_t>(workspace_bytes)}, at::kByte);
  DeferredSums* d = nullptr;
  Args a = args;
  if constexpr (TakesDefer<Args>::value) {
    d = t_deferred_sums;
    if (d) {
      a.defer = d->list();
      join_side_before_deferring(a.defer->count, kMostSegmentsPerLaunch, CVT_COLSUM_MAX);
    }
  }
  PartScope scope(k.part.c_str());  // outside the library's host time below
  const auto t0 = std::chrono::steady_clock::now();
  const int st = k.launch(a, workspace_bytes ? ws.data_ptr() : nullptr, on.stream());
  count_library_host(k.family, std::chrono::steady_clock::now() - t0);
  if (d) {
    if (ws.defined()) d->keep(std::move(ws));
    d->deferred_by(k);
  }
  return st;
}

// `what` describes the problem for the error (a callable: the text is built only on failure,
// never on the hot path's successful launches).
template <class What>
void check_launch(int st, const Kernel& k, const What& what) {
  if (st != CVT_OK)
    TORCH_CHECK(false, "cvt_cutlass: kernel " + k.name + " failed on " + what() + ": " + status_text(st));
}

// A plan-time refusal by the kernel library: the planner chose a kernel the problem does not fit.
template <class What>
void check_can_implement(int st, const Kernel& k, const What& what) {
  if (st != CVT_OK)
    TORCH_CHECK(false, "cvt_cutlass: kernel " + k.name + " cannot run " + what() + ": " + status_text(st));
}

// ------------------------------------------------------------------------------------ schemas
// A schema assembled from the shared argument lists (Library::def takes the text as a C string).
inline void define(torch::Library& m, const std::string& schema) { m.def(schema.c_str()); }

// One public op, cvt_cutlass::<name><args> -> <returns>, and the private ops its Python side
// implements (ops/<op>.py, common.register_op): cvt_cutlass_C::<name>_plan, the planner, taking
// `plan_args` (empty: the op's own) and returning `plan` (empty: the op has no planner of its own),
// and cvt_cutlass_C::<name>_fallback, PyTorch's implementation with the op's arguments and results
// (absent where `fallback` is false: an op with no kernel, its fallback registered on the op).
struct OpSchema {
  std::string name, args, returns;
  std::string plan = "(int, int)";
  bool fallback = true;
  std::string plan_args = {};
};

inline void define_public(torch::Library& pub, const std::vector<OpSchema>& ops) {
  for (const auto& op : ops) define(pub, op.name + op.args + " -> " + op.returns);
}

inline void define_private(torch::Library& priv, const std::vector<OpSchema>& ops) {
  for (const auto& op : ops) {
    const std::string& plan_args = op.plan_args.empty() ? op.args : op.plan_args;
    if (!op.plan.empty()) define(priv, op.name + "_plan" + plan_args + " -> " + op.plan);
    if (op.fallback) define(priv, op.name + "_fallback" + op.args + " -> " + op.returns);
  }
}

// An op's CUDA implementation (the hot path) and, for a differentiable op, its autograd formula.
template <class Cuda, class Autograd = std::nullptr_t>
void impl_op(torch::Library& pub, const char* name, Cuda* cuda, Autograd* autograd = nullptr) {
  pub.impl(name, torch::dispatch(c10::DispatchKey::CUDA, cuda));
  if constexpr (!std::is_same_v<Autograd, std::nullptr_t>)
    pub.impl(name, torch::dispatch(c10::DispatchKey::Autograd, autograd));
}

// A raw kernel launch (cvt_cutlass_C::<op>(int kernel, ...) -> ()): the sweeps' and tests' entry.
template <class Fn>
void define_raw(torch::Library& priv, const char* schema, Fn* fn) {
  priv.def(schema, torch::dispatch(c10::DispatchKey::CUDA, fn));
}

// ------------------------------------------------------------------------------------ autograd
// Every op's autograd formula is C++ (ops/<op>.cpp: a torch::autograd::Function per op whose
// forward calls the op below autograd and whose backward calls the backward ops through the
// dispatcher, so torch.compile traces both): a training step through them runs no Python.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether a call records a gradient: grad mode on and some tensor argument requires grad.
inline bool any_requires_grad(std::initializer_list<const at::Tensor*> ts,
                              std::initializer_list<const std::optional<at::Tensor>*> opts = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->requires_grad()) return true;
  for (const std::optional<at::Tensor>* t : opts)
    if (*t && (*t)->requires_grad()) return true;
  return false;
}

// The typed handle of a public op (cvt_cutlass::<name>), for calls below autograd and backward calls.
template <class Sig>
c10::TypedOperatorHandle<Sig> public_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// g (..., cols) as rows the kernels read, (rows, cols) with unit column stride and a 16-byte row
// pitch: itself when it is, else one contiguous copy (autograd hands out expanded grads, e.g.
// after .sum(), and transposed ones).
inline at::Tensor kernel_rows(const at::Tensor& g, const c10::SymInt& cols_s) {
  auto cols_opt = cols_s.maybe_as_int();
  if (g.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !cols_opt) return g.contiguous();  // traced
  const int64_t cols = *cols_opt;
  if (g.numel() == 0 || cols <= 0) return g;
  const int64_t rows = g.numel() / cols;
  auto st = at::detail::computeStride(g.sizes(), g.strides(), at::IntArrayRef{rows, cols});
  if (st && (*st)[1] == 1 && (rows <= 1 || (*st)[0] % 8 == 0)) return g;
  return g.contiguous();
}

// ------------------------------------------------------------------------------------ Python
// The typed handle of a private op implemented in Python (cvt_cutlass.ops.<op> registers it).
template <class Sig>
c10::TypedOperatorHandle<Sig> python_op(const char* name) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, ""});
  TORCH_CHECK(handle.has_value(), std::string("cvt_cutlass: ") + name + " is not defined (binding out of date?)");
  return handle->typed<Sig>();
}

}  // namespace cvt
