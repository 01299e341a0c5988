"""Token shards: a split of a corpus tokenized once into Arrow files on disk and read back memory-mapped.

A split's folder holds ``shard-00000.arrow``, ``shard-00001.arrow``, ... and, once every document is in, a
``manifest.json`` (until then ``.progress.json`` lists the shards written so far, as the manifest will). A shard is an
Arrow IPC stream of whole documents, one row each (``ids``: the document's tokens; held-out splits also
``byte_ends``), closed at the first document boundary past ``SHARD_TOKENS`` tokens. Each shard is written aside and
renamed into place, and its schema names the preparation it belongs to (``key``): a killed preparation resumes after
its last whole shard, and a shard of another preparation, one that cannot be read, or one whose bytes differ from the
checksum its listing gives (xxh3-128), is refused naming its file.

Shards are read memory-mapped with pyarrow's IPC reader (as Hugging Face ``datasets`` reads its own Arrow cache): a
document is a zero-copy numpy view of the mapped file, so memory holds the pages being read, not the corpus.
The engine was chosen by measurement (docs/performance.md, "Token shards").
"""

import contextlib
import errno
import fcntl
import functools
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import xxhash

from lenext.errors import DataError
from lenext.files import TEMPORARY, atomic_path, fsync, write_atomic

SHARD_TOKENS = 1 << 24  # tokens per shard (32 MiB of uint16): small enough to rewrite after a kill
FORMAT = 1  # bumped when the layout changes, so an older folder is refused rather than misread
MANIFEST = "manifest.json"
PROGRESS = ".progress.json"  # the manifest so far of a preparation under way: a dot file, never pushed to a remote
CHECKSUM = "xxh3_128"  # each shard's, in the manifest: bytes changed after preparation are refused


def token_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size <= 1 << 16 else pa.uint32()


class SplitWriter:
    """Writes one split's documents into shards, after the shards a killed run completed.

    ``resume_from`` is the number of documents the folder already holds: the caller skips them in its source.
    """

    def __init__(self, folder: str, key: str, ids_type: pa.DataType, with_bytes: bool):
        self.folder, self.key = folder, key
        fields = [pa.field("ids", pa.list_(ids_type))] + [pa.field("byte_ends", pa.list_(pa.int64()))] * with_bytes
        self.schema = pa.schema(fields, metadata={"lenext.key": key, "lenext.format": str(FORMAT)})
        for name in filter(TEMPORARY.match, os.listdir(folder)):  # a shard or listing a kill left half-written
            os.unlink(os.path.join(folder, name))  # (the caller holds the folder's lock)
        self.done = completed_shards(folder, key)
        self.resume_from = sum(documents for _, documents, _, _ in self.done)

    def write(self, documents: Iterable[dict[str, np.ndarray]]) -> None:
        """Append ``documents`` (each {"ids": ..., "byte_ends": ...}) in order, then the manifest."""
        rows, tokens, writer = [], 0, None
        try:
            for document in documents:
                rows.append(document)
                tokens += len(document["ids"])
                if len(rows) == 1024 or tokens >= SHARD_TOKENS:  # a batch: memory holds at most one
                    writer = writer or self._open()
                    writer.write(rows)
                    rows = []
                if tokens >= SHARD_TOKENS:
                    self._close(writer)
                    writer, tokens = None, 0
            if rows:
                writer = writer or self._open()
                writer.write(rows)
            if writer:
                self._close(writer)
            self._list(MANIFEST)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.folder, PROGRESS))
        except BaseException as e:
            if writer:
                writer.abandon()
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # kept so far; the next run resumes
                raise DataError(f"token shards in {self.folder} could not be written ({e}); free space there") from None
            raise

    def _open(self) -> "_ShardFile":
        return _ShardFile(os.path.join(self.folder, shard_names(len(self.done) + 1)[-1]), self.schema, self.done)

    def _close(self, writer: "_ShardFile") -> None:
        writer.close()
        self._list(PROGRESS)  # a shard changed before the preparation resumes is then refused, as after it

    def _list(self, name: str) -> None:
        """The shards written so far, into the manifest or the progress file ``name``."""
        shards = [{"file": os.path.basename(p), "documents": d, "tokens": t, CHECKSUM: c} for p, d, t, c in self.done]
        write_atomic(
            os.path.join(self.folder, name),
            json.dumps({"format": FORMAT, "key": self.key, "shards": shards}, indent=1) + "\n",
        )


