"""Evaluation protocols: token accounting, numbers against an independent loop, results files."""

import functools
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import lenext.attention
import lenext.attention.band
import lenext.evaluate
import lenext.model
import lenext.results
from lenext.checkpoints import net_state
from lenext.errors import CheckpointError, ConfigError
from lenext.evaluate import PROTOCOL_SETTINGS, TextEvaluation, sweep, sweep_plan
from lenext.model import Decoder
from lenext.pe import ALiBi, Learned, RoPE, T5Bias
from lenext.protocols import PROTOCOLS, KeyTokens, LastK, NonOverlapping, Sliding, cap_windows
from lenext.run import evaluate_checkpoint, train
from lenext.scoring import evaluate_length
from tests.conftest import CONFIG_FOLDER, small_corpus_overrides, tiny_overrides
from tests.forked import run_command

DOC_LENGTHS = [1, 40, 97, 130, 64, 65]


def scored_positions(windows, length):
    """Multiset of (document, target position) scored by ``windows``; targets of window w are start+1..start+L."""
    return [(w.document, w.start + 1 + t) for w in windows for t in range(w.score_from, length)]


@pytest.mark.parametrize("length", [8, 16, 64])
def test_nonoverlap_scores_each_covered_token_once(length):
    scored = scored_positions(NonOverlapping().windows(DOC_LENGTHS, length), length)
    assert len(scored) == len(set(scored))
    expected = {(d, p) for d, n in enumerate(DOC_LENGTHS) for p in range(1, 1 + (n - 1) // length * length)}
    assert set(scored) == expected


@pytest.mark.parametrize("length,stride", [(16, 4), (16, 16), (32, 5), (8, 1)])
def test_sliding_scores_every_token_after_the_first_window_exactly_once(length, stride):
    windows = Sliding(stride).windows(DOC_LENGTHS, length)
    scored = scored_positions(windows, length)
    assert len(scored) == len(set(scored))
    # every target of every document long enough for one window: positions 1..n-1
    assert set(scored) == {(d, p) for d, n in enumerate(DOC_LENGTHS) if n - 1 >= length for p in range(1, n)}
    for w in windows:  # every scored token has at least L - stride tokens of context (after the first window)
        assert w.score_from == 0 and w.start == 0 or w.score_from >= length - stride


def test_last_k_scores_the_identical_set_at_every_length():
    lengths = [8, 16, 32]
    sets = [scored_positions(LastK(k=8, block=32).windows(DOC_LENGTHS, n), n) for n in lengths]
    assert sets[0] and sets[0] == sets[1] == sets[2]
    assert {d for d, _ in sets[0]} == {d for d, n in enumerate(DOC_LENGTHS) if n - 1 >= 32}
    # Which: the last k targets of every whole block of 32 (tokens (b + 1) 32 - 7 .. (b + 1) 32), as documented.
    blocks = {d: (n - 1) // 32 for d, n in enumerate(DOC_LENGTHS)}
    expected = {(d, p) for d, count in blocks.items() for b in range(count) for p in range(32 * b + 25, 32 * b + 33)}
    assert len(sets[0]) == len(expected) and set(sets[0]) == expected


def tiny_net(pe=RoPE, train_len=16, seed=0, vocab=50):
    torch.manual_seed(seed)
    return Decoder(vocab_size=vocab, train_len=train_len, pe=pe, d_model=32, n_layers=2, n_heads=4).eval()


def random_documents(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, size=n).astype(np.int32) for n in (70, 33, 150, 9)]


def eval_cfg(**overrides):
    base = {
        "protocol": "nonoverlap",
        "lengths": None,
        "factors": [1, 2, 4],
        "stride": None,
        "last_k": None,
        "variants": None,
        "max_windows": None,
        "tokens_per_batch": 64,
        "per_position": True,
    }
    return OmegaConf.create({**base, **overrides})


def sweep_of(net, evaluation, train_len, settings):
    """``sweep`` of a run trained at ``train_len`` with the eval ``settings``, planned as a run plans it."""
    return sweep(net, evaluation, sweep_plan(settings, train_len, None, evaluation.protocols), settings)


def test_the_plan_defaults_and_the_window_cap_are_as_documented():
    """configs/eval/default.yaml: a null stride is half of L_train, a null last_k the shortest length; eval.max_windows
    keeps every k-th window, spread over all of them, not the first ones."""
    plan = sweep_plan(eval_cfg(factors=[2, 4, 8]), 16, None, ("nonoverlap", "sliding", "last_k"))
    assert (plan.lengths, plan.stride, plan.k) == ([32, 64, 128], 8, 32)
    every = ("nonoverlap", "sliding", "last_k")
    given = sweep_plan(eval_cfg(protocol=list(every), stride=3, last_k=5), 16, None, every)
    assert (given.lengths, given.stride, given.k) == ([16, 32, 64], 3, 5)


HAYSTACKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking")


@pytest.mark.parametrize(
    "setting, protocol",
    [
        ({"stride": 8}, "sliding"),
        ({"last_k": 4}, "last_k"),
        ({"key_context": 8}, "key_tokens"),
        ({"key_gain": 5.0}, "key_tokens"),
        ({"key_max_nll": 1.0}, "key_tokens"),
        ({"key_evaluator": "judge.ckpt"}, "key_tokens"),
        ({"haystack_samples": 16}, HAYSTACKS),
        ({"haystack_candidates": 9}, HAYSTACKS),
        ({"haystack_depths": [0.5]}, HAYSTACKS),
    ],
)
def test_a_protocols_own_setting_given_without_the_protocol_is_refused(setting, protocol):
    """eval.stride=8 with nonoverlap alone would evaluate nonoverlap as if nothing were asked; so would
    eval.haystack_samples=16, whose config default is not null. A setting of the haystack protocols is read by
    any one of them."""
    (key, value), every = next(iter(setting.items())), ("nonoverlap", "sliding", "last_k", "key_tokens", *HAYSTACKS)
    whose = f"the {protocol} protocol" if isinstance(protocol, str) else f"the {', '.join(protocol)} protocols"
    expected = rf"^eval.{key}={re.escape(str(value))} changes nothing here: it is a setting of {whose}, which "
    add = protocol if isinstance(protocol, str) else "one of them"
    with pytest.raises(ConfigError, match=expected + rf"eval.protocol=\[nonoverlap\] does not evaluate; add {add}"):
        sweep_plan(eval_cfg(protocol=["nonoverlap"], **setting), 16, None, every)
    reader = protocol if isinstance(protocol, str) else protocol[-1]
    evaluated = {**setting, "key_evaluator": None} if key == "key_evaluator" else setting  # not on disk here
    assert sweep_plan(eval_cfg(protocol=["nonoverlap", reader], **evaluated), 16, None, every)


def test_a_protocols_own_setting_at_its_config_default_asks_nothing():
    """configs/eval/default.yaml shows some protocol defaults (key_gain: 2.0): those values, the ones the protocols
    use when the key is null, pass in any sweep, and the config and the protocols agree on them."""
    defaults = OmegaConf.load(CONFIG_FOLDER / "eval" / "default.yaml")
    every = ("nonoverlap", "sliding", "last_k", "key_tokens", *HAYSTACKS)
    for protocol in PROTOCOLS.values():
        for key, unset in protocol.own_settings.items():
            assert defaults[key] == unset, key
    owned = {key for protocol in PROTOCOLS.values() for key in protocol.own_settings}
    assert owned == {*PROTOCOL_SETTINGS, "stride", "last_k"}  # the plan keeps those two as fields of its own
    shown = {key: defaults[key] for key in PROTOCOL_SETTINGS}
    assert sweep_plan(eval_cfg(protocol=["nonoverlap"], **shown), 16, None, every)
    assert (KeyTokens().gain, KeyTokens().max_nll) == (defaults.key_gain, defaults.key_max_nll)
    haystack = PROTOCOLS["niah_single"]()
    assert (list(haystack.depths), haystack.samples, haystack.candidates) == (
        defaults.haystack_depths,
        defaults.haystack_samples,
        defaults.haystack_candidates,
    )


def test_cap_windows_spreads_evenly():
    assert cap_windows(list(range(100)), 7) == list(range(0, 100, 15))
    assert cap_windows(list(range(10)), None) == list(range(10))


def test_a_key_context_no_length_exceeds_is_refused():
    """An audit found eval.key_context at or beyond every length taken: each key_tokens row had no key token."""
    every = ("nonoverlap", "key_tokens")
    with pytest.raises(ConfigError, match=r"^eval.key_context=64 is invalid with eval.protocol=key_tokens: it must be"):
        sweep_plan(eval_cfg(protocol="key_tokens", lengths=[32, 64], key_context=64), 16, None, every)
    with pytest.raises(ConfigError, match=r"^eval.key_context=null \(L_train = 16\) is invalid .* longest length, 16 "):
        sweep_plan(eval_cfg(protocol="key_tokens", lengths=[16]), 16, None, every)
    assert sweep_plan(eval_cfg(protocol="key_tokens", lengths=[32, 65], key_context=64), 16, None, every)


@pytest.mark.parametrize(
    "setting, refused",
    [
        ({"variants": ["ntk", "ntk"]}, r"eval.variants=\['ntk', 'ntk'\] is invalid: it lists ntk twice"),
        (
            {"protocol": ["nonoverlap", "nonoverlap"]},
            r"eval.protocol=\['nonoverlap', 'nonoverlap'\] is invalid: it lis",
        ),
        ({"haystack_depths": [0.5, 0.5]}, r"eval.haystack_depths=\[0.5, 0.5\] is invalid: it lists 0.5 twice"),
        ({"lengths": []}, r"eval.lengths=\[\] is invalid: give at least one length, or null"),
        ({"lengths": [64, 128, 64]}, r"eval.lengths=\[64, 128, 64\] is invalid: it lists 64 twice"),
        ({"factors": [1, 2, 2.0]}, r"eval.factors=\[1, 2, 2.0\] is invalid: it lists 2 twice"),
        ({"variants": []}, r"eval.variants=\[\] is invalid: give at least one variant \(e.g. \[none,yarn\]\), or null"),
        ({"factors": [1, 1.99]}, r"eval.factors=\[1, 1.99\] is invalid: 1.99 x L_train 32 = 63.68 is no whole number"),
    ],
)
def test_lists_that_would_evaluate_twice_or_elsewhere_than_asked_are_refused(setting, refused):
    """An audit found these taken: a variant, protocol or depth listed twice gave its rows twice (a depth's haystack
    scored twice, its answers counted twice); eval.lengths=[] evaluated eval.factors' lengths; a factor of 1.99
    evaluated L = 63 at L_train 32; a length or factor listed twice, and eval.variants=[], were taken without a word
    (one row; the PE as trained)."""
    with pytest.raises(ConfigError, match="^" + refused):
        sweep_plan(eval_cfg(**setting), 32, None, ("nonoverlap", "niah_single"))
    if "factors" in setting:  # beside eval.lengths, eval.factors are not read: not refused
        assert sweep_plan(eval_cfg(lengths=[32, 64], **setting), 32, None, ("nonoverlap",)).lengths == [32, 64]


def test_lengths_that_make_no_positive_token_count_are_refused_naming_the_key_given():
    """eval.factors=[] had been named as eval.lengths=[]."""
    with pytest.raises(ConfigError, match=r"^eval.factors=\[\] is invalid: give eval.lengths or eval.factors"):
        sweep_plan(eval_cfg(factors=[]), 16, None, ("nonoverlap",))
    with pytest.raises(ConfigError, match=r"^eval.factors=\[0.01\] is invalid: .* \(of L_train 16\)$"):
        sweep_plan(eval_cfg(factors=[0.01]), 16, None, ("nonoverlap",))
    with pytest.raises(ConfigError, match=r"^eval.lengths=\[0, 8\] is invalid"):
        sweep_plan(eval_cfg(lengths=[0, 8]), 16, None, ("nonoverlap",))


def test_a_sliding_stride_longer_than_the_shortest_length_is_refused_before_any_work():
    """Windows advanced by more than L would leave the targets between them unscored (and their bytes counted)."""
    sliding = ("nonoverlap", "sliding")
    with pytest.raises(ConfigError, match=r"^eval.stride=24 is invalid with eval.protocol=sliding: it must be at most "
                       r"the shortest length, 16$"):  # fmt: skip
        sweep_plan(eval_cfg(protocol="sliding", lengths=[16, 32], stride=24), 16, None, sliding)
    with pytest.raises(ConfigError, match=r"^eval.stride=null \(L_train / 2 = 32\) is invalid"):
        sweep_plan(eval_cfg(protocol=["nonoverlap", "sliding"], factors=[0.25, 1]), 64, None, sliding)
    assert sweep_plan(eval_cfg(protocol="sliding", lengths=[16, 32], stride=16), 16, None, sliding).stride == 16
    assert sweep_plan(eval_cfg(protocol="nonoverlap", factors=[0.25, 1]), 64, None, sliding).stride == 32


@pytest.mark.parametrize("protocol", ["nonoverlap", "sliding", "last_k"])
def test_perplexity_equals_exp_mean_nll_of_a_plain_per_window_loop(protocol):
    net, docs = tiny_net(), random_documents()
    own = {"nonoverlap": {}, "sliding": {"stride": 5}, "last_k": {"last_k": 8}}[protocol]
    rows, _ = sweep_of(net, TextEvaluation(docs), 16, eval_cfg(protocol=protocol, **own))
    for row in rows:
        length = row["length"]
        chosen = {"nonoverlap": NonOverlapping(), "sliding": Sliding(5), "last_k": LastK(8, 64)}[protocol]
        windows = chosen.windows([len(d) for d in docs], length)
        total, count = 0.0, 0
        with torch.no_grad():
            for w in windows:  # reference: one window at a time, full logits, log_softmax by hand
                ids = torch.from_numpy(docs[w.document][w.start : w.start + length + 1]).long()[None]
                logp = torch.log_softmax(net.logits(net(ids[:, :-1])).double(), -1)[0]
                nll = -logp[torch.arange(length), ids[0, 1:]]
                total += nll[w.score_from :].sum().item()
                count += length - w.score_from
        assert row["tokens"] == count and row["status"] == "ok"
        assert row["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)


@pytest.mark.parametrize("chunk_elements", [50 * 3 * 7, 50 * 3 * 5, 2**22])  # 7 positions a chunk, 5 (uneven), 1 chunk
def test_token_nll_in_logit_chunks_equals_a_whole_log_softmax_with_its_gradients(chunk_elements, monkeypatch):
    monkeypatch.setitem(lenext.model.LOGIT_CHUNK_ELEMENTS, "cpu", chunk_elements)  # of a batch of 3, vocabulary 50
    net = tiny_net()
    tokens, targets = torch.randint(0, 50, (2, 3, 21)).unbind()
    nll, predicted = net.token_nll(tokens, targets, predictions=True)
    (grad,) = torch.autograd.grad(nll.sum(), net.head.weight)
    logp = torch.log_softmax(net.logits(net(tokens)).double(), -1)  # reference: every logit at once, float64
    expected = -logp.gather(-1, targets[..., None])[..., 0]
    (expected_grad,) = torch.autograd.grad(expected.sum(), net.head.weight)
    torch.testing.assert_close(nll, expected.float())
    torch.testing.assert_close(grad, expected_grad.float())
    assert torch.equal(predicted, logp.argmax(-1))


@pytest.mark.parametrize(
    "pe", [T5Bias, ALiBi, functools.partial(__import__("lenext.pe", fromlist=["x"]).ShawRelative, value_term=True)]
)
def test_query_chunked_evaluation_equals_unchunked(pe, monkeypatch):
    net, docs = tiny_net(pe), random_documents(1)
    windows = NonOverlapping().windows([len(d) for d in docs], 64)
    whole = evaluate_length(net, docs, windows, 64, 256, per_position=True)
    # Blocks of 5 rows: BandedAttention's steps (T5), the explicit path's query blocks (Shaw with a^V,
    # and ALiBi once its fused kernel is taken away).
    monkeypatch.setattr(lenext.attention.band, "BAND_ROWS", 5)
    monkeypatch.setitem(lenext.attention.SCORE_BLOCK_ELEMENTS, "cpu", 4 * 64 * 5)
    monkeypatch.setattr(lenext.attention, "fused_mask_with_causal", lambda device_type: False)
    chunked = evaluate_length(net, docs, windows, 64, 256, per_position=True)
    assert chunked["mean_nll"] == pytest.approx(whole["mean_nll"], rel=1e-5)
    np.testing.assert_allclose(chunked["curve"], whole["curve"], rtol=1e-5)


@pytest.mark.parametrize("tokens_per_batch", [16, 64])  # a window a batch; every window in one
def test_a_nan_loss_makes_the_mean_nan_at_any_batching(tokens_per_batch, monkeypatch):
    """A diverged model's NaN is reported, not dropped: torchmetrics' default would leave the other windows' mean,
    reported over all the tokens, and only when the NaN has a batch of its own."""
    net, docs = tiny_net(), random_documents(3)
    windows = NonOverlapping().windows([len(d) for d in docs], 16)
    token_nll = net.token_nll

    def one_nan(tokens, targets, *args, **kwargs):
        nll = token_nll(tokens, targets, *args, **kwargs).clone()
        nll[tokens[:, 0] == int(docs[0][16]), 3] = float("nan")  # one target of the first document's second window
        return nll

    monkeypatch.setattr(net, "token_nll", one_nan)
    result = evaluate_length(net, docs, windows, 16, tokens_per_batch, per_position=True)
    assert math.isnan(result["mean_nll"]) and result["tokens"] == 16 * len(windows)
    assert math.isnan(result["curve"][3]) and not math.isnan(result["curve"][2])


def test_per_position_curve_averages_the_windows():
    """curve[p]: the mean NLL of the target at position p of a window, over the windows (a one-window-at-a-time
    reference: a curve shifted or reversed would still average to the mean NLL)."""
    net, docs = tiny_net(), random_documents(2)
    windows = NonOverlapping().windows([len(d) for d in docs], 16)
    result = evaluate_length(net, docs, windows, 16, 1000, per_position=True)
    assert result["curve_counts"] == [len(windows)] * 16
    assert np.mean(result["curve"]) == pytest.approx(result["mean_nll"], rel=1e-6)  # MeanMetric sums in fp32
    with torch.no_grad():
        per_window = []
        for w in windows:
            ids = torch.from_numpy(docs[w.document][w.start : w.start + 17]).long()[None]
            logp = torch.log_softmax(net.logits(net(ids[:, :-1])).double(), -1)[0]
            per_window.append(-logp[torch.arange(16), ids[0, 1:]])
    np.testing.assert_allclose(result["curve"], torch.stack(per_window).mean(0).numpy(), rtol=1e-5)


def test_learned_beyond_max_len_is_not_applicable_and_the_sweep_goes_on():
    rows, _ = sweep_of(tiny_net(Learned), TextEvaluation(random_documents()), 16, eval_cfg(factors=[1, 2, 4, 16]))
    by_length = {r["length"]: r for r in rows}
    assert by_length[16]["status"] == "ok" and by_length[16]["ppl"] > 1
    for length in (32, 64):
        assert by_length[length]["status"] == "not applicable" and "positions" in by_length[length]["reason"]
        assert by_length[length]["windows"] == by_length[length]["tokens"] == 0  # none was scored
    # 256 tokens: no document is that long -> 0 windows with the reason, never padding
    assert by_length[256]["status"] == "no windows" and by_length[256]["windows"] == 0
    assert "longest has 149" in by_length[256]["reason"]


def test_rope_scalings_give_one_row_each_with_the_factor_used():
    net = tiny_net(RoPE)
    rows, _ = sweep_of(
        net, TextEvaluation(random_documents()), 16, eval_cfg(variants=["none", "linear", "ntk", "yarn"])
    )
    assert [(r["variant"], r["length"]) for r in rows] == [
        (s, n) for s in ("none", "linear", "ntk", "yarn") for n in (16, 32, 64)
    ]
    for r in rows:
        assert r["variant_factor"] == (1.0 if r["variant"] == "none" else r["length"] / 16)
    at_train_len = {r["ppl"] for r in rows if r["length"] == 16}
    assert len({round(p, 9) for p in at_train_len}) == 1  # every scaling is the identity at L_train
    assert net.pe.scaling == "none"  # restored after the sweep


def test_checkpoint_evaluation_matches_training_validation_and_writes_documented_results(
    compose_train, small_text_corpus, tmp_path
):
    cfg = compose_train(
        *tiny_overrides(
            "pe=rope",
            "data=text_files",
            f"data.corpus.path={small_text_corpus}",
            "data.corpus.holdout_every=4",
            "data.vocab_size=512",
            "data.max_len=32",
            "trainer.max_steps=20",
            "trainer.val_check_interval=20",
            "trainer.enable_progress_bar=false",
            "eval.factors=[1,4]",
        )
    )
    # A commit made while the run trains must not be named: meta.git_commit is the code the process loaded.
    lenext.results.code_commit.cache_clear()
    metrics = train(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        results["complete"] and results["meta"]["train_len"] == 32 and results["meta"]["tokens_trained"] == 20 * 4 * 32
    )
    assert {"pe", "seed", "corpus", "tokenizer", "git_commit", "versions"} <= set(results["meta"])
    assert results["meta"]["git_commit"] == lenext.results.code_commit()
    assert lenext.results.code_commit.cache_info().misses == 1  # asked once, before training
    first = results["rows"][0]
    assert (first["length"], first["status"]) == (32, "ok")
    assert first["ppl"] == pytest.approx(metrics["val/ppl"], rel=1e-5)
    assert (tmp_path / "positions.csv").read_text().startswith("variant,length,position,mean_nll,count")

    eval_dir = tmp_path / "eval"
    eval_config = compose_eval(
        tmp_path,
        eval_dir,
        tmp_path / "checkpoints" / "last.ckpt",
        "eval.lengths=[32,64]",
        "eval.variants=[none,ntk]",
    )
    evaluate_checkpoint(eval_config)
    rows = json.loads((eval_dir / "results.json").read_text())["rows"]
    none_at_train_len = next(r for r in rows if r["variant"] == "none" and r["length"] == 32)
    assert none_at_train_len["ppl"] == pytest.approx(metrics["val/ppl"], rel=1e-5)
    assert [(r["variant"], r["length"]) for r in rows] == [("none", 32), ("none", 64), ("ntk", 32), ("ntk", 64)]

    # Any setting of the checkpoint's PE can change at evaluation, on any split...
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "base", ckpt, "eval.lengths=[64]", "+pe.base=2"))
    base = json.loads((tmp_path / "base" / "results.json").read_text())
    # meta.pe is the evaluated net's own describe(). (Its perplexity barely moves: 20 steps leave the
    # model nearly blind to position, within an fp32 ulp of the mean loss.)
    assert base["meta"]["pe"]["base"] == 2 and base["rows"][0]["status"] == "ok"
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "fit", ckpt, "eval.lengths=[32]", "split=train"))
    assert json.loads((tmp_path / "fit" / "results.json").read_text())["meta"]["split"] == "train"
    # A run folder is read as its last.ckpt, which the results name: as eval.py given that file.
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "folder", tmp_path, "eval.lengths=[32]", "split=train"))
    by_folder = json.loads((tmp_path / "folder" / "results.json").read_text())
    assert by_folder["meta"]["checkpoint"] == str(ckpt)
    fit_rows = json.loads((tmp_path / "fit" / "results.json").read_text())["rows"]
    assert [r["ppl"] for r in by_folder["rows"]] == [r["ppl"] for r in fit_rows]
    # A checkpoint from before the `train` node (positions) and the stored RunSpec existed evaluates at 0..L-1.
    old = torch.load(ckpt, map_location="cpu", weights_only=False)
    config = old["hyper_parameters"].pop("run")["config"]
    del config["train"], config["init_from"], config["pe"]["original_len"]
    config["eval"]["rope_scalings"] = config["eval"].pop("variants")  # the key's name then
    old["hyper_parameters"]["run_config"] = config
    torch.save(old, tmp_path / "old.ckpt")
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "old", tmp_path / "old.ckpt", "eval.lengths=[64]"))
    old_results = json.loads((tmp_path / "old" / "results.json").read_text())
    assert old_results["meta"]["positions"] == {"train": "sequential", "reach": None, "eval": "sequential"}
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "new", ckpt, "eval.lengths=[64]"))
    new_rows = json.loads((tmp_path / "new" / "results.json").read_text())["rows"]
    assert [r["mean_nll"] for r in old_results["rows"]] == [r["mean_nll"] for r in new_rows]
    # A checkpoint from before the rebuild (its run keeps eval.rope_scalings, and no row_fields) evaluates the same.
    before = torch.load(ckpt, map_location="cpu", weights_only=False)
    run = before["hyper_parameters"]["run"]
    run["eval"]["rope_scalings"] = run["eval"].pop("variants")
    del run["row_fields"]
    torch.save(before, tmp_path / "before.ckpt")
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "before", tmp_path / "before.ckpt", "eval.lengths=[64]"))
    before_results = json.loads((tmp_path / "before" / "results.json").read_text())
    assert [r["mean_nll"] for r in before_results["rows"]] == [r["mean_nll"] for r in new_rows]
    assert before_results["meta"]["row"] == "rope" and before_results["meta"]["row_fields"] is None
    # ... but not one the checkpoint's PE lacks, and nothing is read or written for it.
    with pytest.raises(ConfigError, match=r"^pe.k does not apply to this checkpoint's PE"):
        evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "bad", ckpt, "+pe.k=4"))
    assert not (tmp_path / "bad").exists()


