"""The report's figure registry: a figure registered in one entry is drawn and written with the others
(docs/adding/figure.md, whose example is tests/examples/longest_length.py)."""

from collections import Counter
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from lenext.report import figures, report
from tests.examples.longest_length import longest_length
from tests.test_report import write_probe_run, write_run
from tests.test_report_protocols import new_protocol_runs


@pytest.fixture
def registry():
    """The figure registry, restored after the test: figures registered in it are the test's alone."""
    saved = dict(figures.FIGURES)  # the one dict @figure registers into and write_figures draws from
    yield figures.FIGURES
    figures.FIGURES.clear()
    figures.FIGURES.update(saved)


def two_seeds_of_two_pes(folder):
    for seed in range(2):
        write_run(folder / str(2 * seed), "alibi", seed, {64: 20.0 + seed, 128: 19.0 + seed})
        write_run(folder / str(2 * seed + 1), "rope", seed, {64: 21.0 + seed, 128: 40.0 + seed})
    return folder


def test_a_figure_registered_in_one_entry_is_written_with_the_others(registry, tmp_path):
    assert (
        figures.figure("longest_length.png")(longest_length) is longest_length
    )  # the decorator, as the figure modules use it
    assert registry["longest_length.png"] is longest_length
    report([str(two_seeds_of_two_pes(tmp_path / "runs"))], str(tmp_path / "out"))
    written = tmp_path / "out" / "longest_length.png"
    assert written.read_bytes().startswith(b"\x89PNG") and (tmp_path / "out" / "ppl_vs_length.png").exists()


def test_a_figure_with_nothing_to_draw_writes_no_file(registry, tmp_path):
    registry["longest_length.png"] = longest_length
    write_probe_run(tmp_path / "runs" / "0", "nope", 0, {32: 1.0, 64: 0.5})  # accuracy tables: no perplexity
    report([str(tmp_path / "runs")], str(tmp_path / "out"))
    assert (tmp_path / "out" / "accuracy_vs_length.png").exists()
    assert not any((tmp_path / "out" / name).exists() for name in ("longest_length.png", "ppl_vs_length.png"))


# What every built-in figure keeps to (lenext.report.figures' docstring).


def drawn_lines(fig) -> list[tuple]:
    """(axes, legend entry, colour, line style) of every curve with a legend entry, panel by panel."""
    from matplotlib.colors import to_hex

    lines = []
    for ax in fig.axes:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            line = handle.lines[0] if hasattr(handle, "lines") else handle
            lines.append((ax, name, to_hex(line.get_color()), str(line.get_linestyle())))
    return lines


def row_of(name: str) -> str:
    """A legend entry's row label (less what it adds about seeds: `` [1 seed]``)."""
    return name.split(" [")[0]


def extension_runs(folder, pes=("alibi", "nope", "t5")):
    """Two seeds of RoPE evaluated under two scalings, fine-tuned four ways (full length and PoSE), and of other
    PEs fine-tuned directly, with positions.csv and each second stage's validation curve (csv/metrics.csv)."""
    from tests.test_report import second_stage

    def variants(*names, seed=0):
        return [
            {"protocol": "nonoverlap", "scaling": v, "length": n, "ppl": 25.0 + seed + (n == 128) * i, "status": "ok"}
            for i, v in enumerate(names)
            for n in (64, 128)
        ]

    job = 0
    for seed in range(2):
        write_run(
            folder / str(job),
            "rope",
            seed,
            {64: 21 + seed, 128: 42 + seed},
            scaling="none",
            extra_rows=variants("ntk", "yarn", seed=seed),
        )
        job += 1
        for method, ppl in (("direct", 30), ("pi", 28), ("yarn", 26), ("pose", 29)):
            meta = second_stage("rope", method)
            if method == "pose":
                meta["row_fields"] = {
                    "pe": "rope",
                    "positions": "pose",
                    "attention": [],
                    "base": "rope",
                    "method": "pose",
                    "stage_len": 256,
                }
            write_run(folder / str(job), "rope", seed, {64: 20 + seed, 128: ppl + seed}, train_len=256, meta=meta)
            (folder / str(job) / "csv").mkdir()
            (folder / str(job) / "csv" / "metrics.csv").write_text(
                "step,val/ppl\n" + "".join(f"{step},{ppl + 10 - step / 10 + seed}\n" for step in (49, 99, 100))
            )
            job += 1
        for i, pe in enumerate(pes):
            write_run(folder / str(job), pe, seed, {64: 20 + i + seed, 128: 21 + 3 * i + seed})
            write_run(
                folder / str(job + 1),
                pe,
                seed,
                {64: 19 + i + seed, 128: 20 + i + seed},
                train_len=256,
                meta=second_stage(pe, "direct"),
            )
            job += 2
    return folder


