"""The report's loader: a mean pools the seeds of one run description only, and results files of the old and the
new layout load to the same frame."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lenext.report import Summary, TableKey, load, report

STUDIES = Path(__file__).resolve().parents[1] / "studies"
T5_ROW = {"pe": "t5", "positions": "sequential", "attention": [], "base": None, "method": None, "stage_len": None}


def write_results(folder: Path, meta: dict, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"complete": True, "meta": meta, "rows": rows}))


def t5_run(
    folder: Path, seed: int, max_distance: int, ppls: dict, configured=None, checkpoint=None, meta=None, **settings
):
    """A T5 run in the current layout: built with ``max_distance``, configured as ``configured`` (null: the
    default, which the code resolves), evaluated by train.py, or by eval.py from ``checkpoint``; ``settings``
    override its identity's, ``meta`` its meta's keys."""
    identity = {
        "model.d_model": 32,
        "pe._target_": "lenext.pe.T5Bias",
        "pe._partial_": True,
        "pe.max_distance": configured,
        "attention.window": None,
        "attention.scale": "none",
        "attention.normalizer": "softmax",
        "train.positions": "sequential",
        "seed": seed,
        "data.max_len": 64,
        "data.seed": seed,
        "init_from": None,
        "trainer.max_steps": 100,
        "eval.factors": [1, 2],
        "eval.variants": None,
        **settings,
    }
    pe = {"num_buckets": 32, "max_distance": max_distance, "per_layer": False}
    meta = {
        "row": "t5",
        "row_fields": T5_ROW,
        "pe_name": "t5",
        "pe": {"name": "T5Bias", **pe},
        "pe_family": "additive bias",
        "pe_display_name": "T5",
        "pe_config": {"_target_": "lenext.pe.T5Bias", "_partial_": True, **pe},
        "positions": {"train": "sequential", "reach": None, "eval": "sequential"},
        "train_len": 64,
        "base_len": 64,
        "seed": seed,
        "split": "validation",
        "task": None,
        "identity": identity,
        "lineage": [],
        **({"checkpoint": checkpoint} if checkpoint else {}),
        **(meta or {}),
    }
    rows = [
        {
            "protocol": "nonoverlap",
            "variant": None,
            "length": length,
            "variant_factor": None,
            "ppl": ppl,
            "status": "ok",
        }
        for length, ppl in ppls.items()
    ]
    write_results(folder, meta, rows)


def table_lines(markdown: str) -> dict[str, str]:
    return {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}


def test_runs_that_differ_in_a_setting_get_rows_of_their_own_and_a_repeated_seed_counts_once(tmp_path):
    """The reference study's T5 diagnostics, small: three seeds of T5 (max_distance 64, configured as the default
    or explicitly: the same PE, resolved), a diagnostic with max_distance 128, and seed 0 run again. Neither
    diagnostic is averaged into the three seeds."""
    for seed in range(3):
        t5_run(tmp_path / "sweep" / str(seed), seed, 64, {64: 30.0 + seed, 128: 40.0 + seed}, 64 if seed == 2 else None)
    t5_run(tmp_path / "diagnostics" / "t5_max_distance_128", 0, 128, {64: 33.0, 128: 60.0}, 128)
    t5_run(tmp_path / "diagnostics" / "t5_max_distance_64", 0, 64, {64: 30.0, 128: 40.0}, 64)
    markdown = report([str(tmp_path)], str(tmp_path / "out"), figures=False)
    lines = table_lines(markdown)
    assert "t5" not in lines
    assert "| **31.00 ± 1.00** | **41.00 ± 1.00** |" in lines["t5 [pe.max_distance=64]"]
    assert "| 33.00 † | 60.00 † |" in lines["t5 [pe.max_distance=128]"]
    assert "over 1-3 seeds" in markdown
    assert f"- `{tmp_path / 'sweep' / '0'}` repeats `{tmp_path / 'diagnostics' / 't5_max_distance_64'}`" in markdown
    frame = load([str(tmp_path)]).frame
    assert frame.groupby("row").seed.apply(sorted).to_dict() == {
        "t5 [pe.max_distance=128]": [0, 0],
        "t5 [pe.max_distance=64]": [0, 0, 1, 1, 2, 2],
    }
    assert frame.groupby("row").group.nunique().tolist() == [1, 1]


def test_a_run_and_its_re_evaluation_by_eval_py_get_two_rows(tmp_path):
    """eval.py on a run's checkpoint (meta.checkpoint) measures that run again, under its own evaluation settings:
    its row is ``t5 (eval.py)``, beside the run's; two re-evaluations alike but for their evaluation settings are
    told apart by those."""
    for seed in range(2):
        t5_run(tmp_path / "train" / str(seed), seed, 64, {64: 30.0 + seed, 128: 40.0 + seed})
    checkpoint = str(tmp_path / "train" / "0" / "checkpoints" / "last.ckpt")
    t5_run(tmp_path / "eval" / "0", 0, 64, {64: 35.0, 128: 45.0, 256: 70.0}, checkpoint=checkpoint)
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert "| **30.50 ± 0.71** | **40.50 ± 0.71** |" in lines["t5"]
    assert "| 35.00 † | 45.00 † | 70.00 |" in lines["t5 (eval.py)"]  # the one row at 256: no best among one

    t5_run(tmp_path / "eval" / "1", 0, 64, {2048: 99.0}, checkpoint=checkpoint, **{"eval.factors": [32]})
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert set(lines) - {"PE"} == {
        "t5",
        "t5 (eval.py) [eval.factors=[1,2]]",
        "t5 (eval.py) [eval.factors=[32]]",
    }


TRAINED = {
    "hardware": {"cpu": "AMD EPYC", "isa": "AVX512_BF16", "cores": 2, "training_precision": "bf16-mixed"},
    "precision": "bf16-mixed",
    "tokens_trained": 100 * 2 * 64,  # steps x batch x length, on one device
    "run": {"config": {"trainer": {"gradient_clip_val": 1.0}}},
}
BATCH = {"data.batch_size": 2, "trainer.accumulate_grad_batches": 1}


@pytest.mark.parametrize(
    "changed, setting",
    [
        ({"hardware": {**TRAINED["hardware"], "training_precision": "32-true"}}, "trainer.precision=32-true"),
        ({"precision": "32-true"}, "eval.precision=32-true"),
        ({"tokens_trained": 4 * 100 * 2 * 64}, "trainer.devices=4"),  # four devices: a batch four times as large
        ({"run": {"config": {"trainer": {"gradient_clip_val": 0.0}}}}, "trainer.gradient_clip_val=0.0"),
    ],
)
def test_runs_trained_or_evaluated_otherwise_than_their_identity_records_are_not_seeds_of_one_row(
    tmp_path, changed, setting
):
    """What meta.identity leaves to the trainer (the precision trained and evaluated in, the devices' batch, the
    gradient clipping) separates runs too: an audit found such runs pooled as seeds of one row, or the second of a
    seed dropped as a repeat (an fp32 study reported with a bf16 one lost every fp32 run)."""
    t5_run(tmp_path / "0", 0, 64, {64: 30.0}, meta=TRAINED, **BATCH)
    t5_run(tmp_path / "1", 0, 64, {64: 32.0}, meta=TRAINED | changed, **BATCH)
    loaded = load([str(tmp_path)])
    assert not loaded.repeats
    rows = list(Summary(loaded).tables[TableKey(64, "nonoverlap")].index)
    assert len(rows) == 2 and any(row.endswith(f"[{setting}]") for row in rows), rows


def test_eval_py_on_each_seeds_best_checkpoint_pools_and_apart_from_its_last(tmp_path):
    """eval.py on best.ckpt of each seed (each at its own step) is one row of three seeds; on last.ckpt another."""
    for seed, step in enumerate((40, 60, 20)):
        for name in ("best", "last"):
            checkpoint = f"/runs/{seed}/checkpoints/{name}.ckpt"
            tokens = {"tokens_trained": (step if name == "best" else 100) * 2 * 64}
            t5_run(
                tmp_path / name / str(seed), seed, 64, {64: 30.0 + seed}, None, checkpoint, TRAINED | tokens, **BATCH
            )
    rows = Summary(load([str(tmp_path)])).tables[TableKey(64, "nonoverlap")]
    assert list(rows.index) == ["t5 (eval.py) [eval.checkpoint=best.ckpt]", "t5 (eval.py) [eval.checkpoint=last.ckpt]"]
    assert (rows.cells.n == 3).all()


def test_runs_at_other_training_settings_are_labelled_by_each_setting_that_differs(tmp_path):
    t5_run(tmp_path / "0", 0, 64, {64: 30.0})
    t5_run(tmp_path / "1", 0, 64, {64: 31.0}, **{"trainer.max_steps": 200, "model.d_model": 64})
    t5_run(tmp_path / "2", 0, 64, {64: 32.0}, checkpoint="/ckpt", **{"trainer.max_steps": 200, "model.d_model": 64})
    tables = Summary(load([str(tmp_path)])).tables
    assert list(tables[TableKey(64, "nonoverlap")].index) == [
        "t5 [model.d_model=32, trainer.max_steps=100]",
        "t5 [model.d_model=64, trainer.max_steps=200]",
        "t5 (eval.py) [model.d_model=64, trainer.max_steps=200]",
    ]


def test_seeds_of_a_fixed_data_seed_pool_with_the_run_where_it_equals_the_seed(tmp_path):
    """A sweep seed=0,1,2 with data.seed=0: the seed-0 run's data.seed follows its seed, and still pools with the
    other two; a sweep where data.seed follows the seed is a row of its own, whose seed 0 that run is too."""
    for seed in range(3):
        t5_run(tmp_path / "fixed" / str(seed), seed, 64, {64: 30.0 + 2 * seed}, **{"data.seed": 0})
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert set(lines) - {"PE"} == {"t5"} and "| 32.00 ± 2.00 |" in lines["t5"]  # one row: no best named
    for seed in (1, 2):
        t5_run(tmp_path / "following" / str(seed), seed, 64, {64: 40.0 + seed})
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert "| **32.00 ± 2.00** |" in lines["t5 [data.seed=0]"]
    assert "| 37.67 ± 6.66 " in lines["t5 [data.seed=${seed}]"]  # fixed/0's 30 (seed 0, data.seed 0), 41, 42
    # Its seed 0 too: that run and the fixed sweep's seed 0 are one setting, a seed of both rows (the following
    # sweep had lost its seed 0 to the fixed one, whose own seed 0 was then called a repeat: found by an audit).
    t5_run(tmp_path / "following" / "0", 0, 64, {64: 30.0})
    loaded = load([str(tmp_path)])
    assert loaded.repeats == [(str(tmp_path / "following" / "0"), str(tmp_path / "fixed" / "0"))]
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert "| **32.00 ± 2.00** |" in lines["t5 [data.seed=0]"]
    assert "| 37.67 ± 6.66 " in lines["t5 [data.seed=${seed}]"]  # the same three seeds
    # Two fixed sweeps, data.seed=0,1 x seed=0,1,2, and none following the seed: two rows, not a third of the two
    # runs where data.seed and seed agree (found by a review).
    two = tmp_path / "two"
    for data_seed in range(2):
        for seed in range(3):
            t5_run(two / f"{data_seed}{seed}", seed, 64, {64: 30.0 + 10 * data_seed + seed}, **{"data.seed": data_seed})
    lines = table_lines(report([str(two)], str(tmp_path / "out_two"), figures=False))
    assert set(lines) - {"PE"} == {"t5 [data.seed=0]", "t5 [data.seed=1]"}
    assert "31.00 ± 1.00" in lines["t5 [data.seed=0]"] and "41.00 ± 1.00" in lines["t5 [data.seed=1]"]


def test_a_seed_measured_nan_makes_its_cell_nan_and_a_row_without_a_value_shows_a_dash(tmp_path):
    """A diverged seed is not left out of its cell's mean (the other seeds' mean would pass for all three's)."""
    for seed, ppl in enumerate([60.0, float("nan"), 62.0]):
        t5_run(tmp_path / str(seed), seed, 64, {64: 30.0 + seed, 128: ppl, 256: None})
    summary = Summary(load([str(tmp_path)]))
    cells = summary.tables[TableKey(64, "nonoverlap")].cells
    assert cells.loc[("t5", 128)].n == 3 and np.isnan(cells.loc[("t5", 128)]["mean"])
    assert pd.isna(cells.loc[("t5", 128)].separable) and cells.loc[("t5", 64)]["mean"] == 31.0
    assert (cells.loc[("t5", 256)].n, cells.loc[("t5", 256)].status) == (0, "no value")
    line = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))["t5"]
    assert "| t5 | 31.00 ± 1.00 | nan ± nan | - |" in line, line


