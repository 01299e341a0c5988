"""A run's lifecycle: check the config, build the objects, train, evaluate, write the results.

``train.py`` and ``eval.py`` (lenext.cli) call ``train`` and ``evaluate_checkpoint``. Both check
every key (lenext.schema) and build everything they will use, evaluation plan included, before
reading the corpus: a bad setting costs seconds, never a training run.
"""

import dataclasses
import importlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Annotated, Literal

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import get_object
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from lenext import schema
from lenext.attention import AttentionSettings
from lenext.attention.flex import fresh_compile_state
from lenext.errors import CheckpointError, ConfigError, LenextError, Stopped
from lenext.evaluate import (
    RESULTS_FILE,
    EvalSettings,
    SweepPlan,
    code_commit,
    not_lenext_results,
    run_metadata,
    sweep,
    sweep_plan,
    write_results,
)
from lenext.hardware import PRECISION_NAMES, Precision, canonical_precision
from lenext.module import tokens_trained
from lenext.pe.rope import SCALINGS
from lenext.positions import TrainPositions, position_scheme
from lenext.schema import Range
from lenext.spec import RunSpec, Stage, first_stage_row, later_stage_row

log = logging.getLogger("lenext")


class WithoutAdvertising(logging.Filter):
    """Drops Lightning's "Tip: try installing <product>" lines, printed by every Trainer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


# The logger Lightning's rank_zero_info writes to (lightning_utilities' `log`, as lightning.pytorch sets it).
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(WithoutAdvertising())


@dataclass(frozen=True)
class TrainSettings:
    """The top-level keys of configs/train.yaml (its groups are declared by what they build)."""

    task_name: str
    seed: Annotated[int, Range(0, 2**32 - 1)]  # what Lightning's seed_everything accepts
    ckpt_path: str | None
    init_from: str | None = None  # a second stage: the base checkpoint whose weights it starts from


@dataclass(frozen=True)
class Paths:
    """configs/paths/default.yaml."""

    root_dir: str
    log_dir: str
    cache_dir: str
    output_dir: str


@dataclass(frozen=True)
class EvalScriptSettings:
    """The top-level keys of configs/eval.yaml."""

    task_name: str
    ckpt: str
    split: Literal["validation", "test", "train"]
    precision: Precision | None  # null: bf16-mixed on a GPU, 32-true on CPU


def checkpoint_pe_overrides(
    scaling: Literal[("as_trained", *SCALINGS)],
    factor: Literal["as_trained"] | Annotated[float, Range(1)] | None,
    **other_settings_of_the_pe,
) -> None:
    """Declares eval.yaml's ``pe`` node (never called): evaluation-time changes to the checkpoint's PE.

    ``as_trained`` keeps the checkpoint's value. Any other setting of that PE may be added
    (``+pe.base=20000``); it is checked against the PE's own declaration.
    """


TRAIN_NODES = {"attention": AttentionSettings, "eval": EvalSettings, "paths": Paths, "train": TrainPositions}
EVAL_NODES = {**TRAIN_NODES, "pe": checkpoint_pe_overrides}


# How libraries refuse settings when their objects are built (Lightning's Trainer: MisconfigurationException).
REFUSALS = (ValueError, TypeError, MisconfigurationException)


def instantiate(node, key: str, **kwargs):
    """hydra.utils.instantiate of config group ``key``, every error as one line.

    lenext's own errors come out unwrapped; a library's refusal (Lightning's Trainer checks the
    combination of its settings) is named with the group it came from. Any other exception is a
    bug, not a setting, and keeps its traceback.
    """
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, LenextError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, LenextError):
            raise cause from None
        # A library refuses settings with these; from lenext's own classes they are bugs (they raise ConfigError).
        if cause is not None and (not isinstance(cause, REFUSALS) or str(node.get("_target_")).startswith("lenext.")):
            raise cause from e
        reason = str(cause or e).strip().splitlines()[0] if str(cause or e).strip() else type(cause).__name__
        raise ConfigError(f"{key} is invalid: {node.get('_target_')} refused it: {reason}") from e


def hydra_config() -> HydraConfig | None:
    return HydraConfig.get() if HydraConfig.initialized() else None


def config_pe_name(cfg: DictConfig) -> str:
    """The PE's config name (``pe=rope_ntk``; rope and rope_ntk share a class), or its class's for a config
    composed without Hydra's runtime."""
    hydra_cfg = hydra_config()
    chosen = hydra_cfg.runtime.choices.get("pe") if hydra_cfg else None
    return chosen or cfg.get("pe_name") or str(cfg.pe._target_).rsplit(".", 1)[-1].lower()


