"""Takeaways: what a panel shows, in words computed from the statistics, and what a mean covers (``coverage``)."""

from collections import Counter

import pandas as pd
from scipy.stats import binomtest

from lenext.report.load import LEARNED_AT
from lenext.report.stats import NOT_LEARNED, Table


def times_train_len(length: int, train_len: int) -> str:
    return f"{length // train_len}x L_train" if length % train_len == 0 else f"L_eval {length}"


def lengths_takeaway(table: Table, labels: list[str], reference: str | None = None) -> str:
    """What ``labels``' curves of ``table`` show at the longest length where they have values: for a share in %
    (an accuracy), the highest and the lowest, the chance level where the metric has one, and the rows no seed of
    which learned the task; for perplexity, the row that grows least from its L_train value (``growth``: within 5%
    of it, a rise in percent below 50%, or the factor) and the one that grows most, or where no row has a value at
    L_train (no key token there) or the table ranks none (``Table.ranked``) the lowest and the highest. Where a
    panel compares one PE's variants, ``reference`` (the PE as trained) in place of the worst."""
    key, metric = table.key, table.metric
    means = table.cells["mean"].astype(float)
    shown = means[means.index.get_level_values("label").isin(labels)].dropna()
    if shown.empty:
        return "no values"
    longest = max(shown.index.get_level_values("length"))
    at = times_train_len(longest, key.train_len)
    if metric.percent:
        values = (shown.xs(longest, level="length") * metric.scale).reindex(labels).dropna()
        best, worst = (
            (values.idxmin(), values.idxmax())
            if metric.higher_is_better is False
            else (values.idxmax(), values.idxmin())
        )
        name = metric.short_name
        if values[best] == values[worst]:
            text = f"at {at}: {'every row' if len(values) > 1 else best} at {values[best]:.0f}% {name}"
        else:
            if reference in values.index and reference != best:
                worst = reference
            text = f"at {at}: {best} {values[best]:.0f}% {name}; {worst} {values[worst]:.0f}%"
        text += "".join(f" (chance {c * metric.scale:.0f}%)" for c in table.chance)
        tested = len(table.chance) == 1 and metric.per_answer  # a token share's trials are no answers
        apart = apart_from_chance(table, list(values.index), longest) if tested else None
        if apart == []:  # None: some cell's answers unknown (an older results file)
            text += "; none apart from chance (95% binomial band)"
        status = table.cells.status
        not_learned = [
            label for label in labels if (label, longest) in status.index and status[(label, longest)] == NOT_LEARNED
        ]
        return text + (f"; no seed learned it: {', '.join(not_learned)}" if not_learned else "")
    base = key.train_len if key.train_len in table.lengths else table.lengths[0]
    if longest == base:
        return f"measured at {at} only"
    ratios = {}
    for label in labels:
        if (label, longest) in shown.index and (label, base) in shown.index:
            ratios[label] = shown[(label, longest)] / shown[(label, base)]
    if not ratios or not table.ranked:  # no value at L_train to grow from, or no best to claim: the values
        values = shown.xs(longest, level="length").reindex(labels).dropna()
        best, worst = values.idxmin(), values.idxmax()
        if reference in values.index and reference != best:
            worst = reference
        why = " (no value at L_train)" if not ratios else ""
        text = f"at {at}{why}: {best} {metric.name} {values[best]:.{metric.digits}f}"
        return text + (f"; {worst} {values[worst]:.{metric.digits}f}" if worst != best else "")
    ratios = pd.Series(ratios)
    best, worst = ratios.idxmin(), ratios.idxmax()
    if reference in ratios.index and reference != best:
        worst = reference
    if worst == best:
        return f"at {at}: {best} {growth(ratios[best], metric.name).replace('rises least, ', 'rises ')}"
    return f"at {at}: {best} {growth(ratios[best], metric.name)}; {worst} {ratios[worst]:.1f}x"


