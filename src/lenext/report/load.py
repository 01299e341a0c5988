"""Results files -> runs -> one tidy frame.

Every results file below the given folders is read and normalized once, here, to the current layout (files
written before a key was renamed or added read the same as new ones); everything after reads ``Run`` objects and
the frame, never a results file.

A run's *settings* are what it measures, less its seed (``settings``); runs are pooled over seeds only when their
settings are equal. Runs of other settings that share a row name get rows of their own (``label_runs``), and a
second results file of the same settings and seed is a repeat, counted once (``count_once``).
"""

import dataclasses
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from importlib import resources

import pandas as pd
from omegaconf import OmegaConf

from lenext.attention import AttentionSettings
from lenext.build import CONFIG_PACKAGE
from lenext.diagnostics import DIAGNOSTICS_FILE, STATISTICS
from lenext.evaluate import EvalSettings
from lenext.module import VAL_PPL, processes_trained
from lenext.pe import PE_CLASSES
from lenext.pe.rope import redundant_variants
from lenext.protocols import ACCURACY, METRICS_OF, PROTOCOLS
from lenext.resolve import flat_settings
from lenext.results import ERROR_FILE, POSITIONS_FILE, RESULTS_FILE, not_lenext_results
from lenext.spec import METHOD_NAMES, STAGE_MARK, Row, first_stage_row
from lenext.synthetic import TASK_CLASSES, Task
from lenext.temperature import TEMPERATURE

LEARNED_AT = 0.9  # a probe run below this exact match at its own training length did not learn its task there
# A run with an attention setting (SSMax, a window, stick-breaking) is drawn with the 2024-26 methods whatever its PE.
FRONTIER_FAMILY = "2024-26 methods"
OTHER_FAMILY = "other PEs"  # a PE class lenext.pe does not list (renamed or removed since the file was written)
# meta.pe.name: the PE's class name, or its display name where its describe() gives that (xPos).
PE_CLASS_BY_NAME = {name: pe for pe in PE_CLASSES for name in (pe.__name__, pe.DISPLAY_NAME)}

EVALUATED_BY = "evaluated_by"  # the setting that tells an eval.py re-evaluation from the run's own evaluation
RE_EVALUATION = "eval.py"
UNRECORDED = "?"  # a setting's value in a row label where the results file does not record it
FOLLOWS_SEED = "${seed}"  # data.seed's value in a run's settings where it equals the seed (its default follows it)
DIAGNOSTICS_FOLDER = "diagnostics"  # <run>/diagnostics/diagnostics.json: diagnose.py's output for the run
DIAGNOSE_LOG = "diagnose.log"  # diagnose.py's log: a folder holding it (and no results) is no run

EVAL_DEFAULTS = OmegaConf.to_container(OmegaConf.load(resources.files(CONFIG_PACKAGE).joinpath("eval", "default.yaml")))
# Settings added after results files were first written, at the value that does what the code did before them
# (their default since): a file that predates one reads as having it, so its runs pool with later seeds of theirs.
# Evaluation settings of the protocols added since change nothing the older files measured.
SETTINGS_ADDED = {
    **{f"attention.{field.name}": field.default for field in dataclasses.fields(AttentionSettings)},
    **{f"eval.{key}": value for key, value in EVAL_DEFAULTS.items() if key.startswith(("key_", "haystack_"))},
    "model.norm": "layernorm",
    "drop_pe": False,
    "data.corpus.revision": None,  # a hub corpus's: unpinned before it could be pinned
}
# How a run's tokenizer was made: its id (meta.tokenizer, from its content) says which it is, whatever made it.
TOKENIZER_SETTINGS = ("data.tokenizer", "data.tokenizer_sample_mb")
# The settings that say which text a run was measured on: values on other text (another corpus, tokenizer or split)
# are not comparable.
TEXT_SETTINGS = ("data._target_", "data.corpus", "data.tokenizer", "split")
# Keys of results files written before variants had a generic name.
OLD_ROW_KEYS = {"scaling": "variant", "rope_factor": "variant_factor"}
OLD_POSITIONS_COLUMNS = {"scaling": "variant"}
# The parameters each protocol records in its rows (older files had every one in every row, null elsewhere).
PROTOCOL_PARAMETERS = {name: set(protocol().parameters()) for name, protocol in PROTOCOLS.items()}
ALL_PROTOCOL_PARAMETERS = set().union(*PROTOCOL_PARAMETERS.values())
# A stage's method in row names (pi, direct) -> what it does to the PE, as a variant is named (linear, none).
STAGE_METHOD_AS_VARIANT = {shown: method for method, shown in METHOD_NAMES.items()}


def metrics_of(protocol: str) -> tuple[str, ...]:
    """The metrics the report tables of a protocol's rows, its headline first: what the protocol declares
    (``lenext.protocols.METRICS_OF``); ``ppl`` for a protocol no longer known (renamed or removed since the file
    was written)."""
    return METRICS_OF.get(protocol, ("ppl",))


