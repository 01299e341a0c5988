"""lenext.diagnostics: the attention statistics against attention computed here by hand in float64, the recording
hook on every PE's path, the copying score against a plain float64 loop and an induction oracle, RoPE's rotation
coverage against its formula, the distances each position scheme trains, and `python diagnose.py` end to end."""

import json
import math
import os
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lenext.attention import AttentionSettings, recording
from lenext.diagnostics import (
    COPYING,
    STATISTICS,
    AttentionStatistics,
    CopyingScore,
    copy_nll,
    diagnose,
    layer_windows,
    record_statistics,
    repeated,
    rotary_frequencies,
    rotation_coverage,
    trained_distances,
    window_tokens,
)
from lenext.errors import CheckpointError, ConfigError
from lenext.model import Decoder
from lenext.pe import ALiBi, NoPE, PoPE, RoPE, T5Bias
from lenext.positions import PoSE, PositionScheme, Randomized
from tests.conftest import hidden_keys
from tests.forked import run_command
from tests.test_long_context import Copier
from tests.test_pe import PES

VOCAB, TRAIN_LEN, LENGTH, HEADS, LAYERS, D_MODEL = 64, 8, 20, 2, 2, 16


def tiny_net(pe, attention: AttentionSettings | None = None, seed: int = 0) -> Decoder:
    """A float64 decoder with weights large enough for peaked, head-specific attention."""
    torch.manual_seed(seed)
    net = Decoder(VOCAB, TRAIN_LEN, pe, attention, d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS)
    with torch.no_grad():
        for block in net.blocks:
            block.attn.qkv.weight.normal_(std=0.6)
        for param in net.pe.parameters():
            param.normal_(std=1.0)
    net.pe.project_()  # as after an optimizer step: KERPLE's r1, r2 back in their domain
    return net.double().eval()


def attention_inputs(net, tokens) -> list[torch.Tensor]:
    """Each layer's attention input (the normalized residual stream), from the model's own forward pass."""
    seen = []
    hooks = [block.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0])) for block in net.blocks]
    with torch.no_grad():
        net(tokens)
    for hook in hooks:
        hook.remove()
    return seen


def rotated(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE by hand: pairs (2t, 2t+1) of x (B, H, L, d) turned by p theta_t at position p, theta_t = base^(-2t/d)."""
    d, length = x.size(-1), x.size(-2)
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(length, dtype=torch.float64)[:, None] * theta  # (L, d/2)
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def t5_bucket_by_hand(n: int, buckets: int, max_distance: int) -> int:
    """T5's causal bucket of a distance n >= 0 (Raffel et al. 2020), as the fp32 formula computes it."""
    exact = buckets // 2
    if n < exact:
        return n
    scaled = torch.log(torch.tensor(n / exact, dtype=torch.float32)) / math.log(max_distance / exact)
    return min(buckets - 1, exact + int(scaled * (buckets - exact)))


def hand_weights(net, pe_name: str, x: torch.Tensor, layer: int, window: int | None = None) -> torch.Tensor:
    """(B, H, L, L) float64 softmax(q k^T / sqrt(d) + bias), causal (and windowed), from layer ``layer``'s input."""
    batch, length, _ = x.shape
    head_dim = D_MODEL // HEADS
    q, k, _ = (x @ net.blocks[layer].attn.qkv.weight.T).view(batch, length, 3, HEADS, head_dim).permute(2, 0, 3, 1, 4)
    if pe_name == "rope":
        q, k = rotated(q), rotated(k)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if pe_name == "alibi":
        slopes = torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], dtype=torch.float64)
        scores = scores - slopes[:, None, None] * (i - j).clamp(min=0)
    if pe_name == "t5":
        table = net.pe.table[0]  # (buckets, H), shared by the layers
        buckets = torch.tensor(
            [
                [t5_bucket_by_hand(max(a - b, 0), net.pe.num_buckets, net.pe.max_distance) for b in range(length)]
                for a in range(length)
            ]
        )
        scores = scores + table[buckets].permute(2, 0, 1)
    scores = scores.masked_fill(hidden_keys(length, window), float("-inf"))
    return scores.softmax(-1)


