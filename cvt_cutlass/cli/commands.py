"""What each ``cvt-cutlass`` command runs, and the checks that depend on several arguments. The
heavy modules (torch, the kernels, the tooling) are imported by the command that needs them."""

from __future__ import annotations

import sys

PASS_OPS = ("linear", "layernorm", "attention", "conv", "dwconv")  # bench ops with a --pass (training) table
# The passes each profile sweep takes.
OP_PASSES = {"linear": ("fwd", "dgrad", "wgrad"), "conv2d": ("fwd", "dgrad", "wgrad"), "dwconv": ("fwd", "train"),
             "attention": ("fwd", "bwd"), "layernorm": ("fwd",)}


def _specs(a):
    from ..api import kernels_for

    return kernels_for(a.op, a.arch, a.epilogue, a.dtype, which=a.kernels, model=a.model, batches=a.batch,
                       image_size=a.image_size)


def cmd_emit(a) -> int:
    from pathlib import Path

    from ..api import emit

    if not a.out.strip() or (Path(a.out).exists() and not Path(a.out).is_dir()):
        raise ValueError(f"--out {a.out!r}: give a directory for the sources and their headers")
    paths = emit(specs=_specs(a), out=a.out)
    for p in paths:
        print(p)
    print(f"wrote {len(paths)} kernel source(s) to {a.out}", file=sys.stderr)
    return 0


def cmd_build(a) -> int:
    from ..runtime import prebuild

    libs = prebuild(_specs(a), a.device_cc, jobs=a.jobs)
    for name, path in sorted(libs.items()):
        print(f"{name}\t{path}")
    print(f"{len(libs)} kernel(s) in the cache", file=sys.stderr)
    return 0


def cmd_profile(a) -> int:
    from ..tools.sweep.main import profile_main

    return profile_main(a)


def cmd_table(a) -> int:
    from ..tools.sweep.tables import rewrite_tables

    for path in a.profile:
        for out in rewrite_tables(path, a.table_dir, a.tolerance):
            print(f"{path} -> {out}")
    return 0


def cmd_plot(a) -> int:
    from ..tools import plots

    if a.op == "model":
        paths = plots.plot_model_bench(a.profile, a.out)
    else:
        paths = plots.plot_profile(a.profile, a.out, model=a.model, batches=a.batch, image_size=a.image_size,
                                   ceilings_csv=a.ceilings, op=a.op)
    for p in paths:
        print(p)
    return 0


def _bench_module(a) -> str:
    """The tools.bench module that serves ``bench --op ... --pass ...``."""
    if a.op in ("model", "train", "host"):
        return a.op
    if a.op in ("conv", "attention") and a.passes == ["fwd"]:
        return a.op
    if a.op in ("layernorm", "dwconv") or a.passes != ["fwd"]:
        return "passes"
    return "linear"


def cmd_bench(a) -> int:
    import importlib

    sizes = a.image_size or []
    if a.op == "model":
        a.image_size_list, a.image_size = sizes or [224], None
    else:
        a.image_size = sizes[0] if sizes else None
    return importlib.import_module(f"cvt_cutlass.tools.bench.{_bench_module(a)}").bench_main(a)


def cmd_train(a) -> int:
    from .train import train_main

    if a.steps is None and a.epochs is None:
        a.epochs = 1
    if a.cuda_graph and a.compile:
        print("cvt-cutlass train: --cuda-graph and --compile: pick one (the captured step replays the swapped "
              "model's kernels; --compile runs an eager step)", file=sys.stderr)
        return 2
    if a.batch % a.accumulate:
        print(f"cvt-cutlass train: --batch {a.batch} does not split into --accumulate {a.accumulate} equal "
              "micro-batches", file=sys.stderr)
        return 2
    return train_main(a)


def cmd_run(a) -> int:
    from .run import run_main

    return run_main(a)


def check_bench(a, p) -> None:
    """What depends on ``--op``: several image sizes and the providers are for ``--op model``."""
    if a.op != "model" and a.image_size and len(a.image_size) > 1:
        p.error(f"argument --image-size: takes one size for --op {a.op} (several only for --op model)")
    if a.passes is not None and a.op not in PASS_OPS:
        p.error(f"argument --pass: is for --op {' / '.join(PASS_OPS)}, not --op {a.op}")
    if a.passes is None:
        a.passes = ["fwd", "bwd", "fwd+bwd"] if a.op in ("layernorm", "dwconv") else ["fwd"]
    a.batch = a.batch or ([32, 128, 256] if a.op == "train" else [1, 256])
    a.dtype = a.dtype or (["bf16"] if a.op == "train" else ["fp16"])
    if a.providers and a.op not in ("model", "train"):
        p.error(f"argument --providers: is for --op model / train, not --op {a.op}")
    if a.providers:
        from ..tools.bench.model import PROVIDERS
        from ..tools.bench.train import TRAIN_PROVIDERS

        known = PROVIDERS if a.op == "model" else TRAIN_PROVIDERS
        bad = [v for v in a.providers if v not in known]
        if bad:
            p.error(f"argument --providers: unknown provider {bad[0]!r}; choose from {', '.join(known)}")


def check_profile_passes(a, p) -> None:
    bad = [x for x in a.passes if x not in OP_PASSES[a.op]]
    if bad:
        p.error(f"argument --pass: --op {a.op} sweeps {', '.join(OP_PASSES[a.op])}, not {', '.join(bad)}")
    if a.op == "attention" and len(a.passes) > 1:
        p.error("argument --pass: --op attention sweeps fwd or bwd (one at a time)")
