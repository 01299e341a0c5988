"""Shared fixtures: composed configs (as lightning-hydra-template does) and one tokenized corpus."""

import os

import pytest
from hydra import compose, initialize_config_dir

from lenext.cli import CONFIG_DIR
from lenext.data import LMDataModule, Sotu

TEST_VOCAB = 512


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Tokenizers and tokenized corpora shared by the whole session (trained once, ~15 s)."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def sotu_data(cache_dir) -> LMDataModule:
    data = LMDataModule(Sotu(), max_len=32, vocab_size=TEST_VOCAB, batch_size=4, cache_dir=cache_dir)
    data.load()
    return data


@pytest.fixture
def compose_train(tmp_path, cache_dir):
    """compose_train(*overrides) -> the train config, with paths inside tmp_path and the shared cache."""

    def _compose(*overrides: str):
        paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}", f"paths.cache_dir={cache_dir}"]
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose("train", overrides=[*paths, *overrides])

    return _compose


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


def pytest_configure(config):
    os.environ.setdefault("WANDB_MODE", "offline")
