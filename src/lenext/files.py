"""Files written so that a reader, or a run killed mid-write, finds the previous file or the new one, never half;
and ``unmakeable_folder``, why a folder lenext would write in cannot be made (``nearest_existing``: where it would be).

Every file lenext writes (checkpoints, tokenizers, results, report tables and plots, benchmarks) goes
through ``atomic_path``: the writer fills a temporary file in the same folder, which then replaces the
target in one rename.
"""

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator

# atomic_path's temporary names: "." + the target's name + "." + mkstemp's 8 characters + TEMPORARY_MARK + a suffix.
TEMPORARY_MARK = ".tmp"
TEMPORARY = re.compile(rf"^\..+\.[a-z0-9_]{{8}}{re.escape(TEMPORARY_MARK)}(\.\w+)?$")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """A temporary path next to ``path`` to write to; it replaces ``path`` if the block succeeds and is
    removed if it fails. ``suffix`` ends the temporary name, for writers that pick a format from it (".png")."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    # A unique name (not path + ".tmp"): two processes writing the same file never share a temporary.
    try:
        descriptor, tmp = tempfile.mkstemp(
            dir=folder, prefix=f".{os.path.basename(path)}.", suffix=f"{TEMPORARY_MARK}{suffix}"
        )
    except OSError as e:  # no inode left, say: the file it was for
        e.filename = path
        raise
    os.close(descriptor)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide results from the other users of a shared cluster
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):  # a write's error names no file: the target's
            e.filename = path
        raise


def remove_temporaries(folder: str) -> list[str]:
    """The temporary files ``atomic_path`` left in a run's ``folder`` and its ``checkpoints/`` where a process was
    killed mid-write (SIGKILL, out of memory): removed, for the process that now holds the folder alone
    (lenext.lock). A 1B model's checkpoint left gigabytes behind each time. Not the folders inside it, which may be
    another process's (a cache, another run's). Returns the paths removed."""
    removed = []
    for at in (folder, os.path.join(folder, "checkpoints")):
        for name in filter(TEMPORARY.match, os.listdir(at) if os.path.isdir(at) else []):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(at, name))
                removed.append(os.path.join(at, name))
    return removed


def fsync(path: str | os.PathLike) -> None:
    """``path``'s data on disk (before a rename names it whole)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path`` through ``atomic_path``, flushed to disk before the rename."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def unmakeable_folder(path: str) -> str | None:
    """Why the folder ``path`` cannot be made (a file in its way, a parent this user cannot write), or None; made
    by the first write, so that a refused command leaves none. An existing folder passes: a prepared cache is
    only read."""
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    if existing != os.path.abspath(path) and not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def nearest_existing(path: str) -> str:
    """``path``, absolute, or the nearest folder above it that exists: where it would be made."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing
