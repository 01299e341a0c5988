"""Ranges of settings, declared in constructor signatures (``Annotated[int, Range(1)]``) and checked by
``lenext.schema`` before any work. Standard library only: the model's modules import it, and an export vendors
them (lenext.export)."""

from dataclasses import dataclass
from typing import Annotated


@dataclass(frozen=True)
class Range:
    """low <= value <= high (either bound optional; ``open_low`` / ``open_high`` make it strict)."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def holds(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def __str__(self) -> str:
        low, high = (str(int(b)) if float(b).is_integer() else f"{b:g}" for b in (self.low or 0, self.high or 0))
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"
        if self.low is not None:
            return f"{'>' if self.open_low else '>='} {low}"
        return f"{'<' if self.open_high else '<='} {high}"


PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, open_low=True)]
NonNegativeFloat = Annotated[float, Range(0)]
Probability = Annotated[float, Range(0, 1, open_high=True)]  # dropout: 1 would drop everything
Fraction = Annotated[float, Range(0, 1, open_low=True)]
Share = Annotated[float, Range(0, 1)]  # a share of a whole, both ends included
Seed = Annotated[int, Range(0, 2**32 - 1)]  # what Lightning's seed_everything and NumPy accept
