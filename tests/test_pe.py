"""Positional encodings against their papers' formulas (docs/pes/): worked examples, independent references, oracles.

Every reference here is written independently of ``lenext.pe`` (plain loops, float64, the papers'
rules) or taken from ``transformers`` (RoPE scalings, T5 buckets). Models are tiny: the whole
file runs in seconds on two CPU cores.
"""

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

import lenext.attention as attention_module
import lenext.attention.band as band_module
import lenext.pe.base as base_module
from lenext.attention import causal_attention
from lenext.errors import ConfigError, LengthNotSupported
from lenext.model import Decoder
from lenext.pe import (
    DAPE,
    FIRE,
    KERPLE,
    SCALINGS,
    ALiBi,
    AttentionShape,
    Compose,
    CoPE,
    FoX,
    Learned,
    NoPE,
    PaTH,
    PerLayer,
    PoPE,
    RoPE,
    ShawRelative,
    Sinusoidal,
    T5Bias,
    XPos,
    alibi_slopes,
    rope_frequencies,
    sinusoidal_table,
    t5_bucket,
)
from lenext.pe.base import BandValues, sequential_positions
from lenext.pe.rope import (
    ROPE_SCALINGS,
    ROTATIONS,
    TRANSFORMERS_ROPE_TYPES,
    RopeSettings,
    transformers_rope_parameters,
)
from lenext.positions import generator, pose_positions, randomized_positions
from tests.conftest import needs_transformers_models

VOCAB, TRAIN_LEN = 97, 16


def rotate(pe, q, k, positions=None):
    """pe.rotate at positions 0..L-1 unless others are given."""
    return pe.rotate(q, k, sequential_positions(q.size(-2)) if positions is None else positions)


def embed(pe, x, positions=None):
    return pe.embed(x, sequential_positions(x.size(1)) if positions is None else positions)


# Every PE the decoder can hold, with settings that exercise the interesting paths
# (Shaw clipped below the sequence length, YaRN with a real factor).
PES = {
    "nope": NoPE,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rope": RoPE,
    "rope_yarn": partial(RoPE, scaling="yarn", factor=4.0),
    "rope_self_extend": partial(RoPE, scaling="self_extend", factor=4.0, neighbor_window=4),
    "alibi": ALiBi,
    "t5": T5Bias,
    "shaw": partial(ShawRelative, k=4),
    "shaw_value": partial(ShawRelative, k=4, value_term=True),
    "kerple": KERPLE,
    "kerple_power": partial(KERPLE, kernel="power"),
    "fire": FIRE,
    "xpos": XPos,
    "p_rope": partial(RoPE, fraction=0.5),
    "fox": FoX,
    "cope": CoPE,
    "dape": partial(DAPE, base=KERPLE),
    "pope": PoPE,
    "path": PaTH,
    "fox_rope": partial(Compose, pes={"rope": RoPE, "fox": FoX}),
    "rope_nope": partial(PerLayer, pes={"rope": RoPE, "nope": NoPE}, pattern=["nope", "rope"]),
    "rnope_swa": partial(PerLayer, pes={"rope": RoPE, "nope": NoPE}, pattern=["rope", "nope"], windows={"rope": 5}),
}


def tiny_decoder(pe, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    net = Decoder(vocab_size=VOCAB, train_len=TRAIN_LEN, pe=pe, d_model=32, n_layers=2, n_heads=4)
    # PE parameters (learned APE, T5, Shaw tables) start at std 0.02: make a wrong position visible.
    with torch.no_grad():
        for param in net.pe_parameters():
            param.normal_(std=0.5)
    net.pe.project_()  # as after an optimizer step: KERPLE's r1, r2 back in their domain
    return net.eval()


def tokens(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# Sinusoidal
# --------------------------------------------------------------------------------------------


def test_sinusoidal_worked_example():
    """Seed 000: p = 2, d = 4 -> (sin 2, cos 2, sin 0.02, cos 0.02)."""
    expected = torch.tensor([math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)])
    assert_close(sinusoidal_table(3, 4)[2], expected)


@pytest.mark.parametrize("length, dim", [(1, 2), (7, 4), (50, 32), (300, 64)])
def test_sinusoidal_table_matches_formula(length, dim):
    expected = torch.empty(length, dim, dtype=torch.float64)
    for p in range(length):
        for t in range(dim // 2):
            angle = p / 10000 ** (2 * t / dim)
            expected[p, 2 * t], expected[p, 2 * t + 1] = math.sin(angle), math.cos(angle)
    assert_close(sinusoidal_table(length, dim), expected.float())


def test_sinusoidal_module_adds_the_table_and_grows_its_cache():
    pe = Sinusoidal(AttentionShape(d_model=8, n_heads=2, n_layers=1, train_len=4))
    for length in (5, 20, 3):  # grow, then shrink: the cached table must still be sliced right
        x = torch.randn(2, length, 8)
        assert_close(embed(pe, x), x + sinusoidal_table(length, 8))


# --------------------------------------------------------------------------------------------
# RoPE: worked example, relative property, explicit rotation reference
# --------------------------------------------------------------------------------------------


def rope_at(pe: RoPE, q: torch.Tensor, m: int, k: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """q placed at row m, k at row n of a (1, 1, length, d) tensor; returns rotated q_m . k_n (float64)."""
    dim = q.numel()
    qs, ks = torch.zeros(1, 1, length, dim), torch.zeros(1, 1, length, dim)
    qs[0, 0, m], ks[0, 0, n] = q, k
    qr, kr = rotate(pe, qs, ks)
    return qr[0, 0, m].double() @ kr[0, 0, n].double()


def test_rope_worked_example():
    """Seed 001: interleaved pairs, d = 4, q at m = 2, k at n = 5 -> q.k = 0.3683 (exact 0.368307...)."""
    pe = RoPE(AttentionShape(d_model=4, n_heads=1, n_layers=1, train_len=8))
    q, k = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.6, 0.7, 0.8])
    qs, ks = torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4)
    qs[0, 0, 2], ks[0, 0, 5] = q, k
    qr, kr = rotate(pe, qs, ks)
    assert_close(qr[0, 0, 2], torch.tensor([-0.2235, 0.0077, 0.2919, 0.4059]), atol=2e-4, rtol=0)
    dot = (qr[0, 0, 2] @ kr[0, 0, 5]).item()
    assert dot == pytest.approx(0.368307, abs=2e-5)
    assert round(dot, 4) == 0.3683
    # Depends only on n - m = 3: the same pair at m = 0, n = 3 gives the same score.
    assert rope_at(pe, q, 0, k, 3, 6).item() == pytest.approx(dot, abs=1e-6)


def rope_reference(x: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> torch.Tensor:
    """Interleaved-pair rotation written as explicit 2x2 matrices, float64. x: (..., L, d)."""
    x = x.double()
    out = torch.empty_like(x)
    position = torch.arange(x.size(-2), dtype=torch.float64)[:, None]
    angle = position * inv_freq.double()[None, :]  # (L, d/2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out * attention_factor


@pytest.mark.parametrize("scaling", [s for s in SCALINGS if s != "self_extend"])  # it rotates in ``logits``
@pytest.mark.parametrize("factor", [None, 2.0, 4.0])
def test_rope_rotate_matches_explicit_rotation(scaling, factor):
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=8)
    if scaling == "none" and factor is not None:  # a factor no scaling applies: refused, it changed nothing
        with pytest.raises(ConfigError, match=rf"^pe.factor={factor:g} changes nothing with pe.scaling=none"):
            RoPE(shape, scaling=scaling, factor=factor)
        return
    pe = RoPE(shape, scaling=scaling, factor=factor)
    for length in (8, 40):
        q, k = torch.randn(2, 2, length, 16), torch.randn(2, 2, length, 16)
        s = pe.scaling_factor(length)
        inv_freq, attention = rope_frequencies(16, 10000.0, scaling, s, length, 8)
        qr, kr = rotate(pe, q, k)
        assert_close(qr.double(), rope_reference(q, inv_freq, attention), atol=2e-5, rtol=1e-5)
        assert_close(kr.double(), rope_reference(k, inv_freq, attention), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling", [s for s in SCALINGS if s != "self_extend"])
@pytest.mark.parametrize("pe_class", [RoPE, XPos])
def test_a_float64_models_rotation_is_float64(pe_class, scaling):
    """A float64 model, the oracles' reference, rotates in float64: its table was complex64 (and q, k cast to fp32),
    7e-8 from the explicit rotation at 40 positions; xPos's decay too."""
    pe = pe_class(AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=8))
    pe.scaling = scaling  # factor null: s = L / C (what eval.variants switches)
    q, k = torch.randn(2, 2, 2, 40, 16, dtype=torch.float64).unbind()
    inv_freq, attention = rope_frequencies(16, 10000.0, scaling, pe.scaling_factor(40), 40, 8)
    expected_q, expected_k = rope_reference(q, inv_freq, attention), rope_reference(k, inv_freq, attention)
    if pe_class is XPos:
        zeta = (torch.arange(0, 16, 2, dtype=torch.float64) / 16 + 0.4) / 1.4
        decay = (zeta ** ((torch.arange(40, dtype=torch.float64)[:, None] - 20) / pe.scale_base)).repeat_interleave(
            2, -1
        )
        expected_q, expected_k = expected_q * decay, expected_k / decay
    got_q, got_k = rotate(pe, q, k)
    assert got_q.dtype == got_k.dtype == torch.float64
    assert_close(got_q, expected_q, atol=1e-13, rtol=1e-12)
    assert_close(got_k, expected_k, atol=1e-13, rtol=1e-12)
    assert rotate(pe, q.float(), k.float())[0].dtype == torch.float32  # and back: the table follows the input


