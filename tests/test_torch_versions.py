"""lenext takes torch >= 2.4; what needs a newer one is refused in one line before any work, on any torch (the
version is patched here; docs/install.md lists what each feature needs, as measured on torch 2.4.1)."""

import re

import pytest
import torch
import transformers.utils
from omegaconf import OmegaConf
from torch.torch_version import TorchVersion

from lenext.errors import ConfigError
from lenext.export import export
from lenext.hardware import refuse_an_fsdp_that_cannot_run, refuse_older_torch
from lenext.hf import model_config

FSDP = OmegaConf.create(
    {
        "_target_": "lightning.pytorch.strategies.ModelParallelStrategy",
        "data_parallel_size": 2,
        "tensor_parallel_size": 1,
    }
)


@pytest.mark.parametrize("version", ["2.4.1", "2.5.1+cu124", "2.6.0", "2.10.0", "2.13.0+cpu"])
def test_a_setting_that_needs_torch_2_6_is_refused_below_it_naming_both_versions(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    if TorchVersion(version) < "2.6":  # as versions: 2.10 is newer than 2.6
        with pytest.raises(
            ConfigError, match=rf"^module.compile=true needs torch >= 2.6 \(why\); .* {re.escape(version)}$"
        ):
            refuse_older_torch("module.compile=true", "2.6", "why")
        with pytest.raises(ConfigError, match=r"^trainer.strategy=ModelParallelStrategy \(trainer=fsdp\) needs torch"):
            refuse_an_fsdp_that_cannot_run(FSDP, 2)
    else:
        refuse_older_torch("module.compile=true", "2.6", "why")
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
