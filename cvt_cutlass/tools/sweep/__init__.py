"""Profile sweeps in cutlass_profiler's CSV schemas (GPU): :mod:`.driver` (the one sweep loop),
the problem families :mod:`.linear`, :mod:`.conv`, :mod:`.attention`, the selection tables they
feed (:mod:`.tables`) and ``cvt-cutlass profile`` (:mod:`.main`)."""
