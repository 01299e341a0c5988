"""The machine a run trains on: its CPU model and instruction set, the training precision they call for, and how
the C library's malloc should hold memory between training steps.

Precision is a hardware question on CPU. With native bf16 (AMX tiles or AVX512_BF16) oneDNN runs
bf16 matmuls in hardware and autocast is faster than fp32; without it every bf16 operation is
emulated and autocast was ~17x slower than fp32 (AMD EPYC with AVX2 only: 60 vs 1016 tokens/s, 4
layers x 128, L=64, batch 32). Every throughput figure is therefore recorded with the CPU and ISA.
"""

import ctypes
import logging
import os
import platform
import re
from typing import Literal

import torch
from omegaconf import OmegaConf

from lenext.errors import ConfigError

log = logging.getLogger("lenext")

CPUINFO = "/proc/cpuinfo"
# The x86 instruction sets that decide CPU speed here, best first: (name, torch's probe, /proc/cpuinfo flag).
# torch's probes (torch.cpu._is_*_supported) exist in recent versions only; the flags are the fallback.
ISAS = (
    ("AMX", "_is_amx_tile_supported", "amx_bf16"),
    ("AVX512_BF16", "_is_avx512_bf16_supported", "avx512_bf16"),
    ("AVX512", "_is_avx512_supported", "avx512f"),
    ("AVX2", "_is_avx2_supported", "avx2"),
)
NATIVE_BF16_ISAS = ("AMX", "AVX512_BF16")
BF16_EMULATION_SLOWDOWN = 17  # fp32 / bf16-autocast throughput measured on an AVX2-only CPU (see above)

# The precisions lenext trains and evaluates in, under each name Lightning accepts for them: fp32, or bf16 autocast
# with fp32 weights. ``trainer.precision`` and eval.py's ``precision`` take the same names and mean the same.
PRECISION_NAMES = {
    "32-true": "32-true",
    "32": "32-true",
    32: "32-true",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
}
Precision = Literal[tuple(PRECISION_NAMES)]

# glibc's mallopt parameters (malloc.h), and the values keep_freed_memory sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # the ceiling glibc's own adaptive threshold grows to (64-bit)
TRIM_THRESHOLD = 2**30  # free memory the heap's top may hold before glibc gives it back


def _cpuinfo_field(name: str) -> str | None:
    """The first processor's ``name`` field of /proc/cpuinfo; None where there is no such file or field."""
    try:
        with open(CPUINFO) as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(rf"^{name}\s*:\s*(.*)$", text, re.M)
    return match.group(1).strip() if match else None


def _supports(probe: str, flag: str) -> bool:
    torch_probe = getattr(torch.cpu, probe, None)
    if torch_probe is not None:
        return bool(torch_probe())
    return flag in (_cpuinfo_field("flags") or "").split()


def cpu_isa() -> str:
    """The best of AMX, AVX512_BF16, AVX512, AVX2; else torch's own capability string (e.g. DEFAULT on ARM)."""
    for name, probe, flag in ISAS:
        if _supports(probe, flag):
            return name
    return torch.backends.cpu.get_cpu_capability()


