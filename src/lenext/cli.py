"""Hydra entry points: ``lenext-train`` / ``lenext-eval`` (console scripts) and the ``train.py`` / ``eval.py`` shims at
the repository root call these. Configs in, one line out on bad input.

The configs (``configs/`` at the repository root) ship inside the package as ``lenext.configs``, so an installed
lenext runs from any folder; a user adds a config folder of their own with
``hydra.searchpath=[file:///path/to/configs]``.
"""

import contextlib
import functools
import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from importlib import resources

import hydra
import torch
from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from lenext import schema
from lenext.build import CONFIG_PACKAGE, hydra_config, instantiate
from lenext.checkpoints import checkpoint_file
from lenext.data import LMDataModule
from lenext.diagnostics import DiagnoseSettings, diagnosed_model
from lenext.errors import (
    CheckpointError,
    ConfigError,
    LenextError,
    Stopped,
    ctrl_c_or_full_disk_stops,
    errors_in_one_line,
    first_line,
    print_one_line,
)
from lenext.files import write_atomic
from lenext.hardware import default_precision, keep_freed_memory
from lenext.hf import checked_hf, evaluate_hf
from lenext.lock import launched_by_another_process, remove_unused_folder
from lenext.progress import sweep_grid
from lenext.resolve import EVAL_NODES, RENAMED_KEYS, TRAIN_NODES, EvalScriptSettings, TrainSettings
from lenext.results import ERROR_FILE
from lenext.run import (
    DATA_OF_A_CHECKPOINT,
    check_evaluation_settings,
    checkpoint_model,
    evaluate_checkpoint,
    refuse_a_machine_it_cannot_run_on,
    train,
)
from lenext.run_folder import check_settings, preflight
from lenext.schema import HYDRA_KEYS, did_you_mean

# ${auto_precision:<accelerator>}: bf16-mixed on CUDA and on CPUs with native bf16, 32-true elsewhere.
OmegaConf.register_new_resolver("auto_precision", default_precision, replace=True)
# In run folder names: two sweeps started in the same second still get folders of their own. Cached, so that the
# jobs a launcher runs in other processes (joblib) resolve the launching process's, as Hydra's ${now:}.
OmegaConf.register_new_resolver("pid", os.getpid, replace=True, use_cache=True)


def all_devices(devices, num_nodes) -> int:
    """trainer=fsdp's data-parallel size: every device of every node (Lightning's "auto" would shard within nodes
    only). ``devices`` as Lightning takes it: a count, -1 or "auto" (every GPU of the node), indices ([0, 1], "0,1")."""
    if devices in ("auto", -1, "-1"):
        per_node = torch.cuda.device_count()
        if per_node == 0:
            raise ConfigError(
                f"trainer.devices={devices} is invalid here: it counts the node's CUDA GPUs, and it has none; give a "
                "number of processes (trainer.devices=2)"
            )
    elif isinstance(devices, str) and "," in devices:
        per_node = len([index for index in devices.split(",") if index.strip()])
    elif isinstance(devices, str) and devices.strip().isdigit():
        per_node = int(devices)
    elif isinstance(devices, int) and not isinstance(devices, bool):
        per_node = devices
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        per_node = len(devices)
    else:
        raise ConfigError(
            f"trainer.devices={devices!r} is invalid: it must be a number of devices (2), -1 or auto (every GPU of "
            "the node), or device indices ([0,1] or '0,1')"
        )
    return per_node * int(num_nodes)


OmegaConf.register_new_resolver("all_devices", all_devices, replace=True)
# The launch folder, known before Hydra's own config (hydra:runtime.cwd is not, when a sweep folder resolves).
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)


