"""The one attention call site, ``causal_attention``: it picks the cheapest exact path for the PE.

Which path runs follows from what the PE provides (DESIGN.md section 7), never from its name:

- no score bias (NoPE, APEs, RoPE): SDPA ``is_causal``;
- on CUDA, a ``score_mod``: compiled FlexAttention, no (L, L) tensor at all;
- a key-only bias (ALiBi): a (1, H, 1, L) fp32 mask on SDPA's fused causal kernel;
- a banded bias (T5, Shaw) on CPU: ``BandedAttention``, the fused causal flash kernel for the
  keys beyond the band (bias 0) and the W band keys scored directly, in O(L W) extra memory;
- otherwise (Shaw's a^V, or no fused kernel): explicit scores, in query blocks.

The kernels live beside it: ``band`` (BandedAttention, CPU), ``flex`` (FlexAttention, CUDA).
"""

import math
from functools import cache

import torch
import torch.nn.functional as F

from lenext.attention.band import BandedAttention, cpu_flash
from lenext.attention.flex import causal_block_mask, compiled_flex_attention, flex_attention
from lenext.pe import PositionalEncoding

# Float elements of mask per query block on the explicit path. 16 MiB in fp32 keeps each block's
# mask below glibc's mmap threshold (32 MiB), so the heap reuses it: a fresh mmap per mask cost
# more in page faults than the attention itself. The output is preallocated, not concatenated:
# small block outputs kept between growing masks fragmented the heap (2.5 GB at 16k).
SCORE_BLOCK_ELEMENTS = 2**22


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
