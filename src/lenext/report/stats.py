"""Statistics over the tidy frame (``lenext.report.load.tidy``), by group-by: the tables' cells, and the data the
per-position, adaptation and depth (passkey, haystack) figures draw. The rules are the package's (``lenext.report``)."""

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pandas as pd

from lenext.diagnostics import STATISTICS
from lenext.protocols import KeyTokens, metric_range
from lenext.report.load import (
    LEARNED_AT,
    NO_VALUE,
    Loaded,
    Run,
    diagnostics_of,
    metrics_of,
    validation_curve,
)

BINS_PER_OCTAVE = 4
NOT_LEARNED = "not learned"


class Metric(NamedTuple):
    """How a row metric is shown and compared. ``higher_is_better`` None: the metric describes the rows rather
    than scores them (the share of key tokens: more is neither better nor worse), so no cell is marked best and
    none is tested for separability from a best."""

    key: str  # as results files and protocols name it (``lenext.protocols.METRICS_OF``)
    name: str
    scale: float  # shown as value x scale
    digits: int
    higher_is_better: bool | None
    short: str = ""  # in a figure's title ("exact-match"); the name's first word where ""
    per_answer: bool = True  # a share of answers, each right or wrong (a binomial over them), not of tokens

    @property
    def ranked(self) -> bool:
        """Whether a best can be named: the metric has a direction."""
        return self.higher_is_better is not None

    @property
    def percent(self) -> bool:
        """A share shown in % (an accuracy, a share of tokens): drawn on a linear 0-100 axis; else a log axis."""
        return self.scale == 100

    @property
    def bounds(self) -> tuple[float, float]:
        """The values the metric can take, as shown (``lenext.protocols.metric_range``, scaled)."""
        low, high = metric_range(self.key)
        return low * self.scale, high * self.scale

    @property
    def short_name(self) -> str:
        return self.short or self.name.split(" ")[0]


# Every metric a protocol declares (lenext.protocols.METRICS_OF) has an entry; tests/test_report.py checks it.
METRICS = {
    metric.key: metric
    for metric in (
        Metric("ppl", "perplexity", 1, 2, False),
        Metric("exact_match", "exact-match accuracy %", 100, 1, True),
        Metric("token_accuracy", "per-token accuracy %", 100, 1, True, per_answer=False),
        Metric("rank_accuracy", "rank accuracy %", 100, 1, True, short="rank accuracy"),
        # Neither better: more key tokens says the windows hold more that long context helps, not a better PE.
        Metric("key_share", "key-token share %", 100, 2, None, short="key-token share"),
    )
}


def headline(protocol: str) -> str:
    """A protocol's headline metric: the first it declares (``METRICS_OF``); ``ppl`` for one no longer known."""
    return metrics_of(protocol)[0]


class TableKey(NamedTuple):
    """What one table holds: a metric of one protocol at one L_train (and, for probes, one task)."""

    train_len: int
    protocol: str
    metric: str = "ppl"
    task: str = ""


TABLE_KEY = ["task", "train_len", "protocol", "metric"]  # text ("" task) first, then by L_train, protocol, metric
CELL = ["label", "length"]