def one_line_errors(main: Callable) -> Callable:
    """Print a LenextError as one line and exit with its status (1; 143 or 130 for a run SIGTERM or Ctrl-C stopped);
    HYDRA_FULL_ERROR=1 keeps the traceback.

    In a multirun the failed job writes its message to error.txt in its folder and the sweep goes on (the report
    lists the job as failed; the sweep exits 1 at its end: lenext.progress), unless the error ends the sweep
    (SIGTERM: the machine is going away; Ctrl-C; a full disk; a sweep folder that holds other runs).
    """

    @functools.wraps(main)
    def wrapper(cfg: DictConfig):
        hydra_cfg = hydra_config()
        if hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:  # this attempt's outcome replaces an earlier failure's
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(hydra_cfg.runtime.output_dir, ERROR_FILE))
        try:
            with ctrl_c_or_full_disk_stops():
                return main(cfg)
        except LenextError as e:
            if not (isinstance(e, Stopped) and launched_by_another_process()):  # a stop: said once, by rank 0
                print_one_line(e)
            if hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN and not e.ends_sweep:
                write_atomic(os.path.join(hydra_cfg.runtime.output_dir, ERROR_FILE), f"{e}\n")
                return None
            if hydra_cfg and hydra_cfg.mode == RunMode.RUN:
                close_log_files_in(hydra_cfg.runtime.output_dir)  # an empty log then goes with its folder
                remove_unused_folder(hydra_cfg.runtime.output_dir)
            sys.exit(e.exit_status)

    return wrapper


def close_log_files_in(folder: str) -> None:
    """Close and detach the logging handlers writing a file in ``folder`` (Hydra's log of the run); the process's
    other handlers stay open (``logging.shutdown()`` closed them all, a test runner's or a notebook's too)."""
    folder = os.path.join(os.path.realpath(folder), "")
    loggers = [logging.root, *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, logging.FileHandler) and os.path.realpath(handler.baseFilename).startswith(folder):
                logger.removeHandler(handler)
                handler.close()


def checked_command_line(config_name: str) -> Callable:
    """Before Hydra composes, refuse in one line, with the closest name, what Hydra would answer with its search
    path or its advice to add the key: a config group option that does not exist (``pe=rop``), a key the config
    lacks (``data.maxlen=64``), a key an earlier version named otherwise (``eval.rope_scalings``)."""

    def decorate(main: Callable) -> Callable:
        @functools.wraps(main)
        def wrapper(*args, **kwargs):
            with errors_in_one_line():
                command, unread = get_args_parser().parse_known_args(sys.argv[1:])
                refuse_unread_arguments(command, unread)
                modes = [  # Hydra refuses more than one with a traceback
                    flag
                    for flag, given in (
                        ("--run", command.run),
                        ("--multirun", command.multirun),
                        ("--cfg", command.cfg),
                        ("--info", command.info is not None),
                        ("--shell-completion", command.shell_completion),
                    )
                    if given
                ]
                if len(modes) > 1:
                    raise ConfigError(
                        f"{' and '.join(modes)} cannot be given together: give one of --run, --multirun, --cfg, "
                        "--info, --shell-completion"
                    )
                only_shows = (
                    command.cfg or command.help or command.hydra_help or command.info or command.shell_completion
                )
                check_overrides(config_name, command.overrides, command.multirun, jobs=not only_shows)
            return main(*args, **kwargs)

        return wrapper

    return decorate


def refuse_unread_arguments(command, unread: list[str]) -> None:
    """What Hydra's parser leaves (it would print its usage and exit 2): an option it lacks, or overrides after an
    option (``train.py model=tiny -m seed=0,1``: an option ends the overrides), with the command as it reads."""
    if not unread:
        return
    unknown = next((argument for argument in unread if argument.startswith("-")), None)
    if unknown:
        raise ConfigError(f"{unknown} is not an option of this command: --help lists them")
    overrides, options = [*command.overrides, *unread], list(sys.argv[1:])
    for override in overrides:  # the last of equal strings: an option's value comes before the overrides
        del options[len(options) - 1 - options[::-1].index(override)]
    script = os.path.basename(sys.argv[0])
    command_line = shlex.join([*(["python"] if script.endswith(".py") else []), script, *options, *overrides])
    raise ConfigError(
        f"{unread[0]} comes after an option: give the options first, then every override ({command_line})"
    )


