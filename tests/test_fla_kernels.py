"""fla's Triton kernels on the paths lenext sends them (lenext.attention.fla_kernels), against float64 oracles.

On the CPU under Triton's interpreter, which runs the kernels' own code: ``make test-kernels`` installs fla-core and
Triton and runs this module with TRITON_INTERPRET=1; elsewhere it is skipped. The interpreter has no bf16 (its
outputs are garbage there), so these check fp32; on CUDA and in bf16 the GPU check does (scripts/gpu_check.py).
"""

import copy
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("fla's kernels run here under TRITON_INTERPRET=1 only (make test-kernels)", allow_module_level=True)
pytest.importorskip("fla", reason="fla-core is not installed (make test-kernels installs it)")

import triton.runtime.autotuner as autotuner  # noqa: E402
from torch.testing import assert_close  # noqa: E402

import lenext.attention.fla_kernels as fla_kernels  # noqa: E402
from lenext.attention import AttentionSettings, causal_attention, recording  # noqa: E402
from lenext.model import Decoder  # noqa: E402
from lenext.pe import KERPLE, AttentionShape, Compose, CoPE, FoX, NoPE, PaTH, PoPE, RoPE  # noqa: E402
from lenext.pe.base import Bias, ScoreTerms, sequential_positions  # noqa: E402
from tests.kernel_checks import assert_trains_as_in_float64  # noqa: E402
from tests.test_attention_settings import stick_breaking_reference  # noqa: E402
from tests.test_fox import fla_reference, run_fox  # noqa: E402

# The interpreter computes masked lanes too (exp2 of -inf, 0 * inf), which numpy warns of; fla warns of the CPU.
pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")]


@pytest.fixture(autouse=True)
def first_configs(monkeypatch):
    """The interpreter has no driver to time an autotuner's configs: each kernel takes its first."""
    prune = autotuner.Autotuner.prune_configs
    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])


@pytest.fixture
def fla_calls(monkeypatch) -> list:
    """The calls of fla's kernels during the test, as ("forgetting", window), ("path", gated) or ("stick_breaking",
    attend_current): the dispatcher must send FoX, PaTH and stick-breaking there."""
    calls, real = [], fla_kernels.kernels()

    def forgetting(*args, **kwargs):
        calls.append(("forgetting", kwargs["window_size"]))
        return real.forgetting(*args, **kwargs)

    def path(q, k, v, w, beta, g, **kwargs):
        calls.append(("path", g is not None))
        return real.path(q, k, v, w, beta, g, **kwargs)

    def stick_breaking(*args, **kwargs):
        calls.append(("stick_breaking", kwargs["attend_current"]))
        return real.stick_breaking(*args, **kwargs)

    counted = SimpleNamespace(forgetting=forgetting, path=path, stick_breaking=stick_breaking)
    monkeypatch.setattr(fla_kernels, "kernels", lambda: counted)
    return calls


