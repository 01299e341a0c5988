"""Errors lenext raises on purpose. Each carries a message that says what to do.

The command-line entry points print these as one line (no traceback) and exit non-zero;
anything else is a bug and keeps its traceback.
"""


class LenextError(Exception):
    """Base class: a problem with the user's input, not with lenext."""


class ConfigError(LenextError):
    """A configuration value is invalid; the message names the key."""


class DataError(LenextError):
    """A corpus cannot be read or is too small for what was asked."""


class CheckpointError(LenextError):
    """A checkpoint is missing, truncated, or was not written by lenext."""


class LengthNotSupported(LenextError):
    """A positional encoding cannot serve a sequence this long (e.g. learned APE beyond max_len).

    Evaluation records such a length as "not applicable" instead of failing the sweep.
    """
