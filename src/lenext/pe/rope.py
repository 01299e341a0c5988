"""Rotary position embedding (Su et al. 2021) and its length-scaling variants.

Pairing convention: interleaved pairs (x[2t], x[2t+1]) rotated as one complex number, as in
RoFormer; rotation is a complex multiplication (the fastest eager form on CPU).

Scalings (docs/pes/rope.md), with s the factor and C the original context (``original_len``:
transformers' ``original_max_position_embeddings``, litgpt's ``original_max_seq_len``), one function
each in ``ROPE_SCALINGS`` returning (inverse frequencies, attention factor), as transformers'
``ROPE_INIT_FUNCTIONS``:

- ``none``: theta_t = base^(-2t/d).
- ``linear`` (position interpolation, Chen et al. 2023): theta_t / s.
- ``ntk`` (bloc97 2023): base' = base * s^(d/(d-2)).
- ``dynamic_ntk``: for a sequence of length l > C, base' = base * (s*l/C - (s-1))^(d/(d-2)); s defaults to 1.
- ``yarn`` (Peng et al. 2023): a per-dimension ramp between PI and no scaling
  (beta_fast 32, beta_slow 1) and q, k both scaled by 0.1 ln s + 1.
- ``llama3`` (Meta 2024, Llama 3.1): by wavelength lambda_t = 2 pi / theta_t: theta_t / s where
  lambda_t > C / low_freq_factor, theta_t where lambda_t < C / high_freq_factor, and between them
  (1 - g) theta_t / s + g theta_t with g = (C / lambda_t - low_freq_factor) / (high_freq_factor - low_freq_factor).
- ``self_extend`` (Jin et al. 2024, "LLM Maybe LongLM"; datamllab/LongLM): the frequencies unscaled, the
  *positions* grouped. A key fewer than W (``neighbor_window``) positions back is scored at the true
  positions; a farther one with the query at floor(i / G) + W - W / G and the key at floor(j / G), G the
  group size (the factor s): two rotations of q and k, merged per pair before the softmax (``logits``).

p-RoPE (Barbero et al. 2025, "Round and Round We Go!"; ``fraction`` p): only the highest floor(p d / 2)
frequencies rotate, the lowest are 0 (their pairs pass unrotated, NoPE channels), after any scaling, as Gemma's
``rope_proportion`` and transformers' ``proportional`` RoPE. Not GPT-NeoX's ``rotary_pct``, which rotates a
leading share of the dimensions with frequencies recomputed over that share.

The original context C is the span of positions the *first* training stage reached (its training
length; N under randomized positions, the target length under PoSE): ``original_len: null`` resolves
to it, and a second stage (context extension, ``init_from``) keeps the base's. The factor:

- a number: s, fixed, at every length;
- ``null`` in a run trained within C: s = max(1, L / C) for a sequence whose positions span L
  (identity at the training length, the method's own factor beyond it: evaluation-time scaling);
  Self-Extend's G is the smallest whose grouped positions stay below C (1, the identity, within C);
- ``null`` in a run trained beyond C (a second stage at L' > C): resolves to s = L' / C, fixed, the
  factor PI and YaRN fine-tune and evaluate with (Self-Extend's G stays per length).
"""

import dataclasses
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from lenext.errors import ConfigError, LengthNotSupported
from lenext.pe.base import AttentionShape, Logits, PositionalEncoding, keys_product, position_differences, position_span
from lenext.ranges import PositiveFloat, PositiveInt, Range


@dataclass(frozen=True)
class RopeSettings:
    """RoPE's settings at one length, in one object: what a scaling function reads (the head dim, RoPE's base,
    the scaling, its factor s, the length of the sequence (dynamic scalings), the original context C) and the
    methods' own constants, the fields after ``original_len`` (``CONSTANTS``)."""

    dim: int
    base: float
    scaling: str
    factor: float
    length: int
    original_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def unscaled(self, base: float | None = None) -> torch.Tensor:
        """(dim/2,) float64 theta_t = base^(-2t/d), of RoPE's base or another."""
        return (base or self.base) ** -(torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)


