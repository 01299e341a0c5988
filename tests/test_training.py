"""A short real training run learns: validation perplexity falls far below the uniform baseline."""

import pandas as pd
import pytest
import torch

from lenext.module import logged_metrics
from lenext.run import build, train
from lenext.run_folder import resolve_training
from tests.conftest import TEST_VOCAB, small_corpus_overrides, tiny_overrides


def test_short_training_beats_uniform_baseline_by_4x(compose_train, tmp_path):
    cfg = compose_train(
        *tiny_overrides(
            "pe=rope",
            "data.max_len=64",
            "data.batch_size=16",
            "trainer.max_steps=200",
            "trainer.val_check_interval=200",
            "trainer.limit_val_batches=40",
            "eval.enabled=false",
            "module.lr=3e-3",
            "module.warmup_steps=20",
            "trainer.enable_progress_bar=false",
        )
    )
    metrics = train(cfg)
    # Uniform guessing scores a perplexity of TEST_VOCAB (512); 200 steps of the tiny model reach ~75.
    assert metrics["val/ppl"] < TEST_VOCAB / 4
    assert (tmp_path / "checkpoints" / "last.ckpt").exists() and (tmp_path / "checkpoints" / "best.ckpt").exists()
    assert (tmp_path / "csv" / "metrics.csv").read_text().count("train/loss") == 1


@pytest.mark.parametrize("filename", ["best", "best-{epoch}-{step}"])
def test_a_run_shorter_than_its_validation_interval_writes_best_ckpt(filename, compose_train, tmp_path):
    """best.ckpt (the lowest val/loss) is written by the validations during training: a run of fewer steps than
    trainer.val_check_interval, which never validated while training, keeps its final weights as best.ckpt,
    validated once (at its end), named as the callback names its checkpoints (a user's fields filled)."""
    cfg = compose_train(
        *tiny_overrides(
            "trainer.max_steps=4", "trainer.val_check_interval=250", "trainer.limit_val_batches=2", "eval.enabled=false"
        ),
        f"callbacks.best_checkpoint.filename='{filename}'",
    )
    train(cfg)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    written = filename.format(epoch=last["epoch"], step=last["global_step"]) + ".ckpt"
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == sorted([written, "last.ckpt"])
    best = torch.load(tmp_path / "checkpoints" / written, map_location="cpu", weights_only=False)
    assert best["global_step"] == 4
    logged = pd.read_csv(tmp_path / "csv" / "metrics.csv")
    assert logged.dropna(subset=["val/loss"]).step.tolist() == [4]


def test_tokens_trained_counts_every_rank_and_accumulated_batch():
    from types import SimpleNamespace

    from lenext.module import tokens_trained

    trainer = SimpleNamespace(global_step=10, accumulate_grad_batches=4, world_size=2)
    assert tokens_trained(trainer, {"batch_size": 8, "max_len": 64}) == 10 * 8 * 64 * 4 * 2


PASSKEY = ["data=synthetic", "data.task=passkey", "data.digits=3", "data.max_len=16", "data.eval_samples=16"]


@pytest.mark.parametrize("probe", [False, True])
def test_logged_metrics_are_every_metric_a_run_logs(compose_train, small_text_corpus, probe):
    """What a callback's monitor is checked against before any work (lenext.module.logged_metrics) is what
    training and validation log, a probe's answer metrics included."""
    data = [*PASSKEY, "model=tiny", "trainer=cpu"] if probe else small_corpus_overrides(small_text_corpus)
    cfg = compose_train(*data, "trainer.max_steps=2", "trainer.val_check_interval=2", "eval.enabled=false")
    datamodule, module, trainer = build(cfg, resolve_training(cfg)[0])
    trainer.fit(module, datamodule=datamodule)
    assert sorted(trainer.callback_metrics) == sorted(logged_metrics(answers=probe))