def check_overrides(config_name: str, overrides: list[str], multirun: bool = False, jobs: bool = True) -> None:
    """The checks of ``checked_command_line``. A sweep (``-m``, or a preset's) has every job checked
    (``check_sweep_jobs``) unless ``jobs`` is false (--cfg, --help)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise unreadable_override(overrides, e) from None
    own_configs = not any(o.key_or_group == "hydra.searchpath" for o in parsed)  # else groups may have more options
    first_values = []  # one job's overrides: the first value of each sweep
    for override in parsed:
        key = override.key_or_group
        if key in RENAMED_KEYS:
            raise ConfigError(f"{key} was renamed: use {RENAMED_KEYS[key]}=... instead")
        options = group_options(key) if not key.startswith("hydra/") else []  # Hydra's plugins add launchers
        values = sweep_values(override, options)
        if options and own_configs and not override.is_delete():
            for value in values:
                if value is not None and str(value) not in options:
                    raise ConfigError(
                        f"{key}={value} is not one of the {key} configs{did_you_mean(str(value), options)}; "
                        f"they are: {', '.join(options)} (in {config_folder(key)})"
                    )
        if not key.startswith("hydra.") and not override.is_sweep_override():
            first_values.append(override.input_line)
        elif override.is_sweep_override():
            first_values.append(f"{override.get_key_element()}={values[0]}")
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        try:
            compose(config_name, overrides=first_values)
        except (HydraException, OmegaConfBaseException) as e:
            unknown = not_a_setting(config_name, first_values, e)
            if unknown:
                raise unknown from None
            return  # Hydra's own message says it
        if config_name in JOB_CHECKS:
            settings = [
                o.input_line for o in parsed if o.key_or_group.startswith("hydra.") and not o.is_sweep_override()
            ]
            first = compose(config_name, overrides=[*first_values, *settings], return_hydra_config=True)
            basic = first.hydra.sweeper.get("_target_", "").endswith(".BasicSweeper")  # its grid known here
            sweep = multirun or first.hydra.mode == RunMode.MULTIRUN
            if sweep and "SlurmLauncher" in str(first.hydra.launcher.get("_target_")):
                refuse_slurm_without_srun()
            if jobs and basic and sweep:
                check_sweep_jobs(config_name, parsed, first.hydra.sweeper.get("params"))


def unreadable_override(overrides: list[str], error: HydraException) -> ConfigError:
    """The override Hydra's grammar cannot read (a non-ASCII character, a stray quote or bracket in its value, no
    ``=``), named in one line with where it stops and, for a value, the quoting that reads it, as a shell passes it
    on; Hydra's own message names no override."""
    lexer = "LexerNoViableAltException: "
    for line in overrides:
        try:
            OverridesParser.create().parse_overrides([line])
        except HydraException as e:
            message = [m for m in str(e).splitlines() if not m.startswith("See https://")]
            caret = message[1].find("^") - len(lexer) if message[0].startswith(lexer) and len(message) > 1 else -1
            where = f"at {line[caret]!r}" if 0 <= caret < len(line) else message[-1].strip()
            key, equals, value = line.partition("=")
            if not equals:
                return ConfigError(f"{line} cannot be read as an override ({where}): give key=value")
            quote = "'" if '"' in value else '"'
            return ConfigError(
                f"{line} cannot be read as an override ({where}): quote a value that holds non-ASCII characters "
                f"or any of =,[]{{}}()'\": {shlex.quote(f'{key}={quote}{value.strip(quote)}{quote}')}"
            )
    return ConfigError(first_line(error))


