"""Corpora, tokenizer, caches and windows."""

import json
import os
import signal
import types
import typing

import numpy as np
import pytest
import torch

import lenext.data.datamodule
import lenext.data.loaders
import lenext.data.tokenizer
from lenext.data import HubCorpus, LMDataModule, Sotu, TextFiles
from lenext.data.corpus import SPLITS
from lenext.data.loaders import DocumentWindows, TrainWindows
from lenext.errors import DataError
from tests.conftest import TEST_VOCAB


def test_sotu_splits_are_disjoint_whole_documents_held_out_by_year():
    corpus = Sotu()
    docs = {split: list(corpus.documents(split)) for split in ("train", "validation", "test")}
    assert len(docs["train"]) > 150 and len(docs["validation"]) >= 20 and len(docs["test"]) >= 20
    sets = {split: set(d) for split, d in docs.items()}
    assert not sets["train"] & sets["validation"] and not sets["train"] & sets["test"]
    assert not sets["validation"] & sets["test"]
    assert [corpus.split_of(y) for y in (1795, 1800, 1801)] == ["validation", "test", "train"]


def test_held_out_splits_keep_documents_long_enough_for_32x_evaluation(sotu_data):
    # L_train 512 x 32 = 16k tokens must fit inside single validation and test documents.
    for split in ("validation", "test"):
        assert sum(len(d) > 16385 for d in sotu_data.documents(split)) >= 2


@pytest.mark.parametrize("text", ["The Congress shall assemble.", "café — “quotes” 1,234.5\n\n  tabs\t", "日本"])
def test_tokenizer_round_trips(sotu_data, text):
    ids = sotu_data.tokenizer.encode(text).ids
    assert sotu_data.tokenizer.decode(ids) == text
    assert sotu_data.vocab_size == TEST_VOCAB


def test_caches_are_reused_without_retraining(sotu_data, cache_dir, monkeypatch):
    files = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs}

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(lenext.data.datamodule, "train_tokenizer", no_training)
    again = LMDataModule(Sotu(), max_len=32, vocab_size=TEST_VOCAB, cache_dir=cache_dir)
    again.load()
    after = {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs}
    assert after == files  # nothing rewritten: the splits came from their token shards
    for split in SPLITS:
        assert all(
            np.array_equal(a, b) for a, b in zip(again.documents(split), sotu_data.documents(split), strict=True)
        )


def test_documents_start_with_eos_and_train_stream_holds_only_train_tokens(sotu_data):
    eos = sotu_data.tokenizer.token_to_id(lenext.data.tokenizer.EOS)
    for split in SPLITS:
        assert all(d[0] == eos and (d[1:] != eos).all() for d in sotu_data.documents(split))
    stream = sotu_data.stream("train")[:]
    assert np.array_equal(stream, np.concatenate(sotu_data.documents("train")))
    assert (stream == eos).sum() == len(sotu_data.documents("train"))


def test_train_windows_are_consecutive_slices_with_shifted_targets():
    stream = np.arange(100, dtype=np.int32)
    windows = TrainWindows(stream, 8)
    assert len(windows) == 12  # (100 - 1) // 8
    assert windows[0]["tokens"].tolist() == list(range(9)) and windows[11]["tokens"].tolist() == list(range(88, 97))


def test_document_windows_stay_inside_one_document_and_score_each_token_once():
    docs = [np.arange(0, 21, dtype=np.int32), np.arange(100, 105, dtype=np.int32), np.arange(200, 217, dtype=np.int32)]
    windows = DocumentWindows(docs, 4)
    targets = [tuple(windows[i]["tokens"][1:].tolist()) for i in range(len(windows))]
    # doc 0: 20 targets -> 5 windows; doc 1: 4 targets -> 1 window; doc 2: 16 targets -> 4 windows
    assert len(windows) == 10
    flat = [t for window in targets for t in window]
    assert len(flat) == len(set(flat))  # each target token once
    assert set(flat) == set(range(1, 21)) | set(range(101, 105)) | set(range(201, 217))
    for i in range(len(windows)):
        window = windows[i]["tokens"].tolist()
        assert len({v // 100 for v in window}) == 1  # never crosses a document
        document, start = windows[i]["window"].tolist()  # its identity: the document and first token
        assert window == docs[document][start : start + 5].tolist()


def test_text_files_corpus_reads_txt_and_jsonl_and_holds_out_round_robin(tmp_path):
    for i in range(8):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 5, encoding="utf-8-sig" if i == 0 else "utf-8")
    lines = "\n".join(json.dumps({"text": f"line doc {i}"}) for i in range(4))
    (tmp_path / "more.jsonl").write_text(lines, encoding="utf-8-sig")  # a byte order mark before the first line
    corpus = TextFiles(str(tmp_path), holdout_every=4)
    splits = {s: list(corpus.documents(s)) for s in ("train", "validation", "test")}
    assert [len(v) for v in splits.values()] == [6, 3, 3]
    assert sum(splits.values(), []).count("line doc 0") == 1
    assert sum(splits.values(), []).count("document number 0 " * 5) == 1  # its byte order mark is no text


def test_empty_text_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"no .txt, .jsonl, .parquet files"):
        list(TextFiles(str(tmp_path)).documents("train"))


