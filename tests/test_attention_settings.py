"""The attention settings every PE takes (a sliding window, SSMax / log-length scaling) and the PEs made of PEs
(``Compose``, ``PerLayer``), against the naive float64 reference of tests/test_pe.py and by their definitions."""

import math
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import lenext.attention as attention_module
from lenext.attention import AttentionSettings, LengthScale, causal_attention
from lenext.errors import ConfigError
from lenext.model import Decoder
from lenext.pe import KERPLE, ALiBi, Compose, FoX, NoPE, PerLayer, PoPE, RoPE, Sinusoidal
from lenext.pe.base import sequential_positions
from lenext.pe.bias import ShawRelative
from lenext.pe.cope import CoPE
from lenext.pe.path import PaTH
from tests.test_pe import (
    BATCH,
    BIAS_KINDS,
    HEAD_DIM,
    HEADS,
    explicit_path,
    make_bias_pe,
    naive_biased_attention,
    widened_keys,
)

KINDS = ("nope", *BIAS_KINDS)


def attention_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + length)
    return [torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3)]


def run(kind, q, k, v, window=None, row_scale=None):
    pe = None if kind == "nope" else make_bias_pe(kind)
    positions = sequential_positions(q.size(-2))
    terms = pe.layer(1).terms(None, q, k, positions) if pe is not None else attention_module.NO_TERMS
    got = causal_attention(q, k, v, terms, window, row_scale)
    return got, naive_biased_attention(q, k, v, pe, 1, window=window, row_scale=row_scale), pe


@pytest.mark.parametrize("window", [1, 5, 64])
@pytest.mark.parametrize("length", [7, 150])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_sliding_window_matches_naive_reference(fused, kind, length, window, monkeypatch):
    """Each query attends to its last ``window`` keys only, whatever the PE: outputs and gradients of q, k, v and the
    PE's parameters equal the naive reference's (a window of 1: every row is its own value)."""
    if not fused:
        explicit_path(monkeypatch)
    monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * 16)  # several blocks
    q, k, v = attention_inputs(length)
    got, expected, pe = run(kind, q, k, v, window)
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    if window == 1:
        assert_close(got.double(), v.double() if kind != "shaw_value" else expected, atol=1e-5, rtol=1e-5)
    tensors = [q, k, v, *(pe.parameters() if pe is not None else [])]
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    got_grads = torch.autograd.grad((got * weight).sum(), tensors, allow_unused=True, retain_graph=True)
    expected_grads = torch.autograd.grad((expected * weight).sum(), tensors, allow_unused=True)
    for g, e in zip(got_grads, expected_grads, strict=True):
        if e is None or not e.abs().sum():
            continue  # FIRE's other layers, Shaw's value table without the value term
        assert_close(g.double(), e.double(), atol=1e-5, rtol=1e-4)


def row_scales(scale: str, length: int, window=None, train_len: int = 16) -> LengthScale:
    module = LengthScale(AttentionSettings(window=window, scale=scale), HEADS, train_len)
    if scale == "ssmax":
        with torch.no_grad():
            module.per_head.copy_(torch.tensor([0.2, 0.35, 0.5, 0.9]))  # apart, so a head mix-up shows
    return module


