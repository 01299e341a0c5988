"""scripts/bench.py measures the models runs train, its Lightning section compares like with like, and its report
names the machine."""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from lenext import hardware
from lenext.positions import training_positions
from lenext.run import build
from lenext.run_folder import resolve_training
from tests.conftest import ROOT, needs_compiled_paths_torch, needs_transformers_models


def load_script(name: str):
    """scripts/<name>.py as a module of its own (a new one per call: a test may change its globals)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench")


@pytest.fixture
def gpu_check():
    return load_script("gpu_check")


@pytest.mark.parametrize(
    "row", ["rope_ntk", "rope+randomized", "rope+pose", "alibi", "t5", "learned", "nope+ssmax", "nope+stick_breaking"]
)
def test_a_rows_model_is_the_one_its_training_run_trains(bench, compose_train, row):
    """The run is train.py's: its config with the row's overrides, built by lenext.run.build after reading the corpus.
    Same seed: same parameters, positions drawn and outputs."""
    cfg = compose_train(*bench.row_overrides(row))
    spec, weights = resolve_training(cfg)
    trained = build(cfg, spec, weights)[1].net.eval()
    net, bench_spec = bench.row_model(row)
    net.eval()
    assert {k: v.shape for k, v in net.state_dict().items()} == {k: v.shape for k, v in trained.state_dict().items()}
    torch.testing.assert_close(net.state_dict(), trained.state_dict(), rtol=0, atol=0)
    positions = training_positions(bench_spec.scheme, 2, 64, bench_spec.seed, 0, 0, 0)
    torch.testing.assert_close(positions, training_positions(spec.scheme, 2, 64, spec.seed, 0, 0, 0))
    tokens = torch.randint(0, net.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        nll = net.token_nll(tokens[:, :-1], tokens[:, 1:], positions)
        torch.testing.assert_close(nll, trained.token_nll(tokens[:, :-1], tokens[:, 1:], positions), rtol=0, atol=0)


def test_the_bare_loop_trains_exactly_as_the_lightning_trainer(bench, tmp_path):
    """Same batches, parameter groups, schedule and clipping: after 3 steps both made the same updates (up to
    the order in which the gradient norm sums the parameters), so the ratio times the same work.

    Updates are compared, not weights: Adam's steps are ~1e-5 here, below the weights' own tolerance.
    """
    steps = 3
    cfg = bench.study_config(str(tmp_path), "32-true", steps)
    loader = bench.study_loader(cfg, steps)
    module = bench.study_module(cfg)
    bare = bench.study_net(cfg).train()
    assert len(bench.lightning_steps(cfg, module, loader)) == len(bench.bare_steps(cfg, bare, loader)) == steps
    trained, initial = dict(module.net.named_parameters()), dict(bench.study_net(cfg).named_parameters())
    for name, parameter in bare.named_parameters():
        update = parameter - initial[name]
        assert update.abs().max() > 1e-6, f"{name} did not train"
        torch.testing.assert_close(update, trained[name] - initial[name], rtol=1e-3, atol=1e-8, msg=name)


def test_the_lightning_section_reports_both_ratios_with_the_cpu_and_isa(bench, tmp_path, caplog, monkeypatch):
    # The section's flow at the tiny model's size: bf16 is emulated on AVX2-only CPUs (3.4 s a step at the study's).
    study = [o for o in bench.STUDY_OVERRIDES if not o.startswith(("model=", "data.batch_size="))]
    monkeypatch.setattr(bench, "STUDY_OVERRIDES", [*study, "model=tiny", "data.batch_size=4"])
    monkeypatch.setattr(bench, "STUDY_TOKENS_PER_STEP", bench.STUDY_LEN * 4)
    out = tmp_path / "bench.md"
    with caplog.at_level(logging.ERROR):
        bench.main(["--sections", "lightning", "--quick", "--lightning-steps", "2", "--out", str(out)])
    text = out.read_text()
    cpu = hardware.cpu_description()
    assert f"- CPU: {cpu['cpu']}, ISA {cpu['isa']} (native bf16: {'yes' if cpu['native_bf16'] else 'no'};" in text
    chosen = hardware.default_precision("cpu")
    assert f"- Lightning / bare at {chosen} (this machine's default precision): **" in text
    other = "32-true" if chosen == "bf16-mixed" else "bf16-mixed"
    assert f"- bare loop, {other} / {chosen} step time: **" in text
    assert f"- second stage / its base, both under Lightning at {chosen}: **" in text
    assert "| lightning, second stage |" in text
    assert "## Training throughput" not in text and "## Shaw attention" not in text  # only the section asked for
    for name in ("machine", "lightning"):  # docs/performance.md includes sections by these names
        assert text.count(f"<!-- --8<-- [start:{name}] -->") == text.count(f"<!-- --8<-- [end:{name}] -->") == 1


def test_section_markers_wrap_each_sections_body_and_nothing_else(bench):
    text = "# lenext benchmark\n\n- CPU: x\n\n## Training throughput\n\n| a |\n\n## Something new\n\ntext\n"
    assert bench.with_section_markers(text) == (
        "# lenext benchmark\n<!-- --8<-- [start:machine] -->\n\n- CPU: x\n\n<!-- --8<-- [end:machine] -->\n\n"
        "## Training throughput\n<!-- --8<-- [start:training] -->\n\n| a |\n\n<!-- --8<-- [end:training] -->\n\n"
        "## Something new\n\ntext\n"
    )


def test_the_shaw_section_runs_and_agrees_with_the_naive_formula(bench):
    """The section ``make bench`` runs (its call into causal_attention once fell behind the interface)."""
    result = bench.bench_shaw("fp32", length=48, reps=1, log=lambda line: None, heads=2, head_dim=8, clip=4)
    assert result["max_out_err"] < 1e-5 and result["max_grad_err"] < 1e-4, result


def test_a_run_without_sections_asked_measures_every_section(bench):
    """`make bench` passes no --sections: the default must be every section the report has markers for."""
    assert bench.SECTIONS == [name for name in bench.SECTION_MARKERS.values() if name != "machine"]


def test_rows_asked_keep_nope_for_the_training_ratios_and_an_unknown_row_is_refused(bench, capsys):
    assert bench.training_rows(["nope+ssmax", "cope"]) == ["cope", "nope", "nope+ssmax"]
    assert bench.forward_rows(["nope+ssmax", "cope"]) == ["cope", "nope+ssmax"]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rows", "cope,copy"])
    assert exit_info.value.code == 2
    assert "--rows: copy not a row; rows are " in capsys.readouterr().err


@needs_compiled_paths_torch
def test_the_gpu_check_runs_its_sections_on_a_cpu(gpu_check, tmp_path, monkeypatch):
    """scripts/gpu_check.py on the CPU (its smoke test): an exactness row asked with ``@compile`` is checked as its PE,
    the training table lists the rows (one without fla's kernels), and FSDP on one rank equals DDP after two steps
    (the GPU time it is run on is scarce: a script error found there costs a lent machine). A model of 2 layers
    trains: the code run is the same, and bf16, emulated on AVX2-only CPUs, takes minutes with the small model."""
    exact, trained = tmp_path / "reports" / "exact.md", tmp_path / "trained.md"  # a folder not made yet: made
    monkeypatch.setattr(gpu_check, "TRAIN_SHAPE", dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4))
    gpu_check.main(
        ["--device", "cpu", "--quick", "--sections", "exactness", "--rows", "fox@compile", "--out", str(exact)]
    )
    assert "| fox | L 16, L 40, L 40, drawn" in exact.read_text() and "**no**" not in exact.read_text()
    assert "cpu fp32, no grad" in exact.read_text()  # evaluation's paths, NLL only
    gpu_check.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--sections",
            "training,fsdp",
            "--rows",
            "nope,t5,fox@nokernels",
            "--profile",
            "--out",
            str(trained),
        ]
    )
    report = trained.read_text()
    assert "| t5 |" in report and "| xt:t5 |" in report and "| fox@nokernels |" in report
    measured = json.loads(trained.with_suffix(".json").read_text())
    fsdp = measured["fsdp"]
    assert fsdp["loss"]["ddp"] == fsdp["loss"]["fsdp"] and fsdp["worst_parameter_error"] < 1e-6
    # --profile: every arm's step under the profiler, its busy time within the profiled step, beside the timed step
    # (its tokens/s's), its top operators named
    profiles = report.split("## Where a step's time goes")[1]
    for arm in ("nope", "t5", "fox@nokernels", "xt:t5", "fsdp section: ddp", "fsdp section: fsdp"):
        line = next(line for line in profiles.splitlines() if line.startswith(f"| {arm} |"))
        busy, timed, profiled = (float(n) for n in re.findall(r"([\d.]+) ms", line)[:3])
        assert 0 < busy <= profiled * 1.01 and "`aten::" in line
        kind = arm.removeprefix("fsdp section: ")
        section = fsdp if kind != arm else measured["training"]
        tokens_per_s = fsdp["tokens_per_s"][kind] if kind != arm else section[arm]["tokens_per_s"]
        assert timed == pytest.approx(1000 * section["batch"] * section["length"] / tokens_per_s, abs=0.01)
    with pytest.raises(SystemExit, match="fox@nofal: @nofal is not a row suffix"):
        gpu_check.main(["--device", "cpu", "--quick", "--rows", "fox@nofal", "--out", str(trained)])
    with pytest.raises(SystemExit, match=r"--rows rope\+sb@compile: rope\+sb is not a row; rows are alibi, cope, "):
        gpu_check.main(["--device", "cpu", "--quick", "--rows", "rope+sb@compile", "--out", str(trained)])
    with pytest.raises(SystemExit, match="--sections exprt is not a section; they are exactness, training"):
        gpu_check.main(["--device", "cpu", "--quick", "--sections", "training,exprt", "--out", str(trained)])


CRASHES_ALIBI = """
import os
import signal

import lenext.pe.bias as bias


def crash(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGSEGV)


bias.ALiBi.__init__ = crash
"""


@pytest.mark.slow  # three processes, each loading torch: 1-2 min on 2 cores
def test_a_row_that_crashes_the_gpu_check_is_left_out_and_the_check_goes_on(tmp_path, monkeypatch):
    """A segfault in one row's compile had cost the H100's call every later row (2026-11-27). Supervised, the check
    starts again without the row it was on, each time it crashes (here ALiBi, built in both sections: first of the
    exactness rows, before anything was saved), and the sections finished before keep their numbers; the report
    names what was left out and why, and nothing of an earlier report at --out passes for this check's."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CRASHES_ALIBI)  # every child process crashes at ALiBi
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}{os.pathsep}{ROOT / 'src'}")
    out = tmp_path / "check.md"
    out.with_suffix(".json").write_text(json.dumps({"exact": {"nope": {"L 16": {"stale": True}}}}))
    check = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick", "--relaunch"]
    sections = ["--sections", "exactness,training", "--rows", "alibi,nope,t5", "--out", str(out)]
    done = subprocess.run(check + sections, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("alibi killed the process (SIGSEGV)") == 2
    report, measured = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    assert "- left out: `alibi` in exactness, which killed the process (SIGSEGV)" in report
    assert "- left out: `alibi` in training, which killed the process (SIGSEGV)" in report
    assert list(measured["exact"]) == ["alibi", "nope", "t5"]
    assert measured["exact"]["alibi"] == {"skipped": "killed the process (SIGSEGV)"}
    assert all(set(measured["exact"][row]) == {"L 16", "L 40", "L 40, drawn"} for row in ("nope", "t5"))
    assert "stale" not in json.dumps(measured["exact"])
    assert len(re.findall(r"exact nope +L 16 ", done.stdout)) == 1  # kept when training started again
    assert {"nope", "t5", "xt:t5"} <= set(measured["training"]) and "alibi" not in measured["training"]
    assert measured["training"]["skipped"]["alibi"] == "killed the process (SIGSEGV)"
    assert not out.with_suffix(".progress").exists()
    assert f"--rows alibi,nope,t5 --out {out}`" in report  # the command as given, without the child's state


def test_the_gpu_checks_profile_counts_the_devices_kernels_alone(gpu_check):
    """On CUDA a profile's time is its kernels': the CPU's operators and the ranges a ``record_function`` marks on
    the device too (DDP's forward, the optimizer's step: they span kernels already counted) are left out, the rest
    ordered by their own time; on the CPU, its operators, the ranges left out too."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, device_type, device_us, annotation=False):
        return SimpleNamespace(
            key=key,
            device_type=device_type,
            self_device_time_total=device_us,
            self_cpu_time_total=10.0,
            is_user_annotation=annotation,
        )

    averages = [
        event("gemm", cuda, 300.0),
        event("DistributedDataParallel.forward", cuda, 900.0, annotation=True),
        event("aten::mm", cpu, 0.0),
        event("softmax", cuda, 500.0),
    ]
    assert [e.key for e in gpu_check.device_kernels(averages, cuda=True)] == ["softmax", "gemm"]
    assert len(gpu_check.device_kernels(averages, cuda=False)) == 3  # the CPU's: every operator
    assert gpu_check.self_time(averages[0], cuda=True) == pytest.approx(3e-4)


def test_the_gpu_checks_lightning_section_trains_the_preset_asked(gpu_check, tmp_path):
    """``--model``: the Lightning section trains that preset (here the tiny one, on the CPU) beside the bare loop and
    reports Lightning's own tokens/s; ``--profile``: each arm's steps profiled, with the host's reads of device
    values a step."""
    out = tmp_path / "lightning.md"
    args = ["--device", "cpu", "--quick", "--sections", "lightning", "--model", "tiny", "--vocab", "64", "--profile"]
    gpu_check.main([*args, "--out", str(out)])
    report, result = out.read_text(), json.loads(out.with_suffix(".json").read_text())["lightning"]
    assert "RoPE, the model tiny, L 64, batch 2" in report and result["model"] == "tiny" and not result["compiled"]
    assert f"- Lightning's training: {result['tokens_per_s']:,.0f} tokens/s" in report
    assert result["tokens_per_s"] == pytest.approx(2 * 64 / (result["ms_lightning"] / 1000))
    # the net trained is the preset's at vocabulary 64, as the training rows build a preset's (row_config)
    tiny = gpu_check.build("rope", 64, {"vocab_size": 64}, "tiny")
    assert result["parameters"] == sum(p.numel() for p in tiny.parameters())
    profiles = report.split("## Where a step's time goes")[1]
    for arm in ("lightning", "bare"):
        line = next(line for line in profiles.splitlines() if line.startswith(f"| lightning section: {arm} |"))
        busy, timed, profiled = (float(n) for n in re.findall(r"([\d.]+) ms", line)[:3])
        assert 0 < busy <= profiled * 1.01 and timed == pytest.approx(result[f"ms_{arm}"], abs=0.01)
    # lenext's module reads no device value a step beyond what both arms read (on a CPU, torch's fused AdamW reads
    # its learning rate and step count): it read the loss's finiteness and Lightning the progress bar's loss. The
    # profiled steps hold no logging step (every 10th), where the loss is read by design.
    reads = {arm: result["profile"][arm]["host_reads"] for arm in ("lightning", "bare")}
    assert reads["lightning"] == reads["bare"] > 0, reads


def test_a_profile_counts_the_hosts_reads_and_on_cuda_its_waits_for_the_gpu(gpu_check):
    """A read of a device value shows as ``aten::_local_scalar_dense``; on CUDA every wait for the GPU as a stream
    synchronization, which a copy to the host (``.tolist()``) makes without that operator (FIRE's thresholds)."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    averages = [
        SimpleNamespace(key="aten::_local_scalar_dense", count=4, device_type=cpu, self_cpu_time_total=1.0),
        SimpleNamespace(key="cudaStreamSynchronize", count=6, device_type=cpu, self_cpu_time_total=1.0),
        SimpleNamespace(key="gemm", count=2, device_type=cuda, self_device_time_total=3e3, self_cpu_time_total=0.0),
    ]
    on_cuda = gpu_check.profiled_steps(averages, "cuda", 2, 0.1, 0.1)
    assert (on_cuda["host_reads"], on_cuda["host_waits"], on_cuda["busy_s"]) == (2, 3, 1.5e-3)
    assert gpu_check.profiled_steps(averages, "cpu", 2, 0.1, 0.1)["host_waits"] is None
    row = gpu_check.render_profiles({"rope": on_cuda | {"top": []}})[-2]
    assert row.split(" | ")[4] == "2 (3)", row


def test_a_gpu_check_cut_off_keeps_the_exactness_rows_it_finished(gpu_check, tmp_path, monkeypatch):
    """The report is written after each exactness row: a run its time limit kills (or a row that takes the device
    down) keeps the rows before it."""
    out, build = tmp_path / "exact.md", gpu_check.exact_net

    def exact_net(row, *args):
        if row == "alibi":
            raise KeyboardInterrupt  # as a kill would stop the run
        return build(row, *args)

    monkeypatch.setattr(gpu_check, "exact_net", exact_net)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(
            ["--device", "cpu", "--quick", "--sections", "exactness", "--rows", "nope,alibi", "--out", str(out)]
        )
    report = out.read_text()
    assert "| nope | L 16, L 40, L 40, drawn |" in report and "| alibi |" not in report


@needs_transformers_models
def test_the_gpu_checks_export_section_loads_each_export_and_computes_lenexts_numbers(gpu_check, tmp_path, monkeypatch):
    """Each architecture lenext-export writes, loaded by transformers (here on the CPU): fp32 logits and embedding
    gradients within 1e-4 / 1e-3 of float64, and under bf16 autocast no worse than twice lenext's own."""
    # Each architecture at width 64 and 2 layers: bf16 is emulated on AVX2-only CPUs (2.4 s a backward at model=small).
    smaller = {
        case: [*overrides, "model.d_model=64", "model.n_layers=2"] for case, overrides in gpu_check.EXPORT_CASES.items()
    }
    monkeypatch.setattr(gpu_check, "EXPORT_CASES", smaller)
    out = tmp_path / "export.md"
    gpu_check.main(["--device", "cpu", "--quick", "--sections", "export", "--out", str(out)])
    export = json.loads(out.with_suffix(".json").read_text())["export"]
    assert list(export) == ["llama", "gpt_neox", "gpt2", "remote"]
    for case in export.values():
        worst = gpu_check.worst_errors(case)
        assert worst["cpu fp32"]["nll"] < 1e-4 and worst["cpu fp32"]["grad"] < 1e-3
        assert all(gpu_check.export_passes(arm, worst) for arm in worst)
    assert "**no**" not in out.read_text()


def test_a_gpu_check_row_asked_with_ckpt_recomputes_each_block_and_trains_the_same(gpu_check, monkeypatch):
    """``<row>@ckpt`` (CoPE's and DAPE's saved scores outgrow a GPU at 125M): the same loss and parameters after a
    step, each block run twice (forward, then again in the backward)."""
    monkeypatch.setattr(gpu_check, "TRAIN_SHAPE", dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4))
    runs = {}
    for row in ("cope", "cope@ckpt"):
        torch.manual_seed(0)
        arm = gpu_check.Arm(row, 24, 2, "cpu")
        calls = []
        arm.net.blocks[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        runs[row] = arm.step(), len(calls), [p.detach().clone() for p in arm.net.parameters()]
    (loss, calls, after), (ckpt_loss, ckpt_calls, ckpt_after) = runs["cope"], runs["cope@ckpt"]
    assert (calls, ckpt_calls) == (1, 2) and loss == ckpt_loss
    for plain, recomputed in zip(after, ckpt_after, strict=True):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-6)


