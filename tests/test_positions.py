"""Position schemes (``lenext.positions``): randomized positions (Ruoss et al. 2023) and PoSE (Zhu et al. 2023).

Two halves: the draws themselves (their invariants, their distribution, what seeds them), and what
the decoder does with them (relative PEs see only differences, absolute PEs see the positions, the
causal mask still holds, the drawn positions do reach the PE). Models are tiny: the whole file runs in
seconds on two CPU cores.
"""

import json
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from lenext.errors import ConfigError
from lenext.model import Decoder
from lenext.pe import (
    FIRE,
    KERPLE,
    ALiBi,
    Compose,
    FoX,
    Learned,
    NoPE,
    PerLayer,
    RoPE,
    ShawRelative,
    Sinusoidal,
    T5Bias,
    XPos,
)
from lenext.positions import (
    DEFAULT_REACH,
    PoSE,
    PositionScheme,
    Randomized,
    generator,
    pose_positions,
    position_scheme,
    randomized_positions,
    training_positions,
    window_positions,
)
from lenext.run import train
from tests.conftest import small_corpus_overrides

VOCAB, TRAIN_LEN = 97, 16
MAX_POSITION = 64  # N of the drawn positions at the model level: 4 x L_train
SHIFT = 37  # added to drawn positions; odd and not a multiple of anything the PEs are periodic in
LEARNED_TABLE = 128  # the decoder's max_position: the learned APE's table covers drawn + SHIFT (< 64 + 37)

# PEs whose scores depend only on differences of positions, so a constant shift of every position
# leaves the output unchanged. FIRE normalises by max(L_thr, i): relative only for queries below its
# threshold, which 10 000 keeps above every position here.
RELATIVE_PES = {
    "nope": NoPE,
    "rope": RoPE,
    "alibi": ALiBi,
    "t5": T5Bias,
    "shaw": partial(ShawRelative, k=4),
    "shaw_value": partial(ShawRelative, k=4, value_term=True),
    "kerple": KERPLE,
    "kerple_power": partial(KERPLE, kernel="power"),
    "fire": partial(FIRE, init_threshold=10_000.0),
    "xpos": XPos,
    "p_rope": partial(RoPE, fraction=0.5),
    "fox_rope": partial(Compose, pes={"rope": RoPE, "fox": FoX}),
    "rnope_swa": partial(PerLayer, pes={"rope": RoPE, "alibi": ALiBi}, pattern=["rope", "alibi"], windows={"rope": 5}),
}
ABSOLUTE_PES = {"sinusoidal": Sinusoidal, "learned": Learned}
# FIRE with its default threshold (L_train): drawn positions past it take its per-pair path.
ALL_PES = {**RELATIVE_PES, **ABSOLUTE_PES, "fire_default": FIRE, "rope_yarn": partial(RoPE, scaling="yarn", factor=4.0)}


def strictly_increasing(positions: torch.Tensor) -> bool:
    return bool((positions.diff(dim=-1) >= 1).all())


# --------------------------------------------------------------------------------------------
# randomized_positions
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, length, max_position", [(1, 1, 1), (3, 16, 64), (5, 16, 17), (4, 100, 4096)])
def test_randomized_positions_are_distinct_sorted_and_in_range(batch, length, max_position):
    positions = randomized_positions(batch, length, max_position, generator(0))
    assert positions.shape == (batch, length)
    assert not positions.is_floating_point()
    assert strictly_increasing(positions)  # hence distinct within a row
    assert all(row.unique().numel() == length for row in positions)
    assert int(positions.min()) >= 0
    assert int(positions.max()) < max_position


def test_randomized_positions_rows_are_independent_draws():
    positions = randomized_positions(8, 16, 512, generator(0))
    assert positions.unique(dim=0).size(0) == 8  # 8 rows of one call, none repeated