def test_length_scale_is_s_log_n_of_the_keys_attended():
    """SSMax's factor of row i is s_h log n_i, n_i = i + 1 keys (the window's W at most); ``logn`` is log n / log
    L_train, fixed; ``ssmax`` starts there and learns s_h per head."""
    ssmax = LengthScale(AttentionSettings(scale="ssmax"), HEADS, 64)
    logn = LengthScale(AttentionSettings(scale="logn"), HEADS, 64)
    assert [p.shape for p in ssmax.parameters()] == [(HEADS,)] and not list(logn.parameters())
    expected = torch.log(torch.arange(1, 201, dtype=torch.float64)) / math.log(64)
    for module in (ssmax, logn):
        assert_close(module(200, None, "cpu")[0, :, :, 0].double(), expected.expand(HEADS, -1), atol=1e-6, rtol=1e-6)
    windowed = logn(200, 50, "cpu")[0, 0, :, 0].double()
    assert_close(windowed, torch.log(torch.arange(1, 201).clamp(max=50).double()) / math.log(64), atol=1e-6, rtol=0)
    assert LengthScale(AttentionSettings(), HEADS, 64)(200, None, "cpu") is None


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("length", [7, 150])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_ssmax_scales_the_whole_logit_on_every_path(fused, kind, length, window, monkeypatch):
    """(q.k / sqrt(d) + bias) * s_h log n_i, biases included (the band path scales its band; a key bias becomes
    a row-scaled one on the explicit path): outputs and gradients, those of s_h included."""
    if not fused:
        explicit_path(monkeypatch)
    q, k, v = attention_inputs(length, seed=1)
    scale = row_scales("ssmax", length, window)
    row_scale = scale(length, window, q.device)
    got, expected, pe = run(kind, q, k, v, window, row_scale)
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    unscaled, _, _ = run(kind, q, k, v, window)
    assert not torch.allclose(got, unscaled, atol=1e-3)
    tensors = [q, k, v, scale.per_head]
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    got_grads = torch.autograd.grad((got * weight).sum(), tensors, retain_graph=True)
    expected_grads = torch.autograd.grad((expected * weight).sum(), tensors)
    # Logits scaled up to 4.5x (s_h 0.9 at 150 keys) keep fp32's relative precision, not its absolute one; s_h's
    # gradient sums every score of its head, and cancels to a small value.
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g.double(), e.double(), atol=1e-4 * e.abs().max().item(), rtol=1e-4)


def tiny(pe, attention=None, layers: int = 3) -> Decoder:
    torch.manual_seed(0)
    return Decoder(64, 16, pe, attention=attention, d_model=HEADS * HEAD_DIM, n_layers=layers, n_heads=HEADS)


def test_a_mix_of_one_pe_is_that_pe():
    """``PerLayer`` with one PE on every layer, and ``Compose`` of one PE, are that PE: same parameters drawn, same
    output (RoPE; ALiBi; FoX, whose gates are the layers' own)."""
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    for pe in (RoPE, ALiBi, FoX):
        alone = tiny(pe)(tokens)
        assert_close(tiny(partial(PerLayer, pes={"x": pe}, pattern=["x"]))(tokens), alone, atol=0, rtol=0)
        assert_close(tiny(partial(Compose, pes={"x": pe}))(tokens), alone, atol=0, rtol=0)


def test_per_layer_follows_the_pattern_and_windows_like_llama4_and_rnope_swa():
    """Layer l takes pattern[l % len(pattern)]: [rope, rope, rope, nope] makes layer l NoPE iff (l + 1) % 4 == 0, as
    Llama 4's nope_layer_interval; ``windows`` puts that PE's layers on a sliding window (RNoPE-SWA)."""
    pes = {"rope": RoPE, "nope": NoPE}
    model = tiny(partial(PerLayer, pes=pes, pattern=["rope"] * 3 + ["nope"], windows={"rope": 8}), layers=8)
    kinds = [type(block.attn.pe.pe[0]).__name__ for block in model.blocks]
    assert kinds == ["NoPE" if (layer + 1) % 4 == 0 else "RoPE" for layer in range(8)]
    assert [block.attn.window for block in model.blocks] == [None if k == "NoPE" else 8 for k in kinds]
    everywhere = tiny(partial(PerLayer, pes=pes, pattern=["rope"]), AttentionSettings(window=5), layers=2)
    assert [block.attn.window for block in everywhere.blocks] == [5, 5]