NEW_ROW_KEYS = {"scaling": "variant", "rope_factor": "variant_factor"}


def as_new_layout(results: dict, row_fields: dict) -> dict:
    """A results file of the committed (old) layout as train.py writes it now: ``variant`` and ``variant_factor``,
    a protocol's parameters in its own rows alone, ``eval.variants``, and meta's row fields, PE family and display
    name."""
    meta = dict(results["meta"])
    meta["identity"] = {
        ("eval.variants" if key == "eval.rope_scalings" else key): value for key, value in meta["identity"].items()
    }
    meta |= {"row_fields": row_fields, "pe_family": "rotary", "pe_display_name": "RoPE"}
    rows = []
    for old in results["rows"]:
        row = {NEW_ROW_KEYS.get(key, key): value for key, value in old.items()}
        for protocol, parameter in (("sliding", "stride"), ("last_k", "k")):
            if row["protocol"] != protocol:
                del row[parameter]
        rows.append(row)
    return {**results, "meta": meta, "rows": rows}


def test_results_files_of_the_old_and_the_new_layout_load_to_the_same_frame(tmp_path):
    """Two committed extension runs (a RoPE base with its zero-shot scalings, and its PI stage) as committed and as
    they would be written now: the same frame, figures' data and labels."""
    stages = {
        "rope_base_seed0": {**T5_ROW, "pe": "rope"},
        "rope_pi_seed0": {**T5_ROW, "pe": "rope", "base": "rope", "method": "pi", "stage_len": 256},
    }
    for name, row_fields in stages.items():
        committed = STUDIES / "extension" / "runs" / name
        shutil.copytree(committed, tmp_path / "old" / name)
        shutil.copytree(committed, tmp_path / "new" / name)
        results = json.loads((committed / "results.json").read_text())
        (tmp_path / "new" / name / "results.json").write_text(json.dumps(as_new_layout(results, row_fields)))
        positions = (committed / "positions.csv").read_text()
        assert positions.startswith("scaling,")
        (tmp_path / "new" / name / "positions.csv").write_text("variant," + positions.removeprefix("scaling,"))
    old, new = (Summary(load([str(tmp_path / layout)])) for layout in ("old", "new"))
    pd.testing.assert_frame_equal(old.frame.drop(columns="run"), new.frame.drop(columns="run"))
    for data in ("positions", "adaptation"):
        pd.testing.assert_frame_equal(getattr(old, data), getattr(new, data))
        assert len(getattr(old, data))
    stage = old.frame[old.frame.row == "rope -> pi@256"]
    assert set(stage.label) == {"rope -> pi@256"}
    assert stage[
        ["pe", "base", "method", "stage_len", "root", "extension_method"]
    ].drop_duplicates().values.tolist() == [["rope", "rope", "pi", 256, "rope", "linear"]]
    assert set(old.frame.family) == {"rotary"} and set(old.frame.display_name) == {"RoPE"}
    assert {"rope", "rope (yarn)", "rope -> pi@256"} <= set(old.tables[TableKey(64, "nonoverlap")].index)


