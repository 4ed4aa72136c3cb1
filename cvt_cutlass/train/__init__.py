"""Training a swapped CvT: the step users run (:mod:`.step`: precision, optimizer, eager step,
the whole step captured in a CUDA graph) and the data of ``cvt-cutlass train`` (:mod:`.data`)."""

from .data import ImageFolderTask, SyntheticTask
from .step import Precision, fit_classifier, make_captured_step, make_optimizer, make_step, precision_of

__all__ = ["ImageFolderTask", "Precision", "SyntheticTask", "fit_classifier", "make_captured_step", "make_optimizer",
           "make_step", "precision_of"]