def test_per_layer_layers_take_their_pe_and_window():
    """A mix's output is each layer with its own PE and window: the same weights with the layers' attention set
    by hand give it exactly."""
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    pes = {"rope": RoPE, "alibi": ALiBi}
    mix = tiny(partial(PerLayer, pes=pes, pattern=["alibi", "rope"], windows={"rope": 4}), layers=2)
    by_hand = tiny(ALiBi, layers=2)
    rope = RoPE(mix.pe.shape)
    by_hand.blocks[1].attn.pe, by_hand.blocks[1].attn.window = rope.layer(1), 4
    assert_close(mix(tokens), by_hand(tokens), atol=0, rtol=0)


@pytest.mark.parametrize(
    "pes, pattern, windows, message",
    [
        ({"rope": RoPE}, ["nope"], None, "pe.pattern names 'nope', which is not one of pe.pes: it must be one of rope"),
        ({"rope": RoPE}, ["rope"], {"alibi": 4}, "pe.windows names 'alibi', which no layer takes"),
        ({"rope": RoPE, "nope": NoPE}, ["nope"], {"rope": 4}, "pe.windows names 'rope', which no layer takes"),
        ({"rope": RoPE}, [], None, "pe.pattern=[] is invalid"),
        ({"sin": Sinusoidal}, ["sin"], None, "pe.pes.sin (Sinusoidal) adds to the token embeddings"),
    ],
)
def test_per_layer_refuses_what_it_cannot_build(pes, pattern, windows, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        tiny(partial(PerLayer, pes=pes, pattern=pattern, windows=windows))


def test_compose_sums_biases_and_chains_transforms():
    """RoPE + ALiBi by ``Compose``: q, k rotated, ALiBi's bias added; the reference is ALiBi's naive attention on
    the rotated q and k."""
    pe = Compose(make_bias_pe("alibi").shape, {"rope": RoPE, "alibi": ALiBi})
    q, k, v = attention_inputs(60)
    positions = sequential_positions(60)
    layer = pe.layer(1)
    rotated = layer.rotate(q, k, positions)
    got = causal_attention(*rotated, v, layer.terms(None, *rotated, positions))
    assert_close(got.double(), naive_biased_attention(*rotated, v, pe.pes["alibi"], 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "pes, message",
    [
        (
            {"pope": PoPE, "rope": RoPE},
            "pe.pes.rope (RoPE) rotates q and k at the head's width, which pe.pes.pope (PoPE) widens: name it before "
            "pope",
        ),
        (
            {"cope": CoPE, "pope": PoPE},
            "pe.pes.cope (CoPE) reads q and k at the head's width, which pe.pes.pope (PoPE) widens: they cannot be "
            "composed",
        ),
        ({"pope": PoPE, "path": PaTH}, "pe.pes.path (PaTH) reads q and k"),
        ({"shaw": ShawRelative, "pope": PoPE}, "pe.pes.shaw (ShawRelative) reads q and k"),
        (
            {"pope": PoPE, "fox_rope": partial(Compose, pes={"fox": FoX, "rope": RoPE})},
            "pe.pes.fox_rope (Compose) rotates",
        ),
        ({"rope": partial(RoPE, scaling="self_extend"), "pope": PoPE}, "pe.pes.rope (RoPE) reads q and k"),
    ],
)
def test_compose_refuses_a_pe_that_cannot_take_popes_doubled_q_and_k(pes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny(partial(Compose, pes=pes))


def test_compose_takes_pope_in_another_layer_than_cope_and_drops_the_variants_it_cannot_serve():
    """A per-layer mix of PoPE and CoPE gives them different layers, so it composes with KERPLE; RoPE before PoPE
    serves every scaling but self_extend, whose logits read the widened q and k."""
    per_layer = partial(PerLayer, pes={"pope": PoPE, "cope": CoPE}, pattern=["pope", "cope"])
    mixed = tiny(partial(Compose, pes={"mix": per_layer, "kerple": KERPLE}), layers=2)
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    first_block = []
    mixed.blocks[0].register_forward_hook(lambda module, args, output: first_block.append(output))

    def run(parameter: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        first_block.clear()
        with torch.no_grad():
            saved = parameter.clone()
            before = (mixed(tokens), first_block[-1])
            # a drawn change, not a constant, which softmax would drop
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
            after = (mixed(tokens), first_block[-1])
            parameter.copy_(saved)
        return before, after

    # CoPE's embedding is layer 1's alone: layer 0 (PoPE) does not see it, the logits do; PoPE's phase reaches layer 0
    (logits, first), (logits_moved, first_moved) = run(mixed.blocks[1].attn.pe.parts[0].embedding)
    assert_close(first_moved, first, atol=0, rtol=0)
    assert not torch.allclose(logits_moved, logits)
    (_, first), (_, first_moved) = run(mixed.pe.pe0_mix.pe0_pope.phase_bias)
    assert not torch.allclose(first_moved, first)
    rope_pope = Compose(make_bias_pe("alibi").shape, {"rope": RoPE, "pope": PoPE})
    assert rope_pope.variants(["none", "linear", "self_extend"], 4 * 64) == ["none", "linear"]


def test_compose_refuses_two_pes_that_compute_the_logits_when_built_and_drops_such_a_variant():
    """PaTH and RoPE's Self-Extend each compute a layer's logits, which no sum of terms can merge: the model refuses
    them when it is built (not at its first forward, after the data is read), and a sweep over RoPE's scalings of
    RoPE + PaTH leaves out self_extend."""
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "pe.pes.rope (RoPE) and pe.pes.path (PaTH) each compute the attention logits themselves: they cannot be "
            "composed"
        ),
    ):
        tiny(partial(Compose, pes={"rope": partial(RoPE, scaling="self_extend"), "path": PaTH}))
    rope_path = Compose(make_bias_pe("alibi").shape, {"rope": RoPE, "path": PaTH})
    assert rope_path.variants(["none", "linear", "self_extend"], 4 * 64) == ["none", "linear"]


@pytest.mark.parametrize("pes", [{"pope": PoPE, "nope": NoPE}, {"nope": NoPE, "pope": PoPE}])
def test_pope_composed_with_nope_is_pope(pes):
    """PoPE doubles q and k; the members that neither read nor rotate them compose with it, in either order."""
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    alone, composed = tiny(PoPE), tiny(partial(Compose, pes=pes))
    assert_close(composed.token_nll(tokens[:, :-1], tokens[:, 1:]), alone.token_nll(tokens[:, :-1], tokens[:, 1:]))


@pytest.mark.parametrize(
    "window, scale, normalizer",
    [
        (5, "none", "softmax"),
        (None, "ssmax", "softmax"),
        (None, "logn", "softmax"),
        (5, "ssmax", "softmax"),
        (None, "none", "stick_breaking"),
        (5, "none", "stick_breaking"),
    ],
)
def test_a_decoder_layer_attends_as_its_attention_settings_say(window, scale, normalizer):
    """What reaches a layer's attention from ``attention.*``: its output equals float64 attention written from the
    settings' definitions (keys i - W < j <= i; logits times s_h log n_i or log n_i / log L_train, n_i the keys row
    i attends; softmax, or sb_ref's stick-breaking), from the layer's own q, k, v."""
    net = tiny(NoPE, AttentionSettings(window=window, scale=scale, normalizer=normalizer), layers=1)
    attn = net.blocks[0].attn
    if scale == "ssmax":  # heads apart, so that a head's scale given to another shows
        with torch.no_grad():
            attn.length_scale.per_head.copy_(torch.tensor([0.2, 0.5, 0.9, 1.4])[:HEADS])
    seen = []
    attn.register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    length = 30
    net(torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(0)))
    ((x, got),) = seen
    q, k, v = attn.qkv(x).double().view(2, length, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    attended = (j <= i) & ((i - j < window) if window else True)
    if normalizer == "stick_breaking":
        y = stick_breaking_reference(q, k, v, window)
    else:
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        n = attended.sum(-1).double()  # (L,)
        if scale == "ssmax":
            logits = logits * (attn.length_scale.per_head.double()[:, None, None] * n.log()[None, :, None])
        elif scale == "logn":
            logits = logits * (n.log() / math.log(16))[:, None]  # tiny(): L_train 16
        y = logits.masked_fill(~attended, float("-inf")).softmax(-1) @ v
    expected = attn.out(y.transpose(1, 2).reshape(2, length, -1).float())
    assert_close(got, expected, atol=2e-5, rtol=1e-4)


def stickbreaking(q, k, v, mask, cum_weight):
    """shawntan/stickbreaking-attention's ``sb_ref.stickbreaking`` (stickbreaking_attention/sb_ref.py, commit
    3147a38), verbatim: the package needs triton."""
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])

    original_dtype = logits.dtype

    logits = logits.float()
    log_z = F.logsigmoid(logits).masked_fill(mask, -1e5).to(original_dtype)

    log_beta = F.logsigmoid(-logits).masked_fill(mask, 0).to(original_dtype)

    re_cum_log_beta = torch.einsum("bhij,jk->bhik", log_beta, cum_weight.to(log_beta))
    log_att = log_z + re_cum_log_beta
    att = log_att.exp()
    return att @ v, 1 - att.sum(dim=-1)


