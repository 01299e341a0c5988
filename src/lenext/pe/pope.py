"""PoPE, polar coordinate position embeddings (Gopalakrishnan et al. 2025; docs/pes/pope.md).

Each of the d_head components of a query or key becomes a complex number whose magnitude is the content,
softplus(q_c), and whose phase is the position alone, t theta_c (keys: s theta_c + delta_c): the logit is
Re[sum_c conj(q~_c) k~_c] / sqrt(d_head) = sum_c softplus(q_c) softplus(k_c) cos((s - t) theta_c + delta_c)
/ sqrt(d_head). d_head frequencies theta_c = base^(-c / d_head), c = 0..d_head-1 (RoPE has d_head / 2), and a
learned phase offset delta per head and frequency, starting at 0 and clamped to [-2 pi, 0], shared by the layers:
as x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb``. q and k are returned as the 2 d_head real
channels [mag cos, mag sin] (attention gives v zero channels up to that width, for its fused kernels); q also
times sqrt(2), so that attention's 1/sqrt(2 d_head) scales the logit by 1/sqrt(d_head).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from lenext.pe.base import AttentionShape, PositionalEncoding
from lenext.ranges import PositiveFloat


def pope_frequencies(base: float, head_dim: int) -> torch.Tensor:
    """theta_c = base^(-c / d_head), c < d_head (float64): one per channel, not per pair as RoPE's."""
    return base ** -(torch.arange(head_dim, dtype=torch.float64) / head_dim)


class PoPE(PositionalEncoding):
    """Content in the magnitudes, position in the phases."""

    FAMILY = "2024-26 methods"

    widens_qk = True

    def __init__(self, shape: AttentionShape, base: PositiveFloat = 10000.0):
        super().__init__(shape)
        self.base = base
        self.phase_bias = nn.Parameter(torch.zeros(shape.n_heads, 1, shape.head_dim))  # delta: (H, 1, d_head)

    def rotary_frequencies(self, length: int) -> torch.Tensor:
        return pope_frequencies(self.base, self.shape.head_dim)  # the same at every length

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, L, d_head) -> (B, H, L, 2 d_head) each."""
        wide = torch.promote_types(q.dtype, torch.float32)
        inv_freq = pope_frequencies(self.base, q.size(-1)).to(q.device)
        angles = positions.to(torch.float64)[:, None, :, None] * inv_freq  # (B or 1, 1, L, d_head), exact at any L
        cos, sin = angles.cos().to(wide), angles.sin().to(wide)
        offset = self.phase_bias.clamp(-2 * math.pi, 0).to(wide)  # (H, 1, d_head)
        offset_cos, offset_sin = offset.cos(), offset.sin()
        with torch.autocast(q.device.type, enabled=False):
            query, key = F.softplus(q.to(wide)), F.softplus(k.to(wide))
            query = torch.cat([query * cos, query * sin], dim=-1) * math.sqrt(2)
            # the key's phase is the angle plus delta: cos(a + delta), sin(a + delta) by the sum formulas
            key_cos, key_sin = cos * offset_cos - sin * offset_sin, sin * offset_cos + cos * offset_sin
            key = torch.cat([key * key_cos, key * key_sin], dim=-1)
        return query.to(q.dtype), key.to(k.dtype)
