#!/bin/bash
# After run-training.sh, whose old arm ran first in each pair and was faster for CoPE in all five pairs of both
# scripts: the same comparison for NoPE and CoPE with the new arm first (new, old, new, old). Reports
# reversed-<side>-<i>.md.
set -u
OUT=$(dirname "$0")
for i in 1 2; do
  for side in new old; do
    (cd /tmp/$side && PYTHONPATH=/tmp/$side/src /work/main/.venv/bin/python scripts/bench.py --sections training \
      --rows nope,cope --out /tmp/ab/reversed-$side-$i.md > /tmp/ab/reversed-$side-$i.log 2>&1); echo "$side $i rc=$?"
  done
done
cp /tmp/ab/reversed-*.md "$OUT"/