RELATIVE_PAIRS = [(0, 3), (2, 5), (7, 10), (20, 23), (60, 63)]  # n - m = 3, also far beyond train_len = 8


@pytest.mark.parametrize(
    "scaling, factor",
    [("none", None), ("linear", 4.0), ("ntk", 4.0), ("dynamic_ntk", 2.0), ("yarn", 4.0), ("yarn", 16.0)],
)
@pytest.mark.parametrize("gap", [0, 3, 11])
def test_rope_score_depends_only_on_relative_position(scaling, factor, gap):
    pe = RoPE(AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=8), scaling=scaling, factor=factor)
    torch.manual_seed(gap)
    q, k = torch.randn(16), torch.randn(16)
    length = 64  # fixed, so dynamic NTK uses one base for every pair
    scores = torch.stack([rope_at(pe, q, m, k, m + gap, length) for m in (0, 2, 7, 20, 52)])
    assert_close(scores, scores[:1].expand_as(scores), atol=2e-5, rtol=1e-5)
    # ... and does depend on the gap (otherwise the property holds vacuously).
    other = rope_at(pe, q, 0, k, gap + 1, length)
    assert abs(other - scores[0]) > 1e-4


# --------------------------------------------------------------------------------------------
# RoPE scalings: transformers oracles, factor 1 identity, factor for a length
# --------------------------------------------------------------------------------------------


def hf_config(dim: int, base: float, train_len: int, rope_parameters: dict):
    transformers = pytest.importorskip("transformers")
    heads = 2
    return transformers.LlamaConfig(
        hidden_size=heads * dim,
        num_attention_heads=heads,
        max_position_embeddings=train_len,
        rope_parameters={"rope_theta": base, **rope_parameters},
    )


def hf_rope():
    pytest.importorskip("transformers")
    from transformers import modeling_rope_utils

    return modeling_rope_utils


ORACLE_GRID = pytest.mark.parametrize("dim", [16, 64, 128])
BASES = pytest.mark.parametrize("base", [10000.0, 500000.0])
FACTORS = pytest.mark.parametrize("factor", [2.0, 4.0, 8.0, 16.0])
TRAIN_LENS = (16, 512, 4096)


@pytest.mark.parametrize("scaling", list(TRANSFORMERS_ROPE_TYPES))
@needs_transformers_models
def test_the_rope_parameters_lenext_gives_transformers_are_complete_and_mean_lenexts_scaling(scaling, caplog):
    """What an export's config.json and eval.py hf='s variants hand transformers: every key its validation asks for
    and none it does not know (a warning per model load), and frequencies equal to lenext's scaling's, constants
    other than the defaults included."""
    hf = hf_rope()
    dim, base, train_len, length = 32, 10000.0, 64, 256
    settings = RopeSettings(dim, base, scaling, 4.0, length, train_len, beta_fast=16.0, low_freq_factor=2.0)
    parameters = transformers_rope_parameters(scaling, 4.0, train_len, settings)
    context = length if scaling == "llama3" else train_len  # Llama 3's config: the extended context, above C
    with caplog.at_level("WARNING", logger="transformers"):
        config = hf_config(dim, base, context, parameters)
    assert not caplog.records
    if scaling == "none":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, expected_attention = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        arguments = {"seq_len": length} if scaling == "dynamic_ntk" else {}
        expected, expected_attention = hf.ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, **arguments)
    got, attention = ROPE_SCALINGS[scaling](settings)
    assert_close(got.float(), expected, rtol=1e-5, atol=0)
    assert attention == pytest.approx(expected_attention)


@ORACLE_GRID
@BASES
@FACTORS
@needs_transformers_models
def test_linear_scaling_matches_transformers(dim, base, factor):
    hf = hf_rope()
    for train_len in TRAIN_LENS:
        config = hf_config(dim, base, train_len, {"rope_type": "linear", "factor": factor})
        expected, expected_attention = hf._compute_linear_scaling_rope_parameters(config)
        got, attention = rope_frequencies(dim, base, "linear", factor, 4 * train_len, train_len)
        assert got.dtype == torch.float64
        assert_close(got.float(), expected, rtol=1e-5, atol=0)
        assert attention == expected_attention == 1.0


@ORACLE_GRID
@BASES
@FACTORS
@needs_transformers_models
def test_dynamic_ntk_matches_transformers(dim, base, factor):
    hf = hf_rope()
    for train_len in TRAIN_LENS:
        config = hf_config(dim, base, train_len, {"rope_type": "dynamic", "factor": factor})
        for length in (train_len // 2, train_len, train_len + 1, 3 * train_len, 8 * train_len):
            expected, _ = hf._compute_dynamic_ntk_parameters(config, seq_len=length)
            got, attention = rope_frequencies(dim, base, "dynamic_ntk", factor, length, train_len)
            assert_close(got.float(), expected, rtol=1e-5, atol=0)
            assert attention == 1.0


@pytest.mark.parametrize("length", [8, 16, 17, 32, 64, 100])
@needs_transformers_models
def test_dynamic_ntk_of_a_second_stage_follows_each_sequences_length(length):
    """A stage fine-tuned at L' = 64 from C = 16 under dynamic NTK rotates a sequence of L tokens with
    transformers' dynamic frequencies at seq_len L, not at L' (which it took for every L < L' before)."""
    hf = hf_rope()
    dim, original = 8, 16
    pe = RoPE(
        AttentionShape(d_model=2 * dim, n_heads=2, n_layers=1, train_len=64), scaling="dynamic_ntk", original_len=16
    )
    config = hf_config(dim, 10000.0, original, {"rope_type": "dynamic", "factor": 1.0})
    inv_freq, _ = hf._compute_dynamic_ntk_parameters(config, seq_len=length)
    q = torch.randn(1, 2, length, dim, dtype=torch.float64)
    got, _ = pe.rotate(q, q, sequential_positions(length))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq.double()  # (L, d/2)
    pairs = torch.view_as_complex(q.reshape(1, 2, length, dim // 2, 2).contiguous()) * torch.polar(
        torch.ones_like(angles), angles
    )
    assert_close(got.double(), torch.view_as_real(pairs).flatten(-2), atol=1e-5, rtol=1e-5)  # transformers' fp32


@pytest.mark.parametrize("scaling", ["dynamic_ntk", "self_extend"])
def test_drawn_positions_share_one_table_whatever_their_batch(scaling):
    """Trained beyond C with drawn positions (randomized, PoSE), a window scores the same alone and batched with a
    window of a wider span, and steps do not rebuild the table: only a sequence at 0..L-1 follows its own length."""
    pe = RoPE(AttentionShape(64, 4, 1, 64, max_position=256), scaling=scaling, original_len=64)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 64, 16, generator=generator) for _ in range(2))
    near = torch.sort(torch.randperm(120, generator=generator)[:64])[0]
    far = torch.sort(torch.randperm(256, generator=generator)[:64])[0]

    def scored(q, k, positions):
        if scaling == "self_extend":
            return pe.logits(q, k, positions)(0, 64)
        rotated_q, rotated_k = pe.rotate(q, k, positions)
        return rotated_q @ rotated_k.transpose(-2, -1)

    alone = scored(q[:1], k[:1], near[None])
    batched = scored(q, k, torch.stack([near, far]))
    torch.testing.assert_close(batched[:1], alone, rtol=0, atol=0)


def test_yarn_refuses_beta_fast_at_or_below_beta_slow():
    """Reversed, YaRN would interpolate the highest frequencies and keep the lowest (transformers warns)."""
    for fast, slow in ((1.0, 32.0), (4.0, 4.0)):
        with pytest.raises(ConfigError, match=rf"pe\.beta_fast={fast} is invalid: it must exceed pe\.beta_slow={slow}"):
            RoPE(AttentionShape(16, 2, 1, 16), scaling="yarn", beta_fast=fast, beta_slow=slow)


@ORACLE_GRID
@BASES
@FACTORS
@needs_transformers_models
def test_static_ntk_matches_transformers_dynamic_at_factor_times_train_len(dim, base, factor):
    """Static NTK with factor s is HF's dynamic NTK with factor 1 at seq_len = s * L_train."""
    hf = hf_rope()
    for train_len in TRAIN_LENS:
        config = hf_config(dim, base, train_len, {"rope_type": "dynamic", "factor": 1.0})
        expected, _ = hf._compute_dynamic_ntk_parameters(config, seq_len=int(factor * train_len))
        got, attention = rope_frequencies(dim, base, "ntk", factor, 7, train_len)  # length is irrelevant
        assert_close(got.float(), expected, rtol=1e-5, atol=0)
        assert attention == 1.0
        # NTK-aware (bloc97 2023): base' = base * s^(d/(d-2)).
        formula = (base * factor ** (dim / (dim - 2))) ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        assert_close(got, formula, rtol=1e-12, atol=0)


