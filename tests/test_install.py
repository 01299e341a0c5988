"""lenext installed from a wheel (not editable), as on a cluster: the console scripts train, evaluate and report from
an empty folder outside the checkout, with the configs shipped in the package and a config folder of the user's."""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.conftest import ROOT, TEST_VOCAB


def test_the_wheel_holds_every_package_of_the_source_and_the_configs():
    """pyproject.toml lists the packages (the configs, at the top level, are mapped in as lenext.configs): a new
    subpackage of src/lenext must be listed there."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from setuptools import find_packages

    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = tomllib.load(f)["tool"]["setuptools"]["packages"]
    assert set(listed) == set(find_packages(ROOT / "src")) | {"lenext.configs"}


@pytest.mark.slow  # builds and installs a wheel, then trains in a new interpreter: about a minute
def test_the_installed_wheel_trains_evaluates_and_reports_from_any_folder(tmp_path, small_text_corpus):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ and egg-info there
    for folder in ("src", "configs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source], check=True)
    (wheel,) = glob.glob(str(tmp_path / "dist" / "lenext-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run([*pip, "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", wheel], check=True)
    # Its dependencies from this environment: a path line, so this environment's editable lenext stays out of it.
    site = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"  # empty, outside the checkout
    work.mkdir()
    user_configs = tmp_path / "my_configs" / "pe"
    user_configs.mkdir(parents=True)
    (user_configs / "my_alibi.yaml").write_text(
        "# a user's own PE choice\n_target_: lenext.pe.ALiBi\n_partial_: true\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LENEXT_ROOT", "LENEXT_CACHE")}

    def run(command: str, *args) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [venv / "bin" / command, *map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import lenext; print(lenext.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(site), where.stdout + where.stderr  # the installed copy, not the checkout's

    corpus = [f"data.corpus.path={small_text_corpus}", "data.corpus.holdout_every=4", f"data.vocab_size={TEST_VOCAB}"]
    prepared = run("lenext-prepare", "data=text_files", *corpus)  # the run below finds its shards ready
    assert "train: " in prepared.stdout and (work / ".cache" / "shards").is_dir()
    run(
        "lenext-train",
        f"hydra.searchpath=[file://{tmp_path / 'my_configs'}]",
        "pe=my_alibi",
        "model=tiny",
        "trainer=cpu",
        "trainer.max_steps=4",
        "trainer.enable_progress_bar=false",
        "data=text_files",
        *corpus,
        "data.max_len=32",
        "data.batch_size=4",
        "eval.factors=[1,2]",
        "eval.max_windows=4",
    )
    (run_dir,) = glob.glob(str(work / "logs" / "train" / "runs" / "*"))
    results = json.loads(open(os.path.join(run_dir, "results.json")).read())
    assert results["meta"]["pe"]["name"] == "ALiBi" and results["meta"]["pe_name"] == "my_alibi"
    assert results["meta"]["git_commit"] is None  # an installed copy names no commit of the checkout
    assert [r["length"] for r in results["rows"]] == [32, 64]
    assert (work / ".cache" / "tokenizers").is_dir()  # caches and logs under the folder the command ran from

    run("lenext-eval", f"ckpt={os.path.join(run_dir, 'checkpoints', 'last.ckpt')}", "eval.lengths=[32]")
    (eval_dir,) = glob.glob(str(work / "logs" / "eval" / "runs" / "*"))
    assert json.loads(open(os.path.join(eval_dir, "results.json")).read())["rows"][0]["length"] == 32

    # The export's code files are package data of the wheel: an ALiBi model goes out as remote code.
    exported = run("lenext-export", os.path.join(run_dir, "checkpoints", "last.ckpt"), work / "exported")
    assert exported.stdout.startswith("wrote ") and (work / "exported" / "modeling_lenext.py").exists()

    report = run("lenext-report", work / "logs", "--out", work / "report")
    assert "| my_alibi |" in report.stdout
    assert (work / "report" / "table.md").exists() and (work / "report" / "ppl_vs_length.png").exists()
