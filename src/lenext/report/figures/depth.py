"""Depth x length heatmaps, a file per protocol with depth rows (``passkey_depth.png``, ``niah_single_depth.png``)."""

import pandas as pd

from lenext.report.figures.drawing import fit_height, grid, wrapped
from lenext.report.figures.registry import figure
from lenext.report.figures.style import HEATMAP, row_info
from lenext.report.figures.takeaways import coverage
from lenext.report.stats import METRICS, Summary, Table


@figure("*_depth.png")
def depth_heatmaps(summary: Summary):
    """Each protocol's depth x length grid (``Summary.depths``: passkey's, each haystack protocol's), in a file of
    its own, ``<name>_depth.png`` (the probe's task, else the protocol): its headline metric (exact match for
    passkey, rank accuracy for a haystack), mean over seeds, per cell, one panel per (L_train, row), in a
    colour-blind-safe map; the title gives the table's value (over every depth's answers) at the shortest
    and longest length, the suptitle how many answers a cell holds."""
    depths = summary.depths
    if depths.empty:
        return None
    info = row_info(summary)
    return {
        f"{name}_depth.png": depth_heatmap(summary, info, name, grids)
        for name, grids in depths.groupby("name", sort=False)
    }


def depth_heatmap(summary: Summary, info: pd.DataFrame, name: str, depths: pd.DataFrame):
    """One protocol's depth grids (``depth_heatmaps``)."""
    metric_name = depths.metric.iloc[0]
    metric = METRICS[metric_name]
    probe = depths.protocol.iloc[0] != name  # a probe's depths are buckets (their lower edge); a haystack's exact
    panels = list(depths.groupby(["train_len", "label"], sort=False))
    columns = min(4, len(panels))
    width = 3.2
    fig, axes = grid(len(panels), columns, width, 3.0)
    drawn = {(train_len, label) for (train_len, label), _ in panels}
    tables = [
        (table, [label for label in table.index if (key.train_len, label) in drawn])
        for key, table in summary.tables.items()
        if (key.task or key.protocol) == name and key.metric == metric_name
    ]
    note, _ = coverage(tables, info) if tables else ("", {})
    low, high = depths.answers.min(), depths.answers.max()
    held = (
        f"; a cell holds {int(low) if low == high else f'{int(low)}-{int(high)}'} answers (all seeds)"
        if pd.notna(low) and low
        else ""
    )
    fig.suptitle(
        wrapped(
            note.replace("mean ± std", f"{metric.name}, mean")
            + f"{held}; in a title, the table's value (every depth's answers) at the shortest and the longest L_eval",
            width * columns * 1.1,
        ),
        fontsize=9,
        color="0.25",
    )
    for ax, ((train_len, label), cells) in zip(axes.flat, panels, strict=False):
        grid_cells = cells.pivot(index="depth", columns="length", values="mean").sort_index(ascending=False)
        shown = metric.scale * grid_cells.to_numpy()
        image = ax.imshow(shown, vmin=0, vmax=100 if metric.percent else None, cmap=HEATMAP, aspect="auto")
        ax.set_xticks(range(len(grid_cells.columns)), [str(n) for n in grid_cells.columns], fontsize=8)
        ax.set_yticks(
            range(len(grid_cells.index)), [f"{d:.{1 if probe else 2}f}" for d in grid_cells.index], fontsize=8
        )
        by_length = metric.scale * table_values(tables, train_len, label, cells)
        shortest, longest = by_length.index[0], by_length.index[-1]
        ax.set(xlabel="L_eval", ylabel=f"{name} depth (from)" if probe else "needle depth")
        ax.set_title(
            wrapped(f"{label}, L_train {train_len}", width)
            + "\n"
            + (
                f"{by_length[shortest]:.0f}% at {shortest} → {by_length[longest]:.0f}% at {longest}"
                if longest != shortest
                else f"{by_length[shortest]:.0f}% at {shortest}; no values beyond"
            ),
            fontsize=9,
        )
    chance = depths.chance.dropna().unique()
    bar = fig.colorbar(image, ax=axes, label=metric.name + (" (line: chance)" if len(chance) else ""), shrink=0.8)
    for level in chance:
        bar.ax.axhline(metric.scale * level, color="0.1", lw=1.5)
    fit_height(fig)
    return fig


def table_values(tables: list[tuple[Table, list[str]]], train_len: int, label: str, cells: pd.DataFrame) -> pd.Series:
    """A depth grid's value per L_eval as its table gives it (over every depth's answers, not a mean of the depths,
    whose answers differ in number); where the table lacks the cell, the grid's answer-weighted mean."""
    weighted = (cells["mean"] * cells.answers).groupby(cells.length).sum() / cells.answers.groupby(cells.length).sum()
    table = next((table for table, _ in tables if table.key.train_len == train_len), None)
    if table is None:
        return weighted
    cell = {length: table.cell(label, length) for length in weighted.index}
    return pd.Series(
        {length: weighted[length] if c is None else float(c["mean"]) for length, c in cell.items()}, dtype=float
    )
