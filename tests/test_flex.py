"""The FlexAttention path against the SDPA paths of ``causal_attention``.

``causal_attention`` takes flex only on CUDA; here each PE's ``score_mod`` and the cached causal
BlockMask go through eager (uncompiled) flex_attention on CPU, forward only, which torch 2.13 runs.
"""

import warnings

import pytest
import torch
from torch.testing import assert_close

import lenext.attention as attention_module
from lenext.attention import causal_attention, causal_block_mask
from lenext.attention.flex import key_score_mod, window_block_mask
from lenext.pe import FIRE, KERPLE, ALiBi, AttentionShape, NoPE, ShawRelative, T5Bias
from lenext.pe.base import sequential_positions
from lenext.positions import generator, randomized_positions

pytestmark = pytest.mark.skipif(attention_module.flex_attention is None, reason="FlexAttention needs torch >= 2.6")

BATCH, HEADS, HEAD_DIM, LAYERS = 2, 4, 16, 2
SHAPE = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=LAYERS, train_len=16)
PES = {
    "alibi": lambda: ALiBi(SHAPE),
    "t5": lambda: T5Bias(SHAPE),
    "t5_per_layer": lambda: T5Bias(SHAPE, num_buckets=16, max_distance=40, per_layer=True),
    "shaw": lambda: ShawRelative(SHAPE, k=3),
    "kerple": lambda: KERPLE(SHAPE),
    "kerple_power": lambda: KERPLE(SHAPE, kernel="power"),
}


def eager_flex(q, k, v, score_mod, window=None):
    length = q.size(2)
    mask = causal_block_mask(length, q.device) if window is None else window_block_mask(length, window, q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": intended, this is the reference run
        try:
            return attention_module.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
        except (RuntimeError, NotImplementedError) as error:  # a build whose CPU flex cannot run
            pytest.skip(f"flex_attention fails on CPU here: {error}")


POSITIONS = {
    "sequential": lambda length: sequential_positions(length),
    "randomized": lambda length: randomized_positions(BATCH, length, 3 * length, generator(length)),
    "randomized_shared": lambda length: randomized_positions(1, length, 3 * length, generator(length)),
}


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("length", [64, 200])  # one block; two, the last one partial
@pytest.mark.parametrize("kind", list(PES))
def test_score_mod_matches_causal_attention(kind, length, positions):
    pe, positions = PES[kind](), POSITIONS[positions](length)
    torch.manual_seed(length)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_(std=0.5)  # large enough that a wrong bucket/offset changes the output
        pe.project_()
        q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
        for layer in range(LAYERS):
            got = eager_flex(q, k, v, pe.score_mod(q, positions, layer))
            assert_close(
                got, causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, positions)), atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("positions", ["sequential", "randomized"])
@pytest.mark.parametrize("length", [64, 300])
def test_fire_score_mod_below_its_threshold_matches_causal_attention(length, positions):
    """While every query position is below L_thr FIRE's bias is a function of the distance: flex looks it up."""
    pe, positions = FIRE(SHAPE, init_threshold=4000.0), POSITIONS[positions](length)
    torch.manual_seed(length)
    with torch.no_grad():
        for layer in pe.layers:
            for param in layer.mlp.parameters():
                param.normal_(std=0.5)
        q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
        for layer in range(LAYERS):
            got = eager_flex(q, k, v, pe.score_mod(q, positions, layer))
            assert_close(
                got, causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, positions)), atol=1e-5, rtol=1e-5
            )


def test_fire_has_no_score_mod_once_a_query_reaches_its_threshold():
    """From L_thr on the bias depends on i as well: no lookup by distance; the attention scores it in blocks."""
    pe, q = FIRE(SHAPE, init_threshold=40.0), torch.randn(1, HEADS, 41, HEAD_DIM)
    assert pe.score_mod(q[:, :, :40], sequential_positions(40), 0) is not None
    assert pe.score_mod(q, sequential_positions(41), 0) is None


@pytest.mark.parametrize("length", [64, 300])
@pytest.mark.parametrize("window", [1, 7, 128, 200])
@pytest.mark.parametrize("kind", [None, "alibi", "t5"])
def test_window_block_mask_matches_windowed_causal_attention(kind, window, length):
    """A sliding window through flex's block mask (within a block, across blocks, the last one partial), alone and
    with a bias, against the explicit path's window."""
    pe = PES[kind]() if kind else NoPE(SHAPE)
    positions = sequential_positions(length)
    torch.manual_seed(window)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_(std=0.5)
        q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
        got = eager_flex(q, k, v, pe.score_mod(q, positions, 0), window)
        expected = causal_attention(q, k, v, pe.layer(0).terms(None, q, k, positions), window)
    assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, BATCH])
@pytest.mark.parametrize("length", [64, 300])
def test_key_score_mod_matches_the_key_bias_on_sdpa(length, batch):
    """FoX's key bias (one per sequence, or shared) as a score_mod, against SDPA with it as a mask."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen) for _ in range(3))
    cumulative = (-1 + torch.rand(batch, HEADS, 1, length, generator=gen)).cumsum(-1)
    key = cumulative[..., -1:] - cumulative  # (B or 1, H, 1, L)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=key.expand(-1, -1, length, -1).masked_fill(torch.ones(length, length).triu(1).bool(), -1e9)
    )
    assert_close(eager_flex(q, k, v, key_score_mod(key)), expected, atol=1e-5, rtol=1e-5)


def test_pes_flex_cannot_express_return_no_score_mod():
    """Without a score_mod the attention keeps its SDPA paths: no bias. Shaw's a^V is a value term, which sends the
    attention to its explicit path before it asks for a score_mod."""
    q, positions = torch.randn(1, HEADS, 8, HEAD_DIM), sequential_positions(8)
    assert NoPE(SHAPE).score_mod(q, positions, 0) is None
    assert ShawRelative(SHAPE, k=3, value_term=True).value_term(positions, 0) is not None
    assert ShawRelative(SHAPE, k=3).value_term(positions, 0) is None


@pytest.mark.parametrize("length", [1, 128, 300, 4096])
def test_causal_block_mask_is_causal(length):
    mask = causal_block_mask(length, torch.device("cpu"))
    assert mask.shape[-2:] == (length, length)
    dense = mask.to_dense()[0, 0].bool()  # (blocks, blocks): which blocks are visited at all
    assert torch.equal(dense, torch.ones_like(dense).tril())
    assert causal_block_mask(length, torch.device("cpu")) is mask  # built once per (length, device)
