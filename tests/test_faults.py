"""Faults a user or a cluster brings: each answered in one line naming the file, key or process, before any work,
with a non-zero exit status and nothing half-written or written twice."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from lenext.data import TextFiles
from lenext.errors import CheckpointError, ConfigError, DataError
from lenext.lock import LOCK_FILE, FolderInUse, hold_folder, release_folder
from lenext.module import AtomicCheckpointIO
from lenext.report import main as report_main
from lenext.report import unwritable
from lenext.resolve import TRAIN_NODES, TrainSettings, stage_settings
from lenext.run import train
from lenext.run_folder import preflight, refuse_other_settings, resolve_training
from tests import forked
from tests.conftest import ROOT, needs_transformers_models, small_corpus_overrides
from tests.test_report import write_run

GOOD = "A document long enough to be one. " * 20


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("latin1.txt", "caf\xe9 au lait\n".encode("latin-1"), r"latin1.txt, line 1 is not UTF-8 text \(byte 3"),
        (
            "bad.jsonl",
            b'{"text": "fine"}\n{"text": "cut off',
            r"bad.jsonl, line 2 is not JSON \(Unterminated string starting at column 10\)",
        ),
        (
            "bad.jsonl",
            b'{"text": "fine"}\nnot json at all\n',
            r"bad.jsonl, line 2 is not JSON \(Expecting value at column 1\)",
        ),
        ("bad.jsonl", b'{"text": "fine"}\n\n{"body": "x"}\n', r"bad.jsonl, line 3: it has no 'text' field"),
        ("bad.jsonl", b'{"text": null}\n', r"bad.jsonl, line 1: its 'text' is null"),
        ("bad.jsonl", b'{"text": 7}\n', r"bad.jsonl, line 1: its 'text' is 7"),
        ("bad.jsonl", b'["text"]\n', r"bad.jsonl, line 1: it is a JSON list, not an object"),
        ("bad.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), r"bad.jsonl, line 1 is not UTF-8 text"),
        ("bad.jsonl", b'{"text": "\\ud83d x"}\n', r"bad.jsonl, line 1: its 'text' holds '\\ud83d' at character 0"),
        ("bad.jsonl", b"[" * 100_000 + b"\n", r"bad.jsonl, line 1 (is not|cannot be read as) JSON"),
        ("bad.jsonl", b'{"text": ' + b"9" * 5000 + b"}\n", r"bad.jsonl, line 1 cannot be read as JSON"),
    ],
)
def test_a_corpus_file_that_is_not_documents_is_named_with_its_line(tmp_path, name, content, expected):
    (tmp_path / "a.txt").write_text(GOOD)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=r"^data.corpus.path: .*" + expected):
        list(TextFiles(str(tmp_path)).documents("train"))


def test_a_dangling_link_in_a_corpus_folder_is_named(tmp_path):
    (tmp_path / "a.txt").write_text(GOOD)
    os.symlink(tmp_path / "gone.txt", tmp_path / "b.txt")
    with pytest.raises(DataError, match=r"b.txt cannot be read \(a link to '.*gone.txt', which does not exist\)"):
        list(TextFiles(str(tmp_path)).documents("train"))


def test_a_file_reached_twice_through_links_is_read_once(tmp_path):
    (tmp_path / "a.txt").write_text(GOOD)
    os.symlink(tmp_path / "a.txt", tmp_path / "b.txt")
    os.symlink(tmp_path, tmp_path / "loop")  # a link to a folder above the file
    assert list(TextFiles(str(tmp_path), holdout_every=3).documents("train")) == [GOOD]


def test_json_lines_keep_characters_that_split_lines_elsewhere(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one\u2028two"}, ensure_ascii=False) + "\n\n")
    assert list(TextFiles(str(tmp_path), holdout_every=3).documents("train")) == ["one\u2028two"]


def test_a_bad_corpus_stops_the_command_before_training(tmp_path, small_text_corpus):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in small_text_corpus.iterdir():
        (corpus / f.name).write_bytes(f.read_bytes())
    (corpus / "notes.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
    result = run_command(tmp_path, *small_corpus_overrides(corpus, f"hydra.run.dir={tmp_path / 'run'}"))
    assert result.returncode == 1
    assert one_line(result).startswith(f"error: data.corpus.path: {corpus / 'notes.jsonl'}, line 2: its 'text' is null")
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / ".cache").exists()


def test_resuming_under_another_model_shape_names_the_settings(compose_train, small_text_corpus, tmp_path):
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.factors=[1]")
    train(compose_train(*overrides, "callbacks.last_checkpoint.every_n_train_steps=1"))
    wider = compose_train(*overrides, "model.d_model=128")
    with pytest.raises(
        ConfigError, match=r"last.ckpt belongs to a run with other settings.*model.d_model=64 there, 128 here"
    ):
        resolve_training(wider)[0]
    # The finished run's results: a re-launch with other settings is not skipped as if it were this run
    with pytest.raises(ConfigError, match=r"results.json belongs to a run with other settings.*model.d_model"):
        train(wider)


@pytest.mark.parametrize(
    "changed, shown",
    [
        ("trainer.precision=bf16-mixed", "trainer.precision='32-true' there, 'bf16-mixed' here"),
        ("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_val=1.0 there, 0.5 here"),
        ("+trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=None there, 2 here"),
    ],
)
def test_resuming_under_another_step_computation_names_the_setting(compose_train, small_text_corpus, changed, shown):
    """A resume under another precision, gradient clipping or accumulation was taken: the run then followed no
    uninterrupted run's trajectory, and its results were reported under the resumed command's settings."""
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.enabled=false")
    train(compose_train(*overrides, "trainer.precision=32-true"))
    assert resolve_training(compose_train(*overrides, "trainer.precision=32"))[0].start == "resume"  # its other name
    with pytest.raises(ConfigError, match=rf"last.ckpt belongs to a run with other settings.*{re.escape(shown)}"):
        resolve_training(compose_train(*overrides, "trainer.precision=32-true", changed))


def test_resuming_on_another_number_of_processes_is_refused_before_the_corpus_is_read(
    compose_train, small_text_corpus, tmp_path, monkeypatch
):
    """Resumed on other devices, each process reading a batch of its own, a run's global batch and the samples each
    step reads changed, and nothing said so. The count: the tokens the checkpoint trained, per one process's step."""
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.enabled=false")
    train(compose_train(*overrides, "callbacks.last_checkpoint.every_n_train_steps=1"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["tokens_trained"] == 2 * 4 * 32  # one process: steps x batch x L_train
    checkpoint["tokens_trained"] *= 2  # as two processes write it
    torch.save(checkpoint, last)
    monkeypatch.setattr(TextFiles, "documents", lambda *_: pytest.fail("the corpus was read"))
    refused = (
        r"^.*last.ckpt was trained on 2 processes \(trainer.devices x trainer.num_nodes\), this command runs 1, "
        r".* Resume on 2, or give this run another folder$"
    )
    with pytest.raises(ConfigError, match=refused):
        train(compose_train(*overrides, "trainer.max_steps=4"))
    monkeypatch.undo()
    assert not train(compose_train(*overrides)).get("skipped")  # no step left: its evaluation may finish anywhere


def test_a_finished_run_without_gradient_clipping_is_not_skipped_under_clipping(compose_train, small_text_corpus):
    """A null in the stored config is a setting (no clipping), not a key to pass over (an audit found it skipped)."""
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.factors=[1]")
    unclipped = [*overrides, "trainer.precision=32-true", "trainer.gradient_clip_val=null"]
    train(compose_train(*unclipped))
    assert train(compose_train(*unclipped))["skipped"]
    with pytest.raises(ConfigError, match=r"results.json belongs .*trainer.gradient_clip_val=None there, 1.0 here"):
        train(compose_train(*overrides, "trainer.precision=32-true"))


def test_a_finished_run_is_skipped_only_under_its_own_budget_and_evaluation(compose_train, small_text_corpus, tmp_path):
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=3", "eval.factors=[1]")
    train(compose_train(*overrides, "trainer.precision=32-true"))
    assert train(compose_train(*overrides, "trainer.precision=32"))["skipped"]  # 32-true by another name
    overrides.append("trainer.precision=32-true")
    for changed, key in (
        ("trainer.max_steps=4", "trainer.max_steps=3 there, 4 here"),
        ("eval.factors=[1,2]", "eval"),
        # what the steps computed with: another run's numbers
        ("trainer.precision=bf16-mixed", "trainer.precision='32-true' there, 'bf16-mixed' here"),
        ("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_val=1.0 there, 0.5 here"),
    ):
        with pytest.raises(ConfigError, match=rf"results.json belongs to a run with other settings.*{key}"):
            train(compose_train(*overrides, changed))
    # Results from before meta.identity, or from when it held fewer keys: what their meta says of the run (its PE,
    # model, seed, positions, steps) is compared too
    results = json.loads((tmp_path / "results.json").read_text())
    for kept in ({}, {k: v for k, v in results["meta"]["identity"].items() if k.startswith("model.")}):
        results["meta"]["identity"] = kept
        (tmp_path / "results.json").write_text(json.dumps(results))
        assert train(compose_train(*overrides))["skipped"]
        for changed, key in (
            ("trainer.max_steps=4", "trainer.max_steps=3 there, 4 here"),
            ("trainer.max_steps=2", "trainer.max_steps=3 there, 2 here"),
            ("pe=alibi", "pe._target_"),
            ("train.positions=randomized", "train.positions='sequential' there"),
        ):
            with pytest.raises(ConfigError, match=rf"results.json belongs to a run with other settings.*{key}") as e:
                train(compose_train(*overrides, changed))
            # training further is the remedy of a longer budget alone (resuming another PE fails)
            assert ("To train a finished run further" in str(e.value)) == (changed == "trainer.max_steps=4")
    with pytest.raises(ConfigError, match=r"To train a finished run further, delete its results.json"):
        train(compose_train(*overrides, "trainer.max_steps=4"))
    (tmp_path / "results.json").unlink()  # unfinished: resumable with a longer budget, not a shorter one
    with pytest.raises(ConfigError, match=r"^trainer.max_steps=2 is invalid for this run: .*last.ckpt is at step 3"):
        resolve_training(compose_train(*overrides, "trainer.max_steps=2"))[0]


def test_a_default_this_command_leaves_null_is_not_compared(compose_train):
    """Older runs stored some defaults resolved (T5's max_distance); null here means the same default."""
    cfg = compose_train("pe=t5")
    refuse_other_settings({"pe.max_distance": 64, "pe.num_buckets": 32}, cfg, "old.ckpt", "")
    with pytest.raises(ConfigError, match=r"pe.num_buckets=16 there, 32 here"):
        refuse_other_settings({"pe.max_distance": 64, "pe.num_buckets": 16}, cfg, "old.ckpt", "")


def test_a_target_named_by_another_import_path_of_the_same_class_is_the_same_setting(compose_train):
    """A run checkpointed when pe/rope_nope.yaml named lenext.pe.rope.RoPE resumes now that it names lenext.pe.RoPE."""
    cfg = compose_train("pe=rope_nope")
    refuse_other_settings({"pe.pes.rope._target_": "lenext.pe.rope.RoPE"}, cfg, "old.ckpt", "")
    with pytest.raises(ConfigError, match=r"pe.pes.rope._target_='lenext.pe.ALiBi' there, 'lenext.pe.RoPE' here"):
        refuse_other_settings({"pe.pes.rope._target_": "lenext.pe.ALiBi"}, cfg, "old.ckpt", "")
    with pytest.raises(ConfigError, match=r"pe.pes.rope._target_='lenext.pe.Gone' there"):
        refuse_other_settings({"pe.pes.rope._target_": "lenext.pe.Gone"}, cfg, "old.ckpt", "")


def test_a_second_stage_takes_a_base_whose_nested_target_names_its_class_by_another_path():
    """DAPE's base (a PE inside the PE node) stored as lenext.pe.kerple.KERPLE, named lenext.pe.KERPLE now."""
    theirs = {"_target_": "lenext.pe.dape.DAPE", "base": {"_target_": "lenext.pe.kerple.KERPLE", "kernel": "log"}}
    here = {"_target_": "lenext.pe.DAPE", "base": {"_target_": "lenext.pe.KERPLE", "kernel": "log"}}
    assert stage_settings(here, theirs, "pe", "base.ckpt")["base"] == theirs["base"]
    other = {**here, "base": {"_target_": "lenext.pe.FIRE", "kernel": "log"}}
    with pytest.raises(ConfigError, match=r"pe.base=.*is invalid for a second stage"):
        stage_settings(other, theirs, "pe", "base.ckpt")


def test_a_sweep_relaunched_with_other_settings_stops_at_its_first_job(tmp_path, small_text_corpus):
    sweep = tmp_path / "sweep"
    command = [
        "-m",
        *small_corpus_overrides(small_text_corpus, "seed=0,1", "eval.factors=[1]", f"hydra.sweep.dir={sweep}"),
    ]
    assert run_command(tmp_path, *command, "trainer.max_steps=3").returncode == 0
    written = (sweep / "1" / "results.json").stat().st_mtime_ns
    again = run_command(tmp_path, *command, "trainer.max_steps=4")
    assert again.returncode == 1
    assert one_line(again).startswith(f"error: {sweep / '0' / 'results.json'} belongs to a run with other settings")
    assert "trainer.max_steps=3 there, 4 here" in one_line(again)
    assert not (sweep / "0" / "error.txt").exists() and (sweep / "1" / "results.json").stat().st_mtime_ns == written


@pytest.mark.parametrize(
    "written",
    ['{"complete": true}', '{"complete": true, "meta": null}', '{"complete": true, "meta": {}, "rows": []}', "[]", ""],
)
def test_a_run_folder_holding_another_tools_results_is_refused(compose_train, tmp_path, written):
    (tmp_path / "results.json").write_text(written)
    with pytest.raises(ConfigError, match=r"results.json (is not a lenext results file|cannot be read as a results)"):
        train(compose_train())


def test_a_truncated_last_checkpoint_is_named_with_what_to_do(compose_train, small_text_corpus, tmp_path):
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.enabled=false")
    train(compose_train(*overrides))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # a disk filled mid-write
    with pytest.raises(CheckpointError, match=rf"^{last} cannot be read .*truncated.*or delete it to train the run"):
        resolve_training(compose_train(*overrides))[0]


def test_checkpoints_are_written_next_to_their_target_only(tmp_path, monkeypatch):
    full = tmp_path / "tmp_is_full"
    full.write_text("")  # a file: anything staged in the temporary folder fails
    monkeypatch.setattr(tempfile, "tempdir", str(full))
    monkeypatch.setenv("TMPDIR", str(full))
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, str(tmp_path / "ckpt" / "last.ckpt"))
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]["w"].tolist() == [1.0] * 3
    assert os.listdir(tmp_path / "ckpt") == ["last.ckpt"]


