"""Pair rows into requests: the rows of one query (and the same per-row options) become one
request, so the query's tokens are run once for all its items.

A recommender's table usually holds a user's candidates on consecutive rows; the grouping looks
ahead over a bounded window (a job's shard) so a query's rows that are not adjacent still meet:

    rows      q1 a | q1 b | q2 c | q1 d | q3 e        (window: all five)
    requests  q1 [a, b, d] | q2 [c] | q3 [e]           (first appearance order)

Rows of one query in different windows form separate requests; their scores are the same up to
float rounding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


def freeze(value: Any) -> Hashable:
    """A hashable stand-in for a cell value (lists and dicts as tuples), for grouping keys."""
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def group_rows(keys: Sequence[Hashable]) -> list[list[int]]:
    """Positions of equal keys together, groups in order of their first row, rows in order.

    >>> group_rows(["q1", "q1", "q2", "q1", "q3"])
    [[0, 1, 3], [2], [4]]
    """
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())
