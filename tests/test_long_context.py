"""Key-token perplexity and natural-haystack retrieval (lenext.protocols, lenext.haystack) against their definitions
computed here independently: a plain per-target loop in float64, and oracles whose retrieval is known."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import lenext.protocols.key_tokens
from lenext import protocols
from lenext.errors import CheckpointError, ConfigError, LengthNotSupported
from lenext.evaluate import TextEvaluation, sweep, sweep_plan
from lenext.haystack import TASKS, HaystackText, measure_haystack, sample_rng
from lenext.positions import Randomized
from lenext.protocols import PROTOCOLS, KeyTokens, Window
from lenext.protocols.base import ROW_FIELDS, registry
from tests.test_evaluate import eval_cfg, tiny_net

# ---- key-token perplexity -------------------------------------------------------------------------------------------


def short_context_start(t: int, length: int, context: int) -> int:
    """The first token of target t's short context, from the definition: windows of ``context`` tokens advanced by
    a fifth of it, the window scoring t the first that reaches it (t < context: the window from 0)."""
    if t < context:
        return 0
    stride = max(1, context // 5)
    end = min(length, context + math.ceil((t + 1 - context) / stride) * stride)
    return end - context


def nll_of(net, tokens: np.ndarray) -> np.ndarray:
    """The NLL of tokens 1.. given those before, float64."""
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        logits = net.logits(net(ids[:, :-1])).double()
    return (-logits.log_softmax(-1)[0].gather(-1, ids[0, 1:, None])[:, 0]).numpy()


def loud_net(seed: int):
    """A tiny net with weights large enough that a longer context moves its predictions."""
    net = tiny_net(seed=seed)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.normal_(0, 0.5)
    return net


@pytest.mark.parametrize("evaluator", [None, "another model"])
def test_key_token_perplexity_equals_the_definition_computed_target_by_target(evaluator, monkeypatch):
    """The model's NLL over the targets its evaluator (itself, or another model) finds key, computed here one
    target at a time: each target's short context rebuilt from the definition."""
    length, net = 40, loud_net(0)
    judge = net if evaluator is None else loud_net(1)
    monkeypatch.setattr(lenext.protocols.key_tokens, "evaluator_net", lambda path, like: judge)
    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 50, n).astype(np.int32) for n in (90, 45)]
    byte_ends = [np.cumsum(rng.integers(1, 4, len(d))) for d in documents]
    protocol = KeyTokens(context=16, gain=0.05, max_nll=6.0, evaluator=evaluator)
    windows = protocol.windows([len(d) for d in documents], length)
    key_nll, key_bytes, keys, targets = 0.0, 0, 0, 0
    for w in windows:
        tokens = documents[w.document][w.start : w.start + length + 1]
        long, judged = nll_of(net, tokens), nll_of(judge, tokens)
        for t in range(length):
            start = short_context_start(t, length, protocol.context)
            short = nll_of(judge, tokens[start : t + 2])[-1]
            targets += 1
            if short - judged[t] > protocol.gain and judged[t] < protocol.max_nll:
                keys += 1
                key_nll += long[t]
                ends = byte_ends[w.document]
                key_bytes += int(ends[w.start + t + 1] - ends[w.start + t])
    settings = eval_cfg(tokens_per_batch=64)
    row = protocol.measure(net, TextEvaluation(documents, byte_ends), windows, length, settings, "32-true", None, 0)
    assert keys > 5 and row.metrics["tokens"] == keys
    assert row.metrics["key_share"] == pytest.approx(keys / targets)
    assert row.metrics["ppl"] == pytest.approx(math.exp(key_nll / keys), rel=1e-5)
    assert row.metrics["bytes"] == key_bytes
    assert row.metrics["bits_per_byte"] == pytest.approx(key_nll / math.log(2) / key_bytes, rel=1e-5)


