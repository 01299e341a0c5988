"""lenext's commands as a user runs them, each in a process of its own, forked from one that has imported them.

Starting ``python train.py`` imports lenext.cli: Lightning, which imports torchmetrics, which imports transformers
and scipy; 8-13 s on a 2-core EPYC, where the command itself, on bad input or a tiny run, takes a second or a few.
A forkserver (multiprocessing's) imports this module once per test process; each command is then a fork of it
with the command's environment, folder, arguments, standard output and error, running the entry point the command
calls, its exit status the command's. What a new interpreter would do differently, read the environment while
importing, is kept: a command whose environment differs from the forkserver's in a variable read then
(``IMPORT_TIME``) execs the command itself in its fork. A command a test must signal or kill runs under
``subprocess``.
"""

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from lenext import cli, diagnostics

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {  # a script at the repository's root, or a console script
    "train.py": cli.train_main,
    "eval.py": cli.eval_main,
    "diagnose.py": diagnostics.main,
    "lenext-prepare": cli.prepare_main,
}
# Read while lenext's libraries import (the Hugging Face libraries' offline switches and caches, torch's, Triton's,
# OpenMP's, Python's own): a command that sets one otherwise than the forkserver's environment execs itself anew.
# Every other variable is read as the command runs (LENEXT_ROOT, Lightning's ranks and seed, wandb's mode).
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TOKENIZERS", "TORCH", "PYTORCH", "TRITON", "CUDA")
IMPORT_TIME += ("OMP_", "MKL_", "KMP_", "PYTHON", "LD_", "MPL", "XDG_", "HOME", "TMPDIR", "PATH")
# Not compared: the fork's output is line-buffered either way, and libraries set the OpenMP ones on themselves
# as they import (joblib, scikit-learn, threadpoolctl, inductor), in a test process as in a command's.
NOT_COMPARED = {"PYTHONUNBUFFERED", "KMP_INIT_AT_FORK", "KMP_DUPLICATE_LIB_OK"}

FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload([__name__])
# The environment the forkserver starts in (``freeze_environment``): otherwise the one of whichever test first forks,
# and a variable that test set (TMPDIR, say) would send every later command to a new interpreter.
SERVER_ENVIRONMENT: dict[str, str] | None = None
SERVER_STARTED = False


def freeze_environment() -> None:
    """Start the forkserver, when first needed, in this process's environment as it is now (before any test)."""
    global SERVER_ENVIRONMENT
    SERVER_ENVIRONMENT = dict(os.environ)


def ensure_server() -> None:
    """The forkserver running, started in ``SERVER_ENVIRONMENT`` (the environment now, if none was frozen)."""
    global SERVER_STARTED
    if SERVER_STARTED:
        return  # later forks start it themselves if it ever ended
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(SERVER_ENVIRONMENT or current)
    try:
        multiprocessing.forkserver.ensure_running()
        SERVER_STARTED = True
    finally:
        os.environ.clear()
        os.environ.update(current)


def run_command(name: str, arguments, environment: dict[str, str], cwd, timeout: float = 900):
    """The command ``name`` (``COMMANDS``) with ``arguments``, in ``cwd``, with exactly ``environment`` ->
    subprocess.CompletedProcess, its output as text (as ``subprocess.run(..., capture_output=True, text=True)``)."""
    line = command_line(name, [str(argument) for argument in arguments])
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        ensure_server()
        process = FORKS.Process(target=_command, args=(name, line, environment, str(cwd), out, err))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(line, timeout)
        return subprocess.CompletedProcess(line, process.exitcode, out.read_text(), err.read_text())


def call(function, *args):
    """``function(*args)`` in a fork of the forkserver: a process that has imported lenext and done nothing else, as
    a new interpreter would be after its imports (its heap, say) -> the function's result."""
    ensure_server()
    with FORKS.Pool(1) as pool:
        return pool.apply(function, args)


def command_line(name: str, arguments: list[str]) -> list[str]:
    """The command as a user types it: ``python <ROOT/name> ...`` or the installed console script."""
    if name.endswith(".py"):
        return [sys.executable, str(ROOT / name), *arguments]
    return [str(Path(sys.executable).parent / name), *arguments]


def needs_own_interpreter(environment, imported_in) -> bool:
    """Whether a command run with ``environment`` must exec itself: a variable read while importing is set otherwise
    than in ``imported_in``, the environment lenext was imported in."""
    keys = {key for key in environment.keys() | imported_in.keys() if key.startswith(IMPORT_TIME)} - NOT_COMPARED
    return any(environment.get(key) != imported_in.get(key) for key in keys)


def _command(name: str, line: list[str], environment: dict[str, str], cwd: str, out: Path, err: Path):
    """The forked process: the command's folder and output files, then its environment and entry point (or, where
    the environment differs from the one lenext was imported in, the command itself), and at its end what an
    interpreter's exit runs (multiprocessing ends a fork with os._exit)."""
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if needs_own_interpreter(environment, os.environ):  # the fork's environment: the forkserver's
        os.execve(line[0], line, environment)
    os.environ.clear()
    os.environ.update(environment)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = line[1:] if line[0] == sys.executable else line
    torch.set_num_threads(int(environment.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        COMMANDS[name]()
    finally:
        threading._shutdown()  # the threads' exit handlers (loky's: its workers), then atexit's, as Python exits
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
