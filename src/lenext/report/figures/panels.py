"""Panels: which rows are drawn together, at most ``MAX_CURVES`` curves each (``split_rows``)."""

import math
from dataclasses import dataclass

import pandas as pd

from lenext.report.figures.style import FAMILY_PANELS_ABOVE, MAX_CURVES, families_of
from lenext.report.load import OTHER_FAMILY


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
