"""The probes (lenext.synthetic): generators, what is scored, the accuracy metrics, bad input, learnability."""

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lenext.errors import ConfigError
from lenext.positions import generator
from lenext.report import report
from lenext.run import evaluate_checkpoint, train
from lenext.scoring import measure_answers, scored_targets
from lenext.synthetic import (
    BOS,
    FILL,
    KEY,
    PAD,
    SEP,
    SPECIALS,
    SPLIT_STREAMS,
    TASK_CLASSES,
    TRAIN,
    EvaluationSamples,
    SyntheticDataModule,
    TrainSamples,
)
from tests.test_evaluate import compose_eval

LENGTHS = [9, 10, 17, 33, 64, 257]  # sequence tokens n = L + 1; odd and even


def task(name: str, symbols=16, pairs=4, digits=5):
    return TASK_CLASSES[name](symbols, pairs, digits)


def solve(name: str, prefix: list[int]) -> int:
    """The next token after ``prefix``, by the task's rule, from the prefix alone (causal, as the model must)."""
    last = len(prefix) - 1
    if name == "copy":  # s_1..s_m SEP s_1..: the token m + 1 places back, m + 1 = the distance from BOS to SEP
        return prefix[last + 1 - prefix.index(SEP)]
    if name == "recall":  # the value after the earlier occurrence of the queried key
        return prefix[prefix.index(prefix[last]) + 1]
    if name == "passkey":  # digit j after SEP is digit j after KEY
        return prefix[prefix.index(KEY) + 1 + last - prefix.index(SEP)]
    raise AssertionError(name)


@pytest.mark.parametrize("name,n", [(name, n) for name in TASK_CLASSES for n in LENGTHS if n >= task(name).shortest()])
def test_every_answer_follows_by_rule_from_the_tokens_before_it(name, n):
    probe = task(name)
    for i in range(20):
        sample = probe.sample(n, generator(SPLIT_STREAMS["test"], n, i))
        tokens, answer = sample.tokens.tolist(), sample.answer
        assert len(tokens) == n and answer.shape == (n - 1,) and tokens[0] == BOS
        scored = (answer >= 0).nonzero().flatten().tolist()
        assert scored, "every sample has an answer"
        for t in scored:  # target t predicts token t + 1 from tokens 0..t
            assert solve(name, tokens[: t + 1]) == tokens[t + 1]


@pytest.mark.parametrize("name,digits", [("copy", 5), ("passkey", 1), ("passkey", 2)])
def test_a_chance_level_is_what_a_uniform_guess_among_the_answers_symbols_scores(name, digits):
    """The report's chance lines (``Task.chance``) against a simulated guesser: each answer token drawn uniformly
    from the symbols a task's answers use (copy: its 16 symbols; passkey: 10 digits), over 4,000 samples of the
    task's own (3 standard errors of tolerance)."""
    probe, gen = task(name, digits=digits), torch.Generator().manual_seed(0)
    alphabet = 16 if name == "copy" else 10
    tokens = exact = 0
    for i in range(4000):
        sample = probe.sample(33, generator(SPLIT_STREAMS["test"], 33, i))
        truth = sample.tokens[1:][sample.answer >= 0]
        guess = SPECIALS + torch.randint(alphabet, truth.shape, generator=gen)
        tokens, exact = tokens + (guess == truth).float().mean().item(), exact + bool((guess == truth).all())
    for metric, measured in (("token_accuracy", tokens / 4000), ("exact_match", exact / 4000)):
        chance = probe.chance(metric)
        if chance is None:  # copy's whole string: about 0
            assert measured < 1e-3
        else:
            assert abs(measured - chance) < 3 * math.sqrt(chance * (1 - chance) / 4000), (metric, measured, chance)
    assert task("recall").chance("exact_match") is None  # elimination answers better than a guess: no one level


@pytest.mark.parametrize("n", [17, 64, 65])
def test_the_scored_targets_are_exactly_the_answers_each_task_defines(n):
    gen = generator(0, n)
    copy = task("copy").sample(n, gen)
    m = (n - 2) // 2
    assert copy.answer.tolist() == [-1] * (m + 1) + [0] * m + [-1] * (n - 2 - 2 * m)  # the copied half
    assert copy.tokens[m + 1] == SEP and (copy.tokens[n - 1] == PAD) == (n % 2 == 1)

    recall = task("recall", pairs=4).sample(n, gen)
    first_query = n - 8
    labels = [-1] * (n - 1)
    for j in range(4):
        labels[first_query + 2 * j] = j  # predicted at each queried key: its value
    assert recall.answer.tolist() == labels
    values = recall.tokens[[t + 1 for t in range(n - 1) if labels[t] >= 0]]
    assert ((values >= SPECIALS + 16) & (values < SPECIALS + 32)).all()
    assert (recall.tokens[9:first_query] == FILL).all()

    passkey = task("passkey", digits=5).sample(n, gen)
    assert passkey.answer.tolist() == [-1] * (n - 6) + [0] * 5  # the 5 digits after SEP
    assert passkey.tokens[n - 6] == SEP and 0 <= passkey.depth <= 1


