"""CoPE (contextual position encoding) against x-transformers' ``CoPE`` (the paper's Appendix B code), which is
installed with the dev extra: outputs and gradients, in query blocks of every size, with and without a window."""

import math

import pytest
import torch
from torch.testing import assert_close

import lenext.attention as attention_module
from lenext.attention import causal_attention
from lenext.model import Decoder
from lenext.pe import AttentionShape, CoPE
from lenext.pe.base import sequential_positions
from lenext.positions import generator, randomized_positions
from tests.conftest import hidden_keys
from tests.test_pe import widened_keys

BATCH, HEADS, HEAD_DIM = 2, 4, 8
SHAPE = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=2, train_len=16)


def cope_layer(npos_max=None, dtype=torch.float64):
    torch.manual_seed(3)
    layer = CoPE(SHAPE, npos_max).layer(1).to(dtype)
    with torch.no_grad():
        layer.embedding.normal_()  # it starts at 0 (no position signal): drawn, so a wrong position shows
    return layer


def x_transformers_reference(q, k, v, layer, window=None):
    """Full attention as x-transformers' Attend runs it with ``use_cope``: scaled logits, the causal mask as
    -finfo.max, then ``sim + cope(q, sim)``, softmax, times v; in q's dtype."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    cope = xt.CoPE(HEAD_DIM, HEADS, layer.npos_max).to(q.dtype)
    with torch.no_grad():
        cope.pos_emb.copy_(layer.embedding)
    length = q.size(-2)
    sim = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    sim = sim.masked_fill(hidden_keys(length, window), -torch.finfo(sim.dtype).max)
    sim = sim + cope(q, sim)
    return sim.softmax(-1) @ v, cope.pos_emb


def inputs(length, dtype):
    gen = torch.Generator().manual_seed(length)
    return [torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True) for _ in "qkv"]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("rows", [None, 1, 7])
@pytest.mark.parametrize("length, npos_max", [(9, None), (60, None), (60, 40)])
def test_cope_matches_x_transformers_in_float64(length, npos_max, rows, window, monkeypatch):
    """Positions below and at the cap (npos_max 16: rows of 60 keys count past it), the explicit path in one
    block, single rows and blocks of 7 with their keys widened as for bf16 products on a CPU: outputs and gradients
    of q, k, v and the position embeddings to 1e-10."""
    if rows is not None:
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * rows)
    if rows == 7:
        widened_keys(monkeypatch)
    layer = cope_layer(npos_max)
    q, k, v = inputs(length, torch.float64)
    got = causal_attention(q, k, v, layer.terms(None, q, k, sequential_positions(length)), window)
    expected, reference_embedding = x_transformers_reference(q, k, v, layer, window)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v, layer.embedding])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [q, k, v, reference_embedding])
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e, atol=1e-10, rtol=1e-9)


def test_cope_in_fp32_matches_x_transformers():
    layer = cope_layer(dtype=torch.float32)
    q, k, v = inputs(80, torch.float32)
    got = causal_attention(q, k, v, layer.terms(None, q, k, sequential_positions(80)))
    expected, _ = x_transformers_reference(q.double(), k.double(), v.double(), layer.double())
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_cope_counts_content_not_positions():
    """Its positions are counted by the gates: at drawn positions the output is the one at 0..L-1; with the
    embeddings at 0, as it starts, it is NoPE."""
    layer = cope_layer(dtype=torch.float32)
    q, k, v = (t.detach() for t in inputs(40, torch.float32))
    drawn = randomized_positions(BATCH, 40, 400, generator(2))
    at_drawn = causal_attention(q, k, v, layer.terms(None, q, k, drawn))
    assert_close(at_drawn, causal_attention(q, k, v, layer.terms(None, q, k, sequential_positions(40))))
    with torch.no_grad():
        layer.embedding.zero_()
    nope = causal_attention(q, k, v)
    assert_close(causal_attention(q, k, v, layer.terms(None, q, k, drawn)), nope, atol=1e-6, rtol=1e-6)


def test_cope_embeddings_are_each_layers_and_npos_max_resolves_to_l_train():
    model = Decoder(32, 16, CoPE, d_model=HEADS * HEAD_DIM, n_layers=3, n_heads=HEADS)
    tables = [block.attn.pe.embedding for block in model.blocks]
    assert len({id(t) for t in tables}) == 3 and all(t.shape == (16, HEAD_DIM) for t in tables)
    assert model.pe.hyperparameters() == {"npos_max": 16}
