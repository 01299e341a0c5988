"""The docs' "adding" pages: their example protocol and extension method, each registered in one entry, work
through the code that runs every other one (docs/adding/protocol.md, docs/adding/extension.md)."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from lenext import schema
from lenext.evaluate import TextEvaluation
from lenext.pe import RoPE
from lenext.pe.base import AttentionShape
from lenext.pe.rope import ROPE_SCALINGS, rope_frequencies
from lenext.protocols import PROTOCOLS
from tests.examples.ntk_by_parts import ntk_by_parts_scaling
from tests.examples.second_half import SecondHalf
from tests.test_evaluate import eval_cfg, random_documents, sweep_of, tiny_net


def test_a_protocol_registered_in_one_entry_is_swept_and_scores_what_it_says(monkeypatch):
    monkeypatch.setitem(PROTOCOLS, SecondHalf.name, SecondHalf)
    net, docs = tiny_net(), random_documents()
    evaluation = TextEvaluation(docs)
    rows, _ = sweep_of(net, evaluation, 16, eval_cfg(protocol=["nonoverlap", SecondHalf.name]))
    measured = {(row["protocol"], row["length"]): row for row in rows}
    for length in (16, 32, 64):
        half, whole = measured[(SecondHalf.name, length)], measured[("nonoverlap", length)]
        assert half["windows"] == whole["windows"] and half["tokens"] == whole["tokens"] - whole["windows"] * (
            length // 2
        )
        # The reference: each window's second-half targets, one window at a time, log_softmax by hand.
        total, count = 0.0, 0
        with torch.no_grad():
            for w in SecondHalf().windows([len(d) for d in docs], length):
                ids = torch.from_numpy(docs[w.document][w.start : w.start + length + 1]).long()[None]
                logp = torch.log_softmax(net.logits(net(ids[:, :-1])).double(), -1)[0]
                nll = -logp[torch.arange(length), ids[0, 1:]]
                total, count = total + nll[length // 2 :].sum().item(), count + length - length // 2
        assert half["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_a_scaling_registered_in_one_entry_is_a_zero_shot_variant_and_a_trained_scaling(monkeypatch):
    monkeypatch.setitem(ROPE_SCALINGS, "ntk_by_parts", ntk_by_parts_scaling)
    monkeypatch.setattr(RoPE, "VARIANTS", (*RoPE.VARIANTS, "ntk_by_parts"))
    # Its formula: YaRN's frequencies, with an attention factor of 1 (YaRN's is 0.1 ln s + 1).
    yarn, temperature = rope_frequencies(32, 10000.0, "yarn", 8.0, 512, 64)
    got, attention = rope_frequencies(32, 10000.0, "ntk_by_parts", 8.0, 512, 64)
    assert_close(got, yarn, rtol=0, atol=0)
    assert attention == 1.0 and temperature > 1.0
    shape = AttentionShape(d_model=64, n_heads=2, n_layers=1, train_len=64)
    rope = RoPE(shape)
    assert rope.variants(["none", "ntk_by_parts"], 512) == ["none", "ntk_by_parts"]
    with rope.variant("ntk_by_parts"):  # zero-shot: factor L / C at each length
        zero_shot, _ = rope.frequencies(512)
    trained = RoPE(
        AttentionShape(d_model=64, n_heads=2, n_layers=1, train_len=512, max_position=512),
        scaling="ntk_by_parts",
        original_len=64,
    )  # a second stage at L' = 512: s = L' / C, fixed
    assert trained.scaling_factor(2048) == 8.0
    assert_close(zero_shot, yarn, rtol=0, atol=0)
    assert_close(trained.frequencies(2048)[0], yarn, rtol=0, atol=0)


def test_the_example_pe_is_its_formula_on_both_paths():
    """docs/pes/adding.md's FixedSlope, as the page shows it (tests/examples/fixed_slope.py): its key bias through
    the attention, and its score_mod through FlexAttention (eager, on CPU), against softmax(q k^T / sqrt(d) -
    slope (i - j)) v in float64 at drawn positions; its setting checked against its annotation."""
    from lenext.attention import causal_attention
    from lenext.attention.flex import flex_attention
    from lenext.errors import ConfigError
    from tests.examples.fixed_slope import FixedSlope
    from tests.test_flex import eager_flex

    heads, head_dim, length = 2, 8, 40
    pe = FixedSlope(AttentionShape(d_model=heads * head_dim, n_heads=heads, n_layers=1, train_len=16), slope=0.3)
    positions = torch.cumsum(torch.randint(1, 4, (1, length)), 1)  # strictly increasing, not 0..L-1
    q, k, v = (torch.randn(1, heads, length, head_dim) for _ in range(3))
    distance = (positions[0, :, None] - positions[0, None, :]).double()
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(head_dim) - 0.3 * distance
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(scores, -1) @ v.double()
    keyed = causal_attention(q, k, v, pe.layer(0).terms(None, q, k, positions))
    assert_close(keyed.double(), expected, atol=1e-5, rtol=1e-5)
    if flex_attention is not None:  # torch >= COMPILED_PATHS_TORCH (lenext.hardware)
        assert_close(eager_flex(q, k, v, pe.score_mod(q, positions, 0)).double(), expected, atol=1e-5, rtol=1e-5)
    q, k, v = q.double(), k.double(), v.double()  # a float64 model, the oracles' reference: float64 throughout
    assert_close(
        causal_attention(q, k, v, pe.double().layer(0).terms(None, q, k, positions)), expected, atol=1e-12, rtol=1e-12
    )
    assert pe.describe() == {"name": "FixedSlope", "slope": 0.3}  # in results files and the run's first log line
    node = {"_target_": "tests.examples.fixed_slope.FixedSlope", "_partial_": True, "slope": -1.0}
    with pytest.raises(ConfigError, match=r"^pe.slope=-1.0 is invalid: it must be"):
        schema.check(OmegaConf.create({"pe": node}), None, {})


def test_a_target_that_fails_to_import_is_named_with_the_error_inside_it(tmp_path, monkeypatch, caplog):
    """A PE module of one's own whose import fails (an import from the wrong lenext module): the one line names the
    target and the ImportError inside it, not hydra's "Are you sure that module is installed?"; hydra's own log
    line of the failure is not printed besides."""
    from lenext.errors import ConfigError

    (tmp_path / "my_pes.py").write_text("from lenext.schema import NoSuchAlias\n\n\nclass Mine:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        schema.check(OmegaConf.create({"pe": {"_target_": "my_pes.Mine"}}), None, {})
    assert str(refused.value).startswith(
        "pe._target_='my_pes.Mine' cannot be imported "
        "(ImportError: cannot import name 'NoSuchAlias' from 'lenext.schema'"
    )
    assert not [record for record in caplog.records if record.name.startswith("hydra")]
    (tmp_path / "my_other_pes.py").write_text("class Mine:\n    pass\n")  # a misspelt class: the module is named
    with pytest.raises(ConfigError, match=r"^pe._target_='my_other_pes.Min' cannot be imported \(module "
                       r"'my_other_pes' has no 'Min'\)$"):  # fmt: skip
        schema.check(OmegaConf.create({"pe": {"_target_": "my_other_pes.Min"}}), None, {})
