"""The story of a run: check the config, resolve it, build the objects, train, evaluate, write the results.

``train.py`` and ``eval.py`` (lenext.cli) call ``train`` and ``evaluate_checkpoint``. Both check every key and
resolve the run (lenext.resolve), evaluation plan included, before reading the corpus: a bad setting costs
seconds, never a training run. The run's folder decides whether it is skipped or resumed (lenext.run_folder).
"""

import contextlib
import logging
import os
import shutil

import lightning as L
import torch
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from lenext import schema
from lenext.attention.flex import fresh_compile_state
from lenext.build import build_module, build_net, hydra_config, instantiate, unsharded
from lenext.checkpoints import checkpoint_file, load_checkpoint, net_state, refuse_other_data, stored_spec
from lenext.errors import ConfigError, Stopped
from lenext.evaluate import sweep
from lenext.files import atomic_path
from lenext.hardware import (
    COMPILED_PATHS_TORCH,
    refuse_an_fsdp_that_cannot_run,
    refuse_more_cpu_processes_than_cores,
    refuse_nodes_without_a_cluster,
    refuse_older_torch,
)
from lenext.loggers import CSVLogger, log_results_to_wandb
from lenext.module import VAL_LOSS, VAL_PPL, VAL_WINDOWS, CheckpointOnStop, answer_metric, tokens_trained
from lenext.progress import StepsBar, next_steps, validation_scope
from lenext.protocols import refuse_an_evaluator_of_other_text
from lenext.resolve import (
    AS_TRAINED,
    EVAL_NODES,
    TRAIN_NODES,
    EvalScriptSettings,
    TrainSettings,
    resolve_evaluation,
    stage_changes,
)
from lenext.results import RESULTS_FILE, code_commit, format_rows, run_metadata, training_precision, write_results
from lenext.run_folder import (
    FINISHED_IDENTITY,
    check_settings,
    completed_results,
    record_command,
    refuse_results_it_would_replace,
    refuse_resuming_on_other_processes,
    resolve_training,
    run_identity,
)
from lenext.spec import RunSpec

log = logging.getLogger("lenext")


# Lightning's notices (devices available, seed set, "fit stopped", tips) off the console: lenext's lines say what
# a run is and where it went; Lightning's warnings still show.
for name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(name).setLevel(logging.WARNING)


def train(cfg: DictConfig) -> dict:
    """Train, report validation perplexity at L_train, then sweep evaluation lengths. Returns the metrics.

    A run whose output folder already holds a complete results file is skipped, and one with a
    last.ckpt resumes from it: re-launching an interrupted sweep redoes only what did not finish.
    """
    check_settings(cfg, TrainSettings, TRAIN_NODES)
    if cfg.init_from:  # identities compare it, and a later working folder must not change which file it is
        cfg.init_from = os.path.abspath(os.path.expanduser(cfg.init_from))
    done = completed_results(cfg)
    if done:
        first = done["rows"][0]
        print(f"skipping {cfg.paths.output_dir}: its {RESULTS_FILE} is complete")
        return {VAL_PPL: first["ppl"], VAL_LOSS: first["mean_nll"], "skipped": True}
    spec, weights = resolve_training(cfg)
    identity = run_identity(cfg, FINISHED_IDENTITY)  # what a re-launch into this folder must repeat to skip it
    datamodule, module, trainer = build(cfg, spec, weights)
    record_command(cfg)  # accepted: build's checks passed
    del weights  # held by the module's net now
    log_run_start(spec, module, trainer)
    metrics = fit_and_validate(spec, trainer, module, datamodule)
    say = print if rank_zero_only.rank == 0 else lambda *_: None  # under a subprocess launcher each rank runs this
    say(validation_line(spec, metrics, datamodule))
    evaluated = bool(spec.plan) and not cfg.trainer.get("fast_dev_run")
    if evaluated:
        speed = module.train_tokens / module.train_seconds * trainer.world_size if module.train_seconds else None
        # fit's teardown may leave the net on the CPU; under FSDP it is sharded
        net = unsharded(module.net, spec, datamodule.vocab_size).to(trainer.strategy.root_device)
        extra = {"identity": identity, "train_tokens_per_s": speed}
        path = evaluate_and_write(spec, net, datamodule, "validation", tokens_trained(trainer, cfg.data), cfg, extra)
        log_results_to_wandb(trainer, path)
    hydra_cfg = hydra_config()
    if not (hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN) and trainer.is_global_zero:
        print(next_steps(cfg.paths.output_dir, evaluated))
    return metrics


