"""FoX (the Forgetting Transformer) against flash-linear-attention's naive reference, on every attention path.

The oracle is fla's ``naive_forgetting_attn`` (fla/ops/forgetting_attn/naive.py, commit bc3b101), copied
verbatim below (fla needs Triton, which `make test` does not install); the inputs go to it in float64.
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch.testing import assert_close

import lenext.attention as attention_module
import lenext.attention.band as band_module
from lenext.attention import causal_attention, key_bias_channels_attention, recording
from lenext.model import Decoder
from lenext.pe import AttentionShape, Compose, FoX, RoPE
from lenext.pe.base import sequential_positions
from lenext.positions import generator, randomized_positions


def naive_forgetting_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    window_size: int | None = None,
):
    """
    Reference PyTorch implementation of forgetting attention.

    Args:
        q: [B, T, HQ, D]
        k: [B, T, H, D]
        v: [B, T, H, D]
        g: [B, T, HQ]
        scale: float, optional. If None, defaults to 1 / sqrt(D)
        window_size: int, optional. If provided, each query only attends to keys
            in [i - window_size + 1, i]. If None, full causal attention is used.

    Returns:
        output: [B, T, HQ, D]
    """
    _, T, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H

    if scale is None:
        scale = D**-0.5

    gc = g.float().cumsum(1)
    mask = torch.tril(torch.ones((T, T), dtype=torch.bool, device=q.device))
    if window_size is not None:
        mask = mask & torch.triu(torch.ones((T, T), dtype=torch.bool, device=q.device), diagonal=-(window_size - 1))

    ref = torch.einsum("bqhd,bkhd->bhqk", q.float() * scale, repeat(k, "b t h d -> b t (h g) d", g=G).float())
    ref = ref + rearrange(gc, "b t h -> b h t 1") - rearrange(gc, "b t h -> b h 1 t")
    ref = ref.masked_fill(~mask.unsqueeze(0).unsqueeze(0), -float("inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", F.softmax(ref, dim=-1), repeat(v, "b t h d -> b t (h g) d", g=G).float())

    return ref


def fla_reference(q, k, v, log_forget, window=None) -> torch.Tensor:
    """fla's naive forgetting attention on lenext's (B, H, L, d) layout, in float64 throughout (its ``.float()``
    casts made ``.double()``)."""
    layout = [t.double().transpose(1, 2) for t in (q, k, v)]  # (B, L, H, d)
    with _float_is_double():
        return naive_forgetting_attn(*layout, log_forget.double(), window_size=window).transpose(1, 2)


class _float_is_double:
    """``Tensor.float`` as ``Tensor.double`` inside the block, so the oracle's casts keep float64."""

    def __enter__(self):
        self.original = torch.Tensor.float
        torch.Tensor.float = torch.Tensor.double

    def __exit__(self, *exc):
        torch.Tensor.float = self.original


BATCH, HEADS, HEAD_DIM, WIDTH = 2, 4, 8, 32
SHAPE = AttentionShape(d_model=WIDTH, n_heads=HEADS, n_layers=2, train_len=16)


def fox_layer(strength: float = 0.5):
    torch.manual_seed(7)
    layer = FoX(SHAPE).layer(1)
    with torch.no_grad():
        layer.gate.weight.normal_(std=strength)
        layer.gate.bias.normal_(mean=1.0, std=strength)  # gates from near 0 to near 1
    return layer


def inputs(length: int, dtype=torch.float32, requires_grad=True):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(BATCH, length, WIDTH, generator=gen, dtype=dtype)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=dtype) for _ in range(3))
    return [t.requires_grad_(requires_grad) for t in (x, q, k, v)]


# fused: SDPA's causal kernel (the key bias as a channel of q and k with a gradient, else a mask); cuda_channels: the
# channels padded with zeros to a head dim of a multiple of 8, as CUDA's kernels need; explicit: query blocks (with
# a gradient what attention recording runs, without one each block's mask on SDPA)
PATHS = ("fused", "cuda_channels", "explicit", "explicit_small_blocks")


