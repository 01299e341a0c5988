"""Mean loss per position bin at the longest evaluated length (``per_position.png``)."""

import pandas as pd

from lenext.protocols import PROTOCOLS
from lenext.report.figures.drawing import (
    Drawn,
    fit_height,
    legend_below,
    mark_train_len,
    panel_grid,
    reference,
    title,
    title_lines,
)
from lenext.report.figures.panels import split_rows
from lenext.report.figures.registry import figure
from lenext.report.figures.style import line_styles, row_info
from lenext.report.figures.takeaways import seed_marks
from lenext.report.stats import Summary


@figure("per_position.png")
def per_position(summary: Summary):
    """Mean loss per log-spaced position bin at the longest evaluated length (mean over seeds), a section per
    L_train split as ``draw_lengths`` splits; the title names the rows with the lowest and the highest loss in the
    last bin, with their rise from L_train (``positions_takeaway``)."""
    binned = summary.positions
    if binned.empty:
        return None
    info = row_info(summary)
    sections = []
    several = binned.train_len.nunique() > 1
    for train_len, of_train_len in binned.groupby("train_len", sort=True):
        labels = list(of_train_len.label.unique())
        section = []
        for panel in split_rows(info, labels):
            curves = {label: of_train_len[of_train_len.label == label] for label in panel.labels}
            drawn = Drawn(panel, (train_len, curves), {})
            drawn.holds = f"L_train {train_len} · {panel.holds}" if several else panel.holds
            drawn.takeaway = positions_takeaway(curves, train_len, reference(info, panel))
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
            section.append(drawn)
        sections.append(section)
    note, marks = seed_marks(binned.groupby("label").seeds.max(), "mean")
    lengths = binned.groupby(["train_len", "label"]).length.max()
    for section in sections:
        for drawn in section:
            of = lengths[drawn.context[0]]
            longest = max(of[label] for label in drawn.panel.labels)
            drawn.names = {  # a row that stops short (learned, at its table) was scored on other windows' text
                label: label + marks.get(label, "") + (f" (L_eval {of[label]})" if of[label] < longest else "")
                for label in drawn.panel.labels
            }
    at = "" if several else f", L_train {binned.train_len.iloc[0]} (dotted line)"
    windows = "/".join(name for name, protocol in PROTOCOLS.items() if protocol.per_position)
    note = (
        f"loss per bin of positions (4 bins per octave) in {windows} windows of each row's longest L_eval{at}; {note}"
    )
    fig, placed = panel_grid(sections, note)
    for ax, drawn in placed:
        train_len, curves = drawn.context
        styles = line_styles(info, drawn.panel.labels, drawn.panel.by_method)
        for label, curve in curves.items():
            center = ((curve.bin_start + 1) * curve.bin_end) ** 0.5  # geometric middle, in 1-based positions
            ax.plot(center, curve.mean_nll, ms=3, lw=1.2, label=drawn.names[label], **styles[label])
        mark_train_len(ax, train_len)
        stage_lens = {int(info.stage_len[label]) for label in curves if pd.notna(info.stage_len.get(label))}
        longest = max(int(curve.bin_end.max()) for curve in curves.values())
        for stage_len in sorted(stage_lens - {train_len}):
            if stage_len <= longest:
                mark_train_len(ax, stage_len, f"L' {stage_len}")
        ax.set(xscale="log", xlabel="position in window (1-based)", ylabel="mean loss in bin (nats)")
        ax.xaxis.set_major_formatter(plain_number())
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    shown = [ax for ax, _ in placed if ax.has_data()]
    low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
    for ax in shown:
        ax.set_ylim(low, high)
    fit_height(fig)
    return fig


def plain_number():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: f"{value:g}")


def positions_takeaway(curves: dict[str, pd.DataFrame], train_len: int, reference: str | None = None) -> str:
    """The rows with the lowest and the highest loss in the last bin (``reference`` in place of the highest where a
    panel compares one PE's variants), each with its rise, in nats, from its loss over the bins within L_train that
    end in its upper half (token-weighted: positions with about as much context, and more tokens than one bin; the
    title names the positions they span)."""
    end, rise, last, spans = {}, {}, 0, {}
    for label, curve in curves.items():
        within = curve[(curve.bin_end <= train_len) & (curve.bin_end > train_len // 2)]
        if within.empty or curve.bin_end.iloc[-1] <= train_len:
            continue
        end[label] = curve.mean_nll.iloc[-1]
        rise[label] = end[label] - (within.mean_nll * within.tokens).sum() / within.tokens.sum()
        last = max(last, int(curve.bin_end.iloc[-1]))
        spans[label] = f"from positions {int(within.bin_start.min())}-{int(within.bin_end.max()) - 1}"
    if not end:
        return "no position beyond L_train"
    end = pd.Series(end)
    best, worst = end.idxmin(), end.idxmax()
    if reference in end.index and reference != best:
        worst = reference
    text = f"last bin (to position {last}): {best} {end[best]:.2f} nats ({rise[best]:+.2f} {spans[best]})"
    return text + (f"; {worst} {end[worst]:.2f} ({rise[worst]:+.2f})" if worst != best else "")
