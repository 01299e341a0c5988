"""Context extension: a second training stage from a trained checkpoint (``init_from``), as lenext.spec resolves it.

What the papers' recipes rely on, each pinned: the base's weights and nothing else of its training state, every
resolved PE hyperparameter kept, RoPE's original context taken from the base (transformers'
``original_max_position_embeddings``), PoSE's positions reaching L' from L_train-token windows, the lineage in
the results, refusals before any work.
"""

import json
import math
import shutil

import lightning
import pandas as pd
import pytest
import torch
from torch.testing import assert_close

import lenext.data
from lenext import report
from lenext.build import build_net
from lenext.checkpoints import net_state
from lenext.errors import CheckpointError, ConfigError
from lenext.run import build, evaluate_checkpoint, train
from lenext.run_folder import resolve_training
from tests.conftest import needs_transformers_models, run_train
from tests.test_evaluate import compose_eval
from tests.test_pe import hf_config, hf_rope

BASE_LEN, BASE_STEPS, BATCH = 32, 4, 4


def trained_base(compose_run, pe: str, *overrides: str) -> str:
    """The last.ckpt of a base run of ``pe`` trained BASE_STEPS steps at BASE_LEN (trained once per module)."""
    cfg = compose_run(
        f"base_{pe}",
        f"pe={pe}",
        f"trainer.max_steps={BASE_STEPS}",
        f"trainer.val_check_interval={BASE_STEPS}",
        "eval.factors=[1,2]",
        *overrides,
    )
    last = compose_run.root / f"base_{pe}" / "checkpoints" / "last.ckpt"
    if not last.exists():
        train(cfg)
    return str(last)


@pytest.fixture(scope="module")
def rope_base(compose_run) -> str:
    return trained_base(compose_run, "rope", "eval.variants=[none,yarn]")


def second_stage(compose_run, base: str, name: str, *overrides: str):
    return compose_run(name, f"init_from={base}", "trainer.max_steps=2", "trainer.val_check_interval=2", *overrides)


def test_a_second_stage_starts_from_the_bases_weights_alone_and_records_its_lineage(
    compose_run, rope_base, tmp_path, cache_dir
):
    cfg = second_stage(compose_run, rope_base, "yarn", "pe.scaling=yarn", "data.max_len=64", "eval.factors=[1,2]")
    spec, weights = resolve_training(cfg)
    datamodule, module, _ = build(cfg, spec, weights)
    base_checkpoint = torch.load(rope_base, map_location="cpu", weights_only=False)
    base_weights = net_state(base_checkpoint)
    assert module.net.state_dict().keys() == base_weights.keys()
    for name, value in module.net.state_dict().items():  # every weight the base's, PE parameters included
        assert torch.equal(value, base_weights[name]), name

    train(cfg)
    folder = compose_run.root / "yarn"
    stage_checkpoint = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    # A fresh optimizer and schedule: this stage's 2 steps, not the base's 4 continued.
    assert stage_checkpoint["global_step"] == 2 and base_checkpoint["global_step"] == BASE_STEPS
    assert {int(s["step"]) for s in stage_checkpoint["optimizer_states"][0]["state"].values()} == {2}
    assert stage_checkpoint["lr_schedulers"][0]["last_epoch"] == 2
    meta = json.loads((folder / "results.json").read_text())["meta"]
    assert meta["row"] == "rope -> yarn@64" and meta["start"] == "init_from"
    assert (meta["train_len"], meta["base_len"], meta["tokens_trained"]) == (64, BASE_LEN, 2 * BATCH * 64)
    assert meta["lineage"] == [
        {
            "checkpoint": rope_base,
            "row": "rope",
            "train_len": BASE_LEN,
            "reach": BASE_LEN,
            "steps": BASE_STEPS,
            "tokens": BASE_STEPS * BATCH * BASE_LEN,
        }
    ]
    assert meta["run"]["lineage"][0]["config"] == base_checkpoint["hyper_parameters"]["run"]["config"]
    assert meta["run"] == stage_checkpoint["hyper_parameters"]["run"]  # the same description, stored whole in both
    assert (meta["pe"]["factor"], meta["pe"]["original_len"]) == (2.0, BASE_LEN)
    rows = json.loads((folder / "results.json").read_text())["rows"]
    assert [(r["length"], r["length_factor"]) for r in rows] == [(32, 1.0), (64, 2.0)]  # x the base's L_train

    # Its validation before the first step (the base's weights under YaRN at 64), logged at step -1: the report's
    # step 0 of the adaptation curve, where the PI paper's figure starts
    logged = pd.read_csv(folder / "csv" / "metrics.csv").dropna(subset=["val/ppl"])
    untrained = lightning.Trainer(
        precision=spec.precision, logger=False, enable_progress_bar=False, enable_checkpointing=False
    ).validate(module, datamodule=datamodule, verbose=False)[0]
    assert logged.step.tolist() == [-1, 1, 2] and logged["val/ppl"].iloc[0] == pytest.approx(untrained["val/ppl"])

    # eval.py rebuilds the second stage from its checkpoint alone: the same rows, row name and lineage.
    evaluated = tmp_path / "eval"
    ckpt = folder / "checkpoints" / "last.ckpt"
    same_sweep = (f"paths.cache_dir={cache_dir}", "eval.factors=[1,2]", f"precision={meta['precision']}")
    evaluate_checkpoint(compose_eval(tmp_path, evaluated, ckpt, *same_sweep))
    results = json.loads((evaluated / "results.json").read_text())
    assert [r["mean_nll"] for r in results["rows"]] == pytest.approx([r["mean_nll"] for r in rows], rel=1e-5)
    assert (results["meta"]["row"], results["meta"]["lineage"]) == (meta["row"], meta["lineage"])

    # Skipped when finished; another base is another run.
    again = ("pe.scaling=yarn", "data.max_len=64", "eval.factors=[1,2]")
    assert train(second_stage(compose_run, rope_base, "yarn", *again))["skipped"]
    with pytest.raises(ConfigError, match=r"results.json belongs to a run with other settings.*init_from"):
        train(second_stage(compose_run, str(folder / "checkpoints" / "last.ckpt"), "yarn", *again))

    # The report: the base, its zero-shot rows and the extended row side by side, under the base's L_train.
    tables = report.summarize(report.collect(report.find_runs([str(compose_run.root)])[0]))
    table = tables[report.TableKey(BASE_LEN, "nonoverlap", "ppl", "")]
    assert {"rope", "rope (yarn)", "rope -> yarn@64"} <= set(table.index)
    curve = report.adaptation(report.runs_of(report.find_runs([str(compose_run.root)])[0])[0])
    assert curve[curve.row == "rope -> yarn@64"].step.tolist() == [0, 2]  # before training, after its 2 steps