@dataclass(frozen=True)
class Table:
    """One table's statistics. ``cells``, indexed by (label, length): ``mean``, ``std`` (over seeds; 0 for one
    seed), ``n`` (seeds counted), ``status`` (``ok``, ``not learned`` where no seed learned, else the rows'),
    ``best`` (the column's best, several where they tie; none for a metric without a direction), ``separable``
    (from each best; null: not tested), ``untested`` (a valued cell not compared with its column's best in a
    table that tests others: it or the best has one seed), ``answers`` (of a share, the answers its seeds gave
    together; null for perplexity). A cell whose rows are measured but have no value (``NO_VALUE``: no key token at
    L_train) has no mean.
    ``seeds``: the values the means count, by (label, length, seed). ``rows``: the labels in the sweep's order,
    with ``train_tokens_per_s`` (mean) and ``eval_peak_mem_mb`` (max). ``not_learned``: the runs below
    ``LEARNED_AT`` at L_train (``row``, ``seed``, ``accuracy_as_trained``). ``chance``: the chance levels its rows
    record (``tidy``'s ``chance``: a haystack's rank accuracy, a probe's metrics), in the order found."""

    key: TableKey
    cells: pd.DataFrame
    seeds: pd.Series
    rows: pd.DataFrame
    not_learned: pd.DataFrame
    chance: tuple[float, ...] = ()
    unranked: str = ""  # why no best is named, "" where one is (``unranked_because``)

    @property
    def ranked(self) -> bool:
        return not self.unranked

    @property
    def index(self) -> pd.Index:
        """The row labels, in the order the sweep listed them."""
        return self.rows.index

    @property
    def lengths(self) -> list[int]:
        return sorted(self.cells.index.get_level_values("length").unique())

    @property
    def metric(self) -> Metric:
        return METRICS[self.key.metric]

    def cell(self, label: str, length: int) -> pd.Series | None:
        """The statistics of a cell; None where the row has no results at that length."""
        return self.cells.loc[(label, length)] if (label, length) in self.cells.index else None


def summarize(frame: pd.DataFrame) -> dict[TableKey, Table]:
    """Every table, computed once from the tidy frame (depth rows are ``depth_grids``'): text ("" task) first, then
    by L_train and protocol, a protocol's metrics in the order it declares them (its headline first)."""
    tables = {}
    for (task, train_len, protocol, metric), records in frame[frame.depth.isna()].groupby(TABLE_KEY):
        key = TableKey(int(train_len), protocol, metric, task)
        tables[key] = _table(key, records)
    declared = {key: metrics_of(key.protocol) for key in tables}
    order = sorted(
        tables,
        key=lambda key: (
            key.task,
            key.train_len,
            key.protocol,
            declared[key].index(key.metric) if key.metric in declared[key] else len(declared[key]),
            key.metric,
        ),
    )
    return {key: tables[key] for key in order}


# A cell's mean and std are the Series' own, not the group-by's "mean"/"std", which round last bits otherwise; a
# seed's NaN (a diverged run) makes them NaN, not the other seeds'.
def seed_mean(values: pd.Series) -> float:
    return values.mean(skipna=False)


def seed_std(values: pd.Series) -> float:
    return values.std(ddof=1, skipna=False) if len(values) > 1 else 0.0


def _table(key: TableKey, records: pd.DataFrame) -> Table:
    valued = records.status == "ok"
    counted = records[valued & records.counted]
    spread = counted.groupby(CELL, sort=False).value.agg(mean=seed_mean, std=seed_std, n="size")
    spread["answers"] = counted.groupby(CELL, sort=False).answers.sum(min_count=1)  # a share's sample size
    measured = records.assign(measured=valued | (records.status == NO_VALUE), valued=valued).groupby(CELL, sort=False)
    cells = measured.agg(recorded=("status", "first"), measured=("measured", "any"), valued=("valued", "any"))
    cells = cells.join(spread)
    cells["n"] = cells.n.fillna(0).astype(int)
    cells["status"] = np.select(
        [cells.n > 0, cells.valued, cells.measured], ["ok", NOT_LEARNED, NO_VALUE], default=cells.recorded
    )
    cells = cells.drop(columns=["recorded", "measured", "valued"])
    metric = METRICS[key.metric]
    unranked = unranked_because(key, records)
    measured = cells[cells.status == "ok"]["mean"]  # a diverged seed's NaN included; n/a, "-", not learned not
    best = {
        length: _best(means.droplevel("length"), None if unranked else metric.higher_is_better)
        for length, means in measured.groupby(level="length")
    }
    best = {length: best.get(length, ()) for length in cells.index.get_level_values("length").unique()}
    cells["best"] = [label in best[length] for label, length in cells.index]
    seeds = counted.set_index([*CELL, "seed"]).value.sort_index()
    cells["separable"] = pd.array(
        [
            None
            if not best[length] or label in best[length] or status != "ok"
            else _separable_from_all(cells, seeds, label, best[length], length)
            for (label, length), status in cells.status.items()
        ],
        dtype="boolean",
    )
    # Not compared with its column's best, which exists (it or the best has one seed), in a table that tests others.
    has_best = cells.best.groupby(level="length").transform("any")
    valued = (cells.status == "ok") & cells["mean"].notna()  # NaN: a diverged seed
    cells["untested"] = valued & ~cells.best & has_best & cells.separable.isna().to_numpy() & (cells.n.max() > 1)
    # Grouped sorted, then put in the sweep's order: an unsorted group-by rounds the mean's last bit otherwise.
    speeds = records.drop_duplicates(["label", "run"]).groupby("label").train_tokens_per_s.mean()  # a mean over runs
    rows = records.groupby("label").agg(eval_peak_mem_mb=("peak_mem_mb", "max"))
    rows = pd.concat([speeds, rows], axis=1).reindex(records.label.unique())
    not_learned = records[records.accuracy_as_trained < LEARNED_AT].drop_duplicates("run")
    not_learned = not_learned.assign(at=not_learned.own_train_len.astype(int))  # where accuracy_as_trained is
    chance = tuple(float(c) for c in records.chance.dropna().unique())
    not_learned = not_learned[["row", "seed", "accuracy_as_trained", "at"]]
    return Table(key, cells, seeds, rows, not_learned, chance, unranked)


