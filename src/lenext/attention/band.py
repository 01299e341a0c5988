"""Causal attention with a banded score bias (T5, Shaw), and a value term of the band (Shaw's a^V), on the fused CPU
flash kernel, in O(L W) memory."""

import math
from functools import cache

import torch
import torch.nn.functional as F

BAND_ROWS = 64  # query rows per step of BandedAttention's band products


def diagonal_band(matrix: torch.Tensor, width: int) -> torch.Tensor:
    """The view (..., n, W) of a contiguous (..., n, n + W - 1) matrix whose row r is matrix[r, r : r + W]."""
    *lead_strides, row_stride, _ = matrix.stride()
    return matrix.as_strided((*matrix.shape[:-1], width), (*lead_strides, row_stride + 1, 1))


def band_mask(band: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The mask a band (B or 1, H, R, W) of query rows [start, end) stands for, fp32 (float64 for a float64 band).

    Covers keys [first, end), first = max(0, start - W + 1): (B or 1, H, end - start, end - first).
    Row i = start + r holds the band on keys i - W + 1 .. i and -inf on future keys. The keys
    before ``first`` are W or more back from every row of the block: their bias is 0.
    Built as one (rows, rows + W - 1) pattern with the band written along its diagonals, so its
    size does not depend on ``start``.
    """
    rows, width = end - start, band.size(-1)
    future = torch.ones(rows, rows + width - 1, dtype=torch.bool, device=band.device).triu(width)
    # column c: key start - W + 1 + c. One pattern, copied out: 3-7x faster than zeros + masked_fill
    padded = torch.where(future, float("-inf"), 0.0).to(torch.promote_types(band.dtype, torch.float32))
    padded = padded.expand(*band.shape[:-2], -1, -1).contiguous()
    diagonal_band(padded, width).copy_(band)
    return padded[..., max(0, width - 1 - start) :]  # drop the columns of keys before 0


@cache
def cpu_flash() -> bool:
    """Whether this torch exposes the fused causal CPU flash kernel, forward and backward."""
    q = torch.zeros(1, 1, 2, 2)
    try:
        _causal_flash_backward(q, q, q, q, *_causal_flash(q, q, q))
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


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
    two parts merge by their log-sum-exps. A value term of the band (``added`` (B or 1, 1 or H, L, W, d),
    ``BandValues.band``: what each band key's value gains) adds each row's band weights times it.
    SDPA would run a mask that needs a gradient on its unfused math path (softmax over (B, H, L, L)
    in memory, 3.5x slower here), so the backward is written out: the flash kernel's own backward
    for the far keys (exact given the merged output and log-sum-exp), and dS = P (dP - rowsum(dO * O))
    on the band, which is also the bias gradient (a band key's dP: dO . (v_j + added)).
    Each step keeps its (rows, W) and (rows, rows + W - 1) blocks in cache, rather than passing
    over (B, H, L, W) tensors once per operation.
    """

    @staticmethod
    def forward(ctx, q, k, v, band, added=None):
        # q, k, v: (B, H, L, d); band: (B or 1, H, L, W); added: None or (B or 1, 1 or H, L, W, d)
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
            if added is not None:
                out[..., rows, :] += (probs[..., rows, None, :] @ added[..., rows, :, :])[..., 0, :]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, logsumexp, probs, added)
        ctx.band_shape, ctx.band_dtype = band.shape, band.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, logsumexp, probs, added = ctx.saved_tensors
        length, width = probs.shape[-2:]
        scale = 1 / math.sqrt(q.size(-1))
        grad_out = grad_out.contiguous()
        # The far keys' gradients, to which each step adds its band's. grad_k/grad_v rows are keys
        # -W + 1 .. L - 1: a step's band also reaches the W - 1 keys before its rows.
        grad_q, grad_k, grad_v = _far_key_grads(grad_out, q, k, v, out, logsumexp, width)
        grad_band = probs.new_empty(ctx.band_shape)
        grad_added = torch.zeros_like(added) if added is not None and ctx.needs_input_grad[4] else None
        buffer = band_buffer(q, width)
        for rows in band_steps(length):
            start, n = rows.start, rows.stop - rows.start
            spanned = slice(start, rows.stop + width - 1)  # the keys of the step's bands, in grad_k's rows
            d_out, band_probs = grad_out[..., rows, :].float(), probs[..., rows, :]
            rowsum = (d_out * out[..., rows, :].float()).sum(-1, keepdim=True)  # (B, H, n, 1)
            grad_probs = diagonal_band(d_out @ band_keys(v, start, n, width).transpose(-2, -1), width)
            if added is not None:
                grad_probs = grad_probs + (d_out[..., None, :] @ added[..., rows, :, :].transpose(-2, -1))[..., 0, :]
            if grad_added is not None:
                heads = "h" if added.size(1) > 1 else ""  # the term shared by the heads: summed over them
                by_key = torch.einsum(f"bhnw,bhnd->b{heads}nwd", band_probs, d_out)
                by_key = by_key.view(-1, added.size(1), n, width, v.size(-1))
                grad_added[..., rows, :, :] = by_key.sum_to_size(added.size(0), *by_key.shape[1:])
            grad_scores = band_probs * (grad_probs - rowsum)  # dS on the band
            grad_band[..., rows, :] = grad_scores.sum_to_size(*ctx.band_shape[:-2], n, width)
            block = write_band(buffer, grad_scores * scale)  # d(q_i . k_j)
            grad_q[..., rows, :] += block @ band_keys(k, start, n, width)
            grad_k[..., spanned, :] += block.transpose(-2, -1) @ q[..., rows, :].float()
            grad_v[..., spanned, :] += write_band(buffer, band_probs).transpose(-2, -1) @ d_out
        grad_k, grad_v = grad_k[..., width - 1 :, :], grad_v[..., width - 1 :, :]
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_band.to(ctx.band_dtype), grad_added


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