def test_a_checkpoint_of_a_pe_without_rope_settings_evaluates_as_trained(compose_train, small_text_corpus, tmp_path):
    """eval.py's changes to the PE apply to the settings the checkpoint's PE has: an xPos checkpoint (a RoPE without
    a scaling setting) evaluates with none, and the same as the sweep after its training."""
    cfg = compose_train(
        *small_corpus_overrides(small_text_corpus, "pe=xpos", "trainer.max_steps=2", "eval.lengths=[64]")
    )
    train(cfg)
    trained = json.loads((tmp_path / "results.json").read_text())["rows"]
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "eval", ckpt, "eval.lengths=[64]"))
    evaluated = json.loads((tmp_path / "eval" / "results.json").read_text())["rows"]
    assert evaluated[0]["mean_nll"] == pytest.approx(trained[0]["mean_nll"], rel=1e-5)
    with pytest.raises(ConfigError, match=r"^pe.scaling does not apply to this checkpoint's PE \(lenext.pe.XPos\)"):
        evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "bad", ckpt, "pe.scaling=yarn"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: Lightning's teardown moves a model off CUDA")
def test_the_sweep_after_training_runs_on_the_training_device(compose_train, small_text_corpus, tmp_path):
    cfg = compose_train(
        *small_corpus_overrides(small_text_corpus, "trainer=gpu", "trainer.max_steps=2", "eval.factors=[1]")
    )
    train(cfg)
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["device"].startswith("cuda")