def stick_breaking_reference(q, k, v, window=None):
    """As the package's tests run it (tests/test_attn.py ``ref_fwd``, attend_current False): keys before the query,
    the remainder on the query's own value; float64 (``.float()`` there made ``.double()``), a window masked too."""
    length = q.size(-2)
    mask = torch.ones(length, length).triu(0).bool()
    if window is not None:
        mask = mask | torch.ones(length, length).tril(-window).bool()
    original = torch.Tensor.float
    torch.Tensor.float = torch.Tensor.double
    try:
        out, remainder = stickbreaking(q, k, v, mask, torch.ones(length, length).tril(-1).double())
    finally:
        torch.Tensor.float = original
    return out + remainder[..., None] * v


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rows", [None, 1, 7])
@pytest.mark.parametrize("length", [1, 9, 60])
def test_stick_breaking_matches_the_reference_code_in_float64(length, rows, window, monkeypatch):
    """Outputs and gradients of q, k, v equal sb_ref's to 1e-10, in one block, single rows and blocks of 7 with their
    keys widened as for bf16 products on a CPU."""
    if rows is not None:
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * rows)
    if rows == 7:
        widened_keys(monkeypatch)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in "qkv")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = causal_attention(q, k, v, window=window, stick_breaking=True)
    expected = stick_breaking_reference(q, k, v, window)
    assert_close(got, expected, atol=1e-10, rtol=1e-10)
    if length == 1:
        assert_close(got, v)  # no key before the only query: all its weight on its own value
        return
    weight = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad((got * weight).sum(), [q, k, v])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [q, k, v])
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g, e, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("kind", ["kerple", "fire"])
def test_stick_breaking_breaks_the_stick_on_the_biased_logits(kind):
    """A pair bias (exact, not up to a row constant) enters the logits before the sticks break: the reference on
    q widened by ones and k by the bias per (i, j) is the same as the reference on the biased logits."""
    pe = make_bias_pe(kind)
    q, k, v = (t.detach().double() for t in attention_inputs(30))
    got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(30)), stick_breaking=True)
    with torch.no_grad():
        bias = pe.pair_bias(1)(sequential_positions(30), sequential_positions(30)).double()  # (1, H, L, L)
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM) + bias
    mask = torch.ones(30, 30).triu(0).bool()
    log_beta = F.logsigmoid(-logits).masked_fill(mask, 0)
    weights = (F.logsigmoid(logits).masked_fill(mask, -1e5) + log_beta @ torch.ones(30, 30).tril(-1).double()).exp()
    expected = weights @ v + (1 - weights.sum(-1, keepdim=True)) * v
    assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pe", [ALiBi, FoX, partial(PerLayer, pes={"alibi": ALiBi, "nope": NoPE}, pattern=["nope"])])
