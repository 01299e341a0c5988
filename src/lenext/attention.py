"""The one attention call site, ``causal_attention``, and the kernels behind its paths.

Which path runs follows from what the PE provides (DESIGN.md section 7), never from its name:

- no score bias (NoPE, APEs, RoPE): SDPA ``is_causal``;
- on CUDA, a ``score_mod``: compiled FlexAttention, no (L, L) tensor at all;
- a key-only bias (ALiBi): a (1, H, 1, L) fp32 mask on SDPA's fused causal kernel;
- a banded bias (T5, Shaw) on CPU: ``BandedAttention``, the fused causal flash kernel for the
  keys beyond the band (bias 0) and the W band keys scored directly, in O(L W) extra memory;
- otherwise (Shaw's a^V, or no fused kernel): explicit scores, in query blocks.
"""

import math
from functools import cache

import torch
import torch.nn.functional as F

from lenext.pe import PositionalEncoding
from lenext.pe.base import diagonal_band

# FlexAttention runs score-bias PEs on CUDA without any (L, L) tensor. torch 2.6 is the first
# version whose backward reaches tensors a score_mod captures (the T5 table, Shaw's q . a^K).
flex_attention = None
if torch.__version__ >= "2.6":
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Float elements of mask per query block on the explicit path. 16 MiB in fp32 keeps each block's mask below glibc's
# mmap threshold (32 MiB), so the heap reuses it: a fresh mmap per mask cost more in page faults
# than the attention itself (Shaw, B 8, L 512). The output is preallocated, not concatenated:
# small block outputs kept between growing masks fragmented the heap (2.5 GB at 16k).
SCORE_BLOCK_ELEMENTS = 2**22
FLEX_BLOCK = 128  # FlexAttention's sparse block size (its default)
BAND_ROWS = 64  # query rows per matmul of BandedAttention's band products


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
def cpu_flash() -> bool:
    """Whether this torch exposes the fused causal CPU flash kernel, forward and backward."""
    q = torch.zeros(1, 1, 2, 2)
    try:
        _causal_flash_backward(q, q, q, q, *_causal_flash(q, q, q))
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


def _band_steps(y: torch.Tensor, width: int):
    """Yield (r, n, keys): query rows [r, r + n) in steps of BAND_ROWS, and the keys their bands span.

    keys: (B, H, n + W - 1, d) fp32, y's rows r - W + 1 .. r + n - 1, zeros for rows before 0.
    """
    length = y.size(-2)
    for r in range(0, length, BAND_ROWS):
        n = min(BAND_ROWS, length - r)
        missing = max(0, width - 1 - r)  # band keys before position 0
        keys = y[..., r + missing - width + 1 : r + n, :].float()
        yield r, n, F.pad(keys, (0, 0, missing, 0)) if missing else keys


def _dense_blocks(band: torch.Tensor):
    """Yield (r, block): band rows [r, r + n) written along the diagonals of a zero
    (n, n + W - 1) block, whose column c is key r - W + 1 + c. One buffer serves every step:
    the entries off the band stay zero."""
    length, width = band.shape[-2:]
    rows = min(BAND_ROWS, length)
    buffer = band.new_zeros(*band.shape[:-2], rows, rows + width - 1, dtype=torch.float32)
    for r in range(0, length, BAND_ROWS):
        n = min(BAND_ROWS, length - r)
        block = buffer[..., :n, : n + width - 1]
        diagonal_band(block, width).copy_(band[..., r : r + n, :])
        yield r, block


def band_dots(x: torch.Tensor, y: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, L, W) fp32: x_i . y_j for the W keys j = i - W + 1 + w of each row i; keys j < 0 give 0.

    x, y: (B, H, L, d). Each step scores BAND_ROWS rows against the keys their bands span with one
    matmul, then reads the band off the diagonals of that (rows, rows + W - 1) block.
    """
    out = x.new_empty(*x.shape[:-1], width, dtype=torch.float32)
    for r, n, keys in _band_steps(y, width):
        out[..., r : r + n, :] = diagonal_band(x[..., r : r + n, :].float() @ keys.transpose(-2, -1), width)
    return out


def band_matmul(band: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, H, L, d) fp32: the band as an (L, L) matrix times y; row i is sum_w band[i, w] y_{i - W + 1 + w}."""
    out = y.new_empty(*band.shape[:-1], y.size(-1), dtype=torch.float32)
    for (r, block), (_, n, keys) in zip(_dense_blocks(band), _band_steps(y, band.size(-1)), strict=True):
        out[..., r : r + n, :] = block @ keys
    return out


