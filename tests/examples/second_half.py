"""The example protocol of docs/adding/protocol.md (shown there between the section markers)."""

# --8<-- [start:protocol]
from dataclasses import dataclass

from lenext.protocols.base import TextProtocol, Window
from lenext.protocols.nonoverlap import NonOverlapping


@dataclass(frozen=True)
class SecondHalf(TextProtocol):
    """Disjoint windows; only the second half of each window's targets scored."""

    name = "second_half"

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        disjoint = NonOverlapping().windows(document_lengths, length)
        return [Window(w.document, w.start, length // 2) for w in disjoint]


# --8<-- [end:protocol]
