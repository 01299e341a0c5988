"""``key_tokens``: perplexity over the targets a long context helps (LongPPL), judged by the model or an evaluator."""

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from lenext.errors import ConfigError
from lenext.protocols.base import TextProtocol, Window, bits_per_byte, settings_of
from lenext.protocols.nonoverlap import NonOverlapping
from lenext.protocols.sliding import Sliding
from lenext.scoring import Measured, distributed, sum_metric, window_nll


@dataclass(frozen=True)
class KeyTokens(TextProtocol):
    """Perplexity over key tokens (LongPPL, Fang et al. 2025, arXiv 2410.23771): in disjoint windows of L, the
    targets whose log-probability with the whole window before them exceeds by more than ``gain`` nats the one
    with a short context of ``context`` tokens (windows of ``context`` advanced by a fifth of it, as LongPPL's
    4096 + 1024: each target past the window's first ``context`` has 4/5 to all of it before it), and whose own
    log-probability is above ``-max_nll``, both by the ``evaluator`` (a lenext checkpoint sharing the tokenizer;
    None: the model itself, whose key-token perplexity is then below exp(max_nll) by construction:
    docs/evaluation.md)."""

    name = "key_tokens"
    metrics = ("ppl", "key_share")
    own_settings = {"key_context": None, "key_gain": 2.0, "key_max_nll": 2.0, "key_evaluator": None}
    context: int = 1  # the short context: L_train by default
    gain: float = own_settings["key_gain"]
    max_nll: float = own_settings["key_max_nll"]  # LongPPL's -beta
    evaluator: str | None = None

    @classmethod
    def from_plan(cls, plan) -> "KeyTokens":
        return cls(**settings_of(plan, "key_", {"context": plan.base_len}))

    def parameters(self) -> dict:
        return {"context": self.context, "gain": self.gain, "max_nll": self.max_nll, "evaluator": self.evaluator}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        return NonOverlapping().windows(document_lengths, length)

    def short_windows(self, window: Window, length: int) -> list[Window]:
        """The short-context windows over the targets of ``window`` (of ``length`` > ``context``): each scores
        targets none before it scored."""
        stride = max(1, self.context // 5)
        return [
            Window(window.document, window.start + short.start, short.score_from)
            for short in Sliding(stride).windows([length + 1], self.context)
        ]

    def key_targets(self, judge, documents, group, long_nll, length, settings, precision, scheme, seed):
        """(B, L) bool: the key targets of the windows ``group``, by ``judge``, whose long NLL is ``long_nll``."""
        short_nll = torch.full_like(long_nll, float("nan"))  # every target gets its short-context NLL
        owners = [(b, s.start - w.start) for b, w in enumerate(group) for s in self.short_windows(w, length)]
        shorts = [s for w in group for s in self.short_windows(w, length)]
        done = 0
        for part, nll in window_nll(
            judge, documents, shorts, self.context, settings.tokens_per_batch, precision, scheme, seed
        ):
            for s, row in zip(part, nll, strict=True):
                b, offset = owners[done]
                short_nll[b, offset + s.score_from : offset + len(row)] = row[s.score_from :]
                done += 1
        key = (short_nll - long_nll > self.gain) & (long_nll < self.max_nll)
        key[:, : self.context] = False  # their short context is their whole one: a difference there is rounding
        return key

    @torch.no_grad()
    def measure(self, net, evaluation, windows, length, settings, precision, scheme, seed) -> Measured:
        device = next(net.parameters()).device
        judge = net if self.evaluator is None else evaluator_net(self.evaluator, net)
        judge_scheme = scheme if judge is net else None  # the evaluator reads its windows at 0..L-1
        rank, world = distributed()
        counted = ("key_nll", "key_tokens", "targets", "all_nll", *(("key_bytes",) if evaluation.byte_ends else ()))
        sums = {m: sum_metric().to(device) for m in counted}
        batches = window_nll(
            net, evaluation.documents, windows[rank::world], length, settings.tokens_per_batch, precision, scheme, seed
        )
        for group, long_nll in batches:
            if length <= self.context:  # every context is short already: no token gains
                key = torch.zeros_like(long_nll, dtype=torch.bool)
            else:
                judged = long_nll
                if judge is not net:  # the evaluator's own long pass, at 0..L-1
                    ((_, judged),) = window_nll(
                        judge, evaluation.documents, group, length, length * len(group), precision, None, seed
                    )
                key = self.key_targets(
                    judge, evaluation.documents, group, judged, length, settings, precision, judge_scheme, seed
                )
            sums["key_nll"].update(long_nll[key].sum())
            sums["key_tokens"].update(key.sum())
            sums["targets"].update(key.numel())
            sums["all_nll"].update(long_nll.sum())
            if evaluation.byte_ends is not None:
                for b, w in enumerate(group):
                    ends = evaluation.byte_ends[w.document][w.start : w.start + length + 1].astype(np.int64)
                    sums["key_bytes"].update(int(np.diff(ends)[key[b].cpu().numpy()].sum()))
        total = {m: float(v.compute().item()) for m, v in sums.items()}
        count = int(total["key_tokens"])
        mean_nll = total["key_nll"] / count if count else None
        metrics = {
            "ppl": math.exp(mean_nll) if count else None,
            "mean_nll": mean_nll,
            "tokens": count,
            "key_share": count / total["targets"] if total["targets"] else None,
            "all_ppl": math.exp(total["all_nll"] / total["targets"]) if total["targets"] else None,
        }
        if evaluation.byte_ends is not None:
            metrics |= bits_per_byte(total["key_nll"], int(total["key_bytes"]))
        return Measured(metrics)


@cache
def evaluator_net(path: str, like):
    """The model of the lenext checkpoint (or run folder) ``path`` that judges key tokens, on ``like``'s device;
    a ConfigError unless its vocabulary is the evaluated model's (its tokenizer was checked against the data's
    before any work: ``refuse_an_evaluator_of_other_text``)."""
    from lenext.build import build_net  # lenext.build reads configs through lenext.resolve, which imports this
    from lenext.checkpoints import load_checkpoint, net_state, stored_spec

    checkpoint = load_checkpoint(path, "eval.key_evaluator")
    state = net_state(checkpoint)
    vocab, evaluated = state["embedding.weight"].size(0), like.embedding.num_embeddings  # a lenext or HF model's
    if vocab != evaluated:
        raise ConfigError(
            f"eval.key_evaluator={path!r} has a vocabulary of {vocab} tokens, the evaluated model {evaluated}: "
            "it must be a run on the same data and tokenizer"
        )
    judge = build_net(stored_spec(checkpoint, f"eval.key_evaluator={path}"), vocab, state)
    return judge.to(next(like.parameters()).device).eval()


def refuse_an_evaluator_of_other_text(plan, data) -> None:
    """Before any work, once ``data`` is prepared: eval.key_evaluator trained with another tokenizer than the one
    that wrote ``data``'s documents (checkpoints keep it: ``trained_on``), whose token ids would mean other text to
    it. Not compared where either is unknown: the probes' data (token ids, no tokenizer), a checkpoint from before
    lenext kept it, an evaluator still training (no checkpoint yet)."""
    from lenext.checkpoints import checkpoint_file, load_checkpoint

    path = plan.protocol_settings.get("key_evaluator") if plan else None
    here = data.trained_on() if path else None
    if not here or checkpoint_file(path, "eval.key_evaluator", missing_ok=True) is None:
        return
    recorded = (load_checkpoint(path, "eval.key_evaluator").get("trained_on") or {}).get("tokenizer")
    if recorded and recorded != here["tokenizer"]:
        raise ConfigError(
            f"eval.key_evaluator={path!r} was trained with another tokenizer than the one that wrote the evaluated "
            "text (its token ids mean other text to it): it must be a run on the same data and tokenizer"
        )
