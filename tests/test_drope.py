"""DroPE (extension=drope, drop_pe=true): a second stage that drops its RoPE base's rotation, recalibrates at the
base's length and is evaluated with the fitted logit temperature (docs/extension.md, "DroPE").

Pinned: the stage holds every tensor of its base (QK-norm's new gains at 1 aside) in a NoPE model; bases and lengths
it cannot serve refused before any work; QK-norm against its formula; a tiny base -> DroPE run end to end, its
temperature fitted on the validation split also when eval.py reports the test split.
"""

import json
import math

import pytest
import torch

import lenext.data
from lenext.attention import AttentionSettings
from lenext.checkpoints import net_state
from lenext.errors import ConfigError
from lenext.model import NORM_EPS, SelfAttention
from lenext.pe import NoPE
from lenext.pe.base import LayerPE
from lenext.run import build, evaluate_checkpoint, train
from lenext.run_folder import resolve_training
from tests.conftest import hidden_keys
from tests.test_evaluate import compose_eval

DROPE = ("extension=drope", "data.max_len=32")  # the preset, at the test base's length
BASE_LEN, BASE_STEPS = 32, 4


def trained_base(compose_run, pe: str) -> str:
    """The last.ckpt of a base run of ``pe``, BASE_STEPS steps at BASE_LEN (trained once per module)."""
    last = compose_run.root / f"base_{pe}" / "checkpoints" / "last.ckpt"
    if not last.exists():
        steps = (f"trainer.max_steps={BASE_STEPS}", f"trainer.val_check_interval={BASE_STEPS}", "eval.enabled=false")
        train(compose_run(f"base_{pe}", f"pe={pe}", *steps))
    return str(last)


def second_stage(compose_run, base: str, name: str, *overrides: str):
    return compose_run(name, f"init_from={base}", "trainer.max_steps=2", "trainer.val_check_interval=2", *overrides)


