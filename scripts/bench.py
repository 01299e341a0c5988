"""Benchmark the positional encodings on the small model (docs/performance.md).

Every model measured is the one ``train.py`` trains for its row: train.py's config composed with the row's
overrides, resolved by ``lenext.resolve`` and built by ``lenext.build.build_net``. Measures, in one run:

1. training throughput (tokens/s) at L=512, batch 8, one AdamW step per iteration, for every PE on
   the same model size and the same random batch, and for RoPE at randomized and PoSE positions
   drawn every step; the rows are interleaved round-robin across repetitions and the median is
   taken, so the ratios vs NoPE are measured side by side; and the time a draw of positions takes;
2. one forward pass of the whole model (eval, no_grad, batch 1, chunked-logit NLL) at
   L = 512 .. 16384: wall time and peak extra memory (peak RSS minus RSS just before the forward),
   each (PE, L) in a fresh subprocess so peaks do not leak from one measurement into the next;
3. Shaw attention at L=2048: forward+backward of lenext's gather path vs the naive
   (L, L, d_head) einsum reference;
4. the CPU study's training step (compact model, L=64, batch 32) under a real lightning.Trainer vs a
   bare PyTorch loop doing the same training, at the machine's default precision, and the bare loop at
   the other precision (bf16 autocast vs fp32), and the bare loop with the model under torch.compile,
   and a second stage (``init_from`` the first arm's checkpoint, YaRN x4) under the same Trainer;
   the arms interleaved;
5. ``eval.py hf=``'s evaluation of a Hugging Face Llama against a bare transformers loop;
6. training throughput against a peer, x-transformers, on the same shape, step and batch as section 1, for the
   PEs both have: each PE's lenext and x-transformers arms interleaved, their ratio paired by repetition;
7. NoPE's training step of section 1 with lenext's AdamW (torch's fused kernel) against torch's default AdamW,
   interleaved, and the optimizer step alone in each arm.

Every report names the CPU, its ISA and whether it computes bf16 natively (lenext.hardware).

Usage:
    .venv/bin/python scripts/bench.py                   # fp32, writes benchmarks/bench.md
    .venv/bin/python scripts/bench.py --precision bf16  # writes benchmarks/bench-bf16.md
    .venv/bin/python scripts/bench.py --quick           # smoke test
    .venv/bin/python scripts/bench.py --sections lightning --out benchmarks/bench-lightning.md  # section 4
    .venv/bin/python scripts/bench.py --sections training,forward --rows cope,fox,nope+ssmax  # some rows only
    .venv/bin/python scripts/bench.py --sections peer --out benchmarks/bench-peer.md  # section 6
    .venv/bin/python scripts/bench.py --sections adamw --out benchmarks/bench-adamw.md  # section 7
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import lightning as L
import numpy as np
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from lenext import pe as pes
from lenext import schema
from lenext.attention import causal_attention
from lenext.build import build_module, build_net, instantiate
from lenext.cli import CONFIG_PACKAGE
from lenext.data.loaders import TrainWindows, step_loader
from lenext.errors import LengthNotSupported
from lenext.files import write_atomic
from lenext.hardware import default_precision, keep_freed_memory, machine_description, precision_autocast
from lenext.model import LOGIT_CHUNK_ELEMENTS, Decoder
from lenext.module import adamw, adamw_with_schedule
from lenext.pe.base import sequential_positions
from lenext.positions import training_positions
from lenext.resolve import TRAIN_NODES, TrainSettings, config_pe_name, resolve
from lenext.run_folder import resolve_training
from lenext.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
TRAIN_LEN, BATCH, SEED = 512, 8, 0
TRAINER_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}  # --precision as trainer.precision names it

# A row is `train.py pe=<pe> <its settings> <MODEL>`: "<pe>" is a PE's config, "<pe>+<setting>" adds settings.
MODEL = ["model=small", f"data.max_len={TRAIN_LEN}"]
# The configs that only set train.positions (rope_randomized) are the DRAWN_ROWS' settings.
PE_NAMES = sorted(
    p.stem
    for p in (Path(str(resources.files(CONFIG_PACKAGE))) / "pe").glob("*.yaml")
    if not p.stem.endswith("_randomized")
)
SETTING_ROWS = {  # a PE with settings of its own or of the attention
    "shaw+value_term": ["pe.value_term=true"],
    "nope+ssmax": ["attention.scale=ssmax"],
    "rope+ssmax": ["attention.scale=ssmax"],
    "nope+stick_breaking": ["attention.normalizer=stick_breaking"],
}
DRAWN_ROWS = {  # RoPE trained at positions drawn anew every step
    "rope+randomized": ["train.positions=randomized"],
    "rope+pose": ["train.positions=pose"],
}
SAMPLING_TARGET = 0.02  # drawing positions: at most this share of a training step
SECTIONS = ["training", "forward", "shaw", "lightning", "hf", "peer", "adamw"]
TARGETS = {  # training tokens/s vs nope
    "rope": 0.95,
    "alibi": 0.9,
    "t5": 0.8,
    "shaw": 0.7,
    "xpos": 0.9,
    "kerple": 0.8,
    "fire": 0.6,
    "p_rope": 0.95,
    "fox": 0.8,
    "fox_rope": 0.8,
    "cope": 0.4,
    "dape": 0.4,
    "nope+stick_breaking": 0.4,
    "nope+ssmax": 0.95,
    "rope+ssmax": 0.95,
}


# --------------------------------------------------------------------------------------------
# The models, as a run builds them


def train_config(overrides: list[str], output_dir: str) -> DictConfig:
    """train.py's config with ``overrides``, checked as train.py checks it; its run folder is ``output_dir`` (Hydra's
    runtime, which names one, does not run here)."""
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"paths.output_dir={output_dir}"])
    schema.check(cfg, TrainSettings, TRAIN_NODES)
    return cfg


def row_overrides(row: str) -> list[str]:
    """train.py's command line of a row."""
    return [f"pe={row.partition('+')[0]}", *SETTING_ROWS.get(row, []), *DRAWN_ROWS.get(row, []), *MODEL]


def row_config(row: str) -> DictConfig:
    return train_config(row_overrides(row), tempfile.gettempdir())  # builds a model only: its run folder stays empty


def run_net(spec: RunSpec, vocab_size: int, weights: dict | None = None) -> Decoder:
    """The net lenext.run.build makes for ``spec``: built after seeding with the run's seed, holding ``weights``
    (a second stage's base's) if given."""
    torch.manual_seed(spec.seed)
    return build_net(spec, vocab_size, weights)


def row_model(row: str) -> tuple[Decoder, RunSpec]:
    """The model train.py trains for a row, and the run it resolves (its positions: ``spec.scheme``)."""
    cfg = row_config(row)
    spec = resolve(cfg, row.partition("+")[0], sweeps=False)
    return run_net(spec, cfg.data.vocab_size), spec  # a run's tokenizer has data.vocab_size tokens: no corpus read


def small_shape() -> dict:
    """The rows' model size and vocabulary, as their config sets them."""
    cfg = row_config("nope")
    return {"vocab_size": cfg.data.vocab_size, **{key: cfg.model[key] for key in ("d_model", "n_layers", "n_heads")}}


