"""Precision from the hardware: the CPU's ISA decides bf16 vs fp32, and every results file names the machine."""

import json
import logging
import os
import platform
import subprocess
import sys

import pytest
import torch

from lenext import hardware
from lenext.errors import ConfigError
from lenext.run import train
from tests.conftest import small_corpus_overrides

ISA_NAMES = [name for name, _, _ in hardware.ISAS]  # best first


@pytest.fixture
def simulate(monkeypatch):
    """simulate(isa, cuda=False): torch's probes report ``isa`` and every lesser ISA (None: none of them)."""

    def _simulate(isa: str | None, cuda: bool = False):
        supported = set(ISA_NAMES[ISA_NAMES.index(isa) :]) if isa else set()
        for name, probe, _ in hardware.ISAS:
            monkeypatch.setattr(torch.cpu, probe, lambda answer=name in supported: answer, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    return _simulate


@pytest.mark.parametrize(
    "isa,cuda,accelerator,expected",
    [
        ("AMX", False, "auto", "bf16-mixed"),
        ("AVX512_BF16", False, "auto", "bf16-mixed"),
        ("AVX512", False, "auto", "32-true"),
        ("AVX2", False, "auto", "32-true"),
        (None, False, "auto", "32-true"),
        ("AVX2", True, "auto", "bf16-mixed"),  # the GPU trains
        ("AVX2", True, "cpu", "32-true"),  # trainer=cpu on a GPU machine: the CPU decides
        ("AVX512_BF16", True, "cpu", "bf16-mixed"),
        ("AVX2", True, "gpu", "bf16-mixed"),
    ],
)
def test_default_precision_follows_the_hardware(simulate, isa, cuda, accelerator, expected):
    simulate(isa, cuda)
    assert hardware.default_precision(accelerator) == expected


@pytest.mark.parametrize(
    "trainer,isa,cuda,expected",
    [
        ("default", "AVX512_BF16", False, "bf16-mixed"),
        ("default", "AVX2", False, "32-true"),
        ("default", "AVX2", True, "bf16-mixed"),
        ("cpu", "AMX", False, "bf16-mixed"),
        ("cpu", "AVX2", False, "32-true"),
        ("cpu", "AVX2", True, "32-true"),
        ("ddp_sim", "AMX", False, "32-true"),  # fixed: it only checks multi-process code paths
    ],
)
def test_trainer_configs_resolve_precision_from_the_hardware(compose_train, simulate, trainer, isa, cuda, expected):
    simulate(isa, cuda)
    assert compose_train(f"trainer={trainer}").trainer.precision == expected


def test_without_torch_probes_the_isa_comes_from_proc_cpuinfo(monkeypatch, tmp_path):
    for _, probe, _ in hardware.ISAS:
        monkeypatch.delattr(torch.cpu, probe, raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(hardware, "CPUINFO", str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n")
    assert hardware.cpu_description() | {"cores": None, "torch_threads": None} == {
        "cpu": "AMD EPYC 9R14",
        "isa": "AVX512_BF16",
        "native_bf16": True,
        "cores": None,
        "torch_threads": None,
    }
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    assert hardware.cpu_isa() == "AMX" and hardware.default_precision("cpu") == "bf16-mixed"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse avx2\n")
    assert hardware.cpu_isa() == "AVX2" and hardware.default_precision("cpu") == "32-true"
    cpuinfo.unlink()  # no /proc (macOS, Windows): platform's name, torch's capability string, fp32
    description = hardware.cpu_description()
    assert description["cpu"] and description["isa"] == torch.backends.cpu.get_cpu_capability()
    assert not description["native_bf16"] and hardware.default_precision("cpu") == "32-true"


@pytest.mark.parametrize(
    "isa,precision,device,warns",
    [
        ("AVX2", "bf16-mixed", "cpu", True),
        ("AVX512", "bf16", "cpu", True),
        ("AVX2", "32-true", "cpu", False),
        ("AVX512_BF16", "bf16-mixed", "cpu", False),
        ("AMX", "bf16-mixed", "cpu", False),
        ("AVX2", "bf16-mixed", "meta", False),  # not a CPU: the accelerator computes
    ],
)
def test_bf16_on_a_cpu_that_emulates_it_warns_with_the_cost(simulate, caplog, isa, precision, device, warns):
    simulate(isa)
    with caplog.at_level(logging.WARNING, logger="lenext"):
        hardware.warn_if_precision_is_slow(precision, torch.device(device))
    if warns:
        (record,) = caplog.records
        message = record.getMessage()
        assert message.startswith(f"trainer.precision={precision} on a CPU without native bf16 ({isa})")
        assert "17x slower than fp32" in message and message.endswith("use 32-true") and "\n" not in message
    else:
        assert not caplog.records


def test_a_run_warns_about_emulated_bf16_and_its_results_name_the_machine(
    compose_train, small_text_corpus, simulate, caplog, tmp_path
):
    simulate("AVX2")
    cfg = compose_train(
        *small_corpus_overrides(small_text_corpus, "trainer.max_steps=2", "eval.factors=[1]"),
        "trainer.precision=bf16-mixed",
    )
    with caplog.at_level(logging.WARNING, logger="lenext"):
        train(cfg)
    assert [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]
    machine = json.loads((tmp_path / "results.json").read_text())["meta"]["hardware"]
    assert machine["isa"] == "AVX2" and machine["native_bf16"] is False
    assert machine["training_precision"] == "bf16-mixed" and machine["gpu"] is None
    assert machine["cpu"] and machine["cpu"] != "unknown" and machine["cores"] >= 1


STEPS_OF_ACTIVATIONS = """
import resource, torch
from lenext.hardware import keep_freed_memory
torch.set_num_threads(1)  # every tensor in the main thread's heap, the one glibc trims
assert keep_freed_memory()  # glibc accepted both settings


def step():  # what a training step does to the heap: 8 activations of 16 MiB alive at once, then all freed
    activations = [torch.ones(2**22) for _ in range(8)]
    del activations


def resident_bytes():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


for _ in range(3):  # the heap settles: torch's aligned requests are a little larger than the chunks freed
    step()
per_step = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    per_step.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(per_step)[2]  # the median: a step in which the heap grew once more is no step of a settled heap
large = torch.ones(2**26)  # 256 MiB: more than the heap holds free, and above the pinned mmap threshold
held = resident_bytes()
del large
print(faults, held - resident_bytes())
"""


def run_in_plain_glibc(script: str) -> list[str]:
    """stdout of ``script`` in a fresh Python on the system's glibc malloc, with its default settings."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_kept_memory_serves_the_next_step_without_page_faults_and_large_tensors_still_go_back():
    """With keep_freed_memory() glibc accepts both settings and the next step reuses the memory the last one freed:
    no page faults. By default glibc may give that memory back after each step (on the development machine the
    next step then faulted 819 pages in; whether it does depends on what sits above the freed memory in the heap),
    so the default is not asserted. A large tensor that the kept memory cannot hold is still given back."""
    kept, given_back = (float(n) for n in run_in_plain_glibc(STEPS_OF_ACTIVATIONS))
    assert kept < 8, kept  # not even one 16 MiB activation's huge pages
    assert given_back >= 2**28, given_back  # the 256 MiB left the process


EVALUATION_AFTER_TRAINING = """
import torch
from lenext.evaluate import PeakMemory
from lenext.hardware import keep_freed_memory
torch.set_num_threads(1)
assert keep_freed_memory()
activations = [torch.ones(2**22) for _ in range(8)]  # training: 128 MiB, freed and kept by the process
del activations
with PeakMemory(torch.device("cpu")) as memory:
    activations = [torch.ones(2**22) for _ in range(8)]  # evaluation needs as much again
    del activations
print(memory.peak_mb)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_evaluation_peak_memory_counts_what_it_needs_though_training_memory_was_kept():
    (peak_mb,) = run_in_plain_glibc(EVALUATION_AFTER_TRAINING)
    assert float(peak_mb) >= 120, peak_mb  # of the 128 MiB; reusing the kept memory would show ~0


def test_apples_mps_is_refused_before_any_work(compose_train, tmp_path, monkeypatch):
    """On a Mac without CUDA, Lightning's accelerator auto trains on MPS, which has no float64 (lenext's positions,
    angles and sums): one line naming the way out, before any data or folder is touched; trainer=cpu trains."""
    from lenext.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for accelerator in ("auto", "mps"):
        cfg = compose_train("model=tiny", f"trainer.accelerator={accelerator}", "trainer.precision=32-true")
        refused = rf"^trainer.accelerator={accelerator} trains on Apple's MPS here, .* pass trainer=cpu$"
        with pytest.raises(ConfigError, match=refused):
            train(cfg)
    assert os.listdir(tmp_path) == []
    hardware.refuse_mps("cpu")  # the way out: nothing refused


def test_several_nodes_without_a_cluster_environment_are_refused_not_waited_for(monkeypatch):
    """trainer.num_nodes=2 on a machine no cluster launched waited for the other node forever, without a word
    (found by an audit); under SLURM, torchrun or NODE_RANK and MASTER_ADDR set by hand it goes on."""
    from lenext.hardware import refuse_nodes_without_a_cluster

    for name in ("SLURM_NTASKS", "SLURM_JOB_NAME", "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "NODE_RANK", "MASTER_ADDR"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    refuse_nodes_without_a_cluster(1)
    with pytest.raises(ConfigError, match=r"^trainer.num_nodes=2 needs the other nodes, .* no cluster environment"):
        refuse_nodes_without_a_cluster(2)
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    refuse_nodes_without_a_cluster(2)
