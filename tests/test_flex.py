"""The FlexAttention path against the SDPA paths of ``causal_attention``.

``causal_attention`` takes flex only on CUDA; here each PE's ``score_mod`` and the cached causal
BlockMask go through eager (uncompiled) flex_attention on CPU, forward only, which torch 2.13 runs.
"""

import logging
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import lenext.attention as attention_module
from lenext.attention import causal_attention, causal_block_mask
from lenext.attention.flex import key_score_mod, window_block_mask
from lenext.pe import FIRE, KERPLE, ALiBi, AttentionShape, FoX, NoPE, ShawRelative, T5Bias
from lenext.pe.base import position_span, sequential_positions
from lenext.positions import generator, randomized_positions

pytestmark = pytest.mark.skipif(
    attention_module.flex_attention is None, reason="lenext takes FlexAttention from torch 2.11"
)

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


def score_mod_of(pe, q, k, positions, layer):
    """The score_mod the attention gives flex for the PE's bias (its own, or its key or band form's), or None."""
    terms = pe.layer(layer).terms(None, q, k, positions)
    return attention_module.flex_score_mod(terms.biases[0], q.size(-2)) if terms.biases else None


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
            got = eager_flex(q, k, v, score_mod_of(pe, q, k, positions, layer))
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


@pytest.mark.parametrize("positions", ["sequential", "randomized"])
@pytest.mark.parametrize("length", [100, 300])
def test_fire_score_mod_past_its_threshold_matches_causal_attention(length, positions):
    """Past L_thr, in evaluation (no gradient), flex runs FIRE's MLP on each score: the same attention as the pair
    bias scored in query blocks, the normaliser psi(max(i, L_thr)) included."""
    pe, positions = FIRE(SHAPE, init_threshold=40.0), POSITIONS[positions](length)
    torch.manual_seed(length)
    with torch.no_grad():
        for layer in pe.layers:
            for param in layer.mlp.parameters():
                param.normal_(std=0.5)  # c and the threshold as initialised: rows on both sides of L_thr 40
        q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
        assert not any(pe.within_thresholds(positions, position_span(positions)))  # past the threshold: no lookup
        for layer in range(LAYERS):
            got = eager_flex(q, k, v, pe.score_mod(q, positions, layer))
            assert_close(
                got, causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, positions)), atol=1e-5, rtol=1e-5
            )


@pytest.mark.parametrize("positions", ["sequential", "randomized"])
def test_fire_layers_with_their_own_thresholds_each_take_their_own_form(positions):
    """Each layer's learned threshold decides its form (all read at once, once a forward): with layer 0 within its
    threshold (a table by distance) and layer 1 past it (the MLP per score), each still gives the query blocks'
    attention (the other layer's form would not)."""
    pe, positions = FIRE(SHAPE), POSITIONS[positions](100)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer, threshold in zip(pe.layers, (4000.0, 40.0), strict=True):
            layer.threshold_multiplier.fill_(threshold / layer.init_threshold)
            for param in layer.mlp.parameters():
                param.normal_(std=0.5)
        q, k, v = (torch.randn(BATCH, HEADS, 100, HEAD_DIM) for _ in range(3))
        assert pe.within_thresholds(positions, position_span(positions)) == (True, False)
        for layer in range(LAYERS):
            got = eager_flex(q, k, v, pe.score_mod(q, positions, layer))
            assert_close(
                got, causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, positions)), atol=1e-5, rtol=1e-5
            )


def test_fire_has_no_score_mod_past_its_threshold_with_a_gradient():
    """Training past L_thr: every score's gradient would land on the MLP's few weights at once; the attention scores
    it in blocks. A query at L_thr still has the normaliser psi(L_thr): a lookup."""
    pe, q = FIRE(SHAPE, init_threshold=40.0), torch.randn(1, HEADS, 42, HEAD_DIM)
    assert pe.score_mod(q[:, :, :41], sequential_positions(41), 0) is not None  # positions 0..40
    assert pe.score_mod(q, sequential_positions(42), 0) is None
    with torch.no_grad():
        assert pe.score_mod(q, sequential_positions(42), 0) is not None


