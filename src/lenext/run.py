"""The story of a run: check the config, resolve it, build the objects, train, evaluate, write the results.

``train.py`` and ``eval.py`` (lenext.cli) call ``train`` and ``evaluate_checkpoint``. Both check every key and
resolve the run (lenext.resolve), evaluation plan included, before reading the corpus: a bad setting costs
seconds, never a training run. The run's folder decides whether it is skipped or resumed (lenext.run_folder).
"""

import logging
import os

import lightning as L
import torch
from hydra.types import RunMode
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from lenext import schema
from lenext.attention.flex import fresh_compile_state
from lenext.build import build_net, hydra_config, instantiate
from lenext.checkpoints import load_checkpoint, net_state, stored_spec
from lenext.errors import ConfigError, Stopped
from lenext.evaluate import sweep
from lenext.loggers import log_results_to_wandb
from lenext.module import tokens_trained
from lenext.resolve import EVAL_NODES, TRAIN_NODES, EvalScriptSettings, TrainSettings, resolve_evaluation
from lenext.results import RESULTS_FILE, code_commit, format_rows, run_metadata, write_results
from lenext.run_folder import FINISHED_IDENTITY, completed_results, resolve_training, run_identity
from lenext.spec import RunSpec

log = logging.getLogger("lenext")


class WithoutAdvertising(logging.Filter):
    """Drops Lightning's "Tip: try installing <product>" lines, printed by every Trainer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


# The logger Lightning's rank_zero_info writes to (lightning_utilities' `log`, as lightning.pytorch sets it).
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(WithoutAdvertising())


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
    spec, weights = resolve_training(cfg)
    identity = run_identity(cfg, FINISHED_IDENTITY)  # what a re-launch into this folder must repeat to skip it
    datamodule, module, trainer = build(cfg, spec, weights)
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
        net = module.net.to(trainer.strategy.root_device)  # fit's teardown leaves it on the CPU
        extra = {"identity": identity, "train_tokens_per_s": speed}
        path = evaluate_and_write(spec, net, datamodule, "validation", tokens_trained(trainer, cfg.data), cfg, extra)
        log_results_to_wandb(trainer, path)
    return metrics


def build(cfg: DictConfig, spec: RunSpec, weights: dict | None = None):
    """Data module, LightningModule and Trainer of a resolved run, its net holding ``weights`` (a second stage's
    base's) if given; the corpus is read here, after every check."""
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
    net = build_net(spec, datamodule.vocab_size)
    if weights is not None:  # the base's weights only: optimizer, step and schedule start afresh
        net.load_state_dict(weights)
    module = instantiate(cfg.module, "module", _partial_=True, _convert_="all")
    return datamodule, module(net=net, scheme=spec.scheme, seed=spec.seed, run=spec.stored()), trainer


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


def evaluate_and_write(spec: RunSpec, net, datamodule, split: str, tokens, cfg: DictConfig, extra: dict) -> str:
    """Run the length sweep on ``split`` and write results.json (+ positions.csv) into the run's output folder."""
    rows, curves = sweep(
        net, datamodule.evaluation(split), spec.plan, spec.eval, spec.precision, spec.scheme, spec.seed
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return ""
    # The precision of this evaluation (training's: meta.hardware.training_precision).
    meta = {**run_metadata(spec, net, datamodule, split, tokens), "precision": spec.precision, **extra}
    path = write_results(cfg.paths.output_dir, meta, rows, curves)
    print(format_rows(rows))
    print(f"results: {path}")
    return path


def evaluate_checkpoint(cfg: DictConfig) -> str:
    """eval.py: rebuild the model from a checkpoint, with its PE as eval.py changes it, sweep, write results."""
    schema.check(cfg, EvalScriptSettings, EVAL_NODES)
    checkpoint = load_checkpoint(cfg.ckpt)
    spec, datamodule = resolve_evaluation(cfg, stored_spec(checkpoint, f"ckpt={cfg.ckpt}"))
    state = net_state(checkpoint)
    net = build_net(spec, state["embedding.weight"].size(0))
    try:
        net.load_state_dict(state)
    except RuntimeError as e:  # a change that changes the PE's parameters (per_layer, hidden, num_buckets)
        changed = ", ".join(f"pe.{k}" for k, v in cfg.pe.items() if v != "as_trained") or "the PE settings"
        raise ConfigError(
            f"{changed}: the checkpoint's weights do not fit the PE built with it ({str(e).splitlines()[-1].strip()}); "
            "only settings that keep the PE's parameter shapes can change at evaluation"
        ) from None
    datamodule.load()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    identity = run_identity(OmegaConf.create(spec.config), FINISHED_IDENTITY)
    extra = {"checkpoint": os.path.abspath(cfg.ckpt), "identity": identity}
    # tokens_trained: absent from checkpoints written before it was kept
    return evaluate_and_write(spec, net.to(device), datamodule, cfg.split, checkpoint.get("tokens_trained"), cfg, extra)
