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
from lenext.pe import FIRE, KERPLE, ALiBi, AttentionShape, NoPE, ShawRelative, T5Bias

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


def eager_flex(q, k, v, score_mod):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": intended, this is the reference run
        try:
            return attention_module.flex_attention(
                q, k, v, score_mod=score_mod, block_mask=causal_block_mask(q.size(2), q.device)
            )
        except (RuntimeError, NotImplementedError) as error:  # a build whose CPU flex cannot run
            pytest.skip(f"flex_attention fails on CPU here: {error}")


@pytest.mark.parametrize("length", [64, 200])  # one block; two, the last one partial
@pytest.mark.parametrize("kind", list(PES))
def test_score_mod_matches_causal_attention(kind, length):
    pe = PES[kind]()
    torch.manual_seed(length)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_(std=0.5)  # large enough that a wrong bucket/offset changes the output
        pe.project_()
        q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
        for layer in range(LAYERS):
            got = eager_flex(q, k, v, pe.score_mod(q, layer))
            assert_close(got, causal_attention(q, k, v, pe, layer), atol=1e-5, rtol=1e-5)


def test_pes_flex_cannot_express_return_no_score_mod():
    """Without a score_mod the attention keeps its SDPA paths: no bias, Shaw's a^V, FIRE's MLP."""
    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    assert NoPE(SHAPE).score_mod(q, 0) is None
    assert FIRE(SHAPE).score_mod(q, 0) is None
    assert ShawRelative(SHAPE, k=3, value_term=True).score_mod(q, 0) is None


@pytest.mark.parametrize("length", [1, 128, 300, 4096])
def test_causal_block_mask_is_causal(length):
    mask = causal_block_mask(length, torch.device("cpu"))
    assert mask.shape[-2:] == (length, length)
    dense = mask.to_dense()[0, 0].bool()  # (blocks, blocks): which blocks are visited at all
    assert torch.equal(dense, torch.ones_like(dense).tril())
    assert causal_block_mask(length, torch.device("cpu")) is mask  # built once per (length, device)
