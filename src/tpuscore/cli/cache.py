"""`tpuscore cache`: the caches tpuscore keeps on disk, listed, sized and cleared.

    tpuscore cache list                       every entry: kind, size, last use, path
    tpuscore cache size                       each cache's folder, entry count, total and cap
    tpuscore cache clear --kind compilation   remove one kind's entries (default: every kind)

The kinds: `weights` (dequantized GGUF weights, `models/loaders/weight_cache.py`), `kernels`
(the CPU attention kernel's builds, `kernels/cpu_attention/library.py`) and `compilation`
(JAX's persistent compilation cache as the `tpuscore` command keeps it,
`engine/compilation_cache.py`). Each folder is the one the environment chooses
(TPUSCORE_WEIGHTS_CACHE, TPUSCORE_KERNEL_CACHE, TPUSCORE_COMPILATION_CACHE). Clearing also
removes what killed writes left; a process using an entry keeps its copy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("weights", "kernels", "compilation")


@dataclass(frozen=True)
class Cache:
    kind: str
    folder: Path | None  # None: turned off
    setting: str  # the environment variable that moves it
    cap: str  # what bounds it
    entries: Callable[[Path], list[Any]]  # objects with path, bytes, last_used
    remove: Callable[[Path], None]
    tidy: Callable[[Path], Any]


def caches() -> dict[str, Cache]:
    """Each kind's cache where this environment puts it."""
    from tpuscore.engine import compilation_cache
    from tpuscore.kernels.cpu_attention import library
    from tpuscore.models.loaders import weight_cache

    compiled = compilation_cache.command_dir()
    return {
        "weights": Cache(
            "weights",
            weight_cache.cache_dir(),
            weight_cache.ENV,
            human(weight_cache.max_size()),
            weight_cache.entries,
            weight_cache.remove,
            weight_cache.clean_leftovers,
        ),
        "kernels": Cache(
            "kernels",
            library.cache_dir(),
            library.CACHE_ENV,
            f"{library.max_entries()} builds",
            library.entries,
            library.remove,
            library.clean_leftovers,
        ),
        "compilation": Cache(
            "compilation",
            Path(compiled) if compiled else None,
            compilation_cache.ENV,
            human(compilation_cache.max_size()),
            compilation_cache.entries,
            compilation_cache.remove,
            compilation_cache.tidy,
        ),
    }


def add_parser(sub: argparse._SubParsersAction, run: Callable[[argparse.Namespace], int]) -> None:
    help = "list, size or clear the caches tpuscore keeps on disk (weights, kernels, compilation)"
    p = sub.add_parser("cache", help=help, description=help)
    p.set_defaults(run=run, command="cache")
    p.add_argument(
        "action",
        choices=("list", "size", "clear"),
        help="list: every entry; size: totals per cache; clear: remove the entries",
    )
    p.add_argument("--kind", choices=KINDS, help="one kind of cache (default: every kind)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    """The action on the chosen kinds; prints to stdout. ValueError for a bad size setting."""
    found = caches()
    chosen = [found[args.kind]] if args.kind else list(found.values())
    {"list": _list, "size": _size, "clear": _clear}[args.action](chosen)
    return 0


def _entries(cache: Cache) -> list[Any]:
    return [] if cache.folder is None or not cache.folder.is_dir() else cache.entries(cache.folder)


def _where(cache: Cache) -> str:
    return f"off ({cache.setting})" if cache.folder is None else str(cache.folder)


def _list(chosen: list[Cache]) -> None:
    for cache in chosen:
        found = _entries(cache)
        for entry in found:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
            print(f"{cache.kind:<12} {human(entry.bytes):>10}  {used}  {entry.path}")
        total = sum(e.bytes for e in found)
        print(f"{cache.kind}: {_count(len(found))}, {human(total)} in {_where(cache)}")


def _size(chosen: list[Cache]) -> None:
    grand = 0
    for cache in chosen:
        found = _entries(cache)
        total = sum(e.bytes for e in found)
        grand += total
        line = f"{cache.kind:<12} {_count(len(found)):>12} {human(total):>10}  {_where(cache)}"
        print(f"{line} (cap {cache.cap})")
    if len(chosen) > 1:
        print(f"{'total':<12} {'':>12} {human(grand):>10}")


def _clear(chosen: list[Cache]) -> None:
    for cache in chosen:
        found = _entries(cache)
        for entry in found:
            cache.remove(entry.path)
        if cache.folder is not None and cache.folder.is_dir():
            cache.tidy(cache.folder)
        freed = sum(e.bytes for e in found)
        print(f"{cache.kind}: removed {_count(len(found))}, {human(freed)}, from {_where(cache)}")


def _count(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def human(n: int) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 517.2 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
