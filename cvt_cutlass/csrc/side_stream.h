// Launches off a backward's critical path on a second stream of the device.
//
// (The token-embedding conv's backward uses one too: its weight gradient beside its dgrad, joined
// before the op returns.)
//
// The layer op's backward computes its weight gradients from tensors the critical path has
// already made (the MLP's hidden gradient, the attention branch's gradient, q / k / v's), and
// nothing later in the layer reads them: they can run beside the dgrad / attention / LayerNorm /
// depthwise kernels that the next gradient waits for. A SideStream is that second stream for one
// layer backward: run(f, keep) orders the side stream after the current stream's work so far,
// makes it the current stream while f launches and allocates (f's temporaries and workspaces
// belong to it) and holds `keep` (the inputs f reads that the caller may drop before the join);
// join() orders the current stream after everything run() launched and lets `keep` go. Inside a
// CUDA graph capture the fork and the join are the graph's edges, so a replay keeps the overlap.
// The bits are the same either way (every kernel is the same and reads the same inputs).
//
// One side stream (from PyTorch's pool) and two events per (thread, device), made on first use
// (the layer op's first backward runs eagerly before a stage graph captures it) and kept to the
// process's end. A pool stream may
// be someone else's too: after the caller's work that reads what the side stream wrote (the
// deferred column sums) and before the side stream's workspaces are freed, settle() makes the
// side stream wait for that work, so that no later work on that stream reuses them early.
// Off (set_side_stream(False)) or on a tensor that is not CUDA, run calls f on the current stream;
// beside() runs f here for a group the setting leaves out. (A pool stream may also be one that NCCL
// or user code uses: the same bits, only less overlap; one that is the current stream is replaced.)
#pragma once

#include <atomic>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace cvt {

// Which weight gradients go beside (a bit each; all by default): the layer op's fc1, out-projection,
// q / k / v and fc2 ones, and the token-embedding conv's (beside its dgrad: ops/conv2d.cpp). fc2's
// and, on a 16-bit stream, the out-projection's only where their gradient comes in the GEMMs' dtype
// without drop path (a 16-bit stream, or a stage's last layer whose output is rounded); elsewhere
// their row pass writes the dY their dgrad reads, and they stay on the current stream.
enum SideGroup : int { kSideFc1 = 1, kSideOut = 2, kSideQkv = 4, kSideFc2 = 8, kSideEmbed = 16 };
inline constexpr int kSideAll = kSideFc1 | kSideOut | kSideQkv | kSideFc2 | kSideEmbed;
inline std::atomic<int> g_side_stream{kSideAll};

class SideStream {
 public:
  // wanted: the caller's own condition (with the global switch and a CUDA tensor: on())
  SideStream(const at::Tensor& like, bool wanted)
      : groups_(g_side_stream.load(std::memory_order_relaxed)), on_(wanted && like.is_cuda() && groups_ != 0) {
    if (!on_) return;
    const c10::Device dev = like.device();
    main_.emplace(impl().getStream(dev));
    state_ = &state_of(dev);
    // the pool hands its streams out in turn: the current stream may be this thread's side stream
    // (a stage graph's capture stream is a pool stream too), which would overlap nothing; take the next
    for (int i = 0; i < 64 && state_->side == *main_; ++i) state_->side = impl().getStreamFromGlobalPool(dev);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    try {
      join();
      settle();
    } catch (...) {  // (an exception is already on its way out: its own error is the one to see)
    }
  }

  bool on() const { return on_; }
  // Whether launches of this group go beside (the setting when the backward began).
  bool takes(int group) const { return on_ && (groups_ & group) != 0; }

  template <class F>
  decltype(auto) run(F&& f, std::initializer_list<at::Tensor> keep = {}) {
    if (!on_) return f();
    state_->fork.record(*main_);
    state_->fork.block(state_->side);
    held_.insert(held_.end(), keep.begin(), keep.end());
    pending_ = used_ = true;
    const Running running(running_);
    const c10::StreamGuard guard(state_->side);
    return f();
  }

