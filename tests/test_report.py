"""The report tool: mean +- std over seeds, best per column, incomplete runs listed, every file written."""

import json
import math
import os

import pandas as pd
import pytest

from lenext.report import Summary, TableKey, collect, family, find_runs, load, main, report, summarize

HARDWARE = {"cpu": "AMD EPYC", "isa": "AVX512_BF16", "cores": 2, "gpu": None, "training_precision": "bf16-mixed"}


def write_run(
    folder, pe, seed, ppls, train_len=64, complete=True, scaling=None, extra_rows=(), hardware=None, meta=None
):
    """A text run's results in the layout of results files written before variants had a generic name (``scaling``)
    and before meta.identity; ``meta`` adds to (or replaces) its meta's keys."""
    os.makedirs(os.path.join(folder, ".hydra"), exist_ok=True)
    rows = [
        {
            "protocol": "nonoverlap",
            "scaling": scaling,
            "length": length,
            "ppl": ppl,
            "mean_nll": None,
            "status": "ok" if ppl else "not applicable",
            "peak_mem_mb": 10.0 + length / 64,
        }
        for length, ppl in ppls.items()
    ]
    meta = {
        "pe_name": pe,
        "pe": {"name": pe, **({"scaling": scaling} if scaling else {})},
        "train_len": train_len,
        "seed": seed,
        "train_tokens_per_s": 1000.0 + seed,
        "hardware": hardware or HARDWARE,
        **(meta or {}),
    }
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"complete": complete, "meta": meta, "rows": rows + list(extra_rows)}, f)
    with open(os.path.join(folder, "positions.csv"), "w") as f:
        f.write("scaling,length,position,mean_nll,count\n")
        f.writelines(f"{scaling or ''},128,{p},{3 + p / 100},5\n" for p in range(128))


@pytest.fixture
def sweep_dir(tmp_path):
    job = 0
    for seed, delta in enumerate([0.0, 2.0, 4.0]):
        write_run(tmp_path / str(job), "alibi", seed, {64: 20 + delta, 128: 19 + delta})
        job += 1
        write_run(tmp_path / str(job), "learned", seed, {64: 18 + delta, 128: None})
        job += 1
        write_run(
            tmp_path / str(job),
            "rope",
            seed,
            {64: 21 + delta, 128: 40 + delta},
            scaling="none",
            extra_rows=[
                {
                    "protocol": "nonoverlap",
                    "scaling": "ntk",
                    "length": 128,
                    "ppl": 25 + delta,
                    "status": "ok",
                    "peak_mem_mb": 1.0,
                }
            ],
        )
        job += 1
    os.makedirs(tmp_path / str(job) / ".hydra")  # a run that died before writing results
    write_run(tmp_path / str(job + 1), "t5", 0, {64: 1.0}, complete=False)
    os.makedirs(tmp_path / str(job + 2) / ".hydra")
    (tmp_path / str(job + 2) / "error.txt").write_text("pe.k=0 is invalid\n")  # a job of the sweep that failed
    return tmp_path


