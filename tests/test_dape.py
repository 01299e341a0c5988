"""DAPE against its formula in float64 (Zheng et al. 2024; as chuanyang-Zheng/DAPE's ``ParallelKerpleLog_DAPE``,
written out here, not imported): z = s + b + W2 leaky_relu(W1 [s; b] + c1) + c2 per pair over the heads, s the
scaled logits, b KERPLE's log kernel. Outputs and gradients, in query blocks of every size, with a window."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import lenext.attention as attention_module
import lenext.pe.dape as dape_module
from lenext.attention import AttentionSettings, causal_attention
from lenext.errors import ConfigError
from lenext.model import Decoder
from lenext.pe import DAPE, FIRE, KERPLE, ALiBi, AttentionShape, Compose, CoPE, FoX, RoPE
from lenext.pe.base import sequential_positions
from lenext.positions import generator, randomized_positions
from tests.conftest import hidden_keys
from tests.test_pe import widened_keys

BATCH, HEADS, HEAD_DIM, WIDTH = 2, 4, 8, 16
SHAPE = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=2, train_len=16)


def dape_layer(dtype=torch.float64):
    """(the PE, its layer 1), KERPLE's r1 and r2 drawn anew by the seed."""
    torch.manual_seed(3)
    pe = DAPE(SHAPE, KERPLE, mlp_width=WIDTH).to(dtype)
    return pe, pe.layer(1).to(dtype)


def reference(q, k, v, pe: DAPE, layer, window=None):
    """Full (L, L) attention of the formula: the kernel -r1 log(1 + r2 (i - j)) on j <= i (0 above, as the
    reference's tril), the MLP over the head axis of [s; b], the causal (and window) mask, softmax, times v."""
    wide = torch.promote_types(pe.base.r1.dtype, torch.float32)  # KERPLE's kernel: fp32, float64 in a float64 model
    r1, r2 = (r[1][:, None, None].to(wide) for r in (pe.base.r1, pe.base.r2))  # layer 1's (H, 1, 1)
    length = q.size(-2)
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).clamp(min=0).to(wide)
    # log1p: log(1 + x) rounds 1 + x first in fp32
    bias = (-r1 * torch.log1p(r2 * distance)).to(q.dtype).expand(q.size(0), -1, -1, -1)  # (B, H, L, L)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
    first, second = layer.mlp[0], layer.mlp[2]
    features = torch.cat([scores, bias], dim=1).movedim(1, -1)  # (B, L, L, 2H)
    hidden = F.leaky_relu(features @ first.weight.t() + first.bias, negative_slope=0.01)
    logits = scores + bias + (hidden @ second.weight.t() + second.bias).movedim(-1, 1)
    return logits.masked_fill(hidden_keys(length, window), float("-inf")).softmax(-1) @ v


def inputs(length, dtype):
    gen = torch.Generator().manual_seed(length)
    return [torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True) for _ in "qkv"]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("rows", [None, 1, 7])
@pytest.mark.parametrize("length", [9, 60])
def test_dape_matches_its_formula_in_float64(length, rows, window, monkeypatch):
    """The explicit path in one block, single rows and blocks of 7 (and the MLP in chunks of 3 rows) with their keys
    widened as for bf16 products on a CPU: outputs and gradients of q, k, v, both MLP layers and KERPLE's r1, r2 to
    1e-10."""
    if rows is not None:
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * rows)
    if rows == 7:
        widened_keys(monkeypatch)
        monkeypatch.setitem(dape_module.HIDDEN_ELEMENTS, "cpu", BATCH * length * WIDTH * 3)
    pe, layer = dape_layer()
    q, k, v = inputs(length, torch.float64)
    got = causal_attention(q, k, v, layer.terms(None, q, k, sequential_positions(length)), window)
    expected = reference(q, k, v, pe, layer, window)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    wrt = [q, k, v, *layer.mlp.parameters(), pe.base.r1, pe.base.r2]
    got_grads = torch.autograd.grad((got * weight).sum(), wrt)
    expected_grads = torch.autograd.grad((expected * weight).sum(), wrt)
    for index, (g, e) in enumerate(zip(got_grads, expected_grads, strict=True)):
        assert e.abs().sum() > 0
        fp32 = index >= len(wrt) - 2  # r1, r2: their gradients pass through the fp32 bias
        assert_close(g, e, atol=1e-6 if fp32 else 1e-10, rtol=1e-5 if fp32 else 1e-9)


