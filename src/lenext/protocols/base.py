"""What every protocol is: ``TextProtocol`` (its windows, which targets count, how a length is measured), the
``Window``, and the rules the registry holds protocols to (``ROW_FIELDS``, ``registry``)."""

import math
from dataclasses import dataclass
from typing import ClassVar

from lenext.positions import PositionScheme
from lenext.scoring import Measured, evaluate_length


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
                "(lenext.protocols.base.ROW_FIELDS); name them otherwise"
            )
    return {protocol.name: protocol for protocol in protocols}


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