def test_table_has_mean_std_over_seeds_marks_best_and_lists_incomplete_runs(sweep_dir, tmp_path):
    markdown = report([str(sweep_dir)], str(tmp_path / "out"))
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    # alibi: 20, 22, 24 -> 22.00 ± 2.00; learned is best at 64 (18, 20, 22 -> 20.00 ± 2.00)
    assert "| **20.00 ± 2.00** |" in lines["learned"] and "n/a" in lines["learned"]
    assert "22.00 ± 2.00" in lines["alibi"] and "**21.00 ± 2.00**" in lines["alibi"]
    assert "42.00 ± 2.00" in lines["rope"] and "rope (ntk)" in lines
    assert "3 seeds" in markdown
    assert "1,001" in lines["alibi"]  # train tokens/s mean over seeds 1000, 1001, 1002
    assert "Incomplete or failed runs" in markdown and "not marked complete" in markdown
    assert "no results.json" in markdown and "failed: pe.k=0 is invalid" in markdown
    for name in ("table.md", "table.tex", "table.csv", "ppl_vs_length.png", "per_position.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    csv = pd.read_csv(tmp_path / "out" / "table.csv")
    best = csv[(csv.length == 64) & csv.best]
    assert best.pe.tolist() == ["learned"] and best["mean"].tolist() == [20.0]
    assert "\\textbf{20.00 $\\pm$ 2.00}" in (tmp_path / "out" / "table.tex").read_text()


def test_report_command_line_defaults_to_a_report_folder(sweep_dir, capsys):
    main([str(sweep_dir)])
    assert "L_train = 64" in capsys.readouterr().out
    assert (sweep_dir / "report" / "table.md").exists()


def test_no_figures_writes_the_tables_and_the_figures_data_and_no_plot(sweep_dir, tmp_path):
    main([str(sweep_dir), "--out", str(tmp_path / "full")])
    main([str(sweep_dir), "--out", str(tmp_path / "tables"), "--no-figures"])
    full, tables = (sorted(p.name for p in (tmp_path / name).iterdir()) for name in ("full", "tables"))
    assert "ppl_vs_length.png" in full and "per_position.csv" in tables
    assert tables == [name for name in full if not name.endswith(".png")]


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no complete results.json"):
        report([str(tmp_path)], str(tmp_path / "out"))


def test_a_results_file_given_for_a_folder_is_named_not_out(sweep_dir):
    """Not "--out=<file>/report cannot hold the report": the argument given is named, with its folder."""
    results = sweep_dir / "0" / "results.json"
    with pytest.raises(SystemExit, match=rf"^error: '{results}' is a file, not a folder: give the run folder that "):
        main([str(results)])


def test_an_empty_out_is_refused_before_any_work(sweep_dir):
    """``--out $DIR`` with DIR empty: not the default folder in silence."""
    with pytest.raises(SystemExit, match=r"^error: --out='' is invalid: give the folder"):
        main([str(sweep_dir), "--out", ""])
    assert not (sweep_dir / "report").exists()


def test_a_model_lenext_did_not_train_names_its_machine_without_a_precision(tmp_path):
    write_run(tmp_path / "0", "rope", 0, {64: 20.0}, hardware={**HARDWARE, "training_precision": None})
    assert load([str(tmp_path)]).runs[0].machine == "AMD EPYC (AVX512_BF16, 2 cores)"


def _seeded_sweep(folder, per_pe: dict[str, list[float]], first_seed=0):
    """One run per (PE, seed) with perplexity per_pe[pe][i] at length 64 for seed first_seed + i."""
    job = len(os.listdir(folder)) if os.path.isdir(folder) else 0
    for pe, ppls in per_pe.items():
        for i, ppl in enumerate(ppls):
            write_run(folder / str(job), pe, first_seed + i, {64: ppl})
            job += 1
    return folder


def _frame(folder):
    from lenext.report import collect, find_runs

    return collect(find_runs([str(folder)])[0])


def test_significance_rule_separates_only_differences_beyond_two_std_with_consistent_sign(tmp_path):
    from lenext.report import separable, summarize

    sweep = tmp_path / "sweep"
    frame = _frame(
        _seeded_sweep(
            sweep,
            {
                "alibi": [10.0, 11.0, 12.0],  # 11 ± 1
                "t5": [13.5, 14.0, 14.5],  # 14 ± 0.5: 3 apart, more than 2 max(std) = 2 -> separable from alibi
                "shaw": [12.0, 13.0, 14.0],  # 13 ± 1: exactly 2 std apart -> not separable (strictly more needed)
                "nope": [11.5, 12.5, 13.5],  # 12.5 ± 1: within 2 std of alibi -> not separable
                "rope": [30.0, 31.0, 11.5],  # 24.2 ± 11: far in mean, but within 2 std
                "kerple": [12.5, 13.5, 14.5],  # 13.5 ± 1: 2.5 apart, beyond 2 max(std), within a pooled 2 sqrt(2)
                "fire": [12.3, 12.8, 13.3],  # 12.8 ± 0.5: 1.8 apart, within 2 max(std) = 2, beyond 2 min or pooled std
            },
        )
    )
    assert separable(frame, "t5", "alibi", 64, "nonoverlap", 64) is True
    assert separable(frame, "alibi", "t5", 64, "nonoverlap", 64) is True  # symmetric
    assert separable(frame, "shaw", "alibi", 64, "nonoverlap", 64) is False
    assert separable(frame, "nope", "alibi", 64, "nonoverlap", 64) is False
    assert separable(frame, "rope", "alibi", 64, "nonoverlap", 64) is False
    assert separable(frame, "kerple", "alibi", 64, "nonoverlap", 64) is True  # the larger std, not a pooled one
    assert separable(frame, "fire", "alibi", 64, "nonoverlap", 64) is False  # ... nor the smaller one
    assert separable(summarize(frame), "t5", "alibi", 64, "nonoverlap", 64) is True  # the tables work as well

    # 11.2 ± 2.7 vs 16.8 ± 0.5: more than 2 std apart, but seed 4's pair is ordered the other way.
    flip = {"alibi": [10, 10, 10, 10, 16], "shaw": [17, 17, 17, 17, 15.9]}
    flipped = _frame(_seeded_sweep(tmp_path / "flip", flip))
    means = flipped.groupby("label").value.mean()
    assert abs(means["shaw"] - means["alibi"]) > 2 * 2.68
    assert separable(flipped, "shaw", "alibi", 64, "nonoverlap", 64) is False
    # The same values from different seeds: nothing to pair, so the means decide.
    unpaired = tmp_path / "unpaired"
    _seeded_sweep(unpaired, {"alibi": flip["alibi"]})
    _seeded_sweep(unpaired, {"shaw": flip["shaw"]}, first_seed=5)
    assert separable(_frame(unpaired), "shaw", "alibi", 64, "nonoverlap", 64) is True

    markdown = report([str(sweep)], str(tmp_path / "out"), figures=False)
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "**11.00 ± 1.00**" in lines["alibi"]
    assert "14.00 ± 0.50 |" in lines["t5"]
    assert "13.00 ± 1.00 ~ |" in lines["shaw"] and "12.50 ± 1.00 ~ |" in lines["nope"]
    assert "~: not separable" in markdown and "tested only when" not in markdown
    csv = pd.read_csv(tmp_path / "out" / "table.csv").set_index("pe")
    assert csv.loc["t5", "separable_from_best"] == True  # noqa: E712 (read back from CSV as a bool)
    assert csv.loc["nope", "separable_from_best"] == False  # noqa: E712
    assert pd.isna(csv.loc["alibi", "separable_from_best"])  # the best is not compared with itself
    assert "t5 & 14.00 $\\pm$ 0.50 \\\\" in (tmp_path / "out" / "table.tex").read_text()
    assert "12.50 $\\pm$ 1.00 $\\sim$" in (tmp_path / "out" / "table.tex").read_text()


def test_a_lone_seed_is_never_tested_the_table_says_why_and_marks_its_cells(tmp_path):
    from lenext.report import separable

    one_seed = _seeded_sweep(tmp_path / "one", {"alibi": [10.0], "nope": [10.1]})
    assert separable(_frame(one_seed), "nope", "alibi", 64, "nonoverlap", 64) is None
    markdown = report([str(one_seed)], str(tmp_path / "out"), figures=False)
    assert " ~" not in markdown and "over 1 seed;" in markdown and "One seed: no difference is tested" in markdown

    mixed = _seeded_sweep(
        tmp_path / "mixed", {"alibi": [10.0, 10.1, 10.2], "nope": [30.0], "t5": [10.15, 10.25, 10.35]}
    )
    assert separable(_frame(mixed), "nope", "alibi", 64, "nonoverlap", 64) is None
    markdown = report([str(mixed)], str(tmp_path / "out_mixed"), figures=False)
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "over 1-3 seeds;" in markdown and "tested only when it and the best both have >= 2 seeds" in markdown
    assert "| 30.00 † |" in lines["nope"] and "10.25 ± 0.10 ~ |" in lines["t5"]  # nope: one seed, not tested
    assert "† |" not in lines["alibi"] + lines["t5"] and "† |" not in markdown.split("| PE")[0]
    latex = (tmp_path / "out_mixed" / "table.tex").read_text()
    assert (
        "30.00 $^\\dagger$" in latex and "\n% Bold: the column's best. ~: not separable from the column's best" in latex
    )  # its legend

    lone_best = _seeded_sweep(tmp_path / "lone_best", {"alibi": [9.0], "nope": [30.0, 30.1], "t5": [10.0, 10.2]})
    lines = report([str(lone_best)], str(tmp_path / "out_lone_best"), figures=False).splitlines()
    lines = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert "**9.00**" in lines["alibi"] and "30.05 ± 0.07 † |" in lines["nope"] and "10.10 ± 0.14 † |" in lines["t5"]


def test_latex_row_labels_set_a_second_stages_arrow_and_escape_latexs_special_characters():
    from lenext.report.tables import latex_label

    assert latex_label("rope_ntk -> pose+yarn@256 (self_extend)") == "rope\\_ntk $\\to$ pose+yarn@256 (self\\_extend)"
    assert latex_label("t5 [data.corpus.path=~/a b&c%{1}#$^\\]") == (
        "t5 [data.corpus.path=\\textasciitilde{}/a b\\&c\\%\\{1\\}\\#\\$\\textasciicircum{}\\textbackslash{}]"
    )


def test_rows_tied_for_the_best_are_all_bold_and_the_others_are_tested_against_each(tmp_path):
    """A tie (a scaling at L_train is the model as trained; accuracies at 100%) names several best rows, not none:
    a row is separable only from all of them; a column where every row ties singles none out."""
    tied = _seeded_sweep(
        tmp_path / "tied",
        {
            "alibi": [10.0, 10.1, 10.2],
            "kerple": [10.0, 10.1, 10.2],  # the same values: tied with alibi
            "t5": [10.05, 10.15, 10.25],  # within 2 std of both: not separable
            "nope": [30.0, 30.5, 31.0],  # separable from both
            "fire": [30.0],  # one seed: not tested
        },
    )
    lines = report([str(tied)], str(tmp_path / "out"), figures=False).splitlines()
    lines = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert "**10.10 ± 0.10**" in lines["alibi"] and "**10.10 ± 0.10**" in lines["kerple"]
    assert "10.15 ± 0.10 ~ |" in lines["t5"] and "30.50 ± 0.50 |" in lines["nope"] and "30.00 † |" in lines["fire"]
    csv = pd.read_csv(tmp_path / "out" / "table.csv").set_index("pe")
    assert list(csv.best) == [True, True, False, False, False]

    # A row without a value (a diverged seed) is no row tied with them: the two stay bold; a NaN mean is not "†".
    rows = {"alibi": [10.0, 10.1], "kerple": [10.0, 10.1], "nope": [9.0, math.nan]}
    beside = _seeded_sweep(tmp_path / "beside", rows)
    markdown = report([str(beside)], str(tmp_path / "out_beside"), figures=False)
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "**10.05 ± 0.07**" in lines["alibi"] and "**10.05 ± 0.07**" in lines["kerple"]
    assert "†" not in markdown  # every cell has 2 seeds: nothing is marked or explained as untested

    # Beside a row with nothing measured there (n/a: a learned table's end), the rows that all tie single none out.
    rows = {"alibi": [10.0, 10.1], "kerple": [10.0, 10.1], "learned": [None, None]}
    all_tied = _seeded_sweep(tmp_path / "all_tied", rows)
    markdown = report([str(all_tied)], str(tmp_path / "out_all"), figures=False)
    assert "**" not in markdown.split("| PE")[1] and " ~" not in markdown and "† |" not in markdown


def test_rows_measured_on_other_text_are_shown_but_none_is_marked_best(tmp_path):
    """A perplexity per token of another corpus, tokenizer or split is another quantity: such rows share a table
    (each labelled by its setting) with no best and no ~; an older file, which records its split alone, ranks
    beside a newer one on that split."""
    sotu = {"data.corpus._target_": "lenext.data.Sotu", "data.tokenizer_id": "sotu-v512"}
    own = {"data.corpus._target_": "lenext.data.TextFiles", "data.tokenizer_id": "files-v512"}
    for job, (pe, identity, ppl) in enumerate([("alibi", sotu, 20.0), ("rope", own, 30.0), ("rope", sotu, 25.0)]):
        for seed in (0, 1):
            meta = {"identity": {"model.d_model": 64, **identity}, "split": "validation"}
            write_run(tmp_path / "mixed" / f"{job}_{seed}", pe, seed, {64: ppl + seed}, meta=meta)
    markdown = report([str(tmp_path / "mixed")], str(tmp_path / "out"), figures=False)
    assert "rows measured on different text (another corpus, tokenizer or split): no best marked" in markdown
    lines = [line for line in markdown.splitlines() if line.startswith("| ") and " ± " in line]
    assert len(lines) == 3 and "**" not in "".join(lines) and " ~" not in "".join(lines)
    assert not pd.read_csv(tmp_path / "out" / "table.csv").best.any()

    write_run(tmp_path / "older" / "0", "nope", 0, {64: 40.0}, meta={"split": "validation"})  # no identity
    kept = report(
        [str(tmp_path / "mixed" / f"0_{seed}") for seed in (0, 1)] + [str(tmp_path / "older")],
        str(tmp_path / "o2"),
        figures=False,
    )
    assert "**20.50 ± 0.71**" in kept


def test_a_temperature_row_fitted_to_c_0_in_every_seed_is_neither_tabled_nor_drawn_twice(tmp_path):
    """c = 0 makes beta = 1: the row equals the PE as trained. A row with c = 0 in only some seeds is kept whole (its
    mean over every seed), or it would average the seeds with c > 0 alone."""
    for job, (pe, seed, c) in enumerate([("alibi", 0, 0.0), ("alibi", 1, 0.0), ("nope", 0, 0.0), ("nope", 1, 0.1)]):
        ppl = 20.0 + seed
        tempered = ppl - 20 * c
        row = {"protocol": "nonoverlap", "variant": "temperature", "length": 64, "status": "ok", "temperature_c": c}
        write_run(tmp_path / str(job), pe, seed, {64: ppl}, extra_rows=[{**row, "ppl": tempered}])
        with open(tmp_path / str(job) / "positions.csv", "a") as f:
            f.writelines(f"temperature,128,{p},{3 + p / 100 - c},5\n" for p in range(128))
    markdown = report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    assert (
        "alibi (temperature)" not in lines
        and "| nope (temperature) | **19.50 ± 0.71** |" in lines["nope (temperature)"]
    )
    assert "`alibi (temperature)`: the temperature's c was fitted to 0 in every seed (beta = 1)" in markdown
    drawn = set(pd.read_csv(tmp_path / "out" / "per_position.csv").pe)
    assert drawn == {"alibi", "nope", "nope (temperature)"}


def test_per_position_bins_are_token_weighted_means_covering_every_position_once(tmp_path):
    from lenext.report import binned_positions, log_bins

    for length in (1, 7, 64, 100, 2048):
        bins = log_bins(length)
        assert bins[0][0] == 0 and bins[-1][1] == length
        assert all(
            a_end == b_start and a_start < a_end for (a_start, a_end), (b_start, _) in zip(bins, bins[1:], strict=False)
        )
    assert log_bins(64)[:8] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 9)]

    for seed, offset in enumerate((0.0, 1.0)):
        run = tmp_path / str(seed)
        write_run(run, "alibi", seed, {16: 5.0}, train_len=16)
        # Positions 7 and 8 share the bin [7, 9): weights 3 and 1. Rows come in any order.
        (run / "positions.csv").write_text(
            "scaling,length,position,mean_nll,count\n"
            + "".join(f",8,{p},9.0,1\n" for p in range(8))  # a shorter length: ignored
            + "".join(f",16,{p},{p + offset},{1 + 2 * (p % 2)}\n" for p in reversed(range(16)))
        )
    binned = binned_positions(load([str(tmp_path)]).runs).set_index(["bin_start", "bin_end"])
    assert list(binned.index) == log_bins(16)
    seed0, seed1 = (7 * 3 + 8 * 1) / 4, (8 * 3 + 9 * 1) / 4  # counts: position 7 -> 3, position 8 -> 1
    row = binned.loc[(7, 9)]
    assert row.mean_nll == pytest.approx((seed0 + seed1) / 2)
    assert row.std_nll == pytest.approx(abs(seed1 - seed0) / 2**0.5)
    assert row.seeds == 2 and row.tokens == 8
    report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    written = pd.read_csv(tmp_path / "out" / "per_position.csv")
    assert list(written.columns) == [
        "train_len",
        "pe",
        "length",
        "bin_start",
        "bin_end",
        "mean_nll",
        "std_nll",
        "seeds",
        "tokens",
    ]
    assert written.tokens.sum() == 2 * sum(1 + 2 * (p % 2) for p in range(16))