def test_a_key_evaluator_that_does_not_exist_or_reads_another_vocabulary_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="eval.key_evaluator='nowhere' does not exist"):
        sweep_plan(eval_cfg(protocol="key_tokens", key_evaluator="nowhere"), 16, None, tuple(PROTOCOLS))
    (tmp_path / "results.json").write_text("{}")  # not a checkpoint: refused with the plan, not after a sweep
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_text("half")
    for given in (tmp_path / "results.json", tmp_path):
        with pytest.raises(CheckpointError, match=r"^eval.key_evaluator='.*' is not a checkpoint \(torch.save"):
            sweep_plan(eval_cfg(protocol="key_tokens", key_evaluator=str(given)), 16, None, tuple(PROTOCOLS))
    (tmp_path / "checkpoints" / "last.ckpt").unlink()  # a run still training: its checkpoint is read when used
    sweep_plan(eval_cfg(protocol="key_tokens", key_evaluator=str(tmp_path)), 16, None, tuple(PROTOCOLS))
    with pytest.raises(ConfigError, match="eval.haystack_depths=\\[\\] is invalid"):
        sweep_plan(eval_cfg(protocol="niah_single", haystack_depths=[]), 16, None, tuple(PROTOCOLS))


def test_a_key_evaluator_folder_is_read_as_every_checkpoint_folder_is(trained_run, tmp_path):
    """A run folder's one checkpoint, or the checkpoints folder itself, names the judge as it does for eval.py and
    init_from= (lenext.checkpoints.checkpoint_file): eval.key_evaluator had looked for <folder>/checkpoints/last.ckpt
    alone, and called a folder holding only best.ckpt, or a checkpoints folder, one that does not exist."""
    import shutil

    from lenext.checkpoints import load_checkpoint, net_state
    from lenext.protocols import evaluator_net

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copy(trained_run / "checkpoints" / "last.ckpt", tmp_path / "run" / "checkpoints" / "best.ckpt")
    expected = net_state(load_checkpoint(str(trained_run)))["embedding.weight"]
    for folder in (tmp_path / "run", tmp_path / "run" / "checkpoints", trained_run / "checkpoints"):
        sweep_plan(eval_cfg(protocol="key_tokens", key_evaluator=str(folder)), 32, None, tuple(PROTOCOLS))
        judge = evaluator_net(str(folder), tiny_net(vocab=expected.size(0)))
        torch.testing.assert_close(judge.embedding.weight, expected, rtol=0, atol=0)


def test_a_key_evaluator_trained_with_another_tokenizer_is_refused_once_the_data_is_prepared(trained_run, sotu_data):
    """An audit found one of the same vocabulary size accepted: it read the evaluated documents' token ids as its
    own text's, and chose meaningless key tokens. The run folder's tokenizer passes; another corpus's is refused,
    before any evaluation (train.py and eval.py call this once the corpus is prepared)."""
    from types import SimpleNamespace

    from lenext.checkpoints import load_checkpoint
    from lenext.protocols import refuse_an_evaluator_of_other_text

    plan = sweep_plan(eval_cfg(protocol="key_tokens", key_evaluator=str(trained_run)), 32, None, tuple(PROTOCOLS))
    own = load_checkpoint(str(trained_run))["trained_on"]
    refuse_an_evaluator_of_other_text(plan, SimpleNamespace(trained_on=lambda: own))
    assert sotu_data.trained_on()["tokenizer"] != own["tokenizer"]
    with pytest.raises(ConfigError, match=rf"^eval.key_evaluator='{trained_run}' was trained with another tokeni"):
        refuse_an_evaluator_of_other_text(plan, sotu_data)


def test_at_the_short_context_no_token_is_key():
    net, documents = tiny_net(), [np.arange(100, dtype=np.int32) % 50]
    protocol = KeyTokens(context=16, gain=0.0, max_nll=math.inf)  # any gain at all would make a key token
    windows = protocol.windows([100], 16)
    row = protocol.measure(net, TextEvaluation(documents), windows, 16, eval_cfg(), "32-true", None, 0)
    assert row.metrics["tokens"] == 0 and row.metrics["ppl"] is None and row.metrics["key_share"] == 0


def test_no_target_within_the_short_context_is_key_at_any_gain():
    """A window's first C targets have their whole context in the short pass too: at gain 0 the rounding between
    the two passes' shapes, or under randomized positions their other draws, made some of them key (found by an
    audit: 17 of 216 at C 10)."""
    from lenext.positions import Randomized
    from lenext.scoring import window_nll

    net, length = loud_net(0), 48
    documents = [np.random.default_rng(0).integers(0, 50, 200).astype(np.int32)]
    protocol = KeyTokens(context=16, gain=0.0, max_nll=math.inf)
    windows = protocol.windows([200], length)
    for scheme in (None, Randomized(256, 16)):
        ((group, long_nll),) = window_nll(net, documents, windows, length, 10**6, "32-true", scheme, 0)
        key = protocol.key_targets(net, documents, group, long_nll, length, eval_cfg(), "32-true", scheme, 0)
        assert not key[:, :16].any() and key[:, 16:].any()


