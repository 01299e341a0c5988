"""Retrieval from a natural haystack (docs/evaluation.md, "Retrieval in a natural haystack"): RULER's needles
(Hsieh et al. 2024, arXiv 2404.06654) put into held-out corpus text, scored by likelihood so that a base language
model never trained on the task has a score.

A sample of L inputs is L + 1 tokens: haystack text (consecutive tokens of the split's documents, crossing their
boundaries as RULER's essays do) with the task's needles inserted at sentence ends near their depths, then the
query, whose last tokens are the answers. An answer is scored three ways: exact match (every token the model's
most likely one, which is what greedy decoding writes), the NLL of its tokens, and its rank by total
log-likelihood among itself and ``candidates`` distractor answers of the same kind and token count, each put in
its place in a copy of the sample (row c of a sample holds the c-th distractor of every answer). Every sample is
a function of (task, L, index, depth) alone: every run and PE meets the same haystacks.
"""

import math
import string
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lenext.errors import LengthNotSupported
from lenext.hardware import precision_autocast
from lenext.positions import PositionScheme, window_positions
from lenext.scoring import Measured, distributed, mean_metric, sum_metric

HAYSTACK_STREAM = 46  # seeds the samples' draws; no other stream uses it
KEYS = (
    "anchor apple arrow badge barrel basket beacon bridge candle canyon castle cedar cliff comet copper coral "
    "crystal desert dragon engine falcon feather forest fountain garden glacier harbor island jacket jungle "
    "ladder lantern marble meadow mirror mountain needle orchard palace pepper planet pocket river rocket saddle "
    "shadow silver spider summit thunder tiger tower valley violet window winter"
).split()
VALUE_DIGITS = 7  # RULER's numbers
NAME_LETTERS = 5  # RULER's variable names
SENTENCE_ENDS = (".", "!", "?")


@dataclass
class Written:
    """A sample as text: needles at depths in the haystack, then the query: pieces of text and answers."""

    needles: list[tuple[float, str]]  # (depth: the share of the haystack before it, sentence)
    query: list[str | int] = field(default_factory=list)  # text, or the index of an answer in ``answers``
    answers: list[str] = field(default_factory=list)
    kind: str = "value"  # what the answers are: a value (digits) or a name (letters)
    in_text_order: bool = False  # the query's answers come in the order their needles (needle i: answer i) stand
    in_context: list[str] = field(default_factory=list)  # values in the text each answer is also ranked against


DRAWS: dict[str, Callable[[np.random.Generator], str]] = {
    "value": lambda rng: str(rng.integers(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS)),
    "name": lambda rng: "".join(rng.choice(list(string.ascii_uppercase), NAME_LETTERS)),
}
Draw = Callable[[str], str]  # kind ("value" or "name") -> a fresh one, written in the tokenizer's usual token count


def keys(rng: np.random.Generator, n: int) -> list[str]:
    return [str(k) for k in rng.choice(KEYS, n, replace=False)]


def single(rng, depth: float, draw: Draw) -> Written:
    """One needle; the query asks for its value."""
    (key,), answer = keys(rng, 1), draw("value")
    return Written(
        [(depth, f" The special value for {key} is {answer}.")], [f" The special value for {key} is", 0], [answer]
    )


def multikey(rng, depth: float, draw: Draw, distractors: int = 3) -> Written:
    """The needle and ``distractors`` needles of other keys at random depths; the query asks for the first key."""
    key, *others = keys(rng, 1 + distractors)
    answer, distracting = draw("value"), [draw("value") for _ in others]
    needles = [(depth, f" The special value for {key} is {answer}.")]
    needles += [
        (float(rng.random()), f" The special value for {k} is {v}.") for k, v in zip(others, distracting, strict=True)
    ]
    return Written(needles, [f" The special value for {key} is", 0], [answer], in_context=distracting)


def multivalue(rng, depth: float, draw: Draw, values: int = 4) -> Written:
    """One key with ``values`` values, the first at the depth, the others at random ones; the query asks for all,
    in the order the text gives them."""
    (key,) = keys(rng, 1)
    depths = [depth] + [float(d) for d in rng.random(values - 1)]
    answers = [draw("value") for _ in range(values)]
    needles = [(d, f" One of the special values for {key} is {v}.") for d, v in zip(depths, answers, strict=True)]
    query: list[str | int] = [f" The special values for {key} are"]
    for n in range(values):
        query += ([] if n == 0 else [" and" if n == values - 1 else ","]) + [n]
    return Written(needles, query, answers, in_text_order=True)


