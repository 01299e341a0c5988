"""The committed studies: their tables are exactly what the report tool makes of their committed runs."""

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from lenext.report import load, passkey_depths, report

STUDIES = Path(__file__).resolve().parents[1] / "studies"


# A study's report is made from its runs and, for reference_2024 (the 2024-26 rows while they gather seeds), from
# the reference study's runs too, so that its table sets them beside every other PE.
SOURCES = {"reference_2024": ["reference", "reference_2024"]}


@pytest.mark.parametrize("study", ["reference", "probes", "extension", "extension_passkey", "reference_2024"])
def test_committed_tables_are_recomputed_from_the_committed_results_files(study, tmp_path):
    folder = STUDIES / study
    if not (folder / "runs").is_dir():
        pytest.skip(f"no committed {study} study")
    report([str(STUDIES / source / "runs") for source in SOURCES.get(study, [study])], str(tmp_path))
    for name in ("table.md", "table.csv", "table.tex", "passkey_depth.csv"):
        if name == "passkey_depth.csv" and not (folder / name).exists():
            continue
        committed = (folder / name).read_text().replace(str(folder / "runs"), "<runs>")
        assert (tmp_path / name).read_text().replace(str(folder / "runs"), "<runs>") == committed, name


def test_the_readmes_headline_table_is_the_committed_reference_table():
    """README.md shows the reference study's `nonoverlap` table: every row it shows is a row the report wrote."""
    readme = (STUDIES.parent / "README.md").read_text()
    committed = (STUDIES / "reference" / "table.md").read_text().split("### L_train = 64, protocol `nonoverlap`")[1]
    shown = [line for line in readme.splitlines() if line.startswith("| ") and "±" in line]
    assert len(shown) >= 10
    for line in shown:
        assert line in committed.splitlines(), line


def test_the_passkey_depth_grid_is_each_cells_mean_and_std_over_seeds():
    """The report's passkey depth grid (passkey_depth.csv), made from the committed probes runs, against a plain
    loop over their depth rows (every passkey run learned its task, so every row counts): mean, sample std, seeds
    and answers per cell."""
    cells = defaultdict(list)
    for results_file in (STUDIES / "probes" / "runs").glob("*/results.json"):
        results = json.loads(results_file.read_text())
        if results["meta"]["task"] != "passkey":
            continue
        for row in results["rows"]:
            if row.get("depth") is not None and row["status"] == "ok":
                cells[(results["meta"]["row"], row["depth"], row["length"])].append(row)
    assert len(cells) == 8 * 5 * 6 + 5  # rows x depth buckets x lengths; learned at L_train only (n/a beyond)
    grid = passkey_depths(load([str(STUDIES / "probes" / "runs")]).frame).set_index(["label", "depth", "length"])
    assert len(grid) == len(cells)
    for (row, depth, length), rows in cells.items():
        cell = grid.loc[(row, depth, length)]
        matches = [row["exact_match"] for row in rows]
        assert cell["mean"] == pytest.approx(statistics.mean(matches), abs=1e-4)
        assert cell["std"] == pytest.approx(statistics.stdev(matches), abs=1e-4)
        assert (cell["seeds"], cell["answers"]) == (len(rows), sum(row["answers"] for row in rows))
