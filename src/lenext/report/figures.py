"""Figures: renderers over the report's ``Summary``, in a registry.

A figure is a function of the ``Summary`` that returns a matplotlib figure, or None when the runs have nothing it
draws, registered under its file name by ``@figure("<name>.png")`` (docs/adding/figure.md).
``write_figures`` draws every registered figure in ``FIGURE_STYLE`` and saves it into the report's folder.
"""

import os
from collections.abc import Callable

import pandas as pd

from lenext.files import atomic_path
from lenext.pe import FAMILIES
from lenext.report.load import ACCURACIES, OTHER_FAMILY
from lenext.report.stats import Summary, Table

FIGURES: dict[str, Callable] = {}  # file name -> function(Summary) -> matplotlib figure or None, in drawing order
FIGURE_STYLE = {"font.size": 10, "axes.titlesize": 10.5, "legend.fontsize": 9}  # legible at README width
FIGURE_DPI = 120
FAMILY_PANELS_ABOVE = 7  # rows in a table beyond which a figure splits each table into family panels
# A PE's rows share its colour; its variants (scalings, second stages) differ by line style.
LINE_STYLES = ("-", "--", ":", "-.", (0, (1, 3)), (0, (6, 2, 1, 2, 1, 2)), (0, (9, 3)), (0, (3, 1, 1, 1, 1, 1)))
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def figure(name: str):
    """Register the decorated function as the figure written to ``name`` in the report's folder."""

    def register(draw: Callable) -> Callable:
        FIGURES[name] = draw
        return draw

    return register


def pyplot():
    """matplotlib.pyplot, drawing to files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figures(summary: Summary, out: str) -> list[str]:
    """Draw every registered figure the runs have something for and save it into ``out``; the names written."""
    import matplotlib

    plt = pyplot()
    written = []
    for name, draw in FIGURES.items():
        with matplotlib.rc_context(FIGURE_STYLE):
            drawn = draw(summary)
            if drawn is None:
                continue
            with atomic_path(os.path.join(out, name), suffix=os.path.splitext(name)[1]) as tmp:
                drawn.savefig(tmp, dpi=FIGURE_DPI)
            plt.close(drawn)  # pyplot keeps every figure until it is closed
        written.append(name)
    return written


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


def row_styles(roots: pd.Series) -> dict[str, dict]:
    """Per row label (``roots``' index), matplotlib line settings: the colour of its root (the first-stage row it
    descends from), a line style and marker per row of that root."""
    colours = list(dict.fromkeys(roots))
    seen: dict[str, int] = {}
    styles = {}
    for label, root in roots.items():
        seen[root] = seen.get(root, -1) + 1
        variant = seen[root] % len(LINE_STYLES)
        styles[label] = {
            "color": f"C{colours.index(root) % 10}",
            "ls": LINE_STYLES[variant],
            "marker": MARKERS[variant],
        }
    return styles


def roots_of(summary: Summary, labels) -> pd.Series:
    """The root of each of ``labels`` (a label the tables lack is its own)."""
    return pd.Series({label: summary.labels.root.get(label, label) for label in labels}, dtype=object)


def families_of(labels, family: pd.Series) -> list[str]:
    """The PE families of rows ``labels`` (``family``: label -> family), in ``FAMILIES``' order, others after."""
    named = {family[label] for label in labels}
    return [f for f in FAMILIES if f in named] + sorted(named - set(FAMILIES))


def draw_rows(ax, table: Table, labels: list[str], styles: dict, scale: float = 1.0) -> None:
    """Each row's mean +- std over seeds against L_eval."""
    lengths = table.lengths
    for label in labels:
        cells = table.cells.xs(label, level="label").reindex(lengths)
        mean, std = cells["mean"].astype(float), cells["std"].astype(float).fillna(0)
        ax.errorbar(lengths, mean * scale, yerr=std * scale, ms=3.5, lw=1.4, capsize=2, label=label, **styles[label])


def length_axis(ax, lengths: list) -> None:
    """A log axis of evaluation lengths, ticked at the lengths evaluated, in plain numbers."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xticks(lengths, [f"{n:g}" for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())


def plain_log_values(ax) -> None:
    """A log axis of values labelled in plain numbers (30, 50, 100, 200), not powers of ten."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "235" else ""))


def mark_train_len(ax, train_len: int) -> None:
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


def legend_below(ax, entries: int) -> None:
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=1 + (entries > 4) + (entries > 12),
        frameon=False,
    )


