"""``cvt-cutlass``: run | emit | build | profile | plot | bench."""

from __future__ import annotations

import argparse
import sys


def _csv_list(kind):
    def parse(s: str):
        return [kind(v) for v in s.split(",") if v]

    return parse


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default="linear", choices=["linear", "conv2d", "dwconv", "attention", "layernorm"],
                   help="linear: fused Linear layers; conv2d: token-embedding convs; dwconv: depthwise conv "
                        "projections; attention: fused multi-head attention; layernorm: token LayerNorms")
    p.add_argument("--arch", type=_csv_list(int), default=[90], help="89 and/or 90 (comma separated)")
    p.add_argument("--epilogue", type=_csv_list(str), default=None,
                   help="none,bias,bias_gelu,bias_residual,bias_gelu_aux (default: all)")
    p.add_argument("--dtype", type=_csv_list(str), default=None, help="fp16,bf16 (default: both)")
    p.add_argument("--kernels", default="selected", choices=["selected", "candidates"],
                   help="selected: what the runtime picks for the model's problems; "
                        "candidates: the profile sweep's space")
    p.add_argument("--model", default="cvt-13")
    p.add_argument("--batch", type=_csv_list(int), default=[1, 32, 256])
    p.add_argument("--image-size", type=int, default=None)


def _specs(a):
    from .api import kernels_for

    return kernels_for(a.op, a.arch, a.epilogue, a.dtype, which=a.kernels, model=a.model,
                       batches=a.batch, image_size=a.image_size)


def cmd_emit(a) -> int:
    from .api import emit

    paths = emit(specs=_specs(a), out=a.out)
    for p in paths:
        print(p)
    print(f"wrote {len(paths)} kernel source(s) to {a.out}", file=sys.stderr)
    return 0


def cmd_build(a) -> int:
    from .runtime import prebuild

    specs = _specs(a)
    cc = None if a.device_cc is None else int(a.device_cc)
    libs = prebuild(specs, cc, jobs=a.jobs)
    for name, path in sorted(libs.items()):
        print(f"{name}\t{path}")
    print(f"{len(libs)} kernel(s) in the cache", file=sys.stderr)
    return 0


def cmd_profile(a) -> int:
    from .profile import profile_main

    return profile_main(a)


def cmd_plot(a) -> int:
    from .plots import plot_profile

    if a.op == "model":
        from .plots import plot_model_bench

        for p in plot_model_bench(a.profile, a.out):
            print(p)
        return 0
    for p in plot_profile(a.profile, a.out, model=a.model, batches=a.batch, image_size=a.image_size,
                          ceilings_csv=a.ceilings, op=a.op):
        print(p)
    return 0


def cmd_bench(a) -> int:
    sizes = a.image_size or []
    if a.op == "model":
        a.image_size_list = sizes or [224]
        a.image_size = None
    elif len(sizes) > 1:
        print(f"--image-size takes one size for --op {a.op} (several only for --op model)")
        return 2
    else:
        a.image_size = sizes[0] if sizes else None
    if a.op == "model":
        from .bench.model import bench_main
    elif a.op == "conv":
        from .bench.conv import bench_main
    elif a.op == "attention":
        from .bench.attention import bench_main
    else:
        from .bench.linear import bench_main

    return bench_main(a)


def cmd_run(a) -> int:
    from .run import run_main

    return run_main(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cvt-cutlass", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="the main job: build the kernels, swap a CvT, check its logits, time it "
                                   "(CPU reference path without a GPU)")
    p.add_argument("--model", default="cvt-13", help="named config, random weights (cvt-13, cvt-21, cvt-w24)")
    p.add_argument("--checkpoint", default=None,
                   help="local HF directory, .safetensors, or original CvT .pth (instead of --model)")
    p.add_argument("--config", default=None, help="named config for a checkpoint without config.json")
    p.add_argument("--num-heads", type=_csv_list(int), default=None, help="heads per stage, for a bare checkpoint")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: CPU count)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("emit", help="write kernel .cu sources (no GPU needed)")
    _add_kernel_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_emit)

    p = sub.add_parser("build", help="compile kernels into the cache ahead of time")
    _add_kernel_args(p)
    p.add_argument("--device-cc", default=None,
                   help="build the SM80-class (arch 89) kernels for this compute capability, "
                        "e.g. 90 to run them on an H200 (default: sm_89)")
    p.add_argument("--jobs", type=int, default=None)
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("profile", help="sweep kernels over a model's problems (GPU)")
    _add_kernel_args(p)
    p.add_argument("--out", required=True, help="profiler-schema CSV to write (appended, resumable)")
    p.add_argument("--update-table", action="store_true",
                   help="write the best passing kernel per problem into the selection table")
    p.add_argument("--table-dir", default=None, help="where the selection table lives (default: profiles/)")
    p.add_argument("--no-refine", dest="refine", action="store_false",
                   help="skip stage 2 (raster-order / swizzle variants of each problem's winner)")
    p.add_argument("--jobs", type=int, default=None)
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("plot", help="PNG plots of a profile CSV (TFLOP/s per shape and a roofline) or of a "
                                    "model benchmark CSV (throughput vs batch)")
    p.add_argument("--op", default="linear", choices=["linear", "model"])
    p.add_argument("--profile", required=True,
                   help="profiler-schema CSV from `cvt-cutlass profile`, or (--op model) `bench --op model --out`")
    p.add_argument("--ceilings", default=None,
                   help="ceilings CSV (default: <profile stem>_ceilings.csv beside the profile)")
    p.add_argument("--model", default="cvt-13")
    p.add_argument("--batch", type=_csv_list(int), default=[1, 32, 256])
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.set_defaults(fn=cmd_plot)

    p = sub.add_parser("bench", help="fused ops vs what PyTorch / HF runs for the same step (GPU)")
    p.add_argument("--op", default="linear", choices=["linear", "conv", "attention", "model"],
                   help="linear: fused Linear layers; conv: token-embedding and depthwise conv steps; "
                        "attention: fused attention vs HF's einsum path and every SDPA backend; "
                        "model: the whole swapped CvT vs HF eager / CUDA graph / torch.compile")
    p.add_argument("--model", default="cvt-13")
    p.add_argument("--batch", type=_csv_list(int), default=[1, 256])
    p.add_argument("--image-size", type=_csv_list(int), default=None,
                   help="image size (several, comma-separated, for --op model)")
    p.add_argument("--providers", type=_csv_list(str), default=None,
                   help="--op model: hf,hf_graph,compile,compile_max,swapped,swapped_graph "
                        "(default: all but compile_max)")
    p.add_argument("--breakdown", action="store_true",
                   help="--op model: also profile one forward per provider and print its GPU time by "
                        "kernel category (LayerNorm, copies, GEMMs, ...) and its top kernels")
    p.add_argument("--dtype", type=_csv_list(str), default=["fp16"])
    p.add_argument("--path", default="auto", choices=["auto", "sm89", "sm90"])
    p.add_argument("--out", default=None, help="CSV to append results to")
    p.set_defaults(fn=cmd_bench)

    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