def build_decoder(config: dict, train_len: int, reach: int, vocab_size: int):
    """A Decoder of a run config's PE, model and attention nodes (a config from before ``attention`` existed:
    its defaults), trained at ``train_len`` with positions reaching ``reach``."""
    attention = AttentionSettings(**(config.get("attention") or {}))
    pe = instantiate(config["pe"], "pe")
    return instantiate(
        config["model"],
        "model",
        vocab_size=vocab_size,
        train_len=train_len,
        max_position=reach,
        pe=pe,
        attention=attention,
    )


def build_net(spec: RunSpec, vocab_size: int):
    """The Decoder of a run: the one place a model is built (training, eval.py, benchmarks)."""
    return build_decoder(spec.config, spec.train_len, spec.reach, vocab_size)


def resolved_pe(config: dict, train_len: int, reach: int) -> dict:
    """The run config's PE node with every hyperparameter resolved (``PositionalEncoding.hyperparameters``), read
    from the model built with it: milliseconds, and the model's own checks (heads and width, T5's buckets, RoPE's
    head size) run on the way."""
    built = build_decoder(config, train_len, reach, 256).pe
    return {"_target_": config["pe"]["_target_"], "_partial_": True, **built.hyperparameters()}


def resolved_positions(cfg: DictConfig) -> TrainPositions:
    """The run's ``train`` node (absent from configs before it existed: sequential), its nulls filled in."""
    settings = TrainPositions(**(OmegaConf.to_container(cfg.train, resolve=True) if "train" in cfg else {}))
    scheme = position_scheme(dataclasses.asdict(settings), cfg.data.max_len)
    if settings.positions == "randomized":
        return dataclasses.replace(settings, max_position=scheme.reach)
    if settings.positions == "pose":
        return dataclasses.replace(settings, target_len=scheme.reach)
    return settings


def evaluation_plan(eval_settings: EvalSettings, base_len: int, scheme, data) -> SweepPlan:
    """What the sweep will evaluate on ``data``'s protocols, each length checked against the data."""
    plan = sweep_plan(eval_settings, base_len, scheme, data.protocols)
    factors_of = "data.max_len" if base_len == data.max_len else f"L_train of the first stage ({base_len})"
    data.check_length(
        min(plan.lengths), "min(eval.lengths)" if eval_settings.lengths else f"min(eval.factors) x {factors_of}"
    )
    return plan


def resolve(
    cfg: DictConfig, pe_name: str, sweeps: bool = True, precision: str | None = None, resumed: RunSpec | None = None
) -> RunSpec:
    """The RunSpec of a config ``schema.check`` passed: the PE's hyperparameters resolved, the positions, the
    evaluation plan (when the run ``sweeps``), its lineage and row. Settings that only fail together, and a base
    checkpoint (``init_from``) that cannot serve this stage, raise a one-line error here, before any work. A second
    stage ``resumed`` from its own checkpoint takes its PE and lineage from it: its base need not exist any more."""
    positions = resolved_positions(cfg)
    scheme = position_scheme(dataclasses.asdict(positions), cfg.data.max_len)
    reach = scheme.reach or cfg.data.max_len
    config = OmegaConf.to_container(cfg, resolve=True)
    lineage, base_len, row = (), cfg.data.max_len, first_stage_row(pe_name, scheme.name, config.get("attention"))
    if resumed and resumed.lineage:
        config["pe"] = resumed.config["pe"]
        lineage, base_len, row = resumed.lineage, resumed.base_len, resumed.row
    elif cfg.get("init_from"):
        base, stage = read_base(cfg.init_from)
        pe = stage_pe(config, pe_name, base, stage)
        try:
            config["pe"] = resolved_pe({**config, "pe": pe}, cfg.data.max_len, reach)
        except ConfigError as e:
            raise ConfigError(
                f"{e}; but a second stage keeps the PE settings of init_from={stage.checkpoint}, which its weights "
                f"fit: this PE cannot be trained further at {reach} positions"
            ) from None
        fits_weights(config, stage, reach)
        lineage, base_len = (*base.lineage, stage), base.base_len
        row = later_stage_row(base.row, config["pe"], scheme.name, reach)
    else:
        config["pe"] = resolved_pe(config, cfg.data.max_len, reach)
    data = instantiate(cfg.data, "data")  # reads nothing yet: a corpus is read by load()
    eval_settings = EvalSettings(**OmegaConf.to_container(cfg.eval, resolve=True))
    return RunSpec(
        config=config,
        pe_name=pe_name,
        row=row,
        seed=cfg.seed,
        train_len=cfg.data.max_len,
        base_len=base_len,
        positions=positions,
        eval=eval_settings,
        plan=evaluation_plan(eval_settings, base_len, scheme, data) if sweeps else None,
        precision=precision,
        start="init_from" if lineage else "scratch",
        checkpoint=lineage[-1].checkpoint if lineage else None,
        lineage=lineage,
    )