def test_rows_follow_the_order_the_sweep_listed_its_pes(tmp_path):
    """Job folders are read in job order (2 before 10), and a PE's rows come where it first appears."""
    names = ["sinusoidal", "alibi", "rope", "nope", "t5", "shaw", "learned", "rope_ntk", "fire", "kerple", "xpos"]
    for job, name in enumerate(names):
        write_run(tmp_path / str(job), name, 0, {64: 10.0 + job})
    tables = summarize(collect(find_runs([str(tmp_path)])[0]))
    assert list(tables[TableKey(64, "nonoverlap")].index) == names


def test_the_machines_the_runs_were_made_on_are_named(sweep_dir, tmp_path):
    one = report([str(sweep_dir)], str(tmp_path / "one"), figures=False)
    assert "Runs made on AMD EPYC (AVX512_BF16, 2 cores), bf16-mixed." in one
    other = {**HARDWARE, "cpu": "Intel Xeon", "isa": "AMX"}
    write_run(sweep_dir / "20", "alibi", 3, {64: 20.0, 128: 19.0}, hardware=other)
    markdown = report([str(sweep_dir)], str(tmp_path / "two"), figures=False)
    assert (
        "Runs made on 2 machines: AMD EPYC (AVX512_BF16, 2 cores), bf16-mixed (9 runs); "
        "Intel Xeon (AMX, 2 cores), bf16-mixed (1 run). `train tok/s` averages over them"
    ) in markdown


