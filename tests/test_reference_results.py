"""The committed reference study: its tables are exactly what the report tool makes of its committed runs."""

from pathlib import Path

import pytest

from lenext.report import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.mark.skipif(not (RESULTS / "runs").is_dir(), reason="no committed reference study")
def test_committed_tables_are_recomputed_from_the_committed_results_files(tmp_path):
    report([str(RESULTS / "runs")], str(tmp_path))
    for name in ("table.md", "table.csv", "table.tex"):
        committed = (RESULTS / name).read_text().replace(str(RESULTS / "runs"), "<runs>")
        assert (tmp_path / name).read_text().replace(str(RESULTS / "runs"), "<runs>") == committed, name
