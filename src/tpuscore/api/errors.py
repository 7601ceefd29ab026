"""The one error type for a request the scorer cannot run, shared by validation and backends.

An error's location is data: `loc`, a path of names and indices such as
`("requests", 3, "items", 0)`. `param` is the same path written out ("requests[3].items[0]"),
for people and for the wire; consumers read `loc` (and `message`, the text without the location
prefix), never parse `param` or the message back.
"""

from __future__ import annotations

import re
from typing import Any

Loc = tuple[str | int, ...]

_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def parse_loc(param: str | None) -> Loc:
    """The path a `param` string names: "requests[3].items[0]" -> ("requests", 3, "items", 0).
    The inverse of `format_loc`, for errors built with a param string."""
    if not param:
        return ()
    return tuple(int(index) if index else name for name, index in _SEGMENT.findall(param))


def format_loc(loc: Loc) -> str | None:
    """A path written out: ("requests", 3, "items", 0) -> "requests[3].items[0]"; () -> None."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text or None


class ValidationError(ValueError):
    """A request the scorer cannot run.

    Attributes:
        code: stable, for programs (a server maps it to a status).
        loc: where, as a path of names and indices (`()` when nowhere in particular).
        param: `loc` written out ("requests[3].items"), or None.
        message: what is wrong, without the location prefix `str(error)` carries.
    """

    def __init__(
        self, code: str, message: str, param: str | None = None, *, loc: Loc | None = None
    ):
        self._init(code, message, parse_loc(param) if loc is None else tuple(loc), ())

    def _init(self, code: str, message: str, loc: Loc, where: Loc) -> None:
        prefix = format_loc(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.code, self.message, self.loc, self._where = code, message, loc, where

    @property
    def param(self) -> str | None:
        return format_loc(self.loc)

    def __repr__(self) -> str:
        return f"ValidationError(code={self.code!r}, loc={self.loc!r}, message={str(self)!r})"

    def __reduce__(self):  # pickles (a Ray worker's error) with its location
        return _rebuild, (type(self), self.code, self.message, self.loc, self._where)

    def at(self, *where: str | int) -> ValidationError:
        """The same error, located inside `where` (e.g. "requests", 3): its loc gets the prefix
        and its text names it."""
        located = ValidationError.__new__(type(self))
        located._init(self.code, self.message, (*where, *self.loc), (*where, *self._where))
        return located

    def within(self, where: str) -> ValidationError:
        """`at` with the location written out (e.g. "requests[3]")."""
        return self.at(*parse_loc(where))

    @property
    def request_index(self) -> int | None:
        """The index of the request a `score_batch`-style error is in ("requests", i, ...)."""
        if len(self.loc) >= 2 and self.loc[0] == "requests" and isinstance(self.loc[1], int):
            return self.loc[1]
        return None


def _rebuild(cls: type, code: str, message: str, loc: Loc, where: Loc) -> ValidationError:
    error = cls.__new__(cls)
    error._init(code, message, loc, where)
    return error


def check_int(param: str, value: Any, *, minimum: int) -> None:
    """Raise `invalid_backend_option` unless value is an int >= minimum (bools are not ints)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValidationError(
            "invalid_backend_option", f"{param} must be an int >= {minimum}, got {value!r}", param
        )
