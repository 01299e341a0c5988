"""Where a run and a study stand, said on the console.

``StudyProgress``, a Hydra callback (configs/hydra/default.yaml): after each job of a multirun,
`study: job n of N done (...); ~T left`. With the basic launcher every job runs in the process that
launched the sweep, so the callback sees the whole sweep: N is the size of the sweep's grid, and the
time left is the mean wall time of the jobs that trained (skipped ones, whose results were already
complete, take seconds, and failed ones stop at any point: either would make the estimate meaningless)
times the jobs left. Launchers that run jobs elsewhere (submitit; joblib, hydra/launcher=parallel) hand each
job a copy of this callback as it was at launch, so there the line gives only the job's own number, and at the
sweep's end the launching process counts the error.txt files its jobs wrote.

``TrainingProgress``, a Lightning callback (configs/callbacks/default.yaml): while a run trains without
a progress bar (the study presets turn it off), a line at every tenth of its steps and at least every
30 s: `step n of N: loss, tokens/s; training ~T left; study ~T left`. With a bar, ``StepsBar``: Lightning's,
counting steps (a run is bounded by steps, not epochs).

After a run: what validation measured (``validation_scope``), and where the run went and what to run next
(``next_steps``).
"""

import glob
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import lightning as L
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from lightning.pytorch.callbacks import RichProgressBar
from omegaconf import DictConfig

from lenext.lock import launched_by_another_process
from lenext.ranges import PositiveFloat
from lenext.results import ERROR_FILE
from lenext.spec import RunSpec


def sweep_grid(task_overrides: list[str], sweeper_params: dict[str, str] | None) -> tuple[int, set[str]]:
    """(jobs in the grid of a basic sweep, the keys it sweeps); command-line overrides win over the preset's params."""
    by_key = {}
    parser = OverridesParser.create()
    for override in parser.parse_overrides([f"{k}={v}" for k, v in (sweeper_params or {}).items()]):
        by_key[override.get_key_element()] = override
    for override in parser.parse_overrides(list(task_overrides)):
        by_key[override.get_key_element()] = override
    swept = {key: len(list(o.sweep_iterator())) for key, o in by_key.items() if o.is_sweep_override()}
    return math.prod(swept.values()), set(swept)


def duration(seconds: float) -> str:
    """12s, 7m41s, 2h05m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def job_outcome(job_return: JobReturn) -> str:
    """``trained``, ``skipped`` (its results were complete already) or ``failed``."""
    # A lenext error in a multirun is written to the job's error.txt and the job returns None.
    if job_return.status != JobStatus.COMPLETED or job_return.return_value is None:
        return "failed"
    returned = job_return.return_value
    return "skipped" if isinstance(returned, dict) and returned.get("skipped") else "trained"


@dataclass
class StudyClock:
    """What this process's sweep has done so far, for the training lines' study estimate."""

    total: int | None = None  # jobs in the sweep; None outside a basic-launcher sweep
    done: int = 0
    trained_seconds: list[float] = field(default_factory=list)


STUDY = StudyClock()


class StudyProgress(Callback):
    def __init__(self) -> None:
        self.sweep_pid: int | None = None  # the process that launched the sweep; None in a single run
        self.total: int | None = None
        self.swept_keys: set[str] = set()
        self.done = 0
        self.failed = 0
        self.trained_seconds: list[float] = []
        self.started = time.monotonic()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if launched_by_another_process():  # a DDP/FSDP rank: Lightning starts it with the sweep's command line
            return  # it walks the sweep beside rank 0, which alone says how the study goes
        self.sweep_pid, self.earlier_errors = os.getpid(), error_files(config.hydra.sweep.dir)
        self.total, self.swept_keys = sweep_grid(config.hydra.overrides.task, config.hydra.sweeper.get("params"))
        STUDY.total, STUDY.done, STUDY.trained_seconds = self.total, 0, self.trained_seconds

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.sweep_pid is None:
            return
        seconds = time.monotonic() - self.started
        outcome = job_outcome(job_return)
        swept = " ".join(o for o in job_return.overrides or [] if o.split("=")[0] in self.swept_keys)
        took = duration(seconds) if outcome == "trained" else outcome
        what = f"({swept}, {took})" if swept else f"({took})"
        of_total = f" of {self.total}" if self.total else ""
        if os.getpid() != self.sweep_pid:  # a remote launcher: the other jobs finish in other processes
            print(f"study: job {config.hydra.job.num + 1}{of_total} done {what}", flush=True)
            return
        self.done = STUDY.done = self.done + 1
        self.failed += outcome == "failed"
        if outcome == "trained":
            self.trained_seconds.append(seconds)
        line = f"study: job {self.done}{of_total} done {what}"
        left = self.total - self.done if self.total else 0
        if self.total and not left:
            line += "; the study's jobs have all run" if self.failed else "; the study is complete"
        elif left and self.trained_seconds:
            line += f"; ~{duration(left * sum(self.trained_seconds) / len(self.trained_seconds))} left"
        print(line, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep with failed jobs exits 1, so that a script (make study) does not go on as if it were complete."""
        if self.sweep_pid != os.getpid():
            return
        failed, done = self.failed, self.done
        if not done:  # a launcher ran the jobs in other processes: each failed one wrote a new error.txt
            written = error_files(config.hydra.sweep.dir).items() - self.earlier_errors.items()
            failed, done = len(written), self.total
        if failed:
            of_done = f" of {done}" if done else ""
            print(f"study: {failed}{of_done} jobs failed; each one's error.txt says why", file=sys.stderr)
            sys.exit(1)
        print(f"next: python -m lenext.report {config.hydra.sweep.dir}   (its tables and figures)", flush=True)


