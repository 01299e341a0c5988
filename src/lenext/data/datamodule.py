"""``LMDataModule``: the corpus prepared once into token shards on disk (``lenext.shards``, mirrored by
``data.remote``), read memory-mapped by training, validation and the length sweep."""

import itertools
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Annotated

import lightning as L
import numpy as np
from torch.utils.data import DataLoader

from lenext.data.corpus import SPLITS, Corpus, digest
from lenext.data.loaders import DocumentWindows, TrainWindows, evaluation_loader, step_loader
from lenext.data.tokenizer import (
    EOS,
    byte_ends,
    external_tokenizer,
    for_documents,
    sample,
    token_id_bound,
    train_tokenizer,
)
from lenext.errors import ConfigError, DataError, first_line
from lenext.evaluate import TextEvaluation
from lenext.files import atomic_path, nearest_existing, unmakeable_folder, write_atomic
from lenext.protocols import PROTOCOLS
from lenext.ranges import NonNegativeInt, PositiveFloat, PositiveInt, Range, Seed
from lenext.remote import RemoteCache
from lenext.shards import MANIFEST, Split, SplitWriter, TokenStream, open_split, preparing, token_type

log = logging.getLogger("lenext")

ENCODE_BATCH = 256  # documents tokenized together
# How documents become tokens, in the shards' key: changed, shards prepared before are prepared again. "special
# tokens as text": a document's "<|endoftext|>" is encoded as text (shards before 2026-11-29 held the token).
ENCODING = "special tokens as text"


