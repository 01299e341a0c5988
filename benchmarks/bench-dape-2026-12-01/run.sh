#!/bin/bash
for i in 1 2; do
 for d in /tmp/ci /work/main; do
  n=$(basename $d)
  (cd $d && .venv/bin/python scripts/bench.py --sections training --rows dape --reps 5 --out /tmp/dape/train-$n-$i.md > /tmp/dape/train-$n-$i.log 2>&1); echo "$n $i rc=$?"
 done
done
