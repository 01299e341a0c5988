"""The resolver: a composed config -> the ``RunSpec`` of a run, for training, a second stage and eval.py alike.

Every key is checked first (``lenext.schema``, against the settings classes below and each object's signature);
then the settings that only fail together, while resolving: the PE's hyperparameters (read from a model built with
them), the positions, the evaluation plan (checked against the data, which reads nothing yet), and for a second
stage what its base can serve. A bad setting costs seconds, never a training run. Nothing here reads a checkpoint:
the caller passes a base (``lenext.checkpoints.Base``) or a stored run in.
"""

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from lenext import schema
from lenext.attention import AttentionSettings
from lenext.build import build_decoder, hydra_config, instantiate, load_weights, refuse_a_model_beyond_memory
from lenext.errors import CheckpointError, ConfigError
from lenext.evaluate import EvalSettings, SweepPlan, sweep_plan
from lenext.hardware import PRECISION_NAMES, Precision, canonical_precision, refuse_mps
from lenext.pe import VARIANTS
from lenext.positions import TrainPositions, position_scheme
from lenext.ranges import PositiveInt, Range, Seed
from lenext.spec import RunSpec, first_stage_row, later_stage_row

if TYPE_CHECKING:
    from lenext.checkpoints import Base

AS_TRAINED = "as_trained"


@dataclass(frozen=True)
class TrainSettings:
    """The top-level keys of configs/train.yaml (its groups are declared by what they build)."""

    task_name: str
    seed: Seed
    ckpt_path: str | None
    init_from: str | None = None  # a second stage: the base checkpoint whose weights it starts from
    drop_pe: bool = False  # a second stage: DroPE, its RoPE base's rotation dropped (docs/extension.md)


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
    ckpt: str | None  # a lenext checkpoint, or
    hf: str | None  # a Hugging Face model folder or hub id (lenext.hf)
    split: Literal["validation", "test", "train"]
    precision: Precision | None  # null: bf16-mixed on a GPU, 32-true on CPU
    trust_remote_code: bool = False  # hf: run the model folder's own code, for a model transformers lacks
    context: PositiveInt | None = None  # hf: the model's trained context, where its config does not say it

    FIXED = {  # what the checkpoint keeps: evaluated as trained, or changed through the evaluation's own settings
        "attention": "the checkpoint keeps its attention settings (a new one is a second stage: init_from)",
        "train": "the checkpoint keeps its training positions (eval.positions evaluates at other ones)",
        "model": "the checkpoint keeps its model",
    }


def checkpoint_pe_overrides(
    scaling: Literal[(AS_TRAINED, *VARIANTS)],
    factor: Literal[AS_TRAINED] | Annotated[float, Range(1)] | None,
    **other_settings_of_the_pe,
) -> None:
    """Declares eval.yaml's ``pe`` node (never called): evaluation-time changes to the checkpoint's PE (``as_trained``
    keeps the checkpoint's value; eval.yaml names RoPE's two, any other setting may be added: ``+pe.base=20000``),
    each checked against that PE's own declaration once applied (``PositionalEncoding.evaluated_with``)."""


TRAIN_NODES = {"attention": AttentionSettings, "eval": EvalSettings, "paths": Paths, "train": TrainPositions}
# eval.py's nodes: a checkpoint keeps its attention and training positions (eval.positions evaluates at 0..L-1)
EVAL_NODES = {"eval": EvalSettings, "paths": Paths, "pe": checkpoint_pe_overrides}
# Keys earlier versions named otherwise (a settings class's RENAMED), as dotted keys: old -> new.
RENAMED_KEYS = {
    f"{node}.{old}": f"{node}.{new}"
    for node, settings in TRAIN_NODES.items()
    for old, new in getattr(settings, "RENAMED", {}).items()
}


