"""Training a swapped CvT: the step users run (:mod:`.step`: precision, optimizer, schedule, the
eager step; :mod:`.captured`: the whole step captured in a CUDA graph) and the data of
``cvt-cutlass train`` (:mod:`.data`)."""

from .captured import CapturedStep, make_captured_step
from .data import ImageFolderTask, SyntheticTask
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

__all__ = ["CapturedStep", "ImageFolderTask", "Precision", "StepOptions", "SyntheticTask", "cosine_schedule",
           "fit_classifier", "make_captured_step", "make_optimizer", "make_step", "precision_of", "train_body"]
