"""The one attention call site, ``causal_attention``: the first of ``FUSED_PATHS`` that serves the call computes
it, else ``explicit``.

A fused path is a function of the call (``AttentionCall``) that returns its output, or None where it does not serve
it exactly. Which one serves follows from the forms of score bias the PE provides (``lenext.pe.base``;
docs/pes/index.md, "Attention paths"), never from its name. In order, cheapest first:

- ``sdpa_causal``: no score bias (NoPE, APEs, RoPE): SDPA ``is_causal``;
- ``fla_path``: while training on CUDA under bf16 (or fp16) with fla installed, log gates (FoX's) and Householder
  products (PaTH's), alone or together, and stick-breaking of q . k alone: fla's kernels (``fla_kernels``);
- ``contextual_path``: CoPE's logit term alone, on CUDA under bf16 (or fp16): lenext's CoPE kernel
  (``contextual``), its scores kept on chip;
- ``key_channels``: a key bias that needs a gradient (FoX's), but on CUDA in fp32: SDPA ``is_causal`` in fp32
  (also under bf16), the bias as an extra channel of q and k;
- ``flex_band_values``, ``flex_path``: on CUDA, one band bias with a value term of the band (Shaw's a^V), flex
  with its log-sum-exp; biases that each have a ``score_mod``, a key or a band form, and any sliding window (as a
  block mask): compiled FlexAttention, no (L, L) tensor;
- ``sdpa_key_mask``: a key bias (ALiBi): a (B or 1, H, 1, L) fp32 mask on SDPA's fused causal kernel;
- ``banded``: a band bias (T5, Shaw), with a value term of the band or not, on CPU: ``BandedAttention``, the fused
  causal flash kernel for the keys beyond the band (bias 0) and the W band keys scored directly, O(L W) memory;
- ``explicit``, the rest (a pair bias: KERPLE, FIRE; a value term beside other biases; logits the PE computes
  itself: Self-Extend; a window on CPU; no fused kernel): explicit scores in query blocks, no (L, L) tensor.
The PE gives biases; every mask (causal, the band's, a window's) is built here or in ``flex``. A new kernel is a
path function and its place in ``FUSED_PATHS``.

The kernels live beside it: ``band`` (BandedAttention, CPU), ``flex`` (FlexAttention, CUDA), ``fla_kernels``
(fla's Triton kernels, CUDA), ``contextual`` (lenext's CoPE kernel in Triton, CUDA).
``recording(callback)`` sends every call down the explicit path and hands the callback each query block's
weights (lenext.diagnostics).
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lenext.attention.band import BandedAttention, band_mask, cpu_flash, diagonal_band
from lenext.attention.fla_kernels import fla_attention, fla_serves, triton_serves
from lenext.attention.flex import (
    band_score_mod,
    band_values_attention,
    causal_block_mask,
    compiled_flex_attention,
    flex_attention,
    key_score_mod,
    window_block_mask,
)
from lenext.errors import ConfigError
from lenext.pe.base import (
    NO_TERMS,
    BandValues,
    Bias,
    Logits,
    LogitTerm,
    ScoreTerms,
    device_budget,
    kernel_dtype,
    keys_product,
    values_product,
)
from lenext.ranges import PositiveInt

# Float elements of mask per query block on the explicit path, by device. CPU: small enough for the heap to reuse
# each block's mask instead of mapping it afresh; the output is preallocated, as concatenated block outputs fragment
# the heap (docs/performance.md, "Memory"). CUDA: large enough that a block's kernels are not launch-bound.
SCORE_BLOCK_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}

# The head dims a device's fused SDPA kernels take: CUDA's flash and efficient kernels multiples of 8 only (else SDPA
# runs its (L, L) math path), so ``key_bias_channels_attention`` pads its extra channels with zeros to one.
HEAD_DIM_MULTIPLE = {"cuda": 8}

# The head dims lenext's CoPE kernel has tiles for (lenext.attention.contextual, which imports Triton): powers of
# two, from tl.dot's least, 16.
CONTEXTUAL_HEAD_DIMS = (16, 32, 64, 128)

# Attention recording (lenext.diagnostics): the callback ``recording`` set, or None. Not part of the paths above.
AttentionRecorder = Callable[[torch.Tensor, int, int, int], None]
_recorder: AttentionRecorder | None = None  # a module global, not a ContextVar: torch.compile traces a global


@contextmanager
def recording(callback: AttentionRecorder) -> Iterator[None]:
    """While the block runs, every ``causal_attention`` takes the explicit path (no fused kernel, no SDPA) and calls
    ``callback(weights, start, end, first)`` with each query block's attention weights: (B, H, end - start,
    end - first) in the scores' dtype (fp32; float64 for float64 q), detached, of query rows [start, end) against
    keys [first, end), 0 on keys a row does not see; every PE's biases, value term, logits and logit terms, the
    window, the length scale and the normalizer in them, as the layer computes them. Under stick-breaking the weight
    a row leaves over (on its own value) is put on its own key, so each row sums to 1 as under softmax.
    The callback must not keep the tensor beyond the call if memory matters: blocks are O(SCORE_BLOCK_ELEMENTS)."""
    global _recorder
    previous, _recorder = _recorder, callback
    try:
        yield
    finally:
        _recorder = previous


@dataclass(frozen=True)
class AttentionSettings:
    """configs/train.yaml's ``attention`` node: what every layer's attention does besides its PE (docs/attention.md).

    - ``window``: each query attends to its last ``window`` keys, itself included (sliding-window attention);
      null: all keys before it. A layer of a per-layer PE mix may set its own (``pe.windows``).
    - ``scale``: each query row's logits, biases included, multiplied by a function of n, the number of keys it
      attends: ``none``; ``ssmax``, s_h log n with s_h learned per head and layer (Scalable-Softmax, Nakanishi
      2025), starting at 1 / log L_train; ``logn``, log n / log L_train, fixed (log-length scaling).
    - ``normalizer``: how the logits become attention weights: ``softmax``, or ``stick_breaking`` (Tan et al.
      2025): A_ij = sigmoid(z_ij) prod_{j < t < i} (1 - sigmoid(z_it)), a query not attending to itself, the
      weight left over (1 - sum_j A_ij) on its own value, as shawntan/stickbreaking-attention's ``sb_ref`` and
      its tests.
    - ``qk_norm``: q and k each RMS-normalized over the layer's whole projection (all heads together), with a
      learned gain per channel starting at 1, before the heads are split and the PE applied: SakanaAI/DroPE's
      ``qk_norm_nope`` attention (custom_models/attention.py), which DroPE recalibrates with (docs/extension.md).
    """

    window: PositiveInt | None = None
    scale: Literal["none", "ssmax", "logn"] = "none"
    normalizer: Literal["softmax", "stick_breaking"] = "softmax"
    qk_norm: bool = False


def logit_temperature(c: float | None, length: int, train_len: int) -> float:
    """The evaluation-time logit temperature beta(s) = 1 + c ln s, s = length / train_len, at sequences of
    ``length`` tokens of a model trained at ``train_len``: 1 at s <= 1 and for c None (docs/evaluation.md)."""
    if c is None or length <= train_len:
        return 1.0
    return 1.0 + c * math.log(length / train_len)


class LengthScale(nn.Module):
    """The row scale of ``AttentionSettings.scale`` for one layer: (1, H, L, 1) fp32, or None for ``none``; times
    the evaluation-time logit temperature beta(L / L_train) while ``temperature`` (its c) is set
    (``lenext.temperature``): (1, 1, L, 1) alone, None where beta is 1."""

    def __init__(self, settings: AttentionSettings, n_heads: int, train_len: int):
        super().__init__()
        self.kind, self.n_heads, self.train_len = settings.scale, n_heads, train_len
        self.start = 1 / math.log(max(train_len, 2))  # 1 at n = L_train
        self.temperature: float | None = None  # c of beta(s) = 1 + c ln s; None: no temperature (training)
        if self.kind == "ssmax":
            self.per_head = nn.Parameter(torch.full((n_heads,), self.start))

    def forward(self, length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        # A windowed layer's rows attend at most W keys, however long the sequence: its logits dilute no further.
        beta = logit_temperature(self.temperature, min(length, window or length), self.train_len)
        scale = self._scale(length, window, device)
        if beta == 1.0:
            return scale
        return torch.full((1, 1, length, 1), beta, device=device) if scale is None else scale * beta

    def _scale(self, length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        if self.kind == "none":
            return None
        attended = torch.arange(1, length + 1, device=device, dtype=torch.float32)
        if window is not None:
            attended = attended.clamp(max=window)
        per_head = (
            self.per_head.float() if self.kind == "ssmax" else torch.full((self.n_heads,), self.start, device=device)
        )
        return (per_head[:, None] * attended.log())[None, :, :, None]


@cache
def fused_mask_with_causal(device_type: str) -> bool:
    """Whether SDPA accepts an additive mask together with is_causal=True on this device.

    torch 2.13 on CPU does (one fused kernel, no (L, L) mask); older versions raise.
    """
    q = torch.zeros(1, 1, 2, 2, device=device_type)
    try:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 2, device=device_type), is_causal=True)
    except RuntimeError:
        return False
    return True


def _sdpa_keep_mask(q, k, v, attn_mask: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """SDPA with the additive mask kept in its own dtype (fp32 for ALiBi), also under autocast.

    Autocast (and a cast to q's dtype) would round the mask to bf16, whose 8-bit mantissa loses
    ALiBi's key offsets m * (j - anchor) beyond 256 positions: logit errors of order 1 at long lengths.
    SDPA accepts an fp32 mask with bf16 q, k, v on CPU (with or without is_causal); on CUDA it refuses any mask
    together with is_causal (torch 2.11, probed on an H100: ``fused_mask_with_causal``). With float64 q, k, v and
    an fp32 mask its CPU kernel returns wrong values (torch 2.13, no error): the mask goes up to float64 there.
    """
    mask = attn_mask.to(torch.promote_types(q.dtype, attn_mask.dtype))
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def causal_attention(
    q,
    k,
    v,
    terms: ScoreTerms = NO_TERMS,
    window: int | None = None,
    row_scale: torch.Tensor | None = None,
    stick_breaking: bool = False,
) -> torch.Tensor:
    """Causal attention with a layer's score terms, on the first of ``FUSED_PATHS`` that serves them exactly, else
    on the explicit path.

    q, k: (B, H, L, d_qk), v: (B, H, L, d_head) -> (B, H, L, d_head); d_qk >= d_head (PoPE's q and k are twice as
    wide), the logits scaled by 1/sqrt(d_qk). ``window``: each query sees its last ``window`` keys
    (itself included) only; ``row_scale`` (B or 1, H, L, 1): each query row's logits, biases included,
    multiplied by it (SSMax); ``stick_breaking``: the weights by stick-breaking instead of softmax
    (``AttentionSettings``).
    """
    width = v.size(-1)
    # q, k wider than v (PoPE): every path then sees one head dim, which the fused kernels need (the explicit ones
    # pay the zero channels; a value term is v's width, so it keeps the explicit path unpadded)
    if q.size(-1) > width and terms.value is None:
        v = F.pad(v, (0, q.size(-1) - width))
        return causal_attention(q, k, v, terms, window, row_scale, stick_breaking)[..., :width]
    if stick_breaking and not all(b.pair for b in terms.biases):  # SelfAttention refuses it at build time first
        raise ConfigError(
            "attention.normalizer=stick_breaking is invalid with this PE: a bias given up to a per-row constant "
            "(without a pair form), which softmax ignores and stick-breaking does not"
        )
    if stick_breaking and terms.value is not None:
        raise ConfigError(
            "attention.normalizer=stick_breaking is invalid with a value term (Shaw's a^V): its band form needs "
            "a row's weights to sum to 1, and stick-breaking's do not"
        )
    if row_scale is not None:
        q = q * row_scale.to(q.dtype)  # exact for q.k; each bias path scales its bias too, or does not serve
    if window is not None and window >= q.size(-2):
        window = None  # every row sees all its keys
    call = AttentionCall.of(q, k, v, terms, window, row_scale, stick_breaking)
    for path in FUSED_PATHS:
        out = path(call)
        if out is not None:
            return out
    return explicit(call)


@dataclass(frozen=True)
class AttentionCall:
    """One ``causal_attention`` call as the paths see it: q already scaled by ``row_scale``, a window shorter than
    the sequence (else None), and ``key``, the sum of the key biases' key forms (B or 1, H, 1, L), where a fused
    kernel may take the biases as one key bias (else None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    terms: ScoreTerms
    window: int | None
    row_scale: torch.Tensor | None
    stick_breaking: bool
    key: torch.Tensor | None = None

    @classmethod
    def of(cls, q, k, v, terms: ScoreTerms, window, row_scale, stick_breaking: bool) -> "AttentionCall":
        call = cls(q, k, v, terms, window, row_scale, stick_breaking)
        biases = terms.biases
        # the keys' sum, unless flex takes every bias by its own score_mod (ALiBi's on CUDA)
        keyed = call.fused and row_scale is None and len(biases) > 0 and all(b.key for b in biases)
        if not keyed or (call.flex and all(b.flex for b in biases)):
            return call
        key = sum(b.key(0, q.size(-2)) for b in biases)
        return cls(q, k, v, terms, window, row_scale, stick_breaking, key)

    @property
    def unrecorded(self) -> bool:
        """No logit term and no recording: fused kernels compute the scores of q . k or the PE's logits, plus
        biases (recording needs the explicit path's weights)."""
        return len(self.terms.logit_terms) == 0 and _recorder is None

    @property
    def bare(self) -> bool:
        """Unrecorded, without a value term: under either normalizer (fla's kernel is stick-breaking's only
        fused path)."""
        return self.unrecorded and self.terms.value is None

    @property
    def plain(self) -> bool:
        """Bare under softmax, on q . k plus biases (no logits of the PE's own)."""
        return self.bare and not self.stick_breaking and self.terms.logits is None

    @property
    def fused(self) -> bool:
        """Plain, on every key before each query (no window)."""
        return self.plain and self.window is None

    @property
    def band_values(self) -> bool:
        """A value term of the band beside one band bias (Shaw's a^V), alone: it needs only the band's weights,
        which the band's fused paths have (BandedAttention's band, flex's log-sum-exp)."""
        biases = self.terms.biases
        return (
            self.terms.value is not None
            and self.unrecorded
            and not self.stick_breaking
            and self.terms.logits is None
            and self.window is None
            and self.row_scale is None
            and len(biases) == 1
            and biases[0].band is not None
            and self.q.size(-1) == self.v.size(-1)
        )

    @property
    def flex(self) -> bool:
        """Compiled FlexAttention may take the call: plain, no row scale, on CUDA, every bias with a score_mod of
        its own or a key or band form to make one of."""
        plain = self.plain and self.row_scale is None and flex_available(self.q)
        return plain and all(b.flex or b.key or b.band for b in self.terms.biases)


def sdpa_causal(call: AttentionCall) -> torch.Tensor | None:
    """No score bias (NoPE, APEs, RoPE): SDPA ``is_causal``."""
    if call.fused and not call.terms.biases:
        return F.scaled_dot_product_attention(call.q, call.k, call.v, is_causal=True)
    return None


def fla_path(call: AttentionCall) -> torch.Tensor | None:
    """While training on CUDA under bf16 (or fp16) with fla installed: FoX's log gates and PaTH's Householder
    products, alone or together, and stick-breaking of q . k alone, by fla's kernels."""
    served = call.bare and call.row_scale is None and torch.is_grad_enabled()
    if served and fla_serves(call.q, call.terms, call.window, call.stick_breaking):
        return fla_attention(call.q, call.k, call.v, call.terms, call.window, call.stick_breaking)
    return None


def contextual_path(call: AttentionCall) -> torch.Tensor | None:
    """CoPE's logit term alone on the scores (no bias, value term, logits of a PE's own, window, row scale or
    recording), under softmax, a head dim the kernel has tiles for, where Triton kernels serve q's device and dtype
    (``triton_serves``), Triton installed: lenext's CoPE kernel, its scores kept on chip."""
    terms = call.terms
    if terms.contextual is None:
        return None
    # len(), not truthiness: dynamo does not trace ``not`` of a tuple of functions (a block compiles whole)
    alone = len(terms.biases) == 0 and terms.value is None and terms.logits is None and len(terms.logit_terms) == 1
    plain = alone and call.window is None and call.row_scale is None and not call.stick_breaking
    served = plain and _recorder is None and call.q.size(-1) in CONTEXTUAL_HEAD_DIMS and triton_serves(call.q)
    if served and contextual_kernel() is not None:
        return contextual_kernel()(call.q, call.k, call.v, terms.contextual())
    return None


def key_channels(call: AttentionCall) -> torch.Tensor | None:
    """A key bias that needs a gradient (FoX's), in fp32 where flex would compute it from bf16 scores (whose
    gradient of FoX's gate bias is 80% off: docs/performance.md): SDPA ``is_causal``, the bias an extra channel of
    q and k (``key_bias_channels_attention``)."""
    key = call.key
    if key is None or not key.requires_grad or not torch.is_grad_enabled():
        return None
    if call.flex and call.q.dtype.itemsize >= 4:
        return None
    return key_bias_channels_attention(call.q, call.k, call.v, key)


def flex_band_values(call: AttentionCall) -> torch.Tensor | None:
    """One band bias with a value term of the band (Shaw's a^V) on CUDA: flex with its log-sum-exp, from which the
    band's weights and the value term follow."""
    if call.band_values and flex_available(call.q):
        band, values = matched_bands(call.terms.biases[0].band(), call.terms.value)
        return band_values_attention(flex_kernel(), call.q, call.k, call.v, band, values)
    return None


def flex_path(call: AttentionCall) -> torch.Tensor | None:
    """On CUDA, biases that each have a ``score_mod``, a key or a band form, and any sliding window (as a block
    mask): compiled FlexAttention, no (L, L) tensor. A key bias without a score_mod of its own (FoX's) as one: CUDA's
    SDPA takes no mask with is_causal."""
    if not call.flex:
        return None
    biases, length = call.terms.biases, call.q.size(-2)
    if call.key is not None and not any(b.flex for b in biases):
        score_mods = [key_score_mod(call.key)]
    else:
        score_mods = [flex_score_mod(b, length) for b in biases]
    if not all(score_mods):  # a PE may have no score_mod for these positions (FIRE past its threshold)
        return None
    if call.window is None:
        mask = causal_block_mask(length, call.q.device)
    else:
        mask = window_block_mask(length, call.window, call.q.device)
    score_mod = summed_score_mods(score_mods) if score_mods else None
    return flex_kernel()(call.q, call.k, call.v, score_mod=score_mod, block_mask=mask)


def sdpa_key_mask(call: AttentionCall) -> torch.Tensor | None:
    """A key bias (ALiBi's): a (B or 1, H, 1, L) fp32 mask on SDPA's fused causal kernel, O(L) memory at any
    length, where the device's SDPA takes a mask with is_causal."""
    if call.key is None or not fused_mask_with_causal(call.q.device.type):
        return None
    # a strided mask (FoX's, a view of (B, L, H) gates) sends SDPA to (H, L, L) scores
    return _sdpa_keep_mask(call.q, call.k, call.v, attn_mask=call.key.contiguous(), is_causal=True)


def banded(call: AttentionCall) -> torch.Tensor | None:
    """One band bias (T5, Shaw), with a value term of the band or not, on CPU: ``BandedAttention``, the fused causal
    flash kernel for the keys beyond the band (bias 0) and the W band keys scored directly, in O(L W) extra memory.
    It computes in fp32: a float64 model (the oracles' reference) takes the explicit path."""
    biases, q = call.terms.biases, call.q
    one_band = len(biases) == 1 and biases[0].band is not None
    if not ((call.fused or call.band_values) and one_band and q.device.type == "cpu" and q.dtype != torch.float64):
        return None
    if not cpu_flash():
        return None
    band = biases[0].band()  # (B or 1, H, L, W)
    with torch.autocast(q.device.type, enabled=False):  # the band products stay fp32 under bf16
        if call.terms.value is None:
            scaled = band if call.row_scale is None else band * call.row_scale
            return BandedAttention.apply(q, call.k, call.v, scaled)
        band, values = matched_bands(band, call.terms.value)
        return (BandedAttention.apply(q, call.k, call.v, band, values.band) + values.far).to(q.dtype)


def explicit(call: AttentionCall) -> torch.Tensor:
    """Any call (a pair bias: KERPLE, FIRE; a value term beside other biases; logits the PE computes itself:
    Self-Extend; a window on CPU; no fused kernel): explicit scores in query blocks, so no (L, L) tensor at once."""
    terms = call.terms
    bias = explicit_bias(terms.biases, call.q, call.window, call.row_scale)
    return _blocked_attention(
        call.q,
        call.k,
        call.v,
        bias,
        terms.value,
        terms.logits,
        call.row_scale,
        call.window,
        terms.logit_terms,
        call.stick_breaking,
    )


# The fused paths, cheapest first: ``causal_attention`` takes the first whose output is not None, else ``explicit``.
FUSED_PATHS: tuple[Callable[[AttentionCall], torch.Tensor | None], ...] = (
    sdpa_causal,
    fla_path,
    contextual_path,
    key_channels,
    flex_band_values,
    flex_path,
    sdpa_key_mask,
    banded,
)


@cache
def contextual_kernel() -> Callable | None:
    """``lenext.attention.contextual.contextual_attention``, or None without Triton (imported on first use)."""
    try:
        from lenext.attention.contextual import contextual_attention
    except ImportError:
        return None
    return contextual_attention


def matched_bands(band: torch.Tensor, values: BandValues) -> tuple[torch.Tensor, BandValues]:
    """A band bias (B or 1, H, L, W) and a value term of a band at one width, the narrower widened by its farthest
    keys (bias 0; their values gain ``far`` alone)."""
    width = max(band.size(-1), values.band.size(-2))
    return F.pad(band, (width - band.size(-1), 0)), values.widened(width)


def flex_kernel() -> Callable:
    """flex_attention compiled; in a block torch.compile traces, flex_attention itself, which dynamo compiles with
    the block (a call of torch.compile there, which Lightning wraps, would break the block's graph)."""
    return flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()


def flex_score_mod(bias: Bias, length: int) -> Callable | None:
    """A bias as a score_mod: its own (None where it has none for these positions), else its key or band form's."""
    if bias.flex is not None:
        return bias.flex()
    return key_score_mod(bias.key(0, length)) if bias.key is not None else band_score_mod(bias.band())


def flex_available(q: torch.Tensor) -> bool:
    """Whether compiled FlexAttention serves q's device: CUDA only (on CPU it has no backward and compiles for
    seconds: docs/performance.md)."""
    return q.is_cuda and flex_attention is not None


def summed_score_mods(score_mods: list) -> Callable:
    """One FlexAttention score_mod adding every bias's."""
    if len(score_mods) == 1:
        return score_mods[0]

    def summed(score, b, h, q_idx, kv_idx):
        for score_mod in score_mods:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return score

    return summed


def key_bias_channels_attention(q, k, v, key: torch.Tensor) -> torch.Tensor:
    """Fused causal SDPA with a key bias that needs a gradient (FoX's), carried as an extra channel of q and k.

    SDPA refuses a mask that needs a gradient with is_causal, and without it runs its (L, L) math path. But a key
    bias is a product: q_i . k_j / sqrt(d) + b_j = [q_i, 1] . [k_j, b_j sqrt(d)] / sqrt(d), so the fused kernel
    scores it and autograd carries dL/db through k's extra channel. In fp32 (float64 for float64 q) under any
    autocast: a kernel's gradients come out in its dtype, and b's in bf16 (0.4% each) loses the gate's, which sums
    them over the tokens, where they nearly cancel (docs/pes/fox.md). v gets a zero channel: the kernel is fused only
    when q, k and v have one head dim (on CUDA, a multiple of 8: all three get zero channels to it).
    key: (B or 1, H, 1, L) fp32 (float64 with float64 q, k, v).
    """
    head_dim, device = q.size(-1), q.device.type
    dtype = kernel_dtype(q)
    wide = torch.promote_types(q.dtype, torch.float32)
    zeros = -(head_dim + 1) % HEAD_DIM_MULTIPLE.get(device, 1)
    channel = key.transpose(-2, -1).to(wide).expand(*k.shape[:-1], 1) * head_dim**0.5  # (B, H, L, 1)
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    with torch.autocast(device, enabled=False):
        out = F.scaled_dot_product_attention(
            F.pad(torch.cat([q, torch.ones_like(q[..., :1])], -1), (0, zeros)),
            F.pad(torch.cat([k, channel], -1), (0, zeros)),
            F.pad(v, (0, 1 + zeros)),
            is_causal=True,
            scale=head_dim**-0.5,
        )
    return out[..., :head_dim].to(dtype)


def explicit_bias(
    biases: tuple[Bias, ...], q, window: int | None = None, row_scale: torch.Tensor | None = None
) -> Callable[[int, int, int], torch.Tensor]:
    """The score biases summed, as masks of query blocks, for the explicit path.

    Returns ``(start, end, first) -> (B or 1, H, end - start, end - first)`` (or broadcastable) fp32: the bias of
    query rows [start, end) against keys [first, end), scaled by the rows' ``row_scale``, -inf on future keys and
    on keys outside the ``window``, from whichever form each bias gives (a band only when it has no other).
    """
    bands = [b.band() if b.band and not (b.pair or b.key) else None for b in biases]

    def one(bias: Bias, band: torch.Tensor | None, start: int, end: int, first: int) -> torch.Tensor:
        if bias.pair is not None:
            return bias.pair(start, end, first)
        if bias.key is not None:
            # Recomputed per block, anchored at its last key: the values that matter stay small.
            return bias.key(first, end)
        mask = band_mask(band[..., start:end, :], start, end)  # keys [max(0, start - W + 1), end)
        before = end - first - mask.size(-1)  # keys before the band: bias 0 (or cut off by the window)
        return F.pad(mask, (before, 0)) if before >= 0 else mask[..., -before:]

    def block(start: int, end: int, first: int) -> torch.Tensor:
        rows, keys = torch.arange(start, end, device=q.device)[:, None], torch.arange(first, end, device=q.device)
        hidden = keys > rows if window is None else (keys > rows) | (keys <= rows - window)
        total = None
        for bias, band in zip(biases, bands, strict=True):
            term = one(bias, band, start, end, first)
            total = term if total is None else total + term
        if total is None:
            return torch.zeros(end - start, end - first, device=q.device).masked_fill_(hidden, float("-inf"))
        if window is None and row_scale is None and all(band is not None for band in bands):
            return total  # band masks hold the causal -inf already
        if row_scale is not None:  # a band's own -inf (future keys) cleared first: row 0's scale is log 1 = 0
            total = total.masked_fill(hidden, 0.0) * row_scale[..., start:end, :]
        return torch.where(hidden, float("-inf"), total)

    return block


def _blocked_attention(
    q,
    k,
    v,
    bias: Callable[[int, int, int], torch.Tensor],
    value_term: BandValues | None = None,
    logits: Logits | None = None,
    row_scale: torch.Tensor | None = None,
    window: int | None = None,
    logit_terms: tuple[LogitTerm, ...] = (),
    stick_breaking: bool = False,
) -> torch.Tensor:
    """Explicit scores, one block of query rows at a time against the keys it sees (``logits``: the PE's own
    scores instead of q k^T / sqrt(d_head), multiplied here by ``row_scale``, which q already carries; each of
    ``logit_terms`` added to the masked logits, from them).

    A mask that needs no gradient (evaluation) goes to SDPA's fused CPU kernel, which takes it in fp32 with bf16
    q, k, v. One that does (training KERPLE, FIRE) would send SDPA to its math path, which rescales q and k and
    checks for fully masked rows (1.4x slower per KERPLE layer at L 512); then, and on CUDA (whose kernel refuses
    an fp32 mask without is_causal), the scores are written out: q k^T in the model's dtype, then fp32 with the bias.
    """
    batch, heads, length, head_dim = q.shape
    wide = torch.promote_types(q.dtype, torch.float32)  # the scores' dtype: fp32 (float64 for float64 q)
    budget = device_budget(SCORE_BLOCK_ELEMENTS, q.device) // (batch * heads)  # mask elements per head
    if window is None or window >= length:
        rows = max(1, budget // length)  # masks of (rows, at most L)
    else:  # a block of r rows sees r + W - 1 keys: the largest r with r (r + W - 1) <= budget
        rows = max(1, int((math.sqrt((window - 1) ** 2 + 4 * budget) - (window - 1)) / 2))
    blocks = -(-length // rows)  # the fewest within the budget, their rows spread evenly (no runt last block)
    out = q.new_empty(batch, heads, length, v.size(-1))  # written block by block: see SCORE_BLOCK_ELEMENTS
    record = _recorder
    plain = value_term is None and logits is None and len(logit_terms) == 0 and not stick_breaking
    for index in range(blocks):  # query blocks attend to keys [first, end)
        start, end = length * index // blocks, length * (index + 1) // blocks
        first = 0 if window is None else max(0, start - window + 1)
        q_block = q[:, :, start:end]
        mask = bias(start, end, first)
        if plain and not mask.requires_grad and q.device.type == "cpu" and record is None:
            out[:, :, start:end] = _sdpa_keep_mask(q_block, k[:, :, first:end], v[:, :, first:end], attn_mask=mask)
            continue
        if logits is None:  # the products over widened keys: a few shapes under bf16 on a CPU (``widened_end``)
            scores = keys_product(q_block, k, first, end).to(wide).mul_(head_dim**-0.5)
        else:
            scores = logits(start, end)[..., first:]
            if row_scale is not None:
                scores = scores * row_scale[..., start:end, :]
        scores = scores.add_(mask) if logits is None else scores + mask  # a PE's logits may be views of its own
        for term in logit_terms:  # under a length scale the term is scaled with the rest of the logit
            added = term(scores, start, end, first)
            scores = scores + (added if row_scale is None else added * row_scale[..., start:end, :])
        if stick_breaking:
            weights = stick_breaking_weights(scores, start, first)  # (B, H, rows, end - first)
        else:
            weights = scores.softmax(-1)
        block = values_product(weights.to(v.dtype), v, first, end)
        if stick_breaking:  # the weight left over: on the query's own value
            block = block + (1 - weights.sum(-1, keepdim=True)).to(v.dtype) * v[:, :, start:end]
        if record is not None:
            record(_recorded(weights.detach(), start, first, stick_breaking), start, end, first)
        if value_term is not None:
            band_weights = band_of(weights, start, first, value_term.band.size(-2))
            block = block + value_term.output(band_weights, slice(start, end)).to(block.dtype)
        out[:, :, start:end] = block
    return out


def band_of(weights: torch.Tensor, start: int, first: int, width: int) -> torch.Tensor:
    """(B, H, rows, W): the weights (B, H, rows, keys first..) of query rows start.. on their band's keys
    i - W + 1 .. i (0 on keys before ``first``)."""
    padded = F.pad(weights, (width - 1, 0))  # column c + W - 1: key first + c; row r's band from column start-first+r
    return diagonal_band(padded[..., start - first :], width)


def _recorded(weights: torch.Tensor, start: int, first: int, stick_breaking: bool) -> torch.Tensor:
    """What ``recording`` hands over: the weights; under stick-breaking, each row's leftover on its own key."""
    if not stick_breaking:
        return weights
    rows, keys = weights.shape[-2:]
    own = torch.arange(start, start + rows, device=weights.device)[:, None] == torch.arange(
        first, first + keys, device=weights.device
    )
    # Once the stick is used up, 1 - sum rounds below 0: a negative weight would make the entropy's x log x NaN.
    return weights + (1 - weights.sum(-1, keepdim=True)).clamp(min=0) * own


def stick_breaking_weights(logits: torch.Tensor, start: int, first: int) -> torch.Tensor:
    """Stick-breaking attention weights (Tan et al. 2025) of query rows start.. against keys first.., from their
    masked logits z (B, H, rows, keys; -inf on keys a row does not see): A_ij = sigmoid(z_ij) prod_{j < t < i}
    (1 - sigmoid(z_it)), nearest key first, the query itself not attended; in log space, as ``sb_ref``."""
    rows, keys = logits.shape[-2:]
    diagonal = torch.arange(start, start + rows, device=logits.device)[:, None] == torch.arange(
        first, first + keys, device=logits.device
    )
    logits = logits.masked_fill(diagonal, float("-inf"))
    log_beta = F.logsigmoid(-logits)  # log(1 - sigmoid(z)): 0 on keys not seen
    later = log_beta.flip(-1).cumsum(-1).flip(-1) - log_beta  # sum over the keys t > j the row sees
    return (F.logsigmoid(logits) + later).exp()
