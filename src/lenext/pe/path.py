"""PaTH attention, position encoding by accumulated Householder transformations (Yang et al. 2025; docs/pes/path.md).

Each token t gives a reflection-like transformation H_t = I - beta_t w_t w_t^T from its own hidden state x_t: w_t
a unit vector per head (a low-rank projection x -> 32 -> d_model, a causal depthwise convolution of width 3, SiLU,
L2 norm per head) and beta_t = 2 sigmoid(b . x_t + c) in (0, 2) per head. The logit of query i and key j is the
query against the key carried through every token between them:

    z_ij = q_i^T H_i H_(i-1) ... H_(j+1) k_j / sqrt(d_head)        (j = i: q_i . k_i / sqrt(d_head))

as flash-linear-attention's ``PaTHAttention`` layer (``use_low_rank_w``, ``use_w_shortconv``; its forget gate is
FoX's, composed: ``pe=path_fox``) and its ``naive_path_attn`` reference. No position enters: PaTH is what the
content makes of the order. The logits are computed here, keys from the last to the first: the queries' running
product q~^T = q^T H_i .. H_(j+1) meets key j, then takes H_j (the queries at or after j only). That is L
sequential steps of O(L d) per head (checkpointed in chunks while training), and the logits of a sequence are
held whole: (B, H, L, L) memory.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lenext.pe.base import AttentionShape, LayerPE, PositionalEncoding, ScoreTerms
from lenext.schema import PositiveInt

LOW_RANK = 32  # fla's low-rank w projection: d_model -> 32 -> d_model


class PaTH(PositionalEncoding):
    """Data-dependent Householder products between each key and query; every parameter is a layer's."""

    def __init__(self, shape: AttentionShape, conv_size: PositiveInt = 3):
        super().__init__(shape)
        self.conv_size = conv_size

    def layer(self, index: int) -> LayerPE:
        return Householders(self.shape.d_model, self.shape.n_heads, self.conv_size)


class Householders(LayerPE):
    """One layer's w and beta projections, and the logits they make."""

    def __init__(self, d_model: int, heads: int, conv_size: int):
        super().__init__()
        self.heads = heads
        self.w_proj = nn.Sequential(nn.Linear(d_model, LOW_RANK, bias=False), nn.Linear(LOW_RANK, d_model, bias=False))
        self.w_conv = nn.Conv1d(d_model, d_model, conv_size, padding=conv_size - 1, groups=d_model, bias=False)
        self.beta_proj = nn.Linear(d_model, heads)

    def directions(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, L, d_model) -> w (B, H, L, d_head) unit vectors, beta (B, H, L) in (0, 2), both fp32 or wider."""
        length = x.size(1)
        w = F.silu(self.w_conv(self.w_proj(x).transpose(1, 2))[..., :length])  # causal: the first L outputs
        w = w.unflatten(1, (self.heads, -1)).transpose(-2, -1)  # (B, H, L, d_head)
        wide = torch.promote_types(w.dtype, torch.float32)
        beta = 2 * self.beta_proj(x).to(wide).sigmoid().transpose(1, 2)
        return F.normalize(w.to(wide), dim=-1), beta

    def terms(self, x, q, k, positions) -> ScoreTerms:
        w, beta = self.directions(x)
        cached = []

        def logits(start: int, end: int) -> torch.Tensor:
            if not cached:
                cached.append(path_logits(q, k, w, beta))
            return cached[0][..., start:end, :end]

        return ScoreTerms(logits=logits)


def path_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """(B, H, L, L) logits q_i^T H_i .. H_(j+1) k_j / sqrt(d) (any value for j > i: the attention masks them);
    q, k: (B, H, L, d), w: (B, H, L, d) unit vectors, beta: (B, H, L).

    Keys go by in chunks of about sqrt(L); while training, each chunk is recomputed in the backward pass
    (activation checkpointing), so autograd keeps the running queries at chunk boundaries only: O(L^1.5 d) memory
    per head instead of O(L^2 d)."""
    length, head_dim = q.size(-2), q.size(-1)
    carried = q.to(w.dtype)  # row i: q_i^T H_i .. H_(j+1), once key j is reached
    chunk = max(1, math.isqrt(length))
    columns = []
    for end in range(length, 0, -chunk):
        keys = range(max(0, end - chunk), end)
        if torch.is_grad_enabled():
            block, carried = checkpoint(_through_keys, carried, k, w, beta, keys, use_reentrant=False)
        else:
            block, carried = _through_keys(carried, k, w, beta, keys)
        columns.append(block)
    return torch.cat(columns[::-1], dim=-1) / math.sqrt(head_dim)


def _through_keys(carried, k, w, beta, keys: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the running queries against keys ``keys`` (last first), each key's H_j applied to the rows at or
    after it once it is scored: ((B, H, L, len(keys)) in key order, the running queries after the first key)."""
    rows = torch.arange(carried.size(-2), device=carried.device)
    columns = []
    for j in reversed(keys):
        columns.append(carried @ k[..., j, :].to(carried.dtype).unsqueeze(-1))  # (B, H, L, 1)
        along = (carried @ w[..., j, :].unsqueeze(-1)) * beta[..., j, None, None]  # beta_j (q~ . w_j) per row
        carried = carried - (along * (rows >= j)[:, None]) * w[..., j, None, :]
    return torch.cat(columns[::-1], dim=-1), carried
