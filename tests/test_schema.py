"""Every key of every composed config: a wrong type or an out-of-range value is refused in one line that
names the key, before anything is read or written."""

import os
from typing import Annotated, Literal

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lenext.cli import CONFIG_PACKAGE
from lenext.errors import ConfigError
from lenext.ranges import Range
from lenext.resolve import TRAIN_NODES, TrainSettings
from lenext.run import evaluate_checkpoint, train
from lenext.run_folder import preflight
from lenext.schema import conforms, describe
from tests.conftest import CONFIG_FOLDER

# Every option of every group is composed at least once: all PEs, corpora, loggers, trainers, presets.
CONFIGS = [
    ["logger=[csv,tensorboard,wandb]"],
    *[[f"pe={os.path.splitext(p)[0]}"] for p in sorted(os.listdir(CONFIG_FOLDER / "pe"))],
    *[
        [f"data={name}", *(["data.corpus.path=/nowhere"] if name == "text_files" else [])]
        for name in sorted(os.path.splitext(p)[0] for p in os.listdir(CONFIG_FOLDER / "data"))
    ],
    ["trainer=ddp_sim"],
    ["trainer=ddp"],
    ["experiment=quick"],
    ["experiment=extrapolation_small"],
    ["experiment=probes"],
]


# Keys whose every string is valid (names and paths): they get only the wrong type.
FREE_TEXT = {"name", "project", "path", "text_field", "filename", "monitor", "version", "task_name"}
FREE_TEXT |= {"root_dir", "log_dir", "cache_dir", "output_dir"}


def leaves(node, prefix=""):
    """Full keys of the values a user can set (not the targets)."""
    for key in node:
        if key in ("_target_", "_partial_", "hydra"):
            continue
        full = f"{prefix}.{key}" if prefix else str(key)
        child = node._get_node(key)
        if OmegaConf.is_dict(child):
            yield from leaves(node[key], full)
        elif not (OmegaConf.is_list(child) and any(OmegaConf.is_dict(item) for item in child)):
            yield full, child


def compose_with(config: str, overrides: list[str], tmp_path):
    paths = [f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/out", f"paths.cache_dir={tmp_path}/cache"]
    with initialize_config_module(config_module=CONFIG_PACKAGE, version_base="1.3"):
        return compose(config, overrides=[*paths, *overrides])


def wrong_values(node) -> list:
    """A value of a type no key takes, and, for a number or a choice, one outside any range lenext accepts."""
    value = node._value()
    wrong = [{"not": ["a value"]}]
    if isinstance(value, int | float) and not isinstance(value, bool):
        wrong.append(-2)  # below every range (even the ones where -1 means "all")
    elif isinstance(value, str) and not OmegaConf.is_interpolation(node._get_parent(), node._key()):
        if node._key() not in FREE_TEXT:
            wrong.append("not-a-choice")
    return wrong


def assert_refused(check, key):
    """``check`` raises a one-line ConfigError that begins with the key (preflight: nothing can be written)."""
    with pytest.raises(ConfigError) as refused:
        check()
    message = str(refused.value)
    assert (message.startswith(f"{key}=") or message.startswith(f"{key} ")) and "\n" not in message, message


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: " ".join(o))
def test_every_train_key_refuses_a_wrong_type_and_an_out_of_range_value(overrides, tmp_path):
    checked, composed = 0, compose_with("train", overrides, tmp_path)
    pristine = OmegaConf.to_container(composed)
    for key, node in list(leaves(composed)):
        if OmegaConf.is_interpolation(node._get_parent(), node._key()):
            continue  # a copy of another key, refused where the user sets it
        value = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()
        for wrong in wrong_values(node):
            # Set in place and put back (a deep copy of the config per value took half of this test's time).
            OmegaConf.update(composed, key, wrong, merge=False)
            assert_refused(lambda: preflight(composed, TrainSettings, TRAIN_NODES), key)  # noqa: B023 (called at once)
            OmegaConf.update(composed, key, value, merge=False)
            checked += 1
    assert checked > 40 and OmegaConf.to_container(composed) == pristine


