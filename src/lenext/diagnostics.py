"""Why a PE fails beyond L_train: attention statistics per layer and head against evaluation length, RoPE's rotation
coverage and the relative distances each position scheme trains (docs/diagnostics.md, the definitions).

``python diagnose.py ckpt=<run folder or .ckpt>`` (``lenext-diagnose``) rebuilds a checkpoint as eval.py does
(lenext.checkpoints, lenext.resolve, lenext.build), runs a few held-out windows at each length with
``lenext.attention.recording`` on, and streams each query block's attention weights into per-(layer, head) sums:
memory O(a block), never an (L, L) tensor. It writes ``diagnostics.json`` and ``diagnostics.png`` into its folder.

Statistics of a query row i with weights a_ij over the n_i keys it attends (i - j its distance to key j, in tokens):

- ``entropy``: H_i = -sum_j a_ij log a_ij (nats); ``normalized_entropy``: H_i / log n_i (rows with n_i >= 2);
- ``sink``: a_i0, the weight on the window's first token;
- ``distance``: sum_j a_ij (i - j);
- ``beyond``: sum of a_ij over keys with i - j >= L_train.

Each is averaged over all query rows of all windows at a length (``rows``: ``all``), and over the rows i >= L_train
alone (``beyond_train``; none at a length <= L_train).

And at each length L, the in-context copying score (``copying``; Olsson et al. 2022's induction measurement in
spirit): each window's first h = L // 2 tokens w_0..w_{h-1} twice in a row (odd L: w_h at the end), and the mean NLL
of the tokens w_1..w_{h-1} at their first occurrence and at the repeat, h positions later; the gain is their
difference, nats per token: near 0 for a model without induction heads, large for one that copies.
"""

import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from lenext import schema
from lenext.attention import recording
from lenext.errors import ConfigError, LengthNotSupported
from lenext.files import atomic_path, write_atomic
from lenext.hardware import Precision, precision_autocast
from lenext.pe.base import PositionalEncoding
from lenext.positions import PositionScheme, generator, window_positions
from lenext.protocols import cap_windows
from lenext.ranges import PositiveFloat, PositiveInt

log = logging.getLogger("lenext")

STATISTICS = ("entropy", "normalized_entropy", "sink", "distance", "beyond")
ROWS = ("all", "beyond_train")  # all query rows; the rows i >= L_train
DIAGNOSTICS_FILE, FIGURE_FILE = "diagnostics.json", "diagnostics.png"
DIAGNOSTICS_STREAM = 2  # the distance histogram's draws: never training's (0) nor evaluation's (1) positions
DISTANCE_DRAWS = 256  # training windows drawn for the distance histogram of a drawing scheme (randomized, PoSE)
COPYING = ("first_half_nll", "second_half_nll", "gain")  # a length's copying score (nats per token)
COPYING_SHORTEST = 4  # the shortest length with a copying score: h = L // 2 >= 2, so w_1..w_{h-1} is not empty


