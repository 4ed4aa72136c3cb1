"""The sub-commands' arguments (``cvt-cutlass <command> --help``)."""

from __future__ import annotations

import argparse

from ..operators.spec import ARCH_TAG, DTYPES
from . import args as t
from . import commands

ARCHS = tuple(ARCH_TAG)  # the kernel paths: SM80-class kernels (sm89) and SM90 kernels
OPS = ["linear", "conv2d", "dwconv", "attention", "layernorm"]
BENCH_OPS = ["linear", "layernorm", "conv", "dwconv", "attention", "model", "host", "train"]
BENCH_PASSES = ("fwd", "bwd", "fwd+bwd")  # bench --op linear / layernorm: forward, backward, both
PROFILE_PASSES = ("fwd", "dgrad", "wgrad", "bwd", "train")


def _model_args(p: argparse.ArgumentParser, what: str) -> None:
    """--model / --checkpoint / --config / --num-heads: the model run and train load."""
    p.add_argument("--model", type=t.model, default="cvt-13", help=f"named config {what}, random weights "
                   "(cvt-13, cvt-21, cvt-w24)")
    p.add_argument("--checkpoint", type=t.checkpoint, default=None,
                   help="local HF directory, .safetensors, or original CvT .pth (instead of --model)")
    p.add_argument("--config", type=t.config, default=None, help="named config for a checkpoint without config.json")
    p.add_argument("--num-heads", type=t.csv(t.positive_int), default=None, help="heads per stage, for a bare checkpoint")


def add_run(sub) -> None:
    p = sub.add_parser("run", formatter_class=t.HelpFormatter,
                       help="the main job: build the kernels, swap a CvT, check its logits, time it (CPU reference "
                            "path without a GPU)")
    _model_args(p, "to run")
    p.add_argument("--batch", type=t.positive_int, default=32, help="images per forward (the CPU path runs <= 2)")
    p.add_argument("--image-size", type=t.positive_int, default=224, help="image side")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="the swapped model's dtype")
    p.add_argument("--jobs", type=t.positive_int, default=None, help="parallel nvcc jobs (default: one per CPU)")
    p.set_defaults(fn=commands.cmd_run)


