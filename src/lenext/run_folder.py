"""A run's folder and how a run starts: a finished run is skipped, an interrupted one resumes from its last
checkpoint, and either is refused, in one line, when it belongs to a run with other settings than the command's.
"""

import dataclasses
import json
import logging
import os
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lenext import schema
from lenext.build import instantiate, preset_of
from lenext.checkpoints import Base, checkpoint_file, load_checkpoint, read_base, stored_spec
from lenext.errors import CheckpointError, ConfigError, errors_in_one_line
from lenext.files import write_atomic
from lenext.hardware import canonical_precision
from lenext.lock import launched_by_another_process
from lenext.module import logged_metrics, processes_trained, tokens_per_step
from lenext.protocols import ACCURACY
from lenext.resolve import RENAMED_KEYS, config_pe_name, flat_settings, resolve, same_setting
from lenext.results import RESULTS_FILE, not_lenext_results
from lenext.spec import RunSpec

log = logging.getLogger("lenext")

# What makes a run the run it is: resuming it under other values would mix two runs (the trainer's may change:
# a longer max_steps continues a run). Left out: what only changes how data is read or how much memory a step takes.
RUN_IDENTITY = ("model", "pe", "attention", "train", "module", "seed", "data", "init_from", "drop_pe")
NOT_IDENTITY = (
    "data.num_workers",
    "data.eval_batch_size",
    "data.cache_dir",
    "data.remote",
    "data.corpus.streaming",
    "eval.tokens_per_batch",
    "module.compile",
    "module.activation_checkpointing",
)
EVALUATION_ONLY = ("data.eval_samples",)  # a probe's evaluation samples: a resume may change them, a skip may not
# A resume continues a run only under what its steps computed with: under others it follows no uninterrupted run.
STEP_SETTINGS = ("trainer.precision", "trainer.gradient_clip_val", "trainer.accumulate_grad_batches")
RESUME_IDENTITY = (*RUN_IDENTITY, *STEP_SETTINGS)
# A finished run is skipped only if it is what this command would make: its budget and evaluation included, and
# its step settings (compared from its stored config).
FINISHED_IDENTITY = (*RUN_IDENTITY, "trainer.max_steps", "trainer.accumulate_grad_batches", "eval")
ABSENT = object()  # a key a stored config lacks (null is a setting: no gradient clipping)


def run_identity(cfg: DictConfig, keys: tuple[str, ...] = RUN_IDENTITY, ignore: tuple[str, ...] = NOT_IDENTITY):
    """The ``keys`` of a run config, resolved, as dotted keys."""
    nodes = {key: OmegaConf.select(cfg, key, default=None) for key in keys}
    return flat_settings(
        {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in nodes.items()}, ignore
    )


def refuse_other_settings(stored: dict, cfg: DictConfig, what: str, remedy: str, more_steps: str = "") -> None:
    """A RunFolderMismatch naming the settings where ``stored`` (the identity of the run ``what`` belongs to) and this
    command differ, with ``remedy`` (and ``more_steps`` where a larger trainer.max_steps alone differs). Not
    compared: keys ``stored`` lacks (written before they existed), and keys this command leaves null (a default the
    code resolves, which older runs stored resolved: T5's max_distance)."""
    here = run_identity(cfg, tuple(dict.fromkeys(key.split(".")[0] for key in stored)) or RUN_IDENTITY, ())
    differing = [k for k in stored if k in here and here[k] is not None and not same_setting(k, stored[k], here[k])]
    if differing:
        shown = "; ".join(f"{k}={stored[k]!r} there, {here[k]!r} here" for k in differing[:3])
        more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
        longer = differing == ["trainer.max_steps"] and here["trainer.max_steps"] > stored["trainer.max_steps"]
        remedy += f". {more_steps}" if more_steps and longer else ""
        raise RunFolderMismatch(
            f"{what} belongs to a run with other settings than this command: {shown}{more}. {remedy}"
        )


class RunFolderMismatch(ConfigError):
    """The run folder holds another run: every job of a sweep re-launched into it would meet the same, so the sweep
    stops at the first (instead of reporting the old runs as this sweep's)."""

    ends_sweep = True


ANOTHER_FOLDER = (
    "Repeat the run's own settings, or give this run another folder (hydra.run.dir=..., or hydra.sweep.dir=... "
    "for a sweep)"
)
TRAIN_FURTHER = "To train a finished run further, delete its results.json: it resumes from checkpoints/last.ckpt"


