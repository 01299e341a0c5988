#!/bin/bash
# DAPE's training row, before and after its MLP change, alternated: /tmp/ci held a clone of d762a69 (before), /work/main
# the change (4f94ef8), each with its own .venv; the reports are before-<i>.md (ci) and after-<i>.md (main).
for i in 1 2; do
 for d in /tmp/ci /work/main; do
  n=$(basename $d)
  (cd $d && .venv/bin/python scripts/bench.py --sections training --rows dape --reps 5 --out /tmp/dape/train-$n-$i.md > /tmp/dape/train-$n-$i.log 2>&1); echo "$n $i rc=$?"
 done
done
