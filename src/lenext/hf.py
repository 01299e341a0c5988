"""Hugging Face causal LMs under lenext's protocols: ``python eval.py hf=<model folder or hub id>``.

Any ``AutoModelForCausalLM`` is evaluated by the sweep that evaluates lenext's runs, on a corpus lenext has
(``data=``, the embedded one by default) tokenized with the model's own tokenizer, into the same results.json:
every protocol, lengths given directly or as ``eval.factors`` of the model's trained context (``trained_context``:
a lenext export's L_train, a scaling's original context, or ``max_position_embeddings``), perplexity and
bits per byte (models with different tokenizers share a table by the latter).

A RoPE model's zero-shot scalings are its variants (``eval.variants``), set through the model's own config as
transformers defines them (``ROPE_INIT_FUNCTIONS``): at each length L, the factor max(1, L / C) (dynamic NTK's
is 1, as lenext's: it grows its base with the length itself). Self-Extend, which transformers does not define, is
lenext's, through the model's attention (``lenext.hf_self_extend``: Llama-like models). Static NTK (RoPE at another
base, which a zero-shot variant of a trained model would not be asked for) and LongRoPE, whose factors are per
dimension and searched per model, are not HF variants.
"""

import contextlib
import copy
import dataclasses
import os
import re
from collections.abc import Iterator
from importlib import resources
from typing import NamedTuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lenext import schema
from lenext.build import CONFIG_PACKAGE, instantiate
from lenext.data.tokenizer import external_tokenizer, token_id_bound
from lenext.errors import ConfigError, LengthNotSupported, first_line
from lenext.evaluate import EvalSettings, SweepPlan, sweep, sweep_plan
from lenext.hardware import canonical_precision
from lenext.hf_self_extend import ATTENTION_NAME
from lenext.hf_self_extend import install as install_self_extend
from lenext.model import chunked_nll
from lenext.pe.rope import TRANSFORMERS_ROPE_TYPES, self_extend_group, transformers_rope_parameters, unset_factor
from lenext.protocols import refuse_an_evaluator_of_other_text
from lenext.resolve import EVAL_NODES, EvalScriptSettings, flat_settings
from lenext.results import environment, format_rows, write_results
from lenext.run_folder import record_command, refuse_results_it_would_replace