def test_passkey_depth_is_the_share_of_filler_before_the_key():
    probe = task("passkey", digits=3)
    depths = []
    for i in range(200):
        sample = probe.sample(50, generator(9, i))
        before = sample.tokens.tolist().index(KEY) - 1
        filler = 50 - probe.shortest()
        assert sample.depth == pytest.approx(before / filler)
        depths.append(sample.depth)
    assert min(depths) < 0.1 and max(depths) > 0.9  # uniform over [0, 1]


def test_samples_are_seeded_and_training_never_shares_a_seed_with_evaluation():
    probe = task("recall")
    a, b = (EvaluationSamples(probe, "validation", 33, list(range(8))) for _ in range(2))
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(8))
    test = EvaluationSamples(probe, "test", 33, list(range(8)))
    assert not any(torch.equal(a[i]["tokens"], test[i]["tokens"]) for i in range(8))
    train = TrainSamples(probe, 33, seed=0, size=4096)
    assert torch.equal(train[5]["tokens"], TrainSamples(probe, 33, seed=0, size=4096)[5]["tokens"])
    assert not torch.equal(train[5]["tokens"], TrainSamples(probe, 33, seed=1, size=4096)[5]["tokens"])
    # The streams are disjoint by construction, and no drawn sequence of one appears in the other.
    assert TRAIN not in SPLIT_STREAMS.values() and len(set(SPLIT_STREAMS.values())) == len(SPLIT_STREAMS)
    trained = {tuple(train[i]["tokens"].tolist()) for i in range(4096)}
    for split in ("validation", "test"):
        evaluated = EvaluationSamples(probe, split, 33, list(range(256)))
        assert not trained & {tuple(evaluated[i]["tokens"].tolist()) for i in range(256)}


def test_a_seed_gives_the_sequences_the_committed_studies_were_trained_on():
    """The probes' streams are part of their results (studies/probes): a change to how sequences are drawn must be
    a deliberate one. Training sample 7 of seed 0 at L_train 40, as the committed study drew it."""
    recall = TrainSamples(task("recall", symbols=16, pairs=8), 41, seed=0, size=2**20)[7]
    assert recall["tokens"].tolist() == (
        [1, 16, 29, 5, 32, 12, 31, 11, 32, 15, 36, 13, 28, 18, 32, 17, 33, 4, 4, 4, 4]  # BOS, the pairs, FILL
        + [16, 29, 12, 31, 17, 33, 15, 36, 5, 32, 13, 28, 11, 32, 18, 32]  # the queries and their values
        + [0, 0, 0, 0]  # PAD
    )
    assert recall["answer"].tolist() == [-1] * 21 + [a for k in range(8) for a in (k, -1)] + [-1] * 3
    copy = TrainSamples(task("copy", symbols=16), 17, seed=0, size=2**20)[0]  # L_train 16
    assert copy["tokens"].tolist() == [1, 7, 6, 14, 13, 19, 5, 5, 2, 7, 6, 14, 13, 19, 5, 5, 0]  # BOS s.. SEP s.., PAD
    assert copy["answer"].tolist() == [-1] * 8 + [0] * 7 + [-1]
    passkey = TrainSamples(task("passkey", symbols=16, digits=2), 41, seed=0, size=2**20)[7]
    assert passkey["tokens"].tolist() == [1, 3, 10, 12, 2, 10, 12] + [0] * 34  # BOS KEY d d SEP d d, PAD
    assert passkey["answer"].tolist() == [-1] * 4 + [0, 0] + [-1] * 34


def test_training_samples_cover_every_length_up_to_l_train_and_pad_after_the_answers():
    train = TrainSamples(task("recall", pairs=4), 33, seed=0, size=1000)
    lengths = set()
    for i in range(1000):
        tokens, answer = train[i]["tokens"], train[i]["answer"]
        assert tokens.shape == (33,) and answer.shape == (32,)
        n = int((tokens != PAD).sum())  # recall writes no PAD of its own
        assert (tokens[n:] == PAD).all() and (answer[n - 1 :] == -1).all()  # nothing after the sequence is scored
        lengths.add(n)
    assert lengths == set(range(17, 34))  # every length from the shortest recall sequence to L_train + 1


