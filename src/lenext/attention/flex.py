"""FlexAttention glue: the compiled kernel and the causal and sliding-window BlockMasks (CUDA path)."""

from functools import cache

import torch
import torch.nn.functional as F

from lenext.hardware import COMPILED_PATHS_TORCH
from lenext.pe.base import BandValues

# FlexAttention runs score-bias PEs on CUDA without any (L, L) tensor, on the torch it was checked on (an older one:
# the explicit paths, the same numbers).
flex_attention = None
if torch.__version__ >= COMPILED_PATHS_TORCH:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

FLEX_BLOCK = 128  # FlexAttention's sparse block size (its default)


def fresh_compile_state() -> None:
    """Forget what earlier runs in this process compiled: a Hydra multirun runs its jobs in one process.

    torch.compile keeps one cache for flex_attention across every PE a process trains, with a recompile
    limit (8) after which flex runs uncompiled (all (L, L) scores materialised), and its automatic-dynamic
    state turns captured values that differ from an earlier PE's into symbolic ones.
    """
    if flex_attention is not None:
        torch._dynamo.reset()


def allow_recompiles(graphs: int) -> None:
    """dynamo's limit on the graphs one code object compiles raised to at least ``graphs`` (each compiled block, each
    row of a benchmark, a graph of its own): past it, code runs eager."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
    setattr(config, name, max(getattr(config, name), graphs))


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


@cache
def window_block_mask(length: int, window: int, device: torch.device) -> "BlockMask":
    """The causal BlockMask of a sliding window (query i sees keys i - window + 1 .. i), from its block structure
    (create_block_mask would evaluate the mask at all L^2 positions): flex skips every block outside the band, so
    the work is O(L W). A block whose every row sees every key is full; one that some row sees in part, partial."""
    blocks = -(-length // FLEX_BLOCK)
    first = torch.arange(blocks, device=device) * FLEX_BLOCK  # each block's first row (as queries) or key
    last = (first + FLEX_BLOCK - 1).clamp(max=length - 1)
    rows_first, rows_last, keys_first, keys_last = first[:, None], last[:, None], first[None], last[None]
    seen = (keys_first <= rows_last) & (keys_last > rows_first - window)  # some row sees some key
    full = (keys_last <= rows_first) & (keys_first > rows_last - window)  # every row sees every key
    partial_count, partial_index = _listed(seen & ~full)
    full_count, full_index = _listed(full)

    def in_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return BlockMask.from_kv_blocks(
        kv_num_blocks=partial_count,
        kv_indices=partial_index,
        full_kv_num_blocks=full_count,
        full_kv_indices=full_index,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=in_window,
        seq_lengths=(length, length),
    )


def _listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, n) bool of the key blocks each query block visits -> their count (1, 1, n) and indices (1, 1, n, n),
    each row's listed first, in order."""
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
    return blocks.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None].contiguous()


def key_score_mod(key: torch.Tensor):
    """A key bias (B or 1, H, 1, L) as a score_mod: flex's backward adds each score's gradient into it in fp32."""
    key = key[:, :, 0].contiguous()  # (B or 1, H, L)
    if key.size(0) == 1:

        def shared(score, b, h, q_idx, kv_idx):
            return score + key[0, h, kv_idx]

        return shared

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score + key[b, h, kv_idx]

    return per_sequence


def band_score_mod(band: torch.Tensor):
    """A band bias (B or 1, H, L, W) as a score_mod: key j = i - W + 1 + w of row i gets band[..., i, w], keys farther
    back 0 (``Bias.band``'s form)."""
    # W - 1 as a captured tensor: compiled flex turns a captured int that differs from an earlier compile's into a
    # symbolic scalar, on which the lowering of its training graph fails (docs/pes/shaw.md). Filled on the device:
    # torch.tensor would copy it from the host, waiting for the GPU, in every layer's forward
    nearest = torch.full((), band.size(-1) - 1, device=band.device)

    def column(q_idx, kv_idx):
        # in range for every pair; off the band spread by key, where flex's backward adds the zero gradients of
        # a block's keys (one address per row would queue them)
        offset = nearest - (q_idx - kv_idx)
        return torch.where((offset >= 0) & (offset <= nearest), offset, kv_idx % (nearest + 1))

    if band.size(0) == 1:

        def shared(score, b, h, q_idx, kv_idx):
            return score + torch.where(q_idx - kv_idx <= nearest, band[0, h, q_idx, column(q_idx, kv_idx)], 0.0)

        return shared

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx - kv_idx <= nearest, band[b, h, q_idx, column(q_idx, kv_idx)], 0.0)

    return per_sequence


def attention_with_lse(kernel, q, k, v, score_mod, block_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel`` (flex_attention, compiled or not) returning (out, its log-sum-exp (B, H, L) fp32), both
    differentiable."""
    out, aux = kernel(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def band_weights(q: torch.Tensor, k: torch.Tensor, band: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    """(B, H, L, W) fp32 (float64 for float64 q): row i's softmax weights on its band's keys i - W + 1 .. i (0 on
    keys before the first), exp(score - logsumexp) from the row's log-sum-exp over all its keys; the band's scores
    q_i . k_j / sqrt(d) + band written out as W products of q with k shifted: O(L W d), no (L, L) tensor."""
    length, width = band.shape[-2:]
    wide = torch.promote_types(q.dtype, torch.float32)  # float64 for a float64 model
    queries = q.to(wide)
    keys = F.pad(k.to(wide), (0, 0, width - 1, 0))  # row i + w: key i - W + 1 + w (zeros before key 0)
    dots = torch.stack([(queries * keys[..., w : w + length, :]).sum(-1) for w in range(width)], -1)
    before_first = torch.arange(length, device=q.device)[:, None] + torch.arange(width, device=q.device) < width - 1
    return (dots * q.size(-1) ** -0.5 + band - logsumexp[..., None]).exp().masked_fill(before_first, 0.0)


def band_values_attention(kernel, q, k, v, band: torch.Tensor, values: BandValues) -> torch.Tensor:
    """Causal attention with a band bias (B or 1, H, L, W) and a value term in band form (Shaw's a^V) on flex:
    the fused kernel's output and log-sum-exp, then the value term from the band's weights alone."""
    out, logsumexp = attention_with_lse(kernel, q, k, v, band_score_mod(band), causal_block_mask(q.size(-2), q.device))
    added = values.output(band_weights(q, k, band, logsumexp), slice(None))
    return (out.to(added.dtype) + added).to(out.dtype)
