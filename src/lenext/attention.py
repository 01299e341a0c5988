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

# Float elements of mask per query block on the explicit path. 16 MiB in fp32 keeps each block's
# mask below glibc's mmap threshold (32 MiB), so the heap reuses it: a fresh mmap per mask cost
# more in page faults than the attention itself. The output is preallocated, not concatenated:
# small block outputs kept between growing masks fragmented the heap (2.5 GB at 16k).
SCORE_BLOCK_ELEMENTS = 2**22
FLEX_BLOCK = 128  # FlexAttention's sparse block size (its default)
BAND_ROWS = 64  # query rows per step of BandedAttention's band products


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


def band_keys(y: torch.Tensor, start: int, rows: int, width: int) -> torch.Tensor:
    """(B, H, rows + W - 1, d) fp32: the keys the bands of query rows [start, start + rows) span,
    y's rows start - W + 1 .. start + rows - 1, with zeros for rows before 0."""
    missing = max(0, width - 1 - start)
    keys = y[..., start + missing - width + 1 : start + rows, :].float()
    return F.pad(keys, (0, 0, missing, 0)) if missing else keys


def band_steps(length: int):
    """BandedAttention's steps: slices of BAND_ROWS query rows."""
    for start in range(0, length, BAND_ROWS):
        yield slice(start, min(start + BAND_ROWS, length))


def band_buffer(q: torch.Tensor, width: int) -> torch.Tensor:
    """Zero fp32 scratch (B, H, n, n + W - 1) for ``write_band``, n = the rows of one step."""
    rows = min(BAND_ROWS, q.size(-2))
    return q.new_zeros(*q.shape[:2], rows, rows + width - 1, dtype=torch.float32)


def write_band(buffer: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """The band (B, H, n, W) as a dense (B, H, n, n + W - 1) block, column c is key start - W + 1 + c.

    Writes into the top-left corner of ``buffer``, which starts zero: off the band it stays zero,
    so one buffer serves every step.
    """
    rows, width = band.shape[-2:]
    block = buffer[..., :rows, : rows + width - 1]
    diagonal_band(block, width).copy_(band)
    return block


class BandedAttention(torch.autograd.Function):
    """Causal attention with a banded bias (T5, Shaw) on the fused CPU kernel, in O(L W) extra memory.

    Row i's keys split in two. The far keys j <= i - W all carry bias 0: query rows W.. against
    key rows ..L-W-1 is a square causal problem, one call of the fused flash kernel with no mask.
    The W band keys are scored directly with the bias added, BAND_ROWS query rows per step, and the
    two parts merge by their log-sum-exps. SDPA would run a mask that needs a gradient on its
    unfused math path (softmax over (B, H, L, L) in memory, 3.5x slower here), so the backward is
    written out: the flash kernel's own backward for the far keys (exact given the merged output
    and log-sum-exp), and dS = P (dP - rowsum(dO * O)) on the band, which is also the bias gradient.
    Each step keeps its (rows, W) and (rows, rows + W - 1) blocks in cache, rather than passing
    over (B, H, L, W) tensors once per operation.
    """

    @staticmethod
    def forward(ctx, q, k, v, band):
        # q, k, v: (B, H, L, d); band: (B or 1, H, L, W)
        # Contiguous once, so that each step's slices go to the batched matmuls without a copy
        # (the decoder's q, k, v are strided views of one projection).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        length, width = band.shape[-2:]
        scale = 1 / math.sqrt(q.size(-1))
        out_far, logsumexp_far = _far_keys(q, k, v, width)  # (B, H, L, d), (B, H, L)
        out, logsumexp = torch.empty_like(out_far), torch.empty_like(logsumexp_far)
        probs = logsumexp.new_empty(*logsumexp.shape, width)  # the band's attention probabilities
        buffer = band_buffer(q, width)
        for rows in band_steps(length):
            start, n = rows.start, rows.stop - rows.start
            dots = q[..., rows, :].float() @ band_keys(k, start, n, width).transpose(-2, -1)  # (B, H, n, n + W - 1)
            scores = diagonal_band(dots, width) * scale + band[..., rows, :]  # (B, H, n, W)
            if start < width - 1:  # band entries of keys before 0
                row = torch.arange(start, rows.stop, device=q.device)[:, None]
                scores.masked_fill_(row + torch.arange(width, device=q.device) < width - 1, -math.inf)
            logsumexp[..., rows] = torch.logaddexp(scores.logsumexp(-1), logsumexp_far[..., rows])
            torch.exp(scores - logsumexp[..., rows, None], out=probs[..., rows, :])
            far_share = (logsumexp_far[..., rows] - logsumexp[..., rows]).exp()[..., None]
            values = band_keys(v, start, n, width)
            out[..., rows, :] = write_band(buffer, probs[..., rows, :]) @ values + out_far[..., rows, :] * far_share
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp, probs)
        ctx.band_shape, ctx.band_dtype = band.shape, band.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, probs = ctx.saved_tensors
        length, width = probs.shape[-2:]
        scale = 1 / math.sqrt(q.size(-1))
        grad_out = grad_out.contiguous()
        # The far keys' gradients, to which each step adds its band's. grad_k/grad_v rows are keys
        # -W + 1 .. L - 1: a step's band also reaches the W - 1 keys before its rows.
        grad_q, grad_k, grad_v = _far_key_grads(grad_out, q, k, v, out, logsumexp, width)
        grad_band = probs.new_empty(ctx.band_shape)
        buffer = band_buffer(q, width)
        for rows in band_steps(length):
            start, n = rows.start, rows.stop - rows.start
            spanned = slice(start, rows.stop + width - 1)  # the keys of the step's bands, in grad_k's rows
            d_out, band_probs = grad_out[..., rows, :].float(), probs[..., rows, :]
            rowsum = (d_out * out[..., rows, :].float()).sum(-1, keepdim=True)  # (B, H, n, 1)
            grad_probs = diagonal_band(d_out @ band_keys(v, start, n, width).transpose(-2, -1), width)
            grad_scores = band_probs * (grad_probs - rowsum)  # dS on the band
            grad_band[..., rows, :] = grad_scores.sum_to_size(*ctx.band_shape[:-2], n, width)
            block = write_band(buffer, grad_scores * scale)  # d(q_i . k_j)
            grad_q[..., rows, :] += block @ band_keys(k, start, n, width)
            grad_k[..., spanned, :] += block.transpose(-2, -1) @ q[..., rows, :].float()
            grad_v[..., spanned, :] += write_band(buffer, band_probs).transpose(-2, -1) @ d_out
        grad_k, grad_v = grad_k[..., width - 1 :, :], grad_v[..., width - 1 :, :]
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_band.to(ctx.band_dtype)


