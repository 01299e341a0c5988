"""A run's lifecycle: check the config, build the objects, train, evaluate, write the results.

``train.py`` and ``eval.py`` (lenext.cli) call ``train`` and ``evaluate_checkpoint``. Both check
every key (lenext.schema) and build everything they will use, evaluation plan included, before
reading the corpus: a bad setting costs seconds, never a training run.
"""

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
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from lenext import schema
from lenext.attention.flex import fresh_compile_state
from lenext.errors import CheckpointError, ConfigError, LenextError, Stopped
from lenext.evaluate import (
    RESULTS_FILE,
    EvalSettings,
    code_commit,
    not_lenext_results,
    run_metadata,
    sweep,
    sweep_plan,
    write_results,
)
from lenext.hardware import Precision, canonical_precision
from lenext.module import tokens_trained
from lenext.pe.rope import SCALINGS
from lenext.positions import PositionScheme, TrainPositions, position_scheme
from lenext.schema import Range

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


TRAIN_NODES = {"eval": EvalSettings, "paths": Paths, "train": TrainPositions}
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


def positions_of(run: DictConfig) -> PositionScheme:
    """The run's ``train`` positions (checkpoints from before the key: sequential)."""
    settings = run.get("train")
    return position_scheme(OmegaConf.to_container(settings) if settings else None, run.data.max_len)


def build_net(run: DictConfig, vocab_size: int):
    """The Decoder of a run config: the one place a model is built (training, eval.py, pre-flight)."""
    pe = instantiate(run.pe, "pe")
    train_len, reach = run.data.max_len, positions_of(run).reach
    return instantiate(run.model, "model", vocab_size=vocab_size, train_len=train_len, max_position=reach, pe=pe)


def preflight(run: DictConfig, settings: type | None, nodes: dict[str, type], sweeps: bool = True) -> None:
    """Everything a run will use, checked before any work: every key's type and range, the model
    (relations between keys: heads and width, T5's buckets, RoPE's head size) and, when the run ``sweeps``
    lengths, the evaluation plan."""
    schema.check(run, settings, nodes)
    data = instantiate(run.data, "data")  # reads nothing yet: a corpus is read by load()
    build_net(run, 256)  # milliseconds, any vocabulary; the real one waits for the tokenizer's
    if not sweeps:
        return
    plan = sweep_plan(run.eval, run.data.max_len, positions_of(run), data.protocols)
    data.check_length(
        min(plan.lengths), "min(eval.lengths)" if run.eval.lengths else "min(eval.factors) x data.max_len"
    )


def build(cfg: DictConfig):
    """Data module, LightningModule, Trainer and the checkpoint to resume from (or None) for a composed
    training config, each setting checked (``preflight``, the checkpoint) before the corpus is read."""
    preflight(cfg, TrainSettings, TRAIN_NODES, sweeps=cfg.eval.enabled)
    code_commit()  # the code this process loaded, read before a long run
    hydra_cfg = hydra_config()
    with open_dict(cfg):
        # The PE's config name (rope vs rope_ntk share a class) labels rows in reports.
        cfg.pe_name = hydra_cfg.runtime.choices.get("pe") if hydra_cfg else cfg.pe._target_.rsplit(".", 1)[-1].lower()
        if "wandb" in (cfg.get("logger") or {}):
            cfg.logger.wandb.name = cfg.logger.wandb.name or f"{cfg.pe_name}-L{cfg.data.max_len}-seed{cfg.seed}"
            if cfg.logger.wandb.group is None and hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:
                cfg.logger.wandb.group = os.path.basename(hydra_cfg.sweep.dir)  # one wandb group per sweep
    # The Trainer first: Lightning checks its settings together (devices, precision, strategy) when built.
    callbacks = [instantiate(c, f"callbacks.{name}") for name, c in (cfg.get("callbacks") or {}).items()]
    loggers = [instantiate(c, f"logger.{name}") for name, c in (cfg.get("logger") or {}).items()]
    trainer = instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)
    resume_from = resume_checkpoint(cfg)
    fresh_compile_state()  # each run of a multirun compiles its own flex kernels
    L.seed_everything(cfg.seed, workers=True)
    # Validation scores the windows of the sweep's nonoverlap row at L_train: the same measurement.
    datamodule = instantiate(cfg.data, "data", validation_max_windows=cfg.eval.max_windows)
    datamodule.load()
    net = build_net(cfg, datamodule.vocab_size)
    # run_config holds _target_ keys: passed after instantiation so Hydra does not build it.
    module = instantiate(cfg.module, "module", _partial_=True, _convert_="all")(
        net=net, scheme=positions_of(cfg), seed=cfg.seed, run_config=OmegaConf.to_container(cfg, resolve=True)
    )
    return datamodule, module, trainer, resume_from


