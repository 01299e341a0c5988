"""The metric against L_eval, a figure per kind of table: perplexity, the probes' accuracy, retrieval."""

from lenext.report.figures.drawing import (
    draw_lengths,
)
from lenext.report.figures.registry import figure
from lenext.report.stats import Summary, headline


@figure("ppl_vs_length.png")
def ppl_vs_length(summary: Summary):
    """Perplexity against L_eval (text runs), log-log, L_train marked: ``draw_lengths``."""
    tables = [table for key, table in summary.tables.items() if key.metric == "ppl"]
    return draw_lengths(summary, tables) if tables else None


@figure("accuracy_vs_length.png")
def accuracy_vs_length(summary: Summary):
    """Probes: their metrics (exact match and per-token accuracy, %) against L_eval, a section per (task, metric):
    ``draw_lengths``."""
    tables = [table for key, table in summary.tables.items() if key.task]
    return draw_lengths(summary, tables) if tables else None


@figure("retrieval_vs_length.png")
def retrieval_vs_length(summary: Summary):
    """Text protocols whose headline metric is an accuracy (the haystack protocols' rank accuracy, %) against
    L_eval, a section per (L_train, protocol), the chance level drawn as a line: ``draw_lengths``."""
    tables = [
        table
        for key, table in summary.tables.items()
        if not key.task and key.metric == headline(key.protocol) and table.metric.percent and table.ranked
    ]
    return draw_lengths(summary, tables) if tables else None