def find_runs(folders: list[str]) -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    """(run dir, results) for complete runs, and (run dir, why) for runs that are not."""
    complete, incomplete = [], []
    for folder in folders:
        if not os.path.isdir(folder):
            raise SystemExit(f"error: {folder!r} is not a folder: give a multirun folder or run folders")
        visited = set()  # folders by their real path: a link to a run is read, a link to a folder above it once
        for root, dirs, files in os.walk(folder, followlinks=True):
            if os.path.realpath(root) in visited:  # a link to a folder read already (a run, not a copy of it)
                dirs[:] = []
                continue
            visited.add(os.path.realpath(root))
            # Job folders in job order (2 before 10): rows and lines follow the order the sweep listed its PEs.
            dirs[:] = sorted(
                (
                    d
                    for d in dirs
                    if not d.startswith(".")
                    and d not in ("checkpoints", "csv", "report")
                    and os.path.realpath(os.path.join(root, d)) not in visited
                ),
                key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d),
            )
            is_run = ".hydra" in os.listdir(root)
            if SWEEP_FILE in files:
                incomplete += unstarted_jobs(root)
            if diagnose_output(files):  # diagnose.py's folder (<run>/diagnostics): read with its run, no run itself
                continue
            if ERROR_FILE in files and (
                RESULTS_FILE not in files
                or os.path.getmtime(os.path.join(root, ERROR_FILE)) > os.path.getmtime(os.path.join(root, RESULTS_FILE))
            ):  # the latest attempt failed, whatever an earlier one left
                with open(os.path.join(root, ERROR_FILE), encoding="utf-8", errors="replace") as f:
                    incomplete.append((root, f"failed: {' '.join(f.read().split())}"))  # one line, as listed
            elif RESULTS_FILE in files:
                try:
                    with open(os.path.join(root, RESULTS_FILE), encoding="utf-8") as f:
                        results = json.load(f)
                except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON
                    incomplete.append((root, f"unreadable {RESULTS_FILE} ({type(e).__name__})"))
                    continue
                problem = not_lenext_results(results)
                if problem:
                    incomplete.append((root, f"{RESULTS_FILE} is not lenext's ({problem})"))
                elif results.get("complete") is True:
                    complete.append((root, results))
                else:
                    incomplete.append((root, f"{RESULTS_FILE} not marked complete"))
            elif is_run and not any(d.isdigit() for d in dirs):
                incomplete.append((root, f"no {RESULTS_FILE}: failed, interrupted or still running"))
    return complete, incomplete


SWEEP_FILE = "multirun.yaml"  # Hydra's, in a sweep's folder: the sweep as launched
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def unstarted_jobs(folder: str) -> list[tuple[str, str]]:
    """(folder, why) for each job of the sweep in ``folder`` that has no folder (an interrupted sweep stops before
    them), from its ``multirun.yaml``: a basic sweep's grid, its jobs in folders named by number; none for another
    sweeper or a file it cannot read."""
    from lenext.progress import sweep_grid

    try:
        hydra = OmegaConf.load(os.path.join(folder, SWEEP_FILE)).hydra
        sweeper, subdir = hydra.sweeper, OmegaConf.to_container(hydra.sweep, resolve=False).get("subdir")
        if sweeper.get("_target_") != BASIC_SWEEPER or subdir != "${hydra.job.num}":
            return []
        params = OmegaConf.to_container(sweeper.params) if sweeper.get("params") else None
        jobs, _ = sweep_grid(list(hydra.overrides.task), params)
    except Exception:  # noqa: BLE001 (a file Hydra did not write whole, or of another version: nothing to say)
        return []
    return [
        (os.path.join(folder, str(job)), f"not started: job {job} of the {jobs} its {SWEEP_FILE} lists")
        for job in range(jobs)
        if not os.path.isdir(os.path.join(folder, str(job)))
    ]


def diagnose_output(files: list[str]) -> bool:
    """Whether a folder holding ``files`` is diagnose.py's output (its diagnostics.json or its log, no results)."""
    return RESULTS_FILE not in files and ERROR_FILE not in files and bool({DIAGNOSTICS_FILE, DIAGNOSE_LOG} & set(files))


def diagnostics_of(run: "Run") -> dict | None:
    """The run's attention diagnostics (``<run>/diagnostics/diagnostics.json``, written by ``python diagnose.py
    ckpt=<run> hydra.run.dir=<run>/diagnostics``), None where it has none or ``read_diagnostics`` leaves it out."""
    return run.diagnostics[0]


