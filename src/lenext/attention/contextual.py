"""CoPE's attention as one Triton kernel, forward and backward: its scores never leave the chip.

No library has one (docs/scaling.md, "GPU speed per PE"). Query i's position of key j is the suffix sum
p_ij = sum_{t = j..i} g_it of the gates g_it = sigmoid(z_it) of its scaled logits z, capped at P - 1, and its
logit gains the row's per-position score s_i[p] = q_i . e[p] (``by_position``, (B, H, L, P)) interpolated at
p_ij. The forward walks a block of query rows leftwards over the key blocks from the diagonal, carrying the
row's gate sum, as a flash kernel carries its running maximum; it keeps the row's log-sum-exp and its gate total.
The backward walks rightwards, the positions recounted as the total less the gates to the left, and carries the
prefix sums of dL/dp that give each gate its gradient (dL/dg_it = sum_{j <= t} dL/dp_ij); key and value gradients
and the per-position scores' are added atomically in fp32. Imported only where Triton is (``lenext.attention``).
"""

import torch
import triton
import triton.language as tl

from lenext.attention.fla_kernels import kernel_dtype


@triton.jit
def _interpolated(counted, seen, s_rows, cap):
    """Each pair's score s_i[p] interpolated at its position p (capped at ``cap``): (score, weight on the corner
    above, the two corners' indices, the two corners' scores)."""
    capped = tl.minimum(tl.maximum(counted, 0.0), cap)
    below = tl.floor(capped)
    weight = capped - below
    below_index, above_index = below.to(tl.int32), tl.ceil(capped).to(tl.int32)
    s_below = tl.load(s_rows + below_index, mask=seen, other=0.0).to(tl.float32)
    s_above = tl.load(s_rows + above_index, mask=seen, other=0.0).to(tl.float32)
    return s_above * weight + s_below * (1 - weight), weight, below_index, above_index, s_below, s_above


