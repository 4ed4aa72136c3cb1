"""A swapped CvT under ``transformers.Trainer`` (the loop HF users already have): its default
AdamW and linear schedule, bf16=True. On the CPU the swapped ops run their references (counted);
on a GPU the kernels, with no fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch

from cvt_cutlass import fallback
from cvt_cutlass.graphs import ENGINE, graph_stats, reset_graph_stats
from cvt_cutlass.swap import swap

from .conftest import requires_sm80
from .test_swap import tiny_cvt

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

STAGE_GRAPHS = True  # conftest: graphs on in this module, as a user's Trainer runs the model


class Images(torch.utils.data.Dataset):
    """Random images (never zero) and labels as a HF image dataset yields them."""

    def __init__(self, n: int, size: int = 64, classes: int = 16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _train(model, out, cpu: bool, steps: int = 3):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=steps, bf16=True, use_cpu=cpu,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Images(16))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _check(tmp_path, device: str):
    hf = tiny_cvt(drop_path_rate=[0.0, 0.0, 0.0]).train().to(device)
    start = copy.deepcopy(hf)
    swapped = swap(copy.deepcopy(hf))
    fallback.reset()
    reset_graph_stats()
    logs = _train(swapped, tmp_path / "swapped", device == "cpu")
    counted = {**fallback.stats(), "stage_graphs": graph_stats()}
    ref = _train(hf, tmp_path / "hf", device == "cpu")
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert [h["learning_rate"] for h in logs] == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])  # HF's linear decay
    assert logs[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-2)  # the same first batch, before any step
    moved = [not torch.equal(a, b) for a, b in zip(swapped.parameters(), start.parameters(), strict=True)]
    assert sum(moved) > 0.9 * len(moved)
    return counted


def test_swapped_model_trains_under_hf_trainer_cpu(tmp_path):
    counted = _check(tmp_path, "cpu")
    assert sum(counted["fallbacks"].values()) > 0  # the CPU reference path, visibly


@requires_sm80
def test_swapped_model_trains_under_hf_trainer_gpu(tmp_path):
    counted = _check(tmp_path, "cuda")
    assert counted["fallbacks"] == {} and sum(counted["kernel_calls"].values()) > 0, counted
    # the first step warms each stage up, the second captures it: then every stage replays, the
    # parameters' gradients written directly (no hook on them)
    assert counted["stage_graphs"].get("replays") == 3 * 2 and ENGINE not in counted["stage_graphs"], counted
