"""The Linear family: CvT's nn.Linear GEMMs, forward, input gradient and weight gradient.

* :mod:`.spec` -- :class:`LinearSpec` (forward ``fwd`` and input gradient ``dgrad`` kernels, SM90
  and SM80-class) and its instantiation of the headers ``gemm_sm90.cuh``, ``gemm_sm80.cuh``,
  ``dgrad_sm90.cuh``, ``dgrad_sm80.cuh`` (GELU' in ``dgelu.cuh``); the fused epilogues are EVTs
  traced from :mod:`cvt_cutlass.epilogues`.
* :mod:`.wgrad` -- :class:`LinearWgradSpec` (the ``wgrad`` pass: ``wgrad_sm80.cuh``,
  ``wgrad_sm90.cuh``), its search space and heuristic.
* :mod:`.space` -- the forward / dgrad search space and heuristic.
* :mod:`.problems` -- the Linear problems of a CvT (forward and backward GEMMs).
* :mod:`.select` -- the kernel for a problem: the tuned table's row or the heuristic.
* ``abi.h`` -- ``cvt_gemm_args`` and ``cvt_wgrad_args``, what the torch binding passes.
"""

from ..spec import CUTLASS_ELEMENT, DTYPES, SpecError
from .select import select_linear, select_linear_backward, table_epilogue
from .space import backward_candidates, candidates, heuristic_spec, refinements
from .spec import LinearSpec
from .wgrad import LinearWgradSpec, wgrad_candidates, wgrad_heuristic

__all__ = ["CUTLASS_ELEMENT", "DTYPES", "LinearSpec", "LinearWgradSpec", "SpecError", "backward_candidates",
           "candidates", "heuristic_spec", "refinements", "select_linear", "select_linear_backward", "table_epilogue",
           "wgrad_candidates", "wgrad_heuristic"]