def unranked_because(key: TableKey, records: pd.DataFrame) -> str:
    """Why a table's rows cannot be ranked, as its heading says it ("" where they can): its metric has no direction,
    its rows were measured on different text (``Run.text``: a perplexity per token of another tokenizer, corpus or
    split is another quantity), or it is a key-token perplexity of rows that picked their own key tokens (no common
    evaluator: each is below e^max_nll by construction, over a set of its own; docs/evaluation.md)."""
    if not METRICS[key.metric].ranked:
        return "describes the rows"
    if not one_text(records.text.unique()):
        return "rows measured on different text (another corpus, tokenizer or split)"
    evaluators = records.evaluator
    if key.protocol == KeyTokens.name and key.metric == "ppl" and (evaluators.isna().any() or evaluators.nunique() > 1):
        return "each row over key tokens of its own choosing (no common eval.key_evaluator)"
    return ""


def one_text(texts) -> bool:
    """Whether runs' ``Run.text`` say they measured the same text: no setting of it differs among the runs that
    record it (an older results file records its split alone)."""
    recorded = [json.loads(text) for text in texts]
    keys = {key for text in recorded for key in text}
    return all(len({json.dumps(text[key], default=str) for text in recorded if key in text}) <= 1 for key in keys)


def _best(means: pd.Series, higher_is_better: bool | None) -> tuple[str, ...]:
    """The labels sharing the best of ``means`` (by label, the rows measured: NaN where a seed diverged): several
    where rows tie (a scaling at L_train is the model as trained; accuracies tie at 100%); none when no row has a
    value, every measured row ties (nothing is singled out: accuracies all at 0%, or one row alone) or the metric
    has no direction (``higher_is_better`` None)."""
    rows, means = len(means), means.dropna()  # a diverged row is measured: it did not tie
    if means.empty or higher_is_better is None:
        return ()
    leaders = tuple(means.index[means == (means.max() if higher_is_better else means.min())])
    return () if len(leaders) == rows else leaders


def _separable_from_all(cells: pd.DataFrame, seeds: pd.Series, a: str, leaders: tuple, length: int) -> bool | None:
    """Whether row ``a`` is separable from every one of the column's tied best rows: not, if it is not from one of
    them; None (not tested) where a comparison could not be made and none said not."""
    tested = [_separable(cells, seeds, a, leader, length) for leader in leaders]
    if False in tested:
        return False
    return None if None in tested else True