def test_stick_breaking_refuses_a_bias_given_up_to_a_row_constant(pe):
    """ALiBi's key bias, FoX's, T5's band are exact for softmax, which ignores a per-row constant; stick-breaking
    does not: the model refuses to build (a mix only for the layers that take such a PE)."""
    settings = AttentionSettings(normalizer="stick_breaking")
    if isinstance(pe, partial):
        tiny(pe, settings)  # the layers take NoPE only
        return
    with pytest.raises(ConfigError, match="attention.normalizer=stick_breaking is invalid with this PE"):
        tiny(pe, settings)


@pytest.mark.parametrize(
    "settings",
    [AttentionSettings(normalizer="stick_breaking"), AttentionSettings(scale="ssmax"), AttentionSettings(window=4)],
    ids=["stick_breaking", "ssmax", "window"],
)
def test_attention_settings_keep_the_decoder_causal_at_32x(settings):
    """Changing token t + 1 leaves the outputs of tokens 0..t unchanged, at 32 x L_train (16)."""
    model = tiny(RoPE, settings, layers=2).eval()
    tokens = torch.randint(0, 64, (1, 512), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 300] = (changed[0, 300] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert_close(before[:, :300], after[:, :300], atol=0, rtol=0)
    assert not torch.allclose(before[:, 300:], after[:, 300:])


@pytest.mark.parametrize("window", [1, 32, 500])
def test_windowed_blocks_keep_to_the_mask_budget(window, monkeypatch):
    """A block of r query rows sees r + W - 1 keys: the rows are chosen so that its mask stays within the
    budget (O(L W) in all), not as if each row saw W keys (which put all 2048 rows in one (L, L) block)."""
    budget_per_head = 4096
    monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * budget_per_head)
    blocks = spy_blocks(monkeypatch)
    q, k, v = (t.detach() for t in attention_inputs(2048))
    causal_attention(q, k, v, window=window)
    assert max(rows * keys for rows, keys in blocks) <= budget_per_head and len(blocks) > 1


