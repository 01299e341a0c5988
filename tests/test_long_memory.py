"""The 2024-26 methods evaluate long inputs without scores of every (query, key) pair, on every path they take
(docs/attention.md): the peak extra memory of a whole model's forward stays a fraction of one (H, L, L) tensor.

The fused paths are checked at 16k tokens. The explicit query blocks (CoPE, stick-breaking, a key bias under
SSMax, DAPE, PaTH's logits) hold a fixed number of score elements per block (about 40 MB in all for CoPE here),
whatever L: at 8192 tokens here and at 16k among the slow tests (5-25 s each on an AVX2 EPYC), with small blocks so
that the bound is tight, in fp32 and under bf16 autocast (where a shape of product per block held GBs:
``widened_end``). Peak memory on CPU is sampled RSS, which the allocator's history moves in a long test worker: the
explicit cases run in a process of their own."""

import pytest
import torch
from hydra import compose, initialize_config_module
from torch.utils._python_dispatch import TorchDispatchMode

from lenext.attention import SCORE_BLOCK_ELEMENTS, AttentionSettings
from lenext.build import instantiate
from lenext.cli import CONFIG_PACKAGE
from lenext.evaluate import PeakMemory
from lenext.hardware import precision_autocast
from lenext.model import Decoder
from lenext.pe.base import KEY_WIDTHS, widened_end
from tests import forked

HEADS, TRAIN_LEN = 2, 64
FUSED = [
    ["pe=fox"],
    ["pe=fox_rope"],
    ["pe=p_rope"],
    ["pe=pope"],
    ["pe=rope_nope"],
    ["pe=rnope_swa"],
    ["pe=nope", "attention.scale=ssmax"],
]
EXPLICIT = [
    ["pe=cope"],
    ["pe=dape"],
    ["pe=nope", "attention.normalizer=stick_breaking"],
    ["pe=fox", "attention.scale=ssmax"],
    ["pe=path"],
]
# Each at 8192 tokens and, among the slow tests, 16k, in fp32 and bf16. DAPE only among the slow tests (its MLP per
# pair: 26 s at 8192 on a 2-core EPYC) and at 16k in fp32 only (102 s in bf16 on an AMX Xeon; emulated bf16, as on
# an AVX2 CPU, is up to 17x slower).
EXPLICIT_CASES = [
    pytest.param(
        overrides,
        length,
        precision,
        marks=[pytest.mark.slow] if "pe=dape" in overrides or length > 8192 else [],
        id=f"{' '.join(overrides)}-{length}-{precision}",
    )
    for overrides in EXPLICIT
    for length in (8192, 16384)
    for precision in ("32-true", "bf16-mixed")
    if not ("pe=dape" in overrides and length > 8192 and precision == "bf16-mixed")
]


def decoder(overrides: list[str], n_layers: int) -> Decoder:
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"data.max_len={TRAIN_LEN}"])
    torch.manual_seed(0)
    return Decoder(
        vocab_size=64,
        train_len=TRAIN_LEN,
        pe=instantiate(cfg.pe, "pe"),
        attention=AttentionSettings(**cfg.attention),
        d_model=16,
        n_layers=n_layers,
        n_heads=HEADS,
    )


def peak_mb(overrides: list[str], length: int) -> float:
    net = decoder(overrides, n_layers=3).eval()
    tokens = torch.randint(0, 64, (1, length + 1))
    with torch.no_grad():
        net.token_nll(tokens[:, :256], tokens[:, 1:257])  # one-time costs (kernels, thread pools) are not the forward's
        with PeakMemory(torch.device("cpu")) as memory:
            assert net.token_nll(tokens[:, :-1], tokens[:, 1:]).isfinite().all()
    return memory.peak_mb


def pair_scores_mb(length: int) -> float:
    return HEADS * length**2 * 4 / 2**20  # one (H, L, L) fp32 tensor


@pytest.mark.parametrize("overrides", FUSED, ids=" ".join)
def test_a_16k_forward_on_a_fused_path_holds_no_scores_of_every_pair(overrides):
    peak = peak_mb(overrides, 16384)
    assert peak < pair_scores_mb(16384) / 8, f"{peak:.0f} MB"


def peak_mb_in_a_fresh_process(overrides: list[str], length: int, precision: str) -> float:
    """``peak_mb`` with 1 MB of fp32 scores per block, in a process of its own (a fork of one that has only imported
    lenext: tests/forked.py): in a long test worker glibc's adapted mmap threshold serves the blocks' temporaries
    from a heap they fragment (DAPE at 8192: 266 MB there, 60-65 MB in a new interpreter, 77 MB in the fork)."""
    return forked.call(peak_mb_in_small_blocks, overrides, length, precision)


