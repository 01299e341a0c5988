"""Every config composes and builds; every PE trains in fast_dev_run through the real entry point."""

import functools

import hydra
import pytest
from omegaconf import OmegaConf

import lenext.pe
from lenext.pe import PositionalEncoding
from lenext.run import train
from tests.conftest import CONFIG_FOLDER, tiny_overrides

GROUPS = {
    g: sorted(p.stem for p in (CONFIG_FOLDER / g).glob("*.yaml"))
    for g in ("pe", "data", "model", "trainer", "logger", "callbacks", "module")
}
ALL_PES = GROUPS["pe"]


def test_every_pe_has_a_config(compose_train):
    targets = {compose_train(f"pe={name}").pe._target_.rsplit(".", 1)[-1] for name in ALL_PES}
    classes = {n for n in lenext.pe.__all__ if isinstance(getattr(lenext.pe, n), type)}
    assert targets == classes - {"PositionalEncoding", "AttentionShape"}
    assert {"sotu", "ptb", "text_files", "wikitext103", "pg19", "synthetic"} <= set(GROUPS["data"])
    assert {"cpu", "gpu", "ddp"} <= set(GROUPS["trainer"])
    assert {"csv", "wandb", "tensorboard"} <= set(GROUPS["logger"])


def test_every_pe_declares_its_family_and_display_name():
    """The report's panels and names come from the PE: every exported PE is in PE_CLASSES with a family of its own
    declaring (none inherited from the base class)."""
    classes = {getattr(lenext.pe, n) for n in lenext.pe.__all__ if isinstance(getattr(lenext.pe, n), type)}
    assert set(lenext.pe.PE_CLASSES) == {c for c in classes if issubclass(c, PositionalEncoding)} - {PositionalEncoding}
    for pe in lenext.pe.PE_CLASSES:
        assert pe.FAMILY in lenext.pe.FAMILIES and pe.DISPLAY_NAME, pe
    assert PositionalEncoding.FAMILY is None


@pytest.mark.parametrize("group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_config_composes_and_resolves(compose_train, group, option):
    extra = ["data.corpus.path=/tmp"] if option == "text_files" else []
    cfg = compose_train(f"{group}={option}", *extra)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if group == "pe":
        pe = hydra.utils.instantiate(cfg.pe)
        net = hydra.utils.instantiate(cfg.model, vocab_size=300, train_len=cfg.data.max_len, pe=pe)
        assert isinstance(net.pe, PositionalEncoding)
    if group == "data":
        assert hydra.utils.instantiate(cfg.data).max_len == cfg.data.max_len


def test_rope_ntk_is_rope_with_ntk_scaling(compose_train):
    cfg = compose_train("pe=rope_ntk")
    assert cfg.pe._target_ == "lenext.pe.RoPE" and cfg.pe.scaling == "ntk" and cfg.pe.factor is None


@pytest.mark.parametrize("pe", ALL_PES)
def test_every_pe_config_builds_and_runs_a_training_step_and_validation(compose_train, pe):
    """A smoke check of the configs (each PE's numbers are tested against references in test_pe.py and beside)."""
    cfg = compose_train(*tiny_overrides(f"pe={pe}", "trainer.fast_dev_run=true"))
    metrics = train(cfg)
    assert 1 < metrics["val/ppl"] < 10 * 512  # finite, and not absurd for an untrained 512-token model


@pytest.mark.parametrize("pe", ALL_PES)
def test_every_pe_resolves_on_the_meta_device_as_built_on_the_cpu(compose_train, pe):
    """The resolver reads a PE's hyperparameters from a model built on the meta device (nothing allocated): the
    same hyperparameters, parameters and buffers as the model built for real."""
    import torch

    from lenext.build import build_decoder
    from lenext.resolve import resolved_pe

    cfg = compose_train(f"pe={pe}")
    config = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in ("pe", "model", "attention")}
    real = build_decoder(config, 512, 512, 256)
    with torch.device("meta"):
        meta = build_decoder(config, 512, 512, 256)
    assert resolved_pe(config, 512, 512) == {
        "_target_": cfg.pe._target_,
        "_partial_": True,
        **real.pe.hyperparameters(),
    }
    shapes = {name: t.shape for name, t in [*real.named_parameters(), *real.named_buffers()]}
    assert {name: t.shape for name, t in [*meta.named_parameters(), *meta.named_buffers()]} == shapes


