"""The LayerNorm family: CvT's LayerNorms over the channels of its tokens, forward and backward.

* :mod:`.spec` -- :class:`LayerNormSpec`, its search space and heuristic, and its instantiation of
  ``layernorm_fwd.cuh`` / ``layernorm_bwd.cuh``.
* :mod:`.problems` -- the LayerNorms of a CvT; :mod:`.select` -- the kernel for a problem.
* ``abi.h`` -- ``cvt_norm_args`` and ``cvt_normbwd_args``, what the torch binding passes.
"""

from .problems import NormLayer, layernorm_problems
from .select import select_layernorm
from .spec import (
    LN_BWD_MAX_VECS,
    LN_MAX_VECS,
    LayerNormSpec,
    bwd_channels_supported,
    channels_supported,
    layernorm_candidates,
    layernorm_heuristic,
)

__all__ = ["LN_BWD_MAX_VECS", "LN_MAX_VECS", "LayerNormSpec", "NormLayer", "bwd_channels_supported",
           "channels_supported", "layernorm_candidates", "layernorm_heuristic", "layernorm_problems", "select_layernorm"]
