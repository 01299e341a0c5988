"""Second stages: perplexity against L_eval beside their bases (``extension.png``), and their validation curves
during fine-tuning (``adaptation.png``)."""

from collections import Counter
from dataclasses import replace

import pandas as pd

from lenext.report.figures.drawing import (
    Drawn,
    draw_lengths,
    error_curve,
    fit_height,
    legend_below,
    panel_grid,
    title,
    title_lines,
    value_axis,
)
from lenext.report.figures.panels import Panel, by_family, chunks
from lenext.report.figures.registry import figure
from lenext.report.figures.style import line_styles, roots_of, row_info
from lenext.report.figures.takeaways import seed_marks
from lenext.report.stats import METRICS, Summary


@figure("extension.png")
def extension(summary: Summary):
    """Second stages in the ``nonoverlap`` table (else each text table holding them), perplexity against L_eval,
    mean +- std over seeds: the rows of each PE fine-tuned, split as ``split_rows`` splits them (a PE with variants
    or several methods: its zero-shot variants, then its stages by length and positions, coloured by method, PI
    as ``linear``; the PEs with one stage each beside their bases, coloured by PE)."""
    labels = summary.labels
    staged = [
        table
        for key, table in summary.tables.items()
        if key.metric == "ppl" and not key.task and labels.base[table.index].notna().any()
    ]
    if not staged:
        return None
    tables = []
    for table in [table for table in staged if table.key.protocol == "nonoverlap"] or staged:
        rows = labels.loc[table.index]
        fine_tuned = set(rows.root[rows.base.notna()])
        kept = [label for label in table.index if rows.root[label] in fine_tuned]
        tables.append(replace(table, cells=table.cells.loc[kept], rows=table.rows.loc[kept]))  # unranked kept
    return draw_lengths(summary, tables, pes_as_trained=False)


@figure("adaptation.png")
def adaptation(summary: Summary):
    """Validation perplexity against fine-tuning steps (the PI paper's figure of how fast each method adapts), the
    panels of each validation length side by side: a PE's several stages coloured by method, the PEs with one
    stage each coloured by PE; the title names the lowest and highest at the first step shown (0, before
    fine-tuning, in runs that logged it) and how far apart they end."""
    frame = summary.adaptation
    if frame.empty:
        return None
    info = row_info(summary)
    section = []  # few panels: side by side
    several_bases = frame.train_len.nunique() > 1
    for (train_len, length), of_length in frame.groupby(["train_len", "val_len"]):
        rows = list(of_length.row.unique())
        roots = roots_of(summary, rows)
        several = [root for root, n in Counter(roots).items() if n > 1]
        panels = [
            Panel(part, True, f"{root}'s second stages")
            for root in several
            for part in chunks([[row] for row in roots.index[roots == root]])
        ]
        single = [[row] for row in rows if roots[row] not in several]
        if single:
            panels += by_family(info, single, "one second stage each", merge=True)
        for panel in panels:
            curves = {row: of_length[of_length.row == row] for row in panel.labels}
            drawn = Drawn(panel, (length, curves), {})
            drawn.holds = (
                f"{panel.holds} · {f'L_train = {train_len}, ' if several_bases else ''}validating at L = {length}"
            )
            drawn.takeaway = adaptation_takeaway(curves)
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
            section.append(drawn)
    note, marks = seed_marks(frame.groupby("row").seeds.max(), "mean ± std")
    for drawn in section:
        drawn.names = {
            row: row + marks.get(row, "") + fewer_seeds_mark(frame[frame.row == row]) for row in drawn.panel.labels
        }
    note += "; a stage validates at its own training length (L' at full length, L_train for PoSE)"
    fig, placed = panel_grid([section], note)
    for ax, drawn in placed:
        _, curves = drawn.context
        styles = line_styles(info, drawn.panel.labels, drawn.panel.by_method)
        for row, curve in curves.items():
            error_curve(
                ax, curve.step, curve["mean"], curve["std"], drawn.names[row], styles[row], METRICS["ppl"].bounds
            )
        values = pd.concat([curve["mean"] for curve in curves.values()])
        value_axis(ax, float(values.min()), float(values.max()), bounds=METRICS["ppl"].bounds)
        ax.set(xlabel="fine-tuning step", ylabel="validation perplexity")
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


def fewer_seeds_mark(curve: pd.DataFrame) -> str:
    """What a row's legend entry adds where some of its points pool fewer seeds than the rest (a validation some
    seeds did not log, such as step 0 of runs made before it was logged): `` [2 seeds at step 0]``."""
    fewer = curve[curve.seeds < curve.seeds.max()]
    if fewer.empty:
        return ""
    counts = "/".join(str(n) for n in sorted(fewer.seeds.unique()))
    where = f"step {int(fewer.step.iloc[0])}" if len(fewer) == 1 else f"{len(fewer)} of its steps"
    return f" [{counts} seed{'s' * (counts != '1')} at {where}]"


def adaptation_takeaway(curves: dict[str, pd.DataFrame]) -> str:
    """The lowest and highest validation perplexity at the first step every curve logged, and their spread at the
    last such step (each curve's first and last where they share none); or that every curve is at one value (to two
    decimals)."""
    steps = [set(curve.step) for curve in curves.values()]
    shared = sorted(set.intersection(*steps))
    start, end = (shared[0], shared[-1]) if shared else (min(map(min, steps)), max(map(max, steps)))

    def at(step, fallback: int) -> pd.Series:
        return pd.Series(
            {
                row: curve["mean"][curve.step == step].iloc[0] if shared else curve["mean"].iloc[fallback]
                for row, curve in curves.items()
            }
        )

    first, last = at(start, 0), at(end, -1)
    start, end = int(start), int(end)
    every = pd.concat([curve["mean"] for curve in curves.values()])
    if round(every.min(), 2) == round(every.max(), 2):
        return f"every curve at {every.min():.2f} from step {start} on: validation does not tell them apart"
    if len(curves) == 1:
        return f"{first.index[0]} {first.iloc[0]:.2f} at step {start}, {last.iloc[0]:.2f} at step {end}"
    best, worst = first.idxmin(), first.idxmax()
    spread = last.max() - last.min()
    apart = f"{spread:.2f} apart" if spread >= 0.01 else "within 0.01"
    lowest = f"{best} lowest at step {start} ({first[best]:.2f})"
    return f"{lowest}, {worst} highest ({first[worst]:.2f}); {apart} at step {end}"