def next_steps(output_dir: str, evaluated: bool = True) -> str:
    """What a single run leaves and what to run next (a sweep's last line says it for the sweep); a run that
    evaluated nothing (eval.enabled=false, trainer.fast_dev_run) has no results.json to report."""
    checkpoint = os.path.join(output_dir, "checkpoints", "last.ckpt")
    evaluate = f"python eval.py ckpt={checkpoint} eval.lengths=[...]"
    if not evaluated:
        return f"checkpoint: {checkpoint}\nno results.json (no evaluation after training); next: {evaluate}"
    return (
        f"checkpoint: {checkpoint}\n"
        f"next: python -m lenext.report {output_dir}   (tables and figures)\n"
        f"      {evaluate}   (other lengths, variants, splits)"
    )


def error_files(sweep_dir: str) -> dict[str, tuple[int, int]]:
    """The error files under the sweep folder ``sweep_dir``, each with its identity (inode, mtime in ns).

    A job removes its earlier error file when it starts and writes a new one (a new file, renamed into place)
    when it fails, so the files a sweep's jobs wrote are those whose identity changed; comparing identities
    needs no clock, where a file server's clock may differ from this machine's."""
    paths = glob.glob(os.path.join(glob.escape(sweep_dir), "**", ERROR_FILE), recursive=True)
    identities = {}
    for path in paths:
        stat = os.stat(path)
        identities[path] = (stat.st_ino, stat.st_mtime_ns)
    return identities


class StepsBar(RichProgressBar):
    """Lightning's progress bar, named for the steps it counts: Lightning's own says "Epoch 0/-2" for a run
    bounded by steps."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'Training':{len(self.validation_description)}}"


class TrainingProgress(L.Callback):
    """A line at every tenth of the steps and at least every ``every_s`` seconds while training, when the run
    has no progress bar: step n of N, the mean training loss since the last line, tokens/s (the run's, as
    results.json records it), the training time left and, in a sweep, the study's."""

    def __init__(self, every_s: PositiveFloat = 30.0):
        self.every_s = every_s
        self.enabled = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.enabled = trainer.progress_bar_callback is None and trainer.is_global_zero and trainer.max_steps > 0
        if not self.enabled:  # a bar, another rank, or a run bounded by epochs (no N to count steps against)
            return
        self.started = self.last_line = time.monotonic()
        self.first_step, self.last_tenth = trainer.global_step, self._tenth(trainer)
        self.loss_sum, self.losses = 0.0, 0

    @staticmethod
    def _tenth(trainer: L.Trainer) -> int:
        return 10 * trainer.global_step // trainer.max_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        self.loss_sum, self.losses = self.loss_sum + outputs["loss"].detach(), self.losses + 1  # no sync per step
        now, tenth, step = time.monotonic(), self._tenth(trainer), trainer.global_step
        if now - self.last_line < self.every_s and tenth == self.last_tenth:
            return
        per_step = (now - self.started) / max(1, step - self.first_step)
        left = (trainer.max_steps - step) * per_step
        speed = pl_module.train_tokens / pl_module.train_seconds * trainer.world_size if pl_module.train_seconds else 0
        whose = " (rank 0's share of each batch)" if trainer.world_size > 1 else ""  # a collective per line could hang
        line = (
            f"step {step} of {trainer.max_steps}: loss {float(self.loss_sum) / self.losses:.3f}{whose}, "
            f"{speed:,.0f} tokens/s; training ~{duration(left)} left"
        )
        if STUDY.total:  # the jobs after this one, at the mean of those trained so far (or this one's)
            job = statistics.mean(STUDY.trained_seconds) if STUDY.trained_seconds else now - self.started + left
            line += f"; study ~{duration(left + (STUDY.total - STUDY.done - 1) * job)} left"
        print(line, flush=True)
        self.last_line, self.last_tenth, self.loss_sum, self.losses = now, tenth, 0.0, 0


def validation_scope(spec: RunSpec, scored: int, available: int, protocols: tuple[str, ...]) -> str:
    """What the final validation measured, ``N windows (...)``: the sweep's row at this stage's training length of
    the data's first protocol (``nonoverlap`` for text, ``accuracy`` for a probe), or what it lacks.

    Validation scores the windows that row scores (same documents or samples, same eval.max_windows
    thinning), so the two agree unless validation was cut short or the sweep has no such row.
    """
    measured = protocols[0]
    if scored < available:
        return (
            f"{scored} of the {available} windows of the {measured} row at L_train "
            "(cut short by trainer.limit_val_batches or fast_dev_run)"
        )
    in_sweep = bool(spec.plan) and measured in spec.plan.protocols and spec.train_len in spec.plan.lengths
    row = "the sweep's" if in_sweep else "those of the"
    lacks = "" if in_sweep else ", which this sweep lacks"
    return f"{scored} windows ({row} {measured} row at L_train{lacks})"