def test_a_model_lenext_did_not_train_is_no_second_machine(sweep_dir, tmp_path):
    """An ``eval.py hf=`` run on the same machine has no training precision and no train tok/s: it is named apart,
    not counted as a second machine whose speeds the table averages."""
    write_run(sweep_dir / "20", "alibi", 3, {64: 20.0, 128: 19.0}, hardware={**HARDWARE, "training_precision": None})
    markdown = report([str(sweep_dir)], str(tmp_path / "out"), figures=False)
    assert "Runs made on AMD EPYC (AVX512_BF16, 2 cores), bf16-mixed.\n" in markdown
    assert (
        "Models lenext did not train (`eval.py hf=`) evaluated on AMD EPYC (AVX512_BF16, 2 cores) (1 run)." in markdown
    )
    assert "averages over them" not in markdown


def test_a_job_whose_latest_attempt_failed_is_listed_as_failed(tmp_path, capsys):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    write_run(tmp_path / "1", "rope", 0, {64: 21.0})
    (tmp_path / "1" / "error.txt").write_text("data.max_len=0 is invalid\n")
    os.utime(tmp_path / "1" / "results.json", (1, 1))  # the results are older than the error
    main([str(tmp_path), "--no-figures"])
    out = capsys.readouterr().out
    assert "| alibi |" in out and "| rope |" not in out and "failed: data.max_len=0 is invalid" in out