@pytest.mark.parametrize(
    "pe, key, base_value, fresh_value",
    [("t5", "max_distance", BASE_LEN, 128), ("fire", "init_threshold", float(BASE_LEN), 128.0)],
)
def test_defaults_derived_from_l_train_keep_the_bases_values(compose_run, pe, key, base_value, fresh_value):
    base = trained_base(compose_run, pe)
    extended = resolve_training(second_stage(compose_run, base, f"{pe}_stage", f"pe={pe}", "data.max_len=128"))[0]
    fresh = resolve_training(compose_run(f"{pe}_fresh", f"pe={pe}", "data.max_len=128"))[0]
    assert extended.config["pe"][key] == base_value and fresh.config["pe"][key] == fresh_value


def test_a_learned_table_shorter_than_the_new_length_is_refused(compose_run):
    base = trained_base(compose_run, "learned")
    with pytest.raises(
        ConfigError,
        match=r"^pe.max_len=32 is invalid: .*a second stage keeps the PE settings of init_from=.*at 64 positions$",
    ):
        resolve_training(second_stage(compose_run, base, "learned_stage", "pe=learned", "data.max_len=64"))[0]


# lenext's scalings -> transformers' rope types (ntk is transformers' dynamic at seq_len = s x C, factor 1).
HF_TYPES = {"linear": "linear", "yarn": "yarn", "llama3": "llama3", "dynamic_ntk": "dynamic"}


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn", "llama3"])
@needs_transformers_models
def test_each_scaling_extends_from_the_bases_context_as_transformers_computes_it(compose_run, rope_base, scaling):
    """At L' = 4 x L_train: s = 4 and transformers' original_max_position_embeddings = the base's L_train; the
    current length as the original context (the silent error a second stage would make) gives other frequencies."""
    hf, extended_len = hf_rope(), 4 * BASE_LEN
    spec = resolve_training(
        second_stage(compose_run, rope_base, f"{scaling}_freq", f"pe.scaling={scaling}", f"data.max_len={extended_len}")
    )[0]
    pe = build_net(spec, 512).pe
    assert (pe.factor, pe.original_len) == (4.0, BASE_LEN)
    got, attention = pe.frequencies(extended_len)
    dim, base = pe.shape.head_dim, pe.base

    def expected(original: int):
        if scaling == "ntk":
            config = hf_config(dim, base, original, {"rope_type": "dynamic", "factor": 1.0})
            return hf._compute_dynamic_ntk_parameters(config, seq_len=4 * original)
        parameters = {"rope_type": HF_TYPES[scaling], "factor": 4.0, "original_max_position_embeddings": original}
        if scaling == "llama3":
            parameters |= {"low_freq_factor": pe.low_freq_factor, "high_freq_factor": pe.high_freq_factor}
        config = hf_config(dim, base, extended_len, parameters)
        return hf.ROPE_INIT_FUNCTIONS[HF_TYPES[scaling]](config, "cpu")

    inv_freq, hf_attention = expected(BASE_LEN)
    assert_close(got.float(), inv_freq, rtol=1e-5, atol=0)
    assert attention == pytest.approx(hf_attention, rel=1e-12)
    if scaling in ("yarn", "llama3"):  # their bands depend on the original context
        assert not torch.allclose(got.float(), expected(extended_len)[0], rtol=1e-3)


