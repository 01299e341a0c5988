"""A small pre-norm decoder-only transformer whose only knowledge of position is its PE.

The PE (``lenext.pe``) plugs in at three sites: ``embed`` after the token embedding, ``rotate``
on q and k, and its score bias inside the attention, each given the tokens' positions (0..L-1 unless
training draws others). The model never asks which PE it holds.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lenext.attention import AttentionSettings, LengthScale, causal_attention
from lenext.attention.flex import allow_recompiles
from lenext.errors import ConfigError
from lenext.pe import AttentionShape, PositionalEncoding
from lenext.pe.base import SPAN, LayerPE, device_budget, forward_reads, sequential_positions
from lenext.ranges import PositiveFloat, PositiveInt, Probability

# Logits made at a time, in floats: on CPU small enough for the heap to reuse each chunk instead of mapping it
# afresh; CUDA's allocator reuses any size, so fewer launches there (docs/performance.md, "Memory").
LOGIT_CHUNK_ELEMENTS = {"cpu": 2**22, "cuda": 2**24}
NORM_EPS = 1e-5


class SelfAttention(nn.Module):
    def __init__(
        self, d_model: int, n_heads: int, pe: LayerPE, attention: AttentionSettings, train_len: int, dropout: float
    ):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.pe = pe  # this layer's PE: its own parameters (FoX's gate) are the layer's
        self.window = pe.window if pe.window is not None else attention.window
        self.length_scale = LengthScale(attention, n_heads, train_len)
        # QK-norm (attention.qk_norm): over the whole projection, as SakanaAI/DroPE's qk_norm_nope attention
        self.q_norm = nn.RMSNorm(d_model, eps=NORM_EPS) if attention.qk_norm else None
        self.k_norm = nn.RMSNorm(d_model, eps=NORM_EPS) if attention.qk_norm else None
        self.stick_breaking = attention.normalizer == "stick_breaking"
        if self.stick_breaking and pe.up_to_row_constant:
            raise ConfigError(
                "attention.normalizer=stick_breaking is invalid with this PE: its score bias is given up to a "
                "per-row constant (a key or band bias: ALiBi, T5, Shaw, FoX), which softmax ignores and "
                "stick-breaking does not; use a PE without such a bias (nope, rope, kerple, fire, cope, ...)"
            )
        if pe.reads_logits and pe.up_to_row_constant:
            raise ConfigError(
                "pe: a term computed from the logits' values (CoPE, DAPE) cannot be combined with a score bias "
                "given up to a per-row constant (ALiBi, T5, Shaw, FoX): the constant would change the term; "
                "combine it with pair biases only (kerple, fire)"
            )
        if attention.scale != "none" and not pe.takes_row_scale:
            raise ConfigError(
                f"attention.scale={attention.scale} is invalid with this PE: DAPE's MLP reads each logit without "
                "the row's scale, which the scaled logit does not give back; use attention.scale=none"
            )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(x)  # (B, L, 3 d): q, k, v
        if self.q_norm is not None:
            q, k, v = qkv.chunk(3, dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        q, k, v = qkv.view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, H, L, dh)
        q, k = self.pe.rotate(q, k, positions)
        terms = self.pe.terms(x, q, k, positions)
        row_scale = self.length_scale(length, self.window, x.device)  # (1, H, L, 1) or None
        y = causal_attention(q, k, v, terms, self.window, row_scale, self.stick_breaking)  # (B, H, L, dh)
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


def normalization(kind: str, d_model: int) -> nn.Module:
    """LayerNorm (GPT-2, GPT-NeoX) or RMSNorm (Llama), both with LayerNorm's default epsilon (the exports name it)."""
    return nn.LayerNorm(d_model, eps=NORM_EPS) if kind == "layernorm" else nn.RMSNorm(d_model, eps=NORM_EPS)


class Block(nn.Module):
    def __init__(self, d_model, n_heads, mlp_hidden, mlp, norm, pe, attention, train_len, dropout):
        super().__init__()
        self.attn_norm = normalization(norm, d_model)
        self.attn = SelfAttention(d_model, n_heads, pe, attention, train_len, dropout)
        self.mlp_norm = normalization(norm, d_model)
        self.mlp = MLP(d_model, mlp_hidden, mlp, dropout)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


