"""The one attention call site, ``causal_attention``, and the kernels behind its paths.

Which path runs follows from what the PE provides (DESIGN.md section 7), never from its name:

- no score bias (NoPE, APEs, RoPE): SDPA ``is_causal``;
- on CUDA, a ``score_mod``: compiled FlexAttention, no (L, L) tensor at all;
- a key-only bias (ALiBi): a (1, H, 1, L) fp32 mask on SDPA's fused causal kernel;
- a banded bias (T5, Shaw) on CPU: ``BandedAttention``, the fused flash kernel on query blocks
  whose keys before the band need no mask and whose band takes a (rows, rows + W - 1) mask,
  with a backward that computes the bias gradient on the band only;
- otherwise (Shaw's a^V, or no fused kernel): explicit scores, in query blocks.
"""

import math
from functools import cache

import torch
import torch.nn.functional as F

from lenext.pe import PositionalEncoding
from lenext.pe.base import band_mask, diagonal_band

# FlexAttention runs score-bias PEs on CUDA without any (L, L) tensor. torch 2.6 is the first
# version whose backward reaches tensors a score_mod captures (the T5 table, Shaw's q . a^K).
flex_attention = None
if torch.__version__ >= "2.6":
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Float elements of mask per query block. 16 MiB in fp32 keeps each block's mask below glibc's
# mmap threshold (32 MiB), so the heap reuses it: a fresh mmap per mask cost more in page faults
# than the attention itself (Shaw, B 8, L 512). The output is preallocated, not concatenated:
# small block outputs kept between growing masks fragmented the heap (2.5 GB at 16k).
SCORE_BLOCK_ELEMENTS = 2**22
FLEX_BLOCK = 128  # FlexAttention's sparse block size (its default)
BAND_ROWS = 128  # query rows per matmul when BandedAttention's backward scores the band


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


@cache
def cpu_flash_with_mask() -> bool:
    """Whether this torch has the fused CPU flash kernel with an additive mask, forward and backward."""
    q = torch.zeros(1, 1, 2, 2)
    try:
        _flash_backward(q, q, q, q, *_flash(q, q, q, attn_mask=q), attn_mask=q)
    except (AttributeError, RuntimeError, TypeError):
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