def log_run_start(spec: RunSpec, module, trainer) -> None:
    """The run's line: its row, size, PE and settings, L_train, precision and device; a second stage's changes."""
    n_params = sum(p.numel() for p in module.net.parameters())
    pe = ", ".join(f"{k} {v}" for k, v in module.net.pe.describe().items() if k != "name")
    (log.info if rank_zero_only.rank == 0 else log.debug)(
        "%s: %.2fM parameters, PE %s (%s), L_train %d, %s on %s",
        spec.row,
        n_params / 1e6,
        module.net.pe.DISPLAY_NAME,
        pe or "no settings",
        spec.train_len,
        spec.precision,
        trainer.strategy.root_device,
    )
    if spec.start == "init_from":
        log.info("second stage of %s: its weights, a fresh optimizer and schedule", spec.checkpoint)
        for change in stage_changes(spec.config["pe"], spec.lineage[-1].config["pe"]):
            log.info("second stage: %s", change)


def fit_and_validate(spec: RunSpec, trainer, module, datamodule) -> dict:
    """Training from where the run starts, then the validation at the steps done: its metrics. A stop signal
    raises ``Stopped`` once last.ckpt holds where training stopped."""
    stop = next((c for c in trainer.callbacks if isinstance(c, CheckpointOnStop)), None)
    try:
        if spec.start == "init_from":
            log_validation_before_training(trainer, module, datamodule)
        trainer.fit(module, datamodule=datamodule, ckpt_path=spec.checkpoint if spec.start == "resume" else None)
        if trainer.received_sigterm:  # at the last step, after which the loop raises nothing: last.ckpt is the end
            raise SIGTERMException
        # Logged at the steps done, as after an uninterrupted fit: a run resumed where training ended counts one less
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
        if trainer.received_sigterm:
            raise SIGTERMException
        keep_a_best_checkpoint(trainer)
    except SystemExit as e:  # SIGTERMException (a signal, at a step boundary), or Lightning's exit on a second Ctrl-C
        if stop is not None and stop.non_finite is not None:  # the loss went bad before the signal: no checkpoint
            raise stop.non_finite from None
        if stop is not None and (isinstance(e, SIGTERMException) or stop.at_once):
            raise stop.stopped(trainer) from None
        if isinstance(e, SIGTERMException):  # else the command would exit 0
            raise Stopped(
                f"training stopped by a signal at step {trainer.global_step}, saved nowhere: "
                "callbacks.stop_checkpoint is off"
            ) from None
        raise
    return metrics


def validation_line(spec: RunSpec, metrics: dict, datamodule) -> str:
    measured = validation_scope(
        spec, int(metrics[VAL_WINDOWS]), len(datamodule.val_dataloader().dataset.samples), datamodule.protocols
    )
    exact_match = answer_metric("exact_match")
    accuracy = f", exact match {metrics[exact_match]:.3f}" if exact_match in metrics else ""
    return (
        f"validation perplexity at L_train={spec.train_len} over {measured}: {metrics[VAL_PPL]:.2f} "
        f"(loss {metrics[VAL_LOSS]:.4f}{accuracy}, row {spec.row})"
    )


def log_validation_before_training(trainer, module, datamodule) -> None:
    """A second stage's validation before its first step (its base's weights, its method applied: where its
    adaptation curve starts), into metrics.csv at step -1: Lightning logs a validation after step k at k - 1, so the
    report reads it as step 0. Not to the other loggers, which take no step before 0."""
    loggers, trainer.loggers = trainer.loggers, []
    try:
        metrics = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    finally:
        trainer.loggers = loggers
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            logger.log_metrics(metrics, step=-1)
            logger.save()


def keep_a_best_checkpoint(trainer) -> None:
    """A run shorter than its validation interval never validated while training, so a monitoring ModelCheckpoint
    (``best.ckpt``) wrote nothing: its final weights (``last.ckpt``), the only ones validated, are its best."""
    last = next((c.last_model_path for c in trainer.checkpoint_callbacks if c.last_model_path), None)
    if not trainer.is_global_zero or not last or not os.path.exists(last):
        return
    metrics = {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}
    for callback in trainer.checkpoint_callbacks:
        if callback.monitor and not callback.best_model_path and callback.dirpath:
            path = callback.format_checkpoint_name(metrics)  # its filename's fields filled, as Lightning's own
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_path(path) as tmp:
                shutil.copyfile(last, tmp)


