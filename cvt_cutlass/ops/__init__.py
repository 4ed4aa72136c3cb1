"""torch.ops.cvt_cutlass.* custom ops (importing this module registers them; it imports torch)."""

from .conv import conv2d_nhwc, dwconv_tokens
from .linear import linear, linear_gelu_aux

__all__ = ["conv2d_nhwc", "dwconv_tokens", "linear", "linear_gelu_aux"]
