"""A cache of dequantized GGUF weights, so that only the first start pays for dequantizing.

Reading a .gguf file dequantizes every tensor and builds the tokenizer (about 10 s for the
default model on a 2-core CPU). The first load writes the result (the parameter tree in the
requested dtype, the config and the tokenizer) to one entry of this cache; later loads
memory-map it instead.

    <cache>/<blake2b of the file>-<dtype>-<code key>/
        params.bin      every parameter's bytes, back to back, 64-byte aligned
        params.json     {"format", "bytes", "crc32", "source", "versions", "tensors":
                        {"layers/wq": {"dtype", "shape", "offset"}, ...}}
        config.json     the ModelConfig
        tokenizer.json

- Keyed by what decides the content: the file's bytes, the dtype, and the code key (a hash of
  tpuscore's version, this format, the versions of gguf, numpy, ml_dtypes and tokenizers, and
  the source of the modules that turn a GGUF file into parameters): a loader fix or an upgrade
  is a new entry, never a stale one.
- An entry is written in a staging folder and renamed into place, so a crash never leaves half
  of one; a staging folder whose process is gone (or older than a day) is removed by the next
  load. An entry that cannot be read (a bad index, a short params.bin, a damaged config or
  tokenizer) is logged, removed and written again; the load itself succeeds. params.bin's CRC-32
  is checked on every load (0.16 s for the default model's 538 MB, against a 0.3 s cached
  start; the pages are read for the device anyway): a flipped byte would otherwise change the
  scores silently (by 4.8 in logprob for one flip in the default model's, measured).
- Bounded: after a write, the least recently used entries go until the cache holds at most
  `TPUSCORE_WEIGHTS_CACHE_MAX_SIZE` (default 10 GiB; "20G", "512M" or bytes); an entry larger
  than that is not written. The folder's modification time records an entry's last use.

The cache lives in `TPUSCORE_WEIGHTS_CACHE` ("off" turns it off), else
`$XDG_CACHE_HOME/tpuscore/weights` (default `~/.cache/tpuscore/weights`). `tpuscore cache`
lists, sizes and clears it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import tokenizers

from tpuscore.api.processes import host_tag, parse_size, pid_alive
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

ENV = "TPUSCORE_WEIGHTS_CACHE"
MAX_SIZE_ENV = "TPUSCORE_WEIGHTS_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 10 << 30
FORMAT = 3  # 3: params.bin's CRC-32 in the index
ALIGN = 64
STALE_SECONDS = 24 * 3600  # a staging folder no live process on this host can be writing
# What decides an entry's bytes besides the file: the packages the loader reads and converts
# with, and the modules that do it (loaders/__init__.py's _read_gguf, gguf.py, weights.py).
DEPENDENCIES = ("tpuscore", "gguf", "numpy", "ml_dtypes", "tokenizers")
_MODELS = Path(__file__).parents[1]
CODE = (
    _MODELS / "loaders" / "__init__.py",
    _MODELS / "loaders" / "gguf.py",
    _MODELS / "weights.py",
    _MODELS / "config.py",
    Path(__file__),
)
Loaded = tuple[ModelConfig, Params, tokenizers.Tokenizer]


def cache_dir() -> Path | None:
    """Where entries live, or None when `TPUSCORE_WEIGHTS_CACHE=off`."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("off", "0", "") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tpuscore" / "weights"


def max_size() -> int:
    """The cap in bytes: `TPUSCORE_WEIGHTS_CACHE_MAX_SIZE`, else `DEFAULT_MAX_BYTES`."""
    value = os.environ.get(MAX_SIZE_ENV)
    return DEFAULT_MAX_BYTES if value is None else parse_size(value, MAX_SIZE_ENV)


@functools.cache
def versions() -> dict[str, str]:
    """What the code key hashes: the format, package versions and a hash of the loader's code."""
    found = {"format": str(FORMAT)}
    for name in DEPENDENCIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "unknown"
    code = hashlib.blake2b(digest_size=8)
    for path in CODE:
        try:
            code.update(path.read_bytes())
        except OSError:  # installed without sources: the versions above still key it
            code.update(f"{path.name} unreadable".encode())
    found["code"] = code.hexdigest()
    return found


