"""The committed studies: their tables are exactly what the report tool makes of their committed runs."""

from pathlib import Path

import pytest

from lenext.report import report

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
    for name in ("table.md", "table.csv", "table.tex"):
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
