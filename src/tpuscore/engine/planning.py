"""Planning a call: group validated requests, pick their backends, split the output back.

Requests that share a query, labels and item_first form one `Group`, so their items fill batches
together and the query runs once. A `Selector` names the backend "auto" runs for a call's groups
(by default `selection.CostModel`, by estimated time and memory), and each backend gets all the
groups that picked it in one call (`by_backend`), where backends that can mix queries in a device
step do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.backends import registry
from tpuscore.backends.contract import BackendOutput, ScoreBatch, make_batch
from tpuscore.backends.pool import BackendPool
from tpuscore.engine import selection


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
    """Names the registered backend that "auto" runs for groups of a call (all item_first, or
    none), which it scores together. `selection.CostModel` is the default."""

    def select(self, batches: Sequence[ScoreBatch], pool: BackendPool) -> str: ...


class FixedRule:
    """prefill_extend whenever the query comes first (it runs the query once, not once per
    item), else serial: the rule before the cost model, for whoever wants it fixed, and auto's
    rule in batch-invariant mode, where a pick must not depend on what else is in the call."""

    def select(self, batches: Sequence[ScoreBatch], pool: BackendPool) -> str:
        return "serial" if batches[0].item_first else "prefill_extend"


def plan(
    requests: Sequence[ScoreRequest],
    backend: str,
    selector: Selector,
    pool: BackendPool,
    *,
    batch_invariant: bool = False,
) -> list[tuple[Group, str]]:
    """Each group with the backend that runs it: `backend`, or for "auto" the selector's pick
    for all of the call's groups at once (item_first ones apart). Every pick is checked against
    its groups before any runs: its capabilities (batch_invariant: that it has that mode, which
    a user's selector might not respect), and that its steps fit the device
    (`selection.check_fits`)."""
    groups = group(requests)
    names = [backend] * len(groups)
    if backend == registry.AUTO:
        for item_first in (False, True):
            members = [i for i, g in enumerate(groups) if g.batch.item_first == item_first]
            if members:
                name = selector.select([groups[i].batch for i in members], pool)
                for i in members:
                    names[i] = name
    planned = list(zip(groups, names, strict=True))
    for g, name in planned:
        registry.check_capabilities(name, g.batch.item_first, batch_invariant)
    for name, named in by_backend(planned).items():
        selection.check_fits(name, pool.get(name), [g.batch for g in named])
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
                classification=requests[i].classification,
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
