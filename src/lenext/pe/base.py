"""The positional-encoding interface (docs/pes/index.md, "The PE interface").

Every site receives ``positions``: (B or 1, L) strictly increasing integer positions of the tokens,
0..L-1 unless training draws others (randomized positions, PoSE: ``lenext.positions``).

A PE has one model-level site, ``embed(x, positions)``: added to the token embeddings (sinusoidal,
learned). Inside attention layer ``l`` the decoder uses ``pe.layer(l)``, a ``LayerPE`` the block owns
(so are its parameters: FoX's gate is a block's), with two sites:

- ``rotate(q, k, positions)``: a transform of queries and keys (RoPE, its scalings, xPos);
- ``terms(x, q, k, positions)``: the layer's ``ScoreTerms``: score biases, each in the forms it
  has (``Bias``: of the key alone, a band, any pair, a FlexAttention score_mod), a value term, or
  logits the PE computes itself. The attention (``lenext.attention``) picks its path from the
  forms present and owns every mask.

A PE whose parameters are shared across layers (ALiBi, T5, Shaw's per-layer tables in one module)
implements the forms below with a ``layer`` argument, and its ``layer(l)`` is a ``SharedLayer`` view
that gathers them into terms:

- ``key_bias``: a bias of the key alone, up to a per-row constant (ALiBi);
- ``band_bias``: a bias that is constant along each row beyond W keys back (T5, Shaw);
- ``pair_bias``: any bias(i, j) of the two positions (KERPLE, FIRE);
- ``score_mod``: one of the biases above as a FlexAttention score_mod, for CUDA (never alone:
  elsewhere the attention runs the other form);
- ``value_term``: a term added to the values per (query, key) pair, as a band (``BandValues``: Shaw's a^V);
- ``logits(q, k, positions)``: the logits themselves, for a PE whose logit is not one product of the
  rotated q and k (Self-Extend: two rotations merged per pair); ``rotate`` then leaves q and k as they are.

The decoder calls every site for every PE and never looks at which PE it holds.
"""

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lenext.errors import ConfigError

# The PE families of the report's figures, in the order of their panels.
FAMILIES = ("no PE or absolute", "additive bias", "rotary", "2024-26 methods")
# Floats of a PE's MLP activations per chunk of query rows, by device, for the reasons of attention's score blocks
# (lenext.attention.SCORE_BLOCK_ELEMENTS: the CPU's heap, CUDA's kernel launches)
HIDDEN_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}


# The widths of keys the query blocks' products take per length where oneDNN computes them (bf16 on a CPU: the explicit
# attention path, DAPE's MLP, Self-Extend's logits): it builds and keeps a primitive for each new shape, GBs at 16k
# tokens when every block had a width of its own (docs/performance.md, "Precision by machine").
KEY_WIDTHS = 16


def kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype products of x run in: the autocast dtype of its device, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def widened_end(first: int, end: int, length: int, x: torch.Tensor) -> int:
    """The end of keys [first, end) widened to a multiple of length / ``KEY_WIDTHS`` keys, at most ``length``, where
    products of x (the block's queries or logits) are bf16 on a CPU; else ``end``. Keys end.. are future keys of
    every query the block holds, which its caller drops from the products. Only a block that sees keys from the
    first (``first`` 0) is widened: a window's later blocks all see rows + W - 1 keys. Elsewhere the padding costs
    time and saves nothing (measured: docs/performance.md)."""
    if first > 0 or x.device.type != "cpu" or kernel_dtype(x) != torch.bfloat16:
        return end
    granule = -(-length // KEY_WIDTHS)
    return min(length, -(-end // granule) * granule)


def widened(t: torch.Tensor, end: int, last: int) -> torch.Tensor:
    """t (..., keys up to ``end``) with zeros on the keys end..``last`` (``widened_end``); t itself if none."""
    return t if last == end else F.pad(t, (0, last - end))


def keys_product(queries: torch.Tensor, keys: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """queries (..., rows, d) @ keys[..., first:end, :]^T (..., L, d): (..., rows, end - first), taken over the
    widened keys (``widened_end``) and cut back."""
    last = widened_end(first, end, keys.size(-2), queries)
    product = queries @ keys[..., first:last, :].transpose(-2, -1)
    # not a view where nothing was widened: an in-place op on a view (the caller's mul_) costs a copy in the backward
    return product if last == end else product[..., : end - first]


def values_product(weights: torch.Tensor, values: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """weights (..., rows, end - first) @ values[..., first:end, :] (..., L, d_v): (..., rows, d_v), taken over the
    widened keys (``widened_end``), the weights 0 on those added."""
    last = widened_end(first, end, values.size(-2), weights)
    return widened(weights, end, last) @ values[..., first:last, :]


def device_budget(budgets: dict[str, int], device: torch.device) -> int:
    """A per-device budget of elements (``HIDDEN_ELEMENTS``, attention's score blocks, the loss's logits) for
    ``device``: the CPU's on any device the table does not name."""
    return budgets.get(device.type, budgets["cpu"])


PairBias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Logits = Callable[[int, int], torch.Tensor]
KeyBias = Callable[[int, int], torch.Tensor]
LogitTerm = Callable[[torch.Tensor, int, int, int], torch.Tensor]
ScoreMod = Callable


@dataclass(frozen=True)
class Bias:
    """One score bias(i, j) in every form its PE can give (at least one); the attention uses one of them.

    - ``key(first, end)``: (B or 1, H, 1, end - first) fp32 bias of keys [first, end), for a bias(i, j) =
      key[j] + c_i (c_i: any per-row constant, which softmax ignores); it may carry a gradient (FoX).
    - ``band()``: (B or 1, H, L, W), ``PositionalEncoding.band_bias``'s form.
    - ``pair(start, end, first)``: (B or 1, H, end - start, end - first) fp32 bias of query rows [start, end)
      against keys [first, end), for j <= i (values at j > i must be finite; the attention masks them).
    - ``flex()``: a FlexAttention score_mod adding the bias (CUDA), or None where it has none for these positions;
      without it, flex takes the key or band form as one.
    - ``gates()``: (B, L, H) fp32 log gates g, for a bias(i, j) = sum_{t = j+1..i} g_t (FoX's forget gates):
      fla's forgetting-attention kernel while training on CUDA (``lenext.attention.fla_kernels``).
    Forms that cost work are functions, called only by the path that uses them.
    """

    key: KeyBias | None = None
    band: Callable[[], torch.Tensor] | None = None
    pair: Callable[[int, int, int], torch.Tensor] | None = None
    flex: Callable[[], ScoreMod] | None = None
    gates: Callable[[], torch.Tensor] | None = None


@dataclass(frozen=True)
class BandValues:
    """A value term: query i sees key j's value plus ``far`` + ``band[..., i, w]`` for the W keys j = i - W + 1 + w of
    its band (the layout of ``Bias.band``), plus ``far`` alone for every key farther back (Shaw's a^V).

    - ``far``: (d_head,);
    - ``band``: (B or 1, 1 or H, L, W, d_head), what each band key adds beyond ``far`` (0 where it adds nothing more).
    The attention weights of a row sum to 1, so the term adds ``far`` + sum_w p_iw band[..., i, w] to its output:
    only the band's weights are needed, which every fused path has (``lenext.attention``).
    """

    far: torch.Tensor
    band: torch.Tensor

    def output(self, band_weights: torch.Tensor, rows: slice) -> torch.Tensor:
        """(B, H, R, d_head) in the band's dtype: the term's output for query ``rows``, from their weights on the band
        (B, H, R, W)."""
        band = self.band[..., rows, :, :]
        return self.far.to(band.dtype) + (band_weights.to(band.dtype)[..., None, :] @ band)[..., 0, :]

    def widened(self, width: int) -> "BandValues":
        """The same term over a band of ``width`` >= W keys: the keys added (the farthest) gain ``far`` alone."""
        return BandValues(self.far, F.pad(self.band, (0, 0, width - self.band.size(-2), 0)))

    def __add__(self, other: "BandValues") -> "BandValues":
        """Both terms, over the wider band."""
        width = max(self.band.size(-2), other.band.size(-2))
        return BandValues(self.far + other.far, self.widened(width).band + other.widened(width).band)


@dataclass(frozen=True)
class ScoreTerms:
    """What a layer's PE adds to its attention scores: biases (summed), a value term, its own logits, and terms of
    the logits themselves.

    A logit term ``(logits, start, end, first) -> (B, H, end - start, end - first)`` is added to the logits of query
    rows [start, end) against keys [first, end), computed from them as the softmax would see them (every bias
    and mask in, -inf on keys a row does not see): CoPE's contextual positions.
    ``householders()``: PaTH's w (B, H, L, d) unit vectors and beta (B, H, L), fp32, of which its ``logits`` are
    made: fla's PaTH kernel while training on CUDA (``lenext.attention.fla_kernels``).
    ``contextual()``: CoPE's per-position scores q_i . e[p] (B, H, L, P), which its logit term interpolates at the
    positions its gates count (capped at P - 1): lenext's CoPE kernel on CUDA (``lenext.attention.contextual``).
    """

    biases: tuple[Bias, ...] = ()
    value: BandValues | None = None
    logits: Logits | None = None
    logit_terms: tuple[LogitTerm, ...] = ()
    householders: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    contextual: Callable[[], torch.Tensor] | None = None

    def __add__(self, other: "ScoreTerms") -> "ScoreTerms":
        """Both PEs' terms: biases summed, value terms added; one PE at most computes the logits."""
        if self.logits is not None and other.logits is not None:
            raise ConfigError("two PEs that each compute the attention logits themselves cannot be combined")
        value = other.value if self.value is None else self.value if other.value is None else self.value + other.value
        logit_terms = self.logit_terms + other.logit_terms
        householders = self.householders or other.householders
        contextual = self.contextual or other.contextual
        return ScoreTerms(
            self.biases + other.biases, value, self.logits or other.logits, logit_terms, householders, contextual
        )


NO_TERMS = ScoreTerms()


@dataclass(frozen=True)
class AttentionShape:
    """What a PE needs to know about the model it is plugged into."""

    d_model: int
    n_heads: int
    n_layers: int
    train_len: int  # L_train: T5's default max_distance, FIRE's initial threshold
    max_position: int | None = None  # positions training reaches (randomized, PoSE); None: L_train

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def trained_positions(self) -> int:
        """Positions 0..trained_positions-1 occur in training: the learned APE's default table size."""
        return self.max_position or self.train_len


# The forward the decoder is running (``forward_reads``): its positions and the values its PEs read from tensors
# once in it, by key (the positions' span under SPAN); both None outside one. One forward at a time per process:
# lenext runs no forwards in threads.
_forward_positions: torch.Tensor | None = None
_forward_reads: dict[str, object] | None = None
SPAN = "span"


@contextmanager
def forward_reads(positions: torch.Tensor, reads: dict[str, object]) -> Iterator[None]:
    """Inside the ``with``, ``read_once_a_forward`` of ``positions`` takes a value from ``reads`` when it holds the
    key, else reads it and keeps it there for the rest of the forward (and a block the backward recomputes)."""
    global _forward_positions, _forward_reads
    previous = _forward_positions, _forward_reads
    _forward_positions, _forward_reads = positions, reads
    try:
        yield
    finally:
        _forward_positions, _forward_reads = previous


def read_once_a_forward(positions: torch.Tensor, key: str, read: Callable[[], object]) -> object:
    """``read()``, a value read from tensors (on a GPU a wait for every kernel queued before it), once a forward of
    the decoder at ``positions``: the first layer that asks reads it, the others take it. Of other positions
    (Self-Extend's grouped ones) or outside a forward, each call reads. While torch.compile traces a block, the value
    the decoder read before its blocks, whatever the positions (a read breaks the graph; a block reads only of its
    forward's)."""
    if torch.compiler.is_compiling() and _forward_reads is not None and key in _forward_reads:
        return _forward_reads[key]
    if positions is not _forward_positions:
        return read()
    if key not in _forward_reads:
        _forward_reads[key] = read()
    return _forward_reads[key]


def position_span(positions: torch.Tensor) -> int:
    """1 + the largest of ``positions`` (B or 1, L): the positions a PE's tables must cover, read once a forward."""
    return read_once_a_forward(positions, SPAN, lambda: int(positions.max()) + 1)


def sequential_positions(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1, L): positions 0..L-1, what every sequence gets unless training draws others."""
    return torch.arange(length, device=device)[None]


class PositionalEncoding(nn.Module):
    """Base class, and on its own the NoPE control: the causal mask is the only positional signal."""

    # How reports name the PE (its class name unless it says otherwise) and which figure panel it shares (one of
    # ``FAMILIES``: every PE declares its own, tests/test_configs.py checks).
    DISPLAY_NAME: str = "PositionalEncoding"
    FAMILY: str | None = None

    # The settings a second stage (context extension, ``init_from``) may change; it keeps the base's others.
    STAGE_SETTINGS: tuple[str, ...] = ()
    # Constructor arguments the model passes, not settings of a config.
    BUILT_WITH = ("shape",)
    # The evaluation-time variants it can be evaluated under (eval.variants: RoPE's scalings).
    VARIANTS: tuple[str, ...] = ()
    # Whether a score term reads q and k themselves (at the head's width), not only their positions.
    reads_qk: bool = False
    # Whether ``rotate`` returns q and k wider than it takes them (PoPE's real and imaginary channels).
    widens_qk: bool = False
    # Whether its layers compute the attention logits themselves (PaTH, RoPE's Self-Extend): one PE of a layer at most.
    computes_logits: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "DISPLAY_NAME" not in cls.__dict__:
            cls.DISPLAY_NAME = cls.__name__

    def __init__(self, shape: AttentionShape):
        super().__init__()
        self.shape = shape
        # Empty, so free: it follows the module's dtype (``.double()``) for a PE without parameters (``bias_dtype``).
        self.register_buffer("_dtype", torch.empty(0), persistent=False)

    @property
    def bias_dtype(self) -> torch.dtype:
        """The dtype a score bias is computed in: fp32 (under bf16 too), float64 in a float64 model (the oracles')."""
        return torch.float64 if self._dtype.dtype == torch.float64 else torch.float32

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) token embeddings -> same shape with position information."""
        return x

    def read_before_blocks(self, positions: torch.Tensor) -> None:
        """Make the reads of tensor values this PE's layers make once a forward (``read_once_a_forward``; the span
        aside, which the decoder reads): the decoder calls it before blocks that must not read (compiled ones: a read
        breaks the graph)."""

    def layer(self, index: int) -> "LayerPE":
        """The PE inside attention layer ``index``; the block holding it owns its parameters. By default a view
        of this PE's forms at that layer (its parameters stay here, shared or indexed by layer)."""
        return SharedLayer(self, index)

    @property
    def embeds(self) -> bool:
        """Whether the PE adds to the token embeddings (then it cannot be one layer's PE of a mix)."""
        return type(self).embed is not PositionalEncoding.embed

    @property
    def rotates(self) -> bool:
        """Whether the PE transforms q and k (then it expects them at the head's width)."""
        return type(self).rotate is not PositionalEncoding.rotate

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, L, d_head) -> rotated q, k."""
        return q, k

    def key_bias(self, positions: torch.Tensor, layer: int) -> torch.Tensor | None:
        """(B or 1, H, 1, K) fp32 bias of each key j, for a bias(i, j) = key_bias[j] + c_i (c_i: any per-row
        constant, which softmax ignores), over the keys ``positions`` (B or 1, K) holds."""
        return None

    def band_bias(self, q: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor | None:
        """The bias as a band, for PEs whose bias is constant along each row beyond W keys back.

        q: (B, H, L, d_head) and their positions (B or 1, L). Returns (B or 1, H, L, W): entry w
        of row i is bias(i, j) - bias(i, far) for the key j = i - W + 1 + w (w = W - 1 is the
        diagonal; entries of keys before 0 are ignored), where bias(i, far) is the row's value at
        every key W or more indices back. Softmax ignores a per-row constant, so the band alone is
        the exact bias, and attention can score it without (L, L) work.
        """
        return None

    def pair_bias(self, layer: int) -> PairBias | None:
        """The general form: ``(query_positions (B or 1, R), key_positions (B or 1, K)) -> (B or 1, H, R, K)``
        fp32 bias(i, j), used for j <= i only (values at j > i must be finite; the attention masks them)."""
        return None

    def score_mod(self, q: torch.Tensor, positions: torch.Tensor, layer: int) -> Callable | None:
        """The whole score bias as a FlexAttention score_mod ``(score, b, h, q_idx, kv_idx) -> score + bias``.

        q: (B, H, L, d_head), positions (B or 1, L) (index them with b only when B > 1). Flex
        applies the causal mask after it, so it may return anything (in bounds) for kv_idx > q_idx. None: no
        score_mod for these positions (FIRE past its threshold), the attention takes another path.
        """
        return None

    def value_term(self, positions: torch.Tensor, layer: int) -> BandValues | None:
        """A term added to key j's value for query i (Shaw's a^V), constant beyond W keys back: ``BandValues``."""
        return None

    def logits(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> Logits | None:
        """``(start, end) -> (B, H, end - start, end)`` fp32 scaled logits q.k / sqrt(d_head) of query rows
        [start, end) against keys [0, end) (the attention masks future keys and adds any score bias), for a PE
        that computes them itself; q, k: (B, H, L, d_head) as ``rotate`` returned them."""
        return None

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        """The evaluation-time variants a sweep evaluates when ``asked`` for these (eval.variants:
        RoPE's scalings), for positions spanning at most ``longest``: only those that differ from the PE as
        trained there, which comes first. [None], the PE as trained, for a PE that has none (a sweep over
        PEs asks every PE for the same variants)."""
        return [None]

    @contextmanager
    def variant(self, name: str | None) -> Iterator[None]:
        """Inside the block the PE is the named variant (switched in place, restored after)."""
        yield

    def rotary_frequencies(self, length: int) -> torch.Tensor | None:
        """The inverse frequencies (n,) float64 the PE rotates q and k by, for positions spanning ``length`` (its
        scaling's there); None for a PE that rotates by none (the diagnostics' rotation coverage)."""
        return None

    def scaling_factor(self, length: int) -> float | None:
        """The factor by which the PE rescales positions for a sequence whose positions span ``length``, if it does."""
        return None

    def project_(self) -> None:
        """Bring learned parameters back into their domain, after every optimizer step (a projection:
        KERPLE's r1, r2 >= 0.01). Nothing for most PEs."""

    @classmethod
    def evaluated_with(cls, trained: dict, changes: dict) -> dict:
        """The PE node a checkpoint was ``trained`` with (resolved), under eval.py's ``changes`` (``pe.<key>=``):
        each must be a setting of this PE; a PE whose settings imply others says so by overriding this."""
        for key in changes:
            if key not in trained:
                raise ConfigError(f"pe.{key} does not apply to this checkpoint's PE ({trained['_target_']})")
        return {**trained, **changes}

    @property
    def position_limit(self) -> int | None:
        """The most positions it serves (beyond, its forward raises ``LengthNotSupported``); None: any. An export
        keeps it, so that the exported model refuses the same lengths."""
        return None

    def describe(self) -> dict:
        """What identifies this PE in results files and the run's first log line: its class and settings."""
        return {"name": type(self).__name__, **self.hyperparameters()}

    def hyperparameters(self) -> dict:
        """The constructor's settings as this PE resolved them (each default derived from the model or L_train
        replaced by its value): the same PE class built from them at another training length means the same
        thing, so a checkpoint trained further (``init_from``) keeps T5's max_distance, FIRE's threshold,
        learned's table size, RoPE's original context. Every PE keeps each setting as the attribute of its name."""
        names = [n for n in inspect.signature(type(self).__init__).parameters if n not in ("self", "shape")]
        return {name: getattr(self, name) for name in names}


class LayerPE(nn.Module):
    """A PE inside one attention layer: what the attention asks of it. Alone, no positional term."""

    window: int | None = None  # this layer's attention window, when its PE sets one (a per-layer mix)
    # Whether some bias of it is given only up to a per-row constant (key and band forms): exact for softmax,
    # which ignores the constant, not for stick-breaking nor for a term computed from the logits.
    up_to_row_constant: bool = False
    # Whether a logit term of it reads the logits' values (CoPE's gates, DAPE's MLP), not only their order.
    reads_logits: bool = False
    # Whether its terms keep their meaning when attention multiplies each row's logits (SSMax, log-length).
    takes_row_scale: bool = True

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: (B, H, L, d_head) -> transformed q, k."""
        return q, k

    def terms(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> ScoreTerms:
        """The layer's score terms, from its input x (B, L, d_model), its q, k (B, H, L, d_head) as ``rotate``
        returned them and the positions (B or 1, L)."""
        return NO_TERMS


class SharedLayer(LayerPE):
    """Layer ``index`` of a PE that implements the forms of ``PositionalEncoding`` (module docstring): a form is
    present when the PE's class overrides it."""

    def __init__(self, pe: PositionalEncoding, index: int):
        super().__init__()
        self.pe, self.index = [pe], index  # in a list: the decoder owns the PE's parameters, blocks only use it
        overridden = {form for form in ("key_bias", "band_bias") if self._has(form)}
        self.up_to_row_constant = bool(overridden) and pe.pair_bias(index) is None

    def _has(self, form: str) -> bool:
        return getattr(type(self.pe[0]), form) is not getattr(PositionalEncoding, form)

    def rotate(self, q, k, positions):
        return self.pe[0].rotate(q, k, positions)

    def terms(self, x, q, k, positions) -> ScoreTerms:
        pe, layer, has = self.pe[0], self.index, self._has
        pair = pe.pair_bias(layer)
        bias = Bias(
            key=(lambda first, end: pe.key_bias(positions[:, first:end], layer)) if has("key_bias") else None,
            band=(lambda: pe.band_bias(q, positions, layer)) if has("band_bias") else None,
            pair=(lambda start, end, first: pair(positions[:, start:end], positions[:, first:end])) if pair else None,
            flex=(lambda: pe.score_mod(q, positions, layer)) if has("score_mod") else None,
        )
        present = any(form is not None for form in (bias.key, bias.band, bias.pair))
        return ScoreTerms((bias,) if present else (), pe.value_term(positions, layer), pe.logits(q, k, positions))


class NoPE(PositionalEncoding):
    """No positional encoding (Kazemnejad et al. 2023): the control row of every study."""

    FAMILY = "no PE or absolute"


def position_differences(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """(B or 1, R, K): i - j for query positions (B or 1, R) and key positions (B or 1, K)."""
    return query_positions[..., :, None] - key_positions[..., None, :]


def distance_score_mod(table: torch.Tensor, positions: torch.Tensor, batch: int) -> Callable:
    """A score_mod adding ``table`` (N, H) looked up at |p_i - p_j| (positions (B or 1, L), N above the largest).
    |i - j|, not max(i - j, 0): the masked scores (j > i) of the diagonal blocks then spread their zero gradients
    over the table, instead of flex's backward adding them all atomically at distance 0 (T5 trained 3x slower).
    One table, not copies of it by query index: 16 copies trained slower on a GPU (docs/performance.md)."""
    positions = positions.expand(batch, -1)

    def by_distance(score, b, h, q_idx, kv_idx):
        return score + table[(positions[b, q_idx] - positions[b, kv_idx]).abs(), h]

    return by_distance


def band_distances(positions: torch.Tensor, width: int) -> torch.Tensor:
    """(B or 1, L, W) i - j for each query i and the W keys j = i - W + 1 .. i of its band.

    Keys before the first are given the positions before positions[0] (those of 0..L-1 extended
    backwards), so sequential positions give the same row everywhere; the attention ignores them.
    """
    before = positions[:, :1] - torch.arange(width - 1, 0, -1, device=positions.device)
    keys = torch.cat([before, positions], dim=1).unfold(1, width, 1)  # (B or 1, L, W)
    return positions[..., None] - keys
