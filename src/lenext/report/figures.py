"""Figures: renderers over the report's ``Summary``, in a registry.

A figure is a function of the ``Summary`` that returns a matplotlib figure, or None when the runs have nothing it
draws, registered under its file name by ``@figure("<name>.png")`` (docs/adding/figure.md); one drawn once per
protocol registers a pattern (``@figure("*_depth.png")``) and returns {file name: figure} (``drawn_files``).
Which figure draws a table follows its metric: perplexity (log axis), the probes' accuracies, a text protocol's
headline accuracy with its chance level (linear 0-100% axis); a metric without a direction (the key-token share)
is tabled only.
``write_figures`` draws every registered figure in ``FIGURE_STYLE`` and saves it into the report's folder.

What every built-in figure keeps to, so that each panel says one thing:

- **One colour per PE**, the same in every figure and panel of every report: ``pe_style`` reads it from a fixed
  list of the known rows (``KNOWN_PES``, arranged so that PEs drawn together differ), else from a hash of the
  row's name. A second stage is drawn in its first stage's colour. Two PEs of one panel never share a colour: the
  one later in ``KNOWN_PES`` then takes a colour no PE of the panel has (``distinct_colours``).
- **Panels that compare one thing**: the PEs as trained, coloured by PE; one PE's evaluation-time
  variants and second stages, coloured by method (``METHOD_STYLES``: RoPE's scalings and the stages' methods, PI as
  ``linear``, the PE as trained in ``AS_TRAINED_STYLE``'s blue, in every such panel); or PEs with one second stage each
  beside their bases. A method ``METHOD_STYLES`` does not list takes a colour no other row of its panel has. Line
  style says which weights: solid the first stage's (as trained, or scaled at evaluation), dashed a second stage's.
- **At most ``MAX_CURVES`` curves a panel**: more rows are split by PE family, by PE, and a PE's rows by zero-shot
  variants and by the stages' length and positions (``split_rows``).
- **A title that states what the panel shows**, computed from the statistics (``lengths_takeaway`` and the other
  ``*_takeaway`` functions), under a line saying what it holds; a note above the panels says what a mean covers
  (``coverage``), and a legend entry says where a row's seeds differ from it.
- **Colour-blind-safe colours** (Okabe-Ito, with three of Tol's), a colour-blind-safe map for heatmaps
  (``HEATMAP``), plain tick labels on log axes, no offset or scientific notation on near-constant ones.
"""

import math
import os
import textwrap
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from scipy.stats import binomtest

from lenext.files import atomic_path
from lenext.pe import FAMILIES
from lenext.protocols import PROTOCOLS
from lenext.report.load import LEARNED_AT, OTHER_FAMILY, metrics_of
from lenext.report.stats import METRICS, NOT_LEARNED, Summary, Table, headline, perplexity_ratio, seed_mean, seed_std

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
MAX_CURVES = 8  # curves in one panel at most
COLUMNS = 3  # panels to a row at most
PANEL_WIDTH = 4.2  # inches, a panel with its labels
AXES_HEIGHT = 2.7  # inches, a panel's plotting area
FAMILY_PANELS_ABOVE = MAX_CURVES  # rows beyond which a panel of PEs splits into one panel per PE family

# Colour-blind safe: Okabe-Ito's (less its yellow, too light for lines) and three of Paul Tol's.
PALETTE = (
    "#0072b2",  # blue
    "#e69f00",  # orange
    "#000000",  # black
    "#009e73",  # bluish green
    "#d55e00",  # vermillion
    "#56b4e9",  # sky blue
    "#cc79a7",  # reddish purple
    "#999933",  # olive
    "#882255",  # wine
    "#44aa99",  # teal
)
PE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# A known row's place: colour PALETTE[i % 10], marker PE_MARKERS[i // 10]. The PEs a study draws in one panel get
# distinct colours (the families; the reference, extension and probes studies' rows), and the ten PEs compared most
# distinct colours everywhere; a row not listed gets a place from a hash of its name.
KNOWN_PES = {
    "rope": 0,
    "alibi": 1,
    "nope": 2,
    "kerple": 3,
    "t5": 4,
    "xpos": 5,
    "fire": 6,
    "sinusoidal": 7,
    "shaw": 8,
    "learned": 9,
    "fox": 10,
    "cope": 11,
    "nope+ssmax": 12,
    "rope+ssmax": 13,
    "nope+stick_breaking": 14,
    "rope_nope": 15,
    "fox_rope": 16,
    "rnope_swa": 17,
    "dape": 18,
    "pope": 19,
    "path": 20,
    "path_fox": 21,
    "nope_randomized": 22,
    "t5_randomized": 23,
    "p_rope": 24,
    "alibi_randomized": 25,
    "rope_randomized": 26,
    "rope_ntk": 27,
}
# An extension method's colour and marker where a panel compares one PE's methods (a variant's name; a second stage's
# method as a variant is named: PI is linear), the same in every such panel. The PE as trained (and ``none``, direct
# fine-tuning) is ``AS_TRAINED_STYLE`` there, whatever the PE: a method's colour never stands for a PE in one panel and
# for a method in the next.
METHOD_STYLES = {
    "linear": (PALETTE[1], "s"),
    "ntk": (PALETTE[3], "^"),
    "yarn": (PALETTE[4], "D"),
    "llama3": (PALETTE[6], "v"),
    "self_extend": (PALETTE[2], "P"),
    "dynamic_ntk": (PALETTE[9], "X"),
    # dynamic_ntk's teal: dynamic_ntk rows equal NTK's, so are seldom drawn (beside it, distinct_colours)
    "temperature": (PALETTE[9], "d"),
    "pose": (PALETTE[5], "*"),
    "pose+pi": (PALETTE[7], "h"),
    "pose+yarn": (PALETTE[8], "p"),
}
AS_TRAINED_STYLE = (PALETTE[0], "o")
FIRST_STAGE, SECOND_STAGE = "-", "--"  # line styles: the first stage's weights, a second stage's
HEATMAP = "cividis"  # colour-blind safe, dark (0%) to light (100%)
# ``row_styles``' (figures of one's own, docs/adding/figure.md): a PE's rows in its colour, told apart by line style.
LINE_STYLES = ("-", "--", ":", "-.", (0, (1, 3)), (0, (6, 2, 1, 2, 1, 2)), (0, (9, 3)), (0, (3, 1, 1, 1, 1, 1)))
# A stage's line style for each row of one PE (or method) in a panel, runs of other settings after the first.
REPEAT_STYLES = {False: (FIRST_STAGE, *LINE_STYLES[2:5]), True: (SECOND_STAGE, *LINE_STYLES[5:])}
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