def training_rows(wanted: list[str] | None = None) -> list[str]:
    """Every training row, or those ``wanted`` (``--rows``) and nope, which every ratio is taken against."""
    rows = PE_NAMES + list(SETTING_ROWS) + list(DRAWN_ROWS)
    return rows if wanted is None else [row for row in rows if row in wanted or row == "nope"]


def forward_rows(wanted: list[str] | None = None) -> list[str]:
    """Every forward row (drawn training positions change nothing at evaluation), or those ``wanted``."""
    rows = PE_NAMES + list(SETTING_ROWS)
    return rows if wanted is None else [row for row in rows if row in wanted]


def random_batch(batch: int, length: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(SEED))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def autocast(precision: str):
    return precision_autocast(CPU, TRAINER_PRECISION[precision])


# --------------------------------------------------------------------------------------------
# 1. Training throughput


class TrainingRow:
    """A row's model with AdamW, stepping on a fixed batch at positions its run draws anew every step."""

    def __init__(self, row: str, precision: str):
        self.net, spec = row_model(row)
        self.net.train()
        self.optimizer = adamw(self.net.parameters(), lr=1e-4)
        self.scheme, self.seed, self.precision, self.step = spec.scheme, spec.seed, precision, 0

    def train(self, tokens: torch.Tensor, targets: torch.Tensor, steps: int) -> float:
        for _ in range(steps):
            positions = training_positions(self.scheme, *tokens.shape, self.seed, 0, self.step, 0)
            with autocast(self.precision):
                loss = self.net.token_nll(tokens, targets, positions).mean()
            loss.backward()
            self.optimizer.step()
            self.net.pe.project_()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        return loss.item()


def training_flops_per_token(net: Decoder, length: int) -> float:
    """Model FLOPs of one training token, as PaLM counts them (Chowdhery et al. 2022, appendix B): 6 N for the
    weights (N: every parameter but the token embedding, a lookup; the output head included) plus 6 x layers x
    d_model x L for the scores and the weighted values, which is PaLM's 12 x layers x d x L halved for the causal
    mask. A PE's own work (rotations, biases, gates) is not counted: MFU says how far a row is from the GEMMs."""
    weights = sum(p.numel() for p in net.parameters()) - net.embedding.weight.numel()
    return 6 * weights + 6 * len(net.blocks) * net.d_model * length


