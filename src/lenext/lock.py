"""One lenext process per run folder: a run or sweep launched twice into the same folder refuses at the start.

Two processes in one folder would both "succeed": checkpoints with ``-v1`` twins, metric rows written twice.
``FolderLock`` (a Hydra callback, configs/hydra/default.yaml) takes an exclusive ``flock`` on
``<folder>/.lenext.lock`` before Hydra writes anything there: the run folder of a single run; the sweep folder of
a multirun, held by the process that launches it (with the submitit launcher, the one that waits for the jobs);
and each job's folder while the job runs, wherever it runs. The kernel drops a lock when its process ends, however
it ends, so a killed run leaves no stale lock. Worker processes of a run (DDP ranks, nodes) do not lock.
"""

import datetime
import fcntl
import logging
import os
import shutil
import socket
import sys
from typing import Any, TextIO

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lenext.errors import LenextError, print_one_line
from lenext.files import remove_temporaries

log = logging.getLogger("lenext")

LOCK_FILE = ".lenext.lock"
_held: dict[str, TextIO] = {}  # folder (real path) -> its open lock file: the lock lasts while the file is open
_made: set[str] = set()  # folders (real paths) this process made


class FolderInUse(LenextError):
    """Another process holds the folder's lock, or the folder cannot be made."""


def hold_folder(folder: str) -> bool:
    """Lock ``folder`` for this process (False if it holds it already, or the file system cannot lock), or raise
    FolderInUse naming the process that holds it."""
    if not folder:  # an unset variable: the message named no folder
        raise FolderInUse("the run's folder is '' (an unset variable in hydra.run.dir?): give a folder path")
    key = os.path.realpath(folder)
    if key in _held:
        return False
    if not os.path.exists(folder):
        _made.add(key)
    try:
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, LOCK_FILE), "a+")  # not closed: the lock lasts while it is open
    except OSError as e:
        raise FolderInUse(
            f"{folder} cannot hold this run ({e.strerror or type(e).__name__}): give a folder you can write to"
        ) from None
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
    except OSError as e:  # a file system without locks (some network mounts): run, saying what is not guarded
        lock.close()
        log.warning("%s cannot be locked (%s): nothing stops a second process from using it", folder, e.strerror)
        return False
    started = datetime.datetime.now().isoformat(timespec="seconds")
    try:  # who holds it, for the message a second process prints
        lock.seek(0)
        lock.truncate()
        lock.write(f"lenext process {os.getpid()} on {socket.gethostname()} (started {started})\n")
        lock.flush()
    except OSError as e:
        lock.close()
        raise FolderInUse(
            f"{folder} cannot hold this run ({e.strerror or type(e).__name__}): free space there"
        ) from None
    _held[key] = lock
    removed = remove_temporaries(folder)
    if removed:
        log.info("removed %d temporary file(s) a killed process left in %s", len(removed), folder)
    return True


def release_folder(folder: str) -> None:
    lock = _held.pop(os.path.realpath(folder), None)
    if lock is not None:
        lock.close()


def remove_unused_folder(folder: str) -> None:
    """Remove ``folder`` if this process made it and it holds only what Hydra and the lock wrote before the command
    was refused: the lock and the command's log (of the data it prepared, say: the shards stay in the cache), and
    ``.hydra/`` with an empty log (written once the command is accepted: lenext.run_folder.record_command). A refused
    command leaves no run folder behind."""
    key = os.path.realpath(folder)
    if key not in _made or not os.path.isdir(folder):
        return
    names = set(os.listdir(folder))
    logs = [name for name in names if name.endswith(".log")]
    accepted = ".hydra" in names
    if names - {".hydra", LOCK_FILE, *logs} or (
        accepted and any(os.path.getsize(os.path.join(folder, n)) for n in logs)
    ):
        return
    release_folder(folder)
    shutil.rmtree(folder, ignore_errors=True)
    _made.discard(key)


def launched_by_another_process() -> bool:
    """Whether this process is a worker another process started for the same run (DDP ranks, nodes, srun tasks)."""
    ranks = ["RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"]
    if os.environ.get("SLURM_NTASKS", "1").strip() not in ("", "1"):  # srun starts one task per rank
        ranks.append("SLURM_PROCID")
    return any(os.environ.get(rank, "0") != "0" for rank in ranks)


class FolderLock(Callback):
    def __init__(self) -> None:
        self.job_folder: str | None = None  # the job folder this process locked for the job that runs now

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._hold(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._hold(config.hydra.sweep.dir)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = config.hydra.runtime.output_dir
        self.job_folder = folder if self._hold(folder) else None

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.job_folder:
            release_folder(self.job_folder)
            self.job_folder = None

    @staticmethod
    def _hold(folder: str) -> bool:
        if launched_by_another_process():
            return False
        try:
            return hold_folder(folder)
        except FolderInUse as e:
            print_one_line(e)
            sys.exit(e.exit_status)