# Colours and styles.


def pe_style(name: str) -> tuple[str, str]:
    """A PE's (row's) colour and marker, the same in every figure of every report: its place in ``KNOWN_PES``, or
    for a row not listed there one from a hash of its name."""
    place = KNOWN_PES.get(name)
    if place is None:
        place = zlib.crc32(name.encode()) % (len(PALETTE) * len(PE_MARKERS))
    return PALETTE[place % len(PALETTE)], PE_MARKERS[(place // len(PALETTE)) % len(PE_MARKERS)]


def pe_colour(name: str) -> str:
    return pe_style(name)[0]


def method_style(method: str) -> tuple[str, str]:
    """An extension method's colour and marker in a panel of one PE's rows: ``METHOD_STYLES``' (a method not listed:
    from a hash of its name, never ``AS_TRAINED_STYLE``'s colour); ``none`` is ``AS_TRAINED_STYLE``."""
    if method == "none":
        return AS_TRAINED_STYLE
    return METHOD_STYLES.get(method) or (
        PALETTE[1 + zlib.crc32(method.encode()) % (len(PALETTE) - 1)],
        MARKERS[zlib.crc32(method.encode()) % len(MARKERS)],
    )


def row_info(summary: Summary) -> pd.DataFrame:
    """Per row label: ``Summary.labels`` with the row's training ``positions`` and ``stage_len``, and ``pe``, the
    name its colour is keyed by: its root, the first-stage row it descends from without the settings that tell
    runs of one name apart (one colour per PE in every panel; ``line_styles`` tells such rows apart)."""
    first = summary.frame.drop_duplicates("label").set_index("label")
    info = summary.labels.join(first[["positions", "stage_len"]])
    info["pe"] = info.root
    return info


def colour_key(info: pd.DataFrame, label: str) -> str:
    return info.pe[label] if label in info.index else label


def distinct_colours(natural: dict[str, str], rank: Callable[[str], int]) -> dict[str, str]:
    """One colour per key of a panel (a PE, or a method): its ``natural`` one, except where a key of lower
    ``rank`` has it: then one that no key of the panel has (the palette holds more colours than a panel curves)."""
    assigned: dict[str, str] = {}
    for key in sorted(natural, key=rank):
        colour = natural[key]
        if colour in assigned.values():
            free = [c for c in PALETTE if c not in assigned.values()]  # none left beyond 10 keys: the natural one
            colour = next((c for c in free if c not in natural.values()), free[0] if free else colour)
        assigned[key] = colour
    return assigned


def line_styles(info: pd.DataFrame, labels: list[str], by_method: bool) -> dict[str, dict]:
    """matplotlib settings per row: ``by_method`` (one PE's rows), its method's colour and marker (``AS_TRAINED_STYLE``
    for the PE as trained); else its PE's (``pe_style``). Two PEs (methods) of one panel never share a colour: the
    one later in ``KNOWN_PES`` (``METHOD_STYLES``; unlisted ones last) takes one no other has
    (``distinct_colours``). Solid for a first stage's weights, dashed for a second stage's."""
    keys, natural, dashed, nth, seen = {}, {}, {}, {}, {}
    for label in labels:
        known = label in info.index
        dashed[label] = known and pd.notna(info.base[label])
        # as trained, extension_method is "none": AS_TRAINED_STYLE's style
        keys[label] = info.extension_method[label] if by_method and known else colour_key(info, label)
        natural[keys[label]] = method_style(keys[label]) if by_method and known else pe_style(keys[label])
        # rows of one key and stage (runs of one PE with other settings): the first as the key's, the rest apart
        nth[label] = seen[keys[label], dashed[label]] = seen.get((keys[label], dashed[label]), -1) + 1
    order = ["none", *METHOD_STYLES] if by_method else list(KNOWN_PES)
    colours = distinct_colours(
        {key: style[0] for key, style in natural.items()},
        lambda key: order.index(key) if key in order else len(order),
    )

    def style(label: str, key: str) -> dict:
        marker, n = natural[key][1], nth[label]
        if n:
            others = [m for m in MARKERS if m != marker]
            marker = others[(n - 1) % len(others)]
        kinds = REPEAT_STYLES[dashed[label]]
        return {"color": colours[key], "marker": marker, "ls": kinds[n % len(kinds)]}

    return {label: style(label, key) for label, key in keys.items()}


def row_styles(roots: pd.Series) -> dict[str, dict]:
    """Per row label (``roots``' index), matplotlib line settings: the colour of its root (the first-stage row it
    descends from, ``pe_style``), a line style and marker per row of that root."""
    seen: dict[str, int] = {}
    styles = {}
    for label, root in roots.items():
        seen[root] = seen.get(root, -1) + 1
        variant = seen[root] % len(LINE_STYLES)
        styles[label] = {"color": pe_colour(root), "ls": LINE_STYLES[variant], "marker": MARKERS[variant]}
    return styles


def roots_of(summary: Summary, labels) -> pd.Series:
    """The root of each of ``labels`` (a label the tables lack is its own)."""
    return pd.Series({label: summary.labels.root.get(label, label) for label in labels}, dtype=object)


def families_of(labels, family: pd.Series) -> list[str]:
    """The PE families of rows ``labels`` (``family``: label -> family), in ``FAMILIES``' order, others after."""
    named = {family[label] for label in labels}
    return [f for f in FAMILIES if f in named] + sorted(named - set(FAMILIES))


# Panels: which rows are drawn together.


@dataclass
class Panel:
    """Rows drawn together: ``labels`` (in the table's order), ``by_method`` (coloured by method: one PE's variants
    and stages; else by PE) and ``holds``, what the panel holds, in words."""

    labels: list[str]
    by_method: bool
    holds: str


def chunks(groups: list[list[str]], limit: int = MAX_CURVES) -> list[list[str]]:
    """``groups`` of rows (each kept whole) packed in order into panels of at most ``limit`` rows: as few as fit,
    each filled to about an equal share."""
    total = sum(len(group) for group in groups)
    parts = max(1, math.ceil(total / limit))
    while True:
        target, packed, current = math.ceil(total / parts), [], []
        for group in groups:
            if current and (len(current) >= target or len(current) + len(group) > limit):
                packed.append(current)
                current = []
            current = current + group
        packed.append(current)
        if all(len(part) <= limit for part in packed) or parts >= total:
            return packed
        parts += 1


def by_family(info: pd.DataFrame, groups: list[list[str]], holds: str, merge: bool = False) -> list[Panel]:
    """Groups of rows coloured by PE: one panel when they fit in ``MAX_CURVES``, else a panel per PE family (split
    further where a family has more; ``merge``: families that fit together share a panel)."""
    if sum(len(group) for group in groups) <= FAMILY_PANELS_ABOVE:
        return [Panel([label for group in groups for label in group], False, holds)]
    family = info.family.reindex([group[0] for group in groups]).fillna(OTHER_FAMILY)
    parts = []  # (family names, rows)
    for name in families_of(family.index, family):
        split = chunks([group for group in groups if family[group[0]] == name])
        for part in split:
            room = [i for i, (_, held) in enumerate(parts) if len(held) + len(part) <= MAX_CURVES]
            if merge and room and len(split) == 1:
                names, held = parts[room[0]]
                parts[room[0]] = (names + [name], held + part)
            else:
                parts.append(([name], part))
    return [Panel(part, False, f"{', '.join(names)}: {holds}") for names, part in parts]


def split_rows(info: pd.DataFrame, labels: list[str], pes_as_trained: bool = True) -> list[Panel]:
    """A table's rows as panels of at most ``MAX_CURVES`` curves, each comparing one thing:

    - the PEs as trained, coloured by PE (``pes_as_trained``; left out where it would be one PE drawn elsewhere);
    - per PE with evaluation-time variants or several second stages, its rows coloured by method, the PE as
      trained in each panel: one panel when they fit, else its zero-shot variants, then its second stages by
      stage length and training positions (full length, PoSE), split further where more;
    - the PEs with one second stage each (``rope -> direct@256``), beside their bases, coloured by PE.

    Panels of PEs split by PE family when more than fit."""
    info = info.reindex(labels)
    roots = list(dict.fromkeys(info.root.fillna(pd.Series(labels, index=labels))))
    own = {
        root: [label for label in labels if (info.root[label] if pd.notna(info.root[label]) else label) == root]
        for root in roots
    }
    later = info.base.notna()
    trained = {
        root: [label for label in own[root] if not later[label] and pd.isna(info.variant[label])] for root in roots
    }
    extra = {root: [label for label in own[root] if label not in trained[root]] for root in roots}
    pooled = [
        root
        for root in roots
        if len(extra[root]) == 1 and later[extra[root][0]] and pd.isna(info.variant[extra[root][0]]) and trained[root]
    ]
    compared = [root for root in roots if extra[root] and root not in pooled]
    panels = []
    as_trained = [[label] for root in roots for label in trained[root]]
    if pes_as_trained and as_trained and not (len(as_trained) == 1 and (compared or pooled)):
        panels += by_family(info, as_trained, "as trained")
    for root in compared:
        panels += method_panels(info, root, trained[root], extra[root])
    if pooled:
        stages = list(dict.fromkeys(stage_name(info, extra[root][0]) for root in pooled))
        holds = f"as trained and fine-tuned ({', '.join(stages)})"
        panels += by_family(info, [trained[root] + extra[root] for root in pooled], holds, merge=True)
    return panels


def stage_name(info: pd.DataFrame, label: str) -> str:
    """A second stage's method and length as its row names them (``direct@256``)."""
    row = info.row[label]
    return row.rsplit(" -> ", 1)[-1] if " -> " in row else row


def method_panels(info: pd.DataFrame, root: str, trained: list[str], extra: list[str]) -> list[Panel]:
    """One PE's variants and second stages, coloured by method, its as-trained rows in each panel."""
    room = MAX_CURVES - len(trained)
    if len(extra) <= room:
        return [
            Panel(
                trained + extra,
                True,
                f"{root}: variants and stages"
                if any(pd.notna(info.base[label]) for label in extra)
                else f"{root}: scaled at evaluation",
            )
        ]
    zero_shot = [label for label in extra if pd.isna(info.base[label])]
    groups = {}
    for label in extra:
        if pd.notna(info.base[label]):
            stage_len, positions = info.stage_len[label], info.positions[label]
            how = "full length" if positions == "sequential" else f"{positions} positions"
            groups.setdefault(f"{root}: fine-tuned at {stage_len}, {how}", []).append(label)
    groups = {f"{root}: scaled at evaluation (zero-shot)": zero_shot, **groups} if zero_shot else groups
    panels = []
    for holds, rows in groups.items():
        parts = chunks([[label] for label in rows], max(1, room))
        panels += [Panel(trained + part, True, holds) for part in parts]
    return panels


# Takeaways: what a panel shows, from the statistics.


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


# Drawing.


def bounded_error(mean, std, bounds: tuple[float, float]) -> np.ndarray:
    """The (lower, upper) lengths of +- std bars cut at the values the quantity can take (``bounds``), so that
    no bar reaches past 100% or below a perplexity of 1."""
    mean, std = np.asarray(mean, dtype=float), np.asarray(std, dtype=float)
    low, high = bounds
    return np.stack([np.clip(np.minimum(std, mean - low), 0, None), np.clip(np.minimum(std, high - mean), 0, None)])


def error_curve(ax, x, mean, std, label: str, style: dict, bounds=(-np.inf, np.inf)) -> None:
    """One row's curve: its mean with +- std bars cut at ``bounds``, in the line style every figure of the
    report shares."""
    ax.errorbar(x, mean, yerr=bounded_error(mean, std, bounds), ms=4, lw=1.5, capsize=2, label=label, **style)


def draw_rows(
    ax, table: Table, labels: list[str], styles: dict, scale: float = 1.0, names: dict | None = None, unlearned=None
):
    """Each row's mean +- std over seeds against L_eval (``names``: its legend entry, where not its label). A row
    with seeds that did not learn its task (``unlearned``: label -> seeds), which the table counts up to L_train
    only: its line over the other seeds at every length, the table's mean at L_train a hollow marker, so that the
    line does not join two sets of seeds."""
    lengths = table.lengths
    for label in labels:
        cells = table.cells.xs(label, level="label").reindex(lengths)
        mean, std = cells["mean"].astype(float), cells["std"].astype(float).fillna(0)
        name = (names or {}).get(label, label)
        excluded = (unlearned or {}).get(label)
        if excluded:
            seeds = table.seeds.xs(label, level="label")
            kept = seeds[~seeds.index.get_level_values("seed").isin(excluded)].groupby(level="length")
            every = mean[cells.n > kept.size().reindex(lengths).fillna(0)]  # where the table counts them all
            ax.plot(
                every.index,
                every * scale,
                ls="none",
                marker=styles[label]["marker"],
                mfc="none",
                ms=6,
                color=styles[label]["color"],
            )
            mean = kept.agg(seed_mean).reindex(lengths)
            std = kept.agg(seed_std).reindex(lengths).fillna(0)
        error_curve(ax, lengths, mean * scale, std * scale, name, styles[label], table.metric.bounds)


def length_axis(ax, lengths: list) -> None:
    """A log axis of evaluation lengths, ticked at the lengths evaluated, in plain numbers."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.set_xticks(lengths, [f"{n:g}" for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())


def plain_log_values(ax) -> None:
    """A log axis of values labelled in plain numbers (30, 50, 100, 200), not powers of ten; every tick labelled
    where those would leave fewer than two labels in view (values from 700 to 770: 700, 800)."""
    from matplotlib.ticker import FuncFormatter

    def shown(value: float) -> bool:
        return f"{value:g}"[0] in "1235"

    def minor(value: float, _) -> str:
        low, high = sorted(ax.get_ylim())
        ticks = [t for t in [*ax.yaxis.get_majorticklocs(), *ax.yaxis.get_minorticklocs()] if low <= t <= high]
        return f"{value:g}" if shown(value) or sum(map(shown, ticks)) < 2 else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def value_axis(ax, low: float, high: float, log: bool = True, bounds=(-np.inf, np.inf)) -> None:
    """The y axis for values from ``low`` to ``high``: log with plain labels where they span more than x3 (and
    ``log``), else linear in plain numbers (no offset, no scientific notation), at least 2% of the value tall, so
    that a near-constant curve reads as constant, and within ``bounds`` (the values the quantity can take)."""
    if log and low > 0 and high / low > 3:
        ax.set_yscale("log")
        plain_log_values(ax)
        return
    middle, span = (low + high) / 2, high - low
    if span < 0.02 * abs(middle):
        span = 0.02 * abs(middle) or 1.0
        floor, ceiling = bounds
        bottom = min(max(middle - span, floor), max(ceiling - 2 * span, floor))
        ax.set_ylim(bottom, min(bottom + 2 * span, ceiling))
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)


def mark_train_len(ax, train_len: int, label: str = "L_train", top: bool = True) -> None:
    """A dotted line at ``train_len``, named at the top of the panel (``top``; else at its bottom: where curves of
    accuracy are not)."""
    ax.axvline(train_len, color="0.55", ls=":", lw=1.2, zorder=0)
    ax.annotate(
        label,
        (train_len, 1 if top else 0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12 if top else 4),
        textcoords="offset points",
        fontsize=8,
        color="0.35",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5},
    )


def mark_chance(ax, level: float) -> None:
    """A grey dash-dot line at a metric's chance ``level`` (as shown: in %), named at the panel's right."""
    ax.axhline(level, color="0.45", ls="-.", lw=1.1, zorder=0)
    ax.annotate(
        f"chance {level:.0f}%",
        (1, level),
        xycoords=("axes fraction", "data"),
        xytext=(-3, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="0.35",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.5},
    )


def legend_columns(names: list[str], width: float = PANEL_WIDTH) -> int:
    """Legend columns that fit a panel ``width`` inches wide (9-point text)."""
    room = int(width * 72 / (9 * 0.56))
    longest = max((len(name) for name in names), default=1) + 6
    return max(1, min(len(names), 3, room // longest))


def legend_below(ax) -> None:
    """The panel's legend below its axes, in as many columns as fit its width."""
    names = ax.get_legend_handles_labels()[1]
    if names:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=legend_columns(names), frameon=False)


def share_log_scale(axes) -> None:
    """One value scale across the log-scaled panels that have data: they compare at a glance."""
    shown = [ax for ax in axes if ax.has_data() and ax.get_yscale() == "log"]
    if len(shown) > 1:
        low, high = min(ax.get_ylim()[0] for ax in shown), max(ax.get_ylim()[1] for ax in shown)
        for ax in shown:
            ax.set_ylim(low, high)


def wrapped(text: str, width: float = PANEL_WIDTH) -> str:
    """``text`` in lines that fit a panel ``width`` inches wide (10-point text)."""
    return "\n".join(textwrap.wrap(text, int(width * 72 / (10 * 0.62)), break_on_hyphens=False))


def title(ax, holds: str, takeaway: str, width: float = PANEL_WIDTH) -> None:
    """A panel's title: what it holds, then what it shows."""
    ax.set_title(wrapped(holds, width) + "\n" + wrapped(takeaway, width), fontsize=10)


@dataclass
class Drawn:
    """A panel to draw: its rows and how, and the lines its title and legend take (for the figure's height)."""

    panel: Panel
    context: object  # what the drawing function needs (a table, an L_train, ...)
    names: dict
    holds: str = ""
    takeaway: str = ""
    title_lines: int = 2


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


def panel_grid(sections: list[list[Drawn]], note: str, width: float = PANEL_WIDTH, axes_height: float = AXES_HEIGHT):
    """A figure of ``sections`` of panels, each section starting a row of at most ``COLUMNS``, each row as tall as
    its longest title and legend need; ``note`` above. Returns (figure, [(axes, drawn)])."""
    rows = [section[start : start + COLUMNS] for section in sections for start in range(0, len(section), COLUMNS)]
    columns = max(len(row) for row in rows)
    heights = []
    for row in rows:
        title_lines = max(drawn.title_lines for drawn in row)
        legend_lines = max(
            math.ceil(len(drawn.names) / legend_columns(list(drawn.names.values()), width)) for drawn in row
        )
        heights.append(axes_height + 0.18 * title_lines + 0.19 * legend_lines + 0.85)
    note = wrapped(note, width * columns * 1.1)
    top = 0.2 + 0.17 * (note.count("\n") + 1)
    fig, axes = pyplot().subplots(
        len(rows),
        columns,
        figsize=(width * columns, sum(heights) + top),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"height_ratios": heights},
    )
    fig.suptitle(note, fontsize=9, color="0.25")
    placed = []
    for row, row_axes in zip(rows, axes, strict=True):
        for ax in row_axes[len(row) :]:
            ax.axis("off")
        placed += list(zip(row_axes, row, strict=False))
    return fig, placed