def preflight(cfg: DictConfig, settings: type | None, nodes: dict[str, type], sweeps: bool = True) -> RunSpec:
    """Everything a run will use, checked before any work: every key's type and range (``schema.check``), then
    the settings that only fail together, while resolving the run (``resolve``)."""
    schema.check(cfg, settings, nodes)
    return resolve(cfg, config_pe_name(cfg), sweeps)


# Data settings a second stage may change: the others fix the vocabulary (tokenizer) or the task.
STAGE_DATA_SETTINGS = (
    "max_len",
    "batch_size",
    "eval_batch_size",
    "num_workers",
    "cache_dir",
    "seed",
    "eval_samples",
    "train_samples",
)
STAGE_MODEL_SETTINGS = ("dropout",)  # the model's other settings fix its weights' shapes


def read_base(path: str) -> tuple[RunSpec, Stage]:
    """The RunSpec of a base checkpoint (``init_from``) and the stage it is, refused in one line if unreadable."""
    checkpoint = load_checkpoint(path, "init_from")
    base = stored_spec(checkpoint, f"init_from={path}")
    steps, tokens = checkpoint.get("global_step", 0), checkpoint.get("tokens_trained")
    return base, base.as_stage(os.path.abspath(path), steps, tokens)


def stage_pe(config: dict, pe_name: str, base: RunSpec, stage: Stage) -> dict:
    """The PE node of a second stage from ``base``: the base's resolved PE, with this command's values of the PE's
    ``STAGE_SETTINGS`` (RoPE's scaling). Refuses, in one line, what the base's weights cannot serve: a shorter
    length, another model, vocabulary or PE, another value of any other PE setting."""
    where = f"init_from={stage.checkpoint}"
    if config["data"]["max_len"] < base.train_len:
        raise ConfigError(
            f"data.max_len={config['data']['max_len']} is invalid for a second stage: {where} was trained at "
            f"data.max_len={base.train_len}; it must be at least that (a second stage extends the context; for PoSE, "
            "train at the base's length with train.positions=pose train.target_len=L')"
        )
    for group, free in (("model", STAGE_MODEL_SETTINGS), ("data", STAGE_DATA_SETTINGS)):
        here, theirs = flat_settings(config[group], ()), flat_settings(base.config[group], ())
        for name in sorted(set(here) | set(theirs)):
            if name.split(".")[0] not in free and here.get(name) != theirs.get(name):
                raise ConfigError(
                    f"{group}.{name}={here.get(name)!r} is invalid for a second stage: {where} was trained with "
                    f"{group}.{name}={theirs.get(name)!r}; a second stage trains the base's model on the base's "
                    f"vocabulary: repeat the base's {group} settings"
                )
    attention, base_attention = (flat_settings(c.get("attention") or {}, ()) for c in (config, base.config))
    for name in sorted(set(attention) | set(base_attention)):
        if attention.get(name) != base_attention.get(name, AttentionSettings.__dataclass_fields__[name].default):
            raise ConfigError(
                f"attention.{name}={attention.get(name)!r} is invalid for a second stage: {where} was trained with "
                f"attention.{name}={base_attention.get(name)!r}; a second stage trains the base's attention"
            )
    pe, theirs = config["pe"], base.config["pe"]
    changeable = get_object(theirs["_target_"]).STAGE_SETTINGS
    if not same_setting("_target_", theirs["_target_"], pe["_target_"]):
        if pe.get("scaling", "none") != "none" and "scaling" not in changeable:
            raise ConfigError(
                f"pe.scaling={pe['scaling']} is invalid for a second stage from {where}: its PE ({theirs['_target_']}) "
                f"takes no RoPE scaling; fine-tune it directly with its own PE (pe={base.pe_name})"
            )
        raise ConfigError(
            f"pe={pe_name} is invalid for a second stage: {where} was trained with pe={base.pe_name} "
            f"({theirs['_target_']}); a second stage trains the base's PE"
        )
    return stage_settings(pe, theirs, "pe", where)


