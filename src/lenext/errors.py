"""Errors lenext raises on purpose. Each carries a message that says what to do.

The command-line entry points print these as one line (no traceback) and exit non-zero;
anything else is a bug and keeps its traceback.
"""

import atexit
import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path


class LenextError(Exception):
    """Base class: a problem with the user's input, not with lenext.

    The command exits with ``exit_status``. In a multirun the failed job is recorded and the sweep goes on,
    unless the error ``ends_sweep``.
    """

    exit_status = 1
    ends_sweep = False


def print_one_line(error: LenextError) -> None:
    """``error: <message>`` on stderr, the way every entry point reports a LenextError; with HYDRA_FULL_ERROR=1 the
    error is raised instead, traceback and all."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr)


def first_line(error: BaseException) -> str:
    """An exception's message up to its first line break (its type's name when it has none): a part of one of
    lenext's one-line errors."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


class ConfigError(LenextError):
    """A configuration value is invalid; the message names the key (``key``, where one key is the problem)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class DataError(LenextError):
    """A corpus cannot be read or is too small for what was asked."""


class CheckpointError(LenextError):
    """A checkpoint is missing, truncated, or was not written by lenext."""


class LengthNotSupported(LenextError):
    """A positional encoding cannot serve a sequence this long (e.g. learned APE beyond max_len).

    Evaluation records such a length as "not applicable" instead of failing the sweep.
    """


class Stopped(LenextError):
    """A command was stopped from outside: SIGTERM (a cluster's pre-emption, scancel) or Ctrl-C (SIGINT). Training
    saves where it stopped; every file written before is whole (atomic writes).

    The exit status says which (128 + the signal, as a shell reports a process the signal ended), and a sweep stops
    with it: the same command resumes the run, and the sweep from it.
    """

    ends_sweep = True

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.exit_status = 128 + signum


SIGNAL_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}


def interrupted() -> Stopped:
    """What a command says when Ctrl-C stops it outside training's own stop (lenext.module.CheckpointOnStop)."""
    return Stopped(
        "stopped by Ctrl-C (SIGINT); every file written so far is whole: run the same command to go on",
        signal.SIGINT,
    )


class NoSpace(LenextError):
    """A disk or a quota filled while lenext wrote a file. Every file written before is whole (``lenext.files``), so
    the same command, once there is space, goes on from them; every job of a sweep would meet the same."""

    ends_sweep = True


# The repository's shims, at its root: ``python train.py`` and the like run lenext's commands.
SHIMS = ("train.py", "eval.py", "diagnose.py")


def started_as_command() -> bool:
    """Whether this process is one of lenext's commands: a console script (``lenext-*``), a shim at the repository's
    root, ``python -m lenext.<module>``; not a session at a prompt, nor another program that imports lenext."""
    if hasattr(sys, "ps1") or sys.flags.interactive or not sys.argv or not sys.argv[0]:
        return False
    if sys.argv[0] == "-m":  # while -m imports the module's package; the module is in the interpreter's own argv
        options = [*sys.orig_argv[1:], ""]  # -m lenext.report, or -mlenext.report
        at = next((i for i, arg in enumerate(options) if arg.startswith("-m")), None)
        module = "" if at is None else options[at][2:] or options[at + 1]
        return module == "lenext" or module.startswith("lenext.")
    program = Path(sys.argv[0])
    root = Path(__file__).resolve().parents[2]  # src/lenext/errors.py in a checkout
    return program.name.startswith("lenext-") or (program.name in SHIMS and program.resolve().parent == root)


def ctrl_c_in_one_line(previous: Callable) -> Callable:
    """A ``sys.excepthook`` for lenext's commands: a Ctrl-C that reaches the top (while the libraries load, before an
    entry point's ``errors_in_one_line``; between the jobs of a sweep) printed as the one line every stop prints,
    and the command's status that of every stop by Ctrl-C, after the exit handlers have run (Python's own varies:
    death by SIGINT, or 1 once torch has loaded); with HYDRA_FULL_ERROR=1, and for any other exception,
    ``previous``'s traceback."""
    stopped = interrupted()
    status = []

    def hook(kind, value, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            previous(kind, value, traceback)
            return
        print(f"error: {stopped}", file=sys.stderr, flush=True)
        status.append(stopped.exit_status)

    def exit_with_status() -> None:  # registered first, so run last: after every other exit handler
        if status:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status[0])

    atexit.register(exit_with_status)
    return hook


@contextlib.contextmanager
def ctrl_c_or_full_disk_stops() -> Iterator[None]:
    """Ctrl-C (outside training's own stop, lenext.module.CheckpointOnStop) raised as ``interrupted()``; a full disk
    or quota as ``NoSpace``, naming the file (``lenext.files.atomic_path`` names its own)."""
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted() from None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise NoSpace(
            f"{e.filename or 'a file'} could not be written ({e.strerror}); the checkpoints and results written "
            "before it are whole: free space there and run the same command to go on from them"
        ) from e


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM raised as ``Stopped`` while the body runs (in the main thread), so that what it was writing goes as on
    Ctrl-C (an atomic write's temporary, a folder written aside) instead of staying half-written. Not for training,
    which stops at a step boundary with a checkpoint (``lenext.module.CheckpointOnStop``)."""

    def stop(signum, frame):
        raise Stopped("stopped by SIGTERM; every file written so far is whole: run the same command to go on")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def errors_in_one_line(sigterm: bool = False) -> Iterator[None]:
    """An entry point's body: a LenextError printed as one line and the command exits with its status; Ctrl-C and a
    full disk the same (``ctrl_c_or_full_disk_stops``), and with ``sigterm``, SIGTERM (``sigterm_stops``)."""
    try:
        with ctrl_c_or_full_disk_stops(), sigterm_stops() if sigterm else contextlib.nullcontext():
            yield
    except LenextError as e:
        print_one_line(e)
        sys.exit(e.exit_status)
