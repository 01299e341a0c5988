"""Attention diagnostics (docs/diagnostics.md): a panel per statistic against L_eval, and each against perplexity."""

import numpy as np
import pandas as pd

from lenext.report.figures.drawing import (
    Drawn,
    bounded_error,
    error_curve,
    fit_height,
    legend_below,
    length_axis,
    mark_train_len,
    panel_grid,
    title,
    title_lines,
    value_axis,
)
from lenext.report.figures.panels import Panel, split_rows
from lenext.report.figures.registry import figure
from lenext.report.figures.style import SECOND_STAGE, line_styles, row_info
from lenext.report.figures.takeaways import seed_marks, times_train_len
from lenext.report.stats import Summary, perplexity_ratio

# Attention diagnostics (docs/diagnostics.md): a panel per statistic, (statistic, rows, what it shows, y label).
DIAGNOSTIC_PANELS = (
    ("normalized_entropy", "all", "attention entropy / log n", "entropy / log n"),
    ("entropy", "all", "attention entropy", "entropy (nats)"),
    ("sink", "all", "attention on the first token (sink)", "weight on token 0"),
    ("distance", "all", "mean attention distance", "distance (tokens)"),
    ("beyond", "all", "attention mass at distances >= L_train", "weight at i - j >= L_train"),
    (
        "beyond",
        "beyond_train",
        "attention mass at distances >= L_train, rows i >= L_train",
        "weight at i - j >= L_train",
    ),
    ("copying_gain", "", "copying gain: NLL drop on a repeat L/2 back", "gain (nats per token)"),
    ("unseen_fraction", "", "rotary PEs: distances at unseen angles", "fraction of distances 0..L-1"),
)
# The values each diagnostic can take: shares of attention in [0, 1], entropies and distances >= 0.
DIAGNOSTIC_BOUNDS = {
    "normalized_entropy": (0.0, 1.0),
    "entropy": (0.0, np.inf),
    "sink": (0.0, 1.0),
    "distance": (0.0, np.inf),
    "beyond": (0.0, 1.0),
    "unseen_fraction": (0.0, 1.0),
}
COPYING_LEVEL = 0.1  # nats per token: a gain below it at every length is no in-context copying


@figure("diagnostics.png")
def diagnostics(summary: Summary):
    """The runs' attention diagnostics (``Summary.diagnostics``, from ``<run>/diagnostics/diagnostics.json``), a
    panel per statistic (``DIAGNOSTIC_PANELS``: entropy, normalized entropy, sink mass, mean distance, mass beyond
    L_train over all rows and over the rows i >= L_train, the copying gain, the unseen-angle fraction of rotary
    PEs) against L_eval, mean +- std over seeds of each run's mean over layers and heads, a curve per row label in
    its PE's colour, the rows split as ``split_rows`` splits them (at most ``MAX_CURVES`` a panel), a section per
    L_train; the title names the highest and the lowest row at the longest L_eval with their change from L_train
    (``diagnostic_takeaway``). None when no run has diagnostics."""
    frame = summary.diagnostics
    if frame.empty:
        return None
    info = row_info(summary)
    several = frame.train_len.nunique() > 1
    sections = []
    for train_len, of_train_len in frame.groupby("train_len", sort=True):
        section, shown = [], set()
        for panel in split_rows(info, list(of_train_len.label.unique())):
            for statistic, rows, what, ylabel in DIAGNOSTIC_PANELS:
                data = of_train_len[
                    (of_train_len.statistic == statistic)
                    & (of_train_len.rows == rows)
                    & of_train_len.label.isin(panel.labels)
                ]
                labels = [label for label in panel.labels if label in set(data.label)]
                if data.empty or (statistic, rows, frozenset(labels)) in shown:  # a statistic only some rows have
                    continue
                shown.add((statistic, rows, frozenset(labels)))
                drawn = Drawn(Panel(labels, panel.by_method, panel.holds), (train_len, statistic, data, ylabel), {})
                drawn.holds = f"{what} · " + (f"L_train {train_len} · " if several else "") + panel.holds
                drawn.takeaway = diagnostic_takeaway(data, labels, train_len, statistic)
                drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
                section.append(drawn)
        sections.append(section)
    note, marks = seed_marks(frame.groupby("label").seeds.max(), "mean ± std")
    at = "" if several else f"L_train {frame.train_len.iloc[0]} (dotted line); "
    note = (
        f"attention diagnostics ({at}docs/diagnostics.md): each run's mean over layers and heads of a statistic "
        f"averaged over its windows' query rows, then {note}; copying gain: a window's first half repeated, the "
        "same tokens' NLL the first time minus at the repeat"
    )
    for section in sections:
        for drawn in section:
            drawn.names = {label: label + marks.get(label, "") for label in drawn.panel.labels}
    fig, placed = panel_grid(sections, note)
    for ax, drawn in placed:
        train_len, statistic, data, ylabel = drawn.context
        styles = line_styles(info, drawn.panel.labels, drawn.panel.by_method)
        bounds = DIAGNOSTIC_BOUNDS.get(statistic, (-np.inf, np.inf))
        for label in drawn.panel.labels:
            curve = data[data.label == label].sort_values("length")
            error_curve(ax, curve.length, curve["mean"], curve["std"], drawn.names[label], styles[label], bounds)
        if statistic == "copying_gain":
            ax.axhline(0, color="0.45", lw=0.8, zorder=0)
        mark_train_len(ax, train_len)
        length_axis(ax, sorted(data.length.unique()))
        value_axis(ax, float(data["mean"].min()), float(data["mean"].max()), log=False, bounds=bounds)  # linear
        ax.set(xlabel="L_eval (tokens)", ylabel=ylabel)
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