def test_an_override_that_changes_the_pes_weights_is_refused_before_the_corpus_loads(
    compose_train, small_text_corpus, tmp_path
):
    cfg = compose_train(
        *tiny_overrides(
            "pe=t5",
            "data=text_files",
            f"data.corpus.path={small_text_corpus}",
            "data.corpus.holdout_every=4",
            "data.vocab_size=512",
            "data.max_len=32",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.enable_progress_bar=false",
            "eval.enabled=false",
        )
    )
    train(cfg)
    eval_config = compose_eval(tmp_path, tmp_path / "eval", tmp_path / "checkpoints" / "last.ckpt", "+pe.num_buckets=8")
    with pytest.raises(ConfigError, match=r"^pe.num_buckets: the checkpoint's weights do not fit the PE built with it"):
        evaluate_checkpoint(eval_config)
    assert not (tmp_path / "eval").exists()
    # A sweep's check of each job (check_only) refuses it alike, building the model on the meta device: its
    # parameters are the checkpoint's tensors, with no memory or initialization of their own (1B: 17 s saved a job)
    from lenext.run import checkpoint_model

    with pytest.raises(ConfigError, match=r"^pe.num_buckets: the checkpoint's weights do not fit the PE built with it"):
        checkpoint_model(eval_config, eval_config.ckpt, check_only=True)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    _, _, net, checkpoint = checkpoint_model(
        compose_eval(tmp_path, tmp_path / "eval", ckpt), str(ckpt), check_only=True
    )
    state = net_state(checkpoint)
    assert all(p.data_ptr() == state[name].data_ptr() for name, p in net.named_parameters())


