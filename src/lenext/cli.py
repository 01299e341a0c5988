"""Hydra entry points behind ``train.py`` (and the checks that run before any work)."""

import functools
import json
import logging
import os
import sys
from collections.abc import Callable

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from lenext.errors import CheckpointError, ConfigError, LenextError
from lenext.evaluate import (
    ERROR_FILE,
    RESULTS_FILE,
    run_metadata,
    sweep,
    sweep_lengths,
    sweep_protocols,
    write_atomic,
    write_results,
)
from lenext.hardware import default_precision
from lenext.pe.bias import check_t5_buckets

log = logging.getLogger("lenext")
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")

# ${auto_precision:<accelerator>}: bf16-mixed on CUDA and on CPUs with native bf16, 32-true elsewhere.
OmegaConf.register_new_resolver("auto_precision", default_precision, replace=True)
# In run folder names: two sweeps started in the same second still get folders of their own.
OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
# The launch folder, known before Hydra's own config (hydra:runtime.cwd is not, when a sweep folder resolves).
OmegaConf.register_new_resolver("cwd", os.getcwd, replace=True)
# ${min:a,b}: e.g. T5's max_distance capped at L_train (configs/pe/t5.yaml says why).
OmegaConf.register_new_resolver("min", min, replace=True)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


# (key, test, what the value must be). Keys absent from the config (e.g. pe.k for non-Shaw PEs) are skipped.
CHECKS: list[tuple[str, Callable, str]] = [
    ("data.max_len", _positive_int, "a positive integer (the training length L_train)"),
    ("data.batch_size", _positive_int, "a positive integer"),
    (
        "data.vocab_size",
        lambda v: isinstance(v, int) and v >= 256,
        "an integer >= 256 (byte-level BPE keeps all 256 bytes)",
    ),
    ("optim.lr", _positive_number, "a positive number"),
    ("optim.weight_decay", lambda v: isinstance(v, int | float) and v >= 0, "a number >= 0"),
    ("optim.warmup_steps", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
    ("model.d_model", _positive_int, "a positive integer"),
    ("model.n_layers", _positive_int, "a positive integer"),
    ("model.n_heads", _positive_int, "a positive integer"),
    ("pe.k", _positive_int, "an integer >= 1 (Shaw's clipping distance)"),
    ("pe.num_buckets", lambda v: isinstance(v, int) and v >= 2, "an integer >= 2"),
    ("pe.max_distance", _positive_int, "a positive integer"),
    ("pe.base", _positive_number, "a positive number"),
    (
        "pe.factor",
        lambda v: v in (None, "as_trained") or (_positive_number(v) and v >= 1),
        "null (automatic) or a number >= 1",
    ),
    ("eval.tokens_per_batch", _positive_int, "a positive integer"),
    ("eval.stride", lambda v: v is None or _positive_int(v), "null (L_train / 2) or a positive integer"),
    ("eval.last_k", lambda v: v is None or _positive_int(v), "null (the shortest length) or a positive integer"),
]


def validate(cfg: DictConfig) -> None:
    """Fail before any work, with the key and what it must be."""
    for key, test, expected in CHECKS:
        value = OmegaConf.select(cfg, key, default="<absent>")
        if value != "<absent>" and not test(value):
            raise ConfigError(f"{key}={value!r} is invalid: it must be {expected}")
    pe = cfg.get("pe")
    if pe is not None and "num_buckets" in pe and "max_distance" in pe:
        check_t5_buckets(pe.num_buckets, pe.max_distance)
    model = cfg.get("model")
    if model is not None and model.d_model % model.n_heads:
        raise ConfigError(f"model.n_heads={model.n_heads} must divide model.d_model={model.d_model}")
    if "eval" in cfg:
        for key in ("lengths", "factors"):
            values = cfg.eval[key] or []
            if not all(_positive_number(v) for v in values):
                raise ConfigError(f"eval.{key}={list(values)} is invalid: every entry must be a positive number")
        if not (cfg.eval.lengths or cfg.eval.factors):
            raise ConfigError("eval.lengths and eval.factors are both empty: give the lengths to evaluate")


def instantiate(node, **kwargs):
    """hydra.utils.instantiate, re-raising lenext's own errors unwrapped (so they print as one line)."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, LenextError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def _hydra() -> HydraConfig | None:
    return HydraConfig.get() if HydraConfig.initialized() else None


def one_line_errors(main: Callable) -> Callable:
    """Print a LenextError as one line and exit 1; HYDRA_FULL_ERROR=1 keeps the traceback.

    In a multirun the failed job writes its message to error.txt in its folder and the sweep
    goes on; the report lists the job as failed.
    """

    @functools.wraps(main)
    def wrapper(cfg: DictConfig):
        try:
            return main(cfg)
        except LenextError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {e}", file=sys.stderr)
            hydra_cfg = _hydra()
            if hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:
                write_atomic(os.path.join(hydra_cfg.runtime.output_dir, ERROR_FILE), f"{e}\n")
                return None
            sys.exit(1)

    return wrapper


def build(cfg: DictConfig):
    """Data module, LightningModule and Trainer for a composed training config."""
    validate(cfg)
    hydra_cfg = _hydra()
    with open_dict(cfg):
        # The PE's config name (rope vs rope_ntk share a class) labels rows in reports.
        cfg.pe_name = hydra_cfg.runtime.choices.get("pe") if hydra_cfg else cfg.pe._target_.rsplit(".", 1)[-1].lower()
        if "wandb" in (cfg.get("logger") or {}):
            cfg.logger.wandb.name = cfg.logger.wandb.name or f"{cfg.pe_name}-L{cfg.data.max_len}-seed{cfg.seed}"
            if cfg.logger.wandb.group is None and hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:
                cfg.logger.wandb.group = os.path.basename(hydra_cfg.sweep.dir)  # one wandb group per sweep
    L.seed_everything(cfg.seed, workers=True)
    # Validation scores the windows of the sweep's nonoverlap row at L_train: the same measurement.
    datamodule = instantiate(cfg.data, validation_max_windows=cfg.eval.max_windows)
    datamodule.load()
    net = instantiate(cfg.model, vocab_size=datamodule.vocab_size, train_len=cfg.data.max_len, pe=instantiate(cfg.pe))
    # run_config holds _target_ keys: passed after instantiation so Hydra does not build it.
    module = instantiate(cfg.optim, _partial_=True, _convert_="all")(
        net=net, run_config=OmegaConf.to_container(cfg, resolve=True)
    )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return datamodule, module, trainer


def completed_results(output_dir: str) -> dict | None:
    """The run's results if its results file is complete (a finished run a re-launched sweep skips)."""
    try:
        with open(os.path.join(output_dir, RESULTS_FILE)) as f:
            results = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return results if results.get("complete") else None


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """``ckpt_path`` as given; ``last`` or null -> the run directory's last.ckpt when there is one."""
    last = os.path.join(cfg.paths.output_dir, "checkpoints", "last.ckpt")
    if cfg.ckpt_path not in (None, "last"):
        load_checkpoint(cfg.ckpt_path)  # fail now, with a clear message, if it is unusable
        return cfg.ckpt_path
    if os.path.exists(last):
        log.info("resuming from %s", last)
        return last
    if cfg.ckpt_path == "last":
        raise CheckpointError(f"ckpt_path=last: there is no {last} yet; drop ckpt_path to start afresh")
    return None


def train(cfg: DictConfig) -> dict:
    """Train, report validation perplexity at L_train, then sweep evaluation lengths. Returns the metrics.

    A run whose output folder already holds a complete results file is skipped, and one with a
    last.ckpt resumes from it: re-launching an interrupted sweep redoes only what did not finish.
    """
    done = completed_results(cfg.paths.output_dir)
    if done:
        first = done["rows"][0]
        print(f"skipping {cfg.paths.output_dir}: its {RESULTS_FILE} is complete")
        return {"val/ppl": first["ppl"], "val/loss": first["mean_nll"], "skipped": True}
    datamodule, module, trainer = build(cfg)
    n_params = sum(p.numel() for p in module.net.parameters())
    log.info("model: %.2fM parameters, PE %s, L_train %d", n_params / 1e6, module.net.pe.describe(), cfg.data.max_len)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_checkpoint(cfg))
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    measured = validation_scope(cfg, int(metrics["val/windows"]), len(datamodule.val_dataloader().dataset))
    print(
        f"validation perplexity at L_train={cfg.data.max_len} over {measured}: {metrics['val/ppl']:.2f} "
        f"(loss {metrics['val/loss']:.4f}, pe={cfg.pe_name})"
    )
    if cfg.eval.enabled and not cfg.trainer.get("fast_dev_run"):
        tokens = trainer.global_step * cfg.data.batch_size * cfg.data.max_len * trainer.world_size
        precision = "bf16" if str(trainer.precision).startswith("bf16") else "32"
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


