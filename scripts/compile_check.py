"""The compile check: which positional encodings (PEs) torch.compile takes on CPU, as ``module.compile=true`` uses it.

``lenext.module.LanguageModel(compile=True)`` compiles each block for training (``Decoder.compile_blocks`` in
``configure_model``). For every PE config in ``configs/pe/``, each in a fresh subprocess (compile caches, dynamo
state and crashes isolated; a per-PE timeout), on the tiny model of the tests (``model=tiny``: 2 layers, width 64,
4 heads; vocabulary 64; L_train 16), fp32, weights from seed 0, one fixed batch of (2, 16) tokens at positions
0..15, this measures:

1. graph breaks: ``torch._dynamo.explain`` on block 0's forward (its inputs captured from an eager forward, called as
   the decoder calls it, inside ``forward_reads``) and on the whole decoder's forward: ``graph_break_count`` and the
   first of ``break_reasons`` (one line, with the innermost lenext source line it was raised at);
2. per-block compile (what ``module.compile=true`` does): a second net, same seed, ``compile_blocks()``;
   forward + backward of the next-token loss. Whether it compiles (else the exception's type and the first line
   of its message, the inner exception's for ``BackendCompilerFailed``, or the signal that killed the process,
   and in which phase of the first step), the loss's and the gradients' relative error against the eager net
   (per parameter tensor ``||g_compiled - g_eager||`` over ``||g_eager||``, that at least ``GRAD_FLOOR`` times the
   net's largest eager gradient norm; the largest over tensors reported), the first step's wall time (dynamo and
   inductor compiling forward and backward, cold inductor cache: a fresh ``TORCHINDUCTOR_CACHE_DIR`` per
   process), and the steady step time (median of ``--steps`` steps after the first) eager against compiled;
3. fullgraph: ``torch.compile(net, fullgraph=True)`` on a third net (dynamo reset first), forward + backward: whether
   the whole decoder compiles as one graph (else the exception, as above), and its gradients' error likewise.

The report (``benchmarks/compile-check.md``) is rewritten atomically (``lenext.files.write_atomic``) after every
PE, so a run cut off keeps the rows it finished. It names the machine (CPU model, ISA as ``lenext.hardware``
detects it, cores, torch threads) and the torch version; step times on a shared CPU are rough.

    .venv/bin/python scripts/compile_check.py                        # every PE -> benchmarks/compile-check.md
    .venv/bin/python scripts/compile_check.py --pe rope alibi --out /tmp/cc.md   # a few PEs
    .venv/bin/python scripts/compile_check.py --worker rope          # one PE in this process, JSON on stdout
"""

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_MARK = "COMPILE_CHECK_RESULT "  # the worker's row so far, one line of JSON on stdout after each part
STAGE_MARK = "COMPILE_CHECK_STAGE "  # on stderr, before each part
PARTS = ["explain", "block", "fullgraph"]
GRAD_FLOOR = 1e-6  # a gradient's error is relative to at least this fraction of the net's largest gradient norm
VOCAB = 64
LENGTH = 16
BATCH = 2
SEED = 0
TOKEN_SEED = 1
REASON_CHARS = 150


# --------------------------------------------------------------------------------------------
# The worker: one PE, in its own process


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """The first non-empty line of ``text``, at most ``limit`` characters."""
    line = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def describe_exception(error: BaseException) -> str:
    """``Type: first line (at file.py:line)``; for a backend failure the inner exception's first line (the outer's
    says nothing); the place: the last lenext source line the message's "from user code" trace names."""
    inner = getattr(error, "inner_exception", None)
    if inner is not None:
        text = f"{type(error).__name__} ({type(inner).__name__}): {one_line(inner)}"
    else:
        text = f"{type(error).__name__}: {one_line(error)}"
    places = re.findall(r'File "([^"]*lenext[^"]*)", line (\d+)', str(error))
    return text + (f" (at {source_name(places[-1][0])}:{places[-1][1]})" if places else "")


def source_name(filename: str) -> str:
    """A lenext source file's path below the package: ``attention/band.py``."""
    return str(filename).rpartition("/lenext/")[2] or Path(filename).name


