"""Tables (Markdown, LaTeX, CSV): renderers over the statistics of ``lenext.report.stats``."""

import math

import pandas as pd

from lenext.pe.rope import SAME_AS
from lenext.report.load import LEARNED_AT, Loaded, metrics_of
from lenext.report.stats import METRICS, NOT_LEARNED, Table, TableKey, seed_range

NOT_SEPARABLE = "~"
NOT_TESTED = "†"
MARKDOWN = {"pm": "±", "bold": "**{}**", "not_separable": f" {NOT_SEPARABLE}", "not_tested": f" {NOT_TESTED}"}
LATEX = {"pm": "$\\pm$", "bold": "\\textbf{{{}}}", "not_separable": " $\\sim$", "not_tested": " $^\\dagger$"}


def title(key: TableKey) -> str:
    """A table's heading, e.g. "L_train = 64, protocol `nonoverlap`"; a probe's table starts with its task."""
    return (f"{key.task}, " if key.task else "") + f"L_train = {key.train_len}, protocol `{key.protocol}`"


def several_metrics(key: TableKey) -> bool:
    """Whether the table's protocol has tables of other metrics (a probe's; key tokens'; a haystack's): the
    LaTeX comment then names the metric, as the Markdown heading always does."""
    return bool(key.task) or len(metrics_of(key.protocol)) > 1


def what_a_table_shows(table: Table, seeds: str) -> str:
    """The parenthesis of a table's heading: the metric, its chance level where it has one, what a cell's mean
    covers (``seeds``; "" where no cell has a value), and which cell is bold (none for a metric without a
    direction)."""
    metric = table.metric
    chance = "".join(f", chance {c * metric.scale:.{metric.digits}f}%" for c in table.chance)
    marked = f"{table.unranked}: no best marked" if table.unranked else "best per column in bold"
    if not seeds:  # every cell without a value (no key token at any length)
        return f"{metric.name}{chance}: no value at any length"
    return f"{metric.name}{chance}, mean +- std over {seeds}; {marked}"


def cell_text(table: Table, label: str, length: int, marks: dict) -> str:
    """A cell as shown: mean (± std with several seeds), ``~`` when not separable from the best, ``†`` when not
    tested in a table that tests others (it or the best has one seed), the best bold; ``n/a``, ``not learned`` or
    ``-`` for a row without a value, "" where the row has no results at that length."""
    cell = table.cell(label, length)
    if cell is None:
        return ""
    if cell.status != "ok":  # "-": a length without windows, or a row without a value (no key token at L_train)
        return {"not applicable": "n/a", NOT_LEARNED: NOT_LEARNED}.get(cell.status, "-")
    metric = table.metric
    mean, std = cell["mean"] * metric.scale, cell["std"] * metric.scale
    text = f"{mean:.{metric.digits}f}" + (f" {marks['pm']} {std:.{metric.digits}f}" if cell.n > 1 else "")
    if pd.notna(cell.separable) and not cell.separable:
        text += marks["not_separable"]
    elif cell.untested:
        text += marks["not_tested"]
    return marks["bold"].format(text) if cell.best else text


def number(value, digits=0) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def marks_legend(table: Table) -> str:
    """What a ranked table's marks mean ("" for a metric without a direction), as its Markdown says under the heading
    and its LaTeX in a comment."""
    _, most = seed_range(table)
    if not table.ranked or not most:
        return ""
    if most == 1:
        return "One seed: no difference is tested for significance (that needs >= 2 seeds)."
    return (
        f"{NOT_SEPARABLE}: not separable from the column's best (means within 2 std, or paired differences over seeds "
        "of both signs)."
        + (
            f" {NOT_TESTED}: not tested (a cell is tested only when it and the best both have >= 2 seeds)."
            if table.cells.untested.any()
            else ""
        )
    )


def to_markdown(tables: dict[TableKey, Table]) -> str:
    parts = []
    for key, table in tables.items():
        lengths = table.lengths
        fewest, most = seed_range(table)
        seeds = f"{most} seed{'s' if most != 1 else ''}" if fewest == most else f"{fewest}-{most} seeds"
        seeds = seeds if most else ""
        parts.append(f"### {title(key)} ({what_a_table_shows(table, seeds)})\n")
        if legend := marks_legend(table):
            parts.append(legend + "\n")
        head = ["PE", *[f"{n}" for n in lengths], "train tok/s", "eval peak MB"]
        parts.append("| " + " | ".join(head) + " |")
        parts.append("|" + "---|" * len(head))
        for label, row in table.rows.iterrows():
            cells = [cell_text(table, label, n, MARKDOWN) for n in lengths]
            extra = [number(row.train_tokens_per_s), number(row.eval_peak_mem_mb)]
            parts.append("| " + " | ".join([label, *cells, *extra]) + " |")
        parts.append("")
        if len(table.not_learned):
            parts.append(not_learned_note(table.not_learned))
    return "\n".join(parts)


def not_learned_note(runs: pd.DataFrame) -> str:
    """The runs that did not learn their task at their own training length, with their exact match there, under a
    probe's table."""
    by_row: dict[str, list[str]] = {}
    for row, seed, accuracy, at in runs.itertuples(index=False):
        by_row.setdefault(row, []).append(f"seed {seed}: {100 * accuracy:.1f}% at {at}")
    listed = "; ".join(f"{row} ({', '.join(seeds)})" for row, seeds in by_row.items())
    return (
        f"Not learned at their training length (exact match below {100 * LEARNED_AT:.0f}% there; kept out of every "
        f"column beyond it, `{NOT_LEARNED}` where no seed learned): {listed}.\n"
    )