def test_a_hand_written_error_file_is_listed_on_one_line_and_row_fields_without_attention_load(tmp_path, capsys):
    """A multi-line error.txt broke the list's Markdown (its second line outside the bullet), and meta.row_fields
    without ``attention`` (which the check of the file let pass) stopped the whole report with a KeyError."""
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0}, meta={"row_fields": {"pe": "alibi", "positions": "sequential"}})
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "error.txt").write_text("out of memory\n  at step 3\n")
    main([str(tmp_path), "--no-figures"])
    out = capsys.readouterr().out
    assert "| alibi |" in out and "failed: out of memory at step 3\n" in out


def second_stage(base: str, method: str, length: int = 256) -> dict:
    """The meta of a second stage of ``base`` (row ``<base> -> <method>@<length>``), as train.py writes it."""
    stage = {"checkpoint": f"/runs/{base}/last.ckpt", "row": base, "train_len": 64, "reach": 64, "steps": 100}
    return {"row": f"{base} -> {method}@{length}", "base_len": 64, "lineage": [{**stage, "tokens": 6400}]}


def test_figures_draw_a_pes_variants_in_its_colour_and_tell_them_apart_by_line_style(tmp_path):
    """A row's colour is its root's (the first-stage row it descends from) and its extension method the variant or
    the stage's method, both from the rows' structure (meta.row_fields, or the label of an older file read back
    once), never from the labels the tables show."""
    from lenext.report import Summary, extension_method, row_styles
    from lenext.spec import Row

    def variant_rows(*variants):
        return [{"protocol": "nonoverlap", "scaling": v, "length": 128, "ppl": 30.0, "status": "ok"} for v in variants]

    write_run(tmp_path / "0", "rope", 0, {64: 21, 128: 40}, scaling="none", extra_rows=variant_rows("ntk", "yarn"))
    write_run(tmp_path / "1", "rope", 0, {64: 20}, scaling="yarn", train_len=256, meta=second_stage("rope", "yarn"))
    write_run(tmp_path / "2", "alibi", 0, {64: 21})
    write_run(tmp_path / "3", "alibi", 0, {64: 20}, train_len=256, meta=second_stage("alibi", "direct"))
    write_run(tmp_path / "4", "xpos", 0, {64: 22}, scaling="none", extra_rows=variant_rows("yarn"))
    labels = Summary(load([str(tmp_path)])).labels
    assert labels.root.to_dict() == {
        "rope": "rope",
        "rope (ntk)": "rope",
        "rope (yarn)": "rope",
        "rope -> yarn@256": "rope",
        "alibi": "alibi",
        "alibi -> direct@256": "alibi",
        "xpos": "xpos",
        "xpos (yarn)": "xpos",
    }
    styles = row_styles(labels.root)
    rope = [styles[label] for label, root in labels.root.items() if root == "rope"]
    assert len({s["color"] for s in rope}) == 1 and len({str(s["ls"]) for s in rope}) == len(rope)
    assert len({styles["rope"]["color"], styles["alibi"]["color"], styles["xpos (yarn)"]["color"]}) == 3
    # The extension figure colours by method, the same zero-shot and fine-tuned: PI is linear, direct is none.
    assert labels.extension_method[["rope", "rope (ntk)", "rope -> yarn@256", "alibi -> direct@256"]].tolist() == [
        "none",
        "ntk",
        "yarn",
        "none",
    ]
    direct = Row("rope", base="rope", method="direct", stage_len=256)
    assert extension_method(Row("rope", base="rope", method="pi", stage_len=256), None) == "linear"
    assert (extension_method(direct, None), extension_method(direct, "self_extend")) == ("none", "self_extend")


