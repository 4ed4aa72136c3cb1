"""Shared fixtures. The same files hold CPU tests (CI) and GPU tests (skipped without CUDA)."""

from __future__ import annotations

import shutil

import pytest


def _cuda_cc() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


CUDA_CC = _cuda_cc()
HAS_NVCC = shutil.which("nvcc") is not None or shutil.which("/usr/local/cuda/bin/nvcc") is not None

requires_cuda = pytest.mark.skipif(CUDA_CC is None, reason="needs a CUDA GPU")
requires_sm80 = pytest.mark.skipif(CUDA_CC is None or CUDA_CC < 80, reason="needs a GPU of sm_80 or newer")
requires_sm90 = pytest.mark.skipif(CUDA_CC != 90, reason="needs an sm_90 GPU (H100/H200)")
requires_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")


@pytest.fixture
def strict_fallbacks():
    """Any fallback to PyTorch raises: proves the call ran on a CUTLASS kernel."""
    from cvt_cutlass import fallback

    fallback.set_strict(True)
    fallback.reset()
    yield
    fallback.set_strict(None)


@pytest.fixture
def counted_fallbacks():
    from cvt_cutlass import fallback

    fallback.set_strict(False)
    fallback.reset()
    yield fallback
    fallback.set_strict(None)
    fallback.reset()
