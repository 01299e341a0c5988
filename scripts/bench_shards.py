"""Benchmark the streaming-shard engines lenext's data pipeline could be built on.

Candidates: (a) litdata (``optimize`` with ``TokensLoader`` writing chunked token shards, read back with
``StreamingDataset`` + ``StreamingDataLoader``) and (b) Hugging Face ``datasets`` Arrow shards
(``Dataset.from_generator`` + ``save_to_disk``, read memory-mapped with ``load_from_disk`` through a torch
``DataLoader`` over a seeded permutation, the construction of ``lenext.data.loaders.StepShuffler``). Both store the same
synthetic token stream (uint16 ids drawn chunk by chunk from a fixed seed) as disjoint training windows of
513 tokens (512 inputs + 1 target). Measures, with the repetitions interleaved (a, b, a, b):

1. writing: wall time and peak memory, for 1 and 2 worker processes;
2. reading every window once in shuffled order (litdata also with a full permutation inside each chunk instead of
   its default block shuffle), batch 16, ``num_workers`` 0 and 2: windows/s, tokens/s, time to
   the first batch (from opening the shards), peak memory; that every window came exactly once (64-bit window
   fingerprints compared as multisets); and how spread the shuffle is (how many 1% slices of the stream a batch,
   and the first 1,024 windows, touch);
3. resume: whether a loader stopped mid-epoch and restored into a fresh loader (litdata: the
   ``StreamingDataLoader`` ``state_dict``; datasets: the same seeded permutation, skipping the batches consumed)
   yields exactly the batches the uninterrupted epoch yields;
4. the disk size of each engine's shards.

Each write and read runs in a fresh subprocess, so peaks are separate. Peak memory is reported as the main
process's VmHWM and as the peak over time of the RSS (and of the anonymous RSS, i.e. without file-backed pages
such as memory-mapped shards) summed over the subprocess and its children, sampled every 50 ms.

Also checks, from PyPI's wheel metadata, whether mosaicml-streaming can be installed beside lenext.

Usage (litdata installed apart, see the report):
    PYTHONPATH=/tmp/litlibs .venv/bin/python scripts/bench_shards.py --tokens 100000000 --out benchmarks/bench-shards.md
"""

import argparse
import datetime
import glob
import importlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from functools import partial
from importlib import metadata
from pathlib import Path

import numpy as np
import psutil

WINDOW = 513  # 512 inputs + 1 target
BATCH = 16
VOCAB = 50257  # GPT-2's vocabulary: ids fit uint16
TOKEN_DTYPE = np.uint16
PART_WINDOWS = 1024  # the stream is generated, and handed to the writers, one part of this many windows at a time
LITDATA_CHUNK_WINDOWS = 8192  # windows per litdata chunk (8.4 MB of uint16)
FIRST_WINDOWS = 1024  # the shuffle spread is also measured over the first this many windows read
SLICES = 100  # ... in slices of 1% of the stream
ENGINES = ("litdata", "datasets")
# What reads the shards: each engine's loader, and litdata's with item_shuffle_window=0 (a full permutation inside
# each chunk) instead of its default (blocks of 256 windows shuffled, then the windows inside each block).
READERS = ("litdata", "litdata-fullchunk", "datasets")
FINGERPRINT_WEIGHTS = np.random.default_rng(12345).integers(1, 2**62, size=WINDOW, dtype=np.int64)
MOSAIC = "mosaicml-streaming==0.13.0"
PACKAGES = ("torch", "numpy", "datasets", "pyarrow", "litdata", "lightning-utilities", "psutil")


# --- the token stream -------------------------------------------------------------------------------------------


def n_windows(n_tokens: int) -> int:
    return n_tokens // WINDOW


