"""prefill_extend: prefill the query once, then score every item against its cached K/V.

Serial scoring runs N x (query + item) token positions; this runs the query once plus N x item.
Items attend to the query's K/V through one shared matmul and to their own tokens causally, and
the two halves merge exactly (`decoder.extend`), so scores equal serial up to float rounding.

The query's K/V stays in a `PrefixCache` across calls: a repeated query costs item work only, and a
query sharing a prefix with a cached one prefills only the rest.

Several groups (requests with different queries) share device steps: their uncached queries
prefill together, one query per row, and the items each group leaves over after filling steps of
its own share extend steps, where each row attends to its own query's K/V gathered per row.
A step whose rows share one query keeps the shared-prefix matmul.

With LoRA adapters (`Model.adapters`), every step runs each row under its group's adapter: a
query's K/V are prefilled under its adapter and cached under it (the prefix cache's key holds the
adapter), and rows of different adapters share extend steps as rows of different queries do.

`plan` (plan.py) gives a call's waves of groups, each with its prefill and extend steps; `run`
runs those steps and `price` prices the same ones, so what is priced is what runs. The jitted
steps are in steps.py, the step table and the shape set in shapes.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from tpuscore.api.errors import check_int
from tpuscore.backends import budgets, work
from tpuscore.backends.base import Scoring
from tpuscore.backends.buckets import CPU_SPLIT_PADDING_TOKENS, MIN_TOKEN_BUCKET, bucket_prefix
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    ContinuationScores,
    GroupsOutputBuilder,
    Plan,
    PositionScores,
    stack_labels,
)
from tpuscore.backends.prefill_extend import memory, steps
from tpuscore.backends.prefill_extend.loglikelihood import Loglikelihood, LoglikelihoodPlan
from tpuscore.backends.prefill_extend.plan import (
    Planning,
    PrefillStep,
    Wave,
)
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache
from tpuscore.backends.prefill_extend.prompt_logprobs import PromptLogprobs, PromptLogprobsPlan
from tpuscore.backends.prefill_extend.shapes import StepShapes
from tpuscore.backends.prefill_extend.steps import (
    PREFILL,
    PREFILL_ROWS,
    SCORE_ITEMS,
    SCORE_MIXED_ITEMS,
    keys_read,
)
from tpuscore.models.decoder import Prefix
from tpuscore.models.model import Model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillExtendOptions:
    """prefix_cache_bytes: the query K/V cache's budget (default 1 GiB on CPU, a tenth of
    accelerator memory; 0 keeps nothing). batch_items: items per extend step (default from an
    activation-memory estimate). activation_bytes: that estimate's budget (default 256 MiB on
    CPU, an eighth of accelerator memory). prefill_chunk: query tokens per prefill step, which
    bounds its own [chunk, chunk] attention (default 512). split_padding_tokens: an extend step
    whose row padding would hold at least this many item tokens runs as steps of power-of-two
    rows instead (100 items: 64 + 32 + 4 rather than 128; default 128 on CPU, 0 = never, the
    default on accelerators, where a step's fixed cost outweighs padding). batch_invariant: plan
    every step from one query and its items alone (plan.py; set by
    `Scorer(batch_invariant=True)`)."""

    prefix_cache_bytes: int | None = None
    batch_items: int | None = None
    activation_bytes: int | None = None
    prefill_chunk: int | None = None
    split_padding_tokens: int | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name, minimum in (
            ("prefix_cache_bytes", 0),
            ("batch_items", 1),
            ("activation_bytes", 1),
            ("prefill_chunk", 1),
            ("split_padding_tokens", 0),
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=minimum)


class PrefillExtendBackend(Planning, StepShapes, Loglikelihood, PromptLogprobs, Scoring, Budgeted):
    """prefill_extend (module doc): planning in `Planning` (plan.py), the step table and shape
    set in `StepShapes` (shapes.py), loglikelihood plans in `Loglikelihood`
    (loglikelihood.py), prompt log-probabilities plans in `PromptLogprobs`
    (prompt_logprobs.py), running and pricing here."""

    # The jitted steps, reached through the instance: a seam for tests, and what the scorer's
    # executables guard replaces with its own copies (`engine.executables.Guard.own`).
    prefill = staticmethod(steps.prefill)
    prefill_rows = staticmethod(steps.prefill_rows)
    score_items = staticmethod(steps.score_items)
    score_mixed_items = staticmethod(steps.score_mixed_items)
    continuation_logprobs = staticmethod(steps.continuation_logprobs)
    prompt_logprobs = staticmethod(steps.prompt_logprobs)
    stack_prefixes = staticmethod(steps.stack)
    unstack = staticmethod(steps.unstack)
    resize = staticmethod(steps.resize)

    def __init__(self, model: Model, options: PrefillExtendOptions):
        self.model = model
        budget = options.prefix_cache_bytes
        self.cache = PrefixCache(budgets.cache_budget() if budget is None else budget)
        self.batch_items = options.batch_items
        self.activation_bytes = options.activation_bytes or budgets.activation_budget()
        self.prefill_chunk = options.prefill_chunk or 512
        split = options.split_padding_tokens
        if split is None:
            split = CPU_SPLIT_PADDING_TOKENS if model.platform == "cpu" else 0
        self.split_padding_tokens = split
        self.batch_invariant = options.batch_invariant
        self._empty = self._zero_prefix(MIN_TOKEN_BUCKET)

    @property
    def peak_budget(self) -> int:
        """A step's activations fit the budget; the K/V it holds, `held_budget`."""
        return self.budget + self.held_budget

    def price(self, plan: Plan) -> list[work.StepWork]:
        if isinstance(plan, LoglikelihoodPlan):
            return self.price_loglikelihood(plan)
        if isinstance(plan, PromptLogprobsPlan):
            return self.price_prompt_logprobs(plan)
        return self.price_scores(plan)

    def run(
        self, plan: Plan
    ) -> list[BackendOutput] | list[ContinuationScores] | list[list[PositionScores]]:
        if isinstance(plan, LoglikelihoodPlan):
            return self.run_loglikelihood(plan)
        if isinstance(plan, PromptLogprobsPlan):
            return self.run_prompt_logprobs(plan)
        return self.run_scores(plan)

    def replan(self, plan: Plan) -> Plan:
        if isinstance(plan, LoglikelihoodPlan):
            return self.plan_loglikelihood(plan.context, plan.continuations, plan.adapter)
        if isinstance(plan, PromptLogprobsPlan):
            return self.plan_prompt_logprobs(plan.extensions, plan.adapter)
        return self.plan(plan.batches)

    def price_scores(self, plan: Plan) -> list[work.StepWork]:
        """What each step of the plan does (for `selection.py`), with the prefix cache as it is
        now. Every step's peak holds the K/V of its wave's queries. Attention is priced
        over the keys a step reads: a lone query's key blocks up to its length (`keys_read`), a
        step of several queries their whole buffers."""
        config, layout, itemsize = self.model.config, self.model.layout, self.model.dtype.itemsize
        platform, steps = self.model.platform, []
        for wave in self.expand(plan):
            held = sum(self.prefix_bytes(len(q)) for q in wave.queries)
            for step in wave.prefill:
                R, P = step.length, step.base_len
                read = (
                    P if step.rows > 1 else keys_read(P, step.chunks[0].start, R, platform=platform)
                )
                peak = -(-step.rows // layout.data) * memory.prefill_row_bytes(config, R, P)
                steps.append(
                    work.step_work(
                        config,
                        itemsize,
                        rows=step.rows,
                        new=R,
                        pairs=step.rows * R * (R + read),
                        slots=0,
                        peak=peak + held,
                        kv_bytes=work.kv_bytes(config, step.rows * read, itemsize),
                    )
                )
            for step in wave.extend:
                rows, L = step.size, step.item_len
                step_queries = {wave.query_of[w] for w in step.groups}
                longest = max(len(wave.queries[q]) for q in step_queries)
                P = bucket_prefix(longest)
                row_prefix = 0 if len(step_queries) == 1 else P  # else one shared prefix
                read = (
                    P if row_prefix else keys_read(P, longest, platform=platform)
                )  # a lone query's key blocks
                peak = rows // layout.data * memory.extend_row_bytes(config, L, row_prefix)
                steps.append(
                    work.step_work(
                        config,
                        itemsize,
                        rows=rows,
                        new=L,
                        pairs=rows * L * (L + read),
                        slots=1,
                        peak=peak + held,
                        kv_bytes=work.kv_bytes(config, read, itemsize)
                        * (1 if row_prefix == 0 else rows),
                    )
                )
        return steps

    def run_scores(self, plan: Plan) -> list[BackendOutput]:
        """Score several groups: their distinct queries prefilled together (cache hits skip it),
        then their items in extend steps, where items of different queries may share a step."""
        batches = plan.batches
        out = BackendOutput.for_groups(batches)
        for wave in self.expand(plan, read=self.cache.lookup):
            owners = [wave.groups[wave.query_of.index(q)] for q in range(len(wave.queries))]
            prefixes = self._run_prefill(wave, out, owners)
            for step in wave.extend:
                self._extend(step, wave.groups, batches, wave.query_of, prefixes, out)
        return out.build()

    def _run_prefill(
        self, wave: Wave, out: GroupsOutputBuilder | None, owners: Sequence[int]
    ) -> list[Prefix]:
        """Run a wave's prefill steps; returns each query's K/V and caches each one prefilled.
        Each step is counted in `out` (if given), its tokens charged to the query's owner
        group."""
        prefixes, current = list(wave.ready), {}
        # Every prefix a step takes is placed as `warm` places its zeros: on a mesh, jit keys an
        # executable by its inputs' shardings too, so an unplaced one would compile again.
        place = self.model.layout.put_prefix
        for i, (base, start) in wave.reused.items():
            n = len(wave.queries[i])
            logger.debug("prefilling %d of %d query tokens (%d cached)", n - start, n, start)
            if base is None:
                current[i] = self._empty
            else:
                resized = self._resized(base._replace(length=np.int32(start)), bucket_prefix(n))
                current[i] = place(resized)
        for step in wave.prefill:
            advanced = self._prefill_step(wave, step, current, out, owners)
            for chunk, prefix in zip(step.chunks, advanced, strict=True):
                i = chunk.query
                if chunk.stop < len(wave.queries[i]):
                    current[i] = place(prefix)
                else:
                    prefixes[i] = prefix = place(prefix)
                    nbytes = sum(a.nbytes for a in (prefix.k, prefix.v, prefix.last_hidden))
                    self.cache.put(wave.queries[i], prefix, nbytes, adapter=self._adapter(wave, i))
        return prefixes

    @staticmethod
    def _adapter(wave: Wave, query: int) -> int:
        """The adapter of a wave's query (0: none)."""
        return wave.adapters[query] if wave.adapters else 0

    def _prefill_step(self, wave: Wave, step: PrefillStep, current, out, owners) -> list[Prefix]:
        """Run one prefill step on the prefixes so far (`current`, by query); returns the
        advanced prefix of each of its chunks."""
        layout, queries = self.model.layout, wave.queries
        row_adapters = np.zeros(step.rows, np.int32)  # padding rows: none
        row_adapters[: len(step.chunks)] = [self._adapter(wave, c.query) for c in step.chunks]
        chunks = [queries[c.query][c.start : c.stop] for c in step.chunks]
        tokens = np.zeros((step.rows, step.length), np.int32)
        for r, chunk in enumerate(chunks):
            tokens[r, : len(chunk)] = chunk
        charged = {owners[c.query]: c.stop - c.start for c in step.chunks}
        if len(chunks) == 1:  # one query: its prefix in place, as a lone request runs
            if out is not None:
                out.step(PREFILL, (step.length, step.base_len, step.size), charged)
            prefix = self.prefill(
                self.model.params,
                current[step.chunks[0].query],
                tokens,
                np.int32(len(chunks[0])),
                config=self.model.config,
                size=step.size,
                platform=self.model.platform,
                # One row, not split over "data" (a mesh's data axis cannot divide it).
                adapters=self.model.row_adapters(row_adapters, split=False),
            )
            return [prefix]
        counts = np.zeros(tokens.shape[0], np.int32)
        counts[: len(chunks)] = list(map(len, chunks))
        empties = self.stack([self._empty] * step.rows, step.rows)
        if out is not None:
            out.step(PREFILL_ROWS, (*tokens.shape, step.base_len, step.size), charged)
        stacked = self.prefill_rows(
            self.model.params,
            empties,
            layout.put_rows(tokens),
            layout.put_rows(counts),
            config=self.model.config,
            size=step.size,
            adapters=self.model.row_adapters(row_adapters),
        )
        stacked = layout.put_prefix(stacked, stacked=True)  # as `warm` places it (on a mesh)
        return [self.unstack(stacked, np.int32(r), size=step.size) for r in range(len(chunks))]

    def _resized(self, prefix: Prefix, size: int) -> Prefix:
        """`prefix` holding `size` positions (itself if it does)."""
        return prefix if prefix.k.shape[-1] == size else self.resize(prefix, size=size)

    def _extend(self, step, wave, batches, query_of, prefixes, out) -> None:
        """Run one extend step of a wave (step.groups index into the wave)."""
        n = len(step.rows)
        layout = self.model.layout
        groups = np.asarray(wave)[step.groups]
        items = np.zeros((step.size, step.item_len), np.int32)
        item_lens = np.zeros(items.shape[0], np.int32)
        for r, (g, i) in enumerate(zip(groups, step.rows, strict=True)):
            item_lens[r] = batches[g].item_lens[i]
            width = min(step.item_len, batches[g].items.shape[1])  # groups pad to own buckets
            items[r, :width] = batches[g].items[i, :width]
        step_queries = sorted({query_of[w] for w in step.groups})
        row_adapters = np.zeros(step.size, np.int32)  # padding rows: none
        row_adapters[:n] = [batches[g].adapter for g in groups]
        adapters = self.model.row_adapters(row_adapters)
        labels = stack_labels([batches[g].label_ids for g in groups], items.shape[0])
        size = max(prefixes[q].k.shape[-1] for q in step_queries)
        if len(step_queries) == 1:  # the shared-prefix matmul
            name = SCORE_ITEMS
            shape = (*items.shape, size, labels.shape[-1])
            logprobs = self.score_items(
                self.model.params,
                prefixes[step_queries[0]],
                *map(layout.put_rows, (items, item_lens, labels)),
                self.model.config,
                platform=self.model.platform,
                adapters=adapters,
            )
        else:  # each row against its own query's K/V
            name = SCORE_MIXED_ITEMS
            count = self.mixed_queries(step.size, size)
            own = [self._resized(prefixes[q], size) for q in step_queries]
            padding = [self._resized(self._empty, size)] * (count - len(own))
            stacked = self.stack(own + padding, count)
            query_index = np.zeros(items.shape[0], np.int32)
            query_index[:n] = [step_queries.index(query_of[w]) for w in step.groups]
            shape = (*items.shape, count, size, labels.shape[-1])
            logprobs = self.score_mixed_items(
                self.model.params,
                stacked,
                *map(layout.put_rows, (query_index, items, item_lens, labels)),
                self.model.config,
                adapters=adapters,
            )
        tokens = {int(g): 0 for g in groups}
        for g, length in zip(groups, item_lens[:n], strict=True):
            tokens[int(g)] += int(length)
        out.step(name, shape, tokens)
        for g in tokens:
            (where,) = np.nonzero(groups == g)
            out.scores(g, step.rows[where], logprobs, index=where)
