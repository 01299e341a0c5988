"""PEs made of PEs, from config (docs/pes/mix.md): ``Compose`` sums them in every layer, ``PerLayer`` gives
each layer one.

``Compose`` chains the transforms (``rotate``) and embeddings in the order named and sums the score terms:
RoPE with FoX's forget gate is ``{rope: ..., fox: ...}``. At most one of them may compute the logits itself.

``pattern`` names each layer's PE, repeated over the layers: Llama 4's NoPE every n-th layer is
``[rope, rope, rope, nope]`` (its ``nope_layer_interval`` 4: layer l is NoPE when (l + 1) % 4 == 0), and
RNoPE-SWA (Yang et al. 2025, "Rope to Nope and Back Again") the same layers with the RoPE ones on a sliding
window (``windows: {rope: W}``). Each PE named is built once; the layers that name it share it (its
parameters, its caches), and a PE with per-layer parameters gives each of its layers their own.
"""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from lenext.errors import ConfigError
from lenext.pe.base import NO_TERMS, AttentionShape, LayerPE, PositionalEncoding, ScoreTerms
from lenext.ranges import PositiveInt


class Members(PositionalEncoding):
    """What a PE made of named PEs does with them: variants, projection, description, hyperparameters."""

    def __init__(self, shape: AttentionShape, pes: dict[str, PositionalEncoding]):
        super().__init__(shape)
        self.pes = pes
        for index, (name, pe) in enumerate(pes.items()):
            self.add_module(f"pe{index}_{name}", pe)  # their shared parameters, once

    @property
    def reads_qk(self) -> bool:
        return any(pe.reads_qk for pe in self.pes.values())

    @property
    def widens_qk(self) -> bool:
        return any(pe.widens_qk for pe in self.pes.values())

    @property
    def computes_logits(self) -> bool:
        return any(pe.computes_logits for pe in self.pes.values())

    @property
    def rotates(self) -> bool:
        return any(pe.rotates for pe in self.pes.values())

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        """Those of the PEs that have any (RoPE's scalings): every such PE takes the variant."""
        found = [variant for pe in self.pes.values() for variant in pe.variants(asked, longest) if variant is not None]
        return list(dict.fromkeys(found)) or [None]

    @contextmanager
    def variant(self, name: str | None) -> Iterator[None]:
        with ExitStack() as stack:
            for pe in self.pes.values():
                if pe.variants(None, self.shape.trained_positions) != [None]:
                    stack.enter_context(pe.variant(name))
            yield

    def scaling_factor(self, length: int) -> float | None:
        factors = [pe.scaling_factor(length) for pe in self.pes.values()]
        return next((factor for factor in factors if factor is not None), None)

    def read_before_blocks(self, positions: torch.Tensor) -> None:
        for pe in self.pes.values():
            pe.read_before_blocks(positions)

    def project_(self) -> None:
        for pe in self.pes.values():
            pe.project_()

    def describe(self) -> dict:
        pes = {name: pe.describe() for name, pe in self.pes.items()}
        scaling = next((d["scaling"] for d in pes.values() if "scaling" in d), None)  # the variants' trained one
        return {"name": type(self).__name__, "pes": pes} | ({"scaling": scaling} if scaling else {})

    def hyperparameters(self) -> dict:
        pes = {
            name: {"_target_": f"{type(pe).__module__}.{type(pe).__qualname__}", "_partial_": True}
            | pe.hyperparameters()
            for name, pe in self.pes.items()
        }
        return {"pes": pes}