@figure("diagnostics_vs_ppl.png")
def diagnostics_vs_ppl(summary: Summary):
    """Which diagnostic goes with perplexity leaving its L_train level: a panel per statistic of
    ``DIAGNOSTIC_PANELS``, at the longest L_eval it has a correlation at, each row with diagnostics a point (its PE's
    colour and marker): the statistic's mean over seeds against its ``nonoverlap`` perplexity ratio
    ppl(L_eval) / ppl(L_train) (``perplexity_ratio``); the title gives Spearman's rank correlation across the rows
    (``Summary.diagnostic_correlations``). None without correlations."""
    from matplotlib.ticker import MaxNLocator

    correlations = summary.diagnostic_correlations
    if correlations.empty:
        return None
    info, frame = row_info(summary), summary.diagnostics
    sections = []
    for train_len, of_train_len in correlations.groupby("train_len", sort=True):
        section = []
        for statistic, rows, what, xlabel in DIAGNOSTIC_PANELS:
            found = of_train_len[(of_train_len.statistic == statistic) & (of_train_len.rows == rows)]
            if found.empty:
                continue
            found = found.loc[found.length.idxmax()]
            longest = int(found.length)
            ratio = perplexity_ratio(summary.tables, int(train_len), longest)
            data = frame[
                (frame.train_len == train_len)
                & (frame.statistic == statistic)
                & (frame.rows == rows)
                & (frame.length == longest)
                & frame.label.isin(ratio.index)
            ].dropna(subset=["mean"])
            labels = list(data.label)
            drawn = Drawn(Panel(labels, False, what), (statistic, data, ratio, xlabel, train_len, longest), {})
            drawn.holds = f"{what} at {times_train_len(longest, train_len)}"
            order = "no order (a constant)" if pd.isna(found.rho) else f"Spearman rho {found.rho:+.2f}"
            drawn.takeaway = f"{order} with the perplexity ratio over {int(found.labels)} rows"
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
            drawn.names = {label: label for label in labels}
            section.append(drawn)
        sections.append(section)
    note = (
        "each row's diagnostic (mean over seeds of its mean over layers and heads, docs/diagnostics.md) against its "
        "perplexity at that L_eval over its perplexity at L_train (nonoverlap, as trained, mean over seeds); rho: "
        "Spearman's rank correlation across the rows, +1 when the statistic orders them as their perplexity's "
        "growth does"
    )
    fig, placed = panel_grid(sections, note)
    for ax, drawn in placed:
        statistic, data, ratio, xlabel, train_len, longest = drawn.context
        styles = line_styles(info, drawn.panel.labels, False)
        bounds = DIAGNOSTIC_BOUNDS.get(statistic, (-np.inf, np.inf))
        for label in drawn.panel.labels:
            value = data[data.label == label]
            style = {k: v for k, v in styles[label].items() if k != "ls"}
            if styles[label]["ls"] == SECOND_STAGE:  # a second stage has its base's colour: hollow, as dashed lines
                style["mfc"] = "none"
            ax.errorbar(
                value["mean"],
                [ratio[label]],
                xerr=bounded_error(value["mean"], value["std"], bounds),
                ms=6,
                capsize=2,
                ls="none",
                label=label,
                **style,
            )
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.axhline(1, color="0.45", lw=0.8, zorder=0)
        shown = ratio[drawn.panel.labels]
        value_axis(ax, min(shown.min(), 1.0), max(shown.max(), 1.0))
        ax.set(xlabel=xlabel, ylabel=f"ppl at {times_train_len(longest, train_len)} / at L_train")
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


def diagnostic_takeaway(data: pd.DataFrame, labels: list[str], train_len: int, statistic: str) -> str:
    """What a diagnostics panel shows at the longest L_eval its rows have values at: the highest and the lowest row
    (or the one row), each with its change from its value at L_train where it has one; for the copying gain, that no
    row copies (below ``COPYING_LEVEL`` at every length) where none does, else the copy's distance (L/2)."""
    data = data[data.label.isin(labels)]
    if data.empty:
        return "no values"
    digits = 1 if statistic == "distance" else 2 if statistic.startswith("copying") else 3
    if statistic == "copying_gain" and data["mean"].max() < COPYING_LEVEL:
        return f"no row gains {COPYING_LEVEL} nats per token on a repeat at any L_eval: no in-context copying"
    longest = int(data.length.max())
    at = times_train_len(longest, train_len)
    if statistic == "copying_gain":
        at += f" (copy {longest // 2} back)"
    last = data[data.length == longest].set_index("label")["mean"].reindex(labels).dropna()
    base = data[data.length == train_len].set_index("label")["mean"]

    def shown(label: str) -> str:
        text = f"{label} {last[label]:.{digits}f}"
        if label in base.index and longest != train_len:
            text += f" ({last[label] - base[label]:+.{digits}f} from L_train)"
        return text

    if len(last) == 1:
        return f"at {at}: {shown(last.index[0])}"
    highest, lowest = last.idxmax(), last.idxmin()
    if round(last[highest], digits) == round(last[lowest], digits):
        return f"at {at}: every row at {last[highest]:.{digits}f}"
    return f"at {at}: highest {shown(highest)}; lowest {shown(lowest)}"
