#!/bin/bash
# The code of 2026-11-23 (e8e5e54, the last bench.md on an AMX Xeon) against today's, the training section's 13 rows
# of that day, alternated: old, new, old, new.
# /tmp/old: a worktree of e8e5e54 (run on the current .venv with PYTHONPATH to its src); /tmp/ci: a clone of d762a69.
set -u
PY=/tmp/ci/.venv/bin/python
ROWS=alibi,fire,kerple,learned,nope,rope,rope_ntk,shaw,sinusoidal,t5,xpos,rope+randomized,rope+pose
for i in 1 2; do
  (cd /tmp/old && PYTHONPATH=/tmp/old/src $PY scripts/bench.py --sections training --reps 4 --out /tmp/ab/old$i.md > /tmp/ab/old$i.log 2>&1)
  echo "old$i rc=$?"
  (cd /tmp/ci && $PY scripts/bench.py --sections training --rows $ROWS --reps 4 --out /tmp/ab/new$i.md > /tmp/ab/new$i.log 2>&1)
  echo "new$i rc=$?"
done
