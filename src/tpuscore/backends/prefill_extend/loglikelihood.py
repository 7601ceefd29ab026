"""prefill_extend's loglikelihood plans: a context prefilled once (or found in the prefix cache),
then extended by length-sorted steps of continuations, each read at every position over the
whole vocabulary (`Engine.loglikelihood`, `tasks.loglikelihood`).

A `LoglikelihoodPlan` is a plan kind of the backend: priced, run and re-planned (on an
out-of-memory retry) like a scoring plan, and its step is in the step table and the shape set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from tpuscore.backends import work
from tpuscore.backends.buckets import bucket_prefix, pow2_floor, row_buckets
from tpuscore.backends.contract import ContinuationScores, Plan, ShapeLimits, StepShape
from tpuscore.backends.prefill_extend import memory
from tpuscore.backends.prefill_extend.plan import Wave
from tpuscore.backends.prefill_extend.sizing import MAX_BATCH_TOKENS
from tpuscore.backends.prefill_extend.steps import CONTINUATION_LOGPROBS
from tpuscore.models.decoder import Prefix
from tpuscore.parallel.sharding import to_host


@attrs.frozen(eq=False)
class LoglikelihoodPlan(Plan):
    """A context and its continuations, run under LoRA adapter `adapter` (0: none); `steps`:
    (indices into continuations, padded length) per extend step (`continuation_batches`).
    `batches` is empty: no `ScoreBatch` is scored."""

    context: np.ndarray = attrs.field(kw_only=True)
    continuations: tuple[tuple[int, ...], ...] = attrs.field(kw_only=True)
    adapter: int = attrs.field(default=0, kw_only=True)


class Loglikelihood:
    """The loglikelihood plan kind of `PrefillExtendBackend` (module doc)."""

    def plan_loglikelihood(
        self, context: Sequence[int], continuations: Sequence[Sequence[int]], adapter: int = 0
    ) -> LoglikelihoodPlan:
        """The steps that score every continuation after the context, under `adapter`."""
        lens = np.array([len(c) for c in continuations], np.int64)
        return LoglikelihoodPlan(
            (),
            list(self.continuation_batches(lens)),
            context=np.asarray(context, np.int32),
            continuations=tuple(tuple(c) for c in continuations),
            adapter=int(adapter),
        )

    def continuation_batches(self, lens: np.ndarray) -> Iterator[tuple[np.ndarray, int]]:
        """Steps of continuations of one query, each read at every position over the whole
        vocabulary: (indices into lens, padded length) per step.

        Continuations are taken shortest first, so similar lengths share a step; rows per step:
        a power of two within the extend estimate and within the activation budget for the
        float32 [rows, length, vocab] log-probabilities (held about three times: logits,
        log-softmax, the gather)."""
        order = np.argsort(lens, kind="stable")
        sorted_lens = lens[order]
        start, n = 0, len(sorted_lens)
        while start < n:
            count = min(n - start, self.continuation_rows(int(sorted_lens[-1])))
            length = self.item_bucket(int(sorted_lens[start + count - 1]))
            yield order[start : start + count], length
            start += count

    def continuation_rows(self, longest: int) -> int:
        """Continuations per step when the longest is `longest` tokens (module doc)."""
        config, length = self.model.config, self.item_bucket(longest)
        extend = memory.extend_batch_rows(config, length, self.budget, MAX_BATCH_TOKENS)
        vocab = pow2_floor(self.budget // (3 * 4 * length * config.vocab_size))
        return min(extend, vocab)

    def price_loglikelihood(self, plan: LoglikelihoodPlan) -> list[work.StepWork]:
        """Each continuation step's work (counted by the memory guard; not auto's to pick)."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        P, rows_of = bucket_prefix(len(plan.context)), self.model.layout.rows
        return [
            work.step_work(
                config,
                itemsize,
                rows=rows_of(len(rows)),
                new=length,
                pairs=rows_of(len(rows)) * length * (length + P),
                slots=length,
                peak=rows_of(len(rows)) * memory.extend_row_bytes(config, length, 0),
            )
            for rows, length in plan.steps
        ]

    def run_loglikelihood(self, plan: LoglikelihoodPlan) -> list[ContinuationScores]:
        """Prefill the context once (or reuse it from the prefix cache), then extend it by the
        plan's steps; every step is dispatched before the first is read back."""
        model, lens = self.model, [len(c) for c in plan.continuations]
        prefix = self.query_prefix(plan.context, plan.adapter)
        pending = []
        for rows, length in plan.steps:
            tokens = np.zeros((model.layout.rows(len(rows)), length), np.int32)
            for r, i in enumerate(rows):
                tokens[r, : lens[i]] = plan.continuations[i]
            adapters = model.row_adapters(np.full(tokens.shape[0], plan.adapter, np.int32))
            tokens = model.layout.put_rows(tokens)
            logprobs = self.continuation_logprobs(
                model.params, prefix, tokens, model.config, adapters=adapters
            )
            pending.append((rows, logprobs))
        results: list[ContinuationScores | None] = [None] * len(lens)
        for rows, (picked, greedy) in pending:
            picked, greedy = to_host(picked), to_host(greedy)
            for r, i in enumerate(rows):
                n = lens[i]
                token_logprobs = picked[r, :n].astype(np.float32)
                token_logprobs.setflags(write=False)
                results[i] = ContinuationScores(token_logprobs, bool(greedy[r, :n].all()))
        return results

    def query_prefix(self, query: np.ndarray, adapter: int = 0) -> Prefix:
        """One query's K/V under `adapter` (0: none), from the cache or prefilled, with no
        output to count steps in."""
        ready, reused, steps = self._plan_prefill([query], self.cache.lookup, [adapter])
        wave = Wave([0], [query], [0], ready, reused, steps, [], adapters=[adapter])
        return self._run_prefill(wave, None, [0])[0]

    def continuation_shapes(self, limits: ShapeLimits, sizes: Sequence[int]) -> set[StepShape]:
        """continuation_logprobs (rows, L, P): L an item bucket of a continuation within
        limits.item_tokens, rows a power of two within `continuation_rows(L)`, P a context's
        K/V size (none for a classifier, which has no loglikelihood)."""
        if self.model.config.classifier:
            return set()
        out = set()
        for length in sorted({self.item_bucket(n) for n in range(1, limits.item_tokens + 1)}):
            for rows in row_buckets(1, self.continuation_rows(length), self.model.layout.data):
                out.update(StepShape(CONTINUATION_LOGPROBS, (rows, length, P)) for P in sizes)
        return out

    def _continuation_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, size = shape
        tokens = self.model.layout.put_rows(np.zeros((rows, length), np.int32))
        adapters = self.model.row_adapters(np.zeros(rows, np.int32))
        return (self.model.params, self._zero_prefix(size), tokens, self.model.config), {
            "adapters": adapters
        }