# Both precisions on every machine (bf16 is emulated, and slow, without AMX or AVX512_BF16); eval.py names each
# as Lightning does (32 = 32-true, bf16 = bf16-mixed) and reproduces the rows training's sweep wrote in it.
PRECISIONS = [("32-true", "32"), ("bf16-mixed", "bf16"), ("32-true", 32), ("bf16-mixed", "bf16-mixed")]


@pytest.mark.parametrize(
    "scheme,trained_in,evaluated_in", [(s, *p) for s in ("randomized", "pose") for p in PRECISIONS]
)
def test_training_at_drawn_positions_is_reproducible_and_evaluates_as_its_scheme_says(
    scheme, trained_in, evaluated_in, compose_train, small_text_corpus, tmp_path
):
    """Two runs draw the same positions (same seed); validation scores each window at the positions the sweep's
    1x row gives it; results record the scheme; eval.py evaluates as trained or, asked to, at 0..L-1."""
    overrides = small_corpus_overrides(
        small_text_corpus,
        f"trainer.precision={trained_in}",
        "pe=rope",
        f"train.positions={scheme}",
        f"train.{'max_position' if scheme == 'randomized' else 'target_len'}=256",
        "trainer.max_steps=6",
        "eval.factors=[1,2]",
        "eval.max_windows=7",
    )
    runs = []
    for run in ("a", "b"):
        metrics = train(compose_train(*overrides, f"paths.output_dir={tmp_path / run}"))
        runs.append(json.loads((tmp_path / run / "results.json").read_text()))
    assert [r["ppl"] for r in runs[0]["rows"]] == [r["ppl"] for r in runs[1]["rows"]]
    assert metrics["val/ppl"] == pytest.approx(runs[1]["rows"][0]["ppl"], rel=1e-5)
    evaluated = "randomized" if scheme == "randomized" else "sequential"  # PoSE prepares the model for 0..L-1
    assert runs[0]["meta"]["positions"] == {"train": scheme, "reach": 256, "eval": evaluated}

    assert runs[0]["meta"]["hardware"]["training_precision"] == trained_in
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    evaluate_checkpoint(
        compose_eval(
            tmp_path,
            tmp_path / "as_trained",
            ckpt,
            "eval.lengths=[32,64]",
            "eval.max_windows=7",
            f"precision={evaluated_in}",
        )
    )
    as_trained = json.loads((tmp_path / "as_trained" / "results.json").read_text())
    assert [r["ppl"] for r in as_trained["rows"]] == [r["ppl"] for r in runs[0]["rows"]]
    evaluate_checkpoint(
        compose_eval(tmp_path, tmp_path / "plain", ckpt, "eval.lengths=[64]", "eval.positions=sequential")
    )
    assert json.loads((tmp_path / "plain" / "results.json").read_text())["meta"]["positions"]["eval"] == "sequential"
    if scheme == "randomized":  # positions drawn from [0, 256) cannot cover 512 tokens: refused before any work
        with pytest.raises(ConfigError, match=r"^train.max_position=256 is invalid for this evaluation"):
            evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "long", ckpt, "eval.lengths=[512]"))
        assert not (tmp_path / "long").exists()


