"""``nonoverlap``: disjoint windows, every target scored."""

from dataclasses import dataclass

from lenext.protocols.base import TextProtocol, Window


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