def refuse_a_machine_it_cannot_run_on(trainer: DictConfig) -> None:
    """What the trainer asks of this machine that it lacks (a CUDA GPU; a cluster for several nodes), refused in
    ``build`` and, for each job of a sweep, before the first starts (``lenext.cli.check_training_job``)."""
    if trainer.get("accelerator") in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={trainer.accelerator} is invalid here: this machine has no CUDA GPU; use "
            "trainer=cpu, or trainer=default (the fastest device and precision the machine has); trainer=ddp_sim and "
            "trainer=fsdp_sim run DDP and FSDP as processes on this CPU"
        )
    refuse_nodes_without_a_cluster(int(trainer.get("num_nodes") or 1))


def build(cfg: DictConfig, spec: RunSpec, weights: dict | None = None):
    """Data module, LightningModule and Trainer of a resolved run, its net holding ``weights`` (a second stage's
    base's) if given; the corpus is read here, after every check."""
    if (spec.start == "init_from") != (weights is not None):  # else a second stage would train from random weights
        raise ValueError(f"build: a run that starts from {spec.start} takes {'' if weights is None else 'no '}weights")
    code_commit()  # the code this process loaded, read before a long run
    hydra_cfg = hydra_config()
    if "wandb" in (cfg.get("logger") or {}):
        with open_dict(cfg):
            cfg.logger.wandb.name = cfg.logger.wandb.name or f"{spec.row}-L{spec.train_len}-seed{spec.seed}"
            if cfg.logger.wandb.group is None and hydra_cfg and hydra_cfg.mode == RunMode.MULTIRUN:
                cfg.logger.wandb.group = os.path.basename(hydra_cfg.sweep.dir)  # one wandb group per sweep
    refuse_a_machine_it_cannot_run_on(cfg.trainer)
    # The Trainer first: Lightning checks its settings together (devices, precision, strategy) when built.
    callbacks = [instantiate(c, f"callbacks.{name}") for name, c in (cfg.get("callbacks") or {}).items()]
    callbacks += [StepsBar()] if cfg.trainer.get("enable_progress_bar", True) else []
    loggers = [instantiate(c, f"logger.{name}") for name, c in (cfg.get("logger") or {}).items()]
    trainer = instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)
    refuse_more_cpu_processes_than_cores(
        cfg.trainer.get("devices"), trainer.num_devices, trainer.strategy.root_device.type
    )
    refuse_an_fsdp_that_cannot_run(cfg.trainer.get("strategy"), trainer.num_devices * trainer.num_nodes)
    if spec.start == "resume":
        refuse_resuming_on_other_processes(spec.checkpoint, trainer)
    if cfg.module.get("compile"):
        if trainer.strategy.root_device.type == "cpu":
            raise ConfigError(
                "module.compile=true is invalid on a CPU: torch.compile's CPU backend crashed (SIGSEGV) in the "
                "backward pass in some tries (DAPE, FIRE, RoPE under NTK: benchmarks/compile-check.md); it is for GPUs"
            )
        refuse_older_torch("module.compile=true", COMPILED_PATHS_TORCH, "older ones break lenext's blocks' graphs")
    fresh_compile_state()  # each run of a multirun compiles its own flex kernels
    L.seed_everything(spec.seed, workers=True)
    # Validation scores the windows of the sweep's nonoverlap row at L_train: the same measurement.
    datamodule = instantiate(cfg.data, "data", validation_max_windows=spec.eval.max_windows)
    datamodule.load()
    datamodule.train_windows()  # a corpus too short for a batch: refused before the model is built
    if spec.start != "scratch":  # the checkpoint it starts from trained on this data (a corpus changed since: not)
        named = spec.checkpoint if spec.start == "resume" else f"init_from={spec.checkpoint}"
        trained_on = load_checkpoint(spec.checkpoint, key=None).get("trained_on")
        refuse_other_data(trained_on, datamodule, named, whole=spec.start == "resume")
    refuse_an_evaluator_of_other_text(spec.plan, datamodule)
    module = build_module(cfg.module, spec, build_net(spec, datamodule.vocab_size, weights))
    module.trained_on = datamodule.trained_on()
    return datamodule, module, trainer