def test_pose_reaches_the_extended_length_from_windows_of_the_bases_length(compose_run, rope_base):
    target = 4 * BASE_LEN
    cfg = second_stage(
        compose_run,
        rope_base,
        "pose",
        "pe.scaling=yarn",
        "train.positions=pose",
        f"train.target_len={target}",
        "eval.factors=[1,4]",
    )
    spec = resolve_training(cfg)[0]
    assert spec.row == "rope -> pose+yarn@128" and spec.reach == target and spec.train_len == BASE_LEN
    assert (spec.config["pe"]["factor"], spec.config["pe"]["original_len"]) == (4.0, BASE_LEN)
    drawn = torch.cat([spec.scheme.training(64, BASE_LEN, torch.Generator().manual_seed(s)) for s in range(4)])
    assert drawn.max() < target and drawn.max() >= 2 * BASE_LEN and (drawn.diff(dim=-1) >= 1).all()
    train(cfg)
    meta = json.loads((compose_run.root / "pose" / "results.json").read_text())["meta"]
    assert meta["tokens_trained"] == 2 * BATCH * BASE_LEN  # a quarter of full-length fine-tuning's tokens at L'


@pytest.fixture(scope="module")
def alibi_base(compose_run) -> str:
    return trained_base(compose_run, "alibi")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.max_len=16"], r"^data.max_len=16 is invalid for a second stage: .* was trained at data.max_len=32"),
        (["model.d_model=128"], r"^model.d_model=128 is invalid for a second stage: .*model.d_model=64"),
        (["data.vocab_size=1024"], r"^data.vocab_size=1024 is invalid for a second stage"),
        (["pe=alibi"], r"^pe=alibi is invalid for a second stage: .* was trained with pe=rope"),
        (
            ["pe.base=500"],
            r"^pe.base=500 is invalid for a second stage: .*pe.base=10000.0, which its weights keep; rep",
        ),
        (["init_from=nowhere.ckpt"], r"^init_from='.*nowhere.ckpt' does not exist"),
        (
            ["attention.scale=ssmax"],
            r"^attention.scale='ssmax' is invalid for a second stage: .*attention.scale='none'",
        ),
        (["ALIBI"], r"^pe.scaling=yarn is invalid for a second stage from .*: its PE .* takes no RoPE scaling"),
        # a setting the stage gave, not one kept from its base: no word of what the base's weights fit
        (
            ["data.max_len=64", "pe.scaling=yarn", "pe.beta_fast=1", "pe.beta_slow=1"],
            r"^pe.beta_fast=1 is invalid: it must exceed pe.beta_slow=1 \(YaRN [^;]*\)$",
        ),
    ],
)
def test_what_a_base_cannot_serve_is_refused_before_any_work(
    compose_run, rope_base, alibi_base, monkeypatch, overrides, message
):
    def no_work(self):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(lenext.data.LMDataModule, "load", no_work)
    base = alibi_base if overrides == ["ALIBI"] else rope_base
    overrides = ["pe.scaling=yarn", "data.max_len=64"] if overrides == ["ALIBI"] else overrides
    cfg = second_stage(compose_run, base, "refused", *overrides)
    with pytest.raises((ConfigError, CheckpointError), match=message):
        train(cfg)
    assert not (compose_run.root / "refused").exists()


def test_an_unreadable_base_is_named(compose_run, tmp_path):
    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=rf"^init_from='{broken}' cannot be read"):
        train(second_stage(compose_run, str(broken), "unreadable"))


