"""Self-Extend (Jin et al. 2024) on a Hugging Face model, as lenext's RoPE computes it (``lenext.pe.rope``): keys
fewer than W positions back scored at their true positions, farther ones with the query at floor(i / G) + W - W / G
and the key at floor(j / G), W = C // 4 and G the smallest group whose grouped positions stay below C.

It replaces the model's attention function through transformers' attention interface, which receives q and k as
the model rotated them at 0..L-1: the function turns them back with the model's own rotary module and rotates them
again at the grouped positions. That is exact for a model whose rotary module rotates every dimension of a head by
halves (Llama, Qwen2, Mistral and their kin); ``supports`` checks it on the model itself before any work.
"""

import torch
from torch import nn

from lenext.attention import SCORE_BLOCK_ELEMENTS
from lenext.errors import first_line
from lenext.pe.base import device_budget
from lenext.pe.rope import self_extend_positions, self_extend_window

ATTENTION_NAME = "lenext_self_extend"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension: a quarter turn of each pair (t, t + d/2)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class SelfExtendAttention:
    """transformers' attention function (``AttentionInterface``) computing Self-Extend's logits; ``group`` is set
    for each length."""

    def __init__(self, rotary: nn.Module, context: int):
        self.rotary, self.window, self.group = rotary, self_extend_window(context), 1
        self._tables_key, self._tables = None, None

    def tables(self, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """float64 (cos, sin) of the model's own rotation at 0..L-1 (1, 1, L, d), and of the grouped query and key
        positions (L, d), each with the module's attention factor: once per length and group, not per layer."""
        key = (length, self.group, dtype, device)
        if key != self._tables_key:
            positions = torch.arange(length, device=device)
            cos, sin = self.rotary(torch.empty(0, dtype=dtype, device=device), positions[None])  # as the model did
            scale = getattr(self.rotary, "attention_scaling", 1.0)
            inv_freq = self.rotary.inv_freq.double().to(device)
            far = []
            for at in self_extend_positions(positions, self.group, self.window):  # query's, key's
                angles = at.double()[:, None] * inv_freq  # (L, d/2)
                angles = torch.cat((angles, angles), dim=-1)
                far += [angles.cos() * scale, angles.sin() * scale]
            self._tables = (cos[:, None].double(), sin[:, None].double(), *far)
            self._tables_key = key
        return self._tables

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        # query (B, H, L, d), key and value (B, H_kv, L, d): q and k rotated at 0..L-1 by the model.
        length, repeats = query.size(2), query.size(1) // key.size(1)
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))  # transformers' repeat_kv
        cos, sin, q_cos, q_sin, k_cos, k_sin = self.tables(length, query.dtype, query.device)
        unscale = getattr(self.rotary, "attention_scaling", 1.0) ** 2  # the model's rotation undone
        plain_q, plain_k = ((t.double() * cos - rotate_half(t.double()) * sin) / unscale for t in (query, key))
        far_q = plain_q * q_cos + rotate_half(plain_q) * q_sin  # at the grouped positions
        far_k = plain_k * k_cos + rotate_half(plain_k) * k_sin
        window = self.window
        positions = torch.arange(length, device=query.device)
        near_q, near_k = query.double(), key.double()
        scaling = scaling if scaling is not None else query.size(-1) ** -0.5
        rows = max(1, device_budget(SCORE_BLOCK_ELEMENTS, query.device) // (query.size(0) * query.size(1) * length))
        output = torch.empty_like(query)
        for start in range(0, length, rows):
            end = min(length, start + rows)
            distance = positions[start:end, None] - positions[None, :end]  # (R, K)
            near = near_q[:, :, start:end] @ near_k[:, :, :end].transpose(-2, -1)
            far = far_q[:, :, start:end] @ far_k[:, :, :end].transpose(-2, -1)
            logits = torch.where(distance < window, near, far) * scaling
            logits = logits.masked_fill(distance < 0, float("-inf"))
            probabilities = torch.softmax(logits, dim=-1)
            output[:, :, start:end] = (probabilities @ value[:, :, :end].double()).to(query.dtype)
        return output.transpose(1, 2).contiguous(), None  # (B, L, H, d), as transformers' attention functions


def install(model, rotary: nn.Module, context: int) -> SelfExtendAttention | str:
    """Self-Extend registered for ``model`` (set with ``model.set_attn_implementation(ATTENTION_NAME)``), or why it
    cannot patch the model exactly: checked at G = 1, where it must give the model's own logits."""
    from transformers import AttentionInterface

    window = getattr(model.config, "sliding_window", None)
    if window and getattr(model.config, "use_sliding_window", True):  # a check on a few tokens would not see it
        return f"it attends through a sliding window (sliding_window={window}), which Self-Extend's attention drops"
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if softcap:
        return f"it caps its logits (attn_logit_softcapping={softcap}), which Self-Extend's attention does not"
    rope = getattr(model.config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor") or getattr(model.config, "partial_rotary_factor", None)
    if partial is not None and partial < 1:  # Phi, GPT-NeoX, StableLM: a rotated part and a plain one
        return f"it rotates part of each head (partial_rotary_factor={partial}), Self-Extend's attention the whole"
    attention = SelfExtendAttention(rotary, context)
    AttentionInterface.register(ATTENTION_NAME, attention)
    tokens = torch.arange(24)[None] % model.config.vocab_size
    trained = model.config._attn_implementation
    try:
        with torch.no_grad():
            expected = model(input_ids=tokens, use_cache=False).logits
            model.set_attn_implementation(ATTENTION_NAME)
            got = model(input_ids=tokens, use_cache=False).logits
    except Exception as e:  # noqa: BLE001 - any failure means the patch does not fit this architecture
        return f"its attention does not take the patch ({type(e).__name__}: {first_line(e)})"
    finally:
        model.set_attn_implementation(trained)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        return "its rotary embedding is not the whole head rotated by halves (partial rotary, or another layout)"
    return attention
