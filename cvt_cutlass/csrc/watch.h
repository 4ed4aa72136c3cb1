// Version watches: has any of a set of tensors changed since it was recorded? (the swapped
// model's cache of folded / cast weights asks this before every forward).
//
// A watch holds the tensors and, for each, its version counter (bumped by every in-place write:
// optimizer steps, load_state_dict's copy_, ...) and its data pointer (a `.data` swap by
// Module._apply). Checking 400 tensors in C++ costs about a microsecond; doing it in Python cost
// about a millisecond per forward.
#pragma once
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

namespace cvt {

struct Watch {
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> versions;
  std::vector<const void*> data;
};

inline std::mutex g_watch_mutex;
inline std::unordered_map<int64_t, Watch> g_watches;
inline int64_t g_next_watch = 0;

inline int64_t version_of(const at::Tensor& t) { return t.is_inference() ? -1 : static_cast<int64_t>(t._version()); }
inline const void* data_of(const at::Tensor& t) { return t.has_storage() ? t.storage().data() : nullptr; }

inline int64_t watch_tensors(std::vector<at::Tensor> tensors) {
  Watch w;
  for (const at::Tensor& t : tensors) {
    w.versions.push_back(version_of(t));
    w.data.push_back(data_of(t));
  }
  w.tensors = std::move(tensors);
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  g_watches.emplace(g_next_watch, std::move(w));
  return g_next_watch++;
}

inline bool watch_changed(int64_t id) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  auto it = g_watches.find(id);
  if (it == g_watches.end()) return true;
  const Watch& w = it->second;
  for (size_t i = 0; i < w.tensors.size(); ++i)
    if (version_of(w.tensors[i]) != w.versions[i] || data_of(w.tensors[i]) != w.data[i]) return true;
  return false;
}

inline void watch_drop(int64_t id) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  g_watches.erase(id);
}

}  // namespace cvt