def lenext_frame(stack) -> str | None:
    """``file.py:line`` of the innermost frame of ``stack`` inside lenext's sources, if any."""
    frames = [frame for frame in stack or [] if "lenext" in str(getattr(frame, "filename", ""))]
    if not frames:
        return None
    return f"{source_name(frames[-1].filename)}:{frames[-1].lineno}"


def explain(fn, *args) -> dict:
    """Graph breaks of ``fn(*args)`` under ``torch._dynamo.explain``: count, graphs, first reason (one line)."""
    import torch

    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(fn)(*args)
    except Exception as error:  # noqa: BLE001 (recorded, not raised: the row says what failed)
        return {"error": describe_exception(error)}
    reasons = explanation.break_reasons
    first = None
    if reasons:
        where = lenext_frame(reasons[0].user_stack)
        first = one_line(reasons[0].reason) + (f" (at {where})" if where else "")
    unique = sorted(
        {
            one_line(r.reason, 100) + (f" (at {lenext_frame(r.user_stack)})" if lenext_frame(r.user_stack) else "")
            for r in reasons
        }
    )
    return {
        "breaks": explanation.graph_break_count,
        "graphs": explanation.graph_count,
        "first_reason": first,
        "distinct_reasons": unique,
    }


def build(pe: str, folder: str):
    """The tiny net of ``pe`` as tests/test_scaling.py builds it (seed 0, fp32, training mode)."""
    import torch
    from hydra import compose, initialize_config_module

    import lenext.cli  # noqa: F401 (registers the config resolvers)
    from lenext.build import build_net
    from lenext.cli import CONFIG_PACKAGE
    from lenext.run_folder import resolve_training

    overrides = [
        "model=tiny",
        "data.vocab_size=512",
        f"data.max_len={LENGTH}",
        "trainer=cpu",
        f"pe={pe}",
        f"paths.root_dir={folder}",
        f"paths.output_dir={folder}",
        f"paths.cache_dir={folder}/.cache",
    ]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    spec, _ = resolve_training(cfg)
    torch.manual_seed(SEED)
    return build_net(spec, VOCAB).train()


