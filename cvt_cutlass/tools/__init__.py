"""Tooling above the library: profile sweeps (:mod:`.sweep`), benchmarks (:mod:`.bench`), plots
(:mod:`.plots`) and CUDA timing (:mod:`.timing`). It uses the library's public names only; the
library never imports it."""
