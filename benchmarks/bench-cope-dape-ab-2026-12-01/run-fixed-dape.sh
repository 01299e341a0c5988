#!/bin/bash
# DAPE after the same fix: its explicit path had paid the copy too since 7206431, which the evening's pairs
# (run.sh, run-training.sh) measured against the code before its MLP change. NoPE and DAPE's training, fb80210
# (old) against the fix (new), alternated new, old, new, old. Reports fixed-dape-<side>-<i>.md.
set -u
OUT=$(dirname "$0")
for i in 1 2; do
  for side in new old; do
    (cd /tmp/$side && PYTHONPATH=/tmp/$side/src /work/main/.venv/bin/python scripts/bench.py --sections training \
      --rows nope,dape --out /tmp/ab/fixed-dape-$side-$i.md > /tmp/ab/fixed-dape-$side-$i.log 2>&1); echo "$side $i rc=$?"
  done
done
cp /tmp/ab/fixed-dape-*.md "$OUT"/
