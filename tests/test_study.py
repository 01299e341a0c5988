"""Studies: presets, skipping finished runs, resuming, reproducibility, DDP evaluation, launchers."""

import csv
import json
import os
import re
from pathlib import Path

import joblib
import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from lenext.cli import CONFIG_PACKAGE
from lenext.errors import ConfigError
from lenext.files import write_atomic
from lenext.model import Decoder
from lenext.pe import ALiBi
from lenext.progress import StudyProgress, duration, sweep_grid
from lenext.protocols import NonOverlapping
from lenext.run import train
from lenext.scoring import evaluate_length
from tests.conftest import run_train, small_corpus_overrides, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "preset,model,max_len,pes",
    [
        (
            "quick",
            128,
            64,
            "nope,sinusoidal,rope,alibi,kerple,fire,xpos,rope_randomized,fox,p_rope,cope,rope_nope,rnope_swa,dape,pope,path",
        ),
        (
            "reference",
            128,
            64,
            "nope,sinusoidal,learned,shaw,t5,rope,alibi,kerple,fire,xpos,rope_randomized,nope_randomized,"
            "p_rope,fox,fox_rope,cope,rope_nope,rnope_swa,dape,pope,path",
        ),
        ("paper", 256, 512, "nope,sinusoidal,learned,shaw,t5,rope,alibi"),
    ],
)
def test_experiment_presets_compose_into_multiruns(preset, model, max_len, pes, tmp_path):
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose(
            "train", overrides=[f"experiment={preset}", f"paths.root_dir={tmp_path}"], return_hydra_config=True
        )
    assert cfg.model.d_model == model and cfg.data.max_len == max_len
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert cfg.hydra.sweeper.params.pe == pes
    # rope_ntk trains what rope trains: a study evaluates RoPE under NTK instead of training it twice.
    assert "ntk" in cfg.eval.variants


def test_finished_runs_are_skipped_and_interrupted_ones_resume(compose_train, small_text_corpus, tmp_path, caplog):
    first = compose_train(*small_corpus_overrides(small_text_corpus, "trainer.max_steps=6", "eval.factors=[1]"))
    train(first)
    results = tmp_path / "results.json"
    assert json.loads(results.read_text())["complete"]
    written = results.stat().st_mtime_ns
    assert train(first)["skipped"] and results.stat().st_mtime_ns == written

    # An interrupted run: a checkpoint at step 6 but no results. Same folder, longer budget -> resumes.
    results.unlink()
    longer = compose_train(*small_corpus_overrides(small_text_corpus, "trainer.max_steps=10", "eval.factors=[1]"))
    with caplog.at_level("INFO", logger="lenext"):
        train(longer)
    assert f"resuming from {tmp_path / 'checkpoints' / 'last.ckpt'}" in caplog.text
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 10
    meta = json.loads(results.read_text())["meta"]
    assert meta["tokens_trained"] == 10 * 4 * 32
    # The rows of the steps before the checkpoint's are kept, once each: those of an uninterrupted 10-step run, which
    # does not validate at step 6 (the 6-step run's validation after training is logged at its step 6)
    logged = pd.read_csv(tmp_path / "csv" / "metrics.csv")
    assert logged.dropna(subset=["train/loss"]).step.tolist() == [9]  # every 10 steps
    assert logged.dropna(subset=["val/ppl"]).step.tolist() == [10]
    # Its tokens/s covers the 6 steps before the resume too (re-evaluating a finished run keeps its speed).
    assert checkpoint["train_clock"]["tokens"] == 10 * 4 * 32
    seconds = checkpoint["train_clock"]["seconds"]
    assert meta["train_tokens_per_s"] == pytest.approx(10 * 4 * 32 / seconds)


def test_same_config_and_seed_give_identical_results(compose_train, small_text_corpus, tmp_path):
    rows = []
    for run in ("a", "b"):
        cfg = compose_train(
            *small_corpus_overrides(
                small_text_corpus,
                "pe=alibi",
                "trainer.max_steps=8",
                "eval.factors=[1,2]",
                f"paths.output_dir={tmp_path / run}",
            )
        )
        train(cfg)
        rows.append(json.loads((tmp_path / run / "results.json").read_text())["rows"])
    assert [r["ppl"] for r in rows[0]] == [r["ppl"] for r in rows[1]]