@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize("length", [100, 300])
def test_forgetting_kernel_matches_fla_naive_reference(length, window):
    """fla's kernel alone, in fp32, against its naive reference in float64: output and the gradients of q, k, v and
    the log gates (summed by the kernel over the keys and tokens) to fp32's rounding."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, 2, length, 32, generator=gen) for _ in range(3))
    log_forget = torch.nn.functional.logsigmoid(torch.randn(2, length, 2, generator=gen) + 2)
    tensors = [t.requires_grad_() for t in (q, k, v, log_forget)]
    got = fla_kernels.fla_attention(q, k, v, ScoreTerms((Bias(gates=lambda: log_forget),)), window)
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    expected = fla_reference(*leaves, window=window)
    assert_close(got.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    weight = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad((got.double() * weight).sum(), tensors)
    expected_grads = torch.autograd.grad((expected * weight).sum(), leaves)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g.double(), e, atol=1e-4 * e.abs().max().item(), rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("length", [7, 64, 300])
def test_fox_training_takes_fla_and_matches_the_reference(length, window, fla_calls, monkeypatch):
    """FoX's layer through the one attention call site with a gradient: fla's kernel runs (with the window), and the
    output and the gradients of x, q, k, v and the gate's weight and bias equal fla's naive reference in float64 as
    closely as the fp32 paths of tests/test_fox.py do."""
    got, expected, got_grads, expected_grads = run_fox("fused", length, True, window, torch.float32, monkeypatch)
    assert fla_calls == [("forgetting", window)]
    assert_close(got.double(), expected, atol=1e-4 if length > 100 else 1e-5, rtol=1e-5)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g.double(), e.double(), atol=1e-3 * e.abs().max().item(), rtol=0)


def test_fox_evaluation_keeps_the_float64_anchored_key(fla_calls, monkeypatch):
    """Without a gradient (evaluation, at lengths far past L_train) FoX keeps its key bias summed in float64: fla's
    fp32 cumulative sum is not used."""
    got, expected, _, _ = run_fox("fused", 64, False, None, torch.float32, monkeypatch)
    assert fla_calls == []
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", [FoX, lambda shape: Compose(shape, {"rope": RoPE, "fox": FoX})], ids=["fox", "fox_rope"])
def test_a_fox_model_trains_through_fla_as_in_float64(pe, fla_calls):
    """A 2-layer FoX (and FoX + RoPE) decoder's training step in fp32 through fla's kernel: its per-token NLL and
    every parameter's gradient equal the same model's in float64 (which fla does not serve: the explicit key bias)."""
    torch.manual_seed(0)
    net = Decoder(vocab_size=97, d_model=64, n_layers=2, n_heads=4, train_len=96, pe=pe)
    with torch.no_grad():
        for block in net.blocks:
            gate = next(m for m in block.attn.pe.modules() if hasattr(m, "gate")).gate
            gate.weight.normal_(std=0.5)
            gate.bias.normal_(mean=1.0, std=0.5)
    assert_trains_as_in_float64(net, fla_calls, ("forgetting", None))


def path_case(length: int, pe, head_dim: int = 16, dtype=torch.float32):
    """A PaTH (or PaTH + FoX) layer of 2 heads, its gates near fla's range, and inputs: (layer, x, q, k, v)."""
    shape = AttentionShape(d_model=2 * head_dim, n_heads=2, n_layers=2, train_len=16)
    torch.manual_seed(4)
    layer = pe(shape).layer(1).to(dtype)
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, shape.d_model, generator=gen, dtype=dtype, requires_grad=True)
    q, k, v = (torch.randn(2, 2, length, head_dim, generator=gen, dtype=dtype, requires_grad=True) for _ in "qkv")
    return layer, x, q, k, v


PATH_PES = {"path": PaTH, "path_fox": lambda shape: Compose(shape, {"path": PaTH, "fox": FoX})}


@pytest.mark.parametrize("length", [9, 70, 200])
@pytest.mark.parametrize("pe", list(PATH_PES))
def test_path_training_takes_fla_and_matches_float64(pe, length, fla_calls):
    """PaTH's layer (and PaTH + FoX: fla's PaTH kernel scales its gates by 1/sqrt(d) with the logits, lenext's FoX
    does not) through the one attention call site with a gradient, in fp32: fla's PaTH kernel runs, and the output
    and the gradients of x (through w, beta and the gates), q, k, v and every parameter of the layer equal the same
    layer's in float64 on lenext's chunked logits, which tests/test_path.py holds to fla's naive reference."""
    layer, x, q, k, v = path_case(length, PATH_PES[pe])
    got = causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(length)))
    assert fla_calls == [("path", pe == "path_fox")]
    wide = [t.detach().double().requires_grad_() for t in (x, q, k, v)]
    wide_layer = copy.deepcopy(layer).double()
    expected = causal_attention(*wide[1:], wide_layer.terms(wide[0], *wide[1:3], sequential_positions(length)))
    assert len(fla_calls) == 1  # float64: lenext's own path
    # fla carries queries across its 64-token chunks to ~1e-4 in fp32 (within a chunk 1e-7; lenext's fp32 logits
    # 4e-7): measured here, docs/pes/path.md
    assert_close(got.double(), expected, atol=3e-4, rtol=0)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got_grads = torch.autograd.grad((got.double() * weight).sum(), [x, q, k, v, *layer.parameters()])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [*wide, *wide_layer.parameters()])
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert e.abs().sum() > 0
        assert_close(g.double(), e, atol=2e-3 * e.abs().max().item(), rtol=0)