def test_dynamic_ntk_rows_equal_to_ntk_by_construction_are_not_shown_twice(tmp_path):
    """Results made while evaluation still measured both: the table and figures keep `rope (ntk)` alone and say
    that it stands for `dynamic_ntk`."""
    for seed in (0, 1):
        variant_rows = [
            {"protocol": "nonoverlap", "scaling": scaling, "length": 128, "ppl": 30.0 + seed, "status": "ok"}
            for scaling in ("ntk", "dynamic_ntk")
        ]
        write_run(tmp_path / str(seed), "rope", seed, {64: 21, 128: 40}, scaling="none", extra_rows=variant_rows)
    markdown = report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    assert "| rope (ntk) |" in markdown and "dynamic_ntk)" not in markdown
    assert "`ntk` rows also stand for `dynamic_ntk`: equal by construction" in markdown
    assert "dynamic_ntk" not in (tmp_path / "out" / "table.csv").read_text()
    frame = collect(find_runs([str(tmp_path)])[0])
    assert set(frame.label) == {"rope", "rope (ntk)"}
    for seed in (0, 1):
        write_run(tmp_path / str(seed), "rope", seed, {64: 21, 128: 40}, scaling="none", extra_rows=variant_rows[:1])
    markdown = report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    assert "stand for" not in markdown  # dynamic_ntk not asked: nothing to say


def write_probe_run(folder, pe, seed, exact_by_length, train_len=32, task="copy", extra_rows=(), meta=None):
    """A probe run's results: exact match and per-token accuracy (exact + 0.05, at most 1) at each length, then
    ``extra_rows`` (passkey's depth rows); ``meta`` adds to its meta's keys."""
    rows = [
        {
            "protocol": "accuracy",
            "scaling": None,
            "length": length,
            "exact_match": exact,
            "token_accuracy": min(1.0, exact + 0.05),  # every token of an exact answer is right
            "status": "ok",
            "peak_mem_mb": 1.0,
        }
        for length, exact in exact_by_length.items()
    ]
    meta = {"pe": {"name": pe}, "pe_name": pe, "train_len": train_len, "seed": seed, "task": task, **(meta or {})}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"complete": True, "meta": meta, "rows": rows + list(extra_rows)}, f)


def test_a_probe_run_that_did_not_learn_its_task_at_l_train_is_kept_out_of_the_means_beyond_it(tmp_path):
    """Accuracy beyond L_train from a model that never learned the task measures nothing: below 90% exact match
    at L_train a run stays in the L_train column, leaves every longer one, and is listed under the table."""
    write_probe_run(tmp_path / "0", "rope", 0, {32: 1.00, 64: 0.50})
    write_probe_run(tmp_path / "1", "rope", 1, {32: 0.95, 64: 0.30})
    write_probe_run(tmp_path / "2", "rope", 2, {32: 0.40, 64: 0.90})  # not learned: its 90% at 64 is luck
    write_probe_run(tmp_path / "3", "nope", 0, {32: 0.10, 64: 0.05})
    tables = summarize(collect(find_runs([str(tmp_path)])[0]))
    exact = tables[TableKey(32, "accuracy", "exact_match", "copy")]
    assert exact.cell("rope", 32)["mean"] == pytest.approx((1.00 + 0.95 + 0.40) / 3)
    assert exact.cell("rope", 64)["mean"] == pytest.approx((0.50 + 0.30) / 2)
    assert exact.cell("rope", 64).n == 2
    assert exact.cell("nope", 64).status == "not learned"
    per_token = tables[TableKey(32, "accuracy", "token_accuracy", "copy")]
    assert per_token.cell("rope", 64)["mean"] == pytest.approx((0.55 + 0.35) / 2)  # the run, not the metric
    markdown = report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    assert "| nope | 10.0 † | not learned |" in markdown  # one seed beside rope's three: not tested
    assert "Not learned at their training length (exact match below 90% there;" in markdown
    assert "rope (seed 2: 40.0% at 32); nope (seed 0: 10.0% at 32)" in markdown