def stage_settings(pe: dict, theirs: dict, key: str, where: str) -> dict:
    """The base's resolved PE node ``theirs`` with the command's values of its ``STAGE_SETTINGS``; the member PEs of a
    PE made of PEs (``pes``: Compose, PerLayer) merged the same way, each by its own STAGE_SETTINGS."""
    changeable = get_object(theirs["_target_"]).STAGE_SETTINGS
    merged = dict(theirs)
    for name, value in pe.items():
        if name == "pes" and isinstance(value, dict) and isinstance(theirs.get(name), dict):
            merged[name] = dict(theirs[name])
            for member, settings in value.items():
                if member not in theirs[name]:
                    raise ConfigError(
                        f"{key}.pes.{member} is invalid for a second stage: {where} has no such PE "
                        f"(its {key}.pes: {', '.join(theirs[name])}); a second stage trains the base's PEs"
                    )
                merged[name][member] = stage_settings(settings, theirs[name][member], f"{key}.pes.{member}", where)
        elif name in changeable:
            merged[name] = value
        elif name not in schema.HYDRA_KEYS and value is not None and not same_setting(name, theirs.get(name), value):
            may = ", ".join(f"{key}.{k}" for k in changeable) or "none of them"
            raise ConfigError(
                f"{key}.{name}={value!r} is invalid for a second stage: {where} was trained with {key}.{name}="
                f"{theirs.get(name)!r}, which its weights keep; repeat that value (a second stage may change {may})"
            )
    for name in changeable:  # the command's values, its config's defaults included: said, not silent
        if name in theirs and merged.get(name) != theirs[name]:
            log.info("second stage: %s.%s=%r (the base's: %r)", key, name, merged.get(name), theirs[name])
    return merged


def fits_weights(config: dict, stage: Stage, reach: int) -> None:
    """Refuses, before any work, a second stage whose model the base's weights do not fit exactly."""
    state = net_state(load_checkpoint(stage.checkpoint, "init_from"))
    vocab_size = state["embedding.weight"].size(0)
    net = build_decoder(config, config["data"]["max_len"], reach, vocab_size)
    try:
        net.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(
            f"init_from={stage.checkpoint}: its weights do not fit this stage's model "
            f"({str(e).splitlines()[-1].strip()}); repeat the base's model and PE settings"
        ) from None


def net_state(checkpoint: dict) -> dict:
    """The Decoder's weights in a checkpoint of the LightningModule."""
    return {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}


def stored_spec(checkpoint: dict, named: str) -> RunSpec:
    """The RunSpec a checkpoint (``named`` in errors) holds; for one written before lenext kept it, resolved from its
    run config."""
    hyper = checkpoint["hyper_parameters"]
    if "run" in hyper:
        try:
            return RunSpec.from_stored(hyper["run"])
        except (TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(
                f"{named}: its run description is not this lenext version's ({type(e).__name__}: {e}); use the "
                "lenext that wrote it"
            ) from None
    config = OmegaConf.create(hyper["run_config"])
    precision = (config.get("trainer") or {}).get("precision")
    return resolve(
        config,
        config.get("pe_name") or config.pe._target_.rsplit(".", 1)[-1].lower(),
        sweeps=False,
        precision=canonical_precision(precision) if precision in PRECISION_NAMES else None,
    )


def build(cfg: DictConfig, spec: RunSpec):
    """Data module, LightningModule and Trainer of a resolved run; the corpus is read here, after every check."""
    code_commit()  # the code this process loaded, read before a long run
    hydra_cfg = hydra_config()
    if "wandb" in (cfg.get("logger") or {}):
        with open_dict(cfg):
            cfg.logger.wandb.name = cfg.logger.wandb.name or f"{spec.row}-L{spec.train_len}-seed{spec.seed}"
            if cfg.logger.wandb.group is None and hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:
                cfg.logger.wandb.group = os.path.basename(hydra_cfg.sweep.dir)  # one wandb group per sweep
    # The Trainer first: Lightning checks its settings together (devices, precision, strategy) when built.
    callbacks = [instantiate(c, f"callbacks.{name}") for name, c in (cfg.get("callbacks") or {}).items()]
    loggers = [instantiate(c, f"logger.{name}") for name, c in (cfg.get("logger") or {}).items()]
    trainer = instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)
    fresh_compile_state()  # each run of a multirun compiles its own flex kernels
    L.seed_everything(spec.seed, workers=True)
    # Validation scores the windows of the sweep's nonoverlap row at L_train: the same measurement.
    datamodule = instantiate(cfg.data, "data", validation_max_windows=spec.eval.max_windows)
    datamodule.load()
    return datamodule, build_module(cfg, spec, datamodule.vocab_size), trainer