def test_randomized_positions_follow_the_seed():
    first = randomized_positions(4, 16, 256, generator(7, 1, 2))
    assert torch.equal(first, randomized_positions(4, 16, 256, generator(7, 1, 2)))
    assert not torch.equal(first, randomized_positions(4, 16, 256, generator(7, 1, 3)))
    assert not torch.equal(first, randomized_positions(4, 16, 256, generator(8, 1, 2)))


def test_randomized_positions_without_room_are_sequential():
    """N = L: the only L distinct positions in [0, L) are 0..L-1."""
    assert torch.equal(randomized_positions(3, 16, 16, generator(0)), torch.arange(16).expand(3, 16))


def test_randomized_positions_cover_the_range_uniformly():
    """A uniform L-subset of [0, N): every position is in it with probability L / N, and its elements
    have mean (N - 1) / 2.

    2000 rows of L = 8 from N = 32: each position's count is Binomial(2000, 1/4), mean 500, sd 19.4,
    so 500 +- 100 is 5 sd. The mean of the 16 000 positions has variance
    (N^2 - 1) / 12 / L * (N - L) / (N - 1) / rows = 85.25 / 8 * 24 / 31 / 2000 (sampling without
    replacement within a row), sd 0.064: 15.5 +- 0.4 is 6 sd. The draw is seeded, so never flaky; a
    biased draw (the first L, the top of the range, sampling with replacement) fails one or the other.
    """
    rows, length, max_position = 2000, 8, 32
    positions = randomized_positions(rows, length, max_position, generator(0))
    counts = torch.bincount(positions.flatten(), minlength=max_position)
    assert counts.size(0) == max_position
    expected = rows * length / max_position
    assert int(counts.min()) > expected - 100, counts
    assert int(counts.max()) < expected + 100, counts
    assert positions.double().mean().item() == pytest.approx((max_position - 1) / 2, abs=0.4)


# --------------------------------------------------------------------------------------------
# pose_positions
# --------------------------------------------------------------------------------------------


def jumps(positions: torch.Tensor) -> torch.Tensor:
    """(B,): how many times each row leaves its current contiguous run."""
    return (positions.diff(dim=-1) > 1).sum(-1)


@pytest.mark.parametrize(
    "batch, length, target_len, chunks", [(4, 16, 512, 2), (4, 16, 64, 3), (3, 16, 20, 5), (2, 8, 100, 8)]
)
def test_pose_positions_are_chunks_of_contiguous_positions(batch, length, target_len, chunks):
    for seed in range(20):  # many draws: the invariants hold for every one
        positions = pose_positions(batch, length, target_len, chunks, generator(seed))
        assert positions.shape == (batch, length)
        assert not positions.is_floating_point()
        assert strictly_increasing(positions)
        assert (positions[:, 0] == 0).all()  # u_0 = 0, as the PoSE reference code
        assert (positions[:, -1] < target_len).all()
        assert (jumps(positions) <= chunks - 1).all()  # at most ``chunks`` contiguous runs


def test_pose_positions_without_room_are_sequential():
    """L_t = L_c: the total skip is 0, whatever the cuts."""
    for chunks in (2, 3, 16):
        assert torch.equal(pose_positions(4, 16, 16, chunks, generator(chunks)), torch.arange(16).expand(4, 16))


def test_pose_positions_skip_and_reach_the_target_length():
    target_len, length = 512, 16
    positions = pose_positions(1000, length, target_len, 2, generator(0))
    assert (jumps(positions) > 0).any()  # some skips are positive ...
    assert (jumps(positions) == 1).float().mean() > 0.9  # ... nearly all (u_1 = 0 has probability 1 / 497)
    last = positions[:, -1]
    assert int(last.max()) > 0.9 * target_len  # training reaches the end of the target window
    # With 2 chunks u_1 is uniform on 0..L_t - L_c: mean 248, sd 143 / sqrt(1000) = 4.5, so +- 25 is 5 sd.
    assert (last - (length - 1)).double().mean().item() == pytest.approx((target_len - length) / 2, abs=25)