def read_diagnostics(folder: str, row: str, train_len: int) -> tuple[dict | None, str | None]:
    """(the diagnostics of the run in ``folder``, None) or (None, why they are left out: unreadable, not
    diagnose.py's, or of a checkpoint of another ``row`` or ``train_len`` than the run's); (None, None) where it has
    none."""
    file = os.path.join(folder, DIAGNOSTICS_FOLDER, DIAGNOSTICS_FILE)
    if not os.path.isfile(file):
        return None, None
    try:
        with open(file, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        return None, f"unreadable {DIAGNOSTICS_FILE} ({type(e).__name__}): its diagnostics are left out"
    if not isinstance(result, dict) or not isinstance(result.get("meta"), dict) or not diagnosed_lengths(result):
        return None, f"{DIAGNOSTICS_FILE} is not diagnose.py's: left out"
    meta = result["meta"]
    if (meta.get("row"), meta.get("train_len")) != (row, train_len):
        return None, (
            f"{DIAGNOSTICS_FILE} diagnoses {meta.get('checkpoint')} (row {meta.get('row')}, L_train "
            f"{meta.get('train_len')}), not this run (row {row}, L_train {train_len}): left out"
        )
    return result, None


def diagnosed_lengths(result: dict) -> bool:
    """Whether a diagnostics file is as diagnose.py writes it where the report reads it: ``lengths`` entries with an
    integer length, each statistic a value per layer and head (a list of lists of numbers), the copying score's
    fields numbers or null; the rotation coverage's summary entries an integer length and a number."""
    lengths = result.get("lengths")
    if not isinstance(lengths, list) or not all(isinstance(e, dict) and type(e.get("length")) is int for e in lengths):
        return False
    coverage = result.get("rotation_coverage") or {}
    summary = coverage.get("summary") or [] if isinstance(coverage, dict) else None
    if not isinstance(summary, list) or not all(
        isinstance(e, dict) and type(e.get("length")) is int and isinstance(e.get("unseen_fraction"), int | float)
        for e in summary
    ):
        return False
    for entry in lengths:
        copying = entry.get("copying") or {}
        if not isinstance(copying, dict) or not all(isinstance(v, int | float | None) for v in copying.values()):
            return False
        rows = entry.get("rows") or {}
        if not isinstance(rows, dict) or not all(isinstance(s, dict | None) for s in rows.values()):
            return False
        for statistics in filter(None, rows.values()):  # None: no query row of that kind at this length
            for name in STATISTICS:
                layers = statistics.get(name) or []
                if not isinstance(layers, list) or not all(
                    isinstance(layer, list) and all(isinstance(v, int | float) for v in layer) for layer in layers
                ):
                    return False
    return True


def normalized_row(row: dict) -> dict:
    """A results row in the current layout: ``variant`` and ``variant_factor`` (were ``scaling``, ``rope_factor``),
    and a protocol's parameters only in its own rows."""
    row = {OLD_ROW_KEYS.get(key, key): value for key, value in row.items()}
    own = PROTOCOL_PARAMETERS.get(row["protocol"], set())
    return {key: value for key, value in row.items() if key in own or key not in ALL_PROTOCOL_PARAMETERS}


def normalized_meta(meta: dict) -> dict:
    """A results file's meta in the current layout: identity keys under their current names (``eval.variants``),
    and ``row``, ``row_fields``, ``pe_family``, ``pe_display_name`` for files written before them."""
    meta = dict(meta)
    if isinstance(meta.get("identity"), dict):
        meta["identity"] = {renamed_setting(key): value for key, value in meta["identity"].items()}
    fields = row_fields(meta)
    meta["row"] = fields.label
    meta["row_fields"] = dataclasses.asdict(fields)
    pe = PE_CLASS_BY_NAME.get(meta["pe"].get("name"))
    meta.setdefault("pe_family", declared_family(meta))
    meta.setdefault("pe_display_name", pe.DISPLAY_NAME if pe else meta["pe"].get("name") or meta["pe_name"])
    return meta


def declared_family(meta: dict) -> str:
    """The family a run's PE declares: ``meta.pe_family``, or for older files its class's ``FAMILY``."""
    pe = PE_CLASS_BY_NAME.get(meta["pe"].get("name"))
    return meta.get("pe_family") or (pe.FAMILY if pe else OTHER_FAMILY)


def renamed_setting(key: str) -> str:
    """An identity key under its current name (``eval.rope_scalings`` is ``eval.variants``)."""
    node, _, name = key.partition(".")
    return f"eval.{EvalSettings.RENAMED.get(name, name)}" if node == "eval" else key


def row_fields(meta: dict) -> Row:
    """The run's row as structure: ``meta.row_fields``; for files written before it, read back from its label
    (``meta.row``: the one place a label is parsed), or made from its PE and positions where it has none."""
    if meta.get("row_fields"):
        return Row(**{**meta["row_fields"], "attention": tuple(meta["row_fields"].get("attention", ()))})
    scheme = (meta.get("positions") or {}).get("train", "sequential")
    label = meta.get("row")
    if not label:
        return first_stage_row(meta.get("pe_name") or meta["pe"]["name"].lower(), scheme)
    if STAGE_MARK in label:  # <base row> -> <method>@<length>
        base, _, stage = label.rpartition(STAGE_MARK)
        method, _, stage_len = stage.rpartition("@")
        fields = Row(meta.get("pe_name") or base, scheme, base=base, method=method, stage_len=int(stage_len))
    else:  # <pe>[_<scheme>][+<attention setting>...]
        name, *attention = label.split("+")
        fields = Row(name.removesuffix(f"_{scheme}") if scheme != "sequential" else name, scheme, tuple(attention))
    return fields if fields.label == label else Row(label)  # a label of another form stays whole


def settings(meta: dict) -> dict:
    """What a run measures, as flat settings, less its seed: runs are pooled over seeds only when these are equal.

    ``meta.identity`` where the file keeps it (``data.seed`` ``FOLLOWS_SEED`` where it equals the seed); for older files
    what they record: the model, L_train and the training positions. A second stage's ``init_from``, a path of its
    own per seed, as its base's row, L_train and steps (``meta.lineage``). With the PE resolved (``pe.*``: its
    config, each default the code derives replaced by the value the PE was built with, from ``meta.pe``), the row,
    the split evaluated (and for older files the tokens trained), whether eval.py re-evaluated a checkpoint
    (``evaluated_by``; which one: ``eval.checkpoint``, its file name), and what the identity leaves to the
    trainer: the processes trained on (``trainer.devices``, where more than one), the precision trained in (and
    ``eval.precision``, where eval.py chose another) and the gradient clipping."""
    identity = meta.get("identity")
    if isinstance(identity, dict):
        described = {key: value for key, value in identity.items() if key != "seed" and not key.startswith("pe.")}
        if described.get("data.seed") == meta["seed"]:  # data.seed defaults to ${seed}
            described["data.seed"] = FOLLOWS_SEED
        described = {**SETTINGS_ADDED, **described}
        if meta.get("tokenizer"):
            described = {key: v for key, v in described.items() if key not in TOKENIZER_SETTINGS}
            described["data.tokenizer_id"] = meta["tokenizer"]
    else:
        described = flat_settings({"model": meta.get("model") or {}})
        described |= {"data.max_len": meta["train_len"], "tokens_trained": meta.get("tokens_trained")}
        if meta.get("positions"):
            described["train.positions"] = meta["positions"]["train"]
    if meta.get("lineage"):  # a second stage: its base as the row, L_train and steps it was trained to
        base = meta["lineage"][-1]
        described.pop("init_from", None)
        described |= {"init_from.row": base["row"], "init_from.steps": base["steps"]}
        described["init_from.train_len"] = base.get("train_len")
    described |= flat_settings({"pe": {**(meta.get("pe_config") or {}), **meta["pe"]}})
    described |= {"row": meta["row"], "split": meta.get("split")}
    described[EVALUATED_BY] = RE_EVALUATION if "checkpoint" in meta else "train.py"
    trainer = (((meta.get("run") or {}).get("config") or {}).get("trainer")) or {}
    trained_in = (meta.get("hardware") or {}).get("training_precision")
    described |= {"trainer.precision": trained_in, "trainer.gradient_clip_val": trainer.get("gradient_clip_val")}
    # Evaluation settings (``eval.*``, named only between runs alike in all else): eval.py's other precision, and
    # which of the run's checkpoints it read (best.ckpt of every seed pools, whatever its step).
    other = meta.get("precision") if trained_in is not None and meta.get("precision") != trained_in else None
    described["eval.precision"] = other
    if "checkpoint" in meta:
        described["eval.checkpoint"] = os.path.basename(meta["checkpoint"])
    elif (processes := devices(meta.get("tokens_trained"), identity)) not in (None, 1):
        described["trainer.devices"] = processes  # more than one: a larger global batch
    return described


def devices(tokens_trained: int | None, identity) -> int | None:
    """The processes a run trained on (``trainer.devices`` x ``trainer.num_nodes``, which the identity does not
    keep), from the tokens it trained: steps x batch x length x accumulation x processes. None where not recorded."""
    keys = ("trainer.max_steps", "data.batch_size", "data.max_len", "trainer.accumulate_grad_batches")
    steps, *batch = [identity.get(key) for key in keys] if isinstance(identity, dict) else [None] * len(keys)
    if tokens_trained is None or not all(isinstance(f, int) and f > 0 for f in (steps, *batch)):
        return None
    return round(processes_trained(tokens_trained, steps, *batch))


@dataclass(frozen=True)
class Run:
    """One complete results file, normalized: its meta, its rows (less variants another of its rows equals by
    construction), its row and the settings it is pooled by."""

    folder: str
    meta: dict
    rows: tuple[dict, ...]
    fields: Row
    settings: dict
    row: str  # its row's label in tables: ``fields.label``, with what tells it from runs of other settings
    merged_variants: tuple[str, ...]  # variants asked for that another asked one equals by construction

    @classmethod
    def read(cls, folder: str, results: dict) -> "Run":
        meta = normalized_meta(results["meta"])
        rows = [normalized_row(row) for row in results["rows"]]
        merged = merged_variants(meta, rows)
        shown = tuple(row for row in rows if row["variant"] not in merged)
        fields = row_fields(meta)
        return cls(folder, meta, shown, fields, settings(meta), fields.label, tuple(sorted(merged)))

    @cached_property
    def group(self) -> str:
        """The settings as one string: the key runs are pooled by."""
        return json.dumps(self.settings, sort_keys=True, default=str)

    @cached_property
    def text(self) -> str:
        """The text its rows measure, as one string: its corpus, tokenizer and split (``TEXT_SETTINGS``)."""
        measured = {key: value for key, value in self.settings.items() if key.startswith(TEXT_SETTINGS)}
        return json.dumps(measured, sort_keys=True, default=str)

    @property
    def seed(self) -> int:
        return self.meta["seed"]

    @property
    def task(self) -> str:
        """A probe's task; "" for text."""
        return self.meta.get("task") or ""

    @property
    def table_len(self) -> int:
        """The L_train its rows are tabled under: its first stage's (a second stage sits beside its base)."""
        return self.meta.get("base_len") or self.meta["train_len"]

    @property
    def trained_variant(self) -> str | None:
        """The variant its PE was trained as (RoPE's scaling); None for a PE without variants."""
        return self.meta["pe"].get("scaling")

    @property
    def family(self) -> str:
        return family(self.meta)

    @property
    def root(self) -> str:
        """The row of its lineage's first stage (its own for a first stage): figures draw a root's rows in one
        colour."""
        lineage = self.meta.get("lineage")
        return lineage[0]["row"] if lineage else self.fields.base or self.fields.label

    @property
    def evaluated_only(self) -> bool:
        """A model lenext did not train (``eval.py hf=``): its file records no training precision."""
        return not (self.meta.get("hardware") or {}).get("training_precision")

    @property
    def machine(self) -> str | None:
        """Where the file was made (``meta.hardware``: where train.py trained and evaluated, or where eval.py
        evaluated), with the training precision."""
        hardware = self.meta.get("hardware")
        if not hardware:
            return None
        device = hardware.get("gpu") or f"{hardware['cpu']} ({hardware['isa']}, {hardware['cores']} cores)"
        precision = hardware.get("training_precision")  # none for a model lenext did not train (eval.py hf=)
        return f"{device}, {precision}" if precision else device

    @cached_property
    def accuracy_as_trained(self) -> float | None:
        """A probe run's exact match at its own training length, as trained (no evaluation-time variant); None for
        text, or when that length was not evaluated. Only the probes' protocol: a probe trains its task, so a run
        that failed it there has nothing to extrapolate; the haystack protocols' exact match measures a language
        model zero-shot, and every value of it counts."""
        trained = (None, self.trained_variant)
        for row in self.rows:
            if (
                row["protocol"] == ACCURACY
                and row.get("depth") is None
                and row["length"] == self.meta["train_len"]
                and row["variant"] in trained
                and row["status"] == "ok"
            ):
                return row["exact_match"]
        return None

    @property
    def learned(self) -> bool:
        """Whether it learned its task at its training length (``LEARNED_AT``); text runs always count. A run that
        did not is kept out of every mean beyond L_train: what it does there measures nothing."""
        return self.accuracy_as_trained is None or self.accuracy_as_trained >= LEARNED_AT

    @cached_property
    def diagnostics(self) -> tuple[dict | None, str | None]:
        """Its attention diagnostics, or why they are left out (``read_diagnostics``): by its row's name, not its
        label, which may name settings."""
        return read_diagnostics(self.folder, self.meta["row"], self.meta["train_len"])

    @cached_property
    def positions(self) -> tuple[pd.DataFrame | None, str | None]:
        """Its per-position loss (``positions.csv``: variant, length, position, mean_nll, count; the variant "" as
        trained), or why it is left out (``read_positions``); (None, None) where it has none."""
        return read_positions(self.folder)

    @cached_property
    def probe(self) -> Task | None:
        """A probe's task with the settings it ran with; None for text, or a file that does not record them."""
        identity, keys = self.meta.get("identity") or {}, ("data.symbols", "data.pairs", "data.digits")
        if self.task not in TASK_CLASSES or not all(k in identity for k in keys):
            return None
        return TASK_CLASSES[self.task](*(identity[k] for k in keys))

    def metrics(self, protocol: str) -> tuple[str, ...]:
        """The metrics tabled of its ``protocol``'s rows (``metrics_of``), less a probe's per-token accuracy where
        each answer is one token: it is the exact match then."""
        one_token = protocol == ACCURACY and self.probe is not None and self.probe.answer_tokens == 1
        return tuple(m for m in metrics_of(protocol) if not (one_token and m == "token_accuracy"))

    def chance(self, metric: str, row: dict) -> float | None:
        """``metric``'s chance level on ``row``: a haystack row records its rank accuracy's; a probe's comes from its
        task and the settings it ran with (``Task.chance``)."""
        if metric == "rank_accuracy":
            return row.get("chance")
        return self.probe.chance(metric) if row["protocol"] == ACCURACY and self.probe else None

    def shown_variant(self, variant: str | None) -> str | None:
        """The variant a row names: None for the PE as trained."""
        return None if variant in (None, self.trained_variant) else variant

    def label(self, variant: str | None) -> str:
        """A row label: the run's row, the variant when evaluation changed it (``rope (ntk)``), and evaluation
        positions other than the scheme's own."""
        shown = self.shown_variant(variant)
        name = self.row if shown is None else f"{self.row} ({shown})"
        positions = self.meta.get("positions") or {}
        if positions.get("train") == "randomized" and positions.get("eval") == "sequential":
            name += " (eval at 0..L-1)"
        return name

    def extension_method(self, variant: str | None) -> str:
        """What a row does to extend its PE: the variant it is evaluated under, else its stage's method (PI is
        ``linear``, direct fine-tuning ``none``), else ``none``."""
        return extension_method(self.fields, self.shown_variant(variant))


def extension_method(fields: Row, shown_variant: str | None) -> str:
    """``Run.extension_method`` of a row with ``fields`` evaluated under ``shown_variant`` (None: as trained)."""
    if shown_variant is not None:
        return shown_variant
    if fields.method is not None:
        return STAGE_METHOD_AS_VARIANT.get(fields.method, fields.method)
    return "none"


def family(meta: dict) -> str:
    """The figure panel of a run: its PE's family (``meta.pe_family``; the PE class's ``FAMILY`` for older
    files), or the 2024-26 methods' with an attention setting."""
    identity = meta.get("identity") or {}
    defaults = dataclasses.asdict(AttentionSettings())
    attention = (meta.get("row_fields") or {}).get("attention")
    if attention or any(identity.get(f"attention.{key}", default) != default for key, default in defaults.items()):
        return FRONTIER_FAMILY
    return declared_family(meta)


def merged_variants(meta: dict, rows: list[dict]) -> set[str]:
    """The variants a run was asked for (``eval.variants``) or has rows of that another of them equals by
    construction (``SAME_AS``): results made before evaluation stopped measuring them have both."""
    asked = {row["variant"] for row in rows} | set(meta.get("identity", {}).get("eval.variants") or ())
    pe, reach = meta["pe"], (meta.get("positions") or {}).get("reach") or meta["train_len"]
    per_span = pe.get("factor") is None and pe.get("original_len", reach) == reach
    return redundant_variants(asked, pe.get("scaling"), per_span)


def with_fixed_data_seeds(runs: list[Run]) -> list[Run]:
    """The runs, each whose data.seed equals its seed (``FOLLOWS_SEED`` in its settings: the default follows the
    seed) given that data.seed as a setting where runs of otherwise equal settings fixed it at that value: a sweep
    over seed with data.seed=v holds one run where the two agree, which pools with the sweep's others. Where a sweep
    in which data.seed follows the seed is there too (a run of its settings that joins no fixed sweep), the run is a
    seed of both."""
    groups = {run.group for run in runs}

    def fixed(run: Run) -> Run | None:
        if run.settings.get("data.seed") != FOLLOWS_SEED:
            return None
        joined = dataclasses.replace(run, settings={**run.settings, "data.seed": run.seed})
        return joined if joined.group in groups else None

    joins = [(run, fixed(run)) for run in runs]
    following = {run.group for run, joined in joins if joined is None}
    counted = []
    for run, joined in joins:
        if joined is None or run.group in following:
            counted.append(run)
        if joined is not None:
            counted.append(joined)
    return counted


def count_once(runs: list[Run]) -> tuple[list[Run], list[tuple[str, str]]]:
    """The runs, each (settings, seed) once: the first found counts, and each later results file of the same
    settings and seed is a repeat, returned as (its folder, the counted run's folder)."""
    first: dict[tuple[str, int], str] = {}
    counted, repeats = [], []
    for run in runs:
        key = (run.group, run.seed)
        if key in first:
            if run.folder != first[key] and (run.folder, first[key]) not in repeats:  # one in two rows: listed once
                repeats.append((run.folder, first[key]))
        else:
            first[key] = run.folder
            counted.append(run)
    return counted, repeats


def label_runs(runs: list[Run]) -> list[Run]:
    """The runs with their rows' labels: a row's name (``Row.label``), and where runs of other settings share it
    (at one L_train and task), what tells them apart: `` (eval.py)`` on an eval.py re-evaluation, then
    ``[key=value, ...]`` for the settings that differ, evaluation settings (``eval.*``) only between runs alike in
    every other."""

    def name(run: Run) -> tuple:
        return run.table_len, run.task, run.fields.label

    namesakes: dict[tuple, dict[str, dict]] = defaultdict(dict)  # name -> {group: settings}
    for run in runs:
        namesakes[name(run)][run.group] = run.settings
    suffixes = {
        (shared, group): suffix
        for shared, groups in namesakes.items()
        for group, suffix in distinguishing_suffixes(groups).items()
    }
    return [dataclasses.replace(run, row=run.fields.label + suffixes[name(run), run.group]) for run in runs]


def distinguishing_suffixes(groups: dict[str, dict]) -> dict[str, str]:
    """Per group (settings key -> settings) of one row name, what its label adds to the name ("" for a lone one):
    the settings that differ among the groups, and the evaluation settings that differ among those alike in all
    others."""
    if len(groups) == 1:
        return dict.fromkeys(groups, "")

    def differing(members: list[str]) -> list[str]:
        keys = dict.fromkeys(key for group in members for key in groups[group])
        return [
            key
            for key in keys
            if key != EVALUATED_BY
            and len({json.dumps(groups[group].get(key, UNRECORDED), default=str) for group in members}) > 1
        ]

    def shown(group: str, keys: list[str]) -> str:
        described = groups[group]
        marker = f" ({RE_EVALUATION})" if described[EVALUATED_BY] == RE_EVALUATION else ""
        values = ", ".join(f"{key}={setting_text(described.get(key, UNRECORDED))}" for key in keys)
        return marker + (f" [{values}]" if values else "")

    training = [key for key in differing(list(groups)) if not key.startswith("eval.")]
    alike: dict[str, list[str]] = defaultdict(list)  # groups that differ in evaluation settings alone
    for group in groups:
        alike[shown(group, training)].append(group)
    return {
        group: shown(group, training + [key for key in differing(members) if key.startswith("eval.")])
        for members in alike.values()
        for group in members
    }


def setting_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), default=str)


