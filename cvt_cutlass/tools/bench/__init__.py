"""Benchmarks (GPU): CUDA-event timing, medians, the PyTorch peer measured in the same process."""
