"""torch.ops.cvt_cutlass.* custom ops (importing this module registers them; it imports torch)."""

from .linear import linear, linear_gelu_aux

__all__ = ["linear", "linear_gelu_aux"]