def build_module(cfg: DictConfig, spec: RunSpec, vocab_size: int):
    """The LightningModule of a resolved run; a second stage's net holds the base's weights."""
    net = build_net(spec, vocab_size)
    if spec.start == "init_from":  # the base's weights only: optimizer, step and schedule start afresh
        net.load_state_dict(net_state(load_checkpoint(spec.checkpoint, "init_from")))
    return instantiate(cfg.module, "module", _partial_=True, _convert_="all")(
        net=net, scheme=spec.scheme, seed=spec.seed, run=spec.stored()
    )


def resolve_training(cfg: DictConfig) -> RunSpec:
    """The RunSpec of ``train.py``'s config (checked by ``schema.check``), with how it starts: resuming this run's
    checkpoint, from a base checkpoint (``init_from``), or from scratch."""
    resumed = resume_checkpoint(cfg)
    stored = stored_spec(load_checkpoint(resumed, None), resumed) if resumed else None
    if stored and bool(stored.lineage) != bool(cfg.init_from):  # checkpoints from before lenext kept init_from
        trained_from = f"init_from={stored.lineage[-1].checkpoint}" if stored.lineage else "scratch"
        raise RunFolderMismatch(
            f"{resumed} belongs to a run trained from {trained_from}, this command from "
            f"{'init_from=' + cfg.init_from if cfg.init_from else 'scratch'}. {ANOTHER_FOLDER}"
        )
    precision = canonical_precision(cfg.trainer.precision)
    spec = resolve(cfg, config_pe_name(cfg), cfg.eval.enabled, precision, stored)
    return dataclasses.replace(spec, start="resume", checkpoint=resumed) if resumed else spec


# What makes a run the run it is: resuming it under other values would mix two runs (the trainer's may change:
# a longer max_steps continues a run). Left out: what only changes how data is read or how much memory a step takes.
RUN_IDENTITY = ("model", "pe", "attention", "train", "module", "seed", "data", "init_from")
NOT_IDENTITY = ("data.num_workers", "data.eval_batch_size", "data.cache_dir", "eval.tokens_per_batch")
EVALUATION_ONLY = ("data.eval_samples",)  # a probe's evaluation samples: a resume may change them, a skip may not
# A finished run is skipped only if it is what this command would make: its budget and evaluation included.
FINISHED_IDENTITY = (*RUN_IDENTITY, "trainer.max_steps", "trainer.accumulate_grad_batches", "eval")


def flat_settings(settings: dict, ignore: tuple[str, ...] = NOT_IDENTITY) -> dict:
    """Nested settings as dotted keys (``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``), ``ignore`` left
    out."""
    flat = {}

    def visit(key: str, value) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                visit(f"{key}.{name}" if key else str(name), item)
        elif not key.startswith(ignore):
            flat[key] = value

    visit("", settings)
    return flat


def run_identity(cfg: DictConfig, keys: tuple[str, ...] = RUN_IDENTITY, ignore: tuple[str, ...] = NOT_IDENTITY):
    """The ``keys`` of a run config, resolved, as dotted keys."""
    nodes = {key: OmegaConf.select(cfg, key, default=None) for key in keys}
    return flat_settings(
        {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in nodes.items()}, ignore
    )


def same_setting(key: str, stored, here) -> bool:
    """Equal values, where a ``_target_`` (``key`` or inside a mapping) may name its class by another import path:
    a config may name it where its package exports it (lenext.pe.RoPE) or where it is defined
    (lenext.pe.rope.RoPE), and configs have moved between them."""
    if isinstance(stored, dict) and isinstance(here, dict):
        return stored.keys() == here.keys() and all(same_setting(k, stored[k], here[k]) for k in stored)
    if stored == here:
        return True
    if key.rpartition(".")[2] != "_target_" or not (isinstance(stored, str) and isinstance(here, str)):
        return False
    return imported(stored) is not None and imported(stored) is imported(here)