def test_settings_that_need_no_evaluation_are_not_refused_for_it(compose_train, small_text_corpus):
    overrides = small_corpus_overrides(
        small_text_corpus, "pe=rope", "train.positions=randomized", "train.max_position=64", "eval.factors=[1,4]"
    )
    with pytest.raises(ConfigError, match=r"^train.max_position=64 is invalid for this evaluation"):
        preflight(compose_train(*overrides), TrainSettings, TRAIN_NODES, sweeps=True)
    cfg = compose_train(*overrides, "eval.enabled=false")
    preflight(cfg, TrainSettings, TRAIN_NODES, sweeps=cfg.eval.enabled)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused(compose_train, value):
    with pytest.raises(ConfigError, match=rf"^module.lr={value} is invalid: it must be a finite number > 0$"):
        preflight(compose_train(f"module.lr={value}"), TrainSettings, TRAIN_NODES)


def test_a_folder_is_held_by_one_process(tmp_path):
    assert hold_folder(str(tmp_path)) and not hold_folder(str(tmp_path))  # held once, however often asked
    holder = subprocess.run(
        [sys.executable, "-c", f"from lenext.lock import hold_folder; hold_folder({str(tmp_path)!r})"],
        capture_output=True,
        text=True,
    )
    assert holder.returncode != 0 and "FolderInUse" in holder.stderr
    assert f"lenext process {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
    release_folder(str(tmp_path))
    subprocess.run(
        [sys.executable, "-c", f"from lenext.lock import hold_folder; hold_folder({str(tmp_path)!r})"], check=True
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(FolderInUse, match=r"file/run cannot hold this run \(.*\): give a folder you can write to"):
        hold_folder(str(tmp_path / "file" / "run"))


def test_the_temporary_files_a_killed_writer_left_are_removed_by_the_next_process_holding_the_folder(tmp_path):
    """A SIGKILL (or out of memory) while a checkpoint was written left its temporary file, a whole checkpoint's
    size, in the run folder; each kill added one. Other folders inside it (a cache, another run's) keep theirs."""
    killed_mid_write = (
        "import os, signal; from lenext.files import atomic_path\n"
        "with atomic_path(os.path.join({!r}, 'last.ckpt')) as tmp:\n"
        "    open(tmp, 'wb').write(b'half a checkpoint'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    nested = tmp_path / "cache"  # another process's, perhaps writing now
    for folder in (tmp_path / "checkpoints", nested):
        folder.mkdir()
        died = subprocess.run([sys.executable, "-c", killed_mid_write.format(str(folder))])
        assert died.returncode == -signal.SIGKILL and len(os.listdir(folder)) == 1
    (tmp_path / "notes.tmp").write_text("a user's")
    assert hold_folder(str(tmp_path))
    release_folder(str(tmp_path))
    assert os.listdir(tmp_path / "checkpoints") == [] and (tmp_path / "notes.tmp").exists()
    assert len(os.listdir(nested)) == 1


@pytest.mark.slow  # two commands at once, one killed
def test_a_run_launched_twice_into_one_folder_refuses_the_second(tmp_path, small_text_corpus):
    run_dir = tmp_path / "run"
    command = small_corpus_overrides(
        small_text_corpus, "trainer.max_steps=100000", "eval.factors=[1]", f"hydra.run.dir={run_dir}"
    )  # the first still trains when the second checks (it is killed then), however loaded the machine
    first = start_command(tmp_path, *command)
    lock = run_dir / LOCK_FILE
    while not (lock.exists() and lock.read_text()) and first.poll() is None:
        time.sleep(0.05)
    second = run_command(tmp_path, *command)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert second.returncode == 1
    assert one_line(second) == (
        f"error: {run_dir} is in use by {lock.read_text().strip()}: wait for it to end, or start this one in another "
        "folder (hydra.run.dir=... for a run, hydra.sweep.dir=... for a sweep)"
    )
    assert f"process {first.pid} " in one_line(second)


@pytest.mark.slow  # two commands at once, one killed
def test_a_sweep_launched_twice_into_one_folder_refuses_the_second(tmp_path, small_text_corpus):
    sweep = tmp_path / "sweep"
    command = [
        "-m",
        *small_corpus_overrides(
            # steps enough that job 0 still trains when the second command checks, however loaded the machine
            small_text_corpus,
            "seed=0,1",
            "trainer.max_steps=100000",
            "eval.factors=[1]",
            f"hydra.sweep.dir={sweep}",
        ),
    ]
    first = start_command(tmp_path, *command)
    while not (sweep / "0" / ".hydra").exists() and first.poll() is None:
        time.sleep(0.05)
    second = run_command(tmp_path, *command)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert second.returncode == 1 and one_line(second).startswith(f"error: {sweep} is in use by lenext process")
    assert not (sweep / "0" / "error.txt").exists() and not (sweep / "1").exists()


def test_report_skips_another_tools_results_and_says_so(tmp_path, capsys):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    os.makedirs(tmp_path / "1" / ".hydra")
    (tmp_path / "1" / "results.json").write_text(json.dumps({"complete": True, "accuracy": 0.93}))
    report_main([str(tmp_path), "--no-figures"])
    assert f"`{tmp_path / '1'}`: results.json is not lenext's (no meta object)" in capsys.readouterr().out
    with pytest.raises(
        SystemExit,
        match=r"^error: no complete results.json under .* \(1 incomplete runs; .*1: results.json is not lenext's",
    ):
        report_main([str(tmp_path / "1")])


@pytest.mark.parametrize(
    "change,problem",
    [
        (lambda r: r["meta"].pop("pe_name") and r["meta"]["pe"].pop("name"), "meta.pe.name"),
        (lambda r: r.update(rows=[]), "no rows"),
        (lambda r: r["rows"][0].update(ppl="x"), "rows[0].ppl"),
        (lambda r: r["meta"].update(train_len="abc"), "meta.train_len"),
        (lambda r: r["meta"].update(hardware="a CPU"), "meta.hardware"),
        (lambda r: r["meta"].update(positions="sequential"), "meta.positions"),
        # What the report reads where a file has it (hand-edited files had sent a traceback)
        (lambda r: r["meta"].update(row_fields=["rope"]), "meta.row_fields"),
        (lambda r: r["meta"].update(lineage=[{"steps": 100}]), "meta.lineage[0].row"),
        (lambda r: r["meta"].update(identity={"eval.variants": 5}), "meta.identity.eval.variants"),
        (lambda r: r["rows"][0].update(rank_accuracy="high"), "rows[0].rank_accuracy"),
        (lambda r: r["meta"].update(hardware={"gpu": None}), "meta.hardware.cpu"),
        # Values no evaluation writes (hand-edited files had been tabled: -5.00, "weird" as "-")
        (lambda r: r["rows"][0].update(ppl=-5.0), "rows[0].ppl=-5.0 is outside [1, inf]"),
        (lambda r: r["rows"][0].update(status="weird"), "rows[0].status='weird' is none of ok, no windows, not appl"),
        (lambda r: r["rows"][0].update(exact_match=1.5), "rows[0].exact_match=1.5 is outside [0, 1]"),
        # Fields the report reads that had passed, then sent a traceback (found by an audit)
        (lambda r: r["rows"][0].update(peak_mem_mb="big"), "rows[0].peak_mem_mb"),
        (lambda r: r["rows"][0].update(depth="deep"), "rows[0].depth"),
        (lambda r: r["meta"].update(train_tokens_per_s="fast"), "meta.train_tokens_per_s"),
        (lambda r: r["meta"].update(task=5), "meta.task"),
        (lambda r: r["meta"].update(checkpoint=5), "meta.checkpoint"),
        (lambda r: r["meta"].update(pe_config=[1]), "meta.pe_config"),
        (lambda r: r["meta"].update(row_fields={"pe": "rope", "colour": "red"}), "meta.row_fields.colour is no field"),
        (lambda r: r["meta"].update(train_len=0), "meta.train_len=0 is not a length"),
        (lambda r: r["rows"][0].update(length=-64), "rows[0].length=-64 is not a length"),
        # A row twice: counted as two seeds' (n = 2, std 0 from one run)
        (lambda r: r["rows"].append(dict(r["rows"][0])), "rows[1] repeats rows[0] (its protocol, variant and length)"),
    ],
)
def test_report_lists_a_results_file_it_cannot_read_as_lenexts(tmp_path, capsys, change, problem):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    write_run(tmp_path / "1", "rope", 0, {64: 21.0})
    results = json.loads((tmp_path / "1" / "results.json").read_text())
    change(results)
    (tmp_path / "1" / "results.json").write_text(json.dumps(results))
    (tmp_path / "2" / ".hydra").mkdir(parents=True)
    (tmp_path / "2" / "error.txt").write_bytes(b"caf\xe9")  # not UTF-8 either
    report_main([str(tmp_path), "--no-figures"])
    out = capsys.readouterr().out
    assert f"results.json is not lenext's ({problem}" in out and "| alibi |" in out and "failed: caf" in out


def test_report_refuses_an_output_it_cannot_write_before_reading_runs(tmp_path, monkeypatch):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(SystemExit, match=r"^error: --out=.*taken/report' cannot hold the report \(.*taken is a file"):
        report_main([str(tmp_path), "--out", str(tmp_path / "taken" / "report")])
    with pytest.raises(SystemExit, match=r"cannot hold the report \(.*taken is a file, not a folder\)"):
        report_main([str(tmp_path), "--out", str(tmp_path / "taken")])

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", denied)  # a read-only folder, whoever runs the test
    assert unwritable(str(tmp_path / "new" / "report")) == f"{tmp_path}: Permission denied"
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_report_refuses_a_read_only_output_folder(tmp_path):
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(SystemExit, match=r"cannot hold the report \(.*Permission denied\)"):
        report_main([str(tmp_path), "--out", str(locked)])


def run_command(cwd, *overrides):
    return forked.run_command("train.py", overrides, command_environment(cwd), cwd)


def start_command(cwd, *overrides):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=command_environment(cwd),
    )


def command_environment(root) -> dict:
    environment = {**os.environ, "LENEXT_ROOT": str(root), "PYTHONUNBUFFERED": "1"}
    environment.pop("HYDRA_FULL_ERROR", None)
    return environment


def one_line(result) -> str:
    """The command's one error line: no traceback (Lightning's notices, before the corpus is read, may precede it)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def test_an_extension_preset_without_its_sweeps_base_says_where_init_from_came_from(tmp_path, small_text_corpus):
    """extension=yarn outside experiment=extension named a path the user never typed (the preset's base in the
    sweep folder); the line now says it is the preset's, and what to give. A typed init_from is named as typed."""
    overrides = small_corpus_overrides(small_text_corpus, f"hydra.run.dir={tmp_path / 'run'}", "extension=yarn")
    result = run_command(tmp_path, *overrides)
    assert result.returncode == 1
    line = one_line(result)
    assert "rope_base_seed0/checkpoints/last.ckpt' does not exist" in line
    assert "this init_from is set by extension=yarn" in line
    assert line.endswith("outside such a sweep, give init_from=<base run's last.ckpt>")
    typed = run_command(tmp_path, *overrides, f"init_from={tmp_path / 'no.ckpt'}")
    assert typed.returncode == 1 and "set by" not in one_line(typed)


@pytest.mark.parametrize("multirun", [False, True])
def test_a_setting_an_extension_preset_gives_a_pe_without_it_names_the_preset(tmp_path, multirun):
    """pe=alibi extension=yarn: the line named pe.scaling, which the user never typed; it now names the preset that
    set it, in a run and in a sweep's check of its jobs, and not a key the command line set."""
    sweep = ["-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"] if multirun else [f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_command(tmp_path, *sweep, "pe=alibi", "extension=yarn")
    assert result.returncode == 1
    assert one_line(result).endswith(
        "pe.scaling is not a setting of lenext.pe.ALiBi; the settings there: none (pe.scaling is set by "
        f"extension=yarn, not on the command line){'; no job was started' if multirun else ''}"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()
    typed = run_command(tmp_path, *sweep, "pe=alibi", "extension=yarn", "pe.scaling=yarn")
    assert typed.returncode == 1 and "set by" not in one_line(typed)


def test_more_cpu_devices_than_cores_is_refused_before_any_process_starts(tmp_path, small_text_corpus):
    """trainer.devices=64 on a CPU started 63 training processes (about 9 GB before it was stopped); more devices
    than cores is refused in one line, the run folder left as it was."""
    cores = os.cpu_count() or 1
    run_dir = tmp_path / "run"
    overrides = small_corpus_overrides(small_text_corpus, f"hydra.run.dir={run_dir}", f"trainer.devices={cores + 1}")
    result = run_command(tmp_path, *overrides, "trainer.accelerator=cpu")
    assert result.returncode == 1
    assert one_line(result) == (
        f"error: trainer.devices={cores + 1} is invalid on this machine: each CPU device is a training process, and "
        f"it has {cores} cores; give at most {cores} (a GPU machine trains on its GPUs)"
    )
    assert not run_dir.exists()


def test_a_monitor_naming_no_logged_metric_stops_the_command_before_any_work(tmp_path, small_text_corpus):
    """callbacks.best_checkpoint.monitor=val/lss trained up to a validation, then Lightning's ModelCheckpoint stopped
    the run with a traceback (no metric of that name is logged); it is refused in one line, the corpus unread."""
    run_dir = tmp_path / "run"
    steps = ("trainer.max_steps=2", "trainer.val_check_interval=2")  # a validation while training: Lightning's check
    overrides = small_corpus_overrides(small_text_corpus, f"hydra.run.dir={run_dir}", *steps)
    result = run_command(tmp_path, *overrides, "callbacks.best_checkpoint.monitor=val/lss")
    assert result.returncode == 1
    assert one_line(result) == (
        "error: callbacks.best_checkpoint.monitor='val/lss' is invalid: it must be a metric this run logs, one of "
        "'train/loss', 'val/loss', 'val/ppl', 'val/windows' (did you mean val/loss?)"
    )
    assert not run_dir.exists() and not (tmp_path / ".cache").exists()


EARLY_STOPPING = "+callbacks.early._target_=lightning.pytorch.callbacks.EarlyStopping"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "+callbacks.kept._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                "+callbacks.kept.monitor=val/ppl_",
            ],
            r"^callbacks.kept.monitor='val/ppl_' is inv",
        ),
        ([EARLY_STOPPING, "+callbacks.early.monitor=val_loss"], r"^callbacks.early.monitor='val_loss' is invalid: "),
        (["callbacks.best_checkpoint.monitor=val/exact_match"], r"'val/windows'; val/exact_match is a probe's \("),
        (["data=synthetic", "callbacks.best_checkpoint.monitor=val/exact"], r"'val/token_accuracy' \(did you mean "),
    ],
)
def test_every_callbacks_monitor_is_checked_against_what_the_run_logs(compose_train, overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(compose_train(*overrides), TrainSettings, TRAIN_NODES)


@pytest.mark.parametrize(
    "overrides",
    [
        ["callbacks.best_checkpoint.monitor=train/loss"],
        [EARLY_STOPPING, "+callbacks.early.monitor=val/ppl"],
        ["data=synthetic", "callbacks.best_checkpoint.monitor=val/exact_match"],
    ],
)
def test_a_monitor_of_a_metric_the_run_logs_is_taken(compose_train, overrides):
    preflight(compose_train(*overrides), TrainSettings, TRAIN_NODES)


def test_a_relaunch_refused_for_its_settings_keeps_the_record_of_the_run_there(tmp_path, small_text_corpus):
    """Hydra wrote the command's .hydra/ into its run folder before the job started: a relaunch refused for its
    settings left the run there described by the refused command. lenext writes it once a command is accepted."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the run's own\n")
    (run_dir / "results.json").write_text("[]")  # no lenext results: refused
    refused = run_command(tmp_path, *small_corpus_overrides(small_text_corpus, f"hydra.run.dir={run_dir}"))
    assert refused.returncode == 1 and "is not a lenext results file" in one_line(refused)
    assert os.listdir(run_dir / ".hydra") == ["config.yaml"]
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the run's own\n"
    (run_dir / "results.json").unlink()  # refused later, once the trainer is built: still not recorded
    refused = run_command(
        tmp_path, *small_corpus_overrides(small_text_corpus, f"hydra.run.dir={run_dir}", "module.compile=true")
    )
    assert refused.returncode == 1 and one_line(refused).startswith("error: module.compile=true is invalid on a CPU")
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the run's own\n"
    fresh = tmp_path / "fresh"
    steps = ("trainer.max_steps=1", "eval.enabled=false")
    accepted = run_command(tmp_path, *small_corpus_overrides(small_text_corpus, f"hydra.run.dir={fresh}", *steps))
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert sorted(os.listdir(fresh / ".hydra")) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert "- eval.enabled=false" in (fresh / ".hydra" / "overrides.yaml").read_text().splitlines()
    assert "max_steps: 1" in (fresh / ".hydra" / "config.yaml").read_text()
    assert (fresh / ".hydra" / "hydra.yaml").read_text().startswith("hydra:\n")


def test_a_results_file_marked_complete_by_anything_but_true_is_not_counted(tmp_path, capsys):
    """``"complete": "yes"`` (hand-edited) was taken for a complete run."""
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    write_run(tmp_path / "1", "rope", 0, {64: 21.0})
    results = json.loads((tmp_path / "1" / "results.json").read_text())
    (tmp_path / "1" / "results.json").write_text(json.dumps({**results, "complete": "yes"}))
    report_main([str(tmp_path), "--no-figures"])
    out = capsys.readouterr().out
    assert f"`{tmp_path / '1'}`: results.json not marked complete" in out and "| rope |" not in out


@needs_transformers_models
def test_a_checkpoint_meets_a_corpus_changed_since_it_trained_with_one_line(tmp_path, small_text_corpus):
    """A corpus edited after a run trained trains another tokenizer: its token ids mean other text. Resuming the
    run, evaluating or exporting its checkpoint, or starting a second stage from it, is refused in one line. A
    corpus only touched (its files' times) prepares again to the same tokens, and the run resumes; one edited past
    the tokenizer's sample keeps the tokenizer but not the training split, which a resume refuses and an
    evaluation does not."""
    import shutil

    from lenext.export import export

    corpus, run = tmp_path / "corpus", tmp_path / "run"
    shutil.copytree(small_text_corpus, corpus)
    # The tokenizer trains on the first document alone, so an edit past it changes the training split only.
    settings = small_corpus_overrides(corpus, "eval.enabled=false", "data.tokenizer_sample_mb=0.01")
    train_run = lambda steps, *more: run_command(  # noqa: E731
        tmp_path, *settings, f"hydra.run.dir={run}", f"trainer.max_steps={steps}", *more
    )
    evaluate = lambda: forked.run_command(  # noqa: E731
        "eval.py",
        [f"ckpt={run}", "eval.factors=[1]", f"hydra.run.dir={tmp_path / 'eval'}"],
        command_environment(tmp_path),
        tmp_path,
    )
    assert train_run(2).returncode == 0
    for file in corpus.iterdir():
        os.utime(file, ns=(time.time_ns(), time.time_ns()))
    assert train_run(3).returncode == 0, "a touched corpus resumes"

    last = sorted(corpus.glob("*.txt"))[-4]  # a training document past the sample
    last.write_text(last.read_text() + " and one more sentence, spoken at the end.")
    resumed = train_run(4)
    assert resumed.returncode == 1
    assert re.match(
        rf"error: {run}/checkpoints/last.ckpt was trained on other data than data=text_files-\S+ gives "
        r"now \(train_tokens [\d,]+ there, [\d,]+ here\)",
        one_line(resumed),
    ), one_line(resumed)
    assert evaluate().returncode == 0, "the same tokenizer: the checkpoint evaluates on the text as it is now"

    first = sorted(corpus.glob("*.txt"))[0]  # the tokenizer's sample
    first.write_text(first.read_text().replace(" the ", " THE "))
    evaluated = evaluate()
    assert evaluated.returncode == 1
    assert one_line(evaluated).startswith(f"error: ckpt={run}/checkpoints/last.ckpt was trained on other data")
    assert "(its tokenizer differs)" in one_line(evaluated)
    staged = run_command(tmp_path, *settings, f"init_from={run}", f"hydra.run.dir={tmp_path / 'stage'}")
    assert staged.returncode == 1 and "(its tokenizer differs)" in one_line(staged)
    with pytest.raises(CheckpointError, match=r"was trained on other data .*\(its tokenizer differs\)"):
        export(str(run), str(tmp_path / "exported"), cache_dir=os.environ.get("LENEXT_CACHE", str(tmp_path / ".cache")))
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize(
    "written, problem",
    [
        ("variant,length,position,mean_nll,count\n,64,0,3.5,8\n,64,1,3.", "positions.csv is not lenext's"),  # cut
        ("a,b\n1,2\n", "positions.csv is not lenext's"),  # another tool's
        (b"\xff\xfe\x00garbage", "positions.csv cannot be read"),
    ],
)
def test_report_leaves_out_a_per_position_curve_it_cannot_read_and_says_so(tmp_path, capsys, written, problem):
    """A half-written or foreign positions.csv (it sent a traceback after the tables were written): the run's curve
    is left out and listed; its rows stay in the tables, the other runs' curves in the figure data."""
    write_run(tmp_path / "0", "alibi", 0, {64: 20.0})
    write_run(tmp_path / "1", "rope", 0, {64: 21.0})
    path = tmp_path / "1" / "positions.csv"
    path.write_bytes(written) if isinstance(written, bytes) else path.write_text(written)
    report_main([str(tmp_path), "--no-figures"])
    out = capsys.readouterr().out
    assert f"`{tmp_path / '1'}`: {problem}" in out and "its per-position curve left out" in out
    assert "| alibi |" in out and "| rope |" in out
    curves = (tmp_path / "report" / "per_position.csv").read_text()
    assert "alibi" in curves and "rope" not in curves


def test_a_sweep_of_second_stages_from_a_base_already_there_checks_every_job_first(
    tmp_path, small_text_corpus, trained_run
):
    """A sweep whose jobs start from an existing base (init_from): a job that does not fit it (shorter than its
    L_train) is refused before the first job trains (it was found after job 0 had trained, minutes later)."""
    sweep = tmp_path / "sweep"
    overrides = small_corpus_overrides(
        small_text_corpus, "pe=rope", f"init_from={trained_run}", "data.max_len=64,16", f"hydra.sweep.dir={sweep}"
    )
    result = run_command(tmp_path, "-m", *overrides, "trainer.max_steps=1", "eval.enabled=false")
    assert result.returncode == 1
    line = one_line(result)
    assert line.startswith("error: job 1 of the sweep (data.max_len=16): data.max_len=16 is invalid for a second stage")
    assert line.endswith("; no job was started") and not (sweep / "0").exists()


def test_a_refused_second_stage_that_changes_its_pe_leaves_one_line_and_no_folder(
    tmp_path, small_text_corpus, trained_run
):
    """The stage's PE changes (pe.scaling=yarn) are said once the run is accepted: said before a later refusal,
    they went to the run's log, which kept the refused command's folder."""
    run = tmp_path / "stage"
    overrides = small_corpus_overrides(small_text_corpus, "pe=rope", f"init_from={trained_run}", "pe.scaling=yarn")
    result = run_command(
        tmp_path, *overrides, "data.max_len=64", "eval.protocol=last_k", "eval.last_k=1000", f"hydra.run.dir={run}"
    )
    assert result.returncode == 1 and "eval.last_k=1000" in one_line(result)
    assert "second stage:" not in result.stdout + result.stderr and not run.exists()
