"""Hydra entry points behind ``train.py`` (and the checks that run before any work)."""

import functools
import logging
import os
import sys
from collections.abc import Callable

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lenext.errors import CheckpointError, ConfigError, LenextError
from lenext.evaluate import run_metadata, sweep, write_results

log = logging.getLogger("lenext")
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")

OmegaConf.register_new_resolver(
    "auto_precision", lambda: "bf16-mixed" if torch.cuda.is_available() else "32-true", replace=True
)


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
    model = cfg.get("model")
    if model is not None and model.d_model % model.n_heads:
        raise ConfigError(f"model.n_heads={model.n_heads} must divide model.d_model={model.d_model}")
    if "eval" in cfg and not (cfg.eval.lengths or cfg.eval.factors):
        raise ConfigError("eval.lengths and eval.factors are both empty: give the lengths to evaluate")


def one_line_errors(main: Callable) -> Callable:
    """Print a LenextError as one line and exit 1; HYDRA_FULL_ERROR=1 keeps the traceback."""

    @functools.wraps(main)
    def wrapper(cfg: DictConfig):
        try:
            return main(cfg)
        except LenextError as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)

    return wrapper


def build(cfg: DictConfig):
    """Data module, LightningModule and Trainer for a composed training config."""
    validate(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.load()
    net = hydra.utils.instantiate(
        cfg.model, vocab_size=datamodule.vocab_size, train_len=cfg.data.max_len, pe=hydra.utils.instantiate(cfg.pe)
    )
    # run_config holds _target_ keys: passed after instantiation so Hydra does not build it.
    module = hydra.utils.instantiate(cfg.optim, _partial_=True)(
        net=net, run_config=OmegaConf.to_container(cfg, resolve=True)
    )
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return datamodule, module, trainer


def train(cfg: DictConfig) -> dict:
    """Train, report validation perplexity at L_train, then sweep evaluation lengths. Returns the metrics."""
    datamodule, module, trainer = build(cfg)
    n_params = sum(p.numel() for p in module.net.parameters())
    log.info("model: %.2fM parameters, PE %s, L_train %d", n_params / 1e6, module.net.pe.describe(), cfg.data.max_len)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    print(
        f"validation perplexity at L_train={cfg.data.max_len}: {metrics['val/ppl']:.2f} "
        f"(loss {metrics['val/loss']:.4f}, PE {cfg.pe._target_.rsplit('.', 1)[-1]})"
    )
    if cfg.eval.enabled and not cfg.trainer.get("fast_dev_run"):
        tokens = trainer.global_step * cfg.data.batch_size * cfg.data.max_len * trainer.world_size
        precision = "bf16" if str(trainer.precision).startswith("bf16") else "32"
        evaluate_and_write(cfg, module.net, datamodule, "validation", tokens, cfg.paths.output_dir, precision)
    return metrics


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
    datamodule = hydra.utils.instantiate(run.data)
    datamodule.load()
    net = hydra.utils.instantiate(
        run.model, vocab_size=datamodule.vocab_size, train_len=run.data.max_len, pe=hydra.utils.instantiate(run.pe)
    )
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
def train_main(cfg: DictConfig) -> None:
    train(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
@one_line_errors
def eval_main(cfg: DictConfig) -> None:
    evaluate_checkpoint(cfg)
