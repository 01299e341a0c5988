"""The report over every protocol's declared metrics (lenext.protocols.METRICS_OF): key-token perplexity and share,
the haystack protocols' rank accuracy and exact match, their depth grids and figures; means computed by hand."""

import math
import statistics

import pandas as pd
import pytest

from lenext.protocols import METRICS_OF
from lenext.report import METRICS, TableKey, collect, figures, find_runs, load, report, summarize
from lenext.report.stats import Summary
from tests.test_report import write_probe_run, write_run

HAYSTACKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")


def key_token_rows(by_length: dict[int, tuple[float | None, float]], evaluator: str | None = "evaluator") -> list[dict]:
    """key_tokens rows: (key-token perplexity, or None without a key token; key-token share) per length, the key
    tokens picked by ``evaluator`` (None: by the model itself)."""
    return [
        {
            "protocol": "key_tokens",
            "scaling": None,
            "length": length,
            "context": 64,
            "gain": 2.0,
            "floor": -2.0,
            "ppl": ppl,
            "tokens": 0 if ppl is None else 12,
            "key_share": share,
            "all_ppl": 30.0,
            "status": "ok",
            "peak_mem_mb": 1.0,
            "evaluator": evaluator,
        }
        for length, (ppl, share) in by_length.items()
    ]


# (rank accuracy, exact match) per length, overall; and rank accuracy per (length, depth).
def haystack_rows(protocol: str, overall: dict, by_depth: dict) -> list[dict]:
    def row(length, rank, exact, depth=None):
        return {
            "protocol": protocol,
            "scaling": None,
            "length": length,
            "candidates": 4,
            "rank_accuracy": rank,
            "exact_match": exact,
            "token_accuracy": exact,
            "chance": 0.2,
            "ppl": 3.0,
            "answers": 4,
            "status": "ok",
            "peak_mem_mb": 1.0,
            **({"depth": depth} if depth is not None else {}),
        }

    rows = [row(length, rank, exact) for length, (rank, exact) in overall.items()]
    return rows + [row(length, rank, 0.0, depth) for (length, depth), rank in by_depth.items()]


KEY_TOKENS = {  # per PE, per seed: {length: (key-token ppl, key-token share)}
    "rope": [
        {64: (None, 0.0), 128: (5.0, 0.02)},
        {64: (None, 0.0), 128: (7.0, 0.04)},
        {64: (None, 0.0), 128: (None, 0.0)},
    ],
    "alibi": [
        {64: (None, 0.0), 128: (9.0, 0.01)},
        {64: (None, 0.0), 128: (11.0, 0.03)},
        {64: (None, 0.0), 128: (10.0, 0.02)},
    ],
}
HAYSTACK = {  # per PE, per seed: {length: (rank accuracy, exact match)}, {(length, depth): rank accuracy}
    "rope": [
        ({64: (0.8, 0.5), 128: (0.4, 0.1)}, {(64, 0.0): 1.0, (64, 1.0): 0.5, (128, 0.0): 0.5, (128, 1.0): 0.25}),
        ({64: (0.6, 0.3), 128: (0.2, 0.1)}, {(64, 0.0): 0.5, (64, 1.0): 0.75, (128, 0.0): 0.0, (128, 1.0): 0.25}),
    ],
    "alibi": [
        ({64: (0.6, 0.4), 128: (0.5, 0.0)}, {(64, 0.0): 0.75, (64, 1.0): 0.5, (128, 0.0): 0.5, (128, 1.0): 0.5}),
        ({64: (0.6, 0.2), 128: (0.3, 0.0)}, {(64, 0.0): 0.5, (64, 1.0): 0.5, (128, 0.0): 0.25, (128, 1.0): 0.25}),
    ],
}


def new_protocol_runs(folder, haystacks=("niah_single",), evaluator="evaluator"):
    """Runs of two PEs (three seeds of key tokens, two of the haystacks'), each with a nonoverlap row at 64."""
    for pe, seeds in KEY_TOKENS.items():
        for seed, by_length in enumerate(seeds):
            extra = key_token_rows(by_length, evaluator)
            if seed < len(HAYSTACK[pe]):
                overall, by_depth = HAYSTACK[pe][seed]
                extra += [row for protocol in haystacks for row in haystack_rows(protocol, overall, by_depth)]
            write_run(folder / f"{pe}{seed}", pe, seed, {64: 20.0 + seed}, extra_rows=extra)
    return folder