def summary_of(folder):
    from lenext.report import Summary, load

    return Summary(load([str(folder)]))


def test_a_pes_colour_is_the_same_in_every_figure_and_panel(tmp_path):
    """Every curve of a PE as trained is in its colour (``pe_style``: from its name, whatever the report holds),
    a second stage in its first stage's, and in a panel no two curves share both colour and line style."""
    summary = summary_of(extension_runs(tmp_path / "runs"))
    labels = summary.labels
    seen: dict[str, set] = {}
    panels = 0
    for name in ("ppl_vs_length.png", "per_position.png", "extension.png", "adaptation.png"):
        fig = figures.FIGURES[name](summary)
        lines = drawn_lines(fig)
        assert lines, name
        for ax in {ax for ax, *_ in lines}:
            in_panel = [(colour, style) for axes, _, colour, style in lines if axes is ax]
            assert len(set(in_panel)) == len(in_panel), (name, ax.get_title())
            panels += 1
        for _, entry, colour, _ in lines:
            label = row_of(entry)
            if pd.isna(labels.variant[label]) and (
                label == labels.root[label] or labels.extension_method[label] == "none"
            ):
                seen.setdefault(labels.root[label], set()).add(colour)
        figures.pyplot().close(fig)
    assert panels > 8
    assert {root: colours for root, colours in seen.items()} == {
        root: {figures.pe_colour(root)} for root in ("rope", "alibi", "nope", "t5")
    }
    assert len({figures.pe_colour(root) for root in seen}) == len(seen)
    # The same colour in a report of other PEs: it is the PE's, not its place in the report.
    alone = summary_of(two_seeds_of_two_pes(tmp_path / "other"))
    colours = {row_of(entry): colour for _, entry, colour, _ in drawn_lines(figures.lengths.ppl_vs_length(alone))}
    assert colours["rope"] == figures.pe_colour("rope") and colours["alibi"] == figures.pe_colour("alibi")


def test_a_panel_comparing_one_pes_variants_colours_them_by_method(tmp_path):
    """RoPE's scalings and second stages in distinct colours, the method's own in both (PI is linear): the
    comparison the panel makes is found by colour, not by line style."""
    summary = summary_of(extension_runs(tmp_path / "runs"))
    lines = drawn_lines(figures.extension.extension(summary))
    colour = {row_of(entry): colour for _, entry, colour, _ in lines}
    assert colour["rope (yarn)"] == colour["rope -> yarn@256"] == figures.style.METHOD_STYLES["yarn"][0]
    assert colour["rope -> pi@256"] == figures.style.METHOD_STYLES["linear"][0]
    assert colour["rope -> pose@256"] == figures.style.METHOD_STYLES["pose"][0]
    rope = [colour[label] for label in ("rope", "rope (ntk)", "rope (yarn)", "rope -> pi@256", "rope -> pose@256")]
    assert len(set(rope)) == len(rope)
    # Every method panel draws a method in the same colour and the PE as trained in blue, which no method has:
    # vermillion is YaRN in p_rope's panel too, though p_rope's own colour is vermillion.
    assert colour["rope"] == figures.style.AS_TRAINED_STYLE[0]
    assert figures.pe_colour("p_rope") == figures.style.METHOD_STYLES["yarn"][0]
    info = pd.DataFrame(
        {"base": [None, None], "variant": [None, "yarn"], "extension_method": ["none", "yarn"], "pe": "p_rope"},
        index=["p_rope", "p_rope (yarn)"],
    )
    styles = figures.style.line_styles(info, list(info.index), by_method=True)
    assert styles["p_rope"]["color"] == figures.style.AS_TRAINED_STYLE[0]
    assert styles["p_rope (yarn)"]["color"] == figures.style.METHOD_STYLES["yarn"][0]
    assert figures.style.AS_TRAINED_STYLE[0] not in {colour for colour, _ in figures.style.METHOD_STYLES.values()}