def evaluate_and_write(spec: RunSpec, net, datamodule, split: str, tokens, cfg: DictConfig, extra: dict) -> str:
    """Run the length sweep on ``split`` and write results.json (+ positions.csv) into the run's output folder."""
    fit_on = datamodule.evaluation("validation") if split != "validation" else None  # the temperature's c
    rows, curves = sweep(
        net, datamodule.evaluation(split), spec.plan, spec.eval, spec.precision, spec.scheme, spec.seed, fit_on
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return ""
    # The precision of this evaluation (training's: meta.hardware.training_precision).
    meta = {**run_metadata(spec, net, datamodule, split, tokens), "precision": spec.precision, **extra}
    path = write_results(cfg.paths.output_dir, meta, rows, curves)
    print(format_rows(rows))
    print(f"results: {path}")
    return path


def checkpoint_model(cfg: DictConfig, path: str, check_only: bool = False):
    """(spec, data module, model, checkpoint) of the checkpoint at ``path``, its PE changed as ``cfg`` (eval.py's
    config) asks; refused in one line where the change does not fit the checkpoint's weights. ``check_only`` (a
    sweep's check of a job before the first starts): the model on the meta device, its weights' shapes checked
    without memory or initialization (17 s for the 1B preset on a 2-core CPU)."""
    checkpoint = load_checkpoint(path)
    spec, datamodule = resolve_evaluation(cfg, stored_spec(checkpoint, f"ckpt={path}"))
    state = net_state(checkpoint)
    with torch.device("meta") if check_only else contextlib.nullcontext():
        net = build_net(spec, state["embedding.weight"].size(0))
    try:
        net.load_state_dict(state, assign=check_only)
    except RuntimeError as e:  # a change that changes the PE's parameters (per_layer, hidden, num_buckets)
        changed = ", ".join(f"pe.{k}" for k, v in cfg.pe.items() if v != AS_TRAINED) or "the PE settings"
        raise ConfigError(
            f"{changed}: the checkpoint's weights do not fit the PE built with it ({str(e).splitlines()[-1].strip()}); "
            "only settings that keep the PE's parameter shapes can change at evaluation"
        ) from None
    return spec, datamodule, net, checkpoint


# Why eval.py ckpt= takes no data= (nor data.<key>, lenext.cli.not_a_setting)
DATA_OF_A_CHECKPOINT = "applies to hf= evaluations: a checkpoint is evaluated on the data it was trained on"


def check_evaluation_settings(cfg: DictConfig) -> None:
    """eval.py ckpt='s settings, checked before any work (by the evaluation, and by an eval.py sweep for each job
    before the first starts): hf='s own refused first (data= would fail on what it interpolates), then types and
    ranges; ``checkpoint_model`` checks the rest against the checkpoint."""
    if cfg.get("data"):
        raise ConfigError(f"data= {DATA_OF_A_CHECKPOINT}")
    hf_only = {"context": cfg.get("context"), "trust_remote_code": cfg.get("trust_remote_code")}
    if given := [f"{key}={value}" for key, value in hf_only.items() if value not in (None, False)]:
        raise ConfigError(f"{', '.join(given)} applies to hf= evaluations: a checkpoint's L_train and code are its own")
    schema.check(cfg, EvalScriptSettings, EVAL_NODES)


def evaluate_checkpoint(cfg: DictConfig) -> str:
    """eval.py: rebuild the model from a checkpoint, with its PE as eval.py changes it, sweep, write results."""
    check_evaluation_settings(cfg)
    checkpoint_path = checkpoint_file(cfg.ckpt)  # a run folder: its last.ckpt
    refuse_results_it_would_replace(
        cfg.paths.output_dir, evaluated=checkpoint_path and ("checkpoint", os.path.abspath(checkpoint_path))
    )
    spec, datamodule, net, checkpoint = checkpoint_model(cfg, cfg.ckpt)
    datamodule.load()
    refuse_other_data(checkpoint.get("trained_on"), datamodule, f"ckpt={checkpoint_path}")
    refuse_an_evaluator_of_other_text(spec.plan, datamodule)
    record_command(cfg)  # accepted: every check passed
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    identity = run_identity(OmegaConf.create(spec.config), FINISHED_IDENTITY)
    extra = {"checkpoint": os.path.abspath(checkpoint_path), "identity": identity}
    # tokens_trained: absent from checkpoints written before it was kept
    path = evaluate_and_write(spec, net.to(device), datamodule, cfg.split, checkpoint.get("tokens_trained"), cfg, extra)
    trained_in = training_precision(spec)
    if trained_in and trained_in != spec.precision:  # bf16's rounding moves perplexities in their last digits
        print(
            f"note: evaluated in {spec.precision}; training and its sweep ran in {trained_in}: precision={trained_in}"
        )
        print("      reproduces their numbers, the default precision gives the exact ones (docs/evaluation.md)")
    return path