def peak_mb_in_small_blocks(overrides: list[str], length: int, precision: str) -> float:
    SCORE_BLOCK_ELEMENTS["cpu"] = 2**18
    with precision_autocast(torch.device("cpu"), precision):
        return peak_mb(overrides, length)


@pytest.mark.parametrize("overrides, length, precision", EXPLICIT_CASES)
def test_a_long_forward_in_explicit_query_blocks_holds_one_block_of_scores(overrides, length, precision):
    peak = peak_mb_in_a_fresh_process(overrides, length, precision)
    assert peak < pair_scores_mb(length) / 2, f"{peak:.0f} MB"


class ProductShapes(TorchDispatchMode):
    """The distinct (product, operand shapes) of the matrix products run while it is on, backward included."""

    PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.seen.add((func, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def product_shapes(overrides: list[str], length: int, monkeypatch) -> int:
    """How many shapes of products a training step of a one-layer model at ``length`` runs under bf16 autocast, 8
    query rows a block."""
    net = decoder(overrides, n_layers=1)
    monkeypatch.setitem(SCORE_BLOCK_ELEMENTS, "cpu", HEADS * 8 * length)
    tokens = torch.randint(0, 64, (1, length + 1))
    with ProductShapes() as shapes, precision_autocast(torch.device("cpu"), "bf16-mixed"):
        net.token_nll(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    return len(shapes.seen)


@pytest.mark.parametrize(
    "overrides",
    [
        ["pe=cope"],
        ["pe=dape"],
        ["pe=nope", "attention.normalizer=stick_breaking"],
        ["pe=rope", "pe.scaling=self_extend"],
        ["pe=kerple", "attention.window=100"],
    ],
    ids=" ".join,
)
def test_the_query_blocks_products_take_as_many_shapes_at_any_number_of_blocks(overrides, monkeypatch):
    """oneDNN builds and keeps a primitive for each new shape of a bf16 product on CPU: with keys of a width of
    their own per query block, a 16k forward held GBs (CoPE 12.1 GB). Keys widened to one of ``KEY_WIDTHS`` widths:
    as many shapes with 256 blocks as with 128 (twice as many before)."""
    assert product_shapes(overrides, 2048, monkeypatch) == product_shapes(overrides, 1024, monkeypatch)


@pytest.mark.parametrize("length", [7, 1000, 1024, 16384])
def test_keys_widen_to_a_few_widths_by_less_than_one_step_within_the_length(length):
    """A block from key 0 gets one of at most ``KEY_WIDTHS`` widths, each under one step of length / KEY_WIDTHS
    past its own end and never past the length, where its products are bf16 on a CPU; a window's later blocks (from
    a key past 0) keep their width, and so does every block of fp32 products."""
    step = -(-length // KEY_WIDTHS)
    queries = torch.zeros(1, dtype=torch.bfloat16)
    widened = [widened_end(0, end, length, queries) for end in range(1, length + 1)]
    assert len(set(widened)) <= KEY_WIDTHS
    assert all(end <= last < end + step and last <= length for end, last in enumerate(widened, start=1))
    assert all(widened_end(first, length // 2 + first, length, queries) == length // 2 + first for first in (1, 2, 3))
    with precision_autocast(torch.device("cpu"), "bf16-mixed"):
        assert widened_end(0, 1, length, queries.float()) == widened[0]
    assert all(widened_end(0, end, length, queries.float()) == end for end in range(1, length + 1))


def test_an_unwidened_keys_product_is_no_view():
    """Where nothing is widened (fp32) the product is returned as made: the explicit path scales it in place
    (``mul_``), which on a view autograd serves with a copy in the backward. That copy cost CoPE's fp32 training
    about 5% (0.36 against 0.38 of NoPE over seven alternated pairs; docs/performance.md). Widened (bf16 on a CPU),
    the products are cut back to the keys asked for."""
    from lenext.pe.base import keys_product

    queries, keys = torch.randn(1, 2, 8, 4, requires_grad=True), torch.randn(1, 2, 64, 4)
    product = keys_product(queries, keys, 0, 40)
    assert not product._is_view() and product.shape[-1] == 40
    torch.testing.assert_close(product, queries @ keys[..., :40, :].transpose(-2, -1))
    with precision_autocast(torch.device("cpu"), "bf16-mixed"):
        widened = keys_product(queries, keys, 0, 41)  # over 44 keys (64 / KEY_WIDTHS = 4 a step)
    assert widened.shape[-1] == 41 and widened._is_view()
