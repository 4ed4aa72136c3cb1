"""torch.ops.cvt_cutlass.* (importing this package builds, the first time, and loads the torch
binding that defines them, and registers their Python parts; it imports torch)."""

from . import (
    layer,  # noqa: F401  (the layer op's fake kernels)
    stage,  # noqa: F401  (stage_infer: a stage's inference forward as one op under torch.compile)
)
from .attention import attention
from .conv2d import conv2d_nhwc
from .dwconv import dwconv_tokens
from .layernorm import layer_norm_tokens
from .linear import linear, linear_gelu_aux

__all__ = ["attention", "conv2d_nhwc", "dwconv_tokens", "layer_norm_tokens", "linear", "linear_gelu_aux"]