def validation_scope(cfg: DictConfig, scored: int, available: int) -> str:
    """What the final validation measured, ``N windows (...)``: the sweep's nonoverlap 1x row, or what it lacks.

    Validation scores the windows that row scores (same documents, same eval.max_windows thinning),
    so the two perplexities agree unless validation was cut short or the sweep has no such row.
    """
    if scored < available:
        return (
            f"{scored} of the {available} windows of the nonoverlap 1x row "
            "(cut short by trainer.limit_val_batches or fast_dev_run)"
        )
    in_sweep = (
        cfg.eval.enabled
        and not cfg.trainer.get("fast_dev_run")
        and "nonoverlap" in sweep_protocols(cfg.eval)
        and cfg.data.max_len in sweep_lengths(cfg.eval, cfg.data.max_len)
    )
    row = "the sweep's nonoverlap 1x row" if in_sweep else "those of a nonoverlap 1x row, which this sweep lacks"
    return f"{scored} windows ({row})"


def log_results_to_wandb(trainer, results_path: str) -> None:
    """The evaluation rows as a wandb Table (key eval/results) when logging to wandb."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and results_path:
            with open(results_path) as f:
                rows = json.load(f)["rows"]
            columns = list(rows[0])
            logger.log_table(key="eval/results", columns=columns, data=[[r[c] for c in columns] for r in rows])


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
    rows, curves = sweep(net, datamodule.splits[split], cfg.data.max_len, cfg.eval, precision)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return ""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    meta = {**run_metadata(run_config, net, datamodule, split, tokens_trained), **(extra_meta or {})}
    path = write_results(output_dir, meta, rows, curves)
    print(format_rows(rows))
    print(f"results: {path}")
    return path


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'protocol':<10} {'scaling':<11} {'L_eval':>7} {'ppl':>10} {'tokens':>9} {'windows':>7}  status"]
    for r in rows:
        ppl = f"{r['ppl']:.3f}" if r["ppl"] is not None else "-"
        lines.append(
            f"{r['protocol']:<10} {r['scaling'] or '-':<11} {r['length']:>7} {ppl:>10} {r['tokens']:>9} "
            f"{r['windows']:>7}  {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
        )
    return "\n".join(lines)


def load_checkpoint(path: str) -> dict:
    """The checkpoint dict, or a CheckpointError that says what is wrong with the file."""
    if not path or not os.path.isfile(path):
        raise CheckpointError(
            f"ckpt={path!r} does not exist: pass the path of a .ckpt file from a training run "
            "(logs/train/runs/<time>/checkpoints/last.ckpt)"
        )
    try:
        # Full unpickling, as Lightning does: Lightning checkpoints hold more than tensors. Load only your own runs.
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated zip, pickle garbage, ...: all mean the file is not usable
        raise CheckpointError(
            f"ckpt={path!r} cannot be read ({type(e).__name__}): the file is truncated or "
            "not a PyTorch checkpoint; use another checkpoint of the run"
        ) from e
    if not isinstance(checkpoint, dict) or "run_config" not in checkpoint.get("hyper_parameters", {}):
        raise CheckpointError(f"ckpt={path!r} is not a lenext checkpoint (no run configuration inside)")
    return checkpoint


def evaluate_checkpoint(cfg: DictConfig) -> str:
    """eval.py: rebuild the model from a checkpoint, apply eval-time PE overrides, sweep, write results."""
    validate(cfg)
    checkpoint = load_checkpoint(cfg.ckpt)
    run = OmegaConf.create(checkpoint["hyper_parameters"]["run_config"])
    for key, value in cfg.pe.items():
        if value != "as_trained":
            if key not in run.pe:
                raise ConfigError(f"pe.{key} does not apply to this checkpoint's PE ({run.pe._target_})")
            run.pe[key] = value
    run.eval, run.paths = cfg.eval, cfg.paths
    validate(run)
    datamodule = instantiate(run.data)
    datamodule.load()
    net = instantiate(run.model, vocab_size=datamodule.vocab_size, train_len=run.data.max_len, pe=instantiate(run.pe))
    state = {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}
    net.load_state_dict(state)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = cfg.precision or ("bf16" if device.type == "cuda" else "32")
    tokens = checkpoint.get("global_step", 0) * run.data.batch_size * run.data.max_len
    return evaluate_and_write(
        run,
        net.to(device),
        datamodule,
        cfg.split,
        tokens,
        cfg.paths.output_dir,
        precision,
        {"checkpoint": os.path.abspath(cfg.ckpt)},
    )


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@one_line_errors
def train_main(cfg: DictConfig) -> dict:
    return train(cfg)  # the job's return value: the study progress line tells skipped jobs from trained ones


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
@one_line_errors
def eval_main(cfg: DictConfig) -> str:
    return evaluate_checkpoint(cfg)  # the job's return value: None would read as a failed job in a study
