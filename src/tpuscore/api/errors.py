"""The one error type for a request the scorer cannot run, shared by validation and backends."""

from __future__ import annotations

from typing import Any


class ValidationError(ValueError):
    """A request the scorer cannot run. `code` is stable; `param` names the offending argument."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param

    def __repr__(self) -> str:
        return f"ValidationError(code={self.code!r}, param={self.param!r}, message={str(self)!r})"

    def within(self, where: str) -> ValidationError:
        """The same error, located inside `where` (e.g. "requests[3]")."""
        param = f"{where}.{self.param}" if self.param else where
        return ValidationError(self.code, f"{where}: {self}", param)


def check_int(param: str, value: Any, *, minimum: int) -> None:
    """Raise `invalid_backend_option` unless value is an int >= minimum (bools are not ints)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValidationError(
            "invalid_backend_option", f"{param} must be an int >= {minimum}, got {value!r}", param
        )
