"""A short real training run learns: validation perplexity falls far below the uniform baseline."""

import math

import lightning as L
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


def test_adamw_with_schedule_is_the_papers_update_in_float64():
    """Training's optimizer, torch's fused AdamW under lenext's schedule, against AdamW written out (Loshchilov &
    Hutter 2019, Algorithm 2, with torch's decay of lr x wd x p) in float64: linear warmup over ``warmup_steps``,
    cosine decay to ``min_lr_ratio`` x lr at ``total_steps`` and held there; weight decay on linear weights only."""
    from lenext.module import adamw_with_schedule

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3)).double()
    lr, wd, (b1, b2), eps, warmup, total, floor = 0.1, 0.3, (0.8, 0.95), 1e-8, 3, 8, 0.2
    optimizer, scheduler = adamw_with_schedule(net, total, lr, wd, (b1, b2), warmup, floor)
    assert all(group["fused"] for group in optimizer.param_groups)
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in params.items()}
    for step in range(12):  # past total_steps: the rate stays at its floor
        grads = {name: torch.randn_like(p) for name, p in params.items()}
        for name, p in net.named_parameters():
            p.grad = grads[name].clone()
        optimizer.step()
        scheduler.step()
        progress = min(1.0, (step - warmup) / (total - warmup))
        rate = lr * (
            (step + 1) / warmup if step < warmup else floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
        )
        for name, p in params.items():
            m, v = moments[name]
            m.mul_(b1).add_((1 - b1) * grads[name])
            v.mul_(b2).add_((1 - b2) * grads[name] ** 2)
            decay = wd if name == "2.weight" else 0.0
            p.mul_(1 - rate * decay)
            p.sub_(rate * (m / (1 - b1 ** (step + 1))) / ((v / (1 - b2 ** (step + 1))).sqrt() + eps))
        for name, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), params[name], rtol=1e-12, atol=1e-12, msg=f"{name} at step {step}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_training_clips_gradients_under_the_fused_adamw_in_every_precision(compose_train, precision):
    """Lightning refuses gradient clipping for a fused optimizer under autocast (its check is for a gradient
    scaler, which bf16 has none of): lenext clips in both precisions, every step, to ``trainer.gradient_clip_val``."""
    cfg = compose_train(
        *tiny_overrides("trainer.max_steps=3", "eval.enabled=false", "trainer.gradient_clip_val=1e-3"),
        f"trainer.precision={precision}",
    )
    datamodule, module, trainer = build(cfg, resolve_training(cfg)[0])
    norms = []

    class AfterEachStep(L.Callback):
        def on_train_start(self, trainer, module):
            (optimizer,) = trainer.optimizers
            assert optimizer.defaults["fused"]
            # After the step: the gradients the step took, clipped (a pre-hook runs before the closure's backward).
            optimizer.register_step_post_hook(
                lambda optimizer, args, kwargs: norms.append(
                    torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])).item()
                )
            )

    trainer.callbacks.append(AfterEachStep())
    trainer.fit(module, datamodule=datamodule)
    assert len(norms) == 3 and all(norm == pytest.approx(1e-3, rel=1e-3) for norm in norms), norms
