"""Results files -> paper-style tables (Markdown, LaTeX, CSV) and plots (PNG).

    lenext-report <multirun dir or run dirs ...> [--out DIR]      (or: python -m lenext.report ...)

Reads every ``results.json`` below the given folders. A row of the table is a PE (RoPE
evaluated under another scaling gets its own row, e.g. ``rope (ntk)``); columns are L_eval;
cells are mean +- std over seeds, the best of each column marked (lowest perplexity; highest
accuracy; none when several share it). One table per (L_train, protocol) for text, and per
(task, L_train, metric) for the probes' ``accuracy`` rows (exact match, per-token accuracy).
Runs without a complete results file are listed, not dropped.

Which orderings are real: two PEs are *separable* at a length when both have >= 2 seeds, their
means differ by more than two standard deviations (|mean_a - mean_b| > 2 max(std_a, std_b), std
over seeds) and, over the seeds both have (same seed = same initialization and training order),
the paired differences all have the same sign. Cells not separable from their column's best are
marked ``~``; with one seed nothing can be marked, and the table says so.

Per-position curves (``per_position.png``/``.csv``) use each run's longest evaluated length and average
the loss over log-spaced position bins, because a single position holds only one token per window, far
too few to read a curve from. Bin edges are round(2 ** (k / 4)) in 1-based positions (four bins per
octave, duplicate integer edges dropped, so positions 1..7 get a bin each); a bin's loss is the mean
of the positions' losses weighted by their token counts, then mean and std over seeds.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import pandas as pd

from lenext.attention import AttentionSettings
from lenext.evaluate import ACCURACY, ERROR_FILE, POSITIONS_FILE, RESULTS_FILE, not_lenext_results
from lenext.files import atomic_path, write_atomic
from lenext.pe.rope import SAME_AS, redundant_variants
from lenext.spec import STAGE_MARK, first_stage_row

BINS_PER_OCTAVE = 4
NOT_SEPARABLE = "~"


class Metric(NamedTuple):
    name: str
    scale: float  # shown as value x scale
    digits: int
    higher_is_better: bool


METRICS = {
    "ppl": Metric("perplexity", 1, 2, False),
    "exact_match": Metric("exact-match accuracy %", 100, 1, True),
    "token_accuracy": Metric("per-token accuracy %", 100, 1, True),
}
ACCURACIES = ("exact_match", "token_accuracy")  # the metrics of a probe's rows
LEARNED_AT = 0.9  # a probe run below this exact match at its own training length did not learn its task there
NOT_LEARNED = "not learned"

# The figures' panels: PEs by how they act (meta.pe.name, the PE class), every other PE an additive bias; a run
# with an attention setting (SSMax, a window, stick-breaking) goes with the 2024-26 methods whatever its PE.
FRONTIER_FAMILY = "2024-26 methods"
FAMILIES = (
    {name: "no PE or absolute" for name in ("NoPE", "Sinusoidal", "Learned")}
    | {name: "rotary" for name in ("RoPE", "xPos")}
    | {name: FRONTIER_FAMILY for name in ("FoX", "CoPE", "Compose", "PerLayer")}
)
OTHER_FAMILY = "additive bias"
FAMILY_ORDER = ("no PE or absolute", OTHER_FAMILY, "rotary", FRONTIER_FAMILY)
# A PE's rows share its colour; its variants (scalings, second stages) differ by line style.
LINE_STYLES = ("-", "--", ":", "-.", (0, (1, 3)), (0, (6, 2, 1, 2, 1, 2)), (0, (9, 3)), (0, (3, 1, 1, 1, 1, 1)))
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def find_runs(folders: list[str]) -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    """(run dir, results) for complete runs, and (run dir, why) for runs that are not."""
    complete, incomplete = [], []
    for folder in folders:
        if not os.path.isdir(folder):
            raise SystemExit(f"error: {folder!r} is not a folder: give a multirun folder or run folders")
        for root, dirs, files in os.walk(folder):
            # Job folders in job order (2 before 10): rows and lines follow the order the sweep listed its PEs.
            dirs[:] = sorted(
                (d for d in dirs if not d.startswith(".") and d not in ("checkpoints", "csv", "report")),
                key=lambda d: (not d.isdigit(), int(d) if d.isdigit() else 0, d),
            )
            is_run = ".hydra" in os.listdir(root)
            if ERROR_FILE in files and (
                RESULTS_FILE not in files
                or os.path.getmtime(os.path.join(root, ERROR_FILE)) > os.path.getmtime(os.path.join(root, RESULTS_FILE))
            ):  # the latest attempt failed, whatever an earlier one left
                with open(os.path.join(root, ERROR_FILE), encoding="utf-8", errors="replace") as f:
                    incomplete.append((root, f"failed: {f.read().strip()}"))
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
                elif results.get("complete"):
                    complete.append((root, results))
                else:
                    incomplete.append((root, f"{RESULTS_FILE} not marked complete"))
            elif is_run and not any(d.isdigit() for d in dirs):
                incomplete.append((root, f"no {RESULTS_FILE}: failed, interrupted or still running"))
    return complete, incomplete


def label(meta: dict, scaling: str | None) -> str:
    """Row label: the run's row (``meta.row``, lenext.spec: the PE's config name, ``_scheme`` when trained at
    drawn positions, ``<base row> -> <method>@<length>`` for a second stage), the variant when evaluation changed
    it (``rope (ntk)``), and evaluation positions other than the scheme's own."""
    positions = meta.get("positions") or {"train": "sequential", "eval": "sequential"}
    name = meta.get("row") or first_stage_row(meta.get("pe_name") or meta["pe"]["name"].lower(), positions["train"])
    trained = meta["pe"].get("scaling")
    name = name if scaling in (None, trained) else f"{name} ({scaling})"
    if positions["train"] == "randomized" and positions["eval"] == "sequential":
        name += " (eval at 0..L-1)"
    return name