def test_hub_corpus_groups_wikitext_articles_from_a_local_dataset_of_the_same_schema(tmp_path):
    lines = [
        " \n",
        " = Alpha = \n",
        " \n",
        " Alpha text . \n",
        " = = Section = = \n",
        " more alpha . \n",
        " = Beta = \n",
        " Beta text . \n",
    ]
    files = {}
    for split in ("train", "validation", "test"):
        files[split] = str(tmp_path / f"{split}.jsonl")
        with open(files[split], "w") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    corpus = HubCorpus("json", data_files=files, wikitext_articles=True)
    articles = list(corpus.documents("validation"))
    assert len(articles) == 2
    assert articles[0].startswith(" = Alpha = ") and "Section" in articles[0] and "more alpha" in articles[0]
    assert articles[1] == " = Beta = \n Beta text . \n"


def test_hub_corpus_one_document_per_row_as_in_pg19(tmp_path):
    path = tmp_path / "books.jsonl"
    path.write_text("\n".join(json.dumps({"short_book_title": f"B{i}", "text": f"book {i} text"}) for i in range(3)))
    corpus = HubCorpus("json", data_files={"train": str(path)}, split_names={"validation": "train", "test": "train"})
    assert list(corpus.documents("test")) == ["book 0 text", "book 1 text", "book 2 text"]


def test_corpus_with_an_empty_split_fails_before_tokenizing(tmp_path):
    (tmp_path / "only.txt").write_text("just one document")
    data = LMDataModule(TextFiles(str(tmp_path), holdout_every=3), cache_dir=str(tmp_path / "cache"))
    message = r"no validation documents: check data.corpus \(data.corpus.path='.*': of every data.corpus.holdout_e"
    with pytest.raises(DataError, match=message):
        data.load()


