"""The haystack protocols (``niah_*``, ``variable_tracking``): RULER's needles written into held-out text, retrieval
scored by exact match and by rank (the haystacks and their scoring: lenext.haystack)."""

from dataclasses import dataclass
from typing import ClassVar

from lenext.haystack import measure_haystack
from lenext.protocols.base import TextProtocol, settings_of
from lenext.scoring import Measured


@dataclass(frozen=True)
class Haystack(TextProtocol):
    """Retrieval of needles written into the held-out text (lenext.haystack): ``samples`` haystacks at each of
    ``depths``, each answer scored by exact match and by its rank among ``candidates`` distractors."""

    task: ClassVar[str]
    metrics = ("rank_accuracy", "exact_match")
    own_settings = {"haystack_depths": [0.0, 0.25, 0.5, 0.75, 1.0], "haystack_samples": 8, "haystack_candidates": 4}
    depths: tuple[float, ...] = tuple(own_settings["haystack_depths"])
    samples: int = own_settings["haystack_samples"]
    candidates: int = own_settings["haystack_candidates"]

    @classmethod
    def from_plan(cls, plan) -> "Haystack":
        given = settings_of(plan, "haystack_")
        return cls(**given | ({"depths": tuple(given["depths"])} if "depths" in given else {}))

    def parameters(self) -> dict:
        return {"candidates": self.candidates, "samples": self.samples, "depths": list(self.depths)}

    def windows(self, document_lengths: list[int], length: int) -> list[tuple[int, int]]:
        """(sample index, depth index) of every sample."""
        return [(i, d) for i in range(self.samples) for d in range(len(self.depths))]

    def capped(self, windows: list, max_windows: int | None) -> list:
        """The first samples of every depth, as many of each as ``max_windows`` leaves (at least one)."""
        if not max_windows or len(windows) <= max_windows:
            return windows
        per_depth = max(1, max_windows // len(self.depths))
        return [(i, d) for i, d in windows if i < per_depth]

    def measure(self, net, evaluation, windows, length, settings, precision, scheme, seed) -> Measured:
        return measure_haystack(
            net,
            evaluation.haystack(),
            self.task,
            windows,
            self.depths,
            length,
            self.candidates,
            settings.tokens_per_batch,
            precision,
            scheme,
            seed,
        )


class NeedleSingle(Haystack):
    name, task = "niah_single", "single"


class NeedleMultiKey(Haystack):
    name, task = "niah_multikey", "multikey"


class NeedleMultiValue(Haystack):
    name, task = "niah_multivalue", "multivalue"


class NeedleMultiQuery(Haystack):
    name, task = "niah_multiquery", "multiquery"


class VariableTracking(Haystack):
    name, task = "variable_tracking", "variable_tracking"