class Oracle(nn.Module):
    """A 'model' that predicts the target at every position except ``wrong`` ones, with NLL = position."""

    def __init__(self, vocab: int, wrong: set[int]):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 1)
        self.wrong = wrong

    def token_nll(self, tokens, targets, positions=None, predictions=False):
        nll = torch.arange(targets.size(1), dtype=torch.float).expand(targets.shape)
        predicted = targets.clone()
        for t in self.wrong:
            predicted[:, t] = PAD  # PAD is never an answer
        return (nll, predicted) if predictions else nll


def test_measure_answers_counts_whole_answers_tokens_and_their_nll():
    probe = task("recall", pairs=4)
    n = 40
    samples = EvaluationSamples(probe, "test", n, list(range(6)))
    first_query = n - 8
    oracle = Oracle(probe.vocab_size, wrong={first_query + 2, 5})  # the second answer; target 5 is not scored
    measured = measure_answers(oracle, DataLoader(samples, batch_size=4), n - 1)
    assert measured.metrics["exact_match"] == measured.metrics["token_accuracy"] == 3 / 4
    assert measured.metrics["answers"] == 24 and measured.metrics["tokens"] == 24
    expected_nll = sum(first_query + 2 * j for j in range(4)) / 4  # the NLL at the answer targets alone
    assert measured.metrics["mean_nll"] == pytest.approx(expected_nll)
    assert measured.metrics["ppl"] == pytest.approx(math.exp(expected_nll))

    copy = task("copy")
    samples = EvaluationSamples(copy, "test", 21, list(range(4)))  # m = 9 copied symbols
    one_wrong = measure_answers(Oracle(copy.vocab_size, wrong={15}), DataLoader(samples, batch_size=4), 20)
    assert one_wrong.metrics["exact_match"] == 0.0  # one token of the copy wrong: the answer is wrong
    assert one_wrong.metrics["token_accuracy"] == 8 / 9  # 32 of 36 tokens, in float64 (it was float32's 8 / 9)


class ShallowOracle(Oracle):
    """Right about a passkey only when it lies at depth >= 0.4 (KEY far enough into the filler)."""

    def token_nll(self, tokens, targets, positions=None, predictions=False):
        nll, predicted = super().token_nll(tokens, targets, positions, predictions=True)
        filler = tokens.size(1) + 1 - self.shortest
        depth = ((tokens == KEY).float().argmax(dim=1) - 1) / filler
        predicted[depth < 0.4] = PAD
        return (nll, predicted) if predictions else nll


def test_passkey_breakdown_by_depth_scores_each_bucket_of_its_own():
    probe = task("passkey", digits=2)
    samples = EvaluationSamples(probe, "test", 30, list(range(60)))
    oracle = ShallowOracle(probe.vocab_size, set())
    oracle.shortest = probe.shortest()
    measured = measure_answers(oracle, DataLoader(samples, batch_size=16), 29, depth_buckets=5)
    buckets = [min(int(samples[i]["depth"] * 5), 4) for i in range(60)]
    parts = {part["depth"]: part for part in measured.breakdown}
    assert sorted(parts) == [b / 5 for b in sorted(set(buckets))]
    for b in set(buckets):
        part = parts[b / 5]
        assert part["answers"] == part["windows"] == buckets.count(b)
        assert part["exact_match"] == (1.0 if b >= 2 else 0.0)  # buckets 0.0 and 0.2 lie below 0.4
    assert measured.metrics["answers"] == 60
    assert measured.metrics["exact_match"] == pytest.approx(sum(b >= 2 for b in buckets) / 60)


def test_scored_targets_of_a_probe_are_its_answers_alone():
    probe = task("passkey", digits=3)
    samples = EvaluationSamples(probe, "test", 20, list(range(2)))
    batch = next(iter(DataLoader(samples, batch_size=2)))
    nll, predicted, targets = scored_targets(Oracle(probe.vocab_size, set()), batch, predictions=True)
    assert nll.tolist() == [16.0, 17.0, 18.0] * 2  # the NLL the oracle gives targets 16..18
    assert torch.equal(targets, batch["tokens"][:, 17:].flatten())


