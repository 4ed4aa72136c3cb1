"""The attention family: CvT's fused multi-head attention, forward and backward.

* :mod:`.spec` -- :class:`AttnSpec` and :class:`AttnBwdSpec` (CUTLASS example 41, Sm80-class:
  ``ex41_fwd.cuh``, ``ex41_bwd.cuh``), :class:`Attn88Spec` and :class:`Attn88BwdSpec` (example 88,
  Hopper, sm_90a: ``ex88_fwd.cuh``, ``ex88_bwd.cuh``), :class:`AttnShortSpec` and
  :class:`AttnShortBwdSpec` (ours, for Lkv <= 64: ``short_fwd.cuh``, ``short_bwd.cuh`` over
  ``short_common.cuh``), :class:`AttnWgmmaBwdSpec` (ours, Hopper wgmma, head dim 64:
  ``wgmma_bwd.cuh``), their search spaces and heuristics. The backward kernels share
  ``bwd_common.cuh`` (the rowsum(dout * o) pass, the dq conversion, the stride checks).
* :mod:`.problems` -- the attention of each CvT stage; :mod:`.select` -- the kernel for a problem.
* ``ex88/`` -- our copy of example 88's backward mainloop with its bf16 fix (the file's header
  says what changed; tests/test_attention.py diffs it against the installed CUTLASS).
* ``shim/`` -- the cuRAND stand-in example 41's headers include.
* ``abi.h`` -- ``cvt_attn_args`` and ``cvt_attnbwd_args``, what the torch binding passes.
"""

from .problems import AttentionLayer, attention_problems
from .select import select_attention
from .spec import (
    CURAND_SHIM_DIR,
    EX41_DIR,
    EX88_BWD_MAINLOOP,
    EX88_BWD_MAINLOOP_COPY,
    EX88_DIR,
    EX88_SCHEDULES,
    EX88_SMEM_LIMIT,
    LSE_ALIGN,
    Attn88BwdSpec,
    Attn88Spec,
    AttnBwdSpec,
    AttnShortBwdSpec,
    AttnShortSpec,
    AttnSpec,
    AttnWgmmaBwdSpec,
    attn_bwd_candidates,
    attn_bwd_heuristic,
    attn_candidates,
    attn_heuristic,
)

__all__ = ["CURAND_SHIM_DIR", "EX41_DIR", "EX88_BWD_MAINLOOP", "EX88_BWD_MAINLOOP_COPY", "EX88_DIR",
           "EX88_SCHEDULES", "EX88_SMEM_LIMIT", "LSE_ALIGN", "Attn88BwdSpec", "Attn88Spec", "AttnBwdSpec",
           "AttnShortBwdSpec", "AttnShortSpec", "AttnSpec", "AttnWgmmaBwdSpec", "AttentionLayer", "attention_problems", "attn_bwd_candidates", "attn_bwd_heuristic",
           "attn_candidates", "attn_heuristic", "select_attention"]
