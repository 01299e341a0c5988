"""Benchmark lenext's streaming data pipeline: ``lenext-prepare`` on generated text, and training from its shards.

Measures (issue 45):

1. ``lenext-prepare data=text_files data.corpus.path=<folder>`` on a generated 1 GB and 5 GB text corpus, each in a
   fresh subprocess with its own cache: wall time, text MB/s (and per core: the CPU time the process used over its
   wall time says how many cores it kept busy; ``tokenizers`` runs its own thread pool over every core), peak RSS
   (VmHWM, sampled from /proc every 100 ms, and the kernel's ru_maxrss of the waited process) and peak anonymous
   RSS (RssAnon: memory-mapped shard pages are file-backed, RssFile), the same per phase (tokenizer, then each
   split, told apart by the files the run writes), the tokens written and the shards' disk size; and a second
   invocation on the prepared 1 GB corpus (time, peak RSS, and that it leaves every file of the cache as it was).
   The claim checked: peak RSS is the same within 10% for 1 GB and 5 GB (memory O(shard), not O(corpus)).
2. On the 1 GB corpus's shards, in one process, the arms interleaved (a, b, a, b, ...): ``TrainWindows(stream, 512)``
   over (a) the shard-backed ``TokenStream`` (``data.stream("train")``) and (b) the same tokens as one in-memory
   int32 array (``np.concatenate(data.documents("train"))``, what lenext did before shards), read through
   ``lenext.data.loaders.step_loader(batch_size=16, seed=0, trainer=None, num_workers=0)``: batches/s and tokens/s;
   then the small model (``model=small``, L 512, batch 16, fp32, AdamW, train.py's model built as
   ``scripts/bench.py`` builds it, the loss through ``lenext.scoring.scored_targets`` as the training step computes
   it) trained by each loader alternately, one model per arm from the same initialisation: training tokens/s (and
   per CPU second of the process, less sensitive to other processes on the machine) and the ratio shards /
   in-memory. Before timing, every 100th document of each split is tokenized afresh and compared with what its
   shards hold.

Where other processes share the machine, each measurement also records the cores they kept busy (/proc/stat).

The corpus: documents of 5-50 KB (uniform), sentences resampled with replacement from the State of the Union
addresses of the ``sotu`` package (``lenext.data.Sotu().documents("train")``), a paragraph break after a fifth of
them, drawn from a fixed seed; written as .jsonl files of ~100 MB (one document per line, field ``text``) into
``<workdir>/pool``, each file drawn from (seed, file number) alone and written atomically, so a relaunch reuses the
files already there. The 1 GB corpus is the first 10 files, the 5 GB one the first 50 (hard links in
``<workdir>/corpus-<size>gb``): both start with the same text, so both train the same tokenizer.

The report is rewritten after each part (results also in <workdir>/results.json), so partial results survive a
kill; ``--parts`` measures some parts again, keeping the others' results; ``--rewrite`` only renders the report.

Usage (time: about an hour on 2 idle cores, mostly the 5 GB preparation; 2 h on a shared 2-core machine):
    .venv/bin/python scripts/bench_prepare.py                   # 1 GB and 5 GB -> benchmarks/bench-prepare.md
    .venv/bin/python scripts/bench_prepare.py --parts loaders   # part 2 again (the 1 GB corpus prepared if needed)
    .venv/bin/python scripts/bench_prepare.py --sizes 0.05,0.1 --batches 500 --train-steps 2 --train-reps 2 \\
        --tokenizer-sample-mb 20 --workdir /tmp/bench_prepare_smoke --out /tmp/bench-prepare-smoke.md  # smoke test
"""

import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from lenext.files import atomic_path, write_atomic

REPO = Path(__file__).resolve().parent.parent
SPLITS = ("train", "validation", "test")
PHASES = ("tokenizer", *SPLITS, "finish")
PARTS = ("prepare", "loaders")
SAMPLE_S = 0.1  # /proc sampling period
DOC_CHARS = (5_000, 50_000)  # document length, uniform
PARAGRAPH_BREAK = 0.2  # probability of a paragraph break after a sentence
PACKAGES = ("torch", "numpy", "tokenizers", "pyarrow", "datasets", "hydra-core", "sotu", "psutil")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the corpus -------------------------------------------------------------------------------------------------


def sotu_sentences() -> list[str]:
    """The sentences of the sotu training addresses, whitespace collapsed (one list, in a fixed order)."""
    from lenext.data.sotu import Sotu

    sentences = []
    for document in Sotu().documents("train"):
        for sentence in re.split(r"(?<=[.!?])\s+", document):
            sentence = " ".join(sentence.split())
            if len(sentence) >= 2:
                sentences.append(sentence)
    return sentences


def load_sentences(work: Path, log) -> list[str]:
    """``sotu_sentences()``, made in a child process (importing lenext.data would grow this one, whose RSS a
    child's ru_maxrss inherits as a floor)."""
    path = work / "pool" / "sentences.json"
    if not path.exists():
        run_measured(child_command({"kind": "sentences", "out": str(path)}), work / "prepare.log")
    sentences = json.loads(path.read_text())
    log(f"  {len(sentences):,} sotu sentences, {sum(map(len, sentences)) / 1e6:.1f} MB")
    return sentences


def child_command(task: dict) -> list[str]:
    """This script with this command line, running ``task`` in a fresh process."""
    return [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child", json.dumps(task)]


def generate_file(path: Path, number: int, seed: int, file_bytes: int, sentences: list[str]) -> dict:
    """Documents drawn from (seed, number) until the file holds ``file_bytes``; returns its size and text bytes."""
    rng = np.random.default_rng([seed, number])
    lengths = np.array([len(s) + 1 for s in sentences])
    mean = lengths.mean()
    written = text_bytes = documents = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        while written < file_bytes:
            target = int(rng.integers(DOC_CHARS[0], DOC_CHARS[1] + 1))
            picks = rng.integers(0, len(sentences), size=int(target / mean * 1.3) + 16)
            count = min(len(picks), int(np.searchsorted(np.cumsum(lengths[picks]), target)) + 1)
            breaks = rng.random(count) < PARAGRAPH_BREAK
            text = "".join(
                sentences[i] + ("\n\n" if b else " ") for i, b in zip(picks[:count], breaks, strict=True)
            ).rstrip()
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line.encode())
            text_bytes += len(text.encode())
            documents += 1
    return {"file_bytes": written, "text_bytes": text_bytes, "documents": documents}


