"""serial: every item's full sequence (query + item) through the model, batched and jitted.

The baseline every faster backend is measured against: simple, exact, and N times the query work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.batching import (
    BackendOutput,
    ScoreBatch,
    bucket_count,
    bucket_tokens,
    pow2_floor,
)
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

DEFAULT_MAX_BATCH_TOKENS = 8192
MAX_ROWS = 64


@functools.partial(jax.jit, static_argnames="config")
def score_sequences(
    params: Params, tokens: jax.Array, lengths: jax.Array, label_ids: jax.Array, config: ModelConfig
) -> jax.Array:
    """Label logprobs [B, C] at the last real token of each right-padded row of tokens [B, T].

    Rows of length 0 are padding; their output is meaningless and dropped by the caller.
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    attention = functools.partial(decoder.attend, mask=causal)
    hidden = decoder.forward(params, config, tokens, positions, attention)
    last = hidden[jnp.arange(B), jnp.maximum(lengths - 1, 0)]
    return decoder.label_logprobs(params, config, last, label_ids)


class SerialBackend:
    def __init__(
        self, config: ModelConfig, params: Params, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    ):
        self.config = config
        self.params = params
        self.max_batch_tokens = max_batch_tokens

    def score(self, batch: ScoreBatch) -> BackendOutput:
        n = batch.num_items
        lens = batch.sequence_lens
        logprobs = np.zeros((batch.items.shape[0], batch.label_ids.shape[0]), np.float32)
        T = bucket_tokens(int(lens.max(initial=1)))
        # A power of two, so chunks reuse count buckets.
        rows = pow2_floor(min(MAX_ROWS, self.max_batch_tokens // T))
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            tokens = np.zeros((bucket_count(stop - start), T), np.int32)
            for row, i in enumerate(range(start, stop)):
                seq = batch.sequence(i)
                tokens[row, : len(seq)] = seq
            lengths = np.zeros(tokens.shape[0], np.int32)
            lengths[: stop - start] = lens[start:stop]
            out = score_sequences(self.params, tokens, lengths, batch.label_ids, config=self.config)
            logprobs[start:stop] = np.asarray(out)[: stop - start]
        valid = np.arange(logprobs.shape[0]) < n
        return BackendOutput(logprobs=logprobs, valid=valid, num_tokens=int(lens.sum()))