def test_fire_says_once_when_training_leaves_flex_past_its_threshold(caplog):
    """A learned threshold can drift below the trained span: the slow path is then said, once, not taken silently."""
    pe, q = FIRE(SHAPE, init_threshold=40.0), torch.randn(1, HEADS, 42, HEAD_DIM)
    with caplog.at_level(logging.WARNING, logger="lenext"):
        pe.score_mod(q[:, :, :41], sequential_positions(41), 0)  # within the threshold: nothing to say
        assert not caplog.records
        pe.score_mod(q, sequential_positions(42), 0)
        pe.score_mod(q, sequential_positions(42), 1)
    (record,) = caplog.records
    assert "L_thr = 40.0" in record.getMessage() and "span 42" in record.getMessage()


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
        got = eager_flex(q, k, v, score_mod_of(pe, q, k, positions, 0), window)
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


@pytest.mark.parametrize("length, window", [(300, 1), (300, 7), (300, 128), (300, 200), (1024, 300), (129, 128)])
def test_window_block_mask_visits_exactly_the_blocks_the_window_reaches(length, window):
    """Its blocks, full and partial, against the element mask reduced to blocks (full: all of a block seen)."""
    mask = window_block_mask(length, window, torch.device("cpu"))
    rows, keys = torch.arange(length)[:, None], torch.arange(length)
    seen = (keys <= rows) & (keys > rows - window)  # (L, L)
    blocks = -(-length // 128)
    padded = torch.zeros(blocks * 128, blocks * 128, dtype=torch.bool)
    padded[:length, :length] = seen
    per_block = padded.reshape(blocks, 128, blocks, 128).transpose(1, 2)
    in_range = torch.zeros_like(padded)
    in_range[:length, :length] = True
    whole = (per_block | ~in_range.reshape(blocks, 128, blocks, 128).transpose(1, 2)).flatten(2).all(-1)
    assert torch.equal(mask.to_dense()[0, 0].bool(), per_block.flatten(2).any(-1))
    full = torch.zeros(blocks, blocks, dtype=torch.bool)
    for row in range(blocks):
        full[row, mask.full_kv_indices[0, 0, row, : mask.full_kv_num_blocks[0, 0, row]].long()] = True
    assert torch.equal(full, whole & per_block.flatten(2).any(-1))


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """``causal_attention``'s CUDA FlexAttention branch taken on the CPU, through eager flex on detached inputs
    (forward only: CPU flex has no backward); each call's block mask recorded."""
    calls = []

    def eager(q, k, v, score_mod=None, block_mask=None, **aux):  # aux: return_aux
        calls.append(block_mask)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return attention_module.flex_attention(
                q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=block_mask, **aux
            )

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    monkeypatch.setattr(attention_module, "compiled_flex_attention", lambda: eager)
    return calls


def explicit(q, k, v, terms, window=None):
    """The explicit query blocks' output (what attention recording runs), the reference of the dispatch tests."""
    with attention_module.recording(lambda *weights: None):
        return causal_attention(q, k, v, terms, window)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kind", [None, "alibi", "t5", "kerple"])
def test_the_dispatcher_sends_biases_and_windows_to_flex(kind, window, flex_on_cpu):
    pe, positions, length = (PES[kind]() if kind else NoPE(SHAPE)), sequential_positions(100), 100
    torch.manual_seed(1)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM) for _ in range(3))
    with torch.no_grad():
        terms = pe.layer(0).terms(None, q, k, positions)
        got = causal_attention(q, k, v, terms, window)
        assert_close(got, explicit(q, k, v, terms, window), atol=1e-5, rtol=1e-5)
    assert len(flex_on_cpu) == (0 if kind is None and window is None else 1)  # no bias, no window: SDPA