@ORACLE_GRID
@BASES
@FACTORS
@needs_transformers_models
def test_yarn_matches_transformers(dim, base, factor):
    hf = hf_rope()
    for train_len in TRAIN_LENS:
        config = hf_config(
            dim,
            base,
            train_len,
            {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": train_len},
        )
        expected, expected_attention = hf._compute_yarn_parameters(config)
        got, attention = rope_frequencies(dim, base, "yarn", factor, 4 * train_len, train_len)
        assert_close(got.float(), expected, rtol=1e-5, atol=0)
        assert attention == pytest.approx(expected_attention, rel=1e-12)
        assert attention == pytest.approx(0.1 * math.log(factor) + 1.0, rel=1e-12)


@ORACLE_GRID
@BASES
@FACTORS
@pytest.mark.parametrize("low, high", [(1.0, 4.0), (2.0, 8.0)])
@needs_transformers_models
def test_llama3_matches_transformers(dim, base, factor, low, high):
    hf = hf_rope()
    for train_len in TRAIN_LENS:
        parameters = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": train_len,
        }
        expected, expected_attention = hf._compute_llama3_parameters(hf_config(dim, base, train_len, parameters))
        got, attention = rope_frequencies(dim, base, "llama3", factor, 4 * train_len, train_len, 32.0, 1.0, low, high)
        assert_close(got.float(), expected, rtol=1e-5, atol=0)
        assert attention == expected_attention == 1.0