def test_the_gpu_checks_default_rows_put_each_row_without_its_kernel_beside_it(gpu_check, monkeypatch):
    """With the kernels at hand (fla's, lenext's CoPE kernel) the default rows time each row a kernel serves and,
    next to it (before a budget can end the section), the same row without; without them, no such rows."""
    monkeypatch.setattr(gpu_check.fla_kernels, "kernels", lambda: None)
    monkeypatch.setattr(gpu_check.attention_module, "contextual_kernel", lambda: None)
    assert not any(row.endswith("@nokernels") for row in gpu_check.all_rows())
    monkeypatch.setattr(gpu_check.fla_kernels, "kernels", lambda: object())
    monkeypatch.setattr(gpu_check.attention_module, "contextual_kernel", lambda: object())
    rows = gpu_check.all_rows()
    for row in gpu_check.KERNEL_ROWS:
        assert rows[rows.index(row) + 1] == f"{row}@nokernels"


@pytest.mark.parametrize("row", ["nope", "rope", "xpos", "alibi", "t5"])
def test_the_peer_trains_a_model_of_lenexts_shape(bench, row):
    """x-transformers' model in the ``peer`` section has lenext's widths (its default head width, 64, once made its
    attention twice as wide): the same parameter count but for a few norm and bias vectors."""
    ours, _ = bench.row_model(row)
    theirs = bench.xtransformers_net(row, bench.TRAIN_LEN)
    count = lambda net: sum(p.numel() for p in net.parameters())  # noqa: E731
    assert abs(count(theirs) - count(ours)) < 1e-3 * count(ours), (count(theirs), count(ours))
    widths = {m.out_features for name, m in theirs.named_modules() if name.endswith("to_q")}
    assert widths == {bench.small_shape()["d_model"]}
    if row in ("rope", "xpos"):  # the whole head rotated, as lenext's (x-transformers' default: half)
        head = bench.small_shape()["d_model"] // bench.small_shape()["n_heads"]
        assert 2 * theirs.attn_layers.rotary_pos_emb.inv_freq.numel() == head