def multiquery(rng, depth: float, draw: Draw, queries: int = 4) -> Written:
    """``queries`` needles of distinct keys, the first at the depth, the others at random ones; the query asks for
    each key's value in turn, in random order."""
    chosen = keys(rng, queries)
    answers = [draw("value") for _ in chosen]
    depths = [depth] + [float(d) for d in rng.random(queries - 1)]
    needles = [(d, f" The special value for {k} is {v}.") for d, k, v in zip(depths, chosen, answers, strict=True)]
    query: list[str | int] = []
    for i in rng.permutation(queries).tolist():
        query += [f" The special value for {chosen[i]} is", i, "."]
    return Written(needles, query[:-1], answers, in_context=answers)


def variable_tracking(rng, depth: float, draw: Draw, hops: int = 4) -> Written:
    """RULER's variable tracking: ``VAR X1 = v`` at the depth, then ``VAR X(i+1) = VAR Xi`` at later random depths;
    the query asks for every variable holding v, in the order of the chain."""
    names = []
    while len(names) < hops + 1:
        drawn = draw("name")
        names += [drawn] if drawn not in names else []
    held = draw("value")
    depths = [depth] + sorted(float(d) for d in depth + (1 - depth) * rng.random(hops))
    chain = [f" VAR {after} = VAR {before}." for before, after in zip(names, names[1:], strict=False)]
    sentences = [f" VAR {names[0]} = {held}.", *chain]
    query: list[str | int] = [f" The variables assigned the value {held} are"] + list(range(hops + 1))
    return Written(list(zip(depths, sentences, strict=True)), query, names, kind="name")


TASKS: dict[str, Callable[[np.random.Generator, float, Draw], Written]] = {
    "single": single,
    "multikey": multikey,
    "multivalue": multivalue,
    "multiquery": multiquery,
    "variable_tracking": variable_tracking,
}


@dataclass(frozen=True)
class Built:
    """A sample as token rows: (1 + candidates, L + 1) ids, row 0 the true one; each answer's targets."""

    rows: np.ndarray  # row 0 the true sample; then, per answer in order, one row per distractor in its place
    answers: list[range]  # target indices (target t predicts token t + 1) of each answer, in order
    distractor_rows: list[range]  # the rows holding each answer's distractors