def cells_by_label(markdown: str, heading: str) -> dict[str, list[str]]:
    """The cells of the Markdown table under the heading that starts with ``heading``, by row label."""
    section = markdown.split(heading, 1)[1].split("\n### ", 1)[0]
    return {
        line.strip("|").split("|")[0].strip(): [cell.strip() for cell in line.strip("|").split("|")[1:]]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| PE |")
    }


def test_every_declared_metric_is_known_to_the_report_with_an_honest_direction():
    assert {metric for metrics in METRICS_OF.values() for metric in metrics} <= set(METRICS)
    assert METRICS_OF["key_tokens"] == ("ppl", "key_share") and METRICS_OF["niah_single"][0] == "rank_accuracy"
    assert METRICS["rank_accuracy"].higher_is_better is True and METRICS["rank_accuracy"].scale == 100
    assert METRICS["key_share"].higher_is_better is None and not METRICS["key_share"].ranked  # no best to claim


def test_key_token_tables_are_means_over_seeds_with_a_missing_value_shown_as_a_dash(tmp_path):
    """A key-token table per metric, perplexity first: a length without key tokens (None, at L_train) has no
    mean and shows "-"; a seed without a value leaves that cell's mean; the share has no best."""
    folder = new_protocol_runs(tmp_path / "runs", haystacks=())
    tables = summarize(collect(find_runs([str(folder)])[0]))
    assert list(tables) == [
        TableKey(64, "key_tokens", "ppl"),
        TableKey(64, "key_tokens", "key_share"),
        TableKey(64, "nonoverlap", "ppl"),
    ]
    ppl = tables[TableKey(64, "key_tokens", "ppl")]
    assert ppl.cell("rope", 64).status == "no value" and math.isnan(ppl.cell("rope", 64)["mean"])
    assert ppl.cell("rope", 128)["mean"] == pytest.approx(6.0) and ppl.cell("rope", 128).n == 2  # seed 2: None
    assert ppl.cell("rope", 128)["std"] == pytest.approx(statistics.stdev([5.0, 7.0]))
    assert ppl.cell("alibi", 128)["mean"] == pytest.approx(10.0) and ppl.cell("alibi", 128).n == 3
    assert ppl.cell("rope", 128).best and not ppl.cell("alibi", 128).best  # lowest perplexity
    share = tables[TableKey(64, "key_tokens", "key_share")]
    assert share.cell("rope", 128)["mean"] == pytest.approx((0.02 + 0.04 + 0.0) / 3)
    assert share.cell("alibi", 128)["mean"] == pytest.approx(0.02)
    assert not share.cells.best.any() and share.cells.separable.isna().all()

    markdown = report([str(folder)], str(tmp_path / "out"))
    key_ppl = cells_by_label(markdown, "### L_train = 64, protocol `key_tokens` (perplexity,")
    assert key_ppl["rope"][:2] == ["-", f"**6.00 ± {statistics.stdev([5.0, 7.0]):.2f}**"]
    assert key_ppl["alibi"][:2] == ["-", "10.00 ± 1.00"]
    heading = "### L_train = 64, protocol `key_tokens` (key-token share %, mean +- std over 3 seeds; describes the rows"
    assert heading in markdown
    key_share = cells_by_label(markdown, heading)
    assert key_share["rope"][:2] == ["0.00 ± 0.00", "2.00 ± 2.00"]
    assert key_share["alibi"][:2] == ["0.00 ± 0.00", "2.00 ± 1.00"]
    assert "**" not in "".join(key_share["rope"] + key_share["alibi"]) and "~" not in "".join(key_share["rope"])
    csv = pd.read_csv(tmp_path / "out" / "table.csv")
    assert not csv[csv.metric == "key_share"].best.any()
    assert set(csv[(csv.metric == "ppl") & (csv.protocol == "key_tokens") & (csv.length == 64)].status) == {"no value"}
    assert "% L_train = 64, protocol key_tokens, key-token share %" in (tmp_path / "out" / "table.tex").read_text()
    assert (tmp_path / "out" / "ppl_vs_length.png").exists()  # a row with no value at L_train draws