def test_pose_positions_with_three_chunks_skip_again_from_the_last_skip():
    """u_2 uniform on [u_1, L_t - L_c] after u_1 uniform on [0, L_t - L_c]: the last position sits at (L_c - 1) + u_2,
    whose mean is 3/4 of the slack (no second skip would give 1/2; a second skip from 0, a non-increasing row)."""
    target_len, length = 512, 16
    positions = pose_positions(1000, length, target_len, 3, generator(2))
    assert (jumps(positions) == 2).float().mean() > 0.9  # both skips positive in nearly every row
    # u_2 = slack (1 - (1 - U_1)(1 - U_2)): sd 0.22 slack = 109, / sqrt(1000) = 3.5, so +- 20 is 6 sd.
    u_2 = (positions[:, -1] - (length - 1)).double()
    assert u_2.mean().item() == pytest.approx(0.75 * (target_len - length), abs=20)


def test_pose_positions_cut_anywhere_in_the_window():
    """The jump of a 2-chunk row sits at its cut, uniform over the L - 1 places between tokens."""
    positions = pose_positions(2000, 8, 512, 2, generator(1))
    has_jump = jumps(positions) == 1
    cut = (positions[has_jump].diff(dim=-1) > 1).long().argmax(-1) + 1  # first token of chunk 1
    assert torch.equal(cut.unique(), torch.arange(1, 8))  # every cut 1..7 occurs; 0 and 8 never do


def test_pose_positions_follow_the_seed():
    first = pose_positions(4, 16, 512, 3, generator(3, 0))
    assert torch.equal(first, pose_positions(4, 16, 512, 3, generator(3, 0)))
    assert not torch.equal(first, pose_positions(4, 16, 512, 3, generator(3, 1)))


# --------------------------------------------------------------------------------------------
# training_positions: a resumed run draws what the uninterrupted one would
# --------------------------------------------------------------------------------------------

DRAWING_SCHEMES = {
    "randomized": {"positions": "randomized", "max_position": 256},
    "pose": {"positions": "pose", "target_len": 256, "chunks": 3},
}


@pytest.mark.parametrize("settings", DRAWING_SCHEMES.values(), ids=DRAWING_SCHEMES.keys())
def test_training_positions_depend_on_seed_rank_step_and_micro_batch(settings):
    scheme = position_scheme(settings, TRAIN_LEN)
    identity = {"seed": 11, "rank": 1, "step": 40, "micro": 2}
    draw = training_positions(scheme, 4, TRAIN_LEN, **identity)
    assert draw.shape == (4, TRAIN_LEN)
    torch.manual_seed(123)  # the global generator is not what seeds a draw
    assert torch.equal(draw, training_positions(scheme, 4, TRAIN_LEN, **identity))
    for key in identity:
        changed = {**identity, key: identity[key] + 1}
        assert not torch.equal(draw, training_positions(scheme, 4, TRAIN_LEN, **changed)), key


@pytest.mark.parametrize("settings", DRAWING_SCHEMES.values(), ids=DRAWING_SCHEMES.keys())
def test_a_resumed_run_draws_what_the_uninterrupted_run_would(settings):
    def run(steps, scheme):  # two micro-batches per optimizer step
        draw = partial(training_positions, scheme, 2, TRAIN_LEN, seed=5, rank=0)
        return [draw(step=step, micro=micro) for step in steps for micro in (0, 1)]

    uninterrupted = run(range(6), position_scheme(settings, TRAIN_LEN))
    randomized_positions(3, 8, 64, generator(99))  # other draws in between change nothing
    resumed = run(range(3, 6), position_scheme(settings, TRAIN_LEN))  # a fresh scheme, as after a restart
    for got, expected in zip(resumed, uninterrupted[6:], strict=True):
        assert torch.equal(got, expected)