class AttentionStatistics:
    """Per-(layer, head) sums of the statistics over query rows, from attention weights block by block.

    ``add(layer, weights, start, end, first)``: weights (B, H, end - start, end - first) of query rows [start, end)
    against keys [first, end) (``lenext.attention.recording``'s blocks). Sums are float64 on the weights' device.
    ``windows``: each layer's attention window (None: all keys before the query), for n_i.
    """

    def __init__(self, n_layers: int, n_heads: int, train_len: int, windows: list[int | None] | None = None):
        self.n_layers, self.n_heads, self.train_len = n_layers, n_heads, train_len
        self.windows = windows or [None] * n_layers
        self.sums: dict[tuple[str, str], torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}  # query rows counted, per layer (B x rows)
        self.entropy_rows: dict[str, torch.Tensor] = {}  # rows with n_i >= 2, per layer
        self.max_row_error = 0.0  # max |sum_j a_ij - 1| seen: 0 up to rounding

    def _zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64, device=device)

    def add(self, layer: int, weights: torch.Tensor, start: int, end: int, first: int) -> None:
        a = weights.to(torch.float64)  # (B, H, R, K)
        device = a.device
        rows = torch.arange(start, end, device=device)
        distance = (rows[:, None] - torch.arange(first, end, device=device)[None, :]).to(torch.float64)  # (R, K)
        window = self.windows[layer]
        attended = (rows + 1) if window is None else (rows + 1).clamp(max=window)  # n_i
        entropy = -torch.special.xlogy(a, a).sum(-1)  # (B, H, R)
        log_n = attended.to(torch.float64).log()
        normalized = torch.where(attended > 1, entropy / log_n.clamp(min=1e-300), 0.0)
        sink = a[..., 0] if first == 0 else torch.zeros_like(entropy)
        values = {
            "entropy": entropy,
            "normalized_entropy": normalized,
            "sink": sink,
            "distance": (a * distance).sum(-1),
            "beyond": (a * (distance >= self.train_len)).sum(-1),
        }
        self.max_row_error = max(self.max_row_error, float((a.sum(-1) - 1).abs().max()))
        for group in ROWS:
            chosen = rows >= 0 if group == "all" else rows >= self.train_len  # (R,)
            if not bool(chosen.any()):
                continue
            if group not in self.rows:
                self.rows[group], self.entropy_rows[group] = self._zeros(device)[:, 0], self._zeros(device)[:, 0]
            self.rows[group][layer] += int(chosen.sum()) * a.size(0)
            self.entropy_rows[group][layer] += int((chosen & (attended > 1)).sum()) * a.size(0)
            for name, value in values.items():
                key = (group, name)
                if key not in self.sums:
                    self.sums[key] = self._zeros(device)
                self.sums[key][layer] += value[:, :, chosen].sum(dim=(0, 2))

    def means(self) -> dict[str, dict[str, list] | None]:
        """{rows group: {statistic: [layer][head] mean}} (a group without rows, or a statistic without any row
        it is defined for: None)."""
        out = {}
        for group in ROWS:
            if group not in self.rows:
                out[group] = None
                continue
            stats = {}
            for name in STATISTICS:
                count = self.entropy_rows[group] if name == "normalized_entropy" else self.rows[group]
                if not bool((count > 0).all()):
                    stats[name] = None
                    continue
                stats[name] = (self.sums[group, name] / count[:, None]).cpu().tolist()
            out[group] = stats
        return out


@torch.no_grad()
def record_statistics(
    net, tokens: torch.Tensor, positions: torch.Tensor | None, statistics: AttentionStatistics, precision="32-true"
) -> None:
    """Run ``net`` (a lenext Decoder) on ``tokens`` (B, L) at ``positions`` (B or 1, L; None: 0..L-1) and add every
    layer's attention weights to ``statistics``; each layer known by a forward pre-hook on its attention module."""
    layer = [0]

    def entering(index: int) -> Callable:
        def hook(module, args):
            layer[0] = index

        return hook

    hooks = [block.attn.register_forward_pre_hook(entering(i)) for i, block in enumerate(net.blocks)]
    device = tokens.device
    try:
        with recording(lambda w, start, end, first: statistics.add(layer[0], w, start, end, first)):
            with precision_autocast(device, precision):
                net(tokens, positions)
    finally:
        for hook in hooks:
            hook.remove()


# In-context copying.


def repeated(windows: torch.Tensor) -> torch.Tensor:
    """(W, L) windows -> (W, L) sequences whose second half repeats the first: w_0..w_{h-1} w_0..w_{h-1}, h = L // 2,
    and for odd L the window's next token w_h at the end (never scored)."""
    h = windows.size(1) // 2
    return torch.cat([windows[:, :h], windows[:, : windows.size(1) - h]], dim=1)


