"""What the on-disk caches and job outputs share about the processes that write them: this
host's short tag (written into staging names, so a leftover is known as this host's), whether a
writer's process still runs, and byte sizes given in settings."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import sys
from typing import Any

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


@functools.cache
def host_tag() -> str:
    """8 hex digits of this host's name: short enough for a file name, enough to tell hosts."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` on this host still runs; True where it cannot be told (a pid that
    is not one, another user's process, Windows, where os.kill(pid, 0) would signal it)."""
    if not isinstance(pid, int) or pid <= 0 or sys.platform == "win32":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def parse_size(text: str, name: str) -> int:
    """Bytes from "10G", "512M", "1.5GiB", "4096" (binary units); ValueError naming `name`."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{name}={text!r} is not a size such as 10G, 512M or 4096 (bytes)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))