def no_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    return s.unscaled(), 1.0


def linear_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    return s.unscaled() / s.factor, 1.0


def ntk_exponent(s: RopeSettings) -> float:
    """d / (d - 2), the power NTK-aware scalings raise the base's growth to; undefined for a head dim of 2."""
    if s.dim <= 2:
        raise LengthNotSupported(
            f"NTK-aware scaling raises its base to d / (d - 2): undefined for a head dim of {s.dim}"
        )
    return s.dim / (s.dim - 2)


def ntk_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    return s.unscaled(s.base * s.factor ** ntk_exponent(s)), 1.0


def dynamic_ntk_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    length = max(s.length, s.original_len)
    return s.unscaled(s.base * (s.factor * length / s.original_len - (s.factor - 1)) ** ntk_exponent(s)), 1.0


def yarn_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    extrapolation = s.unscaled()
    interpolation = extrapolation / s.factor

    def correction_dim(rotations: float) -> float:
        return s.dim * math.log(s.original_len / (rotations * 2 * math.pi)) / (2 * math.log(s.base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), s.dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(s.dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0 -> keep the original frequency (high-frequency dims), 1 -> interpolate.
    inv_freq = extrapolation * (1 - ramp) + interpolation * ramp
    return inv_freq, 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0


def llama3_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    original = s.unscaled()
    in_original = s.original_len * original / (2 * math.pi)  # C / wavelength
    keep = ((in_original - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    return original / s.factor * (1 - keep) + original * keep, 1.0


# The scaling methods' constants: settings of RoPE a second stage may change, as its scaling and factor.
SETTING_NAMES = [f.name for f in dataclasses.fields(RopeSettings)]
CONSTANTS = tuple(SETTING_NAMES[SETTING_NAMES.index("original_len") + 1 :])

ROPE_SCALINGS: dict[str, Callable[[RopeSettings], tuple[torch.Tensor, float]]] = {
    "none": no_scaling,
    "linear": linear_scaling,
    "ntk": ntk_scaling,
    "dynamic_ntk": dynamic_ntk_scaling,
    "yarn": yarn_scaling,
    "llama3": llama3_scaling,
    "self_extend": no_scaling,  # its positions are grouped instead: RoPE.logits
}
SCALINGS = tuple(ROPE_SCALINGS)
# The scalings transformers defines too, with its rope_type: a Hugging Face model's variants, an export's config.
TRANSFORMERS_ROPE_TYPES = {
    "none": "default",
    "linear": "linear",
    "dynamic_ntk": "dynamic",
    "yarn": "yarn",
    "llama3": "llama3",
}
# The keys of each one's rope_parameters beyond rope_type and rope_theta, as transformers' validation asks for them
# (the constants are named as lenext names them; original_max_position_embeddings is C).
TRANSFORMERS_ROPE_KEYS = {
    "none": (),
    "linear": ("factor",),
    "dynamic_ntk": ("factor",),  # its C is the config's max_position_embeddings
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


def transformers_rope_parameters(scaling: str, factor: float, original_len: int, constants=None) -> dict:
    """transformers' rope_parameters, less rope_theta, for ``scaling`` (one it defines) at ``factor`` from the
    context ``original_len``; the scaling's constants from ``constants`` (a RoPE or RopeSettings), else their
    defaults."""
    values = {"factor": None if factor is None else float(factor), "original_max_position_embeddings": original_len}
    values |= {name: getattr(constants or RopeSettings, name) for name in CONSTANTS}
    keys = TRANSFORMERS_ROPE_KEYS[scaling]
    return {"rope_type": TRANSFORMERS_ROPE_TYPES[scaling], **{key: values[key] for key in keys}}


# Scalings equal to another by construction when both take their factor from the span of a forward pass's
# positions (factor null, extending from the span trained): dynamic NTK's s = L / C is NTK's automatic one. They
# differ only when a sequence grows token by token, which lenext never does. Neither evaluated nor tabled twice.
SAME_AS = {"dynamic_ntk": "ntk"}
# Scalings whose factor, when pe.factor is null, is not L / C but their own at each length: 1 for none and for
# dynamic NTK (its base grows with the length itself), the group size for Self-Extend. Kept null in a second stage.
PER_LENGTH = ("none", "dynamic_ntk", "self_extend")
FOLLOWS_SPAN = ("dynamic_ntk", "self_extend")  # of those, the ones whose frequencies or grouping vary with the span


def unset_factor(scaling: str, length: int, original_len: int) -> float:
    """The factor s of ``scaling`` where none is set, for positions spanning ``length``: L / C, at least 1, or 1
    for the scalings that take their own at each length (``PER_LENGTH``)."""
    return 1.0 if scaling in PER_LENGTH else max(1.0, length / original_len)


def redundant_variants(asked, trained: str | None, trained_per_span: bool) -> set[str]:
    """The variants among ``asked`` that another of them equals by construction (``SAME_AS``): the one that is
    not the trained scaling (``dynamic_ntk`` if neither is). A trained scaling is the same method only when its
    factor also follows the span (``trained_per_span``: factor null, extending from the span it trained)."""
    redundant = set()
    for name, same in SAME_AS.items():
        pair = {name, same}
        if not pair <= set(asked):
            continue
        if trained not in pair:
            redundant.add(name)
        elif trained_per_span:
            redundant |= pair - {trained}
    return redundant


def rope_frequencies(
    dim: int, base: float, scaling: str, factor: float, length: int, original_len: int, *constants: float
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) in float64 and the attention factor applied to q and k; ``constants`` in the
    order of ``CONSTANTS`` (their defaults if not given)."""
    if scaling not in ROPE_SCALINGS:
        raise ConfigError(f"pe.scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
    return ROPE_SCALINGS[scaling](RopeSettings(dim, base, scaling, factor, length, original_len, *constants))


class Rotation:
    """How RoPE turns positions into q.k under a scaling: q and k rotated at their positions by the scaling's
    frequencies. Self-Extend, which groups positions instead, is a subclass (``SelfExtend``)."""

    computes_logits = False  # whether it computes the attention logits itself (then it reads q and k)

    def factor(self, rope: "RoPE", length: int) -> float:
        """The factor s for a sequence whose positions span ``length`` (RoPE's module docstring)."""
        if rope.scaling == "none":
            return 1.0
        if rope.factor is not None:
            return float(rope.factor)
        return unset_factor(rope.scaling, length, rope.original_len)

    def rotate(self, rope: "RoPE", q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        rotations = rope._rotations(rope._span(positions), q)[positions][:, None]  # (B or 1, 1, L, d_head/2)
        return _rotate(q, rotations), _rotate(k, rotations)

    def logits(self, rope: "RoPE", q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> Logits | None:
        return None

    def describe(self, rope: "RoPE") -> dict:
        return {}


class SelfExtend(Rotation):
    """Self-Extend's grouped positions (RoPE's module docstring): q and k left as they are, the logits computed
    from two rotations, at the true positions for keys fewer than W back and at the grouped ones beyond."""

    computes_logits = True

    def factor(self, rope: "RoPE", length: int) -> float:
        """The group size G: pe.factor, or the smallest whose grouped positions stay within C."""
        return float(rope.factor) if rope.factor is not None else float(rope.group_size(length))

    def rotate(self, rope, q, k, positions):
        return q, k  # rotated twice, at true and at grouped positions, by ``logits``

    def logits(self, rope, q, k, positions) -> Logits:
        """q.k at the true positions for keys fewer than W back, at the grouped positions beyond, as LongLM's merge
        of its neighbour and group attention weights."""
        span = rope._span(positions)
        group, window = rope.scaling_factor(span), rope.window
        true = rope._rotations(span, q)[positions][:, None]  # (B or 1, 1, L, d_head/2)
        grouped_queries, grouped_keys = self_extend_positions(positions, group, window)
        near_q, near_k = _rotate(q, true), _rotate(k, true)
        far_q = _rotate(q, rope._rotations_at(grouped_queries, q))
        far_k = _rotate(k, rope._rotations_at(grouped_keys, q))
        scale = q.size(-1) ** -0.5

        def block(start: int, end: int) -> torch.Tensor:  # (B, H, end - start, end) fp32 (float64 for float64 q)
            near = keys_product(near_q[:, :, start:end], near_k, 0, end)
            far = keys_product(far_q[:, :, start:end], far_k, 0, end)
            neighbours = position_differences(positions[:, start:end], positions[:, :end]) < window
            return torch.where(neighbours[:, None], near, far).to(_real_dtype(q)).mul_(scale)

        return block

    def describe(self, rope) -> dict:
        return {"neighbor_window": rope.window}


def self_extend_positions(positions: torch.Tensor, group: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-Extend's grouped query and key positions: floor(p / G) + W - W / G and floor(p / G); a query's grouped
    distance to a key W or more back continues from about W (the neighbour window's last) and grows G times slower."""
    keys = torch.div(positions, group, rounding_mode="floor")
    return keys + window - window / group, keys


def self_extend_group(length: int, window: int, original_len: int) -> int:
    """Self-Extend's smallest G whose grouped query positions, floor((length - 1) / G) + W - W / G, stay below C
    (``original_len``): every relative position the grouped keys get was trained."""
    limit = original_len - 1
    if window >= limit:  # a variant from a context too short for the neighbour window
        raise LengthNotSupported(
            f"Self-Extend with neighbor_window {window} needs an original context of at least {window + 2} "
            f"positions; this model's is {original_len}"
        )
    bound = max(1, math.ceil((length - 1 - window) / (limit - window)))  # valid: the condition without the floor
    # The grouped position is not monotone in G (its floor), so a G below a failing one can hold: try each.
    fits = (group for group in range(1, bound) if (length - 1) // group + window - window / group <= limit)
    return next(fits, bound)


def self_extend_window(original_len: int) -> int:
    """Self-Extend's default neighbour window W: a quarter of C."""
    return max(1, original_len // 4)


PLAIN_ROTATION = Rotation()
ROTATIONS = {"self_extend": SelfExtend()}  # a scaling not listed: PLAIN_ROTATION


class RoPE(PositionalEncoding):
    """Rotary embedding with an optional length scaling, overridable at evaluation time."""

    FAMILY = "rotary"
    VARIANTS = SCALINGS

    STAGE_SETTINGS = ("scaling", "factor", *CONSTANTS, "neighbor_window")

    def __init__(
        self,
        shape: AttentionShape,
        base: PositiveFloat = 10000.0,
        scaling: Literal[SCALINGS] = "none",
        factor: Annotated[float, Range(1)] | None = None,  # null: max(1, L / C) at each length L (dynamic_ntk: 1)
        beta_fast: PositiveFloat = RopeSettings.beta_fast,
        beta_slow: PositiveFloat = RopeSettings.beta_slow,
        low_freq_factor: PositiveFloat = RopeSettings.low_freq_factor,
        high_freq_factor: PositiveFloat = RopeSettings.high_freq_factor,
        original_len: PositiveInt | None = None,  # null: the positions training reaches (module docstring)
        neighbor_window: PositiveInt | None = None,  # Self-Extend's W; null: C // 4 (of a variant's C)
        fraction: Annotated[float, Range(0, 1)] = 1.0,  # p-RoPE: the share of frequencies rotated, highest first
    ):
        super().__init__(shape)
        if beta_fast <= beta_slow:  # else YaRN interpolates the highest frequencies and keeps the lowest
            raise ConfigError(
                f"pe.beta_fast={beta_fast} is invalid: it must exceed pe.beta_slow={beta_slow} (YaRN keeps the "
                "frequencies of more than beta_fast rotations over C and interpolates those of fewer than beta_slow)"
            )
        if scaling == "none" and factor is not None:  # taken, printed and stored, it changed no number
            raise ConfigError(
                f"pe.factor={factor:g} changes nothing with pe.scaling=none: give a scaling it applies to (pe.scaling="
                "linear, ntk, yarn, ...), or drop pe.factor"
            )
        if high_freq_factor <= low_freq_factor:
            raise ConfigError(
                f"pe.high_freq_factor={high_freq_factor} is invalid: "
                f"it must exceed pe.low_freq_factor={low_freq_factor}"
            )
        if shape.head_dim % 2:
            raise ConfigError(
                f"{self.DISPLAY_NAME} rotates pairs of dimensions: the head dim model.d_model / model.n_heads = "
                f"{shape.head_dim} must be even"
            )
        if scaling in ("ntk", "dynamic_ntk") and shape.head_dim <= 2:
            raise ConfigError(
                f"pe.scaling={scaling} is invalid for a head dim of {shape.head_dim} (model.d_model / model.n_heads): "
                "NTK-aware scaling raises its base to d / (d - 2); it needs a head dim of at least 4"
            )
        self.original_len = original_len or shape.trained_positions
        self.neighbor_window = neighbor_window
        if (neighbor_window or scaling == "self_extend") and self.window >= self.original_len - 1:
            raise ConfigError(
                f"pe.neighbor_window={self.window} is invalid: Self-Extend groups the keys beyond it into "
                f"the original context C={self.original_len}; it must be below C - 1"
            )
        if factor is None and scaling not in PER_LENGTH and shape.trained_positions > self.original_len:
            factor = shape.trained_positions / self.original_len  # trained beyond C: s = L' / C, fixed
        self.base, self.scaling, self.factor, self.fraction = base, scaling, factor, fraction
        if fraction > 0 and self.rotated_pairs == 0:  # NoPE, labelled p-RoPE
            raise ConfigError(
                f"pe.fraction={fraction:g} is invalid for a head dim of {shape.head_dim}: it rotates floor(p d / 2) "
                f"= 0 of its {shape.head_dim // 2} frequencies, as pe.fraction=0 does; give that, or at least "
                f"{2 / shape.head_dim:g}"
            )
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.register_buffer("rotations", torch.empty(0, shape.head_dim // 2, dtype=torch.complex64), persistent=False)
        self._cache_key: tuple | None = None

    @classmethod
    def evaluated_with(cls, trained: dict, changes: dict) -> dict:
        """Another scaling than the trained one is zero-shot on the checkpoint as trained, as a sweep's ``variant``:
        factor null from the positions it trained; its trained factor and original context belong to its own
        scaling, unless the command sets them."""
        node = super().evaluated_with(trained, changes)
        if changes.get("scaling", trained.get("scaling")) != trained.get("scaling") and "factor" not in changes:
            node["factor"] = None
            if "original_len" not in changes:
                node["original_len"] = None
        return node

    @property
    def rotation(self) -> Rotation:
        """How positions become q.k under the current scaling."""
        return ROTATIONS.get(self.scaling, PLAIN_ROTATION)

    def settings(self, length: int) -> RopeSettings:
        """RoPE's settings for a sequence whose positions span ``length``, its factor resolved."""
        constants = (getattr(self, name) for name in CONSTANTS)
        factor = self.scaling_factor(length)
        return RopeSettings(self.shape.head_dim, self.base, self.scaling, factor, length, self.original_len, *constants)

    def scaling_factor(self, length: int) -> float:
        """The scaling factor s used for a sequence whose positions span ``length``."""
        return self.rotation.factor(self, length)

    @property
    def window(self) -> int:
        """Self-Extend's W: ``neighbor_window``, or a quarter of C (of the span trained, in a variant)."""
        return self.neighbor_window or self_extend_window(self.original_len)

    def group_size(self, length: int) -> int:
        """Self-Extend's group size G at ``length`` (``self_extend_group``)."""
        return self_extend_group(length, self.window, self.original_len)

    @property
    def rotated_pairs(self) -> int:
        """p-RoPE's rotated frequencies: the highest floor(p d / 2), as Barbero et al.'s ``int(p * d // 2)``."""
        return int(self.fraction * self.shape.head_dim // 2)

    def frequencies(self, length: int) -> tuple[torch.Tensor, float]:
        """The inverse frequencies (d/2,) float64 for a sequence spanning ``length`` positions, and the attention
        factor: the scaling's, with p-RoPE's lowest frequencies 0 (those pairs are not rotated)."""
        inv_freq, attention_factor = ROPE_SCALINGS[self.scaling](self.settings(length))
        inv_freq[self.rotated_pairs :] = 0
        return inv_freq, attention_factor

    def rotary_frequencies(self, length: int) -> torch.Tensor:
        return self.frequencies(length)[0]

    def _rotations(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """(length, d_head/2) complex table e^{i p theta_t} of positions p < length for rotating ``like`` (complex64;
        complex128 for float64), built once per (length, scaling) in float64."""
        key = (self.settings(length), self.fraction)
        device, dtype = like.device, _complex_dtype(like)
        if key != self._cache_key or self.rotations.device != device or self.rotations.dtype != dtype:
            inv_freq, attention_factor = self.frequencies(length)
            angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
            magnitude = torch.full_like(angles, attention_factor)
            self.rotations = torch.polar(magnitude, angles).to(device=device, dtype=dtype)
            self._cache_key = key
        return self.rotations

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotation.rotate(self, q, k, positions)

    def _span(self, positions: torch.Tensor) -> int:
        # Drawn positions, whose span changes every step and batch, share one table of every position training
        # reached. A sequence at 0..L-1 under a scaling that follows its length (dynamic NTK, Self-Extend's G) is
        # scaled at its own L, at least C (within it they are the identity), also after training beyond C.
        span = position_span(positions)
        sequential = positions.size(0) == 1 and span == positions.size(-1)  # strictly increasing: exactly 0..L-1
        floor = self.original_len if sequential and self.scaling in FOLLOWS_SPAN else self.shape.trained_positions
        return max(span, floor)

    def logits(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> Logits | None:
        return self.rotation.logits(self, q, k, positions)

    def _rotations_at(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(B or 1, 1, L, d_head/2) e^{i p theta_t} at any (fractional) positions p, computed in float64, for
        rotating ``like`` (complex64; complex128 for float64)."""
        inv_freq, attention_factor = self.frequencies(self._span(positions))
        angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
        return torch.polar(torch.full_like(angles, attention_factor), angles)[:, None].to(
            like.device, _complex_dtype(like)
        )

    @property
    def reads_qk(self) -> bool:
        return self.rotation.computes_logits  # from q and k

    @property
    def computes_logits(self) -> bool:
        return self.rotation.computes_logits

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        span = self.shape.trained_positions
        if longest <= span and (self.scaling == "none" or (self.factor is None and self.original_len >= span)):
            return [self.scaling]  # trained as the identity there, as every other variant is (``variant``)
        asked = [name for name in asked or () if name in self.VARIANTS] or [self.scaling]
        per_span = self.factor is None and self.original_len == self.shape.trained_positions
        redundant = redundant_variants(asked, self.scaling, per_span)
        return [name for name in asked if name not in redundant]

    @contextmanager
    def variant(self, name: str | None):
        """RoPE under the scaling ``name``: as trained if it is the trained scaling, else a zero-shot scaling of the
        model as trained: factor null, extending from the span of positions it trained (a second stage's L', not
        its base's C), as eval.py's ``pe.scaling`` override does."""
        trained = (self.scaling, self.factor, self.original_len)
        if name != self.scaling:
            self.scaling, self.factor, self.original_len = name, None, self.shape.trained_positions
        try:
            yield
        finally:
            self.scaling, self.factor, self.original_len = trained

    def describe(self) -> dict:
        return (
            {
                "name": "RoPE",
                "base": self.base,
                "scaling": self.scaling,
                "factor": self.factor,
                "original_len": self.original_len,
            }
            | self.rotation.describe(self)
            | (
                {"fraction": self.fraction} if self.fraction != 1 else {}  # p-RoPE
            )
        )


def _real_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype RoPE computes ``x``'s rotation in: fp32 (float64 for float64 x, as a float64 oracle needs)."""
    return torch.promote_types(x.dtype, torch.float32)


def _complex_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.complex128 if _real_dtype(x) == torch.float64 else torch.complex64


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.to(_real_dtype(x)).reshape(*x.shape[:-1], -1, 2).contiguous())  # (B, H, L, d/2)
    return torch.view_as_real(pairs * rotations).flatten(-2).type_as(x)