@pytest.mark.parametrize(
    "scaling, settings",
    [
        ("yarn", {"beta_fast": 16.0, "beta_slow": 2.0}),
        ("llama3", {"low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    ],
)
@needs_transformers_models
def test_ropes_own_scaling_settings_reach_its_frequencies(scaling, settings):
    """pe.beta_fast/beta_slow (YaRN) and pe.low_freq_factor/high_freq_factor (Llama 3) set on ``RoPE`` give
    transformers' frequencies for the same settings (the defaults would not)."""
    hf = hf_rope()
    dim, train_len = 64, 256
    pe = RoPE(AttentionShape(dim * 2, 2, 1, train_len), scaling=scaling, factor=4.0, **settings)
    parameters = {"rope_type": scaling, "factor": 4.0, "original_max_position_embeddings": train_len, **settings}
    config = hf_config(dim, 10000.0, train_len, parameters)
    expected, expected_attention = getattr(hf, f"_compute_{scaling}_parameters")(config)
    got, attention = pe.frequencies(4 * train_len)
    assert_close(got.float(), expected, rtol=1e-5, atol=0)
    assert attention == pytest.approx(expected_attention, rel=1e-12)
    default = RoPE(AttentionShape(dim * 2, 2, 1, train_len), scaling=scaling, factor=4.0).frequencies(4 * train_len)
    assert not torch.allclose(default[0].float(), expected)


@ORACLE_GRID
@BASES
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("factor", [None, 4.0])
@needs_transformers_models
def test_p_rope_frequencies_match_transformers_proportional(dim, base, fraction, factor):
    """p-RoPE's frequencies are transformers' ``proportional`` RoPE (Gemma's ``rope_proportion``): the highest
    int(p * d // 2) of RoPE's kept as they are (also under position interpolation), the rest 0."""
    hf = hf_rope()
    parameters = {"rope_type": "proportional", "partial_rotary_factor": fraction, "factor": factor or 1.0}
    config = hf_config(dim, base, 16, parameters)
    config.head_dim = dim
    expected, _ = hf._compute_proportional_rope_parameters(config)
    shape = AttentionShape(d_model=2 * dim, n_heads=2, n_layers=1, train_len=16)
    pe = RoPE(shape, base=base, scaling="none" if factor is None else "linear", factor=factor, fraction=fraction)
    got, attention = pe.frequencies(64)
    assert_close(got.float(), expected, rtol=1e-6, atol=0)
    assert attention == 1.0


def test_p_rope_rounds_down_and_leaves_the_lowest_pairs_unrotated():
    """p = 0.3 of 32 frequencies rotates 9 (int(0.3 * 64 // 2), as the paper's code), not round(9.6) = 10: those
    9 pairs as RoPE rotates them, the other channels as they came, at every position."""
    shape = AttentionShape(d_model=128, n_heads=2, n_layers=1, train_len=16)
    pe, rope = RoPE(shape, fraction=0.3), RoPE(shape)
    assert pe.rotated_pairs == 9
    q, k = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
    (qp, kp), (qr, _) = rotate(pe, q, k), rotate(rope, q, k)
    assert_close(qp[..., :18], qr[..., :18], atol=0, rtol=0)
    assert_close(kp[..., 18:], k[..., 18:], atol=0, rtol=0)
    assert not torch.allclose(qp[..., 18:20], qr[..., 18:20])


def test_a_p_rope_fraction_that_rotates_nothing_is_refused():
    """p = 0.1 of a head dim of 16 rotates int(0.8) = 0 frequencies: it was taken, labelled 0.1, and trained NoPE."""
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=16)
    with pytest.raises(ConfigError, match=r"^pe.fraction=0.1 is invalid .* = 0 of its 8 frequencies.* at least 0.125$"):
        RoPE(shape, fraction=0.1)
    assert RoPE(shape, fraction=0.125).rotated_pairs == 1 and RoPE(shape, fraction=0).rotated_pairs == 0


@pytest.mark.parametrize("length", [7, 64, 600])
@pytest.mark.parametrize("scale_base", [512.0, 32.0])
def test_xpos_matches_x_transformers(length, scale_base):
    """x-transformers' RotaryEmbedding(use_xpos=True): q by scale^power, k by scale^-power (positions centred
    on L // 2, as here), interleaved pairs as here."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    head_dim, heads = 16, 2
    pe = XPos(AttentionShape(d_model=heads * head_dim, n_heads=heads, n_layers=1, train_len=16), scale_base=scale_base)
    rotary = xt.RotaryEmbedding(head_dim, use_xpos=True, scale_base=scale_base).double()  # float64 angles, as here
    freqs, scale = rotary(torch.arange(length))
    gen = torch.Generator().manual_seed(length)
    q, k = (torch.randn(1, heads, length, head_dim, generator=gen) for _ in range(2))
    for got, x, factor in zip(rotate(pe, q, k), (q, k), (scale, scale**-1), strict=True):
        expected = xt.apply_rotary_pos_emb(x.double(), freqs, factor)
        # fp32 here: errors relative to the largest entry (the decay factors reach ~1e4 at scale_base 32)
        assert_close(got.double(), expected, atol=1e-6 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("pair", [0, 3])
def test_xpos_scores_decay_with_distance_and_are_shift_invariant(pair):
    """A vector whose only nonzero pair is t, against itself: q_n . k_m = |x_t|^2 cos((n - m) theta_t)
    zeta_t^((n - m) / gamma) (Sun et al. 2022), for every n, m: a function of n - m that decays with it."""
    head_dim, gamma = 8, 8.0
    pe = XPos(AttentionShape(d_model=head_dim, n_heads=1, n_layers=1, train_len=16), scale_base=gamma)
    x = torch.zeros(1, 1, 64, head_dim)
    x[..., 2 * pair : 2 * pair + 2] = torch.tensor([0.6, -0.8])  # |x_t| = 1
    q, k = rotate(pe, x, x)
    scores = (q @ k.transpose(-2, -1))[0, 0].double()  # (64, 64)
    distance = (torch.arange(64)[:, None] - torch.arange(64)[None, :]).double()
    theta = 10000.0 ** (-2 * pair / head_dim)
    zeta = (2 * pair / head_dim + 0.4) / 1.4
    assert_close(scores, torch.cos(distance * theta) * zeta ** (distance / gamma), atol=1e-5, rtol=1e-5)


def test_xpos_tables_follow_the_length_and_an_evaluation_time_scaling():
    """Its q and k tables are cached: switching length or RoPE scaling (as eval.variants does) rebuilds them."""
    shape = AttentionShape(d_model=16, n_heads=2, n_layers=1, train_len=16)
    used, x = XPos(shape), torch.randn(1, 2, 40, 8)
    rotate(used, x[:, :, :20], x[:, :, :20])  # a cache for another length
    used.scaling, used.factor = "linear", 4.0
    fresh = XPos(shape)
    fresh.scaling, fresh.factor = "linear", 4.0
    for got, expected in zip(rotate(used, x, x), rotate(fresh, x, x), strict=True):
        assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(rotate(used, x, x)[0], rotate(XPos(shape), x, x)[0])


@pytest.mark.parametrize("scaling, factor", [("linear", 4.0), ("ntk", 4.0), ("yarn", 8.0)])
def test_xpos_under_an_evaluation_time_scaling_is_that_scaled_rope_times_the_unscaled_decay(scaling, factor):
    """docs/pes/xpos.md: a scaling applies to xPos's rotation as to RoPE's, the decay unchanged. Reference: RoPE
    with the scaling, each rotated pair then times zeta_t^((n - L // 2) / gamma) (q) or its inverse (k), from the
    paper's zeta_t = (2t/d + 0.4) / 1.4 in float64."""
    shape = AttentionShape(d_model=16, n_heads=2, n_layers=1, train_len=16)
    xpos, rope = XPos(shape, scale_base=32.0), RoPE(shape, scaling=scaling, factor=factor)
    xpos.scaling, xpos.factor = scaling, factor  # what eval.variants switches
    length, dim = 48, 8
    q, k = torch.randn(2, 1, 2, length, dim, dtype=torch.float64).unbind()
    zeta = (torch.arange(0, dim, 2, dtype=torch.float64) / dim + 0.4) / 1.4
    decay = zeta ** ((torch.arange(length, dtype=torch.float64)[:, None] - length // 2) / 32.0)  # (L, d/2)
    per_dim = decay.repeat_interleave(2, dim=-1)  # pair t is dimensions 2t, 2t + 1
    rotated_q, rotated_k = rotate(rope, q, k)
    got_q, got_k = rotate(xpos, q, k)
    assert_close(got_q, rotated_q * per_dim, rtol=1e-5, atol=1e-6)
    assert_close(got_k, rotated_k / per_dim, rtol=1e-5, atol=1e-6)


def test_xpos_refuses_lengths_whose_scores_overflow_fp32():
    pe = XPos(AttentionShape(d_model=8, n_heads=1, n_layers=1, train_len=16), scale_base=4.0)
    assert pe.position_limit == 255  # 2 * 4 * 40 / ln(3.5)
    x = torch.randn(1, 1, pe.position_limit, 8)
    q, k = rotate(pe, x, x)
    future = torch.ones(pe.position_limit, pe.position_limit, dtype=torch.bool).triu(1)
    scores = (q @ k.transpose(-2, -1)).masked_fill(future, float("-inf"))  # the explicit paths' masked scores
    assert torch.isfinite(scores.softmax(-1)).all()
    with pytest.raises(LengthNotSupported, match="at most 255 positions"):
        rotate(pe, torch.randn(1, 1, 256, 8), torch.randn(1, 1, 256, 8))
    # Training at such a length is refused when the model is built (the pre-flight), not at the first step.
    refused = (
        r"^pe.scale_base=4 is invalid: .* at most 255 positions, "
        r"fewer than the 512 training uses; it must be at least 9"
    )
    with pytest.raises(ConfigError, match=refused):
        XPos(AttentionShape(d_model=8, n_heads=1, n_layers=1, train_len=512), scale_base=4.0)


def test_yarn_ramp_direction():
    """High-frequency dims keep the original frequency, low-frequency dims are interpolated (not inverted)."""
    none, _ = rope_frequencies(128, 10000.0, "none", 1.0, 2048, 2048)
    yarn, _ = rope_frequencies(128, 10000.0, "yarn", 8.0, 8192, 2048)
    assert_close(yarn[:4], none[:4], rtol=1e-12, atol=0)
    assert_close(yarn[-4:], none[-4:] / 8.0, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dim, base, train_len", [(16, 10000.0, 16), (64, 10000.0, 512), (128, 500000.0, 4096)])
def test_factor_one_is_identity(scaling, dim, base, train_len):
    expected, _ = rope_frequencies(dim, base, "none", 1.0, train_len, train_len)
    got, attention = rope_frequencies(dim, base, scaling, 1.0, train_len, train_len)
    assert_close(got, expected, rtol=1e-12, atol=0)
    assert attention == 1.0


@pytest.mark.parametrize("pe_class", [RoPE, XPos])
def test_dynamic_ntk_beside_ntk_is_neither_evaluated_nor_different(pe_class):
    """Run in one forward pass, a window of length L gets dynamic NTK's factor L / C, NTK's: the two zero-shot
    variants rotate identically at every length, so a sweep asking for both evaluates NTK alone; a model trained
    with one drops the other only if its own factor follows the length too (a fixed factor differs)."""
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=16)
    pe = pe_class(shape)
    q, k = torch.randn(1, 2, 80, 16, dtype=torch.float64), torch.randn(1, 2, 80, 16, dtype=torch.float64)
    for length in (16, 24, 64, 80):
        with pe.variant("ntk"):
            ntk = rotate(pe, q[:, :, :length], k[:, :, :length])
        with pe.variant("dynamic_ntk"):
            dynamic = rotate(pe, q[:, :, :length], k[:, :, :length])
        for got, expected in zip(dynamic, ntk, strict=True):
            assert_close(got, expected, rtol=0, atol=0)
    assert pe.variants(["none", "ntk", "dynamic_ntk", "yarn"], 64) == ["none", "ntk", "yarn"]
    assert pe.variants(["none", "dynamic_ntk"], 64) == ["none", "dynamic_ntk"]
    trained_ntk = RoPE(AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=64), scaling="ntk", factor=4.0)
    assert trained_ntk.variants(["ntk", "dynamic_ntk"], 256) == ["ntk", "dynamic_ntk"]
    rope_ntk = RoPE(AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=64), scaling="ntk")  # s = L / C too
    assert rope_ntk.variants(["none", "ntk", "dynamic_ntk"], 256) == ["none", "ntk"]


# Every registered frequency scaling (a new one joins without an edit here); Self-Extend moves positions instead.
FREQUENCY_SCALINGS = [name for name in ROPE_SCALINGS if name not in ("none", *ROTATIONS)]


@pytest.mark.parametrize("scaling", FREQUENCY_SCALINGS)
def test_rope_factor_none_is_identity_at_train_len_and_scales_beyond(scaling):
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=16)
    plain, scaled = RoPE(shape), RoPE(shape, scaling=scaling, factor=None)
    q, k = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    for got, expected in zip(rotate(scaled, q, k), rotate(plain, q, k), strict=True):
        assert_close(got, expected, rtol=1e-6, atol=1e-6)

    long = 4 * 16
    if scaling == "dynamic_ntk":  # dynamic NTK grows its base with the length itself; s defaults to 1
        assert scaled.scaling_factor(long) == 1.0
        assert scaled.scaling_factor(16) == 1.0
    else:
        assert scaled.scaling_factor(long) == 4.0
        assert scaled.scaling_factor(16) == 1.0
        assert scaled.scaling_factor(8) == 1.0  # never compresses below the training length
    expected_freq, expected_attention = rope_frequencies(16, 10000.0, scaling, scaled.scaling_factor(long), long, 16)
    freq, attention = scaled.frequencies(long)
    assert_close(freq, expected_freq, rtol=0, atol=0)
    assert attention == expected_attention
    # ... and the rotation at that length really differs from the unscaled one.
    q, k = torch.randn(1, 2, long, 16), torch.randn(1, 2, long, 16)
    assert not torch.allclose(rotate(scaled, q, k)[0], rotate(plain, q, k)[0], atol=1e-3)
    assert_close(
        rotate(scaled, q, k)[0].double(), rope_reference(q, expected_freq, expected_attention), atol=2e-5, rtol=1e-5
    )


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn", "llama3"])
def test_rope_scalings_refer_to_the_positions_training_reached(scaling):
    """Trained at positions up to N (randomized positions, PoSE), RoPE's scalings are the identity up to N and
    scale by span / N beyond it: positions below N were trained, not extrapolated."""
    shape = AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=16, max_position=256)
    scaled, plain = RoPE(shape, scaling=scaling), RoPE(shape)
    assert scaled.scaling_factor(256) == 1.0 and scaled.scaling_factor(1024) == 4.0
    positions = randomized_positions(2, 16, 256, generator(0))
    q, k = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    for got, expected in zip(rotate(scaled, q, k, positions), rotate(plain, q, k, positions), strict=True):
        assert_close(got, expected, rtol=1e-6, atol=1e-6)
    far = positions * 4  # spanning ~1024: scaled now
    assert not torch.allclose(rotate(scaled, q, k, far)[0], rotate(plain, q, k, far)[0], atol=1e-3)


def test_rope_cache_follows_length_and_overrides():
    """Rotations are cached per (length, scaling): switching scaling or factor at eval must take effect."""
    shape = AttentionShape(d_model=16, n_heads=1, n_layers=1, train_len=8)
    pe = RoPE(shape)
    q = torch.randn(1, 1, 32, 16)
    rotate(pe, q, q)
    pe.scaling, pe.factor = "linear", 4.0  # eval-time override, as `pe.scaling=... pe.factor=...` does
    inv_freq, _ = rope_frequencies(16, 10000.0, "linear", 4.0, 32, 8)
    assert_close(rotate(pe, q, q)[0].double(), rope_reference(q, inv_freq, 1.0), atol=2e-5, rtol=1e-5)
    inv_freq, _ = rope_frequencies(16, 10000.0, "linear", 4.0, 10, 8)
    assert_close(
        rotate(pe, q[:, :, :10], q[:, :, :10])[0].double(),
        rope_reference(q[:, :, :10], inv_freq, 1.0),
        atol=2e-5,
        rtol=1e-5,
    )


# --------------------------------------------------------------------------------------------
# T5 buckets and ALiBi slopes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64), (64, 256), (8, 20), (2, 8)])
@needs_transformers_models
def test_t5_buckets_match_transformers(num_buckets, max_distance):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    distance = torch.arange(0, 10001)
    expected = T5Attention._relative_position_bucket(
        relative_position=-distance, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance
    )
    got = t5_bucket(distance, num_buckets, max_distance)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Future keys (negative distance) share bucket 0, as in T5's causal buckets.
    assert (t5_bucket(-torch.arange(1, 50), num_buckets, max_distance) == 0).all()


def t5_bucket_reference(n: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5: bucket = n if n < B/2 else min(B-1, B/2 + floor(ln(n/(B/2)) / ln(D/(B/2)) * (B - B/2)))."""
    n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(num_buckets - 1, far)


def test_t5_bucket_formula_spot_values():
    got = t5_bucket(torch.tensor([0, 1, 15, 16, 17, 31, 32, 64, 100, 127, 128, 10**6]), 32, 128)
    expected = [t5_bucket_reference(int(n)) for n in (0, 1, 15, 16, 17, 31, 32, 64, 100, 127, 128, 10**6)]
    assert got.tolist() == expected
    assert expected[:5] == [0, 1, 15, 16, 16] and expected[-1] == 31


def alibi_get_slopes(n: int) -> list[float]:
    """The ALiBi repository's ``get_slopes`` (Press et al. 2022), verbatim in spirit."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + alibi_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


@pytest.mark.parametrize("n_heads", sorted(set(range(1, 33)) | {6, 12, 24}))
def test_alibi_slopes_match_paper(n_heads):
    got = alibi_slopes(n_heads)
    assert got.shape == (n_heads,)
    assert_close(got.double(), torch.tensor(alibi_get_slopes(n_heads), dtype=torch.float64), rtol=1e-7, atol=0)


def test_alibi_slopes_eight_heads():
    assert_close(alibi_slopes(8), torch.tensor([2.0**-h for h in range(1, 9)]), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Biased attention: every path of causal_attention against a naive float64 reference
# --------------------------------------------------------------------------------------------

BATCH, HEADS, HEAD_DIM = 2, 4, 8


def make_bias_pe(kind: str, n_layers: int = 2) -> torch.nn.Module:
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=n_layers, train_len=16)
    pe = {
        "alibi": lambda: ALiBi(shape),
        "t5": lambda: T5Bias(shape),
        "t5_per_layer": lambda: T5Bias(shape, num_buckets=16, max_distance=40, per_layer=True),
        "shaw": lambda: ShawRelative(shape, k=3),
        "shaw_value": lambda: ShawRelative(shape, k=3, value_term=True),
        "kerple": lambda: KERPLE(shape),
        "kerple_power": lambda: KERPLE(shape, kernel="power"),
        "fire": lambda: FIRE(shape, hidden=8, init_threshold=5.0),  # L_thr 5: rows past it are normalised
    }[kind]()
    torch.manual_seed(123)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_(std=0.5)  # large enough that a wrong bucket/offset changes the output
    pe.project_()
    return pe


def naive_biased_attention(q, k, v, pe, layer: int, positions=None, window=None, row_scale=None) -> torch.Tensor:
    """softmax((q k^T / sqrt(d) + bias(p_i, p_j)) * row_scale_i + causal -inf) v (+ Shaw's a^V), float64, bias built
    per (i, j) from the tokens' positions p (B or 1, L), 0..L-1 by default (None: NoPE, no bias); the causal mask,
    and the ``window`` (keys j > i - window), by index."""
    q, k, v = q.double(), k.double(), v.double()
    length, head_dim = q.size(-2), q.size(-1)
    positions = torch.arange(length)[None] if positions is None else positions
    i, j = positions[:, None, :, None], positions[:, None, None, :]  # (B or 1, 1, L, 1), (B or 1, 1, 1, L)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    value_offsets = None
    if isinstance(pe, ALiBi):
        slopes = torch.tensor(alibi_get_slopes(q.size(1)), dtype=torch.float64)
        scores = scores - slopes[:, None, None] * (i - j)
    elif isinstance(pe, T5Bias):
        table = pe.table.double()[layer if pe.per_layer else 0]  # (buckets, H)
        far = int(positions.max()) + 1
        by_distance = torch.tensor([t5_bucket_reference(n, pe.num_buckets, pe.max_distance) for n in range(far)])
        buckets = by_distance[(i - j)[:, 0].clamp(min=0)]  # (B or 1, L, L); j > i is masked below
        scores = scores + table[buckets].permute(0, 3, 1, 2)  # (B or 1, H, L, L)
    elif isinstance(pe, ShawRelative):
        clipped = (j - i)[:, 0].clamp(-pe.k, pe.k) + pe.k  # (B or 1, L, L)
        a_key = pe.key_table.double()[layer][clipped]  # (B or 1, L, L, d): the tensor the model never builds
        scores = scores + torch.einsum("bhid,bijd->bhij", q, a_key.expand(q.size(0), -1, -1, -1)) / math.sqrt(head_dim)
        if pe.value_table is not None:
            value_offsets = pe.value_table.double()[layer][clipped].expand(q.size(0), -1, -1, -1)
    elif isinstance(pe, KERPLE):  # Chi et al. 2022, r1, r2 clamped to [0.01, ...] (power: r2 <= 2)
        r1 = pe.r1[layer].clamp(min=0.01).double()[:, None, None]  # clamped as stored (fp32), as the official code
        r2 = pe.r2[layer].clamp(0.01, 2.0 if pe.kernel == "power" else None).double()[:, None, None]
        distance = (i - j).clamp(min=0).double()
        scores = scores + (-r1 * torch.log(1 + r2 * distance) if pe.kernel == "log" else -r1 * distance**r2)
    elif isinstance(pe, FIRE):  # Li et al. 2023: f(psi(i - j) / psi(max(L_thr, i))), psi(x) = log(c x + 1)
        fire = pe.layers[layer]
        c, threshold = fire.c.double(), (fire.threshold_multiplier.double() * fire.init_threshold.double()).abs()
        psi_distance = torch.log(c.abs() * (i - j).abs() + 1)
        normalized = psi_distance / (torch.log(c.abs() * torch.clamp(i, min=threshold) + 1) + 1e-6)  # (B|1, 1, L, L)
        first, last = fire.mlp[0], fire.mlp[2]
        hidden = torch.relu(normalized[..., None] * first.weight.double()[:, 0] + first.bias.double())  # (.., hidden)
        scores = scores + (hidden @ last.weight.double().t() + last.bias.double())[:, 0].permute(0, 3, 1, 2)
    elif pe is not None:
        raise AssertionError(type(pe))
    if row_scale is not None:
        scores = scores * row_scale.double()
    future = torch.arange(length)[None, :] > torch.arange(length)[:, None]
    if window is not None:
        future = future | (torch.arange(length)[None, :] <= torch.arange(length)[:, None] - window)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = probs @ v
    if value_offsets is not None:
        out = out + torch.einsum("bhij,bijd->bhid", probs, value_offsets)
    return out


BLOCKINGS = {  # (BandedAttention's BAND_ROWS, the explicit path's query rows per block) for L rows
    "default": lambda length: (band_module.BAND_ROWS, None),
    "small": lambda length: (5, max(2, length // 3)),  # T5's band (W 113) spans many 5-row steps
    "single_row": lambda length: (1, 1),
}


def use_blocking(monkeypatch, blocking: str, length: int, batch: int = BATCH) -> None:
    band_rows, query_rows = BLOCKINGS[blocking](length)
    monkeypatch.setattr(band_module, "BAND_ROWS", band_rows)
    if query_rows is not None:
        monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", batch * HEADS * length * query_rows)


def explicit_path(monkeypatch) -> None:
    """What runs without the fused kernels (older torch, other devices): the bias in query blocks, from whichever
    form the PE gives (key, band or pair), with the causal mask added."""
    monkeypatch.setattr(attention_module, "cpu_flash", lambda: False)
    monkeypatch.setattr(attention_module, "fused_mask_with_causal", lambda device_type: False)


def widened_keys(monkeypatch) -> None:
    """Every query block from key 0 takes its products over widened keys (``widened_end``), as bf16 products on a
    CPU do, in any dtype: a float64 oracle then checks that the keys added are dropped."""
    monkeypatch.setattr(base_module, "kernel_dtype", lambda x: torch.bfloat16)


BIAS_KINDS = ("alibi", "t5", "t5_per_layer", "shaw", "shaw_value", "kerple", "kerple_power", "fire")


@pytest.mark.parametrize("blocking", BLOCKINGS)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("length", [7, 64, 300])
@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_biased_attention_matches_naive_reference(fused, kind, length, grad, blocking, monkeypatch):
    """Every path (fused kernels or explicit blocks) at lengths below, near and beyond T5's band,
    with and without autograd (on the explicit path, a mask that needs grad gets its scores written out, one that
    does not goes to SDPA)."""
    if not fused:
        explicit_path(monkeypatch)
    use_blocking(monkeypatch, blocking, length)
    pe = make_bias_pe(kind)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen) for _ in range(3))
    layer = 1
    with torch.set_grad_enabled(grad):
        got = causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, sequential_positions(q.size(-2))))
    assert got.dtype == torch.float32 and got.shape == q.shape
    with torch.no_grad():
        expected = naive_biased_attention(q, k, v, pe, layer)
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("kind", BIAS_KINDS)
def test_a_float64_models_biased_attention_is_float64_throughout(kind, grad):
    """A float64 model, the oracles' reference, computes its bias and attention in float64: T5's and Shaw's band
    went through fp32 (BandedAttention, the band's mask) and KERPLE's kernel too, 1e-7 off (found by an audit)."""
    pe = make_bias_pe(kind).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 0.5)
    if isinstance(pe, KERPLE):
        pe.project_()  # r1, r2 back in their range, as after every optimizer step
    q, k, v = (torch.randn(BATCH, HEADS, 300, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3))
    with torch.set_grad_enabled(grad):
        got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(300)))
    assert got.dtype == torch.float64
    with torch.no_grad():
        assert_close(got, naive_biased_attention(q, k, v, pe, 1), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("length, blocking", [(20, "default"), (150, "default"), (150, "small"), (9, "single_row")])
@pytest.mark.parametrize("kind", ["t5", "t5_per_layer", "shaw", "shaw_value", "kerple", "kerple_power", "fire"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_biased_attention_gradients_match_naive_reference(fused, kind, length, blocking, monkeypatch):
    """Gradients through causal_attention (q, k, v and the learned tables) equal the naive reference's.

    150 rows hold T5's band and keys beyond it, across BandedAttention's steps and query blocks.
    """
    if not fused:
        explicit_path(monkeypatch)
    use_blocking(monkeypatch, blocking, length, batch=1)
    pe = make_bias_pe(kind)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    weight = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen)
    used = pe.layers[1].parameters() if isinstance(pe, FIRE) else pe.parameters()  # FIRE: one module per layer
    inputs = [q, k, v, *used]
    out = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(length)))
    got = torch.autograd.grad((out * weight).sum(), inputs)
    expected = torch.autograd.grad((naive_biased_attention(q, k, v, pe, layer=1) * weight).sum(), inputs)
    for g, e in zip(got, expected, strict=True):
        assert e.abs().sum() > 0
        assert_close(g, e.float(), atol=1e-5, rtol=1e-4)


