"""fla's Triton kernels (flash-linear-attention's ``fla-core``, ``pip install 'lenext[kernels]'``): the fused
training paths of the PEs they serve, on CUDA.

- FoX's forget gates (``Bias.gates``): ``parallel_forgetting_attn`` takes the log gates themselves and does their
  cumulative sum, the causal softmax and the gates' gradient in one kernel, accumulating in fp32, so its gate
  gradient is not the one a bf16 kernel's bias gradient loses (docs/pes/fox.md). Any window; head dims to 256.
- PaTH's Householder products (``ScoreTerms.householders``), FoX's gates with them or not: ``parallel_path_attn``,
  no (B, H, L, L) logits (it carries queries across its chunks in fp16). No window; head dim 64 on CUDA (16, 32,
  64 or 128 under Triton's interpreter: ``PATH_HEAD_DIMS``).
- Stick-breaking weights (``attention.normalizer=stick_breaking``) of q . k alone (no bias, no window):
  ``parallel_stickbreaking_attn``, which returns each query's leftover stick with its output and takes that
  leftover's gradient, so lenext's leftover on the query's own value stays exact.

Training under bf16 or fp16 autocast only: Triton's dots take fp32 as TF32 (fp32 training keeps lenext's exact
paths), and evaluation, far past L_train, keeps lenext's (FoX's key bias summed in float64). Triton's interpreter
(``TRITON_INTERPRET=1``) runs the same kernels on the CPU, slowly, with exact fp32 dots and no bf16: there they serve
fp32, which is how the tests check them without a GPU (``make test-kernels``). That rule (``triton_serves``,
``kernel_dtype``) is also lenext's own CoPE kernel's (``lenext.attention.contextual``).
"""

import os
from functools import cache
from types import SimpleNamespace

import torch

from lenext.pe.base import ScoreTerms, kernel_dtype

HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # fla's forgetting-attention and stick-breaking kernels'
# The head dims fla's PaTH kernel serves: under Triton's interpreter all it is built for; on CUDA the one measured
# right (docs/pes/path.md: on an H200 its tiles gave w gradients 50-78% off at 16 and crashed at 32; 128 unmeasured)
PATH_HEAD_DIMS = {"cpu": (16, 32, 64, 128), "cuda": (64,)}


@cache
def kernels() -> SimpleNamespace | None:
    """fla's kernels (``forgetting``, ``path``, ``stick_breaking``), or None without fla (imported on first use: fla
    imports Triton)."""
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn
        from fla.ops.path_attn import parallel_path_attn
        from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn
    except ImportError:
        return None
    return SimpleNamespace(
        forgetting=parallel_forgetting_attn, path=parallel_path_attn, stick_breaking=parallel_stickbreaking_attn
    )


def triton_serves(q: torch.Tensor) -> bool:
    """Whether Triton kernels (fla's, lenext's CoPE kernel) may compute attention for q: on CUDA in bf16 or fp16
    (Triton's dots take fp32 as TF32), or under Triton's interpreter on the CPU in fp32 (its dots exact; it has no
    bf16)."""
    if q.is_cuda:
        return kernel_dtype(q) in HALF_DTYPES
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and q.device.type == "cpu"
    return interpreted and kernel_dtype(q) == torch.float32


def fla_serves(q: torch.Tensor, terms: ScoreTerms, window: int | None, stick_breaking: bool = False) -> bool:
    """Whether one of fla's kernels computes attention with these terms (and normalizer) as exactly as the dtype
    allows, with fla installed: on CUDA in bf16 or fp16, or under Triton's interpreter in fp32. The caller has
    checked that nothing else is on the scores (no value term, logit term, row scale or recording)."""
    if not triton_serves(q) or kernels() is None:
        return False
    if stick_breaking:  # q . k alone (no bias, no PE's logits), head dims to fla's 256
        plain = not terms.biases and terms.householders is None and terms.logits is None
        return plain and window is None and q.size(-1) <= MAX_HEAD_DIM
    gated = len(terms.biases) == 1 and terms.biases[0].gates is not None  # FoX's gates and no other bias
    if terms.householders is None:
        return gated and terms.logits is None and q.size(-1) <= MAX_HEAD_DIM
    return (gated or not terms.biases) and window is None and q.size(-1) in PATH_HEAD_DIMS[q.device.type]


def fla_attention(q, k, v, terms: ScoreTerms, window: int | None, stick_breaking: bool = False) -> torch.Tensor:
    """Causal attention with the terms ``fla_serves`` took: q, k, v (B, H, L, d) -> (B, H, L, d) in the autocast
    dtype (else q's)."""
    dtype = kernel_dtype(q)
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # fla's (B, L, H, d); RoPE may leave q, k fp32
    scale = q.size(-1) ** -0.5
    log_forget = terms.biases[0].gates().float() if terms.biases else None  # (B, L, H)
    if stick_breaking:  # the stick a query leaves over goes to its own value, as lenext's explicit path
        out, left = kernels().stick_breaking(q, k, v, scale=scale, attend_current=False)
        out = out + left[..., None].to(v.dtype) * v
    elif terms.householders is None:
        out = kernels().forgetting(q, k, v, log_forget, scale=scale, window_size=window)
    else:
        w, beta = terms.householders()
        # fla's PaTH kernel scales g with the logits by 1/sqrt(d) (its naive reference too); FoX's gate is unscaled
        g = None if log_forget is None else log_forget / scale
        out, _ = kernels().path(q, k, v, w.float().transpose(1, 2), beta.float().transpose(1, 2), g, scale=scale)
    return out.transpose(1, 2)
