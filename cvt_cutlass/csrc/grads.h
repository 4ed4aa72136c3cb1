// Parameter gradients of a replayed stage backward (cvt_cutlass/graphs.py).
//
// A stage's backward CUDA graph leaves its parameters' gradients in one static buffer per dtype,
// concatenated in the parameters' order. Handing ~250 gradients to the autograd engine as the
// outputs of one node costs the engine an AccumulateGrad evaluation per parameter (~5-10 us each
// on an H100's host, 2026-11-27: more than the batch-32 stage's GPU time); these helpers do the
// same work in one call:
//
//   stage_grads_direct(Tensor[] params) -> bool
//     Whether the parameters' gradients may be written here instead of by AccumulateGrad: every
//     one that requires grad a leaf with no hook that AccumulateGrad would run (tensor hooks, a
//     post-accumulate-grad hook, hooks on its gradient accumulator: DDP's reducer, FSDP and
//     DeepSpeed put theirs there).
//   stage_grads(Tensor[] params, Tensor flat, bool assign) -> Tensor[]
//     assign: accumulate flat into the parameters' .grad as AccumulateGrad does without grad mode
//     (a parameter without a gradient gets a view of one fresh copy of flat, one with a gradient
//     gets flat's part added in place, one foreach launch); returns nothing. Otherwise: views of
//     one fresh copy of flat, one per parameter in its shape (the gradients a node returns).
#pragma once
#include <vector>

#include <ATen/ATen.h>
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

// flat's part for params[i] (from element `offset`) in the parameter's shape, contiguous: a tensor
// on flat's storage made here (an as_strided call through the dispatcher cost ~1 us each; these
// gradients need no view tracking: nothing differentiates through them).
inline at::Tensor grad_part(const at::Tensor& flat, const at::Tensor& p, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(flat.storage()),
                                                   flat.key_set(), flat.dtype());
  impl->set_sizes_and_strides(p.sizes(), c10::contiguous_strides(p.sizes()), flat.storage_offset() + offset);
  return at::Tensor(std::move(impl));
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
