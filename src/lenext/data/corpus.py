"""What a corpus is to lenext: named documents per split, read as a stream (``Corpus``), and the digests that name
what was read (a tokenizer's training text, a corpus's files)."""

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator

SPLITS = ("train", "validation", "test")


def digest(texts: Iterable[str]) -> str:
    """A short hash of ``texts``, in order."""
    h = hashlib.sha256()
    for text in texts:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:12]


class Corpus:
    """A named set of documents per split ("train", "validation", "test"), read as a stream."""

    name = "corpus"

    def documents(self, split: str) -> Iterator[str]:
        """The split's documents, in a fixed order, one at a time: a corpus may be larger than memory."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """What the documents are, cheaply: prepared token shards are reused while it stays the same. A corpus of
        one's own must override it to cover its content (its files' sizes and times, a version), or its shards
        are reused after the content changes."""
        return self.name

    def empty_split_hint(self) -> str:
        """What to change when a split has no documents, after "check data.corpus" ("" where nothing more helps)."""
        return ""


def file_stamps(paths: Iterable[str]) -> list[str]:
    """Each local path's size and modification time: what tells an edited file from the one prepared. A path that
    is not on this machine (a hub path, a dangling link) has none."""
    stamps = []
    for path in paths:
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            stamps.append(f"{path} {stat.st_size} {stat.st_mtime_ns}")
    return stamps
