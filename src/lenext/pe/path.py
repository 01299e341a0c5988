"""PaTH attention, position encoding by accumulated Householder transformations (Yang et al. 2025; docs/pes/path.md).

Each token t gives a reflection-like transformation H_t = I - beta_t w_t w_t^T from its own hidden state x_t: w_t
a unit vector per head (a low-rank projection x -> 32 -> d_model, a causal depthwise convolution of width 3, SiLU,
L2 norm per head) and beta_t = 2 sigmoid(b . x_t + c) in (0, 2) per head. The logit of query i and key j is the
query against the key carried through every token between them:

    z_ij = q_i^T H_i H_(i-1) ... H_(j+1) k_j / sqrt(d_head)        (j = i: q_i . k_i / sqrt(d_head))

as flash-linear-attention's ``PaTHAttention`` layer (``use_low_rank_w``, ``use_w_shortconv``; its forget gate is
FoX's, composed: ``pe=path_fox``) and its ``naive_path_attn`` reference. No position enters: PaTH is what the
content makes of the order. The logits are computed here in chunks of 64 tokens with the UT transform, as fla's
chunked algorithm (``path_logits``): O(L^2 d) work in L / 64 - 1 sequential steps, and the logits of a sequence are
held whole: (B, H, L, L) memory. While training on CUDA under bf16 with fla installed, fla's PaTH kernel runs instead
(``ScoreTerms.householders``; lenext.attention.fla_kernels).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from lenext.pe.base import AttentionShape, LayerPE, PositionalEncoding, ScoreTerms
from lenext.ranges import PositiveInt

LOW_RANK = 32  # fla's low-rank w projection: d_model -> 32 -> d_model
CHUNK = 64  # tokens a chunk: fla's chunk size


class PaTH(PositionalEncoding):
    """Data-dependent Householder products between each key and query; every parameter is a layer's."""

    FAMILY = "2024-26 methods"

    reads_qk = True
    computes_logits = True

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

        return ScoreTerms(logits=logits, householders=lambda: (w, beta))


def path_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """(B, H, L, L) logits q_i^T H_i .. H_(j+1) k_j / sqrt(d) (any finite value for j > i: the attention masks them);
    q, k: (B, H, L, d), w: (B, H, L, d) unit vectors, beta: (B, H, L).

    In chunks of CHUNK tokens (the last padded with H = I), as fla's chunked PaTH: the product of any run of a
    chunk's transformations H_b .. H_a is I - W^T T W over that run, T the same run's block of the chunk's
    T = (I + strictly lower(diag(beta) W W^T))^-1 diag(beta) (the UT transform: a block of a triangular matrix's
    inverse is the inverse of its block). So within a chunk the logits, each query carried back to its chunk's
    first token, each key carried forward to its last and the chunk's whole product are a few matrix products;
    then query chunk a meets key chunk a - delta through the products of the chunks between, for delta = 1 ..
    n - 1: n - 1 sequential steps; autograd keeps the carried queries of each, L^2 d / (2 CHUNK) numbers per head
    beside the L^2 logits."""
    # fp32 (or wider) under autocast too: a chunk's products cancel, which a bf16 Gram matrix turns into errors of
    # the logits' size
    with torch.autocast(q.device.type, enabled=False):
        batch, heads, length, head_dim = q.shape
        size = min(length, CHUNK)
        chunks = -(-length // size)
        pad = chunks * size - length  # padded tokens: beta 0, H = I, after every real token

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, H, L, ...) -> (B, H, n, C, ...)
            return F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad)).unflatten(2, (chunks, size))

        q = q.to(w.dtype) / math.sqrt(head_dim)  # scaled here: the (B, H, L, L) logits are written once
        q, k, w, beta = split(q), split(k.to(w.dtype)), split(w), split(beta)
        eye = torch.eye(size, dtype=w.dtype, device=w.device)
        unit_lower = eye + (beta[..., :, None] * (w @ w.transpose(-1, -2))).tril(-1)
        transform = torch.linalg.solve_triangular(unit_lower, torch.diag_embed(beta), upper=False)  # T: (B, H, n, C, C)
        query_w = (q @ w.transpose(-1, -2)).tril()  # q_i . w_a for a <= i: the H_a that query i passes in its chunk
        w_key = (w @ k.transpose(-1, -2)).tril(-1)  # w_b . k_j for b > j: the H_b that key j passes in its chunk
        inside = q @ k.transpose(-1, -2) - query_w @ transform @ w_key  # (B, H, n, C, C): each chunk against itself
        queries = q - query_w @ transform @ w  # carried back to their chunk's first token
        keys = k - w_key.transpose(-1, -2) @ transform.transpose(-1, -2) @ w  # carried forward to their chunk's last
        # each chunk's whole product H_last .. H_first: (B, H, n, d, d)
        through = torch.eye(head_dim, dtype=w.dtype, device=w.device) - w.transpose(-1, -2) @ transform @ w
        logits = q.new_zeros(batch, heads, chunks, size, chunks, size)
        logits.diagonal(0, 2, 4).copy_(inside.permute(0, 1, 3, 4, 2))
        queries = queries[:, :, 1:]  # chunks delta.. (here delta = 1), each carried to its first token
        for delta in range(1, chunks):
            block = queries @ keys[:, :, : chunks - delta].transpose(-1, -2)  # chunk a against chunk a - delta
            logits.diagonal(-delta, 2, 4).copy_(block.permute(0, 1, 3, 4, 2))
            queries = (queries @ through[:, :, : chunks - delta])[:, :, 1:]  # on through chunk a - delta
        return logits.flatten(4, 5).flatten(2, 3)[..., :length, :length]
