"""Evaluate a checkpoint beyond its training length: `python eval.py ckpt=<path> eval.lengths=[512,2048]`."""

from lenext.cli import eval_main

if __name__ == "__main__":
    eval_main()