def test_a_run_that_evaluates_nothing_does_not_point_the_report_at_it(compose_train, tmp_path, capsys):
    train(compose_train(*tiny_overrides("pe=alibi", "trainer.fast_dev_run=true")))
    out = capsys.readouterr().out
    assert "no results.json (no evaluation after training); next: python eval.py ckpt=" in out
    assert "lenext.report" not in out and not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("preset", ["llama_125m", "llama_350m", "llama_1b"])
def test_the_scale_presets_have_the_parameters_their_files_state(preset):
    """Each count its comment states, built on the meta device (no memory): the blocks and final norm, then the
    whole model at vocabularies of 32,000 and 50,257."""
    import re

    import torch

    from lenext.model import Decoder
    from lenext.pe import RoPE

    text = (CONFIG_FOLDER / "model" / f"{preset}.yaml").read_text()
    stated = [int(n.replace(",", "")) for n in re.findall(r"\b\d{1,3}(?:,\d{3}){2,}\b", text)]  # the millions
    settings = {k: v for k, v in OmegaConf.create(text).items() if k != "_target_"}
    counts = []
    for vocab in (32000, 50257):
        with torch.device("meta"):
            net = Decoder(vocab, 1024, RoPE, **settings)
        total = sum(p.numel() for p in net.parameters())
        counts.append(total)
    embeddings = net.embedding.weight.numel() + net.head.weight.numel()
    assert stated == [counts[1] - embeddings, *counts]
    assert net.blocks[0].mlp.down.in_features % 256 == 0  # the MLP width GPUs tile well


def test_a_library_refusing_a_setting_is_named_with_the_settings_it_names_and_their_values():
    """Lightning's Trainer names `devices`: the line says trainer.devices=-1, as for lenext's own keys, not
    "trainer is invalid"; a refusal naming no setting of the group names the group."""
    from omegaconf import OmegaConf

    from lenext.build import instantiate
    from lenext.errors import ConfigError

    node = OmegaConf.create({"_target_": "lightning.Trainer", "accelerator": "cpu", "devices": -1, "logger": False})
    with pytest.raises(ConfigError, match=r"^trainer.devices=-1 is invalid: lightning.Trainer refused it: `devices` "):
        instantiate(node, "trainer")
    node = OmegaConf.create({"_target_": "lightning.Trainer", "accelerator": "cpu", "precision": "64-bits"})
    with pytest.raises(
        ConfigError, match=r"^trainer is invalid: lightning.Trainer refused it: Precision '64-bits' is invalid"
    ):
        instantiate(node, "trainer")


def test_a_model_is_refused_only_where_its_weights_exceed_the_machines_memory(monkeypatch):
    """At exactly its weights' bytes the model is accepted; a byte less is refused, naming the largest tensor and
    the settings of its group."""
    import torch

    from lenext import build
    from lenext.errors import ConfigError
    from lenext.model import Decoder
    from lenext.pe import Learned

    config = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "tie_embeddings": False}, "pe": {"max_len": 4096}}
    with torch.device("meta"):
        net = Decoder(100, 64, functools.partial(Learned, max_len=4096), d_model=32, n_layers=2, n_heads=4)
    weights = 4 * sum(t.numel() for t in [*net.parameters(), *net.buffers()])
    monkeypatch.setattr(build, "physical_memory", lambda: weights)
    build.refuse_a_model_beyond_memory(net, config)
    monkeypatch.setattr(build, "physical_memory", lambda: weights - 1)
    with pytest.raises(
        ConfigError,
        match=r"^the settings pe.max_len=4096 build .* \(its largest tensor, pe.table.weight, is \(4096, 32\)\)",
    ):
        build.refuse_a_model_beyond_memory(net, config)
