"""Several processes training one model: ``torchrun --nproc-per-node N cvt-cutlass train ...``.

:func:`ranks_from_env` joins the process group torchrun describes (NCCL on GPUs, one GPU per
process by ``LOCAL_RANK``; gloo on the CPU), :class:`ShardedTask` gives each rank its share of a
global batch (the global batch of ``batch * world`` that one process would draw from the same
seed, cut into ``world`` contiguous parts: together the ranks see what one process sees with the
global batch), and ``cvt-cutlass train`` puts DistributedDataParallel around the
swapped model (gradients averaged over the ranks; micro-batches before the last one accumulate
under ``no_sync``: see :func:`cvt_cutlass.train.train_body`; BatchNorm normalizes with each rank's
batch statistics and DDP broadcasts rank 0's running statistics, as for HF's model; with
``--sync-bn`` over all ranks' batches). The synthetic task draws only each rank's rows; a
``--data`` folder is walked in the same order on every rank, each decoding only its share.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .data import share


class Ranks(NamedTuple):
    rank: int
    world: int
    local: int  # the process's index on its host: its GPU

    @property
    def main(self) -> bool:
        return self.rank == 0


def ranks_from_env(cuda: bool, capture: bool = False) -> Ranks | None:
    """The process group of a torchrun launch (WORLD_SIZE > 1), joined; None for one process.
    ``capture``: the step's NCCL collectives will be captured in a CUDA graph, which needs NCCL's
    asynchronous error handling off before the group starts (PyTorch's whole-network capture
    recipe for DistributedDataParallel)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch
    import torch.distributed as dist

    if capture and cuda:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:  # one GPU per process: the local rank's, or the one a launcher left visible
        local %= torch.cuda.device_count()
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), local)


class ShardedTask:
    """A task's batches split over the ranks: ``batch(b)`` is this rank's ``b`` rows (rows
    ``[rank * b, (rank + 1) * b)``) of the global batch of ``b * world`` that every rank draws
    alike (the task's generator advances the same way on every rank). A task whose ``batch``
    takes ``(part, parts)`` (:class:`.data.SyntheticTask`) draws only those rows; another is
    drawn whole and cut."""

    def __init__(self, task, ranks: Ranks):
        import inspect

        self.task, self.ranks = task, ranks
        self.classes = task.classes
        self.class_names = getattr(task, "class_names", None)
        self.drawn_in_parts = "parts" in inspect.signature(task.batch).parameters

    def batch(self, b: int):
        r, w = self.ranks.rank, self.ranks.world
        if self.drawn_in_parts:
            return self.task.batch(b * w, r, w)
        x, y = self.task.batch(b * w)
        lo, hi = share(b * w, r, w)
        return x[lo:hi].contiguous(), y[lo:hi].contiguous()

    def steps_per_epoch(self, batch: int) -> int:
        return self.task.steps_per_epoch(batch * self.ranks.world)


def ranks_agree(params, ranks: Ranks) -> bool:
    """Whether every rank holds the same parameters (a sum of each parameter's values, its min and
    max over the ranks from one all-reduce; every rank gets the answer)."""
    import torch
    import torch.distributed as dist

    sums = torch.stack([p.detach().double().sum() for p in params])
    both = torch.cat([sums, -sums])  # max of -x is -min of x: one all-reduce gives both
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool(torch.equal(both[:len(sums)], -both[len(sums):]))


def mean_over_ranks(values):
    """A tensor's mean over the ranks (one all-reduce; every rank gets it): the per-step losses
    of the ranks' equal shares average to the loss of the global batch."""
    import torch.distributed as dist

    out = values.detach().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def allreduce_ms(numel: int, device, dtype=None, reps: int = 20) -> float:
    """Median milliseconds of one all-reduce (sum) of ``numel`` random values (``dtype``, default
    fp32) over the ranks: what averaging a model's gradients in one piece costs (DDP splits it into buckets and
    overlaps them with the backward; this is the cost, not the part left exposed). CUDA events on
    a GPU, the wall clock after each call on the CPU; 3 unmeasured calls first."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    buf = torch.randn(numel, device=device, dtype=dtype or torch.float32)
    times = []
    for i in range(reps + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(buf)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            dist.all_reduce(buf)
            ms = (time.perf_counter() - t) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def finish(ranks: Ranks | None) -> None:
    """Every rank done, then the process group closed (after a normal end only: a rank that raised
    leaves the group as it is, and torchrun stops the others)."""
    if ranks is None:
        return
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
