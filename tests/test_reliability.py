"""Reliability: killed runs resume exactly, writes are atomic, bad configs fail with lenext's own errors."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.demos.boring_classes import BoringModel

from lenext.errors import LenextError
from lenext.files import atomic_path, write_atomic
from lenext.model import Decoder
from lenext.module import AtomicCheckpointIO, LanguageModel
from lenext.pe import NoPE
from lenext.resolve import TRAIN_NODES, TrainSettings
from lenext.run import build
from lenext.run_folder import preflight
from lenext.scoring import scored_targets
from tests.conftest import CONFIG_FOLDER, small_corpus_overrides

ROOT = Path(__file__).resolve().parents[1]


def _train_command(run_dir, corpus, cache, *extra):
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *small_corpus_overrides(
            corpus,
            "pe=alibi",
            "trainer.max_steps=300",
            "trainer.val_check_interval=300",
            "eval.factors=[1]",
            "callbacks.last_checkpoint.every_n_train_steps=25",
            "trainer.deterministic=true",
            "trainer.precision=32-true",  # exact to 1e-6; bf16 on AMX once resumed 1e-5 off (docs/troubleshooting.md)
            f"paths.cache_dir={cache}",
            f"hydra.run.dir={run_dir}",
            *extra,
        ),
    ]


@pytest.mark.slow  # two trainings, each killed and resumed: 75-110 s a stage on 2 cores
@pytest.mark.parametrize("stage", ["first", "second"])
def test_a_run_killed_or_terminated_resumes_to_the_same_final_loss(small_text_corpus, tmp_path, stage):
    """SIGKILL: the same command resumes from the last periodic checkpoint. SIGTERM (a cluster's pre-emption):
    the run saves where it stopped, says so in one line and exits 143, and the same command resumes it. The same
    for a second stage (init_from), which resumes its own checkpoint, not the base's weights."""
    cache, env = tmp_path / "cache", {**os.environ, "LENEXT_ROOT": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    extra = []
    if stage == "second":
        base = subprocess.run(
            _train_command(tmp_path / "base", small_text_corpus, cache, "trainer.max_steps=20", "eval.enabled=false"),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert base.returncode == 0, base.stderr[-2000:]
        extra = [f"init_from={tmp_path / 'base' / 'checkpoints' / 'last.ckpt'}", "data.max_len=64"]
    straight = subprocess.run(
        _train_command(tmp_path / "straight", small_text_corpus, cache, *extra),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-2000:]

    stopped = {}
    # SIGKILL once a periodic checkpoint exists; SIGTERM once training prints its first step line, with no periodic
    # checkpoint before: its own last.ckpt then comes first (resumed, the run had finished into last-v1.ckpt)
    terminated = ("trainer.enable_progress_bar=false", "callbacks.last_checkpoint.every_n_train_steps=null")
    for name, sent, own in (("killed", signal.SIGKILL, ()), ("terminated", signal.SIGTERM, terminated)):
        run_dir = tmp_path / name
        process = subprocess.Popen(
            _train_command(run_dir, small_text_corpus, cache, *extra, *own),
            env=env,
            stdout=subprocess.PIPE if own else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        last = run_dir / "checkpoints" / "last.ckpt"
        deadline = time.time() + 300
        if own:
            while not process.stdout.readline().startswith("step ") and process.poll() is None:
                assert time.time() < deadline
            assert not last.exists()
        while not own and not last.exists() and process.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        process.send_signal(sent)
        stopped[name] = (process.wait(), process.stderr.read())
        step_at_stop = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
        assert 0 < step_at_stop < 300 and not (run_dir / "results.json").exists()
        if sent == signal.SIGTERM:
            status, stderr = stopped[name]
            errors = [line for line in stderr.splitlines() if line.startswith("error:")]
            assert status == 143 and "Traceback" not in stderr, stderr[-3000:]
            assert errors == [
                f"error: training stopped by SIGTERM at step {step_at_stop} of 300; {last} holds it there: "
                "run the same command to resume"
            ]
        resumed = subprocess.run(
            _train_command(run_dir, small_text_corpus, cache, *extra, *own),
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resuming from" in resumed.stdout + resumed.stderr
        assert sorted(os.listdir(last.parent)) == ["best.ckpt", "last.ckpt"]
        assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 300
    assert stopped["killed"][0] == -signal.SIGKILL
    final = [
        json.loads((tmp_path / d / "results.json").read_text())["rows"][0]["mean_nll"]
        for d in ("straight", "killed", "terminated")
    ]
    assert final[1] == pytest.approx(final[0], abs=1e-6) and final[2] == pytest.approx(final[0], abs=1e-6)


def test_atomic_write_keeps_the_previous_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_atomic(str(path), "old")

    def crash(*args):
        raise KeyboardInterrupt  # killed between writing the temporary file and the rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(path), "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # the temporary file removed


def test_checkpoints_are_never_left_half_written(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, str(target))
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, str(target))
    monkeypatch.undo()
    assert torch.load(target, weights_only=False)["state_dict"]["w"].tolist() == [1.0, 1.0]
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the temporary file removed


def test_a_disk_that_fills_while_training_saves_ends_in_one_line_naming_the_file(
    compose_train, small_text_corpus, tmp_path, monkeypatch, capsys
):
    """A full disk while a checkpoint was written ended in torch's traceback, naming no file."""
    from lenext.cli import one_line_errors
    from lenext.run import train

    save = torch.save

    def fills_at_the_checkpoint(obj, f, *args, **kwargs):
        if ".last.ckpt." in getattr(f, "name", ""):  # the checkpoint's temporary file (lenext.files.atomic_path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fills_at_the_checkpoint)
    overrides = small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.enabled=false")
    with pytest.raises(SystemExit) as exited:
        one_line_errors(train)(compose_train(*overrides))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert exited.value.code == 1 and capsys.readouterr().err.splitlines() == [
        f"error: {last} could not be written (No space left on device); the checkpoints and results written before "
        "it are whole: free space there and run the same command to go on from them"
    ]
    assert os.listdir(last.parent) == []  # the temporary file removed


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_names_the_file_a_write_was_for(tmp_path, monkeypatch, errno_):
    from lenext.errors import NoSpace, ctrl_c_or_full_disk_stops

    target = tmp_path / "results.json"
    monkeypatch.setattr(os, "fsync", lambda _: (_ for _ in ()).throw(OSError(errno_, os.strerror(errno_))))
    with pytest.raises(NoSpace, match=rf"^{re.escape(str(target))} could not be written \({os.strerror(errno_)}\);"):
        with ctrl_c_or_full_disk_stops():
            write_atomic(str(target), "{}")
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError, match="Permission denied"):  # other errors keep their own report
        with ctrl_c_or_full_disk_stops():
            raise OSError(errno.EACCES, "Permission denied")


class _NaNWeightsAt(lightning.Callback):
    """Makes every loss from optimizer step ``step`` on NaN (counted from 1, as the progress lines count)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step:
            with torch.no_grad():
                module.net.embedding.weight.fill_(float("nan"))


class _Items(torch.utils.data.Dataset):
    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def _tiny_fit(callbacks, steps: int = 12, log_every: int = 5, progress_bar: bool = False, **trainer_settings):
    """A tiny model, a trainer of ``steps`` steps and its data module (the same batches at every call)."""
    module = LanguageModel(Decoder(50, 8, NoPE, d_model=16, n_layers=1, n_heads=2), warmup_steps=0)
    trainer = lightning.Trainer(
        max_steps=steps,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, lightning.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        log_every_n_steps=log_every,
        accelerator="cpu",
        num_sanity_val_steps=0,
        **trainer_settings,
    )
    tokens = torch.randint(0, 50, (2 * steps, 9), generator=torch.Generator().manual_seed(0))
    windows = [{"tokens": t} for t in tokens]
    val = [{"tokens": t, "window": torch.tensor([i, 0]), "counted": torch.tensor(True)} for i, t in enumerate(tokens)]
    data = lightning.LightningDataModule.from_datasets(_Items(windows), _Items(val[:4]), batch_size=2)
    return module, trainer, data


def _fit_tiny(callbacks, **settings) -> LanguageModel:
    module, trainer, data = _tiny_fit(callbacks, **settings)
    trainer.fit(module, datamodule=data)
    return module


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_non_finite_loss_stops_with_its_first_step_named_and_no_checkpoint_written_after_it(tmp_path, precision):
    """The loss is tested on the device and read at the loggers' steps and before any checkpoint (a read a step
    would make the host wait for the GPU every step): the error names the first bad step, not the step it was
    read at, and the last checkpoint is the last one before it."""
    with pytest.raises(LenextError, match=r"became nan at step 4; the run stopped and it had written no checkpoint"):
        _fit_tiny([_NaNWeightsAt(4)], precision=precision)  # read at step 5
    every_step = lightning.pytorch.callbacks.ModelCheckpoint(tmp_path, save_last=True, every_n_train_steps=1)
    with pytest.raises(
        LenextError, match=r"became nan at step 4; the run stopped and its last good checkpoint is"
    ) as e:
        _fit_tiny([every_step, _NaNWeightsAt(4)], precision=precision)
    # the precision's advice only where the run was not in fp32 already
    assert str(e.value).endswith(
        "Lower module.lr" + ("" if precision == "32-true" else " or try trainer.precision=32-true")
    )
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3 and all(t.isfinite().all() for t in last["state_dict"].values())
    with pytest.raises(LenextError, match=r"became nan at step 12;"):  # after the last logging step: at the end
        _fit_tiny([_NaNWeightsAt(12)], precision=precision)
    with pytest.raises(LenextError, match=r"became nan at step 4;"):  # no logging: at the end
        _fit_tiny([_NaNWeightsAt(4)], log_every=0, precision=precision)
    _fit_tiny([], precision=precision)  # finite: no error


class _ValidationsEnded(lightning.Callback):
    def __init__(self):
        self.count = 0

    def on_validation_epoch_end(self, trainer, module) -> None:
        self.count += 1


def test_no_validation_runs_on_weights_a_non_finite_loss_updated():
    ended = _ValidationsEnded()
    with pytest.raises(LenextError, match=r"became nan at step 4;"):  # before the validation after step 4
        _fit_tiny([_NaNWeightsAt(4), ended], log_every=50, val_check_interval=4)
    assert ended.count == 0


class _SignalAt(lightning.Callback):
    """SIGTERM as Lightning raises it under DDP, at the end of optimizer step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise lightning.pytorch.utilities.exceptions.SIGTERMException


def test_a_stop_after_a_non_finite_loss_says_so_and_writes_no_checkpoint(tmp_path):
    """The stop's checkpoint finds the bad loss: the run says so (not that it stopped where last.ckpt holds it),
    after Lightning's own cleanup."""
    from lenext.module import CheckpointOnStop
    from lenext.run import fit_and_validate

    class Cleanup(lightning.Callback):  # Lightning's handling of the stop, after the stop's checkpoint
        def on_exception(self, trainer, module, exception) -> None:
            self.seen = exception

    stop, cleanup = CheckpointOnStop(str(tmp_path)), Cleanup()
    module, trainer, data = _tiny_fit([stop, cleanup, _NaNWeightsAt(4), _SignalAt(4)], log_every=50)
    with pytest.raises(LenextError, match=r"became nan at step 4; the run stopped and it had written no checkpoint"):
        fit_and_validate(SimpleNamespace(start="scratch"), trainer, module, data)
    assert os.listdir(tmp_path) == [] and isinstance(cleanup.seen, SystemExit)


def _device_reads_of_a_fit(**fit) -> int:
    """The host's reads of a tensor's value (``.item()``, a tensor's truth: on a GPU each waits for the kernels
    queued before it) during a fit, the data loader's own (CPU tensors) left out."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                files = " ".join(frame.filename for frame in traceback.extract_stack())
                reads.append(not any(loader in files for loader in ("utils/data", "lenext/data/", "combined_loader")))
            return func(*args, **(kwargs or {}))

    with Reads():
        _fit_tiny([], **fit)
    return sum(reads)


def test_a_training_step_reads_no_device_value_unless_a_progress_bar_shows_the_loss():
    """Each step read the loss twice (its finiteness, and Lightning's number for the progress bar, kept where no
    bar shows it): the reads a fit makes do not grow with its steps. A bar shows the loss at every step."""
    assert _device_reads_of_a_fit(steps=12, log_every=50) == _device_reads_of_a_fit(steps=24, log_every=50)
    assert _device_reads_of_a_fit(steps=24, log_every=50, progress_bar=True) >= 24


PES = sorted(p.stem for p in (CONFIG_FOLDER / "pe").glob("*.yaml"))
ROPES = {"rope", "rope_ntk"}
PE_KEYS = {
    "pe.k": {"shaw"},
    "pe.num_buckets": {"t5"},
    "pe.max_distance": {"t5"},
    "pe.scaling": ROPES,
    "pe.factor": ROPES,
    "pe.base": ROPES,
}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pe=st.sampled_from(PES),
    max_len=st.integers(-2, 48),
    d_model=st.sampled_from([0, 8, 12, 16, 24, 36]),
    n_heads=st.integers(0, 5),
    vocab=st.sampled_from([100, 300, 512]),
    lr=st.sampled_from([-1e-3, 0.0, 1e-3, 1.0]),
    pe_extra=st.sampled_from(
        [
            "",
            "pe.k=0",
            "pe.k=3",
            "pe.num_buckets=1",
            "pe.num_buckets=4",
            "pe.max_distance=16",
            "pe.scaling=yarn",
            "pe.scaling=bogus",
            "pe.factor=0.5",
            "pe.base=-1",
        ]
    ),
    factors=st.sampled_from(["[1,2]", "[]", "[0]", "[-1,4]"]),
)
def test_random_configs_either_work_or_fail_with_a_lenext_error(
    compose_train, small_text_corpus, pe, max_len, d_model, n_heads, vocab, lr, pe_extra, factors
):
    overrides = small_corpus_overrides(
        small_text_corpus,
        f"pe={pe}",
        f"data.max_len={max_len}",
        f"model.d_model={d_model}",
        f"model.n_heads={n_heads}",
        f"data.vocab_size={vocab}",
        f"module.lr={lr}",
        f"eval.factors={factors}",
    )
    if pe_extra and pe in PE_KEYS[pe_extra.split("=")[0]]:
        overrides.append(pe_extra)
    try:
        cfg = compose_train(*overrides)
        datamodule, module, _ = build(cfg, preflight(cfg, TrainSettings, TRAIN_NODES))
        tokens = torch.randint(0, datamodule.vocab_size, (2, cfg.data.max_len + 1))
        assert torch.isfinite(scored_targets(module.net, {"tokens": tokens})).all()
        next(iter(datamodule.train_dataloader()))
    except LenextError:
        pass  # the project's own, one-line error: the expected way to fail


def test_checkpoint_problems_are_named(tmp_path):
    from lenext.checkpoints import load_checkpoint
    from lenext.errors import CheckpointError

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "missing.ckpt"))
    good = tmp_path / "good.ckpt"
    torch.save({"hyper_parameters": {"run_config": {"seed": 0}}, "state_dict": {"net.w": torch.ones(1)}}, good)
    assert load_checkpoint(str(good))["hyper_parameters"]["run_config"] == {"seed": 0}
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"truncated \(a run killed .*\) or not a PyTorch checkpoint; use"):
        load_checkpoint(str(truncated))
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, other)
    with pytest.raises(CheckpointError, match="not a lenext checkpoint"):
        load_checkpoint(str(other))
    for weights in ({}, {"state_dict": {}}, {"state_dict": None}):  # a lenext run's settings without its weights
        torch.save({"hyper_parameters": {"run_config": {"seed": 0}}, **weights}, other)
        with pytest.raises(CheckpointError, match=rf"^ckpt='{other}' holds no weights \(no state_dict inside\)"):
            load_checkpoint(str(other))


def test_an_interrupted_write_leaves_no_temporary_file_behind(tmp_path):
    (tmp_path / "plot.png").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        assert tmp.endswith(".png") and os.path.dirname(tmp) == str(tmp_path)  # same folder: the rename is atomic
        raise RuntimeError("the writer failed half-way")
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"] and (tmp_path / "plot.png").read_text() == "old"


@pytest.mark.slow  # a run interrupted and resumed
def test_ctrl_c_stops_training_at_a_step_boundary_and_the_same_command_resumes(small_text_corpus, tmp_path):
    """A first Ctrl-C (SIGINT) takes SIGTERM's path: last.ckpt where training stopped, one line, exit 130."""
    cache, env = tmp_path / "cache", {**os.environ, "LENEXT_ROOT": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    run_dir, last = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    quick = ("callbacks.last_checkpoint.every_n_train_steps=null", "trainer.val_check_interval=1000")
    command = _train_command(run_dir, small_text_corpus, cache, "trainer.max_steps=1000", *quick)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not process.stdout.readline().startswith("step ") and process.poll() is None:
        assert time.time() < deadline
    process.send_signal(signal.SIGINT)
    status, stderr = process.wait(timeout=120), process.stderr.read()
    step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert status == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: training stopped by Ctrl-C (SIGINT) at step {step} of 1000; {last} holds it there: "
        "run the same command to resume"
    ]
    assert 0 < step < 1000 and not (run_dir / "results.json").exists()
    # A shorter budget, so that the test stays short: the run resumes there and finishes.
    command = _train_command(run_dir, small_text_corpus, cache, f"trainer.max_steps={step + 3}", *quick)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step + 3


def test_a_second_ctrl_c_stops_at_once_and_says_what_is_kept(tmp_path):
    from lenext.module import CheckpointOnStop

    stop, trainer = CheckpointOnStop(str(tmp_path)), SimpleNamespace(global_step=7, max_steps=10)
    stop.on_exception(trainer, None, KeyboardInterrupt())
    error = stop.stopped(trainer)
    assert error.exit_status == 130
    assert str(error) == (
        "training stopped at once by Ctrl-C at step 7 of 10, before any checkpoint: run the same command to start again"
    )
    torch.save({}, tmp_path / "last.ckpt")
    assert str(stop.stopped(trainer)) == (
        f"training stopped at once by Ctrl-C at step 7 of 10; {tmp_path / 'last.ckpt'} holds the last "
        "checkpoint written: run the same command to resume"
    )


def test_the_ctrl_c_handler_is_training_s_only_even_when_training_fails():
    """Lightning calls no teardown hook after an exception (a NaN loss): the handler goes back then too, or the next
    run of a sweep would take it for its own previous one."""
    from lenext.module import CheckpointOnStop

    before = signal.getsignal(signal.SIGINT)
    stop = CheckpointOnStop("unused")
    stop.setup(SimpleNamespace(world_size=1), None, "fit")
    assert signal.getsignal(signal.SIGINT) == stop._stop_at_step_boundary
    stop.on_exception(SimpleNamespace(state=SimpleNamespace(fn="fit")), None, RuntimeError("a NaN loss"))
    assert signal.getsignal(signal.SIGINT) == before
    stop.setup(SimpleNamespace(world_size=2), None, "fit")  # DDP: Ctrl-C as Lightning takes it, at once
    assert signal.getsignal(signal.SIGINT) == before


@pytest.mark.parametrize("entry", ["one_line_errors", "errors_in_one_line"])
def test_ctrl_c_outside_training_is_one_line_and_status_130(entry, capsys, monkeypatch):
    """eval.py's sweep, the report, lenext-prepare, lenext-export: Ctrl-C leaves one line, not a traceback."""
    from lenext import cli, errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def work(*_):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        if entry == "one_line_errors":
            cli.one_line_errors(work)(None)
        else:
            with errors.errors_in_one_line():
                work()
    assert stopped.value.code == 130
    assert capsys.readouterr().err == (
        "error: stopped by Ctrl-C (SIGINT); every file written so far is whole: run the same command to go on\n"
    )


@pytest.mark.parametrize(
    "program, full_error, one_line",
    [("lenext-prepare", False, True), ("lenext-prepare", True, False), ("train.py", False, False)],
)
def test_ctrl_c_while_a_command_loads_is_one_line_and_status_130(tmp_path, program, full_error, one_line):
    """Ctrl-C in the seconds a command spends importing torch, Lightning and the rest, before its entry point catches
    anything, leaves one line too, and the exit handlers still run; another program that imports lenext (here a
    train.py outside the repository's root), and HYDRA_FULL_ERROR=1, keep the traceback."""
    script, handled = tmp_path / program, tmp_path / "exit handler ran"
    script.write_text(
        "import atexit, os, pathlib, signal, time\nimport lenext\n"
        f"atexit.register(pathlib.Path({str(handled)!r}).touch)\n"
        "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (
        {"HYDRA_FULL_ERROR": "1"} if full_error else {}
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert handled.exists()
    if one_line:
        assert (done.returncode, done.stderr) == (
            130,
            "error: stopped by Ctrl-C (SIGINT); every file written so far is whole: run the same command to go on\n",
        )
    else:
        assert done.returncode != 0 and "Traceback" in done.stderr and done.stderr.endswith("KeyboardInterrupt\n")


@pytest.mark.parametrize(
    "argv, orig_argv, command",
    [
        (["<root>/train.py"], [], True),
        (["<root>/eval.py", "ckpt=run"], [], True),
        (["<tmp>/train.py"], [], False),  # a user's own script of that name
        (["/venv/bin/lenext-report", "logs"], [], True),
        (["-m"], ["python", "-m", "lenext.report", "logs"], True),
        (["-m"], ["python", "-u", "-mlenext.export", "a", "b"], True),
        (["-m"], ["python", "-m", "lenextra"], False),
        (["-m"], ["python", "-m", "pytest"], False),
        (["/usr/bin/ipython"], [], False),
    ],
)
def test_lenexts_commands_are_told_from_other_programs(argv, orig_argv, command, monkeypatch, tmp_path):
    from lenext.errors import started_as_command

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setattr(sys, "argv", [a.replace("<root>", root).replace("<tmp>", str(tmp_path)) for a in argv])
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert started_as_command() is command


def _default_callbacks(dirpath: Path, every_n_train_steps: int | None = None) -> list:
    """configs/callbacks/default.yaml's checkpoint callbacks and stop handling, writing into ``dirpath``; last.ckpt
    also every ``every_n_train_steps``."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.load(CONFIG_FOLDER / "callbacks" / "default.yaml")
    node.last_checkpoint.every_n_train_steps = every_n_train_steps
    names = ("last_checkpoint", "best_checkpoint", "stop_checkpoint")
    return [instantiate({**OmegaConf.to_container(node[name]), "dirpath": str(dirpath)}) for name in names]


class _Validated(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)["x"]
        self.log("val/loss", 1.0 / (1 + self.global_step) + 0 * loss)  # better at every validation
        return loss


class _Killed(_Validated):
    """Notes the step of each validation, and raises (a SIGKILL's stand-in: nothing saves on it) in the training
    step or the validation at step ``killed_at``."""

    def __init__(self, killed_at: int | None = None, in_validation: bool = True):
        super().__init__()
        self.killed_at, self.in_validation, self.validated = killed_at, in_validation, []

    def training_step(self, batch, batch_idx):
        if not self.in_validation and self.global_step == self.killed_at:
            raise RuntimeError("killed")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.in_validation and self.global_step == self.killed_at:
            raise RuntimeError("killed")
        self.validated.append(self.global_step)  # one batch a validation
        return super().validation_step(batch, batch_idx)


def _fit_checkpointed(folder: Path, model: _Killed, every_n_train_steps: int | None, **fit) -> None:
    """12 steps, validating every 4, with the default checkpoint callbacks into ``folder``."""
    trainer = lightning.Trainer(
        max_steps=12,
        val_check_interval=4,
        limit_val_batches=1,
        num_sanity_val_steps=0,  # as lenext's trainer
        callbacks=_default_callbacks(folder, every_n_train_steps),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    trainer.fit(model, **fit)


# Stand-ins for a SIGKILL (nothing flushed, nothing torn down), at step 13 and in the validation after training.
KILLS = {
    "in training": "from lenext.module import LanguageModel as M\nstart = M.on_train_batch_start\n"
    "M.on_train_batch_start = lambda self, *a: os._exit(9) if self.global_step == 13 else start(self, *a)",
    "in the final validation": "import lightning\nlightning.Trainer.validate = lambda *a, **k: os._exit(9)",
}


@pytest.mark.slow  # three runs of 20 steps a case
@pytest.mark.parametrize("where", KILLS)
def test_metrics_csv_of_a_killed_and_resumed_run_holds_the_uninterrupted_runs_rows(small_text_corpus, tmp_path, where):
    """A resumed run cut metrics.csv at the first step it logged, not at its checkpoint's: killed in its final
    validation, which the resumed run logged at step 19 (Lightning's count after a restore), a run lost step 19's
    training rows, and its last validation was a step early (the report's adaptation curve too)."""
    env = {**os.environ, "LENEXT_ROOT": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    command = small_corpus_overrides(
        small_text_corpus,
        "eval.factors=[1]",
        "trainer.precision=32-true",
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        "trainer.log_every_n_steps=1",
        "callbacks.last_checkpoint.every_n_train_steps=6",
        f"paths.cache_dir={tmp_path / 'cache'}",
    )

    def run(folder: str, kill: str = "") -> int:
        argv = ["train.py", *command, f"hydra.run.dir={tmp_path / folder}"]
        script = f"import os, runpy, sys\n{kill}\nsys.argv = {argv!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')"
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
        return done.returncode

    assert run("straight") == 0 and run("killed", KILLS[where]) == 9 and run("killed") == 0
    import pandas as pd

    straight, resumed = (pd.read_csv(tmp_path / folder / "csv" / "metrics.csv") for folder in ("straight", "killed"))
    assert len(straight) == len(resumed) == 2 * 20 + 3  # a loss and a learning rate a step, 3 validations
    pd.testing.assert_frame_equal(resumed.drop(columns="epoch"), straight.drop(columns="epoch"))
    # Resumed after training, the final validation is logged in epoch 0 (Lightning's count), not 1
    last = -1 if where == "in the final validation" else len(straight)
    pd.testing.assert_series_equal(resumed.epoch[:last], straight.epoch[:last])


# Between two validations (every 2 steps), and after one, in fp32; in bf16 too (slow: three short runs a case)
@pytest.mark.parametrize(
    "stop_at, precision",
    [
        (3, "32-true"),
        pytest.param(4, "32-true", marks=pytest.mark.slow),
        pytest.param(3, "bf16-mixed", marks=pytest.mark.slow),
    ],
)
def test_a_resumed_run_draws_the_dropout_masks_an_uninterrupted_one_draws(
    compose_train, small_text_corpus, stop_at, precision
):
    """A checkpoint kept no random state, so a resumed run with dropout drew other masks than an uninterrupted one
    and ended elsewhere. Both draw what the uninterrupted run draws after the checkpoint: its validation's loader
    included."""
    from lenext.run import train

    dropout = (
        "model.dropout=0.1",
        "eval.enabled=false",
        f"trainer.precision={precision}",
        "trainer.val_check_interval=2",
    )
    overrides = small_corpus_overrides(small_text_corpus, *dropout)
    last = Path(compose_train(*overrides).paths.output_dir) / "checkpoints" / "last.ckpt"
    finals = []
    for budgets in ([6], [stop_at, 6]):
        for checkpoint in last.parent.glob("*.ckpt"):
            checkpoint.unlink()
        for steps in budgets:
            train(compose_train(*overrides, f"trainer.max_steps={steps}"))
        finals.append(torch.load(last, weights_only=False)["state_dict"])
    assert finals[0].keys() == finals[1].keys()
    for name in finals[0]:
        torch.testing.assert_close(finals[1][name], finals[0][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("every_n_train_steps", [None, 2])
def test_a_run_killed_in_a_validation_resumes_from_before_it_and_validates_there(tmp_path, every_n_train_steps):
    """last.ckpt is written after each validation (Lightning writes none there beside no other checkpoint: a SIGKILL
    started the run over), and at a step that validates, after the validation: resumed from step 8's periodic
    checkpoint written before its validation, the run skipped that validation (its metrics, a best.ckpt)."""
    straight, killed, resumed = _Killed(), _Killed(killed_at=8), _Killed()
    _fit_checkpointed(tmp_path / "straight", straight, every_n_train_steps)
    with pytest.raises(RuntimeError, match="killed"):
        _fit_checkpointed(tmp_path / "killed", killed, every_n_train_steps)
    last = tmp_path / "killed" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == (4 if every_n_train_steps is None else 6)
    _fit_checkpointed(tmp_path / "killed", resumed, every_n_train_steps, ckpt_path=str(last))
    assert straight.validated == [4, 8, 12] and killed.validated + resumed.validated == [4, 8, 12]


@pytest.mark.parametrize("every_n_train_steps", [None, 5])
def test_last_checkpoint_holds_where_training_ended(tmp_path, every_n_train_steps):
    """Once a periodic last.ckpt was written, Lightning wrote none where training ended: it held step 10 of 12, and
    eval.py, a second stage or a longer run read step 10's weights beside step 12's results."""
    _fit_checkpointed(tmp_path, _Killed(), every_n_train_steps)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 12


def test_best_checkpoint_is_replaced_in_place(tmp_path):
    """A best.ckpt already there (a run resumed from before its last validation, which validates again) is replaced,
    not joined by best-v1.ckpt while best.ckpt kept the older weights (eval.py read the wrong model)."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "best.ckpt").write_bytes(b"an earlier attempt's")
    trainer = lightning.Trainer(
        max_steps=7,
        val_check_interval=3,
        limit_val_batches=1,
        callbacks=_default_callbacks(checkpoints),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Validated())
    assert sorted(os.listdir(checkpoints)) == ["best.ckpt", "last.ckpt"]
    assert torch.load(checkpoints / "best.ckpt", weights_only=False)["global_step"] == 6


def test_a_stop_during_gradient_accumulation_waits_for_the_optimizer_step(tmp_path):
    """SIGTERM (or Ctrl-C) between the micro-batches of one optimizer step: Lightning stopped after the micro-batch,
    and the resumed run's accumulation was out of step with its data (another trajectory). The stop now waits
    for the step's last micro-batch."""
    checkpoints = tmp_path / "checkpoints"

    class Terminate(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 4:  # the first micro-batch of step 3
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # Lightning's handler, as a SIGTERM calls it

    trainer = lightning.Trainer(
        max_steps=10,
        accumulate_grad_batches=2,
        val_check_interval=60,
        limit_val_batches=1,
        callbacks=[Terminate(), *_default_callbacks(checkpoints)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(SystemExit):
        trainer.fit(_Validated())
    stopped = torch.load(checkpoints / "last.ckpt", weights_only=False)
    micro_batches = stopped["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]
    assert stopped["global_step"] == 3 and micro_batches == 6


def test_a_refused_run_closes_its_own_log_file_and_no_other_handler(compose_train, tmp_path, monkeypatch):
    """A run refused in Hydra's RUN mode closes its log file in its folder (an empty one goes with the folder) and
    leaves the process's other logging handlers open: logging.shutdown() closed them all, a test runner's too."""
    import logging

    import lenext.cli as cli
    from lenext.errors import ConfigError

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere.log"
    run_dir.mkdir()
    cfg = compose_train()
    hydra = SimpleNamespace(mode=cli.RunMode.RUN, runtime=SimpleNamespace(output_dir=str(run_dir)))
    monkeypatch.setattr(cli, "hydra_config", lambda: hydra)
    runs_log, others = logging.FileHandler(run_dir / "train.log"), logging.FileHandler(elsewhere)
    root = logging.getLogger()
    for handler in (runs_log, others):
        root.addHandler(handler)
    try:

        def refused(cfg):
            raise ConfigError("model.d_model=-1 is invalid")

        with pytest.raises(SystemExit):
            cli.one_line_errors(refused)(cfg)
        assert runs_log not in root.handlers and runs_log.stream is None  # closed
        assert others in root.handlers and not others.stream.closed
        logging.getLogger("lenext").warning("after a refused run")
        others.flush()
        assert "after a refused run" in elsewhere.read_text()
    finally:
        for handler in (runs_log, others):
            root.removeHandler(handler)
            handler.close()
