"""PEs that add a bias to the attention scores: ALiBi, T5 relative buckets, Shaw relative keys."""

import math
from typing import Annotated

import torch
from torch import nn

from lenext.errors import ConfigError
from lenext.pe.base import AttentionShape, PositionalEncoding, relative_offsets
from lenext.schema import PositiveInt, Range


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes of Press et al. 2022: 2^(-8h/H) for H a power of two, interleaved otherwise."""

    def power_of_two(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """Attention with linear biases: scores += -m_h (i - j), not scaled by 1/sqrt(d)."""

    has_score_bias = True
    key_only_bias = True

    def __init__(self, shape: AttentionShape):
        super().__init__(shape)
        self.register_buffer("slopes", alibi_slopes(shape.n_heads), persistent=False)

    def score_bias(self, q, layer, start, end):
        # -m (i - j) = m (j - (end-1)) - m (i - (end-1)): the second term is constant along a row
        # and softmax ignores it, so a key-only (1, H, 1, end) bias is exact and keeps SDPA fused.
        # Anchoring at end-1 keeps the values of the keys that matter small, so fp32 stays exact.
        keys = torch.arange(end, device=q.device, dtype=torch.float32) - (end - 1)
        return (self.slopes[:, None] * keys)[None, :, None, :]  # (1, H, 1, end), fp32 even under bf16

    def score_mod(self, q, layer):
        slopes = self.slopes  # fp32; flex adds it to fp32 scores, so -m (i - j) is exact as written

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return alibi


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal T5 bucket of n = max(i - j, 0) (Raffel et al. 2020, bidirectional=False)."""
    n = distance.clamp(min=0)
    max_exact = num_buckets // 2
    scaled = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n, far)