class Compose(Members):
    """Every layer takes all of ``pes``: embeddings and transforms applied in order, score terms summed."""

    FAMILY = "2024-26 methods"

    def __init__(self, shape: AttentionShape, pes: dict[str, Callable[[AttentionShape], PositionalEncoding]]):
        if not pes:
            raise ConfigError("pe.pes={} is invalid: it must name at least one PE")
        super().__init__(shape, {name: build(shape) for name, build in pes.items()})
        conflict = self.conflict()
        if conflict:
            raise ConfigError(conflict)

    def conflict(self) -> str | None:
        """Why the members cannot serve one layer together, if they cannot: two compute the logits, or one cannot
        take the q and k another widens (PoPE's)."""
        computing = [f"pe.pes.{name} ({type(pe).__name__})" for name, pe in self.pes.items() if pe.computes_logits]
        if len(computing) > 1:
            return f"{' and '.join(computing)} each compute the attention logits themselves: they cannot be composed"
        widened = None  # the member after which q and k are wider than the head
        for name, pe in self.pes.items():
            if pe.reads_qk or (widened and pe.rotates):
                wider = widened or next((o for o, p in self.pes.items() if p.widens_qk and o != name), None)
                if wider:
                    return (
                        f"pe.pes.{name} ({type(pe).__name__}) {'reads' if pe.reads_qk else 'rotates'} q and k "
                        f"at the head's width, which pe.pes.{wider} ({type(self.pes[wider]).__name__}) widens: "
                        + ("they cannot be composed" if pe.reads_qk else f"name it before {wider}")
                    )
            widened = widened or (name if pe.widens_qk else None)
        return None

    def variants(self, asked: list[str] | None, longest: int) -> list[str | None]:
        """The members' variants but those under which the members cannot serve a layer together (RoPE's
        self_extend computes its logits from q and k, which PoPE widens, and beside PaTH, which computes its own)."""
        served = []
        for name in super().variants(asked, longest):
            with self.variant(name):
                if self.conflict() is None:
                    served.append(name)
        return served

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for pe in self.pes.values():
            x = pe.embed(x, positions)
        return x

    def layer(self, index: int) -> LayerPE:
        return ComposedLayer([pe.layer(index) for pe in self.pes.values()])


class ComposedLayer(LayerPE):
    def __init__(self, layers: list[LayerPE]):
        super().__init__()
        self.parts = nn.ModuleList(layers)  # the per-layer parameters of each PE (FoX's gate) are this layer's
        self.up_to_row_constant = any(part.up_to_row_constant for part in layers)
        self.reads_logits = any(part.reads_logits for part in layers)
        self.takes_row_scale = all(part.takes_row_scale for part in layers)

    def rotate(self, q, k, positions):
        for part in self.parts:
            q, k = part.rotate(q, k, positions)
        return q, k

    def terms(self, x, q, k, positions) -> ScoreTerms:
        return sum((part.terms(x, q, k, positions) for part in self.parts), NO_TERMS)


class PerLayer(Members):
    """Layer l's PE is ``pes[pattern[l % len(pattern)]]``, on a window of ``windows[name]`` keys if given."""

    FAMILY = "2024-26 methods"

    def __init__(
        self,
        shape: AttentionShape,
        pes: dict[str, Callable[[AttentionShape], PositionalEncoding]],
        pattern: list[str],
        windows: dict[str, PositiveInt] | None = None,
    ):
        if not pattern:
            raise ConfigError("pe.pattern=[] is invalid: it must name the PE of at least one layer")
        unknown = [name for name in pattern if name not in pes]
        if unknown:
            raise ConfigError(
                f"pe.pattern names {unknown[0]!r}, which is not one of pe.pes: it must be one of {', '.join(pes)}"
            )
        unused = [name for name in windows or {} if name not in pattern]
        if unused:
            raise ConfigError(
                f"pe.windows names {unused[0]!r}, which no layer takes: it must be one of pe.pattern's "
                f"({', '.join(dict.fromkeys(pattern))})"
            )
        super().__init__(shape, {name: pes[name](shape) for name in dict.fromkeys(pattern)})  # those a layer takes
        self.pattern, self.windows = list(pattern), dict(windows or {})
        for name, pe in self.pes.items():
            if pe.embeds:
                raise ConfigError(
                    f"pe.pes.{name} ({type(pe).__name__}) adds to the token embeddings, before any layer: it "
                    "cannot be one layer's PE; use it as the model's PE (pe=...) instead"
                )

    def name_of(self, layer: int) -> str:
        return self.pattern[layer % len(self.pattern)]

    def layer(self, index: int) -> LayerPE:
        name = self.name_of(index)
        view = self.pes[name].layer(index)
        view.window = self.windows.get(name)
        return view

    def describe(self) -> dict:
        return super().describe() | {"pattern": self.pattern, "windows": self.windows}

    def hyperparameters(self) -> dict:
        return super().hyperparameters() | {"pattern": self.pattern, "windows": self.windows}