def test_every_target_of_a_key_token_window_gets_one_short_context_of_four_fifths_to_all_of_it():
    protocol = KeyTokens(context=20)
    window = Window(0, 7, 0)
    scored = {}
    for short in protocol.short_windows(window, 97):
        for target in range(short.score_from, 20):
            position = short.start - window.start + target
            assert position not in scored
            scored[position] = target + 1  # tokens of context
    assert sorted(scored) == list(range(97))
    assert all(context >= 16 for position, context in scored.items() if position >= 20)


# ---- natural-haystack retrieval -------------------------------------------------------------------------------------


class Copier(torch.nn.Module):
    """An induction oracle: the next token is the one after the longest earlier match of the context's end, with
    probability 0.9 (the rest spread evenly); no match: token 0."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the device

    @staticmethod
    def continuation(sequence: list[int], t: int) -> int:
        best, best_len = 0, 0
        for j in range(t - 1, -1, -1):
            k = 0
            while k <= j and sequence[j - k] == sequence[t - k]:
                k += 1
            if k > best_len:
                best, best_len = sequence[j + 1], k
        return best

    def token_nll(self, inputs, targets, positions=None, predictions=False):
        predicted = torch.tensor([[self.continuation(row, t) for t in range(len(row))] for row in inputs.tolist()])
        nll = torch.where(predicted == targets, -math.log(0.9), -math.log(0.1 / (self.vocab_size - 1))).float()
        return (nll, predicted) if predictions else nll


class Blind(Copier):
    """Every token equally likely; predicts token 0."""

    def token_nll(self, inputs, targets, positions=None, predictions=False):
        nll = torch.full(targets.shape, math.log(self.vocab_size))
        return (nll, torch.zeros_like(targets)) if predictions else nll


@pytest.fixture(scope="module")
def haystack(sotu_data) -> HaystackText:
    return HaystackText(sotu_data.documents("validation"), sotu_data.tokenizer)


DEPTHS = (0.0, 0.5, 1.0)


def measure(net, haystack, task, length, samples=2, candidates=3):
    windows = [(i, d) for i in range(samples) for d in range(len(DEPTHS))]
    return measure_haystack(net, haystack, task, windows, DEPTHS, length, candidates, 4096, "32-true", None, 0)


@pytest.mark.parametrize("task", ["single", "multikey", "multiquery"])
def test_a_model_that_copies_retrieves_every_needle_at_every_depth(haystack, sotu_data, task):
    measured = measure(Copier(sotu_data.vocab_size), haystack, task, 200)
    assert measured.metrics["exact_match"] == 1.0 and measured.metrics["rank_accuracy"] == 1.0
    assert [row["depth"] for row in measured.breakdown] == list(DEPTHS)
    assert all(row["rank_accuracy"] == 1.0 and row["windows"] == 2 for row in measured.breakdown)
    assert measured.metrics["answers"] == (4 if task == "multiquery" else 1) * 2 * len(DEPTHS)


def test_a_model_that_ignores_the_context_retrieves_nothing_ties_included(haystack, sotu_data):
    measured = measure(Blind(sotu_data.vocab_size), haystack, "single", 120)
    assert measured.metrics["rank_accuracy"] == 0.0 and measured.metrics["exact_match"] == 0.0
    assert measured.metrics["chance"] == 0.25
    assert measured.metrics["ppl"] == pytest.approx(sotu_data.vocab_size)


@pytest.mark.parametrize("task", list(TASKS))
def test_a_sample_is_the_haystack_with_its_needles_then_the_query_and_candidates_differ_only_in_answers(
    haystack, sotu_data, task
):
    length, candidates = 300, 3
    rng = sample_rng(task, length, 0, 1)
    written = haystack.write(task, rng, 0.5)
    built = haystack.build(written, length, rng, candidates)
    rng = sample_rng(task, length, 0, 1)
    again = haystack.build(haystack.write(task, rng, 0.5), length, rng, candidates)
    np.testing.assert_array_equal(built.rows, again.rows)  # a function of (task, L, index, depth) alone
    encode = haystack.encode
    true = built.rows[0].tolist()
    text = sotu_data.tokenizer.decode(true)
    ANSWER_POSITION.update({v: text.find(f" {v}.") for v in written.answers})
    for span, answer in zip(built.answers, answer_order(written), strict=True):
        assert true[span.start + 1 : span.stop + 1] == encode(" " + answer)  # targets t predict tokens t + 1
        assert len(span) == haystack.widths[written.kind]  # every answer and candidate as long
    assert built.answers[-1].stop == length  # the last answer ends the sample
    assert built.rows.shape == (1 + len(built.answers) * candidates, length + 1)
    for span, others in zip(built.answers, built.distractor_rows, strict=True):
        assert len(others) == candidates
        for r in others:  # a distractor row is the true one with this answer alone replaced
            differs = {t for t in range(length) if built.rows[r][t + 1] != built.rows[0][t + 1]}
            assert differs and differs <= set(span)
    body = true[: built.answers[0].start + 1 - len(encode(written.query[0]))]  # the haystack, before the query
    for _, sentence in written.needles:
        needle = encode(sentence)
        starts = [i for i in range(len(body) - len(needle) + 1) if body[i : i + len(needle)] == needle]
        assert len(starts) == 1
    assert written.needles[0][1].strip() in text


def answer_order(written) -> list[str]:
    """The answers in the order the query asks them: multivalue's in the order their needles stand in the text."""
    slots = [written.answers[p] for p in written.query if isinstance(p, int)]
    return slots if not written.in_text_order else sorted(slots, key=lambda v: ANSWER_POSITION[v])