def sweep_values(override, options: list[str]) -> list:
    """The values an override gives: its one value, or each of a sweep's; a sweep lenext's sweep checks and
    progress cannot enumerate (``interval(...)``, an optimizing sweeper's; ``glob(...)``) is refused in one line,
    naming what to give (for a glob, the options it matches)."""
    if not override.is_sweep_override():
        return [override.value()]
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        matched = f" ({','.join(override.value().filter(options))})" if options else ""
        raise ConfigError(f"{override.input_line} is invalid: list the options instead{matched}")
    try:
        return list(override.sweep_string_iterator())
    except HydraException as e:
        raise ConfigError(
            f"{override.input_line} is invalid: {first_line(e)}; give a list (a,b,c) or range(start,stop,step)"
        ) from None


def not_a_setting(config_name: str, overrides: list[str], error: Exception) -> ConfigError | None:
    """The ConfigError naming the key Hydra could not override (with the closest name and the settings there), or
    None for another composition error. Called within a compose context."""
    unknown = re.search(r"Could not override '([^']+)'", str(error))
    if not unknown:
        return None
    path, _, name = unknown.group(1).rpartition(".")
    fixed = getattr(COMMAND_SETTINGS.get(config_name), "FIXED", {}).get(unknown.group(1).split(".")[0])
    if fixed:  # eval.py's model.d_model=8: a node the command takes from the checkpoint
        return schema.kept_elsewhere(unknown.group(1), fixed)
    rest = [line for line in overrides if not line.lstrip("+~").startswith(unknown.group(1) + "=")]
    root = compose(config_name, overrides=rest)
    node = OmegaConf.select(root, path) if path else root
    known = sorted(k for k in node if k not in HYDRA_KEYS) if isinstance(node, DictConfig) else []
    settings = OmegaConf.select(root, unknown.group(1)) if name in known else None
    options = group_options(path) if path and "." not in path and node is None else []
    if options:  # eval.py's data.batch_size=4 without data=: its data group chooses no config by default
        if config_name == "eval" and path == "data" and not any(line.startswith("hf=") for line in overrides):
            return ConfigError(f"{unknown.group(1)} {DATA_OF_A_CHECKPOINT}")
        return ConfigError(
            f"{unknown.group(1)} is a setting of a {path} config, and this command chooses none: give "
            f"{path}=<config> before it (one of: {', '.join(options)})"
        )
    if isinstance(settings, DictConfig):  # pe=alibi to eval.py, whose pe node holds the checkpoint's PE settings
        return ConfigError(
            f"{unknown.group(1)} is a node of settings here, not a config to choose: give them one by one "
            f"({unknown.group(1)}.<setting>=...); its settings: {', '.join(sorted(settings)) or 'none'}"
        )
    return ConfigError(
        f"{unknown.group(1)} is not a setting of {path or 'this config'}{did_you_mean(name, known, path)}; "
        f"the settings there: {', '.join(known) or 'none'}"
    )


