"""JAX's persistent compilation cache, turned on for tpuscore's small CPU compiles too, bounded,
and healing.

A restarted process then loads its executables from disk instead of compiling them again. JAX
only caches compiles that took over a second and entries over a size by default, which leaves
most CPU compiles out; tpuscore caches every one.

- Bounded: JAX's own cap (`jax_compilation_cache_max_size`) evicts the least recently used
  entries past `TPUSCORE_COMPILATION_CACHE_MAX_SIZE` (default 2 GiB; "4G", "512M" or bytes; 0
  turns caching off); a directory already over the cap is trimmed when the cache is enabled.
- Trusted: JAX runs the executables it loads, so a folder another user could write (the kernel
  cache's rule, `kernels/cpu_attention/library.py`) is refused with a warning and the cache
  stays off; a missing folder is created readable by this user only.
- Healing: JAX writes an entry in place (a killed write leaves half of one) and never replaces
  an entry it could not read (it warns and compiles again, every time). tpuscore's cache writes
  aside and renames, and a put replaces what is there: JAX puts a key only after it missed it or
  could not read it, so an unreadable entry is rewritten by the next compile of its key.
  Enabling also gives entries an older JAX wrote without a last-use time one (JAX's eviction
  fails on them), and removes orphaned times and killed writes' temporary files.

The library leaves the cache off unless asked (`Scorer.from_pretrained(compilation_cache_dir=)`
or TPUSCORE_COMPILATION_CACHE); the `tpuscore` command turns it on by default in the user cache
directory (`command_dir`), so a second call of the same shapes loads instead of compiling.
`tpuscore cache` lists, sizes and clears it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from tpuscore.api.processes import host_tag, parse_size, pid_alive

logger = logging.getLogger(__name__)

ENV = "TPUSCORE_COMPILATION_CACHE"  # a directory, or one of OFF
MAX_SIZE_ENV = "TPUSCORE_COMPILATION_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 2 << 30
OFF = frozenset({"", "0", "off", "false", "no", "none"})
ENTRY, LAST_USE = "-cache", "-atime"  # JAX's file suffixes (jax/_src/lru_cache.py)
STALE_SECONDS = 3600  # a temporary file no live process can still be writing


def default_dir() -> str:
    """The user cache directory's tpuscore/jax-compilation (XDG_CACHE_HOME or ~/.cache on Linux,
    ~/Library/Caches on macOS, LOCALAPPDATA on Windows)."""
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    elif os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~/AppData/Local")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "tpuscore", "jax-compilation")


def command_dir(disabled: bool = False) -> str:
    """The directory the `tpuscore` command caches in: TPUSCORE_COMPILATION_CACHE if set,
    else `default_dir()`; "" (off) when `disabled` (--no-compilation-cache) or the variable is
    one of OFF ("off", "0", ...). Pass it to `enable` or `from_pretrained`."""
    if disabled:
        return ""
    value = os.environ.get(ENV)
    if value is None:
        return default_dir()
    return "" if value.strip().lower() in OFF else value


def max_size() -> int:
    """The cap in bytes: TPUSCORE_COMPILATION_CACHE_MAX_SIZE, else `DEFAULT_MAX_BYTES`."""
    value = os.environ.get(MAX_SIZE_ENV)
    return DEFAULT_MAX_BYTES if value is None else parse_size(value, MAX_SIZE_ENV)


def enable(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> str | None:
    """Cache compiled executables under `path` (default: the TPUSCORE_COMPILATION_CACHE environment
    variable; neither, "" or a value in OFF: leave JAX's settings alone), at most `max_bytes`
    (default `max_size()`). Returns the directory in use, or None.

    The setting is process-wide, as JAX's is: the latest directory given wins."""
    path = path if path is not None else os.environ.get(ENV)
    if path is None or os.fspath(path).strip().lower() in OFF:
        return None
    path = os.fspath(os.path.abspath(os.path.expanduser(path)))
    cap = max_size() if max_bytes is None else max_bytes
    try:
        problem = _untrusted(Path(path))
        if not Path(path).is_dir():  # JAX would fail the first compile on it
            raise NotADirectoryError(f"{path} is not a folder")
        if problem is None:
            tidy(Path(path))
    except OSError as e:  # a file in its place, a parent that cannot be created or read
        # The cache only saves compiles: the command runs without it, as with an untrusted one.
        logger.warning("Not caching compiled executables in %s: %s", path, e)
        return None
    if problem is not None:
        logger.warning(
            "Not caching compiled executables in %s: %s. JAX runs what it loads from there, so "
            "another user could run code as you; make the folder yours and writable by you "
            "only (chmod go-w), or choose another.",
            path,
            problem,
        )
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    jax.config.update("jax_compilation_cache_max_size", cap)
    jax.config.update("jax_compilation_cache_dir", path)
    # JAX opens its cache once, at the first compile after a directory is set, and would keep
    # the first directory and cap: reset it, and open this one as tpuscore's.
    jax_cache.reset_cache()
    try:
        _install(path, cap)
    except OSError as e:  # a folder it may read but not write: evicting fails
        jax.config.update("jax_compilation_cache_dir", None)
        jax_cache.reset_cache()
        logger.warning("Not caching compiled executables in %s: %s", path, e)
        return None
    return path


def _untrusted(folder: Path) -> str | None:
    """Why another user could have written `folder` (creating it, private, if missing), or None:
    the kernel cache's rule (`library.folder_problem`)."""
    from tpuscore.kernels.cpu_attention import library

    library.private_folder(folder)
    if not hasattr(os, "getuid"):  # Windows: no owner or mode bits to check
        return None
    return library.folder_problem(folder)


# ---------------------------------------------------------------------------------------------
# The cache JAX writes through


def _healing_cache_class():
    from jax._src.lru_cache import LRUCache

    class HealingCache(LRUCache):
        """JAX's LRU file cache whose put writes aside and renames, replacing what is there."""

        def put(self, key: str, value: bytes) -> None:
            if not key:
                raise ValueError("key cannot be empty")
            if self.eviction_enabled and len(value) > self.max_size:
                return super().put(key, value)  # JAX warns and skips it
            with self._locked():
                self._evict_if_needed(additional_size=len(value))
                _write_whole(Path(self.path) / f"{key}{ENTRY}", value)
                if self.eviction_enabled:
                    _stamp(Path(self.path) / f"{key}{LAST_USE}", time.time_ns())
            return None

        def _locked(self):
            if not self.eviction_enabled:
                return contextlib.nullcontext()
            return self.lock.acquire(timeout=self.lock_timeout_secs)

        def _evict_if_needed(self, *, additional_size: int = 0) -> None:
            if self.eviction_enabled:
                evict(Path(self.path), self.max_size - additional_size)

    return HealingCache


def _install(path: str, cap: int) -> None:
    """Make tpuscore's cache the one JAX reads and writes (JAX's internals: where they differ
    from jax 0.10's, JAX's own cache runs, bounded but not healing)."""
    try:
        from jax._src import compilation_cache as internals

        cache = _healing_cache_class()(path, max_size=cap)
        if cache.eviction_enabled:
            with cache.lock.acquire(timeout=cache.lock_timeout_secs):
                evict(Path(path), cap)
        if jax.config.jax_compilation_cache_check_contents:
            cache = internals.VerificationCache(cache)
        with internals._cache_initialized_mutex:
            internals._cache = cache
            internals._cache_initialized = True
    except (ImportError, AttributeError, TypeError) as error:
        logger.info("JAX's own compilation cache runs (bounded, not healing): %s", error)


# ---------------------------------------------------------------------------------------------
# Entries: listing, eviction, tidying


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch


def entries(root: Path) -> list[Entry]:
    """The executables under `root`, least recently used first."""
    found = []
    for path in Path(root).glob(f"*{ENTRY}"):
        try:
            found.append(Entry(path, path.stat().st_size, _last_use(path) / 1e9))
        except OSError:  # removed meanwhile
            continue
    return sorted(found, key=lambda e: e.last_used)


def _last_use(entry: Path) -> int:
    """ns since the epoch: JAX's record, else the file's modification time."""
    stamp = entry.with_name(entry.name[: -len(ENTRY)] + LAST_USE)
    try:
        return int.from_bytes(stamp.read_bytes()[:8], "little")
    except OSError:
        return entry.stat().st_mtime_ns


def remove(entry: Path) -> None:
    entry.unlink(missing_ok=True)
    entry.with_name(entry.name[: -len(ENTRY)] + LAST_USE).unlink(missing_ok=True)


def evict(root: Path, max_bytes: int) -> list[Path]:
    """Remove the least recently used executables until `root` holds at most `max_bytes`."""
    found = entries(root)
    total = sum(e.bytes for e in found)
    removed = []
    for e in found:
        if total <= max_bytes:
            break
        logger.debug("evicting the compilation cache entry %s (%d bytes)", e.path, e.bytes)
        remove(e.path)
        total -= e.bytes
        removed.append(e.path)
    return removed


def tidy(root: Path) -> None:
    """Give each entry without a last-use time one (its modification time), remove last-use
    times without an entry, and temporary files of writes whose process is gone."""
    for stamp in root.glob(f"*{LAST_USE}"):
        if not stamp.with_name(stamp.name[: -len(LAST_USE)] + ENTRY).exists():
            stamp.unlink(missing_ok=True)
    for entry in root.glob(f"*{ENTRY}"):
        stamp = entry.with_name(entry.name[: -len(ENTRY)] + LAST_USE)
        if not stamp.exists():
            with contextlib.suppress(OSError):
                _stamp(stamp, entry.stat().st_mtime_ns)
    for path in root.glob(".tmp-*"):
        _, pid, host, _ = (path.name.split("-", 3) + ["", "", ""])[:4]
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if age > STALE_SECONDS or (
            host == host_tag() and pid.isdigit() and not pid_alive(int(pid))
        ):
            path.unlink(missing_ok=True)


def _stamp(path: Path, ns: int) -> None:
    path.write_bytes(ns.to_bytes(8, "little"))


def _write_whole(path: Path, value: bytes) -> None:
    fd, name = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-{host_tag()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(name, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