def fit_height(fig) -> None:
    """Draw ``fig`` until every legend and title lies inside it, growing it where one does not: the layout makes
    room for the legends below the axes from where they were at its last run, which moves them."""
    for _ in range(4):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
        boxes += [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
        if not boxes:
            return
        below = -min(box.y0 for box in boxes) / fig.dpi
        above = max(box.y1 for box in boxes) / fig.dpi - fig.get_figheight()
        if below <= 0 and above <= 0:
            return
        fig.set_figheight(fig.get_figheight() + max(below, 0) + max(above, 0) + 0.05)


def title_lines(holds: str, takeaway: str) -> int:
    return wrapped(holds).count("\n") + wrapped(takeaway).count("\n") + 2


def draw_lengths(summary: Summary, tables: list[Table], pes_as_trained: bool = True):
    """The metric against L_eval, mean +- std over seeds, L_train marked, the legend below each panel: a section
    of panels per table, its rows split by ``split_rows``; one value scale across a table's panels."""
    info = row_info(summary)
    sections, drawn_tables = [], []
    for table in tables:
        panels = split_rows(info, list(table.index), pes_as_trained)
        drawn_tables += [(table, panel.labels) for panel in panels]
        sections.append([Drawn(panel, table, {}) for panel in panels])
    note, marks = coverage(drawn_tables, info)
    train_lens = {table.key.train_len for table in tables}
    if len(train_lens) == 1:
        note = f"L_train {train_lens.pop()} (dotted line); {note}"
    for section in sections:
        for drawn in section:
            table = drawn.context
            drawn.names = {label: label + marks.get((table.key, label), "") for label in drawn.panel.labels}
            drawn.holds = f"{table_name(table, not note.startswith('L_train'))} · {drawn.panel.holds}"
            drawn.takeaway = lengths_takeaway(table, drawn.panel.labels, reference(info, drawn.panel))
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
    if any(pd.notna(info.base.get(label)) for table in tables for label in table.index):
        note += "; solid: the first stage's weights (as trained or scaled at evaluation), dashed: fine-tuned"
    if any(table.chance for table in tables):
        note += "; chance level: grey dash-dot line"
    fig, placed = panel_grid(sections, note)
    by_table: dict = {}
    for ax, drawn in placed:
        table, panel = drawn.context, drawn.panel
        key, metric = table.key, table.metric
        styles = line_styles(info, panel.labels, panel.by_method)
        unlearned = {label: unlearned_seeds(table, info, label) for label in panel.labels}
        draw_rows(ax, table, panel.labels, styles, metric.scale, drawn.names, unlearned)
        mark_train_len(ax, key.train_len, top=not metric.percent)
        stage_lens = {int(info.stage_len[label]) for label in panel.labels if pd.notna(info.stage_len.get(label))}
        for stage_len in sorted(stage_lens - {key.train_len}):
            if stage_len > max(table.lengths):
                continue
            mark_train_len(ax, stage_len, f"L' {stage_len}", top=not metric.percent)
        for chance in table.chance:
            mark_chance(ax, chance * metric.scale)
        length_axis(ax, table.lengths)
        ax.set(xlabel="L_eval (tokens)", ylabel=metric.name)
        if not table.cells.loc[panel.labels, "mean"].notna().any():  # no key token at any length: an empty frame
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no values", transform=ax.transAxes, ha="center", va="center", color="0.35")
        elif metric.percent:  # a share: 0-100%, linear; perplexity: log
            ax.set_ylim(-3, 103)
        else:
            ax.set_yscale("log")
            plain_log_values(ax)
            by_table.setdefault(key, []).append(ax)
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    for axes in by_table.values():
        share_log_scale(axes)
    fit_height(fig)
    return fig


def reference(info: pd.DataFrame, panel: Panel) -> str | None:
    """The row a panel of one PE's variants compares them with: the PE as trained."""
    if not panel.by_method:
        return None
    trained = [label for label in panel.labels if pd.isna(info.base[label]) and pd.isna(info.variant[label])]
    return trained[0] if trained else None


def table_name(table: Table, train_len: bool = True) -> str:
    """What a table holds in a few words: its task and metric (a probe's) or protocol, and its L_train."""
    key = table.key
    if key.task:
        what = f"{key.task}, {table.metric.short_name}"
    else:  # a protocol of several metrics (key tokens, a haystack) names the table's
        what = key.protocol + (f", {table.metric.short_name}" if len(metrics_of(key.protocol)) > 1 else "")
    return f"{what}, L_train {key.train_len}" if train_len else what


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


@figure("extension.png")
def extension(summary: Summary):
    """Second stages in the ``nonoverlap`` table (else each text table holding them), perplexity against L_eval,
    mean +- std over seeds: the rows of each PE fine-tuned, split as ``split_rows`` splits them (a PE with variants
    or several methods: its zero-shot variants, then its stages by length and positions, coloured by method, PI
    as ``linear``; the PEs with one stage each beside their bases, coloured by PE)."""
    labels = summary.labels
    staged = [
        table
        for key, table in summary.tables.items()
        if key.metric == "ppl" and not key.task and labels.base[table.index].notna().any()
    ]
    if not staged:
        return None
    tables = []
    for table in [table for table in staged if table.key.protocol == "nonoverlap"] or staged:
        rows = labels.loc[table.index]
        fine_tuned = set(rows.root[rows.base.notna()])
        kept = [label for label in table.index if rows.root[label] in fine_tuned]
        tables.append(replace(table, cells=table.cells.loc[kept], rows=table.rows.loc[kept]))  # unranked kept
    return draw_lengths(summary, tables, pes_as_trained=False)


@figure("adaptation.png")
def adaptation(summary: Summary):
    """Validation perplexity against fine-tuning steps (the PI paper's figure of how fast each method adapts), the
    panels of each validation length side by side: a PE's several stages coloured by method, the PEs with one
    stage each coloured by PE; the title names the lowest and highest at the first step shown (0, before
    fine-tuning, in runs that logged it) and how far apart they end."""
    frame = summary.adaptation
    if frame.empty:
        return None
    info = row_info(summary)
    section = []  # few panels: side by side
    several_bases = frame.train_len.nunique() > 1
    for (train_len, length), of_length in frame.groupby(["train_len", "val_len"]):
        rows = list(of_length.row.unique())
        roots = roots_of(summary, rows)
        several = [root for root, n in Counter(roots).items() if n > 1]
        panels = [
            Panel(part, True, f"{root}'s second stages")
            for root in several
            for part in chunks([[row] for row in roots.index[roots == root]])
        ]
        single = [[row] for row in rows if roots[row] not in several]
        if single:
            panels += by_family(info, single, "one second stage each", merge=True)
        for panel in panels:
            curves = {row: of_length[of_length.row == row] for row in panel.labels}
            drawn = Drawn(panel, (length, curves), {})
            drawn.holds = (
                f"{panel.holds} · {f'L_train = {train_len}, ' if several_bases else ''}validating at L = {length}"
            )
            drawn.takeaway = adaptation_takeaway(curves)
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
            section.append(drawn)
    note, marks = seed_marks(frame.groupby("row").seeds.max(), "mean ± std")
    for drawn in section:
        drawn.names = {
            row: row + marks.get(row, "") + fewer_seeds_mark(frame[frame.row == row]) for row in drawn.panel.labels
        }
    note += "; a stage validates at its own training length (L' at full length, L_train for PoSE)"
    fig, placed = panel_grid([section], note)
    for ax, drawn in placed:
        _, curves = drawn.context
        styles = line_styles(info, drawn.panel.labels, drawn.panel.by_method)
        for row, curve in curves.items():
            error_curve(
                ax, curve.step, curve["mean"], curve["std"], drawn.names[row], styles[row], METRICS["ppl"].bounds
            )
        values = pd.concat([curve["mean"] for curve in curves.values()])
        value_axis(ax, float(values.min()), float(values.max()), bounds=METRICS["ppl"].bounds)
        ax.set(xlabel="fine-tuning step", ylabel="validation perplexity")
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


def fewer_seeds_mark(curve: pd.DataFrame) -> str:
    """What a row's legend entry adds where some of its points pool fewer seeds than the rest (a validation some
    seeds did not log, such as step 0 of runs made before it was logged): `` [2 seeds at step 0]``."""
    fewer = curve[curve.seeds < curve.seeds.max()]
    if fewer.empty:
        return ""
    counts = "/".join(str(n) for n in sorted(fewer.seeds.unique()))
    where = f"step {int(fewer.step.iloc[0])}" if len(fewer) == 1 else f"{len(fewer)} of its steps"
    return f" [{counts} seed{'s' * (counts != '1')} at {where}]"


def adaptation_takeaway(curves: dict[str, pd.DataFrame]) -> str:
    """The lowest and highest validation perplexity at the first step every curve logged, and their spread at the
    last such step (each curve's first and last where they share none); or that every curve is at one value (to two
    decimals)."""
    steps = [set(curve.step) for curve in curves.values()]
    shared = sorted(set.intersection(*steps))
    start, end = (shared[0], shared[-1]) if shared else (min(map(min, steps)), max(map(max, steps)))

    def at(step, fallback: int) -> pd.Series:
        return pd.Series(
            {
                row: curve["mean"][curve.step == step].iloc[0] if shared else curve["mean"].iloc[fallback]
                for row, curve in curves.items()
            }
        )

    first, last = at(start, 0), at(end, -1)
    start, end = int(start), int(end)
    every = pd.concat([curve["mean"] for curve in curves.values()])
    if round(every.min(), 2) == round(every.max(), 2):
        return f"every curve at {every.min():.2f} from step {start} on: validation does not tell them apart"
    if len(curves) == 1:
        return f"{first.index[0]} {first.iloc[0]:.2f} at step {start}, {last.iloc[0]:.2f} at step {end}"
    best, worst = first.idxmin(), first.idxmax()
    spread = last.max() - last.min()
    apart = f"{spread:.2f} apart" if spread >= 0.01 else "within 0.01"
    lowest = f"{best} lowest at step {start} ({first[best]:.2f})"
    return f"{lowest}, {worst} highest ({first[worst]:.2f}); {apart} at step {end}"


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


# Attention diagnostics (docs/diagnostics.md): a panel per statistic, (statistic, rows, what it shows, y label).
DIAGNOSTIC_PANELS = (
    ("normalized_entropy", "all", "attention entropy / log n", "entropy / log n"),
    ("entropy", "all", "attention entropy", "entropy (nats)"),
    ("sink", "all", "attention on the first token (sink)", "weight on token 0"),
    ("distance", "all", "mean attention distance", "distance (tokens)"),
    ("beyond", "all", "attention mass at distances >= L_train", "weight at i - j >= L_train"),
    (
        "beyond",
        "beyond_train",
        "attention mass at distances >= L_train, rows i >= L_train",
        "weight at i - j >= L_train",
    ),
    ("copying_gain", "", "copying gain: NLL drop on a repeat L/2 back", "gain (nats per token)"),
    ("unseen_fraction", "", "rotary PEs: distances at unseen angles", "fraction of distances 0..L-1"),
)
# The values each diagnostic can take: shares of attention in [0, 1], entropies and distances >= 0.
DIAGNOSTIC_BOUNDS = {
    "normalized_entropy": (0.0, 1.0),
    "entropy": (0.0, np.inf),
    "sink": (0.0, 1.0),
    "distance": (0.0, np.inf),
    "beyond": (0.0, 1.0),
    "unseen_fraction": (0.0, 1.0),
}
COPYING_LEVEL = 0.1  # nats per token: a gain below it at every length is no in-context copying


@figure("diagnostics.png")
def diagnostics(summary: Summary):
    """The runs' attention diagnostics (``Summary.diagnostics``, from ``<run>/diagnostics/diagnostics.json``), a
    panel per statistic (``DIAGNOSTIC_PANELS``: entropy, normalized entropy, sink mass, mean distance, mass beyond
    L_train over all rows and over the rows i >= L_train, the copying gain, the unseen-angle fraction of rotary
    PEs) against L_eval, mean +- std over seeds of each run's mean over layers and heads, a curve per row label in
    its PE's colour, the rows split as ``split_rows`` splits them (at most ``MAX_CURVES`` a panel), a section per
    L_train; the title names the highest and the lowest row at the longest L_eval with their change from L_train
    (``diagnostic_takeaway``). None when no run has diagnostics."""
    frame = summary.diagnostics
    if frame.empty:
        return None
    info = row_info(summary)
    several = frame.train_len.nunique() > 1
    sections = []
    for train_len, of_train_len in frame.groupby("train_len", sort=True):
        section, shown = [], set()
        for panel in split_rows(info, list(of_train_len.label.unique())):
            for statistic, rows, what, ylabel in DIAGNOSTIC_PANELS:
                data = of_train_len[
                    (of_train_len.statistic == statistic)
                    & (of_train_len.rows == rows)
                    & of_train_len.label.isin(panel.labels)
                ]
                labels = [label for label in panel.labels if label in set(data.label)]
                if data.empty or (statistic, rows, frozenset(labels)) in shown:  # a statistic only some rows have
                    continue
                shown.add((statistic, rows, frozenset(labels)))
                drawn = Drawn(Panel(labels, panel.by_method, panel.holds), (train_len, statistic, data, ylabel), {})
                drawn.holds = f"{what} · " + (f"L_train {train_len} · " if several else "") + panel.holds
                drawn.takeaway = diagnostic_takeaway(data, labels, train_len, statistic)
                drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
                section.append(drawn)
        sections.append(section)
    note, marks = seed_marks(frame.groupby("label").seeds.max(), "mean ± std")
    at = "" if several else f"L_train {frame.train_len.iloc[0]} (dotted line); "
    note = (
        f"attention diagnostics ({at}docs/diagnostics.md): each run's mean over layers and heads of a statistic "
        f"averaged over its windows' query rows, then {note}; copying gain: a window's first half repeated, the "
        "same tokens' NLL the first time minus at the repeat"
    )
    for section in sections:
        for drawn in section:
            drawn.names = {label: label + marks.get(label, "") for label in drawn.panel.labels}
    fig, placed = panel_grid(sections, note)
    for ax, drawn in placed:
        train_len, statistic, data, ylabel = drawn.context
        styles = line_styles(info, drawn.panel.labels, drawn.panel.by_method)
        bounds = DIAGNOSTIC_BOUNDS.get(statistic, (-np.inf, np.inf))
        for label in drawn.panel.labels:
            curve = data[data.label == label].sort_values("length")
            error_curve(ax, curve.length, curve["mean"], curve["std"], drawn.names[label], styles[label], bounds)
        if statistic == "copying_gain":
            ax.axhline(0, color="0.45", lw=0.8, zorder=0)
        mark_train_len(ax, train_len)
        length_axis(ax, sorted(data.length.unique()))
        value_axis(ax, float(data["mean"].min()), float(data["mean"].max()), log=False, bounds=bounds)  # linear
        ax.set(xlabel="L_eval (tokens)", ylabel=ylabel)
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


@figure("diagnostics_vs_ppl.png")
def diagnostics_vs_ppl(summary: Summary):
    """Which diagnostic goes with perplexity leaving its L_train level: a panel per statistic of
    ``DIAGNOSTIC_PANELS``, at the longest L_eval it has a correlation at, each row with diagnostics a point (its PE's
    colour and marker): the statistic's mean over seeds against its ``nonoverlap`` perplexity ratio
    ppl(L_eval) / ppl(L_train) (``perplexity_ratio``); the title gives Spearman's rank correlation across the rows
    (``Summary.diagnostic_correlations``). None without correlations."""
    from matplotlib.ticker import MaxNLocator

    correlations = summary.diagnostic_correlations
    if correlations.empty:
        return None
    info, frame = row_info(summary), summary.diagnostics
    sections = []
    for train_len, of_train_len in correlations.groupby("train_len", sort=True):
        section = []
        for statistic, rows, what, xlabel in DIAGNOSTIC_PANELS:
            found = of_train_len[(of_train_len.statistic == statistic) & (of_train_len.rows == rows)]
            if found.empty:
                continue
            found = found.loc[found.length.idxmax()]
            longest = int(found.length)
            ratio = perplexity_ratio(summary.tables, int(train_len), longest)
            data = frame[
                (frame.train_len == train_len)
                & (frame.statistic == statistic)
                & (frame.rows == rows)
                & (frame.length == longest)
                & frame.label.isin(ratio.index)
            ].dropna(subset=["mean"])
            labels = list(data.label)
            drawn = Drawn(Panel(labels, False, what), (statistic, data, ratio, xlabel, train_len, longest), {})
            drawn.holds = f"{what} at {times_train_len(longest, train_len)}"
            order = "no order (a constant)" if pd.isna(found.rho) else f"Spearman rho {found.rho:+.2f}"
            drawn.takeaway = f"{order} with the perplexity ratio over {int(found.labels)} rows"
            drawn.title_lines = title_lines(drawn.holds, drawn.takeaway)
            drawn.names = {label: label for label in labels}
            section.append(drawn)
        sections.append(section)
    note = (
        "each row's diagnostic (mean over seeds of its mean over layers and heads, docs/diagnostics.md) against its "
        "perplexity at that L_eval over its perplexity at L_train (nonoverlap, as trained, mean over seeds); rho: "
        "Spearman's rank correlation across the rows, +1 when the statistic orders them as their perplexity's "
        "growth does"
    )
    fig, placed = panel_grid(sections, note)
    for ax, drawn in placed:
        statistic, data, ratio, xlabel, train_len, longest = drawn.context
        styles = line_styles(info, drawn.panel.labels, False)
        bounds = DIAGNOSTIC_BOUNDS.get(statistic, (-np.inf, np.inf))
        for label in drawn.panel.labels:
            value = data[data.label == label]
            style = {k: v for k, v in styles[label].items() if k != "ls"}
            if styles[label]["ls"] == SECOND_STAGE:  # a second stage has its base's colour: hollow, as dashed lines
                style["mfc"] = "none"
            ax.errorbar(
                value["mean"],
                [ratio[label]],
                xerr=bounded_error(value["mean"], value["std"], bounds),
                ms=6,
                capsize=2,
                ls="none",
                label=label,
                **style,
            )
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.axhline(1, color="0.45", lw=0.8, zorder=0)
        shown = ratio[drawn.panel.labels]
        value_axis(ax, min(shown.min(), 1.0), max(shown.max(), 1.0))
        ax.set(xlabel=xlabel, ylabel=f"ppl at {times_train_len(longest, train_len)} / at L_train")
        title(ax, drawn.holds, drawn.takeaway)
        legend_below(ax)
    fit_height(fig)
    return fig


def diagnostic_takeaway(data: pd.DataFrame, labels: list[str], train_len: int, statistic: str) -> str:
    """What a diagnostics panel shows at the longest L_eval its rows have values at: the highest and the lowest row
    (or the one row), each with its change from its value at L_train where it has one; for the copying gain, that no
    row copies (below ``COPYING_LEVEL`` at every length) where none does, else the copy's distance (L/2)."""
    data = data[data.label.isin(labels)]
    if data.empty:
        return "no values"
    digits = 1 if statistic == "distance" else 2 if statistic.startswith("copying") else 3
    if statistic == "copying_gain" and data["mean"].max() < COPYING_LEVEL:
        return f"no row gains {COPYING_LEVEL} nats per token on a repeat at any L_eval: no in-context copying"
    longest = int(data.length.max())
    at = times_train_len(longest, train_len)
    if statistic == "copying_gain":
        at += f" (copy {longest // 2} back)"
    last = data[data.length == longest].set_index("label")["mean"].reindex(labels).dropna()
    base = data[data.length == train_len].set_index("label")["mean"]

    def shown(label: str) -> str:
        text = f"{label} {last[label]:.{digits}f}"
        if label in base.index and longest != train_len:
            text += f" ({last[label] - base[label]:+.{digits}f} from L_train)"
        return text

    if len(last) == 1:
        return f"at {at}: {shown(last.index[0])}"
    highest, lowest = last.idxmax(), last.idxmin()
    if round(last[highest], digits) == round(last[lowest], digits):
        return f"at {at}: every row at {last[highest]:.{digits}f}"
    return f"at {at}: highest {shown(highest)}; lowest {shown(lowest)}"
