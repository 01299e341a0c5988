"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers").

Score bias b(i, j) = f_theta(psi(i - j) / psi(max(L_thr, i))), psi(x) = log(c x + 1), for j <= i:
the distance is normalised by the query's position once the query is past the threshold L_thr
("progressive interpolation"), so the MLP's input stays in [0, 1] at any length. f_theta is an MLP
1 -> ``hidden`` (ReLU) -> one output per head; c (init 0.1) and L_thr = |multiplier| * init_threshold
(multiplier init 1) are learned, with eps 1e-6 in the denominator, as in the paper's reference code.
One FIRE per attention layer (``per_layer``), as each layer owns one there. ``init_threshold: null``
starts L_thr at L_train. The bias depends on i itself, not only on i - j: a pair bias, scored in query blocks;
while every query is below L_thr it is a function of i - j alone, which FlexAttention looks up on CUDA (to tell,
every layer's threshold is read at once, once a forward: a read waits for the GPU). Past it,
without a gradient (evaluation beyond L_train), FlexAttention runs the MLP itself on each score; with one, the
query blocks (every score's gradient would be added onto the MLP's few weights at once).
"""

import logging
from collections.abc import Callable

import torch
from torch import nn

from lenext.pe.base import (
    HIDDEN_ELEMENTS,
    AttentionShape,
    PositionalEncoding,
    device_budget,
    distance_score_mod,
    position_span,
    read_once_a_forward,
)
from lenext.ranges import PositiveFloat, PositiveInt

EPS = 1e-6
log = logging.getLogger("lenext")


class FireBias(nn.Module):
    """One layer's f_theta, c and threshold."""

    def __init__(self, heads: int, hidden: int, init_c: float, init_threshold: float):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, heads))
        # One-element vectors, not scalars: FSDP shards no scalar parameter (trainer=fsdp).
        self.c = nn.Parameter(torch.tensor([init_c]))
        self.register_buffer("init_threshold", torch.tensor(init_threshold))
        self.threshold_multiplier = nn.Parameter(torch.tensor([1.0]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("c", "threshold_multiplier"):  # checkpoints from before they were vectors
            if state_dict.get(prefix + name) is not None and state_dict[prefix + name].dim() == 0:
                state_dict[prefix + name] = state_dict[prefix + name].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Increasing query positions (R,), key positions (K,) -> (H, R, K) bias in the parameters' dtype (defined
        for j <= i).

        Rows before L_thr have the normaliser psi(L_thr): their bias is a function of i - j alone, so
        the MLP runs once per distance and is gathered (all of training when L_thr >= L_train).
        Later rows run it per (i, j), in chunks of rows that keep its hidden activations
        (rows, K, hidden) within the attention's per-block budget at any length.
        """
        threshold = self.threshold()
        below = int((query_positions < threshold).sum())  # a prefix: positions increase
        parts = [self._by_distance(query_positions[:below], key_positions, threshold)] if below else []
        budget = device_budget(HIDDEN_ELEMENTS, key_positions.device)
        rows = max(1, budget // (key_positions.numel() * self.mlp[0].out_features))
        starts = range(below, len(query_positions), rows)
        parts += [self._by_pair(query_positions[r : r + rows], key_positions, threshold) for r in starts]
        return torch.cat(parts, dim=1)

    def _psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.abs(self.c * x) + 1)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """(...) normalised distances -> (H, ...) biases."""
        with torch.autocast(x.device.type, enabled=False):  # a tiny MLP: fp32 whatever the model runs in
            return self.mlp(x[..., None]).movedim(-1, 0)

    def threshold(self) -> torch.Tensor:
        return (self.threshold_multiplier * self.init_threshold).abs()

    def distance_table(self, longest: int) -> torch.Tensor:
        """(longest, H): the bias of distances 0..longest-1 while every query position (below ``longest``) is at most
        the threshold, where the normaliser is psi(L_thr) and the bias a function of the distance alone."""
        return self._distance_table(longest, self.threshold()).T

    def _distance_table(self, count: int, threshold: torch.Tensor) -> torch.Tensor:
        """(H, count): the bias of distances 0..count-1 for queries below the threshold."""
        distances = self._psi(torch.arange(count, device=self.c.device).to(self.c.dtype))
        return self._mlp(distances / (self._psi(threshold) + EPS))

    def pair_score_mod(self, positions: torch.Tensor, batch: int) -> Callable:
        """A score_mod adding b(i, j) computed per score (positions (B or 1, L)): the MLP unrolled over its hidden
        units, in fp32, the same formula as ``_by_pair``."""
        positions, (first, _, second) = positions.expand(batch, -1), self.mlp
        w1, b1, w2, b2 = (t.float() for t in (first.weight[:, 0], first.bias, second.weight, second.bias))
        c, normaliser_floor = self.c.float()[0], self.threshold().float()[0]

        def by_pair(score, b, h, q_idx, kv_idx):
            i, j = positions[b, q_idx].float(), positions[b, kv_idx].float()
            x = torch.log(torch.abs(c * (i - j)) + 1) / (
                torch.log(torch.abs(c * torch.maximum(i, normaliser_floor)) + 1) + EPS
            )
            bias = b2[h]
            for unit in range(w1.numel()):
                bias = bias + w2[h, unit] * torch.relu(w1[unit] * x + b1[unit])
            return score + bias

        return by_pair

    def _by_distance(self, query_positions, key_positions, threshold) -> torch.Tensor:
        distance = (query_positions[:, None] - key_positions[None, :]).clamp(min=0)  # future keys: masked later
        return self._distance_table(int(distance.max()) + 1, threshold)[:, distance]

    def _by_pair(self, query_positions, key_positions, threshold) -> torch.Tensor:
        i, j = query_positions.to(self.c.dtype)[:, None], key_positions.to(self.c.dtype)[None, :]
        return self._mlp(self._psi(i - j) / (self._psi(torch.maximum(i, threshold)) + EPS))


class FIRE(PositionalEncoding):
    """Learned function of the progressively normalised log distance, one output per head."""

    FAMILY = "additive bias"

    def __init__(
        self,
        shape: AttentionShape,
        hidden: PositiveInt = 32,
        init_c: PositiveFloat = 0.1,
        init_threshold: PositiveFloat | None = None,
        per_layer: bool = True,
    ):
        super().__init__(shape)
        self.hidden, self.init_c, self.per_layer = hidden, init_c, per_layer
        self.init_threshold = threshold = float(init_threshold or shape.train_len)
        self.warned_past_threshold = False
        self.layers = nn.ModuleList(
            FireBias(shape.n_heads, hidden, init_c, threshold) for _ in range(shape.n_layers if per_layer else 1)
        )

    def pair_bias(self, layer):
        fire = self.layers[layer if len(self.layers) > 1 else 0]

        def bias(query_positions, key_positions):  # one sequence's positions at a time: (B or 1, H, R, K)
            sequences = max(query_positions.size(0), key_positions.size(0))
            rows, keys = query_positions.expand(sequences, -1), key_positions.expand(sequences, -1)
            return torch.stack([fire(i, j) for i, j in zip(rows, keys, strict=True)])

        return bias

    def read_before_blocks(self, positions):
        self.within_thresholds(positions, position_span(positions))

    def within_thresholds(self, positions: torch.Tensor, span: int) -> tuple[bool, ...]:
        """Per layer, whether every query position (below ``span``) is at most its learned threshold L_thr: read once
        a forward, every layer's at once (a read waits for the GPU)."""

        def read() -> tuple[bool, ...]:
            return tuple((torch.cat([fire.threshold() for fire in self.layers]) >= span - 1).tolist())

        return read_once_a_forward(positions, f"FIRE {id(self)} within thresholds", read)

    def score_mod(self, q, positions, layer):
        index = layer if len(self.layers) > 1 else 0
        fire, span = self.layers[index], position_span(positions)
        if self.within_thresholds(positions, span)[index]:  # a lookup by distance
            return distance_score_mod(fire.distance_table(span), positions, q.size(0))
        if not torch.is_grad_enabled():
            return fire.pair_score_mod(positions, q.size(0))
        if not self.warned_past_threshold:  # once: a learned threshold can drift below L_train in training
            self.warned_past_threshold = True
            log.warning(
                "FIRE: training with queries past the learned threshold L_thr = %.1f (positions span %d): its "
                "attention leaves FlexAttention for the explicit query blocks, far slower on a GPU "
                "(docs/performance.md)",
                float(fire.threshold().max()),
                span,
            )
        return None

    def describe(self) -> dict:
        return {"name": "FIRE", "hidden": self.layers[0].mlp[0].out_features, "per_layer": len(self.layers) > 1}
