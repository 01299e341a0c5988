"""Synthetic length-generalization probes: copy, associative recall and passkey, generated from a seed.

Perplexity says how well a model predicts text, not whether it can *use* a token far back; these
tasks ask exactly that, and score only the answers (docs/probes.md). A sequence of n = L + 1
tokens (L inputs and their shifted targets) is written over one small vocabulary:

    PAD BOS SEP KEY FILL | S symbols | S values        (vocabulary 5 + 2 S)

- ``copy``: ``BOS s_1..s_m SEP s_1..s_m`` (+ one PAD when n is odd), m = (n - 2) // 2 symbols drawn
  uniformly; one answer, the copied s_1..s_m.
- ``recall`` (multi-query associative recall, Arora et al. 2023): ``BOS k_1 v_1 .. k_P v_P``, FILL up
  to the queries, then every key once in random order, each followed by its value, as in Zoology's
  MQAR; P = ``pairs`` distinct keys from the symbols, values from the values. P answers of one token:
  the queried values. (Queries drawn with replacement would let a repeated key copy the answer of its
  earlier query a few tokens back, which no longer measures retrieval from far back.)
- ``passkey`` (as in the YaRN repository): ``BOS FILL.. KEY d_1..d_D FILL.. SEP d_1..d_D`` with D =
  ``digits`` digits (the first 10 symbols); the passkey's depth, the share of the filler before it,
  is uniform in [0, 1]. One answer, the D digits after SEP; accuracy is also reported by depth.

Each target t (predicting token t + 1 from tokens 0..t) is labelled with the answer it belongs to
(0, 1, ...), or -1 when it is not scored; an answer's targets are consecutive. Training
sequences have lengths drawn uniformly from [shortest the task allows, L_train + 1] and PAD after
them (never scored, and after every answer, so causality keeps it out of every prediction); an
evaluation length gets sequences of exactly that length. Every sequence is a function of its seed:
training sample i of a run of seed s is drawn from (TRAIN, s, i), evaluation sample i of n tokens of
a split from (the split's stream, n, i): no evaluation sample shares a seed with a training sample.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lenext.data.loaders import evaluation_loader, step_loader
from lenext.errors import ConfigError
from lenext.positions import generator
from lenext.protocols import ACCURACY, Answers, cap_windows
from lenext.ranges import NonNegativeInt, PositiveInt, Seed
from lenext.scoring import Measured, distributed, measure_answers

PAD, BOS, SEP, KEY, FILL = range(5)
SPECIALS = 5
TASKS = ("copy", "recall", "passkey")
TRAIN = 0
SPLIT_STREAMS = {"train": 3, "validation": 1, "test": 2}  # evaluation on the train split: a stream of its own
DEPTH_BUCKETS = 5  # passkey accuracy by depth: [0, 0.2), [0.2, 0.4), ..., [0.8, 1]


@dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor  # (length,): the n tokens, then PAD
    answer: torch.Tensor  # (length - 1,): the answer each target belongs to, -1 for targets not scored
    depth: float  # passkey: the share of the filler before the passkey; NaN for other tasks


def written(tokens: list[int], starts: Iterable[int], span: int, depth: float, length: int | None) -> Sample:
    """The Sample of ``tokens``, PAD after them to ``length`` tokens (None: none): answer a covers targets starts[a] ..
    starts[a] + span - 1, every other target is -1. Written as lists and made tensors once: a training batch is
    dozens of short sequences, where torch's per-call cost would dominate."""
    length = length or len(tokens)
    answer = [-1] * (length - 1)
    for a, start in enumerate(starts):
        answer[start : start + span] = [a] * span
    return Sample(torch.tensor(tokens + [PAD] * (length - len(tokens))), torch.tensor(answer), depth)


class Task:
    """A probe: ``sample(n, gen, length)`` writes a sequence of n tokens (PAD after it up to ``length``, n by
    default) and names its answers. The random draws are torch's (the generator fixes them)."""

    name: str

    def __init__(self, symbols: int, pairs: int, digits: int):
        self.symbols, self.pairs, self.digits = symbols, pairs, digits

    @property
    def vocab_size(self) -> int:
        return SPECIALS + 2 * self.symbols

    def shortest(self) -> int:
        """The fewest tokens a sequence of this task has."""
        raise NotImplementedError

    def sample(self, n: int, gen: torch.Generator, length: int | None = None) -> Sample:
        raise NotImplementedError

    def describe(self) -> str:
        """The task and the settings it uses, in data.* keys."""
        raise NotImplementedError

    def chance(self, metric: str) -> float | None:
        """The accuracy (``exact_match``, ``token_accuracy``) of a uniform guess among the answer's symbols, at any
        length; None where it is about 0 (a whole string guessed) or no guess defines it."""
        raise NotImplementedError

    @property
    def answer_tokens(self) -> int | None:
        """The tokens of each answer (None: they vary with the length). With one, per-token accuracy is exact match."""
        raise NotImplementedError

    def symbols_of(self, count: int, gen: torch.Generator) -> list[int]:
        return [SPECIALS + s for s in torch.randint(self.symbols, (count,), generator=gen).tolist()]


