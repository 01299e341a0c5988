"""The positional-encoding interface (DESIGN.md section 2).

A PE acts at up to three sites of the decoder, and implements only the ones it needs:

- ``embed(x)``: added to the token embeddings (sinusoidal, learned);
- ``rotate(q, k)``: applied to queries and keys (RoPE and its scalings);
- ``score_bias(q, layer, start, end)``: added to the attention scores (ALiBi, T5, Shaw), and its
  FlexAttention form ``score_mod(q, layer)`` where the attention runs FlexAttention (CUDA).

The decoder calls all three everywhere and never looks at which PE it holds.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionShape:
    """What a PE needs to know about the model it is plugged into."""

    d_model: int
    n_heads: int
    n_layers: int
    train_len: int  # L_train: learned APE size, and the reference length for RoPE scaling

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class PositionalEncoding(nn.Module):
    """Base class, and on its own the NoPE control: the causal mask is the only positional signal."""

    has_score_bias = False  # True: the attention must add ``score_bias``; False: plain causal SDPA
    key_only_bias = False  # True: ``score_bias`` is (1, H, 1, end) and the attention adds the causal mask
    needs_attention_probs = False  # True: ``value_term`` needs the softmax probabilities (Shaw's a^V)

    def __init__(self, shape: AttentionShape):
        super().__init__()
        self.shape = shape

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) token embeddings -> same shape with position information."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, L, d_head), positions 0..L-1 -> rotated q, k."""
        return q, k

    def score_bias(self, q: torch.Tensor, layer: int, start: int, end: int) -> torch.Tensor:
        """Additive bias for query rows [start, end) against keys [0, end), in units of scaled scores.

        q: (B, H, end - start, d_head). Returns either a key-only (1, H, 1, end) bias (with
        ``key_only_bias``; the attention adds the causal mask, on SDPA's fused kernel when it can)
        or a (B or 1, H, end - start, end) bias that already holds -inf at every j > i, so the
        attention uses it as the mask as it is. By default, the mask ``band_bias`` stands for.
        """
        mask = band_mask(self.band_bias(q, layer), start, end)
        return F.pad(mask, (end - mask.size(-1), 0))  # keys before the band: bias 0

    def band_bias(self, q: torch.Tensor, layer: int) -> torch.Tensor | None:
        """The bias as a band, for PEs whose bias is constant along each row beyond W keys back.

        q: (B, H, R, d_head), query rows i. Returns (B or 1, H, R, W) (an expanded view where it is
        the same for every row): entry w is
        bias(i, j) - bias(i, far) for key j = i - W + 1 + w (w = W - 1 is the diagonal), where
        bias(i, far) is the row's value at every j <= i - W. Softmax ignores a per-row constant, so
        the band alone is the exact bias, and attention can score it without (L, L) work.
        None (the default): the PE has no such form.
        """
        return None

    def score_mod(self, q: torch.Tensor, layer: int) -> Callable | None:
        """``score_bias`` over the whole sequence as a FlexAttention score_mod, or None if there is none.

        q: (B, H, L, d_head). Returns ``(score, b, h, q_idx, kv_idx) -> score + bias``; flex applies
        the causal mask after it, so it may return anything (but must index in bounds) for kv_idx > q_idx.
        None (the default) sends the attention to its SDPA paths, as for PEs flex cannot express.
        """
        return None

    def value_term(self, probs: torch.Tensor, layer: int, start: int, end: int) -> torch.Tensor:
        """Extra attention output from the probabilities (B, H, rows, end) -> (B, H, rows, d_head)."""
        raise NotImplementedError

    def project_(self) -> None:
        """Bring learned parameters back into their domain, after every optimizer step (a projection:
        KERPLE's r1, r2 >= 0.01). Nothing for most PEs."""

    def describe(self) -> dict:
        """Parameters that identify this PE in results files."""
        return {"name": type(self).__name__}


class NoPE(PositionalEncoding):
    """No positional encoding (Kazemnejad et al. 2023): the control row of every study."""


def relative_offsets(start: int, end: int, device: torch.device) -> torch.Tensor:
    """(end - start, end) matrix of j - i for query rows i in [start, end) and keys j in [0, end)."""
    i = torch.arange(start, end, device=device)
    j = torch.arange(end, device=device)
    return j[None, :] - i[:, None]


def diagonal_band(matrix: torch.Tensor, width: int) -> torch.Tensor:
    """The view (..., n, W) of a contiguous (..., n, n + W - 1) matrix whose row r is matrix[r, r : r + W]."""
    *lead_strides, row_stride, _ = matrix.stride()
    return matrix.as_strided((*matrix.shape[:-1], width), (*lead_strides, row_stride + 1, 1))


def band_mask(band: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The fp32 mask a band (B or 1, H, R, W) stands for, for query rows [start, end).

    Covers keys [first, end), first = max(0, start - W + 1): (B or 1, H, end - start, end - first).
    Row i = start + r holds the band on keys i - W + 1 .. i and -inf on future keys. The keys
    before ``first`` are W or more back from every row of the block: their bias is 0.
    Built as one (rows, rows + W - 1) pattern with the band written along its diagonals, so its
    size does not depend on ``start``.
    """
    rows, width = end - start, band.size(-1)
    future = torch.ones(rows, rows + width - 1, dtype=torch.bool, device=band.device).triu(width)
    # column c: key start - W + 1 + c. One pattern, copied out: 3-7x faster than zeros + masked_fill
    padded = torch.where(future, float("-inf"), 0.0).expand(*band.shape[:-2], -1, -1).contiguous()
    diagonal_band(padded, width).copy_(band)
    return padded[..., max(0, width - 1 - start) :]  # drop the columns of keys before 0