@pytest.mark.parametrize("layout", ["old", "new"])
def test_the_pe_family_and_display_name_come_from_the_pe(tmp_path, layout):
    """meta.pe_family / meta.pe_display_name where written; for older files the PE class's FAMILY and DISPLAY_NAME,
    found by its name (meta.pe.name)."""
    t5_run(tmp_path / "0", 0, 64, {64: 30.0})
    if layout == "old":
        results = json.loads((tmp_path / "0" / "results.json").read_text())
        for key in ("pe_family", "pe_display_name", "row_fields"):
            del results["meta"][key]
        (tmp_path / "0" / "results.json").write_text(json.dumps(results))
    frame = load([str(tmp_path)]).frame
    assert (set(frame.family), set(frame.display_name), set(frame.pe)) == ({"additive bias"}, {"T5"}, {"t5"})


def test_a_run_made_before_a_setting_existed_pools_with_one_that_has_it_at_its_default(tmp_path):
    """Seeds added to a study with a later lenext record settings the first ones predate (model.norm, drop_pe,
    attention.qk_norm, the long-context protocols' eval.*, a hub corpus's revision): they read as the default that
    did what the code did before, so the seeds pool. How the tokenizer was made (data.tokenizer, its sample) is
    told by the tokenizer's id: the same id pools, another does not."""
    t5_run(tmp_path / "old", 0, 64, {64: 30.0}, meta={"tokenizer": "sotu-v2048"})
    added = {"model.norm": "layernorm", "drop_pe": False, "attention.qk_norm": False, "eval.key_gain": 2.0}
    added["data.corpus.revision"] = None
    made = {"data.tokenizer": None, "data.tokenizer_sample_mb": 256}
    t5_run(tmp_path / "new", 1, 64, {64: 32.0}, meta={"tokenizer": "sotu-v2048"}, **added, **made)
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert set(lines) - {"PE"} == {"t5"} and "| 31.00 ± 1.41 |" in lines["t5"]
    t5_run(tmp_path / "other", 2, 64, {64: 40.0}, meta={"tokenizer": "sotu-v4096"}, **added, **made)
    lines = table_lines(report([str(tmp_path)], str(tmp_path / "out"), figures=False))
    assert "t5 [data.tokenizer_id=sotu-v2048]" in lines and "t5 [data.tokenizer_id=sotu-v4096]" in lines
    t5_run(tmp_path / "rms", 3, 64, {64: 50.0}, meta={"tokenizer": "sotu-v2048"}, **{**added, "model.norm": "rmsnorm"})
    assert "t5 [model.norm=rmsnorm, data.tokenizer_id=sotu-v2048]" in table_lines(
        report([str(tmp_path)], str(tmp_path / "out2"), figures=False)
    )


