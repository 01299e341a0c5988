"""Reading a lenext checkpoint: the file, the run it stores (``lenext.spec.RunSpec``) and the Decoder's weights.

A checkpoint is read once per use: a second stage's base (``init_from``) is read into a ``Base`` that the resolver
checks and the run starts from.
"""

import contextlib
import glob
import os
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from lenext.errors import CheckpointError, ConfigError
from lenext.hardware import PRECISION_NAMES, canonical_precision
from lenext.resolve import resolve, stored_pe_name
from lenext.spec import RunSpec, Stage


def checkpoint_file(path: str, key: str | None = "ckpt", missing_ok: bool = False) -> str | None:
    """The .ckpt ``path`` names: the file itself, or in a run folder its last.ckpt (in it or one level down, where
    a run keeps it), else the folder's one .ckpt; a CheckpointError (naming it as ``key``=path) where a folder holds
    several and no last.ckpt, or none (None with ``missing_ok``: a run still training)."""
    if not path or not os.path.isdir(path):
        return path
    named = f"{key}={path!r}" if key else path
    found = sorted(glob.glob(os.path.join(path, "*.ckpt")) + glob.glob(os.path.join(path, "*", "*.ckpt")))
    last = [file for file in found if os.path.basename(file) == "last.ckpt"]
    if len(last) == 1 or len(found) == 1:
        return (last or found)[0]
    if not found and missing_ok:
        return None
    if not found:
        raise CheckpointError(f"{named} is a folder without a checkpoint (no *.ckpt in it or one level down)")
    raise CheckpointError(f"{named} holds several checkpoints and no one last.ckpt: pass one of {', '.join(found)}")


def another_checkpoint(path: str, key: str) -> str:
    """Advice for an unreadable checkpoint: another of the run's, named where its folder holds one."""
    folder = os.path.dirname(path) or "."
    others = []
    with contextlib.suppress(OSError):
        others = sorted(f for f in os.listdir(folder) if f.endswith(".ckpt") and f != os.path.basename(path))
    return "use another checkpoint of the run" + (f" ({key}={os.path.join(folder, others[0])})" if others else "")


def load_checkpoint(path: str, key: str | None = "ckpt") -> dict:
    """The checkpoint dict of ``path`` (a .ckpt or a run folder: ``checkpoint_file``), or a CheckpointError that
    says what is wrong with the file (named as ``key``=path)."""
    named = f"{key}={path!r}" if key else path
    if key == "ckpt" and not path:
        raise ConfigError(
            "ckpt is required: pass a run folder or a .ckpt file from a training run, or hf=<model folder>"
        )
    given, path = path, checkpoint_file(path, key)
    if path and os.path.abspath(path) != os.path.abspath(given):  # a run folder: the file it reads, named
        named = f"{named} (its {os.path.relpath(path, given)})"
    if not path or not os.path.isfile(path):
        raise CheckpointError(
            f"{named} does not exist: pass a run folder or the path of a .ckpt file from a training run "
            "(logs/train/runs/<time>/checkpoints/last.ckpt)"
        )
    try:
        # Full unpickling, as Lightning does: Lightning checkpoints hold more than tensors. Load only your own runs.
        # Memory-mapped: a resume reads it here for its settings and Lightning reads it again, so no second copy.
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # truncated zip, pickle garbage, ...: all mean the file is not usable
        raise CheckpointError(
            f"{named} cannot be read ({type(e).__name__}): the file is truncated (a run killed or a disk filled "
            "while it was written) or not a PyTorch checkpoint" + (f"; {another_checkpoint(path, key)}" if key else "")
        ) from e
    stored = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    if not isinstance(stored, dict) or not ({"run", "run_config"} & set(stored)):  # run_config: before RunSpec
        raise CheckpointError(f"{named} is not a lenext checkpoint (no run configuration inside)")
    if not isinstance(checkpoint.get("state_dict"), dict) or not checkpoint["state_dict"]:
        raise CheckpointError(f"{named} holds no weights (no state_dict inside): pass a checkpoint a run saved")
    return checkpoint


def net_state(checkpoint: dict) -> dict:
    """The Decoder's weights in a checkpoint of the LightningModule."""
    return {k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}


def stored_spec(checkpoint: dict, named: str) -> RunSpec:
    """The RunSpec a checkpoint (``named`` in errors) holds; for one written before lenext kept it (a first stage:
    second stages came with it), resolved from its run config."""
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
        stored_pe_name(config),
        sweeps=False,
        precision=canonical_precision(precision) if precision in PRECISION_NAMES else None,
    )


@dataclass(frozen=True)
class Base:
    """A second stage's base checkpoint (``init_from``), read once: its run, the stage it is, its weights."""

    spec: RunSpec
    stage: Stage
    state: dict

    @property
    def vocab_size(self) -> int:
        return self.state["embedding.weight"].size(0)


def read_base(path: str) -> Base:
    """The base checkpoint ``init_from`` (a .ckpt or a run folder), refused in one line if unreadable; its stage
    names the file read."""
    checkpoint = load_checkpoint(path, "init_from")
    spec = stored_spec(checkpoint, f"init_from={path}")
    steps, tokens = checkpoint.get("global_step", 0), checkpoint.get("tokens_trained")
    stage = spec.as_stage(os.path.abspath(checkpoint_file(path, "init_from")), steps, tokens)
    return Base(spec, stage, net_state(checkpoint))


def refuse_other_data(recorded: dict | None, data, named: str, whole: bool = False) -> None:
    """A CheckpointError where ``data`` is not what the checkpoint ``named`` trained on (``recorded``, its
    ``trained_on``): another tokenizer (its token ids would mean other text) and, with ``whole`` (a resume), another
    training split. None: a probe's, or a checkpoint from before lenext kept it."""
    here = data.trained_on()
    if not recorded or not here:
        return
    keys = [key for key in recorded if key in here and (whole or key == "tokenizer")]
    differing = [key for key in keys if recorded[key] != here[key]]
    if differing:
        key = differing[0]
        what = "its tokenizer differs" if key == "tokenizer" else f"{key} {recorded[key]:,} there, {here[key]:,} here"
        raise CheckpointError(
            f"{named} was trained on other data than data={data.name} gives now ({what}): the corpus or its data "
            "settings changed since. Restore them" + (", or train a new run in another folder" if whole else "")
        )