def redundant_in(results: dict) -> set[str]:
    """The variants a run was asked for (``eval.rope_scalings``) or has rows of that another of them equals by
    construction (``SAME_AS``): results made before evaluation stopped measuring them have both."""
    meta = results["meta"]
    asked = {row["scaling"] for row in results["rows"]} | set(meta.get("identity", {}).get("eval.rope_scalings") or ())
    pe, reach = meta["pe"], (meta.get("positions") or {}).get("reach") or meta["train_len"]
    per_span = pe.get("factor") is None and pe.get("original_len", reach) == reach
    return redundant_variants(asked, pe.get("scaling"), per_span)


def same_as_note(runs: list[tuple[str, dict]]) -> str:
    """One line naming the variants the tables' rows also stand for: asked for, equal by construction to another
    asked one, so neither evaluated nor shown twice."""
    merged = dict.fromkeys(name for _, results in runs for name in redundant_in(results))
    if not merged:
        return ""
    stands_for = "; ".join(f"`{SAME_AS[name]}` rows also stand for `{name}`" for name in merged)
    return (
        f"{stands_for}: equal by construction (both take their factor from the span of a forward pass's "
        "positions: dynamic NTK's L / C is NTK's), so neither evaluated nor shown twice.\n\n"
    )


def accuracy_as_trained(results: dict) -> float | None:
    """A probe run's exact match at its own training length, as trained (no evaluation-time variant); None for
    text, or when that length was not evaluated."""
    meta = results["meta"]
    trained = (None, meta["pe"].get("scaling"))
    for row in results["rows"]:
        if (
            row["protocol"] == ACCURACY
            and row.get("depth") is None
            and row["length"] == meta["train_len"]
            and row["scaling"] in trained
            and row["status"] == "ok"
        ):
            return row["exact_match"]
    return None


def learned(results: dict) -> bool:
    """Whether a run learned its task at its training length (``LEARNED_AT``); text runs always count. A run that
    did not is kept out of every mean beyond L_train: what it does there measures nothing."""
    accuracy = accuracy_as_trained(results)
    return accuracy is None or accuracy >= LEARNED_AT


def table_len(meta: dict) -> int:
    """The L_train a run's rows are tabled under: its first stage's (a second stage sits beside its base)."""
    return meta.get("base_len") or meta["train_len"]


def shown_rows(results: dict) -> Iterator[tuple[dict, bool]]:
    """A results file's rows, less variants another row equals by construction, each with whether it counts in
    the means: beyond L_train only if the run learned its task (``learned``)."""
    redundant, run_learned, train_len = redundant_in(results), learned(results), table_len(results["meta"])
    for row in results["rows"]:
        if row["scaling"] not in redundant:
            yield row, run_learned or row["length"] <= train_len


def collect(runs: list[tuple[str, dict]]) -> pd.DataFrame:
    """One record per (run, row, metric) with status ok or not applicable: ``ppl`` for text, ``exact_match`` and
    ``token_accuracy`` for a probe's rows (``task`` names the probe; "" for text). Depth rows are left to
    ``passkey_depths``."""
    records = []
    for run_dir, results in runs:
        meta = results["meta"]
        accuracy = accuracy_as_trained(results)
        for row, counted in shown_rows(results):
            if row.get("depth") is not None:
                continue
            for metric in ACCURACIES if row["protocol"] == ACCURACY else ("ppl",):
                records.append(
                    {
                        "run": run_dir,
                        "pe": label(meta, row["scaling"]),
                        "task": meta.get("task") or "",
                        "train_len": table_len(meta),
                        "seed": meta["seed"],
                        "protocol": row["protocol"],
                        "metric": metric,
                        "length": row["length"],
                        "value": row.get(metric),
                        "status": row["status"],
                        "peak_mem_mb": row.get("peak_mem_mb"),
                        "train_tokens_per_s": meta.get("train_tokens_per_s"),
                        "family": family(meta),
                        "counted": counted,
                        "accuracy_as_trained": accuracy,
                    }
                )
    return pd.DataFrame.from_records(records)


def family(meta: dict) -> str:
    """The figure panel of a run: its PE's family, or the 2024-26 methods' with an attention setting."""
    identity = meta.get("identity", {})
    defaults = dataclasses.asdict(AttentionSettings())
    if any(identity.get(f"attention.{key}", default) != default for key, default in defaults.items()):
        return FRONTIER_FAMILY
    return FAMILIES.get(meta["pe"]["name"], OTHER_FAMILY)


def machines(runs: list[tuple[str, dict]]) -> dict[str, int]:
    """The machine each results file was made on (``meta.hardware``: where train.py trained and evaluated,
    or where eval.py evaluated), with its number of runs, first seen first; files without it are left out."""
    hardware = [results["meta"]["hardware"] for _, results in runs if results["meta"].get("hardware")]
    return Counter(f"{_device(hw)}, {hw.get('training_precision')}" for hw in hardware)


