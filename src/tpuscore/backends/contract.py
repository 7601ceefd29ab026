"""The backend contract: the `Backend` protocol every backend implements, what the engine hands
it and what it hands back.

A backend receives validated `ScoreBatch`es, padded to bucket shapes, one per group (a query with
its items and labels). `plan(batches)` says which device steps will score them (a `Plan`),
`price(plan)` what each of those steps computes and holds (`StepWork`, for the cost model and the
memory checks), and `run(plan)` runs them, returning a `BackendOutput` per group: logprobs in the
batch's padded shape, a validity mask, and the stats of the steps it ran. The engine plans once
and hands that plan to the pricing, the memory check and the run; only an out-of-memory retry
plans again (after `grow_safety`).

Each backend lists its jitted steps in a step table (`steps`: name -> `Step`, the function and a
factory of zero inputs for a shape), and `shapes(limits)`, every `StepShape` it can compile for
requests within limits; warming a shape is running its step once on those zeros (`warm`).

Backends build their output through `BackendOutput.for_batch` (one group) or
`BackendOutput.for_groups` (several), which keep every step's result on device until the end, so
all steps of a call are dispatched before the host waits for any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from tpuscore.backends.buckets import (
    MIN_LABEL_BUCKET,
    bucket_count,
    bucket_tokens,
    row_buckets,
)
from tpuscore.backends.work import StepWork
from tpuscore.parallel.sharding import to_host


@attrs.frozen
class ScoreBatch:
    """A validated request. Rows at or past `num_items` and labels past `num_labels` are padding.

    query [Q], items [I, L], item_lens [I], label_ids [C]; all int32, zero-padded. adapter: the
    LoRA adapter every row runs under (`Model.adapters` index; 0: none), which only backends
    with `Capabilities.adapters` are handed.
    """

    query: np.ndarray
    query_len: int
    items: np.ndarray
    item_lens: np.ndarray
    num_items: int
    label_ids: np.ndarray
    num_labels: int
    item_first: bool
    adapter: int = 0

    def sequence(self, i: int) -> np.ndarray:
        """The tokens scored for item i: query + item, or item + query with item_first."""
        q, it = self.query[: self.query_len], self.items[i, : self.item_lens[i]]
        return np.concatenate([it, q] if self.item_first else [q, it])

    @property
    def sequence_lens(self) -> np.ndarray:
        """Scored-sequence length per real item [num_items]."""
        return self.query_len + self.item_lens[: self.num_items]


def make_batch(
    query: Sequence[int],
    items: Sequence[Sequence[int]],
    label_ids: Sequence[int],
    item_first: bool,
    adapter: int = 0,
) -> ScoreBatch:
    """Pad validated token ids to bucket shapes."""
    n = len(items)
    lens = [len(it) for it in items]
    query_arr = np.zeros(bucket_tokens(len(query)), np.int32)
    query_arr[: len(query)] = query
    items_arr = np.zeros((bucket_count(n), bucket_tokens(max(lens, default=0))), np.int32)
    for i, it in enumerate(items):
        items_arr[i, : len(it)] = it
    item_lens = np.zeros(items_arr.shape[0], np.int32)
    item_lens[:n] = lens
    labels_arr = np.zeros(bucket_count(len(label_ids), MIN_LABEL_BUCKET), np.int32)
    labels_arr[: len(label_ids)] = label_ids
    return ScoreBatch(
        query=query_arr,
        query_len=len(query),
        items=items_arr,
        item_lens=item_lens,
        num_items=n,
        label_ids=labels_arr,
        num_labels=len(label_ids),
        item_first=item_first,
        adapter=adapter,
    )


def stack_labels(label_ids: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """Label ids per row [rows, C] for rows of different groups: row r gets label_ids[r], and all
    are padded with 0 to the widest (each is a label bucket already, so the width is one too).
    Rows past len(label_ids) are padding."""
    labels = np.zeros((rows, max(len(ids) for ids in label_ids)), np.int32)
    for r, ids in enumerate(label_ids):
        labels[r, : len(ids)] = ids
    return labels


@attrs.frozen
class ShapeLimits:
    """The requests a scorer's shape set covers: queries of at most `query_tokens` tokens, items
    of at most `item_tokens`, at most `labels` label ids, any number of items and requests per
    call; loglikelihood contexts and continuations as queries and items, prompt log-probabilities
    prompts of at most `query_tokens`. Items per step are the backends' own (their budgets and
    options)."""

    query_tokens: int
    item_tokens: int
    labels: int

    def label_widths(self) -> list[int]:
        """The label buckets (`make_batch`) of 1..labels labels."""
        return row_buckets(MIN_LABEL_BUCKET, bucket_count(self.labels, MIN_LABEL_BUCKET))


@attrs.frozen
class StepShape:
    """One executable: the jitted `step` at padded input `shape`, of `backend` where the engine
    lists several backends' (`Scorer.shapes`); `StepStats.shapes` records a run's."""

    step: str
    shape: tuple[int, ...]
    backend: str = ""

    def sort_key(self) -> tuple:
        return (self.backend, self.step, self.shape)


@attrs.frozen
class Step:
    """One jitted device step of a backend's step table: its `name`, the `function` its run
    calls, and `zeros(shape)`: the (args, kwargs) of zeros `function` takes at a padded input
    `shape` (a `StepShape.shape`), placed as the run places its inputs, built without
    compiling anything."""

    name: str
    function: Callable[..., Any]
    zeros: Callable[[tuple[int, ...]], tuple[tuple, dict[str, Any]]]


StepTable = Mapping[str, Step]


def step_table(*steps: Step) -> dict[str, Step]:
    """A step table from its steps, by name."""
    return {step.name: step for step in steps}


def warm(table: StepTable, shape: StepShape) -> None:
    """Compile one shape: run its step once on zeros of that shape."""
    step = table.get(shape.step)
    if step is None:
        raise ValueError(f"no step {shape.step!r}; the steps are {sorted(table)}")
    args, kwargs = step.zeros(tuple(shape.shape))
    step.function(*args, **kwargs)


@attrs.frozen(eq=False)
class ContinuationScores:
    """One continuation's scores from a loglikelihood plan: each token's log-probability
    (read-only float32 [tokens]) and whether every token is the model's argmax."""

    token_logprobs: np.ndarray
    is_greedy: bool


