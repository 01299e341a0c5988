"""PaTH attention, position encoding by accumulated Householder transformations (Yang et al. 2025; docs/pes/path.md).

Each token t gives a reflection-like transformation H_t = I - beta_t w_t w_t^T from its own hidden state x_t: w_t
a unit vector per head (a low-rank projection x -> 32 -> d_model, a causal depthwise convolution of width 3, SiLU,
L2 norm per head) and beta_t = 2 sigmoid(b . x_t + c) in (0, 2) per head. The logit of query i and key j is the
query against the key carried through every token between them:

    z_ij = q_i^T H_i H_(i-1) ... H_(j+1) k_j / sqrt(d_head)        (j = i: q_i . k_i / sqrt(d_head))

as flash-linear-attention's ``PaTHAttention`` layer (``use_low_rank_w``, ``use_w_shortconv``; its forget gate is
FoX's, composed: ``pe=path_fox``) and its ``naive_path_attn`` reference. No position enters: PaTH is what the
content makes of the order. The logits are computed here in chunks of 64 tokens with the UT transform, as fla's
chunked algorithm, one block of query rows at a time (``PathLogits``): O(L^2 d) work in L / 64 sequential steps,
O(L d) memory beside a block's logits. While training on CUDA under bf16 with fla installed, fla's PaTH kernel runs
instead (``ScoreTerms.householders``; lenext.attention.fla_kernels).
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
        made = []  # built at the first call: fla's kernel, where it serves, needs only w and beta

        def logits(start: int, end: int) -> torch.Tensor:
            if not made:
                made.append(PathLogits(q, k, w, beta))
            return made[0](start, end)

        return ScoreTerms(logits=logits, householders=lambda: (w, beta))


class PathLogits:
    """The logits q_i^T H_i .. H_(j+1) k_j / sqrt(d) of query rows against the keys before them (any finite value for
    j > i: the attention masks them); q, k: (B, H, L, d), w: (B, H, L, d) unit vectors, beta: (B, H, L).

    In chunks of CHUNK tokens (the last padded with H = I), as fla's chunked PaTH: the product of any run of a
    chunk's transformations H_b .. H_a is I - W^T T W over that run, T the same run's block of the chunk's
    T = (I + strictly lower(diag(beta) W W^T))^-1 diag(beta) (the UT transform: a block of a triangular matrix's
    inverse is the inverse of its block). So within a chunk the logits, each query carried back to its chunk's
    first token, each key carried forward to its last and the chunk's whole product are a few matrix products,
    made once. Then, as the query rows advance (the attention's blocks come in order), the keys of the chunks before
    are carried forward through one chunk's product at a time: a row of chunk a meets every earlier key in one
    product. O(L d) memory beside a block's logits (autograd keeps the keys carried to each chunk: L^2 d / (2 CHUNK)
    numbers per head); L / CHUNK sequential steps, O(L^2 d) work."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor):
        # fp32 (or wider) under autocast too: a chunk's products cancel, which a bf16 Gram matrix turns into errors of
        # the logits' size
        with torch.autocast(q.device.type, enabled=False):
            batch, heads, length, head_dim = q.shape
            size = min(length, CHUNK)
            chunks = -(-length // size)
            pad = chunks * size - length  # padded tokens: beta 0, H = I, after every real token

            def split(t: torch.Tensor) -> torch.Tensor:  # (B, H, L, ...) -> (B, H, n, C, ...)
                return F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad)).unflatten(2, (chunks, size))

            q = q.to(w.dtype) / math.sqrt(head_dim)  # scaled here, once
            q, k, w, beta = split(q), split(k.to(w.dtype)), split(w), split(beta)
            eye = torch.eye(size, dtype=w.dtype, device=w.device)
            unit_lower = eye + (beta[..., :, None] * (w @ w.transpose(-1, -2))).tril(-1)
            # T: (B, H, n, C, C)
            transform = torch.linalg.solve_triangular(unit_lower, torch.diag_embed(beta), upper=False)
            query_w = (q @ w.transpose(-1, -2)).tril()  # q_i . w_a for a <= i: the H_a that query i passes in its chunk
            w_key = (w @ k.transpose(-1, -2)).tril(-1)  # w_b . k_j for b > j: the H_b that key j passes in its chunk
            self.inside = q @ k.transpose(-1, -2) - query_w @ transform @ w_key  # (B, H, n, C, C): each chunk's own
            self.queries = q - query_w @ transform @ w  # carried back to their chunk's first token
            self.keys = k - w_key.transpose(-1, -2) @ transform.transpose(-1, -2) @ w  # forward to their chunk's last
            # each chunk's whole product H_last .. H_first: (B, H, n, d, d)
            self.through = torch.eye(head_dim, dtype=w.dtype, device=w.device) - w.transpose(-1, -2) @ transform @ w
        self.size, self.device_type = size, q.device.type
        self.chunk, self.carried = 0, q.new_zeros(batch, heads, 0, head_dim)  # keys before chunk 0 carried to it

    def __call__(self, start: int, end: int) -> torch.Tensor:
        """(B, H, end - start, end): query rows [start, end) against keys [0, end)."""
        size = self.size
        batch, heads = self.queries.shape[:2]
        out = self.queries.new_zeros(batch, heads, end - start, end)  # keys past a row's chunk: future keys, 0
        with torch.autocast(self.device_type, enabled=False):
            for chunk in range(start // size, -(-end // size)):
                offset = chunk * size  # the chunk's first token
                first, last = max(start, offset), min(end, offset + size)  # its rows in the block
                rows, mine = slice(first - start, last - start), slice(first - offset, last - offset)
                out[:, :, rows, :offset] = self.queries[:, :, chunk, mine] @ self.carried_to(chunk).transpose(-1, -2)
                out[:, :, rows, offset:last] = self.inside[:, :, chunk, mine, : last - offset]
        return out

    def carried_to(self, chunk: int) -> torch.Tensor:
        """(B, H, chunk x C, d): the keys of the chunks before ``chunk`` carried forward to its first token."""
        if chunk < self.chunk:  # rows asked for again from an earlier chunk: carried afresh from the first
            self.chunk, self.carried = 0, self.carried[:, :, :0]
        while self.chunk < chunk:
            through = self.through[:, :, self.chunk].transpose(-1, -2)
            self.carried = torch.cat([self.carried @ through, self.keys[:, :, self.chunk]], dim=-2)
            self.chunk += 1
        return self.carried
