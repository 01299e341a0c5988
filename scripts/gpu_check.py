"""The GPU check (docs/performance.md, "The GPU check"): what lenext's CUDA paths compute and how fast they train.

Run on a machine with a CUDA GPU: ``make gpu-check`` (it installs what the machine's CUDA torch lacks from
``.gpu-wheels/``, made here by ``make gpu-wheels``). Sections, each written to the report as soon as it ends
(exactness after each row), so a run cut off keeps what it measured; exactness and training take no new row once
their share of ``--budget`` is spent, and say which rows they did not reach (training still times at least two
repetitions; the Lightning section's size is fixed). Each section's share is of the time left when it starts: what
a section leaves unspent goes to the sections after it. ``--profile``: each training, Lightning and FSDP arm's steps
again under torch.profiler (the device's busy time, the host's reads of device values, the top kernels). On CUDA
the check runs in a child process, started again without any row that crashes it (``supervise``).

1. exactness: every PE config (and the attention settings' rows), a 2-layer model at L_train 64, its per-token NLL
   and every parameter's gradient on CUDA against float64 on the CPU: fp32 (TF32 off) on the automatic path,
   fp32 with FlexAttention switched off (the SDPA-mask and explicit-block paths), and bf16 autocast; the CPU's
   fp32 path beside them. At L 64 and 512, positions 0..L-1, and at 512 positions drawn from [0, 1536); the rows a
   Triton kernel serves also with one head of 64 at L 100.
2. training: the small model (the largest preset: 6 x 256, 8 heads, vocab 8192), L 1024, batch 16, bf16
   autocast, one AdamW step per iteration; every row warmed up (FlexAttention compiles there) and run once more
   untimed, then interleaved round-robin (median of repetitions): tokens/s,
   ratio to NoPE, model FLOPs utilisation (``bench.training_flops_per_token`` against this GPU's measured bf16
   GEMM peak), peak memory.
3. lightning: lenext's LightningModule under lightning.Trainer against a bare loop doing the same training
   (``bench.bare_steps`` on the GPU), RoPE, the small model at L 512, batch 16, arms interleaved (with ``--model``:
   that preset at ``--length`` and ``--batch``; ``--lightning-compile``: both arms' blocks compiled); Lightning's
   tokens/s and MFU.
4. x-transformers: the same shape built by x-transformers, interleaved with lenext's rows, nope, rope, alibi, t5.
5. fsdp (asked by name): FSDP2 as trainer=fsdp shards against DDP, one rank, NoPE at the training shape
   (``--model``, ``--length``, ``--batch``): two steps' parameters compared, tokens/s interleaved, peak memory.
6. export (asked by name): a model as ``lenext-export`` writes it (transformers' Llama, GPT-NeoX and GPT-2, and
   lenext's own code for ALiBi), loaded by transformers on the device, run in fp32 and under bf16 autocast (lenext's
   net beside it): its logits and the gradient of its loss for the token embeddings against lenext's in float64 on
   the CPU, at L 64 and 512 (GPT-2 at 64, its table's length).

    PYTHONPATH=src python scripts/gpu_check.py --out benchmarks/gpu-check-<date>.md
    .venv/bin/python scripts/gpu_check.py --device cpu --quick   # smoke test of the script itself
"""

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the CPU benchmark's rows, model sizes and FLOP count)
import lenext.attention as attention_module  # noqa: E402
import lenext.attention.fla_kernels as fla_kernels  # noqa: E402
from lenext.attention.flex import allow_recompiles, fresh_compile_state  # noqa: E402
from lenext.build import build_decoder, build_net  # noqa: E402
from lenext.cli import CONFIG_PACKAGE  # noqa: E402
from lenext.errors import LengthNotSupported  # noqa: E402
from lenext.export.native import NATIVE  # noqa: E402
from lenext.export.remote import write_remote  # noqa: E402
from lenext.files import write_atomic  # noqa: E402
from lenext.model import Decoder  # noqa: E402
from lenext.module import adamw  # noqa: E402
from lenext.positions import generator, randomized_positions  # noqa: E402
from lenext.run_folder import resolve_training  # noqa: E402

# The PEs added since the last check first (benchmarks/gpu-check.md, 2026-11-23), then the rest.
FIRST = ["dape", "pope", "path", "path_fox", "cope", "fox", "fox_rope", "p_rope", "rope_nope", "rnope_swa"]
VARIANTS = {  # rows beside the PE configs: "<row>": (pe config, overrides)
    "rope_yarn": ["pe.scaling=yarn", "pe.factor=4"],
    "kerple_power": ["pe.kernel=power"],
    **bench.SETTING_ROWS,
    "rope+stick_breaking": ["attention.normalizer=stick_breaking"],  # fla's kernel after RoPE's rotation
}
EXACT_SHAPE = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4)
EXACT_TRAIN_LEN = 64
# The rows a Triton kernel serves: also one head of 64 (the 125M preset's head dim) at a length no tile divides.
KERNEL_CASE = (100, dict(EXACT_SHAPE, n_heads=1))
# Worst error allowed against float64: per-token NLL (absolute) and a gradient relative to its tensor's largest.
TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (0.1, 0.1)}
TRAIN_SHAPE = bench.small_shape()
XT_ROWS = ["nope", "rope", "alibi", "t5"]
# The GPU check's target: Lightning within 5% of a bare loop (the CPU benchmark allows 10%, bench.LIGHTNING_TARGET).
LIGHTNING_TARGET = 1.05


# The rows Triton kernels serve in bf16 on CUDA, fla's (lenext.attention.fla_kernels) and lenext's CoPE kernel
# (lenext.attention.contextual): with the kernel at hand, each is also checked and timed without it.
FLA_ROWS = ["fox", "fox_rope", "path", "path_fox", "nope+stick_breaking", "rope+stick_breaking"]
KERNEL_ROWS = [*FLA_ROWS, "cope"]


# The sections, in the order they run, each with its share of the --budget left when it starts (lightning, fsdp and
# export have fixed sizes: their shares hold time back for them).
SECTIONS = {"exactness": 0.4, "training": 0.45, "lightning": 0.15, "fsdp": 0.15, "export": 0.05}
# A check run under ``supervise``: the file naming the section and row it is on, so that a crash can be pinned on
# its row; and the exit status of a check whose device a row broke (a CUDA error fails every later call too).
PROGRESS: Path | None = None
DEVICE_LOST = 75


def result_key(section: str) -> str:
    """The key of a section's results in the report's JSON."""
    return {"exactness": "exact"}.get(section, section)


@contextlib.contextmanager
def at(section: str, row: str | None = None):
    """Work on ``row`` of ``section`` (None: the section's own, which has no rows), named in the progress file while
    it runs so that ``supervise`` can leave out what crashes; the file is removed when the work ends, and kept when
    it raises (``main`` ends a check whose device is lost, naming the row)."""
    if PROGRESS is not None:
        write_atomic(PROGRESS, json.dumps([section, row]))
    yield
    if PROGRESS is not None:
        PROGRESS.unlink(missing_ok=True)


def device_lost(device: str) -> bool:
    """Whether a supervised check's CUDA context is broken (an illegal memory access): every later call would fail."""
    if PROGRESS is None or device != "cuda":
        return False
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return True
    return False


class DeviceLost(Exception):
    """A row failed and the CUDA context with it (``device_lost``)."""


ROW_SUFFIXES = {"compile", "nokernels", "ckpt"}  # <row>@compile, <row>@nokernels, <row>@ckpt (training rows; Arm)


