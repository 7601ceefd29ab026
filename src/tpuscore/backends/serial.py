"""serial: every item's full sequence (query + item) through the model, batched and jitted.

The baseline every faster backend is measured against: simple, exact, and N times the query work.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import check_int
from tpuscore.backends import budgets, work
from tpuscore.backends.base import Scoring
from tpuscore.backends.buckets import PlatformBuckets, pow2_floor, row_buckets
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    GroupsOutputBuilder,
    Plan,
    ScoreBatch,
    ShapeLimits,
    Step,
    StepShape,
    StepTable,
    step_table,
)
from tpuscore.models import decoder
from tpuscore.models.adapters import RowAdapters
from tpuscore.models.attention import attend, within_window
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params

SCORE_SEQUENCES = "score_sequences"  # its one step
MAX_ROWS = 64
INVARIANT_ROWS = 16  # rows per step and device in batch-invariant mode, padding included


@dataclasses.dataclass(frozen=True, kw_only=True)
class SerialOptions:
    """max_batch_tokens: padded tokens per step and device (default 8192). activation_bytes: the
    memory budget a step's estimate must fit (default 256 MiB on CPU, an eighth of accelerator
    memory). batch_invariant: every step's shape a function of its item's own sequence length
    (set by `Scorer(batch_invariant=True)`)."""

    max_batch_tokens: int | None = None
    activation_bytes: int | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("max_batch_tokens", "activation_bytes"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)


@functools.partial(jax.jit, static_argnames="config")
def score_sequences(
    params: Params,
    tokens: jax.Array,
    lengths: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """Label logprobs [B, C] at the last real token of each right-padded row of tokens [B, T],
    each row under its own LoRA adapter (`adapters`; None: the base model).

    Rows of length 0 are padding; their output is meaningless and dropped by the caller.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def attention(q, k, v, layer):
        window = within_window(positions, positions, layer.window)
        return attend(q, k, v, causal & window, layer)

    hidden = decoder.forward(params, config, tokens, positions, attention, adapters)
    last = hidden[jnp.arange(B), jnp.maximum(lengths - 1, 0)]
    return decoder.label_logprobs(params, config, last, label_ids, adapters)


def serial_row_bytes(config: ModelConfig, length: int) -> int:
    """One serial sequence: its layer memory under a dense causal mask, and its float32 logits
    and log-softmax at the scored position."""
    layer = length * work.activation_bytes_per_token(config) + work.dense_attention_bytes(
        config, length
    )
    return layer + work.logits_bytes(config, 1)