def block_in_forward(block: nn.Module, reads: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``block`` run with its forward's ``reads`` (``forward_reads``), as the decoder runs its blocks."""
    with forward_reads(positions, reads):
        return block(x, positions)


class Decoder(nn.Module):
    """Token ids (B, L) -> hidden states (B, L, d_model); ``logits`` maps them to the vocabulary."""

    BUILT_WITH = ("vocab_size", "train_len", "pe", "attention", "max_position")  # from the data, run, pe, attention

    def __init__(
        self,
        vocab_size: int,
        train_len: int,
        pe: Callable[[AttentionShape], PositionalEncoding],
        attention: AttentionSettings | None = None,  # null: the defaults (no window, no length scale)
        max_position: PositiveInt | None = None,
        d_model: PositiveInt = 256,
        n_layers: PositiveInt = 6,
        n_heads: PositiveInt = 8,
        mlp: Literal["gelu", "swiglu"] = "gelu",
        mlp_ratio: PositiveFloat = 4.0,
        norm: Literal["layernorm", "rmsnorm"] = "layernorm",
        dropout: Probability = 0.0,
        tie_embeddings: bool = False,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"model.n_heads={n_heads} is invalid: it must divide model.d_model={d_model}")
        self.d_model, self.vocab_size = d_model, vocab_size
        self.pe = pe(AttentionShape(d_model, n_heads, n_layers, train_len, max_position))
        attention = attention or AttentionSettings()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)
        shrink = "2/3 x " if mlp == "swiglu" else ""  # same parameter count either way
        hidden = int(mlp_ratio * d_model * (2 / 3 if shrink else 1))
        if hidden < 1:
            raise ConfigError(
                f"model.mlp_ratio={mlp_ratio} is invalid at model.d_model={d_model}: the MLP's width, {shrink}"
                "mlp_ratio x d_model, rounds down to 0; it must be at least 1"
            )
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, hidden, mlp, norm, self.pe.layer(layer), attention, train_len, dropout)
            for layer in range(n_layers)
        )
        self.norm = normalization(norm, d_model)
        self.head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)
        self.checkpoint_blocks = False  # True: each block's activations recomputed in the backward pass
        self.compiled_blocks: tuple[nn.Module, ...] | None = None  # for training (``compile_blocks``)
        self.apply(self._init_weights)
        # Unit-variance token embeddings put tokens and the sinusoidal PE (amplitude 1) on one scale.
        nn.init.normal_(self.embedding.weight, std=1.0)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def pe_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of the PE: its shared ones (``pe``) and each layer's (``block.attn.pe``: FoX's gates,
        CoPE's embeddings, DAPE's MLP, PaTH's projections)."""
        yield from self.pe.parameters()
        for block in self.blocks:
            yield from block.attn.pe.parameters()

    def compile_blocks(self) -> None:
        """Each block compiled with torch.compile (``module.compile=true``), for training: forwards with a gradient
        run the compiled blocks, at the training length; evaluation runs the blocks as they are, so a sweep over
        lengths does not recompile them per length (docs/scaling.md). A compiled block reads no tensor's value: the
        positions' span and a PE's other reads are those the decoder made before its blocks (``forward_reads``)."""
        # dynamo's limit counts the graphs of one code object, which every block shares; a PE that reads its layer's
        # index (ALiBi's slopes, T5's table) specializes each block's graph: past the limit, blocks ran eager
        allow_recompiles(8 * len(self.blocks))
        self.compiled_blocks = tuple(torch.compile(block) for block in self.blocks)  # not submodules: no state

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, L) at positions (B or 1, L), strictly increasing; None: 0..L-1."""
        compiled = self.compiled_blocks is not None and torch.is_grad_enabled()
        recomputed = self.checkpoint_blocks and torch.is_grad_enabled()  # the backward runs blocks outside this forward
        # What the PEs read from tensors (the positions' span, FIRE's thresholds), read once a forward: the span is
        # known at 0..L-1; the rest is read before the blocks for compiled ones (a read in a block breaks its graph)
        # and recomputed ones (else each recomputed layer reads again); else by the first layer that needs it
        before_blocks = (compiled or recomputed) and not torch.compiler.is_compiling()
        if positions is None:
            reads, positions = {SPAN: tokens.size(1)}, sequential_positions(tokens.size(1), tokens.device)
        else:
            reads = {SPAN: int(positions.max()) + 1} if before_blocks else {}
        x = self.embedding(tokens)  # (B, L, d)
        # a whole compiled decoder: its PEs read in its graph
        with contextlib.nullcontext() if torch.compiler.is_compiling() else forward_reads(positions, reads):
            if before_blocks:
                self.pe.read_before_blocks(positions)
            x = self.dropout(self.pe.embed(x, positions))
            for block in self.compiled_blocks if compiled else self.blocks:
                if recomputed:
                    # the backward recomputes the block outside this context: with the reads set again, a compiled
                    # block traces the graph its forward did (else it saved other tensors, and the backward failed)
                    run = functools.partial(block_in_forward, block, reads)
                    x = checkpoint(run, x, positions, use_reentrant=False)
                else:
                    x = block(x, positions)
        return self.norm(x)  # (B, L, d)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden)  # (B, L, V)
        # Tied weights (T5): scale by d^-0.5, else each token's own embedding would score ~d at init.
        return (hidden * self.d_model**-0.5) @ self.embedding.weight.t().to(hidden.dtype)  # (B, L, V)

    def token_nll(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor | None = None,
        predictions: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token negative log-likelihood (B, L) in fp32; with ``predictions``, also the most likely token at
        each position (B, L).

        The logits are made ``LOGIT_CHUNK_ELEMENTS`` at a time: all of a batch of long windows x a large vocabulary
        would cost gigabytes.
        """
        return chunked_nll(self(tokens, positions), targets, self.logits, self.vocab_size, predictions)


def chunked_nll(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    predictions: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-target NLL (B, L) in fp32 of the last hidden states (B, L, d) under the output projection ``logits``
    (and with ``predictions`` the most likely tokens), the logits made ``LOGIT_CHUNK_ELEMENTS`` at a time: lenext's
    Decoder and a Hugging Face model's plain head (lenext.hf) score through here."""
    budget = device_budget(LOGIT_CHUNK_ELEMENTS, hidden.device)
    span = max(1, budget // (vocab_size * targets.size(0)))  # positions per chunk
    # One output written chunk by chunk: chunk outputs kept between the logits fragmented the heap.
    nll = hidden.new_empty(targets.shape, dtype=torch.float32)
    predicted = torch.empty_like(targets) if predictions else None
    for s in range(0, targets.size(1), span):
        chunk = logits(hidden[:, s : s + span]).float()  # (B, span, V)
        # Rows of (B * span, V): on a (B, V, span) view log_softmax copies the logits and reduces a strided axis.
        chunk_nll = F.cross_entropy(chunk.flatten(0, 1), targets[:, s : s + span].flatten(), reduction="none")
        nll[:, s : s + span] = chunk_nll.view(chunk.shape[:2])
        if predictions:
            predicted[:, s : s + span] = chunk.argmax(-1)
    return (nll, predicted) if predictions else nll