class T5Bias(PositionalEncoding):
    """T5 relative bias: one learned scalar per (bucket, head), shared across layers by default."""

    has_score_bias = True

    def __init__(
        self,
        shape: AttentionShape,
        num_buckets: Annotated[int, Range(2)] = 32,
        max_distance: PositiveInt | None = None,
        per_layer: bool = False,
    ):
        super().__init__(shape)
        # null: T5's 128, capped at L_train. A bucket holding only distances >= L_train never gets a
        # gradient and keeps its initial ~0 at every longer length (measured: README, "Reference results").
        # At least num_buckets // 2 + 1, so the log buckets exist even for a short L_train.
        max_distance = max_distance or max(min(128, shape.train_len), num_buckets // 2 + 1)
        if max_distance <= num_buckets // 2:  # the log buckets must span distances
            raise ConfigError(
                f"pe.max_distance={max_distance} is invalid: it must exceed pe.num_buckets // 2 = {num_buckets // 2}, "
                "the distances with a bucket of their own"
            )
        self.num_buckets, self.max_distance, self.per_layer = num_buckets, max_distance, per_layer
        self.table = nn.Parameter(torch.randn(shape.n_layers if per_layer else 1, num_buckets, shape.n_heads) * 0.02)
        self.register_buffer("buckets", torch.empty(0, dtype=torch.long), persistent=False)
        # Buckets of the distances W-1 .. 0 before the last bucket, which holds every distance >= W.
        in_last = t5_bucket(torch.arange(max_distance + 1), num_buckets, max_distance) == num_buckets - 1
        width = int(in_last.nonzero()[0])
        band_buckets = t5_bucket(torch.arange(width - 1, -1, -1), num_buckets, max_distance)
        self.register_buffer("band_buckets", band_buckets, persistent=False)

    def _by_distance(self, layer, end, device):
        """(end, H): the bias of each distance i - j in 0..end-1."""
        if self.buckets.numel() < end:  # bucket of each distance 0..end-1, grown for the longest length
            self.buckets = t5_bucket(torch.arange(end, device=device), self.num_buckets, self.max_distance)
        return self.table[layer if self.per_layer else 0][self.buckets[:end]]

    def band_bias(self, q, layer):
        table = self.table[layer if self.per_layer else 0]  # (buckets, H)
        band = (table[self.band_buckets] - table[-1]).t()  # (H, W): the same for every row
        return band[None, :, None, :].expand(-1, -1, q.size(-2), -1)  # (1, H, R, W)

    def score_mod(self, q, layer):
        # Looked up per distance, not per bucket: the backward scatters gradients into this (L, H)
        # tensor with atomic adds, and far fewer of them collide than on the (buckets, H) table.
        by_distance = self._by_distance(layer, q.size(2), q.device)

        def t5(score, b, h, q_idx, kv_idx):
            return score + by_distance[(q_idx - kv_idx).clamp(min=0), h]  # clamp: j > i (masked) stays in bounds

        return t5

    def describe(self) -> dict:
        return {
            "name": "T5Bias",
            "num_buckets": self.num_buckets,
            "max_distance": self.max_distance,
            "per_layer": self.per_layer,
        }


class ShawRelative(PositionalEncoding):
    """Relative position representations (Shaw et al. 2018) with clipping distance k.

    score(i, j) = (q_i . k_j + q_i . a^K_{clip(j-i, -k, k)}) / sqrt(d_h); optional a^V on values.
    Tables are per layer and shared across heads, as in the paper. The bias is q @ A^T (rows x 2k+1)
    gathered by clipped offset, or on CPU its band q @ (a^K_o - a^K_{-k})^T for the k nearest
    offsets: the (L, L, d_h) tensor of the naive form is never built.
    """

    has_score_bias = True

    def __init__(self, shape: AttentionShape, k: PositiveInt = 16, value_term: bool = False):
        super().__init__(shape)
        self.k = k
        table_shape = (shape.n_layers, 2 * k + 1, shape.head_dim)
        self.key_table = nn.Parameter(torch.randn(table_shape) * 0.02)
        self.value_table = nn.Parameter(torch.randn(table_shape) * 0.02) if value_term else None
        self.needs_attention_probs = value_term

    def _clipped_offsets(self, start, end, device):
        return relative_offsets(start, end, device).clamp(-self.k, self.k) + self.k  # (rows, end) in [0, 2k]

    def _scores(self, q, vectors):
        """(B, H, rows, n): q_i . a / sqrt(d_h) for each of the n vectors a (n, d_h)."""
        return q @ vectors.t().to(q.dtype) / math.sqrt(self.shape.head_dim)

    def _by_offset(self, q, layer):
        """(B, H, rows, 2k+1): q_i . a^K_o / sqrt(d_h) for each clipped offset o + k."""
        return self._scores(q, self.key_table[layer])

    def band_bias(self, q, layer):
        # Offsets j - i <= -k share a^K_{-k}: a per-row constant, so the band is offsets -k+1 .. 0.
        table = self.key_table[layer]  # (2k+1, d_h): row o + k holds a^K_o
        return self._scores(q, table[1 : self.k + 1] - table[0])  # (B, H, R, k)

    def score_mod(self, q, layer):
        if self.needs_attention_probs:
            return None  # flex cannot add a^V: the attention keeps its explicit path
        by_offset, k = self._by_offset(q, layer), self.k

        def shaw(score, b, h, q_idx, kv_idx):
            return score + by_offset[b, h, q_idx, (kv_idx - q_idx).clamp(-k, k) + k]

        return shaw

    def value_term(self, probs, layer, start, end):
        index = self._clipped_offsets(start, end, probs.device).expand_as(probs)
        mass = probs.new_zeros(*probs.shape[:-1], 2 * self.k + 1).scatter_add_(-1, index, probs)
        return mass @ self.value_table[layer].to(probs.dtype)  # (B, H, rows, d_head)

    def describe(self) -> dict:
        return {"name": "ShawRelative", "k": self.k, "value_term": self.value_table is not None}
