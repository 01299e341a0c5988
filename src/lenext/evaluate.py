"""The length sweep: every evaluation-time variant of the PE, protocol (lenext.protocols) and length of a run's
plan, measured on the data's held-out documents or a probe's samples -> the rows of a results file.

The data says which protocols it has (text: ``lenext.protocols.PROTOCOLS``; a probe: ``accuracy``, its answers
alone); ``sweep_plan`` checks the settings against it before any work.
"""

import dataclasses
import logging
import os
import resource
import threading
import time
import zipfile
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import ListConfig

from lenext.errors import CheckpointError, ConfigError, LengthNotSupported
from lenext.hardware import release_freed_memory
from lenext.haystack import HaystackText
from lenext.pe import VARIANTS
from lenext.positions import PositionScheme
from lenext.protocols import PROTOCOL_NAMES, PROTOCOLS, KeyTokens, Sliding, TextProtocol, Window
from lenext.ranges import NonNegativeFloat, PositiveFloat, PositiveInt, Range, Share
from lenext.scoring import Measured
from lenext.temperature import (
    TEMPERATURE,
    asks_temperature,
    describe_fit,
    fit_temperature,
    variant_columns,
    variant_scope,
)

log = logging.getLogger("lenext")
Protocol = Literal[PROTOCOL_NAMES]


class PeakMemory:
    """Peak extra memory (MB) of a block: CUDA's allocator peak, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak_mb = device, 0.0

    @staticmethod
    def _rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            release_freed_memory()  # else the evaluation reuses what training freed and kept, unseen by RSS
            self._base, self._stop = self._rss_mb(), threading.Event()
            self._peak = self._base

            def sample():
                while not self._stop.wait(0.005):
                    self._peak = max(self._peak, self._rss_mb())

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20 - self._base
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self._peak, self._rss_mb()) - self._base


class TextEvaluation:
    """The sweep's view of held-out documents: the text protocols (lenext.protocols) measured on them."""

    def __init__(self, documents: list[np.ndarray], byte_ends: list[np.ndarray] | None = None, tokenizer=None):
        """``byte_ends``: per document, the text's bytes up to each token's end (lenext.data), for bits per byte;
        ``tokenizer`` (a tokenizers.Tokenizer): the one that wrote the documents, for the haystack protocols."""
        self.documents, self.byte_ends, self.lengths = documents, byte_ends, [len(d) for d in documents]
        self.tokenizer, self._haystack = tokenizer, None

    def haystack(self) -> HaystackText:
        """The documents as haystack text, with the tokenizer that writes needles (made once)."""
        if self.tokenizer is None:
            raise ConfigError("eval.protocol: the haystack protocols need the data's tokenizer; this data has none")
        if self._haystack is None:
            self._haystack = HaystackText(self.documents, self.tokenizer)
        return self._haystack

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(PROTOCOLS)

    def protocol(self, name: str, plan: "SweepPlan") -> TextProtocol:
        return PROTOCOLS[name].from_plan(plan)

    def windows(self, protocol: TextProtocol, length: int) -> list[Window]:
        return protocol.windows(self.lengths, length)

    def missing(self, protocol: TextProtocol, length: int) -> str:
        return f"needs documents of {protocol.needs(length)} targets; the longest has {max(self.lengths) - 1}"

    def measure(self, net, protocol: TextProtocol, windows, length, settings, precision, scheme, seed) -> Measured:
        return protocol.measure(net, self, windows, length, settings, precision, scheme, seed)


@dataclass(frozen=True)
class EvalSettings:
    """The keys of configs/eval/default.yaml, with their types and ranges (checked by lenext.schema)."""

    enabled: bool
    protocol: Protocol | list[Protocol] | None  # None: the data's first protocol
    lengths: list[PositiveInt] | None
    factors: list[PositiveFloat] | None
    stride: PositiveInt | None
    last_k: PositiveInt | None
    variants: list[Literal[(*VARIANTS, TEMPERATURE)]] | None  # evaluation-time variants (RoPE's scalings, temperature)
    max_windows: PositiveInt | None
    tokens_per_batch: PositiveInt
    per_position: bool
    positions: Literal["as_trained", "sequential"] = "as_trained"
    # The protocols' own settings (null: the protocol's default, lenext.protocols).
    key_context: PositiveInt | None = None  # key_tokens: the short context (null = L_train)
    key_gain: NonNegativeFloat | None = None  # key_tokens: the least log-probability gain of a key token (nats)
    key_max_nll: PositiveFloat | None = None  # key_tokens: the most NLL of a key token with the long context
    key_evaluator: str | None = None  # key_tokens: the lenext checkpoint (or run folder) that picks key tokens
    haystack_depths: list[Share] | None = None  # haystack protocols: the needle's depths
    haystack_samples: PositiveInt | None = None  # haystacks per depth and length
    # Distractor answers each answer is ranked against, each a copy of the sample scored in one pass with it: more
    # than 99 (chance below 1%) cost a pass each and tell what exact match, reported beside, tells already.
    haystack_candidates: Annotated[int, Range(1, 99)] | None = None

    RENAMED = {"rope_scalings": "variants"}  # keys of earlier versions: refused naming the new key; stored: read

    @classmethod
    def from_stored(cls, stored: dict) -> "EvalSettings":
        """The settings a checkpoint or results file keeps, its keys of earlier versions under their new names."""
        return cls(**{cls.RENAMED.get(key, key): value for key, value in stored.items()})