def test_sequential_training_positions_are_none():
    for settings in (None, {}, {"positions": "sequential"}):
        scheme = position_scheme(settings, TRAIN_LEN)
        assert training_positions(scheme, 4, TRAIN_LEN, seed=0, rank=0, step=0, micro=0) is None


# --------------------------------------------------------------------------------------------
# window_positions: each window's draw depends on the window alone
# --------------------------------------------------------------------------------------------


def test_window_positions_do_not_depend_on_batching():
    scheme = position_scheme(DRAWING_SCHEMES["randomized"], TRAIN_LEN)
    windows = [(0, 0), (1, 64), (0, 16)]
    together = window_positions(scheme, 32, 3, windows)
    alone = torch.cat([window_positions(scheme, 32, 3, [window]) for window in windows])
    assert together.shape == (3, 32)
    assert torch.equal(together, alone)
    assert torch.equal(window_positions(scheme, 32, 3, windows[::-1]), together.flip(0))  # order: only row order
    assert together.unique(dim=0).size(0) == 3  # different windows, different draws
    assert strictly_increasing(together) and int(together.max()) < 256
    assert not torch.equal(together, window_positions(scheme, 32, 4, windows))  # the run's seed counts too


def test_training_and_evaluation_draw_from_separate_streams():
    """The same integers in the same places of the identity, once as training's (rank, step, micro)
    and once as evaluation's (length, document, first token): the draws must still differ."""
    scheme = position_scheme(DRAWING_SCHEMES["randomized"], TRAIN_LEN)
    training = training_positions(scheme, 1, TRAIN_LEN, seed=3, rank=TRAIN_LEN, step=0, micro=64)
    evaluation = window_positions(scheme, TRAIN_LEN, 3, [(0, 64)])
    assert training.shape == evaluation.shape == (1, TRAIN_LEN)
    assert not torch.equal(training, evaluation)


@pytest.mark.parametrize("settings", [None, DRAWING_SCHEMES["pose"]], ids=["sequential", "pose"])
def test_sequential_and_pose_evaluate_at_sequential_positions(settings):
    """None: the decoder's 0..L-1, the positions PoSE prepares the model for."""
    assert window_positions(position_scheme(settings, TRAIN_LEN), 64, 0, [(0, 0), (1, 64)]) is None


# --------------------------------------------------------------------------------------------
# position_scheme: settings, defaults and errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"positions": "randomized", "max_position": TRAIN_LEN - 1}, "train.max_position"),
        ({"positions": "pose", "target_len": TRAIN_LEN - 1}, "train.target_len"),
        ({"positions": "pose", "chunks": TRAIN_LEN + 1}, "train.chunks"),
    ],
)
def test_invalid_settings_name_their_key(settings, key):
    with pytest.raises(ConfigError, match=rf"^{key}=\d+ is invalid"):
        position_scheme(settings, TRAIN_LEN)


def test_boundary_settings_are_accepted():
    """The limits themselves are valid: N = L_train, L_t = L_train, chunks = L_train (one token per chunk)."""
    assert position_scheme({"positions": "randomized", "max_position": TRAIN_LEN}, TRAIN_LEN).reach == TRAIN_LEN
    pose = position_scheme({"positions": "pose", "target_len": TRAIN_LEN, "chunks": TRAIN_LEN}, TRAIN_LEN)
    assert (pose.reach, pose.chunks) == (TRAIN_LEN, TRAIN_LEN)


def test_defaults_reach_32_times_the_training_length():
    assert DEFAULT_REACH == 32
    randomized = position_scheme({"positions": "randomized", "max_position": None}, TRAIN_LEN)
    pose = position_scheme({"positions": "pose", "target_len": None}, TRAIN_LEN)
    assert isinstance(randomized, Randomized) and isinstance(pose, PoSE)
    assert randomized.name == "randomized" and pose.name == "pose"
    assert randomized.reach == pose.reach == 32 * TRAIN_LEN
    assert pose.chunks == 2
    sequential = position_scheme(None, TRAIN_LEN)
    assert type(sequential) is PositionScheme and sequential.name == "sequential" and sequential.reach is None