def _separable(cells: pd.DataFrame, seeds: pd.Series, a: str, b: str, length: int) -> bool | None:
    """The separability rule (``lenext.report``'s docstring) between rows ``a`` and ``b`` at ``length``; None where
    either has fewer than two seeds."""
    if (a, length) not in cells.index or (b, length) not in cells.index:
        return None
    cell_a, cell_b = cells.loc[(a, length)], cells.loc[(b, length)]
    if min(cell_a.n, cell_b.n) < 2 or np.isnan(cell_a["mean"]) or np.isnan(cell_b["mean"]):  # NaN: a diverged seed
        return None
    apart = abs(cell_a["mean"] - cell_b["mean"]) > 2 * max(cell_a["std"], cell_b["std"])
    paired = (seeds.loc[(a, length)] - seeds.loc[(b, length)]).dropna()  # over the seeds both have
    same_sign = len(paired) < 2 or bool((paired > 0).all() or (paired < 0).all())
    return bool(apart and same_sign)


def separable(
    frame_or_tables: pd.DataFrame | dict,
    label_a: str,
    label_b: str,
    train_len: int,
    protocol: str,
    length: int,
    metric: str = "ppl",
    task: str = "",
) -> bool | None:
    """Whether rows ``label_a`` and ``label_b`` (e.g. ``rope (ntk)``) differ in ``metric`` at ``length`` beyond seed
    noise, by the rule in ``lenext.report``'s docstring; None when either has fewer than two seeds there, so no claim
    can be tested. Takes the tidy frame or the tables of ``summarize``."""
    key = TableKey(train_len, protocol, metric, task)
    if isinstance(frame_or_tables, pd.DataFrame):
        frame = frame_or_tables
        frame_or_tables = summarize(frame[(frame.train_len == train_len) & (frame.protocol == protocol)])
    table = frame_or_tables[key]
    return _separable(table.cells, table.seeds, label_a, label_b, length)


def seed_range(table: Table) -> tuple[int, int]:
    """Fewest and most seeds behind a cell that has a value."""
    counts = table.cells.n[table.cells.n > 0]
    return (int(counts.min()), int(counts.max())) if len(counts) else (0, 0)


def log_bins(length: int) -> list[tuple[int, int]]:
    """[start, end) position bins covering 0..length-1, BINS_PER_OCTAVE per doubling of (position + 1)."""
    octaves = math.log2(length)
    edges = sorted({0, length} | {round(2 ** (k / BINS_PER_OCTAVE)) - 1 for k in range(int(octaves * BINS_PER_OCTAVE))})
    return list(zip(edges[:-1], edges[1:], strict=True))


def binned_positions(runs: list[Run], left_out: tuple[str, ...] = ()) -> pd.DataFrame:
    """Per (L_train, label, bin) at the label's longest length: token-weighted mean loss per run, then mean and std
    over the seeds evaluated there (NaN where one diverged), the labels ``left_out`` (``Loaded.untempered``) left out.
    Columns: train_len, label, length, bin_start, bin_end, mean_nll, std_nll, seeds, tokens."""
    per_run = []
    for run in runs:
        curve, _ = run.positions  # why one is left out: listed with the incomplete runs
        if curve is None:
            continue
        longest = curve[curve.length == curve.length.max()]
        for variant, positions in longest[~longest.variant.isin(run.merged_variants)].groupby("variant", sort=False):
            if run.label(variant or None) in left_out:
                continue
            for start, end in log_bins(int(positions.position.max()) + 1):
                in_bin = positions[(positions.position >= start) & (positions.position < end)]
                tokens = int(in_bin["count"].sum())
                per_run.append(
                    {
                        "train_len": run.table_len,
                        "label": run.label(variant or None),
                        "length": int(positions.length.iloc[0]),
                        "bin_start": start,
                        "bin_end": end,
                        "nll": (in_bin.mean_nll * in_bin["count"]).sum(skipna=False) / tokens if tokens else math.nan,
                        "tokens": tokens,
                    }
                )
    if not per_run:
        return pd.DataFrame()
    per_run = pd.DataFrame(per_run)
    longest = per_run.groupby(["train_len", "label"], sort=False).length.transform("max")
    grouped = per_run[per_run.length == longest].groupby(
        ["train_len", "label", "length", "bin_start", "bin_end"], sort=False
    )  # in the sweep's order
    return grouped.agg(
        mean_nll=("nll", seed_mean), std_nll=("nll", seed_std), seeds=("nll", "size"), tokens=("tokens", "sum")
    ).reset_index()