def share_log_scale(axes) -> None:
    """One value scale across the log-scaled panels that have data: families compare at a glance."""
    shown = [ax for ax in axes if ax.has_data() and ax.get_yscale() == "log"]
    if len(shown) > 1:
        low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
        for ax in shown:
            ax.set_ylim(low, high)


def draw_lengths(summary: Summary, tables: list[Table]):
    """The metric against L_eval, mean +- std over seeds, each PE in its colour and its variants in line styles,
    the legend below the data: a row of panels per table, a panel per PE family (``FAMILIES``) when a table has
    more rows than ``FAMILY_PANELS_ABOVE``, else a panel per table (three to a row)."""
    family = summary.labels.family
    if max(len(table.index) for table in tables) > FAMILY_PANELS_ABOVE:
        present = families_of([label for table in tables for label in table.index], family)
        columns = len(present)
        panels = [
            (table, [label for label in table.index if family[label] == name], name)
            for table in tables
            for name in present
        ]
    else:
        columns = min(3, len(tables))
        panels = [(table, list(table.index), "") for table in tables]
    fig, axes = grid(len(panels), columns, 4.6, 5.0)
    for ax, (table, drawn, name) in zip(axes.flat, panels, strict=False):
        key, metric = table.key, table.metric
        draw_rows(ax, table, drawn, row_styles(roots_of(summary, drawn)), metric.scale)
        mark_train_len(ax, key.train_len)
        length_axis(ax, table.lengths)
        ax.set(
            yscale="linear" if metric.higher_is_better else "log",
            xlabel="L_eval (tokens)",
            ylabel=metric.name,
            title=(f"{name}: " if name else "")
            + (f"{key.task}, {metric.name.split(' ')[0]}" if key.task else key.protocol)
            + f", L_train {key.train_len}",
        )
        if metric.higher_is_better:
            ax.set_ylim(-2, 102)
        else:
            plain_log_values(ax)
        if drawn:
            legend_below(ax, len(drawn))
    for row in axes:
        share_log_scale(row)
    return fig


@figure("ppl_vs_length.png")
def ppl_vs_length(summary: Summary):
    """Perplexity against L_eval (text runs), log-log, L_train marked: ``draw_lengths``."""
    tables = [table for key, table in summary.tables.items() if key.metric == "ppl"]
    return draw_lengths(summary, tables) if tables else None


@figure("accuracy_vs_length.png")
def accuracy_vs_length(summary: Summary):
    """Probes: exact match and per-token accuracy (%) against L_eval, a panel per (task, metric)."""
    tables = [table for key, table in summary.tables.items() if key.metric in ACCURACIES]
    return draw_lengths(summary, tables) if tables else None


@figure("per_position.png")
def per_position(summary: Summary):
    """Mean loss per log-spaced position bin at the longest evaluated length, one line per row (mean over seeds):
    a row of panels per L_train, split by PE family as ``draw_lengths`` splits."""
    binned = summary.positions
    if binned.empty:
        return None
    family = pd.Series({label: summary.labels.family.get(label, OTHER_FAMILY) for label in binned.label.unique()})
    panels = []  # (L_train, labels, family or "")
    for train_len, of_train_len in binned.groupby("train_len", sort=True):
        labels = list(of_train_len.label.unique())
        if len(labels) > FAMILY_PANELS_ABOVE:
            for name in families_of(labels, family):
                panels.append((train_len, [label for label in labels if family[label] == name], name))
        else:
            panels.append((train_len, labels, ""))
    fig, axes = grid(len(panels), min(3, len(panels)), 5.6, 5.8)
    for ax, (train_len, labels, name) in zip(axes.flat, panels, strict=False):
        styles = row_styles(roots_of(summary, labels))
        for label in labels:
            curve = binned[(binned.train_len == train_len) & (binned.label == label)]
            center = ((curve.bin_start + 1) * curve.bin_end) ** 0.5  # geometric middle, in 1-based positions
            ax.plot(center, curve.mean_nll, ms=3, lw=1, label=label, **styles[label])
        mark_train_len(ax, train_len)
        ax.set(
            xscale="log",
            xlabel="position in window (1-based; 4 bins per octave)",
            ylabel="mean loss in bin (nats)",
        )
        ax.set_title((f"{name}: " if name else "") + f"at the longest L_eval, L_train {train_len}")
        legend_below(ax, len(labels))
    shown = [ax for ax in axes.flat if ax.has_data()]
    low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
    for ax in shown:
        ax.set_ylim(low, high)
    return fig