def test_randomized_refuses_evaluation_lengths_beyond_its_positions():
    scheme = position_scheme({"positions": "randomized", "max_position": 64}, TRAIN_LEN)
    scheme.check_evaluation_length(64)  # exactly N positions: all of them, in order
    with pytest.raises(ConfigError, match=r"^train\.max_position=64 is invalid.*65 tokens"):
        scheme.check_evaluation_length(65)
    # Sequential and PoSE evaluate at 0..L-1: any length.
    for settings in (None, DRAWING_SCHEMES["pose"]):
        position_scheme(settings, TRAIN_LEN).check_evaluation_length(100_000)


# --------------------------------------------------------------------------------------------
# The decoder under drawn positions
# --------------------------------------------------------------------------------------------


def tiny_decoder(pe, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    net = Decoder(
        vocab_size=VOCAB,
        train_len=TRAIN_LEN,
        pe=pe,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_position=LEARNED_TABLE,
    )
    # PE parameters (learned APE, T5, Shaw tables) start at std 0.02: make a wrong position visible.
    # So do q and k: at std 0.02 every score is ~0, attention is uniform, and RoPE's rotation vanishes.
    with torch.no_grad():
        for param in net.pe_parameters():
            param.normal_(std=0.5)
        for block in net.blocks:
            block.attn.qkv.weight.normal_(std=0.3)
    net.pe.project_()  # as after an optimizer step: KERPLE's r1, r2 back in their domain
    return net.eval()


def tokens(length: int = TRAIN_LEN, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def drawn(scheme: str, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """(batch, L_train) positions of a scheme, reaching up to MAX_POSITION - 1; rows differ."""
    gen = generator(seed)
    if scheme == "randomized":
        positions = randomized_positions(batch, TRAIN_LEN, MAX_POSITION, gen)
    else:
        positions = pose_positions(batch, TRAIN_LEN, MAX_POSITION, 3, gen)
    assert positions.unique(dim=0).size(0) == batch
    return positions


def fire_thresholds(net: Decoder) -> list[float]:
    return [(layer.threshold_multiplier * layer.init_threshold).abs().item() for layer in net.pe.layers]


@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared"])
@pytest.mark.parametrize("pe", RELATIVE_PES.values(), ids=RELATIVE_PES.keys())
def test_relative_pes_are_shift_invariant_under_drawn_positions(pe, shared):
    """Positions p and p + c have the same differences: a relative PE gives the same hidden states."""
    net = tiny_decoder(pe)
    positions = drawn("randomized", batch=1 if shared else 2)  # (1, L) broadcast, or one row per sequence
    if isinstance(net.pe, FIRE):  # only below its threshold is FIRE a function of i - j
        assert min(fire_thresholds(net)) > int(positions.max()) + SHIFT
    x = tokens()
    with torch.no_grad():
        assert_close(net(x, positions + SHIFT), net(x, positions), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pe", ABSOLUTE_PES.values(), ids=ABSOLUTE_PES.keys())
def test_absolute_pes_see_the_shift(pe):
    net, positions, x = tiny_decoder(pe), drawn("randomized"), tokens()
    with torch.no_grad():
        base, shifted = net(x, positions), net(x, positions + SHIFT)
    assert (base - shifted).abs().amax(dim=-1).min() > 1e-2  # every token's state moves


def test_fire_past_its_threshold_is_not_shift_invariant():
    """The other side of FIRE's condition: with L_thr = L_train, queries past it are normalised by their
    own position, so a shift changes the output. Guards the relative test against a FIRE that ignores i."""
    net, positions, x = tiny_decoder(FIRE), drawn("randomized"), tokens()
    assert max(fire_thresholds(net)) < int(positions.max())
    with torch.no_grad():
        assert not torch.allclose(net(x, positions + SHIFT), net(x, positions), atol=1e-4)


@pytest.mark.parametrize("scheme", ["randomized", "pose"])
@pytest.mark.parametrize("pe", ALL_PES.values(), ids=ALL_PES.keys())
def test_causality_under_drawn_positions(pe, scheme):
    """Changing token t + 1 leaves the hidden states of tokens 0..t unchanged, and changes token t + 1's."""
    net, positions, x = tiny_decoder(pe), drawn(scheme), tokens()
    with torch.no_grad():
        base = net(x, positions)
        for t in (3, TRAIN_LEN - 2):  # a change early and at the last token
            changed = x.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
            out = net(changed, positions)
            assert_close(out[:, : t + 1], base[:, : t + 1])
            assert (out[:, t + 1] - base[:, t + 1]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("pe", ALL_PES.values(), ids=ALL_PES.keys())
def test_explicit_sequential_positions_equal_none(pe):
    """0..L-1 given as a (1, L) tensor, or as one row per sequence, is what None means (at a length
    beyond L_train, where T5's and FIRE's far branches and the band's edges are in play)."""
    length = 24
    net, x = tiny_decoder(pe), tokens(length)
    with torch.no_grad():
        default = net(x)
        assert_close(net(x, torch.arange(length)[None]), default, atol=0, rtol=0)
        assert_close(net(x, torch.arange(length).expand(2, length)), default, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", {**RELATIVE_PES, **ABSOLUTE_PES}.values(), ids={**RELATIVE_PES, **ABSOLUTE_PES}.keys())
def test_drawn_positions_reach_the_pe(pe):
    """Every PE but NoPE gives each sequence another output at its drawn positions than at 0..L-1: the
    positions are used, row by row. NoPE ignores them entirely (the causal mask is its only positional
    signal). Per sequence, not per token: a token whose prefix has the gaps of 0..t (token 0 always)
    sees no change under a relative PE."""
    net, positions, x = tiny_decoder(pe), drawn("randomized"), tokens()
    with torch.no_grad():
        at_drawn, at_sequential = net(x, positions), net(x)
    if isinstance(net.pe, NoPE):
        assert_close(at_drawn, at_sequential, atol=0, rtol=0)
    else:
        assert (at_drawn - at_sequential).abs().amax(dim=(1, 2)).min() > 5e-3  # smallest: FIRE, 1.4e-2


def test_randomized_positions_reach_rope():
    """RoPE, the main PE trained with randomized positions: each sequence's own draw changes its output."""
    net, x = tiny_decoder(RoPE), tokens()
    positions = drawn("randomized")
    with torch.no_grad():
        at_drawn, at_sequential = net(x, positions), net(x)
        swapped = net(x, positions.flip(0))  # the rows' draws exchanged
    assert (at_drawn - at_sequential).abs().amax(dim=(1, 2)).min() > 1e-2  # per sequence: see above
    assert not torch.allclose(swapped, at_drawn, atol=1e-3)


def test_nope_trained_at_randomized_positions_is_nope_exactly(compose_train, small_text_corpus, tmp_path):
    """Without a PE positions change nothing, and they are drawn from a generator of their own: initialization,
    data order and dropout stay the sequential run's, so every result is identical (why studies skip the row)."""
    rows = {}
    for row in ("nope", "nope_randomized"):
        overrides = small_corpus_overrides(small_text_corpus, f"pe={row}", "trainer.max_steps=4", "eval.factors=[1,2]")
        train(compose_train(*overrides, f"paths.output_dir={tmp_path / row}", "model.dropout=0.1"))
        rows[row] = json.loads((tmp_path / row / "results.json").read_text())["rows"]
    assert [r["mean_nll"] for r in rows["nope"]] == [r["mean_nll"] for r in rows["nope_randomized"]]
