"""Scoring: the NLL of a batch's scored targets (training, validation and every sweep), text windows' mean NLL,
and a probe's answers."""

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torchmetrics import MeanMetric, MetricCollection, SumMetric

from lenext.hardware import precision_autocast
from lenext.positions import PositionScheme, window_positions


def distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Float64Inputs:
    """A torchmetrics aggregator that stays float64 when moved: ``Metric._apply`` (any ``.to(device)``, Lightning's
    move of a module) resets the metric's dtype to float32, and ``update`` then rounds each value and weight to
    float32 before adding it to the float64 states (torchmetrics 1.9)."""

    def _apply(self, fn, exclude_state=""):
        moved = super()._apply(fn, exclude_state)
        moved._dtype = torch.float64
        return moved


class Float64Mean(Float64Inputs, MeanMetric):
    pass


class Float64Sum(Float64Inputs, SumMetric):
    pass


def mean_metric() -> MeanMetric:
    """A weighted mean in float64 that keeps NaN: torchmetrics' default drops NaN values with a warning, so a
    diverged model's NaN losses would leave the mean of its other tokens, reported as all of them. A NaN is imputed
    as NaN (its "disable" would drop the weights too: torchmetrics 1.9). Its states default to float32, whose
    weights count exactly only to 2^24 tokens."""
    return Float64Mean(nan_strategy=float("nan")).set_dtype(torch.float64)


def sum_metric() -> SumMetric:
    """A sum in float64: torchmetrics' float32 state counts tokens exactly only to 2^24 (16.7M)."""
    return Float64Sum().set_dtype(torch.float64)


