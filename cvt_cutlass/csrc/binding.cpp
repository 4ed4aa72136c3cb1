// cvt_cutlass torch binding: the public ops' schemas and CUDA hot paths, and the kernel loader.
//
// Namespaces:
//   cvt_cutlass    the public ops (torch.ops.cvt_cutlass.linear, ...): schemas, CUDA kernels and
//                  the autograd formulas (C++ for every op: calls needing no gradient never leave
//                  C++); cvt_cutlass/ops/<op>.py adds the fake kernels and the CPU / other-device
//                  reference (CompositeExplicitAutograd)
//   cvt_cutlass_C  private: each op's Python planner (<op>_plan) and fallback (<op>_fallback);
//                  raw launches by kernel id for profile sweeps and tests; the loader, counters,
//                  plan-cache controls, version watches and the stage graphs' gradient hand-over (grads.h)
//
// One translation unit (the ops/*.cpp files are included below), so the compiler parses torch's
// headers once. No CUDA header and no libtorch_cuda: the current stream comes from c10's
// device-generic guard interface, workspaces from at::empty on the tensors' device (PyTorch's
// caching allocator). Nothing here allocates with cudaMalloc, frees or synchronises, so ops can
// be captured in CUDA graphs.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "kernels.h"
#include "plans.h"
#include "grads.h"
#include "watch.h"
#include "ops/attention.cpp"
#include "ops/conv2d.cpp"
#include "ops/dwconv.cpp"
#include "ops/layernorm.cpp"
#include "ops/linear.cpp"
#include "ops/layer.cpp"  // composes the ops above
#include "ops/cast.cpp"

namespace cvt {

int64_t load_kernel_op(const std::string& path, const std::string& name) { return load_kernel(path, name); }

std::string kernel_name(int64_t id) { return kernel(id).name; }

// The profiler scope of the kernel's launches ("cvt_kernel::<op>_<pass>": kernels.h, part_of).
std::string kernel_part(int64_t id) { return kernel(id).part; }

// The raw current stream as the binding sees it (tests compare it with torch's).
int64_t current_stream_handle(const at::Tensor& like) {
  c10::impl::VirtualGuardImpl impl(like.device().type());
  return reinterpret_cast<int64_t>(impl.getStream(like.device()).native_handle());
}

// Column sums through a kernel library's cvt_colsum_flush (operators/common/abi.h; tests):
// segment i sums the first rows[i] rows of ins[i], an fp32 (R, ld) tensor with unit column
// stride, over its first outs[i].numel() columns into outs[i] (float, half or bfloat16); a full
// list is flushed before the next segment.
void colsum_flush_raw(int64_t id, at::TensorList ins, at::IntArrayRef rows, at::TensorList outs) {
  const Kernel& k = kernel(id);
  TORCH_CHECK(k.colsum_flush_fn, "cvt_cutlass: kernel " + k.name + " exports no cvt_colsum_flush");
  TORCH_CHECK(!ins.empty() && ins.size() == outs.size() && rows.size() == ins.size(),
              "cvt_cutlass: colsum_flush_raw takes as many inputs, row counts and outputs");
  const OnDevice on(ins[0]);
  cvt_colsum_list list{};
  auto flush = [&] {
    const int st = k.colsum_flush(&list, on.stream());
    TORCH_CHECK(st == CVT_OK, "cvt_cutlass: kernel " + k.name + ": cvt_colsum_flush failed: " + status_text(st));
  };
  for (size_t i = 0; i < ins.size(); ++i) {
    const at::Tensor &in = ins[i], &out = outs[i];
    TORCH_CHECK(in.scalar_type() == at::kFloat && in.dim() == 2 && in.stride(1) == 1 && in.device() == ins[0].device() &&
                    rows[i] >= 0 && rows[i] <= in.size(0),
                "cvt_cutlass: colsum_flush_raw inputs are float (R, ld) tensors with unit column stride, rows <= R");
    TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.size(0) <= in.size(1) && out.device() == in.device(),
                "cvt_cutlass: colsum_flush_raw outputs are contiguous vectors no longer than their input's rows");
    const at::ScalarType t = out.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
                "cvt_cutlass: colsum_flush_raw outputs are float, half or bfloat16");
    if (list.count == CVT_COLSUM_MAX) flush();
    list.seg[list.count++] = {in.data_ptr<float>(), rows[i], in.stride(0), out.size(0), out.data_ptr(),
                              t == at::kFloat ? CVT_OUT_F32 : t == at::kHalf ? CVT_OUT_F16 : CVT_OUT_BF16};
  }
  flush();
}

// (op names, kernel calls from table choices, kernel calls from heuristic choices).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>> counters() {
  std::vector<std::string> names;
  std::vector<int64_t> table, heuristic;
  for (int op = 0; op < kOpCount; ++op) {
    names.emplace_back(kOpNames[op]);
    table.push_back(g_calls[op][0].load(std::memory_order_relaxed));
    heuristic.push_back(g_calls[op][1].load(std::memory_order_relaxed));
  }
  return {names, table, heuristic};
}