def config_pe_name(cfg: DictConfig) -> str:
    """The PE's config name (``pe=rope_ntk``; rope and rope_ntk share a class), or ``stored_pe_name``'s for a
    config composed without Hydra's runtime."""
    hydra_cfg = hydra_config()
    chosen = hydra_cfg.runtime.choices.get("pe") if hydra_cfg else None
    return chosen or stored_pe_name(cfg)


def stored_pe_name(config) -> str:
    """The PE name a run config keeps (``pe_name``, in configs of earlier versions), else its class's, lower case."""
    return config.get("pe_name") or str(config["pe"]["_target_"]).rsplit(".", 1)[-1].lower()


def resolved_positions(cfg: DictConfig) -> TrainPositions:
    """The run's ``train`` node (absent from configs before it existed: sequential), its nulls filled in; a setting of
    another scheme than ``train.positions`` refused (it would change nothing)."""
    settings = TrainPositions(**(OmegaConf.to_container(cfg.train, resolve=True) if "train" in cfg else {}))
    for key, scheme in TrainPositions.OWN_SETTINGS.items():
        value = getattr(settings, key)
        if scheme != settings.positions and value != getattr(TrainPositions(), key):
            raise ConfigError(
                f"train.{key}={value} changes nothing here: it is a setting of {scheme} positions, which "
                f"train.positions={settings.positions} does not use; give train.positions={scheme}, or drop train.{key}"
            )
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
    cfg: DictConfig,
    pe_name: str,
    sweeps: bool = True,
    precision: str | None = None,
    resumed: RunSpec | None = None,
    base: "Base | None" = None,
) -> RunSpec:
    """The RunSpec of a config ``schema.check`` passed: the PE's hyperparameters resolved, the positions, the
    evaluation plan (when the run ``sweeps``), its lineage and row. A second stage names its ``base``
    (``lenext.checkpoints.Base``: refused here, in one line, if it cannot serve this stage); one ``resumed`` from its
    own checkpoint takes its PE and lineage from that: its base need not exist any more."""
    if cfg.get("drop_pe") and not cfg.get("init_from"):
        raise ConfigError(
            "drop_pe=true is invalid without init_from: DroPE drops the rotation of a trained RoPE base "
            "(init_from=<base>/checkpoints/last.ckpt, or extension=drope in a study)"
        )
    if cfg.get("trainer"):
        refuse_mps(cfg.trainer.get("accelerator", "auto"))
    positions = resolved_positions(cfg)
    scheme = position_scheme(dataclasses.asdict(positions), cfg.data.max_len)
    reach = scheme.span(cfg.data.max_len)
    config = OmegaConf.to_container(cfg, resolve=True)
    lineage, base_len = (), cfg.data.max_len
    row = first_stage_row(pe_name, scheme.name, config.get("attention"))
    label = row.label
    if resumed and resumed.lineage:
        config["pe"] = resumed.config["pe"]
        lineage, base_len, row, label = resumed.lineage, resumed.base_len, resumed.row_fields, resumed.row
    elif cfg.get("init_from"):
        if base is None:
            raise ValueError("resolve: a second stage's base is read by its caller (lenext.checkpoints.read_base)")
        dropped = bool(config.get("drop_pe"))
        config["pe"] = (dropped_pe if dropped else stage_pe_resolved)(config, pe_name, base, reach)
        lineage, base_len = (*base.spec.lineage, base.stage), base.spec.base_len
        first = base.spec.row_fields or first_stage_row(base.spec.pe_name, "sequential")
        row = later_stage_row(base.spec.row, first.pe, config["pe"], scheme.name, reach)
        if dropped:  # rope -> drope@64, rope -> drope+qk_norm@64
            qk_norm = (config.get("attention") or {}).get("qk_norm")
            row = dataclasses.replace(row, method="drope+qk_norm" if qk_norm else "drope")
        label = row.label
    else:
        config["pe"] = resolved_pe(config, cfg.data.max_len, reach)
    data = instantiate(cfg.data, "data")  # reads nothing yet: a corpus is read by load()
    eval_settings = EvalSettings.from_stored(OmegaConf.to_container(cfg.eval, resolve=True))  # or an old checkpoint's
    return RunSpec(
        config=config,
        pe_name=pe_name,
        row=label,
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
        row_fields=row,
    )


