"""The command line as a user types it: bad input ends in one clear line, before any work."""

import os
import re
import subprocess
import sys
from pathlib import Path

import lenext.configs
import pytest
import torch

from tests.conftest import ROOT, needs_compiled_paths_torch, run_train, small_corpus_overrides
from tests.forked import run_command


def test_unknown_pe_lists_the_available_ones(tmp_path):
    result = run_train(tmp_path, "pe=nonsense")
    assert result.returncode != 0
    assert result.stderr.startswith("error: pe=nonsense is not one of the pe configs; they are: alibi,")
    for name in ("alibi", "rope", "shaw", "t5", "nope"):
        assert name in result.stderr
    # where they were read from: a second checkout on PYTHONPATH reads the installed one's
    assert result.stderr.rstrip().endswith(f"(in {Path(lenext.configs.__path__[0]) / 'pe'})")


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["pe=rop"], "error: pe=rop is not one of the pe configs (did you mean rope?); they are: alibi, "),
        (["-m", "pe=rope,alibx"], "error: pe=alibx is not one of the pe configs (did you mean alibi?); they are: "),
        (
            ["model=huge"],
            (
                "error: model=huge is not one of the model configs; they are: compact, llama, llama_125m, llama_1b, "
                "llama_350m, small, tiny"
            ),
        ),
        (["data.maxlen=64"], "error: data.maxlen is not a setting of data (did you mean data.max_len?); the settings"),
        (["mdoel=tiny"], "error: mdoel is not a setting of this config (did you mean model?); the settings there: "),
        (["pe=t5", "+pe.max_distanse=3"], "error: pe.max_distanse is not a setting of lenext.pe.T5Bias (did you mean"),
        (["pe=alibi", "+pe.slope=3"], "error: pe.slope is not a setting of lenext.pe.ALiBi; the settings there: none"),
        (  # an optimizing sweeper's sweep: lenext's check of the overrides raised Hydra's traceback
            ["-m", "data.max_len=interval(1,2)"],
            "error: data.max_len=interval(1,2) is invalid: Can only enumerate CHOICE and RANGE sweeps",
        ),
        (
            ["-m", "pe=glob(rope_n*)"],
            "error: pe=glob(rope_n*) is invalid: list the options instead (rope_nope,rope_ntk)",
        ),
        (  # Hydra's grammar refuses a non-ASCII character unquoted: its message named no key
            ["pe=rópe"],
            "error: pe=rópe cannot be read as an override (at 'ó'): quote a value that holds non-ASCII characters "
            """or any of =,[]{}()'": 'pe="rópe"'""",
        ),
        (["data.max_len=32=64"], "error: data.max_len=32=64 cannot be read as an override (mismatched input '='"),
        (["data.max_len"], "error: data.max_len cannot be read as an override (missing EQUAL at '<EOF>'): give key"),
        (  # an option ends the overrides for Hydra's parser: it printed its usage
            ["model=tiny", "-m", "seed=0,1"],
            "error: seed=0,1 comes after an option: give the options first, then every override (python train.py -m "
            "model=tiny seed=0,1)",
        ),
        (["--sweep", "seed=0,1"], "error: --sweep is not an option of this command: --help lists them"),
        (  # a sweep's config asked for: Hydra's ValueError, as a traceback
            ["-m", "pe=rope,alibi", "--cfg", "job"],
            "error: --multirun and --cfg cannot be given together: give one of --run, --multirun, --cfg, --info,",
        ),
    ],
)
def test_a_mistyped_option_or_key_is_answered_with_the_closest_name_in_one_line(tmp_path, overrides, line):
    result = run_train(tmp_path, *overrides)
    assert result.returncode == 1 and result.stderr.startswith(line), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "override, why",
    [
        ("model.d_model=8", "the checkpoint keeps its model"),
        ("model=small", "the checkpoint keeps its model"),
        ("train.positions=pose", "the checkpoint keeps its training positions (eval.positions evaluates at"),
        ("attention.scale=ssmax", "the checkpoint keeps its attention settings"),
    ],
)
def test_eval_py_names_where_a_training_setting_comes_from_with_or_without_a_plus(tmp_path, override, why):
    """Without +, Hydra refuses the key (eval.py's config has no such node): that said "not a setting of model; the
    settings there: none". With +, the schema says it; both now say the checkpoint keeps it."""
    arguments = [f"ckpt={tmp_path / 'none.ckpt'}", override]
    result = run_command("eval.py", arguments, {**os.environ, "LENEXT_ROOT": str(tmp_path)}, tmp_path)
    lines, key = result.stderr.strip().splitlines(), override.split("=")[0]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {key} is not a setting of this command: {why}"), result.stderr