def test_the_peer_section_reports_each_pe_with_its_ratio_and_mfu(bench):
    peer = bench.bench_peer("fp32", batch=1, warmup=1, steps=1, reps=2, log=lambda line: None, rows=["nope"])
    settings = {"model": bench.small_shape(), "train_length": bench.TRAIN_LEN, "train_batch": 1}
    settings |= {"reps": 2, "steps": 1, "warmup": 1}
    (row,) = [line for line in bench.render_peer(settings, peer) if line.startswith("| nope |")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert float(cells[3]) == pytest.approx(peer["nope"]["ratio"], abs=0.005) and peer["nope"]["ratio"] > 0
    nope = peer["nope"]
    assert nope["ratio_min"] <= nope["ratio"] <= nope["ratio_max"]
    # one FLOP count for both arms: their MFUs stand as their speeds do
    assert nope["mfu"] / nope["peer_mfu"] == pytest.approx(nope["tokens_per_s"] / nope["peer_tokens_per_s"])
    assert 0 < nope["peer_mfu"] < 1.5  # against the machine's measured GEMM peak


def test_the_adamw_section_times_two_optimizers_taking_the_same_steps(bench, monkeypatch):
    """Section 7 compares lenext's fused AdamW with torch's default on one model from the same weights: both arms
    take the same steps (their weights agree after them), and the report states the paired ratio and each
    optimizer's own time."""
    arms = []
    monkeypatch.setattr(bench, "interleaved_rates", lambda arms_, *args: arms.append(arms_) or real(arms_, *args))
    real = load_script("bench").interleaved_rates
    result = bench.bench_adamw("fp32", batch=1, warmup=1, steps=1, reps=2, log=lambda line: None)
    fused, default = (arms[0][name] for name in ("lenext", "default"))
    assert len(fused.optimizer_s) == len(default.optimizer_s) == 3
    for ours, theirs in zip(fused.net.parameters(), default.net.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"]
    settings = {"train_length": bench.TRAIN_LEN, "train_batch": 1, "reps": 2, "steps": 1, "warmup": 1}
    text = "\n".join(bench.render_adamw(settings, result))
    assert f"**{result['ratio']:.3f}**" in text
    assert f"| {result['default']['optimizer_ms']:.1f} |" in text


def test_the_gpu_checks_sections_share_the_time_left_so_what_one_leaves_goes_to_the_next(
    gpu_check, monkeypatch, tmp_path
):
    """A section that ends early leaves its unspent share to the sections after it: GPU time is scarce."""
    given, now = {}, [0.0]
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: now[0])

    def section(name, result, seconds):
        def run(*args, **kwargs):
            given[name] = kwargs.get("budget")
            now[0] += seconds
            return result

        return run

    monkeypatch.setattr(gpu_check, "bench_exactness", section("exactness", {}, 20))
    monkeypatch.setattr(gpu_check, "bench_training", section("training", {"skipped": {}}, 100))
    monkeypatch.setattr(gpu_check, "bench_fsdp", section("fsdp", {}, 0))
    monkeypatch.setattr(gpu_check, "render", lambda *args, **kwargs: "")
    argv = ["--device", "cpu", "--sections", "exactness,training,fsdp", "--budget", "200", "--out", str(tmp_path / "c")]
    gpu_check.main(argv)
    share = gpu_check.SECTIONS
    assert given["exactness"] == pytest.approx(
        200 * share["exactness"] / (share["exactness"] + share["training"] + share["fsdp"])
    )
    assert given["training"] == pytest.approx(180 * share["training"] / (share["training"] + share["fsdp"]))