def same_as_note(variants: list[str]) -> str:
    """One line naming the variants the tables' rows also stand for: asked for, equal by construction to another
    asked one, so neither evaluated nor shown twice."""
    if not variants:
        return ""
    stands_for = "; ".join(f"`{SAME_AS[name]}` rows also stand for `{name}`" for name in variants)
    return (
        f"{stands_for}: equal by construction (both take their factor from the span of a forward pass's "
        "positions: dynamic NTK's L / C is NTK's), so neither evaluated nor shown twice.\n\n"
    )


def untempered_note(labels: tuple[str, ...]) -> str:
    """One line naming the temperature rows left out: c fitted to 0 in every seed, so equal to the rows as trained."""
    if not labels:
        return ""
    named = ", ".join(f"`{label}`" for label in labels)
    return (
        f"{named}: the temperature's c was fitted to 0 in every seed (beta = 1), so each equals its row as trained: "
        "not shown twice.\n\n"
    )


def one_token_note(tasks: list[str]) -> str:
    """One line naming the probes whose per-token accuracy is not tabled: one token per answer makes it the exact
    match."""
    if not tasks:
        return ""
    return f"{'; '.join(tasks)}: one token per answer, so per-token accuracy is the exact match: not shown twice.\n\n"


def _listed(counts: dict[str, int]) -> str:
    return "; ".join(f"{name} ({n} run{'s' if n != 1 else ''})" for name, n in counts.items())


def hardware_note(trained: dict[str, int], evaluated_only: dict[str, int]) -> str:
    """Under the tables: where the runs lenext trained were made, and whether their speeds can be compared; then
    where models it did not train were evaluated (they have no training speed, so they are no second machine)."""
    if len(trained) > 1:
        note = (
            f"Runs made on {len(trained)} machines: {_listed(trained)}. `train tok/s` averages over them: it is not a "
            "speed comparison between PEs (`make bench` is).\n"
        )
    else:
        note = f"Runs made on {next(iter(trained))}.\n" if trained else ""
    if evaluated_only:
        note += f"Models lenext did not train (`eval.py hf=`) evaluated on {_listed(evaluated_only)}.\n"
    return note


def report_markdown(tables: dict[TableKey, Table], loaded: Loaded) -> str:
    """``table.md``: the tables, then what the rows also stand for, where the runs were made, and the results files
    not in the tables (incomplete or failed runs; repeats of a counted run)."""
    markdown = (
        to_markdown(tables)
        + "\n"
        + same_as_note(loaded.merged_variants)
        + untempered_note(loaded.untempered)
        + one_token_note(loaded.one_token_tasks)
        + hardware_note(loaded.machines, loaded.evaluation_machines)
    )
    if loaded.incomplete:
        markdown += (
            "\nIncomplete or failed runs, and files left out (not in the tables or figures):\n\n"
            + "\n".join(f"- `{run}`: {why}" for run, why in loaded.incomplete)
            + "\n"
        )
    if loaded.repeats:
        markdown += (
            "\nRepeats (the settings and seed of a run in the table: counted once):\n\n"
            + "\n".join(f"- `{run}` repeats `{counted}`" for run, counted in loaded.repeats)
            + "\n"
        )
    return markdown


LATEX_SPECIAL = {c: "\\" + c for c in "&%$#_{}"} | {"~": "\\textasciitilde{}", "^": "\\textasciicircum{}"}
LATEX_SPECIAL["\\"] = "\\textbackslash{}"


def latex_label(label: str) -> str:
    """A row label as LaTeX sets it: its special characters escaped (a setting's value may hold any), a second
    stage's ``->`` an arrow (its ``>`` prints as an inverted question mark in the default font)."""
    return "".join(LATEX_SPECIAL.get(c, c) for c in label).replace(" -> ", " $\\to$ ")


def to_latex(tables: dict[TableKey, Table]) -> str:
    parts = []
    for key, table in tables.items():
        lengths = table.lengths
        parts += [
            f"% {title(key).replace('`', '')}" + (f", {METRICS[key.metric].name}" if several_metrics(key) else ""),
            *(f"% Bold: the column's best. {line}" for line in [marks_legend(table)] if line),
            "\\begin{tabular}{l" + "r" * len(lengths) + "}",
            "\\toprule",
            "PE & " + " & ".join(str(n) for n in lengths) + " \\\\",
            "\\midrule",
        ]
        for label in table.index:
            cells = [cell_text(table, label, n, LATEX) for n in lengths]
            parts.append(latex_label(label) + " & " + " & ".join(cells) + " \\\\")
        parts += ["\\bottomrule", "\\end{tabular}", ""]
    return "\n".join(parts)


def to_csv(tables: dict[TableKey, Table]) -> str:
    """One line per cell: the table's key, the row label (``pe``), the length and the cell's statistics, with the
    row's training throughput and peak evaluation memory."""
    parts = []
    for key, table in tables.items():
        cells = table.cells.join(table.rows, on="label").reset_index()
        cells = cells.rename(columns={"label": "pe", "separable": "separable_from_best"})
        cells["order"] = cells.pe.map({label: i for i, label in enumerate(table.index)})
        parts.append(cells.sort_values(["length", "order"]).assign(**key._asdict()))
    columns = ["task", "train_len", "protocol", "metric", "pe", "length", "mean", "std", "n", "status", "best"]
    columns += ["separable_from_best", "train_tokens_per_s", "eval_peak_mem_mb"]
    return pd.concat(parts)[columns].to_csv(index=False)
