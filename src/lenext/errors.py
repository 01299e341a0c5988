"""Errors lenext raises on purpose. Each carries a message that says what to do.

The command-line entry points print these as one line (no traceback) and exit non-zero;
anything else is a bug and keeps its traceback.
"""

import os
import signal
import sys


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


class ConfigError(LenextError):
    """A configuration value is invalid; the message names the key."""


class DataError(LenextError):
    """A corpus cannot be read or is too small for what was asked."""


class CheckpointError(LenextError):
    """A checkpoint is missing, truncated, or was not written by lenext."""


class LengthNotSupported(LenextError):
    """A positional encoding cannot serve a sequence this long (e.g. learned APE beyond max_len).

    Evaluation records such a length as "not applicable" instead of failing the sweep.
    """


class Stopped(LenextError):
    """Training was stopped from outside (SIGTERM: a cluster's pre-emption, scancel) and saved where it stopped.

    The exit status says so (128 + SIGTERM, as a shell reports a process the signal ended), and a sweep stops
    with it: the same command resumes the run, and the sweep from it.
    """

    exit_status = 128 + signal.SIGTERM
    ends_sweep = True