@pytest.mark.parametrize("length, room, expected", [(1024, 341, [256] * 4), (10, 3, [2, 3, 2, 3]), (7, 7, [7])])
def test_query_blocks_are_the_fewest_within_the_budget_their_rows_spread_evenly(length, room, expected, monkeypatch):
    """1024 rows with room for 341 a block are 4 blocks of 256, not 3 of 341 and a last one of 1 row (a block's
    launches for almost no work); 10 with room for 3 are 2, 3, 2, 3."""
    monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", BATCH * HEADS * length * room)
    blocks = spy_blocks(monkeypatch)
    run("kerple", *(t.detach() for t in attention_inputs(length)))  # a pair bias: the explicit path
    assert [rows for rows, _ in blocks] == expected


def spy_blocks(monkeypatch) -> list[tuple[int, int]]:
    """The (query rows, keys) of each block the explicit path builds a bias for, appended as it runs."""
    blocks = []
    real = attention_module.explicit_bias

    def spy(*args, **kwargs):
        bias = real(*args, **kwargs)

        def block(start, end, first):
            blocks.append((end - start, end - first))
            return bias(start, end, first)

        return block

    monkeypatch.setattr(attention_module, "explicit_bias", spy)
    return blocks


@pytest.mark.parametrize("kind, window", [("nope", 5), ("alibi", None), ("kerple", None), ("kerple", 5)])
def test_float64_masks_without_gradients_match_the_naive_reference(kind, window):
    """The explicit path sends a mask that needs no gradient to SDPA's fused CPU kernel, which returned wrong values
    for float64 q, k, v with an fp32 mask (torch 2.13, no error): in float64, without gradients."""
    q, k, v = (t.detach().double() for t in attention_inputs(40))
    with torch.no_grad():
        got, expected, _ = run(kind, q, k, v, window)
    assert_close(got, expected.double(), atol=1e-7, rtol=1e-5)  # the biases are fp32; the bug was errors of ~1