class HaystackText:
    """A split's held-out documents as one stream of haystack tokens, and the tokenizer that writes needles."""

    def __init__(self, documents: list[np.ndarray], tokenizer):
        self.documents, self.tokenizer = documents, tokenizer
        self.ends = np.cumsum([len(d) for d in documents])
        pieces = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
        self.ends_sentence = np.array([p.rstrip().endswith(SENTENCE_ENDS) for p in pieces])
        # The token count most values (names) take: every answer and candidate takes it, so a sample's rows are
        # equally long and each answer is ranked against distractors of its own length.
        rng = np.random.default_rng(HAYSTACK_STREAM)
        self.widths = {
            kind: Counter(len(self.encode(" " + draw(rng))) for _ in range(256)).most_common(1)[0][0]
            for kind, draw in DRAWS.items()
        }

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def drawer(self, rng: np.random.Generator) -> Draw:
        """Fresh values and names of ``width`` tokens, drawn from ``rng``."""

        def draw(kind: str) -> str:
            for _ in range(1000):
                text = DRAWS[kind](rng)
                if len(self.encode(" " + text)) == self.widths[kind]:
                    return text
            raise LengthNotSupported(f"the tokenizer writes few {kind}s as {self.widths[kind]} tokens")

        return draw

    def write(self, task: str, rng: np.random.Generator, depth: float) -> Written:
        """A sample of ``task`` as text, its needle at ``depth``."""
        return TASKS[task](rng, depth, self.drawer(rng))

    def tokens(self, start: int, n: int) -> np.ndarray:
        """Tokens start..start + n - 1 of the documents laid end to end."""
        first = int(np.searchsorted(self.ends, start, side="right"))
        out, at = [], start
        for d in range(first, len(self.documents)):
            begin = at - (self.ends[d] - len(self.documents[d]))
            piece = self.documents[d][begin : begin + n - sum(map(len, out))]
            out.append(np.asarray(piece, dtype=np.int64))
            at = self.ends[d]
            if sum(map(len, out)) == n:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def sentence_end_near(self, fill: np.ndarray, at: int) -> int:
        """The token boundary nearest ``at`` that follows a sentence's end (or the haystack's start), within a
        twentieth of the haystack (2 tokens in one shorter than 40); else ``at`` itself."""
        reach = max(2, len(fill) // 20)
        for offset in range(reach + 1):
            for b in (at - offset, at + offset):
                if 0 <= b <= len(fill) and (b == 0 or self.ends_sentence[fill[b - 1]]):
                    return b
        return at

    def candidates(self, rng, kind: str, count: int, first: list[str], taken: set[str]) -> list[list[int]]:
        """``count`` distractor answers of ``kind``: those of ``first`` not in ``taken``, then fresh ones (each
        then taken)."""
        draw, found = self.drawer(rng), [self.encode(" " + text) for text in first if text not in taken][:count]
        while len(found) < count:
            text = draw(kind)
            if text not in taken:
                taken.add(text)
                found.append(self.encode(" " + text))
        return found

    def build(self, written: Written, length: int, rng: np.random.Generator, candidates: int) -> Built:
        needles = [(depth, self.encode(sentence)) for depth, sentence in written.needles]
        answers = [self.encode(" " + a) for a in written.answers]
        fixed = sum(len(ids) for _, ids in needles) + sum(
            len(answers[p]) if isinstance(p, int) else len(self.encode(p)) for p in written.query
        )
        fill_len = length + 1 - fixed
        if fill_len < 0:
            raise LengthNotSupported(f"its needles and query take {fixed} tokens, more than the {length + 1} of L + 1")
        total = int(self.ends[-1])
        if fill_len > total:
            raise LengthNotSupported(f"the split has {total} tokens of haystack, fewer than the {fill_len} it needs")
        fill = self.tokens(int(rng.integers(0, total - fill_len + 1)), fill_len)
        places = [self.sentence_end_near(fill, round(depth * fill_len)) for depth, _ in needles]
        order = sorted(range(len(needles)), key=lambda i: (places[i], i))
        pieces, at = [], 0
        for i in order:
            pieces += [fill[at : places[i]], np.asarray(needles[i][1])]
            at = places[i]
        pieces.append(fill[at:])
        body = np.concatenate(pieces)
        # The answer each slot of the query asks for, in the order the slots come.
        slots = [p for p in written.query if isinstance(p, int)]
        asked = [order[n] for n in range(len(slots))] if written.in_text_order else slots
        tail, spans, position = [], [], len(body)
        for p in written.query:
            ids = answers[asked[len(spans)]] if isinstance(p, int) else self.encode(p)
            if isinstance(p, int):  # answer tokens position..: targets position - 1.. predict them
                spans.append(range(position - 1, position - 1 + len(ids)))
            tail.append(np.asarray(ids, dtype=np.int64))
            position += len(ids)
        true = np.concatenate([body, *tail])
        taken = set(written.answers) | {word.strip(".") for _, s in written.needles for word in s.split()}
        rows, distractor_rows = [true], []
        for slot, span in enumerate(spans):
            others = [v for v in written.in_context if v != written.answers[asked[slot]]]
            distractor_rows.append(range(len(rows), len(rows) + candidates))
            for ids in self.candidates(rng, written.kind, candidates, others, taken - set(others)):
                row = true.copy()
                row[span.start + 1 : span.stop + 1] = ids
                rows.append(row)
        return Built(np.stack(rows), spans, distractor_rows)


def depth_key(depth: float) -> int:
    """A depth as a seed: its value (to 1e-6), not its place in eval.haystack_depths, so that a depth meets the same
    haystacks whatever other depths a run asks for."""
    return round(depth * 1_000_000)


def sample_rng(task: str, length: int, index: int, depth: float) -> np.random.Generator:
    return np.random.default_rng([HAYSTACK_STREAM, list(TASKS).index(task), length, index, depth_key(depth)])


@torch.no_grad()
def measure_haystack(
    net,
    text: HaystackText,
    task: str,
    samples: list[tuple[int, int]],  # (index, depth index) of each sample
    depths: tuple[float, ...],
    length: int,
    candidates: int,
    tokens_per_batch: int,
    precision: str,
    scheme: PositionScheme | None,
    seed: int,
) -> Measured:
    """Exact match, rank accuracy and the answers' NLL over ``samples`` at ``length``, overall and per depth; under
    DDP each rank its share, every metric summed over ranks."""
    device = next(net.parameters()).device

    def metrics() -> dict:
        return {
            **{m: mean_metric().to(device) for m in ("exact_match", "token_accuracy", "rank_accuracy", "mean_nll")},
            **{m: sum_metric().to(device) for m in ("answers", "tokens", "windows")},
        }

    overall, by_depth = metrics(), {d: metrics() for d in range(len(depths))}
    rank, world = distributed()
    autocast = precision_autocast(device, precision)

    def score(group: list[tuple[int, int]], built: list[Built]) -> None:
        ids = torch.from_numpy(np.concatenate([b.rows for b in built])).to(device)  # (rows of all, L + 1)
        keys = [(i, depth_key(depths[d])) for i, d in group]
        drawn = window_positions(scheme or PositionScheme(), length, seed, keys)
        if drawn is not None:  # a sample's rows at its positions
            drawn = drawn.repeat_interleave(torch.tensor([len(b.rows) for b in built]), 0).to(device)
        # Rows are independent sequences: scored tokens_per_batch at a time, at least one row a pass.
        per_pass = max(1, tokens_per_batch // length)
        nll, predicted = [], []
        for first_row in range(0, len(ids), per_pass):
            rows = slice(first_row, first_row + per_pass)
            positions = None if drawn is None else drawn[rows]
            with autocast:
                pass_nll, pass_predicted = net.token_nll(ids[rows, :-1], ids[rows, 1:], positions, predictions=True)
            nll.append(pass_nll.double())
            predicted.append(pass_predicted)
        nll, correct = torch.cat(nll), torch.cat(predicted) == ids[:, 1:]  # (R, L) each
        first = 0
        for (_, d), sample in zip(group, built, strict=True):
            for span, others in zip(sample.answers, sample.distractor_rows, strict=True):
                targets = list(span)
                true = -nll[first, targets].sum()
                distracting = -nll[[first + r for r in others]][:, targets].sum(-1)
                row = {
                    "exact_match": float(correct[first, targets].all()),
                    "token_accuracy": (correct[first, targets].double().mean(), len(targets)),
                    "rank_accuracy": float(bool((true > distracting).all())),  # a tie is not a retrieval
                    "mean_nll": (nll[first, targets].mean(), len(targets)),
                }
                for into in (overall, by_depth[d]):
                    for m, v in row.items():
                        into[m].update(*(v if isinstance(v, tuple) else (v,)))
                    into["answers"].update(1)
                    into["tokens"].update(len(targets))
            for into in (overall, by_depth[d]):
                into["windows"].update(1)
            first += len(sample.rows)

    group, built = [], []
    for i, d in samples[rank::world]:
        rng = sample_rng(task, length, i, depths[d])
        group.append((i, d))
        built.append(text.build(text.write(task, rng, depths[d]), length, rng, candidates))
        if sum(len(b.rows) for b in built) * length >= tokens_per_batch:
            score(group, built)
            group, built = [], []
    if group:
        score(group, built)

    def computed(group: dict) -> dict:
        with warnings.catch_warnings():  # a depth this rank has no sample of: its counts are 0, as they should be
            warnings.filterwarnings("ignore", message=".*called before the ``update`` method")
            counts = {c: int(group[c].compute().item()) for c in ("answers", "tokens", "windows")}
        if not counts["answers"]:
            return {}
        values = {m: float(group[m].compute().item()) for m in ("exact_match", "token_accuracy", "rank_accuracy")}
        mean_nll = float(group["mean_nll"].compute().item())
        return {**values, "chance": 1 / (1 + candidates), "ppl": math.exp(mean_nll), "mean_nll": mean_nll, **counts}

    breakdown = [{"depth": depths[d], **row} for d, group in by_depth.items() if (row := computed(group))]
    return Measured(computed(overall), breakdown=breakdown)