@pytest.mark.parametrize(
    "pe_class, identity, panel",
    [
        ("NoPE", {}, "no PE or absolute"),
        ("NoPE", {"attention.scale": "ssmax"}, "2024-26 methods"),
        ("RoPE", {"attention.window": 16, "attention.scale": "none"}, "2024-26 methods"),
        ("NoPE", {"attention.normalizer": "stick_breaking"}, "2024-26 methods"),
        ("FoX", {}, "2024-26 methods"),
        ("PerLayer", {"attention.window": None}, "2024-26 methods"),
        ("RoPE", {"attention.window": None, "attention.scale": "none"}, "rotary"),
        ("ALiBi", {}, "additive bias"),
    ],
)
def test_a_run_is_drawn_in_its_pes_panel_and_with_an_attention_setting_among_the_2024_26_methods(
    pe_class, identity, panel
):
    assert family({"pe": {"name": pe_class}, "identity": identity}) == panel


def test_a_second_stage_is_judged_learned_and_kept_at_its_own_training_length(tmp_path):
    """A second stage sits in its base's table (L_train 64) but learned, or not, at its own length (256): a seed
    that did not stays in every column up to 256 and leaves those beyond."""
    for seed, exact in enumerate((1.0, 0.5, 1.0)):
        meta = second_stage("rope", "direct", 256)
        write_probe_run(tmp_path / str(seed), "rope", seed, {64: 1.0, 256: exact, 512: 0.2 + seed / 10}, 256, meta=meta)
    exact = summarize(collect(find_runs([str(tmp_path)])[0]))[TableKey(64, "accuracy", "exact_match", "copy")]
    assert (exact.cell("rope -> direct@256", 256)["mean"], exact.cell("rope -> direct@256", 256).n) == (2.5 / 3, 3)
    assert exact.cell("rope -> direct@256", 512)["mean"] == pytest.approx((0.2 + 0.4) / 2)
    assert exact.cell("rope -> direct@256", 512).n == 2
    assert "rope -> direct@256 (seed 1: 50.0% at 256)" in report([str(tmp_path)], str(tmp_path / "out"), figures=False)


def test_a_pose_stage_not_learned_is_named_with_the_length_it_trained_at_not_its_target(tmp_path):
    """A PoSE stage trains at the base's L_train (64) toward its target (256): its exact match is judged at 64, and
    the note under the table said "at 256" (found by an audit)."""
    meta = second_stage("rope", "pose", 256)
    meta["row_fields"] = {"pe": "rope", "positions": "pose", "attention": [], "base": "rope", "method": "pose",
                          "stage_len": 256}  # fmt: skip
    write_probe_run(tmp_path / "0", "rope", 0, {64: 0.42, 256: 0.38}, 64, meta=meta)
    assert "rope -> pose@256 (seed 0: 42.0% at 64)" in report([str(tmp_path)], str(tmp_path / "out"), figures=False)


def test_training_speed_is_a_mean_over_runs_whatever_rows_each_run_has(tmp_path):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0, 128: 21.0, 256: 22.0}, meta={"train_tokens_per_s": 10_000.0})
    write_run(tmp_path / "1", "alibi", 1, {64: 20.5}, meta={"train_tokens_per_s": 40_000.0})
    table = summarize(collect(find_runs([str(tmp_path)])[0]))[TableKey(64, "nonoverlap", "ppl")]
    assert table.rows.train_tokens_per_s["alibi"] == 25_000.0


def test_per_position_curves_pool_the_seeds_of_the_longest_length_and_keep_a_diverged_one(tmp_path):
    """A seed evaluated to a shorter length is not binned with the others' longest; a seed whose loss is NaN
    (written "nan") makes its bins NaN, as its table cell."""
    from lenext.report import binned_positions

    for seed, (length, nll) in enumerate([(16, "1.0"), (16, "3.0"), (8, "9.0"), (16, "nan")]):
        write_run(tmp_path / str(seed), "alibi" if seed < 3 else "rope", seed, {length: 5.0}, train_len=8)
        (tmp_path / str(seed) / "positions.csv").write_text(
            "variant,length,position,mean_nll,count\n" + "".join(f",{length},{p},{nll},2\n" for p in range(length))
        )
    binned = binned_positions(load([str(tmp_path)]).runs).set_index(["label", "bin_start"])
    assert set(binned.length) == {16} and (binned.seeds.loc["alibi"] == 2).all()
    assert binned.loc[("alibi", 0)].mean_nll == 2.0 and binned.loc[("alibi", 0)].std_nll == pytest.approx(2**0.5)
    assert binned.loc["rope"].mean_nll.isna().all()
    report([str(tmp_path)], str(tmp_path / "out"), figures=False)  # a diverged run's curve is read, not a crash


def test_a_diverged_seeds_validation_curve_makes_the_adaptation_mean_nan(tmp_path):
    for seed, ppl in enumerate(("2.0", "4.0", "nan")):
        write_run(
            tmp_path / str(seed), "rope", seed, {64: 5.0, 256: 4.0}, train_len=256, meta=second_stage("rope", "pi")
        )
        (tmp_path / str(seed) / "csv").mkdir()
        (tmp_path / str(seed) / "csv" / "metrics.csv").write_text(
            f"step,train/loss,val/ppl\n9,1.0,\n49,,3.0\n99,,{ppl}\n"
        )
    curve = Summary(load([str(tmp_path)])).adaptation.set_index("step")
    assert list(curve.index) == [50, 99] and (curve.seeds == 3).all()
    assert curve["mean"][50] == 3.0 and math.isnan(curve["mean"][99])