def _read_if_exists(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


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
        if cache_dir == "":  # an unset variable: it prepared into the folder the command ran in
            raise ConfigError("data.cache_dir='' is invalid: give a folder (LENEXT_CACHE sets the default)")
        if remote == "":  # an unset variable: no remote, unsaid
            raise ConfigError("data.remote='' is invalid: give an fsspec URL (s3://bucket/prefix, ...), or null")
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
        identity = {"tokenizer": digest([json.dumps(vocabulary), str(self.start_token)])}
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
                if not os.path.exists(os.path.join(self._folder(key, split), MANIFEST)):  # pulled or prepared here
                    self._refuse_an_unwritable_cache()
                    with preparing(self._folder(key, split)):  # the ranks of a node: one pulls, the rest find it
                        self.remote.pull_split(self.cache_dir, self._relative_folder(key, split))
        if key is None or any(self._open_split(key, split) is None for split in SPLITS):
            self._refuse_an_unwritable_cache()  # a prepared cache is only read: one on a read-only disk serves
            if self.remote:  # what is prepared here is pushed there: a store it cannot write is refused now
                self.remote.refuse_unwritable()
            for split in SPLITS:  # the first document of each: an empty split is refused before any work
                if next(iter(self.corpus.documents(split)), None) is None:
                    hint = self.corpus.empty_split_hint()
                    raise DataError(f"corpus {self.corpus.name!r} has no {split} documents: check data.corpus{hint}")
            key = self.load_tokenizer()
        if not self.tokenizer_source:
            self._warn_of_a_smaller_vocabulary()
        self.shards = {split: self._prepare(split, key) for split in SPLITS}
        if self.remote:  # what this process made, for the other machines
            for relative in self._made:
                self.remote.push(self.cache_dir, relative)

    def _refuse_an_unwritable_cache(self) -> None:
        """A ConfigError unless this process can write in the cache (or, not made yet, in the folder it would be made
        in), checked by a file made and removed there: before the corpus is read, where something must be prepared.
        Nothing is left: a command refused after it leaves no cache."""
        try:
            with tempfile.NamedTemporaryFile(dir=nearest_existing(self.cache_dir), prefix=".lenext-write-check-"):
                pass
        except OSError as e:
            raise ConfigError(
                f"data.cache_dir={self.cache_dir!r} cannot be written ({e.strerror or type(e).__name__}): it lacks the "
                "prepared corpus, which is made or pulled there; give a folder this user can write (LENEXT_CACHE "
                "sets the default)"
            ) from None

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
        return f"{tokenizer_key}-{digest([self.corpus.fingerprint(), ENCODING])}"

    def _relative_folder(self, tokenizer_key: str, split: str) -> str:
        return f"shards/{self._shard_key(tokenizer_key)}/{split}"

    def _folder(self, tokenizer_key: str, split: str) -> str:
        return os.path.join(self.cache_dir, self._relative_folder(tokenizer_key, split))

    def _pull(self, relative: str) -> str:
        """The cache's path of ``relative``, pulled from ``data.remote`` first if the cache lacks it."""
        path = os.path.join(self.cache_dir, relative)
        if self.remote and not os.path.exists(path):  # pulled or made here: either writes the cache
            self._refuse_an_unwritable_cache()
            self.remote.pull_file(self.cache_dir, relative)
        return path

    def load_tokenizer(self, train: bool = True) -> str | None:
        """The tokenizer alone (``data.tokenizer``'s, else the BPE of the training split's first
        ``tokenizer_sample_mb``: reused from the cache, or, if ``train``, trained) and ``start_token``, every
        document's first; returns its cache key (None: not trained yet). The splits stay unread beyond the sample."""
        from tokenizers import Tokenizer

        if self.tokenizer_source:
            if self.tokenizer is None:
                self.tokenizer, self.start_token = external_tokenizer(self.tokenizer_source)
            key = f"{self.corpus.name}-{digest([self.tokenizer.to_str(), str(self.start_token)])}"
            self.tokenizer_path = os.path.join(self.cache_dir, "tokenizers", f"{key}.json")
            if not os.path.exists(self.tokenizer_path):  # the tokenizer the run used, kept beside lenext's own
                with atomic_path(self.tokenizer_path) as tmp:
                    self.tokenizer.save(tmp)
            return key

        def documents() -> Iterator[str]:  # read twice: to name the tokenizer, then (if new) to train it
            return sample(self.corpus.documents("train"), self.tokenizer_sample_mb)

        # The tokenizer is named by its training text; which text that is, the corpus's fingerprint says cheaply.
        source = [self.corpus.fingerprint(), str(self.tokenizer_sample_mb), str(self.requested_vocab)]
        index = self._pull(f"tokenizers/by_source/{digest(source)}.txt")
        key = _read_if_exists(index)
        if key is None or not os.path.exists(self._pull(f"tokenizers/{key}.json")):
            if not train:
                return None
            key = f"{self.corpus.name}-{digest(documents())}-v{self.requested_vocab}"
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

    def _warn_of_a_smaller_vocabulary(self) -> None:
        """A warning, in each run that loads it, where the BPE stopped short of ``data.vocab_size`` (its text had no
        pair left to merge): the model's vocabulary is what it learned, as the tokenizers library takes the size for
        a most, not the size asked for."""
        if self.vocab_size >= self.requested_vocab:
            return
        if self.tokenizer_sample_mb is None:
            text, more = "the whole training split", "a larger corpus would learn more"
        else:
            text = f"at most data.tokenizer_sample_mb={self.tokenizer_sample_mb} of the training split"
            more = (
                f"more text would learn more: a larger corpus, or a larger data.tokenizer_sample_mb where the training "
                f"split holds more than {self.tokenizer_sample_mb} MB"
            )
        log.warning(
            "data.vocab_size=%d: the BPE learned %s tokens from %s of %s (no pair left to merge): the model's "
            "vocabulary is %s tokens; %s",
            self.requested_vocab,
            f"{self.vocab_size:,}",
            text,
            self.corpus.name,
            f"{self.vocab_size:,}",
            more,
        )

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
                f"  {split}: {documents:,} documents, {tokens:,} tokens in {len(prepared.files)} "
                f"shard{'s' * (len(prepared.files) != 1)} ({where})"
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

    def train_windows(self) -> TrainWindows:
        """The training split's windows of data.max_len + 1 tokens, refused where they cannot fill a batch (checked
        by ``lenext.run.build`` before the model is built, once the data is loaded)."""
        windows = TrainWindows(self.stream("train"), self.max_len)
        if len(windows) < self.batch_size:
            raise DataError(
                f"the training split has {len(windows)} windows of data.max_len + 1 = {self.max_len + 1} tokens, "
                f"fewer than data.batch_size={self.batch_size}: use a shorter data.max_len or a larger corpus"
            )
        return windows

    def train_dataloader(self) -> DataLoader:
        return step_loader(self.train_windows(), self.batch_size, self.seed, self.trainer, self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self.document_loader("validation", self.max_len)

    def document_loader(self, split: str, length: int) -> DataLoader:
        windows = DocumentWindows(self.documents(split), length, self.validation_max_windows)
        if len(windows) == 0:
            raise DataError(f"no {split} document has {length + 1} tokens: use a shorter data.max_len")
        return evaluation_loader(windows, self.eval_batch_size, self.trainer, self.num_workers)