def band_matmul_transposed(band: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, H, L, d) fp32: the band's transpose times x; key j gets band[i, w] x_i wherever j = i - W + 1 + w."""
    width = band.size(-1)
    out = x.new_zeros(*band.shape[:-2], band.size(-2) + width - 1, x.size(-1), dtype=torch.float32)  # from key -W+1
    for r, block in _dense_blocks(band):
        out[..., r : r + block.size(-1), :] += block.transpose(-2, -1) @ x[..., r : r + block.size(-2), :].float()
    return out[..., width - 1 :, :]


class BandedAttention(torch.autograd.Function):
    """Causal attention with a banded bias (T5, Shaw) on the fused CPU kernel, in O(L W) extra memory.

    Row i's keys split in two. The far keys j <= i - W all carry bias 0: query rows W.. against
    key rows ..L-W-1 is a square causal problem, one call of the fused flash kernel with no mask.
    The W band keys are scored directly, (B, H, L, W), with the bias added. The two merge by their
    log-sum-exps. SDPA would run a mask that needs a gradient on its unfused math path (softmax
    over (B, H, L, L) in memory, 3.5x slower here), so the backward is written out: the flash
    kernel's own backward for the far keys (exact given the merged output and log-sum-exp), and
    dS = P (dP - rowsum(dO * O)) on the band, which is also the bias gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, band):
        # q, k, v: (B, H, L, d); band: (B or 1, H, L, W)
        length, width = band.shape[-2:]
        far = length - width  # rows i >= W see the far keys 0 .. i - W
        scores = band_dots(q, k, width) / math.sqrt(q.size(-1)) + band  # (B, H, L, W)
        first_rows = torch.arange(min(length, width - 1), device=q.device)[:, None]  # their bands start before key 0
        scores[..., : width - 1, :].masked_fill_(
            first_rows + torch.arange(width, device=q.device) < width - 1, -math.inf
        )
        logsumexp = scores.logsumexp(-1)  # (B, H, L)
        if far > 0:
            out_far, logsumexp_far = _causal_flash(q[:, :, width:], k[:, :, :far], v[:, :, :far])
            logsumexp[..., width:] = torch.logaddexp(logsumexp[..., width:], logsumexp_far)
        probs = scores.sub_(logsumexp[..., None]).exp_()  # the band's attention probabilities
        out = band_matmul(probs, v)
        if far > 0:
            out[:, :, width:] += out_far.float() * (logsumexp_far - logsumexp[..., width:]).exp()[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp, probs)
        ctx.band_shape, ctx.band_dtype = band.shape, band.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, probs = ctx.saved_tensors
        length, width = probs.shape[-2:]
        far, scale = length - width, 1 / math.sqrt(q.size(-1))
        grad_out = grad_out.contiguous()
        rowsum = (grad_out.float() * out.float()).sum(-1, keepdim=True)  # (B, H, L, 1)
        grad_scores = probs * (band_dots(grad_out, v, width) - rowsum)  # dS on the band
        grad_dots = grad_scores * scale  # of the band's q_i . k_j
        grad_q = band_matmul(grad_dots, k)
        grad_k = band_matmul_transposed(grad_dots, q)
        grad_v = band_matmul_transposed(probs, grad_out)
        if far > 0:
            grad_q_far, grad_k_far, grad_v_far = _causal_flash_backward(
                grad_out[:, :, width:],
                q[:, :, width:],
                k[:, :, :far],
                v[:, :, :far],
                out[:, :, width:],
                logsumexp[..., width:],
            )
            grad_q[:, :, width:] += grad_q_far
            grad_k[:, :, :far] += grad_k_far
            grad_v[:, :, :far] += grad_v_far
        grad_band = grad_scores.sum_to_size(ctx.band_shape).to(ctx.band_dtype)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_band


def _causal_flash(q, k, v):
    """The fused causal CPU flash kernel: (out, logsumexp), what SDPA runs inside, with the
    log-sum-exp that merging with the band needs."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)


def _causal_flash_backward(grad_out, q, k, v, out, logsumexp):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, 0.0, True
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
    flash_band = q.device.type == "cpu" and not pe.needs_attention_probs and cpu_flash()
    band = pe.band_bias(q, layer) if flash_band else None  # (B or 1, H, L, W)
    if band is not None:
        with torch.autocast(q.device.type, enabled=False):  # the band products stay fp32 under bf16
            return BandedAttention.apply(q, k, v, band)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (batch * heads * length))  # masks of (rows, L)
    out = q.new_empty(batch, heads, length, v.size(-1))  # written block by block: see SCORE_BLOCK_ELEMENTS
    for start in range(0, length, rows):  # query blocks attend to keys [0, end)
        end = min(start + rows, length)
        q_block, k_seen, v_seen = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
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
