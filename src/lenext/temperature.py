"""The ``temperature`` evaluation variant (docs/evaluation.md, "Logit temperature"): any PE evaluated with every
attention row's logits, biases included, multiplied by beta(s) = 1 + c ln s, s = L_eval / L_train (1 at
s <= 1), through the attention's row scale (``lenext.attention.LengthScale``), so a PE needs nothing for it.

c is fitted on the validation split, always (also when the sweep reports the test split): the c of lowest mean NLL
(the mean over the lengths beyond L_train of each length's mean NLL per token) under ``nonoverlap`` (a probe: its
``accuracy`` protocol's NLL of the answers), at
the sweep's lengths beyond L_train and its windows (eval.max_windows), on the grid ``COARSE`` scanned upward until
the NLL first rises, then in steps of ``FINE_STEP`` within ``FINE_SPAN`` steps of the best; ties go to the smaller c.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lenext.attention import LengthScale, logit_temperature
from lenext.errors import LengthNotSupported
from lenext.protocols import cap_windows

TEMPERATURE = "temperature"  # its name in eval.variants and in the rows' ``variant``
COARSE = tuple(i / 10 for i in range(11))  # c = 0, 0.1, ..., 1: beta up to 1 + ln 32 = 4.47 at 32 x L_train
FINE_STEP, FINE_SPAN = 0.025, 3  # then c +- 0.025, 0.05, 0.075 around the coarse grid's best (c >= 0)
FIT_SPLIT = "validation"


@dataclass(frozen=True)
class TemperatureFit:
    """A fit of c: ``c`` (None when it could not be fitted: ``reason`` says why), the lengths and protocol it was
    fitted at, and the objective at every c tried."""

    c: float | None
    reason: str | None = None
    lengths: tuple[int, ...] = ()
    protocol: str | None = None
    losses: tuple[tuple[float, float], ...] = ()  # (c, mean NLL), in the order tried


def length_scales(net) -> list[LengthScale]:
    return [module for module in net.modules() if isinstance(module, LengthScale)]


def train_len(net) -> int | None:
    """The L_train the model's attention scales from (its training length), or None for a model without lenext's
    attention (a Hugging Face model)."""
    scales = length_scales(net)
    return scales[0].train_len if scales else None


def unsupported(net) -> str | None:
    """Why the temperature cannot be applied to ``net``, or None."""
    if not length_scales(net):
        return "the temperature scales lenext's attention rows; this model's attention is not lenext's"
    layers = [module for module in net.modules() if hasattr(module, "length_scale")]
    if any(not getattr(layer.pe, "takes_row_scale", True) for layer in layers):
        return "this PE's terms do not keep their meaning under a row scale (DAPE's MLP reads each unscaled logit)"
    return None


@contextmanager
def temperature(net, c: float | None) -> Iterator[None]:
    """Inside the block every attention layer of ``net`` multiplies its rows' logits by beta(L / L_train) with this
    c (None: no temperature); restored after."""
    scales = length_scales(net)
    before = [scale.temperature for scale in scales]
    for scale in scales:
        scale.temperature = c
    try:
        yield
    finally:
        for scale, value in zip(scales, before, strict=True):
            scale.temperature = value


def asks_temperature(asked: list[str] | None, net, lengths: list[int]) -> bool:
    """Whether a sweep evaluates the variant: asked for, and some length beyond L_train (within it beta is 1, the
    model as trained, as a RoPE scaling there is the identity)."""
    trained = train_len(net)
    return TEMPERATURE in (asked or ()) and (trained is None or max(lengths) > trained)


def grid_fit(objective, coarse=COARSE, step: float = FINE_STEP, span: int = FINE_SPAN) -> tuple[float, dict]:
    """The c of least ``objective(c)`` on the ``coarse`` grid, scanned upward until the objective first rises above
    its value at the c before (one minimum in c is assumed), then on steps of ``step`` within ``span`` steps of its
    best (c >= 0); ties to the smaller c. Returns (c, {c: objective} of every c tried, in order)."""
    losses: dict[float, float] = {}

    def best() -> float:
        return min(losses, key=lambda c: (losses[c], c))

    before = None
    for c in coarse:
        losses[c] = objective(c)
        if before is not None and losses[c] > before:
            break
        before = losses[c]
    centre = best()
    for k in range(-span, span + 1):
        c = round(centre + k * step, 10)
        if c >= 0 and c not in losses:
            losses[c] = objective(c)
    return best(), losses


def fit_temperature(net, evaluation, plan, eval_cfg, precision: str, scheme, seed: int) -> TemperatureFit:
    """c fitted on ``evaluation`` (the validation split's: module docstring), at ``plan``'s lengths beyond
    L_train that have windows and that the model can evaluate."""
    reason = unsupported(net)
    if reason:
        return TemperatureFit(None, reason)
    trained = train_len(net)
    name = "nonoverlap" if "nonoverlap" in evaluation.protocols else plan.protocols[0]  # probes: accuracy's NLL
    protocol = evaluation.protocol(name, plan)

    def measure(length: int, windows, c: float) -> float:
        with temperature(net, c):
            measured = evaluation.measure(net, protocol, windows, length, eval_cfg, precision, scheme, seed)
        if measured.metrics.get("mean_nll") is None:
            raise LengthNotSupported(f"the {name} protocol gives no NLL to fit c on")
        return measured.metrics["mean_nll"]

    first: dict[int, float] = {}
    windows = {}
    for length in (length for length in plan.lengths if length > trained):
        found = cap_windows(evaluation.windows(protocol, length), eval_cfg.max_windows)
        if not found:
            continue
        try:
            first[length] = measure(length, found, COARSE[0])
        except LengthNotSupported:
            continue
        windows[length] = found
    if not windows:
        return TemperatureFit(
            None, f"no length beyond L_train={trained} could be evaluated on the {FIT_SPLIT} split to fit c"
        )

    def objective(c: float) -> float:
        if c == COARSE[0]:
            return sum(first.values()) / len(first)
        return sum(measure(length, found, c) for length, found in windows.items()) / len(windows)

    c, losses = grid_fit(objective)
    return TemperatureFit(c, None, tuple(windows), name, tuple(losses.items()))


@contextmanager
def variant_scope(net, variant: str | None, fit: TemperatureFit | None) -> Iterator[None]:
    """The model under a sweep's ``variant``: the temperature with the fitted c, or the PE's own variant."""
    if variant == TEMPERATURE:
        with temperature(net, fit.c):
            yield
    else:
        with net.pe.variant(variant):
            yield


def variant_columns(net, variant: str | None, length: int, fit: TemperatureFit | None) -> dict:
    """A sweep row's ``variant_factor`` (RoPE's s; the temperature's beta at this length, as the layers that see
    the most keys apply it: at min(L, W) under a window W) and, for the temperature, its c and the split it was
    fitted on."""
    if variant != TEMPERATURE:
        return {"variant_factor": net.pe.scaling_factor(length) if variant else None}
    windows = [block.attn.window for block in net.blocks]
    seen = length if None in windows else min(length, max(windows))
    beta = logit_temperature(fit.c, seen, train_len(net)) if fit.c is not None else None
    return {"variant_factor": beta, "temperature_c": fit.c, "temperature_fitted_on": FIT_SPLIT}


def describe_fit(fit: TemperatureFit) -> str:
    """One line for the log."""
    if fit.c is None:
        return f"temperature: not fitted ({fit.reason})"
    lengths = ", ".join(str(length) for length in fit.lengths)
    loss = dict(fit.losses)[fit.c]
    edge = max(c for c, _ in fit.losses)
    beyond = f"; c = {edge:g} is the largest tried: the least NLL may lie beyond" if 0 < fit.c == edge else ""
    return (
        f"temperature: c = {fit.c:g} (beta = 1 + c ln(L / L_train)), fitted on the {FIT_SPLIT} split, {fit.protocol} "
        f"at L = {lengths}: mean NLL {loss:.4f} (c = 0: {dict(fit.losses)[0.0]:.4f}; {len(fit.losses)} values of c"
        f"{beyond})"
    )
