"""FoX, the Forgetting Transformer (Lin et al. 2025, ICLR; zhixuan-lin/forgetting-transformer; docs/pes/fox.md).

Each head of each layer has a forget gate computed from the layer's input x_t (B, L, d_model):
f_t = sigmoid(w . x_t + b), and the logit of query i and key j gains sum_{l = j+1..i} log f_l = F_i - F_j, with
F the cumulative sum of log f over the tokens (not their positions). Softmax drops the row's F_i, so the bias
is one of the key alone, -F_j, with a gradient into the gate: it rides SDPA's fused causal kernel (as channels of
q and k while training, ``lenext.attention.key_bias_channels_attention``), or, while training on CUDA under bf16
with fla installed, fla's forgetting-attention kernel, which takes the log gates themselves (``Bias.gates``). As fla's
layer (``f_proj``): one ``nn.Linear(d_model, H)`` per layer, its bias starting at 0. FoX alone has no other PE
(``pe=fox``); with RoPE it is ``pe=fox_rope`` (``Compose``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from lenext.pe.base import Bias, LayerPE, PositionalEncoding, ScoreTerms


class FoX(PositionalEncoding):
    """The forget gate's PE: every parameter is a layer's (``ForgetGate``), none is shared."""

    FAMILY = "2024-26 methods"

    def layer(self, index: int) -> LayerPE:
        return ForgetGate(self.shape.d_model, self.shape.n_heads)


class ForgetGate(LayerPE):
    """One layer's forget gates: log f (B, L, H) from the layer's input, as the key bias -F_j."""

    up_to_row_constant = True  # -F_j drops the row's F_i

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.gate = nn.Linear(d_model, n_heads, bias=True)
        nn.init.zeros_(self.gate.bias)  # fla's initialisation; the decoder draws the weight

    def log_forget(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, H) log f_t, fp32 (or float64)."""
        gate = self.gate(x)
        return F.logsigmoid(gate.to(torch.promote_types(gate.dtype, torch.float32)))

    def terms(self, x, q, k, positions) -> ScoreTerms:
        log_forget = self.log_forget(x)
        # (B, H, 1, L) F_j, summed in float64: in fp32, F of 16k tokens (about -0.7 each at the start) would carry
        # absolute errors near 1e-3 into every difference F_i - F_j.
        cumulative = log_forget.double().cumsum(1).transpose(1, 2)[:, :, None, :]
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32; float64 for a float64 model (tests)

        def key(first: int, end: int) -> torch.Tensor:
            # F_{end-1} - F_j: anchored at the last key, so rows far from it are rounded at |F| (docs/pes/fox.md).
            return (cumulative[..., end - 1 : end] - cumulative[..., first:end]).to(wide)

        return ScoreTerms((Bias(key=key, gates=lambda: log_forget),))
