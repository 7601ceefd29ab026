"""JAX's persistent compilation cache, turned on for tpuscore's small CPU compiles too.

A restarted process then loads its executables from disk instead of compiling them again. JAX
only caches compiles that took over a second and entries over a size by default, which leaves
most CPU compiles out; tpuscore caches every one.

The library leaves the cache off unless asked (`Scorer.from_pretrained(compilation_cache_dir=)`
or TPUSCORE_COMPILATION_CACHE); the `tpuscore` command turns it on by default in the user cache
directory (`command_dir`), so a second call of the same shapes loads instead of compiling.
"""

from __future__ import annotations

import os
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "TPUSCORE_COMPILATION_CACHE"  # a directory, or one of OFF
OFF = frozenset({"", "0", "off", "false", "no", "none"})


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


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Cache compiled executables under `path` (default: the TPUSCORE_COMPILATION_CACHE environment
    variable; neither, "" or a value in OFF: leave JAX's settings alone). Returns the directory in
    use, or None.

    The setting is process-wide, as JAX's is: the latest directory given wins."""
    path = path if path is not None else os.environ.get(ENV)
    if path is None or os.fspath(path).strip().lower() in OFF:
        return None
    path = os.fspath(os.path.abspath(os.path.expanduser(path)))
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        # JAX opens its cache once, at the first compile after a directory is set, and would
        # keep writing to the first directory: reset it so the next compile opens this one.
        jax_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    return path
