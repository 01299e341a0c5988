"""Objects from config nodes: ``instantiate`` (every refusal as one line) and the one place a model is built (runs,
eval.py, benchmarks)."""

import re
from importlib import resources

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lenext.attention import AttentionSettings
from lenext.errors import ConfigError, LenextError, first_line
from lenext.hardware import physical_memory

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
        reason = first_line(cause or e)
        # the settings the library names (`devices`), with their values: else the group alone
        named = [name for name in dict.fromkeys(re.findall(r"`(\w+)`", reason)) if name in node]
        settings = ", ".join(f"{key}.{name}={node[name]}" for name in named) or key
        raise ConfigError(f"{settings} is invalid: {node.get('_target_')} refused it: {reason}") from e


CONFIG_PACKAGE = "lenext.configs"
_UNSET = object()


def hydra_config() -> HydraConfig | None:
    return HydraConfig.get() if HydraConfig.initialized() else None


def preset_of(key: str) -> str | None:
    """The config group choice whose file sets ``key`` (``extension=yarn``), when the command line does not set it:
    a refusal names it, since the user never typed the value. Files a group's option draws from its own group
    (``defaults: [stage]``) count as the option's."""
    hydra_cfg = hydra_config()
    if hydra_cfg is None or any(o.lstrip("+~").split("=", 1)[0] == key for o in hydra_cfg.overrides.task):
        return None
    # Hydra lists the choices last-applied first (extension, ..., data): the first that sets the key set its value.
    for group, option in hydra_cfg.runtime.choices.items():
        if isinstance(option, str) and not group.startswith("hydra") and _sets(group, option, key):
            return f"{group}={option}"
    return None


def _sets(group: str, option: str, key: str) -> bool:
    source = resources.files(CONFIG_PACKAGE).joinpath(*group.split("/"), f"{option}.yaml")
    if not source.is_file():
        return False
    text = source.read_text()
    node = yaml.safe_load(text) or {}  # as written: its interpolations need the whole config
    package = "" if text.startswith("# @package _global_") else group.replace("/", ".") + "."
    if key.startswith(package):
        value = node
        for part in key.removeprefix(package).split("."):
            value = value.get(part, _UNSET) if isinstance(value, dict) else _UNSET
        if value is not _UNSET:
            return True
    drawn = [entry for entry in node.get("defaults") or () if isinstance(entry, str) and entry != "_self_"]
    return any(_sets(group, entry, key) for entry in drawn)


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


def refuse_a_model_beyond_memory(net, config: dict) -> None:
    """A ConfigError where ``net``'s weights alone (built on the meta device: nothing allocated) exceed this
    machine's memory: every process builds its model whole in host memory first, so the run could only fail, with
    an allocation traceback. A lower bound of what a run needs (no gradients, optimizer state, other ranks; the
    resolver's vocabulary of 256), so only a run that cannot fit is refused. The largest tensor says which group's
    sizes (``config``'s ``model`` or ``pe``) to lower."""
    tensors = dict(net.named_buffers()) | dict(net.named_parameters())
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
    memory = physical_memory()
    total = sum(sizes.values())
    if total > memory:
        largest = max(sizes, key=sizes.get)
        group = "pe" if largest.startswith("pe.") or ".pe." in largest else "model"
        sized = [f"{group}.{k}={v}" for k, v in config[group].items() if isinstance(v, int) and not isinstance(v, bool)]
        settings = ", ".join(sized) or f"of {group}"
        raise ConfigError(
            f"the settings {settings} build a model of {total / 2**30:,.0f} GiB of weights (its "
            f"largest tensor, {largest}, is {tuple(tensors[largest].shape)}), more than this machine's "
            f"{memory / 2**30:,.0f} GiB of memory: they must be smaller"
        )


def build_net(spec, vocab_size: int, weights: dict | None = None):
    """The Decoder of a resolved run (``lenext.spec.RunSpec``), holding ``weights`` if given: a checkpoint's own, or
    a second stage's base's (optimizer, step and schedule start afresh)."""
    net = build_decoder(spec.config, spec.train_len, spec.reach, vocab_size)
    if weights is not None:
        load_weights(net, weights, from_base=spec.start == "init_from")
    return net


# The parameters a second stage may add to its base's model: DroPE's QK-norm gains (attention.qk_norm).
ADDED_BY_STAGE = (".attn.q_norm.weight", ".attn.k_norm.weight")


def load_weights(net, weights: dict, from_base: bool = False) -> None:
    """``weights`` into ``net``, every tensor of it; ``from_base`` (a second stage's net from its base's weights)
    but the QK-norm gains a DroPE stage adds (``ADDED_BY_STAGE``), which keep their initial 1 where the base has
    none. Anything else missing or left over raises torch's RuntimeError, naming it."""
    missing, unexpected = net.load_state_dict(weights, strict=False)
    tolerated = from_base and all(key.endswith(ADDED_BY_STAGE) for key in missing)
    if unexpected or (missing and not tolerated):
        net.load_state_dict(weights)  # raises, naming them


def unsharded(net, spec, vocab_size: int):
    """``net`` itself, or, if FSDP sharded it (trainer=fsdp), a plain copy holding every parameter whole, on every
    rank: the length sweep then runs as under DDP, each rank on its own windows, with no collective per forward."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4 (trainer=fsdp is refused there): nothing is sharded
        return net
    if not any(isinstance(p, DTensor) for p in net.parameters()):
        return net
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return build_net(spec, vocab_size, get_model_state_dict(net, options=StateDictOptions(full_state_dict=True)))


def build_module(module_node, spec, net):
    """The LightningModule of a resolved run (configs/module) around its ``net``."""
    module = instantiate(module_node, "module", _partial_=True, _convert_="all")
    return module(net=net, scheme=spec.scheme, seed=spec.seed, run=spec.stored())
