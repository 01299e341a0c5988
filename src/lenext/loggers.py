"""Lightning's CSV logger, keeping what a run logged before it resumed.

Lightning's writer deletes ``metrics.csv`` when its folder is not empty (lightning 2.6), so a resumed run
lost the curve of its steps before the resume: a second stage's adaptation curve, a base's loss. This one
keeps the rows of the steps its checkpoint holds and drops the later ones, which the resumed run logs again (a
run killed after its last checkpoint logged steps it repeats).
"""

import csv
import json
import os

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from lenext.files import atomic_path


class KeptMetricsWriter(ExperimentWriter):
    def __init__(self, log_dir: str) -> None:
        self.earlier = self._read(os.path.join(log_dir, self.NAME_METRICS_FILE))  # before Lightning's check
        self.resumed_at: int | None = None  # the step of the checkpoint a resumed run starts from: rows before it kept
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv
        pass

    @staticmethod
    def _read(path: str) -> list[dict]:
        if not os.path.isfile(path):
            return []
        with open(path, newline="", encoding="utf-8") as f:
            return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]

    def save(self) -> None:
        if self.metrics and self.earlier is not None:  # the first save: the file keeps the earlier steps only
            kept = (
                []  # a fresh start: no earlier row is this run's
                if self.resumed_at is None
                else [row for row in self.earlier if int(float(row["step"])) < self.resumed_at]
            )
            self.earlier = None
            if kept:
                self.metrics_keys = sorted(set().union(*kept))
                with atomic_path(self.metrics_file_path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
                    writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                    writer.writeheader()
                    writer.writerows(kept)
            elif os.path.isfile(self.metrics_file_path):
                os.remove(self.metrics_file_path)  # every step in it is logged again
        super().save()


class CSVLogger(LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` whose ``metrics.csv`` survives a resume (module docstring)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> KeptMetricsWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = KeptMetricsWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def resume_at(self, step: int) -> None:
        """A resumed run's checkpoint step: the rows of the steps before it, which it holds, are kept (a row's step
        is Lightning's count of steps before it: a checkpoint at step 20 holds rows 0-19, and a second stage's -1,
        its validation before training)."""
        self.experiment.resumed_at = step


def log_results_to_wandb(trainer, results_path: str) -> None:
    """The evaluation rows as a wandb Table (key eval/results) when logging to wandb."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and results_path:
            with open(results_path) as f:
                rows = json.load(f)["rows"]
            columns = list(dict.fromkeys(key for row in rows for key in row))  # passkey's depth rows add `depth`
            logger.log_table(key="eval/results", columns=columns, data=[[r.get(c) for c in columns] for r in rows])