# The most likely tokens a prompt log-probabilities plan reports at each position (vLLM's
# default max_logprobs): a constant of its step, so the shape set holds one executable per shape.
TOP_LOGPROBS = 20


@attrs.frozen(eq=False)
class PositionScores:
    """One continuation's scores from a prompt log-probabilities plan, r tokens after a context:
    each token's log-probability (float32 [r]), and at each of the r + 1 positions from the
    context's last token on the TOP_LOGPROBS most likely tokens' log-probabilities (float32
    [r + 1, TOP_LOGPROBS], best first) and ids (int64, the same shape): row j is what predicts
    token j, row r the token after."""

    token_logprobs: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray


@attrs.frozen(eq=False)
class Plan:
    """What a backend will run for one call: the groups it scores (`batches`) and `steps` in the
    backend's own step types: a list, or where a step depends on the result of one before it
    (prefill_extend's waves see what earlier waves put in its prefix cache), what the backend
    expands step by step as it runs and as it prices."""

    batches: tuple[ScoreBatch, ...]
    steps: Any


class Backend(Protocol):
    """What every backend implements; `registry.register` refuses a class without one of these
    members and names it. `budgets.Budgeted` gives the budget members; a backend that scores one
    group at a time with no compiled steps of its own can subclass `base.PerGroupBackend` and
    write only `score(batch)`.

    Attributes:
        steps: its step table (name -> `Step`): every jitted step it runs, which warmup and the
            shape set read.
        safety: the factor its budget is divided by (1 until a step ran out of memory).
    """

    steps: StepTable
    safety: float

    @property
    def budget(self) -> int:
        """The bytes one step's activations may plan for."""
        ...

    @property
    def peak_budget(self) -> int:
        """What a step's estimated peak (`StepWork.peak`) may reach: `budget` and what the
        backend holds across steps."""
        ...

    def grow_safety(self) -> float:
        """Double `safety` (its later plans have smaller steps); returns the new factor."""
        ...

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The steps that will score these groups, sized to `budget`."""
        ...

    def price(self, plan: Plan) -> list[StepWork]:
        """What each step of the plan computes and holds, in run order."""
        ...

    def run(self, plan: Plan) -> list[BackendOutput]:
        """Run the plan: one output per batch, in order."""
        ...

    def replan(self, plan: Plan) -> Plan:
        """The same work planned again at the current budget (the memory guard's retry)."""
        ...

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape it can compile for requests within `limits` (none: no compiled
        steps)."""
        ...


# The members `registry.register` checks a backend class for.
PROTOCOL = (
    "steps",
    "safety",
    "budget",
    "peak_budget",
    "grow_safety",
    "plan",
    "price",
    "run",
    "shapes",
)


class LoglikelihoodBackend(Backend, Protocol):
    """A backend with loglikelihood plans (`Capabilities.loglikelihood`): `run` of such a plan
    returns one `ContinuationScores` per continuation."""

    def plan_loglikelihood(
        self, context: Sequence[int], continuations: Sequence[Sequence[int]], adapter: int = 0
    ) -> Plan: ...


class PromptLogprobsBackend(Backend, Protocol):
    """A backend with prompt log-probabilities plans (`Capabilities.loglikelihood` too): `run`
    of such a plan returns, per (context, continuations) pair, one `PositionScores` per
    continuation."""

    def plan_prompt_logprobs(
        self, extensions: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], adapter: int = 0
    ) -> Plan: ...


def missing_members(backend: type | object) -> list[str]:
    """The `Backend` members a backend class (or instance) lacks."""
    return [name for name in PROTOCOL if getattr(backend, name, None) is None]


@attrs.define
class StepStats:
    """What a backend ran for one batch.

    steps: jitted device calls; chunks: item batches or packed chunks among them; tokens: token
    positions run through the model (usage accounting); shapes: (step name, padded input shape)
    of every step, the shapes XLA compiles for.
    """

    steps: int = 0
    chunks: int = 0
    tokens: int = 0
    shapes: list[StepShape] = attrs.Factory(list)


@attrs.frozen
class BackendOutput:
    """logprobs [I, C] float32 in the batch's padded shape; valid [I]: rows that were scored."""

    logprobs: np.ndarray
    valid: np.ndarray
    stats: StepStats

    @property
    def num_tokens(self) -> int:
        return self.stats.tokens

    @staticmethod
    def for_batch(batch: ScoreBatch) -> OutputBuilder:
        """A builder for this batch's output: record each step, then `build()`."""
        return OutputBuilder(batch)

    @staticmethod
    def for_groups(batches: Sequence[ScoreBatch]) -> GroupsOutputBuilder:
        """A builder for the outputs of several groups whose steps may mix them."""
        return GroupsOutputBuilder(batches)


class GroupsOutputBuilder:
    """Collects a backend's steps for the groups (batches) of one call, where a step may score
    rows of several groups. Results stay on device until `build`, so the host dispatches every
    step before it waits for the first, and reads each step's result back once.

    Each group's stats count the steps it took part in, its own tokens and the chunks (packed
    rows or item batches) that scored its items; `steps` counts every step of the call once.
    """

    def __init__(self, batches: Sequence[ScoreBatch]):
        self._shapes = [(b.items.shape[0], b.label_ids.shape[0]) for b in batches]
        self._pending: list[list[tuple[np.ndarray, Any, Any]]] = [[] for _ in batches]
        self.stats = [StepStats() for _ in batches]
        self.steps = 0

    def step(self, name: str, shape: tuple[int, ...], tokens: Mapping[int, int]) -> None:
        """Count one device step of input `shape` in which group g ran tokens[g] real token
        positions (the groups it serves, tokens 0 for one that only reads its results)."""
        self.steps += 1
        shape = tuple(int(n) for n in shape)
        for g, n in tokens.items():
            stats = self.stats[g]
            stats.steps += 1
            stats.tokens += int(n)
            stats.shapes.append(StepShape(name, shape))

    def scores(self, group: int, rows: np.ndarray, logprobs: Any, index: Any = ()) -> None:
        """The step just counted scored rows `rows` of batch `group`: logprobs[index] holds
        their logprobs [>= len(rows), >= C] (a device array, read back in `build`)."""
        self.stats[group].chunks += 1
        self._pending[group].append((np.asarray(rows), logprobs, index))

    def build(self) -> list[BackendOutput]:
        host: dict[int, np.ndarray] = {}  # each step's result read back once
        outputs = []
        for shape, pending, stats in zip(self._shapes, self._pending, self.stats, strict=True):
            logprobs = np.zeros(shape, np.float32)
            valid = np.zeros(shape[0], bool)
            for rows, out, index in pending:
                if id(out) not in host:
                    host[id(out)] = to_host(out)
                logprobs[rows] = host[id(out)][index][: len(rows), : shape[1]]
                valid[rows] = True
            outputs.append(BackendOutput(logprobs, valid, stats))
        return outputs


class OutputBuilder:
    """Collects a backend's steps for one batch (`GroupsOutputBuilder` with one group)."""

    def __init__(self, batch: ScoreBatch):
        self._groups = GroupsOutputBuilder([batch])
        self.stats = self._groups.stats[0]

    def step(self, name: str, shape: tuple[int, ...], tokens: int) -> None:
        """Count one device step of input `shape` that ran `tokens` real token positions."""
        self._groups.step(name, shape, {0: tokens})

    def scores(self, rows: np.ndarray, logprobs: Any) -> None:
        """The step just counted scored batch rows `rows`: its logprobs [>= len(rows), C]."""
        self._groups.scores(0, rows, logprobs)

    def build(self) -> BackendOutput:
        return self._groups.build()[0]