def _device(hw: dict) -> str:
    return hw.get("gpu") or f"{hw['cpu']} ({hw['isa']}, {hw['cores']} cores)"


def hardware_note(counts: dict[str, int]) -> str:
    """One line under the tables: where the runs were made, and whether their speeds can be compared."""
    if len(counts) <= 1:
        return f"Runs made on {next(iter(counts))}.\n" if counts else ""
    listed = "; ".join(f"{name} ({n} run{'s' if n != 1 else ''})" for name, n in counts.items())
    return (
        f"Runs made on {len(counts)} machines: {listed}. `train tok/s` averages over them: it is not a speed "
        "comparison between PEs (`make bench` is).\n"
    )


class TableKey(NamedTuple):
    """What one table holds: a metric of one protocol at one L_train (and, for probes, one task)."""

    train_len: int
    protocol: str
    metric: str = "ppl"
    task: str = ""


def summarize(frame: pd.DataFrame) -> dict[TableKey, pd.DataFrame]:
    """Every statistic the tables and plots show, computed once. Per ``TableKey``: a frame indexed by PE with
    columns (length, mean|std|n|status|by_seed|best|separable) + speed/memory; ``best``: the cell is its column's
    best, ``separable``: whether it is separable from that best (None: not tested)."""
    tables = {}
    # Text ("" task) before probes; then by L_train, protocol, metric.
    for (task, train_len, protocol, metric), group in frame.groupby(["task", "train_len", "protocol", "metric"]):
        cells = {}
        for (pe, length), g in group.groupby(["pe", "length"], sort=False):
            measured = g[g.status == "ok"]
            ok = measured[measured.counted]
            values = ok.value.astype(float)
            cells[(pe, length)] = {
                "mean": values.mean() if len(values) else math.nan,
                "std": values.std(ddof=1) if len(values) > 1 else (0.0 if len(values) else math.nan),
                "n": len(values),
                "status": "ok" if len(values) else NOT_LEARNED if len(measured) else g.status.iloc[0],
                "by_seed": dict(zip(ok.seed, values, strict=True)),
            }
        pes = list(dict.fromkeys(pe for pe, _ in cells))  # first seen first: the sweep's order
        lengths = sorted({length for _, length in cells})
        table = pd.DataFrame(
            index=pes,
            columns=pd.MultiIndex.from_product(
                [lengths, ["mean", "std", "n", "status", "by_seed", "best", "separable"]]
            ),
        )
        for (pe, length), cell in cells.items():
            for key, value in cell.items():
                table.at[pe, (length, key)] = value
        speed = group.groupby("pe").train_tokens_per_s.mean()
        memory = group.groupby("pe").peak_mem_mb.max()
        table[("train tok/s", "")] = [speed.get(pe) for pe in pes]
        table[("eval peak MB", "")] = [memory.get(pe) for pe in pes]
        table.attrs["metric"] = metric
        unlearned = group[group.accuracy_as_trained.astype(float) < LEARNED_AT].drop_duplicates("run")
        table.attrs["not_learned"] = list(zip(unlearned.pe, unlearned.seed, unlearned.accuracy_as_trained, strict=True))
        for length in lengths:
            best = _best(table, length)
            for pe in pes:
                table.at[pe, (length, "best")] = pe == best
                table.at[pe, (length, "separable")] = _separable_from_best(table, pe, length, best)
        tables[TableKey(int(train_len), protocol, metric, task)] = table
    return tables


def _best(table: pd.DataFrame, length: int) -> str | None:
    """The PE with the column's best mean; None when no cell has a value or several share the best (accuracies
    often tie at 0% or 100%)."""
    means = pd.to_numeric(table[(length, "mean")], errors="coerce")
    if means.isna().all():
        return None
    best = means.max() if METRICS[table.attrs["metric"]].higher_is_better else means.min()
    leaders = means.index[means == best]
    return leaders[0] if len(leaders) == 1 else None


def _separable_in(table: pd.DataFrame, pe_a: str, pe_b: str, length: int) -> bool | None:
    a, b = ({k: table.loc[pe, (length, k)] for k in ("mean", "std", "n", "by_seed")} for pe in (pe_a, pe_b))
    if not all(isinstance(c["n"], int | float) and c["n"] >= 2 for c in (a, b)):
        return None
    apart = abs(a["mean"] - b["mean"]) > 2 * max(a["std"], b["std"])
    paired = [a["by_seed"][seed] - b["by_seed"][seed] for seed in a["by_seed"].keys() & b["by_seed"].keys()]
    same_sign = len(paired) < 2 or all(d > 0 for d in paired) or all(d < 0 for d in paired)
    return bool(apart and same_sign)


def separable(
    frame_or_tables: pd.DataFrame | dict,
    pe_a: str,
    pe_b: str,
    train_len: int,
    protocol: str,
    length: int,
    metric: str = "ppl",
    task: str = "",
) -> bool | None:
    """Whether PEs ``pe_a`` and ``pe_b`` (row labels, e.g. ``rope (ntk)``) differ in ``metric`` at ``length``
    beyond seed noise, by the rule in the module docstring; None when either has fewer than two seeds there,
    so no claim can be tested. Takes the frame of ``collect`` or the tables of ``summarize``."""
    key = TableKey(train_len, protocol, metric, task)
    if isinstance(frame_or_tables, pd.DataFrame):
        frame = frame_or_tables
        frame_or_tables = summarize(frame[(frame.train_len == train_len) & (frame.protocol == protocol)])
    return _separable_in(frame_or_tables[key], pe_a, pe_b, length)