@pytest.mark.parametrize("case", ["window", "head dim 8", "no gradient", "with FoX, a window"])
def test_path_keeps_lenexts_chunked_logits_where_fla_does_not_serve(case, fla_calls):
    """fla's PaTH kernel takes no window and head dims 16, 32, 64, 128 only; evaluation keeps lenext's paths: there
    the chunked logits run, and equal float64's."""
    pe = PATH_PES["path_fox"] if "FoX" in case else PaTH
    layer, x, q, k, v = path_case(40, pe, head_dim=8 if case == "head dim 8" else 16)
    window = 5 if "window" in case else None
    with torch.set_grad_enabled(case != "no gradient"):
        got = causal_attention(q, k, v, layer.terms(x, q, k, sequential_positions(40)), window)
    wide = [t.detach().double() for t in (x, q, k, v)]
    terms = copy.deepcopy(layer).double().terms(wide[0], *wide[1:3], sequential_positions(40))
    expected = causal_attention(*wide[1:], terms, window)
    assert fla_calls == []
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def fox_case(length: int = 24):
    layer, x, q, k, v = path_case(length, FoX)
    return layer.terms(x, q, k, sequential_positions(length)), q, k, v


def alibi_like(terms, q, k, v):
    other = Bias(key=lambda first, end: -0.1 * torch.arange(end - first, 0, -1, dtype=torch.float32))
    return causal_attention(q, k, v, ScoreTerms(terms.biases + (other,)))


def dape_like(terms, q, k, v):
    def zero_term(logits, start, end, first):
        return torch.zeros_like(logits)

    return causal_attention(q, k, v, replace(terms, logit_terms=(zero_term,)))


NOT_SERVED = {
    "a row scale (SSMax)": lambda t, q, k, v: causal_attention(q, k, v, t, row_scale=torch.full((1, 2, 24, 1), 1.1)),
    "another bias (ALiBi's)": alibi_like,
    "recording": lambda t, q, k, v: _recorded(causal_attention, q, k, v, t),
    "a logit term (DAPE's)": dape_like,
    "bf16 on the CPU": lambda t, q, k, v: _bf16(causal_attention, q, k, v, t),
}


def _recorded(fn, *args):
    with recording(lambda *weights: None):
        return fn(*args)


def _bf16(fn, *args):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args)


@pytest.mark.parametrize("pe", ["fox", "path_fox"])
@pytest.mark.parametrize("case", list(NOT_SERVED))
def test_fla_does_not_serve_a_layer_with_more_on_its_scores(case, pe, fla_calls):
    """Anything besides the gates and the Householder products on the scores (a row scale, another bias, a logit
    term), attention recording (which needs the weights), and bf16 on the CPU (the interpreter has none) keep
    lenext's paths."""
    if pe == "fox":
        terms, q, k, v = fox_case()
    else:
        layer, x, q, k, v = path_case(24, PATH_PES[pe])
        terms = layer.terms(x, q, k, sequential_positions(24))
    out = NOT_SERVED[case](terms, q, k, v)
    assert fla_calls == [] and out.isfinite().all()