SELF_EXTEND = "self_extend"  # lenext's grouped positions, through the model's attention (lenext.hf_self_extend)
# A model's own rotary settings a scaling keeps (partial rotary, multimodal sections).
KEPT_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
# Names of position tables, learned (GPT-2, OPT, GPT-Neo, BioGPT, ...) or fixed buffers (GPT-J's and CodeGen's sin
# and cos of n_positions rows): lengths beyond them are n/a.
POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
# Models whose positions stop at a config setting with no table to read it from (MPT's ALiBi, built to max_seq_len).
POSITION_LIMITS = {"mpt": "max_seq_len"}


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' warnings off while a folder's config is read: its notice on a config of remote code ("You are
    using a model of type lenext ...") comes before lenext's one line, which says it better."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def refuse_without_transformers_models(setting: str) -> None:
    """A ConfigError for ``setting`` where transformers runs no PyTorch model: it turns PyTorch off below the torch
    it requires (transformers 5: 2.6), which lenext's own training and evaluation do not need (they take 2.4)."""
    import transformers
    from transformers.utils import is_torch_available

    if not is_torch_available():
        raise ConfigError(
            f"{setting} needs transformers' PyTorch models, which transformers {transformers.__version__} turns off "
            f"on torch {torch.__version__}: install the torch it asks for (transformers 5: 2.6 or newer)"
        )


def model_config(source: str, trust_remote_code: bool = False):
    """The model config at ``source``, refused in one line where transformers cannot read it (read before the
    tokenizer, whose loading reads it too and would be blamed for it)."""
    from transformers import AutoConfig

    where = f"hf={source!r}"
    refuse_without_transformers_models(where)
    try:
        with transformers_quiet():
            config = AutoConfig.from_pretrained(
                source, local_files_only=os.path.isdir(source), trust_remote_code=trust_remote_code
            )
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(
                f"{where}: its model's code is not in transformers but in the folder; pass trust_remote_code=true "
                "to run it (it runs code from there)"
            ) from None
        raise ConfigError(f"{where} holds no model config transformers knows ({first_line(e)})") from None
    except (ImportError, SyntaxError) as e:
        if not trust_remote_code:
            raise
        raise ConfigError(code_failed(where, e)) from None  # the folder's own code, or a package it imports
    except OSError as e:
        if os.path.isdir(source):  # its config.json is no JSON, or cannot be read
            raise ConfigError(f"{where} holds no model config transformers can read ({first_line(e)})") from None
        raise ConfigError(f"{where} is not a model folder or a hub id this machine reaches ({first_line(e)})") from None
    if not has_causal_lm(config):  # before any other setting is judged against it (its context)
        raise ConfigError(
            f"{where}: {type(config).__name__} is not a causal LM (an encoder-decoder, or transformers has no "
            f"causal LM for model_type {config.model_type!r}): lenext's protocols score each token from the ones "
            "before it"
        )
    return config


def code_failed(where: str, error: BaseException) -> str:
    """The one line for a model whose own code (``trust_remote_code``) cannot be run: a file of it missing or broken,
    or a package it imports not installed."""
    return f"{where}: the model's code in the folder could not be run ({type(error).__name__}: {first_line(error)})"


def has_causal_lm(config) -> bool:
    """Whether transformers (or the folder's own code) has a causal LM for ``config``: not an encoder-decoder, whose
    ``ForCausalLM`` class (BART's, Marian's) is its decoder alone, without the encoder it was trained with."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return False
    remote = getattr(config, "auto_map", None) or {}
    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "AutoModelForCausalLM" in remote


def load_model(source: str, trust_remote_code: bool = False, config=None):
    """The causal LM at ``source`` (a local folder, or a hub id where the machine reaches the hub), refused in one
    line for what lenext cannot evaluate; nothing is downloaded for a local folder."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    where = f"hf={source!r}"
    local = os.path.isdir(source)
    transformers_logging.disable_progress_bar()  # its bar of weights loaded: a line of its own before lenext's
    config = config or model_config(source, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, local_files_only=local, trust_remote_code=trust_remote_code, dtype=torch.float32
        )
    except ValueError as e:
        raise ConfigError(f"{where}: {type(config).__name__} is not a causal LM ({first_line(e)})") from None
    except (ImportError, SyntaxError) as e:
        if not trust_remote_code:
            raise
        raise ConfigError(code_failed(where, e)) from None
    except (OSError, SafetensorError) as e:  # none, or a damaged file (a truncated download)
        if trust_remote_code and re.search(r"\w\.py\b", str(e)):  # a module of the folder's code that is not there
            raise ConfigError(code_failed(where, e)) from None
        raise ConfigError(f"{where} holds no weights transformers can load ({first_line(e)})") from None
    model.eval()
    if not sees_only_the_past(model, config.vocab_size):
        raise ConfigError(
            f"{where}: {type(model).__name__} is not causal (a later token changes an earlier position's logits): "
            "lenext's protocols score each token from the ones before it"
        )
    return model


@torch.no_grad()
def sees_only_the_past(model, vocab_size: int) -> bool:
    """Whether changing the last of 8 tokens leaves the first position's logits as they were (an encoder such as
    BERT, which transformers also loads as a causal LM, sees the whole window)."""
    tokens = torch.arange(8)[None] % vocab_size
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab_size
    first = model(input_ids=tokens, use_cache=False).logits[0, 0]
    return torch.allclose(first, model(input_ids=changed, use_cache=False).logits[0, 0], rtol=1e-4, atol=1e-5)


def trained_context(config, given: int | None = None) -> int:
    """C: the context the model was trained at: ``given`` (eval.py's ``context``), else its config's (a lenext
    export's run's first L_train: a run trained under YaRN or Llama 3's scaling may have another original context)."""
    rope = getattr(config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    context = given or getattr(config, "lenext_context", None) or original
    context = context or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    if not context:
        raise ConfigError(
            f"context=null is invalid for this model: its config ({type(config).__name__}) says no trained context "
            "(max_position_embeddings); give the context it was trained at (context=2048), which eval.factors multiply"
        )
    return int(context)


def position_limit(model) -> int | None:
    """The positions a model's position table serves (a learned one less OPT's offset; a fixed buffer's rows; a
    lenext export's ``position_limit``; ``POSITION_LIMITS``), or None for a model that serves any length."""
    if getattr(model.config, "position_limit", None):
        return model.config.position_limit
    for path, module in model.named_modules():
        if path.rpartition(".")[2] in POSITION_TABLES and isinstance(module, nn.Embedding):
            return module.num_embeddings - getattr(module, "offset", 0)
    for path, buffer in model.named_buffers():
        if path.rpartition(".")[2] in POSITION_TABLES:
            return buffer.size(0)
    setting = POSITION_LIMITS.get(getattr(model.config, "model_type", None))
    return getattr(model.config, setting, None) if setting else None


class HFPositions:
    """What the sweep asks of a PE, for an HF model: its evaluation-time variants (RoPE's scalings, set through
    the model's config and its rotary modules rebuilt) and the factor each uses at a length."""

    def __init__(self, model, context: int | None = None):
        self.model, self.context = model, trained_context(model.config, context)
        # C of the scalings: a lenext export's RoPE's (the span of positions it trained), else the trained context
        self.scaling_context = (
            None if context else getattr(model.config, "lenext_scaling_context", None)
        ) or self.context
        rope = getattr(model.config, "rope_parameters", None)
        self.rope = dict(rope) if isinstance(rope, dict) and "rope_type" in rope else None
        # transformers' dynamic module keeps the longest length it saw, so the model's own is rebuilt per length
        self.dynamic = self.rope is not None and self.rope["rope_type"] == TRANSFORMERS_ROPE_TYPES["dynamic_ntk"]
        self.active: str | None = None  # the variant set, when not the model as trained
        self.self_extend = None  # its attention function, once Self-Extend is asked for (lenext.hf_self_extend)
        self.trained_attention = model.config._attn_implementation
        self._built_for: tuple | None = (None, None, 0)  # the model as trained, its modules as loaded
        self.trained_modules = {
            path: module
            for path, module in model.named_modules()
            if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq")
        }

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        """The model as trained (None) first, then each asked scaling, zero-shot."""
        if not asked:
            return [None]
        if self.rope is None or not self.trained_modules:
            raise ConfigError(
                f"eval.variants={asked} is invalid for this model: it has no RoPE settings (rope_parameters) with "
                "one rotary module set transformers can rebuild under a scaling"
            )
        unknown = [name for name in asked if name not in (*TRANSFORMERS_ROPE_TYPES, SELF_EXTEND)]
        if unknown:
            raise ConfigError(
                f"eval.variants={asked} is invalid for a Hugging Face model: {', '.join(unknown)} is not a scaling "
                f"transformers defines nor Self-Extend; its variants are "
                f"{', '.join(TRANSFORMERS_ROPE_TYPES)}, {SELF_EXTEND}"
            )
        if SELF_EXTEND in asked and self.self_extend is None:
            reason = "it has several rotary modules" if len(self.trained_modules) > 1 else None
            reason = reason or ("its own RoPE is dynamic (rope_type dynamic), not fixed" if self.dynamic else None)
            installed = reason or install_self_extend(self.model, *self.trained_modules.values(), self.scaling_context)
            if isinstance(installed, str):
                raise ConfigError(
                    f"eval.variants={asked} is invalid for this model: Self-Extend cannot patch it, {installed}"
                )
            self.self_extend = installed
        plain = self.rope["rope_type"] == "default"  # then "none" is the model as trained
        return [None, *(name for name in asked if not (plain and name == "none"))]

    @contextlib.contextmanager
    def variant(self, name: str | None) -> Iterator[None]:
        self.active = name
        try:
            yield
        finally:
            self.active = None
            self._configure(None, 0)

    def scaling_factor(self, length: int) -> float | None:
        if self.active is None:
            return None
        if self.active == SELF_EXTEND:  # its factor is the group size G
            return float(self_extend_group(length, self.self_extend.window, self.scaling_context))
        return unset_factor(self.active, length, self.scaling_context)

    def configure(self, length: int) -> None:
        """The model's rotary modules for the active variant at ``length`` (nothing to do as trained)."""
        self._configure(self.active, length)

    def _configure(self, name: str | None, length: int) -> None:
        # A dynamic module (dynamic NTK's, or a dynamic model's own) keeps the longest length it saw: one per length.
        fresh = name == "dynamic_ntk" or (name is None and self.dynamic)
        key = (name, self.scaling_factor(length), length if fresh else 0)
        if key == self._built_for:
            return
        if name in (None, SELF_EXTEND):  # the model as trained: its own modules, put back (built anew if dynamic)
            for path, module in self.trained_modules.items():
                own = type(module)(config=self.model.config).to(module.inv_freq.device) if fresh else module
                self._replace(path, own)
        if name == SELF_EXTEND:
            self.self_extend.group = int(key[1])
        attention = ATTENTION_NAME if name == SELF_EXTEND else self.trained_attention
        if self.model.config._attn_implementation != attention:
            self.model.set_attn_implementation(attention)
        if name not in (None, SELF_EXTEND):
            config = copy.deepcopy(self.model.config)
            config.max_position_embeddings = self.scaling_context  # dynamic NTK grows its base beyond C, as lenext's
            # The model's own rotary settings (partial rotary, multimodal sections) kept; its scaling replaced.
            kept = {k: v for k, v in self.rope.items() if k in KEPT_ROPE_KEYS}
            config.rope_parameters = {**kept, **transformers_rope_parameters(name, key[1], self.scaling_context)}
            for path, module in self.trained_modules.items():
                self._replace(path, type(module)(config=config).to(module.inv_freq.device))
        self._built_for = key

    def _replace(self, path: str, module: nn.Module) -> None:
        parent, _, attribute = path.rpartition(".")
        setattr(self.model.get_submodule(parent), attribute, module)


class HFLanguageModel(nn.Module):
    """The sweep's view of an ``AutoModelForCausalLM``: the per-target NLL lenext's Decoder gives (``token_nll``),
    its logits made a chunk of positions at a time where the head is a plain projection of the last hidden state."""

    def __init__(self, model, context: int | None = None):
        super().__init__()
        self.model, self.pe = model, HFPositions(model, context)
        self.max_length = position_limit(model)
        self.plain_head = isinstance(model.get_output_embeddings(), nn.Linear) and self._head_is_plain()

    @torch.no_grad()
    def _head_is_plain(self) -> bool:
        """Whether the model's logits are its output projection of its base model's last hidden state (many
        models scale or cap them, or transform the state first): checked once, on 16 tokens."""
        tokens = torch.arange(16)[None] % self.model.config.vocab_size
        own = self.model(input_ids=tokens, use_cache=False).logits
        hidden = self.model.base_model(input_ids=tokens, use_cache=False)[0]
        projected = self.model.get_output_embeddings()(hidden)
        return own.shape == projected.shape and torch.allclose(own, projected, rtol=1e-5, atol=1e-5)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def token_nll(self, inputs: torch.Tensor, targets: torch.Tensor, positions=None, predictions: bool = False):
        """(B, L) NLL of each target given the inputs before it (with ``predictions``, also the most likely tokens);
        HF models are evaluated at positions 0..L-1."""
        if positions is not None:
            raise ValueError("Hugging Face models are evaluated at positions 0..L-1")
        length = inputs.size(1)
        if self.max_length and length > self.max_length:
            raise LengthNotSupported(f"its position table serves at most {self.max_length} tokens")
        self.pe.configure(length)
        if not self.plain_head:
            logits = self.model(input_ids=inputs, use_cache=False).logits.float()
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
            return (nll, logits.argmax(-1)) if predictions else nll
        hidden = self.model.base_model(input_ids=inputs, use_cache=False)[0]  # (B, L, d)
        head = self.model.get_output_embeddings()
        return chunked_nll(hidden, targets, head, head.out_features, predictions)  # as lenext's Decoder scores


def row_name(source: str) -> str:
    """The report's row of an HF model: ``hf:<its folder's or hub id's last part>``."""
    return "hf:" + os.path.basename(os.path.normpath(source))


class CheckedHF(NamedTuple):
    """What eval.py hf= reads and checks before the model's weights: its folder and config, its tokenizer, the data
    tokenized with it (nothing read yet) and the sweep's plan."""

    source: str
    config: object
    tokenizer: object
    data_node: DictConfig
    data: object
    settings: EvalSettings
    plan: SweepPlan


def checked_hf(cfg: DictConfig) -> CheckedHF:
    """eval.py hf= of a config ``schema.check`` passed: every setting checked before the weights load (by the
    evaluation, and by an eval.py sweep for each job before the first starts)."""
    if cfg.ckpt:
        raise ConfigError(f"ckpt={cfg.ckpt} and hf={cfg.hf}: give one, the lenext checkpoint or the HF model")
    changed = [f"pe.{key}" for key, value in cfg.pe.items() if value != "as_trained"]
    if changed:
        raise ConfigError(f"{', '.join(changed)} applies to ckpt=; a Hugging Face model's scalings are eval.variants")
    if cfg.get("data") and "corpus" not in cfg.data:
        raise ConfigError("data= with hf= must be a text corpus (sotu, text_files, ...): a probe's tokens are not text")
    source = hf_folder(cfg.hf)
    config = model_config(source, cfg.trust_remote_code)
    with transformers_quiet():  # refused before the weights load: a folder without a tokenizer
        tokenizer, _ = external_tokenizer(source, "hf")
    data_node = cfg.data if cfg.get("data") else OmegaConf.load(resources.files(CONFIG_PACKAGE) / "data/sotu.yaml")
    if data_node.get("tokenizer") not in (None, cfg.hf, source):
        raise ConfigError(f"data.tokenizer={data_node.tokenizer} is invalid with hf=: the model's tokenizer is used")
    # seed: the training order, which evaluation does not use; the file's own reads a run's seed, which has none.
    data_node = OmegaConf.merge(data_node, {"tokenizer": source, "cache_dir": cfg.paths.cache_dir, "seed": 0})
    data = instantiate(data_node, "data")
    settings = EvalSettings(**OmegaConf.to_container(cfg.eval, resolve=True))
    plan = sweep_plan(settings, trained_context(config, cfg.context), None, data.protocols)
    return CheckedHF(source, config, tokenizer, data_node, data, settings, plan)


def evaluate_hf(cfg: DictConfig) -> str:
    """eval.py hf=...: check every setting (``checked_hf``), load the model, check what needs it before reading the
    corpus, sweep, write results.json."""
    schema.check(cfg, EvalScriptSettings, EVAL_NODES)
    refuse_results_it_would_replace(cfg.paths.output_dir, evaluated=("hf", cfg.hf))
    source, config, tokenizer, data_node, data, settings, plan = checked_hf(cfg)
    model = load_model(source, cfg.trust_remote_code, config)
    embeds = model.get_input_embeddings().num_embeddings
    ids = token_id_bound(tokenizer)
    if ids > embeds:  # before the corpus is tokenized
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        beyond = sorted((token for token, id_ in vocab.items() if id_ >= embeds), key=vocab.get)  # by id
        shown = ", ".join(repr(token) for token in beyond[:3]) + (", ..." if len(beyond) > 3 else "")
        why = (
            "the folder has no tokenizer_config.json, without which transformers adds the model type's default "
            "special tokens: restore it (lenext-export writes one)"
            if os.path.isdir(source) and not os.path.exists(os.path.join(source, "tokenizer_config.json"))
            else "a tokenizer of another model?"
        )
        raise ConfigError(
            f"hf={cfg.hf}: its tokenizer has {ids} token ids, more than the {embeds} its model embeds ({shown} "
            f"beyond them): {why}"
        )
    net = HFLanguageModel(model, cfg.context)
    net.pe.variants(settings.variants, max(plan.lengths))  # refuses, before the corpus is read, what it cannot take
    record_command(cfg)  # accepted: every check passed
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = canonical_precision(cfg.precision or ("bf16-mixed" if device.type == "cuda" else "32-true"))
    data.load()
    refuse_an_evaluator_of_other_text(plan, data)
    rows, curves = sweep(net.to(device), data.evaluation(cfg.split), plan, settings, precision)
    meta = {
        "row": row_name(cfg.hf),
        "row_fields": {"pe": row_name(cfg.hf), "positions": "sequential", "attention": []},
        "pe_name": row_name(cfg.hf),
        "pe": {"name": type(model).__name__, **({"scaling": None, "rope": net.pe.rope} if net.pe.rope else {})},
        "pe_family": "Hugging Face models",
        "pe_display_name": os.path.basename(os.path.normpath(cfg.hf)),
        "positions": {"train": "sequential", "reach": None, "eval": "sequential"},
        "pe_config": {},
        "model": {"architecture": type(model).__name__, "model_type": model.config.model_type},
        "train_len": net.pe.context,
        "base_len": net.pe.context,
        "seed": 0,
        "corpus": data.name,
        "task": None,
        "split": cfg.split,
        "tokenizer": data.tokenizer_id,
        "vocab_size": data.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "hf": {"model": cfg.hf, "folder": os.path.abspath(source), "trust_remote_code": cfg.trust_remote_code},
        "identity": {
            "hf.model": os.path.abspath(source),
            "context": cfg.context,
            "precision": precision,
            "trust_remote_code": cfg.trust_remote_code,
            "split": cfg.split,
            **flat_settings(
                {"data": OmegaConf.to_container(data_node, resolve=True), "eval": dataclasses.asdict(settings)},
                ignore=("data.cache_dir",),  # where the cache lives, not what was measured
            ),
        },
        **environment(str(device), None),
        "precision": precision,
    }
    path = write_results(cfg.paths.output_dir, meta, rows, curves)
    print(format_rows(rows))
    print(f"results: {path}")
    return path


def hf_folder(source: str) -> str:
    """A local folder as given; a hub id downloaded (where the machine reaches the hub) into the hub's cache."""
    source = os.path.expanduser(source)  # a shell leaves hf=~/model as it is
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ConfigError(
                f"hf={source!r} holds no config.json: give a Hugging Face model folder (config.json, weights, "
                "tokenizer), such as lenext-export writes"
            )
        return source
    if os.path.exists(source):
        raise ConfigError(f"hf={source!r} is a file: give a model folder (config.json, weights, tokenizer)")
    if source.startswith((os.sep, ".", "~")) or source.count("/") > 1:
        raise ConfigError(f"hf={source!r} does not exist: give a model folder (config.json, weights, tokenizer)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(source)
    except (HFValidationError, OSError) as e:
        raise ConfigError(
            f"hf={source!r} is neither a local folder nor a hub id this machine reaches ({first_line(e)})"
        ) from None
