"""``sliding``: windows advanced by ``eval.stride``, each token scored once, with at least L - stride tokens
before it."""

from dataclasses import dataclass

from lenext.protocols.base import TextProtocol, Window


@dataclass(frozen=True)
class Sliding(TextProtocol):
    """Windows advanced by ``stride``; only targets no earlier window scored count (the last ``stride`` of each,
    after the first window): each token once, each with at least L - stride tokens of context."""

    name = "sliding"
    own_settings = {"stride": None}
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