def serial_batch_rows(
    config: ModelConfig, length: int, budget: int, max_batch_tokens: int, max_rows: int
) -> int:
    """Sequences per serial step: a power of two (so chunks reuse count buckets) whose memory
    fits the budget, with at most max_batch_tokens tokens (at least 1)."""
    fits = budget // serial_row_bytes(config, length)
    return pow2_floor(min(max_rows, max_batch_tokens // length, fits))


@attrs.frozen
class SerialStep:
    """One device step: items `items` of group `group`, each padded to `length` tokens, in
    `rows` rows (the items and padding rows)."""

    group: int
    items: np.ndarray
    length: int
    rows: int


class SerialBackend(Scoring, Budgeted, PlatformBuckets):
    score_sequences = staticmethod(score_sequences)  # the jitted step: a seam for tests

    def __init__(self, model: Model, options: SerialOptions):
        self.model = model
        self.max_batch_tokens = options.max_batch_tokens or 8192
        self.activation_bytes = options.activation_bytes or budgets.activation_budget()
        self.batch_invariant = options.batch_invariant

    def schedule(self, batches: Sequence[ScoreBatch]) -> list[SerialStep]:
        """The steps that score these groups, one group at a time: every sequence of a group
        padded to its longest one's bucket, as many per step as fit the budget on each device.

        Batch-invariant: each sequence padded to its own length's bucket, and every step of a
        bucket runs the same number of rows, padding rows included, so a step's shape depends
        on its sequences' own lengths only, never on what else the call holds."""
        layout, steps = self.model.layout, []
        for g, batch in enumerate(batches):
            lens = batch.sequence_lens
            if self.batch_invariant:
                buckets = np.array([self.token_bucket(int(n)) for n in lens], int)
            else:
                buckets = np.full(len(lens), self.token_bucket(int(lens.max(initial=1))))
            for T in sorted(set(buckets.tolist())):
                (items,) = np.nonzero(buckets == T)
                rows = self.rows_per_step(T)
                for start in range(0, len(items), rows):
                    chunk = items[start : start + rows]
                    size = rows if self.batch_invariant else layout.rows(len(chunk))
                    steps.append(SerialStep(g, chunk, T, size))
        return steps

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The `schedule` of these groups."""
        return Plan(tuple(batches), self.schedule(batches))

    def price(self, plan: Plan) -> list[work.StepWork]:
        """What each step of the plan does (for `selection.py`)."""
        config, data = self.model.config, self.model.layout.data
        return [
            work.step_work(
                config,
                self.model.dtype.itemsize,
                rows=step.rows,
                new=step.length,
                pairs=step.rows * step.length * step.length,  # the causal mask on a dense [T, T]
                slots=1,
                peak=step.rows // data * serial_row_bytes(config, step.length),
            )
            for step in plan.steps
        ]

    def rows_per_step(self, length: int) -> int:
        """Rows of a step of sequences padded to `length`: the most that fit (non-invariant
        steps pad fewer to a power of two); in batch-invariant mode, exactly this many."""
        per_device = serial_batch_rows(
            self.model.config, length, self.budget, self.max_batch_tokens, MAX_ROWS
        )
        if self.batch_invariant:
            per_device = min(per_device, INVARIANT_ROWS)
        return per_device * self.model.layout.data

    def run(self, plan: Plan) -> list[BackendOutput]:
        out = BackendOutput.for_groups(plan.batches)
        for step in plan.steps:
            self._run(step, plan.batches[step.group], out)
        return out.build()

    def _run(self, step: SerialStep, batch: ScoreBatch, out: GroupsOutputBuilder) -> None:
        layout, n = self.model.layout, len(step.items)
        tokens = np.zeros((step.rows, step.length), np.int32)
        for row, i in enumerate(step.items):
            seq = batch.sequence(i)
            tokens[row, : len(seq)] = seq
        lengths = np.zeros(step.rows, np.int32)
        lengths[:n] = batch.sequence_lens[step.items]
        shape = (*tokens.shape, len(batch.label_ids))
        out.step(SCORE_SEQUENCES, shape, {step.group: int(lengths.sum())})
        out.scores(
            step.group,
            step.items,
            self.score_sequences(
                self.model.params,
                layout.put_rows(tokens),
                layout.put_rows(lengths),
                batch.label_ids,
                config=self.model.config,
                adapters=self.model.row_adapters(np.full(step.rows, batch.adapter)),
            ),
        )

    @property
    def steps(self) -> StepTable:
        """Its one step, score_sequences (rows, T, C)."""
        return step_table(Step(SCORE_SEQUENCES, self.score_sequences, self._sequence_zeros))

    def _sequence_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, width = shape
        put = self.model.layout.put_rows
        args = (
            self.model.params,
            put(np.zeros((rows, length), np.int32)),
            put(np.zeros(rows, np.int32)),
            np.zeros(width, np.int32),
        )
        adapters = self.model.row_adapters(np.zeros(rows, np.int32))
        return args, {"config": self.model.config, "adapters": adapters}

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape this backend can compile for requests within `limits`, on its
        budget as it is: score_sequences (rows, T, C) for T a token bucket of a query and an
        item, rows a power of two within T's budget (batch-invariant: `rows_per_step`), C a
        label bucket (docs/serving.md, "Compiled shapes")."""
        longest = limits.query_tokens + limits.item_tokens
        out = set()
        for length in sorted({self.token_bucket(n) for n in range(1, longest + 1)}):
            cap = self.rows_per_step(length)
            counts = [cap] if self.batch_invariant else row_buckets(1, cap, self.model.layout.data)
            for rows, width in itertools.product(counts, limits.label_widths()):
                out.add(StepShape(SCORE_SEQUENCES, (rows, length, width)))
        return out
