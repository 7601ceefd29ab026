"""Find a model wherever it lives and read its config, weights and tokenizer.

Accepted: a local Hugging Face directory (config.json, *.safetensors, tokenizer.json), a Hugging
Face hub id (through the local cache, or downloaded), a .gguf file, an Orbax directory written by
`Scorer.save`, or None for the embedded default model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import huggingface_hub
import numpy as np
import tokenizers

from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import default, files, gguf, weight_cache
from tpuscore.models.loaders import orbax as checkpoint
from tpuscore.models.weights import Params, params_from_checkpoint
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json"]


def model_name(model: str | os.PathLike | None) -> str:
    """The name `model` (as `load` takes it) is known by: a server reports it and requests name
    it. The default model's, a path's last part, or the hub id as given."""
    if model is None:
        return default.NAME
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return str(model)


def load(
    model: str | os.PathLike | None,
    *,
    dtype: np.dtype,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | os.PathLike | None = None,
    layout_for: Callable[[ModelConfig], Layout] = lambda config: ONE_DEVICE,
) -> tuple[ModelConfig, Params, tokenizers.Tokenizer]:
    """(config, params in `dtype`, tokenizer) for `model`; see the module docstring. An Orbax
    checkpoint restores straight into `layout_for(config)`; other formats load on the host."""
    path = default.default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        if path.suffix == ".gguf" or path.is_absolute() or str(model).startswith((".", "~")):
            raise FileNotFoundError(f"model path {str(model)!r} does not exist")
        path = Path(
            huggingface_hub.snapshot_download(
                str(model),
                revision=revision,
                local_files_only=local_files_only,
                cache_dir=cache_dir,
                allow_patterns=HUB_FILES,
            )
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; give a directory or a .gguf file")
        return weight_cache.load_cached(path, dtype, lambda: _read_gguf(path, dtype))
    if checkpoint.is_checkpoint(path):
        return checkpoint.restore(path, dtype, layout_for)
    if (path / "config.json").is_file():
        return _read_hf_dir(path, dtype)
    raise ValueError(
        f"{path} is neither a Hugging Face model directory (config.json) "
        f"nor a tpuscore checkpoint ({checkpoint.MARKER})"
    )


def _read_gguf(path: Path, dtype: np.dtype) -> tuple[ModelConfig, Params, tokenizers.Tokenizer]:
    ckpt = gguf.read_gguf(path)
    return ckpt.config, params_from_checkpoint(ckpt.config, ckpt.tensors, dtype), ckpt.tokenizer


def _read_hf_dir(path: Path, dtype: np.dtype) -> tuple[ModelConfig, Params, tokenizers.Tokenizer]:
    hf_config = files.read_json(path / "config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tensors = {}
    for file in weights:
        tensors.update(files.read_safetensors(file))
    head = tensors.get("score.weight")  # a classification head: its rows count the classes
    config = ModelConfig.from_hf(hf_config, head_rows=None if head is None else head.shape[0])
    params = params_from_checkpoint(config, tensors, dtype)
    return config, params, files.read_tokenizer(path / "tokenizer.json")