@pytest.mark.parametrize("override", ["model.d_model=8", "+model.d_model=8", "+train.positions=pose"])
def test_diagnose_py_names_where_a_training_setting_comes_from(tmp_path, override):
    """diagnose.py reads the checkpoint's model and positions, as eval.py does: the same answer, with or without +
    (it said "not a setting lenext knows; remove it", or "not a setting of model; the settings there: none")."""
    arguments = [f"ckpt={tmp_path / 'none.ckpt'}", override]
    result = run_command("diagnose.py", arguments, {**os.environ, "LENEXT_ROOT": str(tmp_path)}, tmp_path)
    key, kept = override.lstrip("+").split("=")[0], "training positions" if "train" in override else "model"
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"error: {key} is not a setting of this command: the checkpoint keeps its {kept}"
    ]


def test_help_says_what_the_command_does_with_examples_and_its_groups():
    """train.py in a new interpreter (the shim itself), eval.py forked (tests/forked.py)."""
    for script, purpose, group in (("train.py", "train a decoder", "pe: alibi"), ("eval.py", "evaluate a", "eval:")):
        if script == "train.py":
            result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
        else:
            result = run_command(script, ["--help"], dict(os.environ), ROOT)
        assert result.returncode == 0 and purpose in result.stdout.splitlines()[0], result.stdout
        assert "Examples:" in result.stdout and group in result.stdout and "powered by Hydra" not in result.stdout


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["data.max_len=0"], "data.max_len"),
        (["module.lr=-1e-3"], "module.lr"),
        (["data.vocab_size=100"], "data.vocab_size"),
        (["data.vocab_size=10000000000"], "data.vocab_size"),  # the BPE trainer aborted allocating it
        (["data.seed=99999999999999999999"], "data.seed"),  # torch's generator overflowed after preparation
        (["data=synthetic", "data.seed=4294967296"], "data.seed"),
        (["data.tokenizer="], "data.tokenizer=''"),  # an unset $TOK: it trained the corpus's BPE instead
        (["data.cache_dir="], "data.cache_dir=''"),  # it prepared into the folder the command ran in
        (["data.remote="], "data.remote=''"),  # it ran without a remote, unsaid
        (["hydra.run.dir="], "the run's folder is ''"),  # the line named no folder
        (["pe=xpos", "model.d_model=60", "model.n_heads=4"], "xPos rotates pairs"),  # it said RoPE
        # sizes beyond any machine's memory: an allocation traceback, and an empty run folder left
        (["model.d_model=4000000"], "the settings model.d_model=4000000, model.n_layers=6, model.n_heads=8 build"),
        (["pe=learned", "pe.max_len=10000000000"], "the settings pe.max_len=10000000000 build a model of 9,537 GiB"),
        (["pe=cope", "pe.npos_max=10000000000"], "its largest tensor, blocks.0.attn.pe.embedding, is (10000000000,"),
        pytest.param(
            ["trainer=fsdp"],
            "no CUDA GPU; use trainer=cpu, or trainer=default (the fastest device and precision the machine has); "
            "trainer=ddp_sim and trainer=fsdp_sim run DDP and FSDP as processes on this CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU"),
        ),
        (["trainer=fsdp_sim", "trainer.devices=abc"], "trainer.devices='abc' is invalid: it must be a number"),
        pytest.param(
            ["trainer=fsdp_sim", "trainer.devices=-1"],
            "trainer.devices=-1 is invalid here: it counts the node's CUDA GPUs, and it has none",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU"),
        ),
        # Lightning checks the mesh once both processes have started, after the corpus is prepared
        pytest.param(
            ["trainer=fsdp_sim", "trainer.strategy.data_parallel_size=3"],
            "data_parallel_size=3 is invalid: it must be 2",
            marks=needs_compiled_paths_torch,  # below it, trainer=fsdp itself is refused first
        ),
        pytest.param(
            ["trainer=fsdp_sim", "trainer.strategy.tensor_parallel_size=2"],
            "tensor_parallel_size=2 is invalid",
            marks=needs_compiled_paths_torch,
        ),
        (["model=llama_125m", "model.mlp_ratio=0.001"], "model.mlp_ratio=0.001 is invalid at model.d_model=768"),
        (["model.n_heads=3"], "model.n_heads"),
        (["pe=shaw", "pe.k=0"], "pe.k"),
        (["pe=t5", "pe.max_distance=8"], "pe.max_distance"),
        (["module.lr=nan"], "module.lr"),
        (["trainer.precision=16-mixed"], "trainer.precision"),
        (["eval.rope_scalings=[ntk]"], "eval.rope_scalings was renamed: use eval.variants"),
        (["+eval.rope_scalings=[ntk]"], "eval.rope_scalings was renamed: use eval.variants"),
    ],
)
def test_invalid_values_fail_with_one_line_naming_the_key(tmp_path, overrides, key):
    result = run_train(tmp_path, *overrides)
    assert result.returncode == 1
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".cache").exists()  # failed before reading or tokenizing the corpus
    runs = tmp_path / "logs" / "train" / "runs"  # nor left a run folder the report would list as failed
    assert not runs.exists() or not os.listdir(runs)


