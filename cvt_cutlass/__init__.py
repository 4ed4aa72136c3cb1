"""cvt_cutlass: CvT on CUTLASS kernels instantiated from Python.

Importing this package does nothing heavy: no torch import, no CUDA initialisation, no
compilation, no cutlass_cppgen. Names below load their module on first use; kernels are emitted
and built on first use (or ahead of time with ``cvt-cutlass build``).

    import cvt_cutlass
    y = cvt_cutlass.linear(x, fc1.weight, fc1.bias, activation="gelu")   # torch.ops.cvt_cutlass.linear
    cvt_cutlass.emit(op="linear", arch=90, epilogue="bias_gelu", dtype="fp16", out="kernels/")
    cvt_cutlass.stats()   # kernel calls, visible fallbacks, table vs heuristic choices
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "linear": ("cvt_cutlass.ops.linear", "linear"),
    "linear_gelu_aux": ("cvt_cutlass.ops.linear", "linear_gelu_aux"),
    "mlp": ("cvt_cutlass.ops.linear", "mlp"),
    "linear_dgrad": ("cvt_cutlass.ops.linear", "linear_dgrad"),
    "linear_wgrad": ("cvt_cutlass.ops.linear", "linear_wgrad"),
    "layer_norm_tokens_backward": ("cvt_cutlass.ops.layernorm", "layer_norm_tokens_backward"),
    "attention": ("cvt_cutlass.ops.attention", "attention"),
    "conv2d_nhwc": ("cvt_cutlass.ops.conv2d", "conv2d_nhwc"),
    "dwconv_tokens": ("cvt_cutlass.ops.dwconv", "dwconv_tokens"),
    "layer_norm_tokens": ("cvt_cutlass.ops.layernorm", "layer_norm_tokens"),
    "fold_batchnorm": ("cvt_cutlass.ops.dwconv", "fold_batchnorm"),
    "dwconv_bn_train": ("cvt_cutlass.ops.dwconv", "dwconv_bn_train"),
    "dwconv_bn_backward": ("cvt_cutlass.ops.dwconv", "dwconv_bn_backward"),
    "dwconv_bn": ("cvt_cutlass.ops.dwconv", "dwconv_bn"),
    "swap": ("cvt_cutlass.swap", "swap"),
    "load_cvt": ("cvt_cutlass.checkpoint", "load_cvt"),
    "unswap": ("cvt_cutlass.swap", "unswap"),
    "emit": ("cvt_cutlass.api", "emit"),
    "kernels_for": ("cvt_cutlass.api", "kernels_for"),
    "model_kernels": ("cvt_cutlass.api", "model_kernels"),
    "stats": ("cvt_cutlass.fallback", "stats"),
    "reset_stats": ("cvt_cutlass.fallback", "reset"),
    "set_strict": ("cvt_cutlass.fallback", "set_strict"),
    "set_layer_op": ("cvt_cutlass.layer", "set_layer_op"),
    "kernel_path": ("cvt_cutlass.runtime", "kernel_path"),
    "set_kernel_path": ("cvt_cutlass.runtime", "set_kernel_path"),
    "LinearSpec": ("cvt_cutlass.operators.linear", "LinearSpec"),
    "ConvSpec": ("cvt_cutlass.operators.conv2d", "ConvSpec"),
    "DwConvSpec": ("cvt_cutlass.operators.dwconv", "DwConvSpec"),
    "DwConvBnSpec": ("cvt_cutlass.operators.dwconv", "DwConvBnSpec"),
    "AttnSpec": ("cvt_cutlass.operators.attention", "AttnSpec"),
    "LayerNormSpec": ("cvt_cutlass.operators.layernorm", "LayerNormSpec"),
    "LinearWgradSpec": ("cvt_cutlass.operators.linear", "LinearWgradSpec"),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'cvt_cutlass' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
