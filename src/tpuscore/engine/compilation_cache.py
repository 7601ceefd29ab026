"""JAX's persistent compilation cache, turned on for tpuscore's small CPU compiles too.

A restarted process then loads its executables from disk instead of compiling them again. JAX
only caches compiles that took over a second and entries over a size by default, which leaves
most CPU compiles out; tpuscore caches every one.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "TPUSCORE_COMPILATION_CACHE"


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Cache compiled executables under `path` (default: the TPUSCORE_COMPILATION_CACHE environment
    variable; neither: leave JAX's settings alone). Returns the directory in use, or None.

    The setting is process-wide, as JAX's is: the latest directory given wins."""
    path = path if path is not None else os.environ.get(ENV)
    if not path:
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
