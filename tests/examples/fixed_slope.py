"""The example PE of docs/pes/adding.md (shown there between the section markers)."""

# --8<-- [start:pe]
import torch

from lenext.pe.base import AttentionShape, PositionalEncoding
from lenext.ranges import PositiveFloat


class FixedSlope(PositionalEncoding):
    """ALiBi with one configurable slope shared by all heads."""

    FAMILY = "additive bias"  # its panel in the report's figures

    def __init__(self, shape: AttentionShape, slope: PositiveFloat = 0.5):
        super().__init__(shape)
        self.slope = slope  # under its own name: hyperparameters() reads the settings back from the attributes

    def key_bias(self, positions, layer):
        # -slope (i - j) = slope (j - last) - slope (i - last): the second term is constant along a row and
        # softmax ignores it, so a bias of the key alone is exact and keeps SDPA's fused kernel.
        keys = (positions - positions[:, -1:]).to(self.bias_dtype)  # (B or 1, K): fp32 under bf16, float64 in float64
        return (self.slope * keys)[:, None, None, :].expand(-1, self.shape.n_heads, -1, -1)  # (B or 1, H, 1, K)

    def score_mod(self, q, positions, layer):
        # For CUDA (FlexAttention). The slope is captured as a tensor, as ALiBi's slopes are.
        slope = torch.tensor(self.slope, device=q.device)
        positions = positions.expand(q.size(0), -1)

        def fixed_slope(score, b, h, q_idx, kv_idx):
            return score - slope * (positions[b, q_idx] - positions[b, kv_idx])

        return fixed_slope


# --8<-- [end:pe]
