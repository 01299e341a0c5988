"""The ``temperature`` evaluation variant (lenext.temperature): beta(s) = 1 + c ln s on every attention row's logits,
biases included, for any PE, c fitted on the validation split.

Pinned: beta exactly; attention under it against logits computed independently in float64 for a bias PE (ALiBi) and
RoPE; the fit recovering a known c and being the argmin of the NLL over the grid it tried (brute force), its coarse
scan ending at the first rise; at c = 0 the model as trained's rows, not measured again; its rows
in a sweep of a PE without variants; c fitted on the evaluation it is given (the validation split's) whatever the
sweep reports on; a PE it cannot serve gets rows that say why; the keys refused in one line.
"""

import functools
import itertools
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lenext import schema
from lenext.attention import logit_temperature
from lenext.errors import ConfigError
from lenext.evaluate import EvalSettings, SweepPlan, TextEvaluation, sweep
from lenext.model import Decoder
from lenext.pe import DAPE, FIRE, ALiBi, NoPE, RoPE, alibi_slopes
from lenext.resolve import TRAIN_NODES, TrainSettings
from lenext.scoring import Measured
from lenext.temperature import (
    COARSE,
    FINE_STEP,
    TEMPERATURE,
    TemperatureFit,
    fit_temperature,
    grid_fit,
    length_scales,
    temperature,
)
from tests.conftest import hidden_keys

TRAIN_LEN, VOCAB = 8, 64


def test_beta_is_one_plus_c_ln_s_and_one_within_l_train():
    assert logit_temperature(0.3, 24, 8) == 1 + 0.3 * math.log(3)
    assert logit_temperature(0.25, 256, 64) == 1 + 0.25 * math.log(4)
    assert logit_temperature(0.3, 8, 8) == logit_temperature(0.3, 5, 8) == 1.0  # s <= 1
    assert logit_temperature(None, 64, 8) == 1.0 and logit_temperature(0.0, 64, 8) == 1.0


def decoder(pe, **model) -> Decoder:
    torch.manual_seed(0)
    return Decoder(VOCAB, TRAIN_LEN, pe, d_model=16, n_layers=2, n_heads=2, **model)


def reference_attention(attn, x: torch.Tensor, beta: float, bias: torch.Tensor | None, rope_base: float | None):
    """One layer's output, float64, from its weights: softmax(beta (q k^T / sqrt(d) + bias)) v, RoPE's rotation
    written out (interleaved pairs at theta_t = base^(-2t/d))."""
    batch, length, width = x.shape
    heads = attn.n_heads
    q, k, v = (x @ attn.qkv.weight.t()).view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    dim = q.size(-1)
    if rope_base is not None:
        theta = rope_base ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        turn = torch.polar(torch.ones(length, dim // 2, dtype=torch.float64), torch.arange(length)[:, None] * theta)

        def rotate(t):
            return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2).contiguous()) * turn)

        q, k = rotate(q).flatten(-2), rotate(k).flatten(-2)
    logits = q @ k.transpose(-2, -1) / math.sqrt(dim)
    if bias is not None:
        logits = logits + bias
    logits = (beta * logits).masked_fill(hidden_keys(length), float("-inf"))
    y = logits.softmax(-1) @ v
    return attn.out(y.transpose(1, 2).reshape(batch, length, width))


@pytest.mark.parametrize("name", ["alibi", "rope"])
def test_every_rows_logits_biases_included_are_multiplied_by_beta(name):
    pe = ALiBi if name == "alibi" else RoPE
    net = decoder(pe).double()
    attn = net.blocks[0].attn
    length, c = 3 * TRAIN_LEN, 0.3
    x = torch.randn(2, length, 16, dtype=torch.float64)
    positions = torch.arange(length)[None]
    i = torch.arange(length)
    bias = -alibi_slopes(2).double()[:, None, None] * (i[:, None] - i[None, :]) if name == "alibi" else None
    beta = 1 + c * math.log(3)
    with temperature(net, c):
        scaled = attn(x, positions)
    plain = attn(x, positions)
    expected = reference_attention(attn, x, beta, bias, 10000.0 if name == "rope" else None)
    torch.testing.assert_close(scaled, expected, rtol=1e-6, atol=1e-8)  # ALiBi's bias is fp32
    torch.testing.assert_close(plain, reference_attention(attn, x, 1.0, bias, 10000.0 if name == "rope" else None))
    assert not torch.allclose(scaled, plain)
    assert all(scale.temperature is None for scale in length_scales(net))  # restored after the block
    short, at = x[:, :TRAIN_LEN], positions[:, :TRAIN_LEN]
    with temperature(net, c):  # within L_train beta is 1: the model as trained
        within = attn(short, at)
    assert torch.equal(within, attn(short, at))


