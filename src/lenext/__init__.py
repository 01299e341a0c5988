"""lenext: length-extrapolation experiments for positional encodings."""

import warnings

import torch

# Flush denormal floats to zero. ALiBi's far keys get probabilities below fp32's normal range
# (e^-87), and CPU arithmetic on denormals is ~100x slower: its attention backward ran 2.4x
# slower than NoPE's. This must run before torch's first parallel region: the OpenMP worker
# threads copy the flag from the thread that creates them, and never see a later change.
torch.set_flush_denormal(True)

# Library notices a lenext user cannot act on, silenced by exact message (every other warning still shows):
# lightning 2.6 builds torch's deprecated LeafSpec on every step under torch 2.13;
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
# a run folder's checkpoints are lenext's to judge: it resumes from them or refuses the folder (lenext.run).
warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