@pytest.mark.parametrize(
    "settings,key",
    [
        ({"task": "recall", "max_len": 15, "pairs": 4}, "data.max_len=15 is too short for recall"),
        ({"task": "passkey", "max_len": 10, "digits": 5}, "data.max_len=10 is too short for passkey"),
        ({"task": "recall", "pairs": 20, "symbols": 16}, "data.pairs=20 is invalid"),
        ({"task": "passkey", "symbols": 8}, "data.symbols=8 is invalid"),
    ],
)
def test_settings_the_task_cannot_meet_are_refused_with_the_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        SyntheticDataModule(**settings)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["eval.lengths=[8,64]"], r"^min\(eval.lengths\)=8 is too short for recall .* >= 32$"),
        (["eval.factors=[0.125,1]"], r"^min\(eval.factors\) x data.max_len=8 is too short for recall"),
        (["eval.protocol=sliding"], r"^eval.protocol=sliding does not apply to this data: it must be among accuracy$"),
        (["eval.protocol=[]"], r"^eval.protocol=\[\] is invalid: give at least one of accuracy$"),
    ],
)
def test_evaluation_settings_a_probe_cannot_meet_fail_before_any_work(compose_train, overrides, message):
    from lenext.resolve import TRAIN_NODES, TrainSettings
    from lenext.run_folder import preflight

    with pytest.raises(ConfigError, match=message):
        preflight(compose_train("data=synthetic", *overrides), TrainSettings, TRAIN_NODES)


