"""The plain-C entry points every conv / attention kernel library exports (csrc/cvt_*_abi.h).

One text for all families: the info record, can_implement, workspace_size and a run() that
re-checks the problem and the device's compute capability before launching. The returned text
still holds ``${name}`` and ``${min_cc}`` for the family's template substitution.
"""

from __future__ import annotations


def c_exports(family: str, var: str, *, workspace_check: bool = True,
              arch_refused: str = "major * 10 < ${min_cc}") -> str:
    """``family``: "conv" or "attn" (symbol prefix ``cvt_<family>_``, argument type
    ``cvt_<family>_args``); ``var``: the argument's name; ``arch_refused``: the C condition on
    ``major`` under which run() answers CVT_ERR_ARCH."""
    args = f"cvt_{family}_args"
    ws = (f"  if (workspace_bytes < cvt_kernel::workspace_size(*{var})) return CVT_ERR_WORKSPACE;\n"
          if workspace_check else "")
    return (
        '\nextern "C" {\n'
        "CVT_EXPORT const cvt_kernel_info* cvt_kernel_info_get(void) {\n"
        '  static const cvt_kernel_info info = {CVT_KERNEL_ABI_VERSION, cvt_kernel::kFamily, ${min_cc}, "${name}"};\n'
        "  return &info;\n"
        "}\n"
        f"CVT_EXPORT int cvt_{family}_can_implement(const {args}* {var}) {{\n"
        f"  return cvt_kernel::can_implement(*{var}) ? CVT_OK : CVT_ERR_INVALID_PROBLEM;\n"
        "}\n"
        f"CVT_EXPORT size_t cvt_{family}_workspace_size(const {args}* {var}) "
        f"{{ return cvt_kernel::workspace_size(*{var}); }}\n"
        f"CVT_EXPORT int cvt_{family}_run(const {args}* {var}, void* workspace, size_t workspace_bytes, void* stream) {{\n"
        f"  if (!cvt_kernel::can_implement(*{var})) return CVT_ERR_INVALID_PROBLEM;\n"
        + ws
        + "  int major = 0;\n"
        f"  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, {var}->device_id) != cudaSuccess) {{\n"
        "    (void)cudaGetLastError();\n"
        "    return CVT_ERR_ARCH;\n"
        "  }\n"
        f"  if ({arch_refused}) return CVT_ERR_ARCH;\n"
        f"  return cvt_kernel::launch(*{var}, workspace, static_cast<cudaStream_t>(stream));\n"
        "}\n"
        '}  // extern "C"\n'
    )
