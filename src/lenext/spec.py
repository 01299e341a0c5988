"""A run, resolved once: the typed, frozen description everything of a run is built from.

``lenext.run`` checks a composed config (``lenext.schema``), then resolves it into a ``RunSpec``: the
config with the PE's hyperparameters *resolved* (every default derived from the model or L_train
replaced by its value), the positions, the evaluation plan, the precision, how the run starts
(scratch, resume, or from a trained checkpoint: ``init_from``), its lineage and the row name a
report shows. Checkpoints and results store it whole; eval.py and the report read it back instead
of deriving anything again from config names.

A second training stage (context extension, docs/extension.md) is configuration: the
command names a base checkpoint (``init_from``), and the stage takes the base's resolved PE, so
T5's max_distance, FIRE's threshold, learned's table size and RoPE's original context keep the
meaning the base's weights were trained with; only the PE's ``STAGE_SETTINGS`` (RoPE's scaling and
its constants) may change.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from lenext.evaluate import EvalSettings, SweepPlan
from lenext.positions import SCHEMES, PositionScheme, TrainPositions, position_scheme

Start = Literal["scratch", "resume", "init_from"]
# What a second stage's method is called in row names: RoPE's scaling, or direct fine-tuning.
METHOD_NAMES = {"none": "direct", "linear": "pi"}
STAGE_MARK = " -> "  # in a later stage's row: <base row> -> <method>@<length>


@dataclass(frozen=True)
class Stage:
    """A training stage a run descends from, as its lineage records it."""

    checkpoint: str  # absolute path of the checkpoint the next stage started from
    row: str
    train_len: int
    reach: int  # the span of positions it trained (0..reach-1)
    steps: int
    tokens: int | None  # None: a checkpoint from before lenext kept the count
    config: dict  # its run config, resolved


@dataclass(frozen=True)
class Row:
    """A run's row in a report, as structure (results keep it as ``meta.row_fields``); ``label`` names it.

    E.g. ``rope`` (a first stage), ``rope_randomized`` (trained at drawn positions), ``nope+ssmax`` (an attention
    setting), ``rope -> yarn@256`` (a second stage: its base's row, its method, the span of positions it trained).
    """

    pe: str  # the PE's config name (rope and rope_ntk share a class)
    positions: str = "sequential"  # the training positions' scheme (lenext.positions)
    attention: tuple[str, ...] = ()  # attention settings other than the defaults: ssmax, window16, stick_breaking
    base: str | None = None  # a later stage: its base's row label
    method: str | None = None  # a later stage: direct, pi, yarn, pose+pi, ...
    stage_len: int | None = None  # a later stage: the span of positions it trained

    @property
    def label(self) -> str:
        if self.base is not None:
            return f"{self.base}{STAGE_MARK}{self.method}@{self.stage_len}"
        row = self.pe if self.positions == "sequential" else f"{self.pe}_{self.positions}"
        return row + "".join(f"+{setting}" for setting in self.attention)


@dataclass(frozen=True)
class RunSpec:
    """Everything a run is, resolved (module docstring). ``config`` is the composed config with the PE node
    resolved; the fields are what lenext computes from it, once."""

    config: dict
    pe_name: str  # the PE's config name (rope and rope_ntk share a class)
    row: str  # the report's row label (``Row.label``)
    seed: int
    train_len: int  # this stage's training length (data.max_len)
    base_len: int  # L_train of the lineage's first stage: eval.factors multiply it, reports group by it
    positions: TrainPositions  # resolved: max_position / target_len filled in
    eval: EvalSettings
    plan: SweepPlan | None  # None: no sweep (eval.enabled false)
    precision: str | None  # training's (canonical name); eval.py's for an evaluation
    start: Start = "scratch"
    checkpoint: str | None = None  # resume: the checkpoint resumed; init_from: the base's
    lineage: tuple[Stage, ...] = field(default_factory=tuple)  # earliest first; () for a first stage
    row_fields: Row | None = None  # the row as structure (None in runs stored before it was kept)

    @property
    def scheme(self) -> PositionScheme:
        return position_scheme(dataclasses.asdict(self.positions), self.train_len)

    @property
    def reach(self) -> int:
        """The span of positions training reaches: L_train, or N (randomized) or the target length (PoSE)."""
        return self.scheme.span(self.train_len)

    def stored(self) -> dict:
        """As kept in checkpoints (``hyper_parameters.run``) and results (``meta.run``): plain JSON."""
        stored = {**dataclasses.asdict(self), "lineage": [dataclasses.asdict(stage) for stage in self.lineage]}
        if self.row_fields:
            stored["row_fields"]["attention"] = list(self.row_fields.attention)
        return stored

    @classmethod
    def from_stored(cls, stored: dict) -> "RunSpec":
        values = dict(stored)
        values["positions"] = TrainPositions(**values["positions"])
        values["eval"] = EvalSettings.from_stored(values["eval"])
        values["plan"] = SweepPlan(**values["plan"]) if values.get("plan") else None
        values["lineage"] = tuple(Stage(**stage) for stage in values.get("lineage") or ())
        if values.get("row_fields"):
            fields = values["row_fields"]
            values["row_fields"] = Row(**{**fields, "attention": tuple(fields["attention"])})
        return cls(**values)

    def as_stage(self, checkpoint: str, steps: int, tokens: int | None) -> Stage:
        """This run as the stage a later one descends from, at its ``checkpoint``."""
        return Stage(checkpoint, self.row, self.train_len, self.reach, steps, tokens, self.config)


def first_stage_row(pe_name: str, scheme: str, attention: dict | None = None) -> Row:
    """The row of a run trained from scratch: its PE's config name (less a scheme's suffix: ``rope_randomized`` is
    ``rope`` at randomized positions, however its config is named), its positions, then its attention settings
    other than the defaults: ``ssmax`` or ``logn`` (attention.scale), ``window<W>`` (attention.window),
    ``stick_breaking`` (attention.normalizer)."""
    for known in SCHEMES:
        pe_name = pe_name.removesuffix(f"_{known}")
    attention = attention or {}
    settings = []
    if attention.get("scale", "none") != "none":
        settings.append(attention["scale"])
    if attention.get("window") is not None:
        settings.append(f"window{attention['window']}")
    if attention.get("normalizer", "softmax") != "softmax":
        settings.append(attention["normalizer"])
    if attention.get("qk_norm"):
        settings.append("qk_norm")
    return Row(pe_name, scheme, tuple(settings))


def later_stage_row(base_row: str, pe_name: str, pe: dict, scheme: str, reach: int) -> Row:
    """The row of a second stage: its base's row, the method (RoPE's scaling, ``pi`` for linear, or ``direct``
    fine-tuning; ``pose+`` in front when trained at PoSE's positions) and the span of positions it trained (L', or
    PoSE's target): labelled ``rope -> yarn@256``, ``rope -> pose+pi@256``."""
    members = (pe.get("pes") or {}).values()  # a PE made of PEs: its RoPE member's scaling
    scaling = pe.get("scaling") or next((m["scaling"] for m in members if "scaling" in m), "none")
    method = METHOD_NAMES.get(scaling, scaling)
    if scheme == "pose":
        method = "pose" if method == "direct" else f"pose+{method}"
    elif scheme != "sequential":
        method = f"{scheme}+{method}"
    return Row(pe_name, scheme, base=base_row, method=method, stage_len=reach)