class _ShardFile:
    """One shard being written: a temporary file renamed into place (and listed in ``done``) when closed."""

    def __init__(self, path: str, schema: pa.Schema, done: list):
        self.path, self.schema, self.done = path, schema, done
        self._context = atomic_path(path)
        self._tmp = self._context.__enter__()
        self._stream = pa.ipc.new_stream(self._tmp, schema)
        self.documents = self.tokens = 0
        self.ended = False  # closed (kept, or removed by a failed close) or abandoned

    def write(self, rows: list[dict]) -> None:
        arrays = [_list_array([row[f.name] for row in rows], f.type.value_type) for f in self.schema]
        self._stream.write_batch(pa.record_batch(arrays, schema=self.schema))
        self.documents += len(rows)
        self.tokens += sum(len(row["ids"]) for row in rows)

    def close(self) -> None:
        self.ended = True
        try:
            self._stream.close()
            fsync(self._tmp)  # on disk before the rename: a crash leaves no shard whose name promises data it lacks
        except OSError as e:  # the temporary removed, the failure in one line
            self._context.__exit__(type(e), e, e.__traceback__)
            raise DataError(f"token shard {self.path} could not be written ({e})") from None
        checksum = file_checksum(self._tmp)
        self._context.__exit__(None, None, None)
        _CHECKED.add(_identity(self.path, checksum))  # read whole just now: the split's opening reads it no more
        self.done.append((self.path, self.documents, self.tokens, checksum))

    def abandon(self) -> None:
        """Remove the unfinished shard: the next run rewrites it from its first document."""
        if self.ended:
            return
        self.ended = True
        with contextlib.suppress(OSError, pa.ArrowException):  # the disk that failed the write may fail this too
            self._stream.close()
        with contextlib.suppress(DataError):
            self._context.__exit__(DataError, DataError("abandoned"), None)


def _list_array(rows: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.concatenate(rows).astype(value_type.to_pandas_dtype(), copy=False)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def shard_names(count: int) -> list[str]:
    """The file names of a split's ``count`` shards, in order."""
    return [f"shard-{number:05d}.arrow" for number in range(count)]


def completed_shards(folder: str, key: str) -> list[tuple[str, int, int, str]]:
    """(path, documents, tokens, checksum) of each shard already in ``folder``, in order, each read and checked:
    against the progress file where it lists the shard (a kill between a shard's rename and the file's update leaves
    the last one unlisted)."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("shard-") and n.endswith(".arrow"))
    for expected, name in zip(shard_names(len(names)), names, strict=True):
        if name != expected:
            raise DataError(f"token shards in {folder}: {expected} is missing; {_REMOVE.format(folder)}")
    listed = {shard["file"]: shard for shard in _listing(os.path.join(folder, PROGRESS), key) or []}
    done = []
    for name in names:
        path = os.path.join(folder, name)
        if name in listed:
            shard = listed[name]
            _checked_shard(folder, shard, key)
            done.append((path, shard["documents"], shard["tokens"], shard.get(CHECKSUM) or file_checksum(path)))
        else:
            table = read_shard(path, key)
            done.append((path, table.num_rows, _tokens(table), file_checksum(path)))
    return done


_CHECKED: set[tuple] = set()  # (path, size, mtime, checksum) of the shards this process read whole and found so


def _identity(path: str, checksum: str) -> tuple:
    """The file as ``_CHECKED`` knows it: a change of its size or time makes it another."""
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_size, stat.st_mtime_ns, checksum


def unchanged(path: str, expected: str) -> bool:
    """Whether the file's bytes have the checksum ``expected``: read whole once per process while the file stays as
    it was (a split opens twice as data loads)."""
    seen = _identity(path, expected)
    if seen not in _CHECKED:
        if file_checksum(path) != expected:
            return False
        _CHECKED.add(seen)
    return True


def file_checksum(path: str) -> str:
    """xxh3-128 of the file's bytes, read in 16 MiB blocks (a shard is never held whole)."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


_REMOVE = "remove {} to prepare the split again"


def read_shard(path: str, key: str, checksum: str | None = None) -> pa.Table:
    """The shard at ``path``, memory-mapped, or a DataError naming it if it cannot be read, belongs elsewhere or
    (given its manifest's ``checksum``) has changed since it was written."""
    folder = os.path.dirname(path)
    try:
        with pa.memory_map(path) as source:  # the table's buffers stay views of the map after the block
            table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"token shard {path} cannot be read ({e}); {_REMOVE.format(folder)}") from None
    meta = table.schema.metadata or {}
    found = (meta.get(b"lenext.key") or b"no lenext key").decode(), (meta.get(b"lenext.format") or b"?").decode()
    foreign = found[0] != key and found[1] == str(FORMAT)  # marked whole as another preparation's
    if checksum is not None and not foreign and not unchanged(path, checksum):  # damaged, its marks included
        raise DataError(
            f"token shard {path} has changed since it was prepared (its bytes differ from the {CHECKSUM} checksum "
            f"its manifest lists); {_REMOVE.format(folder)}"
        )
    if found != (key, str(FORMAT)):
        raise DataError(
            f"token shard {path} belongs to another preparation ({found[0]}, format {found[1]}; not {key}, format "
            f"{FORMAT}); {_REMOVE.format(folder)}"
        )
    return table


def _tokens(table: pa.Table) -> int:
    return sum(len(chunk.flatten()) for chunk in table.column("ids").chunks)