def test_the_dispatcher_sends_foxs_key_bias_to_flex_in_evaluation_and_fp32_training(flex_on_cpu):
    """FoX's key bias has no score_mod of its own: flex takes it as one (``key_score_mod``), without a gradient and
    with one in fp32; under bf16 autocast with a gradient it stays on the fp32 channels."""
    layer = FoX(SHAPE).layer(0)
    torch.manual_seed(2)
    with torch.no_grad():
        layer.gate.weight.normal_(std=0.5)
    x = torch.randn(BATCH, 80, HEADS * HEAD_DIM)
    q, k, v = (torch.randn(BATCH, HEADS, 80, HEAD_DIM) for _ in range(3))
    positions = sequential_positions(80)
    with torch.no_grad():
        terms = layer.terms(x, q, k, positions)
        assert_close(causal_attention(q, k, v, terms), explicit(q, k, v, terms), atol=1e-5, rtol=1e-5)
    assert len(flex_on_cpu) == 1
    got = causal_attention(q, k, v, layer.terms(x, q, k, positions))  # the gate's gradient wanted, fp32: flex
    assert len(flex_on_cpu) == 2
    assert_close(got, explicit(q, k, v, layer.terms(x, q, k, positions)).detach(), atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = [t.bfloat16() for t in (q, k, v)]
        causal_attention(*half, layer.terms(x, *half[:2], positions))
    assert len(flex_on_cpu) == 2  # bf16 with a gradient: the channels


def test_the_dispatcher_takes_flex_for_fire_past_its_threshold_only_without_a_gradient(flex_on_cpu):
    pe = FIRE(SHAPE, init_threshold=60.0)
    torch.manual_seed(3)
    q, k, v = (torch.randn(BATCH, HEADS, 100, HEAD_DIM) for _ in range(3))
    for length, grad, flexed in ((61, True, 1), (100, True, 1), (100, False, 2)):  # 0..99 with a gradient: blocks
        with torch.set_grad_enabled(grad):
            terms = pe.layer(0).terms(None, q[:, :, :length], k[:, :, :length], sequential_positions(length))
            got = causal_attention(q[:, :, :length], k[:, :, :length], v[:, :, :length], terms)
            want = explicit(q[:, :, :length], k[:, :, :length], v[:, :, :length], terms)
        assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(flex_on_cpu) == flexed


def test_a_bias_without_a_score_mod_of_its_own_reaches_flex_by_its_other_forms():
    """Without a score_mod of its own the attention makes one from the bias's key or band form (Shaw's), or keeps
    SDPA (no bias)."""
    q, positions = torch.randn(1, HEADS, 8, HEAD_DIM), sequential_positions(8)
    assert NoPE(SHAPE).score_mod(q, positions, 0) is None
    assert ShawRelative(SHAPE, k=3).score_mod(q, positions, 0) is None
    assert ShawRelative(SHAPE, k=3, value_term=True).value_term(positions, 0) is not None
    assert ShawRelative(SHAPE, k=3).value_term(positions, 0) is None


@pytest.mark.parametrize("length", [1, 128, 300, 4096])
def test_causal_block_mask_is_causal(length):
    mask = causal_block_mask(length, torch.device("cpu"))
    assert mask.shape[-2:] == (length, length)
    dense = mask.to_dense()[0, 0].bool()  # (blocks, blocks): which blocks are visited at all
    assert torch.equal(dense, torch.ones_like(dense).tril())
    assert causal_block_mask(length, torch.device("cpu")) is mask  # built once per (length, device)


@pytest.mark.parametrize("pe", ["alibi", "t5", "kerple", "fox", "fire", "shaw", "shaw_value"])
def test_an_evaluation_sweep_compiles_flex_a_bounded_number_of_times_not_once_per_length(pe, monkeypatch):
    """Over a sweep's lengths (64 to 1024, past FIRE's threshold) the compiled kernel's graphs stop at 3: the first
    length, the next (one query block: torch specializes a size of 1), then dynamic shapes for every longer one.
    Counted as dynamo's graphs (the eager backend; inductor's CPU flex template does not build in torch 2.13 here),
    which is what a GPU's inductor compiles once each."""
    from functools import cache

    import torch._dynamo
    from torch._dynamo.utils import counters

    from lenext.model import Decoder

    @cache
    def compiled():
        return torch.compile(attention_module.flex_attention, backend="eager")

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    monkeypatch.setattr(attention_module, "compiled_flex_attention", compiled)
    pes = {"alibi": ALiBi, "t5": T5Bias, "kerple": KERPLE, "fox": FoX, "fire": FIRE, "shaw": ShawRelative}
    pes["shaw_value"] = partial(ShawRelative, value_term=True)
    torch.manual_seed(0)
    net = Decoder(vocab_size=97, d_model=64, n_layers=2, n_heads=4, train_len=64, pe=pes[pe]).eval()
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for length in (64, 128, 256, 512, 1024):
        tokens = torch.randint(0, 97, (1, length + 1), generator=torch.Generator().manual_seed(length))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net.token_nll(tokens[:, :-1], tokens[:, 1:])
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 3, 3, 3]


