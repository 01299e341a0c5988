"""lenext: length-extrapolation experiments for positional encodings."""

import torch

# Flush denormal floats to zero. ALiBi's far keys get probabilities below fp32's normal range
# (e^-87), and CPU arithmetic on denormals is ~100x slower: its attention backward ran 2.4x
# slower than NoPE's. This must run before torch's first parallel region: the OpenMP worker
# threads copy the flag from the thread that creates them, and never see a later change.
torch.set_flush_denormal(True)