def open_split(folder: str, key: str) -> "Split | None":
    """The split prepared in ``folder`` (every shard checked against the manifest), or None if it is not complete."""
    path = os.path.join(folder, MANIFEST)
    shards = _listing(path, key)
    if shards is None:
        return None
    listed_files = [shard["file"] for shard in shards]
    on_disk = sorted(n for n in os.listdir(folder) if n.startswith("shard-") and n.endswith(".arrow"))
    if listed_files != shard_names(len(shards)) or on_disk != listed_files:  # a shard dropped, repeated or added
        missing, unlisted = sorted(set(listed_files) - set(on_disk)), sorted(set(on_disk) - set(listed_files))
        which = "".join(
            f"; {what}: {', '.join(names)}" for what, names in (("missing", missing), ("not listed", unlisted)) if names
        )
        raise DataError(
            f"{path} lists {len(shards)} shards ({', '.join(listed_files[:3])}{', ...' * (len(shards) > 3)}) and "
            f"{folder} holds {len(on_disk)}{which}: they must be shard-00000.arrow, shard-00001.arrow, ... in order, "
            f"each once; {_REMOVE.format(folder)}"
        )
    tables = [_checked_shard(folder, shard, key) for shard in shards]
    return Split([os.path.join(folder, s["file"]) for s in shards], key, tables)


def _listing(path: str, key: str) -> list[dict] | None:
    """The shards a manifest (or progress file) at ``path`` lists; None if there is none."""
    try:
        with open(path) as f:
            listing = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}); {_REMOVE.format(os.path.dirname(path))}") from None
    shards = listing.get("shards") if isinstance(listing, dict) else None
    entry = {"file": str, "documents": int, "tokens": int}
    listed = isinstance(shards, list) and all(
        isinstance(s, dict) and all(isinstance(s.get(k), kind) for k, kind in entry.items()) for s in shards
    )
    if not listed or listing.get("key") != key or listing.get("format") != FORMAT:
        raise DataError(
            f"{path} is not the manifest of {key} (format {FORMAT}); {_REMOVE.format(os.path.dirname(path))}"
        )
    return shards


def _checked_shard(folder: str, shard: dict, key: str) -> pa.Table:
    """The shard a manifest lists as ``shard``, checked against its checksum, documents and tokens there."""
    path = os.path.join(folder, shard["file"])
    table = read_shard(path, key, shard.get(CHECKSUM))  # manifests before checksums were kept have none
    if (table.num_rows, _tokens(table)) != (shard["documents"], shard["tokens"]):
        raise DataError(
            f"token shard {path} holds {table.num_rows} documents and {_tokens(table)} tokens, its manifest "
            f"{shard['documents']} and {shard['tokens']}; {_REMOVE.format(folder)}"
        )
    return table


class Split:
    """A prepared split: its documents as zero-copy views of the memory-mapped shards.

    Pickled (to a DataLoader worker) as its file names; the worker maps the files again.
    """

    def __init__(self, files: list[str], key: str, tables: list[pa.Table] | None = None):
        self.files, self.key, self._tables = files, key, tables

    def __getstate__(self) -> dict:
        return {"files": self.files, "key": self.key, "_tables": None}

    @property
    def tables(self) -> list[pa.Table]:
        if self._tables is None:
            self._tables = [read_shard(path, self.key) for path in self.files]
        return self._tables

    def _chunks(self, column: str) -> Iterator[pa.ListArray]:
        for table in self.tables:
            yield from table.column(column).chunks

    def pieces(self) -> list[np.ndarray]:
        """The split's tokens, documents concatenated, as one zero-copy array per Arrow batch."""
        return [chunk.flatten().to_numpy(zero_copy_only=True) for chunk in self._chunks("ids")]

    def documents(self, column: str = "ids") -> list[np.ndarray]:
        """Each document's ``column`` (token ids, or byte_ends), a zero-copy view."""
        views = []
        for chunk in self._chunks(column):
            values = chunk.flatten().to_numpy(zero_copy_only=True)
            offsets = chunk.offsets.to_numpy()
            views.extend(np.split(values, offsets[1:-1] - offsets[0]))
        return views

    @property
    def size(self) -> tuple[int, int]:
        """(documents, tokens) of the split."""
        return sum(t.num_rows for t in self.tables), sum(_tokens(t) for t in self.tables)

    def stream(self) -> "TokenStream":
        return TokenStream(self)


class TokenStream:
    """A split's documents as one token sequence, sliced across the shards' pieces without holding them in memory."""

    def __init__(self, split: Split):
        self.split = split
        self.ends = np.cumsum([len(p) for p in split.pieces()])

    def __getstate__(self) -> dict:
        return {"split": self.split, "ends": self.ends}

    @functools.cached_property
    def _pieces(self) -> list[np.ndarray]:
        return self.split.pieces()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, _ = span.indices(len(self))
        first = int(np.searchsorted(self.ends, start, side="right"))
        parts = []
        while start < stop:
            begin = int(self.ends[first - 1]) if first else 0
            end = min(stop, int(self.ends[first]))
            parts.append(self._pieces[first][start - begin : end - begin])
            start, first = end, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@contextlib.contextmanager
def preparing(folder: str, lock: str = ".prepare.lock") -> Iterator[None]:
    """Hold the preparation lock ``lock`` in ``folder``: a second process preparing the same thing (a split, a
    tokenizer) waits, then finds it done."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, lock), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
