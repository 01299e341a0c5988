"""``last_k``: the last k targets of each block of the longest length, the same targets at every L."""

from dataclasses import dataclass

from lenext.protocols.base import TextProtocol, Window


@dataclass(frozen=True)
class LastK(TextProtocol):
    """Each document cut into blocks of the longest evaluation length; the last ``k`` targets of each block scored,
    with the L tokens before them as context. The scored (document, position) set is the same at every L, so
    lengths compare like for like."""

    name = "last_k"
    own_settings = {"last_k": None}
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