@pytest.mark.parametrize("length", [7, 70, 200])
def test_stick_breaking_training_takes_fla_and_matches_the_reference_code(length, fla_calls):
    """Stick-breaking of q . k alone through the call site with a gradient: fla's kernel runs (the query not
    attended), its leftover stick goes to the query's own value, and the output and the gradients of q, k, v equal
    the stick-breaking package's reference code in float64."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, 2, length, 32, generator=gen, requires_grad=True) for _ in "qkv")
    got = causal_attention(q, k, v, stick_breaking=True)
    assert fla_calls == [("stick_breaking", False)]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = stick_breaking_reference(*leaves)
    assert_close(got.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    weight = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad((got.double() * weight).sum(), [q, k, v])
    expected_grads = torch.autograd.grad((expected * weight).sum(), leaves)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g.double(), e, atol=1e-4 * e.abs().max().item(), rtol=0)


@pytest.mark.parametrize("pe", [NoPE, RoPE, PoPE], ids=["nope", "rope", "pope"])
def test_a_stick_breaking_model_trains_through_fla_as_in_float64(pe, fla_calls):
    """A 2-layer decoder under stick-breaking (NoPE; RoPE, which rotates q and k first; PoPE, whose q and k are twice
    v's width) in fp32 through fla's kernel: its per-token NLL and every parameter's gradient equal the same model's
    in float64 (lenext's explicit path)."""
    torch.manual_seed(0)
    settings = AttentionSettings(normalizer="stick_breaking")
    net = Decoder(vocab_size=97, d_model=64, n_layers=2, n_heads=4, train_len=96, pe=pe, attention=settings)
    assert_trains_as_in_float64(net, fla_calls, ("stick_breaking", False))


def _kerple_terms(q, k):
    shape = AttentionShape(d_model=64, n_heads=2, n_layers=2, train_len=16)
    return KERPLE(shape).layer(1).terms(None, q, k, sequential_positions(q.size(-2)))


STICK_BREAKING_NOT_SERVED = {
    "a bias (KERPLE's)": lambda q, k, v: causal_attention(q, k, v, _kerple_terms(q, k), stick_breaking=True),
    "a window": lambda q, k, v: causal_attention(q, k, v, window=5, stick_breaking=True),
    "a row scale (SSMax)": lambda q, k, v: causal_attention(
        q, k, v, row_scale=torch.full((1, 2, 24, 1), 1.1), stick_breaking=True
    ),
    "recording": lambda q, k, v: _recorded(causal_attention, q, k, v, ScoreTerms(), None, None, True),
    "no gradient": lambda q, k, v: _no_grad(causal_attention, q, k, v, stick_breaking=True),
}


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


@pytest.mark.parametrize("case", list(STICK_BREAKING_NOT_SERVED))
def test_stick_breaking_with_more_than_q_k_keeps_lenexts_path(case, fla_calls):
    """fla's kernel scores q . k alone: a bias, a window, a row scale, recording, and evaluation keep lenext's
    explicit stick-breaking, with the reference's numbers where the reference has the case."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 32, generator=gen, requires_grad=True) for _ in "qkv")
    out = STICK_BREAKING_NOT_SERVED[case](q, k, v)
    assert fla_calls == [] and out.isfinite().all()
    if case in ("a window", "recording", "no gradient"):
        window = 5 if case == "a window" else None
        expected = stick_breaking_reference(*(t.detach().double() for t in (q, k, v)), window)
        assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", ["path", "self_extend", "cope"])
def test_stick_breaking_on_a_pes_own_logits_keeps_lenexts_path(pe, fla_calls):
    """PaTH's and Self-Extend's logits and CoPE's logit term are not q . k: stick-breaking on them keeps lenext's
    explicit path."""
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=2, train_len=8)
    layer, x, q, k, v = path_case(24, PaTH)
    if pe == "self_extend":
        layer = RoPE(shape, scaling="self_extend", factor=4.0, neighbor_window=4).layer(1)
    elif pe == "cope":
        layer = CoPE(shape).layer(1)
    terms = layer.terms(x, q, k, sequential_positions(24))
    assert (terms.logits is not None) == (pe != "cope")
    out = causal_attention(q, k, v, terms, stick_breaking=True)
    assert fla_calls == [] and out.isfinite().all()
