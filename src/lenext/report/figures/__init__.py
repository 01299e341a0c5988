"""Figures: renderers over the report's ``Summary``, in a registry.

A figure is a function of the ``Summary`` that returns a matplotlib figure, or None when the runs have nothing it
draws, registered under its file name by ``@figure("<name>.png")`` (docs/adding/figure.md); one drawn once per
protocol registers a pattern (``@figure("*_depth.png")``) and returns {file name: figure} (``drawn_files``).
Which figure draws a table follows its metric: perplexity (log axis), the probes' accuracies, a text protocol's
headline accuracy with its chance level (linear 0-100% axis); a metric without a direction (the key-token share)
is tabled only.
``write_figures`` draws every registered figure in ``FIGURE_STYLE`` and saves it into the report's folder.

A module per figure (``lengths``: the metric against L_eval, ``positions``, ``extension``, ``depth``,
``diagnostics``), beside what they share: the registry (``registry``), colours (``style``), which rows a panel holds
(``panels``), titles computed from the statistics (``takeaways``) and the drawing helpers (``drawing``, with
``draw_lengths``, the panels of the metric against L_eval that several figures draw). Figure modules import from
these, never from one another, and are drawn in the order they are imported here.

What every built-in figure keeps to, so that each panel says one thing:

- **One colour per PE**, the same in every figure and panel of every report: ``style.pe_style`` reads it from a fixed
  list of the known rows (``style.KNOWN_PES``, arranged so that PEs drawn together differ), else from a hash of the
  row's name. A second stage is drawn in its first stage's colour. Two PEs of one panel never share a colour: the
  one later in ``KNOWN_PES`` then takes a colour no PE of the panel has (``style.distinct_colours``).
- **Panels that compare one thing**: the PEs as trained, coloured by PE; one PE's evaluation-time variants and
  second stages, coloured by method (``style.METHOD_STYLES``: RoPE's scalings and the stages' methods, PI as
  ``linear``, the PE as trained in ``style.AS_TRAINED_STYLE``'s blue, in every such panel); or PEs with one second
  stage each beside their bases. A method ``METHOD_STYLES`` does not list takes a colour no other row of its panel
  has. Line style says which weights: solid the first stage's (as trained, or scaled at evaluation), dashed a
  second stage's.
- **At most ``style.MAX_CURVES`` curves a panel**: more rows are split by PE family, by PE, and a PE's rows by
  zero-shot variants and by the stages' length and positions (``panels.split_rows``).
- **A title that states what the panel shows**, computed from the statistics (``takeaways.lengths_takeaway`` and the
  other ``*_takeaway`` functions), under a line saying what it holds; a note above the panels says what a mean covers
  (``takeaways.coverage``), and a legend entry says where a row's seeds differ from it.
- **Colour-blind-safe colours** (Okabe-Ito, with three of Tol's), a colour-blind-safe map for heatmaps
  (``style.HEATMAP``), plain tick labels on log axes, no offset or scientific notation on near-constant ones.
"""

from lenext.report.figures.drawing import draw_rows, grid, legend_below, length_axis, mark_train_len
from lenext.report.figures.registry import FIGURE_DPI, FIGURE_STYLE, FIGURES, drawn_files, figure, pyplot, write_figures
from lenext.report.figures.style import pe_colour, row_styles

# The built-in figures, a module each, registered (and drawn) in this order.
# isort: off
from lenext.report.figures import lengths, positions, extension, depth, diagnostics
# isort: on

__all__ = [
    "depth",
    "diagnostics",
    "extension",
    "lengths",
    "positions",
    "FIGURES",
    "FIGURE_DPI",
    "FIGURE_STYLE",
    "draw_rows",
    "drawn_files",
    "figure",
    "grid",
    "legend_below",
    "length_axis",
    "mark_train_len",
    "pe_colour",
    "pyplot",
    "row_styles",
    "write_figures",
]
