"""``data=pg19``, ``data=wikitext103`` and any dataset ``datasets.load_dataset`` reads: a hub dataset (streamed or
cached by ``datasets``) or local files of the same schema."""

import glob
import itertools
import json
import os
import socket
from collections.abc import Iterable, Iterator

import pyarrow as pa

from lenext.data.corpus import SPLITS, Corpus, digest, file_stamps
from lenext.errors import ConfigError, DataError, first_line


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
        settings = [files, split_names, self.text_field, str(self.wikitext_articles), *file_stamps(found)]
        if self.revision is not None:  # unpinned corpora keep the fingerprint (and shards) they had
            settings.append(f"revision={self.revision}")
        return f"{self.name}-{digest(settings)}"

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
