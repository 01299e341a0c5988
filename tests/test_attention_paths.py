"""Which of lenext.attention's paths serves each PE config on the CPU, training (with a gradient) and evaluating
(without): the list of docs/pes/index.md, "Attention paths", held to the code. A path that stops serving a PE, or
one that starts serving a PE it cannot, fails here (each path's exactness is tested with its PE)."""

import pytest
import torch

import lenext.attention as attention_module
from lenext.build import build_net
from lenext.run_folder import resolve_training
from tests.conftest import CONFIG_FOLDER, tiny_overrides

LENGTH = 32  # the tiny runs' L_train, past the windows below

NO_BIAS = "sdpa_causal"
# PE config (and settings) -> (paths taken while training, paths taken evaluating), over all layers
PATHS = {
    "nope": ({NO_BIAS}, {NO_BIAS}),
    "sinusoidal": ({NO_BIAS}, {NO_BIAS}),
    "learned": ({NO_BIAS}, {NO_BIAS}),
    "rope": ({NO_BIAS}, {NO_BIAS}),
    "p_rope": ({NO_BIAS}, {NO_BIAS}),
    "rope_ntk": ({NO_BIAS}, {NO_BIAS}),
    "xpos": ({NO_BIAS}, {NO_BIAS}),
    "pope": ({NO_BIAS}, {NO_BIAS}),
    "rope_nope": ({NO_BIAS}, {NO_BIAS}),
    "rnope_swa pe.windows.rope=16": ({"explicit"}, {"explicit"}),  # a window on the CPU (tiny: 2 RoPE layers)
    "rope_nope model.n_layers=3 +pe.windows.rope=16": ({"explicit", NO_BIAS}, {"explicit", NO_BIAS}),
    "alibi": ({"sdpa_key_mask"}, {"sdpa_key_mask"}),
    "fox": ({"key_channels"}, {"sdpa_key_mask"}),  # its gate bias needs a gradient while training
    "fox_rope": ({"key_channels"}, {"sdpa_key_mask"}),
    "t5": ({"banded"}, {"banded"}),
    "shaw": ({"banded"}, {"banded"}),
    "shaw pe.value_term=true": ({"banded"}, {"banded"}),
    "kerple": ({"explicit"}, {"explicit"}),
    "fire": ({"explicit"}, {"explicit"}),
    "cope": ({"explicit"}, {"explicit"}),
    "dape": ({"explicit"}, {"explicit"}),
    "path": ({"explicit"}, {"explicit"}),
    "path_fox": ({"explicit"}, {"explicit"}),
    "rope attention.scale=ssmax": ({NO_BIAS}, {NO_BIAS}),  # the row scale multiplies q
    "t5 attention.scale=ssmax": ({"banded"}, {"banded"}),  # ... and the band
    "alibi attention.scale=ssmax": ({"explicit"}, {"explicit"}),  # a key mask is not scaled per row
    "alibi attention.window=16": ({"explicit"}, {"explicit"}),
    "nope attention.normalizer=stick_breaking": ({"explicit"}, {"explicit"}),
}


def paths_taken(compose_train, config: str, monkeypatch) -> tuple[set, set]:
    pe, *settings = config.split()
    spec, _ = resolve_training(compose_train(*tiny_overrides(f"pe={pe}", *settings)))
    torch.manual_seed(0)
    net = build_net(spec, 64)
    taken = []

    def served_by(path):
        def serve(call):
            out = path(call)
            if out is not None:
                taken.append(path.__name__)
            return out

        return serve

    monkeypatch.setattr(attention_module, "FUSED_PATHS", tuple(map(served_by, attention_module.FUSED_PATHS)))
    monkeypatch.setattr(attention_module, "explicit", served_by(attention_module.explicit))
    tokens = torch.randint(64, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    net(tokens).sum().backward()
    training = set(taken)
    taken.clear()
    with torch.no_grad():
        net(tokens)
    return training, set(taken)


@pytest.mark.parametrize("config", PATHS)
def test_each_pe_takes_the_cheapest_exact_path_on_the_cpu(config, compose_train, monkeypatch):
    assert paths_taken(compose_train, config, monkeypatch) == PATHS[config]


def test_the_table_covers_every_pe_config():
    configs = {path.stem for path in (CONFIG_FOLDER / "pe").glob("*.yaml")}
    configs -= {name for name in configs if name.endswith("_randomized")}  # the same PE, other positions
    assert configs <= {config.split()[0] for config in PATHS}