def band_dots(x: torch.Tensor, y: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """(B, H, R, W) fp32: x_i . y_j for rows i = start + r of x and the W keys j = i - W + 1 + w of y.

    x: (B, H, R, d) rows [start, start + R); y: (B, H, >= start + R, d). Keys j < 0 give 0.
    Each step scores BAND_ROWS rows against the keys their bands span with one matmul, then reads
    the band off the diagonals of that (rows, rows + W - 1) block.
    """
    rows = x.size(-2)
    missing = max(0, width - 1 - start)  # band keys before position 0
    keys = F.pad(y[..., max(0, start - width + 1) : start + rows, :], (0, 0, missing, 0)).float()
    x = x.float()
    bands = []
    for r in range(0, rows, BAND_ROWS):
        n = min(BAND_ROWS, rows - r)
        scores = x[..., r : r + n, :] @ keys[..., r : r + n + width - 1, :].transpose(-2, -1)  # (B, H, n, n+W-1)
        bands.append(diagonal_band(scores, width))
    return torch.cat(bands, dim=-2)


class BandedAttention(torch.autograd.Function):
    """Causal attention for query rows [start, start + R) with a banded bias, on the fused CPU kernel.

    Keys split in two: the band's span [first, end), scored with the band written into a small
    (R, R + W - 1) mask, and the keys before it, which every row sees with bias 0, scored with no
    mask at all; the two halves merge by their log-sum-exps. SDPA would run a mask that needs a
    gradient on its unfused math path (softmax over (B, H, L, L) in memory, 3.5x slower here),
    so the backward is written out: the flash kernel's own backward for q, k, v (exact per key
    range, given the merged output and log-sum-exp), and dS = P (dP - rowsum(dO * O)) for the
    bias, on the band only.
    """

    @staticmethod
    def forward(ctx, q, k, v, band, start: int):
        # q: (B, H, R, d); k, v: (B, H, start + R, d); band: (B or 1, H, R, W)
        first = max(0, start - band.size(-1) + 1)
        mask = band_mask(band, start, start + q.size(-2))  # (B or 1, H, R, end - first)
        out, logsumexp = _flash(q, k[:, :, first:], v[:, :, first:], attn_mask=mask)
        if first > 0:
            out_far, logsumexp_far = _flash(q, k[:, :, :first], v[:, :, :first])
            total = torch.logaddexp(logsumexp, logsumexp_far)  # (B, H, R)
            near_share, far_share = (logsumexp - total).exp()[..., None], (logsumexp_far - total).exp()[..., None]
            out, logsumexp = (out.float() * near_share + out_far.float() * far_share).to(q.dtype), total
        ctx.save_for_backward(q, k, v, band, out, logsumexp)
        ctx.start = start
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, band, out, logsumexp = ctx.saved_tensors
        start, rows, width = ctx.start, q.size(-2), band.size(-1)
        first = max(0, start - width + 1)
        grad_out = grad_out.contiguous()
        mask = band_mask(band, start, start + rows)
        grad_q, grad_k, grad_v = _flash_backward(grad_out, q, k[:, :, first:], v[:, :, first:], out, logsumexp, mask)
        if first > 0:
            grad_q_far, grad_k_far, grad_v_far = _flash_backward(
                grad_out, q, k[:, :, :first], v[:, :, :first], out, logsumexp, None
            )
            grad_q = grad_q + grad_q_far
            grad_k, grad_v = torch.cat([grad_k_far, grad_k], dim=2), torch.cat([grad_v_far, grad_v], dim=2)
        scores = band_dots(q, k, start, width) / math.sqrt(q.size(-1)) + band.float()  # (B, H, R, W)
        probs = torch.exp(scores - logsumexp[..., None])
        grad_probs = band_dots(grad_out, v, start, width) - (grad_out.float() * out.float()).sum(-1, keepdim=True)
        row = torch.arange(start, start + rows, device=q.device)[:, None]
        key = row - (width - 1) + torch.arange(width, device=q.device)  # (R, W): key j of each band entry
        grad_band = (probs * grad_probs).masked_fill_(key < 0, 0.0)  # dS on the band
        return grad_q, grad_k, grad_v, grad_band.sum_to_size(band.shape).to(band.dtype), None


def _flash(q, k, v, attn_mask=None):
    """The fused CPU flash kernel: (out, logsumexp), non-causal, with an optional additive mask."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=attn_mask)


def _flash_backward(grad_out, q, k, v, out, logsumexp, attn_mask):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, 0.0, False, attn_mask=attn_mask
    )


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
    flash_band = q.device.type == "cpu" and not pe.needs_attention_probs and cpu_flash_with_mask()
    band = pe.band_bias(q, layer) if flash_band else None  # (B or 1, H, L, W)
    if band is not None:  # masks of (rows, rows + W - 1): block size independent of L
        rows = max(1, math.isqrt(SCORE_BLOCK_ELEMENTS // (batch * heads)))
    else:  # masks of (rows, L)
        rows = max(1, SCORE_BLOCK_ELEMENTS // (batch * heads * length))
    out = q.new_empty(batch, heads, length, v.size(-1))  # written block by block: see SCORE_BLOCK_ELEMENTS
    for start in range(0, length, rows):  # query blocks attend to keys [0, end)
        end = min(start + rows, length)
        q_block, k_seen, v_seen = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
        if band is not None:
            out[:, :, start:end] = BandedAttention.apply(q_block, k_seen, v_seen, band[:, :, start:end], start)
            continue
        mask = pe.score_bias(q_block, layer, start, end)
        if pe.key_only_bias:  # the PE left the causal mask to us
            future = torch.ones(end - start, end, dtype=torch.bool, device=q.device).triu(start + 1)
            mask = torch.where(future, float("-inf"), mask)
        if pe.needs_attention_probs:
            scores = (q_block @ k_seen.transpose(-2, -1)).float() / math.sqrt(head_dim) + mask
            probs = scores.softmax(-1).to(q.dtype)  # (B, H, rows, end)
            out[:, :, start:end] = probs @ v_seen + pe.value_term(probs, layer, start, end)
        else:
            out[:, :, start:end] = _sdpa_keep_mask(q_block, k_seen, v_seen, attn_mask=mask)
    return out