def _separable_from_best(table: pd.DataFrame, pe: str, length: int, best: str | None) -> bool | None:
    if best is None or pe == best or table.loc[pe, (length, "status")] != "ok":
        return None
    return _separable_in(table, pe, best, length)


def _cell(table, pe, length, fmt) -> str:
    mean, std, n, status = (table.loc[pe, (length, k)] for k in ("mean", "std", "n", "status"))
    if not isinstance(status, str):
        return ""
    if status != "ok":
        return {"not applicable": "n/a", NOT_LEARNED: NOT_LEARNED}.get(status, "-")
    metric = METRICS[table.attrs["metric"]]
    mean, std = mean * metric.scale, std * metric.scale
    text = f"{mean:.{metric.digits}f}" + (f" {fmt['pm']} {std:.{metric.digits}f}" if n > 1 else "")
    if table.loc[pe, (length, "separable")] is False:
        text += fmt["not_separable"]
    return fmt["bold"].format(text) if table.loc[pe, (length, "best")] else text


def _seed_range(table: pd.DataFrame) -> tuple[int, int]:
    """Fewest and most seeds behind a cell that has a value."""
    counts = pd.to_numeric(table.xs("n", axis=1, level=1).stack(), errors="coerce")
    counts = counts[counts > 0]
    return (int(counts.min()), int(counts.max())) if len(counts) else (0, 0)


def _number(value, digits=0) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def to_markdown(tables: dict) -> str:
    parts = []
    for key, table in tables.items():
        lengths = _lengths(table)
        fewest, most = _seed_range(table)
        seeds = f"{most} seed{'s' if most != 1 else ''}" if fewest == most else f"{fewest}-{most} seeds"
        parts.append(
            f"### {title(key)} ({METRICS[key.metric].name}, mean +- std over {seeds}; best per column in bold)\n"
        )
        if most < 2:
            parts.append("One seed: no difference is tested for significance (that needs >= 2 seeds).\n")
        else:
            parts.append(
                f"{NOT_SEPARABLE}: not separable from the column's best (means within 2 std, or paired differences "
                "over seeds of both signs)."
                + (" A cell is tested only when it and the best both have >= 2 seeds." if fewest < 2 else "")
                + "\n"
            )
        head = ["PE", *[f"{n}" for n in lengths], "train tok/s", "eval peak MB"]
        parts.append("| " + " | ".join(head) + " |")
        parts.append("|" + "---|" * len(head))
        for pe in table.index:
            cells = [
                _cell(table, pe, n, {"pm": "±", "bold": "**{}**", "not_separable": f" {NOT_SEPARABLE}"})
                for n in lengths
            ]
            extra = [_number(table.loc[pe, ("train tok/s", "")]), _number(table.loc[pe, ("eval peak MB", "")])]
            parts.append("| " + " | ".join([pe, *cells, *extra]) + " |")
        parts.append("")
        if table.attrs["not_learned"]:
            parts.append(not_learned_note(table.attrs["not_learned"], key.train_len))
    return "\n".join(parts)


def not_learned_note(runs: list[tuple[str, int, float]], train_len: int) -> str:
    """The runs that did not learn their task at L_train, with their exact match there, under a probe's table."""
    by_pe: dict[str, list[str]] = {}
    for pe, seed, accuracy in runs:
        by_pe.setdefault(pe, []).append(f"seed {seed}: {100 * accuracy:.1f}%")
    listed = "; ".join(f"{pe} ({', '.join(seeds)})" for pe, seeds in by_pe.items())
    return (
        f"Not learned at L_train (exact match below {100 * LEARNED_AT:.0f}% at {train_len}; kept out of every column "
        f"beyond it, `{NOT_LEARNED}` where no seed learned): {listed}.\n"
    )


def title(key: TableKey) -> str:
    """A table's heading, e.g. "L_train = 64, protocol `nonoverlap`"; a probe's table starts with its task."""
    return (f"{key.task}, " if key.task else "") + f"L_train = {key.train_len}, protocol `{key.protocol}`"


def to_latex(tables: dict) -> str:
    parts = []
    for key, table in tables.items():
        lengths = _lengths(table)
        parts += [
            f"% {title(key).replace('`', '')}" + (f", {METRICS[key.metric].name}" if key.task else ""),
            "\\begin{tabular}{l" + "r" * len(lengths) + "}",
            "\\toprule",
            "PE & " + " & ".join(str(n) for n in lengths) + " \\\\",
            "\\midrule",
        ]
        for pe in table.index:
            cells = [
                _cell(table, pe, n, {"pm": "$\\pm$", "bold": "\\textbf{{{}}}", "not_separable": " $\\sim$"})
                for n in lengths
            ]
            parts.append(pe.replace("_", "\\_") + " & " + " & ".join(cells) + " \\\\")
        parts += ["\\bottomrule", "\\end{tabular}", ""]
    return "\n".join(parts)


