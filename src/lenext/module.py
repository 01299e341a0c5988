"""The LightningModule: next-token loss, perplexity metrics, AdamW with warmup + cosine decay; and how checkpoints
are written (atomically, ``last.ckpt`` every validation, one on SIGTERM or Ctrl-C) with the state a resume needs."""

import math
import os
import signal
import sys
import threading
import time
from typing import Annotated

import lightning as L
import torch
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lenext.errors import SIGNAL_NAMES, LenextError, Stopped
from lenext.files import atomic_path
from lenext.hardware import warn_if_precision_is_slow
from lenext.loggers import CSVLogger
from lenext.model import Decoder
from lenext.positions import PositionScheme, training_positions, window_positions
from lenext.ranges import NonNegativeFloat, NonNegativeInt, PositiveFloat, Probability, Range
from lenext.scoring import AnswerMetrics, answers_per_sample, mean_metric, scored_targets, sum_metric


class NonFiniteLoss(LenextError):
    """Training produced a NaN or infinite loss."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written once, into a temporary file next to the target, then renamed: a run killed while
    saving leaves the previous complete checkpoint (or none), never a truncated one. Lightning's own save
    stages the whole checkpoint in $TMPDIR first (fsspec's transaction), which a small /tmp on a cluster node
    cannot hold; loading stays Lightning's."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r})")
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


class LastCheckpoint(ModelCheckpoint):
    """``<dirpath>/last.ckpt``, the resume point: after each validation while training, every
    ``every_n_train_steps`` steps if set, and where training ends. Three gaps of Lightning's ``save_last``, each a
    resumed or finished run that is not the uninterrupted one: it writes no "last" at a validation without another
    checkpoint beside it (a SIGKILL started the run over); a resume from a step's checkpoint written before that
    step's validation skips the validation (its metrics row, and a best.ckpt it would have written); and once a
    periodic one was written it writes none where training ends (last.ckpt stayed at step 50 of 60)."""

    def __init__(self, dirpath: str, every_n_train_steps: NonNegativeInt | None = None):
        # No version counter: a SIGTERM's last.ckpt, saved before this callback's first, is no other run's
        super().__init__(
            dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps, enable_version_counter=False
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loop = trainer.fit_loop
        if not loop.epoch_loop._should_check_val_fx(loop._data_fetcher):  # else written after the validation
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_last_unless_saved(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_last_unless_saved(trainer)

    def _save_last_unless_saved(self, trainer: L.Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # training only, once a step
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class CheckpointOnStop(L.Callback):
    """On SIGTERM (a cluster's pre-emption, scancel) or a first Ctrl-C, ``<dirpath>/last.ckpt`` where training
    stopped: Lightning stops the loop at a step boundary, so the same command resumes the run from there, as from any
    last.ckpt. Ctrl-C takes SIGTERM's path in a single process; a second Ctrl-C, or Ctrl-C under several processes
    (DDP: Lightning's SIGTERM path broadcasts from its signal handler and can hang the ranks), stops at once, from the
    last checkpoint written."""

    def __init__(self, dirpath: str):
        self.dirpath = dirpath
        self.signal: int | None = None  # the signal that stopped the run
        self.non_finite: NonFiniteLoss | None = None  # found by the stop's checkpoint: raised once Lightning cleaned up
        self.at_once = False  # by Ctrl-C reaching Lightning, not at a step boundary
        self._sigint_handler = None  # SIGINT's handler before this run's
        self._stop_deferred = False  # a stop asked for between the micro-batches of an optimizer step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.signal, self.at_once, self._stop_deferred, self.non_finite = None, False, False, None
        if trainer.world_size == 1 and threading.current_thread() is threading.main_thread():  # handlers run there
            self._sigint_handler = signal.signal(signal.SIGINT, self._stop_at_step_boundary)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._sigint_handler is not None:
            signal.signal(signal.SIGINT, self._sigint_handler)
            self._sigint_handler = None

    def _stop_at_step_boundary(self, signum: int, frame) -> None:
        lightnings = signal.getsignal(signal.SIGTERM)  # sets trainer.received_sigterm
        self._restore()  # a second Ctrl-C: at once
        if not callable(lightnings):  # before the Trainer registered it: stop now
            raise KeyboardInterrupt
        self.signal = signal.SIGINT
        print("stopping at the end of this step (Ctrl-C again: at once)", file=sys.stderr, flush=True)
        lightnings(signum, frame)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        # Lightning stops after any micro-batch: between those of one optimizer step, the resumed run would accumulate
        # out of step with its data. The stop waits for the step's last micro-batch.
        connector = trainer._signal_connector
        if connector.received_sigterm and trainer.fit_loop.epoch_loop._should_accumulate():
            connector.received_sigterm, self._stop_deferred = False, True
        elif self._stop_deferred:
            connector.received_sigterm = True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()  # Lightning calls no teardown hook after an exception
        # During fit only: a stop in the final validation leaves the last.ckpt training ended with.
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            try:
                trainer.save_checkpoint(os.path.join(self.dirpath, "last.ckpt"), weights_only=False)
            except NonFiniteLoss as error:  # raised here, it would cut short Lightning's cleanup (loggers, teardown)
                self.non_finite = error
        elif isinstance(exception, KeyboardInterrupt):  # Lightning then exits with status 1, saying nothing
            self.signal, self.at_once = signal.SIGINT, True

    def stopped(self, trainer: L.Trainer) -> Stopped:
        """What the command says when training stopped by a signal, and the exit status it stops with."""
        signum, last = self.signal or signal.SIGTERM, os.path.join(self.dirpath, "last.ckpt")
        at = f"at step {trainer.global_step} of {trainer.max_steps}"
        if not self.at_once:
            message = f"training stopped by {SIGNAL_NAMES[signum]} {at}; {last} holds it there"
        elif os.path.exists(last):
            message = f"training stopped at once by Ctrl-C {at}; {last} holds the last checkpoint written"
        else:
            message = f"training stopped at once by Ctrl-C {at}, before any checkpoint"
        return Stopped(
            f"{message}: run the same command to {'resume' if os.path.exists(last) else 'start again'}", signum
        )


# The names LanguageModel logs its metrics under (logged_metrics: every one, what a callback's monitor may name).
TRAIN_LOSS, VAL_LOSS, VAL_PPL, VAL_WINDOWS = "train/loss", "val/loss", "val/ppl", "val/windows"


def answer_metric(name: str) -> str:
    """The name a probe's validation logs its answer metric ``name`` (one of lenext.scoring.AnswerMetrics) under."""
    return f"val/{name}"


def logged_metrics(answers: bool) -> tuple[str, ...]:
    """Every name ``LanguageModel`` logs a metric under, a probe's answer metrics among them where its validation
    scores ``answers``: what a callback's ``monitor`` may name."""
    names = AnswerMetrics() if answers else {}
    return (TRAIN_LOSS, VAL_LOSS, VAL_PPL, VAL_WINDOWS, *map(answer_metric, names))


def random_state(device: torch.device) -> dict:
    """The global random state a step draws from (dropout's masks): the CPU's, and ``device``'s if a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_random_state(state: dict, device: torch.device) -> None:
    """``random_state``'s ``state`` set again (every rank takes rank 0's: seeded alike, they draw alike)."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def tokens_per_step(batch_size: int, max_len: int, accumulate: int, processes: int = 1) -> int:
    """Training tokens of one optimizer step: every process's batch of every accumulated micro-batch."""
    return batch_size * max_len * accumulate * processes


def processes_trained(tokens: int, steps: int, batch_size: int, max_len: int, accumulate: int) -> float:
    """The processes a run trained on (devices x nodes, which its settings do not say), from the tokens it trained
    in ``steps`` optimizer steps: a whole number unless the run's settings are not those it trained with."""
    return tokens / (steps * tokens_per_step(batch_size, max_len, accumulate))


def tokens_trained(trainer: L.Trainer, data: dict) -> int:
    """Training tokens after ``trainer.global_step`` optimizer steps, all ranks and accumulated batches together."""
    per_step = tokens_per_step(data["batch_size"], data["max_len"], trainer.accumulate_grad_batches, trainer.world_size)
    return trainer.global_step * per_step


class LanguageModel(L.LightningModule):
    """Trains a ``Decoder``; logs ``train/loss``, ``val/loss``, ``val/ppl`` (at L_train) and ``val/windows``.

    Batches are dicts: ``tokens`` (B, L+1) windows (inputs + shifted targets); for a probe
    (lenext.synthetic), ``answer`` (B, L), the answer each target belongs to (-1: neither scored nor
    trained on); in validation, ``window`` (document or sample, first token), which seeds the window's
    positions under randomized positions. Probes also log ``val/exact_match`` and ``val/token_accuracy``.

    ``run`` is the resolved run (``lenext.spec.RunSpec.stored()``), kept in checkpoints so ``eval.py`` and a
    second stage (``init_from``) rebuild the model without the original command line.
    """

    def __init__(
        self,
        net: Decoder,
        lr: PositiveFloat = 1e-3,
        weight_decay: NonNegativeFloat = 0.1,
        betas: tuple[Probability, Probability] = (0.9, 0.95),
        warmup_steps: NonNegativeInt = 100,
        min_lr_ratio: Annotated[float, Range(0, 1)] = 0.1,
        scheme: PositionScheme | None = None,
        seed: int = 0,
        run: dict | None = None,
        compile: bool = False,  # noqa: A002 (the switch's name in the config: module.compile)
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["net", "scheme"])
        self.net = net
        self.scheme = scheme or PositionScheme()  # the run's train.positions; seed: what draws them
        # Weighted by token count, synchronised across DDP ranks: each token counts once.
        self.val_nll = mean_metric()
        self.val_windows = sum_metric()
        self.val_answers = AnswerMetrics()  # probes: exact match, token accuracy
        self.train_seconds, self.train_tokens = 0.0, 0  # time inside training steps, for tokens/s (kept on resume)
        self._resumed_random_state = None  # a checkpoint's (on_load_checkpoint), until the first step sets it
        self.trained_on = None  # its data's identity (the data module's trained_on), kept in its checkpoints
        self._non_finite: tuple[torch.Tensor, torch.Tensor] | None = None  # (step, loss) of the first, on the device
        self._checked_at = -1  # the step whose losses were last checked

    def configure_model(self) -> None:
        """How the net runs, applied once per block before training (Lightning's hook): activations recomputed in
        the backward pass (``activation_checkpointing``), each block compiled (``compile``), then each block and
        the net sharded across the data-parallel ranks under ``trainer=fsdp`` (FSDP2, Lightning's
        ModelParallelStrategy). None of it changes what is computed."""
        if getattr(self, "_configured", False):
            return
        self._configured = True
        self.net.checkpoint_blocks = self.hparams.activation_checkpointing
        if self.hparams.compile:
            self.net.compile_blocks()
        if self.device_mesh is not None:
            shard(self.net, self.device_mesh["data_parallel"])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._stop_if_a_loss_was_not_finite()  # a checkpoint is never written from weights a bad step updated
        checkpoint["train_clock"] = {"seconds": self.train_seconds, "tokens": self.train_tokens}
        checkpoint["random_state"] = random_state(self.device)  # dropout's: a resumed run draws the same masks
        if self.trained_on:
            checkpoint["trained_on"] = self.trained_on
        if self.hparams.run:  # kept for eval.py's results files and a later stage's lineage
            checkpoint["tokens_trained"] = tokens_trained(self.trainer, self.hparams.run["config"]["data"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # FIRE's scalar parameters became one-element vectors (FSDP shards no scalar): so does their AdamW state.
        for optimizer in checkpoint.get("optimizer_states", []):
            for state in optimizer.get("state", {}).values():
                for name in ("exp_avg", "exp_avg_sq"):
                    if isinstance(state.get(name), torch.Tensor) and state[name].dim() == 0:
                        state[name] = state[name].reshape(1)
        # A resumed run's tokens/s covers all of its training, the steps before the resume included.
        clock = checkpoint.get("train_clock", {})
        self.train_seconds, self.train_tokens = clock.get("seconds", 0.0), clock.get("tokens", 0)
        # Set at the first step: between here and there, the resumed run draws what the uninterrupted one did not.
        self._resumed_random_state = checkpoint.get("random_state")
        for logger in self._trainer.loggers if self._trainer else []:
            if isinstance(logger, CSVLogger):  # metrics.csv keeps the rows of the steps the checkpoint holds
                logger.resume_at(checkpoint.get("global_step", 0))

    def on_fit_start(self) -> None:
        warn_if_precision_is_slow(self.trainer.precision, self.device)

    def on_train_start(self) -> None:
        self._non_finite, self._checked_at = None, -1

    def on_train_end(self) -> None:
        self._stop_if_a_loss_was_not_finite()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._resumed_random_state is not None:
            set_random_state(self._resumed_random_state, self.device)
            self._resumed_random_state = None
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.net.pe.project_()  # after the optimizer step: learned PE parameters back in their domain
        self.train_seconds += time.perf_counter() - self._step_started
        self.train_tokens += batch["tokens"][:, 1:].numel()
        every = self.trainer.log_every_n_steps  # 0: no logging, and a check at checkpoints and the end only
        if every and self.global_step != self._checked_at and self.global_step % every == 0:
            self._stop_if_a_loss_was_not_finite()  # at the steps whose losses the loggers read anyway

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.net.logits(self.net(tokens, positions))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        micro = batch_idx % self.trainer.accumulate_grad_batches  # the micro-batch within the optimizer step
        tokens = batch["tokens"]
        positions = training_positions(
            self.scheme,
            tokens.size(0),
            tokens.size(1) - 1,
            self.hparams.seed,
            self.global_rank,
            self.global_step,
            micro,
        )
        loss = scored_targets(self.net, batch, positions).mean()
        self._note_if_not_finite(loss)
        # The global batch's, not rank 0's share. On a progress bar only where there is one: Lightning turns the
        # bar's values into numbers every step, a wait for the GPU.
        on_bar = self.trainer.progress_bar_callback is not None
        self.log(TRAIN_LOSS, loss, prog_bar=on_bar, sync_dist=True)
        return loss

    def _note_if_not_finite(self, loss: torch.Tensor) -> None:
        """Keeps the step and value of the first loss that is not finite, on the loss's device: testing it on the
        host here would make the host wait for the GPU at every step."""
        if self._non_finite is None:
            self._non_finite = (torch.full((), -1, device=loss.device), torch.zeros((), device=loss.device))
        step, value = self._non_finite
        first = ~torch.isfinite(loss.detach()) & (step < 0)
        value = torch.where(first, loss.detach().float(), value)
        # the optimizer step this loss belongs to, counted from 1 as the progress lines count them
        self._non_finite = (torch.where(first, self.global_step + 1, step), value)

    def _stop_if_a_loss_was_not_finite(self) -> None:
        """Raises NonFiniteLoss naming the first step, of any rank, whose training loss was not finite. Every rank
        calls it at the same steps (the gather is a collective) and stops with the others."""
        self._checked_at = self.global_step
        if self._non_finite is None:
            return
        steps, values = (self.all_gather(t).reshape(-1) for t in self._non_finite)
        if not bool((steps >= 0).any()):
            return
        first = int(torch.where(steps >= 0, steps, steps.max() + 1).argmin())
        callback = self.trainer.checkpoint_callback
        last = callback and callback.dirpath and os.path.join(callback.dirpath, "last.ckpt")
        kept = (
            "its last good checkpoint is checkpoints/last.ckpt"
            if last and os.path.exists(last)
            else "it had written no checkpoint yet"
        )
        fp32 = self.trainer.precision == "32-true"
        advice = "Lower module.lr" + ("" if fp32 else " or try trainer.precision=32-true")
        raise NonFiniteLoss(
            f"the training loss became {values[first].item()} at step {int(steps[first])}; the run stopped and "
            f"{kept}. {advice}"
        )

    def on_validation_epoch_start(self) -> None:
        if self.trainer.state.fn == "fit":  # no validation of weights a bad step updated
            self._stop_if_a_loss_was_not_finite()
        # reset() gives each process state tensors of its own: ddp_spawn (trainer.strategy=ddp_spawn) shares the
        # module's CPU tensors between the processes it starts, metric states included, so ranks would add into each
        # other's sums.
        for metric in (self.val_nll, self.val_windows, self.val_answers):
            metric.reset()

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        counted = batch.pop("counted")  # False: a repeat that evens out the ranks' shares (lenext.data)
        if "answer" in batch:
            batch["answer"] = batch["answer"].masked_fill(~counted[:, None], -1)
        tokens = batch["tokens"]
        windows = [tuple(w) for w in batch["window"].tolist()]
        positions = window_positions(self.scheme, tokens.size(1) - 1, self.hparams.seed, windows)
        if "answer" in batch:  # a probe: its answers alone, as the sweep's accuracy rows score them
            nll, predicted, targets = scored_targets(self.net, batch, positions, predictions=True)
            if nll.numel():
                _, span = answers_per_sample(batch["answer"])
                self.val_answers.update(predicted.view(-1, span), targets.view(-1, span))
        else:
            nll = scored_targets(self.net, batch, positions)[counted]
        if nll.numel():
            self.val_nll.update(nll.mean(), weight=nll.numel())
        self.val_windows.update(int(counted.sum()))

    def on_validation_epoch_end(self) -> None:
        loss, windows = self.val_nll.compute(), self.val_windows.compute()
        self.log(VAL_LOSS, loss, prog_bar=True, sync_dist=False)
        self.log(VAL_PPL, torch.exp(loss), prog_bar=True, sync_dist=False)
        # What the perplexity covers, all ranks together (a logged metric reaches the caller under ddp_spawn too).
        self.log(VAL_WINDOWS, windows, sync_dist=False)
        # A probe's accuracy, when any rank scored answers (compute() syncs: every rank must call it, or none).
        if self.trainer.strategy.reduce_boolean_decision(bool(self.val_answers["exact_match"].update_count), all=False):
            self.log_dict(
                {answer_metric(k): v for k, v in self.val_answers.compute().items()}, prog_bar=True, sync_dist=False
            )

    def configure_optimizers(self):
        total = max(1, int(self.trainer.estimated_stepping_batches))
        hp = self.hparams
        optimizer, scheduler = adamw_with_schedule(
            self.net, total, hp.lr, hp.weight_decay, tuple(hp.betas), hp.warmup_steps, hp.min_lr_ratio
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        precision = self.trainer.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is None and gradient_clip_val:
            # Lightning refuses to clip for a fused optimizer under any autocast, though only a gradient scaler's
            # unscaling moves into the step (Lightning-AI/pytorch-lightning#21435); bf16 autocast has no scaler.
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(precision, optimizer, gradient_clip_val, algorithm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def shard(net: Decoder, mesh) -> None:
    """FSDP2 over ``mesh``: each block's parameters, gradients and optimizer state split across its ranks and
    gathered while the block runs; the rest (embedding, head, PE tables) as one more group."""
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def adamw(params, **settings) -> torch.optim.AdamW:
    """AdamW as lenext trains with it: torch's fused kernel where every parameter is on a device that has one, one
    pass over each tensor (on a CPU, torch's default otherwise is a loop of a dozen operations per tensor)."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return torch.optim.AdamW(params, fused=all(p.device.type in FUSED_ADAMW_DEVICES for p in tensors), **settings)


def adamw_with_schedule(
    net: nn.Module,
    total_steps: int,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    min_lr_ratio: float,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its per-step schedule: linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``.

    A function of its own so that scripts/bench.py's bare loop optimizes exactly as training does.
    """
    # Decay only matrix weights of linear layers; norms, biases, embeddings and PE tables are exempt.
    linear_weights = {id(m.weight) for m in net.modules() if isinstance(m, nn.Linear)}
    decay = [p for p in net.parameters() if id(p) in linear_weights]
    no_decay = [p for p in net.parameters() if id(p) not in linear_weights]
    optimizer = adamw(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
    )

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
