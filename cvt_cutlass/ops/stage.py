"""``torch.ops.cvt_cutlass.stage_infer``: a fused stage's inference forward as one op, for
torch.compile.

Traced op by op, a compiled swapped model launches every kernel of a stage from Inductor's
wrapper (~55 per CvT-13 stage 3), while the same stage called eagerly replays its CUDA graph
(:mod:`cvt_cutlass.graphs`). Under torch.compile a stage that runs its inference path (no autograd
recording) is this one op instead: opaque to Dynamo and Inductor (one graph, no break), it runs
the stage as an eager call would (replaying its graph, or capturing it, or eagerly where it
cannot replay, counted in ``cvt_cutlass.stats()['stage_graphs']``; inside a reduce-overhead
capture, its kernels go into that graph) and returns fresh copies of the stage's outputs (an op's
outputs may not alias the graph's static buffers or each other).

``stage_infer(Tensor x, int stage, ScalarType dtype) -> (Tensor tokens, Tensor cls)``: ``stage`` is
the fused stage's handle (``FusedCvtStage._handle``), ``dtype`` the compute dtype the trace saw (autocast's,
say: at run time the compiled graph runs its ops outside autocast); tokens (B, C, H', W') in
channels-last memory, cls rows (B, 1, C), or (B, 0, C) for a stage without a cls token. Training
forwards (autograd recording) keep the traced ops and their autograd formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..handles import stage_of
from .conv2d import conv_out


def _stage(handle: int):
    stage = stage_of(handle)
    if stage is None:
        raise RuntimeError(f"cvt_cutlass.stage_infer: handle {handle} names no live fused stage (a graph compiled "
                           "for a model since freed?)")
    return stage


def _outputs(stage, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Empty outputs of the stage on x: tokens (B, C, H', W') channels-last, cls rows (B, 0 or 1, C)."""
    conv = stage.embedding.convolution_embeddings.projection
    (k, _), (s, _), (p, _) = conv.kernel_size, conv.stride, conv.padding
    b, h, w = x.shape[0], conv_out(x.shape[2], k, s, p), conv_out(x.shape[3], k, s, p)
    c = conv.out_channels
    rows = 1 if stage.config.cls_token[stage.stage] else 0
    tokens = x.new_empty((b, h, w, c), dtype=dtype).permute(0, 3, 1, 2)
    return tokens, x.new_empty((b, rows, c), dtype=dtype)


@torch.library.custom_op("cvt_cutlass::stage_infer", mutates_args=())
def stage_infer(x: Tensor, stage: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    s = _stage(stage)
    tokens, cls = s._graphs(s, x, dtype, s._run)
    out_tokens, out_cls = _outputs(s, x, dtype)
    out_tokens.copy_(tokens)
    if cls is not None:
        out_cls.copy_(cls)
    return out_tokens, out_cls


@stage_infer.register_fake
def _fake(x: Tensor, stage: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _outputs(_stage(stage), x, dtype)