def use_path(path: str, monkeypatch, length: int, grad: bool = True) -> contextlib.AbstractContextManager:
    if path == "cuda_channels":
        monkeypatch.setattr(attention_module, "HEAD_DIM_MULTIPLE", {"cpu": 8})
    if path == "explicit_small_blocks":
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * max(2, length // 5))
        monkeypatch.setattr(band_module, "BAND_ROWS", 3)
    if path.startswith("explicit") and not grad:
        monkeypatch.setattr(attention_module, "fused_mask_with_causal", lambda device_type: False)
    return recording(lambda *weights: None) if path.startswith("explicit") and grad else contextlib.nullcontext()


def run_fox(path, length, grad, window, dtype, monkeypatch):
    """lenext's output and gradients (of x, q, k, v, the gate's weight and bias) and fla's reference's (float64)."""
    layer = fox_layer().to(dtype)
    x, q, k, v = inputs(length, dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad), use_path(path, monkeypatch, length, grad):
        got = causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(length)), window)
    log_forget = F.logsigmoid(F.linear(x.double(), layer.gate.weight.double(), layer.gate.bias.double()))
    expected = fla_reference(q, k, v, log_forget, window)
    if not grad:
        return got, expected, [], []
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    tensors = [x, q, k, v, layer.gate.weight, layer.gate.bias]
    got_grads = torch.autograd.grad((got * weight).sum(), tensors)
    expected_grads = torch.autograd.grad((expected * weight.double()).sum(), tensors)
    return got, expected, got_grads, expected_grads


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("length", [7, 64, 300])
@pytest.mark.parametrize("path", PATHS)
def test_fox_matches_fla_naive_reference_in_float64(path, length, grad, window, monkeypatch):
    """The formula, exactly: in float64 every path (with a gradient the fused one carries the key bias as channels of
    q and k, also padded as on CUDA; without, as an SDPA mask; the explicit blocks) gives fla's output and gradients
    to 1e-10."""
    got, expected, got_grads, expected_grads = run_fox(path, length, grad, window, torch.float64, monkeypatch)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("length", [7, 64, 300])
@pytest.mark.parametrize("path", PATHS)
def test_fox_in_fp32_matches_fla_naive_reference(path, length, window, monkeypatch):
    """In fp32, as models train on CPU: outputs to fp32's precision of the key bias (|F| reaches a few hundred at
    300 tokens here, held to ~3e-5, as ALiBi's anchored key bias in tests/test_pe.py), gradients to 1e-3 of their
    scale (the gate's come through a reverse cumulative sum over the tokens of the key bias's)."""
    got, expected, got_grads, expected_grads = run_fox(path, length, True, window, torch.float32, monkeypatch)
    assert_close(got.double(), expected, atol=1e-4 if length > 100 else 1e-5, rtol=1e-5)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g.double(), e.double(), atol=1e-3 * e.abs().max().item(), rtol=0)


