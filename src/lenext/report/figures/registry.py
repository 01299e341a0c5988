"""The figure registry: ``@figure`` registers a function of the ``Summary`` under the file it writes; ``write_figures``
draws every registered figure in ``FIGURE_STYLE`` into the report's folder."""

import os
from collections.abc import Callable

from lenext.files import atomic_path
from lenext.report.stats import Summary

FIGURES: dict[str, Callable] = {}  # file name (or pattern) -> function(Summary) -> figure(s) or None, in drawing order
FIGURE_STYLE = {  # legible at README width: three panels to a row of at most 12.6 inches, text >= 9 pt
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "figure.titlesize": 10,
}
FIGURE_DPI = 120


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
            for file, drawn in drawn_files(name, draw(summary)):
                with atomic_path(os.path.join(out, file), suffix=os.path.splitext(file)[1]) as tmp:
                    drawn.savefig(tmp, dpi=FIGURE_DPI)
                plt.close(drawn)  # pyplot keeps every figure until it is closed
                written.append(file)
    return written


def drawn_files(name: str, drawn) -> list[tuple[str, object]]:
    """(file name, figure) for what a registered figure returned: nothing for None, its registered ``name`` for a
    figure, and for a figure registered under a pattern (``*_depth.png``: one file per protocol) each of the
    {file name: figure} it returned."""
    if drawn is None:
        return []
    return list(drawn.items()) if isinstance(drawn, dict) else [(name, drawn)]