def test_hub_corpus_offline_points_to_text_files(tmp_path):
    result = run_train(tmp_path, "data=wikitext103", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert "data=text_files" in result.stderr and "offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_eval_with_an_empty_hf_names_hf_not_a_missing_ckpt(tmp_path):
    result = run_command("eval.py", ["hf="], {**os.environ, "LENEXT_ROOT": str(tmp_path)}, tmp_path)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "error: hf='' is invalid: give a Hugging Face model folder or hub id (hf=<model>), or ckpt=<run>"
    ]


def test_eval_takes_the_precision_names_training_takes_and_refuses_others(tmp_path):
    """32-true, 32, bf16-mixed, bf16 (tests/test_evaluate.py evaluates in each); any other is one line, before the
    checkpoint is read."""
    arguments = [f"ckpt={tmp_path / 'none.ckpt'}", "precision=16-mixed"]
    result = run_command("eval.py", arguments, {**os.environ, "LENEXT_ROOT": str(tmp_path)}, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "error: precision='16-mixed' is invalid: it must be one of '32-true', '32', 32, 'bf16-mixed', 'bf16' or null"
    )


def test_a_run_and_its_resume_say_they_are_alive_and_print_no_library_warnings(tmp_path, small_text_corpus):
    """A run without a progress bar (as in the study presets) prints a line at every tenth of its steps; neither
    a run nor its resume prints a library warning the user cannot act on (lenext/__init__.py)."""
    common = small_corpus_overrides(small_text_corpus, "eval.factors=[1]", "hydra.run.dir=run")
    first = run_train(tmp_path, *common, "trainer.max_steps=10", "trainer.val_check_interval=5")
    (tmp_path / "run" / "results.json").unlink()  # trained further: it resumes from last.ckpt
    resumed = run_train(tmp_path, *common, "trainer.max_steps=20", "trainer.val_check_interval=5")
    for result in (first, resumed):
        assert result.returncode == 0, result.stderr
        console = result.stdout + result.stderr
        assert not re.search(r"warn|deprecat|is not empty|not resumable|weights_only|was configured", console, re.I)
    line = r"^step (\d+) of {}: loss \d+\.\d+, [\d,]+ tokens/s; training ~\d+s left$"
    assert re.findall(line.format(10), first.stdout, re.M) == [str(s) for s in range(1, 11)]
    assert re.findall(line.format(20), resumed.stdout, re.M) == [str(s) for s in range(12, 21, 2)]


