#!/bin/bash
# The training section alone for NoPE, CoPE and DAPE, fb80210 (old) against 9396263 (new), alternated three times
# (old, new, ...), 10 repetitions each, after run.sh's two rounds disagreed with the morning's DAPE A/B
# (benchmarks/bench-dape-2026-12-01/). Worktrees and .venv as in run.sh; reports train-old-<i>.md, train-new-<i>.md.
set -u
OUT=$(dirname "$0")
for i in 1 2 3; do
  for side in old new; do
    (cd /tmp/$side && PYTHONPATH=/tmp/$side/src /work/main/.venv/bin/python scripts/bench.py --sections training \
      --rows nope,cope,dape --out /tmp/ab/train-$side-$i.md > /tmp/ab/train-$side-$i.log 2>&1); echo "$side $i rc=$?"
  done
done
cp /tmp/ab/train-*.md "$OUT"/