def adaptation(runs: list[Run]) -> pd.DataFrame:
    """Second stages' validation perplexity against fine-tuning steps, mean and std over seeds. Columns: train_len
    (the base's, as the tables'), val_len (the stage's training length, where it validates), row, step, mean, std,
    seeds."""
    records = []
    for run in runs:
        validations = validation_curve(run)
        if validations is None:
            continue
        # Lightning logs a validation during training at the index of its step (0-based), and the validation after
        # training at the steps done: one step after the last, it scores the same weights again. The validation
        # before training is logged at -1 (lenext.run.log_validation_before_training): step 0.
        last = validations.step.max()
        for step, ppl in validations.itertuples(index=False):
            if step == last and last - 1 in set(validations.step):
                continue
            done = int(step) + (step < last)
            stage = {"train_len": run.table_len, "val_len": run.meta["train_len"], "row": run.label(None)}
            records.append({**stage, "step": done, "ppl": ppl})
    if not records:
        return pd.DataFrame()
    grouped = pd.DataFrame(records).groupby(["train_len", "val_len", "row", "step"], sort=False)
    curves = grouped.agg(mean=("ppl", seed_mean), std=("ppl", seed_std), seeds=("ppl", "size")).reset_index()
    # Each row's steps in order, the rows in the sweep's: a step only a later seed logged (step 0) came last
    first_seen = {row: index for index, row in enumerate(curves.row.unique())}
    return curves.sort_values(["row", "step"], key=lambda c: c.map(first_seen) if c.name == "row" else c).reset_index(
        drop=True
    )


DEPTH_KEY = ["name", "protocol", "metric", "train_len", "label", "depth", "length"]


def depth_grids(frame: pd.DataFrame) -> pd.DataFrame:
    """Per protocol with depth rows (passkey's, the haystack protocols'), its headline metric (``headline``: exact
    match for passkey, rank accuracy for a haystack) per (L_train, label, depth, L_eval), mean and std over the
    seeds means count. Columns: name (the probe's task, else the protocol: the grid's file is
    ``<name>_depth.csv``), protocol, metric, train_len, label, depth (passkey: its bucket's lower edge; a
    haystack: the needle's depth), length, mean, std, seeds, answers, chance (null where the metric has none)."""
    headlines = frame.protocol.map(headline)
    depth_rows = frame[frame.depth.notna() & frame.counted & (frame.status == "ok") & (frame.metric == headlines)]
    if depth_rows.empty:
        return pd.DataFrame()
    depth_rows = depth_rows.assign(name=depth_rows.task.where(depth_rows.task != "", depth_rows.protocol))
    grouped = depth_rows.groupby(DEPTH_KEY, sort=False)
    depths = grouped.agg(
        mean=("value", seed_mean),
        std=("value", seed_std),
        seeds=("value", "size"),
        answers=("answers", lambda answers: answers.sum(min_count=1)),  # null where older files have none
        chance=("chance", "first"),
    ).reset_index()
    depths["answers"] = depths.answers.astype("Int64")
    return depths


def passkey_depths(frame: pd.DataFrame) -> pd.DataFrame:
    """Passkey's grid of ``depth_grids``: exact match per (L_train, label, depth bucket, L_eval), mean and std over
    seeds. Columns: train_len, label, depth (the bucket's lower edge), length, mean, std, seeds, answers."""
    grids = depth_grids(frame)
    if grids.empty:
        return grids
    return grids[grids.name == "passkey"].drop(columns=[*DEPTH_KEY[:3], "chance"]).reset_index(drop=True)


# The statistics of diagnostics.csv: each attention statistic (lenext.diagnostics.STATISTICS) over all query rows and
# over the rows i >= L_train; the copying score's fields; RoPE's unseen-angle fraction. ``rows`` "" where the
# statistic is not one of query rows.
COPYING_STATISTICS = {
    "copying_gain": "gain",
    "copying_first_nll": "first_half_nll",
    "copying_second_nll": "second_half_nll",
}
DIAGNOSTIC_STATISTICS = (*STATISTICS, *COPYING_STATISTICS, "unseen_fraction")
DIAGNOSTIC_ROWS = ("all", "beyond_train", "")
DIAGNOSTIC_KEY = ["train_len", "label", "statistic", "rows", "length"]


