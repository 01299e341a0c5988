"""The results file of a run or an evaluation (docs/outputs.md): written whole or not at all, and recognised.

``results.json`` holds ``meta`` (the run, resolved, and where and how it was measured) and ``rows`` (one per
variant, protocol and length); ``positions.csv`` the per-position loss curves; ``error.txt`` why a sweep's job
failed.
"""

import contextlib
import dataclasses
import json
import math
import os
import platform
import subprocess
from functools import cache
from importlib import metadata

from lenext.evaluate import evaluation_positions
from lenext.files import write_atomic
from lenext.hardware import PRECISION_NAMES, machine_description
from lenext.protocols import METRICS_OF, metric_range
from lenext.spec import Row

RESULTS_FILE, POSITIONS_FILE, ERROR_FILE = "results.json", "positions.csv", "error.txt"


@cache
def code_commit() -> str | None:
    """The git commit checked out, "-dirty" appended if tracked files differ from it; None unless this code runs
    from a clone's ``src/lenext`` (an installed copy inside some repository, e.g. a .venv in a checkout, is not it).

    Read once per process: ``run.build`` asks before training, so a sweep that outlives several commits names the
    code it loaded, not HEAD when a results file is written."""
    package = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=package)
        return done.stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(os.path.join(top, "src", "lenext")) != os.path.realpath(package):
            return None
        commit, changed = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if commit and changed else commit or None


def environment(device: str, training_precision: str | None) -> dict:
    """What a results file records of the code and the machine that made it (a run's, or a Hugging Face model's):
    throughput and bf16 rounding depend on the machine and the precision the model was trained in."""

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    packages = ("lenext", "torch", "lightning", "transformers", "datasets", "tokenizers")
    return {
        "git_commit": code_commit(),
        "versions": {package: version(package) for package in packages},
        "python": platform.python_version(),
        "device": device,
        "hardware": {**machine_description(), "training_precision": training_precision},
    }


def run_metadata(spec, net, data, split: str, tokens_trained: int | None) -> dict:
    """Everything needed to identify and reproduce a results file: the run (``lenext.spec.RunSpec``) whole, and
    the fields readers use at the top."""
    scheme, config, stored = spec.scheme, spec.config, spec.stored()
    return {
        "row": spec.row,
        "row_fields": stored["row_fields"],
        "pe_name": spec.pe_name,
        "pe": net.pe.describe(),
        "pe_family": net.pe.FAMILY,  # the report's figure panel
        "pe_display_name": net.pe.DISPLAY_NAME,
        # The positions of training (reaching 0..reach-1) and of this evaluation (lenext.positions).
        "positions": {
            "train": scheme.name,
            "reach": scheme.reach,
            "eval": evaluation_positions(spec.eval, scheme).evaluated_at,
        },
        "pe_config": config["pe"],
        "model": {k: v for k, v in config["model"].items() if not k.startswith("_")},
        "train_len": spec.train_len,
        "base_len": spec.base_len,
        "seed": spec.seed,
        "corpus": data.name,
        "task": config["data"].get("task"),  # a probe's task (lenext.synthetic); None for text
        "split": split,
        "tokenizer": data.tokenizer_id,
        "vocab_size": data.vocab_size,
        "parameters": sum(p.numel() for p in net.parameters()),
        "tokens_trained": tokens_trained,  # this stage's; the lineage has its bases'
        "start": spec.start,
        "lineage": [
            {k: v for k, v in dataclasses.asdict(stage).items() if k != "config"} for stage in spec.lineage
        ],  # the bases' configs: meta.run.lineage
        **environment(str(next(net.parameters()).device), training_precision(spec)),
        "run": stored,
    }


def training_precision(spec) -> str | None:
    """The precision the checkpoint was trained in (canonical); an evaluation's spec keeps it in its config."""
    trained_in = (spec.config.get("trainer") or {}).get("precision")
    return PRECISION_NAMES.get(trained_in, trained_in)


def not_lenext_results(results) -> str | None:
    """What a parsed results file lacks of the layout ``write_results`` gives it (another tool's file, a hand-edited
    one), or None. Checked for what readers use: the run's identity and each row's."""
    if not isinstance(results, dict) or not isinstance(results.get("meta"), dict):
        return "no meta object"
    meta, rows = results["meta"], results.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        return "no rows"
    fields = {
        "meta.train_len": (meta.get("train_len"), int),
        "meta.seed": (meta.get("seed"), int),
        "meta.pe": (meta.get("pe"), dict),
        "meta.pe_name": (meta.get("pe_name"), (str, type(None))),
        "meta.pe.name": ((meta.get("pe") or {}).get("name") if isinstance(meta.get("pe"), dict) else None, str),
        "meta.positions": (meta.get("positions"), (dict, type(None))),
        "meta.hardware": (meta.get("hardware"), (dict, type(None))),
    }
    if meta.get("pe_name"):  # the row label; meta.pe.name is its fallback
        del fields["meta.pe.name"]
    fields |= optional_fields(meta)
    for i, row in enumerate(rows):
        fields |= {
            f"rows[{i}].protocol": (row.get("protocol"), str),
            f"rows[{i}].status": (row.get("status"), str),
            f"rows[{i}].length": (row.get("length"), int),
            # ``scaling``: the variant's key in results written before variants had a generic name
            f"rows[{i}].variant": (row.get("variant", row.get("scaling")), (str, type(None))),
            **{f"rows[{i}].{m}": (row.get(m), (int, float, type(None))) for m in (*NUMBERS_READ, *ROW_METRICS)},
        }
    wrong = [key for key, (value, kind) in fields.items() if not isinstance(value, kind) or isinstance(value, bool)]
    if wrong:
        return f"{wrong[0]} is missing or of another type"
    if meta["train_len"] < 1:
        return f"meta.train_len={meta['train_len']} is not a length"
    row_fields = meta.get("row_fields") or {}
    unknown = [key for key in row_fields if key not in {field.name for field in dataclasses.fields(Row)}]
    if unknown:
        return f"meta.row_fields.{unknown[0]} is no field of a row"
    seen = {}
    for i, row in enumerate(rows):
        # One row per measurement: a repeated one would be counted as another seed's
        key = json.dumps([row["protocol"], row.get("variant", row.get("scaling")), row["length"], row.get("depth")])
        if key in seen:
            return f"rows[{i}] repeats rows[{seen[key]}] (its protocol, variant and length)"
        seen[key] = i
        if row["length"] < 1:
            return f"rows[{i}].length={row['length']} is not a length"
        if row["status"] not in ROW_STATUSES:
            return f"rows[{i}].status={row['status']!r} is none of {', '.join(ROW_STATUSES)}"
        for metric in ("ppl", *ROW_METRICS):
            value, (low, high) = row.get(metric), metric_range(metric)
            if value is not None and not math.isnan(value) and not low <= value <= high:  # NaN: a diverged run's
                return f"rows[{i}].{metric}={value} is outside [{low:g}, {high:g}], where every {metric} lies"
    return None