@pytest.mark.parametrize("length", [64, 300])
def test_fox_key_bias_channels_keep_fp32_precision_in_bf16(length):
    """With bf16 q, k, v the key bias and its gradient are scored in fp32: strong forgetting (log f near -5, F of
    -1500 at 300 tokens) to fp32's precision, where a bf16 channel (8 bits) would be off by whole units, and the
    bias's gradient to its upstream gradient's bf16 rounding (0.5% of its scale)."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).bfloat16() for _ in range(3))
    cumulative = (-5 + torch.rand(1, HEADS, 1, length, generator=gen, dtype=torch.float64)).cumsum(-1)
    key = (cumulative[..., -1:] - cumulative).float().requires_grad_()
    got = key_bias_channels_attention(q, k, v, key)
    assert got.dtype == torch.bfloat16
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(HEAD_DIM) + key.double()
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v.double()
    assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)  # the output rounded to bf16
    weight = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    grad = torch.autograd.grad((got.double() * weight).sum(), key)[0]
    expected_grad = torch.autograd.grad((expected * weight).sum(), key)[0]
    assert_close(grad.double(), expected_grad.double(), atol=5e-3 * expected_grad.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_fox_gate_gradients_under_bf16_autocast(path, monkeypatch):
    """A FoX model under bf16 autocast (as bf16-mixed trains): every gradient, the gates' included, within 5% of its
    tensor's scale of float64's. The gate bias's sums each key's bias gradient over the tokens, where they nearly
    cancel: from a bf16 kernel it was 45-70% off."""
    torch.manual_seed(0)
    net = Decoder(vocab_size=97, d_model=WIDTH, n_layers=2, n_heads=HEADS, train_len=64, pe=FoX)
    with torch.no_grad():
        for block in net.blocks:
            block.attn.pe.gate.weight.normal_(std=0.5)
            block.attn.pe.gate.bias.normal_(mean=1.0, std=0.5)
    tokens = torch.randint(0, 97, (BATCH, 129), generator=torch.Generator().manual_seed(1))

    channels = []  # the calls of the fused path's kernel
    monkeypatch.setattr(
        attention_module,
        "key_bias_channels_attention",
        lambda *args, original=key_bias_channels_attention: channels.append(1) or original(*args),
    )

    def gradients(dtype, bf16):
        model = copy.deepcopy(net).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), use_path(path, monkeypatch, 128):
            model.token_nll(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        return {name: p.grad.double() for name, p in model.named_parameters()}

    expected, got = gradients(torch.float64, False), gradients(torch.float32, True)
    assert len(channels) == (4 if path == "fused" else 0)  # 2 layers, 2 runs: the path named is the path taken
    for name, grad in expected.items():
        assert_close(got[name], grad, atol=0.05 * grad.abs().max().item(), rtol=0, msg=name)


def test_fox_ignores_positions():
    """The gate counts tokens, not positions: at drawn positions the output is the one at 0..L-1."""
    layer = fox_layer()
    x, q, k, v = inputs(40, requires_grad=False)
    drawn = randomized_positions(BATCH, 40, 400, generator(3))
    at_drawn = causal_attention(q, k, v, layer.terms(x, q, k, drawn))
    assert_close(at_drawn, causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(40))))


def test_fox_with_rope_is_rope_then_the_gate():
    """``Compose`` of RoPE and FoX: q, k rotated by RoPE, the gate's bias on top, as the reference given the
    rotated q, k."""
    torch.manual_seed(0)
    pe = Compose(SHAPE, {"rope": RoPE, "fox": FoX})
    layer = pe.layer(0)
    with torch.no_grad():
        layer.parts[1].gate.bias.fill_(2.0)
    x, q, k, v = inputs(50)
    positions = sequential_positions(50)
    rotated = layer.rotate(q, k, positions)
    got = causal_attention(*rotated, v, layer.terms(x, *rotated, positions))
    expected_q, expected_k = RoPE(SHAPE).layer(0).rotate(q, k, positions)
    log_forget = F.logsigmoid(layer.parts[1].gate(x).double())
    assert_close(got.double(), fla_reference(expected_q, expected_k, v, log_forget), atol=1e-5, rtol=1e-5)


def test_fox_gates_are_parameters_of_each_layer():
    """Every layer's gate is its block's own (fla's f_proj per layer, bias 0), none shared, none on the PE."""
    model = Decoder(32, 16, FoX, d_model=WIDTH, n_layers=3, n_heads=HEADS)
    gates = [block.attn.pe.gate for block in model.blocks]
    assert len({id(g.weight) for g in gates}) == 3 and not list(model.pe.parameters())
    assert all(torch.equal(g.bias, torch.zeros(HEADS)) for g in gates)
    assert {name for name in model.state_dict() if "gate" in name} == {
        f"blocks.{i}.attn.pe.gate.{p}" for i in range(3) for p in ("weight", "bias")
    }