DRAWN = {  # positions (B or 1, L) other than 0..L-1, as randomized positions and PoSE give them
    "randomized": lambda batch, length: randomized_positions(batch, length, 4 * length, generator(length)),
    "randomized_shared": lambda batch, length: randomized_positions(1, length, 4 * length, generator(length)),
    "pose": lambda batch, length: pose_positions(batch, length, 8 * length, 3, generator(length)),
}


@pytest.mark.parametrize("drawn", DRAWN)
@pytest.mark.parametrize("blocking", ["default", "small"])
@pytest.mark.parametrize("length", [7, 150])
@pytest.mark.parametrize("kind", BIAS_KINDS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
def test_biased_attention_at_drawn_positions_matches_naive_reference(fused, kind, length, blocking, drawn, monkeypatch):
    """Every path stays exact at increasing positions with gaps: ALiBi's key bias for any positions, T5's and
    Shaw's bands because keys W indices back are W positions back; outputs and gradients."""
    if not fused:
        explicit_path(monkeypatch)
    use_blocking(monkeypatch, blocking, length)
    pe = make_bias_pe(kind)
    positions = DRAWN[drawn](BATCH, length)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(3))
    weight = torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=gen)
    used = list(pe.layers[1].parameters() if isinstance(pe, FIRE) else pe.parameters())
    got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, positions))
    expected = naive_biased_attention(q, k, v, pe, 1, positions)
    # ALiBi's fp32 key bias is anchored at the last key: over PoSE's span of 1200 positions its values reach
    # 600, whose fp32 spacing (6e-5) is the bias error of the first rows' keys.
    tolerance = 1e-4 if kind == "alibi" else 1e-5
    assert_close(got.double(), expected, atol=tolerance, rtol=1e-5)
    # ... and the positions matter: at 0..L-1 the output is another one.
    assert not torch.allclose(
        got, causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(length))), atol=1e-4
    )
    inputs = [q, k, v, *used]
    got_grads = torch.autograd.grad((got * weight).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert_close(g, e.float(), atol=tolerance, rtol=1e-4)


@pytest.mark.parametrize("threshold", [1000.0, 20.0, 0.5])  # every row before L_thr, some, none
def test_fire_rows_before_the_threshold_take_the_per_distance_table_exactly(threshold):
    torch.manual_seed(0)
    fire = FIRE(AttentionShape(d_model=16, n_heads=4, n_layers=1, train_len=16), init_threshold=threshold).layers[0]
    i, j = torch.arange(40), torch.arange(40)
    every_pair = fire._by_pair(i, j, (fire.threshold_multiplier * fire.init_threshold).abs())
    causal = j[None, :] <= i[:, None]
    assert_close(fire(i, j)[:, causal], every_pair[:, causal], atol=1e-6, rtol=1e-6)


def test_fire_bias_is_the_same_when_its_mlp_runs_in_row_chunks(monkeypatch):
    import lenext.pe.fire as fire_module

    pe = make_bias_pe("fire")
    whole = pe.layers[1](torch.arange(30), torch.arange(40))
    monkeypatch.setitem(fire_module.HIDDEN_ELEMENTS, "cpu", 3 * 40 * 8)  # 3 rows per chunk, the last one partial
    # To an fp32 ulp, not bitwise: the GEMM's kernel for a block of rows depends on how many rows it gets (MKL
    # capped at AVX2 rounded 2 of 4800 values differently); a chunking mistake moves rows, far beyond this.
    assert_close(pe.layers[1](torch.arange(30), torch.arange(40)), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["log", "power"])
def test_kerple_training_keeps_r1_r2_where_the_official_in_place_clamp_does(kernel):
    """Three SGD steps large enough to push r1, r2 out of their domain: projecting after each step (lenext)
    gives the parameters the official code has after its clamp before each use, step for step."""
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, train_len=16)
    torch.manual_seed(0)
    pe = KERPLE(shape, kernel=kernel)
    r1, r2 = pe.r1.detach().clone().requires_grad_(), pe.r2.detach().clone().requires_grad_()
    high = 2.0 if kernel == "power" else None
    q, k, v = (torch.randn(1, HEADS, 24, HEAD_DIM, generator=torch.Generator().manual_seed(s)) for s in range(3))
    i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
    distance = (i - j).clamp(min=0).float()
    for _ in range(3):
        with torch.no_grad():  # the official code: clamp the stored values in place, then use them
            r1.clamp_(min=0.01), r2.clamp_(0.01, high)
        a, b = r1[0][:, None, None], r2[0][:, None, None]
        bias = -a * torch.log(1 + b * distance) if kernel == "log" else -a * distance**b
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM) + bias).masked_fill(j > i, float("-inf"))
        official = scores.softmax(-1) @ v
        ours = causal_attention(q, k, v, pe.layer(0).terms(None, q, k, sequential_positions(q.size(-2))))
        assert_close(ours, official, atol=1e-5, rtol=1e-5)
        for params, out in (((r1, r2), official), ((pe.r1, pe.r2), ours)):
            grads = torch.autograd.grad(out.square().sum() * 1e2, params)  # steps that leave the domain
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    param -= grad
        pe.project_()
        assert (pe.r1 >= 0.01).all() and (pe.r2 >= 0.01).all() and (high is None or (pe.r2 <= high).all())
    with torch.no_grad():
        r1.clamp_(min=0.01), r2.clamp_(0.01, high)
    assert_close(pe.r1.detach(), r1, atol=1e-5, rtol=1e-4)
    assert_close(pe.r2.detach(), r2, atol=1e-5, rtol=1e-4)
    assert (pe.r1 == 0.01).any() or (pe.r2 == 0.01).any() or (pe.r2 == 2.0).any()  # the floor was reached