def run_diagnostics(run: Run, result: dict) -> list[dict]:
    """One record per (length, statistic, rows) of a run's diagnostics.json (``lenext.diagnostics``): an attention
    statistic's mean over layers and heads (a value per layer and head, each a mean over the windows' query rows),
    the copying score's fields, the unseen-angle fraction (a rotary PE, every length the coverage has); lengths
    whose status is not ``ok`` and statistics without a value there are left out. The row's label is the run's, with the
    variant the diagnostics evaluated (``meta.pe.scaling``: ``rope (yarn)``)."""
    label = run.label((result["meta"].get("pe") or {}).get("scaling"))
    base = {"train_len": run.table_len, "label": label, "seed": run.seed}
    records = []
    for entry in result["lengths"]:
        if entry.get("status") != "ok":
            continue
        for rows in DIAGNOSTIC_ROWS[:2]:
            statistics = (entry.get("rows") or {}).get(rows) or {}
            for name in STATISTICS:
                values = [value for layer in statistics.get(name) or () for value in layer]
                if values:
                    records.append(
                        {**base, "statistic": name, "rows": rows, "length": entry["length"], "value": np.mean(values)}
                    )
        copying = entry.get("copying") or {}
        for name, field in COPYING_STATISTICS.items():
            if copying.get(field) is not None:
                records.append(
                    {**base, "statistic": name, "rows": "", "length": entry["length"], "value": copying[field]}
                )
    for summary in (result.get("rotation_coverage") or {}).get("summary", ()):
        records.append(
            {
                **base,
                "statistic": "unseen_fraction",
                "rows": "",
                "length": summary["length"],
                "value": summary["unseen_fraction"],
            }
        )
    return records


def diagnostic_statistics(runs: list[Run]) -> pd.DataFrame:
    """The runs' diagnostics (``<run>/diagnostics/diagnostics.json``; runs without are skipped), per (L_train, row
    label, statistic, rows, L_eval): mean and std over seeds of each run's value (``run_diagnostics``: an attention
    statistic's mean over layers and heads). Columns: train_len, label, statistic (``DIAGNOSTIC_STATISTICS``), rows
    (``all``, ``beyond_train``: the query rows i >= L_train; "" for the copying score and the unseen fraction),
    length, mean, std (0 for one seed), seeds; by L_train, the rows in the sweep's order, the statistics in
    ``DIAGNOSTIC_STATISTICS``' order, then L_eval."""
    records = [record for run in runs if (result := diagnostics_of(run)) for record in run_diagnostics(run, result)]
    if not records:
        return pd.DataFrame()
    frame = pd.DataFrame(records)
    grouped = frame.groupby(DIAGNOSTIC_KEY, sort=False).value
    stats = grouped.agg(mean=seed_mean, std=seed_std, seeds="size").reset_index()
    order = {
        "label": {label: i for i, label in enumerate(dict.fromkeys(frame.label))},
        "statistic": {name: i for i, name in enumerate(DIAGNOSTIC_STATISTICS)},
        "rows": {rows: i for i, rows in enumerate(DIAGNOSTIC_ROWS)},
    }
    stats = stats.sort_values(
        DIAGNOSTIC_KEY, key=lambda column: column.map(order[column.name]) if column.name in order else column
    )
    return stats.reset_index(drop=True)


def rank_correlation(x: pd.Series, y: pd.Series) -> float:
    """Spearman's rank correlation of two series, paired by index where both have a value: Pearson's of their ranks
    (ties at their mean rank); NaN where either is constant."""
    ranks = pd.concat([x, y], axis=1, join="inner").dropna().rank()
    if len(ranks) < 2 or ranks.nunique().min() < 2:
        return float("nan")
    return float(np.corrcoef(ranks.iloc[:, 0], ranks.iloc[:, 1])[0, 1])


