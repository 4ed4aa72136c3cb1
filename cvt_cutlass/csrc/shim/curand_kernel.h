// Stand-in for cuRAND's device header, searched after every real include directory
// (-idirafter): CUTLASS example 41's kernel_forward.h includes <curand_kernel.h> unconditionally
// but uses it only for dropout under HAS_PYTORCH, which cvt_cutlass never defines (its attention
// instantiations have kSupportsDropout = false). Toolkits without cuRAND (e.g. a minimal CUDA 13
// install) then still compile them; where cuRAND exists, its header is found first.
#pragma once