def all_rows() -> list[str]:
    """Every PE config and variant, the newest first; each row a Triton kernel serves here followed by itself
    without it (``@nokernels``)."""
    rows = bench.PE_NAMES + list(VARIANTS)
    ordered = [r for r in FIRST if r in rows] + [r for r in rows if r not in FIRST]
    return [r for row in ordered for r in ([row, f"{row}@nokernels"] if kernel_at_hand(row) else [row])]


def kernel_at_hand(row: str) -> bool:
    """Whether a Triton kernel serves the row here (fla's with fla installed; lenext's CoPE kernel with Triton)."""
    if row in FLA_ROWS:
        return fla_kernels.kernels() is not None
    return row in KERNEL_ROWS and attention_module.contextual_kernel() is not None


def pe_of(row: str) -> str:
    """The row without its training suffixes (``@compile``, ``@nokernels``, ``@ckpt``)."""
    return row.partition("@")[0]


def row_config(row: str, model: str | None = None):
    """train.py's composed config for a row: ``<pe>`` or a variant (``rope_yarn``, ``nope+ssmax``), with the
    ``model`` preset if named."""
    pe = {"rope_yarn": "rope", "kerple_power": "kerple"}.get(row, row.partition("+")[0])
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        return compose("train", overrides=[f"pe={pe}", *VARIANTS.get(row, []), *([f"model={model}"] if model else [])])


def build(row: str, train_len: int, shape: dict, model: str | None = None) -> Decoder:
    """The row's model at ``shape`` (a vocabulary and model settings; of a ``model`` preset, its vocabulary alone),
    built as a run builds it."""
    cfg = row_config(row, model)
    cfg.model.merge_with({key: value for key, value in shape.items() if key != "vocab_size"})
    config = OmegaConf.to_container(OmegaConf.masked_copy(cfg, ["model", "pe", "attention"]), resolve=True)
    torch.manual_seed(bench.SEED)
    return build_decoder(config, train_len, train_len, shape["vocab_size"])


@contextlib.contextmanager
def flex_off():
    """The attention paths a GPU without FlexAttention takes: SDPA masks and explicit query blocks."""
    saved = attention_module.flex_attention
    attention_module.flex_attention = None
    try:
        yield
    finally:
        attention_module.flex_attention = saved


# --------------------------------------------------------------------------------------------
# 1. Exactness


def exact_net(row: str, shape: dict = EXACT_SHAPE) -> Decoder:
    """The row's 2-layer model, every PE parameter (its layers' too: CoPE's embeddings start at 0) at std 0.5 (as
    tests/test_pe.py: a wrong position shows)."""
    net = build(row, EXACT_TRAIN_LEN, shape)
    with torch.no_grad():
        for param in net.pe_parameters():
            param.normal_(std=0.5)
    net.pe.project_()
    return net.train()


def nll_and_grads(net, tokens, targets, positions, device, dtype, bf16=False, compiled=False):
    """Per-token NLL and every parameter's gradient of its mean, in float64 on the CPU; ``compiled``: every block
    compiled, as module.compile=true."""
    net = copy.deepcopy(net).to(device=device, dtype=dtype)
    if compiled:
        net.compile_blocks()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        nll = net.token_nll(tokens.to(device), targets.to(device), None if positions is None else positions.to(device))
    nll.mean().backward()
    grads = {n: p.grad.double().cpu() for n, p in net.named_parameters() if p.grad is not None}
    return nll.detach().double().cpu(), grads


def nll_without_grad(net, tokens, targets, positions, device) -> tuple:
    """Per-token NLL in fp32 under no_grad (evaluation's paths: FIRE past its threshold, FoX's score_mod), no
    gradients."""
    net = copy.deepcopy(net).to(device=device, dtype=torch.float32)
    with torch.no_grad():
        nll = net.token_nll(tokens.to(device), targets.to(device), None if positions is None else positions.to(device))
    return nll.double().cpu(), None


def errors(arm, ref) -> dict:
    """The largest NLL error, and the largest gradient error relative to its tensor's largest entry, that floored
    at 1e-4 of the model's largest gradient: a gradient that is zero in exact arithmetic (the bias DAPE adds to
    every logit, which softmax ignores) is rounding noise in any precision."""
    nll, grads = arm
    ref_nll, ref_grads = ref
    if grads is None:  # an arm without a backward
        return {"nll": (nll - ref_nll).abs().max().item(), "grad": None, "grad_param": None}
    floor = 1e-4 * max(g.abs().max().item() for g in ref_grads.values())
    worst_name, worst = None, 0.0
    for name, g in ref_grads.items():
        if name not in grads:
            return {"nll": float("nan"), "grad": float("nan"), "grad_param": f"{name}: no gradient"}
        rel = ((grads[name] - g).abs().max() / max(g.abs().max().item(), floor)).item()
        if not rel <= worst:  # NaN counts as worst
            worst_name, worst = name, rel
    return {"nll": (nll - ref_nll).abs().max().item(), "grad": worst, "grad_param": worst_name}


