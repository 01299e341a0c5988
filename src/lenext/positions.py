"""The positions a sequence's tokens get: 0..L-1, or positions drawn so that training reaches beyond L_train.

- ``sequential``: 0..L-1, the standard.
- ``randomized`` (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length Generalization of
  Transformers"): each sequence of L tokens gets L distinct positions drawn uniformly from [0, N) and
  sorted, N = ``max_position``; the PE sees positions up to N - 1 in training. Evaluation draws the
  same way (as the paper does), so an evaluation length must be at most N.
- ``pose`` (Zhu et al. 2023, "PoSE: Efficient Context Window Extension of LLMs via Positional
  Skip-wise Training"): the training window of L_c tokens is cut into ``chunks`` chunks at random
  points; chunk c's positions are contiguous and shifted by a skip u_c, with u_0 = 0 and u_c drawn
  uniformly from [u_{c-1}, L_t - L_c], so the last position is below the target length L_t =
  ``target_len``. The tokens stay one contiguous window (the paper finds the content's continuity
  does not matter). Evaluation uses 0..L-1, the positions PoSE prepares the model for.

Draws are seeded by what identifies them (run seed, step, rank; or the evaluated window), so a
resumed run and every evaluation of a window see the same positions.
"""

from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch

from lenext.errors import ConfigError
from lenext.ranges import PositiveInt, Range

SCHEMES = ("sequential", "randomized", "pose")
DEFAULT_REACH = 32  # null max_position / target_len: 32 x L_train, the longest default evaluation length


@dataclass(frozen=True)
class TrainPositions:
    """configs/train.yaml's ``train`` node: the positions training sequences get."""

    positions: Literal[SCHEMES] = "sequential"
    max_position: PositiveInt | None = None  # randomized: positions drawn from [0, N); null: 32 x L_train
    target_len: PositiveInt | None = None  # pose: positions reach target_len - 1; null: 32 x L_train
    chunks: Annotated[int, Range(2)] = 2  # pose: chunks of the training window

    OWN_SETTINGS = {"max_position": "randomized", "target_len": "pose", "chunks": "pose"}  # key -> the scheme using it


def generator(*identity: int) -> torch.Generator:
    """A CPU generator seeded by the integers that identify a draw (run seed, stream, step, ...)."""
    seed = np.random.SeedSequence([int(i) for i in identity]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(seed))


def randomized_positions(batch: int, length: int, max_position: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, length): per row, ``length`` distinct positions uniform in [0, max_position), increasing."""
    # The indices of the ``length`` largest of N uniform numbers: a uniform subset.
    chosen = torch.rand(batch, max_position, generator=gen).topk(length, dim=-1, sorted=False).indices
    return chosen.sort(dim=-1).values


def pose_positions(batch: int, length: int, target_len: int, chunks: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, length): PoSE's positions, ``chunks`` contiguous runs separated by random skips, last < target_len."""
    cuts = torch.rand(batch, length - 1, generator=gen).topk(chunks - 1, dim=-1).indices.sort(-1).values + 1
    slack = target_len - length  # the total skip
    skips = torch.zeros(batch, chunks, dtype=torch.long)
    for c in range(1, chunks):  # u_c uniform in [u_{c-1}, slack]
        room = slack - skips[:, c - 1] + 1
        skips[:, c] = skips[:, c - 1] + (torch.rand(batch, generator=gen) * room).long().clamp(max=room - 1)
    chunk = (torch.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1)  # (batch, length): chunk of each token
    return torch.arange(length) + skips.gather(1, chunk)


class PositionScheme:
    """How a run places its tokens: ``training`` for a training batch, ``evaluation`` for evaluated
    windows. None: positions 0..L-1 (the decoder's default, with no tensor to build)."""

    name = "sequential"
    evaluated_at = "sequential"  # the positions ``evaluation`` gives
    reach: int | None = None  # the positions training reaches (0..reach-1), when beyond L_train

    def span(self, train_len: int) -> int:
        """The span of positions training reaches: ``reach``, or L_train."""
        return self.reach or train_len

    def training(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor | None:
        return None

    def evaluation(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor | None:
        return None

    def check_evaluation_length(self, length: int) -> None:
        """Raises ConfigError if windows of ``length`` tokens cannot be evaluated with these positions."""

    def evaluation_span(self, length: int) -> int:
        """The most positions ``evaluation`` spans for windows of ``length`` tokens (0..span-1)."""
        return length


class Randomized(PositionScheme):
    name = evaluated_at = "randomized"

    def __init__(self, max_position: int, train_len: int):
        if max_position < train_len:
            raise ConfigError(
                f"train.max_position={max_position} is invalid: it must be at least data.max_len={train_len}"
            )
        self.reach = max_position

    def training(self, batch, length, gen):
        return randomized_positions(batch, length, self.reach, gen)

    evaluation = training  # as the paper evaluates

    def evaluation_span(self, length):
        return self.reach

    def check_evaluation_length(self, length):
        if length > self.reach:
            raise ConfigError(
                f"train.max_position={self.reach} is invalid for this evaluation: randomized positions evaluate "
                f"{length} tokens with positions drawn from [0, train.max_position); it must be at least the longest "
                "evaluation length (or evaluate with eval.positions=sequential)"
            )


class PoSE(PositionScheme):
    name = "pose"

    def __init__(self, target_len: int, chunks: int, train_len: int):
        if target_len < train_len:
            raise ConfigError(f"train.target_len={target_len} is invalid: it must be at least data.max_len={train_len}")
        if chunks > train_len:
            raise ConfigError(f"train.chunks={chunks} is invalid: it must be at most data.max_len={train_len}")
        self.reach, self.chunks = target_len, chunks

    def training(self, batch, length, gen):
        return pose_positions(batch, length, self.reach, self.chunks, gen)


TRAINING, EVALUATION = 0, 1  # the two streams of draws: never the same positions by accident


def training_positions(scheme: PositionScheme, batch: int, length: int, seed: int, rank: int, step: int, micro: int):
    """A training batch's positions (or None: 0..L-1), the same for the same run seed, rank, optimizer
    step and micro-batch within it: a resumed run draws what the uninterrupted one would have."""
    return scheme.training(batch, length, generator(seed, TRAINING, rank, step, micro))


def window_positions(scheme: PositionScheme, length: int, seed: int, windows: list[tuple[int, int]]):
    """(len(windows), length) positions of evaluated windows (document, first token), or None: 0..L-1.

    Each window's draw depends on the window alone, so validation during training and the sweep's
    row at L_train score one window with the same positions however they batch it.
    """
    if scheme.evaluated_at == "sequential":
        return None
    return torch.cat([scheme.evaluation(1, length, generator(seed, EVALUATION, length, *window)) for window in windows])


def position_scheme(settings: dict | None, train_len: int) -> PositionScheme:
    """The scheme of a run's ``train`` node (absent in checkpoints from before it existed: sequential)."""
    settings = TrainPositions(**(settings or {}))
    if settings.positions == "randomized":
        return Randomized(settings.max_position or DEFAULT_REACH * train_len, train_len)
    if settings.positions == "pose":
        return PoSE(settings.target_len or DEFAULT_REACH * train_len, settings.chunks, train_len)
    return PositionScheme()