# What makes a run the run it is: resuming it under other values would mix two runs (the trainer's may change:
# a longer max_steps continues a run). Left out: what only changes how data is read or how much memory a step takes.
RUN_IDENTITY = ("model", "pe", "train", "module", "seed", "data")
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


def refuse_other_settings(stored: dict, cfg: DictConfig, what: str, remedy: str) -> None:
    """A RunFolderMismatch naming the settings where ``stored`` (the identity of the run ``what`` belongs to) and this
    command differ. Not compared: keys ``stored`` lacks (written before they existed), and keys this command leaves
    null (a default the code resolves, which older runs stored resolved: T5's max_distance)."""
    here = run_identity(cfg, tuple(dict.fromkeys(key.split(".")[0] for key in stored)) or RUN_IDENTITY, ())
    differing = [k for k in stored if k in here and here[k] is not None and stored[k] != here[k]]
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
    trained = OmegaConf.create(checkpoint["hyper_parameters"]["run_config"])
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
    done = completed_results(cfg)
    if done:
        first = done["rows"][0]
        print(f"skipping {cfg.paths.output_dir}: its {RESULTS_FILE} is complete")
        return {"val/ppl": first["ppl"], "val/loss": first["mean_nll"], "skipped": True}
    datamodule, module, trainer, resume_from = build(cfg)
    n_params = sum(p.numel() for p in module.net.parameters())
    log.info("model: %.2fM parameters, PE %s, L_train %d", n_params / 1e6, module.net.pe.describe(), cfg.data.max_len)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
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
        cfg, int(metrics["val/windows"]), len(datamodule.val_dataloader().dataset), datamodule.protocols
    )
    accuracy = f", exact match {metrics['val/exact_match']:.3f}" if "val/exact_match" in metrics else ""
    print(
        f"validation perplexity at L_train={cfg.data.max_len} over {measured}: {metrics['val/ppl']:.2f} "
        f"(loss {metrics['val/loss']:.4f}{accuracy}, pe={cfg.pe_name})"
    )
    if cfg.eval.enabled and not cfg.trainer.get("fast_dev_run"):
        tokens = tokens_trained(trainer, cfg.data)
        precision = canonical_precision(trainer.precision)
        speed = module.train_tokens / module.train_seconds * trainer.world_size if module.train_seconds else None
        path = evaluate_and_write(
            cfg,
            module.net,
            datamodule,
            "validation",
            tokens,
            cfg.paths.output_dir,
            precision,
            {"train_tokens_per_s": speed},
        )
        log_results_to_wandb(trainer, path)
    return metrics


