"""lenext's CoPE kernel (lenext.attention.contextual) against CoPE's explicit path in float64, which
tests/test_cope.py holds to x-transformers' CoPE.

On the CPU under Triton's interpreter, which runs the kernel's own code in fp32 with exact dots: ``make
test-kernels`` runs this module with TRITON_INTERPRET=1; elsewhere it is skipped. Its tiles are half a GPU's there
(16 to 32 rows and keys), so these lengths span several; bf16 on CUDA is the GPU check's (scripts/gpu_check.py).
"""

import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "lenext's CoPE kernel runs here under TRITON_INTERPRET=1 only (make test-kernels)", allow_module_level=True
    )
pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")

from torch.testing import assert_close  # noqa: E402
from triton.runtime.interpreter import InterpreterBuilder  # noqa: E402

import lenext.attention as attention  # noqa: E402
import lenext.attention.contextual as contextual  # noqa: E402
from lenext.attention import AttentionSettings, causal_attention  # noqa: E402
from lenext.attention.contextual import Tiles  # noqa: E402
from lenext.model import Decoder  # noqa: E402
from lenext.pe import KERPLE, Compose, CoPE  # noqa: E402
from lenext.pe.cope import ContextualPositions  # noqa: E402
from tests.kernel_checks import assert_trains_as_in_float64  # noqa: E402

# The interpreter computes masked lanes too (exp of -inf), which numpy warns of.
pytestmark = [pytest.mark.kernels, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """The calls of the CoPE kernel during the test, as ("contextual",)."""
    calls, real = [], attention.contextual_kernel()

    def counted(*args):
        calls.append(("contextual",))
        return real(*args)

    monkeypatch.setattr(attention, "contextual_kernel", lambda: counted)
    return calls


@pytest.fixture
def accesses_outside(monkeypatch) -> list:
    """Every load, store or atomic add of the kernels, unmasked, that falls outside the tensors the kernel was
    launched with (on a GPU, an illegal memory access or a silent overwrite; the interpreter reads host memory
    without complaint): the number of such addresses per access."""
    ranges, outside = [], []

    class Launcher:  # records the bytes of every tensor a kernel is launched with
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tensors = [t for t in args if torch.is_tensor(t)]
                ranges[:] = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
                return self.kernel[grid](*args, **kwargs)

            return launch

    def check(pointers, mask) -> None:
        addresses = pointers.data[mask.data.astype(bool)]
        inside = np.zeros(addresses.shape, dtype=bool)
        for low, high in ranges:
            inside |= (addresses >= low) & (addresses < high)
        if not inside.all():
            outside.append(int((~inside).sum()))

    load, store, atomic = (
        InterpreterBuilder.create_masked_load,
        InterpreterBuilder.create_masked_store,
        InterpreterBuilder.create_atomic_rmw,
    )

    def checked_load(self, pointers, mask, *args):
        check(pointers, mask)
        return load(self, pointers, mask, *args)

    def checked_store(self, pointers, value, mask, *args):
        check(pointers, mask)
        return store(self, pointers, value, mask, *args)

    def checked_atomic(self, op, pointers, value, mask, *args):
        check(pointers, mask)
        return atomic(self, op, pointers, value, mask, *args)

    for name in ("_forward", "_backward"):
        monkeypatch.setattr(contextual, name, Launcher(getattr(contextual, name)))
    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", checked_load)
    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", checked_store)
    monkeypatch.setattr(InterpreterBuilder, "create_atomic_rmw", checked_atomic)
    return outside


def cope_layer(length: int, positions: int, dtype=torch.float64):
    """A CoPE layer of head dim 16 with its embeddings drawn (they start at 0: the term would vanish), and inputs."""
    torch.manual_seed(positions)
    layer = ContextualPositions(16, positions).to(dtype)
    torch.nn.init.normal_(layer.embedding, std=0.5)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, 3, length, 16, generator=gen, dtype=dtype) for _ in "qkv")
    return layer, q, k, v