def hand_statistics(weights: torch.Tensor, window: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Per head (H,), each statistic averaged over the batch's rows: all rows, and rows i >= TRAIN_LEN."""
    length = weights.size(-1)
    i = torch.arange(length, dtype=torch.float64)[:, None]
    distance = i - torch.arange(length, dtype=torch.float64)[None, :]
    n = (
        torch.arange(1, length + 1, dtype=torch.float64)
        if window is None
        else torch.arange(1, length + 1).clamp(max=window).double()
    )
    a_log_a = torch.where(weights > 0, weights * weights.clamp(min=1e-300).log(), torch.zeros_like(weights))
    entropy = -a_log_a.sum(-1)  # (B, H, L)
    per_row = {
        "entropy": entropy,
        "normalized_entropy": entropy / n.log(),  # row 0: 0 / 0, left out below
        "sink": weights[..., 0],
        "distance": (weights * distance).sum(-1),
        "beyond": (weights * (distance >= TRAIN_LEN)).sum(-1),
    }
    out = {}
    for group, rows in (("all", torch.arange(length)), ("beyond_train", torch.arange(TRAIN_LEN, length))):
        out[group] = {}
        for name, value in per_row.items():
            chosen = rows[rows >= 1] if name == "normalized_entropy" else rows  # row 0 attends 1 key: no log n
            out[group][name] = value[:, :, chosen].mean(dim=(0, 2))
    return out


HAND_PES = {
    "nope": (NoPE, None),
    "alibi": (ALiBi, None),
    "t5": (partial(T5Bias, num_buckets=8, max_distance=12), None),
    "rope": (RoPE, None),
    "window": (NoPE, 5),
}


@pytest.mark.parametrize("pe_name", HAND_PES)
def test_statistics_equal_those_of_attention_computed_by_hand(pe_name):
    pe, window = HAND_PES[pe_name]
    net = tiny_net(pe, AttentionSettings(window=window))
    tokens = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    statistics = AttentionStatistics(LAYERS, HEADS, TRAIN_LEN, layer_windows(net))
    record_statistics(net, tokens, None, statistics)
    means = statistics.means()
    # RoPE's rotation tables are complex64 (lenext.pe.rope) and a band bias (T5) is fp32 (lenext.attention): their
    # weights agree to fp32's precision; ALiBi's slopes and distances are exact in fp32
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if pe_name in ("rope", "t5") else {"rtol": 1e-9, "atol": 1e-11}
    for layer, x in enumerate(attention_inputs(net, tokens)):
        weights = hand_weights(net, pe_name if pe_name != "window" else "nope", x, layer, window)
        expected = hand_statistics(weights, window)
        for group in ("all", "beyond_train"):
            for name in STATISTICS:
                got = torch.tensor(means[group][name][layer], dtype=torch.float64)
                torch.testing.assert_close(got, expected[group][name], **tolerance, msg=f"{group} {name} L{layer}")
    assert statistics.max_row_error < 1e-12
    # Peaked and head-specific, not near uniform: the comparison means something.
    entropies = torch.tensor(means["all"]["normalized_entropy"])
    assert entropies.min() < 0.9 and (entropies[:, 0] - entropies[:, 1]).abs().max() > 1e-3


@pytest.mark.parametrize("pe_name", list(PES))
def test_recording_covers_every_row_once_with_weights_that_sum_to_one_and_changes_no_output(pe_name):
    """On every PE's path (biases, Shaw's value term, Self-Extend's and PaTH's logits, CoPE's terms, windows), and
    under the length scale and stick-breaking: each layer's rows recorded once, each row summing to 1, and the
    model's output the same as without recording (the recorded path is the one the PE's scores take)."""
    attentions = [AttentionSettings()]
    if pe_name in ("nope", "kerple"):
        attentions += [AttentionSettings(scale="ssmax"), AttentionSettings(normalizer="stick_breaking", window=6)]
    for attention in attentions:
        net = tiny_net(PES[pe_name], attention).float()
        length = TRAIN_LEN if pe_name == "learned" else LENGTH  # its table ends at L_train
        tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))
        blocks, layer = [], [0]
        hooks = [
            block.attn.register_forward_pre_hook(partial(lambda i, layer, *_: layer.__setitem__(0, i), i, layer))
            for i, block in enumerate(net.blocks)
        ]

        def keep(weights, start, end, first, blocks=blocks, layer=layer):
            assert weights.shape[:2] == (2, HEADS) and weights.shape[-2:] == (end - start, end - first)
            blocks.append((layer[0], start, end, weights.sum(-1)))

        with torch.no_grad():
            plain = net(tokens)
            with recording(keep):
                recorded = net(tokens)
        for hook in hooks:
            hook.remove()
        torch.testing.assert_close(recorded, plain, rtol=1e-4, atol=1e-4)
        for index in range(LAYERS):
            rows = sorted(r for layer_, start, end, _ in blocks if layer_ == index for r in range(start, end))
            assert rows == list(range(length)), (pe_name, attention)
        sums = torch.cat([s.flatten() for *_, s in blocks])
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5)


