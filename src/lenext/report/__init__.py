"""Results files -> paper-style tables (Markdown, LaTeX, CSV) and plots (PNG).

    lenext-report <multirun dir or run dirs ...> [--out DIR]      (or: python -m lenext.report ...)

Reads every ``results.json`` below the given folders. A row of the table is a PE (RoPE evaluated under another
scaling gets its own row, e.g. ``rope (ntk)``); columns are L_eval; cells are mean +- std over seeds, the best of
each column marked (lowest perplexity; highest accuracy; none when several share it, nor for a metric that
describes rather than scores, as the share of key tokens). One table per (L_train, protocol, metric) for each
metric the protocol declares (``lenext.protocols.METRICS_OF``, its headline first: perplexity; key-token
perplexity and key-token share; a haystack's rank accuracy and exact match), and per (task, L_train, metric) for
the probes' ``accuracy`` rows (exact match, per-token accuracy). A row measured without a value (no key token at
L_train) shows ``-``. Runs without a complete results file are listed, not dropped.

Which runs a mean pools: the seeds of one run description. Runs whose settings differ in anything but the seed
(``meta.identity``, less the seed; older files: what they record) get rows of their own: where they share a row
name, each label adds what tells it apart, `` (eval.py)`` on an eval.py re-evaluation and ``[key=value, ...]`` for
the settings that differ (``t5 [pe.max_distance=64]``; the evaluation's ``eval.*`` settings only when nothing else
differs; ``?`` where a file does not record the setting). A second results file of the same settings and seed is
a repeat of that run: counted once, and listed.

Which orderings are real: two PEs are *separable* at a length when both have >= 2 seeds, their means differ by
more than two standard deviations (|mean_a - mean_b| > 2 max(std_a, std_b), std over seeds) and, over the seeds
both have (same seed = same initialization and training order), the paired differences all have the same sign.
Cells not separable from their column's best are marked ``~``; with one seed nothing can be marked, and the table
says so; where only some rows have one seed, their cells (all of a column whose best has one) are marked ``†``.

Per-position curves (``per_position.png``/``.csv``) use each run's longest evaluated length and average the loss
over log-spaced position bins, because a single position holds only one token per window, far too few to read a
curve from. Bin edges are round(2 ** (k / 4)) in 1-based positions (four bins per octave, duplicate integer edges
dropped, so positions 1..7 get a bin each); a bin's loss is the mean of the positions' losses weighted by their
token counts, then mean and std over seeds.

Attention diagnostics (``diagnostics.csv``/``.png``): where a run folder holds ``diagnostics/diagnostics.json``
(``python diagnose.py ckpt=<run> hydra.run.dir=<run>/diagnostics``), each statistic's mean over layers and heads
per run, then mean and std over seeds per (L_train, row label, statistic, rows, L_eval); runs without are skipped
(``lenext.report.stats.diagnostic_statistics``; docs/diagnostics.md). ``diagnostics_vs_ppl.csv``/``.png``: which
diagnostic goes with perplexity leaving its L_train level, Spearman's rank correlation across rows between each
statistic at an L_eval and the ``nonoverlap`` perplexity ratio ppl(L_eval) / ppl(L_train)
(``lenext.report.stats.diagnostic_correlations``).

The report is data, then pictures: ``load`` reads and normalizes every results file once into ``Run`` objects and
one tidy frame (``lenext.report.load``); ``summarize`` computes the statistics by group-by over it
(``lenext.report.stats``); tables (``lenext.report.tables``) and figures (``lenext.report.figures``, a registry:
``@figure``) render them; ``report`` writes them all (``lenext.report.command``).
"""

from lenext.report.command import main, report, unwritable
from lenext.report.figures import FIGURES, figure, pyplot, row_styles
from lenext.report.load import (
    LEARNED_AT,
    Loaded,
    Run,
    collect,
    extension_method,
    family,
    find_runs,
    load,
    runs_of,
    tidy,
)
from lenext.report.stats import (
    METRICS,
    NOT_LEARNED,
    Summary,
    Table,
    TableKey,
    adaptation,
    binned_positions,
    depth_grids,
    headline,
    log_bins,
    passkey_depths,
    separable,
    summarize,
)

__all__ = [
    "FIGURES",
    "LEARNED_AT",
    "METRICS",
    "NOT_LEARNED",
    "Loaded",
    "Run",
    "Summary",
    "Table",
    "TableKey",
    "adaptation",
    "binned_positions",
    "collect",
    "depth_grids",
    "extension_method",
    "family",
    "figure",
    "find_runs",
    "headline",
    "load",
    "log_bins",
    "main",
    "passkey_depths",
    "pyplot",
    "report",
    "row_styles",
    "runs_of",
    "separable",
    "summarize",
    "tidy",
    "unwritable",
]
