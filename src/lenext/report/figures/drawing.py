"""Drawing: curves with their spread, axes, the L_train mark, legends, titles, grids of panels, and the panels of a
metric against L_eval (``draw_lengths``) that several figures draw."""

import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lenext.report.figures.panels import Panel, split_rows
from lenext.report.figures.registry import pyplot
from lenext.report.figures.style import AXES_HEIGHT, COLUMNS, PANEL_WIDTH, line_styles, row_info
from lenext.report.figures.takeaways import coverage, lengths_takeaway, unlearned_seeds
from lenext.report.load import metrics_of
from lenext.report.stats import Summary, Table, seed_mean, seed_std


def bounded_error(mean, std, bounds: tuple[float, float]) -> np.ndarray:
    """The (lower, upper) lengths of +- std bars cut at the values the quantity can take (``bounds``), so that
    no bar reaches past 100% or below a perplexity of 1."""
    mean, std = np.asarray(mean, dtype=float), np.asarray(std, dtype=float)
    low, high = bounds
    return np.stack([np.clip(np.minimum(std, mean - low), 0, None), np.clip(np.minimum(std, high - mean), 0, None)])


def error_curve(ax, x, mean, std, label: str, style: dict, bounds=(-np.inf, np.inf)) -> None:
    """One row's curve: its mean with +- std bars cut at ``bounds``, in the line style every figure of the
    report shares."""
    ax.errorbar(x, mean, yerr=bounded_error(mean, std, bounds), ms=4, lw=1.5, capsize=2, label=label, **style)


def draw_rows(
    ax, table: Table, labels: list[str], styles: dict, scale: float = 1.0, names: dict | None = None, unlearned=None
):
    """Each row's mean +- std over seeds against L_eval (``names``: its legend entry, where not its label). A row
    with seeds that did not learn its task (``unlearned``: label -> seeds), which the table counts up to L_train
    only: its line over the other seeds at every length, the table's mean at L_train a hollow marker, so that the
    line does not join two sets of seeds."""
    lengths = table.lengths
    for label in labels:
        cells = table.cells.xs(label, level="label").reindex(lengths)
        mean, std = cells["mean"].astype(float), cells["std"].astype(float).fillna(0)
        name = (names or {}).get(label, label)
        excluded = (unlearned or {}).get(label)
        if excluded:
            seeds = table.seeds.xs(label, level="label")
            kept = seeds[~seeds.index.get_level_values("seed").isin(excluded)].groupby(level="length")
            every = mean[cells.n > kept.size().reindex(lengths).fillna(0)]  # where the table counts them all
            ax.plot(
                every.index,
                every * scale,
                ls="none",
                marker=styles[label]["marker"],
                mfc="none",
                ms=6,
                color=styles[label]["color"],
            )
            mean = kept.agg(seed_mean).reindex(lengths)
            std = kept.agg(seed_std).reindex(lengths).fillna(0)
        error_curve(ax, lengths, mean * scale, std * scale, name, styles[label], table.metric.bounds)