def test_two_pes_of_one_panel_never_share_a_colour():
    """FoX's place in ``KNOWN_PES`` gives it RoPE's blue: drawn together, RoPE keeps blue (listed first) and FoX
    takes a colour no PE of the panel has; drawn without RoPE, FoX keeps its own."""
    assert figures.pe_colour("fox") == figures.pe_colour("rope")
    pes = ["fox", "alibi", "rope", "nope"]
    info = pd.DataFrame({"base": None, "variant": None, "extension_method": "none", "pe": pes}, index=pes)
    colours = {label: style["color"] for label, style in figures.style.line_styles(info, pes, by_method=False).items()}
    assert colours["rope"] == figures.pe_colour("rope") and colours["alibi"] == figures.pe_colour("alibi")
    assert len(set(colours.values())) == len(pes)
    assert colours["fox"] not in {figures.pe_colour(pe) for pe in pes}
    alone = figures.style.line_styles(info.loc[["fox", "alibi"]], ["fox", "alibi"], by_method=False)
    assert alone["fox"]["color"] == figures.pe_colour("fox")
    # More PEs than colours (diagnostics_vs_ppl draws every diagnosed row in one panel): drawn, some sharing one.
    many = list(figures.style.KNOWN_PES)[:12]
    info_many = pd.DataFrame({"base": None, "variant": None, "extension_method": "none", "pe": many}, index=many)
    assert len({style["color"] for style in figures.style.line_styles(info_many, many, False).values()}) == 10
    # Every known PE drawn eight to a panel: never two of a panel in one colour.
    known = list(figures.style.KNOWN_PES)
    for start in range(len(known) - 7):
        panel = known[start : start + 8]
        info = pd.DataFrame({"base": None, "variant": None, "extension_method": "none", "pe": panel}, index=panel)
        styles = figures.style.line_styles(info, panel, by_method=False)
        assert len({style["color"] for style in styles.values()}) == 8, panel


def test_no_panel_draws_more_than_the_limit_and_every_row_is_drawn(tmp_path):
    """Twenty PEs and a RoPE of eight variants: panels of at most MAX_CURVES curves, by family and by PE, that
    together draw every row of the table."""
    scalings = ("linear", "ntk", "yarn", "llama3", "self_extend", "dynamic_ntk", "s1", "s2")
    for seed in range(2):
        for i in range(20):
            write_run(tmp_path / f"{seed}_{i}", f"pe{i}", seed, {64: 20.0 + i, 128: 20.0 + 2 * i})
        rows = [{"protocol": "nonoverlap", "scaling": s, "length": 128, "ppl": 30.0, "status": "ok"} for s in scalings]
        write_run(tmp_path / f"{seed}_rope", "rope", seed, {64: 21, 128: 40}, scaling="none", extra_rows=rows)
    summary = summary_of(tmp_path)
    fig = figures.lengths.ppl_vs_length(summary)
    lines = drawn_lines(fig)
    per_panel = Counter(ax for ax, *_ in lines)
    assert max(per_panel.values()) <= figures.style.MAX_CURVES and len(per_panel) >= 4
    table = next(iter(summary.tables.values()))
    assert {row_of(entry) for _, entry, *_ in lines} == set(table.index)
    scaled = [ax for ax in per_panel if "rope (yarn)" in {row_of(e) for a, e, *_ in lines if a is ax}]
    assert all("rope" in {row_of(e) for a, e, *_ in lines if a is ax} for ax in scaled)  # the PE beside them


