"""Values in error messages, cut to a bounded length.

An error names the value it refuses, and a caller may send anything: a 12 MB string, a list of a
million ids, a structure nested a thousand deep. Every message that shows a caller's value shows
`short(value)`, so an error costs the same whatever was sent.
"""

from __future__ import annotations

import reprlib
from typing import Any

# Characters of one string or other scalar shown; entries of a list, dict or set; nesting.
MAX_STRING = 60
MAX_ENTRIES = 6
MAX_DEPTH = 3

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = (
    MAX_DEPTH,
    MAX_STRING,
    MAX_STRING,
    MAX_STRING,
)
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = _repr.maxfrozenset = MAX_ENTRIES
_repr.maxarray = _repr.maxdeque = MAX_ENTRIES


def short(value: Any) -> str:
    """repr(value), cut: strings to their first and last characters, containers to their first
    entries and three levels; at most a few hundred characters for any value. The cut parts
    show as `...`."""
    text = _repr.repr(value)
    # reprlib bounds a value's own parts; this bounds a custom __repr__ (numpy's, for one).
    limit = 4 * MAX_STRING * MAX_ENTRIES
    return text if len(text) <= limit else text[: limit // 2] + "..." + text[-limit // 2 :]
