"""The windows the model trains and is evaluated on, and their loaders: training batches in an order fixed by
(seed, step), each rank its slice, so a resumed run sees the batches an uninterrupted one would; evaluation
windows shared out evenly among the ranks."""

import os
import signal
from collections.abc import Callable

import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, Sampler

from lenext.protocols import NonOverlapping, cap_windows


class TrainWindows(Dataset):
    """Consecutive windows of ``length + 1`` tokens over one token stream (inputs + shifted targets).

    ``stream``: an array, or a ``lenext.shards.TokenStream`` (a split read from its shards)."""

    def __init__(self, stream, length: int):
        self.stream, self.length = stream, length

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.length)

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.from_numpy(self.stream[i * self.length : (i + 1) * self.length + 1].astype(np.int64))}


class StepShuffler(Sampler[int]):
    """Training order as a function of (seed, position) alone: sample t of the run is
    permutation_{t // n}[t % n], each epoch's permutation drawn from seed + epoch.

    Every iteration starts at ``start()``, the number of samples already trained (read from the
    trainer's step): a resumed run, or an epoch Lightning restarts, sees exactly the samples the
    uninterrupted run would have seen next. ``total`` samples make the whole run.
    """

    def __init__(self, n: int, seed: int, total: int, start: Callable[[], int] = lambda: 0):
        self.n, self.seed, self.total, self.start = n, seed, total, start

    def __len__(self) -> int:
        return max(0, self.total - self.start())

    def __iter__(self):
        epoch, permutation = None, None
        for t in range(self.start(), self.total):
            if t // self.n != epoch:
                epoch = t // self.n
                permutation = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            yield int(permutation[t % self.n])


class _RankSlice(Sampler[int]):
    """Rank r's share of each global batch of ``batch_size * world`` samples from ``sampler``."""

    def __init__(self, sampler: Sampler[int], batch_size: int, world: int, rank: int):
        self.sampler, self.batch_size, self.world, self.rank = sampler, batch_size, world, rank

    def __len__(self) -> int:
        return len(self.sampler) // (self.batch_size * self.world) * self.batch_size

    def __iter__(self):
        per_step = self.batch_size * self.world
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == per_step:
                yield from batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                batch = []


def step_loader(samples: Dataset, batch_size: int, seed: int, trainer, num_workers: int) -> DataLoader:
    """Training batches in the order ``StepShuffler`` fixes, each rank its slice of every global batch, resumed
    at the trainer's step; ``trainer.max_steps`` optimizer steps of ``accumulate_grad_batches`` batches each (or
    one pass over ``samples`` when unset)."""
    accumulate = trainer.accumulate_grad_batches if trainer else 1
    batches = trainer.max_steps * accumulate if trainer and trainer.max_steps > 0 else len(samples) // batch_size
    world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    per_batch = batch_size * world  # one batch of every rank
    done = (lambda: trainer.global_step * accumulate * per_batch) if trainer else (lambda: 0)
    sampler = StepShuffler(len(samples), seed, batches * per_batch, start=done)
    indices = _RankSlice(sampler, batch_size, world, rank)
    return StepLoader(
        samples,
        batch_size=batch_size,
        sampler=indices,
        num_workers=num_workers,
        drop_last=True,
        worker_init_fn=worker_ignores_stop_signals,
        # Each iterator draws its workers' seed: from here, not from the global state dropout draws from, so a
        # resumed run, whose loader Lightning makes again after its first validation, draws the same masks.
        generator=torch.Generator().manual_seed(seed),
    )


def worker_ignores_stop_signals(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT, which scancel and Ctrl-C send to the whole process group: killed,
    it would take the main process's stop at the step boundary, and its checkpoint, with it. The main process ends
    its workers. Then Lightning's worker seeding, which it adds only to a loader without a worker_init_fn."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":  # seed_everything(workers=True)
        pl_worker_init_function(worker_id)


class StepLoader(DataLoader):
    """The training DataLoader of ``step_loader``: its order is a function of the trainer's step, so a resumed run
    continues it with nothing to restore. It says so to Lightning, which otherwise warns that it cannot resume."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DocumentWindows(Dataset):
    """The windows of the ``nonoverlap`` protocol at ``length``, as token tensors of ``length + 1`` and their identity.

    Window w of a document covers tokens [w L, w L + L]: consecutive windows share one token, so
    every token after the document's first is a target exactly once; a tail shorter than L is left out.
    With ``max_windows``, the same evenly spread subset the length sweep scores: validation during
    training and the sweep's nonoverlap row at L_train are one measurement.
    """

    def __init__(self, documents: list[np.ndarray], length: int, max_windows: int | None = None):
        self.documents, self.length = documents, length
        windows = NonOverlapping().windows([len(d) for d in documents], length)
        self.windows = cap_windows(windows, max_windows)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        """``tokens`` (L + 1,) and ``window`` (document, first token), which identifies the window."""
        window = self.windows[i]
        tokens = self.documents[window.document][window.start : window.start + self.length + 1]
        return {
            "tokens": torch.from_numpy(tokens.astype(np.int64)),
            "window": torch.tensor([window.document, window.start]),
        }


class EqualShares(Dataset):
    """``samples`` followed by repeats of them marked ``counted: False``, up to ``length``."""

    def __init__(self, samples: Dataset, length: int):
        self.samples, self.length = samples, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return {**self.samples[i % len(self.samples)], "counted": torch.tensor(i < len(self.samples))}


def evaluation_loader(samples: Dataset, batch_size: int, trainer, num_workers: int) -> DataLoader:
    """Each rank its own share of ``samples`` (the metrics add the shares up: each sample counts once). The shares
    are padded to one length with repeats that are scored but not counted: under FSDP every forward gathers the
    parameters from all ranks, so every rank must run as many batches."""
    rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
    padded = EqualShares(samples, -(-len(samples) // world) * world)
    return DataLoader(
        padded,
        batch_size=batch_size,
        sampler=range(rank, len(padded), world),
        num_workers=num_workers,
        worker_init_fn=worker_ignores_stop_signals,
    )
