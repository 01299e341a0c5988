"""Panel sizes, colours, markers and line styles: one colour per PE in every figure (``pe_style``), one per extension
method where a panel compares one PE's methods (``METHOD_STYLES``)."""

import zlib
from collections.abc import Callable

import pandas as pd

from lenext.pe import FAMILIES
from lenext.report.stats import Summary

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