def corpus(work: Path, gigabytes: float, file_mb: float, seed: int, log) -> tuple[Path, dict]:
    """The folder of the corpus of ``gigabytes`` (generated files reused) and its size."""
    pool = work / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    n_files = max(1, round(gigabytes * 1000 / file_mb))
    folder = work / f"corpus-{gigabytes:g}gb"
    folder.mkdir(exist_ok=True)
    sentences = None  # read once, only if a file is missing
    totals = {"files": n_files, "file_bytes": 0, "text_bytes": 0, "documents": 0, "generated_s": 0.0}
    for number in range(n_files):
        path, meta_path = pool / f"part-{number:05d}.jsonl", pool / f"part-{number:05d}.meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
        wanted = {"seed": seed, "file_mb": file_mb}
        if not (meta and path.exists() and {k: meta[k] for k in wanted} == wanted):
            sentences = sentences or load_sentences(work, log)
            start = time.perf_counter()
            meta = {**wanted, **generate_file(path, number, seed, int(file_mb * 1e6), sentences)}
            meta["generated_s"] = time.perf_counter() - start
            write_atomic(meta_path, json.dumps(meta) + "\n")
            log(f"  generated {path.name}: {meta['file_bytes'] / 1e6:.0f} MB in {meta['generated_s']:.1f} s")
        link = folder / path.name
        if not (link.exists() and os.path.samefile(link, path)):
            link.unlink(missing_ok=True)
            os.link(path, link)
        for key in ("file_bytes", "text_bytes", "documents", "generated_s"):
            totals[key] += meta[key]
    for extra in set(os.listdir(folder)) - {f"part-{n:05d}.jsonl" for n in range(n_files)}:
        (folder / extra).unlink()
    return folder, totals


# --- one process, measured --------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict | None:
    """VmRSS, VmHWM, RssAnon, RssFile (MB) and the CPU seconds of a live process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(re.findall(r"^(VmRSS|VmHWM|RssAnon|RssFile|Threads):\s+(\d+)", status, re.M))
    if "VmRSS" not in fields:  # a zombie: its memory is gone
        return None
    sample = {k: int(v) / 1024 for k, v in fields.items() if k != "Threads"}
    sample["threads"] = int(fields.get("Threads", 0))
    sample["cpu_s"] = (int(stat[11]) + int(stat[12])) / CLK_TCK  # utime + stime
    return sample


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK  # user nice system idle iowait irq softirq steal (guest is in user)


def phase_of(cache: Path) -> str:
    """Which phase a preparation writing into ``cache`` is in, from the files it has written."""
    if not glob.glob(str(cache / "tokenizers" / "*.json")):
        return "tokenizer"
    for split in SPLITS:
        if not glob.glob(str(cache / "shards" / "*" / split / "manifest.json")):
            return split
    return "finish"


def run_measured(command: list[str], log_path: Path, cache: Path | None = None) -> dict:
    """Run ``command``, sampling its memory and CPU every SAMPLE_S; with ``cache``, per phase too."""
    start, machine_start = time.perf_counter(), busy_cpu_s()
    with open(log_path, "a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=str(cache or REPO))
    peak = {"VmRSS": 0.0, "VmHWM": 0.0, "RssAnon": 0.0, "RssFile": 0.0, "threads": 0}
    phases: dict[str, dict] = {}
    last = None
    while True:
        sample = proc_status(child.pid)
        now = time.perf_counter() - start
        if sample is None:
            break
        last = sample
        for key in peak:
            peak[key] = max(peak[key], sample[key])
        if cache is not None:
            name = phase_of(cache)
            phase = phases.setdefault(
                name, {"start_s": now, "cpu_start": sample["cpu_s"], "VmRSS": 0.0, "RssAnon": 0.0, "threads": 0}
            )
            phase.update(end_s=now, cpu_end=sample["cpu_s"])
            for key in ("VmRSS", "RssAnon", "threads"):
                phase[key] = max(phase[key], sample[key])
        time.sleep(SAMPLE_S)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    machine = busy_cpu_s() - machine_start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{shlex.join(command)} failed (exit {child.returncode}):\n{tail}")
    cpu = usage.ru_utime + usage.ru_stime
    order = [name for name in PHASES if name in phases]
    for number, this in enumerate(order):  # a phase ends where the next begins, the last at exit
        following = order[number + 1] if number + 1 < len(order) else None
        phase = phases[this]
        phase["end_s"] = phases[following]["start_s"] if following else wall
        phase["cpu_end"] = phases[following]["cpu_start"] if following else cpu
        phase["seconds"] = phase["end_s"] - (0.0 if this == order[0] else phase["start_s"])
        phase["cpu_s"] = phase["cpu_end"] - (0.0 if this == order[0] else phase["cpu_start"])
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "others_cores": max(0.0, machine - cpu) / wall,  # what every other process kept busy meanwhile (this one too)
        "maxrss_mb": usage.ru_maxrss / 1024,
        "hwm_mb": max(peak["VmHWM"], (last or {}).get("VmHWM", 0.0)),
        "peak_rss_mb": peak["VmRSS"],
        "peak_anon_mb": peak["RssAnon"],
        "peak_file_mb": peak["RssFile"],
        "threads": peak["threads"],
        "phases": {name: phases[name] for name in order},
    }


def prepare_command(folder: Path, cache: Path, sample_mb: float | None) -> list[str]:
    script = Path(sys.executable).parent / "lenext-prepare"
    program = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "from lenext.cli import prepare_main; prepare_main()"]
    )
    sample = [f"data.tokenizer_sample_mb={sample_mb:g}"] if sample_mb else []
    return [*program, "data=text_files", f"data.corpus.path={folder}", f"paths.cache_dir={cache}", *sample]


def file_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``folder``: what a second preparation must leave as it found."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def manifests(cache: Path) -> dict:
    """Documents, tokens, shards and bytes on disk per split of the preparation in ``cache``."""
    splits = {}
    for path in sorted(glob.glob(str(cache / "shards" / "*" / "*" / "manifest.json"))):
        split = Path(path).parent.name
        shards = json.loads(Path(path).read_text())["shards"]
        files = [Path(path).parent / s["file"] for s in shards]
        splits[split] = {
            "documents": sum(s["documents"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "shards": len(shards),
            "bytes": sum(f.stat().st_size for f in files),
        }
    return splits


# --- 2. loader and training throughput ----------------------------------------------------------------------------


def open_data(folder: Path, cache: Path, length: int):
    """The prepared LMDataModule of the corpus in ``folder`` (its shards in ``cache``), and train.py's config."""
    from hydra import compose, initialize_config_module

    from lenext import schema
    from lenext.build import instantiate
    from lenext.cli import CONFIG_PACKAGE
    from lenext.resolve import TRAIN_NODES, TrainSettings

    overrides = [
        "data=text_files",
        f"data.corpus.path={folder}",
        f"paths.cache_dir={cache}",
        f"data.max_len={length}",
        "model=small",
        "trainer.precision=32-true",
        f"paths.output_dir={cache / 'run'}",
    ]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    schema.check(cfg, TrainSettings, TRAIN_NODES)
    data = instantiate(cfg.data, "data")
    data.load()
    return data, cfg