NO_VALUE = "no value"  # measured, without a value (no key token at L_train): shown as "-", as a length without windows
COLUMNS = (
    *("run", "group", "row", "label", "pe", "positions", "attention", "base", "method", "stage_len", "root"),
    *("extension_method", "family", "display_name", "task", "train_len", "seed", "protocol", "variant", "metric"),
    *("length", "depth", "value", "answers", "chance", "status", "counted", "peak_mem_mb", "train_tokens_per_s"),
    *("accuracy_as_trained", "own_train_len", "machine", "temperature_c", "evaluator", "text"),
)
FLOAT_COLUMNS = (
    *("depth", "value", "answers", "chance", "peak_mem_mb", "train_tokens_per_s", "accuracy_as_trained"),
    "temperature_c",
)


def tidy(runs: list[Run]) -> pd.DataFrame:
    """One record per (run, row, metric), in the order found (the sweep's): a row's metrics are those its protocol
    declares (``Run.metrics``: ``ppl`` for perplexity, ``ppl`` and ``key_share`` for key tokens, ``rank_accuracy``
    and ``exact_match`` for the haystack protocols, ``exact_match`` and ``token_accuracy`` for a probe's rows, the
    latter only where an answer has several tokens),
    depth rows included (passkey's, the haystack protocols'), with their ``depth``; ``value`` null where the row
    has none (no key token at L_train), its status then ``NO_VALUE``; NaN where the run measured NaN (diverged).

    Columns: ``run`` (its folder), ``group`` (its settings: ``Run.group``), ``row`` (its row's label), ``label`` (the
    row label with the variant), the row's structure (``pe``, ``positions``, ``attention`` as ``+``-joined
    settings, ``base``, ``method``, ``stage_len``: ``lenext.spec.Row``), ``root``, ``extension_method``, ``family``,
    ``display_name``, ``task`` ("" for text), ``train_len`` (the first stage's), ``seed``, ``protocol``, ``variant``
    (the evaluation-time variant; null: the PE as trained), ``metric``, ``length``, ``depth``, ``value``,
    ``answers``, ``chance`` (the metric's chance level on the row, where it has one: ``Run.chance``), ``status``,
    ``counted`` (whether means count it: ``Run.learned``, or within the run's own training length), ``peak_mem_mb``,
    ``train_tokens_per_s``, ``accuracy_as_trained``, ``own_train_len`` (the run's own training length, where that
    accuracy is measured: a PoSE stage's is the first stage's, not its target), ``machine``, ``temperature_c`` (a
    temperature row's fitted c), ``evaluator`` (a key-token row's: null, the model itself), ``text`` (``Run.text``)."""
    records = []
    for run in runs:
        fields, meta = run.fields, run.meta
        for row in run.rows:
            for metric in run.metrics(row["protocol"]):
                records.append(
                    {
                        "run": run.folder,
                        "group": run.group,
                        "row": run.row,
                        "label": run.label(row["variant"]),
                        "pe": fields.pe,
                        "positions": fields.positions,
                        "attention": "+".join(fields.attention),
                        "base": fields.base,
                        "method": fields.method,
                        "stage_len": fields.stage_len,
                        "root": run.root,
                        "extension_method": run.extension_method(row["variant"]),
                        "family": run.family,
                        "display_name": meta["pe_display_name"],
                        "task": run.task,
                        "train_len": run.table_len,
                        "seed": run.seed,
                        "protocol": row["protocol"],
                        "variant": run.shown_variant(row["variant"]),
                        "metric": metric,
                        "length": row["length"],
                        "depth": row.get("depth"),
                        "value": row.get(metric),
                        "answers": row.get("answers"),
                        "chance": run.chance(metric, row),
                        "status": NO_VALUE if row["status"] == "ok" and row.get(metric) is None else row["status"],
                        "counted": run.learned or row["length"] <= run.meta["train_len"],
                        "peak_mem_mb": row.get("peak_mem_mb"),
                        "train_tokens_per_s": meta.get("train_tokens_per_s"),
                        "accuracy_as_trained": run.accuracy_as_trained,
                        "own_train_len": run.meta["train_len"],
                        "machine": run.machine,
                        "temperature_c": row.get("temperature_c"),
                        "evaluator": row.get("evaluator"),
                        "text": run.text,
                    }
                )
    frame = pd.DataFrame.from_records(records, columns=COLUMNS)
    frame["stage_len"] = frame.stage_len.astype("Int64")
    return frame.astype(dict.fromkeys(FLOAT_COLUMNS, float))