def test_a_second_stage_may_keep_its_cache_elsewhere(compose_run, rope_base, tmp_path):
    """data.cache_dir and data.remote say where the prepared corpus is kept, not what it is: a stage on another
    cluster, with its own object store, is the same stage."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    elsewhere = (f"data.remote=file://{mirror}", f"paths.cache_dir={tmp_path / 'cache'}", "data.max_len=64")
    spec = resolve_training(second_stage(compose_run, rope_base, "elsewhere", "pe.scaling=yarn", *elsewhere))[0]
    assert spec.config["data"]["remote"] == f"file://{mirror}"


def test_factor_null_is_fixed_at_l_prime_over_c_in_a_second_stage_and_per_length_in_a_first(compose_run, rope_base):
    first = build_net(resolve_training(compose_run("first", "pe=rope_ntk"))[0], 512).pe
    assert first.factor is None and first.scaling_factor(8 * BASE_LEN) == 8.0  # evaluation-time: L / C
    spec = resolve_training(second_stage(compose_run, rope_base, "fixed", "pe=rope_ntk", "data.max_len=64"))[0]
    second = build_net(spec, 512).pe
    assert second.factor == 2.0 and second.scaling_factor(8 * BASE_LEN) == 2.0  # fine-tuned at s = 2: kept
    explicit = resolve_training(
        second_stage(compose_run, rope_base, "explicit", "pe.scaling=linear", "pe.factor=3", "data.max_len=64")
    )[0]
    assert explicit.config["pe"]["factor"] == 3 and math.isclose(build_net(explicit, 512).pe.scaling_factor(64), 3)


@pytest.mark.slow  # a sweep of three stages of training
def test_the_extension_presets_train_each_stage_from_its_own_base(tmp_path, small_text_corpus):
    """experiment=extension (RoPE) and extension_pes (the other PEs) into one sweep folder, as the study runs them,
    shrunk to seconds: every stage finds its base by PE and seed, and one report holds every row."""
    sweep = tmp_path / "sweep"
    shrunk = [
        "model=tiny",
        "data=text_files",
        f"data.corpus.path={small_text_corpus}",
        "data.corpus.holdout_every=4",
        "data.vocab_size=512",
        "data.batch_size=4",
        "trainer.max_steps=3",
        "eval.factors=[1,4]",
        "eval.max_windows=4",
        f"hydra.sweep.dir={sweep}",
        "seed=0",
    ]
    rope = run_train(tmp_path, "experiment=extension", *shrunk, "extension=base,pi,pose_yarn")
    assert rope.returncode == 0, rope.stderr[-3000:]
    others = run_train(tmp_path, "experiment=extension_pes", *shrunk, "pe=alibi", "extension=base,direct")
    assert others.returncode == 0, others.stderr[-3000:]
    metas = {path.parent.name: json.loads(path.read_text())["meta"] for path in sweep.glob("*/results.json")}
    assert {name: meta["row"] for name, meta in metas.items()} == {
        "rope_base_seed0": "rope",
        "rope_pi_seed0": "rope -> pi@256",
        "rope_pose_yarn_seed0": "rope -> pose+yarn@256",
        "alibi_base_seed0": "alibi",
        "alibi_direct_seed0": "alibi -> direct@256",
    }
    for name, base in (("rope_pi_seed0", "rope_base_seed0"), ("alibi_direct_seed0", "alibi_base_seed0")):
        assert metas[name]["lineage"][0]["checkpoint"] == str(sweep / base / "checkpoints" / "last.ckpt")
        assert (metas[name]["train_len"], metas[name]["base_len"]) == (256, 64)
    pose = metas["rope_pose_yarn_seed0"]
    assert (pose["train_len"], pose["positions"]["reach"], pose["tokens_trained"]) == (64, 256, 3 * 4 * 64)
    tables = report.summarize(report.collect(report.find_runs([str(sweep)])[0]))
    rows = set(tables[report.TableKey(64, "nonoverlap", "ppl", "")].index)
    assert {"rope", "rope (yarn)", "rope -> pi@256", "rope -> pose+yarn@256", "alibi -> direct@256"} <= rows
    out = tmp_path / "report"
    report.report([str(sweep)], str(out))
    assert (out / "extension.png").exists() and (out / "adaptation.png").exists()
    adapted = (out / "adaptation.csv").read_text().splitlines()
    # The second stages' validation perplexity before fine-tuning (step 0) and at its end (step 3), at the length
    # each trained.
    assert adapted[0] == "train_len,val_len,row,step,mean,std,seeds" and len(adapted) == 7
    assert {tuple(line.split(",")[:4]) for line in adapted[1:]} == {  # the base's L_train, then the stage's
        *(("64", "256", "rope -> pi@256", step) for step in ("0", "3")),
        *(("64", "64", "rope -> pose+yarn@256", step) for step in ("0", "3")),
        *(("64", "256", "alibi -> direct@256", step) for step in ("0", "3")),
    }


def test_another_scaling_at_evaluation_extends_from_the_positions_the_stage_trained(
    compose_run, rope_base, tmp_path, cache_dir
):
    """Zero-shot on a fine-tuned checkpoint, a sweep's variant and eval.py's pe.scaling agree: factor null from
    the span the stage trained (L' = 64 here: s = 128 / 64), not its base's context, nor its trained factor."""
    folder = compose_run.root / "yarn_for_variants"
    train(second_stage(compose_run, rope_base, folder.name, "pe.scaling=yarn", "data.max_len=64", "eval.enabled=false"))
    ckpt, common = folder / "checkpoints" / "last.ckpt", (f"paths.cache_dir={cache_dir}", "eval.lengths=[128]")
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "sweep", ckpt, *common, "eval.variants=[yarn,linear]"))
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "override", ckpt, *common, "pe.scaling=linear"))
    swept = json.loads((tmp_path / "sweep" / "results.json").read_text())["rows"]
    (overridden,) = json.loads((tmp_path / "override" / "results.json").read_text())["rows"]
    assert [(r["variant"], r["variant_factor"]) for r in swept] == [("yarn", 2.0), ("linear", 2.0)]
    assert (overridden["variant"], overridden["variant_factor"]) == ("linear", 2.0)
    assert overridden["mean_nll"] == pytest.approx(swept[1]["mean_nll"], rel=1e-6)


def test_a_second_stage_resumes_without_its_base_and_a_first_stage_folder_is_not_one(compose_run):
    base = trained_base(compose_run, "nope")
    stage = ("pe=nope", "data.max_len=64", "eval.enabled=false", "callbacks.last_checkpoint.every_n_train_steps=1")
    train(second_stage(compose_run, base, "nope_stage", *stage))
    moved = base + ".moved"
    shutil.move(base, moved)  # the base is gone: the stage's own last.ckpt holds its PE and lineage
    try:
        longer = second_stage(compose_run, base, "nope_stage", *stage, "trainer.max_steps=3")
        spec = resolve_training(longer)[0]
        assert spec.start == "resume" and spec.lineage[0].checkpoint == base and spec.row == "nope -> direct@64"
        train(longer)
    finally:
        shutil.move(moved, base)
    with pytest.raises(ConfigError, match=r"last.ckpt belongs to a run with other settings.*init_from=None there"):
        resolve_training(compose_run("base_nope", "pe=nope", f"init_from={base}", "data.max_len=64"))[0]


def test_a_pe_made_of_pes_extends_its_rope_member(compose_run):
    """A second stage of ``fox_rope`` (Compose) keeps the base's resolved members and takes the command's RoPE
    scaling for its RoPE member (``pe.pes.rope.scaling``), named in its row; another member setting is refused."""
    base = trained_base(compose_run, "fox_rope")
    spec = resolve_training(
        second_stage(compose_run, base, "fox_yarn", "pe=fox_rope", "+pe.pes.rope.scaling=yarn", "data.max_len=64")
    )[0]
    rope = spec.config["pe"]["pes"]["rope"]
    assert rope["scaling"] == "yarn" and rope["original_len"] == 32 and spec.row.endswith(" -> yarn@64")
    refused = second_stage(compose_run, base, "fox_base", "pe=fox_rope", "+pe.pes.rope.base=500", "data.max_len=64")
    with pytest.raises(ConfigError, match=r"^pe.pes.rope.base=500 is invalid for a second stage"):
        resolve_training(refused)[0]


def test_a_second_stage_says_the_pe_settings_it_changed_and_a_dropped_pe_none():
    """Said once the run is accepted: each setting a stage changed from its base's, and nothing for DroPE's NoPE,
    whose settings are not the base's changed (compared name by name, they read as pe.scaling=None)."""
    from lenext.resolve import stage_changes

    base = {"_target_": "lenext.pe.RoPE", "_partial_": True, "base": 10000.0, "scaling": "none", "factor": None}
    stage = {**base, "scaling": "yarn", "factor": 4.0}
    assert stage_changes(stage, base) == ["pe.scaling='yarn' (the base's: 'none')", "pe.factor=4.0 (the base's: None)"]
    assert stage_changes(base, base) == []
    assert stage_changes({"_target_": "lenext.pe.NoPE", "_partial_": True}, base) == []
