"""Positional encodings: one small module per family behind one interface (see ``base``)."""

from lenext.pe.absolute import Learned, Sinusoidal, sinusoidal_table
from lenext.pe.base import FAMILIES, AttentionShape, NoPE, PositionalEncoding
from lenext.pe.bias import ALiBi, ShawRelative, T5Bias, alibi_slopes, t5_bucket
from lenext.pe.cope import CoPE
from lenext.pe.dape import DAPE
from lenext.pe.fire import FIRE
from lenext.pe.fox import FoX
from lenext.pe.kerple import KERPLE
from lenext.pe.mix import Compose, PerLayer
from lenext.pe.path import PaTH
from lenext.pe.pope import PoPE
from lenext.pe.rope import SCALINGS, RoPE, rope_frequencies
from lenext.pe.xpos import XPos

PE_CLASSES = (
    *(NoPE, Sinusoidal, Learned, ALiBi, T5Bias, ShawRelative, KERPLE, FIRE, RoPE, XPos),
    *(FoX, CoPE, DAPE, PaTH, PoPE, Compose, PerLayer),
)
# Every evaluation-time variant some PE has (eval.variants); a PE evaluated under one it lacks is evaluated as trained.
VARIANTS = tuple(dict.fromkeys(name for pe in PE_CLASSES for name in pe.VARIANTS))

__all__ = [
    "ALiBi",
    "FAMILIES",
    "PE_CLASSES",
    "VARIANTS",
    "AttentionShape",
    "Compose",
    "CoPE",
    "DAPE",
    "FIRE",
    "FoX",
    "KERPLE",
    "Learned",
    "NoPE",
    "PaTH",
    "PerLayer",
    "PoPE",
    "PositionalEncoding",
    "RoPE",
    "SCALINGS",
    "ShawRelative",
    "Sinusoidal",
    "T5Bias",
    "XPos",
    "alibi_slopes",
    "rope_frequencies",
    "sinusoidal_table",
    "t5_bucket",
]