def imported(path: str):
    """The object an import path names, or None (no error printed: hydra's get_object logs one)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def refuse_other_settings(stored: dict, cfg: DictConfig, what: str, remedy: str) -> None:
    """A RunFolderMismatch naming the settings where ``stored`` (the identity of the run ``what`` belongs to) and this
    command differ. Not compared: keys ``stored`` lacks (written before they existed), and keys this command leaves
    null (a default the code resolves, which older runs stored resolved: T5's max_distance)."""
    here = run_identity(cfg, tuple(dict.fromkeys(key.split(".")[0] for key in stored)) or RUN_IDENTITY, ())
    differing = [k for k in stored if k in here and here[k] is not None and not same_setting(k, stored[k], here[k])]
    if differing:
        shown = "; ".join(f"{k}={stored[k]!r} there, {here[k]!r} here" for k in differing[:3])
        more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
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
FINISHED_ELSEWHERE = (
    f"{ANOTHER_FOLDER}. To train a finished run further (a larger trainer.max_steps), delete its results.json: "
    "it resumes from checkpoints/last.ckpt"
)


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
    stored = implied_identity(meta, cfg) | (meta["identity"] if isinstance(meta.get("identity"), dict) else {})
    refuse_other_settings(stored, cfg, path, FINISHED_ELSEWHERE)
    return results


def implied_identity(meta: dict, cfg: DictConfig) -> dict:
    """What any lenext results file says of its run: PE, model, seed, L_train, positions and, from the tokens it
    trained, its steps (with this command's batch, on one device)."""
    identity = flat_settings({"pe": meta.get("pe_config") or {}, "model": meta.get("model") or {}})
    identity |= {"seed": meta["seed"], "data.max_len": meta["train_len"]}
    if isinstance(meta.get("positions"), dict) and "train" in meta["positions"]:
        identity["train.positions"] = meta["positions"]["train"]
    trainer, data = cfg.trainer, cfg.data
    if isinstance(meta.get("tokens_trained"), int) and trainer.get("devices") == 1:
        per_step = data.batch_size * data.max_len * (trainer.get("accumulate_grad_batches") or 1)
        steps = meta["tokens_trained"] / per_step
        identity["trainer.max_steps"] = int(steps) if steps.is_integer() else f"{meta['tokens_trained']} tokens"
    return identity


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """``ckpt_path`` as given; ``last`` or null -> the run directory's last.ckpt when there is one. Either is read
    first: an unreadable file, or one from a run with other settings, is refused before any work."""
    checkpoints = os.path.join(cfg.paths.output_dir, "checkpoints")
    last = os.path.join(checkpoints, "last.ckpt")
    if cfg.ckpt_path not in (None, "last"):
        path, key = cfg.ckpt_path, "ckpt_path"
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
    trained = OmegaConf.create(stored_spec(checkpoint, path).config)
    stored = run_identity(trained, ignore=NOT_IDENTITY + EVALUATION_ONLY)
    refuse_other_settings(stored, cfg, f"{key}={path}" if key else path, remedy)
    if cfg.trainer.max_steps < checkpoint.get("global_step", 0):
        raise ConfigError(
            f"trainer.max_steps={cfg.trainer.max_steps} is invalid for this run: {path} is at step "
            f"{checkpoint['global_step']} already; it must be at least that"
        )
    log.info("resuming from %s", path)
    return path


def train(cfg: DictConfig) -> dict:
    """Train, report validation perplexity at L_train, then sweep evaluation lengths. Returns the metrics.

    A run whose output folder already holds a complete results file is skipped, and one with a
    last.ckpt resumes from it: re-launching an interrupted sweep redoes only what did not finish.
    """
    schema.check(cfg, TrainSettings, TRAIN_NODES)
    if cfg.init_from:  # identities compare it, and a later working folder must not change which file it is
        cfg.init_from = os.path.abspath(os.path.expanduser(cfg.init_from))
    done = completed_results(cfg)
    if done:
        first = done["rows"][0]
        print(f"skipping {cfg.paths.output_dir}: its {RESULTS_FILE} is complete")
        return {"val/ppl": first["ppl"], "val/loss": first["mean_nll"], "skipped": True}
    spec = resolve_training(cfg)
    identity = run_identity(cfg, FINISHED_IDENTITY)  # what a re-launch into this folder must repeat to skip it
    datamodule, module, trainer = build(cfg, spec)
    n_params = sum(p.numel() for p in module.net.parameters())
    log.info("model: %.2fM parameters, PE %s, L_train %d", n_params / 1e6, module.net.pe.describe(), spec.train_len)
    if spec.start == "init_from":
        log.info("second stage of %s: its weights, a fresh optimizer and schedule", spec.checkpoint)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=spec.checkpoint if spec.start == "resume" else None)
        if trainer.received_sigterm:  # at the last step, after which the loop raises nothing: last.ckpt is the end
            raise SIGTERMException
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
        if trainer.received_sigterm:
            raise SIGTERMException
    except SIGTERMException:  # saved by lenext.module.CheckpointOnSigterm, or at the end of training
        raise Stopped(
            f"training stopped by SIGTERM at step {trainer.global_step} of {trainer.max_steps}; "
            f"{os.path.join(cfg.paths.output_dir, 'checkpoints', 'last.ckpt')} holds it there: "
            "run the same command to resume"
        ) from None
    measured = validation_scope(
        spec, int(metrics["val/windows"]), len(datamodule.val_dataloader().dataset), datamodule.protocols
    )
    accuracy = f", exact match {metrics['val/exact_match']:.3f}" if "val/exact_match" in metrics else ""
    print(
        f"validation perplexity at L_train={spec.train_len} over {measured}: {metrics['val/ppl']:.2f} "
        f"(loss {metrics['val/loss']:.4f}{accuracy}, row {spec.row})"
    )
    if spec.plan and not cfg.trainer.get("fast_dev_run"):
        speed = module.train_tokens / module.train_seconds * trainer.world_size if module.train_seconds else None
        path = evaluate_and_write(
            spec,
            module.net.to(trainer.strategy.root_device),  # fit's teardown leaves it on the CPU
            datamodule,
            "validation",
            tokens_trained(trainer, cfg.data),
            cfg.paths.output_dir,
            spec.precision,
            {"identity": identity, "train_tokens_per_s": speed},
        )
        log_results_to_wandb(trainer, path)
    return metrics


