"""prefill_extend's step table and shape set: each jitted step with the zeros of its shapes, and
every shape the backend can compile for requests within limits (docs/serving.md, "Compiled
shapes")."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from tpuscore.backends.buckets import MIN_TOKEN_BUCKET, bucket_prefix, row_buckets
from tpuscore.backends.contract import ShapeLimits, Step, StepShape, StepTable, step_table
from tpuscore.backends.prefill_extend.steps import (
    CONTINUATION_LOGPROBS,
    PREFILL,
    PREFILL_ROWS,
    PROMPT_LOGPROBS,
    RESIZE,
    SCORE_ITEMS,
    SCORE_MIXED_ITEMS,
    STACK,
    UNSTACK,
)
from tpuscore.models.decoder import Prefix
from tpuscore.models.model import Model


class StepShapes:
    """The step table and shape set of `PrefillExtendBackend` (module doc)."""

    model: Model

    @property
    def steps(self) -> StepTable:
        """The jitted steps and the zeros of each shape (`shapes` lists them)."""
        return step_table(
            Step(PREFILL, self.prefill, self._prefill_zeros),
            Step(PREFILL_ROWS, self.prefill_rows, self._prefill_rows_zeros),
            Step(STACK, self.stack, self._stack_zeros),
            Step(UNSTACK, self.unstack, self._unstack_zeros),
            Step(RESIZE, self.resize, self._resize_zeros),
            Step(SCORE_ITEMS, self.score_items, self._score_items_zeros),
            Step(SCORE_MIXED_ITEMS, self.score_mixed_items, self._score_mixed_items_zeros),
            Step(CONTINUATION_LOGPROBS, self.continuation_logprobs, self._continuation_zeros),
            Step(PROMPT_LOGPROBS, self.prompt_logprobs, self._prompt_zeros),
        )

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape this backend can compile for requests within `limits`, on its
        budgets as they are: the shape set (docs/serving.md, "Compiled shapes").

        prefill (R, P_in, size): a chunk of R tokens into K/V of `size` = bucket_prefix(query)
        positions, continuing the empty prefix (P_in 16) or its own (P_in = size).
        prefill_rows (rows, R, 16, size), with stack (rows, 16) of its empty prefixes and
        unstack (rows, size): fresh one-chunk queries of one size together.
        resize (P_in, size): a cached prefix continued by a query of another size, or padded to
        a mixed step's size. score_items (rows, L, P, C) and score_mixed_items
        (rows, L, mixed_queries(rows, P), P, C) with its stack: rows a power
        of two within the step's budget, L an item bucket, P a query's size, C a label bucket.
        continuation_logprobs: the loglikelihood plans' step (`continuation_shapes`);
        prompt_logprobs: the prompt log-probabilities plans' (`prompt_shapes`).
        """
        Q, chunk, layout = limits.query_tokens, self.prefill_chunk, self.model.layout
        invariant = self.batch_invariant
        sizes = sorted({bucket_prefix(n) for n in range(Q + 1)})
        out: set[StepShape] = set()
        for size in sizes:
            low, high = (1 if size == MIN_TOKEN_BUCKET else size // 2 + 1), min(Q, size)
            for n in range(low, high + 1):  # a query's first chunk, on the empty prefix
                first = self.token_bucket(min(n, chunk))
                out.add(StepShape(PREFILL, (first, MIN_TOKEN_BUCKET, size)))
            # Later chunks of a long query; without batch invariance, any rest after a cache hit.
            longest_rest = high - chunk if invariant else high - 1
            for m in range(1, min(chunk, longest_rest) + 1):
                out.add(StepShape(PREFILL, (self.token_bucket(m), size, size)))
            if invariant:
                continue
            for n in range(low, min(high, chunk) + 1):
                length = self.token_bucket(n)
                cap = self.prefill_batch_rows(length, MIN_TOKEN_BUCKET)
                for rows in row_buckets(2, cap, layout.data):
                    out.add(StepShape(PREFILL_ROWS, (rows, length, MIN_TOKEN_BUCKET, size)))
                    out.add(StepShape(STACK, (rows, MIN_TOKEN_BUCKET)))
                    out.add(StepShape(UNSTACK, (rows, size)))
            out.update(StepShape(RESIZE, (other, size)) for other in sizes if other != size)
        widths = limits.label_widths()
        for item_len in sorted({self.item_bucket(n) for n in range(limits.item_tokens + 1)}):
            if invariant:
                row_counts = [self.invariant_rows(item_len)]
            else:
                row_counts = row_buckets(1, self.batch_rows(item_len), layout.data)
            for rows, size, width in itertools.product(row_counts, sizes, widths):
                out.add(StepShape(SCORE_ITEMS, (rows, item_len, size, width)))
                if not invariant and rows >= 2:
                    count = self.mixed_queries(rows, size)
                    out.add(StepShape(SCORE_MIXED_ITEMS, (rows, item_len, count, size, width)))
                    out.add(StepShape(STACK, (count, size)))
        return out | self.continuation_shapes(limits, sizes) | self.prompt_shapes(limits, sizes)

    def stack(self, prefixes: Sequence[Prefix], count: int) -> Prefix:
        """`count` prefixes of one size stacked (`stack`), placed as the steps take them."""
        return self.model.layout.put_prefix(
            self.stack_prefixes(prefixes, count=count), stacked=True
        )

    def _prefill_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        length, base_len, size = shape
        params, config = self.model.params, self.model.config
        tokens = np.zeros((1, length), np.int32)
        args = (params, self._zero_prefix(base_len), tokens, np.int32(1))
        adapters = self.model.row_adapters(np.zeros(1, np.int32), split=False)  # as run places it
        kwargs = {"config": config, "size": size, "platform": self.model.platform}
        return args, {**kwargs, "adapters": adapters}

    def _prefill_rows_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, base_len, size = shape
        layout, zeros = self.model.layout, functools.partial(np.zeros, dtype=np.int32)
        args = (
            self.model.params,
            layout.put_prefix(self._zero_prefix(base_len, rows), stacked=True),
            *map(layout.put_rows, (zeros((rows, length)), zeros(rows))),
        )
        adapters = self.model.row_adapters(zeros(rows))
        return args, {"config": self.model.config, "size": size, "adapters": adapters}

    def _stack_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        count, size = shape
        return ([self._zero_prefix(size)] * count, count), {}

    def _unstack_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, size = shape
        return (self._zero_prefix(size, rows), np.int32(0)), {"size": size}

    def _resize_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        base_len, size = shape
        return (self._zero_prefix(base_len),), {"size": size}

    def _score_items_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, item_len, size, width = shape
        zeros, layout = functools.partial(np.zeros, dtype=np.int32), self.model.layout
        inputs = (zeros((rows, item_len)), zeros(rows), zeros((rows, width)))
        args = (self.model.params, self._zero_prefix(size), *map(layout.put_rows, inputs))
        adapters = self.model.row_adapters(zeros(rows))
        return (*args, self.model.config), {"platform": self.model.platform, "adapters": adapters}

    def _score_mixed_items_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, item_len, count, size, width = shape
        zeros, layout = functools.partial(np.zeros, dtype=np.int32), self.model.layout
        stacked = layout.put_prefix(self._zero_prefix(size, count), stacked=True)
        inputs = (zeros(rows), zeros((rows, item_len)), zeros(rows), zeros((rows, width)))
        args = (self.model.params, stacked, *map(layout.put_rows, inputs))
        return (*args, self.model.config), {"adapters": self.model.row_adapters(zeros(rows))}

    def _zero_prefix(self, size: int, count: int | None = None) -> Prefix:
        """A prefix of zeros holding `size` positions, or `count` of them stacked, placed as the
        steps' own are (uncommitted on one device), without compiling anything."""
        config, dtype = self.model.config, self.model.dtype
        L, K, H, D = config.num_layers, config.num_kv_heads, config.head_dim, config.hidden_size
        stacked = () if count is None else (count,)
        prefix = Prefix(
            k=np.zeros((L, *stacked, K, H, size), dtype),
            v=np.zeros((L, *stacked, K, size, H), dtype),
            length=np.zeros(stacked, np.int32),
            last_hidden=np.zeros((*stacked, D), np.float32),
        )
        if self.model.layout.mesh is None:
            return jax.tree.map(jax.device_put, prefix)
        # Host arrays go straight to their shards; resharding a device array would compile.
        return self.model.layout.put_prefix(prefix, stacked=count is not None)