def attend(layer, q, k, v, settings: dict | None = None):
    """The layer's attention (output, and the gradients of q, k, v and the embeddings for a fixed weighting), in
    the inputs' dtype, through the one attention call site."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = causal_attention(*leaves, layer.terms(None, leaves[0], leaves[1], None), **(settings or {}))
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), [*leaves, layer.embedding])
    return out.double(), [g.double() for g in grads]


# Tiles as on a GPU (the forward's rows twice its keys: rows that see no key in their first tile), square, and
# fewer rows than keys.
TILES = {
    "as_on_a_gpu": Tiles(keys=16, forward_rows=32, backward_rows=16, warps=4),
    "square": Tiles(keys=16, forward_rows=16, backward_rows=16, warps=4),
    "keys_over_rows": Tiles(keys=32, forward_rows=16, backward_rows=16, warps=4),
}


# Lengths across tiles and not their multiples; positions below the length (the cap reached) and above.
@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize(("length", "positions"), [(7, 24), (40, 24), (40, 64), (101, 30)])
def test_cope_kernel_matches_the_explicit_path_in_float64(
    length, positions, tiles, kernel_calls, accesses_outside, monkeypatch
):
    """Output and the gradients of q, k, v and the position embeddings (through the kernel's per-position scores):
    the kernel in fp32 against lenext's explicit query blocks in float64, to fp32's rounding, for any tiles; no
    access outside the kernel's tensors (the last tile's rows past the sequence read nothing)."""
    monkeypatch.setitem(contextual.TILES, "cpu", TILES[tiles])
    layer, q, k, v = cope_layer(length, positions)
    expected, expected_grads = attend(layer, q, k, v)
    assert kernel_calls == []  # float64: the explicit path
    got, grads = attend(layer.float(), q.float(), k.float(), v.float())
    assert kernel_calls == [("contextual",)]
    assert accesses_outside == []
    assert_close(got, expected, atol=1e-5, rtol=0)
    for name, g, e in zip("q k v embedding".split(), grads, expected_grads, strict=True):
        assert_close(g, e, atol=1e-4 * e.abs().max().item(), rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_gates_counted_past_the_cap_give_no_position_gradient(kernel_calls):
    """With 2 positions (cap 1) nearly every pair is past the cap: the embeddings' gradient all on e[1] but for
    the pairs below it, as the explicit path's."""
    layer, q, k, v = cope_layer(50, 2)
    expected, expected_grads = attend(layer, q, k, v)
    got, grads = attend(layer.float(), q.float(), k.float(), v.float())
    assert kernel_calls == [("contextual",)]
    assert_close(got, expected, atol=1e-5, rtol=0)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e, atol=1e-4 * e.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "settings",
    [{"window": 8}, {"stick_breaking": True}, {"row_scale": torch.ones(1, 3, 40, 1)}],
    ids=["window", "stick_breaking", "row_scale"],
)
def test_the_kernel_serves_cope_alone_on_the_scores(settings, kernel_calls):
    """A window, stick-breaking or a row scale beside CoPE's term keeps the explicit path (the kernel has none)."""
    layer, q, k, v = cope_layer(40, 24, torch.float32)
    attend(layer, q, k, v, settings)
    assert kernel_calls == []


def test_a_cope_model_trains_through_the_kernel_as_in_float64(kernel_calls):
    """A 2-layer CoPE decoder in fp32 through the kernel (every layer's embeddings drawn): its per-token NLL and
    every parameter's gradient equal the same model's in float64 (the explicit path)."""
    torch.manual_seed(0)
    net = Decoder(vocab_size=97, d_model=64, n_layers=2, n_heads=4, train_len=48, pe=CoPE)
    for parameter in net.pe_parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    assert_trains_as_in_float64(net, kernel_calls, ("contextual",))


def test_cope_beside_a_bias_keeps_the_explicit_path(kernel_calls):
    """CoPE composed with KERPLE (a pair bias on the same scores): not the kernel's, which has no bias."""
    net = Decoder(
        vocab_size=97,
        d_model=64,
        n_layers=2,
        n_heads=4,
        train_len=48,
        pe=lambda shape: Compose(shape, {"cope": CoPE, "kerple": KERPLE}),
        attention=AttentionSettings(),
    )
    net.token_nll(torch.zeros(1, 20, dtype=torch.long), torch.zeros(1, 20, dtype=torch.long))
    assert kernel_calls == []
