"""Train a decoder with a chosen positional encoding: `python train.py pe=rope data.max_len=512`."""

from lenext.cli import train_main

if __name__ == "__main__":
    train_main()
