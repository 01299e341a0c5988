"""CoPE, contextual position encoding (Golovneva et al. 2024; docs/pes/cope.md).

Positions counted by the content: each key gets a gate g_ij = sigmoid(z_ij) from the logit z_ij of query i and
key j, and key j's position for query i is p_ij = sum_{t = j..i} g_it (fractional, capped at ``npos_max - 1``).
A learned embedding e[p] per integer position (per layer, shared by the heads) is interpolated at p_ij and
scored against the query: z_ij += q_i . ((1 - w) e[floor p_ij] + w e[ceil p_ij]), w = p_ij - floor p_ij. As the
paper's Appendix B code and x-transformers' ``CoPE``: q unscaled, the gates from the logits as the softmax would
see them (future keys masked: gate 0), e starting at 0. The explicit query blocks compute it (the gates need
every logit of a row), so memory is O(rows x keys) per block; alone on the scores on CUDA, lenext's CoPE kernel
(``lenext.attention.contextual``), which keeps them on chip.
"""

from typing import Annotated

import torch
from torch import nn

from lenext.pe.base import AttentionShape, LayerPE, PositionalEncoding, ScoreTerms
from lenext.ranges import Range


class CoPE(PositionalEncoding):
    """Contextual positions: every parameter is a layer's (``ContextualPositions``)."""

    FAMILY = "2024-26 methods"

    reads_qk = True

    def __init__(self, shape: AttentionShape, npos_max: Annotated[int, Range(2)] | None = None):
        super().__init__(shape)
        self.npos_max = npos_max or shape.train_len  # null: L_train, the positions a training row can count

    def layer(self, index: int) -> LayerPE:
        return ContextualPositions(self.shape.head_dim, self.npos_max)


class ContextualPositions(LayerPE):
    """One layer's position embeddings e (npos_max, d_head) and its logit term."""

    reads_logits = True

    def __init__(self, head_dim: int, npos_max: int):
        super().__init__()
        self.npos_max = npos_max
        self.embedding = nn.Parameter(torch.zeros(npos_max, head_dim))

    def terms(self, x, q, k, positions) -> ScoreTerms:
        by_position = q @ self.embedding.to(q.dtype).t()  # (B, H, L, npos_max): q_i . e[p] for integer p

        def contextual(logits: torch.Tensor, start: int, end: int, first: int) -> torch.Tensor:
            gates = logits.sigmoid()  # (B, H, rows, keys); 0 on masked keys
            counted = gates.flip(-1).cumsum(-1).flip(-1)  # p_ij = sum_{t >= j} g_it
            return Interpolated.apply(by_position[:, :, start:end], counted, self.npos_max - 1)

        return ScoreTerms(logit_terms=(contextual,), contextual=lambda: by_position)


class Interpolated(torch.autograd.Function):
    """(1 - w) s[floor p] + w s[ceil p], w = p - floor p, of each row's scores s (..., P) at its positions p (..., K)
    capped at ``cap`` (an integer), in p's dtype; the gradient flows to s and to p (through w). Saves s (a view, in
    its own dtype) and p only, and gathers again in the backward: autograd kept the cap's input, the gathers' int64
    indices, both terms' factors and s cast to p's dtype (what CoPE keeps for the backward bounds its memory and its
    speed on a GPU: docs/scaling.md)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, counted: torch.Tensor, cap: int) -> torch.Tensor:
        ctx.save_for_backward(scores, counted)
        ctx.cap = cap
        below, above, weight = Interpolated.corners(counted, cap)
        wide = scores.to(counted.dtype)  # (..., P), not kept
        return wide.gather(-1, above) * weight + wide.gather(-1, below) * (1 - weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        scores, counted = ctx.saved_tensors
        below, above, weight = Interpolated.corners(counted, ctx.cap)
        wide = scores.to(grad.dtype)
        difference = wide.gather(-1, above) - wide.gather(-1, below)
        grad_counted = grad * difference  # 0 above the cap, where both corners are the cap
        grad_scores = grad.new_zeros(scores.shape).scatter_add_(-1, below, grad * (1 - weight))
        return grad_scores.scatter_add_(-1, above, grad * weight).to(scores.dtype), grad_counted, None

    @staticmethod
    def corners(counted: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The integer positions below and above p capped, and its weight on the one above."""
        capped = counted.clamp(max=cap)
        below = capped.floor()
        return below.long(), capped.ceil().long(), capped - below
