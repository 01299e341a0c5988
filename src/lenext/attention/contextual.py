"""CoPE's attention as one Triton kernel, forward and backward: its scores never leave the chip.

No library has one (docs/scaling.md, "GPU speed per PE"). Query i's position of key j is the suffix sum
p_ij = sum_{t = j..i} g_it of the gates g_it = sigmoid(z_it) of its scaled logits z, capped at P - 1, and its
logit gains the row's per-position score s_i[p] = q_i . e[p] (``by_position``, (B, H, L, P)) interpolated at
p_ij. The forward walks a tile of query rows leftwards over the key tiles from the diagonal, carrying the rows'
gate sums, as a flash kernel carries its running maximum; it keeps the rows' log-sum-exp and, when a gradient is
wanted, the sum it carried into each key tile (L / 32 numbers a row), so the backward, walking rightwards, counts
each position as the forward did, and carries the prefix sums of dL/dp that give each gate its gradient
(dL/dg_it = sum_{j <= t} dL/dp_ij); key and value gradients and the per-position scores' are added atomically in
fp32 (so their order of summation, and their last bits, vary from run to run). Imported only where Triton is
(``lenext.attention``).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lenext.pe.base import kernel_dtype


@dataclass(frozen=True)
class Tiles:
    """The kernels' tiles and warps. One tile of keys for both: the backward counts positions per key tile from the
    sums the forward carried into each."""

    keys: int
    forward_rows: int
    backward_rows: int
    warps: int


# On a GPU the largest tiles with which neither kernel spills registers at head dims 16-128 but the backward at 32
# (compiled for sm_90 ahead of time: benchmarks/cope-kernel-sm90-registers-2026-11-28.md); under Triton's
# interpreter half as large, so short test sequences span several.
TILES = {"cuda": Tiles(keys=32, forward_rows=64, backward_rows=32, warps=8), "cpu": Tiles(16, 32, 16, 4)}


@triton.jit
def _counted(q, k, rows, cols, valid, scale, to_the_right):
    """A tile's scaled logits z, the pairs a row sees, their gates and their positions: the gates summed from the
    right within the tile plus each row's sum over the keys after it (forward and backward count alike)."""
    z = tl.dot(q, tl.trans(k)) * scale
    seen = (cols[None, :] <= rows[:, None]) & valid[:, None]
    gates = tl.where(seen, tl.sigmoid(z), 0.0)
    return z, seen, gates, tl.cumsum(gates, axis=1, reverse=True) + to_the_right[:, None]


@triton.jit
def _interpolated(counted, seen, s_rows, cap):
    """Each pair's score s_i[p] interpolated at its position p (capped at ``cap``): (score, weight on the corner
    above, the two corners' indices, the two corners' scores)."""
    capped = tl.minimum(counted, cap)
    below = tl.floor(capped)
    weight = capped - below
    below_index, above_index = below.to(tl.int32), tl.ceil(capped).to(tl.int32)
    s_below = tl.load(s_rows + below_index, mask=seen, other=0.0).to(tl.float32)
    s_above = tl.load(s_rows + above_index, mask=seen, other=0.0).to(tl.float32)
    return s_above * weight + s_below * (1 - weight), weight, below_index, above_index, s_below, s_above


