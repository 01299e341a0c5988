"""Rotary position embedding (Su et al. 2021) and its length-scaling variants.

Pairing convention: interleaved pairs (x[2t], x[2t+1]) rotated as one complex number, as in
RoFormer and seed 001; rotation is a complex multiplication (the fastest eager form on CPU).

Scalings (DESIGN.md section 3), with s the factor and L_train the training length:
- ``none``: theta_t = base^(-2t/d).
- ``linear`` (position interpolation, Chen et al. 2023): theta_t / s.
- ``ntk`` (bloc97 2023): base' = base * s^(d/(d-2)).
- ``dynamic_ntk``: for a sequence of length l > L_train,
  base' = base * (s*l/L_train - (s-1))^(d/(d-2)); s defaults to 1.
- ``yarn`` (Peng et al. 2023): a per-dimension ramp between PI and no scaling
  (beta_fast 32, beta_slow 1) and q, k both scaled by 0.1 ln s + 1.
- ``llama3`` (Meta 2024, Llama 3.1): by wavelength lambda_t = 2 pi / theta_t, with the original
  context L_train: theta_t / s where lambda_t > L_train / low_freq_factor, theta_t where
  lambda_t < L_train / high_freq_factor, and between them (1 - g) theta_t / s + g theta_t with
  g = (L_train / lambda_t - low_freq_factor) / (high_freq_factor - low_freq_factor).
With ``factor: null`` the static scalings use s = max(1, L / L_train) for a sequence whose
positions span L (0..L-1 unless training drew others): identity at the training length, the
method's own factor beyond it. L_train here is the span of positions training reached: the
training length, or N under randomized positions and the target length under PoSE, which
already cover the positions up to them.
"""

import math
from contextlib import contextmanager
from typing import Annotated, Literal

import torch

from lenext.errors import ConfigError
from lenext.pe.base import AttentionShape, PositionalEncoding
from lenext.schema import PositiveFloat, Range

SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")


def rope_frequencies(
    dim: int,
    base: float,
    scaling: str,
    factor: float,
    length: int,
    train_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) in float64 and the attention factor applied to q and k."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if scaling == "none":
        return base**-exponents, 1.0
    if scaling == "linear":
        return base**-exponents / factor, 1.0
    if scaling == "ntk":
        return (base * factor ** (dim / (dim - 2))) ** -exponents, 1.0
    if scaling == "dynamic_ntk":
        length = max(length, train_len)
        scaled_base = base * (factor * length / train_len - (factor - 1)) ** (dim / (dim - 2))
        return scaled_base**-exponents, 1.0
    if scaling == "yarn":
        extrapolation = base**-exponents
        interpolation = extrapolation / factor

        def correction_dim(rotations: float) -> float:
            return dim * math.log(train_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        # ramp 0 -> keep the original frequency (high-frequency dims), 1 -> interpolate.
        inv_freq = extrapolation * (1 - ramp) + interpolation * ramp
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return inv_freq, attention_factor
    if scaling == "llama3":
        original = base**-exponents
        in_train_len = train_len * original / (2 * math.pi)  # L_train / wavelength
        keep = ((in_train_len - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
        return original / factor * (1 - keep) + original * keep, 1.0
    raise ConfigError(f"pe.scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")


class RoPE(PositionalEncoding):
    """Rotary embedding with an optional length scaling, overridable at evaluation time."""

    def __init__(
        self,
        shape: AttentionShape,
        base: PositiveFloat = 10000.0,
        scaling: Literal[SCALINGS] = "none",
        factor: Annotated[float, Range(1)] | None = None,  # null: L / L_train at each length L (dynamic_ntk: max 1)
        beta_fast: PositiveFloat = 32.0,
        beta_slow: PositiveFloat = 1.0,
        low_freq_factor: PositiveFloat = 1.0,
        high_freq_factor: PositiveFloat = 4.0,
    ):
        super().__init__(shape)
        if high_freq_factor <= low_freq_factor:
            raise ConfigError(
                f"pe.high_freq_factor={high_freq_factor} is invalid: "
                f"it must exceed pe.low_freq_factor={low_freq_factor}"
            )
        if shape.head_dim % 2:
            raise ConfigError(
                f"RoPE rotates pairs of dimensions: the head dim model.d_model / model.n_heads = {shape.head_dim} "
                "must be even"
            )
        self.base, self.scaling, self.factor = base, scaling, factor
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.low_freq_factor, self.high_freq_factor = low_freq_factor, high_freq_factor
        self.register_buffer("rotations", torch.empty(0, shape.head_dim // 2, dtype=torch.complex64), persistent=False)
        self._cache_key: tuple | None = None

    def scaling_factor(self, length: int) -> float:
        """The scaling factor s used for a sequence whose positions span ``length``."""
        if self.scaling == "none":
            return 1.0
        if self.factor is not None:
            return float(self.factor)
        if self.scaling == "dynamic_ntk":
            return 1.0
        return max(1.0, length / self.shape.trained_positions)

    def frequencies(self, length: int) -> tuple[torch.Tensor, float]:
        return rope_frequencies(
            self.shape.head_dim,
            self.base,
            self.scaling,
            self.scaling_factor(length),
            length,
            self.shape.trained_positions,
            self.beta_fast,
            self.beta_slow,
            self.low_freq_factor,
            self.high_freq_factor,
        )

    def _rotations(self, length: int, device: torch.device) -> torch.Tensor:
        """(length, d_head/2) complex64 table e^{i p theta_t} of positions p < length, built once per
        (length, scaling) in float64."""
        key = (length, self.base, self.scaling, self.scaling_factor(length))
        key += (self.beta_fast, self.beta_slow, self.low_freq_factor, self.high_freq_factor)
        if key != self._cache_key or self.rotations.device != device:
            inv_freq, attention_factor = self.frequencies(length)
            angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
            magnitude = torch.full_like(angles, attention_factor)
            self.rotations = torch.polar(magnitude, angles).to(device=device, dtype=torch.complex64)
            self._cache_key = key
        return self.rotations

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # At least every position training reached: the scalings are the identity within them, so one table
        # serves drawn positions, whose span changes every step.
        span = max(int(positions.max()) + 1, self.shape.trained_positions)
        rotations = self._rotations(span, q.device)[positions][:, None]  # (B or 1, 1, L, d_head/2)
        return _rotate(q, rotations), _rotate(k, rotations)

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        if longest <= self.shape.trained_positions:  # every scaling is the identity within the trained span
            return [self.scaling]
        return list(asked or [self.scaling])

    @contextmanager
    def variant(self, name: str | None):
        """RoPE under the scaling ``name``: with its trained factor if it is the trained scaling,
        else with factor null (L / L_train at each length)."""
        trained = (self.scaling, self.factor)
        self.scaling, self.factor = name, (trained[1] if name == trained[0] else None)
        try:
            yield
        finally:
            self.scaling, self.factor = trained

    def describe(self) -> dict:
        return {"name": "RoPE", "base": self.base, "scaling": self.scaling, "factor": self.factor}


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())  # (B, H, L, d/2)
    return torch.view_as_real(pairs * rotations).flatten(-2).type_as(x)
