"""prefill_extend's prompt log-probabilities plans: contexts each prefilled once (or found in the
prefix cache), then extended by length-sorted steps of continuations, each read at every
position and the one after it over the whole vocabulary, with the TOP_LOGPROBS most likely
tokens there (`Engine.prompt_logprobs`, `tasks.prompt_logprobs`).

A `PromptLogprobsPlan` is a plan kind of the backend: priced, run and re-planned (on an
out-of-memory retry) like a loglikelihood plan, on the same steps of continuations
(`continuation_batches`), and its step is in the step table and the shape set.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from tpuscore.backends import work
from tpuscore.backends.buckets import MIN_TOKEN_BUCKET, bucket_prefix, row_buckets
from tpuscore.backends.contract import Plan, PositionScores, ShapeLimits, StepShape
from tpuscore.backends.prefill_extend import memory
from tpuscore.backends.prefill_extend.steps import PROMPT_LOGPROBS
from tpuscore.parallel.sharding import to_host


@attrs.frozen(eq=False)
class PromptLogprobsPlan(Plan):
    """(context, continuations) pairs, each context run once; `steps`: (index of the pair,
    indices into its continuations, padded length) per extend step, a pair's steps together.
    `batches` is empty: no `ScoreBatch` is scored. adapter: the LoRA adapter all run under
    (0: none)."""

    extensions: tuple[tuple[np.ndarray, tuple[tuple[int, ...], ...]], ...] = attrs.field(
        kw_only=True
    )
    adapter: int = attrs.field(default=0, kw_only=True)


class PromptLogprobs:
    """The prompt log-probabilities plan kind of `PrefillExtendBackend` (module doc)."""

    def plan_prompt_logprobs(
        self, extensions: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], adapter: int = 0
    ) -> PromptLogprobsPlan:
        """The steps that read every continuation after its context, at each of its positions
        and the one after it. An empty continuation runs as one padding token (its row is read
        at the position after the context only)."""
        pairs = tuple(
            (np.asarray(context, np.int32), tuple(tuple(c) for c in continuations))
            for context, continuations in extensions
        )
        steps = []
        for e, (_, continuations) in enumerate(pairs):
            lens = np.array([max(len(c), 1) for c in continuations], np.int64)
            steps.extend((e, rows, length) for rows, length in self.continuation_batches(lens))
        return PromptLogprobsPlan((), steps, extensions=pairs, adapter=int(adapter))

    def price_prompt_logprobs(self, plan: PromptLogprobsPlan) -> list[work.StepWork]:
        """Each extend step's work (counted by the memory guard; not auto's to pick)."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        rows_of = self.model.layout.rows
        out = []
        for e, rows, length in plan.steps:
            P = bucket_prefix(len(plan.extensions[e][0]))
            out.append(
                work.step_work(
                    config,
                    itemsize,
                    rows=rows_of(len(rows)),
                    new=length,
                    pairs=rows_of(len(rows)) * length * (length + P),
                    slots=length + 1,
                    peak=rows_of(len(rows)) * memory.extend_row_bytes(config, length, 0),
                )
            )
        return out

    def run_prompt_logprobs(self, plan: PromptLogprobsPlan) -> list[list[PositionScores]]:
        """Per (context, continuations) pair in order, one `PositionScores` per continuation:
        the context prefilled once (or reused from the prefix cache), then extended by the
        pair's steps, all dispatched before the first is read back."""
        model, results = self.model, []
        steps_of: dict[int, list[tuple[np.ndarray, int]]] = {}
        for e, rows, length in plan.steps:
            steps_of.setdefault(e, []).append((rows, length))
        for e, (context, continuations) in enumerate(plan.extensions):
            prefix = self.query_prefix(context, plan.adapter)
            pending = []
            for rows, length in steps_of.get(e, []):
                tokens = np.zeros((model.layout.rows(len(rows)), length), np.int32)
                for r, i in enumerate(rows):
                    tokens[r, : len(continuations[i])] = continuations[i]
                adapters = model.row_adapters(np.full(tokens.shape[0], plan.adapter, np.int32))
                tokens = model.layout.put_rows(tokens)
                out = self.prompt_logprobs(
                    model.params, prefix, tokens, model.config, adapters=adapters
                )
                pending.append((rows, out))
            scores: list[PositionScores | None] = [None] * len(continuations)
            for rows, out in pending:
                picked, values, ids = (to_host(x) for x in out)
                for r, i in enumerate(rows):
                    n = len(continuations[i])
                    row = (
                        picked[r, :n].astype(np.float32),
                        values[r, : n + 1].astype(np.float32),
                        ids[r, : n + 1].astype(np.int64),
                    )
                    for array in row:
                        array.setflags(write=False)
                    scores[i] = PositionScores(*row)
            results.append(scores)
        return results

    def prompt_shapes(self, limits: ShapeLimits, sizes: Sequence[int]) -> set[StepShape]:
        """prompt_logprobs (rows, L, P) for prompts of at most limits.query_tokens tokens: a
        context of p tokens (P = bucket_prefix(p)) continued by r <= query_tokens - p (L an item
        bucket of max(r, 1)), rows a power of two within `continuation_rows(L)`; none for a
        classifier, which has no next-token distribution."""
        if self.model.config.classifier:
            return set()
        out, Q = set(), limits.query_tokens
        for size in sizes:
            shortest = 1 if size == MIN_TOKEN_BUCKET else size // 2 + 1  # context sized `size`
            if shortest > Q:
                continue
            for length in sorted({self.item_bucket(r) for r in range(1, max(Q - shortest, 1) + 1)}):
                for rows in row_buckets(1, self.continuation_rows(length), self.model.layout.data):
                    out.add(StepShape(PROMPT_LOGPROBS, (rows, length, size)))
        return out

    def _prompt_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, size = shape
        tokens = self.model.layout.put_rows(np.zeros((rows, length), np.int32))
        adapters = self.model.row_adapters(np.zeros(rows, np.int32))
        return (self.model.params, self._zero_prefix(size), tokens, self.model.config), {
            "adapters": adapters
        }