def loader_batches(loader_iter, count: int) -> float:
    """Seconds to draw ``count`` batches."""
    start = time.perf_counter()
    for _ in range(count):
        next(loader_iter)
    return time.perf_counter() - start


class TrainingArm:
    """The small model with AdamW, fed by its own step_loader, as lenext's training step computes the loss."""

    def __init__(self, cfg, windows, batch: int, vocab_size: int):
        import torch

        from lenext.build import build_net
        from lenext.data.loaders import step_loader
        from lenext.module import adamw
        from lenext.resolve import config_pe_name, resolve

        self.spec = resolve(cfg, config_pe_name(cfg), sweeps=False)
        torch.manual_seed(self.spec.seed)
        self.net = build_net(self.spec, vocab_size)
        self.net.train()
        self.optimizer = adamw(self.net.parameters(), lr=1e-4)
        self.batches = iter(step_loader(windows, batch, seed=0, trainer=None, num_workers=0))
        self.step, self.losses = 0, []

    def train(self, steps: int) -> tuple[float, float]:
        """Wall and CPU seconds (this process, every thread) for ``steps`` optimizer steps, drawing each batch from
        the loader."""
        from lenext.positions import training_positions
        from lenext.scoring import scored_targets

        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            batch = next(self.batches)
            tokens = batch["tokens"]
            positions = training_positions(self.spec.scheme, tokens.size(0), tokens.size(1) - 1, 0, 0, self.step, 0)
            loss = scored_targets(self.net, batch, positions).mean()
            loss.backward()
            self.optimizer.step()
            self.net.pe.project_()
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.append(loss.item())
            self.step += 1
        return time.perf_counter() - start, time.process_time() - cpu


def spot_check(data, every: int) -> dict:
    """Documents 0, every, 2 every, ... of each split tokenized afresh with the run's tokenizer, compared with what
    the shards hold: the ids (``[start] + tokens``) and, for held-out splits, the last byte end (the text's UTF-8
    length). Also that each split holds as many documents as the corpus yields for it."""
    checked = {}
    for split in SPLITS:
        views = data.documents(split)
        count = compared = 0
        mismatches = []
        for i, text in enumerate(data.corpus.documents(split)):
            count += 1
            if i % every:
                continue
            ids = [data.start_token, *data.tokenizer.encode(text, add_special_tokens=False).ids]
            same = i < len(views) and np.array_equal(views[i], ids)
            if same and split != "train":
                same = int(data.documents(split, "byte_ends")[i][-1]) == len(text.encode())
            compared += 1
            if not same:
                mismatches.append(i)
        checked[split] = {
            "documents": count,
            "in_shards": len(views),
            "compared": compared,
            "mismatches": mismatches[:10],
            "mismatch_count": len(mismatches),
        }
    return checked


