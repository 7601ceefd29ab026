"""Progress bars (tqdm), off unless a caller asks for one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def bar(total: int, unit: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar of `total` `unit`s on stderr, as the function that advances it by n; None when
    not enabled (no bar is built, nothing is printed)."""
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, unit=unit, desc="tpuscore") as progress:
        yield progress.update
