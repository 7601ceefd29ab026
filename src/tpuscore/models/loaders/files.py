"""Reading a checkpoint's files so that a file its parser cannot read is named.

The parsers name no file (safetensors' SafetensorError is not even a ValueError, tokenizers
raises a bare Exception), and a copy or download cut short looks like any other file: each
reader here raises `CheckpointMismatchError` with the file's path and size instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import safetensors
import tokenizers

from tpuscore.models.weights import CheckpointMismatchError

T = TypeVar("T")


def read_json(file: Path) -> Any:
    return named(file, lambda f: json.loads(f.read_text()), ValueError)


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of `file`, as numpy."""

    def read(f: Path) -> dict[str, np.ndarray]:
        # The flax reader handles bfloat16, which safetensors' numpy reader does not.
        with safetensors.safe_open(f, framework="flax") as opened:
            names = opened.keys()
            return {name: np.asarray(opened.get_tensor(name)) for name in names}

    return named(file, read, safetensors.SafetensorError)


def read_tokenizer(file: Path) -> tokenizers.Tokenizer:
    # tokenizers raises a bare Exception for a file it cannot parse.
    return named(file, lambda f: tokenizers.Tokenizer.from_file(str(f)), Exception)


def named(file: Path, read: Callable[[Path], T], errors: type[Exception]) -> T:
    """read(file), its parser's `errors` raised as `CheckpointMismatchError` naming the file (a
    missing or unreadable file's OSError passes as it is)."""
    try:
        return read(file)
    except (OSError, MemoryError):
        raise
    except errors as e:
        raise CheckpointMismatchError(
            f"{file} cannot be read ({file.stat().st_size} bytes): truncated or corrupt "
            f"({type(e).__name__}: {e})"
        ) from e
