"""lenext: length-extrapolation experiments for positional encodings."""

import sys
import warnings

from lenext.errors import ctrl_c_in_one_line, started_as_command  # the standard library's modules only

if started_as_command():  # before the seconds of loading torch and the rest, which Ctrl-C may interrupt
    sys.excepthook = ctrl_c_in_one_line(sys.excepthook)

import torch  # noqa: E402

# Flush denormal floats to zero: ALiBi's far keys get probabilities below fp32's normal range, on which CPU
# arithmetic crawls. Before torch's first parallel region: OpenMP's threads copy the flag once, when created.
torch.set_flush_denormal(True)

# Library notices a lenext user cannot act on, silenced by exact message (every other warning still shows):
# Lightning builds torch's deprecated LeafSpec on every step;
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
# a run folder's checkpoints are lenext's to judge: it resumes from them or refuses the folder (lenext.run).
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
# torch 2.4 warns at Lightning's load of the run's own last.ckpt when it resumes (a file lenext wrote).
warnings.filterwarnings(
    "ignore", message=r"You are using `torch.load` with `weights_only=False`", category=FutureWarning
)
# validation logs torchmetrics' computes, already reduced over the ranks (lenext.module): nothing to accumulate.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/.*sync_dist=True")