@dataclass(frozen=True)
class Loaded:
    """What the results files below some folders hold: the runs counted (labelled, in the order found), the
    repeats left out ((folder, folder of the run it repeats)), the runs without complete results ((folder, why))
    and the tidy frame of the counted runs (``tidy``)."""

    runs: list[Run]
    repeats: list[tuple[str, str]]
    incomplete: list[tuple[str, str]]
    frame: pd.DataFrame
    untempered: tuple[str, ...] = ()  # temperature rows left out of ``frame``: ``untempered_labels``

    @property
    def machines(self) -> Counter:
        """The machines the runs lenext trained were made on (with the training precision), with their number of
        runs, first seen first: those whose ``train tok/s`` a table averages."""
        return Counter(run.machine for run in self.runs if run.machine and not run.evaluated_only)

    @property
    def evaluation_machines(self) -> Counter:
        """The machines that evaluated models lenext did not train (``eval.py hf=``), with their number of runs."""
        return Counter(run.machine for run in self.runs if run.machine and run.evaluated_only)

    @property
    def one_token_tasks(self) -> list[str]:
        """The probes whose answers are one token each, with their settings (``Task.describe``): their per-token
        accuracy is not tabled (``Run.metrics``)."""
        probes = [run.probe for run in self.runs]
        return list(dict.fromkeys(probe.describe() for probe in probes if probe and probe.answer_tokens == 1))

    @property
    def merged_variants(self) -> list[str]:
        """The variants some run's rows also stand for (``Run.merged_variants``), first seen first."""
        return list(dict.fromkeys(name for run in self.runs for name in run.merged_variants))