def test_dape_in_fp32_matches_its_formula():
    pe, layer = dape_layer(torch.float32)
    q, k, v = inputs(80, torch.float32)
    got = causal_attention(q, k, v, layer.terms(None, q, k, sequential_positions(80)))
    expected = reference(q.double(), k.double(), v.double(), pe.double(), layer.double())
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_dape_with_a_silent_mlp_is_its_base_and_keeps_relative_positions():
    """The MLP's output layer at 0 leaves KERPLE exactly; at positions shifted by a constant the output is the same
    (every input of the MLP is a function of q, k and i - j)."""
    pe, layer = dape_layer(torch.float32)
    q, k, v = (t.detach() for t in inputs(40, torch.float32))
    positions = sequential_positions(40)
    shifted = causal_attention(q, k, v, layer.terms(None, q, k, positions + 300))
    assert_close(shifted, causal_attention(q, k, v, layer.terms(None, q, k, positions)))
    drawn = randomized_positions(BATCH, 40, 400, generator(2))
    assert not torch.allclose(causal_attention(q, k, v, layer.terms(None, q, k, drawn)), shifted)
    with torch.no_grad():
        layer.mlp[2].weight.zero_()
        layer.mlp[2].bias.zero_()
    kerple = pe.base.layer(1)
    assert_close(
        causal_attention(q, k, v, layer.terms(None, q, k, drawn)),
        causal_attention(q, k, v, kerple.terms(None, q, k, drawn)),
    )


def test_each_layer_owns_its_mlp_and_the_base_keeps_its_settings():
    model = Decoder(32, 16, partial(DAPE, base=partial(KERPLE, kernel="power")), d_model=32, n_layers=3, n_heads=4)
    mlps = [block.attn.pe.mlp for block in model.blocks]
    assert len({id(m) for m in mlps}) == 3 and all(m[0].in_features == 8 and m[0].out_features == 32 for m in mlps)
    assert model.pe.hyperparameters() == {
        "base": {"_target_": "lenext.pe.kerple.KERPLE", "_partial_": True, "kernel": "power", "per_layer": True},
        "mlp_width": 32,
    }
    assert DAPE(SHAPE, FIRE).describe()["base"]["name"] == "FIRE"


def test_a_base_without_a_pair_bias_is_refused_at_build_time():
    with pytest.raises(ConfigError, match=r"pe.base=RoPE is invalid for DAPE: .*kerple, fire"):
        DAPE(SHAPE, RoPE)


@pytest.mark.parametrize(
    "pes, scale, message",
    [
        ({"dape": partial(DAPE, base=KERPLE), "alibi": ALiBi}, "none", r"pe: a term computed from the logits' values"),
        ({"cope": CoPE, "fox": FoX}, "none", r"pe: a term computed from the logits' values"),
        ({"dape": partial(DAPE, base=KERPLE)}, "ssmax", r"attention.scale=ssmax is invalid with this PE: DAPE's MLP"),
    ],
)
def test_what_would_change_a_logit_reading_term_is_refused_at_build_time(pes, scale, message):
    """A key bias is anchored per query block (a per-row constant softmax ignores), so CoPE's gates or DAPE's MLP
    would depend on the block size; a row scale hides the logit DAPE reads. With a pair bias both are served."""
    with pytest.raises(ConfigError, match=message):
        Decoder(32, 16, partial(Compose, pes=pes), attention=AttentionSettings(scale=scale), d_model=32, n_heads=4)
    Decoder(32, 16, partial(Compose, pes={"dape": partial(DAPE, base=KERPLE), "fire": FIRE}), d_model=32, n_heads=4)
