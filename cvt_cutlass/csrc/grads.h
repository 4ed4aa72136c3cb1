// Parameter gradients of a replayed stage backward (cvt_cutlass/graphs.py).
//
// A stage's backward CUDA graph leaves its parameters' gradients in one static buffer per dtype,
// concatenated in the parameters' order. Returned as the outputs of one autograd node, ~250
// gradients cost the engine an AccumulateGrad evaluation each (5-10 us per parameter of host time
// on an H100 host, 2026-11-27, more than a batch-32 stage's GPU time); these helpers do the same
// work in one call:
//
//   stage_grads_direct(Tensor[] params) -> bool
//     Whether the parameters' gradients may be written here instead of by AccumulateGrad: every
//     one that requires grad a leaf with no hook that AccumulateGrad would run (tensor hooks, a
//     post-accumulate-grad hook, hooks on its gradient accumulator: DDP's reducer, FSDP and
//     DeepSpeed put theirs there).
//   stage_grads(Tensor[] params, Tensor flat, bool assign) -> Tensor[]
//     assign: accumulate flat into the parameters' .grad as AccumulateGrad does without grad mode
//     (a parameter without a gradient gets a view of one fresh copy of flat, one with a gradient
//     gets flat's part added in place, one foreach launch), for the parameters this backward
//     fills (grad_wanted); returns nothing. Otherwise: views of
//     one fresh copy of flat, one per parameter in its shape (the gradients a node returns).
#pragma once
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

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

// flat's part for params[i] (from element `offset`) in the parameter's shape: a tensor on flat's
// storage made here (no as_strided dispatch per parameter; nothing differentiates through these
// gradients), or, for a parameter whose strides are not contiguous (channels-last, say), a copy in
// its strides (the layout AccumulateGrad gives, which fused optimizers require).
inline at::Tensor grad_part(const at::Tensor& flat, const at::Tensor& p, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(flat.storage()),
                                                   flat.key_set(), flat.dtype());
  impl->set_sizes_and_strides(p.sizes(), c10::contiguous_strides(p.sizes()), flat.storage_offset() + offset);
  at::Tensor part(std::move(impl));
  if (p.is_contiguous()) return part;
  at::Tensor out = at::empty_strided(p.sizes(), p.strides(), flat.options());
  out.copy_(part);
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

inline std::vector<at::Tensor> stage_grads(const std::vector<at::Tensor>& params, const at::Tensor& flat,
                                           bool assign) {
  int64_t total = 0;
  for (const at::Tensor& p : params) total += p.numel();
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous() && flat.numel() == total,
                    "cvt_cutlass.stage_grads: flat must be a contiguous 1-D tensor of the parameters' ",
                    total, " elements, got ", flat.sizes());
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  if (!assign) {
    const at::Tensor fresh = flat.clone();
    int64_t offset = 0;
    for (const at::Tensor& p : params) {
      out.push_back(grad_part(fresh, p, offset));
      offset += p.numel();
    }
    return out;
  }
  at::Tensor fresh;  // made when a parameter has no gradient yet
  std::vector<at::Tensor> held, parts;
  int64_t offset = 0;
  for (const at::Tensor& p : params) {
    if (!grad_wanted(p)) {
      offset += p.numel();
      continue;
    }
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) {
      if (!fresh.defined()) fresh = flat.clone();
      g = grad_part(fresh, p, offset);
    } else {
      held.push_back(g);
      parts.push_back(grad_part(flat, p, offset));
    }
    offset += p.numel();
  }
  if (!held.empty()) at::_foreach_add_(held, parts);
  return out;
}

}  // namespace cvt