def test_runs_reached_through_links_are_read_and_a_link_above_is_not_followed_again(tmp_path):
    """A folder of links to runs elsewhere (os.walk passed over them without a word); a link to a folder above
    the one walked is not walked twice."""
    for seed in range(2):
        t5_run(tmp_path / "runs" / str(seed), seed, 64, {64: 30.0 + seed})
    (tmp_path / "study").mkdir()
    for seed in range(2):
        (tmp_path / "study" / f"r{seed}").symlink_to(tmp_path / "runs" / str(seed), target_is_directory=True)
    (tmp_path / "study" / "loop").symlink_to(tmp_path / "study", target_is_directory=True)
    (tmp_path / "study" / "z").symlink_to(tmp_path / "study" / "r0", target_is_directory=True)  # read once
    loaded = load([str(tmp_path / "study")])
    assert sorted(run.seed for run in loaded.runs) == [0, 1] and not loaded.repeats and not loaded.incomplete


def test_jobs_an_interrupted_sweep_never_started_are_listed_from_its_multirun_yaml(tmp_path):
    """A sweep stopped during job 1 of 3 leaves no folder for job 2: its multirun.yaml (Hydra's, the sweep as
    launched: the command line's sweeps and the preset's) says there were three, and the report lists the third."""
    t5_run(tmp_path / "0", 0, 64, {64: 30.0})
    (tmp_path / "1" / ".hydra").mkdir(parents=True)  # started, stopped: no results
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  sweep:\n    dir: " + str(tmp_path) + "\n    subdir: ${hydra.job.num}\n"
        "  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    params:\n      seed: 0,1,2\n  overrides:\n    task:\n    - model=tiny\n    - seed=0,1,2\n"
    )
    incomplete = dict(load([str(tmp_path)]).incomplete)
    assert incomplete[str(tmp_path / "1")].startswith("no results.json")
    assert incomplete[str(tmp_path / "2")] == "not started: job 2 of the 3 its multirun.yaml lists"
    assert str(tmp_path / "0") not in incomplete
