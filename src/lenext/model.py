"""A small pre-norm decoder-only transformer whose only knowledge of position is its PE.

The PE (``lenext.pe``) plugs in at three sites: ``embed`` after the token embedding, ``rotate``
on q and k, ``score_bias`` inside the attention. The model never asks which PE it holds.
"""

import math
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from lenext.errors import ConfigError
from lenext.pe import AttentionShape, PositionalEncoding

# FlexAttention runs score-bias PEs on CUDA without any (L, L) tensor. torch 2.6 is the first
# version whose backward reaches tensors a score_mod captures (the T5 table, Shaw's q . a^K).
flex_attention = None
if torch.__version__ >= "2.6":
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Float elements of bias per query block: bounds attention memory at long lengths to
# O(block * L) (64 MiB in fp32) while training lengths (B 8, H 8, L 512) fit in one block.
SCORE_BLOCK_ELEMENTS = 2**24
FLEX_BLOCK = 128  # FlexAttention's sparse block size (its default)


@cache
def fused_mask_with_causal(device_type: str) -> bool:
    """Whether SDPA accepts an additive mask together with is_causal=True on this device.

    torch 2.13 on CPU does (one fused kernel, no (L, L) mask); older versions raise.
    """
    q = torch.zeros(1, 1, 2, 2, device=device_type)
    try:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 2, device=device_type), is_causal=True)
    except RuntimeError:
        return False
    return True


def _sdpa_keep_mask(q, k, v, **kwargs) -> torch.Tensor:
    """SDPA with the additive mask kept in its own dtype (fp32 for ALiBi), also under autocast.

    Autocast (and a cast to q's dtype) would round the mask to bf16, whose 8-bit mantissa loses
    ALiBi's key offsets m * (j - anchor) beyond 256 positions: logit errors of order 1 at long lengths.
    SDPA accepts an fp32 mask with bf16 q, k, v.
    """
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@cache
def compiled_flex_attention():
    """flex_attention compiled once, on first use: uncompiled it materializes all (L, L) scores."""
    return torch.compile(flex_attention)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@cache