def gemm_peak(precision: str, size: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a (size x size) @ (size x size) matmul in the training precision (bf16: under autocast, as the
    model's), the best of ``reps``: the machine's GEMM peak MFU is measured against."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = math.inf
    with autocast(precision):
        a @ b  # warm up oneDNN
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def sampling_ms(schemes: dict, batch: int, length: int, draws: int = 50) -> dict[str, float]:
    """Milliseconds one training batch's positions take to draw, per row (median of ``draws``)."""
    times = {}
    for row, scheme in schemes.items():
        drawn = []
        for step in range(draws):
            start = time.perf_counter()
            training_positions(scheme, batch, length, SEED, 0, step, 0)
            drawn.append((time.perf_counter() - start) * 1e3)
        times[row] = statistics.median(drawn)
    return times


def interleaved_rates(arms: dict, batch: int, warmup: int, steps: int, reps: int, log) -> dict[str, list[float]]:
    """Each arm's tokens/s in every repetition: ``warmup`` steps each, then ``reps`` rounds of ``steps`` timed steps
    of every arm in turn on the same random batch, the first arm of a round rotating."""
    names = list(arms)
    tokens, targets = random_batch(batch, TRAIN_LEN, small_shape()["vocab_size"])
    for name, arm in arms.items():
        start = time.perf_counter()
        loss = arm.train(tokens, targets, warmup)
        log(f"  warmup {name:<15} {warmup} steps, {time.perf_counter() - start:6.1f} s, loss {loss:.3f}")
    rates = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            arms[name].train(tokens, targets, steps)
            rates[name].append(steps * batch * TRAIN_LEN / (time.perf_counter() - start))
        log(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{name} {rates[name][-1]:.0f}" for name in names))
    return rates


def bench_training(precision, batch, warmup, steps, reps, log, rows):
    arms = {row: TrainingRow(row, precision) for row in rows}
    rates = interleaved_rates(arms, batch, warmup, steps, reps, log)
    drawn = {row: arm.scheme for row, arm in arms.items() if arm.scheme.reach}
    results = {
        "rows": rows,
        "sampling_ms": sampling_ms(drawn, batch, TRAIN_LEN),
        "reach": sorted({scheme.reach for scheme in drawn.values()}),
        "gemm_peak": gemm_peak(precision),
    }
    for row in rows:
        # Ratio: median over repetitions of (this PE / nope in the same repetition), i.e. paired.
        paired = [r / n for r, n in zip(rates[row], rates["nope"], strict=True)]
        flops = training_flops_per_token(arms[row].net, TRAIN_LEN)
        results[row] = {
            "mfu": statistics.median(rates[row]) * flops / results["gemm_peak"],
            "tokens_per_s": statistics.median(rates[row]),
            "ratio": statistics.median(paired),
            "ratio_min": min(paired),
            "ratio_max": max(paired),
            "rates": rates[row],
        }
    return results


# --------------------------------------------------------------------------------------------
# 6. Against a peer: x-transformers trains the same model

# x-transformers' settings for each PE both have; its xPos is RoPE with xPos's scale (rotary_xpos).
PEER_PES = {
    "nope": {},
    "rope": {"rotary_pos_emb": True},
    "xpos": {"rotary_pos_emb": True, "rotary_xpos": True},
    "alibi": {"alibi_pos_bias": True},
    "t5": {"rel_pos_bias": True},
}
PEER_TARGET = 1.5  # lenext's training tokens/s over x-transformers' on every PE both have


def xtransformers_net(row: str, length: int, shape: dict | None = None):
    """x-transformers' decoder of the small model's shape (GELU, ff x4, pre-norm LayerNorm, lenext's head width
    d_model / heads: x-transformers' default of 64 would train a larger attention; untied output head), this row's
    PE, rotating the whole head as lenext does (x-transformers' default: half of it), seeded."""
    from x_transformers import Decoder as XDecoder
    from x_transformers import TransformerWrapper

    shape = shape or small_shape()
    head = shape["d_model"] // shape["n_heads"]
    rotary = {"rotary_emb_dim": head} if PEER_PES[row].get("rotary_pos_emb") else {}  # all of a head, as lenext's
    torch.manual_seed(SEED)
    layers = XDecoder(
        dim=shape["d_model"],
        depth=shape["n_layers"],
        heads=shape["n_heads"],
        attn_dim_head=head,
        attn_flash=row != "t5",  # x-transformers refuses flash with its T5 bias
        **PEER_PES[row],
        **rotary,
    )
    return TransformerWrapper(
        num_tokens=shape["vocab_size"], max_seq_len=length, attn_layers=layers, use_abs_pos_emb=False
    )


class PeerRow:
    """x-transformers' model of a row with AdamW, stepping as ``TrainingRow`` does: forward, cross-entropy over
    its logits (its own way to a loss), backward, AdamW step, zero_grad."""

    def __init__(self, row: str, precision: str):
        self.net = xtransformers_net(row, TRAIN_LEN)
        self.net.train()
        self.optimizer = adamw(self.net.parameters(), lr=1e-4)
        self.precision = precision

    def train(self, tokens: torch.Tensor, targets: torch.Tensor, steps: int) -> float:
        for _ in range(steps):
            with autocast(self.precision):
                logits = self.net(tokens)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def bench_peer(precision, batch, warmup, steps, reps, log, rows):
    """Per PE: lenext's and x-transformers' tokens/s (medians) and lenext / x-transformers paired by repetition."""
    arms = {}
    for row in rows:
        arms[row], arms[f"xt:{row}"] = TrainingRow(row, precision), PeerRow(row, precision)
    rates = interleaved_rates(arms, batch, warmup, steps, reps, log)
    results = {"rows": rows, "gemm_peak": gemm_peak(precision)}
    for row in rows:
        paired = [ours / theirs for ours, theirs in zip(rates[row], rates[f"xt:{row}"], strict=True)]
        flops = training_flops_per_token(arms[row].net, TRAIN_LEN)  # the same model: one count for both
        results[row] = {
            "mfu": statistics.median(rates[row]) * flops / results["gemm_peak"],
            "peer_mfu": statistics.median(rates[f"xt:{row}"]) * flops / results["gemm_peak"],
            "tokens_per_s": statistics.median(rates[row]),
            "peer_tokens_per_s": statistics.median(rates[f"xt:{row}"]),
            "ratio": statistics.median(paired),
            "ratio_min": min(paired),
            "ratio_max": max(paired),
        }
    return results


def model_words(model: dict) -> str:
    """'<n> layers, d_model <d>, <h> heads': the model in the renderers' prose."""
    return f"{model['n_layers']} layers, d_model {model['d_model']}, {model['n_heads']} heads"


def timed_steps(settings) -> str:
    """'<n> timed step(s)': the steps each repetition times, in the renderers' prose."""
    return f"{settings['steps']} timed step{'s' if settings['steps'] > 1 else ''}"


def render_peer(settings, peer) -> list[str]:
    from importlib.metadata import version

    model = settings["model"]
    lines = [
        "## Against x-transformers",
        "",
        f"x-transformers {version('x-transformers')} trains the model of section 1 (the small model: "
        f"{model_words(model)} of {model['d_model'] // model['n_heads']}, GELU, "
        f"untied head) with each PE both have, at L={settings['train_length']}, batch {settings['train_batch']}, "
        "on the same random batch: its forward, cross-entropy over its logits, backward, AdamW step. Its RoPE "
        "rotates the whole head (`rotary_emb_dim`), as lenext's does; its xPos is `rotary_xpos`; its T5 bias runs "
        "without flash attention (it refuses the two together). Every PE's two "
        f"arms interleaved round-robin over {settings['reps']} repetitions of {timed_steps(settings)} after "
        f"{settings['warmup']} warmup steps; tokens/s: medians; "
        "ratio: median over repetitions of lenext / x-transformers in the same repetition, with its range. MFU: "
        "as in section 1 (PaLM's FLOP count of the model, the same for both, over the GEMM peak measured in this "
        f"precision, {peer['gemm_peak'] / 1e9:.0f} GFLOP/s).",
        "",
        "| PE | lenext tokens/s | x-transformers tokens/s | lenext / x-transformers | range | target | meets "
        "| MFU lenext | MFU x-transformers |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for name in peer["rows"]:
        row = peer[name]
        lines.append(
            f"| {name} | {row['tokens_per_s']:.0f} | {row['peer_tokens_per_s']:.0f} | {row['ratio']:.2f} | "
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f} | >= {PEER_TARGET} | "
            f"{'yes' if row['ratio'] >= PEER_TARGET else '**no**'} | {row['mfu']:.2f} | {row['peer_mfu']:.2f} |"
        )
    return lines


# --------------------------------------------------------------------------------------------
# 7. The optimizer: lenext's fused AdamW against torch's default


class TimedOptimizerRow(TrainingRow):
    """NoPE's row of section 1 with ``optimizer``, timing its steps alone as well (``optimizer_s``)."""

    def __init__(self, precision: str, optimizer):
        super().__init__("nope", precision)
        self.optimizer, self.optimizer_s = optimizer(self.net.parameters(), lr=1e-4), []
        step = self.optimizer.step

        def timed_step():
            start = time.perf_counter()
            step()
            self.optimizer_s.append(time.perf_counter() - start)

        self.optimizer.step = timed_step


def bench_adamw(precision, batch, warmup, steps, reps, log):
    """NoPE's training tokens/s with lenext's AdamW and with torch's default (medians), their ratio paired by
    repetition, and each arm's optimizer step alone (median milliseconds of the timed steps)."""
    arms = {"lenext": TimedOptimizerRow(precision, adamw), "default": TimedOptimizerRow(precision, torch.optim.AdamW)}
    assert arms["lenext"].optimizer.defaults["fused"] and not arms["default"].optimizer.defaults["fused"]
    for arm in arms.values():
        arm.net.load_state_dict(arms["lenext"].net.state_dict())  # the same weights: the same step, twice
    rates = interleaved_rates(arms, batch, warmup, steps, reps, log)
    paired = [f / d for f, d in zip(rates["lenext"], rates["default"], strict=True)]
    return {
        "parameters": sum(p.numel() for p in arms["lenext"].net.parameters()),
        "ratio": statistics.median(paired),
        "ratio_min": min(paired),
        "ratio_max": max(paired),
        **{
            name: {
                "tokens_per_s": statistics.median(rates[name]),
                "optimizer_ms": statistics.median(arm.optimizer_s[warmup:]) * 1e3,
                "step_ms": batch * TRAIN_LEN / statistics.median(rates[name]) * 1e3,
            }
            for name, arm in arms.items()
        },
    }


def render_adamw(settings, result) -> list[str]:
    lines = [
        "## AdamW",
        "",
        f"NoPE's row of section 1 ({result['parameters']:,} parameters, L={settings['train_length']}, batch "
        f"{settings['train_batch']}) with lenext's AdamW (`lenext.module.adamw`: torch's fused kernel) and with "
        "torch's default AdamW (on a CPU, a loop of operations per tensor), from the same weights, interleaved "
        f"round-robin over {settings['reps']} repetitions of {timed_steps(settings)} after {settings['warmup']} "
        "warmup steps. tokens/s: medians; the optimizer's step alone: median of the timed steps; ratio: median over "
        "repetitions of lenext / default in the same repetition, with its range.",
        "",
        "| AdamW | tokens/s | step ms | optimizer step ms |",
        "|---|---:|---:|---:|",
    ]
    for name, words in (("lenext", "lenext's (fused)"), ("default", "torch's default")):
        arm = result[name]
        lines.append(f"| {words} | {arm['tokens_per_s']:.0f} | {arm['step_ms']:.0f} | {arm['optimizer_ms']:.1f} |")
    lines += [
        "",
        f"lenext / default: **{result['ratio']:.3f}** ({result['ratio_min']:.2f}-{result['ratio_max']:.2f}).",
    ]
    return lines


# --------------------------------------------------------------------------------------------
# 2. Forward pass of the whole model, one (PE, length) per subprocess


def _proc_status(field: str) -> int:
    """A /proc/self/status field in KiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def forward_worker(cell: dict) -> dict:
    row, length, precision, repeats = cell["pe"], cell["length"], cell["precision"], cell["repeats"]
    net = row_model(row)[0].eval()
    tokens, targets = random_batch(1, length, net.vocab_size)
    with torch.no_grad(), autocast(precision):
        net.token_nll(*random_batch(1, 64, net.vocab_size))  # kernels, oneDNN primitives, lazy init
        rss_before = _proc_status("VmRSS")
        peak_reset = _reset_peak_rss()
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        times = []
        try:
            for _ in range(repeats):
                start = time.perf_counter()
                nll = net.token_nll(tokens, targets)
                times.append(time.perf_counter() - start)
        except LengthNotSupported as error:
            return {"status": "n/a", "reason": f"LengthNotSupported: {error}"}
    if peak_reset:
        peak = _proc_status("VmHWM")
        method = "VmHWM"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss" + (" (lower bound: earlier peak)" if maxrss_before > rss_before else "")
    return {
        "status": "ok",
        "ms": 1000 * min(times),
        "ms_first": 1000 * times[0],
        "extra_mb": max(0, peak - rss_before) / 1024,
        "rss_before_mb": rss_before / 1024,
        "peak_method": method,
        "mean_nll": float(nll.mean()),
    }


def run_forward_subprocess(row, length, precision, repeats, timeout):
    cell = {"pe": row, "length": length, "precision": precision, "repeats": repeats}
    command = [sys.executable, str(Path(__file__).resolve()), "--_forward-worker", json.dumps(cell)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timeout after {timeout} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        reason = "killed (out of memory?)" if done.returncode < 0 else tail[0]
        return {"status": "error", "reason": f"exit {done.returncode}: {reason}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_forward(precision, lengths, timeout, log, rows):
    results = {}
    for length in lengths:
        repeats = 3 if length <= 2048 else 1
        for row in rows:
            start = time.perf_counter()
            result = results[(row, length)] = run_forward_subprocess(row, length, precision, repeats, timeout)
            if result["status"] == "ok":
                detail = f"{result['ms']:9.1f} ms  {result['extra_mb']:8.1f} MB extra"
            else:
                detail = f"{result['status']}: {result['reason'][:80]}"
            log(f"  forward {row:<19} L={length:<6} {detail}   ({time.perf_counter() - start:.1f} s wall)")
    return results


# --------------------------------------------------------------------------------------------
# 3. Shaw attention: lenext gather path vs naive (L, L, d_head) einsum


def naive_shaw_attention(q, k, v, table, clip):
    """Reference: rel = table[clip(j - i) + k] -> (L, L, d); scores = q k^T + einsum(q, rel)."""
    length, head_dim = q.size(-2), q.size(-1)
    positions = torch.arange(length)
    offsets = (positions[None, :] - positions[:, None]).clamp(-clip, clip) + clip  # (L, L), j - i
    rel = table[offsets]  # (L, L, d)
    scores = q @ k.transpose(-2, -1) + torch.einsum("bhid,ijd->bhij", q, rel)
    scores = scores / math.sqrt(head_dim)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.float().softmax(-1).to(v.dtype) @ v


def bench_shaw(precision, length, reps, log, heads=8, head_dim=64, clip=16):
    shape = pes.AttentionShape(d_model=heads * head_dim, n_heads=heads, n_layers=1, train_len=length)
    torch.manual_seed(SEED)
    pe = pes.ShawRelative(shape, k=clip)
    # Under bf16, q/k/v are bf16 as they are in the model (outputs of an autocast Linear).
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    q, k, v = (torch.randn(1, heads, length, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    inputs = [q, k, v, pe.key_table]

    positions = sequential_positions(length)

    def lenext_path():
        return causal_attention(q, k, v, pe.layer(0).terms(None, q, k, positions))

    def naive_path():
        return naive_shaw_attention(q, k, v, pe.key_table[0], clip)

    def no_bias_path():  # the floor: the same attention without any bias
        return causal_attention(q, k, v)

    def fwd_bwd(fn):
        for tensor in inputs:
            tensor.grad = None
        start = time.perf_counter()
        with autocast(precision):
            out = fn()
        out.float().sum().backward()
        elapsed = time.perf_counter() - start
        return elapsed, out.detach().float(), [t.grad.detach().clone() for t in inputs if t.grad is not None]

    # Correctness check and warmup.
    _, out_lenext, grads_lenext = fwd_bwd(lenext_path)
    _, out_naive, grads_naive = fwd_bwd(naive_path)
    max_out_err = (out_lenext - out_naive).abs().max().item()
    max_grad_err = max((a - b).abs().max().item() for a, b in zip(grads_lenext, grads_naive, strict=True))
    paths = {"lenext": lenext_path, "naive": naive_path, "no_bias": no_bias_path}
    fwd_bwd(no_bias_path)
    times = {name: [] for name in paths}
    for rep in range(reps):  # interleaved
        for name, path in paths.items():
            times[name].append(fwd_bwd(path)[0])
        log(f"  shaw rep {rep + 1}/{reps}: " + ", ".join(f"{n} {1000 * t[-1]:.0f} ms" for n, t in times.items()))
    lenext_ms, naive_ms, no_bias_ms = (1000 * statistics.median(times[name]) for name in paths)
    return {
        "length": length,
        "heads": heads,
        "head_dim": head_dim,
        "k": clip,
        "lenext_ms": lenext_ms,
        "naive_ms": naive_ms,
        "no_bias_ms": no_bias_ms,
        "speedup": naive_ms / lenext_ms,
        "max_out_err": max_out_err,
        "max_grad_err": max_grad_err,
    }


# --------------------------------------------------------------------------------------------
# 4. The study recipe's training step: lenext's LightningModule under a lightning.Trainer vs a bare loop

STUDY_LEN, STUDY_BATCH = 64, 32
STUDY_TOKENS_PER_STEP = STUDY_LEN * STUDY_BATCH
STUDY_OVERRIDES = [
    "trainer=cpu",
    "model=compact",
    "data.vocab_size=2048",
    f"data.max_len={STUDY_LEN}",
    f"data.batch_size={STUDY_BATCH}",
    "module.lr=3e-3",
    "trainer.enable_progress_bar=false",
]
LIGHTNING_TARGET = 1.10  # Lightning's step time / the bare loop's
SECOND_STAGE = "lightning, second stage"
STAGE_OVERRIDES = ["pe.scaling=yarn", "pe.factor=4"]  # a context-extension stage, at the base's length and batch
STAGE_TARGET = 1.05  # a second stage's step time / its base's: it trains at the base's tokens/s
COMPILED = "bare, torch.compile"


def study_config(output_dir: str, precision: str, steps: int, extra: tuple[str, ...] = ()) -> DictConfig:
    """train.py's config at the study size, training ``steps`` steps with no validation in between."""
    overrides = [
        *extra,
        *STUDY_OVERRIDES,
        f"trainer.precision={precision}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
    ]
    return train_config(overrides, output_dir)


def study_loader(cfg, steps: int) -> DataLoader:
    """The data module's training batches (``lenext.data.loaders.step_loader``) of ``steps`` steps, over random
    tokens."""
    tokens = steps * cfg.data.batch_size * cfg.data.max_len + 1  # as many windows as the steps take
    stream = torch.randint(
        0, cfg.data.vocab_size, (tokens,), dtype=torch.int32, generator=torch.Generator().manual_seed(SEED)
    )
    return step_loader(TrainWindows(stream.numpy(), cfg.data.max_len), cfg.data.batch_size, cfg.seed, None, 0)


def study_net(cfg) -> Decoder:
    """The net train.py trains from ``cfg`` from scratch."""
    return run_net(resolve(cfg, config_pe_name(cfg), sweeps=False), cfg.data.vocab_size)


def study_module(cfg):
    """lenext's LanguageModel as lenext.run.build makes it from ``cfg`` (a second stage's with its base's weights)."""
    spec, weights = resolve_training(cfg)
    return build_module(cfg.module, spec, run_net(spec, cfg.data.vocab_size, weights))


def mean_step_seconds(ends: list[float]) -> float:
    """A step's mean wall time from the end of the first step (untimed: the optimizer's state made there) to the
    end of the last. On CUDA only those two ends wait for the GPU: a wait at every step would expose the host's
    work between steps, which a run without one overlaps with the GPU's."""
    return (ends[-1] - ends[0]) / (len(ends) - 1)


class StepClock(L.Callback):
    """The time at the end of every training step (on CUDA the first and last waiting for the GPU:
    ``mean_step_seconds``); ``on_step`` (a profiler's ``step``) called after each."""

    def __init__(self, on_step=None):
        self.ends, self.on_step = [], on_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if module.device.type == "cuda" and (not self.ends or trainer.global_step >= trainer.max_steps):
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        if self.on_step:
            self.on_step()


def lightning_steps(cfg, module, loader, save_to: str | None = None, on_step=None) -> list[float]:
    """Fit ``module`` with the trainer, callbacks and loggers train.py builds from ``cfg``; step end times. The
    fitted module is saved to ``save_to`` when given (a base for a second stage); ``on_step`` is called after each
    step."""
    clock = StepClock(on_step)
    callbacks = [instantiate(c, f"callbacks.{name}") for name, c in cfg.callbacks.items()] + [clock]
    loggers = [instantiate(c, f"logger.{name}") for name, c in cfg.logger.items()]
    trainer = instantiate(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers)
    trainer.fit(module, train_dataloaders=loader)
    if save_to:
        trainer.save_checkpoint(save_to, weights_only=False)
    return clock.ends


def bare_steps(cfg, net, loader, device: str = "cpu", on_step=None) -> list[float]:
    """The same training by hand: autocast, loss, backward, gradient clipping, AdamW and schedule steps; the
    batches moved to ``device`` (``net``'s), as Lightning moves them; ``on_step`` is called after each step."""
    optim = cfg.module
    optimizer, scheduler = adamw_with_schedule(
        net,
        cfg.trainer.max_steps,
        optim.lr,
        optim.weight_decay,
        tuple(optim.betas),
        optim.warmup_steps,
        optim.min_lr_ratio,
    )
    ends = []
    for index, batch in enumerate(loader):
        tokens = batch["tokens"].to(device, non_blocking=True)
        with precision_autocast(torch.device(device), cfg.trainer.precision):
            loss = net.token_nll(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        net.pe.project_()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if device == "cuda" and index in (0, len(loader) - 1):  # as StepClock
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        if on_step:
            on_step()
    return ends


def bench_lightning(reps, steps, log, compiled=True):
    """Per-step wall time of Lightning and the bare loop at the machine's default precision, of a second stage
    under Lightning from the first arm's checkpoint, of the bare loop at the other precision and (``compiled``)
    of the bare loop with the model under ``torch.compile``; arms interleaved, each repetition a fresh fit of
    ``steps`` + 1 steps (the first step, with the optimizer's lazy state, is not timed; compilation happens in the
    warmup run)."""
    chosen = default_precision("cpu")
    other = "32-true" if chosen.startswith("bf16") else "bf16-mixed"
    arms = {"lightning": chosen, SECOND_STAGE: chosen, "bare": chosen, f"bare {other}": other}
    if compiled:
        arms[COMPILED] = chosen
    with tempfile.TemporaryDirectory() as output_dir:
        cfgs = {precision: study_config(output_dir, precision, steps + 1) for precision in (chosen, other)}
        loader = study_loader(cfgs[chosen], steps + 1)
        modules = {"lightning": study_module(cfgs[chosen])}
        base = os.path.join(output_dir, "base.ckpt")
        lightning_steps(cfgs[chosen], modules["lightning"], loader, save_to=base)  # also the first arm's warmup
        stage_cfg = study_config(
            os.path.join(output_dir, "stage"), chosen, steps + 1, (f"init_from={base}", *STAGE_OVERRIDES)
        )
        modules[SECOND_STAGE] = study_module(stage_cfg)
        nets = {"bare": study_net(cfgs[chosen]), f"bare {other}": study_net(cfgs[other])}
        if compiled:
            nets[COMPILED] = study_net(cfgs[chosen])
            nets[COMPILED].compile()  # in place: token_nll's self(tokens) runs the compiled forward
        for net in nets.values():
            net.train()

        def run(arm):
            cfg = stage_cfg if arm == SECOND_STAGE else cfgs[arms[arm]]
            # Regenerating views by replaying their view functions fails at RoPE's graph break (docs/performance.md).
            with torch._functorch.config.patch(view_replay_for_aliased_outputs=False):
                ends = (
                    lightning_steps(cfg, modules[arm], loader) if arm in modules else bare_steps(cfg, nets[arm], loader)
                )
            return mean_step_seconds(ends)

        for arm in list(arms)[1:]:  # warmup: oneDNN primitives, autocast, Lightning's first fit (the base's: above)
            run(arm)
        times = {arm: [] for arm in arms}
        for rep in range(reps):
            for arm in list(arms)[rep % len(arms) :] + list(arms)[: rep % len(arms)]:
                times[arm].append(run(arm))
            log(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{a} {1000 * t[-1]:.1f} ms" for a, t in times.items()))

    def paired(arm, baseline):
        ratios = [a / b for a, b in zip(times[arm], times[baseline], strict=True)]
        return statistics.median(ratios), [min(ratios), max(ratios)]

    result = {
        "precision": chosen,
        "other_precision": other,
        "arms": arms,
        "step_ms": {arm: 1000 * statistics.median(t) for arm, t in times.items()},
        "times": times,
    }
    result["lightning_vs_bare"], result["lightning_vs_bare_range"] = paired("lightning", "bare")
    result["stage_vs_base"], result["stage_vs_base_range"] = paired(SECOND_STAGE, "lightning")
    result["other_vs_chosen"], result["other_vs_chosen_range"] = paired(f"bare {other}", "bare")
    if compiled:
        result["compiled_vs_eager"], result["compiled_vs_eager_range"] = paired(COMPILED, "bare")
    return result


# --------------------------------------------------------------------------------------------
# Contention: CPU time that other processes took while a section ran


class CpuMeter:
    """Busy CPU seconds of the whole machine minus those of this process and its waited-for children."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return time.perf_counter(), busy, own

    def stop(self) -> dict:
        (w0, b0, o0), (w1, b1, o1) = self.start, self._sample()
        wall = w1 - w0
        foreign = max(0.0, (b1 - b0) - (o1 - o0))
        return {
            "wall_s": wall,
            "own_cpu_s": o1 - o0,
            "foreign_cpu_s": foreign,
            "foreign_cores": foreign / wall if wall > 0 else 0.0,
        }


# --------------------------------------------------------------------------------------------
# Report


def machine_info(precision: str) -> dict:
    return {
        **machine_description(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "precision": precision,
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
    }


def render_header(info, settings, elapsed) -> list[str]:
    contention = settings["contention"]
    return [
        "# lenext benchmark",
        "",
        f"- CPU: {info['cpu']}, ISA {info['isa']} (native bf16: {'yes' if info['native_bf16'] else 'no'}; "
        f"{info['cores']} cores; torch threads {info['torch_threads']})"
        + (f"; GPU: {info['gpu']}" if info["gpu"] else ""),
        f"- torch {info['torch']}, Python {info['python']}",
        "- memory: "
        + (
            "glibc keeps freed memory for the next step (`lenext.hardware.keep_freed_memory`), as train.py does"
            if settings["keeps_freed_memory"]
            else "the C library's default (`lenext.hardware.keep_freed_memory` did not apply here)"
        ),
        f"- precision of sections 1-3: {info['precision']}"
        + (" (torch.autocast('cpu', dtype=torch.bfloat16))" if info["precision"] == "bf16" else ""),
        f"- date: {info['date']}",
        f"- command: `{settings['command']}`",
        f"- total run time: {elapsed / 60:.1f} min",
        "- CPU taken by other processes while each section ran (cores busy on average, out of "
        f"{info['cores']}): "
        + ", ".join(f"{k} {v['foreign_cores']:.2f}" for k, v in contention.items())
        + (
            " -- **the machine was shared; absolute numbers are pessimistic and noisy**"
            if max(v["foreign_cores"] for v in contention.values()) > 0.2
            else ""
        ),
    ]


def render_training(settings, training) -> list[str]:
    model = settings["model"]
    added = [f"`{' '.join(SETTING_ROWS[row])}` ({row})" for row in training["rows"] if row in SETTING_ROWS]
    settings_words = f"; `<pe>+<setting>` adds {', '.join(added)}" if added else ""
    lines = [
        "## Training throughput",
        "",
        f"Small model ({model_words(model)}, vocab {model['vocab_size']}), "
        f"L={settings['train_length']}, batch {settings['train_batch']}, "
        "one step = forward `token_nll().mean()`, backward, AdamW step, zero_grad; same random batch for "
        f"every PE. {settings['warmup']} warmup steps per PE, then {settings['reps']} repetitions "
        f"round-robin over the PEs of {timed_steps(settings)} each. "
        "tokens/s: median over repetitions; ratio: median over repetitions of (PE / nope in the same repetition), "
        "with the min-max range. MFU: model FLOPs per second (PaLM's count: 6 N per token for the weights, N "
        "without the token embedding, plus 6 x layers x d_model x L for causal attention; a PE's own work "
        f"not counted) over the GEMM peak measured in this precision ({training['gemm_peak'] / 1e9:.0f} GFLOP/s: "
        f"the best of ten 2048 x 2048 matmuls). A row's model is the one `train.py pe=<pe> {' '.join(MODEL)}` "
        f"trains{settings_words}.",
        "",
        "| PE | tokens/s | ratio vs nope | range | target | meets | MFU |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    for name in training["rows"]:
        row = training[name]
        target = TARGETS.get(name)
        meets = "" if target is None else ("yes" if row["ratio"] >= target else "**no**")
        lines.append(
            f"| {name} | {row['tokens_per_s']:.0f} | {row['ratio']:.3f} | "
            f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f} | "
            f"{'' if target is None else f'>= {target}'} | {meets} | {row['mfu']:.2f} |"
        )
    if "rope" not in training or not training["sampling_ms"]:  # no drawn-positions row measured
        return lines
    rope_step_ms = settings["train_batch"] * settings["train_length"] / training["rope"]["tokens_per_s"] * 1e3
    lines += [
        "",
        f"`rope+<scheme>`: RoPE at positions drawn every step as training draws them (`train.positions`, "
        f"N = L_t = {' / '.join(map(str, training['reach']))}). Drawing one batch's positions (median of 50 draws) "
        f"against a RoPE step ({rope_step_ms:.0f} ms), target < {SAMPLING_TARGET:.0%}:",
        "",
    ]
    for name, ms in training["sampling_ms"].items():
        share = ms / rope_step_ms
        verdict = "meets" if share < SAMPLING_TARGET else "**misses**"
        lines.append(f"- {name}: {ms:.2f} ms, {share:.2%} of a step ({verdict})")
    return lines


def render_forward(settings, forward) -> list[str]:
    lengths, chunk = settings["lengths"], LOGIT_CHUNK_ELEMENTS["cpu"] // settings["model"]["vocab_size"]
    rows = list(dict.fromkeys(name for name, _ in forward))
    lines = [
        "## Forward pass (whole model, eval, no_grad, batch 1)",
        "",
        f"One `token_nll` forward (logits in chunks of {chunk} tokens) "
        "per cell, each (PE, L) in a fresh process after a warmup forward at L=64. Cell: wall ms / peak extra MB "
        "(peak RSS during the forward minus RSS just before it). Time: min of 3 runs for L <= 2048, a single run "
        "above.",
        "",
        "| PE | " + " | ".join(f"L={length}" for length in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for name in rows:
        cells = []
        for length in lengths:
            result = forward[(name, length)]
            if result["status"] == "ok":
                cells.append(f"{result['ms']:.0f} ms / {result['extra_mb']:.0f} MB")
            elif result["status"] == "n/a":
                cells.append("n/a (LengthNotSupported)")
            else:
                cells.append(f"error: {result['reason'][:60]}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    methods = {r.get("peak_method") for r in forward.values() if r["status"] == "ok"}
    return [*lines, "", f"Peak measured with: {', '.join(sorted(methods)) or 'n/a'}."]


def render_shaw(settings, shaw) -> list[str]:
    return [
        "## Shaw attention: lenext vs naive einsum",
        "",
        f"Attention alone at L={shaw['length']} (B=1, H={shaw['heads']}, d_head={shaw['head_dim']}, "
        f"k={shaw['k']}), forward+backward, median of {settings['shaw_reps']} interleaved runs: "
        f"lenext `causal_attention` with `ShawRelative` {shaw['lenext_ms']:.0f} ms vs naive "
        f"(L, L, d_head) einsum {shaw['naive_ms']:.0f} ms: **{shaw['speedup']:.1f}x speedup** "
        f"(max |diff| output {shaw['max_out_err']:.1e}, gradients {shaw['max_grad_err']:.1e}). "
        f"The same attention without any bias (NoPE, SDPA `is_causal`) took {shaw['no_bias_ms']:.0f} ms "
        "in the same runs: the floor for any biased path.",
    ]


def bench_hf(precision, length, reps, log) -> dict:
    """``eval.py hf=``'s evaluation of a Hugging Face model (lenext.hf.HFLanguageModel in lenext's
    ``evaluate_length``) against a bare transformers loop over the same nonoverlap windows in the same batches: one
    forward of the model, cross-entropy on its logits. A random Llama of the small model's width (transformers'
    config, no download), random documents; wall time and peak extra memory, interleaved repetitions."""
    import transformers

    from lenext.evaluate import PeakMemory
    from lenext.hf import HFLanguageModel
    from lenext.protocols import NonOverlapping
    from lenext.scoring import evaluate_length

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=length,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    net = HFLanguageModel(model)
    documents = [np.random.default_rng(d).integers(0, 8192, size=4 * length + 1).astype(np.int32) for d in range(4)]
    windows = NonOverlapping().windows([len(d) for d in documents], length)
    tokens_per_batch = 2 * length  # two windows a batch
    dtype = "bf16-mixed" if precision == "bf16" else "32-true"

    def lenext_path():
        return evaluate_length(net, documents, windows, length, tokens_per_batch, False, dtype)["mean_nll"]

    @torch.no_grad()
    def bare_path():
        total, count = 0.0, 0
        for b in range(0, len(windows), 2):
            group = windows[b : b + 2]
            ids = torch.from_numpy(np.stack([documents[w.document][w.start : w.start + length + 1] for w in group]))
            ids = ids.long()
            with precision_autocast(torch.device("cpu"), dtype):
                logits = model(input_ids=ids[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            total, count = total + nll.item(), count + ids[:, 1:].numel()
        return total / count

    paths = {"lenext": lenext_path, "bare": bare_path}
    values = {name: path() for name, path in paths.items()}  # warmup, and the same number both ways
    times = {name: [] for name in paths}
    peaks = {name: [] for name in paths}
    for rep in range(reps):
        for name, path in paths.items():
            with PeakMemory(torch.device("cpu")) as memory:
                start = time.perf_counter()
                path()
                times[name].append(time.perf_counter() - start)
            peaks[name].append(memory.peak_mb)
        log(f"  hf rep {rep + 1}/{reps}: " + ", ".join(f"{n} {1000 * t[-1]:.0f} ms" for n, t in times.items()))
    ratios = [a / b for a, b in zip(times["lenext"], times["bare"], strict=True)]
    return {
        "length": length,
        "windows": len(windows),
        "parameters": sum(p.numel() for p in model.parameters()),
        "lenext_ms": 1000 * statistics.median(times["lenext"]),
        "bare_ms": 1000 * statistics.median(times["bare"]),
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "lenext_mb": statistics.median(peaks["lenext"]),
        "bare_mb": statistics.median(peaks["bare"]),
        "nll_diff": abs(values["lenext"] - values["bare"]),
    }


def render_hf(settings, hf) -> list[str]:
    low, high = hf["ratio_range"]
    return [
        "## `eval.py hf=` against a bare transformers loop",
        "",
        f"A random Llama ({hf['parameters'] / 1e6:.1f}M parameters, transformers' `LlamaForCausalLM`, vocabulary 8192) "
        f"evaluated at L={hf['length']} on {hf['windows']} nonoverlap windows, two a batch, median of "
        f"{settings['hf_reps']} interleaved runs: lenext's path (`lenext.hf.HFLanguageModel` in `evaluate_length`, "
        f"logits a chunk of positions at a time) {hf['lenext_ms']:.0f} ms against a bare loop (the model's forward, "
        f"cross-entropy on its full logits) {hf['bare_ms']:.0f} ms: **{hf['ratio']:.2f}x** the bare loop's time "
        f"(paired {low:.2f}-{high:.2f}); peak extra memory {hf['lenext_mb']:.0f} MB against {hf['bare_mb']:.0f} MB; "
        f"mean NLL equal within {hf['nll_diff']:.1e}. Target: within 10% of its time and of its memory.",
    ]


def render_lightning(info, settings, lightning) -> list[str]:
    chosen, other = lightning["precision"], lightning["other_precision"]
    step_ms = lightning["step_ms"]
    low, high = lightning["lightning_vs_bare_range"]
    other_low, other_high = lightning["other_vs_chosen_range"]
    ratio = lightning["lightning_vs_bare"]
    verdict = "met" if ratio <= LIGHTNING_TARGET else "**not met**"
    stage, (stage_low, stage_high) = lightning["stage_vs_base"], lightning["stage_vs_base_range"]
    stage_verdict = "met" if stage <= STAGE_TARGET else "**not met**"
    lines = [
        "## The study's training step: Lightning vs a bare PyTorch loop",
        "",
        f"The CPU study's recipe ({' '.join(STUDY_OVERRIDES)}; rope, gelu MLP, AdamW with warmup + cosine, "
        "gradient clipping 1.0) on "
        f"{info['cpu']} ({info['isa']}). **lightning**: lenext's `LanguageModel` fitted by a `lightning.Trainer` "
        "built from `configs/trainer/cpu.yaml` with the default callbacks (checkpoints, learning-rate "
        "monitor) and CSV logger, as `train.py` builds them; **bare**: the same model, optimizer parameter groups, "
        "schedule, clipping and batches (lenext's `TrainWindows` + `StepShuffler` over random tokens) in a "
        "hand-written loop. "
        f"Wall time per step, from the end of step 1 to the end of step {settings['lightning_steps'] + 1} of a fit; "
        f"the arms interleaved over {settings['lightning_reps']} repetitions; medians, and ratios paired within a "
        "repetition with their min-max range.",
        "",
        "| arm | precision | ms / step | tokens/s |",
        "|---|---|---:|---:|",
        *(
            f"| {arm} | {lightning['arms'][arm]} | {ms:.1f} | {STUDY_TOKENS_PER_STEP / ms * 1000:,.0f} |"
            for arm, ms in step_ms.items()
        ),
        "",
        f"- Lightning / bare at {chosen} (this machine's default precision): **{ratio:.3f}** "
        f"({low:.2f}-{high:.2f}); target <= {LIGHTNING_TARGET}: {verdict}",
        f"- bare loop, {other} / {chosen} step time: **{lightning['other_vs_chosen']:.2f}** "
        f"({other_low:.2f}-{other_high:.2f})",
        f"- second stage / its base, both under Lightning at {chosen}: **{stage:.3f}** ({stage_low:.2f}-"
        f"{stage_high:.2f}); target <= {STAGE_TARGET}: {stage_verdict}. The second stage is train.py's "
        f"`init_from=<the lightning arm's checkpoint> {' '.join(STAGE_OVERRIDES)}` at the base's length and batch: "
        "a context-extension stage trains at its base's tokens/s (at a longer L' each step costs what a base "
        "trained at L' would)",
    ]
    if "compiled_vs_eager" in lightning:
        c_low, c_high = lightning["compiled_vs_eager_range"]
        lines.append(
            f"- bare loop, `torch.compile` (inductor) / eager step time at {chosen}: "
            f"**{lightning['compiled_vs_eager']:.2f}** ({c_low:.2f}-{c_high:.2f}); compilation itself is not timed"
        )
    return lines


SECTION_MARKERS = {  # heading -> the name docs/performance.md includes the section's body by (pymdownx.snippets)
    "# lenext benchmark": "machine",
    "## Training throughput": "training",
    "## Forward pass": "forward",
    "## Shaw attention": "shaw",
    "## The study's training step": "lightning",
    "## `eval.py hf=`": "hf",
    "## Against x-transformers": "peer",
    "## AdamW": "adamw",
}


def with_section_markers(text: str) -> str:
    """Each known section's body between snippet markers (HTML comments, unseen where Markdown renders), so that a
    page includes a section by name, whatever the number of rows before it."""
    out, open_name = [], None
    for line in text.rstrip("\n").split("\n"):
        name = next((n for heading, n in SECTION_MARKERS.items() if line.startswith(heading)), None)
        if name or (line.startswith("#") and open_name):
            if open_name:
                out += [f"<!-- --8<-- [end:{open_name}] -->", ""]
            out += [line, f"<!-- --8<-- [start:{name}] -->"] if name else [line]
            open_name = name
            continue
        out.append(line)
    if open_name:
        out.append(f"<!-- --8<-- [end:{open_name}] -->")
    return "\n".join(out) + "\n"


def render(
    info, settings, elapsed, training=None, forward=None, shaw=None, lightning=None, hf=None, peer=None, adamw=None
) -> str:
    sections = [render_header(info, settings, elapsed)]
    if training is not None:
        sections.append(render_training(settings, training))
    if forward is not None:
        sections.append(render_forward(settings, forward))
    if shaw is not None:
        sections.append(render_shaw(settings, shaw))
    if lightning is not None:
        sections.append(render_lightning(info, settings, lightning))
    if hf is not None:
        sections.append(render_hf(settings, hf))
    if peer is not None:
        sections.append(render_peer(settings, peer))
    if adamw is not None:
        sections.append(render_adamw(settings, adamw))
    return with_section_markers("\n\n".join("\n".join(lines) for lines in sections))


FULL = dict(
    train_batch=BATCH,
    warmup=2,
    reps=10,  # one step each: paired ratios compare steps close in time (the host is noisy)
    steps=1,
    lengths=[512, 2048, 8192, 16384],
    shaw_reps=5,
    lightning_reps=6,
    lightning_steps=20,
    hf_reps=5,
)
QUICK = dict(
    train_batch=2,
    warmup=1,
    reps=2,
    steps=1,
    lengths=[512, 2048],
    shaw_reps=1,
    lightning_reps=1,
    lightning_steps=3,
    hf_reps=1,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=tuple(TRAINER_PRECISION), default="fp32")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    parser.add_argument("--out", type=Path, help="Markdown output (default benchmarks/bench.md or bench-bf16.md)")
    parser.add_argument("--reps", type=int, help="training repetitions (round-robin over PEs)")
    parser.add_argument("--steps", type=int, help="timed training steps per PE per repetition")
    parser.add_argument("--warmup", type=int, help="warmup training steps per PE")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], help="forward lengths")
    parser.add_argument("--lightning-reps", type=int, help="repetitions of the Lightning vs bare loop comparison")
    parser.add_argument("--lightning-steps", type=int, help="timed steps per arm per repetition there")
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        default=SECTIONS,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--rows",
        type=lambda s: s.split(","),
        help="comma-separated rows of the training and forward sections, e.g. cope,fox,nope+ssmax (default: all; "
        "training always runs nope, its baseline), and those of them the peer section has",
    )
    parser.add_argument("--_forward-worker", dest="forward_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.rows or []) - set(training_rows()) - set(forward_rows()))
    if unknown:
        parser.error(f"--rows: {', '.join(unknown)} not a row; rows are {', '.join(training_rows())}")
    keeps_freed_memory = keep_freed_memory()  # as train.py and eval.py run

    if args.forward_worker:
        print(json.dumps(forward_worker(json.loads(args.forward_worker))))
        return

    settings = dict(QUICK if args.quick else FULL, train_length=TRAIN_LEN)
    for key in ("reps", "steps", "warmup", "lengths", "lightning_reps", "lightning_steps"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    settings["keeps_freed_memory"] = keeps_freed_memory
    settings["model"] = small_shape()
    out = args.out or REPO / ("benchmarks/bench-bf16.md" if args.precision == "bf16" else "benchmarks/bench.md")

    started = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    info = machine_info(args.precision)
    log(
        f"{info['cpu']} ({info['isa']}), {info['cores']} cores, torch {info['torch']}, {args.precision}, "
        f"settings {json.dumps({k: v for k, v in settings.items() if k != 'command'})}"
    )

    contention = settings["contention"] = {}

    def measured(section, fn, *fn_args, **fn_kwargs):
        if section not in args.sections:
            return None
        log(section)
        meter = CpuMeter()
        result = fn(*fn_args, **fn_kwargs)
        contention[section] = meter.stop()
        log(
            f"  {section}: {contention[section]['wall_s']:.0f} s, other processes busy "
            f"{contention[section]['foreign_cores']:.2f} cores on average"
        )
        return result

    peer_rows = [row for row in PEER_PES if row in (args.rows or PEER_PES)]
    if "peer" in args.sections and not peer_rows:
        log(f"peer: skipped, --rows names none of its PEs ({', '.join(PEER_PES)})")
        args.sections = [section for section in args.sections if section != "peer"]
    # The training-step sections' shared arguments: precision, batch, warmup steps, timed steps, repetitions, log
    timed = (args.precision, settings["train_batch"], settings["warmup"], settings["steps"], settings["reps"], log)
    training = measured("training", bench_training, *timed, training_rows(args.rows))
    forward = measured(
        "forward",
        bench_forward,
        args.precision,
        settings["lengths"],
        timeout=900,
        log=log,
        rows=forward_rows(args.rows),
    )
    shaw = measured("shaw", bench_shaw, args.precision, 2048, settings["shaw_reps"], log)
    lightning = measured(
        "lightning",
        bench_lightning,
        settings["lightning_reps"],
        settings["lightning_steps"],
        log,
        compiled=not args.quick,  # compiling takes minutes: not in a smoke test
    )

    hf = measured("hf", bench_hf, args.precision, 1024, settings["hf_reps"], log)
    peer = measured("peer", bench_peer, *timed, peer_rows)
    optimizer = measured("adamw", bench_adamw, *timed)
    text = render(
        info, settings, time.perf_counter() - started, training, forward, shaw, lightning, hf, peer, optimizer
    )
    write_atomic(out, text)
    print()
    print(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
