"""lenext takes torch >= 2.4; what needs a newer one is refused in one line before any work, on any torch (the
version is patched here; docs/install.md says what each feature needs, as measured on torch 2.4.1 and 2.6.0)."""

import re

import pytest
import torch
import transformers.utils
from omegaconf import OmegaConf
from torch.torch_version import TorchVersion

from lenext.errors import ConfigError
from lenext.export import export
from lenext.hardware import COMPILED_PATHS_TORCH, refuse_an_fsdp_that_cannot_run, refuse_older_torch
from lenext.hf import model_config

FSDP = OmegaConf.create(
    {
        "_target_": "lightning.pytorch.strategies.ModelParallelStrategy",
        "data_parallel_size": 2,
        "tensor_parallel_size": 1,
    }
)


@pytest.mark.parametrize("version", ["2.4.1", "2.6.0+cu124", "2.10.0", "2.11.0", "2.13.0+cpu"])
def test_compile_and_fsdp_are_refused_below_the_torch_their_paths_were_checked_on(monkeypatch, version):
    """module.compile=true and trainer=fsdp need COMPILED_PATHS_TORCH (2.11), compared as versions (2.10 < 2.11);
    the one line names both versions. Another strategy is not judged."""
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    if TorchVersion(version) < COMPILED_PATHS_TORCH:
        line = rf"^module.compile=true needs torch >= 2.11 \(why\); this environment has torch {re.escape(version)}$"
        with pytest.raises(ConfigError, match=line):
            refuse_older_torch("module.compile=true", COMPILED_PATHS_TORCH, "why")
        with pytest.raises(ConfigError, match=r"^trainer.strategy=ModelParallelStrategy \(trainer=fsdp\) needs torch"):
            refuse_an_fsdp_that_cannot_run(FSDP, 2)
    else:
        refuse_older_torch("module.compile=true", COMPILED_PATHS_TORCH, "why")
        refuse_an_fsdp_that_cannot_run(FSDP, 2)
    refuse_an_fsdp_that_cannot_run(OmegaConf.create({"_target_": "lightning.pytorch.strategies.DDPStrategy"}), 2)


def test_the_hugging_face_bridge_is_refused_where_transformers_runs_no_model(monkeypatch, tmp_path):
    """transformers turns PyTorch off below the torch it needs: eval.py hf= and lenext-export say so in one line,
    before reading the model or the checkpoint, and write nothing."""
    monkeypatch.setattr(transformers.utils, "is_torch_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^hf='gpt2' needs transformers' PyTorch models, which transformers "):
        model_config("gpt2")
    out = tmp_path / "export"
    with pytest.raises(ConfigError, match=r"^lenext-export needs transformers' PyTorch models.*: 2.6 or newer\)$"):
        export(str(tmp_path / "missing.ckpt"), str(out))
    assert list(tmp_path.iterdir()) == []