def length_axis(ax, lengths: list) -> None:
    """A log axis of evaluation lengths, ticked at the lengths evaluated, in plain numbers."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xticks(lengths, [f"{n:g}" for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())


def plain_log_values(ax) -> None:
    """A log axis of values labelled in plain numbers (30, 50, 100, 200), not powers of ten; every tick labelled
    where those would leave fewer than two labels in view (values from 700 to 770: 700, 800)."""
    from matplotlib.ticker import FuncFormatter

    def shown(value: float) -> bool:
        return f"{value:g}"[0] in "1235"

    def minor(value: float, _) -> str:
        low, high = sorted(ax.get_ylim())
        ticks = [t for t in [*ax.yaxis.get_majorticklocs(), *ax.yaxis.get_minorticklocs()] if low <= t <= high]
        return f"{value:g}" if shown(value) or sum(map(shown, ticks)) < 2 else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def value_axis(ax, low: float, high: float, log: bool = True, bounds=(-np.inf, np.inf)) -> None:
    """The y axis for values from ``low`` to ``high``: log with plain labels where they span more than x3 (and
    ``log``), else linear in plain numbers (no offset, no scientific notation), at least 2% of the value tall, so
    that a near-constant curve reads as constant, and within ``bounds`` (the values the quantity can take)."""
    if log and low > 0 and high / low > 3:
        ax.set_yscale("log")
        plain_log_values(ax)
        return
    middle, span = (low + high) / 2, high - low
    if span < 0.02 * abs(middle):
        span = 0.02 * abs(middle) or 1.0
        floor, ceiling = bounds
        bottom = min(max(middle - span, floor), max(ceiling - 2 * span, floor))
        ax.set_ylim(bottom, min(bottom + 2 * span, ceiling))
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)


def mark_train_len(ax, train_len: int, label: str = "L_train", top: bool = True) -> None:
    """A dotted line at ``train_len``, named at the top of the panel (``top``; else at its bottom: where curves of
    accuracy are not)."""
    ax.axvline(train_len, color="0.55", ls=":", lw=1.2, zorder=0)
    ax.annotate(
        label,
        (train_len, 1 if top else 0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12 if top else 4),
        textcoords="offset points",
        fontsize=8,
        color="0.35",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5},
    )


def mark_chance(ax, level: float) -> None:
    """A grey dash-dot line at a metric's chance ``level`` (as shown: in %), named at the panel's right."""
    ax.axhline(level, color="0.45", ls="-.", lw=1.1, zorder=0)
    ax.annotate(
        f"chance {level:.0f}%",
        (1, level),
        xycoords=("axes fraction", "data"),
        xytext=(-3, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="0.35",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5},
    )


def legend_columns(names: list[str], width: float = PANEL_WIDTH) -> int:
    """Legend columns that fit a panel ``width`` inches wide (9-point text)."""
    room = int(width * 72 / (9 * 0.56))
    longest = max((len(name) for name in names), default=1) + 6
    return max(1, min(len(names), 3, room // longest))


def legend_below(ax) -> None:
    """The panel's legend below its axes, in as many columns as fit its width."""
    names = ax.get_legend_handles_labels()[1]
    if names:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=legend_columns(names), frameon=False)


def share_log_scale(axes) -> None:
    """One value scale across the log-scaled panels that have data: they compare at a glance."""
    shown = [ax for ax in axes if ax.has_data() and ax.get_yscale() == "log"]
    if len(shown) > 1:
        low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
        for ax in shown:
            ax.set_ylim(low, high)


def wrapped(text: str, width: float = PANEL_WIDTH) -> str:
    """``text`` in lines that fit a panel ``width`` inches wide (10-point text)."""
    return "\n".join(textwrap.wrap(text, int(width * 72 / (10 * 0.62)), break_on_hyphens=False))


def title(ax, holds: str, takeaway: str, width: float = PANEL_WIDTH) -> None:
    """A panel's title: what it holds, then what it shows."""
    ax.set_title(wrapped(holds, width) + "\n" + wrapped(takeaway, width), fontsize=10)


@dataclass
class Drawn:
    """A panel to draw: its rows and how, and the lines its title and legend take (for the figure's height)."""

    panel: Panel
    context: object  # what the drawing function needs (a table, an L_train, ...)
    names: dict
    holds: str = ""
    takeaway: str = ""
    title_lines: int = 2


