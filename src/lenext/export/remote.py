"""The remote-code export: lenext's own model code written into the model folder, for transformers to run with
``trust_remote_code=True``, with no lenext import.

transformers copies a model's code files by their relative imports (``from .name import``), in one flat folder:
each lenext module the decoder needs becomes ``lenext_<dotted path>.py`` beside ``modeling_lenext.py``, its
``from lenext.x.y import`` lines made ``from .lenext_x_y import``.
"""

import ast
import importlib.util
import json
import re
import shutil
from importlib import resources
from pathlib import Path

from lenext.export.native import lenext_contexts, shape_settings
from lenext.model import Decoder

ROOT_MODULES = ("lenext.model", "lenext.pe")  # the decoder, and every PE (a config may name any of them)
LENEXT_IMPORT = re.compile(r"^(\s*)from (lenext(?:\.\w+)*) import ", flags=re.MULTILINE)
CODE_FILES = ("configuration_lenext.py", "modeling_lenext.py")
AUTO_MAP = {
    "AutoConfig": "configuration_lenext.LenextConfig",
    "AutoModel": "modeling_lenext.LenextModel",
    "AutoModelForCausalLM": "modeling_lenext.LenextForCausalLM",
}


def flat_name(module: str) -> str:
    return module.replace(".", "_")


def needed_modules() -> dict[str, Path]:
    """Every lenext module the roots import, transitively: {dotted name: source file}."""
    found, todo = {}, list(ROOT_MODULES)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = Path(importlib.util.find_spec(name).origin)
        for node in ast.walk(ast.parse(found[name].read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lenext":
                if node.level or any(alias.name == "*" for alias in node.names):
                    raise RuntimeError(f"{name}: lenext-export vendors only `from lenext.x import name` imports")
                todo.append(node.module)
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "lenext" for a in node.names):
                raise RuntimeError(f"{name}: lenext-export vendors only `from lenext.x import name` imports")
    return found


def write_remote(net: Decoder, spec, folder: Path, special_tokens: dict) -> None:
    """The code, config.json (naming ``special_tokens``: BOS and EOS ids) and weights (safetensors) of the model,
    into ``folder``."""
    import transformers
    from safetensors.torch import save_file

    write_code(folder)
    config = remote_config(net, spec) | special_tokens | {"transformers_version": transformers.__version__}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    weights = {f"model.net.{k}": v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_code(folder: Path) -> None:
    """lenext's model code and the transformers classes around it, into ``folder``."""
    for name, source in needed_modules().items():
        text = LENEXT_IMPORT.sub(lambda m: f"{m.group(1)}from .{flat_name(m.group(2))} import ", source.read_text())
        (folder / f"{flat_name(name)}.py").write_text(text, encoding="utf-8")
    for file in CODE_FILES:
        with resources.as_file(resources.files("lenext.export") / "hf_code" / file) as path:
            shutil.copyfile(path, folder / file)


def remote_config(net: Decoder, spec) -> dict:
    """config.json's settings: the run's model, PE and attention nodes, which the modeling code builds from."""
    config = spec.config
    return {
        "model_type": "lenext",
        "architectures": ["LenextForCausalLM"],
        "auto_map": AUTO_MAP,
        **shape_settings(net),  # transformers' names, which tools read (generation, lm-evaluation-harness, vLLM)
        "max_position_embeddings": spec.base_len,  # the context eval.factors multiply, as for the checkpoint
        **lenext_contexts(net, spec.base_len),  # as a native export's: what eval.py hf= reads first
        "lenext": {
            "model": config["model"],
            "pe": config["pe"],
            "attention": config.get("attention") or {},
            "train_len": spec.train_len,
            "reach": spec.reach,
        },
        "position_limit": net.pe.position_limit,
    }
