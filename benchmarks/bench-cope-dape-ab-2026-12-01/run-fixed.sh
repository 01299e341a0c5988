#!/bin/bash
# After keys_product stopped returning a view where nothing is widened: NoPE and CoPE's training, fb80210 (old)
# against the fix (new), alternated new, old, new, old. Reports fixed-<side>-<i>.md.
set -u
OUT=$(dirname "$0")
for i in 1 2; do
  for side in new old; do
    (cd /tmp/$side && PYTHONPATH=/tmp/$side/src /work/main/.venv/bin/python scripts/bench.py --sections training \
      --rows nope,cope --out /tmp/ab/fixed-$side-$i.md > /tmp/ab/fixed-$side-$i.log 2>&1); echo "$side $i rc=$?"
  done
done
cp /tmp/ab/fixed-*.md "$OUT"/
