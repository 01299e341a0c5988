"""DAPE, data-adaptive positional encoding (Zheng et al. 2024, NeurIPS; docs/pes/dape.md).

A base bias b (KERPLE in the paper's main rows; FIRE too) refined by the content: each layer's MLP sees, per pair
(i, j), the scaled logits s_ij = q_i . k_j / sqrt(d_head) of every head and the base bias of every head, and
adds one output per head: z_ij = s_ij + b_ij + f([s_ij; b_ij]), f = Linear(2H, W) -> LeakyReLU -> Linear(W, H),
W = ``mlp_width`` (32 in the reference code's configs), as chuanyang-Zheng/DAPE's ``ParallelKerpleLog_DAPE``
(its weights start as the model's other linear weights, not at torch's default as there: docs/pes/dape.md). The
MLP needs every logit of a pair: only the explicit query blocks compute it, its hidden activations in chunks of
rows (memory O(rows x keys) per block).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lenext.errors import ConfigError
from lenext.pe.base import (
    HIDDEN_ELEMENTS,
    AttentionShape,
    LayerPE,
    PositionalEncoding,
    ScoreTerms,
    device_budget,
    widened,
    widened_end,
)
from lenext.ranges import PositiveInt


class DAPE(PositionalEncoding):
    """A base PE's pair bias plus a per-layer MLP over the heads' logits and biases."""

    FAMILY = "2024-26 methods"

    def __init__(
        self, shape: AttentionShape, base: Callable[[AttentionShape], PositionalEncoding], mlp_width: PositiveInt = 32
    ):
        super().__init__(shape)
        self.base, self.mlp_width = base(shape), mlp_width
        if self.base.pair_bias(0) is None:
            raise ConfigError(
                f"pe.base={type(self.base).__name__} is invalid for DAPE: it must be a PE whose whole signal is a "
                "bias of the pair (i, j) (kerple, fire), which the MLP takes as its input"
            )

    def layer(self, index: int) -> LayerPE:
        return AdaptiveBias(self.base.layer(index), self.shape.n_heads, self.mlp_width)

    def project_(self) -> None:
        self.base.project_()

    def describe(self) -> dict:
        return {"name": "DAPE", "base": self.base.describe(), "mlp_width": self.mlp_width}

    def hyperparameters(self) -> dict:
        base = {"_target_": f"{type(self.base).__module__}.{type(self.base).__qualname__}", "_partial_": True}
        return {"base": base | self.base.hyperparameters(), "mlp_width": self.mlp_width}


class AdaptiveBias(LayerPE):
    """One layer's base bias and its MLP f."""

    reads_logits = True
    takes_row_scale = False  # f reads s_ij, which a row's scaled logit r (s + b) does not give back at r = 0

    def __init__(self, base: LayerPE, heads: int, width: int):
        super().__init__()
        self.base = base
        self.mlp = nn.Sequential(nn.Linear(2 * heads, width), nn.LeakyReLU(), nn.Linear(width, heads))

    def terms(self, x, q, k, positions) -> ScoreTerms:
        base = self.base.terms(x, q, k, positions)
        (bias,) = base.biases

        def adaptive(logits: torch.Tensor, start: int, end: int, first: int) -> torch.Tensor:
            pair = bias.pair(start, end, first)  # (B or 1, H, rows, keys) fp32
            seen = logits > float("-inf")  # the MLP's input on masked keys is any finite value: masked again after
            # keys' = [first, widened end): a few shapes of the MLP's products (``widened_end``); keys past end dropped
            keys, last = end - first, widened_end(first, end, q.size(-2), logits)
            scores = widened(torch.where(seen, logits - pair, 0.0), end, last)  # s_ij
            scores, pair = scores.movedim(1, -1), widened(pair, end, last).movedim(1, -1)  # (B or 1, rows, keys', H)
            # f's first layer on [s; b] as two products, b's once for a batch that shares it: no (B, .., 2H) copy.
            # Under bf16 autocast the MLP runs in bf16 (it is most of DAPE's work); its output joins fp32 logits.
            inner, activation, outer = self.mlp
            heads = scores.size(-1)
            on_scores, on_pair = inner.weight[:, :heads], inner.weight[:, heads:]
            budget = device_budget(HIDDEN_ELEMENTS, logits.device)
            rows = max(1, budget // (scores.shape[0] * scores.shape[2] * inner.out_features))
            chunks = [
                outer(activation(F.linear(s, on_scores) + F.linear(b, on_pair, inner.bias)))
                for s, b in zip(scores.split(rows, dim=1), pair.split(rows, dim=1), strict=True)
            ]
            return torch.cat(chunks, dim=1)[:, :, :keys].movedim(-1, 1)

        return ScoreTerms(base.biases, base.value, base.logits, base.logit_terms + (adaptive,))
