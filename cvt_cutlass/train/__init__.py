"""Training a swapped CvT: the step users run (:mod:`.step`: precision, optimizer, schedule, the
eager step; :mod:`.optim`: torch's fused SGD / AdamW with their per-parameter Python done once;
:mod:`.captured`: the whole step captured in a CUDA graph), the data of ``cvt-cutlass train``
(:mod:`.data`) and its runs over several processes (:mod:`.dist`)."""

from .captured import CapturedStep, make_captured_step
from .data import ImageFolderTask, SyntheticTask
from .dist import Ranks, ShardedTask, allreduce_ms, finish, mean_over_ranks, ranks_agree, ranks_from_env
from .step import (
    Precision,
    StepOptions,
    cosine_schedule,
    fit_classifier,
    make_optimizer,
    make_step,
    precision_of,
    train_body,
)

__all__ = ["CapturedStep", "ImageFolderTask", "Precision", "Ranks", "ShardedTask", "StepOptions", "SyntheticTask",
           "allreduce_ms", "cosine_schedule", "finish", "fit_classifier", "make_captured_step", "make_optimizer",
           "make_step", "mean_over_ranks", "PlannedAdamW", "PlannedSGD", "precision_of", "ranks_agree",
           "ranks_from_env", "train_body"]


def __getattr__(name: str):
    # the optimizer classes subclass torch's: imported on first use (importing this package imports
    # no torch)
    if name in ("PlannedAdamW", "PlannedSGD"):
        from . import optim

        return getattr(optim, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
