"""EVT epilogue functions of the Linear family.

Each function is traced by ``cutlass_cppgen.epilogue.trace`` into a CUTLASS epilogue visitor tree
(EVT). Tracing parses this file's source, so activations are called by their bare name (``gelu``,
which CUTLASS implements as the exact erf form, like ``nn.GELU()``), not as attributes.

Names carry meaning to the tracer and to :mod:`cvt_cutlass.epilogues.packing`:

* ``accum``: the fp32 accumulator tile of ``x @ W^T``.
* ``bias``: a (1, N) example, i.e. a row broadcast of a length-N vector.
* ``rs``: an (M, 1) example, i.e. a column broadcast of a length-M fp32 vector: a per-row scale
  (drop path's mask / keep probability per token row).
* ``C``: an (M, N) source tensor. On SM90 CUTLASS loads it through the collective epilogue's own
  TMA pipeline (its shared memory is reused for D), which is why the residual is spelled ``C``.
* ``D``: the (M, N) output. ``Z``: an extra (M, N) store (the pre-activation, kept for backward).
  ``G``: an extra (M, N) fp16 store of gelu'(the value the tree stores there):
  :mod:`cvt_cutlass.epilogues.packing` maps the traced store through the derivative.
"""

# ``gelu`` and ``sigmoid`` are resolved by the EVT tracer, not by Python:
# ruff: noqa: F821


def none(accum):
    D = accum
    return D


def bias(accum, bias):
    D = accum + bias
    return D


def bias_gelu(accum, bias):
    D = gelu(accum + bias)
    return D


def bias_residual(accum, bias, C):
    D = accum + bias + C
    return D


def bias_scale_residual(accum, bias, rs, C):
    D = (accum + bias) * rs + C
    return D


def bias_residual_scale(accum, bias, C, rs):
    D = (accum + bias + C) * rs
    return D


def bias_gelu_aux(accum, bias):
    Z = accum + bias
    D = gelu(Z)
    return D, Z


def bias_gelu_dgelu(accum, bias):
    G = accum + bias
    D = gelu(G)
    return D, G


# ---- dgrad epilogues (dX = dY . W): ``C`` is what the forward saved of the GELU that follows
# the layer whose input gradient this is. ``sigmoid`` is a placeholder: epilogues.packing swaps it
# for the exact GELU derivative (DGeluErf) and adds the row reduction into dbias.
def dgelu_dbias(accum, C):
    D = accum * sigmoid(C)
    return D


# ``C`` is gelu'(Z), saved in fp16 by the forward's ``bias_gelu_dgelu``; epilogues.packing adds the
# row reduction into dbias.
def dgelu_saved_dbias(accum, C):
    D = accum * C
    return D
