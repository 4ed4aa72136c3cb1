// Version watches: has any of a set of tensors changed since it was recorded? (the swapped
// model's cache of folded / cast weights asks this before every forward).
//
// A watch holds the tensors (a parameter replaced in its module stays alive until the stage
// derives its weights again, which drops the old watch: the folded weights hold the same memory
// until then anyway) and records, for each, its version counter (bumped by every in-place write:
// optimizer steps, load_state_dict's copy_, ...) and its data pointer (a `.data` swap by
// Module._apply). Holding them, a check reads each tensor with plain loads, no atomic reference
// count updates (whose fences kept the CPU from overlapping the tensors' cache misses): ~550
// tensors (CvT-13) took 60 us that way on a 2-core CI machine, 2026-11-27, and 180-240 us per
// forward on an H100 host under the profiler.
#pragma once
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

namespace cvt {

struct Watched {
  c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> ref;
  int64_t version;
  const void* data;   // the storage's data (a version watch compares it)
  const void* first;  // the first element's address: data plus the storage offset (a placement watch)
  bool requires_grad;
};

inline int64_t version_of(c10::TensorImpl* t) {
  return t->is_inference() ? -1 : static_cast<int64_t>(t->version_counter().current_version());
}
inline const void* data_of(const c10::TensorImpl* t) { return t->has_storage() ? t->storage().data() : nullptr; }
inline const void* first_of(const c10::TensorImpl* t) {
  const void* data = data_of(t);
  return data == nullptr ? nullptr : static_cast<const char*>(data) + t->storage_offset() * t->itemsize();
}

inline std::mutex g_watch_mutex;
inline std::unordered_map<int64_t, std::vector<Watched>> g_watches;  // both kinds, by id
inline int64_t g_next_watch = 0;

inline int64_t watch_tensors(const std::vector<at::Tensor>& tensors) {
  std::vector<Watched> w;
  w.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    w.push_back({t.getIntrusivePtr(), version_of(impl), data_of(impl), first_of(impl), impl->requires_grad()});
  }
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  g_watches.emplace(g_next_watch, std::move(w));
  return g_next_watch++;
}

// Whether watch id saw a change by `same` (a missing watch counts as changed); call with
// g_watch_mutex held.
template <class Same>
inline bool changed_locked(int64_t id, Same same) {
  auto it = g_watches.find(id);
  if (it == g_watches.end()) return true;
  for (const Watched& w : it->second)
    if (!same(w, w.ref.get())) return true;
  return false;
}
inline bool same_version(const Watched& w, c10::TensorImpl* t) {
  return version_of(t) == w.version && data_of(t) == w.data;
}

inline bool watch_changed(int64_t id) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  return changed_locked(id, same_version);
}

// Whether any of several watches saw a change (one call for all the stages of a model).
inline bool watch_changed_any(const std::vector<int64_t>& ids) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  for (int64_t id : ids)
    if (changed_locked(id, same_version)) return true;
  return false;
}

// Placement: the same record read another way, where a set of tensors lives (each one's first
// element) and whether each requires grad (a stage's parameters and buffers, whose addresses a
// captured CUDA graph reads and writes). In-place writes (optimizer steps, load_state_dict) leave
// it; a `.data` swap (to another storage or another place in the same one), `.to()` or
// requires_grad_() change it. The swapped stages ask before each training call instead of
// reading every tensor's data_ptr and requires_grad from Python (CvT-13's stage 3, 255
// parameters: ~330 us per call that way on a 2-core CI machine, 2026-11-27). A watch holds its
// tensors: torch.utils.swap_tensors on a watched tensor raises (loudly) until the watch is dropped.
inline bool placement_changed(int64_t id) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  return changed_locked(id, [](const Watched& w, c10::TensorImpl* t) {
    return first_of(t) == w.first && t->requires_grad() == w.requires_grad;
  });
}

inline void watch_drop(int64_t id) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  g_watches.erase(id);
}

}  // namespace cvt