def shaw_with_values(clip: int = 3) -> ShawRelative:
    pe = ShawRelative(SHAPE, k=clip, value_term=True)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_(std=0.5)  # large enough that a wrong offset or weight changes the output
    return pe


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("length", [64, 200])
def test_the_dispatcher_sends_shaws_value_term_to_flex(length, positions, flex_on_cpu):
    """Shaw with a^V on CUDA: flex scores the band bias and gives its log-sum-exp, from which the band's weights and
    the value term follow; the float64 naive formula's output (forward: flex has no backward on a CPU)."""
    from tests.test_pe import naive_biased_attention

    pe, positions = shaw_with_values(), POSITIONS[positions](length)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen) for _ in range(3))
    with torch.no_grad():
        got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, positions))
        expected = naive_biased_attention(q, k, v, pe, 1, positions)
    assert len(flex_on_cpu) == 1
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def dense_flex(q, k, v, score_mod=None, block_mask=None, **aux):
    """flex_attention's definition written out, differentiable on a CPU: every score through ``score_mod``, the
    causal mask, softmax; out, or (out, the log-sum-exp) in flex's return convention when asked for it."""
    batch, heads, length, _ = q.shape
    b, h = torch.arange(batch)[:, None, None, None], torch.arange(heads)[None, :, None, None]
    i, j = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
    scores = score_mod(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, b, h, i, j).masked_fill(j > i, float("-inf"))
    out, logsumexp = scores.softmax(-1) @ v, scores.logsumexp(-1)
    if not aux:
        return out
    return out, SimpleNamespace(lse=logsumexp)


