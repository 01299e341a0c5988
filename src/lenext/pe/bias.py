"""PEs that add a bias to the attention scores: ALiBi, T5 relative buckets, Shaw relative keys."""

import math
from typing import Annotated

import torch
from torch import nn

from lenext.errors import ConfigError
from lenext.pe.base import (
    AttentionShape,
    BandValues,
    PositionalEncoding,
    band_distances,
    distance_score_mod,
    position_span,
)
from lenext.ranges import PositiveInt, Range


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Head slopes of Press et al. 2022: 2^(-8h/H) for H a power of two, interleaved otherwise."""

    def power_of_two(n: int) -> list[float]:
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """Attention with linear biases: scores += -m_h (i - j), not scaled by 1/sqrt(d)."""

    FAMILY = "additive bias"

    def __init__(self, shape: AttentionShape):
        super().__init__(shape)
        # Derived buffers are made on first use, as RoPE's tables: a model built on the meta device (as transformers
        # loads one, lenext.export) holds none to restore.
        self.register_buffer("slopes", torch.empty(0), persistent=False)

    def head_slopes(self, device: torch.device) -> torch.Tensor:
        """(H,) fp32 slopes m_h."""
        if self.slopes.numel() != self.shape.n_heads or self.slopes.device != device:
            self.slopes = alibi_slopes(self.shape.n_heads).to(device)
        return self.slopes

    def key_bias(self, positions, layer):
        # -m (i - j) = m (j - last) - m (i - last): the second term is constant along a row and
        # softmax ignores it, so a key bias is exact (for any positions) and keeps SDPA fused.
        # Anchored at the last key: a row i's logits are rounded at the size of m (last - i) (docs/pes/alibi.md).
        keys = (positions - positions[:, -1:]).float()  # (B or 1, K)
        return (
            self.head_slopes(keys.device)[None, :, None, None] * keys[:, None, None, :]
        )  # (B or 1, H, 1, K), fp32 under bf16

    def score_mod(self, q, positions, layer):
        slopes = self.head_slopes(q.device)  # fp32; flex adds it to fp32 scores, so -m (i - j) is exact as written
        positions = positions.expand(q.size(0), -1)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (positions[b, q_idx] - positions[b, kv_idx])

        return alibi


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal T5 bucket of n = max(i - j, 0) (Raffel et al. 2020, bidirectional=False)."""
    n = distance.clamp(min=0)
    max_exact = num_buckets // 2
    scaled = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n, far)


class T5Bias(PositionalEncoding):
    """T5 relative bias: one learned scalar per (bucket, head), shared across layers by default.

    Its band: keys W or more indices back are W or more positions back (positions increase), all
    in the last bucket, so the W nearest keys carry the whole bias.
    """

    FAMILY = "additive bias"
    DISPLAY_NAME = "T5"

    def __init__(
        self,
        shape: AttentionShape,
        num_buckets: Annotated[int, Range(2)] = 32,
        max_distance: PositiveInt | None = None,
        per_layer: bool = False,
    ):
        super().__init__(shape)
        # null: T5's 128, capped at L_train. A bucket holding only distances >= L_train never gets a
        # gradient and keeps its initial ~0 at every longer length (measured: docs/studies/reference.md).
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
        # Buckets of the distances 0 .. W, where W, the band's width, is the first distance of the last bucket.
        in_last = t5_bucket(torch.arange(max_distance + 1, device="cpu"), num_buckets, max_distance) == num_buckets - 1
        self.band_width = int(in_last.nonzero()[0])
        self.register_buffer("band_buckets", torch.empty(0, dtype=torch.long), persistent=False)  # on first use

    def _by_distance(self, layer, end, device):
        """(end, H): the bias of each distance i - j in 0..end-1."""
        if self.buckets.numel() < end:  # bucket of each distance 0..end-1, grown for the longest length
            self.buckets = t5_bucket(torch.arange(end, device=device), self.num_buckets, self.max_distance)
        return self.table[layer if self.per_layer else 0][self.buckets[:end]]

    def band_bias(self, q, positions, layer):
        table = self.table[layer if self.per_layer else 0]  # (buckets, H)
        width = self.band_width
        if self.band_buckets.numel() != width + 1 or self.band_buckets.device != table.device:
            distances = torch.arange(width + 1, device=table.device)
            self.band_buckets = t5_bucket(distances, self.num_buckets, self.max_distance)
        by_distance = table[self.band_buckets] - table[-1]  # (W + 1, H): distance W and beyond: 0
        distances = band_distances(positions, width)  # (B or 1, L, W)
        if (distances == distances[:, -1:]).all():  # every row alike (0..L-1): one row, broadcast
            return by_distance[distances[:, -1]].transpose(-2, -1)[:, :, None, :].expand(-1, -1, q.size(-2), -1)
        return by_distance[distances.clamp(max=width)].permute(0, 3, 1, 2)  # (B or 1, H, L, W)

    def score_mod(self, q, positions, layer):
        # Looked up per distance, not per bucket: the backward scatters gradients into this (L, H)
        # tensor with atomic adds, and far fewer of them collide than on the (buckets, H) table.
        return distance_score_mod(self._by_distance(layer, position_span(positions), q.device), positions, q.size(0))


