"""Positional encodings: one small module per family behind one interface (see ``base``)."""

from lenext.pe.absolute import Learned, Sinusoidal, sinusoidal_table
from lenext.pe.base import AttentionShape, NoPE, PositionalEncoding
from lenext.pe.bias import ALiBi, ShawRelative, T5Bias, alibi_slopes, t5_bucket
from lenext.pe.rope import SCALINGS, RoPE, rope_frequencies

__all__ = [
    "ALiBi",
    "AttentionShape",
    "Learned",
    "NoPE",
    "PositionalEncoding",
    "RoPE",
    "SCALINGS",
    "ShawRelative",
    "Sinusoidal",
    "T5Bias",
    "alibi_slopes",
    "rope_frequencies",
    "sinusoidal_table",
    "t5_bucket",
]