ANSWER_POSITION: dict[str, int] = {}


def test_the_controlled_needle_sits_at_its_depth_after_a_sentence_end(haystack):
    length = 400
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        rng = sample_rng("single", length, 3, 0)
        written = haystack.write("single", rng, depth)
        built = haystack.build(written, length, rng, 2)
        row = built.rows[0].tolist()
        needle = haystack.encode(written.needles[0][1])
        query_len = length + 1 - (built.answers[0].start + 1) + len(haystack.encode(" The special value for x is"))
        start = next(i for i in range(len(row)) if row[i : i + len(needle)] == needle)
        fill = (
            length
            + 1
            - len(needle)
            - (length + 1 - (built.answers[0].start + 1))
            - len(haystack.encode(written.query[0]))
        )
        assert abs(start - depth * fill) <= max(2, fill // 20) + 1, (depth, start, fill, query_len)
        assert start == 0 or haystack.ends_sentence[row[start - 1]] or abs(start - round(depth * fill)) == 0


def test_metrics_equal_a_plain_loop_over_the_built_samples(haystack, sotu_data):
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=32)
    length, candidates, task = 256, 3, "multiquery"
    samples = [(i, d) for i in range(2) for d in range(len(DEPTHS))]
    measured = measure_haystack(net, haystack, task, samples, DEPTHS, length, candidates, 1000, "32-true", None, 0)
    exact, ranked, nll_sum, tokens, answers = 0, 0, 0.0, 0, 0
    for i, d in samples:
        rng = sample_rng(task, length, i, DEPTHS[d])
        built = haystack.build(haystack.write(task, rng, DEPTHS[d]), length, rng, candidates)
        scores = [nll_of(net, row) for row in built.rows]
        with torch.no_grad():
            ids = torch.from_numpy(built.rows[0])[None]
            predicted = net.logits(net(ids[:, :-1])).argmax(-1)[0].numpy()
        for span, others in zip(built.answers, built.distractor_rows, strict=True):
            targets = list(span)
            answers += 1
            tokens += len(targets)
            nll_sum += scores[0][targets].sum()
            exact += int((predicted[targets] == built.rows[0][1:][targets]).all())
            ranked += int(all(-scores[0][targets].sum() > -scores[r][targets].sum() for r in others))
    assert measured.metrics["answers"] == answers and measured.metrics["tokens"] == tokens
    assert measured.metrics["exact_match"] == pytest.approx(exact / answers)
    assert measured.metrics["rank_accuracy"] == pytest.approx(ranked / answers)
    assert measured.metrics["mean_nll"] == pytest.approx(nll_sum / tokens, rel=1e-5)


