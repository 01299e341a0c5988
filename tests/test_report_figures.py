"""The report's figure registry: a figure registered in one entry is drawn and written with the others
(docs/adding/figure.md, whose example is tests/examples/longest_length.py)."""

import pytest

from lenext.report import figures, report
from tests.examples.longest_length import longest_length
from tests.test_report import write_probe_run, write_run


@pytest.fixture
def registry(monkeypatch):
    """The figure registry, restored after the test: figures registered in it are the test's alone."""
    monkeypatch.setattr(figures, "FIGURES", dict(figures.FIGURES))
    return figures.FIGURES


def two_seeds_of_two_pes(folder):
    for seed in range(2):
        write_run(folder / str(2 * seed), "alibi", seed, {64: 20.0 + seed, 128: 19.0 + seed})
        write_run(folder / str(2 * seed + 1), "rope", seed, {64: 21.0 + seed, 128: 40.0 + seed})
    return folder


def test_a_figure_registered_in_one_entry_is_written_with_the_others(registry, tmp_path):
    assert (
        figures.figure("longest_length.png")(longest_length) is longest_length
    )  # the decorator, as figures.py uses it
    assert registry["longest_length.png"] is longest_length
    report([str(two_seeds_of_two_pes(tmp_path / "runs"))], str(tmp_path / "out"))
    written = tmp_path / "out" / "longest_length.png"
    assert written.read_bytes().startswith(b"\x89PNG") and (tmp_path / "out" / "ppl_vs_length.png").exists()


def test_a_figure_with_nothing_to_draw_writes_no_file(registry, tmp_path):
    registry["longest_length.png"] = longest_length
    write_probe_run(tmp_path / "runs" / "0", "nope", 0, {32: 1.0, 64: 0.5})  # accuracy tables: no perplexity
    report([str(tmp_path / "runs")], str(tmp_path / "out"))
    assert (tmp_path / "out" / "accuracy_vs_length.png").exists()
    assert not any((tmp_path / "out" / name).exists() for name in ("longest_length.png", "ppl_vs_length.png"))