def test_stick_breaking_statistics_stay_finite_when_the_stick_is_used_up():
    """Sharp stick-breaking rows spend the whole stick on near keys: the leftover put on the row's own key, 1 - sum,
    rounded to -2e-7 in fp32, and the entropy's x log x of it made every head's entropy NaN."""
    net = tiny_net(PES["nope"], AttentionSettings(normalizer="stick_breaking")).float()
    with torch.no_grad():
        for block in net.blocks:
            block.attn.qkv.weight.mul_(25)  # sharp logits: sigmoid(z) near 1 on the nearest keys
    statistics = AttentionStatistics(LAYERS, HEADS, TRAIN_LEN, layer_windows(net))
    tokens = torch.randint(0, VOCAB, (2, 96), generator=torch.Generator().manual_seed(0))
    record_statistics(net, tokens, None, statistics, "32-true")
    means = statistics.means()["all"]
    for name in STATISTICS:
        assert torch.isfinite(torch.tensor(means[name])).all(), name
    assert statistics.max_row_error < 1e-5


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 40),
    train_len=st.integers(1, 16),
    window=st.one_of(st.none(), st.integers(1, 12)),
    rows=st.integers(1, 9),
)
def test_uniform_attention_has_entropy_log_n_and_sink_one_over_n_in_any_blocks(length, train_len, window, rows):
    """Uniform weights over the n_i keys a row sees, fed in blocks of any size: entropy log n_i exactly, normalized
    1, sink 1/n_i (0 once the window has passed the first key), distance (n_i - 1) / 2, beyond the count of keys
    i - j >= L_train over n_i."""
    statistics = AttentionStatistics(1, 1, train_len, [window])
    expected = {name: [] for name in STATISTICS}
    for start in range(0, length, rows):
        end = min(start + rows, length)
        first = 0 if window is None else max(0, start - window + 1)
        i = torch.arange(start, end)[:, None]
        j = torch.arange(first, end)[None, :]
        seen = (j <= i) & (True if window is None else (j > i - window))
        n = seen.sum(-1, keepdim=True)
        statistics.add(0, (seen.double() / n)[None, None], start, end, first)
        for row in range(start, end):
            count = min(row + 1, window or row + 1)
            expected["entropy"].append(math.log(count))
            expected["normalized_entropy"] += [1.0] if count > 1 else []
            expected["sink"].append(1 / count if row < (window or row + 1) else 0.0)
            expected["distance"].append((count - 1) / 2)
            expected["beyond"].append(sum(1 for d in range(count) if d >= train_len) / count)
    means = statistics.means()["all"]
    for name in STATISTICS:
        if not expected[name]:
            assert means[name] is None
            continue
        assert means[name][0][0] == pytest.approx(sum(expected[name]) / len(expected[name]), rel=1e-12, abs=1e-12)
    assert (statistics.means()["beyond_train"] is None) == (length <= train_len)