def _far_keys(q, k, v, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each row i over the keys j <= i - W alone: (out, logsumexp), fp32,
    (B, H, L, d) and (B, H, L); rows i < W have no such keys (out 0, logsumexp -inf)."""
    far = q.size(-2) - width
    if far <= 0:
        return q.new_zeros(v.shape, dtype=torch.float32), q.new_full(q.shape[:-1], -math.inf, dtype=torch.float32)
    out, logsumexp = _causal_flash(q[:, :, width:], k[:, :, :far], v[:, :, :far])
    return F.pad(out.float(), (0, 0, width, 0)), F.pad(logsumexp, (width, 0), value=-math.inf)


def _far_key_grads(grad_out, q, k, v, out, logsumexp, width: int) -> tuple[torch.Tensor, ...]:
    """The far keys' part of (grad_q, grad_k, grad_v), fp32: grad_q (B, H, L, d) for the query
    rows, grad_k and grad_v (B, H, L + W - 1, d) for keys -W + 1 .. L - 1 (zero but for 0 .. L - W - 1).

    The flash backward is exact for a subset of keys given the merged output and log-sum-exp.
    """
    length = q.size(-2)
    far = length - width
    if far <= 0:
        return q.new_zeros(q.shape, dtype=torch.float32), *(
            q.new_zeros(*q.shape[:2], length + width - 1, q.size(-1), dtype=torch.float32) for _ in "kv"
        )
    grad_q, grad_k, grad_v = _causal_flash_backward(
        grad_out[:, :, width:], q[:, :, width:], k[:, :, :far], v[:, :, :far], out[:, :, width:], logsumexp[..., width:]
    )
    key_rows = (0, 0, width - 1, width)  # padding: the W - 1 keys before 0, the last W keys
    return F.pad(grad_q.float(), (0, 0, width, 0)), F.pad(grad_k.float(), key_rows), F.pad(grad_v.float(), key_rows)


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