def check_sweep_jobs(config_name: str, parsed: list, preset_params: dict | None) -> None:
    """Every job of a sweep (train.py's, eval.py's, diagnose.py's) composed and checked as the job will check itself
    before any work (``JOB_CHECKS``), before the first job starts: a bad value for the fifth job is refused now,
    naming the job, not after four trainings. What only the data can tell (a corpus too short for a length) is still
    found by the job, which writes its error.txt. Called within a compose context."""
    params = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in (preset_params or {}).items()])
    try:  # the grid as Hydra's basic sweeper makes it: the command line over the preset's params
        (jobs,) = BasicSweeper.split_arguments([*params, *parsed], None)
    except HydraException:  # a sweep type the basic sweeper does not run (ranges): left to Hydra
        return
    swept = sweep_grid([o.input_line for o in parsed], preset_params)[1]
    # Process-wide, set per job below: restored after, or an in-process caller's next run reads the last job's pe=
    hydra_state = HydraConfig.instance()
    found = hydra_state.cfg
    try:
        for number, job in enumerate(jobs):
            task = [line for line in job if not line.startswith(("hydra.", "hydra/"))]
            try:
                launcher = [line for line in job if line.startswith("hydra/launcher=")]
                cfg = compose(config_name, overrides=[*task, *launcher], return_hydra_config=True)
                with open_dict(cfg):  # as the launcher sets them, for ${hydra:job.num} in a job's settings
                    cfg.hydra.job.num, cfg.hydra.job.id = number, f"job_id_for_{number}"
                hydra_state.set_config(cfg)  # ${hydra:...} in a job's settings (a second stage's init_from)
                if "joblib" in str(cfg.hydra.launcher.get("_target_")).lower():
                    refuse_processes_of_its_own(cfg)
                with open_dict(cfg):
                    del cfg["hydra"]
                    cfg.paths.output_dir = "."  # a job's folder: Hydra's, once the sweep runs
                JOB_CHECKS[config_name](cfg)
            except (HydraException, OmegaConfBaseException) as e:
                problem = not_a_setting(config_name, task, e)
                if problem is None:
                    continue  # Hydra's own check of the batch says it
            except (ConfigError, CheckpointError) as e:
                problem = e
            else:
                continue
            named = " ".join(line for line in job if line.split("=", 1)[0] in swept)
            raise ConfigError(
                f"job {number} of the sweep{f' ({named})' if named else ''}: {problem}; no job was started"
            )
    finally:
        hydra_state.cfg = found


def refuse_processes_of_its_own(cfg: DictConfig) -> None:
    """A ConfigError for a job whose trainer starts processes of its own (DDP, FSDP), for joblib's launcher: its
    workers cannot start them (Lightning's launcher re-runs the command line, a loky worker's), and the sweep died in
    a traceback."""
    strategy = (cfg.get("trainer") or {}).get("strategy")
    if strategy not in (None, "auto"):
        shown = strategy if isinstance(strategy, str) else strategy.get("_target_")
        raise ConfigError(
            f"trainer.strategy={shown} is invalid under hydra/launcher=parallel: joblib's workers cannot start its "
            "processes; sweep such jobs with the default launcher (one after another) or hydra/launcher=slurm"
        )


def refuse_slurm_without_srun() -> None:
    """A ConfigError for hydra/launcher=slurm where SLURM's srun is not on PATH, which submitit's executor needs
    (it raised a traceback after the sweep's folder was made)."""
    if shutil.which("srun") is None:
        raise ConfigError(
            "hydra/launcher=slurm is invalid here: SLURM's srun is not on PATH on this machine; launch the sweep "
            "from a machine of the SLURM cluster, or leave out hydra/launcher=slurm to run its jobs here"
        )


def check_training_job(cfg: DictConfig) -> None:
    """A train.py job's checks before any work: types and ranges, then the settings that only fail together
    (``preflight``), a second stage's against its base (``init_from``) where the base is there already; one the
    sweep trains first (experiment=extension) is read by its own job only; and what it asks of this machine."""
    init_from = cfg.get("init_from")
    base = init_from and checkpoint_file(os.path.expanduser(init_from), "init_from", missing_ok=True)
    if not init_from or (base and os.path.isfile(base)):
        preflight(cfg, TrainSettings, TRAIN_NODES, sweeps=cfg.eval.enabled)
    else:
        check_settings(cfg, TrainSettings, TRAIN_NODES)
    refuse_a_machine_it_cannot_run_on(cfg.trainer)


def evaluates_hf(cfg: DictConfig) -> bool:
    """Whether eval.py evaluates a Hugging Face model (``hf=``) rather than a lenext checkpoint (``ckpt=``)."""
    if cfg.get("hf") == "":  # an unset variable: taken for no model, it was refused as a missing ckpt
        raise ConfigError("hf='' is invalid: give a Hugging Face model folder or hub id (hf=<model>), or ckpt=<run>")
    return bool(cfg.get("hf"))


