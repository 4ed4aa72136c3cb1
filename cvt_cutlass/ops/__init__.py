"""torch.ops.cvt_cutlass.* custom ops (importing this module registers them; it imports torch)."""

from .attention import attention
from .conv import conv2d_nhwc, dwconv_tokens
from .linear import linear, linear_gelu_aux
from .norm import layer_norm_tokens

__all__ = ["attention", "conv2d_nhwc", "dwconv_tokens", "layer_norm_tokens", "linear", "linear_gelu_aux"]
