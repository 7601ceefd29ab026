"""What a job's output depends on, recorded in its manifest so a resume can tell that nothing
changed: the input file (its size and content hash, or the store's own checksum) and the model
(its config, dtype and a hash of its weights). `differences` says what changed, for the message
of a refused resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Iterator
from typing import Any

import fsspec
import jax
import numpy as np
from fsspec.implementations.local import LocalFileSystem

CHUNK = 1 << 20
# Checksums object stores keep per object (s3: ETag; gcs: md5Hash, crc32c; azure: content_md5):
# reading them costs one metadata call instead of a download.
STORE_CHECKSUMS = ("md5Hash", "crc32c", "ETag", "etag", "content_md5", "checksum")
_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scorer -> its digests


def of_input(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    """{"size", "sha256"} of a local (or in-memory) file, read once; {"size", <the store's
    checksum>} of an object in a store that keeps one."""
    info = fs.info(path)
    fingerprint: dict[str, Any] = {"size": int(info["size"])}
    if not isinstance(fs, LocalFileSystem):
        for key in STORE_CHECKSUMS:
            if info.get(key) is not None:
                fingerprint[key] = str(info[key])
                return fingerprint
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    fingerprint["sha256"] = digest.hexdigest()
    return fingerprint


def of_bytes(data: bytes) -> str:
    """The sha256 of a file's content, as recorded for a committed shard."""
    return hashlib.sha256(data).hexdigest()


def of_file(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def of_model(scorer: Any) -> dict[str, Any]:
    """The model's config, the precision it runs in and the sha256 of its weights (names, shapes,
    dtypes and bytes; hashed once per scorer), and of its LoRA adapters where it has some (a
    row's `adapter` column names one)."""
    config = json.loads(json.dumps(dataclasses.asdict(scorer.config), default=str))
    model = scorer.engine.model
    if scorer not in _weights:
        _weights[scorer] = _weights_digest(scorer.params), _weights_digest(model.adapters)
    weights, adapters = _weights[scorer]
    # The precision by the name a job is given (dtype="mixed"): mixed and int8 run attention in
    # float32, so scorer.dtype would not tell them from float32.
    fingerprint = {"config": config, "dtype": model.precision, "weights_sha256": weights}
    if model.adapter_names:
        fingerprint["adapters"] = {"names": list(model.adapter_names), "sha256": adapters}
    return fingerprint


def _weights_digest(params: Any) -> str:
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        digest.update(jax.tree_util.keystr(path).encode())
        for index, block in _host_blocks(leaf):
            digest.update(f"{index}:{block.dtype}:{block.shape}".encode())
            digest.update(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
    return digest.hexdigest()


def _host_blocks(leaf: Any) -> Iterator[tuple[Any, np.ndarray]]:
    """A leaf's values on this host: the whole array, or (multi-host) its local shards."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            yield shard.index, np.asarray(shard.data)
        return
    yield None, np.asarray(leaf)


def differences(old: Any, new: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """(key path, old value, new value) of every leaf that differs between two JSON values."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in [*old, *(k for k in new if k not in old)]:
            found += differences(old.get(key), new.get(key), f"{where}.{key}" if where else key)
        return found
    return [] if old == new else [(where, old, new)]
