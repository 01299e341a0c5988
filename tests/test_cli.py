"""The command line as a user types it: bad input ends in one clear line, before any work."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_train


def test_unknown_pe_lists_the_available_ones(tmp_path):
    result = run_train(tmp_path, "pe=nonsense")
    assert result.returncode != 0
    assert "Available options in 'pe'" in result.stderr
    for name in ("alibi", "rope", "shaw", "t5", "nope"):
        assert name in result.stderr


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["data.max_len=0"], "data.max_len"),
        (["module.lr=-1e-3"], "module.lr"),
        (["data.vocab_size=100"], "data.vocab_size"),
        (["model.n_heads=3"], "model.n_heads"),
        (["pe=shaw", "pe.k=0"], "pe.k"),
        (["pe=t5", "pe.max_distance=8"], "pe.max_distance"),
        (["module.lr=nan"], "module.lr"),
        (["trainer.precision=16-mixed"], "trainer.precision"),
    ],
)
def test_invalid_values_fail_with_one_line_naming_the_key(tmp_path, overrides, key):
    result = run_train(tmp_path, *overrides)
    assert result.returncode == 1
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".cache").exists()  # failed before reading or tokenizing the corpus


def test_hub_corpus_offline_points_to_text_files(tmp_path):
    result = run_train(tmp_path, "data=wikitext103", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert "data=text_files" in result.stderr and "offline" in result.stderr
    assert "Traceback" not in result.stderr


def test_eval_takes_the_precision_names_training_takes_and_refuses_others(tmp_path):
    """32-true, 32, bf16-mixed, bf16 (tests/test_evaluate.py evaluates in each); any other is one line, before the
    checkpoint is read."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), f"ckpt={tmp_path / 'none.ckpt'}", "precision=16-mixed"],
        capture_output=True,
        text=True,
        env={**os.environ, "LENEXT_ROOT": str(tmp_path)},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "error: precision='16-mixed' is invalid: it must be one of '32-true', '32', 32, 'bf16-mixed', 'bf16' or null"
    )