def to_csv(frame: pd.DataFrame, tables: dict) -> str:
    rows = []
    for key, table in tables.items():
        for length in _lengths(table):
            for pe in table.index:
                if not isinstance(table.loc[pe, (length, "status")], str):
                    continue
                rows.append(
                    {
                        "task": key.task,
                        "train_len": key.train_len,
                        "protocol": key.protocol,
                        "metric": key.metric,
                        "pe": pe,
                        "length": length,
                        **{k: table.loc[pe, (length, k)] for k in ("mean", "std", "n", "status")},
                        "best": table.loc[pe, (length, "best")],
                        "separable_from_best": table.loc[pe, (length, "separable")],
                        "train_tokens_per_s": table.loc[pe, ("train tok/s", "")],
                        "eval_peak_mem_mb": table.loc[pe, ("eval peak MB", "")],
                    }
                )
    return pd.DataFrame(rows).to_csv(index=False)


FIGURE_STYLE = {"font.size": 10, "axes.titlesize": 10.5, "legend.fontsize": 9}  # legible at README width


def styled(plot):
    """Draw ``plot``'s figure in ``FIGURE_STYLE``, leaving matplotlib's settings as they were for the caller."""

    @functools.wraps(plot)
    def draw(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(FIGURE_STYLE):
            return plot(*args, **kwargs)

    return draw


def base_row(row: str) -> str:
    """The PE a row belongs to: ``rope (ntk)`` and ``rope -> yarn@256`` are ``rope``'s rows."""
    return row.split(STAGE_MARK)[0].split(" (")[0]


def row_styles(rows: list[str]) -> dict[str, dict]:
    """Per row, matplotlib line settings: the colour of its PE, a line style per variant of that PE."""
    bases = list(dict.fromkeys(base_row(row) for row in rows))
    seen: dict[str, int] = {}
    styles = {}
    for row in rows:
        base = base_row(row)
        seen[base] = seen.get(base, -1) + 1
        variant = seen[base] % len(LINE_STYLES)
        styles[row] = {"color": f"C{bases.index(base) % 10}", "ls": LINE_STYLES[variant], "marker": MARKERS[variant]}
    return styles


def _lengths(table: pd.DataFrame) -> list:
    return [c for c in table.columns.get_level_values(0).unique() if isinstance(c, int | float)]


def _draw_rows(ax, table: pd.DataFrame, rows: list[str], styles: dict, scale: float = 1.0) -> None:
    """Each row's mean +- std over seeds against L_eval."""
    lengths = _lengths(table)
    for pe in rows:
        mean = pd.to_numeric(pd.Series([table.loc[pe, (n, "mean")] for n in lengths]), errors="coerce")
        std = pd.to_numeric(pd.Series([table.loc[pe, (n, "std")] for n in lengths]), errors="coerce").fillna(0)
        ax.errorbar(lengths, mean * scale, yerr=std * scale, ms=3.5, lw=1.4, capsize=2, label=pe, **styles[pe])


def _length_axis(ax, lengths: list) -> None:
    """A log axis of evaluation lengths, ticked at the lengths evaluated, in plain numbers."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xticks(lengths, [f"{n:g}" for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())


def _plain_log_values(ax) -> None:
    """A log axis of values labelled in plain numbers (30, 50, 100, 200), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "235" else ""))


def _mark_train_len(ax, train_len: int) -> None:
    ax.axvline(train_len, color="grey", ls="--", lw=1)
    ax.annotate(
        "L_train",
        (train_len, 1),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
        fontsize=8,
        color="grey",
    )


def _legend_below(ax, entries: int) -> None:
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=1 + (entries > 4) + (entries > 12),
        frameon=False,
    )


FAMILY_PANELS_ABOVE = 7  # rows in a table beyond which a figure splits each table into family panels


def families_of(pes, families: dict[str, str]) -> list[str]:
    """The PE families the rows ``pes`` belong to, in ``FAMILY_ORDER`` (any other after, by name)."""
    named = {families.get(pe, OTHER_FAMILY) for pe in pes}
    return [f for f in FAMILY_ORDER if f in named] + sorted(named - set(FAMILY_ORDER))


@styled
def plot_lengths(tables: dict, families: dict[str, str], path: str) -> None:
    """The metric against L_eval, mean +- std over seeds, each PE in its colour and its variants in line styles,
    the legend below the data: a row of panels per table, a panel per PE family (``FAMILIES``) when a table has
    more rows than ``FAMILY_PANELS_ABOVE``, else a panel per table (three to a row)."""
    plt = _pyplot()
    panels = []  # (table key, table, rows, family or "")
    if max(len(table) for table in tables.values()) > FAMILY_PANELS_ABOVE:
        present = families_of([pe for table in tables.values() for pe in table.index], families)
        columns = len(present)
        for key, table in tables.items():
            for family in present:
                panels.append(
                    (key, table, [pe for pe in table.index if families.get(pe, OTHER_FAMILY) == family], family)
                )
    else:
        columns = min(3, len(tables))
        panels = [(key, table, list(table.index), "") for key, table in tables.items()]
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 5.0 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (key, table, drawn, family) in zip(axes.flat, panels, strict=False):
        metric = METRICS[key.metric]
        _draw_rows(ax, table, drawn, row_styles(drawn), metric.scale)
        _mark_train_len(ax, key.train_len)
        _length_axis(ax, _lengths(table))
        ax.set(
            yscale="linear" if metric.higher_is_better else "log",
            xlabel="L_eval (tokens)",
            ylabel=metric.name,
            title=(f"{family}: " if family else "")
            + (f"{key.task}, {metric.name.split(' ')[0]}" if key.task else key.protocol)
            + f", L_train {key.train_len}",
        )
        if metric.higher_is_better:
            ax.set_ylim(-2, 102)
        else:
            _plain_log_values(ax)
        if drawn:
            _legend_below(ax, len(drawn))
    for row in axes:  # one perplexity scale across a row's panels: families compare at a glance
        shown = [ax for ax in row if ax.has_data() and ax.get_yscale() == "log"]
        if len(shown) > 1:
            low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
            for ax in shown:
                ax.set_ylim(low, high)
    _save_figure(fig, path)


