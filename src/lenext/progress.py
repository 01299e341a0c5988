"""Where a study stands: after each job of a multirun, `study: job n of N done (...); ~T left`.

A Hydra callback (registered in configs/hydra/default.yaml). With the basic launcher every job runs
in this process, so the callback sees the whole sweep: N is the size of the sweep's grid, and the
time left is the mean wall time of the jobs that trained (skipped ones, whose results were already
complete, take seconds and would make the estimate meaningless) times the jobs left. Launchers
that run jobs elsewhere (submitit) call on_job_end in the job's own process, where only the job's
number is known, and the line says just that.
"""

import math
import time
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


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


class StudyProgress(Callback):
    def __init__(self) -> None:
        self.total: int | None = None
        self.swept_keys: set[str] = set()
        self.done = 0
        self.trained_seconds: list[float] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.total, self.swept_keys = sweep_grid(config.hydra.overrides.task, config.hydra.sweeper.get("params"))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode is None or str(config.hydra.mode) != "RunMode.MULTIRUN":
            return
        seconds = time.monotonic() - self.started
        returned = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        skipped = isinstance(returned, dict) and returned.get("skipped")
        if not skipped:
            self.trained_seconds.append(seconds)
        self.done += 1
        what = " ".join(o for o in job_return.overrides or [] if o.split("=")[0] in self.swept_keys or not self.total)
        if self.total is None:  # a remote launcher: this process runs one job
            print(f"study: job {config.hydra.job.num + 1} done ({what}, {duration(seconds)})", flush=True)
            return
        line = f"study: job {self.done} of {self.total} done ({what}, {'skipped' if skipped else duration(seconds)})"
        left = self.total - self.done
        if left and self.trained_seconds:
            line += f"; ~{duration(left * sum(self.trained_seconds) / len(self.trained_seconds))} left"
        elif not left:
            line += "; the study is complete"
        print(line, flush=True)