def resolve_evaluation(cfg: DictConfig, trained: RunSpec):
    """eval.py's RunSpec, and the data it evaluates on: the checkpoint's run ``trained`` with this command's
    evaluation settings, precision and changes to its PE (each PE says what a change implies:
    ``PositionalEncoding.evaluated_with``), every key checked before any work."""
    changes = {key: value for key, value in OmegaConf.to_container(cfg.pe).items() if value != AS_TRAINED}
    run = OmegaConf.create(trained.config)
    pe_class = get_object(run.pe._target_)
    run.pe = pe_class.evaluated_with(OmegaConf.to_container(run.pe), changes)
    run.eval, run.paths = cfg.eval, cfg.paths
    # What evaluation uses of the run; the other keys belong to training and to the code that trained it.
    used = [key for key in ("data", "model", "pe", "attention", "train", "eval", "paths") if key in run]
    schema.check(OmegaConf.masked_copy(run, used), None, {k: v for k, v in TRAIN_NODES.items() if k in run})
    config = OmegaConf.to_container(run, resolve=True)
    config["pe"] = resolved_pe(config, trained.train_len, trained.reach)
    data = instantiate(run.data, "data")
    eval_settings = EvalSettings(**config["eval"])
    fallback = "bf16-mixed" if torch.cuda.is_available() else "32-true"  # fp32 on CPU: exact, whatever the ISA
    spec = dataclasses.replace(
        trained,
        config=config,
        eval=eval_settings,
        plan=evaluation_plan(eval_settings, trained.base_len, trained.scheme, data),
        precision=canonical_precision(fallback if cfg.precision is None else cfg.precision),
    )
    return spec, data


def resolved_pe(config: dict, train_len: int, reach: int, base: "Base | None" = None) -> dict:
    """The run config's PE node with every hyperparameter resolved (``PositionalEncoding.hyperparameters``), read
    from the model built with it: milliseconds, and the model's own checks (heads and width, T5's buckets, RoPE's
    head size) run on the way. Built on the meta device, allocating nothing, and refused if its weights would not fit
    in memory; with a ``base``, built for real and holding its weights exactly (a CheckpointError else)."""
    if base is None:
        with torch.device("meta"):
            net = build_decoder(config, train_len, reach, 256)
        refuse_a_model_beyond_memory(net, config)
    else:
        net = build_decoder(config, train_len, reach, base.vocab_size)
        try:
            load_weights(net, base.state, from_base=True)
        except RuntimeError as e:
            raise CheckpointError(
                f"init_from={base.stage.checkpoint}: its weights do not fit this stage's model "
                f"({str(e).splitlines()[-1].strip()}); repeat the base's model and PE settings"
            ) from None
    return {"_target_": config["pe"]["_target_"], "_partial_": True, **net.pe.hyperparameters()}


# Data settings a second stage may change: the others fix the vocabulary (tokenizer) or the task.
STAGE_DATA_SETTINGS = (
    "max_len",
    "batch_size",
    "eval_batch_size",
    "num_workers",
    "cache_dir",
    "remote",  # a mirror of the cache: the same corpus's tokens, wherever they are kept
    "seed",
    "eval_samples",
    "train_samples",
)
STAGE_MODEL_SETTINGS = ("dropout",)  # the model's other settings fix its weights' shapes


def stage_pe(config: dict, pe_name: str, base: RunSpec, stage) -> dict:
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
        if name == "qk_norm" and config.get("drop_pe"):  # DroPE may add QK-norm to the base's attention
            continue
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
    return merged