def causal_block_mask(length: int, device: torch.device) -> "BlockMask":
    """The causal BlockMask, built from its block structure.

    create_block_mask would evaluate ``causal`` at all L^2 positions (20 s / 10 GB at 32k on CPU).
    Query block i sees key blocks 0..i-1 whole and its diagonal block i through ``causal``;
    flex itself bounds rows and keys past ``length`` in the last block.
    """
    blocks = -(-length // FLEX_BLOCK)
    index = torch.arange(blocks, dtype=torch.int32, device=device)
    in_order = index.expand(blocks, blocks).contiguous()[None, None]  # (1, 1, n, n): every row lists 0..n-1
    return BlockMask.from_kv_blocks(
        kv_num_blocks=torch.ones_like(index)[None, None],  # row i: one partial block,
        kv_indices=in_order.transpose(-2, -1).contiguous(),  # block i
        full_kv_num_blocks=index[None, None],  # and i full blocks,
        full_kv_indices=in_order,  # blocks 0..i-1
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=causal,
        seq_lengths=(length, length),
    )


def causal_attention(q, k, v, pe: PositionalEncoding, layer: int) -> torch.Tensor:
    """Causal attention with the PE's score bias, on the cheapest path that is exact.

    q, k, v: (B, H, L, d_head) -> (B, H, L, d_head).
    """
    batch, heads, length, head_dim = q.shape
    if not pe.has_score_bias:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # Flex only on CUDA: on CPU it has no backward and compiles for seconds (DESIGN.md section 7).
    score_mod = pe.score_mod(q, layer) if q.is_cuda and flex_attention is not None else None
    if score_mod is not None:
        return compiled_flex_attention()(q, k, v, score_mod=score_mod, block_mask=causal_block_mask(length, q.device))
    if pe.key_only_bias and not pe.needs_attention_probs and fused_mask_with_causal(q.device.type):
        # (1, H, 1, L) mask on the fused causal kernel: O(L) memory at any length (ALiBi).
        return _sdpa_keep_mask(q, k, v, attn_mask=pe.score_bias(q, layer, 0, length), is_causal=True)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (batch * heads * length))
    blocks = []
    for start in range(0, length, rows):  # query blocks attend to keys [0, end): memory O(rows * L)
        end = min(start + rows, length)
        q_block, k_seen, v_seen = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
        mask = pe.score_bias(q_block, layer, start, end)
        if pe.key_only_bias:  # the PE left the causal mask to us
            future = torch.ones(end - start, end, dtype=torch.bool, device=q.device).triu(start + 1)
            mask = torch.where(future, float("-inf"), mask)
        if pe.needs_attention_probs:
            scores = (q_block @ k_seen.transpose(-2, -1)).float() / math.sqrt(head_dim) + mask
            probs = scores.softmax(-1).to(q.dtype)  # (B, H, rows, end)
            blocks.append(probs @ v_seen + pe.value_term(probs, layer, start, end))
        else:
            blocks.append(_sdpa_keep_mask(q_block, k_seen, v_seen, attn_mask=mask))
    return torch.cat(blocks, dim=2)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, pe: PositionalEncoding, layer: int, dropout: float):
        super().__init__()
        self.n_heads, self.layer = n_heads, layer
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.pe = [pe]  # in a list: the decoder owns the PE's parameters, blocks only use it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, dh)
        q, k = self.pe[0].rotate(q, k)
        y = causal_attention(q, k, v, self.pe[0], self.layer)  # (B, H, L, dh)
        return self.dropout(self.out(y.transpose(1, 2).reshape(batch, length, width)))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, kind: str, dropout: float):
        super().__init__()
        self.gated = kind == "swiglu"
        self.up = nn.Linear(d_model, 2 * hidden if self.gated else hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(self.up(x))
        return self.dropout(self.down(hidden))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, mlp_hidden, mlp, pe, layer, dropout):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, pe, layer, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_hidden, mlp, dropout)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids (B, L) -> hidden states (B, L, d_model); ``logits`` maps them to the vocabulary."""

    def __init__(
        self,
        vocab_size: int,
        train_len: int,
        pe: Callable[[AttentionShape], PositionalEncoding],
        d_model: int = 256,
        n_layers: int = 6,
        n_heads: int = 8,
        mlp: str = "gelu",
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        tie_embeddings: bool = False,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"model.n_heads ({n_heads}) must divide model.d_model ({d_model})")
        if mlp not in ("gelu", "swiglu"):
            raise ConfigError(f"model.mlp must be 'gelu' or 'swiglu'; got {mlp!r}")
        self.d_model = d_model
        self.pe = pe(AttentionShape(d_model, n_heads, n_layers, train_len))
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)
        hidden = int(mlp_ratio * d_model * (2 / 3 if mlp == "swiglu" else 1))  # same parameter count either way
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, hidden, mlp, self.pe, layer, dropout) for layer in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # Unit-variance token embeddings put tokens and the sinusoidal PE (amplitude 1) on one scale.
        nn.init.normal_(self.embedding.weight, std=1.0)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (B, L, d)
        x = self.dropout(self.pe.embed(x))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)  # (B, L, d)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden)  # (B, L, V)
        # Tied weights (T5): scale by d^-0.5, else each token's own embedding would score ~d at init.
        return (hidden * self.d_model**-0.5) @ self.embedding.weight.t().to(hidden.dtype)  # (B, L, V)

    def token_nll(self, tokens: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
        """Per-token negative log-likelihood (B, L) in fp32, with logits for ``chunk_tokens`` tokens at a time.

        Full logits of a batch of long windows x a large vocabulary would cost gigabytes.
        """
        hidden = self(tokens)
        span = max(1, chunk_tokens // tokens.size(0))  # positions per chunk
        return torch.cat(
            [
                F.cross_entropy(
                    self.logits(hidden[:, s : s + span]).float().flatten(0, 1),
                    targets[:, s : s + span].flatten(),
                    reduction="none",
                ).view(targets.size(0), -1)
                for s in range(0, tokens.size(1), span)
            ],
            dim=1,
        )
