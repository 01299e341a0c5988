"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): RoPE whose score decays with distance.

After the rotation, pair t of the query at position n is scaled by zeta_t^(n / gamma) and of the key at
position m by zeta_t^(-m / gamma), with zeta_t = (2t/d + 0.4) / 1.4 and gamma = ``scale_base`` (512),
so the q.k product of pair t carries zeta_t^((n - m) / gamma) <= 1: farther keys weigh less.
Positions are centred on L // 2 before the powers (as x-transformers does): the products are unchanged,
and the largest factor is zeta_0^(-L / (2 gamma)) = 3.5^(L / (2 gamma)) instead of its square. Scores of
a query and a key both far from the centre (including masked future ones) multiply two such factors:
beyond e^40 each they overflow fp32, so longer sequences are refused as not applicable
(``position_limit``: 32.7k tokens at gamma 512).
Trained without a scaling; evaluation may still apply RoPE's frequency scalings to the rotation
(``eval.variants``; Self-Extend's grouped positions are not among its variants).
"""

import math

import torch

from lenext.errors import ConfigError, LengthNotSupported
from lenext.pe.base import AttentionShape, position_span
from lenext.pe.rope import SCALINGS, RoPE, _rotate
from lenext.ranges import PositiveFloat, PositiveInt

LARGEST_LOG_FACTOR = 40.0  # e^40 per q or k: products of two stay below fp32's e^88
SMALLEST_ZETA = 0.4 / 1.4  # zeta_0: the fastest decay, which bounds the length fp32 holds


class XPos(RoPE):
    """RoPE with the xPos decay: q scaled by zeta^(n/gamma), k by zeta^(-m/gamma), per rotated pair."""

    FAMILY = "rotary"
    DISPLAY_NAME = "xPos"
    # Self-Extend's grouped positions would need the decay at grouped positions too: not a variant of xPos.
    VARIANTS = tuple(name for name in SCALINGS if name != "self_extend")

    STAGE_SETTINGS = ()  # trained without a scaling

    def __init__(
        self,
        shape: AttentionShape,
        base: PositiveFloat = 10000.0,
        scale_base: PositiveFloat = 512.0,
        original_len: PositiveInt | None = None,  # the context evaluation-time scalings extend from (RoPE's)
    ):
        super().__init__(shape, base=base, original_len=original_len)
        self.scale_base = scale_base
        self._tables_key: tuple | None = None  # RoPE's rotation table the q and k tables were built from
        if self.position_limit < shape.trained_positions:
            raise ConfigError(
                f"pe.scale_base={scale_base:g} is invalid: xPos then serves at most {self.position_limit} positions, "
                f"fewer than the {shape.trained_positions} training uses; it must be at least "
                f"{math.ceil(shape.trained_positions * -math.log(SMALLEST_ZETA) / (2 * LARGEST_LOG_FACTOR))}"
            )

    @property
    def position_limit(self) -> int:
        """The longest sequence whose decay factors fp32 scores hold (see the module docstring)."""
        return math.floor(2 * self.scale_base * LARGEST_LOG_FACTOR / -math.log(SMALLEST_ZETA))

    def decay(self, length: int, device: torch.device) -> torch.Tensor:
        """(length, d_head/2) float64 zeta_t^((n - length // 2) / gamma) of positions n < length: the query's
        factor, 1 / it the key's."""
        pairs = torch.arange(0, self.shape.head_dim, 2, dtype=torch.float64) / self.shape.head_dim
        zeta = (pairs + 0.4) / 1.4  # (d_head/2,)
        centred = torch.arange(length, dtype=torch.float64) - length // 2
        return (zeta[None, :] ** (centred[:, None] / self.scale_base)).to(device)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = position_span(positions)  # what the centring and the bound are about
        if length > self.position_limit:
            raise LengthNotSupported(
                f"xPos with scale_base {self.scale_base:g} serves at most {self.position_limit} positions: its decay "
                f"factors at position {length - 1} overflow fp32 scores (raise pe.scale_base for longer sequences)"
            )
        rotations = self._rotations(length, q)  # (span, d_head/2) complex, cached by RoPE
        if self._tables_key != (self._cache_key, q.device, rotations.dtype):  # once per length and scaling
            decay = self.decay(length, q.device).to(rotations.real.dtype)
            self._query_table, self._key_table = rotations * decay, rotations / decay
            self._tables_key = (self._cache_key, q.device, rotations.dtype)
        query_table, key_table = (table[positions][:, None] for table in (self._query_table, self._key_table))
        return _rotate(q, query_table), _rotate(k, key_table)  # tables (B or 1, 1, L, d_head/2)

    def describe(self) -> dict:
        return {**super().describe(), "name": "xPos", "scale_base": self.scale_base}