@triton.jit
def _forward(
    Q, K, V, S, OUT, LSE, CARRIED, scale, length, positions, cap,
    D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, KEEP: tl.constexpr,
):  # fmt: skip
    block, head = tl.program_id(0), tl.program_id(1).to(tl.int64)  # head: batch x heads (offsets past 2^31)
    rows, keys, dims = block * ROWS + tl.arange(0, ROWS), tl.arange(0, KEYS), tl.arange(0, D)
    valid = rows < length
    offset = head * length * D
    q = tl.load(Q + offset + rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    s_rows = S + head * length * positions + rows.to(tl.int64)[:, None] * positions  # (ROWS, 1): each row's s_i
    key_tiles = tl.cdiv(length, KEYS)
    carried = CARRIED + head * length * key_tiles + rows * key_tiles  # (ROWS,): each row's carried gate sums
    to_the_right = tl.zeros([ROWS], tl.float32)  # each row's gate sum over the keys after the tile
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    last = tl.minimum((block * ROWS + ROWS - 1) // KEYS, key_tiles - 1)  # the tile of the last row's key
    for step in range(0, last + 1):  # the key tiles from the diagonal leftwards
        n = last - step
        cols = n * KEYS + keys
        k = tl.load(K + offset + cols[:, None] * D + dims[None, :], mask=cols[:, None] < length, other=0.0)
        v = tl.load(V + offset + cols[:, None] * D + dims[None, :], mask=cols[:, None] < length, other=0.0)
        z, seen, gates, counted = _counted(q, k, rows, cols, valid, scale, to_the_right)
        if KEEP:  # for the backward, which counts each position as here
            tl.store(carried + n, to_the_right, mask=valid)
        to_the_right += tl.sum(gates, axis=1)
        term, _, _, _, _, _ = _interpolated(counted, seen, s_rows, cap)
        score = tl.where(seen, z + term, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(score, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no key yet: weights 0
        rescale = tl.exp(row_max - shift)
        weights = tl.exp(score - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        row_max = new_max
    out = (acc / row_sum[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + offset + rows[:, None] * D + dims[None, :], out, mask=valid[:, None])
    tl.store(LSE + head * length + rows, row_max + tl.log(row_sum), mask=valid)


@triton.jit
def _backward(
    Q, K, V, S, DO, LSE, DELTA, CARRIED, DQ, DK, DV, DS, scale, length, positions, cap,
    D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    block, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows, keys, dims = block * ROWS + tl.arange(0, ROWS), tl.arange(0, KEYS), tl.arange(0, D)
    valid = rows < length
    offset = head * length * D
    q = tl.load(Q + offset + rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(DO + offset + rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    lse = tl.load(LSE + head * length + rows, mask=valid, other=0.0)
    delta = tl.load(DELTA + head * length + rows, mask=valid, other=0.0)
    s_rows = S + head * length * positions + rows.to(tl.int64)[:, None] * positions
    ds_rows = DS + head * length * positions + rows.to(tl.int64)[:, None] * positions
    key_tiles = tl.cdiv(length, KEYS)
    carried = CARRIED + head * length * key_tiles + rows * key_tiles
    dcounted_before = tl.zeros([ROWS], tl.float32)  # each row's sum of dL/dp over the keys before the tile
    dq = tl.zeros([ROWS, D], tl.float32)
    last = tl.minimum((block * ROWS + ROWS - 1) // KEYS, key_tiles - 1)
    for n in range(0, last + 1):  # the key tiles from the first rightwards
        cols = n * KEYS + keys
        key_mask = cols[:, None] < length
        k = tl.load(K + offset + cols[:, None] * D + dims[None, :], mask=key_mask, other=0.0)
        v = tl.load(V + offset + cols[:, None] * D + dims[None, :], mask=key_mask, other=0.0)
        to_the_right = tl.load(carried + n, mask=valid, other=0.0)  # as the forward carried it
        z, seen, gates, counted = _counted(q, k, rows, cols, valid, scale, to_the_right)
        term, weight, below, above, s_below, s_above = _interpolated(counted, seen, s_rows, cap)
        probs = tl.where(seen, tl.exp(z + term - lse[:, None]), 0.0)
        dscore = probs * (tl.dot(do, tl.trans(v)) - delta[:, None])  # dL/dz through the softmax
        dv = tl.dot(tl.trans(probs.to(do.dtype)), do)
        tl.atomic_add(DV + offset + cols[:, None] * D + dims[None, :], dv, mask=key_mask, sem="relaxed")
        tl.atomic_add(ds_rows + below, dscore * (1 - weight), mask=seen, sem="relaxed")
        tl.atomic_add(ds_rows + above, dscore * weight, mask=seen & (weight > 0), sem="relaxed")
        dcounted = dscore * (s_above - s_below)  # 0 past the cap, where both corners are the cap
        dgates = dcounted_before[:, None] + tl.cumsum(dcounted, axis=1)  # dL/dg_it = sum_{j <= t} dL/dp_ij
        dcounted_before += tl.sum(dcounted, axis=1)
        dz = (dscore + dgates * gates * (1 - gates)) * scale
        dq += tl.dot(dz.to(k.dtype), k)
        dk = tl.dot(tl.trans(dz.to(q.dtype)), q)
        tl.atomic_add(DK + offset + cols[:, None] * D + dims[None, :], dk, mask=key_mask, sem="relaxed")
    tl.store(DQ + offset + rows[:, None] * D + dims[None, :], dq, mask=valid[:, None])


class ContextualAttention(torch.autograd.Function):
    """Causal softmax attention of q . k / sqrt(d) plus CoPE's interpolated per-position scores: q, k, v (B, H, L, d)
    in the kernel's dtype, by_position (B, H, L, P) -> (B, H, L, d)."""

    @staticmethod
    def forward(ctx, q, k, v, by_position):
        batch, heads, length, head_dim = q.shape
        q, k, v, by_position = (t.contiguous() for t in (q, k, v, by_position))
        tiles = TILES[q.device.type]
        keep = any(ctx.needs_input_grad)  # the gate sums carried into each key tile, for the backward
        shape = (batch, heads, length, triton.cdiv(length, tiles.keys)) if keep else (1,)
        carried = q.new_empty(shape, dtype=torch.float32)
        out = torch.empty_like(q)
        lse = q.new_empty(batch, heads, length, dtype=torch.float32)
        positions = by_position.size(-1)
        _forward[(triton.cdiv(length, tiles.forward_rows), batch * heads)](
            q, k, v, by_position, out, lse, carried, head_dim**-0.5, length, positions, float(positions - 1),
            D=head_dim, ROWS=tiles.forward_rows, KEYS=tiles.keys, KEEP=keep, num_warps=tiles.warps,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, by_position, out, lse, carried)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, by_position, out, lse, carried = ctx.saved_tensors
        batch, heads, length, head_dim = q.shape
        grad_out = grad_out.to(q.dtype).contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, L): sum_j P_ij dL/dP_ij
        dq = torch.empty_like(q, dtype=torch.float32)
        dk, dv, dby_position = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v, by_position))
        tiles = TILES[q.device.type]
        positions = by_position.size(-1)
        _backward[(triton.cdiv(length, tiles.backward_rows), batch * heads)](
            q, k, v, by_position, grad_out, lse, delta, carried, dq, dk, dv, dby_position, head_dim**-0.5, length,
            positions, float(positions - 1), D=head_dim, ROWS=tiles.backward_rows, KEYS=tiles.keys,
            num_warps=tiles.warps,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dby_position.to(by_position.dtype)


@torch.compiler.disable  # a Triton kernel inside an autograd function: the compiled block calls it as it is
def contextual_attention(q, k, v, by_position: torch.Tensor) -> torch.Tensor:
    """CoPE's causal attention (``ScoreTerms.contextual``): q, k, v (B, H, L, d), by_position (B, H, L, P) ->
    (B, H, L, d) in the autocast dtype (else q's)."""
    dtype = kernel_dtype(q)
    return ContextualAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), by_position)
