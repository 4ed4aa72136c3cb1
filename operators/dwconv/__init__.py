"""The dwconv family: CvT's depthwise 3x3 conv projections (q at stride 1, k and v at stride 2).

* :mod:`.spec` -- :class:`DwConvSpec` (inference, BatchNorm folded: ``dwconv.cuh``) and
  :class:`DwConvBnSpec` (training: conv + BatchNorm with batch statistics, forward ``dwbn_fwd.cuh``
  and backward ``dwbn_bwd.cuh``, what they share in ``dwbn_common.cuh``), their search spaces and
  heuristics.
* :mod:`.problems` -- the depthwise convs of a CvT; :mod:`.select` -- the kernel for a problem.
* ``abi.h`` -- ``cvt_dwbn_args`` and ``cvt_dwbnbwd_args``; the inference kernel takes
  ``cvt_conv_args`` (operators/conv2d/abi.h).
"""

from .problems import dwconv_problems
from .select import select_dwconv, select_dwconv_bn
from .spec import (
    DwConvBnSpec,
    DwConvSpec,
    dwconv_bn_candidates,
    dwconv_bn_heuristic,
    dwconv_candidates,
    dwconv_heuristic,
)

__all__ = ["DwConvBnSpec", "DwConvSpec", "dwconv_bn_candidates", "dwconv_bn_heuristic", "dwconv_candidates",
           "dwconv_heuristic", "dwconv_problems", "select_dwconv", "select_dwconv_bn"]