def completed_results(cfg: DictConfig) -> dict | None:
    """The run's results if its results file is complete (a finished run a re-launched sweep skips); a
    ConfigError if the file is not lenext's or that run had other settings than this command."""
    path = os.path.join(cfg.paths.output_dir, RESULTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # written atomically: not lenext's, or not a file
        raise RunFolderMismatch(
            f"{path} cannot be read as a results file ({type(e).__name__}): move it away, or use another folder"
        ) from None
    problem = not_lenext_results(results)
    if problem:
        raise RunFolderMismatch(f"{path} is not a lenext results file ({problem}): move it away, or use another folder")
    if not results.get("complete"):
        return None
    meta = results["meta"]
    # What the file says of its run; meta.identity, where kept, says more (and earlier versions of it less).
    kept = meta["identity"] if isinstance(meta.get("identity"), dict) else {}
    stored = implied_identity(meta, cfg) | {RENAMED_KEYS.get(key, key): value for key, value in kept.items()}
    config = meta["run"].get("config") if isinstance(meta.get("run"), dict) else None
    if isinstance(config, dict):  # what its steps computed with: not in the identity, which groups the report's rows
        config = OmegaConf.create(config)
        given = [key for key in STEP_SETTINGS if OmegaConf.select(config, key, default=ABSENT) is not ABSENT]
        stored |= {key: value for key, value in run_identity(config, tuple(given), ()).items() if key not in stored}
    refuse_other_settings(stored, cfg, path, ANOTHER_FOLDER, more_steps=TRAIN_FURTHER)
    return results


def refuse_results_it_would_replace(
    output_dir: str, key: str = "hydra.run.dir", folder: str | None = None, evaluated: tuple[str, str] | None = None
) -> None:
    """An evaluation (eval.py's ckpt= or hf=) writes a results.json of its own: refused before any work where the
    folder holds a training run's (one without ``meta.checkpoint`` or ``meta.hf``), which it would replace, or
    (given ``evaluated``: ("checkpoint", its absolute path) or ("hf", the model as given)) another model's evaluation.
    ``key`` and ``folder``: the setting that chose the folder, and its value (a sweep's folder, above the job's)."""
    path = os.path.join(output_dir, RESULTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f).get("meta")
    except (OSError, ValueError, RecursionError, AttributeError):  # none, or not lenext's: no run's results to keep
        return
    if isinstance(meta, dict) and not {"checkpoint", "hf"} & set(meta):
        held = RESULTS_FILE if folder is None else path
        raise ConfigError(
            f"{key}={folder or output_dir} holds a training run's {held}, which this evaluation would replace: "
            f"give it another folder ({key}=...)"
        )
    if isinstance(meta, dict) and evaluated:
        kind, model = evaluated
        theirs = meta.get("checkpoint") if "checkpoint" in meta else (meta.get("hf") or {}).get("model")
        if theirs != model:
            raise ConfigError(
                f"{key}={folder or output_dir} holds the results of another model's evaluation ({theirs}), which this "
                f"evaluation of {kind} {model} would replace: give it another folder ({key}=...)"
            )


def refuse_a_runs_folder(output_dir: str, key: str = "hydra.run.dir", folder: str | None = None) -> None:
    """diagnose.py writes its own record of its command (.hydra/) and no results.json: refused before any work where
    the folder holds a lenext run's results.json, whose record it would replace. ``key`` and ``folder``: as
    ``refuse_results_it_would_replace``'s."""
    path = os.path.join(output_dir, RESULTS_FILE)
    if os.path.exists(path):
        raise ConfigError(
            f"{key}={folder or output_dir} holds a lenext run's {RESULTS_FILE if folder is None else path}, whose "
            f"record of its command (.hydra/) this diagnosis would replace: give it another folder "
            f"({key}={'<run>/diagnostics' if folder is None else '...'})"
        )


def record_command(cfg: DictConfig) -> None:
    """``<run folder>/.hydra/``: the command's config, Hydra's and its overrides, as Hydra writes them, but once the
    command is accepted (configs/hydra/default.yaml turns Hydra's own off: it writes them before the job starts, so a
    relaunch refused for its settings left the folder's run described by the refused command)."""
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is None or OmegaConf.is_missing(hydra_cfg.runtime, "output_dir") or launched_by_another_process():
        return  # not a job Hydra runs (a config composed in-process)
    folder = os.path.join(hydra_cfg.runtime.output_dir, ".hydra")
    for name, node in (
        ("config.yaml", cfg),
        ("hydra.yaml", HydraConfig.instance().cfg),  # {hydra: ...}
        ("overrides.yaml", hydra_cfg.overrides.task),
    ):
        write_atomic(os.path.join(folder, name), OmegaConf.to_yaml(node))


class EvaluationFolders(Callback):
    """eval.py's run folder, or the job folders (``<sweep>/<job number>``) its sweep folder already holds, checked
    before any job starts (``refuse_results_it_would_replace``): a sweep into a training sweep's folder is refused
    before its first job, not job by job, each failed job writing its error.txt into a training run's folder."""

    refuse = staticmethod(refuse_results_it_would_replace)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = config.hydra.sweep.dir
        if OmegaConf.to_container(config.hydra.sweep)["subdir"] != "${hydra.job.num}":
            return  # job folders named otherwise: each job checks its own (refuse_results_it_would_replace)
        for name in sorted(os.listdir(sweep)) if os.path.isdir(sweep) else []:
            if name.isdigit():  # a job folder of this sweep, by the default name
                self._check(os.path.join(sweep, name), "hydra.sweep.dir", sweep)

    def _check(self, *where: str) -> None:
        with errors_in_one_line():
            self.refuse(*where)


class DiagnosisFolders(EvaluationFolders):
    """diagnose.py's run folder, or its sweep's job folders, checked as eval.py's are (``refuse_a_runs_folder``):
    a sweep into a training sweep's folder is refused naming hydra.sweep.dir, before its first job."""

    refuse = staticmethod(refuse_a_runs_folder)


def implied_identity(meta: dict, cfg: DictConfig) -> dict:
    """What any lenext results file says of its run: PE, model, seed, L_train, positions and, from the tokens it
    trained, its steps (with this command's batch, on one device)."""
    identity = flat_settings({"pe": meta.get("pe_config") or {}, "model": meta.get("model") or {}})
    identity |= {"seed": meta["seed"], "data.max_len": meta["train_len"]}
    if isinstance(meta.get("positions"), dict) and "train" in meta["positions"]:
        identity["train.positions"] = meta["positions"]["train"]
    trainer, data = cfg.trainer, cfg.data
    if isinstance(meta.get("tokens_trained"), int) and trainer.get("devices") == 1:
        per_step = tokens_per_step(data.batch_size, data.max_len, trainer.get("accumulate_grad_batches") or 1)
        steps = meta["tokens_trained"] / per_step
        identity["trainer.max_steps"] = int(steps) if steps.is_integer() else f"{meta['tokens_trained']} tokens"
    return identity


def resume_checkpoint(cfg: DictConfig) -> tuple[str, RunSpec] | None:
    """The checkpoint a run resumes from and the run it stores: ``ckpt_path`` as given; ``last`` or null -> the run
    directory's last.ckpt when there is one. Either is read first: an unreadable file, or one from a run with other
    settings, is refused before any work."""
    checkpoints = os.path.join(cfg.paths.output_dir, "checkpoints")
    last = os.path.join(checkpoints, "last.ckpt")
    if cfg.ckpt_path not in (None, "last"):
        path, key = checkpoint_file(cfg.ckpt_path, "ckpt_path"), "ckpt_path"  # a run folder: its last.ckpt
    elif os.path.exists(last):
        path, key = last, None
    elif cfg.ckpt_path == "last":
        raise CheckpointError(f"ckpt_path=last: there is no {last} yet; drop ckpt_path to start afresh")
    else:
        return None
    try:
        checkpoint = load_checkpoint(path, key)
    except CheckpointError as e:
        if key:
            raise
        others = sorted(f for f in os.listdir(checkpoints) if f.endswith(".ckpt") and f != "last.ckpt")
        alternatives = (
            f"resume from another of its checkpoints (ckpt_path={os.path.join(checkpoints, others[0])}), "
            if others
            else ""
        )
        raise CheckpointError(
            f"{e}. This run's folder cannot resume from it: {alternatives}or delete it to train the run afresh"
        ) from None
    remedy = ANOTHER_FOLDER if key is None else "Repeat the settings it was trained with, or resume from another"
    spec = stored_spec(checkpoint, path)
    stored = run_identity(OmegaConf.create(spec.config), RESUME_IDENTITY, NOT_IDENTITY + EVALUATION_ONLY)
    refuse_other_settings(stored, cfg, f"{key}={path}" if key else path, remedy)
    if cfg.trainer.max_steps < checkpoint.get("global_step", 0):
        raise ConfigError(
            f"trainer.max_steps={cfg.trainer.max_steps} is invalid for this run: {path} is at step "
            f"{checkpoint['global_step']} already; it must be at least that"
        )
    log.info("resuming from %s", path)
    return path, spec


def refuse_resuming_on_other_processes(path: str, trainer) -> None:
    """A resume from ``path`` with steps left to train on another number of training processes (devices x nodes)
    than trained it, refused in one line: each process reads a batch of its own, so the global batch and the
    samples each step reads would change. A run with none left (its evaluation to finish) may move."""
    checkpoint = load_checkpoint(path)
    steps, tokens = checkpoint.get("global_step", 0), checkpoint.get("tokens_trained")
    if not steps or not isinstance(tokens, int) or trainer.max_steps <= steps:
        return
    config = stored_spec(checkpoint, path).config
    accumulate = config["trainer"].get("accumulate_grad_batches") or 1
    processes = processes_trained(tokens, steps, config["data"]["batch_size"], config["data"]["max_len"], accumulate)
    if processes != trainer.world_size:
        raise RunFolderMismatch(
            f"{path} was trained on {processes:g} processes (trainer.devices x trainer.num_nodes), this command runs "
            f"{trainer.world_size}, and each reads a batch of its own: the global batch and the samples each step "
            f"reads would change. Resume on {processes:g}, or give this run another folder",
            "trainer.devices",
        )


def preflight(cfg: DictConfig, settings: type | None, nodes: dict[str, type], sweeps: bool = True) -> RunSpec:
    """Everything a run will use, checked before any work: every key's type and range (``schema.check``), then
    the settings that only fail together, while resolving the run (``resolve``; a second stage's base read)."""
    check_settings(cfg, settings, nodes)
    return resolve(cfg, config_pe_name(cfg), sweeps, base=configured_base(cfg) if cfg.get("init_from") else None)


def check_settings(cfg: DictConfig, settings: type | None, nodes: dict[str, type]) -> None:
    """``schema.check``, then what the callbacks monitor (``refuse_unlogged_monitors``); a refused key that a preset
    set, not the command line, is said to be the preset's."""
    try:
        schema.check(cfg, settings, nodes)
        refuse_unlogged_monitors(cfg)
    except ConfigError as e:
        preset = preset_of(e.key) if e.key else None
        if preset is None:
            raise
        raise ConfigError(f"{e} ({e.key} is set by {preset}, not on the command line)", e.key) from None


def refuse_unlogged_monitors(cfg: DictConfig) -> None:
    """A callback's ``monitor`` (best.ckpt's ModelCheckpoint, an EarlyStopping) that names no metric the run logs
    (``lenext.module.logged_metrics``), refused in one line: Lightning finds it missing at a validation, or after
    the whole run, with a traceback."""
    answers = ACCURACY in instantiate(cfg.data, "data").protocols  # a probe's validation scores its answers
    logged = logged_metrics(answers)
    for name, callback in (cfg.get("callbacks") or {}).items():
        monitor = callback.get("monitor")
        if monitor is None or monitor in logged:
            continue
        key = f"callbacks.{name}.monitor"
        if monitor in logged_metrics(answers=True):  # a probe's metric, monitored by a run on text
            hint = f"; {monitor} is a probe's (data=synthetic)"
        else:
            hint = schema.did_you_mean(monitor, logged)
        names = ", ".join(map(repr, logged))
        raise ConfigError(f"{key}={monitor!r} is invalid: it must be a metric this run logs, one of {names}{hint}", key)


def configured_base(cfg: DictConfig) -> Base:
    """The second stage's base, ``init_from``; one a preset names (extension=...: the base of the same PE and seed
    in the sweep's folder) and that does not exist is said to be the preset's."""
    try:
        return read_base(cfg.init_from)
    except CheckpointError as e:
        preset = preset_of("init_from")
        if preset is None or os.path.exists(cfg.init_from):
            raise
        raise CheckpointError(
            f"{e}; this init_from is set by {preset} (the base of the same PE and seed in the sweep folder, which "
            "experiment=extension trains first): outside such a sweep, give init_from=<base run's last.ckpt>"
        ) from None


def resolve_training(cfg: DictConfig) -> tuple[RunSpec, dict | None]:
    """The RunSpec of ``train.py``'s config (checked by ``schema.check``) with how it starts, nanoGPT's ``init_from``
    switch: resuming this run's checkpoint, from a base checkpoint (``init_from``: read once, here), or from
    scratch; and the weights it starts from (a second stage's base's; None otherwise)."""
    resumed = resume_checkpoint(cfg)
    path, stored = resumed or (None, None)
    if stored and bool(stored.lineage) != bool(cfg.init_from):  # checkpoints from before lenext kept init_from
        trained_from = f"init_from={stored.lineage[-1].checkpoint}" if stored.lineage else "scratch"
        raise RunFolderMismatch(
            f"{path} belongs to a run trained from {trained_from}, this command from "
            f"{'init_from=' + cfg.init_from if cfg.init_from else 'scratch'}. {ANOTHER_FOLDER}"
        )
    base = configured_base(cfg) if cfg.init_from and not stored else None
    precision = canonical_precision(cfg.trainer.precision)
    spec = resolve(cfg, config_pe_name(cfg), cfg.eval.enabled, precision, stored, base)
    if path:
        return dataclasses.replace(spec, start="resume", checkpoint=path), None
    return spec, base.state if base else None