@figure("extension.png")
def extension(summary: Summary):
    """Second stages in the ``nonoverlap`` table (else each text table holding them), perplexity against L_eval,
    mean +- std over seeds. A PE with zero-shot scalings gets two panels, its base and those scalings, then its
    base and each method after fine-tuning, a method in one colour in both (PI is ``linear``); the PEs without any
    share one panel, each in its colour. Fine-tuned rows are solid, the others dashed."""
    labels = summary.labels
    staged = [table for key, table in summary.tables.items() if not key.task and labels.base[table.index].notna().any()]
    if not staged:
        return None
    panels = []  # (table, labels, title, colour of a label)
    for table in [table for table in staged if table.key.protocol == "nonoverlap"] or staged:
        rows = labels.loc[table.index]
        later = rows.base.notna()
        plain = []
        for root in dict.fromkeys(rows.root[later]):
            of_root = rows.root == root
            zero_shot = list(rows.index[of_root & ~later])
            tuned = list(rows.index[of_root & (later | rows.variant.isna())])
            if len(zero_shot) == 1:
                plain += tuned
                continue
            methods = list(dict.fromkeys(rows.extension_method[zero_shot + tuned]))
            colour = {label: f"C{methods.index(rows.extension_method[label]) % 10}" for label in zero_shot + tuned}
            panels.append((table, zero_shot, f"{root}, zero-shot", colour))
            panels.append((table, tuned, f"{root}, after fine-tuning", colour))
        if plain:
            roots = list(dict.fromkeys(rows.root[plain]))
            colour = {label: f"C{roots.index(rows.root[label]) % 10}" for label in plain}
            panels.append((table, plain, "the other PEs: base and direct fine-tuning", colour))
    fig, axes = grid(len(panels), min(2, len(panels)), 6.4, 5.6, sharey=True)
    for ax, (table, drawn, title, colour) in zip(axes.flat, panels, strict=False):
        styles = {
            label: {
                "color": colour[label],
                "ls": "-" if pd.notna(labels.base[label]) else "--",
                "marker": "o" if pd.notna(labels.base[label]) else "s",
            }
            for label in drawn
        }
        draw_rows(ax, table, drawn, styles)
        mark_train_len(ax, table.key.train_len)
        length_axis(ax, table.lengths)
        ax.set(yscale="log", xlabel="L_eval (tokens)", ylabel="perplexity")
        plain_log_values(ax)
        ax.set_title(f"{title} ({table.key.protocol})")
        legend_below(ax, len(drawn))
    return fig


@figure("adaptation.png")
def adaptation(summary: Summary):
    """Validation perplexity against fine-tuning steps, one panel per validation length (the PI paper's figure of
    how fast each method adapts)."""
    frame = summary.adaptation
    if frame.empty:
        return None
    lengths = sorted(frame.val_len.unique())
    fig, axes = grid(len(lengths), len(lengths), 7, 6)
    styles = row_styles(roots_of(summary, frame.row.unique()))
    for ax, length in zip(axes[0], lengths, strict=True):
        for row, curve in frame[frame.val_len == length].groupby("row", sort=False):
            ax.errorbar(curve.step, curve["mean"], yerr=curve["std"], ms=3, capsize=2, label=row, **styles[row])
        ax.set(yscale="log", xlabel="fine-tuning step", ylabel=f"validation perplexity at L = {length}")
        ax.set_title(f"second stages validating at their training length {length}")
        legend_below(ax, frame[frame.val_len == length].row.nunique())
    return fig


@figure("passkey_depth.png")
def passkey_depth(summary: Summary):
    """Passkey's depth x length grid: exact match (mean over seeds) per cell, one panel per (L_train, row)."""
    depths = summary.depths
    if depths.empty:
        return None
    panels = list(depths.groupby(["train_len", "label"], sort=False))
    fig, axes = grid(len(panels), min(4, len(panels)), 4, 3.4)
    for ax, ((train_len, label), cells) in zip(axes.flat, panels, strict=False):
        cells = cells.pivot(index="depth", columns="length", values="mean").sort_index(ascending=False)
        image = ax.imshow(100 * cells.to_numpy(), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(cells.columns)), [str(n) for n in cells.columns], fontsize=7)
        ax.set_yticks(range(len(cells.index)), [f"{d:.1f}" for d in cells.index], fontsize=7)
        ax.set(xlabel="L_eval", ylabel="passkey depth (from)", title=f"{label}, L_train = {train_len}")
    fig.colorbar(image, ax=axes, label="exact match %", shrink=0.8)
    return fig
