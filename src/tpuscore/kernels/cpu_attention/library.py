"""The CPU attention kernels' shared library: compiled from its C++ sources on first use, kept in
the user cache, registered with XLA:CPU as FFI targets.

The package ships the sources (`prefix_attention.cc`, `segment_attention.cc` and the `common.h`
they share), not a binary: the first process that wants the kernels compiles them with the system
C++ compiler (`$CXX`, split as a shell would, so `CXX="ccache g++"` works; else `c++`, `g++` or
`clang++`; about 6 s) against the XLA FFI headers jaxlib ships, into an entry keyed by the sources,
the compiler and jaxlib, written under a temporary name and renamed into place (so two processes
compiling at once both end with a whole one; a killed build's temporary file is removed by a later
one). Later processes load it; one that does not load, or whose bytes are not those built (a
SHA-256 written beside it at build time, checked before each load), is built again. Where it
cannot run (not Linux on x86-64, no compiler, a CPU without AVX-512F, a failed build)
`registered()` is False and callers keep XLA's own ops; `TPUSCORE_CPU_KERNELS=off` turns it off.

Loading a library runs its code, so the cache is trusted only when no other user could have
written it: the folder (and every folder above it, unless sticky like /tmp) must be owned by
this user (or root) and not writable by group or others, and the library owned by this user
and not writable by others. A folder that fails this is refused with a warning and the kernel
is built into a private temporary folder for this process instead; a library file that fails
it is removed and built again.

The cache lives in `TPUSCORE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tpuscore/kernels` (default
`~/.cache/tpuscore/kernels`), keeping the 8 most recently loaded builds
(`TPUSCORE_KERNEL_CACHE_MAX_ENTRIES`). `tpuscore cache` lists, sizes and clears it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib

from tpuscore.api.processes import host_tag, pid_alive

logger = logging.getLogger(__name__)

ENV = "TPUSCORE_CPU_KERNELS"
CACHE_ENV = "TPUSCORE_KERNEL_CACHE"
MAX_ENTRIES_ENV = "TPUSCORE_KERNEL_CACHE_MAX_ENTRIES"
DIGEST = ".sha256"  # beside each library: its SHA-256, checked before it is loaded
DEFAULT_MAX_ENTRIES = 8  # builds for other compilers or jaxlibs beyond these go, oldest first
SOURCES = tuple(
    Path(__file__).with_name(f"{name}.cc") for name in ("prefix_attention", "segment_attention")
)
# what the sources include: part of the key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("common.h", "bf16_tiles.h"))
FLAGS = ("-O3", "-mavx512f", "-mfma", "-std=c++17", "-shared", "-fPIC", "-pthread")
# FFI target in XLA -> its handler in the library
TARGETS = {
    "tpuscore_prefix_attention": "TpuscorePrefixAttention",
    "tpuscore_segment_attention": "TpuscoreSegmentAttention",
}
PREFIX_TARGET, SEGMENT_TARGET = TARGETS
SUPPORTED = "tpuscore_cpu_supported"  # whether this CPU runs it
BF16_DOTS = "tpuscore_cpu_bf16_dots"  # whether this CPU runs the segment kernel's bfloat16 dots
STALE_SECONDS = 24 * 3600  # a temporary build file no live process can be writing
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tpuscore" / "kernels"


def compiler() -> list[str] | None:
    """The compiler's command: `$CXX` split as a shell would (ValueError if it cannot be), else
    the first of c++, g++ and clang++ on the PATH; None if there is none."""
    configured = os.environ.get("CXX", "").strip()
    if configured:
        command = shlex.split(configured)
        if command:
            return command
    found = next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)
    return None if found is None else [found]


def entry_name(cxx: list[str]) -> str:
    """The library's file name in the cache: keyed by the sources, the compiler, jaxlib and the
    flags."""
    run = subprocess.run(
        [*cxx, "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    key = hashlib.blake2b(digest_size=12)
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    key.update(f"{run.stdout}\n{jaxlib.__version__}\n{FLAGS}".encode())
    return f"prefix_attention-{key.hexdigest()}.so"


# ---------------------------------------------------------------------------------------------
# Trust: who could have written the folder and the file


def folder_problem(folder: Path) -> str | None:
    """Why code in `folder` could have been written by another user, or None if it could not:
    the folder must be this user's and writable by no one else; each folder above it this
    user's or root's, and writable by no one else unless sticky (as /tmp is)."""
    uid = os.getuid()
    real = folder.resolve()
    for path in (real, *real.parents):
        info = os.stat(path)
        leaf = path == real
        owners = (uid,) if leaf else (uid, 0)
        if info.st_uid not in owners:
            return f"{path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
        sticky = not leaf and info.st_mode & stat.S_ISVTX
        if info.st_mode & WRITABLE_BY_OTHERS and not sticky:
            return f"{path} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def file_problem(path: Path) -> str | None:
    """Why the library file `path` cannot be trusted (not a regular file of this user's, or
    writable by others), or None."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.getuid()})"
    if info.st_mode & WRITABLE_BY_OTHERS:
        return f"{path} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def private_folder(folder: Path) -> None:
    """Create the missing folders of `folder`, readable and writable by this user only."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it
            path.mkdir(mode=0o700)


# ---------------------------------------------------------------------------------------------
# Building and loading


def load_library(cxx: list[str], folder: Path | None = None) -> ctypes.CDLL | None:
    """The kernel's library from `folder` (default `cache_dir()`), built there first if absent,
    untrusted or unloadable; built into a private temporary folder if `folder` is untrusted.
    None, with a warning, when it does not build or load."""
    folder = cache_dir() if folder is None else folder
    try:
        name = entry_name(cxx)
        private_folder(folder)
        problem = folder_problem(folder)
        if problem is None:
            clean_leftovers(folder)
            library = _load_or_build(cxx, folder / name)
            try:
                limit = max_entries()
            except ValueError as error:
                logger.warning("%s; keeping %d", error, DEFAULT_MAX_ENTRIES)
                limit = DEFAULT_MAX_ENTRIES
            evict(folder, limit, keep=folder / name)
            return library
        logger.warning(
            "Not using the kernel cache %s: %s (another user could plant code there). Building "
            "the CPU attention kernel into a private temporary folder for this process; make "
            "the folder yours and writable by you only (chmod go-w) or set %s to keep builds.",
            folder,
            problem,
            CACHE_ENV,
        )
        with tempfile.TemporaryDirectory(prefix="tpuscore-kernel-") as private:
            return _load_or_build(cxx, Path(private) / name)  # a loaded library outlives its file
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("The CPU attention kernel did not build; XLA's ops run instead: %s", detail)
        return None


def _load_or_build(cxx: list[str], path: Path) -> ctypes.CDLL:
    if path.exists() or path.is_symlink():
        problem = file_problem(path) or digest_problem(path)
        if problem is None:
            try:
                library = _open(path)
                with contextlib.suppress(OSError):
                    os.utime(path)  # its last use, which `tpuscore cache list` shows
                return library
            except OSError as error:
                problem = f"it does not load: {error}"
        logger.warning("Building the CPU attention kernel %s again: %s", path, problem)
        remove(path)
    logger.info("Compiling the CPU attention kernel into %s", path)
    _build(cxx, path)
    return _open(path)


def _open(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    for symbol in (*TARGETS.values(), SUPPORTED, BF16_DOTS):
        if not hasattr(library, symbol):
            raise OSError(f"{path} has no symbol {symbol}")
    return library


def _temporary_prefix() -> str:
    return f".build-{os.getpid()}-{host_tag()}-"


def _build(cxx: list[str], out: Path) -> None:
    fd, name = tempfile.mkstemp(prefix=_temporary_prefix(), suffix=".so", dir=out.parent)
    os.close(fd)
    built = Path(name)
    try:
        command = [*cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(built)]
        subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
        os.chmod(built, 0o755)  # whatever the umask: writable by this user only
        # The digest first: a process loading between the two renames finds the old library
        # under the new digest and builds again, never a library under a digest not its own.
        digest_of(built).write_text(_sha256(built))
        os.replace(digest_of(built), digest_of(out))
        os.replace(built, out)
    finally:
        built.unlink(missing_ok=True)
        digest_of(built).unlink(missing_ok=True)


def digest_of(library: Path) -> Path:
    """The file beside `library` holding its SHA-256, written when it is built."""
    return library.with_name(library.name + DIGEST)


def digest_problem(library: Path) -> str | None:
    """Why `library`'s bytes are not those built (no digest beside it, or another), or None:
    a damaged library that still loads would run."""
    try:
        recorded = digest_of(library).read_text().strip()
    except OSError:
        return "it has no digest beside it"
    if recorded != _sha256(library):
        return "its bytes are not those built (its SHA-256 differs from the digest beside it)"
    return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clean_leftovers(folder: Path, stale_seconds: float = STALE_SECONDS) -> list[Path]:
    """Remove temporary build files whose process on this host is gone, and any older than
    `stale_seconds`. Returns what was removed."""
    removed = []
    for path in folder.glob(".build-*"):
        try:
            age = time.time() - path.lstat().st_mtime
        except OSError:
            continue
        _, pid, host, _ = (path.name.split("-", 3) + ["", "", ""])[:4]
        dead = host == host_tag() and pid.isdigit() and not pid_alive(int(pid))
        if dead or age > stale_seconds:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------
# Entries, for `tpuscore cache`


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch: its last load


def entries(folder: Path | None = None) -> list[Entry]:
    """The built libraries in `folder` (default `cache_dir()`), least recently used first."""
    folder = cache_dir() if folder is None else folder
    found = []
    for path in folder.glob("prefix_attention-*.so"):
        with contextlib.suppress(OSError):
            info = path.lstat()
            found.append(Entry(path, info.st_size, info.st_mtime))
    return sorted(found, key=lambda e: e.last_used)


def remove(entry: Path) -> None:
    entry.unlink(missing_ok=True)  # a process that loaded it keeps it
    digest_of(entry).unlink(missing_ok=True)


def max_entries() -> int:
    """How many builds the cache keeps: TPUSCORE_KERNEL_CACHE_MAX_ENTRIES, else 8."""
    value = os.environ.get(MAX_ENTRIES_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_ENTRIES
    if not value.isdigit():
        raise ValueError(f"{MAX_ENTRIES_ENV}={value!r} is not a whole number of builds")
    return int(value)


def evict(folder: Path, count: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently loaded builds until `folder` holds at most `count` (never
    `keep`); returns the removed ones."""
    found = [e.path for e in entries(folder) if e.path != keep]
    removed = found[: max(0, len(found) + (keep is not None) - count)]
    for path in removed:
        logger.info("evicting the CPU kernel build %s", path)
        remove(path)
    return removed


# ---------------------------------------------------------------------------------------------
# Registration

_lock = threading.Lock()  # two threads tracing their first steps at once build and register once


def registered() -> bool:
    """Whether the kernel is registered with XLA:CPU (compiling it the first time)."""
    with _lock:
        return _register() is not None


def bf16_dots() -> bool:
    """Whether the segment kernel's bfloat16 dots (AVX-512 BF16) run in this process."""
    with _lock:
        library = _register()
    return library is not None and bool(getattr(library, BF16_DOTS)())


@functools.cache
def _register() -> ctypes.CDLL | None:
    """The library, loaded and its targets registered; None where the kernel is off."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "false"):
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        cxx = compiler()
    except ValueError as error:
        logger.warning(
            "CXX=%r cannot be split (%s); XLA's ops run instead", os.environ["CXX"], error
        )
        return None
    if cxx is None:
        logger.info("No C++ compiler: the CPU attention kernel is off (XLA's ops run instead).")
        return None
    library = load_library(cxx)
    if library is None or not getattr(library, SUPPORTED)():
        return None
    for target, symbol in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    return library
