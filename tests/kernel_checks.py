"""What the Triton kernels' tests share (tests/test_fla_kernels.py, tests/test_cope_kernel.py)."""

import copy

import torch
from torch.testing import assert_close

from lenext.model import Decoder


def assert_trains_as_in_float64(net: Decoder, calls: list, call: tuple) -> None:
    """``net``'s training step in fp32 calls its kernel once a layer (``calls`` records each as ``call``), and its
    per-token NLL and every parameter's gradient equal the same model's in float64 (which no Triton kernel serves:
    lenext's explicit paths)."""
    tokens = torch.randint(0, 97, (2, 97), generator=torch.Generator().manual_seed(1))

    def step(dtype):
        model = copy.deepcopy(net).to(dtype)
        nll = model.token_nll(tokens[:, :-1], tokens[:, 1:])
        grads = torch.autograd.grad(nll.mean(), list(model.parameters()))
        return nll.detach().double(), [g.double() for g in grads]

    nll, grads = step(torch.float32)
    assert calls == [call] * len(net.blocks)
    expected_nll, expected_grads = step(torch.float64)
    assert_close(nll, expected_nll, atol=1e-4, rtol=0)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close(g, e, atol=1e-3 * e.abs().max().item() + 1e-7, rtol=0)