def test_key_token_perplexities_of_rows_that_picked_their_own_key_tokens_are_not_ranked(tmp_path):
    """Without a common evaluator each row's key tokens are its own, each perplexity below e^max_nll by
    construction: no best is claimed (docs/evaluation.md says to compare such rows by their share)."""
    folder = new_protocol_runs(tmp_path / "runs", haystacks=(), evaluator=None)
    tables = summarize(collect(find_runs([str(folder)])[0]))
    ppl = tables[TableKey(64, "key_tokens", "ppl")]
    assert not ppl.ranked and not ppl.cells.best.any() and ppl.cells.separable.isna().all()
    assert tables[TableKey(64, "nonoverlap", "ppl")].ranked
    markdown = report([str(folder)], str(tmp_path / "out"), figures=False)
    heading = (
        "### L_train = 64, protocol `key_tokens` (perplexity, mean +- std over 2-3 seeds; each row over key tokens"
    )
    assert heading in markdown and "**" not in "".join(sum(cells_by_label(markdown, heading).values(), []))


def test_haystack_tables_mark_the_highest_rank_accuracy_best_and_state_the_chance_level(tmp_path):
    folder = new_protocol_runs(tmp_path / "runs", haystacks=HAYSTACKS)
    tables = summarize(collect(find_runs([str(folder)])[0]))
    for protocol in HAYSTACKS:  # each a rank-accuracy table, then an exact-match one
        keys = [key for key in tables if key.protocol == protocol]
        assert keys == [TableKey(64, protocol, "rank_accuracy"), TableKey(64, protocol, "exact_match")]
        rank = tables[keys[0]]
        assert rank.chance == (0.2,)
        assert rank.cell("rope", 64)["mean"] == pytest.approx((0.8 + 0.6) / 2)
        assert rank.cell("alibi", 128)["mean"] == pytest.approx((0.5 + 0.3) / 2)
        assert rank.cell("rope", 64).best and rank.cell("alibi", 128).best  # the highest, at each length
        assert not rank.cell("alibi", 64).best and not rank.cell("rope", 128).best
        exact = tables[keys[1]]
        assert exact.cell("rope", 128)["mean"] == pytest.approx(0.1) and exact.cell("rope", 128).best

    markdown = report([str(new_protocol_runs(tmp_path / "one"))], str(tmp_path / "out"), figures=False)
    heading = "### L_train = 64, protocol `niah_single` (rank accuracy %, chance 20.0%, mean +- std over 2 seeds;"
    rank = cells_by_label(markdown, heading)
    assert rank["rope"][:2] == [f"**70.0 ± {100 * statistics.stdev([0.8, 0.6]):.1f}**", "30.0 ± 14.1 ~"]
    assert rank["alibi"][:2] == ["60.0 ± 0.0 ~", "**40.0 ± 14.1**"]
    exact = cells_by_label(markdown, "### L_train = 64, protocol `niah_single` (exact-match accuracy %")
    assert exact["rope"][:2] == ["**40.0 ± 14.1**", "**10.0 ± 0.0**"]
    assert exact["alibi"][:2] == ["30.0 ± 14.1 ~", "0.0 ± 0.0"]  # 10 points apart: separable at 128 alone
    assert markdown.index("protocol `niah_single` (rank accuracy") < markdown.index("protocol `niah_single` (exact")