# eval keys that protocols take (``from_plan``), each named by its protocol's prefix: null keeps its default.
PROTOCOL_SETTINGS = (
    "key_context",
    "key_gain",
    "key_max_nll",
    "key_evaluator",
    "haystack_depths",
    "haystack_samples",
    "haystack_candidates",
)


@dataclass(frozen=True)
class SweepPlan:
    protocols: list[str]
    lengths: list[int]  # ascending
    stride: int  # sliding: targets scored per window
    k: int  # last_k: targets scored per block
    base_len: int  # L_train of the run's first stage: rows' length_factor = length / base_len
    protocol_settings: dict = dataclasses.field(default_factory=dict)  # PROTOCOL_SETTINGS given (not null)


def evaluation_positions(eval_cfg, scheme: PositionScheme) -> PositionScheme:
    """The positions the sweep evaluates with: the run's scheme's own (as_trained), or 0..L-1."""
    return scheme if getattr(eval_cfg, "positions", "as_trained") == "as_trained" else PositionScheme()


def sweep_plan(eval_cfg, base_len: int, scheme: PositionScheme | None, protocols: tuple[str, ...]) -> SweepPlan:
    """What ``sweep`` will evaluate, given the ``protocols`` the data has (null eval.protocol: its first), with
    eval.factors multiplying ``base_len`` (the L_train of the run's first stage, so a second stage is evaluated
    at the lengths its base was); raises ConfigError for settings that only fail together."""
    asked = protocols[0] if eval_cfg.protocol is None else eval_cfg.protocol
    plan_protocols = [asked] if isinstance(asked, str) else list(asked)
    if not plan_protocols:
        raise ConfigError(f"eval.protocol=[] is invalid: give at least one of {', '.join(protocols)}")
    for protocol in plan_protocols:
        if protocol not in protocols:
            raise ConfigError(
                f"eval.protocol={protocol} does not apply to this data: it must be among {', '.join(protocols)}"
            )
    if getattr(eval_cfg, "variants", None) == []:  # null asks for the PE as trained; [] would too, unsaid
        raise ConfigError("eval.variants=[] is invalid: give at least one variant (e.g. [none,yarn]), or null")
    refuse_entries_given_twice(eval_cfg)
    lengths = plan_lengths(eval_cfg, base_len)
    k = eval_cfg.last_k or min(lengths)
    if k > min(lengths):
        raise ConfigError(f"eval.last_k={k} is invalid: it must be at most the shortest length, {min(lengths)}")
    stride = eval_cfg.stride or max(1, base_len // 2)
    if Sliding.name in plan_protocols and stride > min(lengths):  # targets between windows would go unscored
        setting = f"eval.stride={stride}" if eval_cfg.stride else f"eval.stride=null (L_train / 2 = {stride})"
        raise ConfigError(
            f"{setting} is invalid with eval.protocol=sliding: it must be at most the shortest length, {min(lengths)}"
        )
    refuse_settings_of_other_protocols(eval_cfg, plan_protocols, asked)
    evaluation_positions(eval_cfg, scheme or PositionScheme()).check_evaluation_length(max(lengths))
    if getattr(eval_cfg, "haystack_depths", None) == []:
        raise ConfigError("eval.haystack_depths=[] is invalid: give at least one depth in [0, 1], e.g. [0.5]")
    refuse_a_key_evaluator_that_is_no_checkpoint(getattr(eval_cfg, "key_evaluator", None))
    plan = SweepPlan(
        plan_protocols,
        lengths,
        stride,
        k,
        base_len,
        {key: value for key in PROTOCOL_SETTINGS if (value := getattr(eval_cfg, key, None)) is not None},
    )
    context = KeyTokens.from_plan(plan).context if KeyTokens.name in plan_protocols else None
    if context is not None and context >= max(lengths):  # every row would have no key token
        given = getattr(eval_cfg, "key_context", None)
        setting = f"eval.key_context={context}" if given else f"eval.key_context=null (L_train = {context})"
        raise ConfigError(
            f"{setting} is invalid with eval.protocol=key_tokens: it must be below the longest length, {max(lengths)} "
            "(within the short context no target is key); give a shorter eval.key_context or a longer length"
        )
    return plan


def refuse_entries_given_twice(eval_cfg) -> None:
    """Each entry is rows of its own: twice, twice the rows (or, for a length, one row that was asked for twice).
    eval.factors only where they make the lengths: beside eval.lengths they are not read."""
    for key in ("protocol", "variants", "haystack_depths", "lengths", *([] if eval_cfg.lengths else ["factors"])):
        listed = getattr(eval_cfg, key, None)
        if not isinstance(listed, str) and listed is not None and len(set(listed)) < len(listed):
            twice = next(value for value in listed if list(listed).count(value) > 1)
            raise ConfigError(f"eval.{key}={list(listed)} is invalid: it lists {twice} twice; give each once")


def plan_lengths(eval_cfg, base_len: int) -> list[int]:
    """The evaluation lengths, ascending: eval.lengths, else eval.factors x ``base_len``, each a whole number."""
    if eval_cfg.lengths is not None and len(eval_cfg.lengths) == 0:
        raise ConfigError("eval.lengths=[] is invalid: give at least one length, or null (eval.factors x L_train)")
    given = "lengths" if eval_cfg.lengths else "factors"  # the key the lengths come from: named if they are bad
    lengths = sorted(set(eval_cfg.lengths or [int(f * base_len) for f in eval_cfg.factors or []]))
    if not lengths or min(lengths) < 1:
        shown = list(getattr(eval_cfg, given) or [])
        raise ConfigError(
            f"eval.{given}={shown} is invalid: give eval.lengths or eval.factors that make positive token counts "
            f"(of L_train {base_len})"
        )
    for factor in [] if eval_cfg.lengths else eval_cfg.factors or []:
        if not float(factor * base_len).is_integer():
            raise ConfigError(
                f"eval.factors={list(eval_cfg.factors)} is invalid: {factor:g} x L_train {base_len} = "
                f"{factor * base_len:g} is no whole number of tokens; give factors that make one, or eval.lengths"
            )
    return lengths


def refuse_a_key_evaluator_that_is_no_checkpoint(evaluator: str | None) -> None:
    if evaluator is None:
        return
    if not os.path.exists(evaluator):
        raise ConfigError(
            f"eval.key_evaluator={evaluator!r} does not exist: give a lenext checkpoint or run folder (or null: "
            "the model itself)"
        )
    from lenext.checkpoints import checkpoint_file  # here: it imports lenext.resolve, which imports this

    file = checkpoint_file(evaluator, "eval.key_evaluator", missing_ok=True)  # None: a run still training
    if file is not None and not zipfile.is_zipfile(file):
        raise CheckpointError(
            f"eval.key_evaluator={evaluator!r} is not a checkpoint (torch.save writes a zip archive): give a "
            "lenext checkpoint or run folder (or null: the model itself)"
        )


def refuse_settings_of_other_protocols(eval_cfg, plan_protocols: list[str], asked) -> None:
    """A protocol's own setting, set to ask something of it in a sweep that evaluates none of the protocols that
    read it, is refused: it would change nothing."""
    readers: dict[str, list[str]] = {}
    for name, protocol in PROTOCOLS.items():
        for key in protocol.own_settings:
            readers.setdefault(key, []).append(name)
    for key, names in readers.items():
        value = getattr(eval_cfg, key, None)
        value = list(value) if isinstance(value, (tuple, ListConfig)) else value  # compared as the config's list
        if value is None or value == PROTOCOLS[names[0]].own_settings[key] or set(names) & set(plan_protocols):
            continue
        shown = asked if isinstance(asked, str) else f"[{','.join(asked)}]"
        whose = f"the {names[0]} protocol" if len(names) == 1 else f"the {', '.join(names)} protocols"
        add = names[0] if len(names) == 1 else "one of them"
        raise ConfigError(
            f"eval.{key}={value} changes nothing here: it is a setting of {whose}, which eval.protocol={shown} "
            f"does not evaluate; add {add} to eval.protocol, or drop eval.{key} (a preset's: eval.{key}=null)"
        )


def sweep(
    net,
    evaluation,
    plan: SweepPlan,
    eval_cfg,
    precision: str = "32-true",
    scheme: PositionScheme | None = None,
    seed: int = 0,
    fit_evaluation=None,
) -> tuple[list, list]:
    """Evaluate every (evaluation-time variant of the PE, protocol, length) of ``plan`` on ``evaluation`` (the
    data's ``TextEvaluation`` or probe), at the positions of the run's ``scheme`` (seeded by its ``seed``) or
    0..L-1 (eval.positions). Returns (rows, per-position curve rows). The ``temperature`` variant's c is fitted on
    ``fit_evaluation``, the validation split's (``evaluation`` when None: the sweep's own is the validation split)."""
    evaluated_at = evaluation_positions(eval_cfg, scheme or PositionScheme())
    device = next(net.parameters()).device
    rows, curves = [], []
    net.eval()
    span = evaluated_at.evaluation_span(max(plan.lengths))
    variants = net.pe.variants(eval_cfg.variants, span)
    trained = net.pe.variants(None, span)[0]  # the PE as trained (a RoPE stage's own scaling), wherever asked
    fit = None
    if asks_temperature(eval_cfg.variants, net, plan.lengths):  # any PE: lenext.temperature
        variants = [*variants, TEMPERATURE]
        fit = fit_temperature(net, fit_evaluation or evaluation, plan, eval_cfg, precision, evaluated_at, seed)
        log.info("%s", describe_fit(fit))
    reuse = fit is not None and fit.c == 0  # beta = 1 at every length: the model as trained, measured once
    as_trained = {}  # (protocol, length): the model as trained's measurement and peak memory
    for variant in variants:
        with variant_scope(net, variant, fit):
            for name in plan.protocols:
                protocol = evaluation.protocol(name, plan)
                for length in plan.lengths:
                    windows = evaluation.windows(protocol, length)
                    row = {
                        "protocol": name,
                        "variant": variant,
                        "length": length,
                        "length_factor": length / plan.base_len,
                        **variant_columns(net, variant, length, fit),
                        **protocol.parameters(),
                    }
                    windows = protocol.capped(windows, eval_cfg.max_windows)
                    row["windows"] = len(windows)
                    unmeasured = {"ppl": None, "mean_nll": None, "tokens": 0, "windows": 0}  # none was scored
                    if variant == TEMPERATURE and fit.c is None:
                        rows.append({**row, "status": "not applicable", **unmeasured, "reason": fit.reason})
                        continue
                    if not windows:
                        reason = evaluation.missing(protocol, length)
                        rows.append({**row, "status": "no windows", **unmeasured, "reason": reason})
                        continue
                    repeated = reuse and variant == TEMPERATURE and (name, length) in as_trained
                    if repeated:  # its rows whole, the time and memory it took included
                        measured, cost = as_trained[name, length]
                    else:
                        started = time.perf_counter()
                        try:
                            with PeakMemory(device) as memory:
                                measured = evaluation.measure(
                                    net, protocol, windows, length, eval_cfg, precision, evaluated_at, seed
                                )
                        except LengthNotSupported as e:
                            rows.append({**row, "status": "not applicable", **unmeasured, "reason": str(e)})
                            continue
                        cost = {
                            "seconds": round(time.perf_counter() - started, 3),
                            "peak_mem_mb": round(memory.peak_mb, 1),
                        }
                    if reuse and variant == trained:
                        as_trained[name, length] = measured, cost
                    measured_row = {**row, "status": "ok", **measured.metrics, **cost, "reason": None}
                    rows += [measured_row] + [
                        {**row, "status": "ok", **part, "reason": None} for part in measured.breakdown
                    ]
                    (log.info if rank_zero_only.rank == 0 else log.debug)(  # progress only, once: the table has it
                        "evaluated %s%s at L=%d (%d windows, %s)",
                        name,
                        f" under {variant or 'the model as trained'}" if len(variants) > 1 else "",
                        length,
                        measured_row["windows"],
                        "c = 0: the model as trained's" if repeated else f"{measured_row['seconds']:.1f} s",
                    )
                    if measured.curve is not None:
                        curves += [
                            (variant, length, p, v, int(c))
                            for p, (v, c) in enumerate(zip(measured.curve, measured.curve_counts, strict=True))
                        ]
    return rows, curves