void reset_counters() {
  for (auto& op : g_calls)
    for (auto& c : op) c.store(0, std::memory_order_relaxed);
  for (auto& fam : g_library_host)
    for (auto& c : fam) c.store(0, std::memory_order_relaxed);
  for (auto& op : g_op_host)
    for (auto& c : op) c.store(0, std::memory_order_relaxed);
}

// (composite ops, calls, host nanoseconds inside their implementations).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>> op_host() {
  std::vector<std::string> names;
  std::vector<int64_t> calls, ns;
  for (int op = 0; op < kOpCount; ++op) {
    const int64_t n = g_op_host[op][0].load(std::memory_order_relaxed);
    if (!n) continue;
    names.emplace_back(kOpNames[op]);
    calls.push_back(n);
    ns.push_back(g_op_host[op][1].load(std::memory_order_relaxed));
  }
  return {names, calls, ns};
}

// (kernel families, launches, host nanoseconds inside the libraries' launch entry points).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>> library_host() {
  std::vector<std::string> names;
  std::vector<int64_t> calls, ns;
  for (int f = 0; f < kFamilyCount; ++f) {
    const char* name = family_name(f);
    const int64_t n = g_library_host[f][0].load(std::memory_order_relaxed);
    if (!name || !n) continue;
    names.emplace_back(name);
    calls.push_back(n);
    ns.push_back(g_library_host[f][1].load(std::memory_order_relaxed));
  }
  return {names, calls, ns};
}

bool set_defer_sums(bool on) { return g_defer_sums.exchange(on); }
int64_t set_side_stream(int64_t groups) { return g_side_stream.exchange(int(groups & kSideAll)); }

// Plans are made again after this (the kernel path or the selection tables changed).
void clear_plans() {
  for (auto& clear : cache_hooks().clear) clear();
}

int64_t plan_count() {
  size_t n = 0;
  for (auto& size : cache_hooks().size) n += size();
  return static_cast<int64_t>(n);
}

}  // namespace cvt

// Every op family: its public ops (schemas, CUDA hot paths, C++ autograd formulas) and its private
// ones (planner and fallback schemas the Python side implements, raw kernel launches).
struct Family {
  void (*register_public)(torch::Library&);
  void (*register_private)(torch::Library&);
};
constexpr Family kFamilies[] = {
    {cvt::register_linear, cvt::register_linear_private},
    {cvt::register_conv2d, cvt::register_conv2d_private},
    {cvt::register_dwconv, cvt::register_dwconv_private},
    {cvt::register_attention, cvt::register_attention_private},
    {cvt::register_layernorm, cvt::register_layernorm_private},
    {cvt::register_layer, cvt::register_layer_private},
    {cvt::register_cast, cvt::register_cast_private},
};

TORCH_LIBRARY(cvt_cutlass, m) {
  for (const Family& f : kFamilies) f.register_public(m);
}

TORCH_LIBRARY(cvt_cutlass_C, m) {
  for (const Family& f : kFamilies) f.register_private(m);
  m.def("load_kernel(str path, str name) -> int", &cvt::load_kernel_op);
  m.def("kernel_name(int id) -> str", &cvt::kernel_name);
  m.def("kernel_part(int id) -> str", &cvt::kernel_part);
  m.def("counters() -> (str[], int[], int[])", &cvt::counters);
  m.def("reset_counters() -> ()", &cvt::reset_counters);
  m.def("library_host() -> (str[], int[], int[])", &cvt::library_host);
  m.def("op_host() -> (str[], int[], int[])", &cvt::op_host);
  m.def("set_defer_sums(bool on) -> bool", &cvt::set_defer_sums);
  m.def("set_side_stream(int groups) -> int", &cvt::set_side_stream);
  cvt::define_raw(m, "colsum_flush_raw(int kernel, Tensor[] ins, int[] rows, Tensor(a!)[] outs) -> ()",
                  &cvt::colsum_flush_raw);
  m.def("clear_plans() -> ()", &cvt::clear_plans);
  m.def("plan_count() -> int", &cvt::plan_count);
  m.def("current_stream_handle(Tensor like) -> int", torch::dispatch(c10::DispatchKey::CUDA, &cvt::current_stream_handle));
  m.def("watch_tensors(Tensor[] tensors) -> int", &cvt::watch_tensors);
  m.def("watch_changed(int id) -> bool", &cvt::watch_changed);
  m.def("watch_changed_any(int[] ids) -> bool", &cvt::watch_changed_any);
  m.def("watch_drop(int id) -> ()", &cvt::watch_drop);
  m.def("placement_changed(int id) -> bool", &cvt::placement_changed);
  m.def("stage_grads_direct(Tensor[] params) -> bool", &cvt::stage_grads_direct);
  m.def("stage_grads(Tensor[] params, Tensor[] grads, bool assign) -> Tensor[]", &cvt::stage_grads);
}