def validation_scope(cfg: DictConfig, scored: int, available: int, protocols: tuple[str, ...]) -> str:
    """What the final validation measured, ``N windows (...)``: the sweep's 1x row of the data's first protocol
    (``nonoverlap`` for text, ``accuracy`` for a probe), or what it lacks.

    Validation scores the windows that row scores (same documents or samples, same eval.max_windows
    thinning), so the two agree unless validation was cut short or the sweep has no such row.
    """
    measured = protocols[0]
    if scored < available:
        return (
            f"{scored} of the {available} windows of the {measured} 1x row "
            "(cut short by trainer.limit_val_batches or fast_dev_run)"
        )
    in_sweep = False
    if cfg.eval.enabled and not cfg.trainer.get("fast_dev_run"):  # planned (and checked) only when there is a sweep
        plan = sweep_plan(cfg.eval, cfg.data.max_len, None, protocols)
        in_sweep = measured in plan.protocols and cfg.data.max_len in plan.lengths
    row = f"the sweep's {measured} 1x row" if in_sweep else f"those of the {measured} 1x row, which this sweep lacks"
    return f"{scored} windows ({row})"


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
    cfg: DictConfig,
    net,
    datamodule,
    split: str,
    tokens_trained,
    output_dir: str,
    precision: str,
    extra_meta: dict | None = None,
) -> str:
    """Run the length sweep on ``split`` and write results.json (+ positions.csv) into ``output_dir``."""
    rows, curves = sweep(
        net, datamodule.evaluation(split), cfg.data.max_len, cfg.eval, precision, positions_of(cfg), cfg.seed
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return ""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    meta = {
        **run_metadata(run_config, net, datamodule, split, tokens_trained),
        "precision": precision,  # of this evaluation (training's: meta.hardware.training_precision)
        "identity": run_identity(cfg, FINISHED_IDENTITY),  # what a re-launch into this folder must repeat to skip it
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
    if not isinstance(checkpoint, dict) or "run_config" not in checkpoint.get("hyper_parameters", {}):
        raise CheckpointError(f"{named} is not a lenext checkpoint (no run configuration inside)")
    return checkpoint


def evaluate_checkpoint(cfg: DictConfig) -> str:
    """eval.py: rebuild the model from a checkpoint, apply eval-time PE overrides, sweep, write results."""
    schema.check(cfg, EvalScriptSettings, EVAL_NODES)
    checkpoint = load_checkpoint(cfg.ckpt)
    run = OmegaConf.create(checkpoint["hyper_parameters"]["run_config"])
    for key, value in cfg.pe.items():
        if value != "as_trained":
            if key not in run.pe:
                raise ConfigError(f"pe.{key} does not apply to this checkpoint's PE ({run.pe._target_})")
            run.pe[key] = value
    run.eval, run.paths = cfg.eval, cfg.paths
    # What evaluation uses of the run; the other keys belong to training and to the code that trained it.
    used = [key for key in ("data", "model", "pe", "train", "eval", "paths") if key in run]
    preflight(OmegaConf.masked_copy(run, used), None, {k: v for k, v in TRAIN_NODES.items() if k in run})
    state = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}
    net = build_net(run, state["embedding.weight"].size(0))
    try:
        net.load_state_dict(state)
    except RuntimeError as e:  # an override that changes the PE's parameters (per_layer, hidden, num_buckets)
        changed = ", ".join(f"pe.{k}" for k, v in cfg.pe.items() if v != "as_trained") or "the PE settings"
        raise ConfigError(
            f"{changed}: the checkpoint's weights do not fit the PE built with it ({str(e).splitlines()[-1].strip()}); "
            "only settings that keep the PE's parameter shapes can change at evaluation"
        ) from None
    datamodule = instantiate(run.data, "data")
    datamodule.load()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fallback = "bf16-mixed" if device.type == "cuda" else "32-true"  # fp32 on CPU: exact, whatever the ISA
    precision = canonical_precision(fallback if cfg.precision is None else cfg.precision)
    return evaluate_and_write(
        run,
        net.to(device),
        datamodule,
        cfg.split,
        checkpoint.get("tokens_trained"),  # absent from checkpoints written before it was kept
        cfg.paths.output_dir,
        precision,
        {"checkpoint": os.path.abspath(cfg.ckpt)},
    )