def test_a_titles_takeaway_is_computed_from_the_statistics(tmp_path):
    """The PEs' panel names the row that grows least from L_train and the one that grows most, by the table's
    means; a panel of one PE's variants compares the best with the PE as trained."""
    for seed in range(2):
        write_run(tmp_path / f"a{seed}", "alibi", seed, {64: 20.0 + 2 * seed, 128: 21.0 + 2 * seed})
        rows = [
            {"protocol": "nonoverlap", "scaling": "ntk", "length": n, "ppl": p + seed, "status": "ok"}
            for n, p in ((64, 20.0), (128, 30.0))
        ]
        write_run(
            tmp_path / f"r{seed}",
            "rope",
            seed,
            {64: 20.0 + 2 * seed, 128: 40.0 + 4 * seed},
            scaling="none",
            extra_rows=rows,
        )
        write_run(tmp_path / f"n{seed}", "nope", seed, {64: 20.0, 128: 70.0})
    summary = summary_of(tmp_path)
    table = next(iter(summary.tables.values()))
    mean = table.cells["mean"]
    assert (mean[("alibi", 128)] / mean[("alibi", 64)], mean[("nope", 128)] / mean[("nope", 64)]) == (22 / 21, 3.5)
    titles = [ax.get_title() for ax in figures.lengths.ppl_vs_length(summary).axes]
    trained = [t for t in titles if "as trained" in t]
    assert len(trained) == 1
    assert "at 2x L_train: alibi stays within 5% of its L_train perplexity; nope 3.5x" in trained[0].replace("\n", " ")
    scaled = [t.replace("\n", " ") for t in titles if "scaled at evaluation" in t]
    ratio = mean[("rope (ntk)", 128)] / mean[("rope (ntk)", 64)]
    assert 1.05 < ratio < 1.5  # said in percent
    assert scaled == [
        f"nonoverlap · rope: scaled at evaluation at 2x L_train: rope (ntk) rises least, {100 * (ratio - 1):.0f}% "
        f"above its L_train perplexity; rope {mean[('rope', 128)] / mean[('rope', 64)]:.1f}x"
    ]
    assert (
        figures.takeaways.lengths_takeaway(table, ["alibi"])
        == "at 2x L_train: alibi stays within 5% of its L_train perplexity"
    )


def probe_runs(folder, learned_by_rope=(1.00, 0.95, 0.40)):
    from tests.test_report import write_probe_run

    for seed, at_train_len in enumerate(learned_by_rope):
        write_probe_run(folder / f"r{seed}", "rope", seed, {32: at_train_len, 64: 0.50 - 0.1 * seed})
        write_probe_run(folder / f"a{seed}", "alibi", seed, {32: 1.0, 64: 0.9})
    return folder


def test_a_figure_says_what_its_means_cover_and_which_seeds_learned_the_task(tmp_path):
    """Beyond L_train a probe's mean counts only the seeds that learned the task: the figure says so in its note
    and in the legend entry of each row that lost seeds there; where every seed learned, only the seed count. The
    line follows the seeds that learned it at L_train too (rope: 97.5%, then 45%), not from every seed's mean
    (78.3%, a hollow marker) to theirs, which would join two sets of seeds."""
    fig = figures.lengths.accuracy_vs_length(summary_of(probe_runs(tmp_path / "some")))
    note = fig.get_suptitle().replace("\n", " ")
    assert "mean ± std over 3 seeds" in note
    assert "a line follows the seeds that learned the task (exact match ≥ 90% at L_train)" in note
    assert "a hollow marker gives the mean over every seed at L_train" in note
    entries = {entry for _, entry, *_ in drawn_lines(fig)}
    assert {"rope [2 of 3 seeds learned it]", "alibi"} <= entries
    exact = next(ax for ax in fig.axes if "exact" in ax.get_title())
    rope = next(h for h, n in zip(*exact.get_legend_handles_labels(), strict=True) if n.startswith("rope"))
    assert list(rope.lines[0].get_ydata()) == pytest.approx([97.5, 45.0])
    hollow = [line for line in exact.get_lines() if line.get_markerfacecolor() == "none"]
    assert [list(line.get_xdata()) for line in hollow] == [[32]]
    assert list(hollow[0].get_ydata()) == pytest.approx([100 * (1.0 + 0.95 + 0.40) / 3])
    title = " ".join(ax.get_title().replace("\n", " ") for ax in fig.axes)
    assert "at 2x L_train: alibi 90% exact-match; rope 45%" in title  # rope: seeds 0 and 1 (50%, 40%)
    fig = figures.lengths.accuracy_vs_length(summary_of(probe_runs(tmp_path / "all", (1.0, 1.0, 1.0))))
    assert "learned" not in fig.get_suptitle() and "mean ± std over 3 seeds" in fig.get_suptitle()
    assert {entry for _, entry, *_ in drawn_lines(fig)} == {"rope", "alibi"}