def grid(panels: int, columns: int, width: float, height: float, **options):
    """A figure of ``panels`` axes, ``columns`` to a row, each ``width`` x ``height`` inches; unused axes hidden.
    Returns (figure, axes as a 2-D array)."""
    rows = -(-panels // columns)
    fig, axes = pyplot().subplots(
        rows, columns, figsize=(width * columns, height * rows), squeeze=False, layout="constrained", **options
    )
    for ax in axes.flat[panels:]:
        ax.axis("off")
    return fig, axes


def panel_grid(sections: list[list[Drawn]], note: str, width: float = PANEL_WIDTH, axes_height: float = AXES_HEIGHT):
    """A figure of ``sections`` of panels, each section starting a row of at most ``COLUMNS``, each row as tall as
    its longest title and legend need; ``note`` above. Returns (figure, [(axes, drawn)])."""
    rows = [section[start : start + COLUMNS] for section in sections for start in range(0, len(section), COLUMNS)]
    columns = max(len(row) for row in rows)
    heights = []
    for row in rows:
        title_lines = max(drawn.title_lines for drawn in row)
        legend_lines = max(
            math.ceil(len(drawn.names) / legend_columns(list(drawn.names.values()), width)) for drawn in row
        )
        heights.append(axes_height + 0.18 * title_lines + 0.19 * legend_lines + 0.85)
    note = wrapped(note, width * columns * 1.1)
    top = 0.2 + 0.17 * (note.count("\n") + 1)
    fig, axes = pyplot().subplots(
        len(rows),
        columns,
        figsize=(width * columns, sum(heights) + top),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    fig.suptitle(note, fontsize=9, color="0.25")
    placed = []
    for row, row_axes in zip(rows, axes, strict=True):
        for ax in row_axes[len(row) :]:
            ax.axis("off")
        placed += list(zip(row_axes, row, strict=False))
    return fig, placed


def fit_height(fig) -> None:
    """Draw ``fig`` until every legend and title lies inside it, growing it where one does not: the layout makes
    room for the legends below the axes from where they were at its last run, which moves them."""
    for _ in range(4):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
        boxes += [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
        if not boxes:
            return
        below = -min(box.y0 for box in boxes) / fig.dpi
        above = max(box.y1 for box in boxes) / fig.dpi - fig.get_figheight()
        if below <= 0 and above <= 0:
            return
        fig.set_figheight(fig.get_figheight() + max(below, 0) + max(above, 0) + 0.05)


def title_lines(holds: str, takeaway: str) -> int:
    return wrapped(holds).count("\n") + wrapped(takeaway).count("\n") + 2


def draw_lengths(summary: Summary, tables: list[Table], pes_as_trained: bool = True):
    """The metric against L_eval, mean +- std over seeds, L_train marked, the legend below each panel: a section
    of panels per table, its rows split by ``split_rows``; one value scale across a table's panels."""
    info = row_info(summary)
    sections, drawn_tables = [], []
    for table in tables:
        panels = split_rows(info, list(table.index), pes_as_trained)
        drawn_tables += [(table, panel.labels) for panel in panels]
        sections.append([Drawn(panel, table, {}) for panel in panels])
    note, marks = coverage(drawn_tables, info)
    train_lens = {table.key.train_len for table in tables}
    if len(train_lens) == 1:
        note = f"L_train {train_lens.pop()} (dotted line); {note}"
    for section in sections:
        for drawn in section:
            table = drawn.context
            drawn.names = {label: label + marks.get((table.key, label), "") for label in drawn.panel.labels}
            drawn.holds = f"{table_name(table, not note.startswith('L_train'))} · {drawn.panel.holds}"
            drawn.takeaway = lengths_takeaway(table, drawn.panel.labels, reference(info, drawn.panel))
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
    if any(pd.notna(info.base.get(label)) for table in tables for label in table.index):
        note += "; solid: the first stage's weights (as trained or scaled at evaluation), dashed: fine-tuned"
    if any(table.chance for table in tables):
        note += "; chance level: grey dash-dot line"
    fig, placed = panel_grid(sections, note)
    by_table: dict = {}
    for ax, drawn in placed:
        table, panel = drawn.context, drawn.panel
        key, metric = table.key, table.metric
        styles = line_styles(info, panel.labels, panel.by_method)
        unlearned = {label: unlearned_seeds(table, info, label) for label in panel.labels}
        draw_rows(ax, table, panel.labels, styles, metric.scale, drawn.names, unlearned)
        mark_train_len(ax, key.train_len, top=not metric.percent)
        stage_lens = {int(info.stage_len[label]) for label in panel.labels if pd.notna(info.stage_len.get(label))}
        for stage_len in sorted(stage_lens - {key.train_len}):
            if stage_len > max(table.lengths):
                continue
            mark_train_len(ax, stage_len, f"L' {stage_len}", top=not metric.percent)
        for chance in table.chance:
            mark_chance(ax, chance * metric.scale)
        length_axis(ax, table.lengths)
        ax.set(xlabel="L_eval (tokens)", ylabel=metric.name)
        if not table.cells.loc[panel.labels, "mean"].notna().any():  # no key token at any length: an empty frame
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no values", transform=ax.transAxes, ha="center", va="center", color="0.35")
        elif metric.percent:  # a share: 0-100%, linear; perplexity: log
            ax.set_ylim(-3, 103)
        else:
            ax.set_yscale("log")
            plain_log_values(ax)
            by_table.setdefault(key, []).append(ax)
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    for axes in by_table.values():
        share_log_scale(axes)
    fit_height(fig)
    return fig


def reference(info: pd.DataFrame, panel: Panel) -> str | None:
    """The row a panel of one PE's variants compares them with: the PE as trained."""
    if not panel.by_method:
        return None
    trained = [label for label in panel.labels if pd.isna(info.base[label]) and pd.isna(info.variant[label])]
    return trained[0] if trained else None


def table_name(table: Table, train_len: bool = True) -> str:
    """What a table holds in a few words: its task and metric (a probe's) or protocol, and its L_train."""
    key = table.key
    if key.task:
        what = f"{key.task}, {table.metric.short_name}"
    else:  # a protocol of several metrics (key tokens, a haystack) names the table's
        what = key.protocol + (f", {table.metric.short_name}" if len(metrics_of(key.protocol)) > 1 else "")
    return f"{what}, L_train {key.train_len}" if train_len else what
