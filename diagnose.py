"""Why a PE fails beyond L_train: `python diagnose.py ckpt=<run folder or .ckpt> [lengths=[...]] [windows=8]`."""

from lenext.diagnostics import main

if __name__ == "__main__":
    main()
