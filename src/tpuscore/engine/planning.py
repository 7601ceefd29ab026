"""Planning a call: group validated requests, pick their backends, split the output back.

Requests that share a query, labels, item_first and LoRA adapter form one `Group`, so their
items fill batches together and the query runs once (under its adapter: a query's K/V differ
per adapter). Groups of different adapters still share a backend call, and its device steps
where the backend mixes groups in a step (each row its own adapter).

A `Selector` names the backend "auto" runs for a call's groups (by default
`selection.CostModel`, by estimated time and memory, which hands back the plan it priced), and
each backend gets its groups in one `Call` with that backend's plan, built once: priced,
checked against the device's memory and run as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.backends import registry
from tpuscore.backends.contract import BackendOutput, Plan, ScoreBatch, make_batch
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
            key = (
                tuple(request.query),
                tuple(request.label_ids),
                request.item_first,
                request.adapter,
            )
            keys.setdefault(key, []).append(i)
    groups = []
    for (query, label_ids, item_first, adapter), members in keys.items():
        items = [item for i in members for item in requests[i].items]
        groups.append(
            Group(
                batch=make_batch(query, items, label_ids, item_first, adapter),
                members=tuple(members),
                counts=tuple(len(requests[i].items) for i in members),
                item_tokens=tuple(sum(map(len, requests[i].items)) for i in members),
            )
        )
    return groups


class Selector(Protocol):
    """Names the registered backend that "auto" runs for groups of a call (all item_first, or
    none), which it scores together: its name, or a `selection.Choice` with the plan it priced
    (which then runs as it is). `selection.CostModel` is the default."""

    def select(
        self, batches: Sequence[ScoreBatch], pool: BackendPool
    ) -> str | selection.Choice: ...


def picked(choice: str | selection.Choice) -> str:
    """The backend name of a selector's pick."""
    return choice if isinstance(choice, str) else choice.backend


class FixedRule:
    """prefill_extend whenever the query comes first (it runs the query once, not once per
    item), else serial (`Capabilities.fixed_rule`): the rule before the cost model, for whoever
    wants it fixed, and auto's rule in batch-invariant mode, where a pick must not depend on
    what else is in the call."""

    def select(self, batches: Sequence[ScoreBatch], pool: BackendPool) -> str:
        return registry.fixed_rule(batches[0].item_first)


@attrs.frozen(eq=False)
class Call:
    """One backend call of an engine call: `backend` runs `plan`, which scores `groups`."""

    backend: str
    groups: tuple[Group, ...]
    plan: Plan


def plan(
    requests: Sequence[ScoreRequest],
    backend: str,
    selector: Selector,
    pool: BackendPool,
    *,
    batch_invariant: bool = False,
) -> list[Call]:
    """The backend calls that score these requests: all their groups on `backend`, or for
    "auto" the selector's pick for all of the call's groups at once (item_first ones apart),
    each with its plan (the selector's, else planned here, once). Every pick is checked before
    any runs: its capabilities (batch_invariant: that it has that mode, which a user's selector
    might not respect), then that its priced steps fit the device (`selection.check_fits`)."""
    groups = group(requests)
    picks: list[tuple[str | selection.Choice, list[Group]]] = []
    if backend != registry.AUTO:
        if groups:
            picks.append((backend, groups))
    else:
        for item_first in (False, True):
            members = [g for g in groups if g.batch.item_first == item_first]
            if members:
                picks.append((selector.select([g.batch for g in members], pool), members))
    for choice, members in picks:
        for g in members:
            registry.check_capabilities(
                picked(choice), g.batch.item_first, batch_invariant, adapter=g.batch.adapter != 0
            )
    calls = []
    for choice, members in picks:
        name = picked(choice)
        instance = pool.get(name)
        if isinstance(choice, selection.Choice):
            planned, steps = choice.plan, choice.work
        else:
            planned = instance.plan([g.batch for g in members])
            steps = instance.price(planned)
        selection.check_fits(name, instance, steps)
        calls.append(Call(name, tuple(members), planned))
    return calls


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