def cpu_description() -> dict:
    """The CPU's model, best ISA, whether it computes bf16 natively, and its core count."""
    isa = cpu_isa()
    return {
        "cpu": _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown",
        "isa": isa,
        "native_bf16": isa in NATIVE_BF16_ISAS,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def machine_description() -> dict:
    """``cpu_description`` plus the GPU's name (None without CUDA): what a measured speed depends on."""
    return {**cpu_description(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refuse_mps(accelerator: str) -> None:
    """Apple's MPS lacks float64, in which lenext computes positions, RoPE's angles and its sums: refused before any
    work, where ``accelerator`` (Lightning's ``auto`` on a Mac without CUDA, or ``mps``) would train on it."""
    mps = getattr(torch.backends, "mps", None)
    on_mps = accelerator == "mps" or (
        accelerator == "auto" and not torch.cuda.is_available() and mps is not None and mps.is_available()
    )
    if on_mps:
        raise ConfigError(
            f"trainer.accelerator={accelerator} trains on Apple's MPS here, which lenext does not support (it computes "
            "positions and sums in float64, which MPS lacks): pass trainer=cpu"
        )


def refuse_nodes_without_a_cluster(num_nodes: int) -> None:
    """A ConfigError for ``trainer.num_nodes`` > 1 where no cluster environment Lightning knows says where the other
    nodes are (SLURM, torchrun, LSF, MPI, or NODE_RANK and MASTER_ADDR set by hand): the process would wait for them
    without a word."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    detected = any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment))
    if num_nodes > 1 and not detected and not {"NODE_RANK", "MASTER_ADDR"} <= set(os.environ):
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} needs the other nodes, and this process finds no cluster environment: "
            "launch it through SLURM (hydra/launcher=slurm), torchrun, or with NODE_RANK and MASTER_ADDR set on each "
            "node (else it waits for them forever)"
        )


# The oldest torch lenext's compiled paths (FlexAttention's score_mods, torch.compile's blocks, FSDP2) were checked on:
# 2.11 on GPUs, 2.13 on CPUs. On 2.6 (CPU, 2026-12-01) compiled blocks broke graphs, FoX's score_mod failed under
# vmap and a sharded step failed (Stream.record_event); on 2.4, dynamo failed tracing the attention. Below it, the
# score-bias PEs take their explicit paths (the same numbers), and compile and FSDP are refused.
COMPILED_PATHS_TORCH = "2.11"


def refuse_older_torch(setting: str, minimum: str, why: str) -> None:
    """A ConfigError for ``setting`` on a torch older than ``minimum`` (lenext itself runs on torch >= 2.4)."""
    if torch.__version__ < minimum:  # a TorchVersion: compared as a version ("2.10" after "2.6")
        raise ConfigError(f"{setting} needs torch >= {minimum} ({why}); this environment has torch {torch.__version__}")


def refuse_an_fsdp_that_cannot_run(strategy, world_size: int) -> None:
    """A ConfigError for trainer=fsdp (``trainer.strategy``, Lightning's ModelParallelStrategy) on a torch without
    FSDP2, or with a mesh other than every process in data parallel: Lightning checks the mesh only once every process
    has started, after the corpus is prepared, and lenext applies FSDP alone (no tensor-parallel plan: its ranks
    would train apart)."""
    if not OmegaConf.is_dict(strategy) or not str(strategy.get("_target_")).endswith(".ModelParallelStrategy"):
        return
    refuse_older_torch("trainer.strategy=ModelParallelStrategy (trainer=fsdp)", COMPILED_PATHS_TORCH, "FSDP2")
    tensor = strategy.get("tensor_parallel_size", "auto")
    if tensor != 1:
        raise ConfigError(
            f"trainer.strategy.tensor_parallel_size={tensor} is invalid: it must be 1 (lenext shards every "
            "parameter with FSDP over every process, and has no tensor-parallel plan)"
        )
    data = strategy.get("data_parallel_size", "auto")
    if data != world_size:
        raise ConfigError(
            f"trainer.strategy.data_parallel_size={data} is invalid: it must be {world_size}, trainer.devices x "
            "trainer.num_nodes (every process holds a shard)"
        )


def refuse_more_cpu_processes_than_cores(devices, num_devices: int, device_type: str) -> None:
    """A ConfigError for more CPU devices than the machine has cores: each is a process of its own, and dozens of
    them (``trainer.devices=64`` on 2 cores) took the machine's memory before the first step."""
    cores = os.cpu_count() or 1
    if device_type == "cpu" and num_devices > cores:
        raise ConfigError(
            f"trainer.devices={devices} is invalid on this machine: each CPU device is a training process, and it "
            f"has {cores} cores; give at most {cores} (a GPU machine trains on its GPUs)"
        )


def default_precision(accelerator: str = "auto") -> str:
    """Lightning's ``precision`` that trains fastest here: bf16 autocast on CUDA and on CPUs with native bf16."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "bf16-mixed"
    if accelerator in ("cpu", "auto") and cpu_isa() in NATIVE_BF16_ISAS:
        return "bf16-mixed"
    return "32-true"


def canonical_precision(precision: str | int) -> str:
    """``32-true`` or ``bf16-mixed`` for any name of them in ``PRECISION_NAMES`` (Lightning's own canonical names)."""
    try:
        return PRECISION_NAMES[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISION_NAMES)}") from None


def precision_autocast(device: torch.device, precision: str | int) -> torch.autocast:
    """The autocast context of ``precision`` on ``device``: bf16 for ``bf16-mixed`` and its aliases, off for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=canonical_precision(precision) == "bf16-mixed")


def warn_if_precision_is_slow(precision: str, device: torch.device) -> None:
    """One warning when bf16 was asked for on a CPU that can only emulate it."""
    if device.type != "cpu" or canonical_precision(precision) != "bf16-mixed":
        return
    isa = cpu_isa()
    if isa not in NATIVE_BF16_ISAS:
        log.warning(
            "trainer.precision=%s on a CPU without native bf16 (%s): bf16 is emulated here and autocast runs up to "
            "~%dx slower than fp32 (measured on AVX2); use 32-true",
            precision,
            isa,
            BF16_EMULATION_SLOWDOWN,
        )


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc (whose malloc the functions below tune)."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a training step frees for the next step, instead of giving it back at once;
    whether it now does.

    By default glibc returns the top of its heap to the system once more than twice its mmap threshold is free
    there (64 MiB once that threshold has adapted up to its 32 MiB ceiling), and a training step frees most of what
    its forward allocated: every step then faulted its activations in again, page by page (KERPLE's step, small
    model, L 512, batch 8, fp32, Intel Xeon: 1.40 s instead of 1.04 s; benchmarks/bench-memory). A request of 32 MiB
    or more that the free heap cannot serve is still mapped apart and given back when freed: with mmap off
    altogether the heap fragmented, and a 16k-token forward took 0.8-0.9 GB extra instead of < 0.5 GB. False
    where the C library is not glibc or refuses a setting. Called by ``train.py``, ``eval.py`` and the benchmark
    before any work.
    """
    libc = _glibc()
    # Setting either turns off glibc's adaptive thresholds: the mmap threshold is pinned where they would end.
    return libc is not None and all(
        libc.mallopt(parameter, value) == 1
        for parameter, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    )


def release_freed_memory() -> None:
    """Give the free memory glibc keeps back to the system now: before a block whose peak memory is measured as
    resident memory, so that the peak counts what the block needs, not only what it could not reuse."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
