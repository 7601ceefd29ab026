"""A cache of dequantized GGUF weights, so that only the first start pays for dequantizing.

Reading a .gguf file dequantizes every tensor and builds the tokenizer (about 10 s for the
default model on a 2-core CPU). The first load writes the result (the parameter tree in the
requested dtype, the config and the tokenizer) to one entry of this cache, keyed by the file's
content hash and the dtype; later loads memory-map it instead. An entry is written in a
temporary directory and renamed into place, so a crash never leaves half of one, and two
processes writing the same entry at once both end with a whole one.

    <cache>/<blake2b of the file>-<dtype>/
        params.bin      every parameter's bytes, back to back, 64-byte aligned
        params.json     {"format", "tensors": {"layers/wq": {"dtype", "shape", "offset"}, ...}}
        config.json     the ModelConfig
        tokenizer.json

The cache lives in `TPUSCORE_WEIGHTS_CACHE` ("off" turns it off), else
`$XDG_CACHE_HOME/tpuscore/weights` (default `~/.cache/tpuscore/weights`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tokenizers

from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

ENV = "TPUSCORE_WEIGHTS_CACHE"
FORMAT = 1
ALIGN = 64
Loaded = tuple[ModelConfig, Params, tokenizers.Tokenizer]


def cache_dir() -> Path | None:
    """Where entries live, or None when `TPUSCORE_WEIGHTS_CACHE=off`."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("off", "0", "") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tpuscore" / "weights"


def file_hash(path: Path) -> str:
    """blake2b of the file's content (about 0.2 s for 100 MB)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def load_cached(path: Path, dtype: np.dtype, read: Callable[[], Loaded]) -> Loaded:
    """`read()`'s result for the .gguf file at `path` in `dtype`, from the cache when it holds
    an entry for the file's content, else read and stored (a cache that cannot be written is
    logged and skipped: the load itself never fails for it)."""
    root = cache_dir()
    if root is None:
        return read()
    entry = root / f"{file_hash(path)}-{np.dtype(dtype).name}"
    if (entry / "params.json").is_file():
        try:
            loaded = _read_entry(entry)
            logger.info("loaded %s from the weight cache %s", path.name, entry)
            return loaded
        except (OSError, ValueError, KeyError) as e:
            logger.warning("ignoring the unreadable weight cache entry %s: %s", entry, e)
    loaded = read()
    try:
        _write_entry(entry, *loaded)
    except OSError as e:
        logger.warning("could not write the weight cache entry %s: %s", entry, e)
    return loaded


def _leaves(params: Params, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    out = []
    for key, value in params.items():
        name = f"{prefix}{key}"
        out += _leaves(value, f"{name}/") if isinstance(value, dict) else [(name, value)]
    return out


def _write_entry(
    entry: Path, config: ModelConfig, params: Params, tokenizer: tokenizers.Tokenizer
) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        tensors, offset = {}, 0
        with open(staging / "params.bin", "wb") as f:
            for name, value in _leaves(params):
                value = np.ascontiguousarray(value)
                f.write(b"\0" * (-offset % ALIGN))
                offset += -offset % ALIGN
                tensors[name] = {
                    "dtype": value.dtype.name,
                    "shape": list(value.shape),
                    "offset": offset,
                }
                f.write(value.tobytes())
                offset += value.nbytes
        (staging / "config.json").write_text(json.dumps(config.to_dict()))
        tokenizer.save(str(staging / "tokenizer.json"))
        # Written last: an entry is whole once this file exists.
        (staging / "params.json").write_text(json.dumps({"format": FORMAT, "tensors": tensors}))
        try:
            staging.rename(entry)
        except OSError:  # another process renamed its whole entry first
            if not (entry / "params.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_entry(entry: Path) -> Loaded:
    index = json.loads((entry / "params.json").read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"format {index.get('format')!r}, expected {FORMAT}")
    data = np.memmap(entry / "params.bin", np.uint8, mode="r")
    params: Params = {}
    for name, meta in index["tensors"].items():
        dtype = np.dtype(meta["dtype"]) if meta["dtype"] != "bfloat16" else _bfloat16()
        count = int(np.prod(meta["shape"], dtype=np.int64))
        start = meta["offset"]
        value = data[start : start + count * dtype.itemsize].view(dtype).reshape(meta["shape"])
        *parents, leaf = name.split("/")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    config = ModelConfig.from_dict(json.loads((entry / "config.json").read_text()))
    return config, params, tokenizers.Tokenizer.from_file(str(entry / "tokenizer.json"))


def _bfloat16() -> np.dtype:
    import ml_dtypes  # a dependency of jax

    return np.dtype(ml_dtypes.bfloat16)
