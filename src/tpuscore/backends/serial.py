"""serial: every item's full sequence (query + item) through the model, batched and jitted.

The baseline every faster backend is measured against: simple, exact, and N times the query work.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import check_int
from tpuscore.backends import costs
from tpuscore.backends.buckets import bucket_tokens
from tpuscore.backends.contract import BackendOutput, ScoreBatch
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params

MAX_ROWS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class SerialOptions:
    """max_batch_tokens: padded tokens per step and device (default 8192). activation_bytes: the
    memory budget a step's estimate must fit (default 256 MiB on CPU, an eighth of accelerator
    memory)."""

    max_batch_tokens: int | None = None
    activation_bytes: int | None = None

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
) -> jax.Array:
    """Label logprobs [B, C] at the last real token of each right-padded row of tokens [B, T].

    Rows of length 0 are padding; their output is meaningless and dropped by the caller.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def attention(q, k, v, layer):
        window = decoder.within_window(positions, positions, layer.window)
        return decoder.attend(q, k, v, causal & window, layer)

    hidden = decoder.forward(params, config, tokens, positions, attention)
    last = hidden[jnp.arange(B), jnp.maximum(lengths - 1, 0)]
    return decoder.label_logprobs(params, config, last, label_ids)


class SerialBackend(costs.Budgeted):
    estimate = "serial"

    def __init__(self, model: Model, options: SerialOptions):
        self.model = model
        self.max_batch_tokens = options.max_batch_tokens or 8192
        self.activation_bytes = options.activation_bytes or costs.activation_budget()

    def plan(self, batch: ScoreBatch) -> tuple[int, int]:
        """(padded length, sequences per step) for this batch: every sequence padded to the
        longest one's bucket, as many per step as fit the budget on each device."""
        T = bucket_tokens(int(batch.sequence_lens.max(initial=1)))
        per_device = costs.serial_batch_rows(
            self.model.config, T, self.budget, self.max_batch_tokens, MAX_ROWS
        )
        return T, per_device * self.model.layout.data

    def work(self, batches: Sequence[ScoreBatch]) -> list[costs.StepWork]:
        """What each step of `score` on these batches would do (for `selection.py`)."""
        layout, config = self.model.layout, self.model.config
        steps = []
        for batch in batches:
            T, rows = self.plan(batch)
            for start in range(0, batch.num_items, rows):
                padded = layout.rows(min(rows, batch.num_items - start))
                peak = padded // layout.data * costs.serial_row_bytes(config, T)
                pairs = padded * T * T  # the causal mask is applied to a dense [T, T]
                steps.append(
                    costs.step_work(
                        config,
                        self.model.dtype.itemsize,
                        rows=padded,
                        new=T,
                        pairs=pairs,
                        slots=1,
                        peak=peak,
                    )
                )
        return steps

    def score(self, batch: ScoreBatch) -> BackendOutput:
        n = batch.num_items
        lens = batch.sequence_lens
        out = BackendOutput.for_batch(batch)
        layout = self.model.layout
        T, rows = self.plan(batch)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            tokens = np.zeros((layout.rows(stop - start), T), np.int32)
            for row, i in enumerate(range(start, stop)):
                seq = batch.sequence(i)
                tokens[row, : len(seq)] = seq
            lengths = np.zeros(tokens.shape[0], np.int32)
            lengths[: stop - start] = lens[start:stop]
            out.step("score_sequences", (*tokens.shape, len(batch.label_ids)), int(lengths.sum()))
            out.scores(
                np.arange(start, stop),
                score_sequences(
                    self.model.params,
                    layout.put_rows(tokens),
                    layout.put_rows(lengths),
                    batch.label_ids,
                    config=self.model.config,
                ),
            )
        return out.build()
