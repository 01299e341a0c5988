"""The report tool: mean +- std over seeds, best per column, incomplete runs listed, every file written."""

import json
import os

import pandas as pd
import pytest

from lenext.report import main, report


def write_run(folder, pe, seed, ppls, train_len=64, complete=True, scaling=None, extra_rows=()):
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


def test_no_results_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no complete results.json"):
        report([str(tmp_path)], str(tmp_path / "out"))
