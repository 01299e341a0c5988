"""One PaTH attention layer, forward and backward, with its logits as before (d1a415c: the queries carried back
diagonal by diagonal, a sequence's (B, H, L, L) logits held whole) and as now (``PathLogits``: a block of rows at a
time), alternated; the small model's shape (batch 8, 8 heads, head dim 32). From the repository root:

    python benchmarks/bench-path-blocks-2026-12-01/attention_step.py [L]
"""

import subprocess
import sys
import time
import types

import torch
import torch.nn.functional as F

from lenext.attention import causal_attention
from lenext.pe.base import ScoreTerms
from lenext.pe.path import PathLogits

before = types.ModuleType("path_before")
exec(subprocess.check_output(["git", "show", "d1a415c:src/lenext/pe/path.py"], text=True), before.__dict__)

torch.manual_seed(0)
length = int(sys.argv[1]) if len(sys.argv) > 1 else 512
q, k, v = (torch.randn(8, 8, length, 32, requires_grad=True) for _ in "qkv")
w = F.normalize(torch.randn(8, 8, length, 32), dim=-1).requires_grad_()
beta = (2 * torch.rand(8, 8, length)).requires_grad_()


def terms_before() -> ScoreTerms:
    made = []

    def logits(start, end):
        if not made:
            made.append(before.path_logits(q, k, w, beta))
        return made[0][..., start:end, :end]

    return ScoreTerms(logits=logits)


def terms_now() -> ScoreTerms:
    made = []

    def logits(start, end):
        if not made:
            made.append(PathLogits(q, k, w, beta))
        return made[0](start, end)

    return ScoreTerms(logits=logits)


def step(terms) -> torch.Tensor:
    out = causal_attention(q, k, v, terms())
    out.sum().backward()
    return out.detach()


print(f"L {length}: outputs differ by at most {(step(terms_before) - step(terms_now)).abs().max().item():.1e}")
times = {"before": [], "now": []}
for _ in range(6):
    for name, terms in (("before", terms_before), ("now", terms_now)):
        start = time.perf_counter()
        step(terms)
        times[name].append(1000 * (time.perf_counter() - start))
for name, ms in times.items():
    print(f"{name}: median {sorted(ms)[len(ms) // 2]:.0f} ms of {', '.join(f'{t:.0f}' for t in ms)}")