def _method(row: str) -> str:
    """What a row of an extension figure does to its PE: the scaling it is evaluated under, else the stage's
    method (``pi`` is ``linear``, ``direct`` is ``none``), else ``none``."""
    if row.endswith(")") and " (" in row:
        return row.rsplit(" (", 1)[1][:-1]
    if STAGE_MARK in row:
        method = row.split(STAGE_MARK)[1].split("@")[0]
        return {"pi": "linear", "direct": "none"}.get(method, method)
    return "none"


@styled
def plot_extension(tables: dict, path: str) -> None:
    """Second stages in the ``nonoverlap`` table (else each text table holding them), perplexity against L_eval,
    mean +- std over seeds. A PE with zero-shot scalings gets two panels, its base and those scalings, then its base
    and each method after fine-tuning, a method in one colour in both (PI is ``linear``); the PEs without any share
    one panel, each in its colour. Fine-tuned rows are solid, the others dashed."""
    plt = _pyplot()
    staged = {k: t for k, t in tables.items() if not k.task and any(STAGE_MARK in pe for pe in t.index)}
    main = {k: t for k, t in staged.items() if k.protocol == "nonoverlap"} or staged
    panels = []  # (table key, table, rows, title, colour of a row)
    for key, table in main.items():
        plain = []
        for base in dict.fromkeys(pe.split(STAGE_MARK)[0] for pe in table.index if STAGE_MARK in pe):
            zero_shot = [pe for pe in table.index if STAGE_MARK not in pe and base_row(pe) == base]
            tuned = [base] + [pe for pe in table.index if pe.startswith(base + STAGE_MARK)]
            if len(zero_shot) == 1:
                plain += tuned
                continue
            methods = list(dict.fromkeys(_method(pe) for pe in zero_shot + tuned))
            colour = {pe: f"C{methods.index(_method(pe)) % 10}" for pe in zero_shot + tuned}
            panels.append((key, table, zero_shot, f"{base}, zero-shot", colour))
            panels.append((key, table, tuned, f"{base}, after fine-tuning", colour))
        if plain:
            bases = list(dict.fromkeys(base_row(pe) for pe in plain))
            colour = {pe: f"C{bases.index(base_row(pe)) % 10}" for pe in plain}
            panels.append((key, table, plain, "the other PEs: base and direct fine-tuning", colour))
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(6.4 * columns, 5.6 * rows), squeeze=False, sharey=True, layout="constrained"
    )
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (key, table, drawn, title, colour) in zip(axes.flat, panels, strict=False):
        styles = {
            pe: {
                "color": colour[pe],
                "ls": "-" if STAGE_MARK in pe else "--",
                "marker": "o" if STAGE_MARK in pe else "s",
            }
            for pe in drawn
        }
        _draw_rows(ax, table, drawn, styles)
        _mark_train_len(ax, key.train_len)
        _length_axis(ax, _lengths(table))
        ax.set(yscale="log", xlabel="L_eval (tokens)", ylabel="perplexity")
        _plain_log_values(ax)
        ax.set_title(f"{title} ({key.protocol})")
        _legend_below(ax, len(drawn))
    _save_figure(fig, path)


def adaptation(runs: list[tuple[str, dict]]) -> pd.DataFrame:
    """Second stages' validation perplexity against fine-tuning steps (their csv/metrics.csv), mean and std over
    seeds. Columns: row, val_len (the stage's training length, where it validates), step, mean, std, seeds."""
    records = []
    for run_dir, results in runs:
        meta, file = results["meta"], os.path.join(run_dir, "csv", "metrics.csv")
        if not meta.get("lineage") or not os.path.exists(file):
            continue
        logged = pd.read_csv(file)
        if "val/ppl" not in logged:
            continue
        # Lightning logs a validation during training at the index of its step (0-based), and the validation after
        # training at the steps done: one step after the last, it scores the same weights again.
        validations = logged.dropna(subset=["val/ppl"])
        last = validations.step.max()
        for step, ppl in validations[["step", "val/ppl"]].itertuples(index=False):
            if step == last and last - 1 in set(validations.step):
                continue
            done = int(step) + (step < last)
            records.append({"row": label(meta, None), "val_len": meta["train_len"], "step": done, "ppl": ppl})
    if not records:
        return pd.DataFrame()
    grouped = pd.DataFrame(records).groupby(["val_len", "row", "step"], sort=False)
    frame = grouped.agg(mean=("ppl", "mean"), std=("ppl", "std"), seeds=("ppl", "count")).reset_index()
    frame["std"] = frame["std"].fillna(0.0)
    return frame


