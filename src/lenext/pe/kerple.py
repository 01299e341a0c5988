"""KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation").

A learned conditionally positive definite kernel of the distance |i - j| as the score bias, per head h:

- ``log``:   -r1_h log(1 + r2_h |i - j|)
- ``power``: -r1_h |i - j|^r2_h, with 0 < r2_h <= 2

r1_h, r2_h are learned per layer (each attention layer of the official gpt-neox code owns its
kernel), initialised uniformly as there (log: r1 ~ U(0, 2), r2 ~ U(0, 1); power: r1 ~ U(0, 1),
r2 ~ U(0, 2)) and projected into the kernel's domain (clamped in place to [0.01, ...], power r2 <= 2)
at initialisation and after every optimizer step: the official code clamps in place before every
use, which puts the same values in every forward.
Unlike ALiBi's, the bias is not linear in j and not constant beyond any band: a pair bias, which the
attention scores in query blocks (never an (L, L) tensor at once) on CPU and as a score_mod on CUDA.
"""

from typing import Literal

import torch
from torch import nn

from lenext.pe.base import (
    AttentionShape,
    PositionalEncoding,
    distance_score_mod,
    position_differences,
    position_span,
)

FLOOR = 1e-2  # the official code's lower bound for r1 and r2


def kerple_kernel(distance, r1, r2, kernel: str):
    """-r1 log(1 + r2 d) or -r1 d^r2 for distances d >= 0; broadcasts (tensors, or a score_mod's scalars)."""
    return -r1 * torch.log1p(r2 * distance) if kernel == "log" else -r1 * distance.pow(r2)


class KERPLE(PositionalEncoding):
    """Kernelized relative bias: -r1 log(1 + r2 |i - j|) or -r1 |i - j|^r2, learned per head and layer."""

    FAMILY = "additive bias"

    def __init__(self, shape: AttentionShape, kernel: Literal["log", "power"] = "log", per_layer: bool = True):
        super().__init__(shape)
        self.kernel, self.per_layer = kernel, per_layer
        tables = shape.n_layers if per_layer else 1
        scale_r1, scale_r2 = (2.0, 1.0) if kernel == "log" else (1.0, 2.0)
        self.r1 = nn.Parameter(torch.rand(tables, shape.n_heads) * scale_r1)
        self.r2 = nn.Parameter(torch.rand(tables, shape.n_heads) * scale_r2)
        self.project_()

    def project_(self) -> None:
        with torch.no_grad():
            self.r1.clamp_(min=FLOOR)
            self.r2.clamp_(min=FLOOR, max=2.0 if self.kernel == "power" else None)

    def kernel_parameters(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (r1, r2), each (H,), in fp32 (a float64 model's: float64)."""
        index = layer if self.per_layer else 0
        wide = torch.promote_types(self.r1.dtype, torch.float32)
        return self.r1[index].to(wide), self.r2[index].to(wide)

    def pair_bias(self, layer):
        r1, r2 = (r[:, None, None] for r in self.kernel_parameters(layer))  # (H, 1, 1)

        def kerple(query_positions, key_positions):
            distance = position_differences(query_positions, key_positions).clamp(min=0).to(r1.dtype)[:, None]
            return kerple_kernel(distance, r1, r2, self.kernel)  # (B or 1, H, R, K)

        return kerple

    def score_mod(self, q, positions, layer):
        # Looked up per distance, as T5's bias: flex's backward scatters each score's gradient into this (N, H)
        # table instead of adding all L^2 of them atomically into r1 and r2 (slower and less exact: docs/pes/kerple.md).
        r1, r2 = (r.float() for r in self.kernel_parameters(layer))  # flex's scores are fp32
        distance = torch.arange(position_span(positions), device=q.device, dtype=torch.float32)[:, None]
        return distance_score_mod(kerple_kernel(distance, r1, r2, self.kernel), positions, q.size(0))  # (N, H)