def test_axes_are_labelled_in_plain_numbers_and_heatmaps_in_a_colour_blind_safe_map(tmp_path):
    """Log axes in plain numbers (30, 50, 100), a near-constant axis with neither offset nor scientific notation
    and tall enough to read as constant; passkey's heatmap in cividis."""
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    ax.plot([50, 100, 150], [0.99998, 1.00008, 1.00002])
    figures.drawing.value_axis(ax, 0.99998, 1.00008)
    fig.canvas.draw()
    low, high = ax.get_ylim()
    assert high - low >= 0.02 and not ax.yaxis.get_offset_text().get_text()
    assert all("e" not in t.get_text() and "×" not in t.get_text() for t in ax.get_yticklabels())
    summary = summary_of(two_seeds_of_two_pes(tmp_path / "runs"))
    fig = figures.lengths.ppl_vs_length(summary)
    fig.canvas.draw()
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels() if t.get_text()]
    assert labels and not [t for t in labels if "^" in t or "e+" in t]
    assert figures.style.HEATMAP in {"cividis", "viridis"}


@pytest.mark.parametrize(
    "low, high, expected",
    [(700, 770, {"700", "750"}), (27, 71, {"30", "50"}), (120, 180, {"150"}), (20, 900, {"20", "100", "500"})],
)
def test_a_log_value_axis_shows_at_least_two_plain_labels(low, high, expected):
    """Perplexities from 700 to 770 lie between the labelled 500 and 1000: every tick is labelled then."""
    plt = figures.pyplot()
    fig, ax = plt.subplots()
    ax.plot([64, 128], [low, high])
    ax.set_yscale("log")
    figures.drawing.plain_log_values(ax)
    fig.canvas.draw()
    bottom, top = ax.get_ylim()
    shown = {
        t.get_text()
        for t in [*ax.yaxis.get_majorticklabels(), *ax.yaxis.get_minorticklabels()]
        if t.get_text() and bottom <= t.get_position()[1] <= top
    }
    assert len(shown) >= 2 and expected <= shown, shown
    plt.close(fig)


def test_no_legend_or_title_is_cropped(tmp_path):
    """Every legend and title lies inside its figure, however many rows a panel's legend takes."""
    from tests.test_report import write_probe_run

    summaries = [summary_of(extension_runs(tmp_path / "text", pes=("alibi", "nope", "t5", "kerple", "fire")))]
    for seed in range(2):
        for pe in ("rope", "alibi", "nope", "t5"):
            write_probe_run(tmp_path / "probe" / f"{pe}{seed}", pe, seed, {32: 1.0 - 0.3 * seed, 64: 0.5})
    summaries.append(summary_of(tmp_path / "probe"))
    summaries.append(summary_of(new_protocol_runs(tmp_path / "haystack")))  # key tokens, a haystack, its depths
    for summary in summaries:
        for name, draw in figures.FIGURES.items():
            for file, fig in figures.drawn_files(name, draw(summary)):  # a pattern's (*_depth.png): several
                fig.canvas.draw()
                renderer, (width, height) = fig.canvas.get_renderer(), fig.canvas.get_width_height()
                for ax in fig.axes:
                    shown = [ax.get_legend(), ax.title] if ax.get_legend() else [ax.title]
                    for artist in shown:
                        box = artist.get_window_extent(renderer)
                        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, file
                figures.pyplot().close(fig)


@pytest.mark.parametrize(
    "ratio, words",
    [
        (1.04, "stays within 5% of its L_train ppl"),
        (0.96, "stays within 5% of its L_train ppl"),
        (1.103, "rises least, 10% above its L_train ppl"),  # ALiBi in the classic study: it read "within 20%"
        (0.899, "falls to 0.90x its L_train ppl"),  # FoX 31.84 -> 28.62: not "within 20%"
        (1.3, "rises least, 30% above its L_train ppl"),
        (1.72, "rises least, to 1.7x its L_train ppl"),
    ],
)
def test_a_titles_growth_words_say_which_way_the_row_went(ratio, words):
    assert figures.takeaways.growth(ratio, "ppl") == words


