"""``cvt-cutlass``: run | train | emit | build | profile | plot | bench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .operators.spec import ARCH_TAG, DTYPES

BENCH_PASSES = ("fwd", "bwd", "fwd+bwd")  # bench --op linear / layernorm: forward, backward, both
PASS_OPS = ("linear", "layernorm", "attention", "conv", "dwconv")  # bench ops with a --pass (training) table

ARCHS = tuple(ARCH_TAG)  # the kernel paths: SM80-class kernels (sm89) and SM90 kernels


def _choice(what: str, kind, choices):
    """argparse type: one ``kind`` value out of ``choices`` (a sequence, or a function returning
    one, so that the choices' module is imported only when the option is parsed)."""

    def parse(s: str):
        valid = list(choices() if callable(choices) else choices)
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v not in valid:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {s!r}; choose from {', '.join(map(str, valid))}")
        return v

    return parse


def _csv(item):
    """argparse type: a comma-separated list, each value parsed by ``item``."""

    def parse(s: str) -> list:
        values = [item(v.strip()) for v in s.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"empty list {s!r}; expected comma-separated values")
        return values

    return parse


def _csv_choices(what: str, kind, choices):
    return _csv(_choice(what, kind, choices))


TABLE_TOLERANCE = 0.05  # the packaged tables: kernels within 5% of each problem's fastest


def _fraction(s: str) -> float:
    """A float in [0, 1)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"invalid value {s!r}; expected a positive integer")
    return v


def _model_names() -> list[str]:
    from .models import CONFIGS

    return sorted(CONFIGS)


def _epilogue_names() -> list[str]:
    from .epilogues import LINEAR_EPILOGUES

    return list(LINEAR_EPILOGUES)


_model = _choice("model", str.lower, _model_names)  # case-insensitive, like models.get_config
_config = _choice("config", str.lower, _model_names)


def _input_file(s: str) -> str:
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"{'not a file' if Path(s).exists() else 'no such file'}: {s!r}")
    return s


def _checkpoint(s: str) -> str:
    """What ``load_cvt`` reads: an existing path (or a config name, for random weights)."""
    if Path(s).exists() or s.lower() in _model_names():
        return s
    raise argparse.ArgumentTypeError(f"no such file or directory: {s!r} (expected a local HF directory, "
                                     ".safetensors, or original CvT .pth/.pt/.bin)")


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", default="linear", choices=["linear", "conv2d", "dwconv", "attention", "layernorm"],
                   help="linear: fused Linear layers; conv2d: token-embedding convs; dwconv: depthwise conv "
                        "projections; attention: fused multi-head attention; layernorm: token LayerNorms")
    p.add_argument("--arch", type=_csv_choices("arch", int, ARCHS), default=[90],
                   help="89 and/or 90 (comma separated)")
    p.add_argument("--epilogue", type=_csv_choices("epilogue", str, _epilogue_names), default=None,
                   help="none,bias,bias_gelu,bias_residual,bias_gelu_aux (default: all)")
    p.add_argument("--dtype", type=_csv_choices("dtype", str, DTYPES), default=None,
                   help="fp16,bf16 (default: both)")
    p.add_argument("--kernels", default="selected", choices=["selected", "candidates"],
                   help="selected: what the runtime picks for the model's problems; "
                        "candidates: the profile sweep's space")
    p.add_argument("--model", type=_model, default="cvt-13")
    p.add_argument("--batch", type=_csv(_positive_int), default=[1, 32, 256])
    p.add_argument("--image-size", type=_positive_int, default=None)


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
    cc = a.device_cc
    libs = prebuild(specs, cc, jobs=a.jobs)
    for name, path in sorted(libs.items()):
        print(f"{name}\t{path}")
    print(f"{len(libs)} kernel(s) in the cache", file=sys.stderr)
    return 0


def cmd_profile(a) -> int:
    from .profile import profile_main

    return profile_main(a)


def cmd_table(a) -> int:
    from .profile import rewrite_tables

    for path in a.profile:
        for out in rewrite_tables(path, a.table_dir, a.tolerance):
            print(f"{path} -> {out}")
    return 0


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
    else:
        a.image_size = sizes[0] if sizes else None
    if a.op == "model":
        from .bench.model import bench_main
    elif a.op == "train":
        from .bench.train import bench_main
    elif a.op == "conv" and a.passes == ["fwd"]:
        from .bench.conv import bench_main
    elif a.op == "attention" and a.passes == ["fwd"]:
        from .bench.attention import bench_main
    elif a.op == "host":
        from .bench.host import bench_main
    elif a.op in ("layernorm", "dwconv") or a.passes != ["fwd"]:
        from .bench.passes import bench_main
    else:
        from .bench.linear import bench_main

    return bench_main(a)


def _check_bench(a, p: argparse.ArgumentParser) -> None:
    """What depends on ``--op``: several image sizes and the providers are for ``--op model``."""
    if a.op != "model" and a.image_size and len(a.image_size) > 1:
        p.error(f"argument --image-size: takes one size for --op {a.op} (several only for --op model)")
    if a.passes is not None and a.op not in PASS_OPS:
        p.error(f"argument --pass: is for --op {' / '.join(PASS_OPS)}, not --op {a.op}")
    if a.passes is None:
        a.passes = list(BENCH_PASSES) if a.op in ("layernorm", "dwconv") else ["fwd"]
    a.batch = a.batch or ([32, 128, 256] if a.op == "train" else [1, 256])
    a.dtype = a.dtype or (["bf16"] if a.op == "train" else ["fp16"])
    if a.providers and a.op not in ("model", "train"):
        p.error(f"argument --providers: is for --op model / train, not --op {a.op}")
    if a.providers:
        from .bench.model import PROVIDERS
        from .bench.train import TRAIN_PROVIDERS

        known = PROVIDERS if a.op == "model" else TRAIN_PROVIDERS
        bad = [v for v in a.providers if v not in known]
        if bad:
            p.error(f"argument --providers: unknown provider {bad[0]!r}; choose from {', '.join(known)}")


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a swapped CvT on an ImageFolder directory or a synthetic task "
                                     "(a few CPU reference steps without a GPU)")
    p.add_argument("--model", type=_model, default="cvt-13", help="named config, random weights")
    p.add_argument("--checkpoint", type=_checkpoint, default=None,
                   help="local HF directory, .safetensors, or original CvT .pth (instead of --model)")
    p.add_argument("--config", type=_config, default=None, help="named config for a checkpoint without config.json")
    p.add_argument("--num-heads", type=_csv(_positive_int), default=None, help="heads per stage, for a bare checkpoint")
    p.add_argument("--data", default=None, help="ImageFolder directory: one folder of images per class "
                                                "(default: a synthetic task with a learnable signal)")
    p.add_argument("--classes", type=_positive_int, default=10, help="classes of the synthetic task (default 10)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps")
    length.add_argument("--epochs", type=_positive_int, default=None,
                        help="passes over --data (the synthetic task: 100 batches each) (default: 1)")
    p.add_argument("--batch", type=_positive_int, default=64)
    p.add_argument("--image-size", type=_positive_int, default=224)
    p.add_argument("--lr", type=_positive_float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-5)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd: momentum 0.9 (default)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="parameter dtype: fp32 master weights (with --amp), or a pure bf16 / fp16 model")
    p.add_argument("--amp", default=None, choices=["bf16", "fp16", "none"],
                   help="autocast dtype for fp32 parameters (default bf16 on a GPU; fp16 uses a GradScaler)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--compile", action="store_true", help="torch.compile the swapped model")
    speed.add_argument("--cuda-graph", action="store_true",
                       help="capture the whole step (forward, backward, optimizer) in one CUDA graph after 3 eager "
                            "steps: no host work per kernel; fixed batch, constant lr, not with --amp fp16 (its GradScaler)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="cvt-finetuned", help="directory of the final checkpoint (HF format)")
    p.set_defaults(fn=cmd_train)


def cmd_train(a) -> int:
    from .train import train_main

    if a.steps is None and a.epochs is None:
        a.epochs = 1
    if a.cuda_graph and a.amp == "fp16":
        print("cvt-cutlass train: --cuda-graph cannot capture fp16 autocast (the GradScaler's skip-and-rescale "
              "is host logic): use --amp bf16", file=sys.stderr)
        return 2
    return train_main(a)


def cmd_run(a) -> int:
    from .run import run_main

    return run_main(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cvt-cutlass", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="the main job: build the kernels, swap a CvT, check its logits, time it "
                                   "(CPU reference path without a GPU)")
    p.add_argument("--model", type=_model, default="cvt-13",
                   help="named config, random weights (cvt-13, cvt-21, cvt-w24)")
    p.add_argument("--checkpoint", type=_checkpoint, default=None,
                   help="local HF directory, .safetensors, or original CvT .pth (instead of --model)")
    p.add_argument("--config", type=_config, default=None, help="named config for a checkpoint without config.json")
    p.add_argument("--num-heads", type=_csv(_positive_int), default=None, help="heads per stage, for a bare checkpoint")
    p.add_argument("--batch", type=_positive_int, default=32)
    p.add_argument("--image-size", type=_positive_int, default=224)
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--jobs", type=_positive_int, default=None, help="parallel nvcc jobs (default: CPU count)")
    p.set_defaults(fn=cmd_run)

    _add_train_parser(sub)

    p = sub.add_parser("emit", help="write kernel .cu sources (no GPU needed)")
    _add_kernel_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_emit)

    p = sub.add_parser("build", help="compile kernels into the cache ahead of time")
    _add_kernel_args(p)
    p.add_argument("--device-cc", type=_positive_int, default=None,
                   help="build the SM80-class (arch 89) kernels for this compute capability, "
                        "e.g. 90 to run them on an H200 (default: sm_89)")
    p.add_argument("--jobs", type=_positive_int, default=None)
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("profile", help="sweep kernels over a model's problems (GPU)")
    _add_kernel_args(p)
    p.add_argument("--out", required=True, help="profiler-schema CSV to write (appended, resumable)")
    p.add_argument("--update-table", action="store_true",
                   help="write the best passing kernel per problem into the selection table")
    p.add_argument("--table-dir", default=None, help="where the selection table lives (default: profiles/)")
    p.add_argument("--pass", dest="passes", type=_csv_choices("pass", str, PROFILE_PASSES),
                   default=["fwd"], help="--op linear / conv2d: fwd and/or the backward GEMMs dgrad, wgrad; "
                                         "--op attention: fwd or bwd (the fused backward kernels); --op dwconv: fwd "
                                         "(the eval kernels, BatchNorm folded) and/or train (the training kernels: "
                                         "conv + BatchNorm with batch statistics, and its backward) (default: fwd)")
    p.add_argument("--no-refine", dest="refine", action="store_false",
                   help="skip stage 2 (raster-order / swizzle variants of each problem's winner)")
    p.add_argument("--jobs", type=_positive_int, default=None)
    p.add_argument("--tolerance", type=_fraction, default=TABLE_TOLERANCE,
                   help="--update-table: per problem, any kernel within this fraction of the fastest may serve it, "
                        "so that fewer distinct kernels cover the model (fewer to compile); 0 = always the fastest "
                        f"(default {TABLE_TOLERANCE})")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("table", help="rewrite selection tables from profile CSVs already measured (no GPU)")
    p.add_argument("--profile", type=_input_file, nargs="+", required=True,
                   help="profiler-schema CSVs from `cvt-cutlass profile` (linear, conv2d/dwconv or attention)")
    p.add_argument("--table-dir", default=None, help="where the selection tables live (default: profiles/)")
    p.add_argument("--tolerance", type=_fraction, default=TABLE_TOLERANCE,
                   help=f"as for profile --update-table (default {TABLE_TOLERANCE})")
    p.set_defaults(fn=cmd_table)

    p = sub.add_parser("plot", help="PNG plots of a profile CSV (TFLOP/s per shape and a roofline) or of a "
                                    "model benchmark CSV (throughput vs batch)")
    p.add_argument("--op", default="linear", choices=["linear", "model"])
    p.add_argument("--profile", type=_input_file, required=True,
                   help="profiler-schema CSV from `cvt-cutlass profile`, or (--op model) `bench --op model --out`")
    p.add_argument("--ceilings", type=_input_file, default=None,
                   help="ceilings CSV (default: <profile stem>_ceilings.csv beside the profile)")
    p.add_argument("--model", type=_model, default="cvt-13")
    p.add_argument("--batch", type=_csv(_positive_int), default=[1, 32, 256])
    p.add_argument("--image-size", type=_positive_int, default=None)
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.set_defaults(fn=cmd_plot)

    p = sub.add_parser("bench", help="fused ops vs what PyTorch / HF runs for the same step (GPU)")
    p.add_argument("--op", default="linear",
                   choices=["linear", "layernorm", "conv", "dwconv", "attention", "model", "host", "train"],
                   help="linear: fused Linear layers; conv: token-embedding and depthwise conv steps; "
                        "dwconv: the depthwise conv projection + BatchNorm in training mode (see --pass); "
                        "attention: fused attention vs HF's einsum path and every SDPA backend; "
                        "model: the whole swapped CvT vs HF eager / CUDA graph / torch.compile; "
                        "host: host microseconds per op call vs PyTorch's equivalent; "
                        "layernorm: LayerNorm's forward / backward vs PyTorch's (see --pass); "
                        "train: ms per training step (autocast, SGD momentum) of HF eager, torch.compile(HF), "
                        "swapped and torch.compile(swapped), peak memory, kernel calls and fallbacks")
    p.add_argument("--pass", dest="passes", type=_csv_choices("pass", str, BENCH_PASSES), default=None,
                   help="--op linear / layernorm / attention / conv / dwconv: fwd, bwd, fwd+bwd (comma-separated). "
                        "linear, attention and conv with fwd alone (their default) are the inference tables; with "
                        "bwd or fwd+bwd, the training table of CvT-13's stage shapes vs torch autograd (attention: "
                        "vs cuDNN's and flash's SDPA; conv: --model's embedding convs; dwconv: the depthwise "
                        "projection + BatchNorm in training mode; layernorm: always; default all)")
    p.add_argument("--model", type=_model, default="cvt-13")
    p.add_argument("--batch", type=_csv(_positive_int), default=None,
                   help="batch sizes (default 1,256; --op train: 32,128,256)")
    p.add_argument("--image-size", type=_csv(_positive_int), default=None,
                   help="image size (several, comma-separated, for --op model)")
    p.add_argument("--providers", type=_csv(str), default=None,
                   help="--op model: hf,hf_graph,compile,compile_ro,compile_max,swapped,swapped_graph,"
                        "swapped_compile,swapped_compile_ro (default: all but compile_max and compile_ro); "
                        "--op train: hf,compile,swapped,swapped_compile (default: all)")
    p.add_argument("--label", default=None, help="--op host: a label for the rows (e.g. before / after)")
    p.add_argument("--breakdown", action="store_true",
                   help="--op model: also profile one forward per provider and print its GPU time by "
                        "kernel category (LayerNorm, copies, GEMMs, ...) and its top kernels; "
                        "--op linear/layernorm with --pass: also the MLP's backward GEMMs one by one and "
                        "LayerNorm's backward kernel vs aten's, GPU time only")
    p.add_argument("--dtype", type=_csv_choices("dtype", str, DTYPES), default=None,
                   help="fp16 and/or bf16 (default fp16; --op train: bf16, the autocast dtype)")
    p.add_argument("--path", default="auto", choices=["auto", "sm89", "sm90"])
    p.add_argument("--out", default=None, help="CSV to append results to")
    p.set_defaults(fn=cmd_bench)

    a = ap.parse_args(argv)
    p = sub.choices[a.cmd]
    if a.cmd == "bench":
        _check_bench(a, p)
    if a.cmd == "profile":
        _check_profile_passes(a, p)
    return _dispatch(a, p.prog)


# The passes each profile sweep takes.
PROFILE_PASSES = ("fwd", "dgrad", "wgrad", "bwd", "train")
_OP_PASSES = {"linear": ("fwd", "dgrad", "wgrad"), "conv2d": ("fwd", "dgrad", "wgrad"), "dwconv": ("fwd", "train"),
              "attention": ("fwd", "bwd"), "layernorm": ("fwd",)}


def _check_profile_passes(a, p) -> None:
    bad = [x for x in a.passes if x not in _OP_PASSES[a.op]]
    if bad:
        p.error(f"argument --pass: --op {a.op} sweeps {', '.join(_OP_PASSES[a.op])}, not {', '.join(bad)}")
    if a.op == "attention" and len(a.passes) > 1:
        p.error("argument --pass: --op attention sweeps fwd or bwd (one at a time)")


def _dispatch(a, prog: str) -> int:
    """Run the subcommand; a missing input file, or a ValueError raised by our own code (bad
    arguments it validates, e.g. models.get_config), is one ``<prog>: error:`` line and status 2.
    Anything else keeps its traceback."""
    try:
        return a.fn(a)
    except FileNotFoundError as e:
        msg = f"no such file or directory: {e.filename!r}" if e.filename else str(e)
    except ValueError as e:
        if not _raised_by_us(e):
            raise
        msg = str(e)
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def _raised_by_us(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("cvt_cutlass.")


if __name__ == "__main__":
    raise SystemExit(main())
