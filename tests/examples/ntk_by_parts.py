"""The example extension method of docs/adding/extension.md (shown there between the section markers)."""

# --8<-- [start:scaling]
import torch

from lenext.pe.rope import RopeSettings, yarn_scaling


def ntk_by_parts_scaling(s: RopeSettings) -> tuple[torch.Tensor, float]:
    """YaRN's per-dimension ramp between PI and no scaling, without its attention temperature (bloc97 2023)."""
    inv_freq, _ = yarn_scaling(s)
    return inv_freq, 1.0


# --8<-- [end:scaling]