@torch.no_grad()
def window_nll(
    net,
    documents: list[np.ndarray],
    windows: list,  # lenext.protocols.Window
    length: int,
    tokens_per_batch: int,
    precision: str = "32-true",
    scheme: PositionScheme | None = None,
    seed: int = 0,
):
    """Yields (a batch of ``windows``, the NLL of each of their L targets (B, L) float64), at the positions
    ``scheme`` draws for each window (seeded by the run's ``seed``; 0..L-1 by default)."""
    device = next(net.parameters()).device
    batch = max(1, tokens_per_batch // length)
    autocast = precision_autocast(device, precision)
    for b in range(0, len(windows), batch):
        group = windows[b : b + batch]
        ids = np.stack([documents[w.document][w.start : w.start + length + 1] for w in group]).astype(np.int64)
        ids = torch.from_numpy(ids).to(device)
        drawn = window_positions(scheme or PositionScheme(), length, seed, [(w.document, w.start) for w in group])
        with autocast:
            nll = net.token_nll(ids[:, :-1], ids[:, 1:], None if drawn is None else drawn.to(device))
        yield group, nll.double()


@torch.no_grad()
def evaluate_length(
    net,
    documents: list[np.ndarray],
    windows: list,  # lenext.protocols.Window
    length: int,
    tokens_per_batch: int,
    per_position: bool,
    precision: str = "32-true",
    scheme: PositionScheme | None = None,
    seed: int = 0,
) -> dict:
    """Mean NLL over the scored targets of ``windows`` (``window_nll``); DDP ranks split windows, each token
    counted once."""
    device = next(net.parameters()).device
    rank, world = distributed()
    nll_mean, tokens = mean_metric().to(device), sum_metric().to(device)
    position_sum = torch.zeros(length, dtype=torch.float64, device=device)
    position_count = torch.zeros(length, dtype=torch.float64, device=device)
    mine = windows[rank::world]
    for group, nll in window_nll(net, documents, mine, length, tokens_per_batch, precision, scheme, seed):
        scored = (
            torch.arange(length, device=device)[None, :]
            >= torch.tensor([w.score_from for w in group], device=device)[:, None]
        )
        count = sum(length - w.score_from for w in group)  # an int: torchmetrics writes into a NaN's weight tensor
        nll_mean.update(nll[scored].sum() / count, weight=count)
        tokens.update(count)
        if per_position:
            position_sum += (nll * scored).sum(0)
            position_count += scored.sum(0)
    if world > 1:
        torch.distributed.all_reduce(position_sum)
        torch.distributed.all_reduce(position_count)
    n_tokens = int(tokens.compute().item())
    mean_nll = float(nll_mean.compute().item()) if n_tokens else float("nan")
    curve = (position_sum / position_count.clamp(min=1)).tolist() if per_position else None
    return {"mean_nll": mean_nll, "tokens": n_tokens, "curve": curve, "curve_counts": position_count.tolist()}


def scored_targets(net, batch: dict, positions: torch.Tensor | None = None, predictions: bool = False):
    """NLL of the scored targets of ``batch`` at ``positions`` (B or 1, L; None: 0..L-1): every target of a text
    window, (B, L); a probe's answers alone (those its ``answer`` labels (B, L) do not mark -1), flattened in order
    (S,). With ``predictions``, (nll, the most likely tokens, the targets), each of that shape. Training, validation
    and the probes' sweep all score through here."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if positions is not None:
        positions = positions.to(tokens.device)
    per_target = net.token_nll(inputs, targets, positions, predictions=predictions)
    nll, predicted = per_target if predictions else (per_target, None)
    if "answer" in batch:
        scored = batch["answer"] >= 0
        nll, targets = nll[scored], targets[scored]
        predicted = predicted[scored] if predictions else None
    return (nll, predicted, targets) if predictions else nll


def answers_per_sample(answer: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(answers of each sample (B,), tokens per answer) from a batch's ``answer`` labels (B, L): at one evaluation
    length every answer of a task is equally long, so the scored targets reshape to (answers, answer length)."""
    per_sample = answer.max(dim=1).values + 1
    return per_sample, int((answer >= 0).sum()) // int(per_sample.sum())


class AnswerMetrics(MetricCollection):
    """Exact match of whole answers and per-token accuracy, each a float64 mean (torchmetrics' classification metrics
    compute theirs in float32: 73 tokens of 480 right came out 0.15208333730697632), updated with (predicted,
    targets), each (answers, answer length)."""

    def __init__(self):
        super().__init__({"exact_match": mean_metric(), "token_accuracy": mean_metric()}, compute_groups=False)

    def update(self, predicted: torch.Tensor, targets: torch.Tensor) -> None:
        for name, values in self.scored(predicted, targets).items():
            self[name].update(values)

    def forward(self, predicted: torch.Tensor, targets: torch.Tensor) -> dict:
        """The batch's values, accumulated as ``update`` does (torchmetrics' ``forward``)."""
        return {name: self[name](values) for name, values in self.scored(predicted, targets).items()}

    @staticmethod
    def scored(predicted: torch.Tensor, targets: torch.Tensor) -> dict:
        correct = (predicted == targets).double()
        return {"exact_match": correct.amin(-1), "token_accuracy": correct}  # an answer: every token of it right


@torch.no_grad()
def measure_answers(
    net,
    batches,
    length: int,
    precision: str = "32-true",
    scheme: PositionScheme | None = None,
    seed: int = 0,
    depth_buckets: int | None = None,
) -> "Measured":
    """``AnswerMetrics``, the NLL of the answer tokens and the answers counted, over ``batches`` of probe samples
    of ``length`` inputs (dicts of ``tokens``, ``answer``, ``window`` and ``depth``); with ``depth_buckets``,
    the same per bucket of depth (rows of the breakdown, each with its bucket's lower edge). Under DDP each rank
    passes its own samples and every metric adds up all ranks'."""
    device = next(net.parameters()).device

    def metrics() -> dict:
        return {
            "accuracy": AnswerMetrics().to(device),
            "mean_nll": mean_metric().to(device),
            **{count: sum_metric().to(device) for count in ("answers", "tokens", "windows")},
        }

    overall = metrics()
    by_depth = {b: metrics() for b in range(depth_buckets or 0)}
    autocast = precision_autocast(device, precision)
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        windows = [tuple(w) for w in batch["window"].tolist()]
        drawn = window_positions(scheme or PositionScheme(), length, seed, windows)
        with autocast:
            scored = scored_targets(net, batch, drawn, predictions=True)
        per_sample, span = answers_per_sample(batch["answer"])
        nll, got, want = (t.view(-1, span) for t in scored)  # (answers, answer length)
        sample_of_answer = torch.arange(len(per_sample), device=device).repeat_interleave(per_sample)
        groups = [(overall, torch.ones(len(per_sample), dtype=torch.bool, device=device))]
        if depth_buckets:
            bucket = (batch["depth"] * depth_buckets).long().clamp(max=depth_buckets - 1)  # (B,)
            groups += [(by_depth[b], bucket == b) for b in bucket.unique().tolist()]
        for group, samples in groups:
            rows = samples[sample_of_answer]  # the answers of those samples
            group["accuracy"].update(got[rows], want[rows])
            group["mean_nll"].update(nll[rows].double().mean(), weight=nll[rows].numel())
            group["answers"].update(rows.sum())
            group["tokens"].update(nll[rows].numel())
            group["windows"].update(samples.sum())

    def computed(group: dict) -> dict:
        with warnings.catch_warnings():  # a bucket this rank has no sample of: its counts are 0, as they should be
            warnings.filterwarnings("ignore", message=".*called before the ``update`` method")
            counts = {count: int(group[count].compute().item()) for count in ("answers", "tokens", "windows")}
        if not counts["answers"]:  # a depth bucket no sample fell in, on any rank
            return {}
        mean_nll = group["mean_nll"].compute().item()
        accuracy = {name: value.item() for name, value in group["accuracy"].compute().items()}
        return {**accuracy, "ppl": math.exp(mean_nll), "mean_nll": mean_nll, **counts}

    breakdown = [{"depth": b / depth_buckets, **row} for b, group in by_depth.items() if (row := computed(group))]
    return Measured(computed(overall), breakdown=breakdown)


@dataclass(frozen=True)
class Measured:
    """What a protocol measured at one length: the row's metrics, its per-position curve (or None), and
    rows of a breakdown (passkey: one per depth bucket, each with its ``depth``)."""

    metrics: dict
    curve: list | None = None
    curve_counts: list | None = None
    breakdown: list = field(default_factory=list)
