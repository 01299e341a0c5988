"""``data=text_files``: a folder or glob of local .txt, .jsonl and .parquet files, streamed a file (a line, a batch
of rows) at a time; anything that is not a document is refused, naming the file and line or row."""

import functools
import glob
import json
import os
from collections.abc import Iterator
from typing import Annotated

import pyarrow as pa

from lenext.data.corpus import Corpus, digest, file_stamps
from lenext.errors import DataError
from lenext.ranges import Range

DOCUMENT_FILES = (".txt", ".jsonl", ".parquet")
BYTE_ORDER_MARK = "\ufeff"  # as editors save one before a file's text: not part of it


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
        self.name = "text_files-" + digest([os.path.abspath(path)])

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
        stamps = file_stamps(self.files)  # a dangling link has none: it is named when read
        return f"{self.name}-{digest([str(self.holdout_every), self.text_field, *stamps])}"

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
                raise DataError(
                    f"{where} is not JSON ({e.msg.removesuffix(' at')} at column {e.colno}): fix or remove the line"
                ) from None
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