# In-context copying.


@pytest.mark.parametrize(("pe_name", "length", "drawn"), [("rope", 12, False), ("alibi", 9, False), ("rope", 11, True)])
def test_copying_score_equals_a_plain_float64_loop_over_prefixes(pe_name, length, drawn):
    """The Decoder run on each prefix of the repeated window alone, its next-token log-probabilities in float64:
    the same NLL at the first occurrence and at the repeat as ``copy_nll``, and ``CopyingScore``'s means, batch by
    batch, those of all the windows' tokens. ``drawn``: at increasing positions with gaps, as randomized schemes."""
    net = tiny_net(HAND_PES[pe_name][0])
    windows = torch.randint(0, VOCAB, (3, length), generator=torch.Generator().manual_seed(3))
    positions = torch.cumsum(torch.randint(1, 4, (1, length), generator=torch.Generator().manual_seed(4)), 1) - 1
    positions = positions if drawn else None
    h = length // 2
    first, second = [], []
    for window in windows.tolist():
        sequence = window[:h] + window[:h] + window[h : length - h]  # odd L: w_h at the end
        assert len(sequence) == length and sequence[h + 1 : 2 * h] == window[1:h]
        nll = {}
        for t in [*range(1, h), *range(h + 1, 2 * h)]:
            prefix = torch.tensor([sequence[:t]])
            with torch.no_grad():
                hidden = net(prefix, None if positions is None else positions[:, :t])
                log_p = net.logits(hidden[:, -1]).to(torch.float64).log_softmax(-1)[0]
            nll[t] = -float(log_p[sequence[t]])
        first.append([nll[t] for t in range(1, h)])
        second.append([nll[t] for t in range(h + 1, 2 * h)])
    first, second = torch.tensor(first, dtype=torch.float64), torch.tensor(second, dtype=torch.float64)
    got_first, got_second = copy_nll(net, windows, positions)
    assert got_first.dtype == torch.float64 and got_first.shape == got_second.shape == (3, h - 1)
    torch.testing.assert_close(got_first, first, rtol=1e-6, atol=1e-6)  # token_nll's NLL is fp32
    torch.testing.assert_close(got_second, second, rtol=1e-6, atol=1e-6)
    score = CopyingScore(length)
    for b in range(0, 3, 2):  # batches of 2 and 1 windows
        score.add(*copy_nll(net, windows[b : b + 2], positions))
    result = score.result()
    assert set(COPYING) <= set(result) and (result["distance"], result["tokens"]) == (h, 3 * (h - 1))
    assert result["first_half_nll"] == pytest.approx(float(first.mean()), rel=1e-6)
    assert result["second_half_nll"] == pytest.approx(float(second.mean()), rel=1e-6)
    assert result["gain"] == pytest.approx(float(first.mean() - second.mean()), abs=1e-5)


class Inducer(torch.nn.Module):
    """An induction oracle: the next token is the one after the longest earlier match of the context's end, with
    probability 0.9 (the rest spread evenly over the other tokens); no earlier match: token 0."""

    def __init__(self, vocab_size: int, copies: bool = True):
        super().__init__()
        self.vocab_size, self.copies = vocab_size, copies

    continuation = staticmethod(Copier.continuation)

    def token_nll(self, inputs, targets, positions=None):
        if not self.copies:  # every token equally likely: the context does not matter
            return torch.full(targets.shape, math.log(self.vocab_size))
        predicted = torch.tensor([[self.continuation(row, t) for t in range(len(row))] for row in inputs.tolist()])
        right, wrong = -math.log(0.9), -math.log(0.1 / (self.vocab_size - 1))
        return torch.where(predicted == targets, right, wrong).float()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), length=st.integers(4, 41), windows=st.integers(1, 3))