def apart_from_chance(table: Table, labels: list[str], length: int) -> list[str] | None:
    """The rows whose share at ``length`` lies outside the 95% band of a binomial at the table's chance level over
    their answers (the seeds' answers pooled): an exact two-sided test at 5%; None where a cell's answers are
    unknown."""
    (chance,) = table.chance
    apart = []
    for label in labels:
        cell = table.cell(label, length)
        if cell is None or pd.isna(cell.answers) or not cell.answers:
            return None
        answers = int(cell.answers)
        if binomtest(round(cell["mean"] * answers), answers, chance).pvalue < 0.05:
            apart.append(label)
    return apart


def growth(ratio: float, noun: str) -> str:
    """How a row's value at a length compares with its value at L_train, in words: within 5% of it, a rise below
    50% in percent, else the factor (a fall beyond 5% as a factor too)."""
    if abs(ratio - 1) <= 0.05:
        return f"stays within 5% of its L_train {noun}"
    if ratio < 1:
        return f"falls to {ratio:.2f}x its L_train {noun}"
    if ratio < 1.5:
        return f"rises least, {100 * (ratio - 1):.0f}% above its L_train {noun}"
    return f"rises least, to {ratio:.1f}x its L_train {noun}"


def coverage(tables: list[tuple[Table, list[str]]], info: pd.DataFrame) -> tuple[str, dict]:
    """What the means of ``tables``' drawn rows cover: a note for the figure ("mean ± std over 3 seeds", and where
    runs that did not learn their task are kept out beyond L_train, that rule), and per (table key, label) what its
    legend entry adds where the row's seeds differ from the note's (``[1 seed]``, ``[2 of 3 seeds learned it]``)."""
    seeds, learned = {}, {}
    fewest = {}
    for table, labels in tables:
        counted = table.cells.n[table.cells.n > 0].groupby(level="label")
        most, least = counted.max(), counted.min()
        for label in labels:
            total = int(most.get(label, 0))
            excluded = unlearned_seeds(table, info, label)
            seeds[table.key, label] = total
            fewest[table.key, label] = int(least.get(label, total))
            learned[table.key, label] = total - len(excluded) if excluded else None
    common = Counter(seeds.values()).most_common(1)[0][0] if seeds else 0
    marks = {}
    for key, total in seeds.items():
        if learned[key] is not None:
            marks[key] = (
                " [no seed learned it]" if learned[key] == 0 else f" [{learned[key]} of {total} seeds learned it]"
            )
        elif total == 0:  # measured, without a value at any length (no key token)
            marks[key] = " [no value]"
        elif fewest[key] < total:  # some lengths have fewer seeds (not evaluated there, or without a value)
            marks[key] = f" [{fewest[key]}-{total} seeds]"
        elif total != common:
            marks[key] = f" [{total} seed{'s' * (total != 1)}]"
    note = f"mean ± std over {common} seeds" if common > 1 else "one seed (no spread)"
    if any(total != common or fewest[key] < total for key, total in seeds.items()):
        note += " (other counts in [ ])"
    if any(value is not None for value in learned.values()):
        note += (
            f"; a line follows the seeds that learned the task (exact match ≥ {LEARNED_AT:.0%} at L_train), "
            "a hollow marker gives the mean over every seed at L_train"
        )
    return note, marks


def unlearned_seeds(table: Table, info: pd.DataFrame, label: str) -> set[int]:
    """The seeds of a row that did not learn their task at their training length (``Table.not_learned``)."""
    row = info.row[label] if label in info.index else label
    return set(table.not_learned.seed[table.not_learned.row == row])


def seed_marks(seeds: pd.Series, what: str) -> tuple[str, dict]:
    """A note for curves of ``seeds`` seeds each (by label): "<what> over 3 seeds", and per label whose count
    differs what its legend entry adds (``[1 seed]``)."""
    common = Counter(seeds).most_common(1)[0][0]
    marks = {label: f" [{n} seed{'s' * (n != 1)}]" for label, n in seeds.items() if n != common}
    note = f"{what} over {common} seeds" if common > 1 else f"one seed ({what} of one run)"
    return note + (" (other counts in [ ])" if marks else ""), marks
