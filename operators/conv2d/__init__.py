"""The conv2d family: CvT's convolutional token embedding, an implicit GEMM on NHWC tokens, forward
and backward.

* :mod:`.spec` -- :class:`ConvSpec` (SM80-class fprop, ``fprop_sm80.cuh``), :class:`Conv90Spec`
  (SM90 fprop, TMA im2col + wgmma, ``fprop_sm90.cuh``), :class:`ConvBwdSpec` (SM80-class strided
  dgrad, ``dgrad_sm80.cuh``, and parallel split-K wgrad with the db row-sum, ``wgrad_sm80.cuh``),
  :class:`Conv90WgradSpec` (SM90 wgrad, ``wgrad_sm90.cuh``), :class:`ConvRowsSpec` and
  :class:`ConvRowsWgradSpec` (the stem's forward and wgrad as row-window
  GEMMs, ``fprop_rows.cuh``, ``wgrad_rows.cuh``),
  their search spaces and heuristics.
* :mod:`.problems` -- the convolutions of a CvT (the depthwise ones too: their geometry follows
  the embedding); :mod:`.select` -- the kernel for a problem.
* ``abi.h`` -- ``cvt_conv_args`` and ``cvt_convbwd_args``, what the torch binding passes.
"""

from .problems import ConvLayer, conv_problems
from .select import select_conv2d, select_conv2d_backward
from .spec import (
    CONV_ARCHS,
    CONV_BWD_ITERATORS,
    CONV_ITERATORS,
    Conv90Spec,
    Conv90WgradSpec,
    ConvBwdSpec,
    ConvRowsSpec,
    ConvRowsWgradSpec,
    ConvSpec,
    conv_bwd_candidates,
    conv_bwd_heuristic,
    conv_candidates,
    conv_heuristic,
    conv_window,
    rows_serve,
    stem_channels,
)

__all__ = ["CONV_ARCHS", "CONV_BWD_ITERATORS", "CONV_ITERATORS", "Conv90Spec", "Conv90WgradSpec", "ConvBwdSpec", "ConvLayer",
           "ConvRowsSpec", "ConvRowsWgradSpec", "ConvSpec", "conv_bwd_candidates", "conv_bwd_heuristic", "conv_candidates",
           "conv_heuristic", "conv_problems", "conv_window", "rows_serve", "select_conv2d",
           "select_conv2d_backward", "stem_channels"]