class SampleIds(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> int:
        return i


def loader_order(step: int, accumulate: int, world: int = 1, rank: int = 0) -> list[list[int]]:
    """The batches ``step_loader`` gives a trainer at ``step`` of 30 optimizer steps (batch 4)."""
    trainer = types.SimpleNamespace(
        global_step=step, max_steps=30, accumulate_grad_batches=accumulate, world_size=world, global_rank=rank
    )
    return [batch.tolist() for batch in lenext.data.loaders.step_loader(SampleIds(), 4, 0, trainer, 0)]


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_training_reads_every_batch_of_each_optimizer_step_once_and_resumes_after_them(accumulate):
    """With gradient accumulation an optimizer step takes ``accumulate`` batches: a run reads max_steps of them
    each, every 37 samples a permutation, and one resumed at step s reads on from batch s * accumulate (the loader
    had counted batches as steps: 30 batches for 30 steps of 2, resumed into batches it had read)."""
    whole = loader_order(0, accumulate)
    assert len(whole) == 30 * accumulate
    samples = [i for batch in whole for i in batch]
    assert all(sorted(samples[e * 37 : (e + 1) * 37]) == list(range(37)) for e in range(len(samples) // 37))
    for step in (1, 7, 29):
        assert loader_order(step, accumulate) == whole[step * accumulate :]
    ranks = [loader_order(0, accumulate, world=2, rank=r) for r in (0, 1)]
    assert len(ranks[0]) == 30 * accumulate and not set(ranks[0][0]) & set(ranks[1][0])


class WorkerSignalHandlers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {
            "ignored": torch.tensor([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGINT)])
        }


def test_loader_workers_ignore_the_signals_that_stop_a_run():
    """scancel and Ctrl-C signal the whole process group: a worker that died of it took the run's stop at its
    step boundary (and its last.ckpt, or a traceback beside it) with it. Workers ignore both; the main process
    ends them."""
    trainer = types.SimpleNamespace(global_step=0, max_steps=2, accumulate_grad_batches=1, world_size=1, global_rank=0)
    loaders = (
        lenext.data.loaders.step_loader(WorkerSignalHandlers(), 4, 0, trainer, num_workers=1),
        lenext.data.loaders.evaluation_loader(WorkerSignalHandlers(), 4, None, num_workers=1),
    )
    for loader in loaders:
        assert all(batch["ignored"].all() for batch in loader)
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # the main process keeps its handlers


def test_the_tokenizer_sample_is_bounded_in_bytes_of_text():
    """data.tokenizer_sample_mb counts UTF-8 bytes: 400 CJK characters are 1,200 bytes, so a 1,000-byte bound takes
    the first document, the one that crosses it (characters had taken three)."""
    documents = ["日" * 400] * 5
    assert len(list(lenext.data.tokenizer.sample(documents, 0.001))) == 1
    assert len(list(lenext.data.tokenizer.sample(["a" * 400] * 5, 0.001))) == 3
    assert len(list(lenext.data.tokenizer.sample(documents, None))) == 5


def test_a_tokenizer_json_alone_starts_documents_with_its_end_of_text_as_a_file_or_in_a_folder(tmp_path):
    """A folder of a tokenizer.json without a config naming BOS/EOS (it was refused) takes the file's rule."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lenext.data.tokenizer import external_tokenizer

    vocab = {"<unk>": 0, "a": 1, "</s>": 2, "b": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "folder").mkdir()
    tokenizer.save(str(tmp_path / "folder" / "tokenizer.json"))
    _, from_file = external_tokenizer(str(tmp_path / "folder" / "tokenizer.json"))
    loaded, from_folder = external_tokenizer(str(tmp_path / "folder"))
    assert from_file == from_folder == 2 and loaded.encode("a b", add_special_tokens=False).ids == [1, 3]


def test_a_folder_of_the_corpus_that_cannot_be_read_is_named_not_passed_over(tmp_path, monkeypatch):
    """glob leaves out a folder it cannot list, and the documents in it: the corpus would shrink without a word. A
    path that does not exist is said to be missing."""
    (tmp_path / "sub").mkdir()
    for folder in (tmp_path, tmp_path / "sub"):
        (folder / "doc.txt").write_text("a document")
    scandir = os.scandir

    (tmp_path / ".hidden").mkdir()  # glob's ** never reads a hidden folder: one that cannot be read is no error

    def unreadable(path="."):
        if os.fspath(path) == str(tmp_path / ".hidden"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        if os.fspath(path) == str(tmp_path / "sub") and unread_sub:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    unread_sub = False
    monkeypatch.setattr(os, "scandir", unreadable)
    assert len(TextFiles(str(tmp_path)).files) == 2
    unread_sub = True
    message = rf"^data.corpus.path: the folder {tmp_path / 'sub'} cannot be read: Permission denied; fix or remove it$"
    with pytest.raises(DataError, match=message):
        list(TextFiles(str(tmp_path)).documents("train"))
    with pytest.raises(DataError, match=rf"^data.corpus.path='{tmp_path / 'nowhere'}' does not exist"):
        list(TextFiles(str(tmp_path / "nowhere")).documents("train"))


def test_the_smallest_vocabulary_allowed_is_the_one_trained():
    """data.vocab_size counts the 256 bytes and EOS: its lower bound, 257, is a tokenizer of exactly 257 tokens
    (256 gave 257), and every size above it is the size asked for."""
    from lenext.data.tokenizer import train_tokenizer

    documents = [" ".join(f"word{i * j}" for j in range(200)) for i in range(20)]
    (bounds,) = typing.get_type_hints(LMDataModule.__init__, include_extras=True)["vocab_size"].__metadata__
    lowest = int(bounds.low)
    for size in (lowest, lowest + 40):
        assert train_tokenizer(documents, size).get_vocab_size() == size