def code_key() -> str:
    """The part of an entry's name that `versions()` decides."""
    text = json.dumps(versions(), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def file_hash(path: Path) -> str:
    """blake2b of the file's content (about 0.2 s for 100 MB)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def load_cached(
    path: Path, dtype: np.dtype, read: Callable[[], Loaded], *, max_bytes: int | None = None
) -> Loaded:
    """`read()`'s result for the .gguf file at `path` in `dtype`, from the cache when it holds
    a readable entry for the file's content and this code, else read and stored. An unreadable
    entry is removed and written again; a cache that cannot be written is logged and skipped:
    the load itself never fails for the cache. `max_bytes` caps the cache (default
    `max_size()`)."""
    root = cache_dir()
    if root is None:
        return read()
    try:
        clean_leftovers(root)
    except OSError as e:  # an unreadable cache folder: the entry below fails the same way
        logger.warning("could not tidy the weight cache %s: %s", root, e)
    entry = root / f"{file_hash(path)}-{np.dtype(dtype).name}-{code_key()}"
    if _exists(entry):
        try:
            loaded = _read_entry(entry)
        except Exception as e:  # noqa: BLE001 (whatever is wrong with it, the entry goes)
            logger.warning(
                "the weight cache entry %s is unreadable (%s: %s): removing it and reading %s",
                entry,
                type(e).__name__,
                e,
                path.name,
            )
            remove(entry)
        else:
            _touch(entry)
            logger.info("loaded %s from the weight cache %s", path.name, entry)
            return loaded
    loaded = read()
    cap = max_size() if max_bytes is None else max_bytes
    try:
        if _write_entry(entry, *loaded, source=path.name, cap=cap):
            evict(root, cap, keep=entry)
    except OSError as e:
        logger.warning("could not write the weight cache entry %s: %s", entry, e)
    return loaded


# ---------------------------------------------------------------------------------------------
# Entries: listing, last use, removal, eviction, leftovers


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch


def entries(root: Path | None = None) -> list[Entry]:
    """The whole entries under `root` (default `cache_dir()`), least recently used first."""
    root = cache_dir() if root is None else root
    if root is None or not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(".") or not path.is_dir():
            continue
        try:
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            found.append(Entry(path, size, path.stat().st_mtime))
        except OSError:  # removed meanwhile
            continue
    return sorted(found, key=lambda e: e.last_used)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a folder this user cannot read: as good as empty
        return False


def _touch(entry: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache serves, in its write order
        os.utime(entry)


def remove(path: Path) -> None:
    """Remove an entry or leftover: renamed aside first (atomic, so a reader never sees half of
    one and two removers do not collide), then deleted."""
    aside = path.with_name(f"{_staging_prefix('trash')}{os.urandom(4).hex()}")
    try:
        path.rename(aside)
    except FileNotFoundError:
        return
    except OSError:
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def evict(root: Path, max_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used entries until `root` holds at most `max_bytes` (never
    `keep`); returns the removed entries."""
    found = entries(root)
    total = sum(e.bytes for e in found)
    removed = []
    for e in found:
        if total <= max_bytes:
            break
        if e.path == keep:
            continue
        logger.info("evicting the weight cache entry %s (%d bytes)", e.path, e.bytes)
        remove(e.path)
        total -= e.bytes
        removed.append(e.path)
    return removed


def _staging_prefix(kind: str) -> str:
    return f".{kind}-{os.getpid()}-{host_tag()}-"


_LEFTOVER = re.compile(r"\.(?:staging|trash)-(\d+)-([0-9a-f]{8})-\w+")


def clean_leftovers(root: Path, stale_seconds: float = STALE_SECONDS) -> list[Path]:
    """Remove what killed writes and removals left under `root`: staging folders whose process
    on this host is gone, and any older than `stale_seconds` (another host's, a reused pid,
    an older tpuscore's). Returns what was removed."""
    if not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        if not path.name.startswith("."):
            continue
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        match = _LEFTOVER.fullmatch(path.name)
        mine = match is not None and match[2] == host_tag()
        if age > stale_seconds or (mine and not pid_alive(int(match[1]))):
            logger.info("removing %s, left by a write that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------
# Reading and writing one entry


def _leaves(params: Params, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    out = []
    for key, value in params.items():
        name = f"{prefix}{key}"
        out += _leaves(value, f"{name}/") if isinstance(value, dict) else [(name, value)]
    return out


def _write_entry(
    entry: Path,
    config: ModelConfig,
    params: Params,
    tokenizer: tokenizers.Tokenizer,
    *,
    source: str,
    cap: int,
) -> bool:
    """Write the entry (False, nothing written, when its tensors alone exceed `cap`)."""
    leaves = [(name, np.ascontiguousarray(value)) for name, value in _leaves(params)]
    size = sum(value.nbytes + ALIGN for _, value in leaves)
    if size > cap:
        logger.info(
            "not caching %s: its %d bytes exceed the weight cache's cap of %d (%s)",
            source,
            size,
            cap,
            MAX_SIZE_ENV,
        )
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix("staging"), dir=entry.parent))
    try:
        tensors, offset, crc = {}, 0, 0
        with open(staging / "params.bin", "wb") as f:
            for name, value in leaves:
                padding = b"\0" * (-offset % ALIGN)
                f.write(padding)
                crc = zlib.crc32(padding, crc)
                offset += len(padding)
                tensors[name] = {
                    "dtype": value.dtype.name,
                    "shape": list(value.shape),
                    "offset": offset,
                }
                raw = value.reshape(-1).view(np.uint8)
                f.write(raw)
                crc = zlib.crc32(raw, crc)
                offset += value.nbytes
        (staging / "config.json").write_text(json.dumps(config.to_dict()))
        tokenizer.save(str(staging / "tokenizer.json"))
        index = {
            "format": FORMAT,
            "bytes": offset,
            "crc32": crc,
            "source": source,
            "versions": versions(),
            "tensors": tensors,
        }
        (staging / "params.json").write_text(json.dumps(index))
        try:
            staging.rename(entry)
        except OSError:  # another process renamed its whole entry first
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def _read_entry(entry: Path) -> Loaded:
    index = json.loads((entry / "params.json").read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"format {index.get('format')!r}, expected {FORMAT}")
    size = (entry / "params.bin").stat().st_size
    if size != index["bytes"]:
        raise ValueError(f"params.bin holds {size} bytes, its index says {index['bytes']}")
    data = np.memmap(entry / "params.bin", np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    crc = zlib.crc32(data)
    if crc != index["crc32"]:
        raise ValueError(f"params.bin's CRC-32 is {crc}, its index says {index['crc32']}")
    params: Params = {}
    for name, meta in index["tensors"].items():
        dtype = np.dtype(meta["dtype"]) if meta["dtype"] != "bfloat16" else _bfloat16()
        count = int(np.prod(meta["shape"], dtype=np.int64))
        start, stop = meta["offset"], meta["offset"] + count * dtype.itemsize
        if stop > size:
            raise ValueError(f"tensor {name} ends at byte {stop}, past params.bin's {size}")
        value = data[start:stop].view(dtype).reshape(meta["shape"])
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