def n_parts(n_tokens: int) -> int:
    return -(-n_windows(n_tokens) // PART_WINDOWS)


def token_part(part: int, n_tokens: int, seed: int) -> np.ndarray:
    """Part ``part`` of the stream: the tokens of up to PART_WINDOWS windows, drawn from (seed, part) alone."""
    windows = min(PART_WINDOWS, n_windows(n_tokens) - part * PART_WINDOWS)
    return np.random.default_rng([seed, part]).integers(0, VOCAB, size=windows * WINDOW, dtype=TOKEN_DTYPE)


def window_rows(parts: list[int], n_tokens: int, seed: int):
    """The rows of the datasets engine: one {"tokens": window} per window of the given parts."""
    for part in parts:
        for window in token_part(part, n_tokens, seed).reshape(-1, WINDOW):
            yield {"tokens": window}


def fingerprints(windows: np.ndarray) -> np.ndarray:
    """One 64-bit hash per window (row): a random linear form, wrapping around in int64."""
    with np.errstate(over="ignore"):
        return (windows.astype(np.int64) * FINGERPRINT_WEIGHTS).sum(axis=1)


# --- the measurements, each run in its own subprocess -----------------------------------------------------------


def write_litdata(out: Path, n_tokens: int, seed: int, workers: int) -> dict:
    from litdata import TokensLoader, optimize

    optimize(
        fn=partial(token_part, n_tokens=n_tokens, seed=seed),
        inputs=list(range(n_parts(n_tokens))),
        output_dir=str(out),
        chunk_size=LITDATA_CHUNK_WINDOWS * WINDOW,
        item_loader=TokensLoader(),
        num_workers=workers,
        reorder_files=False,
        verbose=False,
    )
    return {}


def write_datasets(out: Path, n_tokens: int, seed: int, workers: int) -> dict:
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({"tokens": datasets.List(datasets.Value("uint16"), length=WINDOW)})
    start = time.perf_counter()
    dataset = datasets.Dataset.from_generator(
        window_rows,
        features=features,
        gen_kwargs={"parts": list(range(n_parts(n_tokens))), "n_tokens": n_tokens, "seed": seed},
        num_proc=workers if workers > 1 else None,
        cache_dir=str(out / "cache"),
    )
    generated = time.perf_counter()
    dataset.save_to_disk(str(out / "shards"), num_proc=workers if workers > 1 else None)
    saved = time.perf_counter()
    del dataset
    shutil.rmtree(out / "cache")  # what stays is the saved copy: the generator's cache is a second one
    return {"generate_s": generated - start, "save_s": saved - generated}


def engine_of(reader: str) -> str:
    return reader.split("-")[0]


def stack_tokens(rows: list[dict]):
    import torch

    return torch.from_numpy(np.stack([row["tokens"] for row in rows]))


def open_loader(reader: str, root: Path, seed: int, num_workers: int, skip_batches: int = 0):
    """``reader``'s shuffled loader of batches of BATCH windows over its engine's shards in ``root``."""
    if engine_of(reader) == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        dataset = StreamingDataset(
            str(root),
            item_loader=TokensLoader(block_size=WINDOW),
            shuffle=True,
            seed=seed,
            drop_last=False,
            item_shuffle_window=0 if reader == "litdata-fullchunk" else None,
        )
        return StreamingDataLoader(dataset, batch_size=BATCH, num_workers=num_workers)
    import datasets
    import torch
    from torch.utils.data import DataLoader

    dataset = datasets.load_from_disk(str(root / "shards")).with_format("numpy")
    # lenext.data.loaders.StepShuffler's order: one permutation per epoch drawn from seed + epoch, resumed by position.
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[skip_batches * BATCH :]
    return DataLoader(
        dataset, batch_size=BATCH, sampler=order.tolist(), num_workers=num_workers, collate_fn=stack_tokens
    )


def batch_fingerprints(loader, limit: int | None = None) -> list[np.ndarray]:
    """The fingerprints of the windows of each batch, in the order read, for at most ``limit`` batches."""
    batches = []
    for batch in loader:
        batches.append(fingerprints(batch.numpy()))
        if len(batches) == limit:
            break
    return batches


def read(reader: str, root: Path, seed: int, num_workers: int, order_path: Path) -> dict:
    start = time.perf_counter()
    loader = open_loader(reader, root, seed, num_workers)
    first_batch_s, batches = None, []
    for batch in loader:
        first_batch_s = first_batch_s or time.perf_counter() - start
        batches.append(fingerprints(batch.numpy()))
    seconds = time.perf_counter() - start
    np.save(order_path, np.concatenate(batches))
    return {"seconds": seconds, "first_batch_s": first_batch_s, "batches": len(batches)}


def resume(reader: str, root: Path, seed: int, num_workers: int) -> dict:
    """Stop an epoch after about half its batches, restore a fresh loader, and compare with an uninterrupted one."""
    uninterrupted = batch_fingerprints(open_loader(reader, root, seed, num_workers))
    stop = len(uninterrupted) // 2 + 3
    if engine_of(reader) == "litdata":
        loader = open_loader(reader, root, seed, num_workers)
        head = batch_fingerprints(loader, limit=stop)
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would store it
        del loader
        restored = open_loader(reader, root, seed, num_workers)
        restored.load_state_dict(state)
    else:
        head = batch_fingerprints(open_loader(reader, root, seed, num_workers), limit=stop)
        restored = open_loader(reader, root, seed, num_workers, skip_batches=stop)
    tail = batch_fingerprints(restored)
    resumed = head + tail
    identical = len(resumed) == len(uninterrupted) and all(map(np.array_equal, resumed, uninterrupted))
    return {
        "batches": len(uninterrupted),
        "stopped_after": stop,
        "resumed_batches": len(resumed),
        "head_identical": all(map(np.array_equal, head, uninterrupted[:stop])),
        "identical": bool(identical),
    }


def run_child(task: dict) -> None:
    """Run one measurement; write its result, with the process's VmHWM, to task["result"]."""
    root, name = Path(task["root"]), task["name"]
    for module in ("torch", engine_of(name)):  # imported before the clock starts
        importlib.import_module(module)
    start = time.perf_counter()
    if task["kind"] == "write":
        writer = write_litdata if name == "litdata" else write_datasets
        result = writer(root, task["tokens"], task["seed"], task["workers"])
        result["seconds"] = time.perf_counter() - start
    elif task["kind"] == "read":
        result = read(name, root, task["seed"], task["workers"], Path(task["order"]))
    else:
        result = resume(name, root, task["seed"], task["workers"])
    result["main_hwm_mb"] = vm_hwm_mb()
    Path(task["result"]).write_text(json.dumps(result))


def vm_hwm_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


# --- the parent: runs the subprocesses and samples their memory -------------------------------------------------


def tree_memory_mb(process: psutil.Process) -> tuple[float, float]:
    """RSS and anonymous RSS, in MB, summed over ``process`` and its descendants."""
    rss = anon = 0
    for proc in [process, *process.children(recursive=True)]:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            continue
        fields = dict(re.findall(r"(VmRSS|RssAnon):\s+(\d+) kB", status))
        rss += int(fields.get("VmRSS", 0))
        anon += int(fields.get("RssAnon", 0))
    return rss / 1024, anon / 1024


def run_measurement(task: dict, work: Path, log: Path) -> dict:
    task = {**task, "result": str(work / "result.json")}
    Path(task["result"]).unlink(missing_ok=True)
    with log.open("a") as log_file:
        log_file.write(f"\n=== {json.dumps(task)}\n")
        log_file.flush()
        child = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(task)], stdout=log_file, stderr=subprocess.STDOUT
        )
        process, peak_rss, peak_anon = psutil.Process(child.pid), 0.0, 0.0
        while child.poll() is None:
            rss, anon = tree_memory_mb(process)
            peak_rss, peak_anon = max(peak_rss, rss), max(peak_anon, anon)
            time.sleep(0.05)
    if child.returncode:
        raise RuntimeError(f"{task['kind']} {task['name']} failed (exit {child.returncode}); see {log}")
    return {**json.loads(Path(task["result"]).read_text()), "tree_rss_mb": peak_rss, "tree_anon_mb": peak_anon}