def stage_changes(pe: dict, theirs: dict) -> list[str]:
    """A second stage's resolved PE node ``pe`` where it differs from its base's, ``theirs``, in the settings a stage
    may change (the command's values, its config's defaults included: said once the run is accepted, not silent);
    none for a stage of another PE (DroPE's NoPE), whose settings are not the base's changed."""
    if pe.get("_target_") != theirs["_target_"]:
        return []
    changeable = get_object(theirs["_target_"]).STAGE_SETTINGS
    return [
        f"pe.{name}={pe.get(name)!r} (the base's: {theirs[name]!r})"
        for name in changeable
        if name in theirs and pe.get(name) != theirs[name]
    ]


def stage_pe_resolved(config: dict, pe_name: str, base: "Base", reach: int) -> dict:
    """A second stage's PE node, resolved: the base's, with this command's ``STAGE_SETTINGS`` (``stage_pe``), built
    at this stage's length into a model that must hold the base's weights exactly."""
    pe = stage_pe(config, pe_name, base.spec, base.stage)
    try:
        return resolved_pe({**config, "pe": pe}, config["data"]["max_len"], reach, base)
    except ConfigError as e:
        key = e.key or str(e).split("=", 1)[0].split(" ", 1)[0]  # its messages begin with the key
        if key in {f"pe.{name}" for name in get_object(pe["_target_"]).STAGE_SETTINGS}:
            raise  # a setting this stage gave, not one it kept from the base
        raise ConfigError(
            f"{e}; but a second stage keeps the PE settings of init_from={base.stage.checkpoint}, which its weights "
            f"fit: this PE cannot be trained further at {reach} positions"
        ) from None


DROPPED_PE = {"_target_": "lenext.pe.NoPE", "_partial_": True}  # what DroPE leaves: no PE


def dropped_pe(config: dict, pe_name: str, base: "Base", reach: int) -> dict:
    """The PE node of a DroPE stage (``drop_pe``; Gelberg et al. 2025, docs/extension.md): NoPE, its base's RoPE
    rotation dropped in every layer, recalibrated at the base's length with the base's model, data and attention
    (``stage_pe``'s checks; attention.qk_norm may be added). Refuses, in one line, a base that is not a RoPE run
    and another length; the model built must hold the base's weights (new QK-norm gains aside: ``load_weights``)."""
    where = f"init_from={base.stage.checkpoint}"
    theirs = base.spec.config["pe"]["_target_"]
    if imported(theirs) is not imported("lenext.pe.RoPE"):
        raise ConfigError(
            f"drop_pe=true is invalid for a second stage from {where}: DroPE drops a RoPE base's rotation, and that "
            f"run was trained with pe={base.spec.pe_name} ({theirs}); start it from a pe=rope run"
        )
    stage_pe(config, pe_name, base.spec, base.stage)
    if config["data"]["max_len"] != base.spec.train_len:
        raise ConfigError(
            f"data.max_len={config['data']['max_len']} is invalid for DroPE: it recalibrates at its base's length, "
            f"and {where} was trained at data.max_len={base.spec.train_len}; repeat that length"
        )
    return resolved_pe({**config, "pe": dict(DROPPED_PE)}, config["data"]["max_len"], reach, base)


def flat_settings(settings: dict, ignore: tuple[str, ...] = ()) -> dict:
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


def same_setting(key: str, stored, here) -> bool:
    """Equal values, where a ``_target_`` (``key`` or inside a mapping) may name its class by another import path:
    a config may name it where its package exports it (lenext.pe.RoPE) or where it is defined
    (lenext.pe.rope.RoPE), and configs have moved between them; a precision by another of its names."""
    if isinstance(stored, dict) and isinstance(here, dict):
        return stored.keys() == here.keys() and all(same_setting(k, stored[k], here[k]) for k in stored)
    if stored == here:
        return True
    if key == "trainer.precision" and {stored, here} <= PRECISION_NAMES.keys():  # 32 and 32-true: one precision
        return canonical_precision(stored) == canonical_precision(here)
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
