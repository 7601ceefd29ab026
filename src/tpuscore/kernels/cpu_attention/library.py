"""The CPU attention kernel's shared library: compiled from its C++ source on first use, kept in
the user cache, registered with XLA:CPU as an FFI target.

The package ships the source (`prefix_attention.cc`), not a binary: the first process that wants
the kernel compiles it with the system C++ compiler (`$CXX`, else `c++`, `g++` or `clang++`;
about 6 s) against the XLA FFI headers jaxlib ships, into an entry keyed by the source, the
compiler and jaxlib, written under a temporary name and renamed into place (so two processes
compiling at once both end with a whole one). Later processes load it. Where it cannot run (not
Linux on x86-64, no compiler, a CPU without AVX-512F, a failed build) `registered()` is False and
callers keep XLA's own ops; `TPUSCORE_CPU_KERNELS=off` turns it off.

The cache lives in `TPUSCORE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tpuscore/kernels` (default
`~/.cache/tpuscore/kernels`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

ENV = "TPUSCORE_CPU_KERNELS"
CACHE_ENV = "TPUSCORE_KERNEL_CACHE"
SOURCE = Path(__file__).with_name("prefix_attention.cc")
FLAGS = ("-O3", "-mavx512f", "-mfma", "-std=c++17", "-shared", "-fPIC", "-pthread")
TARGET = "tpuscore_prefix_attention"  # the FFI target's name in XLA
SYMBOL = "TpuscorePrefixAttention"  # its handler in the library


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tpuscore" / "kernels"


def compiler() -> str | None:
    return os.environ.get("CXX") or next(
        filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None
    )


def _entry(cxx: str) -> Path:
    """The library's path in the cache: keyed by the source, the compiler, jaxlib and the flags."""
    run = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60)
    key = hashlib.blake2b(SOURCE.read_bytes(), digest_size=12)
    key.update(f"{run.stdout}\n{jaxlib.__version__}\n{FLAGS}".encode())
    return cache_dir() / f"prefix_attention-{key.hexdigest()}.so"


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
        os.replace(built, out)


_lock = threading.Lock()  # two threads tracing their first steps at once build and register once


def registered() -> bool:
    """Whether the kernel is registered with XLA:CPU (compiling it the first time)."""
    with _lock:
        return _register()


@functools.cache
def _register() -> bool:
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false"):
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    cxx = compiler()
    if cxx is None:
        logger.info("No C++ compiler: the CPU attention kernel is off (XLA's ops run instead).")
        return False
    try:
        path = _entry(cxx)
        if not path.exists():
            logger.info("Compiling the CPU attention kernel into %s", path)
            _build(cxx, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("The CPU attention kernel did not build; XLA's ops run instead: %s", detail)
        return False
    if not library.tpuscore_cpu_supported():
        return False
    handler = jax.ffi.pycapsule(getattr(library, SYMBOL))
    jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    return True