def test_a_model_that_copies_gains_log_9_v_minus_1_and_one_that_ignores_the_context_nothing(data, length, windows):
    """Windows of distinct tokens (no earlier match within a first half; token 0, the oracle's guess without a
    match, left out): the oracle misses every first occurrence and predicts every repeat, a gain of
    log(0.9 / (0.1 / (V - 1))) nats per token at any length; a model blind to the context gains exactly 0."""
    vocab = 64
    drawn = [data.draw(st.permutations(range(1, vocab)))[:length] for _ in range(windows)]
    tokens = torch.tensor(drawn)
    sequence = repeated(tokens)
    assert torch.equal(sequence[:, length // 2 : 2 * (length // 2)], tokens[:, : length // 2])
    score = CopyingScore(length)
    score.add(*copy_nll(Inducer(vocab), tokens))
    result = score.result()
    assert result["second_half_nll"] == pytest.approx(-math.log(0.9), rel=1e-6)
    assert result["first_half_nll"] == pytest.approx(-math.log(0.1 / (vocab - 1)), rel=1e-6)
    assert result["gain"] == pytest.approx(math.log(9 * (vocab - 1)), rel=1e-6)  # 6.34 nats
    blind = CopyingScore(length)
    blind.add(*copy_nll(Inducer(vocab, copies=False), tokens))
    assert blind.result()["gain"] == 0 and blind.result()["tokens"] == windows * (length // 2 - 1)


def test_a_copying_score_needs_four_tokens():
    with pytest.raises(ValueError, match="at least 4 tokens"):
        copy_nll(Inducer(8), torch.zeros(1, 3, dtype=torch.long))


def test_rotation_coverage_follows_its_formula_in_float64():
    """theta_k = base^(-2k/d) for d = 8: the arc theta_k (span - 1), a full turn when it reaches 2 pi, and the share
    of distances d < L whose angle theta'_k d mod 2 pi lies beyond the arc; PI's halved frequencies at 2x."""
    span, lengths = 16, [16, 32, 64]
    net = Decoder(VOCAB, span, RoPE, d_model=16, n_layers=1, n_heads=2)  # head dim 8
    name, frequencies = rotary_frequencies(net.pe)
    theta = [10000.0 ** (-2 * k / 8) for k in range(4)]
    torch.testing.assert_close(frequencies(span), torch.tensor(theta, dtype=torch.float64), rtol=1e-15, atol=0)
    coverage = rotation_coverage(frequencies(span), {n: frequencies(n) for n in lengths}, span)
    for k, entry in enumerate(coverage["frequencies"]):
        arc = theta[k] * (span - 1)
        assert entry["trained_arc"] == pytest.approx(arc, rel=1e-15)
        assert entry["full_turn"] == (arc >= 2 * math.pi)
        for n in lengths:
            unseen = 0 if arc >= 2 * math.pi else sum(1 for d in range(n) if math.fmod(theta[k] * d, 2 * math.pi) > arc)
            assert entry["unseen"][str(n)] == pytest.approx(unseen / n, abs=1e-15)
    assert [f["full_turn"] for f in coverage["frequencies"]] == [True, False, False, False]  # theta_0 = 1: 15 rad
    assert coverage["frequencies"][3]["unseen"] == {"16": 0.0, "32": 0.5, "64": 0.75}  # 0.001 d: no wrap by 64
    by_length = {s["length"]: s["unseen_fraction"] for s in coverage["summary"]}
    assert by_length[16] == 0.0 and by_length[64] > by_length[32] > 0
    # Position interpolation (factor L / span at L): theta_k / 2 at 32, the lowest frequency's angles stay within the
    # arc up to d = 30; d = 31 alone is beyond it.
    linear = Decoder(VOCAB, span, partial(RoPE, scaling="linear"), d_model=16, n_layers=1, n_heads=2)
    _, scaled = rotary_frequencies(linear.pe)
    pi = rotation_coverage(scaled(span), {32: scaled(32)}, span)
    assert pi["frequencies"][3]["unseen"]["32"] == pytest.approx(1 / 32, abs=1e-15)
    assert rotary_frequencies(Decoder(VOCAB, span, ALiBi, d_model=16, n_layers=1, n_heads=2).pe) is None
    # PoPE: theta_c = base^(-c / d), one per channel of the head (8), at every length
    _, pope = rotary_frequencies(Decoder(VOCAB, span, PoPE, d_model=16, n_layers=1, n_heads=2).pe)
    per_channel = torch.tensor([10000.0 ** (-c / 8) for c in range(8)], dtype=torch.float64)
    torch.testing.assert_close(pope(64), per_channel, rtol=1e-15, atol=0)


def test_the_distances_training_gives_counted_by_hand():
    sequential = trained_distances(PositionScheme(), 4, [4, 8])
    assert sequential["counts"] == [4.0, 3.0, 2.0, 1.0]  # pairs (i, j), i >= j, at i - j = 0, 1, 2, 3
    assert (sequential["span"], sequential["largest_distance"], sequential["beyond_train_fraction"]) == (4, 3, 0.0)
    # A window of 8 at 0..7: 36 pairs, of which (8 - d) at each d = 4..7 never trained: 4 + 3 + 2 + 1 = 10.
    assert sequential["untrained_pairs"] == [{"length": 4, "fraction": 0.0}, {"length": 8, "fraction": 10 / 36}]
    for scheme in (Randomized(32, 4), PoSE(32, 2, 4)):
        drawn = trained_distances(scheme, 4, [32, 64])
        counts = torch.tensor(drawn["counts"])
        assert len(counts) == 32 and counts[0] == 4 and counts.sum() == pytest.approx(10)  # 4 x 5 / 2 pairs
        assert drawn["largest_distance"] > 3 and drawn["beyond_train_fraction"] > 0
        assert drawn["untrained_pairs"][1]["fraction"] >= (32 * 33 / 2) / (64 * 65 / 2)  # d >= 32: never
    # Randomized: E[count at d >= 1] = (N - d) L (L - 1) / (N (N - 1)), within the draws' noise.
    counts = torch.tensor(trained_distances(Randomized(32, 4), 4, [32], draws=4096)["counts"])
    expected = torch.tensor([(32 - d) * 12 / (32 * 31) for d in range(1, 32)])
    torch.testing.assert_close(counts[1:], expected, rtol=0, atol=0.02)


def test_a_probe_is_diagnosed_on_its_samples_at_each_length():
    from lenext.synthetic import SyntheticDataModule

    data = SyntheticDataModule(task="passkey", max_len=32, eval_samples=9)
    tokens, identities = window_tokens(data.evaluation("validation"), 64, 3)
    assert tokens.shape == (3, 64) and identities == [(0, 0), (3, 0), (6, 0)]  # every 3rd sample, as cap_windows


# The command.


def compose_diagnose(folder, output, *overrides):
    from hydra import compose, initialize_config_module

    from lenext.cli import CONFIG_PACKAGE

    paths = [f"paths.root_dir={folder}", f"paths.output_dir={output}", f"paths.cache_dir={folder}/.cache"]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        return compose("diagnose", overrides=[*paths, *overrides])


def test_diagnose_writes_the_statistics_coverage_and_histogram_of_a_checkpoint(trained_run, tmp_path, cache_dir):
    out = tmp_path / "out"
    cfg = compose_diagnose(trained_run, out, f"ckpt={trained_run}", "lengths=[16,32,64]", "windows=2")
    cfg.paths.cache_dir = cache_dir
    diagnose(cfg)
    result = json.loads((out / "diagnostics.json").read_text())
    assert (out / "diagnostics.png").stat().st_size > 10_000
    meta = result["meta"]
    assert (meta["train_len"], meta["layers"], meta["heads"], meta["row"]) == (32, 2, 4, "rope")
    assert meta["checkpoint"].endswith(os.path.join("checkpoints", "last.ckpt"))  # found in the run folder
    assert [(e["length"], e["status"], e["windows"]) for e in result["lengths"]] == [
        (16, "ok", 2),
        (32, "ok", 2),
        (64, "ok", 2),
    ]
    for entry in result["lengths"]:
        stats = entry["rows"]["all"]
        assert set(stats) == set(STATISTICS) and all(
            len(stats[name]) == 2 and len(stats[name][0]) == 4 for name in stats
        )
        assert entry["max_row_sum_error"] < 1e-5
        assert (entry["rows"]["beyond_train"] is None) == (entry["length"] <= 32)
        beyond = torch.tensor(stats["beyond"])
        assert (beyond == 0).all() if entry["length"] <= 32 else (beyond > 0).all()
        copying = entry["copying"]  # 2 windows of h - 1 tokens each half, the copy h = L / 2 back
        assert (copying["distance"], copying["tokens"]) == (entry["length"] // 2, 2 * (entry["length"] // 2 - 1))
        assert copying["gain"] == pytest.approx(copying["first_half_nll"] - copying["second_half_nll"], abs=1e-12)
        assert 0 < copying["second_half_nll"] < 20 and 0 < copying["first_half_nll"] < 20
    coverage = result["rotation_coverage"]
    assert coverage["trained_span"] == 32 and coverage["frequencies_count"] == 8  # head dim 16
    assert [s["length"] for s in coverage["summary"]] == [16, 32, 64] and coverage["summary"][1]["unseen_fraction"] == 0
    distances = result["trained_distances"]
    assert distances["counts"] == [float(32 - d) for d in range(32)] and distances["scheme"] == "sequential"
    # Bad input: refused before anything is read or written.
    with pytest.raises(ConfigError, match=r"^lengths="):
        diagnose(compose_diagnose(trained_run, tmp_path / "bad", f"ckpt={trained_run}", "lengths=[0,64]"))
    with pytest.raises(CheckpointError, match=r"without a checkpoint"):
        diagnose(compose_diagnose(trained_run, tmp_path / "bad", f"ckpt={tmp_path}"))
    assert not (tmp_path / "bad").exists()


def test_rotation_coverage_under_a_fixed_factor_measures_against_the_frequencies_as_trained(trained_run, tmp_path):
    """``pe.scaling=linear pe.factor=2``: theta_k is the checkpoint's (base^(-2k/d), d = 16), the arc it trained
    theta_k (32 - 1); the angles evaluated are PI's theta_k / 2 d. Not the halved theta_k taken for the trained one,
    which made a scaling that removes unseen angles look as if it added them."""
    out = tmp_path / "linear"
    overrides = (f"ckpt={trained_run}", "lengths=[32,64,128]", "windows=1", "pe.scaling=linear", "pe.factor=2")
    with open(diagnose(compose_diagnose(trained_run, out, *overrides))) as f:
        result = json.load(f)
    coverage = result["rotation_coverage"]
    theta = [10000.0 ** (-2 * k / 16) for k in range(8)]
    for k, entry in enumerate(coverage["frequencies"]):
        arc = theta[k] * 31
        assert entry["theta"] == pytest.approx(theta[k], rel=1e-12) and entry["trained_arc"] == pytest.approx(arc)
        for n in (32, 64, 128):
            angles = [math.fmod(theta[k] / 2 * d, 2 * math.pi) for d in range(n)]
            unseen = 0 if arc >= 2 * math.pi else sum(a > arc * (1 + 1e-12) for a in angles) / n
            assert entry["unseen"][str(n)] == pytest.approx(unseen, abs=1e-12), (k, n)
    by_length = {s["length"]: s["unseen_fraction"] for s in coverage["summary"]}
    assert by_length[32] == 0 and by_length[64] < 0.05  # PI keeps 2x's angles within the arc but for d = 63


def test_a_diagnose_sweep_checks_every_job_before_the_first_starts(trained_run):
    """An audit found diagnose.py -m unchecked: its second job's bad lengths failed after the first diagnosis."""
    from lenext.cli import check_overrides

    refused = r"^job 1 of the sweep \(lengths=\[0\]\): lengths=\[0\] is invalid: .*; no job was started$"
    with pytest.raises(ConfigError, match=refused):
        check_overrides("diagnose", [f"ckpt={trained_run}", "lengths=[32],[0]"], multirun=True)
    check_overrides("diagnose", [f"ckpt={trained_run}", "lengths=[32],[64]"], multirun=True)


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ("lengths=[]", r"^lengths=\[\] is invalid: give at least one length, or null \(factors x L_train\)$"),
        ("factors=[0.3]", r"^factors=\[0.3\] is invalid: .* give factors that make one, or lengths$"),
    ],
)
def test_diagnose_refusals_name_its_own_keys_not_eval_pys(trained_run, tmp_path, given, refused):
    """The evaluation's checks said eval.lengths=[] to a command whose key is lengths=."""
    cfg = compose_diagnose(trained_run, tmp_path / "out", f"ckpt={trained_run}", given)
    with pytest.raises(ConfigError, match=refused) as raised:
        diagnose(cfg)
    assert raised.value.key in (None, given.split("=")[0]) and not (tmp_path / "out").exists()


def test_diagnose_into_a_runs_folder_is_refused_before_anything_there_changes(trained_run, tmp_path):
    """An audit found hydra.run.dir=<a training run> accepted: the run's .hydra/ record of its command was replaced
    by diagnose.py's (eval.py refuses that folder)."""
    run = tmp_path / "run"  # a run's folder: its results and its command's record
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "results.json").write_text(json.dumps({"meta": {"seed": 0}, "rows": []}))
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    refused = r"^hydra.run.dir=.* holds a lenext run's results.json, whose record of its command \(.hydra/\) this "
    with pytest.raises(ConfigError, match=refused):
        diagnose(compose_diagnose(trained_run, run, f"ckpt={trained_run}", "lengths=[32]", "windows=1"))
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == files


def test_a_diagnose_sweep_into_a_training_sweeps_folder_is_refused_naming_the_sweep_before_any_job(
    trained_run, tmp_path
):
    """Refused job by job, a diagnose.py sweep into a training sweep's folder named hydra.run.dir, which the user had
    not set, and told them to set it; it names hydra.sweep.dir now, before the first job, as eval.py's sweep does."""
    run = tmp_path / "sweep" / "0"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("pe: rope\n")
    (run / "results.json").write_text(json.dumps({"complete": True, "meta": {"row": "rope", "seed": 0}, "rows": []}))
    environment = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"LENEXT_ROOT": str(tmp_path)}
    arguments = ["-m", f"hydra.sweep.dir={run.parent}", f"ckpt={trained_run}", "lengths=[32]", "windows=1"]
    done = run_command("diagnose.py", arguments, environment, tmp_path)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"error: hydra.sweep.dir={run.parent} holds a lenext run's {run / 'results.json'}, whose record of its "
        "command (.hydra/) this diagnosis would replace: give it another folder (hydra.sweep.dir=...)"
    ]
    assert sorted(os.listdir(run)) in ([".hydra", "results.json"], [".hydra", ".lenext.lock", "results.json"])
    assert (run / ".hydra" / "config.yaml").read_text() == "pe: rope\n"


def test_diagnose_py_answers_bad_input_in_one_line_and_has_help(tmp_path):
    environment = {**os.environ, "LENEXT_ROOT": str(tmp_path)}
    environment.pop("HYDRA_FULL_ERROR", None)
    result = run_command("diagnose.py", [f"ckpt={tmp_path / 'none.ckpt'}", "windows=0"], environment, tmp_path)
    assert result.returncode == 1 and result.stderr.strip().startswith("error: windows=0 is invalid"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not list(tmp_path.rglob("diagnostics.json"))
    # A command of its own, as the first: Hydra's main, run in this process, left its logging handler on the root
    # logger, writing to this test's captured output, closed after it ("--- Logging error ---" in later tests)
    helped = run_command("diagnose.py", ["--help"], environment, tmp_path)
    shown = helped.stdout
    assert helped.returncode == 0, helped.stderr
    assert "diagnose why" in shown.splitlines()[0] and "Examples:" in shown and "powered by Hydra" not in shown