def test_a_second_stage_of_bases_trained_at_other_lengths_pools_neither_its_table_nor_its_adaptation(tmp_path):
    """Two PI stages toward 256, one from a base trained at 64, one from a base at 128 (an audit found them pooled as
    one seed each of one row, or the second dropped as a repeat of the first, and their curves averaged)."""
    for folder, base_len, ppl in (("a", 64, "3.0"), ("b", 128, "5.0")):
        stage = second_stage("rope", "pi")
        stage["base_len"] = stage["lineage"][0]["train_len"] = base_len
        write_run(tmp_path / folder, "rope", 0, {256: float(ppl)}, train_len=256, meta=stage)
        (tmp_path / folder / "csv").mkdir()
        (tmp_path / folder / "csv" / "metrics.csv").write_text(f"step,train/loss,val/ppl\n49,,{ppl}\n99,,{ppl}\n")
    summary = Summary(load([str(tmp_path)]))
    assert {key.train_len for key in summary.tables} == {64, 128}
    assert not summary.loaded.repeats
    curves = summary.adaptation
    assert curves.groupby("train_len")["mean"].first().to_dict() == {64: 3.0, 128: 5.0}
    assert (curves.seeds == 1).all()


def test_a_report_replaces_an_earlier_reports_files_and_leaves_others(tmp_path, sweep_dir):
    """A report into a folder holding another study's report removes that report's tables, figures and their data
    (they stayed beside the new tables); files that are not a report's stay."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = ("adaptation.csv", "passkey_depth.csv", "passkey_depth.png", "ppl_vs_length.png", "notes.txt")
    # a killed report's temporaries (lenext.files.atomic_path's names), and one of a file not a report's
    killed = (".ppl_vs_length.png.a1b2c3d4.tmp.png", ".table.md.x_9y8z7w.tmp", ".notes.txt.a1b2c3d4.tmp")
    for name in (*earlier, *killed):
        (out / name).write_text("earlier")
    report([str(sweep_dir)], str(out), figures=False)
    kept = [".notes.txt.a1b2c3d4.tmp", "notes.txt"]
    assert sorted(os.listdir(out)) == [*kept, "per_position.csv", "table.csv", "table.md", "table.tex"]


def test_a_probes_chance_level_comes_from_its_task_and_no_binomial_claim_is_made_on_a_token_share(tmp_path):
    """Copy's per-token chance is 1 / data.symbols; its rows near it are not said to be "none apart from chance":
    a share of tokens has more trials than answers, so a binomial over the answers would claim too much."""
    from lenext.report import figures

    identity = {"data.symbols": 16, "data.pairs": 8, "data.digits": 5}
    for seed in range(2):
        rows = [{"protocol": "accuracy", "scaling": None, "length": n, "status": "ok", "exact_match": e,
                 "token_accuracy": min(1.0, e + 0.02), "answers": 64} for n, e in ((32, 1.0), (64, 0.05))]  # fmt: skip
        meta = {"pe": {"name": "rope"}, "pe_name": "rope", "train_len": 32, "seed": seed, "task": "copy"}
        os.makedirs(tmp_path / str(seed), exist_ok=True)
        with open(tmp_path / str(seed) / "results.json", "w") as f:
            json.dump({"complete": True, "meta": {**meta, "identity": identity}, "rows": rows}, f)
    tables = summarize(collect(find_runs([str(tmp_path)])[0]))
    token = tables[TableKey(32, "accuracy", "token_accuracy", "copy")]
    assert token.chance == (1 / 16,) and tables[TableKey(32, "accuracy", "exact_match", "copy")].chance == ()
    takeaway = figures.takeaways.lengths_takeaway(token, ["rope"])
    assert takeaway == "at 2x L_train: rope at 7% per-token (chance 6%)"  # 7% over 64 answers: no claim either way


def test_a_probe_with_one_token_per_answer_tables_its_exact_match_alone(tmp_path):
    """Recall (a value per answer) and a one-digit passkey: per-token accuracy is the exact match, so it is neither
    tabled nor drawn twice, and table.md says so; a two-digit passkey keeps both."""
    for task, digits in (("recall", 5), ("passkey", 1), ("passkey", 2)):
        identity = {"data.symbols": 16, "data.pairs": 4, "data.digits": digits}
        token = 0.5 if task == "recall" or digits == 1 else 0.7
        rows = [{"protocol": "accuracy", "scaling": None, "length": n, "status": "ok", "exact_match": 0.5,
                 "token_accuracy": token, "answers": 64} for n in (32, 64)]  # fmt: skip
        meta = {"pe": {"name": "rope"}, "pe_name": "rope", "train_len": 32, "seed": 0, "task": task}
        folder = tmp_path / "runs" / f"{task}{digits}"
        os.makedirs(folder)
        with open(folder / "results.json", "w") as f:
            json.dump({"complete": True, "meta": {**meta, "identity": identity}, "rows": rows}, f)
    markdown = report([str(tmp_path / "runs")], str(tmp_path / "out"), figures=False)
    headings = [line for line in markdown.splitlines() if line.startswith("### ")]
    assert [(h.split(",")[0], "per-token" in h) for h in headings] == [
        ("### passkey", False),  # both passkeys
        ("### passkey", True),  # the two-digit one alone
        ("### recall", False),
    ]
    assert (
        "passkey (data.digits=1); recall (data.pairs=4, data.symbols=16): one token per answer, so per-token "
        "accuracy is the exact match: not shown twice." in markdown
    )
