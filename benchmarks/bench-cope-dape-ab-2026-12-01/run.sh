#!/bin/bash
# CoPE and DAPE (NoPE the baseline), the code of the last make bench on an AMX Xeon (fb80210, benchmarks/bench.md)
# against the code after session 59's changes (9396263), alternated old, new, old, new: the training section and
# the forward at 8,192 tokens. /tmp/old and /tmp/new: worktrees of the two, each run on /work/main's .venv with
# PYTHONPATH to its src; the reports are old-<i>.md and new-<i>.md.
set -u
OUT=$(dirname "$0")
for i in 1 2; do
  (cd /tmp/old && PYTHONPATH=/tmp/old/src /work/main/.venv/bin/python scripts/bench.py --sections training,forward \
    --rows nope,cope,dape --lengths 8192 --out /tmp/ab/old-$i.md > /tmp/ab/old-$i.log 2>&1); echo "old $i rc=$?"
  (cd /tmp/new && PYTHONPATH=/tmp/new/src /work/main/.venv/bin/python scripts/bench.py --sections training,forward \
    --rows nope,cope,dape --lengths 8192 --out /tmp/ab/new-$i.md > /tmp/ab/new-$i.log 2>&1); echo "new $i rc=$?"
done
cp /tmp/ab/*.md "$OUT"/