def error_bars(ax) -> dict[str, list[tuple[float, float]]]:
    """Each legend entry's +- std bars in ``ax``: (lowest, highest) value of each bar."""
    bars = {}
    for container in ax.containers:
        segments = container.lines[2][0].get_segments()
        bars[container.get_label()] = [(float(s[:, 1].min()), float(s[:, 1].max())) for s in segments]
    return bars


def test_no_std_bar_reaches_past_the_values_its_metric_can_take(tmp_path):
    """A mean +- std bar stops at the metric's range: an accuracy at 100% (96.7 +- 5.8 at L_train), a perplexity
    at 1 (2.0 +- 1.4); inside its range it is the std."""
    for seed, (at_train_len, at_twice) in enumerate(((1.0, 0.9), (1.0, 0.1), (0.9, 0.5))):
        write_probe_run(tmp_path / "probe" / str(seed), "rope", seed, {32: at_train_len, 64: at_twice})
    fig = figures.lengths.accuracy_vs_length(summary_of(tmp_path / "probe"))
    exact = next(ax for ax in fig.axes if "exact" in ax.get_title())
    at_train_len, at_twice = error_bars(exact)["rope"]
    assert at_train_len == pytest.approx((100 * (2.9 / 3) - 100 * pd.Series([1.0, 1.0, 0.9]).std(), 100.0))
    assert at_twice == pytest.approx((10.0, 90.0))
    for seed, ppl in enumerate((3.0, 1.01)):
        write_run(tmp_path / "ppl" / str(seed), "rope", seed, {64: 1.2, 128: ppl})
    fig = figures.lengths.ppl_vs_length(summary_of(tmp_path / "ppl"))
    at_train_len, at_128 = error_bars(fig.axes[0])["rope"]
    assert at_train_len == pytest.approx((1.2, 1.2))
    assert at_128 == pytest.approx((1.0, 2.005 + pd.Series([3.0, 1.01]).std()))
    bars = figures.drawing.bounded_error([0.98, 0.5], [0.1, 0.1], (0.0, 1.0))
    assert bars.ravel().tolist() == pytest.approx([0.1, 0.1, 0.02, 0.1])  # (lower, upper) lengths


def test_a_row_with_fewer_seeds_at_some_lengths_says_so_in_its_legend(tmp_path):
    """A row whose seeds did not all reach every length: its legend entry gives the range of seeds (the figure said
    "over 2 seeds" of a point that had one, where the table said 1-2)."""
    from lenext.report import Summary, load

    write_run(tmp_path / "0", "alibi", 0, {64: 20.0, 128: 19.0})
    write_run(tmp_path / "1", "alibi", 1, {64: 21.0})  # seed 1 has no row at 128
    for seed in range(2):
        write_run(tmp_path / f"rope{seed}", "rope", seed, {64: 21.0 + seed, 128: 40.0 + seed})
    fig = figures.FIGURES["ppl_vs_length.png"](Summary(load([str(tmp_path)])))
    names = {row_of(name): name for _, name, _, _ in drawn_lines(fig)}
    assert names == {"alibi": "alibi [1-2 seeds]", "rope": "rope"}
    assert "mean ± std over 2 seeds (other counts in [ ])" in " ".join(fig._suptitle.get_text().split())


def test_a_per_position_titles_rise_is_from_the_token_weighted_loss_over_positions_l_train_half_to_l_train():
    """One bin at L_train holds few tokens: the rise is measured from the bins ending in L_train's upper half
    (token-weighted), not from the last of them alone, nor from the early positions with little context."""
    bins = [(0, 16, 9.0, 100), (16, 32, 5.0, 100), (32, 48, 4.0, 300), (48, 64, 3.0, 100), (64, 128, 4.5, 800)]
    curve = pd.DataFrame(bins, columns=["bin_start", "bin_end", "mean_nll", "tokens"])
    title = figures.positions.positions_takeaway({"alibi": curve}, 64)
    # 4.5 - (4.0 x 300 + 3.0 x 100) / 400; the last bin alone would give +1.50, every bin below L_train -0.33
    assert title == "last bin (to position 128): alibi 4.50 nats (+0.75 from positions 32-63)"


