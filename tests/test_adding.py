"""The docs' "adding" pages: their example protocol and extension method, each registered in one entry, work
through the code that runs every other one (docs/adding/protocol.md, docs/adding/extension.md)."""

import math

import pytest
import torch
from torch.testing import assert_close

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