@pytest.fixture
def flex_by_definition(monkeypatch):
    """``causal_attention``'s CUDA FlexAttention branch taken on the CPU with ``dense_flex`` as the kernel, gradients
    included; each call recorded."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs.get("block_mask"))
        return dense_flex(*args, **kwargs)

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    monkeypatch.setattr(attention_module, "compiled_flex_attention", lambda: kernel)
    return calls


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("clip", [3, 64])  # 64 > L: every key in the band
def test_shaws_value_term_on_flex_has_the_naive_formulas_gradients(clip, positions, flex_by_definition):
    """The gradients through the band's weights, exp(score - log-sum-exp), and the value term: q, k, v and both
    tables against the float64 naive formula, with flex's definition (differentiable, float64) as the kernel."""
    from tests.test_pe import naive_biased_attention

    pe, length = shaw_with_values(clip).double(), 40
    positions = POSITIONS[positions](length)
    gen = torch.Generator().manual_seed(clip)
    q, k, v = (
        torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    weight = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64)
    inputs = [q, k, v, pe.key_table, pe.value_table]
    got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, positions))
    expected = naive_biased_attention(q, k, v, pe, 1, positions)
    assert_close(got, expected, atol=1e-12, rtol=1e-12)
    assert len(flex_by_definition) == 1
    got_grads = torch.autograd.grad((got * weight).sum(), inputs)
    for g, e in zip(got_grads, torch.autograd.grad((expected * weight).sum(), inputs), strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("positions", ["sequential", "randomized"])
@pytest.mark.parametrize("kind", ["t5", "t5_per_layer", "kerple", "kerple_power", "fire"])
def test_per_distance_score_mods_have_the_naive_formulas_gradients(kind, positions, flex_by_definition):
    """T5's, KERPLE's and FIRE's tables read by distance in a score_mod: outputs and gradients (q, k, v, the PE's
    parameters) of the naive float64 formula, with flex's definition as the kernel."""
    from tests.test_pe import make_bias_pe, naive_biased_attention

    if kind == "fire":  # every query below its threshold: a table by distance
        pe = FIRE(AttentionShape(d_model=4 * 8, n_heads=4, n_layers=2, train_len=16), init_threshold=4000.0)
        with torch.no_grad():
            for param in pe.parameters():
                param.normal_(std=0.5)
            pe.layers[1].c.abs_()
    else:
        pe = make_bias_pe(kind)
    if isinstance(pe, KERPLE):  # r1, r2 off their floor, where the formula's clamp has no gradient
        with torch.no_grad():
            pe.r1.abs_().add_(0.05)
            pe.r2.abs_().add_(0.05)
        pe.project_()
    pe, length = pe.double(), 40
    positions = POSITIONS[positions](length)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, length, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    weight = torch.randn(2, 4, length, 8, generator=gen, dtype=torch.float64)
    used = list(pe.layers[1].parameters() if isinstance(pe, FIRE) else pe.parameters())
    inputs = [q, k, v, *(p for p in used if p.requires_grad)]
    got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, positions))
    expected = naive_biased_attention(q, k, v, pe, 1, positions)
    assert len(flex_by_definition) == 1
    tolerance = 1e-6 if kind.startswith("kerple") else 1e-11  # KERPLE's table is fp32, as flex's scores
    assert_close(got, expected, atol=tolerance, rtol=tolerance)
    got_grads = torch.autograd.grad((got * weight).sum(), inputs, allow_unused=True)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs, allow_unused=True)
    for g, e in zip(got_grads, expected_grads, strict=True):
        if e is None:
            assert g is None or not g.any()
            continue
        assert_close(g, e, atol=tolerance, rtol=1e-5 if kind.startswith("kerple") else 1e-9)


@pytest.mark.parametrize("flex", [True, False], ids=["flex", "band_kernel"])
@pytest.mark.parametrize("bias_k, value_k", [(3, 5), (5, 3)])
def test_a_value_band_of_another_width_than_the_bias_band_is_exact_on_the_fused_paths(bias_k, value_k, flex, request):
    """A value term whose band is narrower or wider than the bias's (another PE's a^V beside it): the fused paths
    widen the narrower one; outputs and gradients as the explicit query blocks give them."""
    from lenext.pe.base import ScoreTerms

    bias_pe, value_pe = shaw_with_values(bias_k), shaw_with_values(value_k)
    positions = POSITIONS["randomized"](40)
    gen = torch.Generator().manual_seed(bias_k)
    q, k, v = (torch.randn(BATCH, HEADS, 40, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    weight = torch.randn(BATCH, HEADS, 40, HEAD_DIM, generator=gen)
    inputs = [q, k, v, bias_pe.key_table, value_pe.value_table]

    def terms():
        return ScoreTerms(bias_pe.layer(1).terms(None, q, k, positions).biases, value_pe.value_term(positions, 1))

    expected = explicit(q, k, v, terms())
    calls = request.getfixturevalue("flex_by_definition") if flex else []
    got = causal_attention(q, k, v, terms())
    assert len(calls) == flex
    assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got_grads = torch.autograd.grad((got * weight).sum(), inputs)
    for g, e in zip(got_grads, torch.autograd.grad((expected * weight).sum(), inputs), strict=True):
        assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_stick_breaking_with_a_value_term_is_refused():
    """The value term's band form needs a row's weights to sum to 1; stick-breaking's do not."""
    from lenext.errors import ConfigError
    from lenext.pe.base import ScoreTerms

    pe, positions = shaw_with_values(), sequential_positions(8)
    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    with pytest.raises(ConfigError, match=r"^attention.normalizer=stick_breaking is invalid with a value term"):
        causal_attention(q, q, q, ScoreTerms((), pe.value_term(positions, 0)), stick_breaking=True)