def bench_loaders(args, folder: Path, cache: Path, log) -> dict:
    import resource

    import torch

    from lenext.data.loaders import TrainWindows, step_loader

    length, batch = args.length, args.batch
    data, cfg = open_data(folder, cache, length)
    start = time.perf_counter()
    checked = spot_check(data, args.check_every)
    log(f"  spot check in {time.perf_counter() - start:.0f} s: {checked}")
    rss = lambda: proc_status(os.getpid())  # noqa: E731
    before = rss()
    start = time.perf_counter()
    shard_stream = data.stream("train")
    shard_setup = time.perf_counter() - start
    start = time.perf_counter()
    memory_stream = np.concatenate(data.documents("train")).astype(np.int32)
    memory_setup = time.perf_counter() - start
    after = rss()
    if len(shard_stream) != len(memory_stream):
        raise RuntimeError(f"the streams differ in length: {len(shard_stream)} vs {len(memory_stream)}")
    arms = {"shards": TrainWindows(shard_stream, length), "in-memory": TrainWindows(memory_stream, length)}
    per_pass = len(arms["shards"]) // batch
    count = min(args.batches, per_pass)
    log(f"  {len(shard_stream):,} training tokens, {len(arms['shards']):,} windows, {per_pass:,} batches a pass")

    # The same batches from both: the first args.check_batches compared exactly.
    same = all(
        torch.equal(a["tokens"], b["tokens"])
        for a, b, _ in zip(
            step_loader(arms["shards"], batch, 0, None, 0),
            step_loader(arms["in-memory"], batch, 0, None, 0),
            range(args.check_batches),
            strict=False,
        )
    )
    rates = {name: [] for name in arms}
    for rep in range(args.repeats):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
        for name in order:
            seconds = loader_batches(iter(step_loader(arms[name], batch, 0, None, 0)), count)
            rates[name].append(count / seconds)
        log(f"  loader rep {rep + 1}: " + ", ".join(f"{n} {rates[n][-1]:,.0f} batches/s" for n in arms))

    torch.set_num_threads(args.threads or torch.get_num_threads())
    trainers = {name: TrainingArm(cfg, windows, batch, data.vocab_size) for name, windows in arms.items()}
    for name, arm in trainers.items():  # warm up: kernels, allocator, oneDNN
        seconds, _ = arm.train(args.train_warmup)
        log(f"  warmup {name}: {args.train_warmup} steps in {seconds:.1f} s")
    train_rates = {name: [] for name in trainers}
    cpu_rates = {name: [] for name in trainers}  # tokens per CPU second of this process
    others = []  # cores the other processes kept busy during each repetition
    for rep in range(args.train_reps):
        order = list(trainers) if rep % 2 == 0 else list(trainers)[::-1]
        machine, own, clock = busy_cpu_s(), time.process_time(), time.perf_counter()
        for name in order:
            seconds, cpu = trainers[name].train(args.train_steps)
            train_rates[name].append(args.train_steps * batch * length / seconds)
            cpu_rates[name].append(args.train_steps * batch * length / cpu)
        mine = time.process_time() - own
        others.append(max(0.0, busy_cpu_s() - machine - mine) / (time.perf_counter() - clock))
        log(
            f"  train rep {rep + 1}: "
            + ", ".join(f"{n} {train_rates[n][-1]:,.0f} tokens/s ({cpu_rates[n][-1]:,.0f}/CPU s)" for n in trainers)
            + f"; other processes {others[-1]:.2f} cores"
        )
    losses = [trainers[name].losses for name in trainers]
    return {
        "train_tokens": len(shard_stream),
        "windows": len(arms["shards"]),
        "per_pass": per_pass,
        "batches": count,
        "same_batches": bool(same),
        "setup_s": {"shards": shard_setup, "in-memory": memory_setup},
        "anon_growth_mb": after["RssAnon"] - before["RssAnon"],
        "memory_array_mb": memory_stream.nbytes / 1e6,
        "rates": rates,
        "train_rates": train_rates,
        "train_others_cores": others,
        "spot_check": checked,
        "train_cpu_rates": cpu_rates,
        "same_losses": losses[0] == losses[1],
        "max_loss_diff": max(abs(a - b) for a, b in zip(*losses, strict=True)),
        "torch_threads": torch.get_num_threads(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "parameters": sum(p.numel() for p in trainers["shards"].net.parameters()),
        "vocab_size": data.vocab_size,
        "pe": trainers["shards"].spec.config["pe"]["_target_"],
    }


# --- the report ---------------------------------------------------------------------------------------------------


def cpu_description() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s+(.+)", lscpu)
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    wanted = ("avx512_bf16", "amx_bf16", "avx2")
    import psutil

    return {
        "model": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "flags": {flag: flag in flags for flag in wanted},
    }


def code_version() -> str:
    """The lenext commit measured, and whether src/ differed from it (when git can tell)."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (no git)"
    return commit + (" with src/ modified" if git("status", "--porcelain", "src") else "")


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def cells(values: list[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def within(a: float, b: float, tolerance: float = 0.10) -> bool:
    return abs(a - b) <= tolerance * min(a, b)


def report(parser: argparse.ArgumentParser, results: dict) -> str:
    cpu = cpu_description()
    flags = ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in cpu["flags"].items())
    commands = results.get("commands", {})
    part_args = {part: parser.parse_args(commands[part]["argv"] if part in commands else []) for part in PARTS}
    args, loader_args = part_args["prepare"], part_args["loaders"]
    runs = {}  # one line per command: the parts it measured
    for part, command in commands.items():
        runs.setdefault(shlex.join(command["argv"]), []).append((part, command))
    lines = [
        "# Data pipeline: `lenext-prepare` at 1 GB and 5 GB, and training from token shards",
        "",
        "Generated by `scripts/bench_prepare.py`"
        + ("" if results.get("complete") else " (**partial**: not every part has been measured yet)")
        + ".",
        "",
        f"Machine: {cpu['model']} ({flags}), {cpu['cores']} cores, {cpu['ram_gib']:.0f} GiB RAM, no GPU;"
        f" Python {platform.python_version()}. Local disk; page cache not dropped. Other processes (test runs) may"
        " share the cores: *cores busy* says what each run got, and where it was measured the tables say how many"
        " cores the other processes kept busy; where two things are compared they were interleaved in one process.",
        "",
        "Commands (the parts each measured, its date and wall time):",
        "",
        "```",
    ]
    for argv, done in runs.items():
        what = ", ".join(
            f"{part} ({c['date']}, {c['wall_s'] / 60:.1f} min, lenext {c.get('code', 'not recorded')})"
            for part, c in done
        )
        lines += [f"# {what}", f".venv/bin/python scripts/bench_prepare.py {argv}".rstrip()]
    lines += [
        "```",
        "",
        "Packages: " + ", ".join(f"{p} {version(p)}" for p in PACKAGES) + ".",
        "",
        "## The corpora",
        "",
        f"Generated (seed {args.seed}): documents of {DOC_CHARS[0] // 1000}-{DOC_CHARS[1] // 1000} thousand characters,"
        " sentences of the sotu training addresses resampled with replacement, a paragraph break after"
        f" {PARAGRAPH_BREAK:.0%} of them; .jsonl files of ~{args.file_mb:g} MB (one document a line, field `text`)."
        " The larger corpus starts with the files of the smaller (hard links to the same generated files).",
        "",
        "| corpus | files | documents | .jsonl MB | text MB (UTF-8) |",
        "|---|---|---|---|---|",
    ]
    for size, c in results.get("corpora", {}).items():
        lines.append(
            row(
                size,
                c["files"],
                f"{c['documents']:,}",
                f"{c['file_bytes'] / 1e6:,.0f}",
                f"{c['text_bytes'] / 1e6:,.0f}",
            )
        )
    prepares = results.get("prepare", {})
    others = any("others_cores" in p for p in prepares.values())
    if prepares:
        lines += [
            "",
            "## 1. `lenext-prepare`",
            "",
            "Each run: `lenext-prepare data=text_files data.corpus.path=<corpus>"
            " paths.cache_dir=<its own, empty cache>"
            + (f" data.tokenizer_sample_mb={args.tokenizer_sample_mb:g}" if args.tokenizer_sample_mb else "")
            + "` in a fresh subprocess. *Cores busy*: the process's CPU time (user + system, all threads) / wall time."
            " *MB/s* counts the corpus's text (all splits) over the run's wall time, which includes starting Python"
            " and importing lenext. Peak RSS: VmHWM (sampled every 100 ms) and ru_maxrss (the kernel's, at exit;"
            " Linux carries the RSS of the process that started it into it as a floor: this bench process's peak was"
            f" {commands.get('prepare', {}).get('bench_hwm_mb', results.get('bench_hwm_mb', 0)):,.0f} MB);"
            " RssAnon: the peak of the anonymous RSS, without file-backed pages (mapped shards, libraries).",
            "",
            "| run | wall (s) | text MB/s | cores busy | MB/s per busy core | MB/s per core (of"
            f" {cpu['cores']}) | peak RSS VmHWM (MB) | ru_maxrss (MB) | peak RssAnon (MB) | threads |"
            + " other processes' cores |"
            * others,
            "|---|---|---|---|---|---|---|---|---|---|" + "---|" * others,
        ]
        for name, p in prepares.items():
            text_mb = results["corpora"][p["corpus"]]["text_bytes"] / 1e6
            busy = p["cpu_s"] / p["wall_s"]
            rate = text_mb / p["wall_s"]
            lines.append(
                row(
                    name,
                    f"{p['wall_s']:.1f}",
                    f"{rate:.1f}" if not p.get("again") else "-",
                    f"{busy:.2f}",
                    f"{rate / busy:.1f}" if not p.get("again") else "-",
                    f"{rate / cpu['cores']:.1f}" if not p.get("again") else "-",
                    f"{p['hwm_mb']:,.0f}",
                    f"{p['maxrss_mb']:,.0f}",
                    f"{p['peak_anon_mb']:,.0f}",
                    p["threads"],
                    *([f"{p.get('others_cores', math.nan):.2f}"] if others else []),
                )
            )
        if others:
            lines += [
                "",
                "*Other processes' cores*: the CPU time the whole machine spent busy during the run (/proc/stat),"
                " less the run's own, over its wall time: how much of the machine other work took meanwhile.",
            ]
        if "imports" in results:
            i = results["imports"]
            lines += [
                "",
                f"For scale: `python -c 'import lenext.cli, lenext.data'` alone (torch, lightning, datasets): "
                f"{i['wall_s']:.1f} s, peak RSS {i['hwm_mb']:,.0f} MB, RssAnon {i['peak_anon_mb']:,.0f} MB.",
            ]
        lines += [
            "",
            "Per phase (told apart by the files the run writes: the tokenizer's .json, then each split's"
            " manifest.json; *tokenizer* runs from the start, imports included, through reading the first document of"
            " each split, naming the tokenizer (a hash of the sample) and training it on the sample; each split's"
            " phase reads every corpus file (the splits are round-robin over documents) and tokenizes and writes its"
            " split; *finish* opens the shards and prints the summary):",
            "",
            "| run | phase | s | cores busy | split text MB/s | peak VmRSS (MB) | peak RssAnon (MB) | threads |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, p in prepares.items():
            for phase, ph in p["phases"].items():
                split_mb = p.get("split_text_mb", {}).get(phase)
                lines.append(
                    row(
                        name,
                        phase,
                        f"{ph['seconds']:.1f}",
                        f"{ph['cpu_s'] / max(ph['seconds'], 1e-9):.2f}",
                        f"{split_mb / ph['seconds']:.1f}" if split_mb and not p.get("again") else "-",
                        f"{ph['VmRSS']:,.0f}",
                        f"{ph['RssAnon']:,.0f}",
                        ph["threads"],
                    )
                )
        lines += [
            "",
            "What was written:",
            "",
            "| run | split | documents | tokens | shards | MB on disk | bytes per token |",
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for name, p in prepares.items():
            if p.get("again"):
                continue
            for split, m in p["splits"].items():
                lines.append(
                    row(
                        name,
                        split,
                        f"{m['documents']:,}",
                        f"{m['tokens']:,}",
                        m["shards"],
                        f"{m['bytes'] / 1e6:,.0f}",
                        f"{m['bytes'] / m['tokens']:.2f}",
                    )
                )
            total = sum(m["tokens"] for m in p["splits"].values())
            text_mb = results["corpora"][p["corpus"]]["text_bytes"] / 1e6
            lines.append(
                row(
                    name,
                    "**all**",
                    f"{sum(m['documents'] for m in p['splits'].values()):,}",
                    f"{total:,}",
                    sum(m["shards"] for m in p["splits"].values()),
                    f"{sum(m['bytes'] for m in p['splits'].values()) / 1e6:,.0f}",
                    f"{text_mb * 1e6 / total:.2f} text bytes per token",
                )
            )
    loaders = results.get("loaders")
    if loaders:
        lines += loader_section(loader_args, loaders)
    lines += ["", "## What this shows", ""] + findings(results, cpu)
    return "\n".join(lines) + "\n"


def loader_section(args, r: dict) -> list[str]:
    per_batch = args.batch * args.length
    ratio = [s / m for s, m in zip(r["rates"]["shards"], r["rates"]["in-memory"], strict=True)]
    train_ratio = [s / m for s, m in zip(r["train_rates"]["shards"], r["train_rates"]["in-memory"], strict=True)]
    same_losses = "identical" if r["same_losses"] else f"max difference {r['max_loss_diff']:.2e}"
    lines = [
        "",
        "## 2. Training loader: shards vs in memory (1 GB corpus)",
        "",
        f"The 1 GB corpus's training split: {r['train_tokens']:,} tokens, {r['windows']:,} windows of"
        f" {args.length} + 1 tokens, {r['per_pass']:,} batches of {args.batch} a pass. (a) **shards**:"
        " `TrainWindows(data.stream('train'), 512)`, the memory-mapped `TokenStream` (set up in"
        f" {r['setup_s']['shards']:.2f} s); (b) **in-memory**: `TrainWindows(np.concatenate(data.documents('train'))"
        f".astype(np.int32), 512)` ({r['memory_array_mb']:,.0f} MB, built in {r['setup_s']['in-memory']:.1f} s; the"
        f" process's RssAnon grew {r['anon_growth_mb']:,.0f} MB building both). Both read through"
        f" `step_loader(windows, batch_size={args.batch}, seed=0, trainer=None, num_workers=0)`; the first"
        f" {args.check_batches:,} batches of the two are {'identical' if r['same_batches'] else '**NOT identical**'}."
        + spot_check_text(r.get("spot_check"), args.check_every)
        + " The page cache was not dropped: the shards were written earlier on this machine and were likely in it.",
        "",
        f"Loader alone: {r['batches']:,} batches per repetition (a fresh loader each), repetitions in the order run,"
        " the arms alternating (a, b, b, a, ...):",
        "",
        "| loader | batches/s | M tokens/s | median batches/s |",
        "|---|---|---|---|",
    ]
    for name, rates in r["rates"].items():
        lines.append(
            row(
                name,
                cells(rates, ",.0f"),
                cells([x * per_batch / 1e6 for x in rates], ".2f"),
                f"{statistics.median(rates):,.0f}",
            )
        )
    lines += [
        "",
        f"Ratio shards / in-memory, per repetition: {cells(ratio, '.3f')} (median {statistics.median(ratio):.3f}).",
        "",
        f"Training: train.py's `model=small` ({r['parameters'] / 1e6:.1f}M parameters with this tokenizer's"
        f" {r['vocab_size']:,} tokens; PE `{r['pe']}`), L {args.length}, batch {args.batch}, fp32, AdamW (lr 1e-4),"
        " the loss as lenext's training step computes it (`scored_targets`), one model per arm from the same"
        f" initial weights, each fed by its own `step_loader`; {args.train_warmup} warmup steps each, then"
        f" {args.train_reps} repetitions of {args.train_steps} steps per arm, alternating (a, b, b, a, ...);"
        f" torch threads {r['torch_threads']}. The time includes drawing each batch from the loader."
        f" The two arms' losses, step by step: {same_losses}.",
        "",
        "| loader | training tokens/s, per repetition | median | best |",
        "|---|---|---|---|",
    ]
    for name, rates in r["train_rates"].items():
        lines.append(row(name, cells(rates, ",.0f"), f"{statistics.median(rates):,.0f}", f"{max(rates):,.0f}"))
    best = max(r["train_rates"]["shards"]) / max(r["train_rates"]["in-memory"])
    lines += [
        "",
        f"Ratio shards / in-memory, per repetition (paired): {cells(train_ratio, '.3f')}"
        f" (median **{statistics.median(train_ratio):.3f}**; the issue asks for >= 0.98); ratio of the two arms'"
        f" best repetitions (the least disturbed by other processes): **{best:.3f}**.",
    ]
    if "train_cpu_rates" in r:
        cpu_rates = r["train_cpu_rates"]
        cpu_ratio = [s / m for s, m in zip(cpu_rates["shards"], cpu_rates["in-memory"], strict=True)]
        lines += [
            "",
            "The same steps per CPU second of the training process (all its threads): less sensitive to other"
            " processes taking the cores, since waiting for a core costs no CPU time (spinning threads still do):",
            "",
            "| loader | training tokens per CPU second, per repetition | median |",
            "|---|---|---|",
        ]
        for name, rates in cpu_rates.items():
            lines.append(row(name, cells(rates, ",.0f"), f"{statistics.median(rates):,.0f}"))
        lines += [
            "",
            f"Ratio shards / in-memory per CPU second, per repetition: {cells(cpu_ratio, '.3f')}"
            f" (median **{statistics.median(cpu_ratio):.3f}**).",
        ]
    if r.get("train_others_cores"):
        lines += [
            "",
            "Cores the other processes kept busy during each repetition (/proc/stat, less this process):"
            f" {cells(r['train_others_cores'], '.2f')}.",
        ]
    lines += [
        "",
        f"Peak RSS of the process that measured this part (VmHWM, in-memory array and both models included):"
        f" {r.get('process_hwm_mb', r['maxrss_mb']):,.0f} MB.",
    ]
    return lines


def spot_check_text(checked: dict | None, every: int) -> str:
    if not checked:
        return ""
    parts = []
    for split, c in checked.items():
        verdict = "all equal" if not c["mismatch_count"] else f"**{c['mismatch_count']} differ**"
        parts.append(
            f"{split} {c['compared']:,} of {c['documents']:,} documents ({c['in_shards']:,} in the shards), {verdict}"
        )
    return (
        f" Output check: every {every}th document of each split tokenized afresh with the run's tokenizer and compared"
        " with its shards (ids, and for held-out splits the last byte end = the text's UTF-8 length): "
        + "; ".join(parts)
        + "."
    )


def findings(results: dict, cpu: dict) -> list[str]:
    """Bullet points from the numbers measured (only what was measured)."""
    out = []
    prepares = {n: p for n, p in results.get("prepare", {}).items() if not p.get("again")}
    fresh = list(prepares.items())
    for name, p in fresh:
        text_mb = results["corpora"][p["corpus"]]["text_bytes"] / 1e6
        busy = p["cpu_s"] / p["wall_s"]
        out.append(
            f"- `{name}`: {text_mb:,.0f} MB of text prepared in {p['wall_s'] / 60:.1f} min: {text_mb / p['wall_s']:.1f}"
            f" MB/s, {text_mb / p['wall_s'] / cpu['cores']:.1f} MB/s per core of {cpu['cores']} ({busy:.2f} cores busy"
            f" on average), peak RSS {p['hwm_mb']:,.0f} MB (RssAnon {p['peak_anon_mb']:,.0f} MB)."
        )
    if len(fresh) >= 2:
        a, b = fresh[0][1], fresh[-1][1]
        held = within(a["hwm_mb"], b["hwm_mb"]) and within(a["peak_anon_mb"], b["peak_anon_mb"])
        growth = b["hwm_mb"] / a["hwm_mb"] - 1
        anon_growth = b["peak_anon_mb"] / a["peak_anon_mb"] - 1
        size_ratio = results["corpora"][b["corpus"]]["text_bytes"] / results["corpora"][a["corpus"]]["text_bytes"]
        verdict = "**held**" if held else "**did not hold**"
        out.append(
            f"- Memory O(shard), not O(corpus): {verdict}. With {size_ratio:.1f}x the text, peak RSS went from"
            f" {a['hwm_mb']:,.0f} to {b['hwm_mb']:,.0f} MB ({growth:+.1%}) and peak RssAnon from"
            f" {a['peak_anon_mb']:,.0f} to {b['peak_anon_mb']:,.0f} MB ({anon_growth:+.1%}); the 10% bound"
            f" {'holds for both' if held else 'is exceeded'}."
        )
        phases = [ph for ph in a["phases"] if ph in b["phases"]]
        out.append(
            "- Peak RssAnon per phase, smaller -> larger corpus: "
            + "; ".join(
                f"{ph} {a['phases'][ph]['RssAnon']:,.0f} -> {b['phases'][ph]['RssAnon']:,.0f} MB"
                f" ({b['phases'][ph]['RssAnon'] / a['phases'][ph]['RssAnon'] - 1:+.1%})"
                for ph in phases
            )
            + "."
        )
        where = {n: max(p["phases"], key=lambda ph: p["phases"][ph]["VmRSS"]) for n, p in fresh}
        out.append(
            "- The peak RSS is reached in the phase: " + ", ".join(f"`{n}` {ph}" for n, ph in where.items()) + "."
        )
        text_a = results["corpora"][a["corpus"]]["text_bytes"] / 1e6
        text_b = results["corpora"][b["corpus"]]["text_bytes"] / 1e6
        busy_a, busy_b = a["cpu_s"] / a["wall_s"], b["cpu_s"] / b["wall_s"]
        out.append(
            f"- Time: {b['wall_s'] / a['wall_s']:.2f}x the wall time and {b['cpu_s'] / a['cpu_s']:.2f}x the CPU time"
            f" for {size_ratio:.1f}x the text (CPU seconds per MB of text: {a['cpu_s'] / text_a:.2f} and"
            f" {b['cpu_s'] / text_b:.2f}; per busy core {text_a / a['cpu_s']:.2f} and {text_b / b['cpu_s']:.2f}"
            f" MB/s). The runs had {busy_a:.2f} and {busy_b:.2f} cores busy on average"
            + (
                ": the larger got fewer of the machine's cores (other processes ran meanwhile), so its wall time and"
                " MB/s are the shared machine's, not the pipeline's alone."
                if busy_b < 0.8 * busy_a
                else "."
            )
        )
    again = [p for p in results.get("prepare", {}).values() if p.get("again")]
    if again and fresh:
        g, first = again[0], fresh[0][1]
        imports = results.get("imports")
        out.append(
            f"- A second `lenext-prepare` on the prepared {g['corpus']} corpus returned in {g['wall_s']:.1f} s"
            f" (the first took {first['wall_s']:.1f} s), peak RSS {g['hwm_mb']:,.0f} MB"
            f" (RssAnon {g['peak_anon_mb']:,.0f} MB)"
            + (
                f"; importing lenext alone takes {imports['wall_s']:.1f} s and {imports['hwm_mb']:,.0f} MB"
                if imports
                else ""
            )
            + {
                True: "; every file of its cache was left as it was (size and mtime): nothing was prepared again.",
                False: "; **files of its cache changed** (size or mtime).",
                None: ".",
            }[g.get("unchanged")]
        )
    r = results.get("loaders")
    if r:
        ratio = statistics.median(s / m for s, m in zip(r["rates"]["shards"], r["rates"]["in-memory"], strict=True))
        train = statistics.median(
            s / m for s, m in zip(r["train_rates"]["shards"], r["train_rates"]["in-memory"], strict=True)
        )
        out.append(
            f"- Loader alone, shards / in-memory: {ratio:.3f} (median of the paired repetitions;"
            f" {statistics.median(r['rates']['shards']):,.0f} vs {statistics.median(r['rates']['in-memory']):,.0f}"
            f" batches/s). Same batches: {'yes' if r['same_batches'] else 'NO'}."
        )
        best = max(r["train_rates"]["shards"]) / max(r["train_rates"]["in-memory"])
        if "train_cpu_rates" in r:
            c = r["train_cpu_rates"]
            per_cpu = statistics.median(s / m for s, m in zip(c["shards"], c["in-memory"], strict=True))
            out.append(
                f"- Training tokens per CPU second, shards / in-memory: {per_cpu:.3f} (median of paired"
                f" repetitions): {'>=' if per_cpu >= 0.98 else '**below**'} 0.98."
            )
        out.append(
            f"- Training the small model: shards / in-memory {train:.3f} (median of paired repetitions), {best:.3f}"
            f" (best repetition of each arm): the issue's >= 0.98 {'holds' if train >= 0.98 else '**does not hold**'}"
            f" by the median, {'holds' if best >= 0.98 else '**does not hold**'} by the"
            f" best repetitions. A training step took {args_per_step(r):.2f} s (median, shards arm); a batch took"
            f" {1e3 / statistics.median(r['rates']['shards']):.3f} ms to draw from the shards and"
            f" {1e3 / statistics.median(r['rates']['in-memory']):.3f} ms from memory: the shards' extra cost is"
            f" {extra_share(r):.4%} of a step, so by the loader's cost alone the training ratio would be"
            f" {1 / (1 + extra_share(r)):.4f}; a wider gap between the arms than that is not the loader's cost but"
            " variation from step to step (the paired ratios above)."
        )
        out.append(
            f"- The in-memory arm holds the training split as {r['memory_array_mb']:,.0f} MB of int32; the shard arm"
            " maps the shards (page cache, shared, reclaimable)."
        )
    if out:
        out.append(
            "- Caveat on the text: the corpus resamples the sentences of 9 MB of addresses, so it repeats a small"
            " vocabulary; a corpus with more distinct words may train the tokenizer and tokenize at other rates"
            " (not measured here)."
        )
    return out or ["- Nothing measured yet."]


def args_per_step(r: dict) -> float:
    rate = statistics.median(r["train_rates"]["shards"])
    return r["tokens_per_batch"] / rate


def extra_share(r: dict) -> float:
    """The time drawing a batch from the shards takes beyond drawing it from memory / the time of a training step."""
    extra = 1 / statistics.median(r["rates"]["shards"]) - 1 / statistics.median(r["rates"]["in-memory"])
    return extra / args_per_step(r)


def run_child(args, task: dict) -> None:
    """A part run in its own process; its result as JSON into task["out"]."""
    if task["kind"] == "sentences":
        result = sotu_sentences()
    else:

        def log(message: str) -> None:
            print(message, flush=True)

        result = bench_loaders(args, Path(task["folder"]), Path(task["cache"]), log)
    write_atomic(task["out"], json.dumps(result) + "\n")


# --- main ---------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,5", help="corpus sizes in GB, comma-separated, smallest first")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_prepare"), help="corpora, caches, log")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "bench-prepare.md")
    parser.add_argument("--file-mb", type=float, default=100, help="size of each generated .jsonl file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-sample-mb", type=float, default=None, help="data.tokenizer_sample_mb (default: the config's)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="loader repetitions per arm")
    parser.add_argument("--batches", type=int, default=20_000, help="batches per loader repetition")
    parser.add_argument("--check-batches", type=int, default=1_000, help="batches compared between the two loaders")
    parser.add_argument(
        "--check-every", type=int, default=100, help="every n-th document of each split re-tokenized and compared"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--train-warmup", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=1, help="training steps per arm per repetition")
    parser.add_argument("--train-reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to measure: prepare (1: every size, and the smallest again), loaders (2: on the smallest);"
        " a run of some parts keeps the others' results from <workdir>/results.json",
    )
    parser.add_argument("--keep", action="store_true", help="keep the token shards (the corpora are always kept)")
    parser.add_argument(
        "--rewrite", action="store_true", help="only rewrite --out from <workdir>/results.json of an earlier run"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args, json.loads(args.child))
        return

    work = args.workdir
    results_path = work / "results.json"
    if args.rewrite:
        results = json.loads(results_path.read_text())
        write_atomic(args.out, report(parser, results))
        print(f"wrote {args.out} from {results_path}")
        return
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: {args.parts!r}; give some of {','.join(PARTS)}")
    start = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "prepare.log"
    # A run of every part starts afresh; a run of some parts keeps the other parts' results of the last run.
    results: dict = {"corpora": {}, "prepare": {}, "commands": {}}
    if set(parts) != set(PARTS) and results_path.exists():
        results = json.loads(results_path.read_text())
    results["complete"] = False
    command_line = {"argv": sys.argv[1:], "date": str(datetime.date.today()), "code": code_version()}

    def log(message: str) -> None:
        print(f"[{(time.perf_counter() - start) / 60:5.1f} min] {message}", flush=True)

    def write_report() -> None:
        hwm = proc_status(os.getpid())["VmHWM"]
        for part in parts:
            results["commands"][part] = {**command_line, "wall_s": time.perf_counter() - start, "bench_hwm_mb": hwm}
        write_atomic(args.out, report(parser, results))
        write_atomic(results_path, json.dumps(results, indent=1, default=str) + "\n")
        log(f"wrote {args.out}")

    sizes = [float(s) for s in args.sizes.split(",")]
    if "prepare" in parts:
        log("imports alone")
        results["imports"] = run_measured([sys.executable, "-c", "import lenext.cli, lenext.data"], log_path)
    for number, size in enumerate(sizes if "prepare" in parts else sizes[:1]):
        name = f"{size:g} GB"
        log(f"corpus {name}")
        folder, totals = corpus(work, size, args.file_mb, args.seed, log)
        results["corpora"][name] = totals
        cache = work / f"cache-{size:g}gb"
        command = prepare_command(folder, cache, args.tokenizer_sample_mb)
        if "prepare" in parts:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()
            log(f"prepare {name}: {shlex.join(command)}")
            measured = run_measured(command, log_path, cache)
            measured.update(corpus=name, splits=manifests(cache))
            tokens = {s: m["tokens"] for s, m in measured["splits"].items()}
            # The text of each split: its share of the tokens times the corpus's text (splits are round-robin).
            measured["split_text_mb"] = {
                s: totals["text_bytes"] / 1e6 * t / sum(tokens.values()) for s, t in tokens.items()
            }
            results["prepare"][f"prepare {name}"] = measured
            log(
                f"  {measured['wall_s']:.0f} s, VmHWM {measured['hwm_mb']:.0f} MB,"
                f" RssAnon {measured['peak_anon_mb']:.0f} MB"
            )
            write_report()
        if number != 0:
            continue
        if "prepare" in parts:
            log(f"prepare {name} again")
            before = file_stamps(cache)
            again = run_measured(command, log_path, cache)
            again.update(corpus=name, again=True, unchanged=file_stamps(cache) == before)
            results["prepare"][f"prepare {name} again"] = again
            log(f"  {again['wall_s']:.0f} s, VmHWM {again['hwm_mb']:.0f} MB")
            write_report()
        if "loaders" in parts:
            if "prepare" not in parts:  # the shards of an earlier run, or prepared now (not measured)
                log(f"prepare {name} (reused if prepared)")
                cache.mkdir(exist_ok=True)
                run_measured(command, log_path, cache)
            log(f"loaders and training (in a child process; its progress in {log_path})")
            out = work / "loaders.json"
            task = {"kind": "loaders", "out": str(out), "folder": str(folder), "cache": str(cache)}
            process = run_measured(child_command(task), log_path)
            loaders = json.loads(out.read_text())
            loaders.update(tokens_per_batch=args.batch * args.length, process_hwm_mb=process["hwm_mb"])
            results["loaders"] = loaders
            write_report()
    results["complete"] = all(part in results["commands"] for part in PARTS)
    write_report()
    if not args.keep:
        for size in sizes:
            shutil.rmtree(work / f"cache-{size:g}gb", ignore_errors=True)
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min; corpora kept in {work / 'pool'}")


if __name__ == "__main__":
    main()
