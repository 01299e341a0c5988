"""PaTH's attention at one length, evaluation (no gradient), with ``PathLogits`` as first written (26abdd3: each
block's rows assembled by concatenation) and as now (written into one output), alternated in one process; batch 1,
8 heads, head dim 32, glibc's memory setting as train.py's (``keep_freed_memory``). From the repository root:

    python benchmarks/bench-path-blocks-2026-12-01/first_vs_final.py [L]
"""

import subprocess
import sys
import time
import types

import torch
import torch.nn.functional as F

from lenext.attention import causal_attention
from lenext.hardware import keep_freed_memory
from lenext.pe.base import ScoreTerms
from lenext.pe.path import PathLogits

first = types.ModuleType("path_first")
exec(subprocess.check_output(["git", "show", "26abdd3:src/lenext/pe/path.py"], text=True), first.__dict__)

keep_freed_memory()
torch.manual_seed(0)
length = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
q, k, v = (torch.randn(1, 8, length, 32) for _ in "qkv")
w = F.normalize(torch.randn(1, 8, length, 32), dim=-1)
beta = 2 * torch.rand(1, 8, length)


def terms(logits_class) -> ScoreTerms:
    made = []

    def logits(start, end):
        if not made:
            made.append(logits_class(q, k, w, beta))
        return made[0](start, end)

    return ScoreTerms(logits=logits)


with torch.no_grad():
    difference = causal_attention(q, k, v, terms(first.PathLogits)) - causal_attention(q, k, v, terms(PathLogits))
    print(f"L {length}: outputs differ by at most {difference.abs().max().item():.1e}")
    times = {"first": [], "final": []}
    for _ in range(4):
        for name, logits_class in (("first", first.PathLogits), ("final", PathLogits)):
            start = time.perf_counter()
            causal_attention(q, k, v, terms(logits_class))
            times[name].append(time.perf_counter() - start)
for name, seconds in times.items():
    print(f"{name}: " + ", ".join(f"{s:.2f}" for s in seconds) + " s")