def shuffle_spread(order: np.ndarray, position: dict[int, int], windows: int) -> dict:
    """How many 1% slices of the stream each batch, and the first FIRST_WINDOWS windows, come from."""
    slices = np.array([position[int(f)] for f in order]) * SLICES // windows
    per_batch = [len(np.unique(slices[i : i + BATCH])) for i in range(0, len(slices) - BATCH + 1, BATCH)]
    return {"batch_slices": float(np.mean(per_batch)), "first_slices": len(np.unique(slices[:FIRST_WINDOWS]))}


def disk_usage(path: Path) -> dict:
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"files": len(files), "mb": sum(p.stat().st_size for p in files) / 1e6}


# --- the report --------------------------------------------------------------------------------------------------


def cpu_description() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s+(.+)", lscpu)
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    wanted = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
    return {
        "model": model.group(1).strip() if model else platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "flags": {flag: flag in flags for flag in wanted},
    }


def mosaic_requirements() -> list[str]:
    """The Requires-Dist of mosaicml-streaming's wheel, as PyPI serves it (empty if it could not be downloaded)."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", MOSAIC, "-d", folder], capture_output=True
        )
        wheels = glob.glob(f"{folder}/*.whl")
        if not wheels:
            return []
        with zipfile.ZipFile(wheels[0]) as wheel:
            meta = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
            lines = wheel.read(meta).decode().splitlines()
    return [
        line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def both(values: list[float], fmt: str) -> str:
    """The repetitions' values, formatted, as one table cell."""
    return " / ".join(format(v, fmt) for v in values)