ROW_METRICS = tuple(dict.fromkeys(metric for metrics in METRICS_OF.values() for metric in metrics))
ROW_STATUSES = ("ok", "no windows", "not applicable")
NUMBERS_READ = ("ppl", "depth", "answers", "peak_mem_mb", "temperature_c")  # of a row, where it has them


def optional_fields(meta: dict) -> dict:
    """``not_lenext_results``' checks of what the meta may lack (files written before these existed) but the report
    reads where it is there: key -> (value, the types it may have)."""

    def at(node, key):
        return node.get(key) if isinstance(node, dict) else None

    row_fields, lineage, hardware, identity = (meta.get(k) for k in ("row_fields", "lineage", "hardware", "identity"))
    run = meta.get("run")
    fields = {
        "meta.task": (meta.get("task"), (str, type(None))),
        "meta.checkpoint": (meta.get("checkpoint"), (str, type(None))),
        "meta.pe_config": (meta.get("pe_config"), (dict, type(None))),
        "meta.train_tokens_per_s": (meta.get("train_tokens_per_s"), (int, float, type(None))),
        "meta.run": (run, (dict, type(None))),
        "meta.run.config": (at(run, "config"), (dict, type(None))),
        "meta.run.config.trainer": (at(at(run, "config"), "trainer"), (dict, type(None))),
        "meta.row_fields": (row_fields, (dict, type(None))),
        "meta.lineage": (lineage, (list, type(None))),
        "meta.identity": (identity, (dict, type(None))),
        "meta.identity.eval.variants": (at(identity, "eval.variants"), (list, type(None))),
    }
    if isinstance(row_fields, dict) and row_fields:
        fields |= {"meta.row_fields.pe": (row_fields.get("pe"), str)}
        fields |= {"meta.row_fields.attention": (row_fields.get("attention", []), list)}
    for i, stage in enumerate(lineage if isinstance(lineage, list) else []):
        fields |= {
            f"meta.lineage[{i}].row": (at(stage, "row"), str),
            f"meta.lineage[{i}].steps": (at(stage, "steps"), int),
            f"meta.lineage[{i}].train_len": (at(stage, "train_len"), (int, type(None))),
        }
    if isinstance(hardware, dict) and hardware and not hardware.get("gpu"):  # a CPU's: its model, ISA and cores
        fields |= {
            f"meta.hardware.{k}": (hardware.get(k), kind)
            for k, kind in (("cpu", str), ("isa", str), ("cores", (int, type(None))))
        }
    return fields


def write_results(output_dir: str, meta: dict, rows: list, curves: list) -> str:
    os.makedirs(output_dir, exist_ok=True)
    if curves:
        lines = ["variant,length,position,mean_nll,count"] + [
            f"{s or ''},{length},{p},{v:.6f},{c}" for s, length, p, v, c in curves
        ]
        write_atomic(os.path.join(output_dir, POSITIONS_FILE), "\n".join(lines) + "\n")
    else:  # a curve an earlier evaluation into this folder wrote would be read as this one's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(output_dir, POSITIONS_FILE))
    path = os.path.join(output_dir, RESULTS_FILE)
    write_atomic(path, json.dumps({"complete": True, "meta": meta, "rows": rows}, indent=1) + "\n")
    return path


def format_rows(rows: list[dict]) -> str:
    """The rows as a console table; a probe's rows with their exact-match accuracy (and depth, for passkey)."""
    probe = any("exact_match" in r for r in rows)

    def number(value, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    extra = f" {'exact':>6} {'depth':>5}" if probe else ""
    lines = [f"{'protocol':<10} {'variant':<11} {'L_eval':>7} {'ppl':>10}{extra} {'tokens':>9} {'windows':>7}  status"]
    for r in rows:
        extra = f" {number(r.get('exact_match')):>6} {number(r.get('depth'), 2):>5}" if probe else ""
        lines.append(
            f"{r['protocol']:<10} {r['variant'] or '-':<11} {r['length']:>7} {number(r['ppl']):>10}{extra} "
            f"{r['tokens']:>9} {r['windows']:>7}  {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
        )
    return "\n".join(lines)
