"""The report's diagnostics outputs: diagnostics.csv (mean and std over seeds of each run's mean over layers and
heads, from fabricated diagnostics.json files whose values are checked by hand) and diagnostics.png (a panel per
statistic, the PE's colour, a computed title); runs without diagnostics skipped, diagnose.py's folders no runs."""

import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest

from lenext.report import figures, load, report
from lenext.report.stats import Summary
from tests.test_report import write_run
from tests.test_report_figures import drawn_lines

STATISTICS = ("entropy", "normalized_entropy", "sink", "distance", "beyond")


def write_diagnostics(run, seed_shift: float, gains: dict, scaling: str | None = None, unseen: dict | None = None):
    """``<run>/diagnostics/diagnostics.json`` as diagnose.py writes it (2 layers x 2 heads, L_train 64) at the
    lengths of ``gains`` (length -> copying gain): every attention statistic's [layer][head] values are
    [[0.1, 0.3], [0.2, 0.4]] + ``seed_shift`` (mean 0.25 + shift) over all rows, twice that over the rows
    i >= L_train (beyond 64 only); the copying NLLs 3 + gain and 3; ``unseen`` (length -> fraction): a rotary
    PE's coverage summary. With diagnose.py's .hydra and log beside it."""
    folder = run / "diagnostics"
    os.makedirs(folder / ".hydra", exist_ok=True)
    (folder / "diagnose.log").write_text("diagnosed\n")
    heads = [[0.1 + seed_shift, 0.3 + seed_shift], [0.2 + seed_shift, 0.4 + seed_shift]]
    lengths = [
        {
            "length": length,
            "status": "ok",
            "windows": 4,
            "rows": {
                "all": dict.fromkeys(STATISTICS, heads),
                "beyond_train": None
                if length <= 64
                else {name: [[2 * v for v in layer] for layer in heads] for name in STATISTICS},
            },
            "copying": {
                "distance": length // 2,
                "tokens": 4 * (length // 2 - 1),
                "first_half_nll": 3.0 + gain,
                "second_half_nll": 3.0,
                "gain": gain,
            },
        }
        for length, gain in gains.items()
    ] + [{"length": 4096, "status": "no windows", "windows": 0, "reason": "no held-out document fills one"}]
    coverage = None
    if unseen:
        coverage = {
            "summary": [
                {"length": n, "unseen_fraction": f, "frequencies_with_unseen_angles": 1} for n, f in unseen.items()
            ]
        }
    trained = json.loads((run / "results.json").read_text())["meta"]  # the run it diagnoses
    pe = {"name": "RoPE", "scaling": scaling} if scaling else {"name": "ALiBi"}
    meta = {"row": trained.get("row") or trained["pe_name"], "pe": pe, "train_len": trained["train_len"]}
    result = {"meta": meta, "lengths": lengths, "rotation_coverage": coverage, "trained_distances": {}}
    (folder / "diagnostics.json").write_text(json.dumps(result))


@pytest.fixture
def diagnosed(tmp_path):
    """Two seeds of rope (one diagnosed again under YaRN) and alibi, diagnosed at 64 and 128; a t5 run without
    diagnostics; rope's seeds gain 1.0 and 2.0 nats from a repeat at 64, alibi 0.0 and 0.02."""
    runs = tmp_path / "runs"
    job = 0
    for seed in range(2):
        write_run(runs / str(job), "rope", seed, {64: 20.0, 128: 30.0}, scaling="none")
        write_diagnostics(runs / str(job), 0.1 * seed, {64: 1.0 + seed, 128: 0.5}, "none", {64: 0.0, 128: 0.25})
        job += 1
        write_run(runs / str(job), "alibi", seed, {64: 21.0, 128: 20.0})
        write_diagnostics(runs / str(job), 0.2 * seed, {64: 0.02 * seed, 128: 0.0})
        job += 1
    write_run(runs / str(job), "t5", 0, {64: 22.0, 128: 23.0})
    return runs


def test_diagnostics_csv_has_mean_and_std_over_seeds_of_the_mean_over_layers_and_heads(diagnosed, tmp_path):
    markdown = report([str(diagnosed)], str(tmp_path / "out"))
    assert "Incomplete" not in markdown and "no results.json" not in markdown  # <run>/diagnostics is no run
    csv = pd.read_csv(tmp_path / "out" / "diagnostics.csv", keep_default_na=False)
    assert list(csv.columns) == ["train_len", "pe", "statistic", "rows", "length", "mean", "std", "seeds"]
    assert list(dict.fromkeys(csv.pe)) == ["rope", "alibi"]  # the sweep's order; t5 has no diagnostics

    def cell(pe, statistic, rows, length):
        found = csv[(csv.pe == pe) & (csv.statistic == statistic) & (csv.rows == rows) & (csv.length == length)]
        assert len(found) == 1, (pe, statistic, rows, length)
        return found.iloc[0]

    for name in STATISTICS:
        # rope: seeds 0.25 and 0.35 -> 0.30 ± 0.0707 (sqrt(2 x 0.05^2)); alibi: 0.25 and 0.45 -> 0.35 ± 0.1414
        for length in (64, 128):
            rope, alibi = cell("rope", name, "all", length), cell("alibi", name, "all", length)
            assert (rope["mean"], rope["std"], rope.seeds) == (
                pytest.approx(0.30),
                pytest.approx(0.05 * math.sqrt(2), abs=1e-6),
                2,
            )
            assert (alibi["mean"], alibi["std"]) == (pytest.approx(0.35), pytest.approx(0.1 * math.sqrt(2), abs=1e-6))
        assert cell("rope", name, "beyond_train", 128)["mean"] == pytest.approx(0.60)  # twice: 0.5 and 0.7
        assert cell("rope", name, "beyond_train", 128)["std"] == pytest.approx(0.1 * math.sqrt(2), abs=1e-6)
        assert csv[(csv.statistic == name) & (csv.rows == "beyond_train") & (csv.length == 64)].empty
    gain = cell("rope", "copying_gain", "", 64)
    assert (gain["mean"], gain["std"]) == (pytest.approx(1.5), pytest.approx(math.sqrt(0.5), abs=1e-6))
    assert cell("rope", "copying_first_nll", "", 64)["mean"] == pytest.approx(4.5)
    assert (cell("rope", "copying_second_nll", "", 64)["mean"], cell("alibi", "copying_gain", "", 128)["std"]) == (3, 0)
    unseen = cell("rope", "unseen_fraction", "", 128)
    assert (unseen["mean"], unseen["std"], unseen.seeds) == (0.25, 0.0, 2)
    assert csv[(csv.pe == "alibi") & (csv.statistic == "unseen_fraction")].empty  # no rotation
    assert not (csv.length == 4096).any()  # a length without windows
    assert (tmp_path / "out" / "diagnostics.png").read_bytes().startswith(b"\x89PNG")


def test_a_diagnosed_variant_is_its_own_row_and_a_report_without_diagnostics_writes_none(diagnosed, tmp_path):
    extra = diagnosed / "9"
    write_run(extra, "rope", 0, {64: 20.0}, scaling="none", meta={"seed": 5})
    write_diagnostics(extra, 0.0, {64: 3.0}, "yarn")
    frame = Summary(load([str(diagnosed)])).diagnostics
    yarn = frame[frame.label == "rope (yarn)"]
    assert set(yarn.seeds) == {1} and yarn[yarn.statistic == "copying_gain"]["mean"].tolist() == [3.0]
    plain = tmp_path / "plain"
    write_run(plain / "0", "rope", 0, {64: 20.0, 128: 30.0})
    report([str(plain)], str(tmp_path / "out"))
    assert not any((tmp_path / "out" / name).exists() for name in ("diagnostics.csv", "diagnostics.png"))


def test_diagnostics_of_another_run_or_unreadable_are_left_out_and_listed(diagnosed, tmp_path):
    """diagnose.py's output put in the wrong run's folder (another row) would pair that run's perplexity with
    another model's attention; a truncated file would vanish without a word. Both are listed in table.md."""
    other = diagnosed / "0" / "diagnostics" / "diagnostics.json"  # rope's, seed 0
    result = json.loads(other.read_text())
    other.write_text(json.dumps({**result, "meta": {**result["meta"], "row": "learned", "checkpoint": "l.ckpt"}}))
    (diagnosed / "1" / "diagnostics" / "diagnostics.json").write_text('{"meta": {')  # alibi's, seed 0
    flat = diagnosed / "2" / "diagnostics" / "diagnostics.json"  # per-layer values as one flat list: a traceback
    result = json.loads(flat.read_text())
    for entry in result["lengths"]:
        for statistics in filter(None, (entry.get("rows") or {}).values()):
            statistics["entropy"] = [value for layer in statistics["entropy"] for value in layer]
    flat.write_text(json.dumps(result))
    write_run(diagnosed / "5", "rope", 2, {64: 20.0, 128: 30.0}, scaling="none")
    write_diagnostics(diagnosed / "5", 0.0, {64: 1.0, 128: 0.5}, "none", {64: 0.0, 128: 0.25})
    write_run(diagnosed / "6", "alibi", 2, {64: 21.0, 128: 20.0})
    write_diagnostics(diagnosed / "6", 0.0, {64: 0.0, 128: 0.0})
    for job, damage in ((6, "copying"), (5, "rotation_coverage")):  # a field of another type: a traceback
        damaged = diagnosed / str(job) / "diagnostics" / "diagnostics.json"
        result = json.loads(damaged.read_text())
        if damage == "copying":
            result["lengths"][0]["copying"]["gain"] = "1.5"
        else:
            result["rotation_coverage"] = {"summary": [{"length": 64, "unseen_fraction": "a quarter"}]}
        damaged.write_text(json.dumps(result))
    markdown = report([str(diagnosed)], str(tmp_path / "out"), figures=False)
    for job in (2, 5, 6):
        assert f"- `{diagnosed / str(job)}`: diagnostics.json is not diagnose.py's: left out" in markdown
    assert (
        f"- `{diagnosed / '0'}`: diagnostics.json diagnoses l.ckpt (row learned, L_train 64), not this run (row rope, "
        "L_train 64): left out" in markdown
    )
    assert (
        f"- `{diagnosed / '1'}`: unreadable diagnostics.json (JSONDecodeError): its diagnostics are left out"
        in markdown
    )
    frame = Summary(load([str(diagnosed)])).diagnostics  # rope's two left out, one of alibi's
    assert frame[frame.label == "rope"].empty and set(frame[frame.label == "alibi"].seeds) == {1}
    wider = diagnosed / "7"  # a row whose label names a setting: its diagnostics name the row alone, and pair
    write_run(wider, "alibi", 0, {64: 21.0, 128: 20.0}, meta={"model": {"d_model": 64}})
    write_diagnostics(wider, 0.0, {64: 0.0, 128: 0.0})
    frame = Summary(load([str(diagnosed)])).diagnostics
    assert "alibi [model.d_model=64]" in set(frame.label)


def test_diagnostics_figure_draws_a_panel_per_statistic_in_the_pes_colours_with_computed_titles(diagnosed):
    fig = figures.FIGURES["diagnostics.png"](Summary(load([str(diagnosed)])))
    lines = drawn_lines(fig)
    colours = {name: colour for _, name, colour, _ in lines}
    assert colours == {"rope": figures.pe_colour("rope"), "alibi": figures.pe_colour("alibi")}
    titles = [ax.get_title().replace("\n", " ") for ax in fig.axes if ax.get_title()]
    assert len(titles) == 8  # 5 statistics, beyond over rows >= L_train, copying gain, unseen fraction
    assert all(sum(1 for ax, *_ in lines if ax is axis) <= figures.style.MAX_CURVES for axis in fig.axes)
    gain = next(t for t in titles if t.startswith("copying gain"))
    # at 128 (2x L_train): both 0.5 (rope) and 0.0 (alibi); at 64 rope 1.5, alibi 0.01
    assert "at 2x L_train (copy 64 back): highest rope 0.50 (-1.00 from L_train); lowest alibi 0.00 (-0.01" in gain
    sink = next(t for t in titles if t.startswith("attention on the first token"))
    assert "highest alibi 0.350 (+0.000 from L_train); lowest rope 0.300" in sink
    assert "mean ± std over 2 seeds" in fig._suptitle.get_text().replace("\n", " ")
    assert figures.diagnostics.diagnostic_takeaway(
        pd.DataFrame({"label": ["a", "a"], "length": [64, 128], "mean": [0.05, -0.3]}), ["a"], 64, "copying_gain"
    ).endswith("no in-context copying")


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho by its definition, in float64: Pearson's correlation of the ranks (ties at their mean)."""

    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        ranked = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for i in order[start : end + 1]:
                ranked[i] = (start + end) / 2 + 1
            start = end + 1
        return ranked

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def test_diagnostics_vs_ppl_is_each_statistics_rank_correlation_with_the_perplexity_ratio(tmp_path):
    """diagnostics_vs_ppl.csv against Spearman's rho computed here: four PEs whose perplexity grows by 1, 1.5, 3 and
    2 times from 64 to 128, whose attention statistics are 0.25 + shift (shifts 0, 0.3, 0.1, 0.1: a tie; over the
    rows past L_train twice that) at every length, and whose copying gain changes by 0.4, 0.1, 0.2, 0.3 from 64 to
    128: rho of the statistics' values; rho_change of the copying gain's change (the statistics do not change: no
    rho_change). A fifth PE, diagnosed at 128 but without a perplexity there, is no point."""
    pes, ratios = ["nope", "rope", "alibi", "t5"], [1.0, 1.5, 3.0, 2.0]
    shifts, changes = [0, 0.3, 0.1, 0.1], [0.4, 0.1, 0.2, 0.3]
    runs = tmp_path / "runs"
    for job, (pe, ratio, shift, change) in enumerate(zip(pes, ratios, shifts, changes, strict=True)):
        write_run(runs / str(job), pe, 0, {64: 20.0, 128: 20.0 * ratio})
        write_diagnostics(runs / str(job), shift, {64: 0.0, 128: change})
    write_run(runs / "4", "sinusoidal", 0, {64: 20.0})
    write_diagnostics(runs / "4", 0.5, {64: 0.0, 128: 1.0})
    report([str(runs)], str(tmp_path / "out"), figures=False)
    table = pd.read_csv(tmp_path / "out" / "diagnostics_vs_ppl.csv").set_index(["statistic", "rows"])
    assert set(table.length) == {128} and set(table.labels) == {4} and set(table.train_len) == {64}
    values = [0.25 + shift for shift in shifts]
    rho = spearman(values, ratios)
    assert rho == pytest.approx(1 / math.sqrt(10))  # the oracle: ranks (1, 4, 2.5, 2.5) against (1, 2, 4, 3)
    for statistic in STATISTICS:
        for rows in ("all", "beyond_train"):
            assert table.loc[(statistic, rows), "rho"] == pytest.approx(rho, abs=1e-4)
        assert math.isnan(table.loc[(statistic, "all"), "rho_change"])
    copying = table.xs("copying_gain", level="statistic")
    assert copying.rho_change.iloc[0] == pytest.approx(spearman(changes, ratios), abs=1e-4)
    assert copying.rho.iloc[0] == pytest.approx(spearman(changes, ratios), abs=1e-4)
    fig = figures.FIGURES["diagnostics_vs_ppl.png"](Summary(load([str(runs)])))
    titles = [ax.get_title().replace("\n", " ") for ax in fig.axes if ax.get_title()]
    assert len(titles) == 7  # 5 statistics, beyond over rows >= L_train, copying gain; no unseen fraction (no rope)
    assert sum(f"Spearman rho {rho:+.2f} with the perplexity ratio over 4 rows" in t for t in titles) == 6


def test_a_statistic_only_some_rows_have_is_not_drawn_again_for_the_same_rows():
    """The long-context study: RoPE's unseen-angle fraction is drawn once, in the panels of the PEs as trained;
    the section of RoPE beside its DroPE stage (no rotation, no coverage) would draw the same curve again."""
    studies = Path(__file__).resolve().parents[1] / "studies"
    fig = figures.FIGURES["diagnostics.png"](Summary(load([str(studies / "long_context" / "runs")])))
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert sum(title.startswith("rotary PEs: distances at unseen angles") for title in titles) == 1
    assert sum(title.startswith("copying gain") for title in titles) == 2  # as trained; beside the DroPE stage
    figures.pyplot().close(fig)