def test_a_haystacks_depth_grid_is_its_rank_accuracy_per_depth_and_length_mean_over_seeds(tmp_path):
    """niah_single_depth.csv beside passkey_depth.csv (whose columns are as they were): the headline metric per
    (row, depth, L_eval), mean, std, seeds and answers over seeds, with the chance level."""
    report([str(new_protocol_runs(tmp_path / "runs"))], str(tmp_path / "out"))
    grid = pd.read_csv(tmp_path / "out" / "niah_single_depth.csv")
    assert list(grid.columns) == ["train_len", "pe", "depth", "length", "mean", "std", "seeds", "answers", "chance"]
    assert len(grid) == 2 * 2 * 2  # PEs x depths x lengths
    cells = grid.set_index(["pe", "depth", "length"])
    for pe, seeds in HAYSTACK.items():
        for length, depth in [(64, 0.0), (64, 1.0), (128, 0.0), (128, 1.0)]:
            values = [by_depth[(length, depth)] for _, by_depth in seeds]
            cell = cells.loc[(pe, depth, length)]
            assert cell["mean"] == pytest.approx(statistics.mean(values), abs=1e-4)
            assert cell["std"] == pytest.approx(statistics.stdev(values), abs=1e-4)
            assert (cell.seeds, cell.answers, cell.chance) == (2, 8, 0.2)
    for name in ("niah_single_depth.png", "retrieval_vs_length.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(b"\x89PNG")

    passkey = [
        {"protocol": "accuracy", "scaling": None, "length": 32, "depth": 0.0, "exact_match": 1.0, "answers": 4}
        | {"status": "ok"}
    ]
    write_probe_run(tmp_path / "probe" / "0", "rope", 0, {32: 1.0}, task="passkey", extra_rows=passkey)
    report([str(tmp_path / "probe")], str(tmp_path / "probe_out"))
    written = {path.name for path in (tmp_path / "probe_out").iterdir()}
    assert {"passkey_depth.png", "passkey_depth.csv"} <= written and not any("niah" in name for name in written)
    columns = pd.read_csv(tmp_path / "probe_out" / "passkey_depth.csv").columns
    assert list(columns) == ["train_len", "pe", "depth", "length", "mean", "std", "seeds", "answers"]


def test_the_haystack_figure_draws_rank_accuracy_with_the_chance_level_and_says_who_is_highest(tmp_path):
    from tests.test_report_figures import drawn_lines, summary_of

    summary = summary_of(new_protocol_runs(tmp_path / "runs"))
    fig = figures.lengths.retrieval_vs_length(summary)
    (ax,) = [ax for ax in fig.axes if ax.has_data()]
    assert {entry for _, entry, *_ in drawn_lines(fig)} == {"rope", "alibi"}
    assert ax.get_ylabel() == "rank accuracy %" and ax.get_yscale() == "linear"
    chance = [line for line in ax.get_lines() if list(line.get_ydata()) == [20.0, 20.0]]
    assert len(chance) == 1  # the chance level, a horizontal line at 20%
    assert "at 2x L_train: alibi 40% rank accuracy; rope 30% (chance 20%)" in ax.get_title().replace("\n", " ")
    assert "chance level" in fig.get_suptitle()
    files = figures.drawn_files("*_depth.png", figures.depth.depth_heatmaps(summary))
    assert [name for name, _ in files] == ["niah_single_depth.png"]
    heatmap = files[0][1]
    titles = [ax.get_title().replace("\n", " ") for ax in heatmap.axes if ax.get_title()]
    # The table's rank accuracy (0.8 and 0.6 at 64; 0.4 and 0.2 at 128), not the mean of the depths' cells (69%).
    assert "rope, L_train 64 70% at 64 → 30% at 128" in titles and len(titles) == 2
    for drawn in (fig, heatmap):
        figures.pyplot().close(drawn)


def test_a_panel_whose_rows_have_no_value_at_any_length_says_so_on_an_empty_axis(tmp_path):
    """A PE without a key token at any length (ALiBi, KERPLE, FoX judged by themselves): its key-token panel draws
    no scale (a log axis of no data ticked 1e-37 .. 1e-296 before) and says "no values"."""
    for seed in range(2):
        write_run(
            tmp_path / f"k{seed}",
            "kerple",
            seed,
            {64: 30.0, 128: 29.0},
            extra_rows=key_token_rows({64: (None, 0.0), 128: (None, 0.0)}),
        )
    fig = figures.FIGURES["ppl_vs_length.png"](Summary(load([str(tmp_path)])))
    key_axes = [ax for ax in fig.axes if ax.get_title().startswith("key_tokens")]
    assert len(key_axes) == 1 and list(key_axes[0].get_yticks()) == []
    assert [text.get_text() for text in key_axes[0].texts if text.get_text() == "no values"] == ["no values"]
    report([str(tmp_path)], str(tmp_path / "out"), figures=False)  # its table's heading says so, not "over 0 seeds"
    markdown = (tmp_path / "out" / "table.md").read_text()
    assert "### L_train = 64, protocol `key_tokens` (perplexity: no value at any length)" in markdown
    assert "over 0 seeds" not in markdown


def test_a_diverged_seed_makes_its_depth_cells_nan(tmp_path):
    for seed, rank in enumerate((0.5, float("nan"))):
        extra = haystack_rows("niah_single", {64: (0.5, 0.5)}, {(64, 0.0): rank, (64, 1.0): 0.25})
        write_run(tmp_path / str(seed), "rope", seed, {64: 20.0}, extra_rows=extra)
    report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    grid = pd.read_csv(tmp_path / "out" / "niah_single_depth.csv").set_index("depth")
    assert math.isnan(grid["mean"][0.0]) and grid.seeds[0.0] == 2
    assert (grid["mean"][1.0], grid.seeds[1.0]) == (0.25, 2)
