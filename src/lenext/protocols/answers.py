"""``accuracy``, the probes' protocol: their answers alone (lenext.synthetic measures them)."""

from dataclasses import dataclass
from typing import ClassVar

from lenext.protocols.base import cap_windows

ACCURACY = "accuracy"  # the probes' protocol (lenext.synthetic): answers only, exact-match and per-token accuracy


@dataclass(frozen=True)
class Answers:
    """The probes' protocol: their answers alone, windows being samples (lenext.synthetic measures them)."""

    name: ClassVar[str] = ACCURACY
    metrics: ClassVar[tuple[str, ...]] = ("exact_match", "token_accuracy")

    def parameters(self) -> dict:
        return {}

    def capped(self, windows: list, max_windows: int | None) -> list:
        return cap_windows(windows, max_windows)