@torch.no_grad()
def copy_nll(
    net, windows: torch.Tensor, positions: torch.Tensor | None = None, precision="32-true"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NLL (W, h - 1), float64, of the tokens w_1..w_{h-1} of ``repeated(windows)`` at their first occurrence
    (positions 1..h-1) and at the repeat (positions h+1..2h-1, h back from their copy), from ``net.token_nll`` (a
    lenext Decoder, or any module with its signature) at ``positions`` (None: 0..L-1). w_0 is left out of both:
    its first occurrence has no context and its second no cue that a repeat begins."""
    length = windows.size(1)
    h = length // 2
    if length < COPYING_SHORTEST:
        raise ValueError(f"a copying score needs windows of at least {COPYING_SHORTEST} tokens, not {length}")
    sequence = repeated(windows)
    targets = sequence.roll(-1, dims=1)  # nll[:, i] scores token i + 1; the last (wrapped round) is not used
    with precision_autocast(sequence.device, precision):
        nll = net.token_nll(sequence, targets, positions).to(torch.float64)
    return nll[:, : h - 1], nll[:, h : 2 * h - 1]


class CopyingScore:
    """Sums of ``copy_nll`` over the windows at one length: ``add`` each batch, ``result`` the means."""

    def __init__(self, length: int):
        self.length, self.distance = length, length // 2
        self.sums = [0.0, 0.0]  # first occurrence, repeat
        self.tokens = 0

    def add(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.sums[0] += float(first.sum())
        self.sums[1] += float(second.sum())
        self.tokens += first.numel()

    def result(self) -> dict:
        """distance (h: how far back each repeated token's copy is), tokens (scored per half), first_half_nll,
        second_half_nll (means over those tokens) and gain = first_half_nll - second_half_nll (nats per token)."""
        first, second = (total / self.tokens for total in self.sums)
        return {
            "distance": self.distance,
            "tokens": self.tokens,
            "first_half_nll": first,
            "second_half_nll": second,
            "gain": first - second,
        }


def layer_windows(net) -> list[int | None]:
    """Each layer's attention window (None: every key before the query)."""
    return [block.attn.window for block in net.blocks]


# RoPE's rotation coverage.


def rotary_frequencies(pe) -> tuple[str, Callable[[int], torch.Tensor]] | None:
    """(name, length -> inverse frequencies (n,) float64) of the first rotary PE in ``pe`` (a model's PE: RoPE, its
    scalings, xPos, p-RoPE, a mix's RoPE member; PoPE's d_head frequencies), or None when it rotates nothing."""
    for name, module in pe.named_modules():
        if isinstance(module, PositionalEncoding) and module.rotary_frequencies(1) is not None:
            return name or "pe", module.rotary_frequencies
    return None


def rotation_coverage(trained: torch.Tensor, evaluated: dict[int, torch.Tensor], span: int) -> dict:
    """Per frequency k (theta_k as trained, ``trained``; theta'_k at each evaluation length, ``evaluated``): the arc
    of angles training saw, theta_k (span - 1) (``span``: the relative distances 0..span-1 training gives), whether
    it is a full turn (>= 2 pi), and at each length L the fraction of distances d < L whose angle theta'_k d
    (mod 2 pi) lies beyond the arc, for frequencies without a full turn (``unseen``); the summary, its mean over
    the frequencies (docs/diagnostics.md)."""
    trained = trained.to(torch.float64)
    arc = trained * (span - 1)
    full_turn = arc >= 2 * math.pi
    frequencies = [
        {
            "index": k,
            "theta": float(trained[k]),
            "wavelength": (2 * math.pi / float(trained[k])) if trained[k] > 0 else None,
            "trained_arc": float(arc[k]),
            "full_turn": bool(full_turn[k]),
            "unseen": {},
        }
        for k in range(len(trained))
    ]
    summary = []
    for length, theta in evaluated.items():
        angles = torch.remainder(
            theta.to(torch.float64)[:, None] * torch.arange(length, dtype=torch.float64), 2 * math.pi
        )
        unseen = ((angles > arc[:, None] * (1 + 1e-12)) & ~full_turn[:, None]).to(torch.float64).mean(-1)  # (n,)
        for k, value in enumerate(unseen.tolist()):
            frequencies[k]["unseen"][str(length)] = value
        summary.append(
            {
                "length": length,
                "unseen_fraction": float(unseen.mean()),
                "frequencies_with_unseen_angles": int((unseen > 0).sum()),
            }
        )
    rotated = trained > 0
    return {
        "trained_span": span,
        "frequencies_count": len(trained),
        "rotated": int(rotated.sum()),
        "full_turn": int((full_turn & rotated).sum()),
        "frequencies": frequencies,
        "summary": summary,
    }


# The relative distances training gives.


def trained_distances(scheme: PositionScheme, train_len: int, lengths: list[int], draws: int = DISTANCE_DRAWS) -> dict:
    """The histogram of relative distances p_i - p_j (i >= j) of training windows of L_train tokens at the positions
    ``scheme`` gives them (one window: 0..L_train-1; a drawing scheme: the mean over ``draws`` windows drawn as
    training draws them, seeded), counted per window; and at each evaluation length L, the fraction of an
    evaluation window's (query, key) pairs at 0..L-1 whose distance no training window gave (``untrained_pairs``)."""
    span = scheme.span(train_len)
    drawn = scheme.training(draws, train_len, generator(DIAGNOSTICS_STREAM, train_len, draws))
    positions = torch.arange(train_len)[None] if drawn is None else drawn
    counts = torch.zeros(span, dtype=torch.float64)
    lower = torch.ones(train_len, train_len, dtype=torch.bool).tril()
    for window in positions:
        differences = (window[:, None] - window[None, :])[lower]
        counts += torch.bincount(differences, minlength=span)[:span].to(torch.float64)
    counts /= len(positions)
    untrained = []
    for length in lengths:
        d = torch.arange(length)
        pairs = (length - d).to(torch.float64)  # pairs at distance d in a window of 0..L-1
        never = d >= span
        never[d < span] = counts[d[d < span]] == 0
        untrained.append({"length": length, "fraction": float(pairs[never].sum() / pairs.sum())})
    total = float(counts.sum())
    return {
        "scheme": scheme.name,
        "train_len": train_len,
        "span": span,
        "windows": len(positions),
        "counts": counts.tolist(),
        "largest_distance": int(torch.nonzero(counts).max()),
        "beyond_train_fraction": float(counts[train_len:].sum()) / total,
        "untrained_pairs": untrained,
    }


# The command.


@dataclass(frozen=True)
class DiagnoseSettings:
    """The top-level keys of configs/diagnose.yaml."""

    task_name: str
    ckpt: str | None  # a run folder or a .ckpt of train.py
    split: Literal["validation", "test", "train"]
    lengths: list[PositiveInt] | None
    factors: list[PositiveFloat]
    windows: PositiveInt
    tokens_per_batch: PositiveInt
    precision: Precision | None  # null: 32-true (exact statistics), on any device

    FIXED = {  # what the checkpoint keeps: diagnosed as trained
        "attention": "the checkpoint keeps its attention settings",
        "train": "the checkpoint keeps its training positions",
        "model": "the checkpoint keeps its model",
    }


# The eval.py keys ``evaluation_config`` sets, and this command's keys that give them.
EVALUATION_KEYS = {
    "lengths": "lengths",
    "factors": "factors",
    "max_windows": "windows",
    "tokens_per_batch": "tokens_per_batch",
}


def evaluation_config(cfg: DictConfig) -> DictConfig:
    """The eval.py config ``lenext.resolve.resolve_evaluation`` takes: this command's lengths, split and precision,
    the data's own protocol (nonoverlap for text), nothing swept but the lengths."""
    from importlib import resources

    from lenext.cli import CONFIG_PACKAGE

    eval_node = OmegaConf.load(str(resources.files(CONFIG_PACKAGE).joinpath("eval", "default.yaml")))
    for key, own in EVALUATION_KEYS.items():
        eval_node[key] = cfg[own]
    eval_node.per_position = False
    precision = "32-true" if cfg.precision is None else cfg.precision
    return OmegaConf.create({"pe": cfg.pe, "eval": eval_node, "paths": cfg.paths, "precision": precision})


def window_tokens(evaluation, length: int, windows: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
    """(tokens (W, L), identities for drawn positions) of at most ``windows`` held-out windows of ``length`` inputs,
    spread over the split: text's nonoverlap windows or a probe's samples; None: no document fills one."""
    if hasattr(evaluation, "documents"):  # text (lenext.evaluate.TextEvaluation)
        from lenext.protocols import NonOverlapping

        chosen = cap_windows(evaluation.windows(NonOverlapping(), length), windows)
        if not chosen:
            return None
        ids = np.stack([evaluation.documents[w.document][w.start : w.start + length] for w in chosen])
        return torch.from_numpy(ids.astype(np.int64)), [(w.document, w.start) for w in chosen]
    from lenext.synthetic import EvaluationSamples

    indices = cap_windows(evaluation.windows(None, length), windows)
    samples = EvaluationSamples(evaluation.task, evaluation.split, length + 1, indices)
    items = [samples[i] for i in range(len(samples))]
    return torch.stack([item["tokens"][:-1] for item in items]), [tuple(item["window"].tolist()) for item in items]


def diagnosed_model(cfg: DictConfig, check_only: bool = False):
    """(checkpoint file, and ``lenext.run.checkpoint_model``'s spec, data module, model and checkpoint) of
    diagnose.py's config, every setting checked before any work (by the diagnosis, and by a diagnose.py sweep for
    each job before the first starts: ``check_only``)."""
    from lenext.checkpoints import checkpoint_file
    from lenext.resolve import EVAL_NODES
    from lenext.run import checkpoint_model

    schema.check(cfg, DiagnoseSettings, {k: v for k, v in EVAL_NODES.items() if k in ("paths", "pe")})
    if not cfg.ckpt:
        raise ConfigError("ckpt is required: pass a run folder or a .ckpt file of train.py (ckpt=<path>)")
    path = checkpoint_file(cfg.ckpt)
    try:
        return (path, *checkpoint_model(evaluation_config(cfg), path, check_only))
    except ConfigError as e:  # the evaluation's checks name eval.py's keys: said with this command's
        message = re.sub(r"\beval\.(\w+)", lambda m: EVALUATION_KEYS.get(m[1], m[0]), str(e))
        raise type(e)(message, e.key and EVALUATION_KEYS.get(e.key.removeprefix("eval."), e.key)) from None


def diagnose(cfg: DictConfig) -> str:
    """``lenext-diagnose``: every check first, then the statistics at each length, the coverage, the histogram;
    writes diagnostics.json and diagnostics.png into paths.output_dir. Returns the JSON's path."""
    from lenext.build import instantiate
    from lenext.checkpoints import stored_spec
    from lenext.evaluate import evaluation_positions
    from lenext.run_folder import record_command, refuse_a_runs_folder

    refuse_a_runs_folder(cfg.paths.output_dir)  # a sweep's job folders: before its first job (DiagnosisFolders)
    path, spec, data, net, checkpoint = diagnosed_model(cfg)
    record_command(cfg)  # accepted: every check passed
    data.load()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net.to(device).eval()
    evaluation = data.evaluation(cfg.split)
    scheme = evaluation_positions(spec.eval, spec.scheme)
    lengths = spec.plan.lengths
    n_layers, n_heads = len(net.blocks), net.blocks[0].attn.n_heads
    per_length = []
    for length in lengths:
        row = {"length": length, "length_factor": length / spec.base_len}
        found = window_tokens(evaluation, length, cfg.windows)
        if found is None:
            per_length.append({**row, "status": "no windows", "windows": 0, "reason": "no held-out document fills one"})
            continue
        tokens, identities = found
        statistics = AttentionStatistics(n_layers, n_heads, spec.train_len, layer_windows(net))
        copying = CopyingScore(length) if length >= COPYING_SHORTEST else None
        started = time.perf_counter()
        batch = max(1, spec.eval.tokens_per_batch // length)
        try:
            for b in range(0, len(tokens), batch):
                drawn = window_positions(scheme, length, spec.seed, identities[b : b + batch])
                drawn = None if drawn is None else drawn.to(device)
                windows = tokens[b : b + batch].to(device)
                record_statistics(net, windows, drawn, statistics, spec.precision)
                if copying is not None:
                    copying.add(*copy_nll(net, windows, drawn, spec.precision))
        except LengthNotSupported as e:
            per_length.append({**row, "status": "not applicable", "windows": 0, "reason": str(e)})  # none scored
            continue
        per_length.append(
            {
                **row,
                "status": "ok",
                "windows": len(tokens),
                "reason": None,
                "max_row_sum_error": statistics.max_row_error,
                "seconds": round(time.perf_counter() - started, 3),
                "rows": statistics.means(),
                "copying": None if copying is None else copying.result(),
            }
        )
        log.info("diagnosed L=%d (%d windows, %.1f s)", length, len(tokens), per_length[-1]["seconds"])
    rotary = rotary_frequencies(net.pe)
    coverage = None
    if rotary is not None:
        name, frequencies = rotary
        # theta_k as trained: from the checkpoint's PE, not from the one this command may have scaled (pe.factor=)
        trained_pe = instantiate(stored_spec(checkpoint, f"ckpt={path}").config["pe"], "pe")(net.pe.shape)
        _, trained = rotary_frequencies(trained_pe)
        coverage = {
            "pe": name,
            **rotation_coverage(trained(spec.reach), {n: frequencies(n) for n in lengths}, spec.reach),
        }
    result = {
        "meta": {
            "checkpoint": os.path.abspath(path),
            "row": spec.row,
            "pe": net.pe.describe(),
            "train_len": spec.train_len,
            "base_len": spec.base_len,
            "reach": spec.reach,
            "positions": {"train": spec.scheme.name, "eval": scheme.evaluated_at},
            "split": cfg.split,
            "windows": cfg.windows,
            "precision": spec.precision,
            "layers": n_layers,
            "heads": n_heads,
            "attention_windows": layer_windows(net),
            "statistics": list(STATISTICS),
            "rows": list(ROWS),
            "copying": list(COPYING),
        },
        "lengths": per_length,
        "rotation_coverage": coverage,
        "trained_distances": trained_distances(spec.scheme, spec.train_len, lengths),
    }
    out = cfg.paths.output_dir
    json_path = os.path.join(out, DIAGNOSTICS_FILE)
    write_atomic(json_path, json.dumps(result, indent=1) + "\n")
    write_figure(result, os.path.join(out, FIGURE_FILE))
    print(summary_table(result))
    print(f"diagnostics: {json_path}")
    print(f"figure: {os.path.join(out, FIGURE_FILE)}")
    return json_path


def layer_means(entry: dict, name: str, group: str = "all") -> list[float] | None:
    """Per layer, the mean over heads of a statistic at one length (None: not measured there)."""
    stats = (entry.get("rows") or {}).get(group)
    if not stats or stats.get(name) is None:
        return None
    return [sum(heads) / len(heads) for heads in stats[name]]


def summary_table(result: dict) -> str:
    """The console's table: per length and layer, each statistic's mean over heads (all rows)."""
    header = f"{'L_eval':>7} {'layer':>5} {'entropy':>8} {'H/log n':>8} {'sink':>7} {'distance':>9} {'beyond':>7}"
    lines = [header]
    for entry in result["lengths"]:
        if entry["status"] != "ok":
            lines.append(f"{entry['length']:>7} {entry['status']}: {entry['reason']}")
            continue
        means = {name: layer_means(entry, name) for name in STATISTICS}
        for layer in range(result["meta"]["layers"]):
            cells = [
                "n/a"
                if means[name] is None
                else f"{means[name][layer]:.3f}"
                if name != "distance"
                else f"{means[name][layer]:.1f}"
                for name in STATISTICS
            ]
            lines.append(
                f"{entry['length']:>7} {layer:>5} {cells[0]:>8} {cells[1]:>8} {cells[2]:>7} {cells[3]:>9} {cells[4]:>7}"
            )
    copying = [entry for entry in result["lengths"] if entry.get("copying")]
    if copying:
        lines.append("copying (a window's first half repeated; the same tokens' NLL the first time and h later):")
        lines += [
            f"{entry['length']:>7} h={entry['copying']['distance']}: first {entry['copying']['first_half_nll']:.3f}, "
            f"repeat {entry['copying']['second_half_nll']:.3f}, gain {entry['copying']['gain']:+.3f} nats/token"
            for entry in copying
        ]
    coverage = result["rotation_coverage"]
    if coverage:
        unseen = ", ".join(f"{s['length']}: {s['unseen_fraction']:.3f}" for s in coverage["summary"])
        lines.append(
            f"rotation coverage: {coverage['full_turn']} of {coverage['rotated']} rotated frequencies turn fully "
            f"within {coverage['trained_span']} positions; unseen angles by length: {unseen}"
        )
    return "\n".join(lines)


PANELS = (
    ("normalized_entropy", "entropy / log n"),
    ("sink", "attention on the first token"),
    ("distance", "mean attention distance (tokens)"),
    ("beyond", "attention mass at i - j >= L_train"),
)


def write_figure(result: dict, path: str) -> None:
    """diagnostics.png: each statistic against evaluation length, one line per layer (mean over heads; dashed: the
    rows i >= L_train), the copying score against the distance back to the copy (h = L // 2), the trained
    distances' histogram and the rotation coverage (a rotary PE)."""
    import matplotlib

    from lenext.report.figures import FIGURE_DPI, FIGURE_STYLE, pyplot

    plt = pyplot()
    meta = result["meta"]
    measured = [entry for entry in result["lengths"] if entry["status"] == "ok"]
    panels = len(PANELS) + 2 + (result["rotation_coverage"] is not None)
    columns = 3
    with matplotlib.rc_context(FIGURE_STYLE):
        figure, axes = plt.subplots(
            math.ceil(panels / columns), columns, figsize=(4.2 * columns, 3.3 * math.ceil(panels / columns))
        )
        axes = list(np.ravel(axes))
        colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, max(1, meta["layers"])))
        for ax, (name, title) in zip(axes, PANELS, strict=False):
            for group, style in (("all", "-"), ("beyond_train", "--")):
                points = [(e["length"], layer_means(e, name, group)) for e in measured]
                points = [(length, values) for length, values in points if values is not None]
                for layer in range(meta["layers"]):
                    if not points:
                        continue
                    ax.plot(
                        [p[0] for p in points],
                        [p[1][layer] for p in points],
                        style,
                        marker="o",
                        markersize=3,
                        color=colours[layer],
                        label=f"layer {layer}" if group == "all" else None,
                    )
            ax.axvline(meta["train_len"], color="grey", linewidth=0.8, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("evaluation length")
            ax.set_title(title, fontsize=9)
        axes[0].legend(fontsize=7, title="dashed: rows i >= L_train", title_fontsize=7)
        ax = axes[len(PANELS)]
        copied = [entry for entry in measured if entry.get("copying")]
        for name, label, style in (
            ("first_half_nll", "NLL, first occurrence", ":"),
            ("second_half_nll", "NLL, repeat", "--"),
            ("gain", "gain (first - repeat)", "-"),
        ):
            ax.plot(
                [e["copying"]["distance"] for e in copied],
                [e["copying"][name] for e in copied],
                style,
                marker="o",
                markersize=3,
                color="#0072b2" if name == "gain" else "0.4",
                label=label,
            )
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.axvline(meta["train_len"], color="grey", linewidth=0.8, linestyle=":")  # copies beyond: untrained distances
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance back to the copy, h = L // 2 (tokens)")
        ax.set_ylabel("nats per token")
        ax.set_title("in-context copying: a window's first half repeated", fontsize=9)
        if copied:
            ax.legend(fontsize=7)
        ax = axes[len(PANELS) + 1]
        distances = result["trained_distances"]
        counts = np.array(distances["counts"])
        ax.bar(np.arange(len(counts)), counts, width=1.0, color="#4c72b0")
        ax.axvline(meta["train_len"], color="grey", linewidth=0.8, linestyle=":")
        longest = max([entry["length"] for entry in result["lengths"]] + [len(counts)])
        ax.set_xlim(-0.5, longest - 0.5)  # the distances evaluated beyond those trained: empty
        ax.set_xlabel("relative distance p_i - p_j (up to the longest evaluated)")
        ax.set_ylabel("pairs per training window")
        ax.set_title(f"distances trained ({distances['scheme']} positions)", fontsize=9)
        coverage = result["rotation_coverage"]
        if coverage is not None:
            ax = axes[len(PANELS) + 2]
            index = [f["index"] for f in coverage["frequencies"]]
            for s, summary in enumerate(coverage["summary"]):
                length = str(summary["length"])
                ax.plot(
                    index,
                    [f["unseen"][length] for f in coverage["frequencies"]],
                    marker=".",
                    color=plt.get_cmap("magma")(0.1 + 0.8 * s / max(1, len(coverage["summary"]) - 1)),
                    label=f"L={length}",
                )
            ax.set_xlabel("frequency index k (highest first)")
            ax.set_ylabel("fraction of distances at unseen angles")
            ax.set_title(f"rotation coverage ({coverage['full_turn']} of {coverage['rotated']} turn fully)", fontsize=9)
            ax.legend(fontsize=7)
        for ax in axes[panels:]:
            ax.set_visible(False)
        figure.suptitle(f"{meta['row']}: attention diagnostics (L_train {meta['train_len']}, {meta['split']})")
        figure.tight_layout()
        with atomic_path(path, suffix=".png") as tmp:
            figure.savefig(tmp, dpi=FIGURE_DPI)
        plt.close(figure)


def _entry() -> Callable:
    from lenext.cli import CONFIG_PACKAGE, checked_command_line, one_line_errors

    @checked_command_line("diagnose")
    @hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_PACKAGE}", config_name="diagnose")
    @one_line_errors
    def diagnose_main(cfg: DictConfig) -> str:
        return diagnose(cfg)

    return diagnose_main


def main() -> None:
    """``lenext-diagnose`` / ``python diagnose.py``."""
    _entry()()


if __name__ == "__main__":
    sys.exit(main())
