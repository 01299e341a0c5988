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

from lenext.errors import ConfigError, LenextError

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
    ("data.vocab_size", lambda v: isinstance(v, int) and v >= 256, "an integer >= 256 (byte-level BPE keeps all 256 bytes)"),
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
    ("pe.factor", lambda v: v is None or (_positive_number(v) and v >= 1), "null (automatic) or a number >= 1"),
]


def validate(cfg: DictConfig) -> None:
    """Fail before any work, with the key and what it must be."""
    for key, test, expected in CHECKS:
        value = OmegaConf.select(cfg, key, default="<absent>")
        if value != "<absent>" and not test(value):
            raise ConfigError(f"{key}={value!r} is invalid: it must be {expected}")
    d_model, heads = cfg.model.d_model, cfg.model.n_heads
    if d_model % heads:
        raise ConfigError(f"model.n_heads={heads} must divide model.d_model={d_model}")


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
    net = hydra.utils.instantiate(cfg.model, vocab_size=datamodule.vocab_size, train_len=cfg.data.max_len,
                                  pe=hydra.utils.instantiate(cfg.pe))
    # run_config holds _target_ keys: passed after instantiation so Hydra does not build it.
    module = hydra.utils.instantiate(cfg.optim, _partial_=True)(net=net, run_config=OmegaConf.to_container(cfg, resolve=True))
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    return datamodule, module, trainer


def train(cfg: DictConfig) -> dict:
    """Train, then report validation perplexity at L_train. Returns the final metrics."""
    datamodule, module, trainer = build(cfg)
    n_params = sum(p.numel() for p in module.net.parameters())
    log.info("model: %.2fM parameters, PE %s, L_train %d", n_params / 1e6, module.net.pe.describe(), cfg.data.max_len)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    print(f"validation perplexity at L_train={cfg.data.max_len}: {metrics['val/ppl']:.2f} "
          f"(loss {metrics['val/loss']:.4f}, PE {cfg.pe._target_.rsplit('.', 1)[-1]})")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
@one_line_errors
def train_main(cfg: DictConfig) -> None:
    train(cfg)
