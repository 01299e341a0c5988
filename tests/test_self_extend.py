"""Self-Extend (Jin et al. 2024; datamllab/LongLM) against its reference formula in float64.

The reference below follows LongLM's ``self_extend_forward`` (self_extend_patch/Llama.py) for a prefill:
neighbour logits at the true positions, group logits with the query at i // G + W - W / G and the key at
j // G, merged by its mask (the causal triangle minus the triangle W rows down), softmax, values. Written
here with interleaved pairs, lenext's RoPE convention.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from lenext.attention import SCORE_BLOCK_ELEMENTS, causal_attention
from lenext.errors import ConfigError, LengthNotSupported
from lenext.pe import AttentionShape, RoPE, XPos
from lenext.pe.base import sequential_positions
from tests.test_pe import widened_keys

HEAD_DIM, HEADS = 16, 2


def shape(train_len: int) -> AttentionShape:
    return AttentionShape(d_model=HEAD_DIM * HEADS, n_heads=HEADS, n_layers=1, train_len=train_len)


def rotated(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x (B, H, L, d) rotated at (fractional) positions (L,), float64, pairs (x[2t], x[2t+1])."""
    inv_freq = base ** -(torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angle = positions.double()[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    even, odd = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def longlm_attention(q, k, v, group: int, window: int) -> torch.Tensor:
    """LongLM's prefill Self-Extend attention at positions 0..L-1, float64."""
    length = q.size(-2)
    positions = torch.arange(length)
    scale = math.sqrt(HEAD_DIM)
    neighbour = rotated(q, positions) @ rotated(k, positions).transpose(-2, -1) / scale
    group_q = rotated(q, positions // group + window - window / group)
    grouped = group_q @ rotated(k, positions // group).transpose(-2, -1) / scale
    neighbours = torch.ones(length, length).tril()
    if length > window:
        neighbours[window:, :-window] -= torch.ones(length - window, length - window).tril()
    weights = torch.where(neighbours.bool(), neighbour, grouped)
    weights = weights.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return weights.softmax(-1) @ v.double()


def self_extend(q, k, v, pe: RoPE, positions=None) -> torch.Tensor:
    positions = sequential_positions(q.size(-2)) if positions is None else positions
    q, k = pe.rotate(q, k, positions)
    return causal_attention(q, k, v, pe.layer(0).terms(None, q, k, positions))


@pytest.mark.parametrize("rows", [None, 5], ids=["one block", "blocks of 5 rows"])
@pytest.mark.parametrize("length, train_len, window, factor", [(64, 16, 4, None), (96, 32, 8, 4.0), (40, 16, 5, 3.0)])
def test_self_extend_matches_longlm_outputs_and_gradients(length, train_len, window, factor, rows, monkeypatch):
    if rows is not None:  # query blocks whose keys are widened past their last row's, as for bf16 products on a CPU
        monkeypatch.setitem(SCORE_BLOCK_ELEMENTS, "cpu", 2 * HEADS * length * rows)
        widened_keys(monkeypatch)
    torch.manual_seed(0)
    pe = RoPE(shape(train_len), scaling="self_extend", factor=factor, neighbor_window=window)
    group = factor or pe.group_size(length)
    assert group > 1  # the grouped branch is exercised
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    got = self_extend(q, k, v, pe)
    expected = longlm_attention(q, k, v, int(group), window)
    assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    direction = torch.randn_like(expected)
    grads = torch.autograd.grad((got * direction).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * direction).sum(), (q, k, v))
    for name, g, e in zip("qkv", grads, expected_grads, strict=True):
        assert_close(g.double(), e.double(), atol=2e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_a_float64_models_self_extend_is_float64():
    """Both rotations and the merged logits of a float64 model are float64 (they were fp32, 1e-7 off)."""
    torch.manual_seed(1)
    pe = RoPE(shape(16), scaling="self_extend", neighbor_window=4)
    q, k, v = (torch.randn(2, HEADS, 64, HEAD_DIM, dtype=torch.float64) for _ in range(3))
    got = self_extend(q, k, v, pe)
    assert got.dtype == torch.float64
    assert_close(got, longlm_attention(q, k, v, pe.group_size(64), 4), atol=1e-12, rtol=1e-12)


def test_self_extend_differs_from_rope_beyond_the_window_only_when_grouping():
    """Within C (G = 1 with factor null) it is RoPE exactly; beyond C it is not."""
    torch.manual_seed(1)
    pe, plain = RoPE(shape(16), scaling="self_extend"), RoPE(shape(16))
    for length, same in ((16, True), (12, True), (64, False)):
        q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM) for _ in range(3))
        got, rope = self_extend(q, k, v, pe), self_extend(q, k, v, plain)
        assert torch.allclose(got, rope, atol=1e-5) == same, length


def test_neighbours_are_by_position_distance_at_drawn_positions():
    """At drawn positions (randomized, PoSE) a key is a neighbour when its *position* is fewer than W back, and
    both rotations use the positions: the same as the reference at those positions."""
    torch.manual_seed(2)
    pe = RoPE(shape(16), scaling="self_extend", factor=4.0, neighbor_window=4)
    positions = torch.tensor([[0, 1, 2, 9, 10, 11, 30, 31, 45, 46, 47, 60]])
    q, k, v = (torch.randn(1, HEADS, positions.size(1), HEAD_DIM) for _ in range(3))
    got = self_extend(q, k, v, pe, positions)
    p = positions[0]
    neighbour = rotated(q, p) @ rotated(k, p).transpose(-2, -1)
    grouped = rotated(q, p // 4 + 4 - 1) @ rotated(k, p // 4).transpose(-2, -1)
    distance = p[:, None] - p[None, :]
    weights = torch.where(distance < 4, neighbour, grouped) / math.sqrt(HEAD_DIM)
    expected = weights.masked_fill(distance < 0, float("-inf")).softmax(-1) @ v.double()
    assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("train_len, window", [(16, 1), (16, 4), (16, 13), (64, 4), (64, 48), (100, 13), (100, 75)])
def test_group_size_is_the_smallest_whose_positions_were_trained(train_len, window):
    """At every length to 32x C, no smaller G keeps the grouped positions within C. The last query's grouped
    position is not monotone in G: at C 16, W 13, L 29, G 6 holds, 7 does not, and G was 8 (found by an audit)."""
    pe = RoPE(shape(train_len), scaling="self_extend", neighbor_window=window)

    def largest_position(length: int, group: int) -> float:  # the last query's grouped position
        return (length - 1) // group + window - window / group

    for length in range(train_len, 32 * train_len + 1):
        group = pe.group_size(length)
        assert largest_position(length, group) <= train_len - 1
        assert all(largest_position(length, smaller) > train_len - 1 for smaller in range(1, group)), length
        assert pe.scaling_factor(length) == group
    assert pe.group_size(train_len) == 1
    if (train_len, window) == (16, 13):
        assert pe.group_size(29) == 6


def test_neighbor_window_defaults_to_a_quarter_of_the_original_context_and_is_checked():
    assert RoPE(shape(64), scaling="self_extend").window == 16
    assert RoPE(shape(64), scaling="self_extend", original_len=32).window == 8
    stage = RoPE(AttentionShape(HEAD_DIM * HEADS, HEADS, 1, train_len=256), original_len=64)  # fine-tuned at 256
    assert stage.window == 16
    with stage.variant("self_extend"):  # zero-shot from the span it trained, as every variant
        assert stage.original_len == 256 and stage.window == 64
    with pytest.raises(ConfigError, match=r"pe\.neighbor_window=63 is invalid: .* below C - 1"):
        RoPE(shape(64), scaling="self_extend", neighbor_window=63)
    tiny = RoPE(shape(2))  # too short a context for any window: refused as a variant, not when built
    with tiny.variant("self_extend"), pytest.raises(LengthNotSupported, match="original context of at least 3"):
        tiny.scaling_factor(8)


def test_self_extend_is_a_variant_of_rope_and_not_of_xpos():
    asked = ["none", "linear", "self_extend"]
    assert RoPE(shape(16)).variants(asked, 64) == asked
    assert XPos(shape(16)).variants(asked, 64) == ["none", "linear"]
    pe = RoPE(shape(16))
    with pe.variant("self_extend"):
        assert pe.scaling == "self_extend" and pe.scaling_factor(64) == pe.group_size(64) > 1
    assert pe.scaling == "none" and pe.logits(torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16), None) is None
