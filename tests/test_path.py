"""PaTH attention against flash-linear-attention's naive reference (fla-core 0.6.0,
fla/ops/path_attn/naive.py, MIT, Songlin Yang, Yu Zhang, Zhiyuan Li), copied below with its float32 casts made
float64 (fla needs Triton, which `make test` does not install): outputs and gradients, through lenext's attention
paths; the layer's w and beta as fla's ``PaTHAttention`` makes them."""

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch.testing import assert_close

import lenext.attention as attention_module
import lenext.pe.path as path_module
from lenext.attention import causal_attention
from lenext.model import Decoder
from lenext.pe import AttentionShape, Compose, FoX, PaTH
from lenext.pe.base import sequential_positions
from lenext.pe.path import PathLogits
from lenext.positions import generator, randomized_positions


def naive_path_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
):
    """
    Reference PyTorch implementation of path attention.

    Args:
        q: [B, T, HQ, D]
        k: [B, T, H, D]
        v: [B, T, H, D]
        w: [B, T, H, D]
        beta: [B, T, H]
        g: [B, T, HQ]
        scale: float
        chunk_size: int, default 64

    Returns:
        output: [B, T, HQ, D]
    """
    original_dtype = q.dtype
    HQ = q.shape[2]
    H = k.shape[2]
    BT = chunk_size

    q, k, v, w, beta, g = map(lambda x: x.to(torch.float64).transpose(1, 2), [q, k, v, w, beta, g])
    g_cumsum = g.cumsum(-1)

    q = q.unsqueeze(2).expand(-1, -1, HQ // HQ, -1, -1).flatten(1, 2)
    k = k.unsqueeze(2).expand(-1, -1, HQ // H, -1, -1).flatten(1, 2)
    v = v.unsqueeze(2).expand(-1, -1, HQ // H, -1, -1).flatten(1, 2)
    w = w.unsqueeze(2).expand(-1, -1, HQ // H, -1, -1).flatten(1, 2)
    beta = beta.unsqueeze(2).expand(-1, -1, HQ // H, -1).flatten(1, 2)

    b, h, l, _ = q.shape  # noqa: E741
    if l % BT != 0:
        padding_size = BT - l % BT
        q, k, w = map(lambda x: F.pad(x, (0, 0, 0, padding_size)), [q, k, w])
        beta = F.pad(beta, (0, padding_size))

    seq_len = q.shape[2]
    w_beta = w * beta[..., None]
    q, k, w, w_beta = map(lambda x: rearrange(x, "b h (n c) d -> b h n c d", c=BT), [q, k, w, w_beta])

    mask = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=0)
    T_mat = -(w_beta @ w.transpose(-1, -2)).masked_fill(mask, 0)

    for i in range(1, BT):
        T_mat[..., i, :i] = T_mat[..., i, :i].clone() + (
            T_mat[..., i, :, None].clone() * T_mat[..., :, :i].clone()
        ).sum(-2)

    T_mat = T_mat + torch.eye(BT, dtype=q.dtype, device=q.device)
    Twbk = T_mat @ (w_beta @ k.transpose(-1, -2)).masked_fill(mask, 0)
    qw = (q @ w.transpose(-1, -2)).tril()
    Twb = T_mat @ w_beta
    A_local = (q @ k.transpose(-1, -2)).tril() - qw @ Twbk
    q = q - qw @ Twb
    k = k - Twbk.transpose(-1, -2) @ w
    H_mat = w.transpose(-1, -2) @ Twb

    A = torch.zeros(b, h, seq_len, seq_len, device=q.device, dtype=torch.float64)
    q, k, w, w_beta = map(lambda x: rearrange(x, "b h n c d -> b h (n c) d"), [q, k, w, w_beta])

    for i in range(0, seq_len, BT):
        q_i = q[:, :, i : i + BT].clone()
        for j in range(i - BT, -BT, -BT):
            k_j = k[:, :, j : j + BT]
            A_ij = q_i @ k_j.transpose(-1, -2)
            A[:, :, i : i + BT, j : j + BT] = A_ij
            q_i = q_i - q_i @ H_mat[:, :, j // BT]

    for i in range(0, seq_len // BT):
        A[:, :, i * BT : i * BT + BT, i * BT : i * BT + BT] = A_local[:, :, i]

    A = A.masked_fill_(~torch.tril(torch.ones(seq_len, seq_len, device=q.device, dtype=torch.bool)), float("-inf"))
    A = A[:, :, :l, :l]
    A = A + g_cumsum[..., None] - g_cumsum[..., None, :]
    ref_o = (A * scale).softmax(-1).to(v) @ v

    return ref_o.to(original_dtype).transpose(1, 2)


BATCH, HEADS, HEAD_DIM = 2, 4, 8
WIDTH = HEADS * HEAD_DIM
SHAPE = AttentionShape(d_model=WIDTH, n_heads=HEADS, n_layers=2, train_len=16)


def path_layer(dtype=torch.float64):
    torch.manual_seed(4)
    return PaTH(SHAPE).layer(1).to(dtype)


def inputs(length, dtype=torch.float64):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(BATCH, length, WIDTH, generator=gen, dtype=dtype, requires_grad=True)
    return x, *[
        torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=dtype, requires_grad=True) for _ in "qkv"
    ]


def fla_reference(q, k, v, w, beta, log_forget=None):
    """fla's naive PaTH attention on lenext's (B, H, L, d) layout; beta (B, H, L), log_forget (B, H, L) (none: 0)."""
    g = torch.zeros_like(beta) if log_forget is None else log_forget
    layout = [t.transpose(1, 2) for t in (q, k, v, w)]  # (B, L, H, d)
    out = naive_path_attn(*layout, beta.transpose(1, 2), g.transpose(1, 2), scale=HEAD_DIM**-0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    "length, rows, chunk", [(9, None, 64), (9, 1, 64), (70, None, 64), (70, 7, 64), (70, None, 16)]
)
def test_path_matches_fla_naive_in_float64(length, rows, chunk, monkeypatch):
    """Within and beyond fla's chunk of 64, the logits in one block, single rows and blocks of 7, and lenext's
    chunks of 16 (five, the last padded) against fla's of 64: outputs and the gradients of x (through w and beta),
    q, k, v and every parameter of the layer to 1e-10."""
    monkeypatch.setattr(path_module, "CHUNK", chunk)
    if rows is not None:
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * rows)
    layer = path_layer()
    x, q, k, v = inputs(length)
    got = causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(length)))
    w, beta = layer.directions(x)
    expected = fla_reference(q, k, v, w, beta)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    wrt = [x, q, k, v, *layer.parameters()]
    got_grads = torch.autograd.grad((got * weight).sum(), wrt)
    expected_grads = torch.autograd.grad((expected * weight).sum(), wrt)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("chunk", [4, 64])
def test_path_logits_multiply_out_the_papers_transformations(chunk, monkeypatch):
    """PaTH's logits against the definition in float64, each H_t = I - beta_t w_t w_t^T a matrix and every pair's
    product H_i .. H_(j+1) multiplied out: in one chunk, and in chunks of 4 (three, the last padded); all rows at
    once and in blocks of rows."""
    monkeypatch.setattr(path_module, "CHUNK", chunk)
    length, dim = 11, 5
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(BATCH, HEADS, length, dim, generator=gen, dtype=torch.float64) for _ in "qk")
    w = F.normalize(torch.randn(BATCH, HEADS, length, dim, generator=gen, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(BATCH, HEADS, length, generator=gen, dtype=torch.float64)
    eye = torch.eye(dim, dtype=torch.float64)
    householders = eye - beta[..., None, None] * w[..., :, None] * w[..., None, :]  # (B, H, L, d, d)
    expected = torch.zeros(BATCH, HEADS, length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(i + 1):
            product = eye.expand(BATCH, HEADS, dim, dim)
            for t in range(i, j, -1):
                product = product @ householders[:, :, t]
            expected[:, :, i, j] = (q[:, :, i, None, :] @ product @ k[:, :, j, :, None])[..., 0, 0] / math.sqrt(dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    logits = PathLogits(q, k, w, beta)
    assert_close(logits(0, length)[..., causal], expected[..., causal], atol=1e-12, rtol=1e-12)
    # blocks of 3 rows, each against the keys up to its last, then one from the start again
    for start, end in [(0, 3), (3, 6), (6, 9), (9, 11), (2, 7)]:
        got = logits(start, end)
        assert got.shape[-2:] == (end - start, end)
        seen = causal[start:end, :end]
        assert_close(got[..., seen], expected[..., start:end, :end][..., seen], atol=1e-12, rtol=1e-12)


def test_path_logits_stay_close_in_fp32_and_under_bf16_autocast_when_products_cancel():
    """Three chunks of 64 of nearly parallel w of alternating sign at beta near 2 (a chunk's products cancel): fp32,
    and fp32 inputs under bf16 autocast, within 1e-3 of the logits' largest size against float64 (a Gram matrix
    rounded to bf16 was off by 0.4 of it)."""
    length, dim = 130, 32
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, length, dim, generator=gen, dtype=torch.float64) for _ in "qk")
    signs = (-1.0) ** torch.arange(length, dtype=torch.float64)[:, None]
    near = torch.randn(dim, generator=gen, dtype=torch.float64) + 0.05 * torch.randn(
        1, 2, length, dim, generator=gen, dtype=torch.float64
    )
    w = F.normalize(signs * near, dim=-1)
    beta = torch.full((1, 2, length), 1.999, dtype=torch.float64)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    exact = PathLogits(q, k, w, beta)(0, length)[..., causal]
    single = [t.float() for t in (q, k, w, beta)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = PathLogits(*single)(0, length)
    for got in (PathLogits(*single)(0, length), autocast):
        assert (got.double()[..., causal] - exact).abs().max() < 1e-3 * exact.abs().max()


def test_w_and_beta_are_fla_layers_and_causal():
    """w: x -> 32 -> d_model (no bias), a causal depthwise convolution of width 3 (no bias), SiLU, unit length per
    head; beta = 2 sigmoid(linear x) in (0, 2), as fla's PaTHAttention (which needs triton: restated here, the
    convolution as a sum of shifted products), and w_t unchanged when tokens after t change."""
    layer = path_layer()
    x = inputs(12)[0].detach()
    w, beta = layer.directions(x)
    projected = layer.w_proj[1](layer.w_proj[0](x))  # (B, L, d_model)
    kernel = layer.w_conv.weight[:, 0]  # (d_model, 3): output t = sum_s kernel[:, s] x_(t - 2 + s)
    padded = F.pad(projected, (0, 0, 2, 0))
    convolved = sum(kernel[:, s] * padded[:, s : s + 12] for s in range(3))
    expected_w = F.normalize(F.silu(convolved).unflatten(-1, (HEADS, HEAD_DIM)), dim=-1).transpose(1, 2)
    assert_close(w, expected_w, atol=1e-12, rtol=1e-12)
    assert_close(beta, 2 * torch.sigmoid(layer.beta_proj(x)).transpose(1, 2))
    changed = x.clone()
    changed[:, 7:] = torch.randn(BATCH, 5, WIDTH, dtype=torch.float64)
    assert_close(layer.directions(changed)[0][..., :7, :], w[..., :7, :], atol=0, rtol=0)


def test_path_uses_no_positions_and_with_fox_adds_fla_forget_gate():
    """The same output at drawn positions (PaTH is what the content makes of the order); composed with FoX, fla's
    PaTH-FoX, whose naive reference scales its gate g = log sigmoid with the logits by 1/sqrt(d) where FoX alone
    (fla's forgetting attention, lenext's gate) does not: lenext's gate is fla's PaTH gate times sqrt(d)."""
    layer = path_layer(torch.float32)
    x, q, k, v = (t.detach().float() for t in inputs(30))
    sequential = causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(30)))
    drawn = randomized_positions(BATCH, 30, 900, generator(3))
    assert_close(causal_attention(q, k, v, layer.terms(x, q, k, drawn)), sequential)
    torch.manual_seed(5)
    both = Compose(SHAPE, {"path": PaTH, "fox": FoX}).layer(1)
    terms = both.terms(x, q, k, sequential_positions(30))
    path, fox = both.parts
    w, beta = path.directions(x)
    gate = fox.log_forget(x).double().transpose(1, 2) * math.sqrt(HEAD_DIM)
    expected = fla_reference(q.double(), k.double(), v.double(), w.double(), beta.double(), gate)
    assert_close(causal_attention(q, k, v, terms).double(), expected, atol=1e-5, rtol=1e-5)


def test_each_layer_owns_its_projections():
    model = Decoder(32, 16, PaTH, d_model=WIDTH, n_layers=3, n_heads=HEADS)
    projections = [block.attn.pe.w_proj for block in model.blocks]
    assert len({id(p) for p in projections}) == 3
    assert model.pe.hyperparameters() == {"conv_size": 3}


@pytest.mark.parametrize(
    "device, head_dim, served",
    [
        ("cuda", 64, True),
        ("cuda", 16, False),
        ("cuda", 32, False),
        ("cuda", 128, False),
        ("cpu", 16, True),
        ("mps", 64, False),  # no Triton there, interpreted or not
    ],
)
def test_fla_serves_path_at_the_head_dims_measured_right(device, head_dim, served, monkeypatch):
    """fla's PaTH kernel takes a CUDA layer at head dim 64 only: on an H200 its tiles gave w gradients 50-78% off at
    16 and an illegal memory access at 32 (docs/pes/path.md); lenext's chunked logits serve the others. Under
    Triton's interpreter (the CPU's kernel tests) every head dim fla is built for; on another device none."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    import lenext.attention.fla_kernels as fla_kernels
    from lenext.pe.base import ScoreTerms

    monkeypatch.setattr(fla_kernels, "kernels", lambda: SimpleNamespace())  # fla as if installed
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with FakeTensorMode():  # a CUDA tensor's device and dtype, on a machine without CUDA
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # what Triton serves there
        q = torch.empty(2, 2, 128, head_dim, device=device, dtype=dtype)
    terms = ScoreTerms(householders=lambda: None)
    assert fla_kernels.fla_serves(q, terms, window=None) is served