@pytest.mark.parametrize("kind", ["t5", "shaw"])
def test_banded_attention_under_bf16_autocast_scores_the_band_in_fp32(kind):
    """bf16 q, k, v under autocast stay close to the float64 reference on the same inputs.

    Autocast would run the band's matmuls in bf16 too: that rounding doubled the worst error here
    (T5 0.089, Shaw 0.045 against 0.027 and 0.025 with the band in fp32).
    """
    pe = make_bias_pe(kind)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, 600, HEAD_DIM, generator=gen).mul(2).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(q.size(-2))))
    assert got.dtype == torch.bfloat16
    assert (got.double() - naive_biased_attention(q, k, v, pe, layer=1)).abs().max() < 0.035


def test_alibi_under_bf16_autocast_keeps_long_offsets(monkeypatch):
    """The key-only ALiBi mask must stay fp32 under bf16 (docs/pes/index.md, "Attention paths").

    In bf16, offsets m * (j - anchor) beyond 256 positions round by whole slope units:
    with the mask cast to bf16 the output was off by ~1; with an fp32 mask it is off by ~0.02.
    """
    length = 1536
    pe = ALiBi(AttentionShape(d_model=HEADS * 16, n_heads=HEADS, n_layers=1, train_len=16))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, 16, generator=gen).bfloat16() for _ in range(3))
    expected = naive_biased_attention(q, k, v, pe, layer=0)
    for fused in (True, False):  # the fused key-only path, then query blocks of 512 rows
        if not fused:
            explicit_path(monkeypatch)
            monkeypatch.setitem(attention_module.SCORE_BLOCK_ELEMENTS, "cpu", HEADS * length * 512)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = causal_attention(q, k, v, pe.layer(0).terms(None, q, k, sequential_positions(q.size(-2))))
        assert (got.double() - expected).abs().max() < 0.06


