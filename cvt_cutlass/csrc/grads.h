// Parameter gradients of a replayed stage backward (cvt_cutlass/graphs.py).
//
// A stage's backward CUDA graph leaves its parameters' gradients in static tensors (the graph
// rewrites them on every replay). Returned as the outputs of one autograd node, ~250 gradients
// cost the engine an AccumulateGrad evaluation each (5-10 us per parameter of host time on an H100
// host, 2026-11-27, more than a batch-32 stage's GPU time); these helpers do the same work in one
// call:
//
//   stage_grads_direct(Tensor[] params) -> bool
//     Whether the parameters' gradients may be written here instead of by AccumulateGrad: every
//     one that requires grad a leaf with no hook that AccumulateGrad would run (tensor hooks, a
//     post-accumulate-grad hook, hooks on its gradient accumulator: DDP's reducer, FSDP and
//     DeepSpeed put theirs there).
//   stage_grads(Tensor[] params, Tensor[] grads, bool assign) -> Tensor[]
//     grads: the static gradients of params, one each, of one dtype (the parameters'). assign:
//     accumulate them into the parameters' .grad as AccumulateGrad does without grad mode (a
//     parameter without a gradient gets a copy in the layout AccumulateGrad would give, on one
//     fresh buffer for all of them; one with a gradient gets it added in place: one foreach copy
//     and one foreach add), for the parameters this backward fills (grad_wanted); returns
//     nothing. Otherwise: such fresh copies, one per parameter (the gradients a node returns).
#pragma once
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "kernels.h"

namespace cvt {

inline bool grad_hooked(const at::Tensor& p) {
  namespace impl = torch::autograd::impl;
  if (!p.requires_grad()) return false;  // gets no gradient
  if (!p.is_leaf()) return true;
  if (!impl::hooks(p).empty() || impl::post_acc_grad_hooks(p)) return true;
  const auto acc = impl::try_get_grad_accumulator(p);
  return acc && (!acc->pre_hooks().empty() || !acc->post_hooks().empty() || !acc->tensor_pre_hooks().empty());
}

inline bool stage_grads_direct(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params)
    if (grad_hooked(p)) return false;
  return true;
}

// Whether p's gradient gets a tensor of its own in p's strides (the layout AccumulateGrad gives,
// which fused optimizers require: channels-last, say), not a contiguous part of the shared buffer.
inline bool own_strides(const at::Tensor& p) { return !p.is_contiguous() && p.is_non_overlapping_and_dense(); }

// Where p's gradient lands, from element `offset` of the fresh buffer `flat`: a tensor on flat's
// storage made here (no as_strided dispatch per parameter; nothing differentiates through these
// gradients), or one of its own in p's strides (own_strides).
inline at::Tensor grad_dest(const at::Tensor& flat, const at::Tensor& p, int64_t offset) {
  if (own_strides(p)) return at::empty_strided(p.sizes(), p.strides(), flat.options());
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(flat.storage()),
                                                   flat.key_set(), flat.dtype());
  impl->set_sizes_and_strides(p.sizes(), c10::contiguous_strides(p.sizes()), flat.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

// Fresh copies of grads (one buffer for those not in own_strides) in the layouts of params.
inline std::vector<at::Tensor> fresh_copies(const std::vector<at::Tensor>& params,
                                            const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> out;
  if (grads.empty()) return out;
  int64_t total = 0;
  for (const at::Tensor& p : params)
    if (!own_strides(p)) total += p.numel();
  const at::Tensor flat = at::empty({total}, grads[0].options());
  int64_t offset = 0;
  for (const at::Tensor& p : params) {
    out.push_back(grad_dest(flat, p, offset));
    if (!own_strides(p)) offset += p.numel();
  }
  at::_foreach_copy_(out, grads);
  return out;
}

// Whether this backward fills p's gradient: in a backward() over the whole graph, yes (the engine's
// execution map is empty); in torch.autograd.grad or backward(inputs=...) only where the engine
// reaches p's gradient accumulator by another path (the parameters are not edges of the replay's
// node, so a request for them alone leaves them without gradient: the README's limit), and
// torch.autograd.grad with respect to such a p raises (the replay returns no gradient for it).
inline bool grad_wanted(const at::Tensor& p) {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr || info->empty()) return true;
  const auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
  const auto it = acc ? info->find(acc.get()) : info->end();
  if (it == info->end()) return false;
  TORCH_CHECK(!it->second.captures_,
              "cvt_cutlass: torch.autograd.grad with respect to a parameter of a fused stage replayed from its CUDA "
              "graph (the replay writes .grad instead); run it with cvt_cutlass.graphs.set_stage_graphs(False)");
  return it->second.needed_;
}

inline std::vector<at::Tensor> stage_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                           bool assign) {
  // messages preformatted (kernels.h: a variadic check with integers crashes on the device's torch)
  TORCH_CHECK_VALUE(params.size() == grads.size(), "cvt_cutlass.stage_grads: " + std::to_string(params.size()) +
                                                       " parameters and " + std::to_string(grads.size()) + " gradients");
  for (size_t i = 0; i < params.size(); ++i)
    TORCH_CHECK_VALUE(grads[i].sizes() == params[i].sizes() && grads[i].dtype() == params[i].dtype() &&
                          grads[i].dtype() == grads[0].dtype(),
                      "cvt_cutlass.stage_grads: gradient " + std::to_string(i) + " of shape " + dims(grads[i].sizes()) +
                          " and dtype " + std::string(grads[i].dtype().name()) + " for a parameter of shape " +
                          dims(params[i].sizes()) + " and dtype " + std::string(params[i].dtype().name()) +
                          " (one dtype for all: " + std::string(grads[0].dtype().name()) + ")");
  at::NoGradGuard no_grad;
  if (!assign) return fresh_copies(params, grads);
  std::vector<at::Tensor> set_p, set_g, held, adds;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grad_wanted(params[i])) continue;
    const at::Tensor& g = params[i].grad();
    if (g.defined()) {
      held.push_back(g);
      adds.push_back(grads[i]);
    } else {
      set_p.push_back(params[i]);
      set_g.push_back(grads[i]);
    }
  }
  const std::vector<at::Tensor> fresh = fresh_copies(set_p, set_g);
  for (size_t i = 0; i < set_p.size(); ++i) set_p[i].mutable_grad() = fresh[i];
  if (!held.empty()) at::_foreach_add_(held, adds);
  return {};
}

}  // namespace cvt
