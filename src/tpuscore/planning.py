"""Planning a call: group validated requests, pick a backend per group, split its output back.

Requests that share a query, labels and item_first form one `Group`, so their items fill batches
together and the query runs once. A `Selector` names the backend "auto" runs for a group, and
each backend gets all the groups that picked it in one call (`by_backend`), where backends that
can mix queries in a device step do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from tpuscore import validation
from tpuscore.backends import registry
from tpuscore.backends.contract import BackendOutput, ScoreBatch, make_batch
from tpuscore.models.model import Model
from tpuscore.results import ScoreResult
from tpuscore.validation import ScoreRequest


@attrs.frozen
class Group:
    """Requests `members` (indices into the call's requests) scored as one `batch`; member k owns
    the next `counts[k]` items of the batch, in order."""

    batch: ScoreBatch
    members: tuple[int, ...]
    counts: tuple[int, ...]
    item_tokens: tuple[int, ...]


def group(requests: Sequence[ScoreRequest]) -> list[Group]:
    """Groups of the requests that have items, in order of first appearance."""
    keys: dict[tuple, list[int]] = {}
    for i, request in enumerate(requests):
        if request.items:
            key = (tuple(request.query), tuple(request.label_ids), request.item_first)
            keys.setdefault(key, []).append(i)
    groups = []
    for (query, label_ids, item_first), members in keys.items():
        items = [item for i in members for item in requests[i].items]
        groups.append(
            Group(
                batch=make_batch(query, items, label_ids, item_first),
                members=tuple(members),
                counts=tuple(len(requests[i].items) for i in members),
                item_tokens=tuple(sum(map(len, requests[i].items)) for i in members),
            )
        )
    return groups


class Selector(Protocol):
    """Names the registered backend that "auto" runs for a group."""

    def select(self, group: Group, model: Model) -> str: ...


class FixedRule:
    """prefill_extend whenever the query comes first (it runs the query once, not once per
    item), else serial."""

    def select(self, group: Group, model: Model) -> str:
        return "serial" if group.batch.item_first else "prefill_extend"


def plan(
    requests: Sequence[ScoreRequest], backend: str, selector: Selector, model: Model
) -> list[tuple[Group, str]]:
    """Each group with the backend that runs it: `backend`, or the selector's pick for "auto".
    Every pick is checked against the group before any runs."""
    planned = []
    for g in group(requests):
        name = selector.select(g, model) if backend == registry.AUTO else backend
        validation.check_capabilities(name, g.batch.item_first)
        planned.append((g, name))
    return planned


def by_backend(planned: Sequence[tuple[Group, str]]) -> dict[str, list[Group]]:
    """The planned groups of each backend, in plan order: a backend gets all of a call's groups
    at once, so groups with different queries can share its device steps."""
    groups: dict[str, list[Group]] = {}
    for g, name in planned:
        groups.setdefault(name, []).append(g)
    return groups


def split(
    output: BackendOutput, group: Group, requests: Sequence[ScoreRequest], backend: str
) -> list[ScoreResult]:
    """The results of the group's members, in member order."""
    batch = group.batch
    n, c = batch.num_items, batch.num_labels
    if not output.valid[:n].all():
        raise RuntimeError(
            f"backend {backend!r} left items unscored: {np.flatnonzero(~output.valid[:n])}"
        )
    tokens = share_tokens(output.num_tokens, group.counts, group.item_tokens)
    results, start = [], 0
    for i, count, num_tokens in zip(group.members, group.counts, tokens, strict=True):
        results.append(
            ScoreResult(
                output.logprobs[start : start + count, :c],
                backend=backend,
                num_tokens=num_tokens,
                apply_softmax=requests[i].apply_softmax,
            )
        )
        start += count
    return results


def share_tokens(total: int, counts: Sequence[int], item_tokens: Sequence[int]) -> list[int]:
    """Split a group's processed tokens between its requests: each its own item tokens, plus the
    query work in proportion to its item count (the remainder to the first request)."""
    shared = total - sum(item_tokens)
    shares = [shared * c // sum(counts) for c in counts]
    shares[0] += shared - sum(shares)
    return [t + s for t, s in zip(item_tokens, shares, strict=True)]