def test_alibis_fp32_key_bias_rounds_each_row_at_the_size_of_its_distance_to_the_last_key():
    """docs/pes/alibi.md: inside the fused kernel a row i's logits are added to biases near m (last - i), so they round
    at that size (fp32's spacing, 2^-24 of it); the last rows keep fp32's precision. A bias anchored elsewhere (the
    first key) would break the second bound."""
    length = 2048
    pe = ALiBi(AttentionShape(d_model=HEADS * 16, n_heads=HEADS, n_layers=1, train_len=16))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        got = causal_attention(q, k, v, pe.layer(0).terms(None, q, k, sequential_positions(length)))
    error = (got.double() - naive_biased_attention(q, k, v, pe, layer=0)).abs().amax(dim=(0, 1, 3))  # per row
    steepest = float(pe.head_slopes(torch.device("cpu")).max())
    assert error.max() < 8 * steepest * length * 2**-24
    assert error[-64:].max() < 8 * steepest * 64 * 2**-24 + 1e-6


# --------------------------------------------------------------------------------------------
# Shaw: efficient path vs the (L, L, d_head) formula
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [5, 20, 40])
@pytest.mark.parametrize("clip", [2, 3, 64])  # 64 >= L: no effective clipping
@pytest.mark.parametrize("value_term", [False, True])
def test_shaw_matches_naive_formula(length, clip, value_term):
    shape = AttentionShape(d_model=3 * 8, n_heads=3, n_layers=2, train_len=16)
    pe = ShawRelative(shape, k=clip, value_term=value_term)
    assert pe.key_table.shape == (2, 2 * clip + 1, 8)
    torch.manual_seed(clip)
    with torch.no_grad():
        for param in pe.parameters():
            param.normal_()
    q, k, v = (torch.randn(2, 3, length, 8) for _ in range(3))
    layer = 1
    a_key = pe.key_table[layer].detach().double()
    a_value = pe.value_table[layer].detach().double() if value_term else None
    qd, kd, vd = q.double(), k.double(), v.double()
    # The (L, L, d_head) relative tensors, written the way the paper writes them.
    rel_k = torch.stack(
        [torch.stack([a_key[min(max(j - i, -clip), clip) + clip] for j in range(length)]) for i in range(length)]
    )
    rel_v = None
    if value_term:
        rel_v = torch.stack(
            [torch.stack([a_value[min(max(j - i, -clip), clip) + clip] for j in range(length)]) for i in range(length)]
        )
    # score(i, j) = q_i . (k_j + a^K_ij) / sqrt(d); out_i = sum_j p_ij (v_j + a^V_ij): (B, H, L, L, d) products.
    scores = (qd[..., :, None, :] * (kd[..., None, :, :] + rel_k)).sum(-1) / math.sqrt(8)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    values = vd[..., None, :, :] + (rel_v if value_term else 0)
    expected = (probs[..., None] * values).sum(-2)
    with torch.no_grad():
        got = causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, sequential_positions(q.size(-2))))
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    with torch.enable_grad():
        got = causal_attention(q, k, v, pe.layer(layer).terms(None, q, k, sequential_positions(q.size(-2))))
    assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_shaws_value_term_runs_on_the_band_kernel_in_fp32_and_bf16(monkeypatch):
    """On the CPU Shaw with a^V takes BandedAttention, its value term from the band's weights (it had taken the
    explicit query blocks); bf16 under autocast within bf16's rounding of the float64 formula."""
    calls = []
    kernel = attention_module.BandedAttention
    monkeypatch.setattr(
        attention_module, "BandedAttention", SimpleNamespace(apply=lambda *a: calls.append(1) or kernel.apply(*a))
    )
    pe = make_bias_pe("shaw_value")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, 150, HEAD_DIM, generator=gen) for _ in range(3))
    expected = naive_biased_attention(q, k, v, pe, 1)
    assert_close(
        causal_attention(q, k, v, pe.layer(1).terms(None, q, k, sequential_positions(150))).double(),
        expected,
        atol=1e-5,
        rtol=1e-5,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = [t.bfloat16() for t in (q, k, v)]
        got = causal_attention(*half, pe.layer(1).terms(None, *half[:2], sequential_positions(150)))
    assert got.dtype == torch.bfloat16
    assert_close(got.double(), naive_biased_attention(*half, pe, 1), atol=3e-2, rtol=1e-2)
    assert calls == [1, 1]


def test_band_values_added_widen_the_narrower_band():
    """Two value terms (two PEs' a^V) add: the narrower band's keys beyond it gain only its ``far``."""
    gen = torch.Generator().manual_seed(0)
    narrow = BandValues(torch.randn(4, generator=gen), torch.randn(1, 1, 6, 2, 4, generator=gen))
    wide = BandValues(torch.randn(4, generator=gen), torch.randn(2, 1, 6, 5, 4, generator=gen))
    weights = torch.rand(2, 3, 6, 5, generator=gen)
    rows = slice(1, 4)
    both = narrow.output(weights[..., rows, -2:], rows) + wide.output(weights[..., rows, :], rows)
    assert_close((narrow + wide).output(weights[..., rows, :], rows), both)
    assert_close((wide + narrow).output(weights[..., rows, :], rows), both)


# --------------------------------------------------------------------------------------------
# Shift invariance of relative PEs (score level)
# --------------------------------------------------------------------------------------------

SHIFTS = pytest.mark.parametrize("shift", [1, 5, 37])


@SHIFTS
@pytest.mark.parametrize("scaling, factor", [("none", None), ("linear", 4.0), ("ntk", 4.0), ("yarn", 8.0)])
def test_rope_scores_shift_invariant(shift, scaling, factor):
    pe = RoPE(AttentionShape(d_model=32, n_heads=2, n_layers=1, train_len=8), scaling=scaling, factor=factor)
    length = 24
    q, k = torch.randn(1, 2, length, 16), torch.randn(1, 2, length, 16)
    qr, kr = rotate(pe, q, k)
    pad = torch.randn(1, 2, shift, 16)
    qs, ks = rotate(pe, torch.cat([pad, q], 2), torch.cat([pad, k], 2))
    base_scores = qr.double() @ kr.double().transpose(-2, -1)
    shifted = qs[:, :, shift:].double() @ ks[:, :, shift:].double().transpose(-2, -1)
    assert_close(shifted, base_scores, atol=5e-5, rtol=1e-5)


def explicit_bias(pe, q, positions, layer):
    """The explicit path's masks of query blocks [start, end) against keys [0, end) for this PE."""
    blocks = attention_module.explicit_bias(pe.layer(layer).terms(None, q, q, positions).biases, q)
    return lambda start, end: blocks(start, end, 0)


def full_bias(pe, q: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """The masked bias of the explicit path for all rows, broadcast to (B, H, L, L)."""
    length = q.size(-2)
    bias = explicit_bias(pe, q, sequential_positions(length), layer)(0, length)
    return bias.expand(q.size(0), q.size(1), length, length)


@SHIFTS
def test_alibi_bias_is_minus_slope_times_distance_and_shift_invariant(shift):
    pe = ALiBi(AttentionShape(d_model=6 * 4, n_heads=6, n_layers=1, train_len=8))
    length = 50
    bias = full_bias(pe, torch.zeros(1, 6, length + shift, 4)).double()
    diag = bias.diagonal(dim1=-2, dim2=-1)[..., :, None]  # bias(i, i): the per-row constant softmax ignores
    relative = bias - diag  # bias(i, j) - bias(i, i)
    i, j = torch.arange(length + shift)[:, None], torch.arange(length + shift)[None, :]
    slopes = torch.tensor(alibi_get_slopes(6), dtype=torch.float64)
    causal = j <= i
    expected = -slopes[:, None, None] * (i - j)
    assert_close(relative[0][:, causal], expected[:, causal], atol=1e-4, rtol=1e-6)
    assert_close(
        relative[..., shift:, shift:][..., causal[:length, :length]],
        relative[..., :length, :length][..., causal[:length, :length]],
        atol=1e-4,
        rtol=1e-6,
    )


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 16), (32, 8), (2, 1)])
def test_t5_max_distance_within_the_exact_buckets_is_a_config_error(num_buckets, max_distance):
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, train_len=16)
    with pytest.raises(ConfigError, match=r"pe.max_distance=\d+ is invalid: it must exceed pe.num_buckets // 2"):
        T5Bias(shape, num_buckets=num_buckets, max_distance=max_distance)


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 17), (3, 2)])
def test_t5_band_ends_where_the_last_bucket_begins(num_buckets, max_distance):
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, train_len=16)
    width = T5Bias(shape, num_buckets=num_buckets, max_distance=max_distance).band_width
    buckets = [t5_bucket_reference(n, num_buckets, max_distance) for n in range(width + 1)]
    assert buckets[width] == num_buckets - 1 and buckets[width - 1] != num_buckets - 1