def test_a_per_position_title_names_the_positions_of_the_report_s_own_bins_it_averages():
    """``log_bins``' edges do not fall at L_train / 2: the bin straddling it is used and named."""
    from lenext.report import log_bins

    bins = [b for b in log_bins(512) if b[1] <= 128] + [(128, 512)]
    rows = [(a, b, 4.0 if a >= 128 else 2.0 + (a >= 64), 10 * (b - a)) for a, b in bins]
    curve = pd.DataFrame(rows, columns=["bin_start", "bin_end", "mean_nll", "tokens"])
    used = [(a, b, nll, tokens) for a, b, nll, tokens in rows[:-1] if b > 64]
    rise = 4.0 - sum(nll * tokens for *_, nll, tokens in used) / sum(tokens for *_, tokens in used)
    span = f"{used[0][0]}-{used[-1][1] - 1}"
    assert used[0][0] < 64 and used[-1][1] <= 128  # a bin straddling L_train / 2 is used
    title = figures.positions.positions_takeaway({"rope": curve}, 128)
    assert title == f"last bin (to position 512): rope 4.00 nats ({rise:+.2f} from positions {span})"


def test_a_near_constant_axis_is_kept_at_or_above_the_least_value_its_quantity_takes():
    """Passkey answers at perplexity 1.00 drew an axis from 0.98, a perplexity no model can have."""
    fig, (flat, floored, share) = figures.pyplot().subplots(1, 3)
    figures.drawing.value_axis(flat, 1.0, 1.0)
    figures.drawing.value_axis(floored, 1.0, 1.0, bounds=(1.0, np.inf))
    figures.drawing.value_axis(share, 1.0, 1.0, log=False, bounds=(0.0, 1.0))  # a sink mass of 1: not above it
    assert flat.get_ylim() == pytest.approx((0.98, 1.02)) and floored.get_ylim() == pytest.approx((1.0, 1.04))
    assert share.get_ylim() == pytest.approx((0.96, 1.0))
    figures.pyplot().close(fig)


def test_a_point_of_an_adaptation_curve_pooling_fewer_seeds_is_named_in_its_legend(tmp_path):
    """Step 0 logged by one seed of three (runs made before it was logged beside later ones): its mean is that
    seed's, and the legend says so; a curve whose every point pools all its seeds adds nothing."""
    from tests.test_report import second_stage

    for seed in range(3):
        for job, pe in enumerate(("rope", "alibi"), start=2 * seed):  # the sweep's order: rope first
            folder = tmp_path / str(job)
            write_run(folder, pe, seed, {64: 5.0, 256: 4.0}, train_len=256, meta=second_stage(pe, "direct"))
            (folder / "csv").mkdir()
            before = "-1,9.0\n" if seed == 2 and pe == "rope" else ""  # rope: step 0 of its last seed alone
            curve = "49,3.0\n99,2.0\n" if pe == "rope" else "49,4.0\n99,2.5\n"
            (folder / "csv" / "metrics.csv").write_text(f"step,val/ppl\n{before}{curve}")
    summary = summary_of(tmp_path)
    rope = summary.adaptation[summary.adaptation.row == "rope -> direct@256"]
    assert list(rope.step) == [0, 50, 99] and list(rope.seeds) == [1, 3, 3]  # drawn in order of steps
    assert list(summary.adaptation.row.unique()) == ["rope -> direct@256", "alibi -> direct@256"]
    fig = figures.extension.adaptation(summary)
    names = {row_of(entry): entry for _, entry, *_ in drawn_lines(fig)}
    # The title compares the curves where all have a value: not rope's step 0 against alibi's step 50.
    (title,) = [" ".join(ax.get_title().split()) for ax in fig.axes if ax.get_title()]
    assert title.endswith(
        "rope -> direct@256 lowest at step 50 (3.00), alibi -> direct@256 highest (4.00); 0.50 apart at step 99"
    )
    assert names == {
        "rope -> direct@256": "rope -> direct@256 [1 seed at step 0]",
        "alibi -> direct@256": "alibi -> direct@256",
    }


