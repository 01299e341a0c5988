"""KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation").

A learned conditionally positive definite kernel of the distance |i - j| as the score bias, per head h:
- ``log``:   -r1_h log(1 + r2_h |i - j|)
- ``power``: -r1_h |i - j|^r2_h, with 0 < r2_h <= 2
r1_h, r2_h are learned per layer (each attention layer of the official gpt-neox code owns its
kernel), initialised uniformly as there (log: r1 ~ U(0, 2), r2 ~ U(0, 1); power: r1 ~ U(0, 1),
r2 ~ U(0, 2)) and kept in the kernel's domain by clamping to [0.01, ...] as there. The official code
clamps the stored value in place; here the forward uses the clamped value and passes the gradient
straight through, the same projection without an in-place write inside the autograd graph.
Unlike ALiBi's, the bias is not linear in j and not constant beyond any band: the attention takes its
general path (query blocks, never an (L, L) tensor at once) on CPU and a score_mod on CUDA.
"""

from typing import Literal

import torch
from torch import nn

from lenext.pe.base import AttentionShape, PositionalEncoding, relative_offsets

FLOOR = 1e-2  # the official code's lower bound for r1 and r2


def clamped(parameter: torch.Tensor, low: float, high: float | None = None) -> torch.Tensor:
    """``parameter`` clamped to [low, high] in value, with the identity's gradient (a projection)."""
    return parameter + (parameter.clamp(low, high) - parameter).detach()


def kerple_bias(distance: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, kernel: str) -> torch.Tensor:
    """distance (...) >= 0, r1 and r2 (H,) already in their domain -> (H, ...) bias."""
    r1, r2 = (r.view(-1, *[1] * distance.dim()) for r in (r1, r2))
    if kernel == "log":
        return -r1 * torch.log1p(r2 * distance)
    return -r1 * distance.pow(r2)


class KERPLE(PositionalEncoding):
    """Kernelized relative bias: -r1 log(1 + r2 |i - j|) or -r1 |i - j|^r2, learned per head and layer."""

    has_score_bias = True

    def __init__(self, shape: AttentionShape, kernel: Literal["log", "power"] = "log", per_layer: bool = True):
        super().__init__(shape)
        self.kernel, self.per_layer = kernel, per_layer
        tables = shape.n_layers if per_layer else 1
        scale_r1, scale_r2 = (2.0, 1.0) if kernel == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.rand(tables, shape.n_heads) * scale_r1)
        self.r2 = nn.Parameter(torch.rand(tables, shape.n_heads) * scale_r2)

    def kernel_parameters(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (r1, r2), each (H,) fp32, in the kernel's domain."""
        index = layer if self.per_layer else 0
        r1 = clamped(self.r1[index].float(), FLOOR)
        r2 = clamped(self.r2[index].float(), FLOOR, 2.0 if self.kernel == "power" else None)
        return r1, r2

    def score_bias(self, q, layer, start, end):
        offsets = relative_offsets(start, end, q.device)  # (rows, end): j - i
        bias = kerple_bias((-offsets).clamp(min=0).float(), *self.kernel_parameters(layer), self.kernel)
        return bias.masked_fill(offsets > 0, float("-inf"))[None]  # (1, H, rows, end)

    def score_mod(self, q, layer):
        r1, r2 = self.kernel_parameters(layer)
        log_kernel = self.kernel == "log"

        def kerple(score, b, h, q_idx, kv_idx):
            distance = (q_idx - kv_idx).abs().float()
            return score - r1[h] * (torch.log1p(r2[h] * distance) if log_kernel else distance.pow(r2[h]))

        return kerple

    def describe(self) -> dict:
        return {"name": "KERPLE", "kernel": self.kernel, "per_layer": self.per_layer}