class ShawRelative(PositionalEncoding):
    """Relative position representations (Shaw et al. 2018) with clipping distance k.

    score(i, j) = (q_i . k_j + q_i . a^K_{clip(j-i, -k, k)}) / sqrt(d_h); optional a^V on values.
    Tables are per layer and shared across heads, as in the paper. The bias is a band: keys k or
    more indices back are k or more positions back (positions increase), all clipped to a^K_{-k}.
    It is q @ A^T for the k + 1 offsets -k..0, gathered by clipped offset: the (L, L, d_h) tensor
    of the naive form is never built.
    """

    FAMILY = "additive bias"
    DISPLAY_NAME = "Shaw"

    reads_qk = True

    def __init__(self, shape: AttentionShape, k: PositiveInt = 16, value_term: bool = False):
        super().__init__(shape)
        self.k = k
        table_shape = (shape.n_layers, 2 * k + 1, shape.head_dim)
        self.key_table = nn.Parameter(torch.randn(table_shape) * 0.02)
        self.value_table = nn.Parameter(torch.randn(table_shape) * 0.02) if value_term else None

    def _scores(self, q, vectors):
        """(B, H, rows, n): q_i . a / sqrt(d_h) for each of the n vectors a (n, d_h)."""
        return q @ vectors.t().to(q.dtype) / math.sqrt(self.shape.head_dim)

    def _clipped(self, differences):
        """Row o + k of a table, for o = clip(j - i, -k, k) given the differences i - j."""
        return self.k - differences.clamp(-self.k, self.k)

    def band_bias(self, q, positions, layer):
        by_offset = self._scores(q, self.key_table[layer][: self.k + 1])  # (B, H, L, k + 1): offsets -k..0
        index = self._clipped(band_distances(positions, self.k))[:, None]  # (B or 1, 1, L, k) in [0, k]
        band = by_offset.gather(-1, index.expand(*by_offset.shape[:-1], -1))
        return band - by_offset[..., :1]  # relative to a^K_{-k}, the bias of every key k or more back

    def value_term(self, positions, layer):
        if self.value_table is None:
            return None
        table = self.value_table[layer]
        rows = self._clipped(band_distances(positions, self.k))  # (B or 1, L, k) in [0, k]; 0: a^V_{-k}, the far keys'
        return BandValues(far=table[0], band=(table[rows] - table[0])[:, None])  # band (B or 1, 1, L, k, d_head)

    def hyperparameters(self) -> dict:  # ``value_term`` names a site of the interface, not the setting
        return {"k": self.k, "value_term": self.value_table is not None}
