"""A lenext decoder as a transformers causal LM (written by lenext-export; no lenext import needed).

The lenext_*.py files beside this one are lenext's own model code (the decoder, its PEs and attention), their
imports made relative: the model computes what lenext computed. It keeps no cache: ``generate`` runs the whole
sequence at every step, as lenext scores it.
"""

import functools
import importlib

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from .configuration_lenext import LenextConfig
from .lenext_attention import AttentionSettings
from .lenext_model import Decoder
from .lenext_pe import PE_CLASSES  # noqa: F401  (imported so that every PE's module comes with the model)


def built(node):
    """A config node built as hydra.utils.instantiate builds it, its ``_target_`` read from the files beside."""
    if isinstance(node, list):
        return [built(value) for value in node]
    if not isinstance(node, dict):
        return node
    settings = {key: built(value) for key, value in node.items() if not key.startswith("_")}
    if "_target_" not in node:
        return settings
    module, _, name = node["_target_"].rpartition(".")
    target = getattr(importlib.import_module("." + module.replace(".", "_"), __package__), name)
    return functools.partial(target, **settings) if node.get("_partial_") else target(**settings)


class LenextPreTrainedModel(PreTrainedModel):
    config_class = LenextConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        """Nothing: every weight comes from the export."""


class LenextModel(LenextPreTrainedModel):
    """The decoder: token ids (B, L) -> last hidden states (B, L, d_model)."""

    def __init__(self, config: LenextConfig):
        super().__init__(config)
        run = config.lenext
        self.net = Decoder(
            vocab_size=config.vocab_size,
            train_len=run["train_len"],
            pe=built(run["pe"]),
            attention=AttentionSettings(**(run.get("attention") or {})),
            max_position=run["reach"],
            **{key: value for key, value in run["model"].items() if not key.startswith("_")},
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.net.embedding

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        refuse_left_padding(attention_mask)
        return BaseModelOutput(last_hidden_state=self.net(input_ids))


class LenextForCausalLM(LenextPreTrainedModel, GenerationMixin):
    def __init__(self, config: LenextConfig):
        super().__init__(config)
        self.model = LenextModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.net.embedding

    def get_output_embeddings(self):
        return self.model.net.head  # None for tied weights (scaled by d^-0.5 in the logits, as T5)

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        logits = self.model.net.logits(hidden).float()  # (B, L, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # no cache: the whole sequence each step


def refuse_left_padding(attention_mask: torch.Tensor | None) -> None:
    """Padding after the tokens leaves a causal model's logits of the tokens as they are; padding before them
    would move their positions, which lenext's positions (0..L-1) cannot express."""
    if attention_mask is None:
        return
    kept = attention_mask.bool()
    if (kept[:, 1:] & ~kept[:, :-1]).any():
        raise ValueError("lenext models take sequences padded on the right only (tokenizer.padding_side='right')")