@pytest.fixture(scope="module")
def rope_base(compose_run) -> str:  # noqa: F811
    return trained_base(compose_run, "rope")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_stage_holds_every_tensor_of_its_base_without_its_rotation(compose_run, rope_base, qk_norm):
    extra = ["attention.qk_norm=true"] if qk_norm else []
    cfg = second_stage(compose_run, rope_base, f"drope_weights_{qk_norm}", *DROPE, *extra)
    spec, weights = resolve_training(cfg)
    _, module, _ = build(cfg, spec, weights)
    assert isinstance(module.net.pe, NoPE) and spec.config["pe"]["_target_"] == "lenext.pe.NoPE"
    assert spec.row == ("rope -> drope+qk_norm@32" if qk_norm else "rope -> drope@32")
    base = net_state(torch.load(rope_base, map_location="cpu", weights_only=False))
    state = module.net.state_dict()
    added = {name for name in state if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert set(state) - added == set(base) and (len(added) == 4) == qk_norm  # 2 layers x q, k
    for name in base:  # RoPE keeps no tensor: every weight is the base's
        assert torch.equal(state[name], base[name]), name
    for name in added:
        assert torch.equal(state[name], torch.ones_like(state[name])), name


@pytest.fixture(scope="module")
def alibi_base(compose_run) -> str:  # noqa: F811
    return trained_base(compose_run, "alibi")


def test_only_a_stage_from_its_base_may_lack_the_qk_norm_gains():
    """The gains DroPE adds start at 1 when a stage loads its base; a checkpoint of a QK-norm model that lacks them
    (damaged, or another model's) is refused naming them, not loaded with gains of 1."""
    from lenext.build import load_weights
    from lenext.model import Decoder

    torch.manual_seed(0)
    with_norm = Decoder(64, 16, NoPE, d_model=32, n_layers=2, n_heads=4, attention=AttentionSettings(qk_norm=True))
    without = {k: v for k, v in with_norm.state_dict().items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    load_weights(with_norm, without, from_base=True)
    with pytest.raises(RuntimeError, match="q_norm.weight"):
        load_weights(with_norm, without)


@pytest.mark.parametrize(
    "base, overrides, message",
    [
        ("alibi", ["pe=alibi"], r"^drop_pe=true is invalid for a second stage from .*: DroPE drops a RoPE base's"),
        ("rope", ["data.max_len=64"], r"^data.max_len=64 is invalid for DroPE: .*trained at data.max_len=32"),
        ("rope", ["attention.scale=logn"], r"^attention.scale='logn' is invalid for a second stage"),
        ("none", [], r"^drop_pe=true is invalid without init_from"),
    ],
)
def test_what_drope_cannot_serve_is_refused_before_any_work(
    compose_run,
    rope_base,
    alibi_base,
    monkeypatch,
    base,
    overrides,
    message,
):
    def no_work(self):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(lenext.data.LMDataModule, "load", no_work)
    checkpoint = {"alibi": alibi_base, "rope": rope_base, "none": "null"}[base]
    cfg = second_stage(compose_run, checkpoint, "refused_drope", *DROPE, *overrides)
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (compose_run.root / "refused_drope").exists()


def test_qk_norm_is_rms_normalization_of_the_whole_projection_with_learned_gains():
    torch.manual_seed(0)
    width, heads, length = 16, 2, 6
    attn = SelfAttention(width, heads, LayerPE(), AttentionSettings(qk_norm=True), 8, 0.0).double()
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2)
        attn.k_norm.weight.uniform_(0.5, 2)
    x = torch.randn(1, length, width, dtype=torch.float64)
    q, k, v = (x @ attn.qkv.weight.t()).split(width, -1)

    def rms(t, gain):  # over all heads together: the reference's nn.RMSNorm(num_heads * head_dim)
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + NORM_EPS) * gain

    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k, v = (t.view(1, length, heads, -1).transpose(1, 2) for t in (q, k, v))
    logits = (q @ k.transpose(-2, -1) / math.sqrt(width // heads)).masked_fill(hidden_keys(length), float("-inf"))
    expected = attn.out((logits.softmax(-1) @ v).transpose(1, 2).reshape(1, length, width))
    torch.testing.assert_close(attn(x, torch.arange(length)[None]), expected, rtol=1e-10, atol=1e-12)


def test_a_base_then_drope_run_end_to_end(compose_run, rope_base, tmp_path, cache_dir):
    cfg = second_stage(
        compose_run,
        rope_base,
        "drope_run",
        "extension=drope_qk_norm",
        "data.max_len=32",
        "eval.factors=[1,2]",
        "eval.max_windows=2",
    )
    assert (cfg.module.lr, cfg.module.weight_decay, list(cfg.module.betas)) == (3e-3, 0.0, [0.9, 0.999])
    train(cfg)
    folder = compose_run.root / "drope_run"
    results = json.loads((folder / "results.json").read_text())
    meta, rows = results["meta"], results["rows"]
    assert meta["row"] == "rope -> drope+qk_norm@32" and meta["lineage"][0]["checkpoint"] == rope_base
    assert (meta["train_len"], meta["base_len"]) == (BASE_LEN, BASE_LEN)
    assert [(r["variant"], r["length"]) for r in rows] == [
        (None, 32),
        (None, 64),
        ("temperature", 32),
        ("temperature", 64),
    ]
    fitted = rows[-1]["temperature_c"]
    assert fitted is not None and rows[-1]["variant_factor"] == 1 + fitted * math.log(2)
    assert rows[2]["mean_nll"] == rows[0]["mean_nll"]  # beta = 1 at L_train

    # eval.py on the test split: c fitted on the validation split again, the same c as the run's own sweep.
    ckpt, out = folder / "checkpoints" / "last.ckpt", tmp_path / "test_split"
    same = (
        f"paths.cache_dir={cache_dir}",
        "eval.factors=[1,2]",
        "eval.max_windows=2",
        f"precision={meta['precision']}",
    )
    evaluate_checkpoint(compose_eval(tmp_path, out, ckpt, *same, "split=test", "eval.variants=[none,temperature]"))
    tested = json.loads((out / "results.json").read_text())
    assert tested["meta"]["split"] == "test"
    assert [r["temperature_c"] for r in tested["rows"] if r["variant"] == "temperature"] == [fitted, fitted]