def runs_of(complete: list[tuple[str, dict]]) -> tuple[list[Run], list[tuple[str, str]]]:
    """``find_runs``' complete runs read (``Run.read``), each (settings, seed) once (``count_once``) and
    labelled (``label_runs``); with the repeats left out."""
    runs, repeats = count_once(with_fixed_data_seeds([Run.read(folder, results) for folder, results in complete]))
    return label_runs(runs), repeats


def untempered_labels(frame: pd.DataFrame) -> tuple[str, ...]:
    """The temperature rows whose c was fitted to 0 in every seed: beta = 1, so each equals its row as trained,
    value for value; neither tabled nor drawn twice."""
    tempered = frame[frame.variant == TEMPERATURE]
    fitted = tempered.groupby("label", sort=False).temperature_c
    return tuple(label for label, c in fitted if c.notna().all() and (c == 0).all())


def load(folders: list[str]) -> Loaded:
    """Every results file below ``folders``: the runs, their tidy frame (less ``untempered_labels``), and what was
    not counted."""
    complete, incomplete = find_runs(folders)
    runs, repeats = runs_of(complete)
    # a run counted in two rows (``with_fixed_data_seeds``) listed once
    incomplete += list(
        dict.fromkeys((run.folder, why) for run in runs for why in (run.diagnostics[1], run.positions[1]) if why)
    )
    frame = tidy(runs)
    untempered = untempered_labels(frame)
    return Loaded(runs, repeats, incomplete, frame[~frame.label.isin(untempered)], untempered)


