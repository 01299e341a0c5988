"""Every config key's type and range, declared once, checked before any work.

A group built by hydra.utils.instantiate declares its keys in the signature of its ``_target_``: the
annotation is the type, and ``Annotated[int, Range(1)]`` adds a range (lenext's classes use the
aliases below). Lightning's classes bring their own annotations; ``LIBRARY_RANGES`` adds the
ranges of the keys lenext's configs set. A node without a target is declared by a dataclass
(``eval`` by ``EvalSettings``; the top level by the entry point's settings class).

``check`` walks a composed config and raises a ConfigError naming the first key that is missing,
unknown, of the wrong type or out of range. Relations between keys (heads dividing the width, T5's
buckets, last_k and the lengths) are checked by the objects that use them, built before any work.
"""

import dataclasses
import datetime
import difflib
import inspect
import logging
import math
import pathlib
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, Literal, Union

from hydra.utils import get_object
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lenext.errors import ConfigError, first_line
from lenext.hardware import Precision
from lenext.ranges import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    Range,
)

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


# Lightning checks these only when its objects are built, some as a traceback; lenext checks them
# first. Keyed by class, so that every path to it (lightning.Trainer, lightning.pytorch.Trainer) is checked.
LIBRARY_RANGES = {
    Trainer: {
        "accelerator": Literal[("auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators()))],
        "strategy": Literal[("auto", *StrategyRegistry.available_strategies())],
        "max_steps": PositiveInt,  # the learning-rate schedule needs the run's length
        "accumulate_grad_batches": PositiveInt,
        # Not 0: a run whose loop trains nothing would still be recorded as complete
        "limit_train_batches": PositiveInt | Fraction | None,
        "max_epochs": PositiveInt | Literal[-1] | None,
        "precision": Precision,  # fp32 or bf16 autocast: what evaluation (eval.py's precision) can reproduce
        "devices": PositiveInt | Literal[-1] | str | list[NonNegativeInt],  # -1: all; "0,1": these
        "num_nodes": PositiveInt,
        "val_check_interval": PositiveInt | Fraction | str | dict[str, float] | None,  # "DD:HH:MM:SS", {minutes: 30}
        # Not 0: every run ends with a validation at L_train, reported next to the sweep.
        "limit_val_batches": PositiveInt | Fraction | None,
        "gradient_clip_val": NonNegativeFloat | None,
        "log_every_n_steps": NonNegativeInt | None,
        "num_sanity_val_steps": Annotated[int, Range(-1)] | None,  # -1: all
        "check_val_every_n_epoch": PositiveInt | None,
    },
    ModelCheckpoint: {
        "save_top_k": Annotated[int, Range(-1)],  # -1: every checkpoint
        "every_n_train_steps": NonNegativeInt | None,  # 0: not by steps
        "mode": Literal["min", "max"],
    },
    LearningRateMonitor: {"logging_interval": Literal["step", "epoch"] | None},
    WandbLogger: {"group": str | None},  # passed on to wandb.init
}


def check(cfg: DictConfig, settings: type | None, declared: dict[str, type]) -> None:
    """Raise ConfigError on the first bad key of ``cfg``; ``settings`` declares the top level's own keys,
    ``declared`` the target-less nodes by their key (``{"eval": EvalSettings}``).

    Interpolated values are checked as resolved, after every value set directly: a bad
    ``paths.cache_dir`` is named as itself, not as the ``data.cache_dir`` that copies it.
    """
    copies = []
    _check_node(cfg, "", settings, declared, copies)
    for full, value, expected, source in copies:
        _refuse_unless_conforms(full, value, expected, f" (from {source})")


def _refuse_unless_conforms(full: str, value, expected, source: str = "") -> None:
    if not conforms(value, expected):
        shown = OmegaConf.to_container(value) if isinstance(value, DictConfig | ListConfig) else value
        raise ConfigError(f"{full}={shown!r}{source} is invalid: it must be {describe(expected)}", full)


def located(target: str):
    """The object ``target`` names (hydra's ``get_object``), without the second report of a failure it logs: the
    ConfigError names it, with the error that caused it (an import inside the module that failed)."""
    hydra_log = logging.getLogger("hydra.utils")
    disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        return get_object(target)
    finally:
        hydra_log.disabled = disabled


def _check_node(node: DictConfig, path: str, declarer, declared: dict[str, type], copies: list) -> None:
    target = node.get("_target_") if "_target_" in node else None
    if target is not None:
        try:
            declarer = located(target)
        except (ImportError, ValueError) as e:
            where = f"{path}._target_" if path else "_target_"
            cause = f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else first_line(e)
            if (
                isinstance(e.__cause__, ModuleNotFoundError) and e.__cause__.name == target
            ):  # the module has no such name
                module, _, name = target.rpartition(".")
                cause = f"module {module!r} has no {name!r}"
            raise ConfigError(f"{where}={target!r} cannot be imported ({cause})") from None
    parameters = _parameters(declarer) if declarer is not None else None
    # A node's own values before its sub-nodes: `seed=-1` is named as itself, not as data.seed.
    for key in sorted(node, key=lambda k: OmegaConf.is_config(node._get_node(k))):
        if key in HYDRA_KEYS or key == "hydra":
            continue
        full = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_missing(node, key):
            expected = f": it must be {describe(parameters[key])}" if parameters and key in parameters else ""
            raise ConfigError(f"{full} is required{expected}; set it on the command line ({full}=...)")
        try:
            value = node[key]
        except OmegaConfBaseException as e:
            raise _raised_by_a_resolver(e) or ConfigError(f"{full} cannot be resolved: {first_line(e)}") from None
        fixed = getattr(declarer, "FIXED", {}).get(key)
        if fixed:  # a node the command takes from elsewhere (eval.py: the checkpoint's training settings)
            leaf = next(iter(value), None) if isinstance(value, DictConfig) else None
            raise kept_elsewhere(f"{full}{f'.{leaf}' if leaf else ''}", fixed)
        built_with = getattr(declarer, "BUILT_WITH", ())
        if key in built_with:  # lenext passes it when it builds the object: a value here would be overridden
            settings = sorted(k for k in parameters if k != "**" and k not in built_with)
            raise ConfigError(
                f"{full} is not a setting: lenext gives {target or 'this object'} its {key} when it builds it; "
                f"the settings there: {', '.join(settings) or 'none'}",
                full,
            )
        expected = LIBRARY_RANGES.get(declarer, {}).get(key) or (parameters or {}).get(key)
        # Sub-nodes are checked on their own, unless the declarer types the key (a mapping it takes as a value).
        if isinstance(value, DictConfig) and ("_target_" in value or full in declared or expected is None):
            if parameters and "**" in parameters and "_target_" not in value:
                continue  # a mapping passed on as a keyword the declarer does not name (e.g. to wandb.init)
            _check_node(value, full, declared.get(full), declared, copies)
            continue
        entries = mapping_values(expected)
        if isinstance(value, DictConfig) and entries is not None:  # a mapping of names: each entry on its own
            for name in value:
                if isinstance(value[name], DictConfig) and "_target_" in value[name]:
                    _check_node(value[name], f"{full}.{name}", None, declared, copies)
                else:
                    _refuse_unless_conforms(f"{full}.{name}", value[name], entries)
            continue
        if isinstance(value, ListConfig) and any(isinstance(v, DictConfig) and "_target_" in v for v in value):
            for i, item in enumerate(value):
                _check_node(item, f"{full}[{i}]", None, declared, copies)
            continue
        if parameters is None:
            raise ConfigError(f"{full} is not a setting lenext knows; remove it")
        if expected is None:
            if "**" in parameters:
                continue  # passed on as a keyword the declarer does not name
            renamed = getattr(declarer, "RENAMED", {}).get(key)
            if renamed:
                raise ConfigError(f"{full} was renamed: use {path + '.' if path else ''}{renamed}=... instead")
            settings = sorted(k for k in parameters if k != "**" and k not in built_with)
            raise ConfigError(
                f"{full} is not a setting of {target or 'this config'}{did_you_mean(key, settings, path)}; "
                f"the settings there: {', '.join(settings) or 'none'}",
                full,
            )
        if OmegaConf.is_interpolation(node, key):
            copies.append((full, value, expected, node._get_node(key)._value()))
        else:
            _refuse_unless_conforms(full, value, expected)


def _raised_by_a_resolver(error: BaseException) -> ConfigError | None:
    """The ConfigError a lenext resolver raised (``${all_devices:...}``), which OmegaConf wraps: it names the setting
    the user gave, not the one interpolated from it."""
    while error is not None and not isinstance(error, ConfigError):
        error = error.__cause__ or error.__context__
    return error


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean <prefix>.<closest>?)`` for the known name closest to a mistyped one, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""


def _parameters(declarer) -> dict[str, Any]:
    """Name -> annotation of what ``declarer`` accepts; key ``**`` when it takes any keyword."""
    function = declarer.__init__ if inspect.isclass(declarer) else declarer
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except NameError:  # one annotation names a type not importable here (wandb's Run): take them as written
        hints = {}
    parameters = {}
    for name, parameter in inspect.signature(declarer).parameters.items():
        if parameter.kind == inspect.Parameter.VAR_KEYWORD:
            parameters["**"] = Any
        elif parameter.kind != inspect.Parameter.VAR_POSITIONAL:
            written = parameter.annotation if parameter.annotation is not inspect.Parameter.empty else Any
            parameters[name] = hints.get(name, written)
    if dataclasses.is_dataclass(declarer):
        parameters.update({f.name: hints.get(f.name, Any) for f in dataclasses.fields(declarer)})
    return parameters


def conforms(value, annotation) -> bool:
    """Whether a config value is of ``annotation`` (the typing forms configs use), ranges included."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or isinstance(annotation, typing.TypeVar | typing.ForwardRef | str):
        return True
    if origin is Annotated:
        return conforms(value, args[0]) and all(r.holds(value) for r in args[1:] if isinstance(r, Range))
    if origin is Union or origin is types.UnionType:
        return any(conforms(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is type(None) or annotation is None:
        return value is None
    if origin in (list, tuple, Sequence, Iterable) or annotation in (list, tuple):
        if not isinstance(value, ListConfig | list | tuple):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(conforms(v, args[0]) for v in value)
    if origin is dict or annotation is dict:
        return isinstance(value, DictConfig | dict) and (not args or all(conforms(v, args[1]) for v in value.values()))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:  # finite: NaN passes every range comparison, and no setting means infinity
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if annotation in (str, pathlib.Path):
        return isinstance(value, str)
    if annotation is datetime.timedelta:
        return isinstance(value, DictConfig | dict)
    if origin is Callable or annotation is Callable:
        return isinstance(value, DictConfig) and "_target_" in value
    if inspect.isclass(annotation):  # an object: given as a node with a target (checked on its own)
        return isinstance(value, annotation) or (isinstance(value, DictConfig) and "_target_" in value)
    return True


def mapping_values(annotation):
    """V of an annotation ``dict[str, V]`` (or ``dict[str, V] | None``); None for any other."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return mapping_values(options[0]) if len(options) == 1 else None
    if typing.get_origin(annotation) is dict and typing.get_args(annotation):
        return typing.get_args(annotation)[1]
    return None


def describe(annotation) -> str:
    """What a value of ``annotation`` is, for the one-line error."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        ranges = " ".join(str(r) for r in args[1:] if isinstance(r, Range))
        return f"{describe(args[0])} {ranges}".strip()
    if origin is Union or origin is types.UnionType:
        literals = [v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a)]
        others = [describe(a) for a in args if typing.get_origin(a) is not Literal]
        return " or ".join(dict.fromkeys(([describe(Literal[tuple(literals)])] if literals else []) + others))
    if origin is Literal:
        return ("one of " if len(args) > 1 else "") + ", ".join(repr(a) for a in args)
    if annotation is type(None) or annotation is None:
        return "null"
    if origin in (list, tuple, Sequence, Iterable) or annotation in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)}: [{', '.join(describe(a) for a in args)}]"
        return f"a list of ({describe(args[0])})" if args else "a list"
    names = {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        pathlib.Path: "a path",
    }
    if annotation in names:
        return names[annotation]
    if origin is dict:
        return f"a mapping of names to ({describe(args[1])})" if args else "a mapping"
    return f"a {getattr(annotation, '__name__', str(annotation))} config node"


def kept_elsewhere(key: str, where: str) -> ConfigError:
    """A key of a node the command takes from elsewhere (eval.py's and diagnose.py's ``FIXED``: the checkpoint's)."""
    return ConfigError(f"{key} is not a setting of this command: {where}", key.split(".")[0])
