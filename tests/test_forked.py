"""tests/forked.py, the harness that runs lenext's commands in forks: a command execs itself only where its
environment differs in what lenext's imports read, and the forkserver imports in the environment the test process
had before any test, not in one a test changed."""

import os

from tests import forked

BASE = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}


def test_only_a_variable_read_while_importing_sends_a_command_to_a_new_interpreter():
    assert not forked.needs_own_interpreter(dict(BASE), BASE)
    # Read as the command runs: lenext's root, Lightning's seed and ranks, wandb's mode.
    run_time = {"LENEXT_ROOT": "/x", "PL_GLOBAL_SEED": "0", "WANDB_MODE": "offline"}
    assert not forked.needs_own_interpreter({**BASE, **run_time}, BASE)
    # Set by libraries on themselves as they import (joblib, scikit-learn, threadpoolctl), or unread by a fork.
    unread = {"KMP_INIT_AT_FORK": "FALSE", "KMP_DUPLICATE_LIB_OK": "True", "PYTHONUNBUFFERED": "1"}
    assert not forked.needs_own_interpreter({**BASE, **unread}, BASE)
    assert forked.needs_own_interpreter({**BASE, "HF_HUB_OFFLINE": "1"}, BASE)
    assert forked.needs_own_interpreter({**BASE, "OMP_NUM_THREADS": "2"}, BASE)
    assert forked.needs_own_interpreter({"PATH": "/bin", "OMP_NUM_THREADS": "1"}, BASE)  # one unset counts too


def temporary_folder_variable() -> str | None:
    return os.environ.get("TMPDIR")


def test_the_forkserver_imports_in_the_environment_frozen_before_the_tests(monkeypatch):
    monkeypatch.setenv("TMPDIR", "/a/test/changed/it")
    assert forked.SERVER_ENVIRONMENT is not None and forked.SERVER_ENVIRONMENT.get("TMPDIR") != "/a/test/changed/it"
    assert forked.call(temporary_folder_variable) == forked.SERVER_ENVIRONMENT.get("TMPDIR")