def _evaluate_on_rank(rank, world, port, out):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = Decoder(50, 16, ALiBi, d_model=32, n_layers=2, n_heads=4).eval()
    docs = [np.random.default_rng(i).integers(0, 50, size=n).astype(np.int32) for i, n in enumerate((90, 51, 133))]
    windows = NonOverlapping().windows([len(d) for d in docs], 16)
    result = evaluate_length(net, docs, windows, 16, 32, per_position=True)
    if rank == 0:
        torch.save(result, out)
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two processes (DDP)
def test_evaluation_under_ddp_counts_each_token_once_and_matches_one_process(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.pt"
    mp.spawn(_evaluate_on_rank, args=(2, port, str(out)), nprocs=2, join=True)
    distributed = torch.load(out, weights_only=False)
    single = tmp_path / "single.pt"
    _single_process(str(single))
    alone = torch.load(single, weights_only=False)
    assert distributed["tokens"] == alone["tokens"] == (89 // 16 + 50 // 16 + 132 // 16) * 16
    assert distributed["mean_nll"] == pytest.approx(alone["mean_nll"], rel=1e-6)
    np.testing.assert_allclose(distributed["curve"], alone["curve"], rtol=1e-6)


def _single_process(out):
    torch.manual_seed(0)
    net = Decoder(50, 16, ALiBi, d_model=32, n_layers=2, n_heads=4).eval()
    docs = [np.random.default_rng(i).integers(0, 50, size=n).astype(np.int32) for i, n in enumerate((90, 51, 133))]
    torch.save(evaluate_length(net, docs, NonOverlapping().windows([len(d) for d in docs], 16), 16, 32, True), out)


@pytest.mark.slow
def test_ddp_sim_trains_and_evaluates_like_one_process(small_text_corpus, tmp_path):
    common = [
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=4", "eval.factors=[1,2]"),
        f"paths.cache_dir={tmp_path / '.cache'}",
    ]
    ddp = run_train(
        tmp_path,
        *common,
        "trainer=ddp_sim",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path / 'ddp'}",
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert re.search(r"^step 1 of 4: loss \d+\.\d+ \(rank 0's share of each batch\), ", ddp.stdout, re.M), ddp.stdout
    # Every step's training loss, and the last validation at the last step (ddp_spawn's run logged neither)
    logged = list(csv.DictReader((tmp_path / "ddp" / "csv" / "metrics.csv").open()))
    assert [int(row["step"]) for row in logged if row.get("train/loss")] == [0, 1, 2, 3]
    assert int([row for row in logged if row.get("val/loss")][-1]["step"]) == 4  # the steps done
    rows = json.loads((tmp_path / "ddp" / "results.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    # Validation split its windows between the two ranks and scored each once: the sweep's 1x row, exactly.
    at_l_train = rows[0]
    assert (
        f"over {at_l_train['windows']} windows (the sweep's nonoverlap row at L_train): {at_l_train['ppl']:.2f}"
        in ddp.stdout
    )
    assert (tmp_path / "ddp" / "checkpoints" / "last.ckpt").exists()
    # Resumed on one process, each step would read half the global batch: refused, the count read from the checkpoint
    (tmp_path / "ddp" / "results.json").unlink()
    again = run_train(
        tmp_path, *common, "trainer.max_steps=6", "trainer.precision=32-true", f"hydra.run.dir={tmp_path / 'ddp'}"
    )
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1, again.stderr[-2000:]
    assert "last.ckpt was trained on 2 processes (trainer.devices x trainer.num_nodes), this command runs 1" in (
        again.stderr
    )


@pytest.mark.slow
def test_a_sweep_of_ddp_runs_says_each_job_once(small_text_corpus, tmp_path):
    """Lightning starts rank 1 with the sweep's command line, so it walks the sweep beside rank 0: rank 0 alone says
    how the study goes (each job's line and the next step were printed twice, one with rank 1's times)."""
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.factors=[1]", "seed=0,1")
    result = run_train(
        tmp_path,
        "-m",
        *overrides,
        "trainer=ddp_sim",
        f"paths.cache_dir={tmp_path / '.cache'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("study: job 1 of 2 done", "study: job 2 of 2 done", "next: python -m lenext.report"):
        assert result.stdout.count(line) == 1, result.stdout
    assert all((tmp_path / "sweep" / job / "results.json").exists() for job in ("0", "1"))


@pytest.mark.slow
@pytest.mark.parametrize("pe", ["rope", "fire"])
def test_trainer_fsdp_trains_and_evaluates_like_one_process_on_the_same_global_batches(pe, small_text_corpus, tmp_path):
    common = [
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=3", "eval.factors=[1,2]", f"pe={pe}"),
        f"paths.cache_dir={tmp_path / '.cache'}",
    ]
    # Two ranks of 4 windows each see the global batch of 8 one process sees, in the same order (lenext.data); a
    # step's gradients are one process's to 1e-5 (tests/test_scaling.py).
    common.append("trainer.log_every_n_steps=1")
    sharded = run_train(tmp_path, *common, "trainer=fsdp_sim", f"hydra.run.dir={tmp_path / 'fsdp'}")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    single = run_train(tmp_path, *common, "data.batch_size=8", f"hydra.run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    assert sharded.stdout.count("validation perplexity") == 1  # rank 0 speaks for the run
    assert torch.load(tmp_path / "fsdp" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"].keys() == (
        torch.load(tmp_path / "one" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"].keys()
    )  # one file, gathered, read as any run's
    # Validation (ranks' shares evened out with uncounted repeats) and the sweep (on the gathered net) count each
    # window once, as one process does; the NLL agrees to Adam's amplification of rounding in near-zero gradients.
    rows = [json.loads((tmp_path / run / "results.json").read_text())["rows"] for run in ("fsdp", "one")]
    assert [(r["windows"], r["tokens"]) for r in rows[0]] == [(r["windows"], r["tokens"]) for r in rows[1]]
    for sharded_row, single_row in zip(*rows, strict=True):
        assert sharded_row["mean_nll"] == pytest.approx(single_row["mean_nll"], rel=1e-3)
    # The logged training loss is the global batch's (it was rank 0's half: 6.278 against 6.267; an audit).
    losses = [pd.read_csv(tmp_path / run / "csv" / "metrics.csv")["train/loss"].dropna() for run in ("fsdp", "one")]
    assert len(losses[0]) == 3 and losses[0].tolist() == pytest.approx(losses[1].tolist(), rel=1e-5)


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_two_job_sweep(small_text_corpus, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    result = run_train(
        tmp_path,
        "-m",
        "hydra/launcher=submitit_local",
        "pe=nope,alibi",
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=3", "eval.factors=[1]"),
        f"paths.cache_dir={tmp_path / '.cache'}",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = sorted(json.loads((sweep / str(job) / "results.json").read_text())["meta"]["pe_name"] for job in (0, 1))
    assert names == ["alibi", "nope"]
    # Each job runs in a process of its own: its log names the job's number in the sweep, not a count of one.
    logs = "".join(log.read_text() for log in (sweep / ".submitit").rglob("*_log.out"))
    lines = sorted(line.split(",")[0] for line in logs.splitlines() if line.startswith("study:"))
    assert lines == ["study: job 1 of 2 done (pe=nope", "study: job 2 of 2 done (pe=alibi"]


def test_a_bad_setting_of_any_job_refuses_the_sweep_before_its_first_job(tmp_path):
    """Every job is composed and checked before the sweep starts: the second job's bad value (or a key its PE
    lacks) is named with the job, and nothing runs or is written."""
    for sweep, expected in (
        (["module.lr=1e-3,-1"], "job 1 of the sweep (module.lr=-1): module.lr=-1 is invalid: it must be a finite"),
        (["pe=rope,alibi", "pe.scaling=yarn"], "job 1 of the sweep (pe=alibi): pe.scaling is not a setting of pe;"),
        (  # joblib's workers cannot start DDP's processes: the sweep died in a traceback
            ["seed=0,1", "trainer=ddp_sim", "hydra/launcher=parallel"],
            "job 0 of the sweep (seed=0): trainer.strategy=ddp is invalid under hydra/launcher=parallel",
        ),
        *(  # a GPU where there is none: every job failed in turn (an audit)
            [(["pe=rope,alibi", "trainer=gpu"], "job 0 of the sweep (pe=rope): trainer.accelerator=gpu is invalid")]
            if not torch.cuda.is_available()
            else []
        ),
    ):
        result = run_train(tmp_path, "-m", *tiny_overrides(*sweep))
        assert result.returncode == 1 and result.stderr.startswith(f"error: {expected}"), result.stderr[-2000:]
        assert len(result.stderr.splitlines()) == 1 and result.stderr.rstrip().endswith("; no job was started")
        assert not (tmp_path / "logs").exists()
    # A preset's grid (its sweeper params), with the command line's values over it
    result = run_train(tmp_path, "experiment=classic", "seed=0", "trainer.max_steps=0")
    assert result.stderr.startswith("error: job 0 of the sweep (pe=nope): trainer.max_steps=0 is invalid")


@pytest.mark.parametrize("launcher", ["basic", pytest.param("parallel", marks=pytest.mark.slow)])  # jobs as processes
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(small_text_corpus, tmp_path, launcher):
    """With the basic launcher every job runs in the sweep's process; with `parallel` (joblib) two at once, each
    in its own process with half the cores' torch threads, and the sweep counts the failures from their files."""
    (tmp_path / "empty").mkdir()  # a job whose corpus has no text: found by the job, when it reads the data
    result = run_train(
        tmp_path,
        "-m",
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=3", "eval.factors=[1]"),
        f"data.corpus.path={tmp_path / 'empty'},{small_text_corpus}",
        *(["hydra/launcher=parallel", "hydra.launcher.n_jobs=2"] if launcher == "parallel" else []),
        set_root=False,
    )
    empty = f"no .txt, .jsonl, .parquet files at data.corpus.path='{tmp_path / 'empty'}'"
    assert f"error: {empty}" in result.stderr
    # The sweep went on, then says how many failed and exits 1: a script must not take it as complete.
    assert result.returncode == 1 and "study: 1 of 2 jobs failed; each one's error.txt says why" in result.stderr
    # The failed job counts as done, and its seconds stay out of the estimate for the jobs left.
    assert f"study: job 1 of 2 done (data.corpus.path={tmp_path / 'empty'}, failed)\n" in result.stdout
    if launcher == "basic":  # with a job failed, the study is not said to be complete
        assert "; the study's jobs have all run\n" in result.stdout and "complete" not in result.stdout
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert empty in (sweep / "0" / "error.txt").read_text()
    results = json.loads((sweep / "1" / "results.json").read_text())
    assert results["complete"]
    if launcher == "parallel":
        # joblib caps each worker's threads at cores // n_jobs; the launching process's OMP_NUM_THREADS, if lower
        cores = joblib.cpu_count()
        threads = min(int(os.environ.get("OMP_NUM_THREADS", cores)), max(1, cores // 2))
        assert results["meta"]["hardware"]["torch_threads"] == threads


def test_a_sweep_run_elsewhere_counts_the_error_files_its_jobs_wrote_whatever_their_clock(tmp_path, capsys):
    """Jobs run in other processes (joblib, submitit) leave only their error files. Those the sweep's jobs wrote are
    the new ones, told apart from a file of an earlier sweep by identity, not by time: a file server's clock may be
    behind this machine's."""
    sweep = tmp_path / "sweep"
    for job in ("0", "1", "2"):
        (sweep / job).mkdir(parents=True)
    write_atomic(sweep / "2" / "error.txt", "an earlier sweep's failure, not relaunched\n")
    config = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["pe=nope,rope"]}, "sweeper": {"params": None}}}
    )
    progress = StudyProgress()
    progress.on_multirun_start(config)
    # Job 0 fails on a node whose file server stamps its error file an hour behind the launching machine.
    write_atomic(sweep / "0" / "error.txt", "data.max_len=0 is invalid\n")
    an_hour_ago = os.stat(sweep / "0" / "error.txt").st_mtime - 3600
    os.utime(sweep / "0" / "error.txt", (an_hour_ago, an_hour_ago))
    with pytest.raises(SystemExit) as exit:
        progress.on_multirun_end(config)
    assert exit.value.code == 1
    assert "study: 1 of 2 jobs failed; each one's error.txt says why" in capsys.readouterr().err

    # Relaunched, the same job fails again: its new file counts; a sweep whose jobs all succeed exits normally.
    progress.on_multirun_start(config)
    (sweep / "0" / "error.txt").unlink()
    write_atomic(sweep / "0" / "error.txt", "data.max_len=0 is invalid\n")
    with pytest.raises(SystemExit):
        progress.on_multirun_end(config)
    progress.on_multirun_start(config)
    (sweep / "0" / "error.txt").unlink()
    progress.on_multirun_end(config)


def test_wandb_logs_offline_without_an_account_and_gets_the_results_table(
    compose_train, small_text_corpus, tmp_path, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tables = []
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setattr(WandbLogger, "log_table", lambda self, key, columns, data: tables.append((key, columns, data)))
    cfg = compose_train(
        *small_corpus_overrides(small_text_corpus, "logger=wandb", "trainer.max_steps=3", "eval.factors=[1,2]")
    )
    train(cfg)
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    key, columns, data = tables[0]
    assert key == "eval/results" and "ppl" in columns and len(data) == 2


def test_sweep_grid_counts_the_jobs_of_presets_and_command_lines():
    preset = {"seed": "0,1,2", "pe": "nope,sinusoidal,learned,shaw,t5,rope,alibi"}
    assert sweep_grid(["experiment=reference"], preset) == (21, {"seed", "pe"})
    assert sweep_grid(["pe=rope,alibi", "data.max_len=32,64", "model=tiny"], preset) == (
        12,
        {"seed", "pe", "data.max_len"},
    )
    assert sweep_grid(["seed=range(0,5)"], None) == (5, {"seed"})
    assert [duration(s) for s in (12, 461, 7500)] == ["12s", "7m41s", "2h05m"]


def test_a_study_says_after_each_job_how_many_are_done_and_how_long_the_rest_will_take(small_text_corpus, tmp_path):
    sweep = tmp_path / "sweep"
    common = [
        "-m",
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.factors=[1]", "eval.max_windows=4"),
        f"paths.cache_dir={tmp_path / '.cache'}",
        f"hydra.sweep.dir={sweep}",
    ]
    first = run_train(tmp_path, *common, "pe=nope,alibi")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [line for line in first.stdout.splitlines() if line.startswith("study:")]
    assert len(lines) == 2
    assert lines[0].startswith("study: job 1 of 2 done (pe=nope, ") and lines[0].endswith(" left")
    assert lines[1].startswith("study: job 2 of 2 done (pe=alibi, ") and lines[1].endswith("; the study is complete")
    # While a job trains: its steps, and the study's time left (the first job's from its own pace).
    steps = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all(re.search(r"training ~\d+s left; study ~\d+s left$", line) for line in steps)
    # What a study prints is its own: no product tips, no model summary with a FLOPs column of zeros.
    printed = first.stdout + first.stderr
    assert "Tip:" not in printed and "FLOPs" not in printed and "study:" in printed

    # Re-launched with one more PE: the two finished jobs are skipped, counted, and kept out of the estimate.
    again = run_train(tmp_path, *common, "pe=nope,alibi,rope")
    lines = [line for line in again.stdout.splitlines() if line.startswith("study:")]
    assert lines[:2] == ["study: job 1 of 3 done (pe=nope, skipped)", "study: job 2 of 3 done (pe=alibi, skipped)"]
    assert lines[2].startswith("study: job 3 of 3 done (pe=rope, ") and "skipped" not in lines[2]


def test_validation_at_the_end_of_training_is_the_sweeps_nonoverlap_row_at_l_train(
    compose_train, small_text_corpus, tmp_path, capsys
):
    common = small_corpus_overrides(small_text_corpus, "trainer.max_steps=5", "eval.max_windows=7")
    metrics = train(compose_train(*common, "eval.factors=[1,2]"))
    row = json.loads((tmp_path / "results.json").read_text())["rows"][0]
    assert row["length"] == 32 and row["windows"] == 7
    assert metrics["val/ppl"] == pytest.approx(row["ppl"], rel=1e-5)
    assert (
        "validation perplexity at L_train=32 over 7 windows (the sweep's nonoverlap row at L_train): "
        in capsys.readouterr().out
    )

    # Validation cut short (one batch of 4) or a sweep without the 1x row: the line says what it measured instead.
    train(
        compose_train(
            *common, "trainer.limit_val_batches=1", "eval.enabled=false", f"paths.output_dir={tmp_path / 'a'}"
        )
    )
    assert "over 4 of the 7 windows of the nonoverlap row at L_train (cut short by" in capsys.readouterr().out
    train(compose_train(*common, "eval.factors=[2]", f"paths.output_dir={tmp_path / 'b'}"))
    assert "over 7 windows (those of the nonoverlap row at L_train, which this sweep lacks)" in capsys.readouterr().out


def test_extrapolation_small_preset_matches_the_published_study_and_trains(small_text_corpus, tmp_path):
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["experiment=extrapolation_small", f"paths.root_dir={tmp_path}"],
            return_hydra_config=True,
        )
    # The published runs' settings (train.py and model.py at the commit that wrote their numbers), point by point.
    model, data, optim = cfg.model, cfg.data, cfg.module
    assert (model.n_layers, model.d_model, model.n_heads) == (6, 384, 6)
    assert (model.mlp_ratio, model.dropout, model.tie_embeddings) == (2.0, 0.1, False)
    assert (data.max_len, data.vocab_size, data.batch_size, cfg.trainer.max_steps) == (128, 8192, 128, 10000)
    assert (optim.lr, optim.weight_decay, list(optim.betas)) == (2e-4, 0.0, [0.9, 0.999])
    assert (optim.warmup_steps, optim.min_lr_ratio, cfg.trainer.gradient_clip_val) == (0, 1.0, 1.0)
    assert cfg.trainer.accelerator == "gpu" and cfg.eval.protocol == "nonoverlap" and cfg.eval.max_windows is None
    assert [int(f * data.max_len) for f in cfg.eval.factors] == [128, 256, 512, 1024, 2048]
    assert (
        str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        and cfg.hydra.sweep.dir == f"{tmp_path}/logs/studies/extrapolation_small"
    )
    assert sweep_grid([], cfg.hydra.sweeper.params) == (30, {"seed", "pe"})  # rotary and alibi, 15 runs each
    assert cfg.hydra.sweeper.params.pe == "rope,alibi"

    out = tmp_path / "run"
    result = run_train(
        tmp_path,
        "experiment=extrapolation_small",
        "hydra.mode=RUN",
        "trainer=cpu",
        "trainer.max_steps=2",
        "model.d_model=48",  # the preset's shape, narrower: seconds on CPU
        "data=text_files",
        f"data.corpus.path={small_text_corpus}",
        "data.corpus.holdout_every=4",
        "data.vocab_size=512",
        "data.max_len=16",
        "data.batch_size=4",
        "eval.factors=[1,2]",
        "eval.max_windows=4",
        f"paths.cache_dir={tmp_path / '.cache'}",
        f"hydra.run.dir={out}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["model"]["n_layers"] == 6 and [r["status"] for r in results["rows"]] == ["ok", "ok"]


def test_the_csv_log_of_a_resumed_run_keeps_earlier_steps_once(tmp_path):
    """Killed after its last checkpoint (step 15), a run logged steps 15..20 it logs again when it resumes: the file
    is cut at the checkpoint's step, not at the first step the resumed run logs."""
    from lenext.loggers import CSVLogger

    folder = tmp_path / "csv"
    folder.mkdir()
    pd.DataFrame({"step": range(21), "train/loss": [float(s) for s in range(21)]}).to_csv(
        folder / "metrics.csv", index=False
    )
    logger = CSVLogger(str(tmp_path), name="csv", version="")
    logger.resume_at(15)
    for step in range(16, 18):  # logged from step 16 on: step 15's earlier row goes too, a step after the checkpoint
        logger.log_metrics({"train/loss": 100.0 + step}, step=step)
    logger.log_metrics({"val/ppl": 7.0}, step=17)
    logger.save()
    logged = pd.read_csv(folder / "metrics.csv")
    assert logged.step.tolist() == [*range(15), 16, 17, 17]
    assert logged["train/loss"].tolist()[:17] == [*map(float, range(15)), 116.0, 117.0]
    assert logged["val/ppl"].dropna().tolist() == [7.0]


def test_the_sweep_check_takes_the_grid_hydra_runs():
    """The command line's hydra.sweeper.params over the preset's, each job's ${hydra:job.num}; --cfg checks none."""
    from lenext.cli import check_overrides

    found = HydraConfig.instance().cfg
    check_overrides("train", ["experiment=quick", "hydra.sweeper.params.pe=rope", "pe.scaling=yarn"])
    check_overrides("train", ["pe=rope,alibi", "seed=${hydra:job.num}"], multirun=True)
    check_overrides("train", ["pe=rope,alibi", "pe.scaling=yarn"], multirun=True, jobs=False)
    with pytest.raises(ConfigError, match=r"^job 1 of the sweep \(pe=alibi\): pe.scaling is not a setting of pe"):
        check_overrides("train", ["pe=rope,alibi", "pe.scaling=yarn"], multirun=True)
    # Each job's check set Hydra's config; left set, a later test's run in this process took its pe= for its own
    assert HydraConfig.instance().cfg is found