def diagnostic_correlations(diagnostics: pd.DataFrame, tables: dict[TableKey, Table]) -> pd.DataFrame:
    """Which diagnostic goes with perplexity leaving its L_train level: per (L_train, statistic, rows, L_eval past
    L_train), over the row labels that have both (at least 3), Spearman's rank correlation between the statistic's
    mean and the perplexity ratio ppl(L_eval) / ppl(L_train) of the ``nonoverlap`` table (as trained: the
    diagnostics are), ``rho``; and with the statistic's change from its value at L_train where it has one
    (``rho_change``). Columns: train_len, statistic, rows, length, labels, rho, rho_change."""
    if diagnostics.empty:
        return pd.DataFrame()
    key = ["train_len", "statistic", "rows"]
    at_train = diagnostics[diagnostics.length == diagnostics.train_len].set_index([*key, "label"])["mean"].sort_index()
    records, ratios = [], {}
    for (train_len, statistic, rows, length), group in diagnostics.groupby([*key, "length"], sort=False):
        if length <= train_len:
            continue
        if (train_len, length) not in ratios:  # one per length, shared by every statistic
            ratios[train_len, length] = perplexity_ratio(tables, int(train_len), int(length))
        ratio, value = ratios[train_len, length], group.set_index("label")["mean"]
        paired = pd.concat([value, ratio], axis=1, join="inner").dropna()
        if len(paired) < 3:
            continue
        start = at_train.get((train_len, statistic, rows), pd.Series(dtype=float))
        change = value - start.reindex(value.index)
        records.append(
            {
                "train_len": train_len,
                "statistic": statistic,
                "rows": rows,
                "length": length,
                "labels": len(paired),
                "rho": rank_correlation(value, ratio),
                "rho_change": rank_correlation(change, ratio) if change.notna().sum() >= 3 else float("nan"),
            }
        )
    return pd.DataFrame(records)


def perplexity_ratio(tables: dict[TableKey, Table], train_len: int, length: int) -> pd.Series:
    """Per row label, its ``nonoverlap`` perplexity at ``length`` over its perplexity at ``train_len`` (means over
    seeds); the labels with both."""
    table = tables.get(TableKey(train_len, "nonoverlap"))
    if table is None or not {length, train_len} <= set(table.lengths):
        return pd.Series(dtype=float)
    means = table.cells["mean"].astype(float)
    return (means.xs(length, level="length") / means.xs(train_len, level="length")).dropna()


class Summary:
    """Everything the report shows, from what ``load`` read: the tables, computed at once, and on first use what
    figures draw by (``labels``) and the figures' own statistics (``positions``, ``adaptation``, ``depths``: every
    protocol's depth grid, ``depth_grids``; ``diagnostics``: the runs' diagnostics.json, ``diagnostic_statistics``)."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.frame = loaded.frame
        self.tables = summarize(loaded.frame)

    @cached_property
    def labels(self) -> pd.DataFrame:
        """Per row label (the index): its ``row``, ``root``, ``base`` (null for a first stage), ``variant`` (null:
        as trained), ``extension_method``, ``family`` and ``display_name``, as the tidy frame has them."""
        columns = ["row", "root", "base", "variant", "extension_method", "family", "display_name"]
        return self.frame.drop_duplicates("label").set_index("label")[columns]

    @cached_property
    def positions(self) -> pd.DataFrame:
        return binned_positions(self.loaded.runs, self.loaded.untempered)

    @cached_property
    def adaptation(self) -> pd.DataFrame:
        return adaptation(self.loaded.runs)

    @cached_property
    def depths(self) -> pd.DataFrame:
        return depth_grids(self.frame)

    @cached_property
    def diagnostics(self) -> pd.DataFrame:
        """The runs' attention diagnostics and copying score, mean and std over seeds (``diagnostic_statistics``)."""
        return diagnostic_statistics(self.loaded.runs)

    @cached_property
    def diagnostic_correlations(self) -> pd.DataFrame:
        """Each diagnostic's rank correlation with the perplexity ratio across rows (``diagnostic_correlations``)."""
        return diagnostic_correlations(self.diagnostics, self.tables)