def collect(complete: list[tuple[str, dict]]) -> pd.DataFrame:
    """The tidy frame of ``find_runs``' complete runs (``tidy``)."""
    return tidy(runs_of(complete)[0])


POSITIONS_INTEGERS = ("length", "position", "count")


def read_positions(folder: str) -> tuple[pd.DataFrame | None, str | None]:
    """(the per-position loss in ``folder``, None), (None, None) where it has none, or (None, why it is left out: a
    file that cannot be parsed, or whose columns are not lenext's whole)."""
    file = os.path.join(folder, POSITIONS_FILE)
    if not os.path.exists(file):
        return None, None
    try:  # The variant "" (as trained) kept a string; a diverged run's mean_nll "nan" read as NaN.
        curve = pd.read_csv(file, keep_default_na=False, na_values={"mean_nll": ["nan"]})
    except (OSError, ValueError) as e:  # pandas' parser errors are ValueErrors, as is text that is not UTF-8
        return None, f"{POSITIONS_FILE} cannot be read ({type(e).__name__}): its per-position curve left out"
    curve = curve.rename(columns=OLD_POSITIONS_COLUMNS)
    whole = {"variant", "mean_nll", *POSITIONS_INTEGERS} <= set(curve.columns) and all(
        pd.api.types.is_integer_dtype(curve[column]) for column in POSITIONS_INTEGERS
    )
    if not whole or not pd.api.types.is_numeric_dtype(curve.mean_nll):
        return None, (
            f"{POSITIONS_FILE} is not lenext's (columns variant, length, position, mean_nll, count, each row whole): "
            "its per-position curve left out"
        )
    return curve, None


def validation_curve(run: Run) -> pd.DataFrame | None:
    """A second stage's validation perplexity per step (``csv/metrics.csv``: step, val/ppl), None for a first stage
    or a run without it."""
    file = os.path.join(run.folder, "csv", "metrics.csv")
    if not run.meta.get("lineage") or not os.path.exists(file):
        return None
    logged = pd.read_csv(file, dtype=str, keep_default_na=False)  # "" on the rows of other metrics; "nan": diverged
    if VAL_PPL not in logged:
        return None
    validated = logged[logged[VAL_PPL] != ""]
    return pd.DataFrame({"step": validated.step.astype(int), VAL_PPL: validated[VAL_PPL].astype(float)})
