"""Shared fixtures: composed configs (as lightning-hydra-template does) and one tokenized corpus."""

import atexit
import itertools
import os
import shutil
import tempfile

# transformers copies a remote-code model's files here (lenext's exports): one folder per test process, not ~/.cache,
# removed when the process ends.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
from importlib import resources
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from lenext.cli import CONFIG_PACKAGE
from lenext.data import LMDataModule, Sotu
from lenext.hardware import COMPILED_PATHS_TORCH
from tests import forked
from tests.forked import ROOT, run_command  # noqa: F401 - ROOT: the repository, for the tests

TEST_VOCAB = 512


def transformers_runs_torch() -> bool:
    """Whether transformers runs PyTorch models here: it turns PyTorch off below the torch it needs (transformers 5:
    torch 2.6), which lenext's own code does not need (it takes torch 2.4)."""
    from transformers.utils import is_torch_available

    return is_torch_available()


# Tests whose oracle or subject is a transformers model (lenext refuses such work on an older torch: tests/test_hf.py)
needs_transformers_models = pytest.mark.skipif(
    not transformers_runs_torch(), reason=f"transformers runs no PyTorch model on torch {torch.__version__}"
)
# lenext's compiled paths (FlexAttention, module.compile=true, trainer=fsdp): refused or not taken on an older torch
needs_compiled_paths_torch = pytest.mark.skipif(
    torch.__version__ < COMPILED_PATHS_TORCH, reason=f"not taken on torch {torch.__version__} (lenext.hardware)"
)
CONFIG_FOLDER = Path(str(resources.files(CONFIG_PACKAGE)))  # the package's configs, as files


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Tokenizers and tokenized corpora shared by the whole session (trained once, ~15 s)."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def sotu_data(cache_dir) -> LMDataModule:
    data = LMDataModule(Sotu(), max_len=32, vocab_size=TEST_VOCAB, batch_size=4, cache_dir=cache_dir)
    data.load()
    return data


@pytest.fixture(scope="module")
def compose_run(tmp_path_factory, cache_dir, small_text_corpus):
    """compose_run(folder name, *overrides) -> a train config on the small corpus writing into its own folder of a
    module-wide root (``compose_run.root``): the second-stage tests' runs and their bases."""
    root = tmp_path_factory.mktemp("stages")

    def _compose(name: str, *overrides: str):
        paths = [f"paths.root_dir={root}", f"paths.output_dir={root / name}", f"paths.cache_dir={cache_dir}"]
        with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
            return compose("train", overrides=[*paths, *small_corpus_overrides(small_text_corpus, *overrides)])

    _compose.root = root
    return _compose


@pytest.fixture
def compose_train(tmp_path, cache_dir):
    """compose_train(*overrides) -> the train config, with paths inside tmp_path and the shared cache."""

    def _compose(*overrides: str):
        paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}", f"paths.cache_dir={cache_dir}"]
        with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
            return compose("train", overrides=[*paths, *overrides])

    return _compose


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_text_corpus, cache_dir):
    """A tiny RoPE run of 2 steps at L_train 32, no sweep: its folder."""
    from lenext.run import train

    folder = tmp_path_factory.mktemp("run")
    overrides = small_corpus_overrides(small_text_corpus, "pe=rope", "trainer.max_steps=2", "eval.enabled=false")
    paths = [f"paths.root_dir={folder}", f"paths.output_dir={folder}", f"paths.cache_dir={cache_dir}"]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        train(compose("train", overrides=[*paths, *overrides]))
    return folder


@pytest.fixture(scope="session")
def small_text_corpus(tmp_path_factory):
    """Twelve real addresses as a text_files corpus (3 validation documents): seconds to train and evaluate."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(itertools.islice(Sotu().documents("train"), 12)):
        (folder / f"{i:02d}.txt").write_text(text)
    return folder


def small_corpus_overrides(folder, *extra: str) -> list[str]:
    """tiny_overrides on the small text corpus, with a short evaluation."""
    return tiny_overrides(
        "data=text_files",
        f"data.corpus.path={folder}",
        "data.corpus.holdout_every=4",
        "trainer.enable_progress_bar=false",
        *extra,
    )


def tiny_overrides(*extra: str) -> list[str]:
    """A tiny model on short windows with the test vocabulary: seconds per run on CPU."""
    return [
        "model=tiny",
        f"data.vocab_size={TEST_VOCAB}",
        "data.max_len=32",
        "data.batch_size=4",
        "trainer=cpu",
        *extra,
    ]


def hidden_keys(length: int, window: int | None = None) -> torch.Tensor:
    """(L, L) bool: True where query i does not see key j (j > i, or j <= i - window): the references' mask."""
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
    return hidden if window is None else hidden | torch.ones(length, length, dtype=torch.bool).tril(-window)


def pytest_configure(config):
    os.environ.setdefault("WANDB_MODE", "offline")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each worker by `pytest -n`
    if workers > 1:
        # The cores shared among the workers: more torch threads than cores makes OpenMP spin, many times slower.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the subprocesses a test starts
        torch.set_num_threads(threads)
    forked.freeze_environment()


def run_train(tmp_path, *overrides, env=None, set_root=True):
    """`python train.py <overrides>` as a user runs it, from tmp_path; LENEXT_ROOT=tmp_path unless set_root=False
    (forked from a process that has imported lenext: tests/forked.py)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    environment.pop("HYDRA_FULL_ERROR", None)
    environment.pop("LENEXT_ROOT", None)
    if set_root:
        environment["LENEXT_ROOT"] = str(tmp_path)
    return run_command("train.py", overrides, environment, tmp_path)