def test_a_probe_trains_evaluates_from_its_checkpoint_and_reports(compose_train, tmp_path):
    """train.py on data=synthetic: validation is the sweep's accuracy 1x row, eval.py reproduces the rows from the
    checkpoint, and the report writes accuracy tables, the accuracy plot and passkey's depth x length grid."""
    cfg = compose_train(
        "data=synthetic",
        "data.task=passkey",
        "data.digits=3",
        "data.max_len=16",
        "data.batch_size=8",
        "data.eval_samples=16",
        "model=tiny",
        "trainer=cpu",
        "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        "trainer.enable_progress_bar=false",
        "eval.factors=[1,4]",
    )
    metrics = train(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["task"] == "passkey" and results["meta"]["corpus"] == "synthetic-passkey"
    rows = [r for r in results["rows"] if r.get("depth") is None]
    assert [(r["protocol"], r["length"], r["answers"], r["tokens"]) for r in rows] == [
        ("accuracy", 16, 16, 48),
        ("accuracy", 64, 16, 48),
    ]
    assert rows[0]["exact_match"] == pytest.approx(metrics["val/exact_match"])
    assert rows[0]["token_accuracy"] == pytest.approx(metrics["val/token_accuracy"])
    assert rows[0]["ppl"] == pytest.approx(metrics["val/ppl"], rel=1e-5)
    for length in (16, 64):
        parts = [r for r in results["rows"] if r.get("depth") is not None and r["length"] == length]
        assert sum(r["answers"] for r in parts) == 16
        assert sum(r["exact_match"] * r["answers"] for r in parts) == pytest.approx(
            next(r["exact_match"] for r in rows if r["length"] == length) * 16
        )

    evaluate_checkpoint(
        compose_eval(tmp_path, tmp_path / "eval", tmp_path / "checkpoints" / "last.ckpt", "eval.factors=[1,4]")
    )
    again = json.loads((tmp_path / "eval" / "results.json").read_text())["rows"]
    assert [r["exact_match"] for r in again] == [r["exact_match"] for r in results["rows"]]

    markdown = report([str(tmp_path / "eval")], str(tmp_path / "report"))
    heading = "### passkey, L_train = 16, protocol `accuracy` (exact-match accuracy %, chance 0.1%, mean +- std over 1"
    assert heading in markdown  # chance: a guess of its 3 digits
    assert "### passkey, L_train = 16, protocol `accuracy` (per-token accuracy %" in markdown
    written = {p.name for p in (tmp_path / "report").iterdir()}
    assert {"accuracy_vs_length.png", "passkey_depth.png", "passkey_depth.csv", "table.csv"} <= written
    assert "ppl_vs_length.png" not in written  # no perplexity table, no perplexity plot


def test_the_probes_preset_is_a_checked_multirun_over_tasks_pes_and_seeds(compose_train, tmp_path):
    from hydra import compose, initialize_config_module

    from lenext.cli import CONFIG_PACKAGE
    from lenext.progress import sweep_grid
    from lenext.resolve import TRAIN_NODES, TrainSettings
    from lenext.run_folder import preflight

    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=probes", f"paths.root_dir={tmp_path}"], return_hydra_config=True)
    params = dict(cfg.hydra.sweeper.params)
    assert params["probe"] == "copy,passkey,recall" and params["seed"] == "0,1,2"
    assert sweep_grid([], params)[0] == 3 * 3 * len(params["pe"].split(","))
    assert cfg.model.d_model == 64
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == -1  # one per core
    # L_train, steps, lr decay, batch
    recipes = {"copy": (16, 4000, 0.1, 64), "passkey": (32, 800, 0.1, 32), "recall": (40, 4000, 1.0, 32)}
    for probe, recipe in recipes.items():  # every job's settings pass the pre-flight checks
        job = compose_train("experiment=probes", f"probe={probe}")
        preflight(job, TrainSettings, TRAIN_NODES)
        assert job.data._target_ == "lenext.synthetic.SyntheticDataModule" and job.data.task == probe
        assert (job.data.max_len, job.trainer.max_steps, job.module.min_lr_ratio, job.data.batch_size) == recipe
        assert job.trainer.precision == "32-true"  # one precision on every machine


@pytest.mark.slow
def test_the_tiny_model_learns_recall_at_l_train_with_its_recipe(compose_train):
    """Recall is learnable: its recipe (probe=recall: 8 pairs, L_train 40, 4000 steps at a constant lr 3e-3) with
    batches of 64 takes RoPE past the elimination plateau to >= 90% exact match at L_train (3 seeds of 3 in the
    batch-64 study). The preset's batches of 32 (to fit its 30 minutes) learn it in fewer seeds (docs/probes.md).
    The induction circuit forms late and at a seed-dependent step, so this is the slowest test (~2 min on an AMX
    Xeon, 4 min on an AVX2-only EPYC): among the slow tests."""
    cfg = compose_train(
        "experiment=probes",  # fp32, lr 3e-3
        "probe=recall",
        "pe=rope",
        "data.batch_size=64",
        "eval.enabled=false",
    )
    metrics = train(cfg)
    assert metrics["val/exact_match"] >= 0.9, metrics


def test_the_tiny_model_learns_passkey_at_l_train_in_a_short_cpu_run(compose_train):
    """The probe is learnable: half its recipe's steps at half its L_train (400 at 16; ~6 s on 2 CPU cores) take
    the tiny model to >= 90% exact match at L_train (100% with seeds 0-3 in a bare loop)."""
    cfg = compose_train(
        "experiment=probes",
        "probe=passkey",
        "pe=rope",
        "data.max_len=16",
        "trainer.max_steps=400",
        "trainer.val_check_interval=400",
        "eval.enabled=false",
    )
    metrics = train(cfg)
    assert metrics["val/exact_match"] >= 0.9, metrics


def test_answer_metrics_are_float64_shares_by_update_and_by_call():
    """Exact match over answers, token accuracy over their tokens, as exact float64 fractions; a call (torchmetrics'
    forward) returns the batch's and accumulates as update does."""
    from lenext.scoring import AnswerMetrics

    metrics = AnswerMetrics()
    predicted, targets = torch.tensor([[1, 2, 3], [1, 2, 4]]), torch.tensor([[1, 2, 3], [1, 2, 3]])
    batch = metrics(predicted, targets)
    assert (batch["exact_match"].item(), batch["token_accuracy"].item()) == (1 / 2, 5 / 6)
    metrics.update(predicted[:1], targets[:1])
    total = metrics.compute()
    assert total["exact_match"].dtype == torch.float64
    assert (total["exact_match"].item(), total["token_accuracy"].item()) == (2 / 3, 8 / 9)


def test_training_samples_too_few_for_a_batch_are_refused_before_the_model_is_built(tmp_path):
    """An epoch of data.train_samples fewer than data.batch_size fills no batch: refused in one line, nothing left;
    in a sweep, before its first job."""
    from lenext.cli import check_overrides
    from tests.conftest import run_train

    with pytest.raises(ConfigError, match=r"^job 0 of the sweep \(seed=0\): data.train_samples=4 is invalid: fewer"):
        check_overrides("train", ["probe=passkey", "data.train_samples=4", "seed=0,1"], multirun=True)

    run = tmp_path / "run"
    done = run_train(tmp_path, "probe=passkey", "model=tiny", "data.train_samples=4", f"hydra.run.dir={run}")
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "error: data.train_samples=4 is invalid: fewer than data.batch_size=32, an epoch would fill no batch; give "
        "data.train_samples >= data.batch_size"
    ]
    assert not run.exists()