@SHIFTS
@pytest.mark.parametrize("per_layer", [False, True])
def test_t5_bias_shift_invariant_and_table_lookup(shift, per_layer):
    pe = make_bias_pe("t5_per_layer" if per_layer else "t5")
    length = 150  # beyond max_distance (at most 128; 40): the far buckets are covered too
    layer = 1
    bias = full_bias(pe, torch.zeros(1, HEADS, length + shift, HEAD_DIM), layer)[0]  # (H, L, L)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    assert_close(bias[:, shift:, shift:][:, mask], bias[:, :length, :length][:, mask], rtol=0, atol=0)
    table = pe.table.detach()[layer if per_layer else 0]
    bucket = partial(t5_bucket_reference, num_buckets=pe.num_buckets, max_distance=pe.max_distance)
    for i, j in [(0, 0), (10, 3), (149, 0), (100, 99), (shift + 20, shift)]:  # up to the per-row constant
        assert_close(bias[:, i, j] - bias[:, i, i], table[bucket(i - j)] - table[bucket(0)])


@SHIFTS
@pytest.mark.parametrize("clip", [2, 16])
def test_shaw_bias_shift_invariant(shift, clip):
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, train_len=8)
    pe = ShawRelative(shape, k=clip)
    length = 30
    q = torch.randn(1, HEADS, length, HEAD_DIM)
    q_shifted = torch.cat([torch.randn(1, HEADS, shift, HEAD_DIM), q], 2)  # same row content, positions + shift
    bias = full_bias(pe, q).detach()
    shifted = full_bias(pe, q_shifted).detach()[..., shift:, shift:]
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    assert_close(shifted[..., mask], bias[..., mask], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["alibi", "t5", "shaw", "kerple", "fire"])
def test_bias_rows_of_a_block_equal_rows_of_the_full_bias(kind):
    """The explicit path's mask of query rows [start, end) must equal those rows of the full bias (keys [0, end))."""
    pe = make_bias_pe(kind)
    length = 40
    q = torch.randn(1, HEADS, length, HEAD_DIM)
    full = full_bias(pe, q, 1).detach()
    blocks = explicit_bias(pe, q, sequential_positions(length), 1)
    i = torch.arange(length)[:, None]
    for start, end in [(0, 5), (5, 17), (17, 40), (39, 40)]:
        block = blocks(start, end).detach()
        block = block.expand(1, HEADS, end - start, end)
        causal = torch.arange(end)[None, :] <= i[start:end]
        reference = full[:, :, start:end, :end]
        if kind == "alibi":  # key-only: rows agree up to a per-row constant
            block = block - block.diagonal(offset=start, dim1=-2, dim2=-1)[..., None]
            reference = reference - reference.diagonal(offset=start, dim1=-2, dim2=-1)[..., None]
        assert_close(block[..., causal], reference[..., causal], atol=1e-5, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# The decoder with every PE: causality, long inputs, caches, bf16
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PES)
def test_pe_parameters_are_every_parameter_a_nope_decoder_lacks(name):
    """What the oracles draw at std 0.5 (``tiny_decoder``): the shared tables and each layer's (FoX's gates, DAPE's MLP,
    PaTH's projections, CoPE's embeddings, which start at 0: a check that skipped them checked NoPE), none left at 0."""
    net = tiny_decoder(PES[name])
    nope = Decoder(vocab_size=VOCAB, train_len=TRAIN_LEN, pe=NoPE, d_model=32, n_layers=2, n_heads=4)
    model_only = {n for n, _ in nope.named_parameters()}
    expected = [p for n, p in net.named_parameters() if n not in model_only]
    assert {id(p) for p in net.pe_parameters()} == {id(p) for p in expected}
    assert all(p.abs().max() > 0 for p in net.pe_parameters())


@pytest.mark.parametrize("name", PES)
def test_decoder_is_causal(name):
    net = tiny_decoder(PES[name])
    x = tokens(TRAIN_LEN, batch=1)
    changed_at = (0, 6, TRAIN_LEN - 2)  # t: the token at t + 1 changes
    batch = x.repeat(1 + len(changed_at), 1)  # row 0 unchanged, row r changes token changed_at[r - 1] + 1
    for row, t in enumerate(changed_at, start=1):
        batch[row, t + 1] = (batch[row, t + 1] + 1) % VOCAB
    with torch.no_grad():
        logits = net.logits(net(batch))
    for row, t in enumerate(changed_at, start=1):
        assert_close(logits[row, : t + 1], logits[0, : t + 1])
        assert (logits[row, t + 1] - logits[0, t + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", PES)
def test_decoder_serves_thirty_two_times_train_len(name):
    net = tiny_decoder(PES[name])
    long = tokens(32 * TRAIN_LEN)
    with torch.no_grad():
        if name == "learned":
            with pytest.raises(LengthNotSupported):
                net(long)
            with pytest.raises(LengthNotSupported):
                net(long[:, : TRAIN_LEN + 1])
            assert torch.isfinite(net(long[:, :TRAIN_LEN])).all()  # exactly max_len works
            return
        hidden = net(long)
        assert hidden.shape == (2, 32 * TRAIN_LEN, 32)
        assert torch.isfinite(net.logits(hidden)).all()
        # Caches grown for 512 tokens must not change what a short input sees.
        short = long[:, :TRAIN_LEN]
        fresh = tiny_decoder(PES[name])
        assert_close(net(short), fresh(short), atol=1e-5, rtol=1e-5)
        # Prefix consistency: a causal model's first 16 outputs do not depend on the length of the input
        # (every PE here has a length-independent rule: RoPE-YaRN has a fixed factor).
        assert_close(hidden[:, :TRAIN_LEN], net(short), atol=1e-5, rtol=1e-5)


def test_learned_max_len_is_configurable():
    net = tiny_decoder(partial(Learned, max_len=40))
    with torch.no_grad():
        assert torch.isfinite(net(tokens(40))).all()
        with pytest.raises(LengthNotSupported, match="0..39"):
            net(tokens(41))


def test_learned_adds_its_table():
    pe = Learned(AttentionShape(d_model=8, n_heads=2, n_layers=1, train_len=6))
    x = torch.randn(3, 5, 8)
    assert_close(embed(pe, x), x + pe.table.weight[:5].detach())


@pytest.mark.parametrize("name", PES)
def test_decoder_bf16_autocast_close_to_fp32(name):
    net = tiny_decoder(PES[name])
    x = tokens(2 * TRAIN_LEN if name != "learned" else TRAIN_LEN)
    with torch.no_grad():
        reference = net.logits(net(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = net.logits(net(x))
    assert torch.isfinite(low).all()
    assert_close(low.float(), reference, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("name", PES)
def test_decoder_computes_in_float64_when_its_parameters_are(name):
    """Every PE follows the model's dtype: the float64 oracles (and the GPU check's reference) need it. FIRE cast
    its positions to fp32 and failed in float64 (found by scripts/gpu_check.py)."""
    net = tiny_decoder(PES[name])
    x = tokens(TRAIN_LEN)
    with torch.no_grad():
        reference = net.logits(net(x))
        wide = net.double().logits(net(x))
    assert wide.dtype == torch.float64
    assert_close(wide, reference.double(), atol=1e-4, rtol=1e-4)


def test_denormals_flush_to_zero_in_every_thread():
    """Importing lenext flushes denormals, also in torch's worker threads (see lenext/__init__.py).

    Without it, ALiBi's far-key probabilities (< e^-87) made its attention backward 2.4x slower.
    The tensor is large enough that every intra-op thread computes a part of it.
    """
    assert torch.full((2**22,), 1e-30).mul(1e-10).count_nonzero() == 0  # 1e-40 is denormal in fp32


@pytest.mark.parametrize("train_len, expected", [(512, 128), (128, 128), (64, 64), (8, 17)])
def test_t5_max_distance_defaults_to_128_capped_at_l_train(train_len, expected):
    """Every bucket the default uses holds a distance below L_train, so training reaches it (at L_train 8 the
    log buckets still need a distance past the 16 exact ones)."""
    shape = AttentionShape(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, train_len=train_len)
    pe = T5Bias(shape)
    assert pe.max_distance == expected
    if train_len > 16:
        trained = t5_bucket(torch.arange(train_len), 32, pe.max_distance).unique()
        assert trained.tolist() == list(range(32))


@pytest.mark.parametrize("scaling", ["ntk", "dynamic_ntk"])
def test_ntk_scalings_need_a_head_dim_above_two(scaling):
    """d / (d - 2) is undefined for d = 2: refused when trained with it, not applicable as an evaluation variant
    (found by the random-config test: d_model 8 with 4 heads)."""
    shape = AttentionShape(d_model=8, n_heads=4, n_layers=1, train_len=16)
    with pytest.raises(ConfigError, match=rf"pe\.scaling={scaling} is invalid for a head dim of 2"):
        RoPE(shape, scaling=scaling)
    pe = RoPE(shape)
    with pe.variant(scaling), pytest.raises(LengthNotSupported, match="head dim of 2"):
        rotate(pe, torch.randn(1, 4, 64, 2), torch.randn(1, 4, 64, 2))