@styled
def plot_adaptation(frame: pd.DataFrame, path: str) -> None:
    """Validation perplexity against fine-tuning steps, one panel per validation length (the PI paper's figure of
    how fast each method adapts)."""
    plt = _pyplot()
    lengths = sorted(frame.val_len.unique())
    fig, axes = plt.subplots(1, len(lengths), figsize=(7 * len(lengths), 6), squeeze=False, layout="constrained")
    styles = row_styles(list(frame.row.unique()))
    for ax, length in zip(axes[0], lengths, strict=True):
        for row, curve in frame[frame.val_len == length].groupby("row", sort=False):
            ax.errorbar(curve.step, curve["mean"], yerr=curve["std"], ms=3, capsize=2, label=row, **styles[row])
        ax.set(yscale="log", xlabel="fine-tuning step", ylabel=f"validation perplexity at L = {length}")
        ax.set_title(f"second stages validating at their training length {length}")
        _legend_below(ax, frame[frame.val_len == length].row.nunique())
    _save_figure(fig, path)


def log_bins(length: int) -> list[tuple[int, int]]:
    """[start, end) position bins covering 0..length-1, BINS_PER_OCTAVE per doubling of (position + 1)."""
    octaves = math.log2(length)
    edges = sorted({0, length} | {round(2 ** (k / BINS_PER_OCTAVE)) - 1 for k in range(int(octaves * BINS_PER_OCTAVE))})
    return list(zip(edges[:-1], edges[1:], strict=True))


def binned_positions(runs: list[tuple[str, dict]]) -> pd.DataFrame:
    """Per (L_train, PE, bin) at each run's longest length: token-weighted mean loss per run, then mean and std
    over seeds. Columns: train_len, pe, bin_start, bin_end, mean_nll, std_nll, seeds, tokens."""
    per_run = []
    for run_dir, results in runs:
        file = os.path.join(run_dir, POSITIONS_FILE)
        if not os.path.exists(file):
            continue
        frame = pd.read_csv(file, keep_default_na=False)
        frame = frame[frame.length == frame.length.max()]
        meta = results["meta"]
        frame = frame[~frame.scaling.isin(redundant_in(results))]
        for scaling, curve in frame.groupby("scaling", sort=False):
            for start, end in log_bins(int(curve.position.max()) + 1):
                in_bin = curve[(curve.position >= start) & (curve.position < end)]
                tokens = int(in_bin["count"].sum())
                per_run.append(
                    {
                        "train_len": table_len(meta),
                        "pe": label(meta, scaling or None),
                        "bin_start": start,
                        "bin_end": end,
                        "nll": (in_bin.mean_nll * in_bin["count"]).sum() / tokens if tokens else math.nan,
                        "tokens": tokens,
                    }
                )
    if not per_run:
        return pd.DataFrame()
    grouped = pd.DataFrame(per_run).groupby(["train_len", "pe", "bin_start", "bin_end"], sort=False)  # sweep order
    binned = grouped.agg(
        mean_nll=("nll", "mean"), std_nll=("nll", "std"), seeds=("nll", "count"), tokens=("tokens", "sum")
    ).reset_index()
    binned["std_nll"] = binned.std_nll.fillna(0.0)
    return binned


@styled
def plot_positions(binned: pd.DataFrame, families: dict[str, str], path: str) -> None:
    """Mean loss per log-spaced position bin at the longest evaluated length, one line per PE (mean over seeds): a
    row of panels per L_train, split by PE family as ``plot_lengths`` splits."""
    plt = _pyplot()
    panels = []  # (L_train, rows, family or "")
    for train_len, of_train_len in binned.groupby("train_len", sort=True):
        pes = list(of_train_len.pe.unique())
        if len(pes) > FAMILY_PANELS_ABOVE:
            for family in families_of(pes, families):
                panels.append((train_len, [pe for pe in pes if families.get(pe, OTHER_FAMILY) == family], family))
        else:
            panels.append((train_len, pes, ""))
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.6 * columns, 5.8 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (train_len, pes, family) in zip(axes.flat, panels, strict=False):
        styles = row_styles(pes)
        for pe in pes:
            curve = binned[(binned.train_len == train_len) & (binned.pe == pe)]
            center = ((curve.bin_start + 1) * curve.bin_end) ** 0.5  # geometric middle, in 1-based positions
            ax.plot(center, curve.mean_nll, ms=3, lw=1, label=pe, **styles[pe])
        _mark_train_len(ax, train_len)
        ax.set(
            xscale="log",
            xlabel="position in window (1-based; 4 bins per octave)",
            ylabel="mean loss in bin (nats)",
        )
        ax.set_title((f"{family}: " if family else "") + f"at the longest L_eval, L_train {train_len}")
        _legend_below(ax, len(pes))
    shown = [ax for ax in axes.flat if ax.has_data()]
    low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
    for ax in shown:
        ax.set_ylim(low, high)
    _save_figure(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: str) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    _pyplot().close(fig)  # pyplot keeps every figure until it is closed


