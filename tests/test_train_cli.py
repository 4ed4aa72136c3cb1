"""`cvt-cutlass train` and `bench --op train`: the data, precision and step helpers, the CPU
reference path end to end (synthetic task and an ImageFolder of tensors), the checkpoint it writes,
argument errors; on a GPU a short training benchmark of every provider."""

from __future__ import annotations

import csv
import math
import re

import numpy as np
import pytest
import torch

from cvt_cutlass.cli import main
from cvt_cutlass.train import ImageFolderTask, SyntheticTask, fit_classifier, make_step, precision_of

from .conftest import requires_sm80


def test_synthetic_task_is_seeded_and_learnable():
    a, b = SyntheticTask(4, 32, "cpu", seed=1), SyntheticTask(4, 32, "cpu", seed=1)
    (xa, ya), (xb, yb) = a.batch(64), b.batch(64)
    assert xa.shape == (64, 3, 32, 32) and torch.equal(xa, xb) and torch.equal(ya, yb)
    # the class pattern is in the images: the nearest template recovers most labels
    d = ((xa[:, None] - a.templates[None]) ** 2).flatten(2).sum(-1)
    assert (d.argmin(1) == ya).float().mean() > 0.9
    assert not torch.equal(a.batch(8)[0], xa[:8])  # the stream moves on


