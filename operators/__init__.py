"""Kernel specs and C++ templates, one module per op family. Installed as ``cvt_cutlass.operators``."""
