"""The example figure of docs/adding/figure.md (shown there between the section markers)."""

# --8<-- [start:figure]
from lenext.report.figures.registry import pyplot
from lenext.report.figures.style import pe_colour


def longest_length(summary):
    """Perplexity at each text table's longest L_eval, a bar per row (mean +- std over seeds), in its PE's colour
    (the same in every figure)."""
    tables = [table for key, table in summary.tables.items() if key.metric == "ppl"]
    if not tables:
        return None  # nothing to draw for these runs: no file is written
    fig, axes = pyplot().subplots(1, len(tables), figsize=(5 * len(tables), 6), squeeze=False, layout="constrained")
    for ax, table in zip(axes[0], tables, strict=True):
        longest = table.lengths[-1]
        cells = table.cells.xs(longest, level="length").reindex(table.index)  # the table's rows, in its order
        colours = [pe_colour(root) for root in summary.labels.root[cells.index]]
        ax.barh(cells.index, cells["mean"], xerr=cells["std"], color=colours)
        ax.invert_yaxis()  # the first row on top, as in the table
        ax.set(xlabel=f"perplexity at L_eval = {longest}", title=f"{table.key.protocol}, L_train {table.key.train_len}")
    return fig


# --8<-- [end:figure]