def test_a_depth_meets_the_same_haystacks_whatever_other_depths_are_asked(haystack, sotu_data):
    """Samples are keyed by the depth's value, not its place in eval.haystack_depths: depth 0.5 alone scores what
    it scores among others (it was seeded by its index, so [0.5] and [0, 0.5, 1] drew other haystacks)."""
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=32)

    def at_half(depths: tuple[float, ...]) -> dict:
        d = depths.index(0.5)
        measured = measure_haystack(
            net, haystack, "single", [(i, d) for i in range(3)], depths, 200, 3, 1000, "32-true", None, 0
        )
        return next(row for row in measured.breakdown if row["depth"] == 0.5)

    assert at_half((0.5,)) == at_half(DEPTHS) == at_half((0.25, 0.5))


def test_distractors_are_the_other_values_in_the_text_before_fresh_ones(haystack):
    """Multikey's and multiquery's answers are ranked against the values of the other keys they read: a model that
    copies any value seen does not pass for one that finds the asked key's."""
    for task, in_text in (("multikey", 3), ("multiquery", 3)):
        rng = sample_rng(task, 512, 0, 0)
        written = haystack.write(task, rng, 0.5)
        built = haystack.build(written, 512, rng, 4)
        for span, others in zip(built.answers, built.distractor_rows, strict=True):
            asked = haystack.tokenizer.decode(built.rows[0][span.start + 1 : span.stop + 1].tolist()).strip()
            ranked = [
                haystack.tokenizer.decode(built.rows[r][span.start + 1 : span.stop + 1].tolist()).strip()
                for r in others
            ]
            expected = [v for v in written.in_context if v != asked]
            assert ranked[:in_text] == expected and len(set(ranked)) == 4 and asked not in ranked


def test_a_capped_haystack_sample_list_keeps_every_depth():
    protocol = PROTOCOLS["niah_single"](depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=8)
    windows = protocol.windows([], 64)
    for cap in (4, 5, 8, 10, 20, 39):
        kept = protocol.capped(windows, cap)
        assert {d for _, d in kept} == set(range(5)) and len(kept) == 5 * max(1, cap // 5)


def test_a_length_too_short_for_the_needles_is_not_applicable_and_the_sweep_goes_on(sotu_data):
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=16)
    evaluation = sotu_data.evaluation("validation")
    settings = eval_cfg(
        protocol=["niah_multiquery", "nonoverlap"],
        lengths=[16, 256],
        haystack_samples=1,
        haystack_candidates=2,
        max_windows=4,
    )
    plan = sweep_plan(settings, 16, None, evaluation.protocols)
    rows, _ = sweep(net, evaluation, plan, settings)
    status = {(r["protocol"], r["length"]): r["status"] for r in rows if r.get("depth") is None}
    assert status == {
        ("niah_multiquery", 16): "not applicable",
        ("niah_multiquery", 256): "ok",
        ("nonoverlap", 16): "ok",
        ("nonoverlap", 256): "ok",
    }
    reason = next(r["reason"] for r in rows if r["status"] == "not applicable")
    assert "needles and query take" in reason


def test_the_haystack_protocols_need_a_tokenizer_and_say_so():
    with pytest.raises(ConfigError, match="need the data's tokenizer"):
        TextEvaluation([np.arange(10)]).haystack()


