"""``data.remote``: an object store (any fsspec URL: s3://, gs://, az://, hf://) that mirrors the cache's tokenizers
and token shards, so a corpus prepared once is fetched by every machine that trains on it (docs/data.md).

Runs read shards memory-mapped from the local cache (``data.cache_dir``); the remote copy is what a machine without
it pulls from. A split folder counts as present, locally or remotely, once its manifest is there: its shards are
copied first and the manifest last, each file under a temporary name until whole, so a copy cut short is never
taken for a whole one. A pulled folder is checked as a locally prepared one is (``lenext.shards.open_split``).
"""

import contextlib
import os
import re
import tempfile
import uuid

import fsspec

from lenext.errors import ConfigError, DataError, first_line
from lenext.files import atomic_path, fsync
from lenext.shards import MANIFEST


class RemoteCache:
    """The cache's mirror at ``url``. Each method takes a path relative to both roots: a file, or a split folder."""

    def __init__(self, url: str):
        # s3:/bucket: fsspec would take it for a local folder of that name (file:/path is its local path, as meant)
        scheme = re.match(r"([a-z][a-z0-9+.-]+):/(?!/)", url, re.IGNORECASE)
        if scheme and scheme.group(1).lower() not in ("file", "local"):
            raise ConfigError(
                f"data.remote={url!r} is not a URL: it must be <protocol>://... (did you mean "
                f"{scheme.group(1)}://{url[scheme.end() :]}?), or a local folder"
            )
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its package (s3fs, gcsfs, adlfs) missing
            raise ConfigError(f"data.remote={url!r} cannot be opened: {e}") from None
        except Exception as e:  # noqa: BLE001 (a store that connects when made: ftp's socket errors)
            raise unreachable(url, e) from None
        self.url, self.root = url.rstrip("/"), root.rstrip("/")
        try:  # now, not once the corpus is prepared: fsspec's HTTP exists() and info() say "absent" for a host it
            self.fs.ls(self.root, detail=False)  # cannot reach; ls() raises (the cache's root holds two folders)
        except FileNotFoundError:
            pass  # an empty prefix: the first machine to prepare fills it
        except Exception as e:  # noqa: BLE001 (each store has its own: botocore's, google-auth's, HTTP errors)
            raise unreachable(url, e) from None

    def refuse_unwritable(self) -> None:
        """A ConfigError unless this machine can write to the remote as ``push`` does: called before a corpus is
        prepared, whose tokenizer and shards are pushed there once made (a read-only store, an HTTP mirror, would
        fail then, after the work). An empty file of its own name is uploaded as ``push`` uploads, then removed."""
        probe = self._path(f".lenext-write-check-{uuid.uuid4().hex}")
        try:
            with tempfile.NamedTemporaryFile() as empty:
                self._upload(empty.name, probe)
        except Exception as e:  # noqa: BLE001 (each store has its own: botocore's, google-auth's, HTTP errors)
            if not self._landed(probe):  # push takes a landed file too: s3fs's mv copies, then may fail to delete
                raise ConfigError(
                    f"data.remote={self.url!r} cannot be written ({type(e).__name__}: {first_line(e)}): this machine "
                    "prepares what neither its cache nor the remote holds and pushes it there; it must be a store "
                    "this machine can write, or one that holds the prepared corpus (or unset data.remote to prepare "
                    "here only)"
                ) from None
        self._remove(probe)

    def pull_file(self, cache_dir: str, relative: str) -> None:
        """The remote's copy of a file into the cache, if the cache lacks it and the remote has it."""
        if not os.path.exists(os.path.join(cache_dir, relative)) and self._exists(relative):
            self._get(relative, cache_dir)

    def pull_split(self, cache_dir: str, relative: str) -> None:
        """The remote's split folder into the cache, if the cache has no manifest there and the remote has one."""
        if os.path.exists(os.path.join(cache_dir, relative, MANIFEST)) or not self._exists(f"{relative}/{MANIFEST}"):
            return
        paths = self._call(relative, self.fs.ls, self._path(relative), detail=False)
        names = [os.path.basename(p) for p in paths if not p.endswith(".partial")]  # not another machine's upload
        for name in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
            self._get(f"{relative}/{name}", cache_dir)

    def push(self, cache_dir: str, relative: str) -> None:
        """A cached file, or a prepared split folder (shards, then the manifest), onto the remote if it lacks it.
        Machines preparing the same corpus at once may push the same files: each under a name of its own until whole,
        and the same bytes either way."""
        local = os.path.join(cache_dir, relative)
        folder = os.path.isdir(local)
        if self._exists(f"{relative}/{MANIFEST}" if folder else relative):
            return
        names = [n for n in os.listdir(local) if not n.startswith(".")] if folder else []  # not the lock
        for file in [f"{relative}/{n}" for n in sorted(names, key=lambda n: n == MANIFEST)] if folder else [relative]:
            try:
                self._upload(os.path.join(cache_dir, file), self._path(file))
            except Exception as e:  # noqa: BLE001 (a store's own errors): another machine's copy may have landed first
                if not self._landed(self._path(file)):
                    raise DataError(
                        f"data.remote: {self.url}/{file} could not be written ({type(e).__name__}: {first_line(e)})"
                    ) from None

    def _upload(self, local: str, target: str) -> None:
        """The local file onto the remote at ``target``, under a name of its own until whole (removed if it fails,
        where the store allows)."""
        partial = f"{target}.{uuid.uuid4().hex}.partial"
        try:
            self.fs.makedirs(target.rpartition("/")[0], exist_ok=True)
            self.fs.put_file(local, partial)
            self.fs.mv(partial, target)
        except Exception:
            self._remove(partial)
            raise

    def _landed(self, path: str) -> bool:
        """Whether the remote holds ``path``, False where it cannot say."""
        try:
            return self.fs.exists(path)
        except Exception:  # noqa: BLE001 (each store has its own errors)
            return False

    def _remove(self, path: str) -> None:
        """``path`` removed from the remote, where the store allows (one that takes writes but not deletes keeps it)."""
        with contextlib.suppress(Exception):
            self.fs.rm_file(path)

    def _path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def _exists(self, relative: str) -> bool:
        return self._call(relative, self.fs.exists, self._path(relative))

    def _get(self, relative: str, cache_dir: str) -> None:
        with atomic_path(os.path.join(cache_dir, relative)) as tmp:
            self._call(relative, self.fs.get_file, self._path(relative), tmp)
            fsync(tmp)

    def _call(self, relative: str, method, *args, **kwargs):
        """``method(*args, **kwargs)`` on the remote, a failure named in one line by ``relative``."""
        try:
            return method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (each store has its own: botocore's, google-auth's, HTTP errors)
            raise DataError(f"data.remote: {self.url}/{relative} failed ({type(e).__name__}: {e})") from None


def unreachable(url: str, error: Exception) -> ConfigError:
    return ConfigError(
        f"data.remote={url!r} cannot be reached ({type(error).__name__}: {first_line(error)}): it must be a store "
        "this machine can reach"
    )