def step(net, tokens, announce=None):
    """One forward + backward of the next-token loss; the loss and every parameter's gradient (grads cleared).
    ``announce(phase)``, if given, before the forward and before the backward."""
    import torch

    for param in net.parameters():
        param.grad = None
    if announce:
        announce("forward")
    hidden = net(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(net.logits(hidden).flatten(0, 1).float(), tokens[:, 1:].flatten())
    if announce:
        announce("backward")
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def timed_steps(net, tokens, steps: int) -> float:
    """Median wall time of ``steps`` forward + backward steps, in ms."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step(net, tokens)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def errors_against(reference, result) -> dict:
    """The loss's relative error and the largest per-tensor gradient error (and its parameter): ``||g - g_eager||``
    over ``||g_eager||``, floored at ``GRAD_FLOOR`` times the largest eager gradient norm of the net, so that a
    tensor whose exact gradient is 0 (a bias softmax ignores: fp32 leaves 1e-12 of noise) is judged on the net's
    scale rather than on its noise."""
    (ref_loss, ref_grads), (loss, grads) = reference, result
    loss_error = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-12)
    if set(grads) != set(ref_grads):
        return {"loss_rel_error": loss_error, "grad_error": "gradients differ in which parameters have one"}
    floor = GRAD_FLOOR * max(float(ref.norm()) for ref in ref_grads.values())
    worst, worst_name = -1.0, None
    for name, ref in ref_grads.items():
        error = float((grads[name] - ref).norm()) / max(float(ref.norm()), floor, 1e-30)
        if error > worst:
            worst, worst_name = error, name
    return {
        "loss_rel_error": loss_error,
        "grad_rel_error": worst,
        "grad_worst_param": worst_name,
        "grad_worst_norm": float(ref_grads[worst_name].norm()),
    }


def emit(row: dict) -> None:
    """The row so far, on stdout: the driver keeps the last, so a crash later loses nothing before it."""
    print(RESULT_MARK + json.dumps(row), flush=True)


def stage(name: str, phase: str | None = None) -> None:
    """On stderr, before each part (and phase of its first step): the driver names where a crash or timeout was."""
    print(STAGE_MARK + name + (f" {phase}" if phase else ""), file=sys.stderr, flush=True)


def worker(pe: str, steps: int, threads: int, parts: list[str]) -> dict:
    import torch

    from lenext.pe.base import SPAN, forward_reads

    torch.set_num_threads(threads)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    row = {"pe": pe, "done": []}
    tokens = torch.randint(VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(TOKEN_SEED))
    with tempfile.TemporaryDirectory(prefix=f"compile-check-{pe}-") as folder:
        stage("setup")
        eager = build(pe, folder)
        row["parameters"] = sum(p.numel() for p in eager.parameters())
        # eager reference and its step time
        reference = step(eager, tokens)
        row["eager_ms"] = timed_steps(eager, tokens, steps)
        emit(row)

        if "explain" in parts:  # 1. graph breaks (explain's backend compiles nothing: it only traces)
            stage("explain")
            captured = {}  # block 0's inputs, as the decoder passes them
            hook = eager.blocks[0].register_forward_pre_hook(lambda module, args: captured.setdefault("args", args))
            with torch.no_grad():
                eager(tokens[:, :-1])
            hook.remove()
            block_args = [a.detach() for a in captured["args"]]
            positions = block_args[1]
            with forward_reads(positions, {SPAN: int(positions.max()) + 1}):  # as the decoder runs compiled blocks
                eager.pe.read_before_blocks(positions)
                row["explain_block"] = explain(eager.blocks[0], *block_args)
            row["explain_decoder"] = explain(eager, tokens[:, :-1])
            row["done"].append("explain")
            emit(row)

        if "block" in parts:  # 2. each block compiled, as LanguageModel.configure_model does
            stage("block")
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            compiled = build(pe, folder)
            compiled.compile_blocks()
            started = time.perf_counter()
            try:
                result = step(compiled, tokens, lambda phase: stage("block", phase))
            except Exception as error:  # noqa: BLE001 (recorded: the row says what failed)
                row["compile"] = {"ok": False, "error": describe_exception(error)}
            else:
                row["compile"] = {"ok": True, "first_step_s": time.perf_counter() - started}
                row["compile"].update(errors_against(reference, result))
                row["compile"]["compiled_ms"] = timed_steps(compiled, tokens, steps)
                row["compile"]["unique_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            row["done"].append("block")
            emit(row)

        if "fullgraph" in parts:  # 3. the whole decoder as one graph
            stage("fullgraph")
            torch._dynamo.reset()
            whole = torch.compile(build(pe, folder), fullgraph=True)
            started = time.perf_counter()
            try:
                loss, grads = step(whole, tokens, lambda phase: stage("fullgraph", phase))
            except Exception as error:  # noqa: BLE001
                row["fullgraph"] = {"ok": False, "error": describe_exception(error)}
            else:
                row["fullgraph"] = {"ok": True, "first_step_s": time.perf_counter() - started}
                grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
                row["fullgraph"].update(errors_against(reference, (loss, grads)))
            row["done"].append("fullgraph")
            emit(row)
    return row


# --------------------------------------------------------------------------------------------
# The driver: every PE in a subprocess, the report after each


def isa_flags() -> str:
    """The vector ISA flags /proc/cpuinfo lists (AVX, AVX-512, AMX, FMA, F16C): what inductor's C++ kernels use."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(sorted(flag for flag in flags if flag.startswith(("avx", "amx")) or flag in ("fma", "f16c")))


def pe_names() -> list[str]:
    from importlib import resources

    from lenext.cli import CONFIG_PACKAGE

    return sorted(path.stem for path in Path(str(resources.files(CONFIG_PACKAGE))).joinpath("pe").glob("*.yaml"))


def failed_part(row: dict, part: str, why: str) -> None:
    """Record in ``row`` that ``part`` ended its process (a crash, a timeout)."""
    if part == "explain":
        row["explain_block"] = row["explain_decoder"] = {"error": why}
    else:
        row["compile" if part == "block" else "fullgraph"] = {"ok": False, "error": why, "process_died": True}


def run_worker(pe: str, steps: int, threads: int, timeout: float, tries: int) -> dict:
    """``pe``'s row from fresh interpreters. A part whose process a signal kills (a segfault in compiled code) is
    tried again in a new process, up to ``tries`` times in all, and its row says how many tries crashed; one that
    still crashes, times out, or raises outside the measured steps is recorded as failed, and the parts after it
    run in a new process (cold caches again)."""
    row, remaining, wall, crashes = {"pe": pe}, list(PARTS), 0.0, {part: [] for part in PARTS}
    while remaining:
        with tempfile.TemporaryDirectory(prefix=f"inductor-{pe}-") as cache:
            # the worker's temporary folders inside this one: removed here even when a signal kills the worker
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TMPDIR": cache, "PYTHONUNBUFFERED": "1"}
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", pe, "--steps", str(steps)]
            command += ["--threads", str(threads), "--parts", *remaining]
            started = time.perf_counter()
            # its own process group: a timeout ends inductor's compile workers with it
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
                why = f"timed out after {timeout:.0f} s"
            else:
                code = process.returncode
                why = None if code == 0 else f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            wall += time.perf_counter() - started
        results = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
        if results:
            row.update(json.loads(results[-1][len(RESULT_MARK) :]))
        finished = set(row.pop("done", []))
        remaining = [part for part in remaining if part not in finished]
        if why is None:
            break
        stages = [line[len(STAGE_MARK) :] for line in stderr.splitlines() if line.startswith(STAGE_MARK)]
        last, _, phase = (stages[-1] if stages else "setup").partition(" ")
        if phase:
            why += f" in the first step's {phase}"
        errors = [line for line in stderr.splitlines() if line.strip() and not line.startswith(STAGE_MARK)]
        if why.startswith("exit") and errors:
            why += f": {one_line(errors[-1])}"
        if last not in remaining:  # died building the net or its eager reference: nothing to go on with
            row["crash"] = f"{why} in {last}"
            break
        crashes[last].append(why)
        if why.startswith("killed") and len(crashes[last]) < tries:
            continue  # the same parts again, in a new process
        failed_part(row, last, why + (f" ({len(crashes[last])} of {len(crashes[last])} tries)" if tries > 1 else ""))
        remaining.remove(last)
    for part, whys in crashes.items():
        key = {"explain": "explain_block", "block": "compile", "fullgraph": "fullgraph"}[part]
        if whys and isinstance(row.get(key), dict) and not row[key].get("process_died"):
            row[key]["crashed_tries"] = f"{len(whys)} of {len(whys) + 1} tries {whys[0]}"
    row["wall_s"] = wall
    return row


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def number(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def breaks_text(explained: dict | None) -> str:
    if not explained:
        return "–"
    if "error" in explained:
        return "explain failed"
    return str(explained["breaks"])


def table_row(row: dict) -> str:
    if "crash" in row:
        return f"| {row['pe']} | **crashed** | – | – | {cell(row['crash'])} | – | – | – | – | – |"
    compiled, whole = row["compile"], row["fullgraph"]
    block, decoder = row["explain_block"], row["explain_decoder"]
    per_block = "yes" if compiled["ok"] else "**no**"
    if compiled.get("crashed_tries"):
        per_block = f"**flaky**: yes, but {compiled['crashed_tries']}"
    if not compiled["ok"]:
        reason = "fails: " + compiled["error"]
    elif block.get("first_reason") or decoder.get("first_reason"):
        reason = block.get("first_reason") or decoder.get("first_reason")
    elif "error" in block or "error" in decoder:
        reason = "explain: " + (block.get("error") or decoder["error"])
    else:
        reason = ""
    fullgraph = "yes" if whole["ok"] else "no"
    if whole.get("crashed_tries"):
        fullgraph += f" (crashed {whole['crashed_tries']})"
    if compiled["ok"]:
        grad = compiled.get("grad_rel_error")
        grad_text = number(grad, ".1e") if grad is not None else cell(compiled.get("grad_error", "–"))
        first = number(compiled["first_step_s"], ".1f")
        times = f"{row['eager_ms']:.1f} / {compiled['compiled_ms']:.1f}"
        speedup = f"{row['eager_ms'] / compiled['compiled_ms']:.2f}x"
    else:
        grad_text, first, times, speedup = "–", "–", f"{row['eager_ms']:.1f} / –", "–"
    return (
        f"| {row['pe']} | {per_block} | {breaks_text(block)} / {breaks_text(decoder)} "
        f"| {fullgraph} | {cell(reason)} | {grad_text} | {first} | {times} | {speedup} | {row['wall_s']:.0f} |"
    )


def summary(rows: list[dict]) -> list[str]:
    """The PEs that fail, break graphs, or do not compile as one graph, each with its measured reason."""
    lines = ["", "## What does not compile cleanly", ""]
    crashed = [r for r in rows if "crash" in r]
    failing = [r for r in rows if "crash" not in r and not r["compile"]["ok"]]
    breaking = [
        r
        for r in rows
        if "crash" not in r
        and r["compile"]["ok"]
        and (r["explain_block"].get("breaks") or r["explain_decoder"].get("breaks"))
    ]
    not_whole = [r for r in rows if "crash" not in r and not r["fullgraph"]["ok"]]
    clean = [
        r["pe"]
        for r in rows
        if "crash" not in r
        and r["compile"]["ok"]
        and r["fullgraph"]["ok"]
        and not r["explain_block"].get("breaks")
        and not r["explain_decoder"].get("breaks")
        and "error" not in r["explain_block"]
        and not r["compile"].get("crashed_tries")
        and not r["fullgraph"].get("crashed_tries")
    ]
    lines.append(f"**Clean** (per-block compile, no graph break, one full graph): {', '.join(clean) or 'none'}.")
    lines.append("")
    lines.append(f"**Per-block compile fails** ({len(failing)}):")
    lines.append("")
    for r in failing:
        breaks = r["explain_block"].get("breaks") or r["explain_decoder"].get("breaks")
        also = f"; besides, {breaks_text(r['explain_block'])} graph break(s) in a block" if breaks else ""
        first = r["explain_block"].get("first_reason") or r["explain_decoder"].get("first_reason")
        lines.append(f"- `{r['pe']}`: {r['compile']['error']}" + (f"{also} ({first})" if breaks else ""))
    if not failing:
        lines.append("- none")
    lines.append("")
    lines.append(f"**Compiles with graph breaks** ({len(breaking)}):")
    lines.append("")
    for r in breaking:
        reasons = r["explain_block"].get("distinct_reasons", []) + [
            reason
            for reason in r["explain_decoder"].get("distinct_reasons", [])
            if reason not in r["explain_block"].get("distinct_reasons", [])
        ]
        lines.append(
            f"- `{r['pe']}` ({breaks_text(r['explain_block'])} in a block, {breaks_text(r['explain_decoder'])} in "
            f"the decoder): {'; '.join(reasons)}"
        )
    if not breaking:
        lines.append("- none")
    lines.append("")
    lines.append(f"**Not one graph under `torch.compile(net, fullgraph=True)`** ({len(not_whole)}):")
    lines.append("")
    for r in not_whole:
        lines.append(f"- `{r['pe']}`: {r['fullgraph']['error']}")
    if not not_whole:
        lines.append("- none")
    flaky = [
        (r["pe"], part, r[key]["crashed_tries"])
        for r in rows
        if "crash" not in r
        for part, key in (("per-block", "compile"), ("fullgraph", "fullgraph"))
        if r[key].get("crashed_tries")
    ]
    if flaky:
        lines.extend(
            ["", "**Flaky: a try's process crashed, a later one ran** (the rows' numbers: the try that ran):", ""]
        )
        lines.extend(f"- `{pe}` ({part}): {text}" for pe, part, text in flaky)
    if crashed:
        lines.extend(["", f"**Crashed or timed out** ({len(crashed)}):", ""])
        lines.extend(f"- `{r['pe']}`: {r['crash']}" for r in crashed)
    inexact = [
        r for r in rows if "crash" not in r and r["compile"]["ok"] and (r["compile"].get("grad_rel_error") or 0) > 1e-4
    ]
    if inexact:
        lines.extend(["", "**Compiled gradients off by more than 1e-4 (relative)**:", ""])
        lines.extend(
            f"- `{r['pe']}`: {r['compile']['grad_rel_error']:.1e} at `{r['compile']['grad_worst_param']}`"
            for r in inexact
        )
    return lines


def report(rows: list[dict], pending: list[str], header: dict, command: str) -> str:
    lines = [
        "# Compile check: torch.compile per PE on CPU",
        "",
        f"Made by `{command}` (scripts/compile_check.py; its docstring says what is measured), "
        f"{header['date']}. Machine: {header['cpu']}, ISA {header['isa']} (flags: {header['flags']}), "
        f"{header['cores']} cores, "
        f"{header['threads']} torch thread(s) per worker; torch {header['torch']}, Python {header['python']}. "
        "The CPU was shared with another benchmark: times are rough.",
        "",
        f"Tiny model (2 layers, width 64, 4 heads, vocab {VOCAB}), fp32, seed {SEED}, one batch of ({BATCH}, "
        f"{LENGTH}) tokens at positions 0..{LENGTH - 1}, forward + backward of the next-token loss. Each PE in its "
        "own process with a cold inductor cache.",
        "",
        "- **per block**: each block `torch.compile`d, as `module.compile=true` does; forward + backward ran.",
        "- **breaks**: `torch._dynamo.explain` graph breaks in block 0's forward / in the whole decoder's forward.",
        "- **fullgraph**: `torch.compile(net, fullgraph=True)` ran forward + backward.",
        "- **reason**: why per-block compile fails, else the first graph break's reason (explain's, one line).",
        "- **grad rel err**: per-block compiled against eager, the largest over parameter tensors of "
        "||g_compiled - g_eager|| / max(||g_eager||, 1e-6 x the net's largest ||g_eager||) (the floor: a tensor "
        "whose exact gradient is 0 holds fp32 noise only).",
        "- **first step**: the compiled net's first forward + backward, compilation included (cold cache).",
        f"- **step ms**: median of {header['steps']} steps after the first, eager / per-block compiled.",
        "",
        "| pe | per block | breaks (block / decoder) | fullgraph | reason | grad rel err | first step s "
        "| step ms eager / compiled | speed-up | worker s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(table_row(row) for row in rows),
    ]
    if pending:
        lines.extend(["", f"Not measured yet (the run is going on, or was cut off): {', '.join(pending)}."])
    losses = [r["compile"]["loss_rel_error"] for r in rows if "loss_rel_error" in r.get("compile", {})]
    if losses:
        lines.extend(["", f"Largest loss relative error, per-block compiled against eager: {max(losses):.1e}."])
    if rows:
        lines.extend(summary(rows))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "compile-check.md"))
    parser.add_argument("--pe", nargs="*", help="these PE configs only (default: every one in configs/pe)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per PE")
    parser.add_argument("--tries", type=int, default=3, help="tries of a part whose process a signal kills")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, eager and compiled")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker (1: steadier when shared)")
    parser.add_argument("--json", help="also write the raw rows here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="*", default=PARTS, choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))

    if args.worker:
        try:
            worker(args.worker, args.steps, args.threads, args.parts)
        except Exception:
            traceback.print_exc()  # the driver reports the last line, and the part it happened in
            sys.exit(1)
        return

    import platform

    import torch

    from lenext.files import write_atomic
    from lenext.hardware import machine_description

    header = {
        **machine_description(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "steps": args.steps,
        "threads": args.threads,
        "flags": isa_flags(),
    }
    command = "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    names = args.pe or pe_names()
    rows: list[dict] = []
    write_atomic(args.out, report(rows, names, header, command))
    for i, pe in enumerate(names):
        print(f"[{i + 1}/{len(names)}] {pe} ...", flush=True)
        row = run_worker(pe, args.steps, args.threads, args.timeout, args.tries)
        rows.append(row)
        print(f"    {table_row(row)}", flush=True)
        write_atomic(args.out, report(rows, names[i + 1 :], header, command))
        if args.json:
            write_atomic(args.json, json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