@pytest.mark.parametrize(
    "override, why",
    [
        ("+attention.window=8", "the checkpoint keeps its attention settings"),
        ("+train.positions=randomized", r"the checkpoint keeps its training positions \(eval.positions evaluates"),
        ("+model.d_model=8", "the checkpoint keeps its model"),
    ],
)
def test_eval_refuses_the_training_settings_it_would_not_apply(override, why, trained_run, tmp_path):
    """An audit found +attention.* and +train.* taken by eval.py: the checkpoint's own were evaluated, the rows
    those of the model as trained. The refusal says where the setting comes from."""
    key, ckpt = override.removeprefix("+").split("=")[0], trained_run / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=rf"^{key} is not a setting of this command: {why}"):
        evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "eval", ckpt, "eval.lengths=[32]", override))
    assert not (tmp_path / "eval").exists()


def test_a_run_folder_whose_last_checkpoint_is_cut_names_the_file_read_and_the_one_to_use(
    trained_run, tmp_path, monkeypatch
):
    """An audit found ckpt=<folder> with a 0-byte last.ckpt (a run being written) named the folder alone."""
    import shutil

    from lenext.checkpoints import load_checkpoint

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(b"")
    shutil.copy(trained_run / "checkpoints" / "last.ckpt", folder / "best.ckpt")
    expected = (
        rf"^ckpt='{tmp_path / 'run'}' \(its checkpoints/last.ckpt\) cannot be read \(.*; use another checkpoint "
        rf"of the run \(ckpt={folder / 'best.ckpt'}\)$"
    )
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(str(tmp_path / "run"))
    assert load_checkpoint(str(folder / "best.ckpt"))["global_step"] == 2
    monkeypatch.chdir(folder)  # a bare file name: its folder is the working one
    with pytest.raises(CheckpointError, match=r"^ckpt='last.ckpt' cannot be read .* of the run \(ckpt=./best.ckpt\)$"):
        load_checkpoint("last.ckpt")