def column(runs: list[dict], key: str, fmt: str) -> str:
    return both([run[key] for run in runs], fmt)


def row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def report(args, results: dict, spreads: dict, disks: dict, resumes: dict, wall_s: float) -> str:
    cpu = cpu_description()
    flags = ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in cpu["flags"].items())
    windows = n_windows(args.tokens)
    tokens = windows * WINDOW
    lines = [
        "# Streaming-shard engines: litdata vs Hugging Face datasets (Arrow)",
        "",
        f"Generated by `scripts/bench_shards.py` on {datetime.date.today()} in {wall_s / 60:.1f} min.",
        "",
        f"Machine: {cpu['model']} ({flags}), {cpu['cores']} cores, {cpu['ram_gib']:.0f} GiB RAM, no GPU;"
        f" Python {platform.python_version()}. Shards on local disk, read from a warm page cache (just written).",
        "",
        "Command:",
        "",
        "```",
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')} .venv/bin/python scripts/bench_shards.py"
        f" {shlex.join(sys.argv[1:])}",
        "```",
        "",
        "Packages: " + ", ".join(f"{p} {version(p)}" for p in PACKAGES) + ".",
        "",
        "## What was measured",
        "",
        f"One synthetic token stream: {tokens:,} uint16 token ids (vocabulary {VOCAB}, seed {args.seed}), generated"
        f" {PART_WINDOWS} windows at a time, stored by each engine as {windows:,} disjoint windows of {WINDOW}"
        " tokens (512 inputs + 1 target):",
        "",
        f"- **litdata**: `optimize(fn, inputs=parts, chunk_size={LITDATA_CHUNK_WINDOWS}*{WINDOW},"
        " item_loader=TokensLoader())` (each part one uint16 array; chunks hold whole windows), read with"
        f" `StreamingDataset(item_loader=TokensLoader(block_size={WINDOW}), shuffle=True)` +"
        f" `StreamingDataLoader(batch_size={BATCH})`; its default shuffle permutes the chunks, then inside each"
        " chunk blocks of 256 windows, then the windows inside each block (`item_shuffle_window`); the reader"
        " **litdata-fullchunk** is the same with `item_shuffle_window=0`: a full permutation inside each chunk.",
        "- **datasets**: `Dataset.from_generator` (one row per window, feature `List(Value('uint16'),"
        f" length={WINDOW})`, `num_proc` = workers) then `save_to_disk`; the generator's cache is deleted after, so"
        " the write time counts writing the Arrow data twice (generate + save, split below). Read with"
        f" `load_from_disk(...).with_format('numpy')` (memory-mapped) through `torch.utils.data.DataLoader(batch_size="
        f"{BATCH}, sampler=<seeded torch.randperm>)`: every window once, uniformly shuffled.",
        "",
        "Each cell lists the repetitions in the order run (a / b); they were interleaved (litdata, datasets, litdata,"
        " datasets for the writes; litdata, litdata-fullchunk, datasets, again for the reads)."
        " Each write and each read ran in a fresh subprocess. *Main peak* is the main process's VmHWM; *tree peak* is"
        " the peak of the RSS summed over the process and its workers (sampled every 50 ms), *anon* the same without"
        " file-backed pages (mapped shards, libraries). The reads use the shards of the last write (2 workers).",
        "",
        "## Writing",
        "",
        "| engine | workers | time (s) | M tokens/s | main peak RSS (MB) | tree peak RSS (MB) | tree peak anon (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workers in (1, 2):
        for engine in ENGINES:
            runs = results["write", engine, workers]
            seconds = [r["seconds"] for r in runs]
            lines.append(
                row(
                    engine,
                    workers,
                    both(seconds, ".1f"),
                    both([tokens / s / 1e6 for s in seconds], ".2f"),
                    column(runs, "main_hwm_mb", ".0f"),
                    column(runs, "tree_rss_mb", ".0f"),
                    column(runs, "tree_anon_mb", ".0f"),
                )
            )
    splits = [
        f"{workers} worker{'s' if workers > 1 else ''}: generate {column(runs, 'generate_s', '.1f')} s,"
        f" save {column(runs, 'save_s', '.1f')} s"
        for workers in (1, 2)
        for runs in [results["write", "datasets", workers]]
    ]
    lines += [
        "",
        f"datasets' write split: {'; '.join(splits)}.",
        "",
        "## Reading (every window once, shuffled, batch 16)",
        "",
        "| reader | num_workers | epoch (s) | windows/s | M tokens/s | first batch (s) | main peak RSS (MB)"
        " | tree peak RSS (MB) | tree peak anon (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workers in (0, 2):
        for reader in READERS:
            runs = results["read", reader, workers]
            seconds = [r["seconds"] for r in runs]
            lines.append(
                row(
                    reader,
                    workers,
                    both(seconds, ".1f"),
                    both([windows / s for s in seconds], ",.0f"),
                    both([tokens / s / 1e6 for s in seconds], ".2f"),
                    column(runs, "first_batch_s", ".2f"),
                    column(runs, "main_hwm_mb", ".0f"),
                    column(runs, "tree_rss_mb", ".0f"),
                    column(runs, "tree_anon_mb", ".0f"),
                )
            )
    lines += [
        "",
        "Every read above yielded every window exactly once (its windows' 64-bit fingerprints equal, as a multiset,"
        " those of the stream): "
        + ("yes, all." if all(s["complete"] for s in spreads.values()) else "NO (see the column complete)."),
        "",
        f"Shuffle spread (uniform shuffle: ≈{SLICES * (1 - (1 - 1 / SLICES) ** BATCH):.1f} slices per batch,"
        f" ≈{SLICES * (1 - (1 - 1 / SLICES) ** FIRST_WINDOWS):.0f} in the first {FIRST_WINDOWS:,} windows):",
        "",
        f"| reader | num_workers | complete | distinct 1% slices of the stream per batch | ... in the first"
        f" {FIRST_WINDOWS:,} windows |",
        "|---|---|---|---|---|",
    ]
    yes = {True: "yes", False: "NO"}
    for workers in (0, 2):
        for reader in READERS:
            spread = spreads[reader, workers]
            lines.append(
                row(
                    reader,
                    workers,
                    yes[spread["complete"]],
                    column(spread["runs"], "batch_slices", ".1f"),
                    column(spread["runs"], "first_slices", "d"),
                )
            )
    lines += [
        "",
        "## Resume mid-epoch",
        "",
        "An epoch is read uninterrupted; then a loader is stopped after about half the batches, a new loader is"
        " restored (litdata: `StreamingDataLoader.state_dict()` through a JSON round trip, then `load_state_dict` on a"
        " fresh `StreamingDataset` + `StreamingDataLoader`; datasets: the same seeded permutation rebuilt, the"
        " consumed batches skipped, i.e. the sampler resumed from its position as"
        " `lenext.data.loaders.StepShuffler` does),"
        " and the batches before the stop plus the restored loader's are compared, batch by batch, with the"
        " uninterrupted epoch's. Run once each (a correctness check, not a timing).",
        "",
        "| reader | num_workers | batches | stopped after | batches after resume | same batches before stop"
        " | identical epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for (reader, workers), r in resumes.items():
        lines.append(
            row(
                reader,
                workers,
                r["batches"],
                r["stopped_after"],
                r["resumed_batches"],
                yes[r["head_identical"]],
                yes[r["identical"]],
            )
        )
    lines += [
        "",
        "## Disk",
        "",
        "| engine | files | MB | bytes per token |",
        "|---|---|---|---|",
    ]
    for engine in ENGINES:
        disk = disks[engine]
        lines.append(row(engine, disk["files"], f"{disk['mb']:.1f}", f"{disk['mb'] * 1e6 / tokens:.3f}"))
    requirements = mosaic_requirements()
    conflicts = [r for r in requirements if re.match(r"(numpy|transformers)\b", r)]
    lines += [
        "",
        "## MosaicML streaming",
        "",
        f"`pip download --no-deps {MOSAIC}` and its wheel's METADATA: "
        + (
            f"Requires-Dist {', '.join(f'`{r}`' for r in conflicts)}, while lenext requires `transformers>=5` and has"
            f" numpy {version('numpy')} and transformers {version('transformers')} installed: it cannot be installed"
            " beside lenext, so it was not measured."
            if requirements
            else "could not be downloaded; not checked."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000_000, help="length of the token stream")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench-shards.md"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the shards go (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return

    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_shards_", dir=args.workdir))
    log = work / "log.txt"
    print(f"shards and log in {work}", flush=True)
    expected = np.concatenate(
        [fingerprints(token_part(p, args.tokens, args.seed).reshape(-1, WINDOW)) for p in range(n_parts(args.tokens))]
    )
    position = {int(f): i for i, f in enumerate(expected)}
    common = {"tokens": args.tokens, "seed": args.seed}
    results: dict = {}

    def measure(kind: str, name: str, workers: int, **extra) -> dict:
        """Run a write (``name`` an engine), a read or a resume (``name`` a reader) in a fresh subprocess."""
        task = {**common, **extra, "kind": kind, "name": name, "workers": workers, "root": str(work / engine_of(name))}
        result = run_measurement(task, work, log)
        results.setdefault((kind, name, workers), []).append(result)
        print(kind, name, workers, {k: round(v, 2) for k, v in result.items()}, flush=True)
        return result

    for _ in range(args.repeats):
        for workers in (1, 2):
            for engine in ENGINES:
                shutil.rmtree(work / engine, ignore_errors=True)
                measure("write", engine, workers)
    disks = {engine: disk_usage(work / engine) for engine in ENGINES}

    spreads: dict = {}
    for _ in range(args.repeats):
        for workers in (0, 2):
            for reader in READERS:
                order_path = work / "order.npy"
                measure("read", reader, workers, order=str(order_path))
                order = np.load(order_path)
                spread = spreads.setdefault((reader, workers), {"runs": [], "complete": True})
                spread["runs"].append(shuffle_spread(order, position, len(expected)))
                spread["complete"] &= bool(np.array_equal(np.sort(order), np.sort(expected)))

    resumes = {}
    for workers in (0, 2):
        for reader in READERS:
            resumes[reader, workers] = measure("resume", reader, workers)
    if {engine: disk_usage(work / engine) for engine in ENGINES} != disks:
        raise RuntimeError("the shards changed while being read")

    args.out.write_text(report(args, results, spreads, disks, resumes, time.perf_counter() - start))
    shutil.rmtree(work)
    print(f"wrote {args.out} in {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