def test_every_long_context_protocol_is_registered_with_its_metrics():
    haystack = {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking"}
    assert {"key_tokens", *haystack} <= set(PROTOCOLS)
    assert PROTOCOLS["niah_single"].metrics[0] == "rank_accuracy"


def test_a_haystack_longer_than_the_split_is_refused_in_its_row(sotu_data):
    tiny = HaystackText([np.arange(40, dtype=np.int32)], sotu_data.tokenizer)
    with pytest.raises(LengthNotSupported, match="tokens of haystack"):
        rng = sample_rng("single", 400, 0, 0)
        tiny.build(tiny.write("single", rng, 0.5), 400, rng, 2)


@pytest.mark.parametrize("protocol", ["key_tokens", "niah_single"])
def test_bf16_autocast_measures_what_fp32_does(protocol, sotu_data):
    """Both protocols under bf16-mixed (what CPUs with native bf16 train in): the same rows, the NLL within bf16's
    rounding of fp32's."""
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=32)
    evaluation = sotu_data.evaluation("validation")
    own = {"haystack_samples": 1} if protocol == "niah_single" else {"key_gain": 0.0, "key_max_nll": 100.0}
    settings = eval_cfg(protocol=protocol, lengths=[128], max_windows=8, **own)
    plan = sweep_plan(settings, 32, None, evaluation.protocols)
    rows = {p: sweep(net, evaluation, plan, settings, p)[0][0] for p in ("32-true", "bf16-mixed")}
    fp32, bf16 = rows["32-true"], rows["bf16-mixed"]
    assert fp32["status"] == bf16["status"] == "ok" and fp32["windows"] == bf16["windows"]
    assert fp32["tokens"] > 0 and bf16["mean_nll"] == pytest.approx(fp32["mean_nll"], rel=0.02)
    if protocol == "key_tokens":  # a gain near 0 may cross the threshold under bf16: the share moves a little
        assert bf16["key_share"] == pytest.approx(fp32["key_share"], abs=0.1)


def test_a_row_holds_its_protocols_parameters_and_row_fields_alone_so_a_parameter_never_overwrites_a_measure(
    sotu_data,
):
    """Every registered protocol swept (and the temperature variant): each row's keys are ``ROW_FIELDS`` and its
    protocol's parameters, given as set. A protocol with a parameter named as a row field is refused when registered:
    its value would overwrite the measure, and the report would drop the field from every other protocol's rows."""
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=32)
    evaluation = sotu_data.evaluation("validation")
    settings = eval_cfg(
        protocol=list(PROTOCOLS),
        lengths=[32, 160],
        variants=["none", "temperature"],
        haystack_samples=1,
        haystack_candidates=2,
        max_windows=2,
        stride=8,
        key_context=16,
    )
    plan = sweep_plan(settings, 32, None, evaluation.protocols)
    rows, _ = sweep(net, evaluation, plan, settings)
    assert {row["protocol"] for row in rows} == set(PROTOCOLS)
    for row in rows:
        parameters = PROTOCOLS[row["protocol"]].from_plan(plan).parameters()
        assert set(row) - set(parameters) <= ROW_FIELDS, row["protocol"]
        assert {key: row[key] for key in parameters} == parameters

    @dataclasses.dataclass(frozen=True)
    class Clashing(protocols.NonOverlapping):
        name = "clashing"
        tokens: int = 8

        def parameters(self) -> dict:
            return {"tokens": self.tokens}

    with pytest.raises(TypeError, match=r"protocol clashing: its parameters \['tokens'\] are names a results row"):
        registry(protocols.NonOverlapping, Clashing)


@pytest.mark.parametrize("scheme", [None, Randomized(1024, 32)], ids=["sequential", "randomized"])
def test_a_samples_rows_are_scored_at_most_tokens_per_batch_a_pass_with_the_same_metrics(haystack, sotu_data, scheme):
    """Multiquery ranks each of its 4 answers against 3 distractors: 13 rows of L tokens a sample, which went through
    the model in one pass whatever eval.tokens_per_batch said (13 x 32k tokens at L 32k). Under randomized positions
    each pass takes its rows' positions."""
    net = tiny_net(vocab=sotu_data.vocab_size, train_len=32)
    length, samples, passes = 256, [(0, 0), (1, 2)], []
    token_nll = net.token_nll

    def recorded(tokens, *args, **kwargs):
        passes.append(tokens.size(0))
        return token_nll(tokens, *args, **kwargs)

    def measured(tokens_per_batch: int) -> dict:
        passes.clear()
        return measure_haystack(
            net, haystack, "multiquery", samples, DEPTHS, length, 3, tokens_per_batch, "32-true", scheme, 0
        ).metrics

    net.token_nll = recorded
    whole = measured(10**6)
    assert passes == [26]  # both samples' rows in one pass
    for tokens_per_batch, rows in ((3 * length, 3), (length - 1, 1)):
        split = measured(tokens_per_batch)
        assert max(passes) == rows and sum(passes) == 26
        assert split.keys() == whole.keys()
        for metric, value in whole.items():
            assert split[metric] == pytest.approx(value, rel=1e-6), metric