def test_rows_of_one_pe_under_other_settings_share_its_colour_and_are_told_apart_by_line_and_marker():
    """Runs of one PE with other settings (``rope [trainer.precision=...]``) in one panel: the PE's colour for each
    (a suffixed label had its colour from a hash: another PE's, found by an audit), a line style and marker each,
    so the legend tells them apart (they were drawn alike); a second stage stays dashed."""
    from lenext.report.figures.style import PALETTE, line_styles, pe_style

    labels = ["rope [p=32]", "rope [p=bf16]", "alibi [p=32]", "alibi [p=bf16]", "rope [p=32] -> pi@128"]
    info = pd.DataFrame(
        {
            "base": [None, None, None, None, "rope [p=32]"],
            "extension_method": ["none", "none", "none", "none", "pi"],
            "pe": ["rope", "rope", "alibi", "alibi", "rope"],
        },
        index=labels,
    )
    styles = line_styles(info, labels, by_method=False)
    assert styles["rope [p=32]"]["color"] == styles["rope [p=bf16]"]["color"] == pe_style("rope")[0]
    assert styles["alibi [p=32]"]["color"] == styles["alibi [p=bf16]"]["color"] == pe_style("alibi")[0]
    assert pe_style("rope")[0] != pe_style("alibi")[0] and pe_style("rope")[0] in PALETTE
    drawn = {label: (s["color"], s["marker"], str(s["ls"])) for label, s in styles.items() if label != labels[-1]}
    assert len(set(drawn.values())) == 4 and styles["rope [p=32]"]["ls"] == styles["alibi [p=32]"]["ls"] == "-"
    assert styles[labels[-1]]["ls"] == "--"
    # The committed first study with its fp32 copy: each row of a PE keyed by the PE, its variants' too
    from lenext.report.load import load
    from lenext.report.stats import Summary
    from tests.conftest import ROOT

    info = figures.style.row_info(Summary(load([str(ROOT / "studies" / "classic")])))
    assert (
        info.pe["rope [trainer.precision=32-true]"] == info.pe["rope [trainer.precision=bf16-mixed] (yarn)"] == "rope"
    )
    assert info.pe["t5 [trainer.precision=32-true]"] == "t5"


def test_apart_from_chance_is_an_exact_binomial_test_at_5_percent():
    """The titles' "none apart from chance": a row is apart where the exact two-sided binomial p-value of its count
    (the sum of the probabilities of every count no more likely, computed here in exact fractions) is below 5%. The
    normal approximation it used called 0 right of 60 at chance 1/16 apart (p = 0.053)."""
    from fractions import Fraction
    from math import comb
    from types import SimpleNamespace

    def exact_p(successes: int, trials: int, p: Fraction) -> Fraction:
        pmf = [comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(trials + 1)]
        return sum(q for q in pmf if q <= pmf[successes])

    for trials, chance in ((60, Fraction(1, 16)), (96, Fraction(1, 100)), (13, Fraction(1, 13)), (40, Fraction(1, 4))):
        labels = [f"{k} of {trials}" for k in range(trials + 1)]
        cells = {label: pd.Series({"mean": k / trials, "answers": trials}) for k, label in enumerate(labels)}
        table = SimpleNamespace(chance=(float(chance),), cell=lambda label, length: cells[label])  # noqa: B023
        apart = figures.takeaways.apart_from_chance(table, labels, 64)
        assert apart == [label for k, label in enumerate(labels) if exact_p(k, trials, chance) < Fraction(1, 20)]
        assert "0 of 60" not in apart and "0 of 96" not in apart


def test_the_extension_figure_keeps_what_its_tables_say_of_ranking_and_chance(tmp_path, monkeypatch):
    """extension.png draws each table's fine-tuned rows alone: a table whose rows cannot be ranked (measured on
    different text) names no best there either."""
    summary = summary_of(extension_runs(tmp_path / "runs"))
    why = "rows measured on different text (another corpus, tokenizer or split)"
    for key, table in summary.tables.items():
        summary.tables[key] = replace(table, unranked=why, chance=(0.5,))
    drawn = []
    monkeypatch.setattr(figures.extension, "draw_lengths", lambda summary, tables, **_: drawn.extend(tables))
    figures.extension.extension(summary)
    assert drawn and all(table.unranked == why and table.chance == (0.5,) for table in drawn)
    # the title then gives the values, not a best's growth (which the same table ranked would name)
    takeaways = [figures.takeaways.lengths_takeaway(table, list(table.index)) for table in drawn]
    ranked = [figures.takeaways.lengths_takeaway(replace(table, unranked=""), list(table.index)) for table in drawn]
    assert any(said != would for said, would in zip(takeaways, ranked, strict=True))