def _npy_folder(root, classes=("cat", "dog", "emu"), per_class=3, size=20):
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            np.save(root / c / f"{i}.npy", rng.standard_normal((3, size, size)).astype(np.float32))
    (root / "cat" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_task(tmp_path):
    task = ImageFolderTask(_npy_folder(tmp_path / "data"), 16, "cpu")
    assert task.class_names == ["cat", "dog", "emu"] and task.classes == 3 and len(task.files) == 9
    assert task.steps_per_epoch(4) == 3
    x, y = task.batch(9)  # one epoch: every file once
    assert x.shape == (9, 3, 16, 16) and sorted(y.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="at least 2 class folders"):
        ImageFolderTask(tmp_path / "data" / "cat", 16, "cpu")
    with pytest.raises(ValueError, match="not a directory"):
        ImageFolderTask(tmp_path / "missing", 16, "cpu")
    np.save(tmp_path / "data" / "dog" / "bad.npy", np.zeros((1, 4, 4), np.float32))
    bad = ImageFolderTask(tmp_path / "data", 16, "cpu")
    with pytest.raises(ValueError, match="not a 3-channel image"):
        bad._load(next(i for i, (f, _) in enumerate(bad.files) if f.name == "bad.npy"))


def test_precision_choices():
    assert precision_of("fp32", None, cuda=True).amp is torch.bfloat16
    assert precision_of("fp32", None, cuda=False).amp is None
    p = precision_of("fp32", "fp16", cuda=True)
    assert p.param is torch.float32 and p.scaler_needed
    assert precision_of("bf16", None, cuda=True) == precision_of("bf16", "none", cuda=True)
    with pytest.raises(ValueError, match="for fp32 master weights"):
        precision_of("bf16", "fp16", cuda=True)


def test_fit_classifier_and_one_step_moves_the_weights():
    from cvt_cutlass.checkpoint import random_cvt as build_model

    model = build_model("cvt-13").train()
    fit_classifier(model, 3, ["a", "b", "c"])
    assert model.classifier.out_features == 3 and model.config.id2label == {0: "a", 1: "b", 2: "c"}
    w0 = model.classifier.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = make_step(model, opt, precision_of("fp32", "none", cuda=False), "cpu")
    loss = step(torch.randn(2, 3, 64, 64), torch.tensor([0, 2]))
    assert loss.dim() == 0 and torch.isfinite(loss) and not torch.equal(w0, model.classifier.weight)


def test_train_cpu_reference_path_writes_a_hf_checkpoint(tmp_path, capsys, monkeypatch):
    from transformers import CvtForImageClassification

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, on any machine

    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(_npy_folder(tmp_path / "data")), "--image-size", "64", "--batch", "2",
                 "--steps", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU is visible" in text and "3 steps of batch 2" in text and "checkpoint (HF format)" in text
    back = CvtForImageClassification.from_pretrained(out)
    assert back.classifier.out_features == 3 and back.config.id2label[2] == "emu"


def test_train_residual_stream_option_reaches_the_swap(tmp_path, capsys, monkeypatch):
    """--residual-stream compute swaps with swap(residual_stream="compute"); the default is "fp32"
    (HF's autocast numerics)."""
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module("cvt_cutlass.swap")
    seen, real = [], module.swap

    def spy(model, **kw):
        seen.append(kw.get("residual_stream"))
        return real(model, **kw)

    monkeypatch.setattr(module, "swap", spy)
    for extra in ([], ["--residual-stream", "compute"]):
        assert main(["train", "--image-size", "64", "--batch", "2", "--steps", "1", "--out",
                     str(tmp_path / "ck"), *extra]) == 0
    assert seen == ["fp32", "compute"]
    capsys.readouterr()


def test_captured_step_refuses_a_grad_scaler_without_a_fused_optimizer():
    from cvt_cutlass.train import make_captured_step

    with pytest.raises(ValueError, match="GradScaler.*fused=True"):
        make_captured_step(None, None, precision_of("fp32", "fp16", cuda=True), torch.zeros(1), torch.zeros(1))


def test_train_arguments(capsys):
    from .test_cli import _usage_error

    line = _usage_error(capsys, ["train", "--steps", "3", "--epochs", "1"])
    assert "not allowed with argument" in line
    line = _usage_error(capsys, ["train", "--lr", "0"])
    assert "--lr" in line and "expected a number > 0" in line
    line = _usage_error(capsys, ["bench", "--op", "train", "--providers", "hf,compile_ro"])
    assert "'compile_ro'" in line and "swapped_compile" in line


def test_train_refuses_before_training_what_it_would_fail_on_or_ignore(tmp_path, capsys):
    """--out naming a file (the checkpoint is written after the steps), --warmup-steps without the
    cosine schedule (ignored otherwise), one class of the synthetic task: status 2, one line."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, said in ((["--out", str(afile)], "is a file"), (["--warmup-steps", "5"], "--schedule cosine"),
                       (["--classes", "1"], "at least 2 classes")):
        assert main(["train", "--steps", "1", "--batch", "2", "--image-size", "32", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0] and "Traceback" not in err[0], err
    assert afile.read_text() == "x"


def test_step_options_and_precision_names_are_checked():
    from cvt_cutlass.train import StepOptions

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="micro-batches"):
            StepOptions(accumulate=bad)
    with pytest.raises(ValueError, match="clip_norm"):
        StepOptions(clip_norm=0.0)
    for dtype, amp in (("fp8", None), ("fp32", "fp8")):
        with pytest.raises(ValueError, match="--dtype is one of fp32, bf16, fp16"):
            precision_of(dtype, amp, cuda=False)


def test_bench_train_needs_a_gpu_and_plots_its_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--op", "train"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    rows = [{"date": "2026-11-23", "gpu": "Test GPU", "torch": "2.13", "model": "cvt-13", "image_size": "224",
             "op": "train", "provider": p, "dtype": "bf16", "batch": str(b), "img_per_s": str(v * b)}
            for p, v in (("hf", 10), ("swapped", 30)) for b in (32, 128)]
    path = tmp_path / "train.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main(["plot", "--op", "model", "--profile", str(path), "--out", str(tmp_path / "png")]) == 0
    assert (tmp_path / "png" / "train_cvt-13_bf16.png").is_file()


@requires_sm80
def test_bench_train_providers_gpu():
    """The eager and captured providers train a few steps (the compiled ones are the benchmark's: a
    minute of compilation each); the swapped model counts its kernel calls."""
    from cvt_cutlass.checkpoint import random_cvt as build_model
    from cvt_cutlass.tools.bench.train import measure_provider

    base = build_model("cvt-13").train()
    x, y = torch.randn(4, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (4,), device="cuda")
    prec = precision_of("fp32", "bf16", cuda=True)
    launches = {}
    for prov in ("hf", "swapped_ops", "swapped", "swapped_graph"):
        r = measure_provider(base, prov, prec, x, y)
        assert r["ms_per_step"] > 0 and r["peak_gib"] > 0 and r["host_ms"] > 0 and r["gpu_kernel_ms"] > 0
        assert 0 < r["gpu_busy_ms"] <= r["gpu_kernel_ms"] * 1.0001  # overlapping kernels count once
        assert 0 < r["ms_per_step_pipelined"] < 1.5 * r["ms_per_step"]  # no wait per step: not slower
        assert r["gpu_kernels_per_step"] > 100  # a graph's kernels are recorded too
        launches[prov] = r["launches_per_step"]
        if prov == "swapped":
            assert r["kernel_calls_fwd"] > 0
    assert launches["swapped_graph"] <= 8 < 100 < launches["swapped"], launches  # graph, batch copies, loss copy
    assert launches["swapped"] <= launches["swapped_ops"], launches  # the layer op: the same kernels, from C++


def test_count_events_of_a_profile():
    """Host launch calls, GPU kernels and their time, from profiler records (memcpy / memset on the
    GPU are not kernels; a graph launch is a launch)."""
    from types import SimpleNamespace as Ev

    from torch.autograd import DeviceType

    from cvt_cutlass.tools.timing import count_events

    def ev(name, dev, us=1.0):
        return Ev(name=name, device_type=dev, time_range=Ev(elapsed_us=lambda: us))

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [ev("cudaLaunchKernel", cpu), ev("cudaGraphLaunch", cpu), ev("cuLaunchKernelEx", cpu),
              ev("aten::mm", cpu), ev("gemm", gpu, 10.0), ev("Memset (Device)", gpu, 2.0), ev("ln", gpu, 4.0)]
    assert count_events(events) == (3, 2, 14.0)


def test_busy_time_counts_overlapping_records_once():
    """The GPU's busy time is the union of its kernels' intervals, per device: kernels that overlap
    (a side stream, a kernel started early by programmatic dependent launch) count once, gaps not
    at all; CPU records and copies are not kernel time (as in count_events' sum)."""
    from types import SimpleNamespace as Ev

    from torch.autograd import DeviceType

    from cvt_cutlass.tools.timing import busy_us

    def ev(a, b, dev=DeviceType.CUDA, index=0, name="k"):
        return Ev(name=name, device_type=dev, device_index=index, time_range=Ev(start=a, end=b))

    events = [ev(0, 10), ev(5, 12), ev(20, 25), ev(21, 22), ev(30, 31, DeviceType.CPU), ev(0, 4, index=1),
              ev(40, 50, name="Memcpy DtoD (Device -> Device)")]
    assert busy_us(events) == 12 + 5 + 4
    assert busy_us([]) == 0.0


def test_train_cuda_graph_arguments(capsys):
    from .test_cli import _usage_error

    assert main(["train", "--cuda-graph", "--compile"]) == 2
    assert "pick one" in capsys.readouterr().err
    assert main(["train", "--batch", "6", "--accumulate", "4"]) == 2
    assert "does not split into --accumulate 4" in capsys.readouterr().err
    for bad in (["--warmup-steps", "-1"], ["--clip-norm", "0"], ["--accumulate", "0"], ["--schedule", "step"]):
        assert _usage_error(capsys, ["train", *bad])


@requires_sm80
def test_train_cuda_graph_trains_as_eager_gpu(tmp_path, capsys):
    """``--cuda-graph``: 3 eager warm-up steps, then replays; zero fallbacks, and the weights move
    as the eager run's do (the drop-path draws differ inside a graph: compared by direction)."""
    from transformers import CvtForImageClassification

    from cvt_cutlass.checkpoint import random_cvt as build_model
    from cvt_cutlass.train import fit_classifier

    args = ["train", "--steps", "8", "--batch", "8", "--classes", "10"]  # 10: the padded classifier
    assert main(args + ["--no-cuda-graph", "--out", str(tmp_path / "eager")]) == 0
    capsys.readouterr()
    assert main(args + ["--cuda-graph", "--out", str(tmp_path / "graph")]) == 0
    out = capsys.readouterr().out
    assert "the step in a CUDA graph" in out and " 0 fallbacks" in out, out
    p0 = build_model("cvt-13")
    fit_classifier(p0, 10)
    eager, graph = (CvtForImageClassification.from_pretrained(tmp_path / d) for d in ("eager", "graph"))
    d_e, d_g = (torch.cat([(p - q).flatten() for p, q in zip(m.parameters(), p0.parameters(), strict=True)])
                for m in (eager, graph))
    assert d_g.norm() > 0 and torch.nn.functional.cosine_similarity(d_e, d_g, dim=0) > 0.9


class ImageFolderLike:
    classes = 3

    def batch(self, b: int):
        return torch.zeros(b, 3, 4, 4), torch.arange(b)


def test_sharded_task_partitions_the_global_batch(tmp_path):
    """Each rank's contiguous share of the global batch one process draws from the same seed (the
    synthetic task draws only that share; other tasks are drawn whole and cut), an epoch counts
    global batches."""
    from cvt_cutlass.train import Ranks, ShardedTask

    for b, world in ((2, 3), (24, 2), (7, 5)):  # shares inside one noise block, whole blocks, across blocks
        one = SyntheticTask(5, 16, "cpu", seed=3)
        (x, y), (x2, y2) = one.batch(b * world), one.batch(b * world)
        tasks = [ShardedTask(SyntheticTask(5, 16, "cpu", seed=3), Ranks(r, world, r)) for r in range(world)]
        assert all(t.drawn_in_parts for t in tasks)
        for r, t in enumerate(tasks):
            for (xs, ys), xg, yg in ((t.batch(b), x, y), (t.batch(b), x2, y2)):  # two steps
                assert xs.shape == (b, 3, 16, 16) and xs.is_contiguous()
                assert torch.equal(xs, xg[r * b:(r + 1) * b]) and torch.equal(ys, yg[r * b:(r + 1) * b])
    folder = _npy_folder(tmp_path / "data")  # files: every rank walks one order, decodes its share
    whole = ImageFolderTask(folder, 16, "cpu", seed=5)
    shares = [ShardedTask(ImageFolderTask(folder, 16, "cpu", seed=5), Ranks(r, 2, r)) for r in range(2)]
    for _ in range(3):  # across an epoch's end
        x, y = whole.batch(4)
        got = [t.batch(2) for t in shares]
        assert torch.equal(torch.cat([g[0] for g in got]), x) and torch.equal(torch.cat([g[1] for g in got]), y)
    assert all(t.drawn_in_parts for t in shares) and len(shares[0].task._cache) < len(whole._cache)
    gathered = ShardedTask(ImageFolderLike(), Ranks(1, 2, 1))  # a task drawn whole and cut
    assert not gathered.drawn_in_parts and torch.equal(gathered.batch(3)[1], torch.arange(3, 6))
    with pytest.raises(ValueError, match="equal parts"):
        SyntheticTask(5, 16, "cpu").batch(7, 0, 2)
    class Epochs(SyntheticTask):
        def steps_per_epoch(self, batch: int) -> int:
            return 960 // batch

    task = ShardedTask(Epochs(5, 16, "cpu"), Ranks(0, 4, 0))
    assert task.classes == 5 and task.steps_per_epoch(8) == 30  # global batches of 32


def test_accumulated_micro_batches_skip_the_all_reduce_but_the_last():
    """train_body runs the micro-batches before the last under a DDP model's no_sync."""
    from types import SimpleNamespace

    from cvt_cutlass.train import StepOptions, train_body

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.synced = torch.nn.Linear(4, 3), []
            self._quiet = False

        def forward(self, x):
            self.synced.append(not self._quiet)
            return SimpleNamespace(logits=self.lin(x))

        def no_sync(self):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                self._quiet = True
                yield
                self._quiet = False
            return ctx()

    m = Model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    train_body(m, opt, precision_of("fp32", "none", False), None, torch.randn(6, 4), torch.tensor([0, 1, 2] * 2),
               StepOptions(accumulate=3))
    assert m.synced == [False, False, True]


def test_train_under_torchrun_with_two_cpu_processes(tmp_path):
    """torchrun --nproc-per-node 2 cvt-cutlass train on the CPU (gloo): DDP over the two processes
    with their shares of the global batch (their parameters equal at the end, checked by the run
    itself), one description and one summary (rank 0), rank 0's checkpoint."""
    import os
    import subprocess
    import sys

    from transformers import CvtForImageClassification

    out = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "cvt_cutlass.cli", "train", "--data", str(_npy_folder(tmp_path / "data")), "--image-size", "64",
           "--batch", "2", "--accumulate", "2", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("x 2 processes (DDP, global batch 4)") == 1, r.stdout
    assert r.stdout.count("checkpoint (HF format)") == 1 and "the mean over 2 ranks" in r.stdout
    assert "parameters equal on all 2 ranks: yes" in r.stdout  # DDP kept the ranks' models one
    assert re.search(r"one all-reduce of the whole gradient \(\d+\.\d M float32 values, \d+ MiB\) over 2 ranks: "
                     r"\d+\.\d\d ms", r.stdout), r.stdout
    rows = (out / "train_losses.csv").read_text().split()
    assert rows[0] == "step,loss" and len(rows) == 3 and all(math.isfinite(float(x.split(",")[1])) for x in rows[1:])
    assert CvtForImageClassification.from_pretrained(out).classifier.out_features == 3


def test_train_no_swap_trains_hf_modules(tmp_path, capsys, monkeypatch):
    """--no-swap trains HF's model as it is (no fused stage runs: no CUTLASS op is called), the
    peer of a comparison."""
    from cvt_cutlass import fallback

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fallback.reset()
    assert main(["train", "--no-swap", "--image-size", "64", "--batch", "2", "--steps", "2",
                 "--out", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "not swapped" in text and "0 CUTLASS kernel calls, 0 fallbacks" in text