def test_an_eval_sweep_checks_every_job_before_the_first_starts(trained_run, tmp_path):
    """An audit found eval.py -m unchecked: its third job's bad value failed after two evaluations. Each job is
    checked as it checks itself: its keys, its checkpoint and its plan against the checkpoint's run."""
    from lenext.cli import check_overrides

    ckpt = f"ckpt={trained_run / 'checkpoints' / 'last.ckpt'}"
    refusals = [
        ([ckpt, "eval.lengths=[32],[64],[0]"], r"job 2 of the sweep \(eval.lengths=\[0\]\): eval.lengths=\[0\] is "),
        ([f"{ckpt},{tmp_path / 'missing.ckpt'}"], r"job 1 of the sweep \(ckpt=.*missing.ckpt\): ckpt='.*' does not "),
        (
            [ckpt, "eval.protocol=last_k", "eval.lengths=[64],[32]", "eval.last_k=48"],
            r"job 1 of the sweep \(eval.lengths=\[32\]\): eval.last_k=48 is invalid: it must be at most the shortest",
        ),
    ]
    for overrides, message in refusals:
        with pytest.raises(ConfigError, match=rf"^{message}.*; no job was started$"):
            check_overrides("eval", overrides, multirun=True)
    check_overrides("eval", [ckpt, "eval.lengths=[32],[64]"], multirun=True)