def test_every_eval_key_refuses_a_wrong_value(tmp_path):
    composed = compose_with("eval", ["ckpt=/no/such.ckpt"], tmp_path)
    for key, node in list(leaves(composed)):
        if key == "ckpt" or OmegaConf.is_interpolation(node._get_parent(), node._key()):
            continue  # ckpt is checked as a file (test_reliability)
        value = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()
        for wrong in wrong_values(node):
            OmegaConf.update(composed, key, wrong, merge=False)
            assert_refused(lambda: evaluate_checkpoint(composed), key)  # noqa: B023 (called at once)
            OmegaConf.update(composed, key, value, merge=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "eval.protocol=slidng",
            "eval.protocol='slidng' is invalid: it must be one of 'nonoverlap', 'sliding', 'last_k', 'key_tokens', "
            "'niah_single',",
        ),
        ("eval.last_k=1000", "eval.last_k=1000 is invalid: it must be at most the shortest length, 128"),
        ("eval.variants=[ntk,bogus]", "eval.variants=['ntk', 'bogus'] is invalid"),
        ("+eval.rope_scalings=[ntk]", "eval.rope_scalings was renamed: use eval.variants=... instead"),
        ("seed=-1", "seed=-1 is invalid: it must be an integer in [0, 4294967295]"),
        ("model.dropout=2", "model.dropout=2 is invalid: it must be a finite number in [0, 1)"),
        (
            "+model.depth=3",
            "model.depth is not a setting of lenext.model.Decoder; the settings there: d_model, dropout, mlp,",
        ),
        # What lenext passes when it builds the model: it listed them as settings and took +model.max_position
        (
            "+model.max_position=100",
            "model.max_position is not a setting: lenext gives lenext.model.Decoder its max_position when it builds",
        ),
        (
            "+foo=1",
            "foo is not a setting of this config; the settings there: ckpt_path, drop_pe, init_from, seed, task_name",
        ),
        ("trainer.max_steps=0", "trainer.max_steps=0 is invalid: it must be an integer >= 1"),
        # Lightning's own keys that failed after training began, or trained nothing and recorded a complete run
        ("+trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 is invalid: it must be an integer"),
        ("+trainer.limit_train_batches=0", "trainer.limit_train_batches=0 is invalid: it must be an integer >= 1"),
        ("+trainer.max_epochs=0", "trainer.max_epochs=0 is invalid: it must be -1 or an integer >= 1 or null"),
        ("data=text_files", "data.corpus.path is required: it must be a string; set it on the command line"),
        # Taken and printed, they changed nothing: a scheme's setting under another scheme; a candidate count that
        # filled memory with copies of each sample before failing
        (
            "train.max_position=128",
            "train.max_position=128 changes nothing here: it is a setting of randomized positions, which "
            "train.positions=sequential does not use; give train.positions=randomized, or drop train.max_position",
        ),
        ("train.chunks=3", "train.chunks=3 changes nothing here: it is a setting of pose positions, which"),
        (
            "eval.haystack_candidates=100000",
            "eval.haystack_candidates=100000 is invalid: it must be an integer in [1, 99] or null",
        ),
    ],
)
def test_the_reported_bad_settings_are_refused_with_what_they_must_be(override, message, tmp_path):
    """train() runs the pre-flight before anything else: nothing is read, tokenized or written."""
    with pytest.raises(ConfigError) as refused:
        train(compose_with("train", [override], tmp_path))
    assert str(refused.value).startswith(message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["pe._target_=lenext.pe.NoSuchPE"], "pe._target_='lenext.pe.NoSuchPE' cannot be imported"),
        # Every path to Lightning's Trainer gets the same ranges.
        (["trainer._target_=lightning.pytorch.Trainer", "trainer.max_steps=0"], "trainer.max_steps=0 is invalid"),
        # An interpolation is checked as resolved, and named with where it came from.
        (
            ["data.max_len=${oc.env:LENEXT_UNSET_VARIABLE,abc}"],
            "data.max_len='abc' (from ${oc.env:LENEXT_UNSET_VARIABLE,abc}) is invalid: it must be an integer",
        ),
        # A copy's source is named as itself, not as the key that copies it (data.cache_dir: ${paths.cache_dir}).
        (["paths.cache_dir=[1]"], "paths.cache_dir=[1] is invalid: it must be a string"),
        # Every run ends with a validation at L_train: Lightning's 0 (none) would fail only after training.
        (["trainer.limit_val_batches=0"], "trainer.limit_val_batches=0 is invalid: it must be an integer >= 1"),
    ],
)
def test_targets_and_interpolations_are_checked_too(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as refused:
        preflight(compose_with("train", overrides, tmp_path), TrainSettings, TRAIN_NODES)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "override",
    [
        "trainer.devices=-1",  # all devices
        "trainer.devices='0,1'",
        "trainer.val_check_interval='00:00:10:00'",  # a time, DD:HH:MM:SS
        "trainer.val_check_interval={minutes:10}",
        "trainer.val_check_interval={hours:0.5}",
        "trainer.log_every_n_steps=0",
        "callbacks.last_checkpoint.every_n_train_steps=0",
    ],
)
def test_what_lightning_accepts_passes_the_preflight(override, tmp_path):
    """Lightning's own meanings (-1 = all, 0 = off, a time) are not refused; what the combination
    allows on this machine is for the Trainer to say when it is built."""
    preflight(compose_with("train", [override], tmp_path), TrainSettings, TRAIN_NODES)


def test_eval_without_a_checkpoint_says_to_give_one(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^ckpt is required: pass a run folder or a .ckpt file from a training run, or hf=<model"
    ):
        evaluate_checkpoint(compose_with("eval", [], tmp_path))


def test_types_and_ranges_follow_the_annotations():
    within = Annotated[float, Range(0, 1, open_high=True)]
    assert conforms(0.0, within) and conforms(0, within) and not conforms(1.0, within) and not conforms(True, within)
    assert conforms(3, int) and not conforms(3.0, int) and not conforms(True, int) and conforms(True, bool)
    assert conforms(None, int | None) and not conforms("3", int | None)
    assert conforms([0.9, 0.95], tuple[float, float]) and not conforms([0.9], tuple[float, float])
    assert conforms(["ntk"], list[Literal["ntk", "yarn"]]) and not conforms(["ntk", "x"], list[Literal["ntk", "yarn"]])
    assert not conforms(1, Literal["1"]) and not conforms(True, Literal[1])  # 1 == True, but not the same setting
    assert describe(Annotated[int, Range(1)] | None) == "an integer >= 1 or null"
    assert describe(Literal["a", "b"] | None) == "one of 'a', 'b' or null"
    assert str(Range(0, 1, open_low=True)) == "in (0, 1]" and str(Range(high=2, open_high=True)) == "< 2"