class Copy(Task):
    name = "copy"

    def shortest(self) -> int:
        return 4  # BOS s SEP s

    def sample(self, n: int, gen: torch.Generator, length: int | None = None) -> Sample:
        m = (n - 2) // 2
        string = self.symbols_of(m, gen)
        tokens = [BOS, *string, SEP, *string] + [PAD] * (n - 2 - 2 * m)
        return written(tokens, [m + 1], m, math.nan, length)  # targets of tokens m+2..2m+1

    def describe(self) -> str:
        return f"copy (data.symbols={self.symbols})"

    def chance(self, metric: str) -> float | None:
        return 1 / self.symbols if metric == "token_accuracy" else None  # a string of m symbols: 1 / symbols^m

    @property
    def answer_tokens(self) -> int | None:
        return None  # half the sequence


class Recall(Task):
    name = "recall"

    def shortest(self) -> int:
        return 1 + 4 * self.pairs  # BOS, the pairs, the queries

    def sample(self, n: int, gen: torch.Generator, length: int | None = None) -> Sample:
        p = self.pairs
        keys = [SPECIALS + k for k in torch.randperm(self.symbols, generator=gen)[:p].tolist()]
        values = [SPECIALS + self.symbols + v for v in torch.randint(self.symbols, (p,), generator=gen).tolist()]
        order = torch.randperm(p, generator=gen).tolist()
        filler = n - self.shortest()
        pairs = [token for k in range(p) for token in (keys[k], values[k])]
        queries = [token for k in order for token in (keys[k], values[k])]
        tokens = [BOS, *pairs] + [FILL] * filler + queries
        first_query = 1 + 2 * p + filler
        return written(tokens, range(first_query, n - 1, 2), 1, math.nan, length)  # each query

    def describe(self) -> str:
        return f"recall (data.pairs={self.pairs}, data.symbols={self.symbols})"

    def chance(self, metric: str) -> float | None:
        # None: a model that binds no key to its value still answers by elimination (each key is queried once), and
        # what that scores depends on how it guesses among the values left (docs/probes.md), not one level.
        return None

    @property
    def answer_tokens(self) -> int | None:
        return 1  # a value


class Passkey(Task):
    name = "passkey"

    def shortest(self) -> int:
        return 3 + 2 * self.digits  # BOS KEY digits SEP digits

    def sample(self, n: int, gen: torch.Generator, length: int | None = None) -> Sample:
        filler = n - self.shortest()
        before = int(torch.randint(filler + 1, (1,), generator=gen))
        digits = [SPECIALS + d for d in torch.randint(10, (self.digits,), generator=gen).tolist()]
        tokens = [BOS] + [FILL] * before + [KEY, *digits] + [FILL] * (filler - before) + [SEP, *digits]
        return written(tokens, [n - 1 - self.digits], self.digits, before / filler if filler else 0.0, length)

    def describe(self) -> str:
        return f"passkey (data.digits={self.digits})"

    def chance(self, metric: str) -> float | None:
        whole = 0.1**self.digits  # all digits; below 0.1% (4 digits or more) about 0, as a heading shows it
        return 0.1 if metric == "token_accuracy" else (whole if whole >= 1e-3 else None)

    @property
    def answer_tokens(self) -> int | None:
        return self.digits


TASK_CLASSES = {task.name: task for task in (Copy, Recall, Passkey)}


class TrainSamples(Dataset):
    """Training sample i: a sequence of a length drawn from [the task's shortest, length], PAD after it."""

    def __init__(self, task: Task, length: int, seed: int, size: int):
        self.task, self.length, self.seed, self.size = task, length, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        gen = generator(TRAIN, self.seed, i)
        n = int(torch.randint(self.task.shortest(), self.length + 1, (1,), generator=gen))
        sample = self.task.sample(n, gen, self.length)
        return {"tokens": sample.tokens, "answer": sample.answer}


class EvaluationSamples(Dataset):
    """Sample i of a split with exactly ``n`` tokens (n - 1 inputs), with its identity for drawn positions."""

    def __init__(self, task: Task, split: str, n: int, indices: list[int]):
        self.task, self.stream, self.n, self.indices = task, SPLIT_STREAMS[split], n, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        index = self.indices[i]
        sample = self.task.sample(self.n, generator(self.stream, self.n, index))
        return {
            "tokens": sample.tokens,
            "answer": sample.answer,
            "depth": torch.tensor(sample.depth),
            "window": torch.tensor([index, 0]),
        }


