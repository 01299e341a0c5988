"""Evaluation protocols (docs/evaluation.md): a registry of objects, each owning its parameters and its windows.

A perplexity protocol turns held-out documents and an evaluation length L into windows of L + 1 tokens (inputs +
shifted targets) and says which targets of each window are scored. Windows never cross a document and are
never padded: a length no document can fill gives no window, and ``missing`` says why. Key-token perplexity
scores the targets a longer context helps (two passes); the haystack protocols write needles into the held-out
text and score retrieval (lenext.haystack).

A new protocol is one class here and its entry in ``PROTOCOLS`` (docs/adding/protocol.md).
"""

import math
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import numpy as np
import torch

from lenext.errors import ConfigError
from lenext.haystack import measure_haystack
from lenext.positions import PositionScheme
from lenext.scoring import Measured, distributed, evaluate_length, sum_metric, window_nll

ACCURACY = "accuracy"  # the probes' protocol (lenext.synthetic): answers only, exact-match and per-token accuracy


@dataclass(frozen=True)
class Window:
    document: int
    start: int  # first input token; the window holds tokens [start, start + L]
    score_from: int  # targets 0..L-1 of the window; those >= score_from are scored


@dataclass(frozen=True)
class TextProtocol:
    """How a length's windows are cut from documents of the given token counts, and which targets count."""

    name: ClassVar[str]
    per_position: ClassVar[bool] = False  # whether its rows have a per-position loss curve (eval.per_position)
    metrics: ClassVar[tuple[str, ...]] = ("ppl",)  # the row metrics the report tables, the first its headline
    # eval keys only this protocol (and its subclasses) reads, each with its value that asks nothing (null, or the
    # default the config shows): set otherwise in a sweep without the protocol, refused (it would change nothing)
    own_settings: ClassVar[dict[str, object]] = {}

    @classmethod
    def from_plan(cls, plan) -> "TextProtocol":
        """The protocol with its parameters from a ``SweepPlan``."""
        return cls()

    def parameters(self) -> dict:
        """What a results row records of the protocol besides its name."""
        return {}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        raise NotImplementedError

    def needs(self, length: int) -> int:
        """The targets a document must have to give a window at ``length``."""
        return length

    def capped(self, windows: list, max_windows: int | None) -> list:
        """At most ``max_windows`` of ``windows`` (eval.max_windows): ``cap_windows``'s even spread by default."""
        return cap_windows(windows, max_windows)

    def measure(
        self,
        net,
        evaluation,  # lenext.evaluate.TextEvaluation: the documents, their bytes, the tokenizer
        windows: list[Window],
        length: int,
        settings,
        precision: str,
        scheme: PositionScheme,
        seed: int,
    ) -> Measured:
        """Perplexity over the scored targets of ``windows`` (``settings``: the run's ``EvalSettings``) and their
        bits per byte where the documents' bytes are known, with the per-position curve where the protocol has one
        and eval.per_position asks for it."""
        per_position = settings.per_position and self.per_position
        result = evaluate_length(
            net, evaluation.documents, windows, length, settings.tokens_per_batch, per_position, precision, scheme, seed
        )
        metrics = {"ppl": math.exp(result["mean_nll"]), "mean_nll": result["mean_nll"], "tokens": result["tokens"]}
        if evaluation.byte_ends is not None:
            scored_bytes = sum(  # a window's scored targets are its tokens score_from + 1 .. L: contiguous
                int(
                    evaluation.byte_ends[w.document][w.start + length]
                    - evaluation.byte_ends[w.document][w.start + w.score_from]
                )
                for w in windows
            )
            metrics |= bits_per_byte(result["mean_nll"] * result["tokens"], scored_bytes)
        return Measured(metrics, result["curve"], result["curve_counts"])


def bits_per_byte(total_nll: float, scored_bytes: int) -> dict:
    """The row's ``bytes`` and ``bits_per_byte``: the scored targets' NLL in bits per UTF-8 byte of their text."""
    return {"bytes": scored_bytes, "bits_per_byte": total_nll / math.log(2) / scored_bytes if scored_bytes else None}


