"""Absolute PEs, added to the token embeddings."""

import torch
from torch import nn

from lenext.errors import ConfigError, LengthNotSupported
from lenext.pe.base import AttentionShape, PositionalEncoding, position_span
from lenext.ranges import PositiveInt


def sinusoidal_table(length: int, dim: int) -> torch.Tensor:
    """(length, dim) table: PE[p, 2t] = sin(p / 10000^(2t/d)), PE[p, 2t+1] = cos(p / 10000^(2t/d))."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table.float()


class Sinusoidal(PositionalEncoding):
    """Fixed sinusoidal APE (Vaswani et al. 2017), defined for every position."""

    FAMILY = "no PE or absolute"

    def __init__(self, shape: AttentionShape):
        super().__init__(shape)
        # Non-persistent: rebuilt for the longest length seen, so checkpoints stay length-free.
        self.register_buffer("table", torch.empty(0, shape.d_model), persistent=False)

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        needed = position_span(positions)
        if self.table.size(0) < needed:
            self.table = sinusoidal_table(needed, self.shape.d_model).to(x.device)
        return x + self.table[positions].to(x.dtype)  # (B or 1, L, d) broadcast over the batch


class Learned(PositionalEncoding):
    """Learned APE (GPT-2, BERT): one trained vector per position below ``max_len``.

    ``max_len: null``: the positions training reaches (L_train; N under randomized positions, the
    target length under PoSE), so that every row of the table is trained.
    """

    FAMILY = "no PE or absolute"

    def __init__(self, shape: AttentionShape, max_len: PositiveInt | None = None):
        super().__init__(shape)
        self.max_len = max_len or shape.trained_positions
        if self.max_len < shape.trained_positions:
            raise ConfigError(
                f"pe.max_len={self.max_len} is invalid: training reaches positions up to "
                f"{shape.trained_positions - 1}; it must be at least {shape.trained_positions} (or null)"
            )
        self.table = nn.Embedding(self.max_len, shape.d_model)
        nn.init.normal_(self.table.weight, std=0.02)

    @property
    def position_limit(self) -> int:
        return self.max_len

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        last = position_span(positions) - 1
        if last >= self.max_len:
            raise LengthNotSupported(
                f"learned positional embeddings exist for positions 0..{self.max_len - 1}; "
                f"a sequence reaching position {last} needs positions it never trained"
            )
        return x + self.table(positions).to(x.dtype)