def compose_eval(tmp_path, output_dir, ckpt, *overrides):
    from hydra import compose, initialize_config_module

    from lenext.cli import CONFIG_PACKAGE

    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        return compose(
            "eval",
            overrides=[
                f"paths.root_dir={tmp_path}",
                f"paths.output_dir={output_dir}",
                f"paths.cache_dir={tmp_path}/.cache",
                f"ckpt={ckpt}",
                *overrides,
            ],
        )


def test_an_evaluation_into_a_training_runs_folder_is_refused_before_any_work(tmp_path):
    """eval.py writes a results.json of its own: into a training run's folder it would replace the run's, into
    another model's evaluation's folder that evaluation's (an audit lost one so); into an earlier evaluation of the
    same model's folder it may (ckpt= and hf= alike)."""
    run = tmp_path / "run"
    run.mkdir()
    trained = json.dumps({"complete": True, "meta": {"row": "rope", "seed": 0}, "rows": []})
    (run / "results.json").write_text(trained)
    with pytest.raises(ConfigError, match=rf"^hydra.run.dir={run} holds a training run's results.json, which this "):
        evaluate_checkpoint(compose_eval(tmp_path, run, tmp_path / "missing.ckpt"))
    assert (run / "results.json").read_text() == trained
    another = trained.replace('"seed": 0', '"seed": 0, "checkpoint": "/x.ckpt"')
    (run / "results.json").write_text(another)
    message = rf"^hydra.run.dir={run} holds the results of another model's evaluation \(/x.ckpt\), which this "
    with pytest.raises(ConfigError, match=message):
        evaluate_checkpoint(compose_eval(tmp_path, run, tmp_path / "missing.ckpt"))
    assert (run / "results.json").read_text() == another
    same = trained.replace('"seed": 0', f'"seed": 0, "checkpoint": "{tmp_path / "missing.ckpt"}"')
    (run / "results.json").write_text(same)
    with pytest.raises(CheckpointError, match=r"^ckpt="):  # past the folder: the missing checkpoint is named
        evaluate_checkpoint(compose_eval(tmp_path, run, tmp_path / "missing.ckpt"))


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_eval_py_into_a_training_runs_folder_is_refused_before_any_job_starts(trained_run, tmp_path, mode):
    """Hydra wrote .hydra/ into a job's folder before the job started: a training run's was replaced by the refused
    evaluation's. A sweep folder is checked job folder by job folder (its jobs' settings checked first)."""
    run = tmp_path / "sweep" / "0" if mode == "sweep" else tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("pe: rope\n")
    (run / "results.json").write_text(json.dumps({"complete": True, "meta": {"row": "rope", "seed": 0}, "rows": []}))
    folder = ["-m", f"hydra.sweep.dir={run.parent}"] if mode == "sweep" else [f"hydra.run.dir={run}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"LENEXT_ROOT": str(tmp_path)}
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    done = run_command("eval.py", [*folder, f"ckpt={ckpt}"], env, tmp_path)
    key, named, held = (
        ("hydra.sweep.dir", run.parent, run / "results.json")
        if mode == "sweep"
        else ("hydra.run.dir", run, "results.json")
    )
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: {key}={named} holds a training run's {held}, which this evaluation would replace: give it "
        f"another folder ({key}=...)"
    ]
    assert sorted(os.listdir(run)) in ([".hydra", "results.json"], [".hydra", ".lenext.lock", "results.json"])
    assert (run / ".hydra" / "config.yaml").read_text() == "pe: rope\n"


@pytest.mark.parametrize("script", ["eval.py", "diagnose.py"])
def test_a_refused_evaluation_keeps_the_record_of_the_evaluation_in_its_folder(trained_run, tmp_path, script):
    """eval.py and diagnose.py wrote their .hydra/ record at the start of the job: relaunched into an earlier
    evaluation's folder and refused for a setting, they left its results described by the refused command."""
    run = tmp_path / "evaluated"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("the evaluation's own\n")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"LENEXT_ROOT": str(tmp_path)}
    bad = "eval.factors=[0.3]" if script == "eval.py" else "factors=[0.3]"  # no whole number of tokens
    ckpt = trained_run / "checkpoints" / "last.ckpt" if script == "eval.py" else trained_run
    done = run_command(script, [f"hydra.run.dir={run}", f"ckpt={ckpt}", bad], env, tmp_path)
    assert done.returncode == 1 and "is no whole number of tokens" in done.stderr, done.stderr[-2000:]
    assert (run / ".hydra" / "config.yaml").read_text() == "the evaluation's own\n"
    assert os.listdir(run / ".hydra") == ["config.yaml"]