def add_train(sub) -> None:
    p = sub.add_parser("train", formatter_class=t.HelpFormatter,
                       help="fine-tune a swapped CvT on an ImageFolder directory or a synthetic task (a few CPU "
                            "reference steps without a GPU)")
    _model_args(p, "to fine-tune")
    p.add_argument("--data", default=None, help="ImageFolder directory: one folder of images per class (needs "
                   "Pillow: pip install -e '.[data]') (default: a synthetic task with a learnable signal)")
    p.add_argument("--skip-bad-images", action="store_true",
                   help="leave out image files Pillow cannot read (counted in one warning) instead of stopping")
    p.add_argument("--classes", type=t.positive_int, default=10, help="classes of the synthetic task")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=t.positive_int, default=None, help="optimizer steps (instead of --epochs)")
    length.add_argument("--epochs", type=t.positive_int, default=None,
                        help="passes over --data (the synthetic task: 100 batches each) (default: 1)")
    p.add_argument("--batch", type=t.positive_int, default=64, help="images per step")
    p.add_argument("--image-size", type=t.positive_int, default=224, help="image side")
    p.add_argument("--lr", type=t.positive_float, default=0.01, help="learning rate")
    p.add_argument("--weight-decay", type=float, default=5e-5, help="weight decay")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd: momentum 0.9")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="parameter dtype: fp32 master weights (with --amp), or a pure bf16 / fp16 model")
    p.add_argument("--amp", default=None, choices=["bf16", "fp16", "none"],
                   help="autocast dtype for fp32 parameters (default: bf16 on a GPU; fp16 uses a GradScaler)")
    p.add_argument("--schedule", default="constant", choices=["constant", "cosine"],
                   help="learning rate: constant, or linear warm-up then cosine decay to 0 at the last step")
    p.add_argument("--warmup-steps", type=t.nonnegative_int, default=0, help="steps of the cosine schedule's warm-up")
    p.add_argument("--clip-norm", type=t.positive_float, default=None,
                   help="clip the gradients' global norm to this (after unscaling under --amp fp16) (default: off)")
    p.add_argument("--accumulate", type=t.positive_int, default=1,
                   help="micro-batches per optimizer step (--batch splits into equal parts)")
    p.add_argument("--compile", action="store_true", help="torch.compile the swapped model (an eager step)")
    p.add_argument("--residual-stream", default="fp32", choices=["fp32", "compute"],
                   help="under --amp: the residual stream in fp32 as HF's CvT keeps it (default: its gradients' "
                        "error as HF autocast's), or in the autocast dtype (compute: ~10%% less GPU time per step "
                        "on an H100, HF's pure-16-bit accuracy)")
    p.add_argument("--sync-bn", action="store_true",
                   help="under torchrun: BatchNorm statistics over all processes' batches "
                        "(nn.SyncBatchNorm.convert_sync_batchnorm before the swap)")
    p.add_argument("--no-swap", action="store_true",
                   help="train HF's model as it is, without the CUTLASS stages (the peer of a comparison)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="the whole step (forward, backward, clipping, optimizer, GradScaler, schedule on the "
                        "device) captured in one CUDA graph after 3 eager steps: no host work per kernel (default: "
                        "on with a GPU, unless --compile)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the random weights")
    p.add_argument("--out", default="cvt-finetuned", help="directory of the final checkpoint (HF format)")
    p.set_defaults(fn=commands.cmd_train)


def _kernel_args(p: argparse.ArgumentParser, which: bool = True) -> None:
    """The kernel set of emit / build / profile: op family, paths, epilogues, dtypes, the model's
    problems (``which``: --kernels, the set emit and build take; profile sweeps its candidates)."""
    p.add_argument("--op", default="linear", choices=OPS,
                   help="linear: fused Linear layers; conv2d: token-embedding convs; dwconv: depthwise conv "
                        "projections; attention: fused multi-head attention; layernorm: token LayerNorms")
    p.add_argument("--arch", type=t.csv_choices("arch", int, ARCHS), default=[90], help="89 and/or 90")
    p.add_argument("--epilogue", type=t.csv_choices("epilogue", str, t.epilogue_names), default=None,
                   help="--op linear: which fused epilogues, any of "
                        "cvt_cutlass.epilogues.LINEAR_EPILOGUES, or with --pass dgrad of DGRAD_EPILOGUES "
                        "(default: all)")
    p.add_argument("--dtype", type=t.csv_choices("dtype", str, DTYPES), default=None,
                   help="fp16,bf16 (default: both)")
    if which:
        p.add_argument("--kernels", default="selected", choices=["selected", "candidates"],
                       help="selected: what the runtime picks for the model's problems; candidates: the profile "
                            "sweep's space")
    p.add_argument("--model", type=t.model, default="cvt-13", help="whose problems")
    p.add_argument("--batch", type=t.csv(t.positive_int), default=[1, 32, 256], help="batch sizes")
    p.add_argument("--image-size", type=t.positive_int, default=None, help="image side (default: the model's)")


def add_emit_build(sub) -> None:
    p = sub.add_parser("emit", formatter_class=t.HelpFormatter, help="write kernel .cu sources (no GPU needed)")
    _kernel_args(p)
    p.add_argument("--out", required=True, help="directory for the .cu files and the headers they include")
    p.set_defaults(fn=commands.cmd_emit)
    p = sub.add_parser("build", formatter_class=t.HelpFormatter, help="compile kernels into the cache ahead of time")
    _kernel_args(p)
    p.add_argument("--device-cc", type=t.positive_int, default=None,
                   help="build the SM80-class (arch 89) kernels for this compute capability, e.g. 90 to run them "
                        "on an H200 (default: sm_89)")
    p.add_argument("--jobs", type=t.positive_int, default=None, help="parallel nvcc jobs (default: one per CPU)")
    p.set_defaults(fn=commands.cmd_build)


def add_profile(sub) -> None:
    p = sub.add_parser("profile", formatter_class=t.HelpFormatter,
                       help="sweep kernels over a model's problems (GPU)")
    _kernel_args(p, which=False)
    p.add_argument("--out", required=True, help="profiler-schema CSV to write (appended, resumable)")
    p.add_argument("--update-table", action="store_true",
                   help="write the best passing kernel per problem into the selection table")
    p.add_argument("--table-dir", default=None, help="where the selection tables live (default: the package's)")
    p.add_argument("--pass", dest="passes", type=t.csv_choices("pass", str, PROFILE_PASSES), default=["fwd"],
                   help="--op linear / conv2d: fwd and/or the backward GEMMs dgrad, wgrad; --op attention: fwd or "
                        "bwd (the fused backward kernels); --op dwconv: fwd (the eval kernels, BatchNorm folded) "
                        "and/or train (conv + BatchNorm with batch statistics, and its backward)")
    p.add_argument("--no-refine", dest="refine", action="store_false",
                   help="skip stage 2 (raster-order / swizzle variants of each problem's winner), which runs by "
                        "default")
    p.add_argument("--jobs", type=t.positive_int, default=None, help="parallel nvcc jobs (default: one per CPU)")
    p.add_argument("--tolerance", type=t.fraction, default=t.TABLE_TOLERANCE,
                   help="--update-table: per problem, any kernel within this fraction of the fastest may serve it, "
                        "so that fewer distinct kernels cover the model (fewer to compile); 0 = always the fastest")
    p.set_defaults(fn=commands.cmd_profile)


def add_table_plot(sub) -> None:
    p = sub.add_parser("table", formatter_class=t.HelpFormatter,
                       help="rewrite selection tables from profile CSVs already measured (no GPU)")
    p.add_argument("--profile", type=t.input_file, nargs="+", required=True,
                   help="profiler-schema CSVs from `cvt-cutlass profile` (linear, conv2d/dwconv or attention)")
    p.add_argument("--table-dir", default=None, help="where the selection tables live (default: the package's)")
    p.add_argument("--tolerance", type=t.fraction, default=t.TABLE_TOLERANCE, help="as for profile --update-table")
    p.set_defaults(fn=commands.cmd_table)
    p = sub.add_parser("plot", formatter_class=t.HelpFormatter,
                       help="PNG plots of a profile CSV (TFLOP/s per shape and a roofline) or of a model benchmark "
                            "CSV (throughput vs batch)")
    p.add_argument("--op", default="linear", choices=["linear", "model"], help="what the CSV holds")
    p.add_argument("--profile", type=t.input_file, required=True,
                   help="profiler-schema CSV from `cvt-cutlass profile`, or (--op model) `bench --op model --out`")
    p.add_argument("--ceilings", type=t.input_file, default=None,
                   help="ceilings CSV (default: <profile stem>_ceilings.csv beside the profile)")
    p.add_argument("--model", type=t.model, default="cvt-13", help="whose problems label the plot")
    p.add_argument("--batch", type=t.csv(t.positive_int), default=[1, 32, 256], help="batch sizes to plot")
    p.add_argument("--image-size", type=t.positive_int, default=None, help="image side (default: the model's)")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.set_defaults(fn=commands.cmd_plot)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", formatter_class=t.HelpFormatter,
                       help="fused ops vs what PyTorch / HF runs for the same step (GPU)")
    p.add_argument("--op", default="linear", choices=BENCH_OPS,
                   help="linear: fused Linear layers; conv: token-embedding and depthwise conv steps; dwconv: the "
                        "depthwise conv projection + BatchNorm in training mode (see --pass); attention: fused "
                        "attention vs HF's einsum path and every SDPA backend; model: the whole swapped CvT vs HF "
                        "eager / CUDA graph / torch.compile; host: host microseconds per op call vs PyTorch's; "
                        "layernorm: LayerNorm's forward / backward vs PyTorch's (see --pass); train: ms per "
                        "training step (autocast, SGD momentum) of HF eager, torch.compile(HF), swapped and "
                        "torch.compile(swapped), peak memory, kernel calls and fallbacks")
    p.add_argument("--pass", dest="passes", type=t.csv_choices("pass", str, BENCH_PASSES), default=None,
                   help="--op linear / layernorm / attention / conv / dwconv: fwd, bwd, fwd+bwd. linear, attention "
                        "and conv with fwd alone (their default) are the inference tables; with bwd or fwd+bwd, the "
                        "training table of CvT-13's stage shapes vs torch autograd (layernorm and dwconv: default all)")
    p.add_argument("--model", type=t.model, default="cvt-13", help="whose problems")
    p.add_argument("--batch", type=t.csv(t.positive_int), default=None,
                   help="batch sizes (default: 1,256; --op train: 32,128,256)")
    p.add_argument("--image-size", type=t.csv(t.positive_int), default=None,
                   help="image size (several, comma-separated, for --op model; default: the model's)")
    p.add_argument("--providers", type=t.csv(str), default=None,
                   help="--op model: hf,hf_graph,compile,compile_ro,compile_max,swapped,swapped_graph,swapped_compile,"
                        "swapped_compile_ro (default: all but compile_max and compile_ro); --op train: hf,hf_graph,"
                        "swapped_ops,swapped,swapped_graph,swapped_ckpt,compile,swapped_compile (default: all)")
    p.add_argument("--label", default=None, help="--op host: a label for the rows (e.g. before / after)")
    p.add_argument("--breakdown", action="store_true",
                   help="--op model: GPU time by kernel category per provider; --op linear/layernorm with --pass: "
                        "the MLP's backward GEMMs one by one and LayerNorm's backward kernel vs aten's")
    p.add_argument("--dtype", type=t.csv_choices("dtype", str, DTYPES), default=None,
                   help="fp16 and/or bf16 (default: fp16; --op train: bf16, the autocast dtype)")
    p.add_argument("--path", default="auto", choices=["auto", "sm89", "sm90"], help="kernel path")
    p.add_argument("--out", default=None, help="CSV to append results to")
    p.set_defaults(fn=commands.cmd_bench)