def test_a_library_errors_first_line_is_what_a_one_line_error_quotes():
    """A message of several lines gives its first; an empty one its type's name (an IndexError before)."""
    from lenext.errors import first_line

    assert first_line(ValueError("Unknown split 'x'.\nShould be one of ...")) == "Unknown split 'x'."
    assert first_line(KeyError()) == "KeyError" and first_line(OSError("  ")) == "OSError"


def test_a_value_for_a_node_of_settings_names_its_settings():
    """eval.py's pe node holds the checkpoint's PE settings: pe=alibi read 'pe is not a setting of this config (did
    you mean pe?)'."""
    from lenext.cli import check_overrides
    from lenext.errors import ConfigError

    message = r"^pe is a node of settings here, not a config to choose: give them one by one \(pe.<setting>=...\); "
    with pytest.raises(ConfigError, match=message + r"its settings: factor, scaling$"):
        check_overrides("eval", ["ckpt=x.ckpt", "pe=alibi"])


def test_a_slurm_sweep_where_there_is_no_srun_is_refused_before_the_sweep_starts(monkeypatch):
    """submitit's SLURM executor raised a traceback where srun is not on PATH, after the sweep's folder was made."""
    from lenext.cli import check_overrides
    from lenext.errors import ConfigError

    sweep = ["pe=rope,alibi", "hydra/launcher=slurm", "hydra.launcher.partition=p"]
    monkeypatch.setattr("lenext.cli.shutil.which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^hydra/launcher=slurm is invalid here: SLURM's srun is not on PATH"):
        check_overrides("train", sweep, multirun=True)
    check_overrides("train", sweep[1:])  # not a sweep: the launcher is not used
    monkeypatch.setattr("lenext.cli.shutil.which", lambda name: f"/usr/bin/{name}")
    check_overrides("train", sweep, multirun=True)


def test_a_corpus_too_short_for_a_batch_is_refused_before_the_model_is_built(small_text_corpus, tmp_path):
    """Refused by the training loader, after the model was built and the run's record written: the run folder was
    left behind (an audit)."""
    run = tmp_path / "run"
    overrides = small_corpus_overrides(small_text_corpus, "data.max_len=4096", "data.batch_size=16")
    result = run_train(tmp_path, *overrides, f"hydra.run.dir={run}")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert re.match(
        r"error: the training split has \d+ windows of data.max_len \+ 1 = 4097 tokens, fewer than "
        r"data.batch_size=16: use a shorter data.max_len or a larger corpus$",
        result.stderr,
    )
    assert "parameters" not in result.stdout and not run.exists()


def test_a_data_setting_without_a_data_config_says_what_to_give():
    """eval.py's data group chooses no config: data.batch_size=4 was 'not a setting of data; the settings there:
    none' (an audit). With hf=, the data config to give; with ckpt=, that a checkpoint keeps its own data."""
    from lenext.cli import check_overrides
    from lenext.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"^data.batch_size is a setting of a data config, and this command chooses "
        r"none: give data=<config> before it \(one of: .*sotu, .*text_files",
    ):
        check_overrides("eval", ["hf=/any/model", "data.batch_size=4"])
    with pytest.raises(
        ConfigError,
        match=r"^data.vocab_size applies to hf= evaluations: a "
        r"checkpoint is evaluated on the data it was trained on$",
    ):
        check_overrides("eval", ["ckpt=/any/run", "data.vocab_size=100"])
