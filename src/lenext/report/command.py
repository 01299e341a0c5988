"""The report as a command: ``lenext-report <folders...> [--out DIR]`` (or ``python -m lenext.report``)."""

import argparse
import fnmatch
import os
import sys
import tempfile

import pandas as pd

from lenext.errors import errors_in_one_line
from lenext.files import TEMPORARY_MARK, write_atomic
from lenext.report.figures import FIGURES, write_figures
from lenext.report.load import load
from lenext.report.stats import DEPTH_KEY, Summary
from lenext.report.tables import report_markdown, to_csv, to_latex
from lenext.results import RESULTS_FILE

DESCRIPTION = "Results files -> paper-style tables (Markdown, LaTeX, CSV) and plots (PNG)."
TABLE_FILES = ("table.md", "table.tex", "table.csv")
DATA_FILES = {  # file name -> (the Summary's frame, float format)
    "per_position.csv": ("positions", "%.6f"),
    "adaptation.csv": ("adaptation", "%.4f"),
    "diagnostics.csv": ("diagnostics", "%.6f"),
    "diagnostics_vs_ppl.csv": ("diagnostic_correlations", "%.4f"),
}
DEPTH_FILES = "*_depth.csv"  # one per protocol with depth rows (``depth_csvs``)


def data_files(summary: Summary) -> dict[str, str]:
    """The figures' data as CSV, by file name, for the runs that have it: per_position.csv, adaptation.csv,
    ``<name>_depth.csv`` per protocol with depth rows (``depth_csvs``), diagnostics.csv (the runs' attention
    diagnostics and copying score: ``lenext.report.stats.diagnostic_statistics``) and diagnostics_vs_ppl.csv (each
    diagnostic's rank correlation with the perplexity ratio: ``diagnostic_correlations``), a row's label in the
    column ``pe``, as the tables' CSV names it (``row`` for adaptation)."""
    frames = {name: (getattr(summary, frame), float_format) for name, (frame, float_format) in DATA_FILES.items()}
    frames |= {name: (grid, "%.4f") for name, grid in depth_csvs(summary.depths).items()}
    return {
        name: frame.rename(columns={"label": "pe"}).to_csv(index=False, float_format=float_format)
        for name, (frame, float_format) in frames.items()
        if not frame.empty
    }


def depth_csvs(depths: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each protocol's depth grid (``lenext.report.stats.depth_grids``) by file name, ``<name>_depth.csv`` (the
    probe's task, else the protocol: ``passkey_depth.csv``, ``niah_single_depth.csv``): train_len, label, depth,
    length, mean (the protocol's headline metric, a share), std, seeds, answers, and chance where the metric has
    one."""
    if depths.empty:
        return {}
    grids = {}
    for name, grid in depths.groupby("name", sort=False):
        unused = [*DEPTH_KEY[:3], *(["chance"] if grid.chance.isna().all() else [])]
        grids[f"{name}_depth.csv"] = grid.drop(columns=unused).reset_index(drop=True)
    return grids


def report(folders: list[str], out: str, figures: bool = True) -> str:
    """Write table.{md,tex,csv}, the figures of ``lenext.report.figures.FIGURES`` the runs have something for
    (unless ``figures`` is False) and their data (``data_files``) into ``out``; return the Markdown."""
    loaded = load(folders)
    if not loaded.runs:
        incomplete = loaded.incomplete
        first = f"; {incomplete[0][0]}: {incomplete[0][1]}" if incomplete else ""
        raise SystemExit(
            f"error: no complete {RESULTS_FILE} under {', '.join(folders)}"
            + (
                f" ({len(incomplete)} incomplete runs{first}{', ...' if len(incomplete) > 1 else ''})"
                if incomplete
                else ""
            )
        )
    summary = Summary(loaded)
    markdown = report_markdown(summary.tables, loaded)
    os.makedirs(out, exist_ok=True)
    remove_earlier_report(out)
    for name, text in zip(TABLE_FILES, (markdown, to_latex(summary.tables), to_csv(summary.tables)), strict=True):
        write_atomic(os.path.join(out, name), text)
    for name, text in data_files(summary).items():
        write_atomic(os.path.join(out, name), text)
    if figures:
        write_figures(summary, out)
    return markdown


def remove_earlier_report(out: str) -> None:
    """Remove what an earlier report wrote into ``out`` (its tables, figures and their data, by name, and the
    temporaries of their writes a killed report left), so that no file of another study, or of these runs before,
    stays beside this report's; other files are left alone."""
    owned = (*TABLE_FILES, *DATA_FILES, DEPTH_FILES, *FIGURES)
    owned += tuple(f".{pattern}.*{TEMPORARY_MARK}*" for pattern in owned)  # lenext.files.atomic_path's names
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if os.path.isfile(path) and any(fnmatch.fnmatchcase(name, pattern) for pattern in owned):
            os.remove(path)


def unwritable(out: str) -> str | None:
    """Why tables and plots cannot be written into the folder ``out`` (which need not exist yet), or None."""
    folder = out
    while not os.path.exists(folder):  # the nearest existing folder: where ``out`` would be created
        folder = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{folder}: {e.strerror or type(e).__name__}"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lenext-report", description=DESCRIPTION)
    parser.add_argument("folders", nargs="+", help="multirun folder(s) or run folders holding results.json")
    parser.add_argument("--out", help="where to write tables and plots (default: <first folder>/report)")
    parser.add_argument(
        "--no-figures",
        action="store_true",
        help="tables and the figures' CSV data only, no PNG (matplotlib takes most of a large study's report)",
    )
    args = parser.parse_args(argv)
    for folder in args.folders:  # before --out, which defaults to a folder inside the first
        if os.path.isfile(folder):
            raise SystemExit(
                f"error: {folder!r} is a file, not a folder: give the run folder that holds it "
                f"({os.path.dirname(os.path.abspath(folder))}), a multirun folder or run folders"
            )
    if args.out is not None and not args.out.strip():  # an unset shell variable, most likely
        raise SystemExit("error: --out='' is invalid: give the folder to write the report to, or leave --out out")
    out = args.out or os.path.join(args.folders[0], "report")
    problem = unwritable(out)
    if problem:
        raise SystemExit(f"error: --out={out!r} cannot hold the report ({problem}): give a folder you can write to")
    try:
        with errors_in_one_line(sigterm=True):
            markdown = report(args.folders, out, figures=not args.no_figures)
    except OSError as e:  # the disk filled, a folder vanished: each file already written is whole (atomic writes)
        raise SystemExit(f"error: the report could not be written to {out!r}: {e}") from None
    print(markdown)
    print(f"tables and plots: {out}", file=sys.stderr)
