"""PoPE against its formula in float64 (Gopalakrishnan et al. 2025: the logit as a sum of cosines of phase
differences, written out here) and against x-transformers' ``PolarEmbedding`` / ``apply_polar_pos_emb`` (fp32, as
it computes): outputs and gradients, at drawn positions, on the fused kernel and in explicit query blocks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from lenext.attention import causal_attention
from lenext.model import Decoder
from lenext.pe import FoX, PoPE
from lenext.pe.base import AttentionShape, sequential_positions
from lenext.positions import generator, randomized_positions
from tests.conftest import hidden_keys

BATCH, HEADS, HEAD_DIM = 2, 4, 8
SHAPE = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=2, train_len=16)


def pope(dtype=torch.float64, base=100.0) -> PoPE:
    """A small base, so that positions up to ~1000 turn every frequency more than once."""
    pe = PoPE(SHAPE, base=base).to(dtype)
    with torch.no_grad():  # delta starts at 0: drawn inside its range, so a wrong sign or offset shows
        pe.phase_bias.uniform_(-2 * math.pi, 0, generator=torch.Generator().manual_seed(5))
    return pe


def formula(q, k, v, pe: PoPE, positions, window=None):
    """softmax_j(sum_c softplus(q_ic) softplus(k_jc) cos((p_j - p_i) theta_c + delta_hc) / sqrt(d)) v_j."""
    theta = pe.base ** -(torch.arange(HEAD_DIM, dtype=torch.float64) / HEAD_DIM)
    p = positions.to(torch.float64)  # (B or 1, L)
    phase = (p[:, None, None, :, None] - p[:, None, :, None, None]) * theta + pe.phase_bias[None, :, None]
    products = F.softplus(q)[..., :, None, :] * F.softplus(k)[..., None, :, :]  # (B, H, L, L, d)
    logits = (products * phase.cos()).sum(-1) / math.sqrt(HEAD_DIM)
    length = q.size(-2)
    return logits.masked_fill(hidden_keys(length, window), float("-inf")).softmax(-1) @ v


def inputs(length, dtype):
    gen = torch.Generator().manual_seed(length)
    return [torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True) for _ in "qkv"]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("drawn", [False, True])
@pytest.mark.parametrize("length", [9, 40])
def test_pope_matches_its_formula_in_float64(length, drawn, window):
    """On the fused kernel (no window) and in explicit query blocks (a window), at 0..L-1 and at positions drawn
    up to 1000: outputs and the gradients of q, k, v and delta to 1e-10."""
    pe = pope()
    positions = randomized_positions(BATCH, length, 1000, generator(1)) if drawn else sequential_positions(length)
    q, k, v = inputs(length, torch.float64)
    rotated_q, rotated_k = pe.rotate(q, k, positions)
    assert rotated_q.shape == (BATCH, HEADS, length, 2 * HEAD_DIM)
    got = causal_attention(rotated_q, rotated_k, v, window=window)
    expected = formula(q, k, v, pe, positions, window)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v, pe.phase_bias])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [q, k, v, pe.phase_bias])
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e, atol=1e-10, rtol=1e-9)


def test_pope_in_fp32_matches_x_transformers():
    """x-transformers' PolarEmbedding (d_head frequencies, the key's phase plus its clamped learned bias) and
    apply_polar_pos_emb, scored at 1/sqrt(d_head) as its Attend does; outputs and gradients to 1e-5."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    pe = pope(torch.float32, base=10000.0)
    with torch.no_grad():
        pe.phase_bias[0, 0, :2] = torch.tensor([-9.0, 1.0])  # outside [-2 pi, 0]: both clamp it
    reference = xt.PolarEmbedding(HEAD_DIM, HEADS)
    with torch.no_grad():
        reference.learned_bias.copy_(pe.phase_bias)
    length = 50
    q, k, v = inputs(length, torch.float32)
    got = causal_attention(*pe.rotate(q, k, sequential_positions(length)), v)
    freqs, bias = reference(torch.arange(length))
    scores = xt.apply_polar_pos_emb(q, freqs) @ xt.apply_polar_pos_emb(k, freqs + bias).transpose(-1, -2)
    scores = scores * HEAD_DIM**-0.5
    expected = scores.masked_fill(hidden_keys(length), float("-inf")).softmax(-1) @ v
    assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(0))
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v, pe.phase_bias])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [q, k, v, reference.learned_bias])
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_pope_is_relative_and_composes_with_a_key_bias():
    """Positions shifted by a constant give the same output; with FoX's gate (a key bias with a gradient: extra q/k
    channels on the fused kernel) it equals the explicit query blocks, which take the gate as a mask."""
    pe = pope(torch.float32)
    q, k, v = (t.detach() for t in inputs(30, torch.float32))
    positions = sequential_positions(30)
    out = causal_attention(*pe.rotate(q, k, positions), v)
    assert_close(causal_attention(*pe.rotate(q, k, positions + 5000), v), out, atol=1e-5, rtol=1e-5)
    gate = FoX(SHAPE).layer(0)
    x = torch.randn(BATCH, 30, SHAPE.d_model, generator=torch.Generator().manual_seed(2))
    rotated = pe.rotate(q, k, positions)
    terms = gate.terms(x, *rotated, positions)
    fused = causal_attention(*rotated, v, terms)  # the gate needs a gradient: the channels path
    explicit = causal_attention(*rotated, v, terms, window=30)  # a window as long as the input: explicit blocks
    assert fused.requires_grad
    assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_the_phase_offsets_are_one_table_shared_by_the_layers():
    model = Decoder(32, 16, PoPE, d_model=HEADS * HEAD_DIM, n_layers=3, n_heads=HEADS)
    assert [name for name, _ in model.named_parameters() if "phase_bias" in name] == ["pe.phase_bias"]
    assert model.pe.hyperparameters() == {"base": 10000.0}