  // Whether run() is on this thread's stack (its launches are the side stream's).
  bool running() const { return running_; }
  bool pending() const { return pending_; }

  void join() {
    if (!pending_) return;
    state_->join.record(state_->side);
    state_->join.block(*main_);
    pending_ = false;  // (only once the current stream waits: what is held may go)
    held_.clear();
  }

  // After the current stream's work that reads the side stream's results: the side stream waits
  // for it (then joins again, which a capture asks of every stream that took part).
  void settle() {
    if (!used_ || pending_) return;
    state_->fork.record(*main_);
    state_->fork.block(state_->side);
    state_->join.record(state_->side);
    state_->join.block(*main_);
    used_ = false;
  }

 private:
  struct State {
    explicit State(c10::Device dev)
        : side(impl().getStreamFromGlobalPool(dev)), fork(dev.type()), join(dev.type()) {}
    c10::Stream side;
    c10::Event fork, join;
  };

  static const c10::impl::VirtualGuardImpl& impl() {
    static const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    return cuda;
  }
  // Never destroyed: destroyed with the thread, a state destroys its CUDA events then, and at the
  // process's exit that came after the CUDA driver had begun shutting down (after test_conv_backward's
  // GPU tests, H100, 2026-12-07: c10's SetDevice threw "driver shutting down" from this vector's
  // destructor under __call_tls_dtors, and the process aborted). Two events per thread and device
  // stay behind.
  static State& state_of(c10::Device dev) {
    thread_local auto* states = new std::vector<std::unique_ptr<State>>();
    const size_t i = static_cast<size_t>(dev.index());
    if (states->size() <= i) states->resize(i + 1);
    if (!(*states)[i]) (*states)[i] = std::make_unique<State>(dev);
    return *(*states)[i];
  }

  struct Running {
    explicit Running(bool& flag) : flag_(flag), was_(flag) { flag_ = true; }
    ~Running() { flag_ = was_; }
    bool& flag_;
    bool was_;
  };

  int groups_;
  bool on_;
  bool pending_ = false, used_ = false, running_ = false;
  std::optional<c10::Stream> main_;
  State* state_ = nullptr;
  std::vector<at::Tensor> held_;
};

// A thread-local pointer set for a scope, the previous value restored after (the layer op's
// backward: its side stream here, its deferred column sums in plans.h).
template <class T>
class ThreadScope {
 public:
  ThreadScope(T*& slot, T* value) : slot_(slot), prev_(slot) { slot_ = value; }
  ~ThreadScope() { slot_ = prev_; }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  T*& slot_;
  T* prev_;
};

// The side stream of the layer backward running on this thread (set by a ThreadScope), or null.
inline thread_local SideStream* t_side_stream = nullptr;

// f on the scope's side stream where it takes `group` (holding keep until its join), else here.
template <class F>
decltype(auto) beside(int group, F&& f, std::initializer_list<at::Tensor> keep = {}) {
  if (t_side_stream && t_side_stream->takes(group)) return t_side_stream->run(std::forward<F>(f), keep);
  return f();
}

inline void join_side() {
  if (t_side_stream) t_side_stream->join();
}

inline void settle_side() {
  if (t_side_stream) t_side_stream->settle();
}

// Before a launch on the current stream that may add `adding` segments to a deferred column-sum
// list holding `count`: a full list is flushed on that stream by the launch itself, so the side
// stream's partials in it must be done (the join) first. (A launch inside run() flushes on the side
// stream, after the fork: every segment's partials are ordered before it.)
inline void join_side_before_deferring(int count, int adding, int max) {
  if (t_side_stream && !t_side_stream->running() && t_side_stream->pending() && count + adding > max)
    t_side_stream->join();
}

}  // namespace cvt