@triton.jit
def _forward(Q, K, V, S, OUT, LSE, TOTAL, scale, length, positions, cap, D: tl.constexpr, BLOCK: tl.constexpr):
    block, head = tl.program_id(0), tl.program_id(1).to(tl.int64)  # head: batch x heads (offsets past 2^31)
    rows, cols0, dims = block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, BLOCK), tl.arange(0, D)
    offset = head * length * D
    q = tl.load(Q + offset + rows[:, None] * D + dims[None, :], mask=rows[:, None] < length, other=0.0)
    s_rows = S + head * length * positions + rows[:, None] * positions  # (BLOCK, 1) pointers to each row's s_i
    to_the_right = tl.zeros([BLOCK], tl.float32)  # each row's gate sum over the keys after the tile
    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for step in range(0, block + 1):  # the key blocks from the diagonal leftwards
        cols = (block - step) * BLOCK + cols0
        k = tl.load(K + offset + cols[:, None] * D + dims[None, :], mask=cols[:, None] < length, other=0.0)
        v = tl.load(V + offset + cols[:, None] * D + dims[None, :], mask=cols[:, None] < length, other=0.0)
        z = tl.dot(q, tl.trans(k)) * scale
        seen = (cols[None, :] <= rows[:, None]) & (cols[None, :] < length)
        gates = tl.where(seen, tl.sigmoid(z), 0.0)
        counted = tl.cumsum(gates, axis=1, reverse=True) + to_the_right[:, None]
        to_the_right += tl.sum(gates, axis=1)
        term, _, _, _, _, _ = _interpolated(counted, seen, s_rows, cap)
        score = tl.where(seen, z + term, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(score, axis=1))  # finite: each row sees a key of the diagonal block
        rescale = tl.exp(row_max - new_max)
        weights = tl.exp(score - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        row_max = new_max
    valid = rows < length
    out = (acc / row_sum[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + offset + rows[:, None] * D + dims[None, :], out, mask=valid[:, None])
    tl.store(LSE + head * length + rows, row_max + tl.log(row_sum), mask=valid)
    tl.store(TOTAL + head * length + rows, to_the_right, mask=valid)


@triton.jit
def _backward(
    Q, K, V, S, DO, LSE, DELTA, TOTAL, DQ, DK, DV, DS, scale, length, positions, cap,
    D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    block, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows, cols0, dims = block * BLOCK + tl.arange(0, BLOCK), tl.arange(0, BLOCK), tl.arange(0, D)
    offset = head * length * D
    valid = rows < length
    q = tl.load(Q + offset + rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(DO + offset + rows[:, None] * D + dims[None, :], mask=valid[:, None], other=0.0)
    lse = tl.load(LSE + head * length + rows, mask=valid, other=0.0)
    delta = tl.load(DELTA + head * length + rows, mask=valid, other=0.0)
    total = tl.load(TOTAL + head * length + rows, mask=valid, other=0.0)
    s_rows = S + head * length * positions + rows[:, None] * positions
    ds_rows = DS + head * length * positions + rows[:, None] * positions
    to_the_left = tl.zeros([BLOCK], tl.float32)  # each row's gate sum over the keys before the tile
    dcounted_before = tl.zeros([BLOCK], tl.float32)  # and of dL/dp
    dq = tl.zeros([BLOCK, D], tl.float32)
    for n in range(0, block + 1):  # the key blocks from the first rightwards
        cols = n * BLOCK + cols0
        key_mask = cols[:, None] < length
        k = tl.load(K + offset + cols[:, None] * D + dims[None, :], mask=key_mask, other=0.0)
        v = tl.load(V + offset + cols[:, None] * D + dims[None, :], mask=key_mask, other=0.0)
        z = tl.dot(q, tl.trans(k)) * scale
        seen = (cols[None, :] <= rows[:, None]) & valid[:, None]
        gates = tl.where(seen, tl.sigmoid(z), 0.0)
        counted = total[:, None] - to_the_left[:, None] - tl.cumsum(gates, axis=1) + gates  # sum over t >= j
        to_the_left += tl.sum(gates, axis=1)
        term, weight, below, above, s_below, s_above = _interpolated(counted, seen, s_rows, cap)
        probs = tl.where(seen, tl.exp(z + term - lse[:, None]), 0.0)
        dscore = probs * (tl.dot(do, tl.trans(v)) - delta[:, None])  # dL/dz through the softmax
        tl.atomic_add(
            DV + offset + cols[:, None] * D + dims[None, :], tl.dot(tl.trans(probs.to(do.dtype)), do), mask=key_mask
        )
        tl.atomic_add(ds_rows + below, dscore * (1 - weight), mask=seen)
        tl.atomic_add(ds_rows + above, dscore * weight, mask=seen)
        dcounted = dscore * (s_above - s_below)  # 0 past the cap, where both corners are the cap
        dgates = dcounted_before[:, None] + tl.cumsum(dcounted, axis=1)  # dL/dg_it = sum_{j <= t} dL/dp_ij
        dcounted_before += tl.sum(dcounted, axis=1)
        dz = (dscore + dgates * gates * (1 - gates)) * scale
        dq += tl.dot(dz.to(k.dtype), k)
        tl.atomic_add(
            DK + offset + cols[:, None] * D + dims[None, :], tl.dot(tl.trans(dz.to(q.dtype)), q), mask=key_mask
        )
    tl.store(DQ + offset + rows[:, None] * D + dims[None, :], dq, mask=valid[:, None])


def block_size(q: torch.Tensor) -> int:
    """Query and key rows a tile: 64 on a GPU; 16 under Triton's interpreter, so short test sequences span blocks."""
    return 64 if q.is_cuda else 16


class ContextualAttention(torch.autograd.Function):
    """Causal softmax attention of q . k / sqrt(d) plus CoPE's interpolated per-position scores: q, k, v (B, H, L, d)
    in the kernel's dtype, by_position (B, H, L, P) -> (B, H, L, d)."""

    @staticmethod
    def forward(ctx, q, k, v, by_position):
        batch, heads, length, head_dim = q.shape
        q, k, v, by_position = (t.contiguous() for t in (q, k, v, by_position))
        out = torch.empty_like(q)
        lse, total = (q.new_empty(batch, heads, length, dtype=torch.float32) for _ in range(2))
        block = block_size(q)
        grid = (triton.cdiv(length, block), batch * heads)
        positions = by_position.size(-1)
        _forward[grid](
            q, k, v, by_position, out, lse, total, head_dim**-0.5, length, positions, float(positions - 1),
            D=head_dim, BLOCK=block,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, by_position, out, lse, total)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, by_position, out, lse, total = ctx.saved_tensors
        batch, heads, length, head_dim = q.shape
        grad_out = grad_out.to(q.dtype).contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, L): sum_j P_ij dL/dP_ij
        dq = torch.empty_like(q, dtype=torch.float32)
        dk, dv, dby_position = (torch.zeros_like(t, dtype=torch.float32) for t in (k, v, by_position))
        block = block_size(q)
        grid = (triton.cdiv(length, block), batch * heads)
        positions = by_position.size(-1)
        _backward[grid](
            q, k, v, by_position, grad_out, lse, delta, total, dq, dk, dv, dby_position, head_dim**-0.5, length,
            positions, float(positions - 1), D=head_dim, BLOCK=block,
        )  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dby_position.to(by_position.dtype)


@torch.compiler.disable  # a Triton kernel inside an autograd function: the compiled block calls it as it is
def contextual_attention(q, k, v, by_position: torch.Tensor) -> torch.Tensor:
    """CoPE's causal attention (``ScoreTerms.contextual``): q, k, v (B, H, L, d), by_position (B, H, L, P) ->
    (B, H, L, d) in the autocast dtype (else q's)."""
    dtype = kernel_dtype(q)
    return ContextualAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), by_position)