def validation_scope(spec: RunSpec, scored: int, available: int, protocols: tuple[str, ...]) -> str:
    """What the final validation measured, ``N windows (...)``: the sweep's row at this stage's training length of
    the data's first protocol (``nonoverlap`` for text, ``accuracy`` for a probe), or what it lacks.

    Validation scores the windows that row scores (same documents or samples, same eval.max_windows
    thinning), so the two agree unless validation was cut short or the sweep has no such row.
    """
    measured = protocols[0]
    if scored < available:
        return (
            f"{scored} of the {available} windows of the {measured} row at L_train "
            "(cut short by trainer.limit_val_batches or fast_dev_run)"
        )
    in_sweep = bool(spec.plan) and measured in spec.plan.protocols and spec.train_len in spec.plan.lengths
    row = "the sweep's" if in_sweep else "those of the"
    lacks = "" if in_sweep else ", which this sweep lacks"
    return f"{scored} windows ({row} {measured} row at L_train{lacks})"


def log_results_to_wandb(trainer, results_path: str) -> None:
    """The evaluation rows as a wandb Table (key eval/results) when logging to wandb."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and results_path:
            with open(results_path) as f:
                rows = json.load(f)["rows"]
            columns = list(dict.fromkeys(key for row in rows for key in row))  # passkey's depth rows add `depth`
            logger.log_table(key="eval/results", columns=columns, data=[[r.get(c) for c in columns] for r in rows])


def evaluate_and_write(
    spec: RunSpec,
    net,
    datamodule,
    split: str,
    tokens_trained,
    output_dir: str,
    precision: str,
    extra_meta: dict | None = None,
) -> str:
    """Run the length sweep on ``split`` and write results.json (+ positions.csv) into ``output_dir``."""
    rows, curves = sweep(net, datamodule.evaluation(split), spec.plan, spec.eval, precision, spec.scheme, spec.seed)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return ""
    meta = {
        **run_metadata(spec, net, datamodule, split, tokens_trained),
        "precision": precision,  # of this evaluation (training's: meta.hardware.training_precision)
        **(extra_meta or {}),
    }
    path = write_results(output_dir, meta, rows, curves)
    print(format_rows(rows))
    print(f"results: {path}")
    return path


def format_rows(rows: list[dict]) -> str:
    """The rows as a console table; a probe's rows with their exact-match accuracy (and depth, for passkey)."""
    probe = any("exact_match" in r for r in rows)

    def number(value, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    extra = f" {'exact':>6} {'depth':>5}" if probe else ""
    lines = [f"{'protocol':<10} {'scaling':<11} {'L_eval':>7} {'ppl':>10}{extra} {'tokens':>9} {'windows':>7}  status"]
    for r in rows:
        extra = f" {number(r.get('exact_match')):>6} {number(r.get('depth'), 1):>5}" if probe else ""
        lines.append(
            f"{r['protocol']:<10} {r['scaling'] or '-':<11} {r['length']:>7} {number(r['ppl']):>10}{extra} "
            f"{r['tokens']:>9} {r['windows']:>7}  {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
        )
    return "\n".join(lines)


def load_checkpoint(path: str, key: str | None = "ckpt") -> dict:
    """The checkpoint dict, or a CheckpointError that says what is wrong with the file (named as ``key``=path)."""
    named = f"{key}={path!r}" if key else path
    if not path or not os.path.isfile(path):
        raise CheckpointError(
            f"{named} does not exist: pass the path of a .ckpt file from a training run "
            "(logs/train/runs/<time>/checkpoints/last.ckpt)"
        )
    try:
        # Full unpickling, as Lightning does: Lightning checkpoints hold more than tensors. Load only your own runs.
        # Memory-mapped: a resume reads it here for its settings and Lightning reads it again, so no second copy.
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # truncated zip, pickle garbage, ...: all mean the file is not usable
        raise CheckpointError(
            f"{named} cannot be read ({type(e).__name__}): the file is truncated (a run killed or a disk filled "
            "while it was written) or not a PyTorch checkpoint" + ("; use another checkpoint of the run" if key else "")
        ) from e
    stored = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    if not isinstance(stored, dict) or not ({"run", "run_config"} & set(stored)):  # run_config: before RunSpec
        raise CheckpointError(f"{named} is not a lenext checkpoint (no run configuration inside)")
    return checkpoint


def evaluate_checkpoint(cfg: DictConfig) -> str:
    """eval.py: rebuild the model from a checkpoint, apply eval-time PE overrides, sweep, write results."""
    schema.check(cfg, EvalScriptSettings, EVAL_NODES)
    checkpoint = load_checkpoint(cfg.ckpt)
    trained = stored_spec(checkpoint, f"ckpt={cfg.ckpt}")
    run = OmegaConf.create(trained.config)
    trained_scaling = run.pe.get("scaling")
    for key, value in cfg.pe.items():
        if value != "as_trained":
            if key not in run.pe:
                raise ConfigError(f"pe.{key} does not apply to this checkpoint's PE ({run.pe._target_})")
            run.pe[key] = value
    if cfg.pe.scaling not in ("as_trained", trained_scaling) and cfg.pe.factor == "as_trained":
        # Another scaling, zero-shot on the checkpoint as trained: factor null from the positions it trained, as
        # a sweep's variant (RoPE.variant); its trained factor and original context belong to its own scaling.
        run.pe.factor = None
        if cfg.pe.get("original_len", "as_trained") == "as_trained":
            run.pe.original_len = None
    run.eval, run.paths = cfg.eval, cfg.paths
    # What evaluation uses of the run; the other keys belong to training and to the code that trained it.
    used = [key for key in ("data", "model", "pe", "attention", "train", "eval", "paths") if key in run]
    schema.check(OmegaConf.masked_copy(run, used), None, {k: v for k, v in TRAIN_NODES.items() if k in run})
    config = OmegaConf.to_container(run, resolve=True)
    config["pe"] = resolved_pe(config, trained.train_len, trained.reach)
    datamodule = instantiate(run.data, "data")
    eval_settings = EvalSettings(**config["eval"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fallback = "bf16-mixed" if device.type == "cuda" else "32-true"  # fp32 on CPU: exact, whatever the ISA
    spec = dataclasses.replace(
        trained,
        config=config,
        eval=eval_settings,
        plan=evaluation_plan(eval_settings, trained.base_len, trained.scheme, datamodule),
        precision=canonical_precision(fallback if cfg.precision is None else cfg.precision),
    )
    state = net_state(checkpoint)
    net = build_net(spec, state["embedding.weight"].size(0))
    try:
        net.load_state_dict(state)
    except RuntimeError as e:  # an override that changes the PE's parameters (per_layer, hidden, num_buckets)
        changed = ", ".join(f"pe.{k}" for k, v in cfg.pe.items() if v != "as_trained") or "the PE settings"
        raise ConfigError(
            f"{changed}: the checkpoint's weights do not fit the PE built with it ({str(e).splitlines()[-1].strip()}); "
            "only settings that keep the PE's parameter shapes can change at evaluation"
        ) from None
    datamodule.load()
    return evaluate_and_write(
        spec,
        net.to(device),
        datamodule,
        cfg.split,
        checkpoint.get("tokens_trained"),  # absent from checkpoints written before it was kept
        cfg.paths.output_dir,
        spec.precision,
        {"checkpoint": os.path.abspath(cfg.ckpt), "identity": run_identity(run, FINISHED_IDENTITY)},
    )