class TaskEvaluation:
    """The sweep's view of a probe: ``accuracy`` rows (answers only) at every evaluation length."""

    protocols = (ACCURACY,)

    def __init__(self, task: Task, split: str, samples: int):
        self.task, self.split, self.samples = task, split, samples

    def protocol(self, name: str, plan) -> Answers:
        return Answers()

    def windows(self, protocol: Answers, length: int) -> list[int]:
        return list(range(self.samples))

    def missing(self, protocol: Answers, length: int) -> str:
        return "no samples"

    def measure(
        self, net, protocol: Answers, windows: list[int], length: int, settings, precision, scheme, seed
    ) -> Measured:
        rank, world = distributed()  # each rank its share of the samples; the metrics add them up
        samples = EvaluationSamples(self.task, self.split, length + 1, windows[rank::world])
        by_depth = DEPTH_BUCKETS if self.task.name == "passkey" else None
        batches = DataLoader(samples, batch_size=max(1, settings.tokens_per_batch // length))
        return measure_answers(net, batches, length, precision, scheme, seed, by_depth)


class SyntheticDataModule(L.LightningDataModule):
    """A probe's training stream and evaluation samples (module docstring), generated on the fly, no files."""

    protocols = TaskEvaluation.protocols

    def __init__(
        self,
        task: Literal[TASKS] = "recall",
        max_len: PositiveInt = 64,  # L_train: the longest training sequence, in input tokens
        symbols: PositiveInt = 16,  # symbols (and, for recall, values) to draw from
        pairs: PositiveInt = 8,  # recall: key-value pairs per sequence
        digits: PositiveInt = 5,  # passkey: digits of the passkey
        batch_size: PositiveInt = 32,
        eval_batch_size: PositiveInt | None = None,
        eval_samples: PositiveInt = 128,  # sequences per evaluation length (and for validation)
        train_samples: PositiveInt = 2**20,  # an epoch: training draws new sequences, never repeats within it
        num_workers: NonNegativeInt = 0,
        seed: Seed = 0,
        validation_max_windows: PositiveInt | None = None,
    ):
        super().__init__()
        if task == "recall" and pairs > symbols:
            raise ConfigError(
                f"data.pairs={pairs} is invalid: recall's keys are distinct, so at most data.symbols={symbols}"
            )
        if task == "passkey" and symbols < 10:
            raise ConfigError(f"data.symbols={symbols} is invalid: passkey's digits are the first 10 symbols, so >= 10")
        if train_samples < batch_size:
            raise ConfigError(
                f"data.train_samples={train_samples} is invalid: fewer than data.batch_size={batch_size}, an epoch "
                "would fill no batch; give data.train_samples >= data.batch_size"
            )
        self.task = TASK_CLASSES[task](symbols, pairs, digits)
        self.max_len, self.batch_size, self.eval_batch_size = max_len, batch_size, eval_batch_size or batch_size
        self.eval_samples, self.train_samples = eval_samples, train_samples
        self.num_workers, self.seed, self.validation_max_windows = num_workers, seed, validation_max_windows
        self.check_length(max_len, "data.max_len")

    tokenizer_id = None  # no tokenizer: the task writes token ids

    def trained_on(self) -> None:
        """Nothing beyond the task's settings, which the run's identity compares."""

    @property
    def name(self) -> str:
        return f"synthetic-{self.task.name}"

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    def check_length(self, length: int, key: str) -> None:
        """A ConfigError unless sequences of ``length`` inputs (length + 1 tokens) fit the task."""
        if length + 1 < self.task.shortest():
            raise ConfigError(
                f"{key}={length} is too short for {self.task.describe()}: a sequence needs "
                f"{self.task.shortest()} tokens, so {key} >= {self.task.shortest() - 1}"
            )

    def load(self) -> None:
        """Nothing to read: every sequence is generated from its seed."""

    def evaluation(self, split: str) -> TaskEvaluation:
        return TaskEvaluation(self.task, split, self.eval_samples)

    def train_windows(self) -> TrainSamples:
        """The training sequences (enough for a batch: refused in the constructor otherwise)."""
        return TrainSamples(self.task, self.max_len + 1, self.seed, self.train_samples)

    def train_dataloader(self) -> DataLoader:
        return step_loader(self.train_windows(), self.batch_size, self.seed, self.trainer, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    def _loader(self, split: str) -> DataLoader:
        """The sweep's samples at L_train: validation during training is the sweep's 1x row."""
        indices = cap_windows(list(range(self.eval_samples)), self.validation_max_windows)
        samples = EvaluationSamples(self.task, split, self.max_len + 1, indices)
        return evaluation_loader(samples, self.eval_batch_size, self.trainer, self.num_workers)