def test_an_eval_sweep_into_other_job_folders_of_a_training_sweep_folder_goes_on(trained_run, tmp_path):
    """Job folders named otherwise (hydra.sweep.subdir) are not the training run's: the jobs run, each into its own."""
    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    trained = json.dumps({"complete": True, "meta": {"row": "rope", "seed": 0}, "rows": []})
    (run / "results.json").write_text(trained)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"LENEXT_ROOT": str(tmp_path)}
    folders = [f"hydra.sweep.dir={run.parent}", "hydra.sweep.subdir=eval_${hydra.job.num}"]
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    done = run_command("eval.py", ["-m", *folders, f"ckpt={ckpt}", "eval.lengths=[32],[64]"], env, tmp_path)
    assert done.returncode == 0 and "holds a training run's" not in done.stderr, done.stderr[-2000:]
    assert all(json.loads((run.parent / f"eval_{n}" / "results.json").read_text())["complete"] for n in (0, 1))
    assert (run / "results.json").read_text() == trained


@pytest.mark.parametrize("moved", [False, True])
def test_counts_and_means_accumulate_in_float64(moved):
    """torchmetrics' states are float32: 3,000 batches of 8,191 tokens summed to 24,573,952, not 24,573,000, and a
    mean's weights lose units the same way past 2^24 tokens. Moved to a device (every sweep's, Lightning's move of
    the module), a metric took float32 again: each batch's mean NLL was rounded to float32 first (an audit: two
    variants' NLLs 6.4e-7 apart gave one row's digits)."""
    from lenext.scoring import mean_metric, sum_metric

    tokens, nll = sum_metric(), mean_metric()
    if moved:
        tokens, nll = tokens.to("cpu"), torch.nn.ModuleList([nll]).to(torch.device("cpu"))[0]
    for i in range(3000):
        tokens.update(8191)
        nll.update(torch.tensor(0.1 * (i % 3), dtype=torch.float64), weight=8191)
    assert int(tokens.compute().item()) == 3000 * 8191
    assert nll.compute().dtype == torch.float64 and nll.compute().item() == pytest.approx(0.1, rel=1e-12)
    one = mean_metric().to("cpu")
    one.update(torch.tensor(9.023920502979308, dtype=torch.float64), weight=2048)
    assert one.compute().item() == 9.023920502979308  # float32 made it 9.023920059204102


def test_an_evaluation_without_curves_leaves_no_earlier_positions_file(tmp_path):
    """eval.py run again into a folder with eval.per_position=false (or only protocols without a curve): the
    earlier run's positions.csv would be read by the report beside the new results.json (found by an audit)."""
    from lenext.results import POSITIONS_FILE, write_results

    write_results(str(tmp_path), {}, [], [(None, 32, 0, 1.5, 4)])
    assert (tmp_path / POSITIONS_FILE).exists()
    write_results(str(tmp_path), {}, [], [])
    assert not (tmp_path / POSITIONS_FILE).exists() and (tmp_path / "results.json").exists()


def test_hf_settings_given_with_a_checkpoint_are_refused_not_ignored(tmp_path):
    """context= and trust_remote_code= are an HF model's: with ckpt= they changed nothing, without a word (the
    evaluation ran at the checkpoint's own L_train)."""
    for given, named in (("context=64", "context=64"), ("trust_remote_code=true", "trust_remote_code=True")):
        cfg = compose_eval(tmp_path, tmp_path / "out", tmp_path / "missing.ckpt", given)
        with pytest.raises(ConfigError, match=rf"^{named} applies to hf= evaluations"):
            evaluate_checkpoint(cfg)
    for data in ("sotu", "synthetic"):  # synthetic's data.seed is ${seed}, which eval.py's config has not: said first
        with pytest.raises(ConfigError, match=r"^data= applies to hf= evaluations"):
            evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "out", tmp_path / "missing.ckpt", f"data={data}"))


def test_a_folder_given_for_a_checkpoint_is_its_last_ckpt_or_its_only_one_else_refused(tmp_path):
    """eval.py, diagnose.py, init_from= and eval.key_evaluator take a run folder as the checkpoint in it: last.ckpt
    (in it or one level down), else its one .ckpt; a folder of none, or of several and no last.ckpt, is named."""
    from lenext.checkpoints import checkpoint_file

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"^ckpt='.*run' is a folder without a checkpoint \(no \*.ckpt in it"):
        checkpoint_file(str(run))
    (run / "checkpoints" / "best.ckpt").write_bytes(b"")
    assert checkpoint_file(str(run)) == str(run / "checkpoints" / "best.ckpt")
    (run / "checkpoints" / "step=10.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"^init_from='.*run' holds several checkpoints and no one last.ckpt"):
        checkpoint_file(str(run), "init_from")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert checkpoint_file(str(run)) == str(run / "checkpoints" / "last.ckpt")
    assert checkpoint_file(str(run / "checkpoints" / "best.ckpt")) == str(run / "checkpoints" / "best.ckpt")


def test_a_resume_from_a_run_folder_hands_lightning_its_last_ckpt(trained_run, tmp_path, cache_dir, small_text_corpus):
    """ckpt_path=<run folder> resumes from the file the folder holds: Lightning is given that file, not the folder."""
    from hydra import compose, initialize_config_module

    from lenext.cli import CONFIG_PACKAGE
    from lenext.run_folder import resume_checkpoint

    overrides = small_corpus_overrides(small_text_corpus, "pe=rope", "trainer.max_steps=2", "eval.enabled=false")
    paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}", f"paths.cache_dir={cache_dir}"]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=[*paths, *overrides, f"ckpt_path={trained_run}"])
    path, _ = resume_checkpoint(cfg)
    assert path == str(trained_run / "checkpoints" / "last.ckpt")