def report(folders: list[str], out: str) -> str:
    """Write table.{md,tex,csv}, ppl_vs_length.png / accuracy_vs_length.png (text / probes), per_position.{png,csv},
    for second stages extension.png and adaptation.{png,csv}, and, for passkey, passkey_depth.{png,csv} into
    ``out``; return the Markdown."""
    runs, incomplete = find_runs(folders)
    if not runs:
        first = f"; {incomplete[0][0]}: {incomplete[0][1]}" if incomplete else ""
        raise SystemExit(
            f"error: no complete {RESULTS_FILE} under {', '.join(folders)}"
            + (
                f" ({len(incomplete)} incomplete runs{first}{', ...' if len(incomplete) > 1 else ''})"
                if incomplete
                else ""
            )
        )
    frame = collect(runs)
    tables = summarize(frame)
    markdown = to_markdown(tables) + "\n" + same_as_note(runs) + hardware_note(machines(runs))
    if incomplete:
        markdown += (
            "\nIncomplete or failed runs (not in the table):\n\n"
            + "\n".join(f"- `{run}`: {why}" for run, why in incomplete)
            + "\n"
        )
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "table.md"), markdown)
    write_atomic(os.path.join(out, "table.tex"), to_latex(tables))
    write_atomic(os.path.join(out, "table.csv"), to_csv(frame, tables))
    families = dict(zip(frame.pe, frame.family, strict=True))
    for name, metrics in (("ppl_vs_length.png", ("ppl",)), ("accuracy_vs_length.png", ACCURACIES)):
        chosen = {key: table for key, table in tables.items() if key.metric in metrics}
        if chosen:
            plot_lengths(chosen, families, os.path.join(out, name))
    binned = binned_positions(runs)
    if len(binned):
        write_atomic(os.path.join(out, "per_position.csv"), binned.to_csv(index=False, float_format="%.6f"))
        plot_positions(binned, families, os.path.join(out, "per_position.png"))
    if any(STAGE_MARK in pe for key, table in tables.items() if not key.task for pe in table.index):
        plot_extension(tables, os.path.join(out, "extension.png"))
    adapted = adaptation(runs)
    if len(adapted):
        write_atomic(os.path.join(out, "adaptation.csv"), adapted.to_csv(index=False, float_format="%.4f"))
        plot_adaptation(adapted, os.path.join(out, "adaptation.png"))
    depths = passkey_depths(runs)
    if len(depths):
        write_atomic(os.path.join(out, "passkey_depth.csv"), depths.to_csv(index=False, float_format="%.4f"))
        plot_depths(depths, os.path.join(out, "passkey_depth.png"))
    return markdown


def passkey_depths(runs: list[tuple[str, dict]]) -> pd.DataFrame:
    """Passkey's exact match per (L_train, PE, depth bucket, L_eval), mean and std over seeds. Columns: train_len,
    pe, depth (the bucket's lower edge), length, mean, std, seeds, answers."""
    records = [
        {
            "train_len": table_len(results["meta"]),
            "pe": label(results["meta"], row["scaling"]),
            "depth": row["depth"],
            "length": row["length"],
            "exact_match": row["exact_match"],
            "answers": row["answers"],
        }
        for _, results in runs
        for row, counted in shown_rows(results)
        if row.get("depth") is not None and counted
    ]
    if not records:
        return pd.DataFrame()
    grouped = pd.DataFrame(records).groupby(["train_len", "pe", "depth", "length"], sort=False)
    depths = grouped.agg(
        mean=("exact_match", "mean"),
        std=("exact_match", "std"),
        seeds=("exact_match", "count"),
        answers=("answers", "sum"),
    ).reset_index()
    depths["std"] = depths["std"].fillna(0.0)
    return depths


@styled
def plot_depths(depths: pd.DataFrame, path: str) -> None:
    """Passkey's depth x length grid: exact match (mean over seeds) per cell, one panel per (L_train, PE)."""
    plt = _pyplot()
    panels = list(depths.groupby(["train_len", "pe"], sort=False))
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, ((train_len, pe), grid) in zip(axes.flat, panels, strict=False):
        grid = grid.pivot(index="depth", columns="length", values="mean").sort_index(ascending=False)
        image = ax.imshow(100 * grid.to_numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(grid.columns)), [str(n) for n in grid.columns], fontsize=7)
        ax.set_yticks(range(len(grid.index)), [f"{d:.1f}" for d in grid.index], fontsize=7)
        ax.set(xlabel="L_eval", ylabel="passkey depth (from)", title=f"{pe}, L_train = {train_len}")
    fig.colorbar(image, ax=axes, label="exact match %", shrink=0.8)
    _save_figure(fig, path)


def unwritable(out: str) -> str | None:
    """Why tables and plots cannot be written into the folder ``out`` (which need not exist yet), or None."""
    folder = out
    while not os.path.exists(folder):  # the nearest existing folder: where ``out`` would be created
        folder = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{folder}: {e.strerror or type(e).__name__}"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lenext-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="multirun folder(s) or run folders holding results.json")
    parser.add_argument("--out", help="where to write tables and plots (default: <first folder>/report)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.folders[0], "report")
    problem = unwritable(out)
    if problem:
        raise SystemExit(f"error: --out={out!r} cannot hold the report ({problem}): give a folder you can write to")
    try:
        markdown = report(args.folders, out)
    except OSError as e:  # the disk filled, a folder vanished: each file already written is whole (atomic writes)
        raise SystemExit(f"error: the report could not be written to {out!r}: {e}") from None
    print(markdown)
    print(f"tables and plots: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