def settings_of(plan, prefix: str, defaults: dict | None = None) -> dict:
    """The settings the plan gives a protocol: its ``eval.<prefix>*`` keys that are not null, without the prefix."""
    given = {key[len(prefix) :]: value for key, value in plan.protocol_settings.items() if key.startswith(prefix)}
    return (defaults or {}) | given


@dataclass(frozen=True)
class NonOverlapping(TextProtocol):
    """Disjoint windows; every target scored (the ALiBi paper's default)."""

    name = "nonoverlap"
    per_position = True

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        return [
            Window(d, w * length, 0)
            for d, n in enumerate(document_lengths)
            for w in range((n - 1) // length)  # targets: positions 1..n-1 can be predicted
        ]


@dataclass(frozen=True)
class Sliding(TextProtocol):
    """Windows advanced by ``stride``; only targets no earlier window scored count (the last ``stride`` of each,
    after the first window): each token once, each with at least L - stride tokens of context."""

    name = "sliding"
    own_settings = {"stride": None}
    stride: int = 1

    @classmethod
    def from_plan(cls, plan) -> "Sliding":
        return cls(plan.stride)

    def parameters(self) -> dict:
        return {"stride": self.stride}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        windows = []
        for d, n in enumerate(document_lengths):
            targets = n - 1
            if targets < length:
                continue
            windows.append(Window(d, 0, 0))
            scored = length  # targets 1..scored are done
            while scored < targets:
                end = min(scored + self.stride, targets)
                windows.append(Window(d, end - length, length - (end - scored)))
                scored = end
        return windows


@dataclass(frozen=True)
class LastK(TextProtocol):
    """Each document cut into blocks of the longest evaluation length; the last ``k`` targets of each block scored,
    with the L tokens before them as context. The scored (document, position) set is the same at every L, so
    lengths compare like for like."""

    name = "last_k"
    own_settings = {"last_k": None}
    k: int = 1
    block: int = 1  # the sweep's longest length

    @classmethod
    def from_plan(cls, plan) -> "LastK":
        return cls(plan.k, max(plan.lengths))

    def parameters(self) -> dict:
        return {"k": self.k}

    def windows(self, document_lengths: list[int], length: int) -> list[Window]:
        return [
            Window(d, (b + 1) * self.block - length, length - self.k)
            for d, n in enumerate(document_lengths)
            for b in range((n - 1) // self.block)
        ]

    def needs(self, length: int) -> int:
        return self.block


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


@dataclass(frozen=True)
class Haystack(TextProtocol):
    """Retrieval of needles written into the held-out text (lenext.haystack): ``samples`` haystacks at each of
    ``depths``, each answer scored by exact match and by its rank among ``candidates`` distractors."""

    task: ClassVar[str]
    metrics = ("rank_accuracy", "exact_match")
    own_settings = {"haystack_depths": [0.0, 0.25, 0.5, 0.75, 1.0], "haystack_samples": 8, "haystack_candidates": 4}
    depths: tuple[float, ...] = tuple(own_settings["haystack_depths"])
    samples: int = own_settings["haystack_samples"]
    candidates: int = own_settings["haystack_candidates"]

    @classmethod
    def from_plan(cls, plan) -> "Haystack":
        given = settings_of(plan, "haystack_")
        return cls(**given | ({"depths": tuple(given["depths"])} if "depths" in given else {}))

    def parameters(self) -> dict:
        return {"candidates": self.candidates, "samples": self.samples, "depths": list(self.depths)}

    def windows(self, document_lengths: list[int], length: int) -> list[tuple[int, int]]:
        """(sample index, depth index) of every sample."""
        return [(i, d) for i in range(self.samples) for d in range(len(self.depths))]

    def capped(self, windows: list, max_windows: int | None) -> list:
        """The first samples of every depth, as many of each as ``max_windows`` leaves (at least one)."""
        if not max_windows or len(windows) <= max_windows:
            return windows
        per_depth = max(1, max_windows // len(self.depths))
        return [(i, d) for i, d in windows if i < per_depth]

    def measure(self, net, evaluation, windows, length, settings, precision, scheme, seed) -> Measured:
        return measure_haystack(
            net,
            evaluation.haystack(),
            self.task,
            windows,
            self.depths,
            length,
            self.candidates,
            settings.tokens_per_batch,
            precision,
            scheme,
            seed,
        )


class NeedleSingle(Haystack):
    name, task = "niah_single", "single"


class NeedleMultiKey(Haystack):
    name, task = "niah_multikey", "multikey"


class NeedleMultiValue(Haystack):
    name, task = "niah_multivalue", "multivalue"


class NeedleMultiQuery(Haystack):
    name, task = "niah_multiquery", "multiquery"


class VariableTracking(Haystack):
    name, task = "variable_tracking", "variable_tracking"


@dataclass(frozen=True)
class Answers:
    """The probes' protocol: their answers alone, windows being samples (lenext.synthetic measures them)."""

    name: ClassVar[str] = ACCURACY
    metrics: ClassVar[tuple[str, ...]] = ("exact_match", "token_accuracy")

    def parameters(self) -> dict:
        return {}

    def capped(self, windows: list, max_windows: int | None) -> list:
        return cap_windows(windows, max_windows)


# What a results row measures or names besides its protocol's parameters. A parameter of one of these names would
# overwrite the measurement (or, since the report drops any protocol's parameter from the other protocols' rows,
# remove it from every row): ``registry`` refuses it.
ROW_FIELDS = frozenset(
    {
        *("protocol", "variant", "length", "length_factor", "variant_factor", "temperature_c"),
        *("temperature_fitted_on", "status", "reason", "windows", "tokens", "seconds", "peak_mem_mb", "depth"),
        *("ppl", "mean_nll", "bytes", "bits_per_byte", "all_ppl", "key_share", "answers", "chance"),
        *("exact_match", "token_accuracy", "rank_accuracy"),
    }
)


def registry(*protocols: type[TextProtocol]) -> dict[str, type[TextProtocol]]:
    """The protocols by name; a TypeError for one whose parameters take a name a row uses (``ROW_FIELDS``)."""
    for protocol in protocols:
        if clash := sorted(set(protocol().parameters()) & ROW_FIELDS):
            raise TypeError(
                f"protocol {protocol.name}: its parameters {clash} are names a results row uses for what it measures "
                "(lenext.protocols.ROW_FIELDS); name them otherwise"
            )
    return {protocol.name: protocol for protocol in protocols}


PROTOCOLS: dict[str, type[TextProtocol]] = registry(
    NonOverlapping,
    Sliding,
    LastK,
    KeyTokens,
    NeedleSingle,
    NeedleMultiKey,
    NeedleMultiValue,
    NeedleMultiQuery,
    VariableTracking,
)
PROTOCOL_NAMES = (*PROTOCOLS, ACCURACY)
METRICS_OF = {name: protocol.metrics for name, protocol in (*PROTOCOLS.items(), (ACCURACY, Answers))}


def metric_range(metric: str) -> tuple[float, float]:
    """The values a row metric can take, as results files hold it: a perplexity, exp of a mean of NLLs >= 0, is at
    least 1; every other metric is a share, in [0, 1]."""
    return (1.0, math.inf) if metric == "ppl" else (0.0, 1.0)


def cap_windows(windows: list, max_windows: int | None) -> list:
    """At most ``max_windows`` of ``windows``, evenly spread: every k-th, k = ceil(n / max_windows), so at least
    about half of ``max_windows`` (the rule the committed studies were made with); all of them for null."""
    if max_windows and len(windows) > max_windows:
        return windows[:: math.ceil(len(windows) / max_windows)]
    return windows
