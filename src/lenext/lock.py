"""One lenext process per run folder: a run or sweep launched twice into the same folder refuses at the start.

Two processes in one folder would both "succeed": checkpoints with ``-v1`` twins, metric rows written twice.
``FolderLock`` (a Hydra callback, configs/hydra/default.yaml) takes an exclusive ``flock`` on
``<folder>/.lenext.lock`` before Hydra writes anything there: the run folder of a single run, the sweep folder
of a multirun (the process that launches it: with the submitit launcher, the one that waits for the jobs). The
kernel drops the lock when the process ends, however it ends, so a killed run never leaves a stale lock.
"""

import datetime
import fcntl
import os
import socket
import sys
from typing import Any, TextIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lenext.errors import LenextError

LOCK_FILE = ".lenext.lock"
_held: list[TextIO] = []  # open lock files: the locks last as long as the process


class FolderInUse(LenextError):
    """Another process holds the folder's lock."""


def hold_folder(folder: str) -> None:
    """Lock ``folder`` for this process, or raise FolderInUse naming the process that holds it."""
    os.makedirs(folder, exist_ok=True)
    lock = open(os.path.join(folder, LOCK_FILE), "a+")  # not closed: held until the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise FolderInUse(
            f"{folder} is in use by {holder}: wait for it to end, or start this one in another folder "
            "(hydra.run.dir=... for a run, hydra.sweep.dir=... for a sweep)"
        ) from None
    lock.seek(0)
    lock.truncate()
    started = datetime.datetime.now().isoformat(timespec="seconds")
    lock.write(f"lenext process {os.getpid()} on {socket.gethostname()} (started {started})\n")
    lock.flush()
    _held.append(lock)


def launched_by_another_process() -> bool:
    """Whether this process is a worker another lenext process started for the same run (DDP ranks, nodes)."""
    return any(os.environ.get(rank, "0") != "0" for rank in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))


class FolderLock(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._hold(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._hold(config.hydra.sweep.dir)

    @staticmethod
    def _hold(folder: str) -> None:
        if launched_by_another_process():
            return
        try:
            hold_folder(folder)
        except FolderInUse as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(e.exit_status)