def exactness_case(net, length, drawn, device, kernel_row=False, compiled=False):
    tokens = torch.randint(0, EXACT_SHAPE["vocab_size"], (2, length + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = tokens[:, :-1], tokens[:, 1:]
    positions = randomized_positions(2, length, 3 * length, generator(0, length)) if drawn else None
    ref = nll_and_grads(net, tokens, targets, positions, "cpu", torch.float64)
    arms = {
        "cpu fp32": lambda: nll_and_grads(net, tokens, targets, positions, "cpu", torch.float32),
        "cpu fp32, no grad": lambda: nll_without_grad(net, tokens, targets, positions, "cpu"),
    }
    if device == "cuda":
        arms["cuda fp32"] = lambda: nll_and_grads(net, tokens, targets, positions, device, torch.float32)
        arms["cuda fp32, flex off"] = lambda: _flex_off(nll_and_grads, net, tokens, targets, positions, device)
        arms["cuda bf16"] = lambda: nll_and_grads(net, tokens, targets, positions, device, torch.float32, bf16=True)
        if compiled and length > EXACT_TRAIN_LEN and not drawn:  # asked with @compile: its numbers too (one case)
            arms["cuda fp32, compiled"] = lambda: nll_and_grads(
                net, tokens, targets, positions, device, torch.float32, compiled=True
            )
        if kernel_row:  # the arm above ran a Triton kernel; lenext's paths without it:
            arms["cuda bf16, kernels off"] = lambda: _kernels_off(
                nll_and_grads, net, tokens, targets, positions, device
            )
        arms["cuda fp32, no grad"] = lambda: nll_without_grad(net, tokens, targets, positions, device)
    return {name: errors(arm(), ref) for name, arm in arms.items()}


@contextlib.contextmanager
def kernels_off():
    """The paths without Triton kernels (FoX's key bias on SDPA or FlexAttention, PaTH's logits in chunks,
    stick-breaking's and CoPE's explicit blocks)."""
    saved = fla_kernels.kernels, attention_module.contextual_kernel
    fla_kernels.kernels = attention_module.contextual_kernel = lambda: None
    try:
        yield
    finally:
        fla_kernels.kernels, attention_module.contextual_kernel = saved


def _kernels_off(fn, *args):
    with kernels_off():
        return fn(*args, torch.float32, bf16=True)


def _flex_off(fn, *args):
    with flex_off():
        return fn(*args, torch.float32)


def passes(arm: str, err: dict) -> bool:
    nll_tol, grad_tol = TOLERANCE["bf16" if "bf16" in arm else "fp32"]
    return err["nll"] <= nll_tol and (err["grad"] is None or err["grad"] <= grad_tol)


def bench_exactness(rows, lengths, device, budget, log, compiled=(), measured=lambda results: None):
    """``measured``: called with the results after each row, so that a run cut off keeps the rows it finished."""
    start, results = time.perf_counter(), {}
    cases = [(lengths[0], False)] + [(length, drawn) for length in lengths[1:] for drawn in (False, True)]
    for row in rows:
        if time.perf_counter() - start > budget:
            results[row] = {"skipped": "time budget"}
            continue
        with at("exactness", row):
            exactness_row(row, results, cases, device, log, compiled)
        measured(results)
    measured(results)  # the rows the budget did not reach, named
    return results


def exactness_row(row: str, results: dict, cases, device, log, compiled) -> None:
    fresh_compile_state()
    results[row], net, kernel = {}, exact_net(row), kernel_at_hand(row)
    runs = [(f"L {length}" + (", drawn" if drawn else ""), net, length, drawn) for length, drawn in cases]
    if kernel:  # a Triton kernel's row: also a wider head at a length no tile divides
        length, shape = KERNEL_CASE
        head_dim = shape["d_model"] // shape["n_heads"]
        runs.append((f"L {length}, head dim {head_dim}", exact_net(row, shape), length, False))
    for case, case_net, length, drawn in runs:
        t0 = time.perf_counter()
        try:
            results[row][case] = exactness_case(case_net, length, drawn, device, kernel, row in compiled)
        except LengthNotSupported as e:
            results[row][case] = {"refused": str(e).splitlines()[0]}
        except Exception as e:  # noqa: BLE001  (the report names it; the other rows still run)
            results[row][case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            log(traceback.format_exc())
            if device_lost(device):
                raise DeviceLost from e
        log(f"  exact {row:<22} {case:<15} {time.perf_counter() - t0:5.1f} s  {summarise(results[row][case])}")


def summarise(case: dict) -> str:
    if "refused" in case or "error" in case:
        return next(iter(case.values()))
    return ", ".join(f"{arm}: nll {e['nll']:.1e} grad {grad_cell([e['grad']])}" for arm, e in case.items())


def grad_cell(grads: list) -> str:
    """The worst relative gradient error (NaN counts as worst); '-' for an arm without a backward."""
    if any(g is None for g in grads):
        return "-"
    return f"{max(grads, key=lambda g: g if g == g else float('inf')):.1e}"


# --------------------------------------------------------------------------------------------
# 2. Training speed (and 4., x-transformers, in the same rotation)


def gpu_gemm_peak(device: str, size: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of a (size x size) product on the device, the best of ``reps``: what MFU is measured against."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Arm:
    """One training row: a model, its optimizer and one step on a fixed batch. ``<row>@compile``: each block
    compiled, as ``module.compile=true`` does; ``<row>@nokernels``: without Triton kernels (fla's for FoX, PaTH and
    stick-breaking; lenext's for CoPE);
    ``<row>@ckpt``: each block's activations recomputed in the backward, as ``module.activation_checkpointing=true``
    (suffixes combine: ``cope@compile@ckpt``)."""

    def __init__(self, row: str, length: int, batch: int, device: str, model: str | None = None, vocab: int = 0):
        xt = row.startswith("xt:")
        shape = {"vocab_size": vocab} if model else TRAIN_SHAPE
        self.kernels = kernels_off if "nokernels" in row.split("@") else contextlib.nullcontext
        pe_row = pe_of(row)
        self.net = (
            bench.xtransformers_net(row[3:], length, TRAIN_SHAPE) if xt else build(pe_row, length, shape, model)
        ).to(device)
        self.net.train()
        if "compile" in row.split("@"):
            self.net.compile_blocks()
        if "ckpt" in row.split("@"):
            self.net.checkpoint_blocks = True
        self.optimizer = adamw(self.net.parameters(), lr=1e-4)
        tokens = torch.randint(0, shape["vocab_size"], (batch, length + 1), generator=torch.Generator().manual_seed(0))
        self.tokens, self.targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.xt, self.device = xt, device
        self.flops = None if xt else bench.training_flops_per_token(self.net, length)

    def step(self) -> float:
        with self.kernels(), torch.autocast(self.device, dtype=torch.bfloat16):
            if self.xt:
                logits = self.net(self.tokens)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())
            else:
                loss = self.net.token_nll(self.tokens, self.targets).mean()
        loss.backward()
        self.optimizer.step()
        if not self.xt:
            self.net.pe.project_()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def warm_up(row, arms, results, length, batch, device, warmup, log, model, vocab) -> None:
    """Build ``row``'s arm and run its first steps (its compiles) into ``arms``; a failure into ``results``."""
    try:
        if device == "cuda":  # the row's own peak: the earlier rows' models and optimizers stay allocated
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        arm = Arm(row, length, batch, device, model, vocab)
        for _ in range(warmup):
            loss = arm.step()
        sync(device)
        arm.warmup_s = time.perf_counter() - t0  # the compiles (flex's kernel, @compile's blocks) and first steps
        arm.peak = torch.cuda.max_memory_allocated() - before if device == "cuda" else float("nan")
        arms[row] = arm
        log(f"  warmup {row:<22} {time.perf_counter() - t0:6.1f} s, loss {float(loss):.3f}")
    except Exception as e:  # noqa: BLE001
        results["skipped"][row] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        log(traceback.format_exc())
        if device_lost(device):
            raise DeviceLost from e


def tokens_per_second(arm, steps: int, tokens_per_step: int, device: str) -> float:
    """``steps`` of ``arm`` timed, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        arm.step()
    sync(device)
    return steps * tokens_per_step / (time.perf_counter() - t0)


def device_kernels(averages, cuda: bool) -> list:
    """The profiler's averages (``key_averages()``) that are the device's kernels (on the CPU: its operators), most
    time first: a range a ``record_function`` marks (DDP's forward, the optimizer's step, a profiled step), on the
    device too, is not a kernel, and its own time on the CPU is the Python between operators."""
    averages = [e for e in averages if not getattr(e, "is_user_annotation", False)]
    if cuda:
        averages = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(averages, key=lambda e: self_time(e, cuda), reverse=True)


def self_time(event, cuda: bool) -> float:
    """A profiler average's own time in seconds, over the steps profiled: on the device, or on the CPU."""
    return (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6


def step_profile(arm, device: str, tokens_per_step: int, tokens_per_s: float, steps: int = 3) -> dict:
    """Where ``steps`` of ``arm`` spend their time (torch.profiler), as ``profiled_steps`` says, against the step
    timed without the profiler (``tokens_per_step / tokens_per_s``)."""
    from torch.profiler import profile

    with profile(activities=profiled_activities(device)) as prof:
        profiled_tokens_per_s = tokens_per_second(arm, steps, tokens_per_step, device)
    step_s, timed_step_s = tokens_per_step / profiled_tokens_per_s, tokens_per_step / tokens_per_s
    return profiled_steps(prof.key_averages(), device, steps, step_s, timed_step_s)


def profiled_activities(device: str) -> list:
    """What torch.profiler records on ``device``: the CPU's operators, and on CUDA the GPU's kernels."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def profiled_steps(averages, device: str, steps: int, step_s: float, timed_step_s: float, top: int = 8) -> dict:
    """A profile of ``steps`` steps: the kernels' time a step, summed over them (and over streams: where kernels
    overlap, more than the time the device was busy), against the step timed without the profiler
    (``timed_step_s``): the rest of it the GPU waited for the CPU to launch work at least; the reads of a device
    value by the host a step (``aten::_local_scalar_dense``: ``.item()``, a tensor's truth; on a GPU each waits for
    every kernel queued before it) and on CUDA its waits for the GPU a step (``cudaStreamSynchronize``, which a copy
    to the host such as ``.tolist()`` makes too, and not a read of a CPU tensor); the ``top`` kernels (on the CPU:
    operators) by their own time, and the profiled step's wall time (``step_s``)."""
    cuda = device == "cuda"
    kernels = device_kernels(averages, cuda)
    return {
        "step_s": step_s,
        "timed_step_s": timed_step_s,
        "busy_s": sum(self_time(e, cuda) for e in kernels) / steps,  # the kernels' summed time a step
        "host_reads": sum(e.count for e in averages if e.key == "aten::_local_scalar_dense") / steps,
        "host_waits": sum(e.count for e in averages if e.key == "cudaStreamSynchronize") / steps if cuda else None,
        "top": [(e.key, self_time(e, cuda) / steps, e.count // steps) for e in kernels[:top]],
    }


# A fit's steps under the profiler: the trace of every step of a 125M fit took minutes to read (2026-11-30).
PROFILED_FIT_STEPS = 3


def fit_profile(fit, device: str, steps: int, timed_step_s: float) -> dict:
    """``profiled_steps`` of ``PROFILED_FIT_STEPS`` steps of a fresh fit of ``steps`` + 1 steps (``fit(on_step)``,
    calling ``on_step`` after each step), after its first step (the optimizer's state made); each profiled step
    waits for the GPU at its end, so the profile holds its kernels alone, and is timed to there (the profiler's
    reading of its trace, after the last, left out)."""
    from torch.profiler import profile, schedule

    active = min(steps, PROFILED_FIT_STEPS)
    averages, ends = [], []  # the active steps' averages (the profiler clears them as its cycle ends)

    def on_step() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        prof.step()

    with profile(
        activities=profiled_activities(device),
        schedule=schedule(wait=0, warmup=1, active=active, repeat=1),
        on_trace_ready=lambda prof: averages.append(prof.key_averages()),
    ) as prof:
        fit(on_step)
    return profiled_steps(averages[0], device, active, bench.mean_step_seconds(ends[: active + 1]), timed_step_s)


def bench_training(rows, length, batch, device, warmup, steps, reps, budget, log, model=None, vocab=0, profile=False):
    start, arms, results = time.perf_counter(), {}, {"skipped": {}}
    # One compile state for the section: every row's flex kernel stays compiled for the timed repetitions.
    fresh_compile_state()
    allow_recompiles(4 * len(rows))
    for row in rows:  # warm up (FlexAttention compiles here) while the budget's first two thirds last
        if time.perf_counter() - start > budget * 2 / 3:
            results["skipped"][row] = "time budget"
            continue
        with at("training", row):
            warm_up(row, arms, results, length, batch, device, warmup, log, model, vocab)
    names = list(arms)
    for name in names:  # untimed: whatever a later row's compile evicted or re-guarded is compiled again here
        with at("training", name):
            arms[name].step()
    rates = {name: [] for name in names}
    for rep in range(reps if names else 0):
        if rep > 1 and time.perf_counter() - start > budget:
            break
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            with at("training", name):
                rates[name].append(tokens_per_second(arms[name], steps, batch * length, device))
        log(f"  rep {rep + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f}" for n in names))
    peak = gpu_gemm_peak(device) if device == "cuda" else float("nan")
    nope = arms.get("nope")
    results.update(gemm_peak=peak, length=length, batch=batch, steps=steps, reps=len(rates[names[0]]) if names else 0)
    results["model"] = (
        f"{model or 'small'} ({sum(p.numel() for p in nope.net.parameters()):,} parameters, vocab "
        f"{vocab or TRAIN_SHAPE['vocab_size']})"
        if nope
        else model or "small"
    )
    for name in names:
        paired = [r / n for r, n in zip(rates[name], rates.get("nope", []), strict=False)]  # none: NoPE failed
        tokens_per_s = statistics.median(rates[name])
        flops = arms[name].flops
        results[name] = {
            "tokens_per_s": tokens_per_s,
            "ratio": statistics.median(paired) if paired else None,
            "range": (min(paired), max(paired)) if paired else None,
            "mfu": tokens_per_s * flops / peak if flops else None,
            "peak_bytes": arms[name].peak,
            "warmup_s": arms[name].warmup_s,
            "warmup_steps": warmup,
        }
        if profile:
            with at("training", name):
                results[name]["profile"] = step_profile(arms[name], device, batch * length, tokens_per_s)
    return results


# --------------------------------------------------------------------------------------------
# 3. Lightning against a bare loop


def lightning_config(output_dir: str, steps: int, length: int, batch: int, model=None, vocab=0, compiled=False):
    overrides = [
        "pe=rope",
        f"model={model or 'small'}",
        f"data.vocab_size={vocab if model else TRAIN_SHAPE['vocab_size']}",
        f"module.compile={str(compiled).lower()}",
        f"data.max_len={length}",
        f"data.batch_size={batch}",
        f"paths.output_dir={output_dir}",
        f"paths.root_dir={output_dir}",
        "trainer.precision=bf16-mixed",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress",  # a line (and a read of the loss) every tenth of the steps: every third step here
    ]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        return compose("train", overrides=overrides)


def bench_lightning(length, batch, steps, reps, device, log, model=None, vocab=0, compiled=False, profile=False):
    """lenext's training under Lightning against the bare loop, RoPE at ``model`` (the small preset if None), each
    arm's blocks compiled with ``compiled`` (``module.compile=true``); Lightning's tokens/s and MFU besides
    (``profile``: and a fit of each arm again under the profiler)."""
    arms, profiles = {"lightning": [], "bare": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = lightning_config(tmp, steps + 1, length, batch, model, vocab, compiled)
        net = bench.study_net(cfg)
        flops, parameters = bench.training_flops_per_token(net, length), sum(p.numel() for p in net.parameters())

        def fit(arm, on_step=None) -> list[float]:
            torch.manual_seed(bench.SEED)
            loader = bench.study_loader(cfg, steps + 1)
            if arm == "lightning":
                return bench.lightning_steps(cfg, bench.study_module(cfg), loader, on_step=on_step)
            net = bench.study_net(cfg).to(device)
            if compiled:  # as the module's configure_model does
                net.compile_blocks()
            return bench.bare_steps(cfg, net, loader, device=device, on_step=on_step)

        for rep in range(reps):
            for arm in arms if rep % 2 == 0 else dict(reversed(arms.items())):
                ends = fit(arm)
                arms[arm].append(bench.mean_step_seconds(ends))
                log(f"  {arm:<10} rep {rep + 1}: {1000 * arms[arm][-1]:.2f} ms/step")
        if profile:
            for arm, times in arms.items():
                profiles[arm] = fit_profile(partial(fit, arm), device, steps, statistics.median(times))
    tokens_per_s = batch * length / statistics.median(arms["lightning"])
    return {
        "ms_lightning": 1000 * statistics.median(arms["lightning"]),
        "ms_bare": 1000 * statistics.median(arms["bare"]),
        "model": model or "small",
        "parameters": parameters,
        "compiled": compiled,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops / gpu_gemm_peak(device) if device == "cuda" else None,
        "length": length,
        "batch": batch,
        "steps": steps,
        "reps": reps,
        **({"profile": profiles} if profile else {}),
    }


# --------------------------------------------------------------------------------------------
# 5. FSDP against DDP on one device


class MeanNLL(torch.nn.Module):
    """A net's mean next-token loss as a module's forward (what DDP wraps)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, tokens, targets):
        return self.net.token_nll(tokens, targets).mean()


class ShardedArm:
    """One training step of ``net`` wrapped as ``kind``: "ddp" (DistributedDataParallel) or "fsdp" (FSDP2 as
    trainer=fsdp shards it, ``lenext.module.shard``), on a process group of one rank, bf16 autocast, AdamW."""

    def __init__(self, kind: str, net, tokens, device: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel

        from lenext.module import shard

        self.net, self.kind, self.device = copy.deepcopy(net).to(device).train(), kind, device
        if kind == "ddp":  # its gradient sync hangs on its forward: the loss, through a module that computes it
            self.loss_of = DistributedDataParallel(MeanNLL(self.net), device_ids=[0] if device == "cuda" else None)
        else:
            shard(self.net, init_device_mesh(device, (1,), mesh_dim_names=("data_parallel",))["data_parallel"])
            self.loss_of = MeanNLL(self.net)
        self.optimizer = adamw(self.net.parameters(), lr=1e-4)
        self.tokens, self.targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step(self) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            loss = self.loss_of(self.tokens, self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def parameters(self) -> dict:
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().cpu()
            for name, p in self.net.named_parameters()
        }


def bench_fsdp(model, vocab, length, batch, steps, reps, device, log, profile=False) -> dict:
    """FSDP2 against DDP on one device: the same net and batch, one step's loss and parameters compared, then
    interleaved repetitions of ``steps`` steps (median tokens/s), each arm's peak memory (``profile``: and where
    each arm's step spends its time)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        net = build("nope", length, {"vocab_size": vocab} if model else TRAIN_SHAPE, model)
        tokens = torch.randint(0, net.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(0))
        arms, peaks = {}, {}
        for kind in ("ddp", "fsdp"):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            arms[kind] = ShardedArm(kind, net, tokens, device)
            arms[kind].loss = float(arms[kind].step())  # the first step: compared below, then warm
            arms[kind].step()
            sync(device)
            peaks[kind] = torch.cuda.max_memory_allocated() - before if device == "cuda" else float("nan")
            log(f"  {kind}: first loss {arms[kind].loss:.6f}")
        ddp, fsdp = arms["ddp"].parameters(), arms["fsdp"].parameters()
        worst = max(((fsdp[n] - p).abs().max() / p.abs().max().clamp(min=1e-12)).item() for n, p in ddp.items())
        rates = {kind: [] for kind in arms}
        for rep in range(reps):
            for kind in list(arms) if rep % 2 == 0 else list(reversed(arms)):
                rates[kind].append(tokens_per_second(arms[kind], steps, batch * length, device))
            log(f"  rep {rep + 1}: " + ", ".join(f"{k} {rates[k][-1]:.0f}" for k in rates))
        tokens_per_s = {kind: statistics.median(r) for kind, r in rates.items()}
        results = {
            "model": model or "small",
            "parameters": sum(p.numel() for p in net.parameters()),
            "length": length,
            "batch": batch,
            "steps": steps,
            "reps": reps,
            "loss": {kind: arm.loss for kind, arm in arms.items()},
            "worst_parameter_error": worst,
            "tokens_per_s": tokens_per_s,
            "ratio": statistics.median(f / d for f, d in zip(rates["fsdp"], rates["ddp"], strict=True)),
            "peak_bytes": peaks,
        }
        if profile:
            results["profile"] = {
                kind: step_profile(arm, device, batch * length, tokens_per_s[kind]) for kind, arm in arms.items()
            }
        return results
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The report


def environment(device: str) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": os.environ.get("LENEXT_COMMIT") or _git("rev-parse", "--short", "HEAD") or "unknown",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": bench.machine_description(),
    }
    if device == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            driver=_run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader") or "unknown",
        )
    if fla_kernels.kernels() is not None:
        import fla

        # FoX's, PaTH's and stick-breaking's bf16 training rows (not @nokernels) and CUDA bf16 arms run its kernels;
        # under Triton's interpreter (TRITON_INTERPRET=1) the CPU's fp32 arm does
        info["fla"] = fla.__version__ + (", Triton's interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "")
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    return info


def _run(*cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _git(*args) -> str | None:
    return _run("git", "-C", str(bench.REPO), *args)


# --------------------------------------------------------------------------------------------
# 6. An exported model on the device

EXPORT_CASES = {  # the architecture lenext-export writes ("remote": lenext's own code): the run's overrides
    "llama": ["pe=rope", "model=llama"],
    "gpt_neox": ["pe=rope"],
    "gpt2": ["pe=learned"],
    "remote": ["pe=alibi"],
}


def exported_net(case: str, folder: Path) -> Decoder:
    """A run's model (L_train ``EXACT_TRAIN_LEN``, every weight moved off its initial value, as tests/test_export.py
    makes them), written into ``folder`` as lenext-export writes ``case``."""
    overrides = [f"data.max_len={EXACT_TRAIN_LEN}", f"paths.root_dir={folder}", f"paths.output_dir={folder}"]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        spec, _ = resolve_training(compose("train", overrides=[*EXPORT_CASES[case], *overrides]))
    torch.manual_seed(bench.SEED)
    net = build_net(spec, EXACT_SHAPE["vocab_size"])
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    net.pe.project_()
    no_tokenizer = {"bos_token_id": None, "eos_token_id": None}
    if case == "remote":
        write_remote(net, spec, folder, no_tokenizer)
    else:
        NATIVE[case].write(net, folder, spec.base_len, no_tokenizer)
    return net.eval()


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double().cpu() - expected).norm() / expected.norm())


def export_case(net: Decoder, folder: Path, remote: bool, length: int, device: str) -> dict:
    """The exported model's logits and the gradient of its mean next-token loss for the token embeddings, loaded in
    fp32 on ``device`` and run in fp32 and under bf16 autocast (as lenext runs bf16), and lenext's net under bf16
    autocast there too, each against lenext's net in float64 on the CPU (relative, over the whole tensors)."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, net.vocab_size, (2, length + 1), generator=torch.Generator().manual_seed(length))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].flatten()
    reference = copy.deepcopy(net).double()
    expected = reference.logits(reference(inputs))
    torch.nn.functional.cross_entropy(expected.flatten(0, 1), targets).backward()
    options = dict(local_files_only=True, trust_remote_code=remote, dtype=torch.float32)
    errors = {}
    for arm in ("fp32", "bf16", "lenext bf16"):
        ours = arm.startswith("lenext")
        model = (copy.deepcopy(net) if ours else AutoModelForCausalLM.from_pretrained(folder, **options)).to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled="bf16" in arm):
            ids = inputs.to(device)
            logits = model.logits(model(ids)) if ours else model(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.to(device)).backward()
        embedding = model.embedding if ours else model.get_input_embeddings()
        errors[f"{device} {arm}"] = {
            "nll": relative(logits.detach(), expected.detach()),  # the logits' error, in the NLL's column
            # every case's head is untied: the input embedding's gradient is the same tensor's in both models
            "grad": relative(embedding.weight.grad, reference.embedding.weight.grad),
        }
    return errors


def bench_export(device, log, factor: int = 8) -> dict:
    """Each of ``EXPORT_CASES`` at L_train and ``factor`` x L_train (GPT-2: L_train only, its table's length)."""
    results = {}
    for case in EXPORT_CASES:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                net = exported_net(case, Path(tmp))
                lengths = [EXACT_TRAIN_LEN] + ([] if case == "gpt2" else [factor * EXACT_TRAIN_LEN])
                results[case] = {f"L {n}": export_case(net, Path(tmp), case == "remote", n, device) for n in lengths}
            except Exception as e:  # noqa: BLE001  (the report names it; the other cases still run)
                results[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                log(traceback.format_exc())
        log(f"  export {case:<10} {results[case]}")
    return results


def worst_errors(case: dict) -> dict:
    """{arm: {"nll": error, "grad": error}}: each arm's largest errors over a case's lengths."""
    arms = next(iter(case.values()))
    return {a: {k: max(length[a][k] for length in case.values()) for k in ("nll", "grad")} for a in arms}


def export_passes(arm: str, worst: dict) -> bool:
    """fp32 within the exactness section's tolerance; the export under bf16 autocast at most twice lenext's own error
    there (bf16's error is the dtype's, not the export's)."""
    if "bf16" not in arm:
        return passes(arm, worst[arm])
    if "lenext" in arm:  # the yardstick, reported: lenext's own bf16 is judged by the exactness section
        return True
    ours = worst[arm.replace("bf16", "lenext bf16")]
    return all(worst[arm][k] <= 2 * ours[k] for k in ("nll", "grad"))


def render_export(export) -> list[str]:
    runs = ", ".join(f"{case}: `{' '.join(overrides)}`" for case, overrides in EXPORT_CASES.items())
    lines = [
        "## An exported model on the device",
        "",
        f"A run's model ({runs}; L_train {EXACT_TRAIN_LEN}, vocab {EXACT_SHAPE['vocab_size']}, every weight moved "
        "off its initial value) written as `lenext-export` writes it (transformers' own classes; `remote`: lenext's "
        "code beside the weights), loaded by `AutoModelForCausalLM` in fp32 on the device, run in fp32 and under bf16 "
        "autocast; `lenext bf16`: lenext's net there under bf16 autocast. Each cell: the relative error of the "
        "logits / of the gradient of the mean next-token loss for the token embeddings, against lenext's net in "
        "float64 on the CPU, the worse over the lengths (GPT-2: L_train only, its table's length). Passes: fp32 within "
        "0.0001 / 0.001; bf16 at most twice lenext's own bf16 errors (bf16's error is the dtype's, not the export's; "
        "lenext's own is judged by the exactness section).",
        "",
    ]
    arms = list(dict.fromkeys(arm for r in export.values() if "error" not in r for arm in worst_errors(r)))
    lines += ["| case | lengths | " + " | ".join(arms) + " | passes |", "|---|---|" + "---|" * len(arms) + "---|"]
    for case, r in export.items():
        if "error" in r:
            lines.append(f"| {case} | | {r['error']} |" + " |" * len(arms))
            continue
        worst = worst_errors(r)
        cells = [f"{worst[a]['nll']:.1e} / {worst[a]['grad']:.1e}" for a in arms]
        ok = all(export_passes(a, worst) for a in arms)
        lines.append(f"| {case} | {', '.join(r)} | " + " | ".join(cells) + f" | {'yes' if ok else '**no**'} |")
    return [*lines, ""]


def render(info, settings, exact=None, training=None, lightning=None, fsdp=None, export=None) -> str:
    lines = ["# lenext GPU check", ""]
    lines += [f"- {key}: {value}" for key, value in info.items()]
    lines += [f"- command: `{settings['command']}`", f"- elapsed: {settings['elapsed']:.0f} s"]
    lines += [
        f"- left out: {'`' + c['row'] + '`' if c['row'] else 'the section'} in {c['section']}, which {c['why']}; the "
        "check went on in a new process"
        for c in settings.get("crashed", [])
    ]
    lines.append("")
    if exact is not None:
        lines += render_exactness(exact)
    if training is not None:
        lines += render_training(training)
    if lightning is not None:
        lines += render_lightning(lightning)
    if fsdp is not None:
        lines += render_fsdp(fsdp)
    profiles = {n: r["profile"] for n, r in (training or {}).items() if isinstance(r, dict) and "profile" in r}
    profiles |= {f"lightning section: {arm}": p for arm, p in (lightning or {}).get("profile", {}).items()}
    profiles |= {f"fsdp section: {kind}": p for kind, p in (fsdp or {}).get("profile", {}).items()}
    if profiles:
        lines += render_profiles(profiles)
    if export is not None:
        lines += render_export(export)
    return "\n".join(lines) + "\n"


def render_fsdp(r) -> list[str]:
    mb = {kind: f"{peak / 2**20:,.0f} MB" for kind, peak in r["peak_bytes"].items()}
    return [
        "## FSDP against DDP on one device",
        "",
        f"Model {r['model']} ({r['parameters']:,} parameters), NoPE, L {r['length']}, batch {r['batch']}, bf16 "
        f"autocast, AdamW; one process group of one rank; FSDP2 as `trainer=fsdp` shards (each block, then the net). "
        f"{r['reps']} repetitions of {r['steps']} steps, the arms alternating.",
        "",
        "| arm | tokens/s | first loss | peak memory |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {r['tokens_per_s'][k]:,.0f} | {r['loss'][k]:.6f} | {mb[k]} |" for k in ("ddp", "fsdp")),
        "",
        f"FSDP's tokens/s over DDP's (median of the paired repetitions): {r['ratio']:.3f} (target: within 10%). After "
        f"two identical steps, the largest difference of any parameter, relative to its tensor's largest entry: "
        f"{r['worst_parameter_error']:.1e}.",
        "",
    ]


def render_profiles(profiles: dict) -> list[str]:
    lines = [
        "## Where a step's time goes",
        "",
        "Each arm's steps again under torch.profiler, after its timed repetitions: the device's kernels' time a "
        "step, summed (over streams too: kernels that overlap count twice), against the step's time in the timed "
        "repetitions, without the profiler (the profiled step's in brackets; `-` in files written before "
        "2026-11-30 02:00 UTC): the rest of a step the GPU waited for the CPU to launch work, at least. The host's "
        "reads of a device value a step (`aten::_local_scalar_dense`: on a GPU each waits for the kernels queued "
        "before it; `-` in files written before 2026-11-30 20:00 UTC), on CUDA with its waits for the GPU a step in "
        "brackets (`cudaStreamSynchronize`: copies to the host such as `.tolist()` too, reads of CPU tensors not; "
        "since 2026-12-01). Then the kernels taking most of it, per step.",
        "",
        "| arm | kernels' time a step | timed step (profiled step) | kernels' share | host reads a step | "
        "top kernels (ms a step, calls) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, p in profiles.items():
        top = "; ".join(f"`{key[:60]}` {1e3 * s:.2f} ms x{n}" for key, s, n in p["top"])
        timed = p.get("timed_step_s")  # not in files written before 2026-11-30 02:00 UTC
        timed_cell, share = (f"{1e3 * timed:.2f} ms", f"{p['busy_s'] / timed:.0%}") if timed else ("-", "-")
        reads = "-" if p.get("host_reads") is None else f"{p['host_reads']:g}"
        if p.get("host_waits") is not None:
            reads += f" ({p['host_waits']:g})"
        lines.append(
            f"| {name} | {1e3 * p['busy_s']:.2f} ms | {timed_cell} ({1e3 * p['step_s']:.2f} ms) | {share} | {reads} "
            f"| {top} |"
        )
    return [*lines, ""]


def render_exactness(exact) -> list[str]:
    nll_fp32, grad_fp32 = TOLERANCE["fp32"]
    nll_bf16, grad_bf16 = TOLERANCE["bf16"]
    lines = [
        "## Exactness against float64 on the CPU",
        "<!-- --8<-- [start:exactness] -->",
        "",
        f"Model: {EXACT_SHAPE['n_layers']} layers, d_model {EXACT_SHAPE['d_model']}, {EXACT_SHAPE['n_heads']} heads, "
        f"vocab {EXACT_SHAPE['vocab_size']}, L_train {EXACT_TRAIN_LEN}, batch 2, PE parameters at std 0.5. "
        "Each cell: the largest error of the per-token NLL (absolute) / of any parameter's gradient (relative to "
        "that tensor's largest entry), over the cases; `no grad`: the NLL under no_grad, evaluation's paths (on CUDA "
        "FIRE past its threshold and FoX through flex score_mods; on the CPU the query blocks through SDPA). "
        "The `cuda bf16` arm of FoX, PaTH (at head dim 64 only: its `head dim 64` case) and stick-breaking runs "
        "fla's kernels (with fla installed), and CoPE's "
        "lenext's CoPE kernel; under Triton's interpreter their `cpu fp32` arm runs them; `kernels off`: the paths "
        "without them. "
        "Passes: fp32 within "
        f"{nll_fp32:g} / {grad_fp32:g}, bf16 within {nll_bf16:g} / {grad_bf16:g}.",
        "",
    ]
    arms = sorted({a for r in exact.values() for c in r.values() if isinstance(c, dict) for a in c if " " in a})
    lines += ["| row | cases | " + " | ".join(arms) + " | passes |", "|---|---|" + "---|" * len(arms) + "---|"]
    for row, cases in exact.items():
        if "skipped" in cases:
            lines.append(f"| {row} | not run ({cases['skipped']}) |" + " |" * len(arms) + " |")
            continue
        measured = {case: arms_ for case, arms_ in cases.items() if "refused" not in arms_ and "error" not in arms_}
        notes = [f"{case}: {next(iter(v.values()))}" for case, v in cases.items() if case not in measured]
        cells, ok = [], True
        for arm in arms:
            errs = [m[arm] for m in measured.values() if arm in m]
            if not errs:
                cells.append("-")
                continue
            nll = max(e["nll"] for e in errs)
            ok &= all(passes(arm, e) for e in errs)
            cells.append(f"{nll:.1e} / {grad_cell([e['grad'] for e in errs])}")
        ok &= not any("error" in v for v in cases.values())
        lines.append(
            f"| {row} | {', '.join(measured) or '-'} | " + " | ".join(cells) + f" | {'yes' if ok else '**no**'} |"
        )
        lines += [f"|  | {note} |" + " |" * (len(arms) + 1) for note in notes]
    return lines + ["", "<!-- --8<-- [end:exactness] -->", ""]


def render_training(training) -> list[str]:
    lines = [
        "## Training speed",
        "<!-- --8<-- [start:training] -->",
        "",
        f"Model {training.get('model', 'small (6 layers, d_model 256, 8 heads, vocab 8192)')}, L "
        f"{training['length']}, batch {training['batch']}, bf16 autocast, fused AdamW; {training['reps']} "
        f"repetitions round-robin of {training['steps']} steps per row; median tokens/s, the ratio to NoPE paired per "
        "repetition. MFU: PaLM's count (6 N + 6 layers d_model L per token, the PE's own work not counted) against "
        f"this GPU's bf16 GEMM peak measured in the run ({training['gemm_peak'] / 1e12:.0f} TFLOP/s). Warm-up: "
        "building the row's model and its first steps, its compiles included (FlexAttention's kernel; `@compile`: "
        "every block compiled, as `module.compile=true`), apart from the timed steps. `xt:`: x-transformers.",
        "",
        "| row | tokens/s | ratio vs nope | range | MFU | warm-up | peak memory (the row's own) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, r in training.items():
        if not isinstance(r, dict) or "tokens_per_s" not in r:
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        spread = "-" if r["range"] is None else f"{r['range'][0]:.2f}-{r['range'][1]:.2f}"
        warm = f"{r['warmup_s']:.1f} s ({r['warmup_steps']} steps)" if "warmup_s" in r else "-"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {spread} | {mfu} | {warm} | "
            f"{r['peak_bytes'] / 2**20:,.0f} MB |"
        )
    lines += [f"- {name}: not measured ({why})" for name, why in training["skipped"].items()]
    return lines + ["", "<!-- --8<-- [end:training] -->", ""]


def render_lightning(r) -> list[str]:
    ratio, target = r["ms_lightning"] / r["ms_bare"], LIGHTNING_TARGET
    return [
        "## Lightning against a bare loop",
        "<!-- --8<-- [start:lightning] -->",
        "",
        f"RoPE, the model {r.get('model', 'small')}{', its blocks compiled' if r.get('compiled') else ''}, L "
        f"{r['length']}, batch {r['batch']}, bf16-mixed; each arm a fresh fit of {r['steps']} + 1 steps, "
        f"{r['reps']} repetitions alternating; a fit's mean step time after its first step (the GPU waited for at"
        " the first and last steps' ends only), median of the fits.",
        "",
        f"- Lightning: {r['ms_lightning']:.2f} ms/step; bare loop: {r['ms_bare']:.2f} ms/step; ratio {ratio:.3f} "
        f"(target <= {target:g}: {'meets' if ratio <= target else 'misses'})",
        *(
            [
                f"- Lightning's training: {r['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] else "")
            ]
            if "tokens_per_s" in r
            else []
        ),
        "",
        "<!-- --8<-- [end:lightning] -->",
        "",
    ]


def run_sections(args, sections, rows, results, left_out, budget, log, save) -> None:
    """The asked ``sections`` in their order, into ``results`` (saved after each); ``left_out``: each section's rows
    that crashed an earlier process, by row, with why (``supervise``)."""
    if "exactness" in sections:
        lengths = (16, 40) if args.quick else (EXACT_TRAIN_LEN, 8 * EXACT_TRAIN_LEN)
        exact_rows = list(dict.fromkeys(pe_of(r) for r in rows))  # kernels off: training's matter
        kept = {row: {"skipped": why} for row, why in left_out["exactness"].items()} | results.get("exact", {})
        compiled = {pe_of(r) for r in rows if "compile" in r.split("@")}  # also checked compiled (on CUDA)

        def measured(exact: dict) -> None:
            results["exact"] = {row: (kept | exact)[row] for row in exact_rows if row in kept | exact}
            save()

        bench_exactness(
            [row for row in exact_rows if row not in kept],
            lengths,
            args.device,
            budget=budget("exactness"),
            log=log,
            compiled=compiled,
            measured=measured,
        )
    if "training" in sections:
        quick = dict(length=128, batch=2, warmup=1, steps=1, reps=2) if args.quick else {}
        settings_t = dict(length=args.length, batch=args.batch, warmup=3, steps=5, reps=5) | quick
        xt = [] if args.model else [f"xt:{r}" for r in XT_ROWS if r in rows]  # x-transformers: the small shape
        trained = [row for row in ["nope"] + [r for r in rows if r != "nope"] + xt if row not in left_out["training"]]
        results["training"] = bench_training(
            trained,
            device=args.device,
            budget=budget("training"),
            log=log,
            model=args.model,
            vocab=args.vocab,
            profile=args.profile,
            **settings_t,
        )
        results["training"]["skipped"] |= left_out["training"]
        save()
    if "lightning" in sections:
        with at("lightning"):
            sizes = dict(length=args.length, batch=args.batch) if args.model else dict(length=512, batch=16)
            sizes = dict(length=64, batch=2, steps=3, reps=2) if args.quick else sizes | dict(steps=30, reps=4)
            results["lightning"] = bench_lightning(
                device=args.device,
                log=log,
                model=args.model,
                vocab=args.vocab,
                compiled=args.lightning_compile,
                profile=args.profile,
                **sizes,
            )
            save()
    if "fsdp" in sections:
        with at("fsdp"):
            quick = dict(length=64, batch=2, steps=2, reps=2) if args.quick else dict(steps=5, reps=6)
            sizes = dict(length=args.length, batch=args.batch) | quick
            results["fsdp"] = bench_fsdp(
                args.model, args.vocab, device=args.device, log=log, profile=args.profile, **sizes
            )
            save()
    if "export" in sections:
        with at("export"):
            results["export"] = bench_export(args.device, log, factor=2 if args.quick else 8)
            save()


def supervise(argv: list[str], out: Path, budget: float) -> None:
    """The check in a child process (``--relaunch``, the default on CUDA), started again, on the time left, when a
    signal ends it (a segfault in a compile) or a row breaks its device (``DEVICE_LOST``): without the row it was on
    (``at``), the sections before keeping what they measured. The report names each row so left out. A lent GPU's
    minutes are few: one crash had cost a call's every later row."""
    progress, crashed, started = out.with_suffix(".progress"), [], time.time()
    # A SIGTERM (a timeout's) ends the child too: subprocess.run kills it on the way out of this exit.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    while True:
        progress.unlink(missing_ok=True)
        state = {"crashed": crashed, "started": started, "budget": max(0.0, budget - (time.time() - started))}
        code = subprocess.run([sys.executable, __file__, *argv, "--child", json.dumps(state)]).returncode
        if (code >= 0 and code != DEVICE_LOST) or not progress.exists():  # finished, failed, or crashed outside rows
            progress.unlink(missing_ok=True)
            if code:
                sys.exit(code if code > 0 else 128 - code)  # as a shell reports a death by signal
            return
        section, row = json.loads(progress.read_text())
        why = "broke the device (a CUDA error)" if code == DEVICE_LOST else f"killed the process ({signal_name(-code)})"
        crashed.append({"section": section, "row": row, "why": why})
        print(f"gpu_check: {row or 'the section'} {why} in {section}: going on without it", flush=True)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of the script")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu-check-run.md"))
    parser.add_argument("--sections", default="exactness,training,lightning", help=f"of {','.join(SECTIONS)}")
    parser.add_argument("--rows", help="comma-separated rows (default: every PE config and variant)")
    parser.add_argument("--quick", action="store_true", help="tiny lengths and steps (a smoke test)")
    parser.add_argument("--budget", type=float, default=500, help="seconds for the whole run, shared by sections")
    parser.add_argument("--model", help="training: a model preset (configs/model/), e.g. llama_125m (default: small)")
    parser.add_argument("--vocab", type=int, default=32000, help="training with --model: its vocabulary")
    parser.add_argument("--length", type=int, default=1024, help="training: L")
    parser.add_argument("--batch", type=int, default=16, help="training: sequences per step")
    parser.add_argument(
        "--lightning-compile", action="store_true", help="lightning: both arms' blocks compiled (module.compile=true)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="training, lightning and fsdp: each arm's steps profiled (device busy time, host reads, top kernels)",
    )
    parser.add_argument(
        "--relaunch",
        action=argparse.BooleanOptionalAction,
        help="run the check in a child process, started again without a row that crashes it (default: on CUDA)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # supervise's state, as JSON: a child's own flag
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False); --device cpu runs a smoke test")
    # The Triton kernels on the CPU: the interpreter has no driver to time an autotuner's configs, so each kernel
    # takes its first
    if os.environ.get("TRITON_INTERPRET") == "1":
        if args.device == "cuda":
            sys.exit("gpu_check: TRITON_INTERPRET=1 is for --device cpu (the Triton kernels on the CPU)")
        from triton.runtime.autotuner import Autotuner

        prune = Autotuner.prune_configs
        Autotuner.prune_configs = lambda self, *args, **kwargs: prune(self, *args, **kwargs)[:1]
    rows = args.rows.split(",") if args.rows else all_rows()
    known = bench.PE_NAMES + list(VARIANTS)
    for row in rows:
        if pe_of(row) not in known:
            sys.exit(f"gpu_check: --rows {row}: {pe_of(row)} is not a row; rows are {', '.join(known)}")
        unknown = set(row.split("@")[1:]) - ROW_SUFFIXES
        if unknown:
            suffixes = ", ".join(f"@{s}" for s in sorted(unknown))
            sys.exit(
                f"gpu_check: --rows {row}: {suffixes} is not a row suffix; they are @compile, @nokernels and @ckpt"
            )
    sections = args.sections.split(",")
    unknown = [section for section in sections if section not in SECTIONS]
    if unknown:
        sys.exit(f"gpu_check: --sections {','.join(unknown)} is not a section; they are {', '.join(SECTIONS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.child is None and (args.device == "cuda" if args.relaunch is None else args.relaunch):
        supervise(argv, args.out, args.budget)
        return
    state = json.loads(args.child) if args.child else {"crashed": [], "started": time.time()}
    if args.child:
        global PROGRESS
        PROGRESS, args.budget = args.out.with_suffix(".progress"), state["budget"]
        argv = argv[: argv.index("--child")]
    crashed = state["crashed"]
    started = time.perf_counter()
    settings = {"command": " ".join(["python scripts/gpu_check.py", *argv]), "elapsed": 0.0, "crashed": crashed}
    info, results = environment(args.device), {}
    log_file = args.out.with_suffix(".log")
    if crashed:  # a child started again: the sections before the crash's keep what they measured
        resumed_at = list(SECTIONS).index(crashed[-1]["section"])
        saved = args.out.with_suffix(".json")
        prior = json.loads(saved.read_text()) if saved.exists() else {}  # none: the crash came before any save
        for section in [s for s in sections if list(SECTIONS).index(s) < resumed_at]:
            sections.remove(section)
            if result_key(section) in prior:
                results[result_key(section)] = prior[result_key(section)]
        if crashed[-1]["row"] is None:  # a section without rows (lightning, fsdp, export): left out
            sections.remove(crashed[-1]["section"])
        elif crashed[-1]["section"] == "exactness":  # its rows finished keep their numbers
            results["exact"] = prior.get("exact", {})
    else:  # a report of an earlier check at --out would pass for this one's until its first save
        for earlier in (log_file, args.out, args.out.with_suffix(".json")):
            earlier.unlink(missing_ok=True)
    left_out = {section: {c["row"]: c["why"] for c in crashed if c["section"] == section} for section in SECTIONS}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 exactness means fp32

    def log(message: str) -> None:
        print(message, flush=True)
        with open(log_file, "a") as f:
            f.write(message + "\n")

    def save() -> None:
        settings["elapsed"] = time.time() - state["started"]
        write_atomic(args.out, render(info, settings, **results))
        measured = {"info": info, "crashed": crashed, **results}
        write_atomic(args.out.with_suffix(".json"), json.dumps(measured, indent=1, default=str))

    log(f"{info}; sections {', '.join(s for s in SECTIONS if s in sections)}, budget {args.budget:.0f} s")

    def budget(section: str) -> float:
        """The section's share of the time left, shared with the sections after it."""
        left = [s for s in list(SECTIONS)[list(SECTIONS).index(section) :] if s in sections]
        seconds = (
            max(0.0, args.budget - (time.perf_counter() - started)) * SECTIONS[section] / sum(SECTIONS[s] for s in left)
        )
        log(f"{section}: {seconds:.0f} s")
        return seconds

    try:
        run_sections(args, sections, rows, results, left_out, budget, log, save)
    except Exception as e:  # a row's failure that took the device with it: ended, for supervise to go on without it
        if not (isinstance(e, DeviceLost) or device_lost(args.device)):
            raise
        save()
        where = PROGRESS.read_text() if PROGRESS.exists() else "no row"
        log(f"{traceback.format_exc()}the device is lost at {where}: ending this process")
        sys.exit(DEVICE_LOST)
    save()
    log(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