class KnownOptimum:
    """An evaluation whose NLL is (c - optimum)^2 + 1 for the c the model's attention holds: the fit must find it."""

    protocols = ("nonoverlap",)

    def __init__(self, optimum: float):
        self.optimum, self.asked = optimum, []

    def protocol(self, name, plan):
        return name

    def windows(self, protocol, length):
        return [length]

    def measure(self, net, protocol, windows, length, settings, precision, scheme, seed):
        c = length_scales(net)[0].temperature
        self.asked.append(c)
        return Measured({"mean_nll": (c - self.optimum) ** 2 + 1, "tokens": 1})


def plan(*lengths: int) -> SweepPlan:
    return SweepPlan(["nonoverlap"], list(lengths), TRAIN_LEN // 2, TRAIN_LEN, TRAIN_LEN)


def settings(**changes) -> EvalSettings:
    values = dict(enabled=True, protocol=None, lengths=None, factors=None, stride=None, last_k=None)
    values |= dict(variants=["none", TEMPERATURE], max_windows=4, tokens_per_batch=4096, per_position=False)
    return EvalSettings(**(values | changes))


@pytest.mark.parametrize("optimum", [0.35, 0.6, 0.0, 1.0])
def test_the_fit_recovers_a_known_c(optimum):
    evaluation = KnownOptimum(optimum)
    fit = fit_temperature(decoder(NoPE), evaluation, plan(8, 16, 32), settings(), "32-true", None, 0)
    assert fit.c == pytest.approx(optimum) and fit.reason is None
    assert fit.lengths == (16, 32) and fit.protocol == "nonoverlap"  # the lengths beyond L_train only
    nll = {c: (c - optimum) ** 2 + 1 for c in COARSE}  # KnownOptimum's, the same at every length
    first_rise = next((c for before, c in itertools.pairwise(COARSE) if nll[c] > nll[before]), COARSE[-1])
    assert [c for c in dict(fit.losses) if c in COARSE] == [c for c in COARSE if c <= first_rise]


def test_the_coarse_scan_stops_at_the_first_rise_and_finds_the_grid_minimum_of_one_dip():
    asked = []

    def objective(c: float) -> float:
        asked.append(c)
        return abs(c - 0.3)

    c, losses = grid_fit(objective)
    assert c == pytest.approx(0.3)
    assert asked[:5] == [0.0, 0.1, 0.2, 0.3, 0.4]  # 0.4 rises above 0.3: the coarse scan ends there
    assert sorted(set(asked[5:])) == [0.225, 0.25, 0.275, 0.325, 0.35, 0.375]
    assert len(asked) == len(set(asked)) == len(losses)  # no c evaluated twice


def random_documents(seed: int = 0) -> TextEvaluation:
    generator = np.random.default_rng(seed)
    return TextEvaluation([generator.integers(0, VOCAB, 200) for _ in range(4)])


def test_the_fit_is_the_argmin_of_the_nll_over_its_grid():
    net = decoder(NoPE)
    with torch.no_grad():  # sharper attention than at init, so that c matters
        for block in net.blocks:
            block.attn.qkv.weight.mul_(8)
    evaluation, swept, cfg = random_documents(), plan(8, 16, 32), settings()
    fit = fit_temperature(net, evaluation, swept, cfg, "32-true", None, 0)
    protocol = evaluation.protocol("nonoverlap", swept)

    def brute(c: float) -> float:
        nll = []
        for length in (16, 32):
            windows = evaluation.windows(protocol, length)[:: math.ceil(len(evaluation.windows(protocol, length)) / 4)]
            with temperature(net, c):
                nll.append(
                    evaluation.measure(net, protocol, windows, length, cfg, "32-true", None, 0).metrics["mean_nll"]
                )
        return sum(nll) / len(nll)

    tried = dict(fit.losses)
    brute_force = {c: brute(c) for c in tried}
    assert tried == pytest.approx(brute_force, rel=1e-6)
    assert fit.c == min(brute_force, key=lambda c: (brute_force[c], c))
    coarse_best = min(set(COARSE) & set(tried), key=lambda c: (brute_force[c], c))
    assert set(tried) - set(COARSE) <= {round(coarse_best + k * FINE_STEP, 10) for k in range(-3, 4)}


def test_a_fit_at_the_top_of_the_search_says_the_least_nll_may_lie_beyond():
    from lenext.temperature import TemperatureFit, describe_fit

    c, losses = grid_fit(lambda c: -c)  # falling all the way: the largest c tried wins
    assert c == pytest.approx(1.075)
    fit = TemperatureFit(c, None, (128,), "nonoverlap", tuple(losses.items()))
    assert describe_fit(fit).endswith(f"c = {c:g} is the largest tried: the least NLL may lie beyond)")
    inside = TemperatureFit(0.5, None, (128,), "nonoverlap", ((0.0, 2.0), (0.5, 1.0), (0.6, 1.5)))
    assert "largest tried" not in describe_fit(inside)


def test_grid_fit_prefers_the_smaller_c_on_ties_and_stays_non_negative():
    c, losses = grid_fit(lambda c: 1.0)
    assert c == 0.0 and min(losses) == 0.0


def test_the_variant_gives_rows_for_a_pe_without_variants_and_fits_on_the_evaluation_given():
    net = decoder(ALiBi)
    reported, validation = random_documents(1), random_documents(2)
    rows, _ = sweep(net, reported, plan(8, 16, 32), settings(), fit_evaluation=validation)
    fitted = fit_temperature(net, validation, plan(8, 16, 32), settings(), "32-true", None, 0).c
    by_variant = {(r["variant"], r["length"]): r for r in rows}
    assert sorted({r["variant"] for r in rows}, key=str) == [None, TEMPERATURE]  # ALiBi's own row: None
    for length in (8, 16, 32):
        row = by_variant[TEMPERATURE, length]
        assert row["status"] == "ok" and row["temperature_c"] == fitted
        assert row["variant_factor"] == logit_temperature(fitted, length, TRAIN_LEN)
        assert row["temperature_fitted_on"] == "validation"
    assert by_variant[TEMPERATURE, 8]["mean_nll"] == by_variant[None, 8]["mean_nll"]  # beta = 1 at L_train
    assert all(scale.temperature is None for scale in length_scales(net))


def test_at_c_zero_the_rows_are_the_model_as_trained_measured_once(monkeypatch):
    class Counted(TextEvaluation):
        def measure(self, net, *args):
            temperatures.append(length_scales(net)[0].temperature)
            return super().measure(net, *args)

    temperatures, evaluation = [], Counted(random_documents().documents)
    fitted = TemperatureFit(0.0, None, (16, 32), "nonoverlap", ((0.0, 1.0),))
    monkeypatch.setattr("lenext.evaluate.fit_temperature", lambda *args: fitted)
    rows, curves = sweep(decoder(NoPE), evaluation, plan(8, 16, 32), settings(per_position=True))
    by_variant = {(r["variant"], r["length"]): r for r in rows}
    for length in (8, 16, 32):
        as_trained, warmer = by_variant[None, length], by_variant[TEMPERATURE, length]
        assert warmer["temperature_c"] == 0.0 and warmer["mean_nll"] == as_trained["mean_nll"]
        assert warmer["tokens"] == as_trained["tokens"] > 0
    assert temperatures == [None] * 3  # each length measured once, as trained, not again at beta = 1
    assert [c[1:] for c in curves if c[0] == TEMPERATURE] == [c[1:] for c in curves if c[0] is None]


def test_at_c_zero_the_rows_repeat_the_pe_as_trained_whichever_variant_comes_first(monkeypatch):
    fitted = TemperatureFit(0.0, None, (16, 32), "nonoverlap", ((0.0, 1.0),))
    monkeypatch.setattr("lenext.evaluate.fit_temperature", lambda *args: fitted)
    net = decoder(RoPE)
    with torch.no_grad():  # sharper attention than at init, so that the scaling matters
        for block in net.blocks:
            block.attn.qkv.weight.mul_(8)
    rows, _ = sweep(net, random_documents(), plan(8, 16, 32), settings(variants=["ntk", "none", TEMPERATURE]))
    by_variant = {(r["variant"], r["length"]): r for r in rows}
    assert by_variant["ntk", 32]["mean_nll"] != by_variant["none", 32]["mean_nll"]  # the two differ at 4x
    for length in (16, 32):
        assert by_variant[TEMPERATURE, length]["mean_nll"] == by_variant["none", length]["mean_nll"]
    rows, _ = sweep(net, random_documents(), plan(8, 16, 32), settings(variants=["ntk", TEMPERATURE]))
    by_variant = {(r["variant"], r["length"]): r for r in rows}  # the PE as trained not asked: measured at beta = 1
    with temperature(net, 0.0):
        evaluation = random_documents()
        protocol = evaluation.protocol("nonoverlap", plan(8, 16, 32))
        windows = protocol.capped(evaluation.windows(protocol, 32), 4)
        expected = evaluation.measure(net, protocol, windows, 32, settings(), "32-true", None, 0).metrics["mean_nll"]
    assert by_variant[TEMPERATURE, 32]["mean_nll"] == pytest.approx(expected, rel=1e-6)


def test_no_variant_row_unless_asked_or_beyond_l_train():
    net = decoder(NoPE)
    assert {r["variant"] for r in sweep(net, random_documents(), plan(8, 16), settings(variants=None))[0]} == {None}
    assert {r["variant"] for r in sweep(net, random_documents(), plan(4, 8), settings())[0]} == {None}


def test_a_pe_that_cannot_take_a_row_scale_gets_rows_saying_why():
    net = decoder(functools.partial(DAPE, base=FIRE))
    rows, _ = sweep(net, random_documents(), plan(8, 16), settings(max_windows=1))
    (row,) = [r for r in rows if r["variant"] == TEMPERATURE and r["length"] == 16]
    assert row["status"] == "not applicable" and "DAPE" in row["reason"] and row["temperature_c"] is None


def test_the_keys_are_checked():
    def check(**eval_changes):
        node = {**{k: v for k, v in vars(settings()).items()}, **eval_changes}
        cfg = OmegaConf.create(
            {"task_name": "t", "seed": 0, "ckpt_path": None, "init_from": None, "drop_pe": False, "eval": node}
        )
        schema.check(cfg, TrainSettings, {"eval": TRAIN_NODES["eval"]})

    check(variants=["none", "temperature", "yarn"])
    with pytest.raises(ConfigError, match=r"^eval.variants.*temperature"):
        check(variants=["tempreture"])


def test_rows_of_a_sweep_keep_the_variant_as_trained_first():
    rows, _ = sweep(decoder(RoPE), random_documents(), plan(8, 16), settings(max_windows=1))
    assert [r["variant"] for r in rows if r["length"] == 16] == ["none", TEMPERATURE]


def test_a_windowed_models_rows_report_the_beta_its_attention_applies():
    """Under attention.window=W the attention takes beta at min(L, W) (the keys a row sees): the rows said beta at L
    (W 12, L_train 8, c 0.5: 1.693 at 32 where 1.203 is applied)."""
    from lenext.attention import AttentionSettings
    from lenext.temperature import TemperatureFit, variant_columns

    net = decoder(ALiBi, attention=AttentionSettings(window=12))
    fit = TemperatureFit(0.5, None, (16, 32), "nonoverlap", ((0.0, 1.0), (0.5, 0.9)))
    for length in (8, 16, 32):
        assert variant_columns(net, TEMPERATURE, length, fit)["variant_factor"] == pytest.approx(
            1 + 0.5 * math.log(max(1.0, min(length, 12) / TRAIN_LEN))
        )
    assert variant_columns(decoder(ALiBi), TEMPERATURE, 32, fit)["variant_factor"] == pytest.approx(
        1 + 0.5 * math.log(4)
    )