def check_evaluation_job(cfg: DictConfig) -> None:
    """An eval.py job's checks before any work: types and ranges, then its checkpoint's run with this job's settings
    (``check_evaluation_settings``, ``checkpoint_model``) or its Hugging Face model's folder, tokenizer and plan
    (``checked_hf``)."""
    if evaluates_hf(cfg):
        schema.check(cfg, EvalScriptSettings, EVAL_NODES)
        checked_hf(cfg)
    else:
        check_evaluation_settings(cfg)
        checkpoint_model(cfg, cfg.ckpt, check_only=True)


def check_diagnosis_job(cfg: DictConfig) -> None:
    """A diagnose.py job's checks before any work: types and ranges, then its checkpoint's run with this job's
    lengths (``diagnosed_model``)."""
    diagnosed_model(cfg, check_only=True)


# Each entry point's checks of one job, which its sweeps run on every job before the first starts.
JOB_CHECKS = {"train": check_training_job, "eval": check_evaluation_job, "diagnose": check_diagnosis_job}
COMMAND_SETTINGS = {"train": TrainSettings, "eval": EvalScriptSettings, "diagnose": DiagnoseSettings}


def config_folder(group: str):
    """Where the package's configs of ``group`` are read from (an editable install's: its checkout's configs/)."""
    return resources.files(CONFIG_PACKAGE).joinpath(*group.split("/"))


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` in the package's configs (none: not a group)."""
    folder = config_folder(group)
    if not folder.is_dir():
        return []
    return sorted(item.name.removesuffix(".yaml") for item in folder.iterdir() if item.name.endswith(".yaml"))


@checked_command_line("train")
@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="train")
@one_line_errors
def train_main(cfg: DictConfig) -> dict:
    keep_freed_memory()
    return train(cfg)  # the job's return value: the study progress line tells skipped jobs from trained ones


@checked_command_line("eval")
@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="eval")
@one_line_errors
def eval_main(cfg: DictConfig) -> str:
    keep_freed_memory()
    # The job's return value: None would read as a failed job in a study.
    return evaluate_hf(cfg) if evaluates_hf(cfg) else evaluate_checkpoint(cfg)


PREPARE_USAGE = """usage: lenext-prepare [override ...]

Prepare the data of `python train.py [override ...]` and stop: the tokenizer (trained on the first
data.tokenizer_sample_mb of the training split, or data.tokenizer's) and each split's token shards, in
data.cache_dir (paths.cache_dir by default). Training does this itself on first use; a killed preparation resumes
where it stopped.

Example: lenext-prepare data=text_files data.corpus.path=/data/my_corpus"""


def prepare_main() -> None:
    """``lenext-prepare [overrides]``: the data of a training run prepared, nothing trained."""
    overrides = sys.argv[1:]
    if {"-h", "--help"} & set(overrides):
        print(PREPARE_USAGE)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # its progress: the splits as they start
    with errors_in_one_line(sigterm=True):
        sweeps = [o for o in overrides if o in ("-m", "--multirun") or _is_sweep(o)]
        if sweeps:
            raise ConfigError(f"lenext-prepare prepares one data config: {sweeps[0]} is a sweep; give one value")
        check_overrides("train", overrides)
        with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
            try:
                cfg = compose("train", overrides=overrides)
            except (HydraException, OmegaConfBaseException) as e:
                raise ConfigError(f"lenext-prepare {' '.join(overrides)}: {first_line(e)}") from None
        scope = OmegaConf.masked_copy(cfg, ["data", "paths", "seed"])
        scope.paths.output_dir = "."  # a run's folder: there is no run
        schema.check(scope, TrainSettings, TRAIN_NODES)
        data = instantiate(cfg.data, "data")
        if not isinstance(data, LMDataModule):
            print(f"{type(data).__name__} generates its data from a seed: there is nothing to prepare")
            return
        data.load()
    for line in data.describe_preparation():
        print(line)


def _is_sweep(override: str) -> bool:
    try:
        return OverridesParser.create().parse_overrides([override])[0].is_sweep_override()
    except HydraException:
        return False
