"""``lenext-export <checkpoint> <folder>``: a lenext checkpoint as a Hugging Face model folder (config, safetensors
weights, tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads without lenext.

A model transformers computes exactly goes out as that architecture (``lenext.export.native``: RoPE as Llama or
GPT-NeoX, learned positions as GPT-2); every other one with lenext's own code beside it (``lenext.export.remote``,
loaded with ``trust_remote_code=True``). The folder is written aside, loaded back and checked against lenext's
logits before it takes its name: a failed export leaves nothing.
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lenext.build import build_net, instantiate
from lenext.checkpoints import load_checkpoint, net_state, refuse_other_data, stored_spec
from lenext.errors import ConfigError, errors_in_one_line
from lenext.export.native import NATIVE
from lenext.export.remote import write_remote
from lenext.files import unmakeable_folder
from lenext.hf import refuse_without_transformers_models
from lenext.model import Decoder
from lenext.pe import RoPE
from lenext.results import RESULTS_FILE

ARCHITECTURES = ("auto", "remote", *NATIVE)
# How far the exported model's logits may be from lenext's (relative, over the whole logits tensor) on a sequence of
# L_train tokens: rounding only. A native RoPE export is checked on at most ROPE_CHECK_LENGTH tokens within
# ROPE_TOLERANCE: transformers' fp32 RoPE angles (lenext's are fp64) drift with the length and with how sharp the
# attention is (docs/export.md); a wrong conversion is off by 1e-2 and more.
TOLERANCE, ROPE_TOLERANCE, ROPE_CHECK_LENGTH = 1e-5, 1e-3, 256


def choose_architecture(net: Decoder, asked: str) -> str:
    """The architecture to write: ``asked``, refused in one line if it cannot hold the model exactly; ``auto``:
    the first native one that can, else remote code."""
    if asked == "auto":
        return next((name for name, arch in NATIVE.items() if arch.refusal(net) is None), "remote")
    if asked in NATIVE:
        reason = NATIVE[asked].refusal(net)
        if reason:
            raise ConfigError(
                f"--architecture {asked} is invalid for this checkpoint: {reason}; use --architecture auto (the "
                "remote-code export holds every model)"
            )
    return asked


def exported_tokenizer(spec, cache_dir: str, trained_on: dict | None, named: str):
    """The run's tokenizer as a transformers tokenizer (its BOS the token each document starts with, put before
    the text it encodes), or None for a probe task's token ids. Only the tokenizer is loaded (from the cache, or
    trained again on the training split), and refused if not the one the checkpoint ``named`` trained with."""
    node = OmegaConf.create(spec.config["data"])
    if "corpus" not in node:
        return None
    node.cache_dir = cache_dir
    data = instantiate(node, "data")
    data.load_tokenizer()
    refuse_other_data(trained_on, data, named)
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = node.get("tokenizer")
    if source and os.path.isdir(source):  # an HF tokenizer folder: its own settings, its start token as lenext's
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(data.tokenizer.to_str()))
    start = data.tokenizer.id_to_token(data.start_token)
    # Text is encoded as lenext's documents are: after the start token (the harness, generate()); lenext's own
    # encoding adds no special tokens, so its rows do not change. A post-processor already adding it is kept.
    if tokenizer("x")["input_ids"][:1] != [data.start_token]:
        special = [(start, data.start_token)]
        processor = TemplateProcessing(single=[start, "$A"], pair=[start, "$A", "$B:1"], special_tokens=special)
        tokenizer.backend_tokenizer.post_processor = processor
    tokenizer.bos_token = tokenizer.bos_token or start  # generate() stops at the EOS its config names
    tokenizer.eos_token = tokenizer.eos_token or start
    return tokenizer


def refuse_unsafe_folder(out: str, checkpoint: str, force: bool) -> Path:
    """The export's folder, resolved, refused in one line before any work where writing it would fail or lose
    something: inside a file, a link, the folder the command runs in (or one holding it), one holding the
    checkpoint, a file (even with ``--force``), one that holds something without ``--force``, or a run's checkpoints or
    results (even with ``--force``)."""
    if not out.strip():
        raise ConfigError("the export's folder is '' (an unset variable?): give a folder path")
    target = Path(out).resolve()
    if Path(out).is_symlink():
        raise ConfigError(f"{out} is a symbolic link: give the folder itself, or a new folder")
    blocking = next((parent for parent in target.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{out} is inside {blocking}, which is a file: give a folder path")
    existing = next(parent for parent in target.parents if parent.exists())  # where it is written, or made
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only disk too (EROFS), for root as well
        raise ConfigError(f"{out} cannot be written: {existing} is not writable; give a folder this user can write")
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise ConfigError(f"{out} is the folder this command runs in, or holds it: give a new folder")
    if Path(checkpoint).resolve().is_relative_to(target):
        raise ConfigError(f"{out} holds the checkpoint {checkpoint}: writing there would replace it; give a new folder")
    if target.exists() and not target.is_dir():  # --force replaces a folder's contents, never a file
        raise ConfigError(f"{out} is a file, not a folder: give a folder path")
    if target.exists() and any(target.iterdir()) and not force:
        raise ConfigError(f"{out} exists and is not an empty folder: give a new folder, or --force to replace it")
    held = next((p for p in target.rglob("*") if p.name == RESULTS_FILE or p.suffix == ".ckpt"), None)
    if held:  # a run's checkpoints and results are never an export's to replace
        raise ConfigError(
            f"{out} holds a lenext run's {held.relative_to(target)}: --force replaces an export, not a run; give a "
            "new folder"
        )
    return target


def logit_error(net: Decoder, folder: Path, remote: bool, length: int) -> float:
    """Relative distance between the exported model's logits and lenext's on one random sequence of ``length``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, trust_remote_code=remote, dtype=torch.float32
    ).eval()
    tokens = torch.randint(net.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = net.logits(net(tokens)).float()
        theirs = model(input_ids=tokens, use_cache=False).logits.float()
    return float((theirs - ours).norm() / ours.norm())


def export(checkpoint: str, out: str, architecture: str = "auto", force: bool = False, cache_dir: str | None = None):
    """Write ``checkpoint``'s model into the folder ``out``: (the architecture written, its logits' relative distance
    from lenext's, whether a tokenizer went with it)."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"--architecture {architecture!r} is invalid: it must be one of {', '.join(ARCHITECTURES)}")
    refuse_without_transformers_models("lenext-export")
    target = refuse_unsafe_folder(out, checkpoint, force)
    cache = cache_dir or os.environ.get("LENEXT_CACHE") or os.path.join(os.environ.get("LENEXT_ROOT", "."), ".cache")
    unusable = unmakeable_folder(cache)
    if unusable:
        raise ConfigError(f"--cache-dir {cache} cannot be the data cache ({unusable}): give a folder")
    loaded = load_checkpoint(checkpoint, key=None)
    spec = stored_spec(loaded, checkpoint)
    state = net_state(loaded)
    net = build_net(spec, state["embedding.weight"].size(0), state).eval()
    chosen = choose_architecture(net, architecture)
    tokenizer = exported_tokenizer(spec, cache, loaded.get("trained_on"), checkpoint)
    # The ids generation starts and stops at (transformers' defaults are other tokens of this vocabulary, or none).
    special_tokens = {
        "bos_token_id": tokenizer.bos_token_id if tokenizer else None,
        "eos_token_id": tokenizer.eos_token_id if tokenizer else None,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        folder = Path(tmp) / target.name  # transformers names a remote-code module by its folder's name
        folder.mkdir()
        if chosen == "remote":
            write_remote(net, spec, folder, special_tokens)
        else:
            NATIVE[chosen].write(net, folder, spec.base_len, special_tokens)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        fp32_angles = chosen != "remote" and isinstance(net.pe, RoPE)
        length = min(spec.train_len, ROPE_CHECK_LENGTH) if fp32_angles else spec.train_len
        error = logit_error(net, folder, chosen == "remote", length)
        if not error <= (ROPE_TOLERANCE if fp32_angles else TOLERANCE):
            raise RuntimeError(f"the {chosen} export's logits differ from lenext's by {error:.2e} (relative): a bug")
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        os.replace(folder, target)
    return chosen, error, tokenizer is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lenext-export",
        description="Write a lenext checkpoint as a Hugging Face model folder (docs/export.md).",
    )
    parser.add_argument("checkpoint", help="a .ckpt file of a lenext run, or its run folder (its last.ckpt)")
    parser.add_argument("out", help="the model folder to write (new or empty)")
    parser.add_argument(
        "--architecture",
        default="auto",
        help=f"one of {', '.join(ARCHITECTURES)}; auto: a native one where it computes exactly what lenext does, "
        "else remote code (default: auto)",
    )
    parser.add_argument("--force", action="store_true", help="replace the folder if it holds something")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="tokenizers' cache (default: $LENEXT_CACHE, else $LENEXT_ROOT/.cache or ./.cache)",
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its bar of weights loaded, when the export is checked
    with errors_in_one_line(sigterm=True):
        chosen, error, with_tokenizer = export(args.checkpoint, args.out, args.architecture, args.force, args.cache_dir)
    remote = chosen == "remote"
    print(
        f"wrote {args.out}: {'remote code (lenext_*.py beside the config)' if remote else chosen}, logits within "
        f"{error:.1e} of lenext's{'' if with_tokenizer else '; no tokenizer (a probe task: token ids)'}"
    )
    print(
        f"load it: AutoModelForCausalLM.from_pretrained({args.out!r}{', trust_remote_code=True' if remote else ''}); "
        f"evaluate it: python eval.py hf={args.out}{' trust_remote_code=true' if remote else ''}"
    )
