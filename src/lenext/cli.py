"""Hydra entry points: ``lenext-train`` / ``lenext-eval`` (console scripts) and the ``train.py`` / ``eval.py`` shims at
the repository root call these. Configs in, one line out on bad input.

The configs ship inside the package (``lenext/configs``), so an installed lenext runs from any folder; a user adds
a config folder of their own with ``hydra.searchpath=[file:///path/to/configs]``.
"""

import contextlib
import functools
import os
import sys
from collections.abc import Callable

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lenext.build import hydra_config
from lenext.errors import ConfigError, LenextError, print_one_line
from lenext.files import write_atomic
from lenext.hardware import default_precision, keep_freed_memory
from lenext.resolve import TRAIN_NODES
from lenext.results import ERROR_FILE
from lenext.run import evaluate_checkpoint, train

CONFIG_PACKAGE = "lenext.configs"

# ${auto_precision:<accelerator>}: bf16-mixed on CUDA and on CPUs with native bf16, 32-true elsewhere.
OmegaConf.register_new_resolver("auto_precision", default_precision, replace=True)
# In run folder names: two sweeps started in the same second still get folders of their own. Cached, so that the
# jobs a launcher runs in other processes (joblib) resolve the launching process's, as Hydra's ${now:}.
OmegaConf.register_new_resolver("pid", os.getpid, replace=True, use_cache=True)
# The launch folder, known before Hydra's own config (hydra:runtime.cwd is not, when a sweep folder resolves).
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)


def one_line_errors(main: Callable) -> Callable:
    """Print a LenextError as one line and exit with its status (1, or 143 for a run SIGTERM stopped);
    HYDRA_FULL_ERROR=1 keeps the traceback.

    In a multirun the failed job writes its message to error.txt in its folder and the sweep goes on (the report
    lists the job as failed; the sweep exits 1 at its end: lenext.progress), unless the error ends the sweep
    (SIGTERM: the machine is going away; a sweep folder that holds other runs).
    """

    @functools.wraps(main)
    def wrapper(cfg: DictConfig):
        hydra_cfg = hydra_config()
        if hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:  # this attempt's outcome replaces an earlier failure's
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(hydra_cfg.runtime.output_dir, ERROR_FILE))
        try:
            return main(cfg)
        except LenextError as e:
            print_one_line(e)
            if hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN and not e.ends_sweep:
                write_atomic(os.path.join(hydra_cfg.runtime.output_dir, ERROR_FILE), f"{e}\n")
                return None
            sys.exit(e.exit_status)

    return wrapper


def refuse_renamed_keys(main: Callable) -> Callable:
    """A command-line override of a key an earlier version named otherwise (a settings class's ``RENAMED``) is
    refused in one line naming the new key, before Hydra composes (which would only say the key is unknown)."""
    renamed = {
        f"{node}.{old}": f"{node}.{new}"
        for node, settings in TRAIN_NODES.items()
        for old, new in getattr(settings, "RENAMED", {}).items()
    }

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        for override in sys.argv[1:]:
            key = override.lstrip("+~").split("=", 1)[0]
            if key in renamed:
                print_one_line(ConfigError(f"{key} was renamed: use {renamed[key]}=... instead"))
                sys.exit(ConfigError.exit_status)
        return main(*args, **kwargs)

    return wrapper


@refuse_renamed_keys
@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="train")
@one_line_errors
def train_main(cfg: DictConfig) -> dict:
    keep_freed_memory()
    return train(cfg)  # the job's return value: the study progress line tells skipped jobs from trained ones


@refuse_renamed_keys
@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="eval")
@one_line_errors
def eval_main(cfg: DictConfig) -> str:
    keep_freed_memory()
    return evaluate_checkpoint(cfg)  # the job's return value: None would read as a failed job in a study
