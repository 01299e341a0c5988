"""Evaluation protocols (docs/evaluation.md): a registry of objects, each owning its parameters and its windows.

A text protocol turns held-out documents and an evaluation length L into windows of L + 1 tokens (inputs +
shifted targets) and says which targets of each window are scored. Windows never cross a document and are
never padded: a length no document can fill gives no window, and ``missing`` says why.

A new protocol is one class here and its entry in ``PROTOCOLS`` (docs/adding/protocol.md).
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lenext.positions import PositionScheme
from lenext.scoring import Measured, evaluate_length

ACCURACY = "accuracy"  # the probes' protocol (lenext.synthetic): answers only, exact-match and per-token accuracy


@dataclass(frozen=True)
class Window:
    document: int
    start: int  # first input token; the window holds tokens [start, start + L]
    score_from: int  # targets 0..L-1 of the window; those >= score_from are scored


@dataclass(frozen=True)
class TextProtocol:
    """How a length's windows are cut from documents of the given token counts, and which targets count."""

    name: ClassVar[str]
    per_position: ClassVar[bool] = False  # whether its rows have a per-position loss curve (eval.per_position)

    @classmethod
    def from_plan(cls, plan) -> "TextProtocol":
        """The protocol with its parameters from a ``SweepPlan``."""
        return cls()

    def parameters(self) -> dict:
        """What a results row records of the protocol besides its name."""
        return {}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        raise NotImplementedError

    def needs(self, length: int) -> int:
        """The targets a document must have to give a window at ``length``."""
        return length

    def measure(
        self,
        net,
        documents: list[np.ndarray],
        windows: list[Window],
        length: int,
        settings,
        precision: str,
        scheme: PositionScheme,
        seed: int,
    ) -> Measured:
        """Perplexity over the scored targets of ``windows`` (``settings``: the run's ``EvalSettings``), with the
        per-position curve where the protocol has one and eval.per_position asks for it."""
        per_position = settings.per_position and self.per_position
        result = evaluate_length(
            net, documents, windows, length, settings.tokens_per_batch, per_position, precision, scheme, seed
        )
        metrics = {"ppl": math.exp(result["mean_nll"]), "mean_nll": result["mean_nll"], "tokens": result["tokens"]}
        return Measured(metrics, result["curve"], result["curve_counts"])


@dataclass(frozen=True)
class NonOverlapping(TextProtocol):
    """Disjoint windows; every target scored (the ALiBi paper's default)."""

    name = "nonoverlap"
    per_position = True

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        return [
            Window(d, w * length, 0)
            for d, n in enumerate(document_lengths)
            for w in range((n - 1) // length)  # targets: positions 1..n-1 can be predicted
        ]


@dataclass(frozen=True)
class Sliding(TextProtocol):
    """Windows advanced by ``stride``; only targets no earlier window scored count (the last ``stride`` of each,
    after the first window): each token once, each with at least L - stride tokens of context."""

    name = "sliding"
    stride: int = 1

    @classmethod
    def from_plan(cls, plan) -> "Sliding":
        return cls(plan.stride)

    def parameters(self) -> dict:
        return {"stride": self.stride}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        windows = []
        for d, n in enumerate(document_lengths):
            targets = n - 1
            if targets < length:
                continue
            windows.append(Window(d, 0, 0))
            scored = length  # targets 1..scored are done
            while scored < targets:
                end = min(scored + self.stride, targets)
                windows.append(Window(d, end - length, length - (end - scored)))
                scored = end
        return windows


@dataclass(frozen=True)
class LastK(TextProtocol):
    """Each document cut into blocks of the longest evaluation length; the last ``k`` targets of each block scored,
    with the L tokens before them as context. The scored (document, position) set is the same at every L, so
    lengths compare like for like."""

    name = "last_k"
    k: int = 1
    block: int = 1  # the sweep's longest length

    @classmethod
    def from_plan(cls, plan) -> "LastK":
        return cls(plan.k, max(plan.lengths))

    def parameters(self) -> dict:
        return {"k": self.k}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        return [
            Window(d, (b + 1) * self.block - length, length - self.k)
            for d, n in enumerate(document_lengths)
            for b in range((n - 1) // self.block)
        ]

    def needs(self, length: int) -> int:
        return self.block


@dataclass(frozen=True)
class Answers:
    """The probes' protocol: their answers alone, windows being samples (lenext.synthetic measures them)."""

    name: ClassVar[str] = ACCURACY

    def parameters(self) -> dict:
        return {}


PROTOCOLS: dict[str, type[TextProtocol]] = {p.name: p for p in (NonOverlapping, Sliding, LastK)}
PROTOCOL_NAMES = (*PROTOCOLS, ACCURACY)


def cap_windows(windows: list, max_windows: int | None) -> list:
    """At most ``max_windows`` of ``windows``, evenly spread (every k-th); all of them for null."""
    if max_windows and len(windows) > max_windows:
        return windows[:: math.ceil(len(windows) / max_windows)]
    return windows
