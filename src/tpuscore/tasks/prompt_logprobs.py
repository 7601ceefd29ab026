"""Prompt log-probabilities: for every token of a prompt, log P(token | the tokens before it) and
the TOP most likely tokens there, and the same for the token after the prompt (OpenAI's
`/v1/completions` with `echo` and `logprobs`, docs/completions.md).

Prompts are grouped by their first token and each group's longest common prefix (p tokens) is
computed once for all its prompts: prefilled once (or found in prefill_extend's prefix cache),
every prompt's remainder extending it; the prefix's own positions 1..p-1 are read once, from
its tokens extending its first. So the choices of one question, which share the question, share
its computation. It runs on prefill_extend's prefill and extend steps, as
`tasks.loglikelihood` does; a token's log-probability here equals `Scorer.loglikelihood`'s for
the same tokens (tests/test_completions.py checks it against transformers through
lm-evaluation-harness).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import ValidationError
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import to_host

if TYPE_CHECKING:
    from tpuscore.engine.runner import Engine

BACKEND = "prefill_extend"
TOP = 20  # the most alternatives a position reports (vLLM's default max_logprobs)


@attrs.frozen
class PromptLogprobs:
    """One prompt's log-probabilities.

    Attributes:
        tokens: the prompt's token ids [n].
        token_logprobs: log P(token j | tokens before it), float32 [n]; [0] is NaN (nothing
            predicts the first token).
        top_ids, top_logprobs: the TOP most likely tokens and their log-probabilities at
            positions 1..n, [n, TOP], best first: row j - 1 is what predicts token j, row n - 1
            the token after the prompt.
    """

    tokens: list[int]
    token_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnames=("config", "top"))
def _positions(
    params: Params, prefix: Prefix, tokens: jax.Array, config: ModelConfig, top: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For rows tokens [B, L] (right-padded) continuing `prefix`: the log-probability of each
    token [B, L], and the top log-probabilities and ids [B, L + 1, top] at each of the L + 1
    positions from the prefix's last token on (position i predicts token i; the caller reads a
    row's positions up to its length; causal attention keeps padding out of real tokens)."""
    B, L = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, tokens, causal)  # [B, L, D]
    first = jnp.broadcast_to(prefix.last_hidden, (B, 1, hidden.shape[-1]))
    before = jnp.concatenate([first, hidden], axis=1)  # [B, L + 1, D]
    vocab = jnp.arange(config.vocab_size)
    logprobs = decoder.label_logprobs(params, config, before.reshape(B * (L + 1), -1), vocab)
    logprobs = logprobs.reshape(B, L + 1, -1)  # [B, L + 1, V]
    picked = jnp.take_along_axis(logprobs[:, :L], tokens[..., None], axis=-1)[..., 0]
    values, ids = jax.lax.top_k(logprobs, top)
    return picked, values, ids


def validate(engine: Engine, prompts: Any, param: str = "prompt") -> list[list[int]]:
    """The prompts as token-id lists, each non-empty, in the vocabulary and within the model's
    positions; a classification model has no next-token distribution and is refused."""
    config = engine.model.config
    if config.num_labels:
        raise ValidationError(
            "unsupported_model",
            "a classification model has no next-token probabilities to report",
            param,
        )
    checked = []
    for i, prompt in enumerate(prompts):
        where = f"{param}[{i}]" if len(prompts) > 1 else param
        if len(prompt) == 0:
            raise ValidationError("empty_prompt", f"{where} has no token", where)
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise ValidationError(
                "token_id_negative" if bad[0] < 0 else "token_id_exceeds_vocab",
                f"{where} holds token id {bad[0]}; the vocabulary has {config.vocab_size}",
                where,
            )
        if len(prompt) > config.max_position_embeddings:
            raise ValidationError(
                "sequence_too_long",
                f"{where} has {len(prompt)} tokens; the model takes at most "
                f"{config.max_position_embeddings}",
                where,
            )
        checked.append([int(t) for t in prompt])
    return checked


def prompt_logprobs(engine: Engine, prompts: Sequence[Sequence[int]]) -> list[PromptLogprobs]:
    """`Scorer.prompt_logprobs`: validate, group by first token, run each group."""
    prompts = validate(engine, prompts)
    backend = engine.backends.get(BACKEND)
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt[0], []).append(i)
    results: list[PromptLogprobs | None] = [None] * len(prompts)
    for members in groups.values():
        for i, result in zip(members, _group(backend, [prompts[i] for i in members]), strict=True):
            results[i] = result
    engine.executables.check()
    return results


def _common_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    length = min(map(len, prompts))
    for prompt in prompts[1:]:
        mismatch = np.flatnonzero(np.asarray(prompt[:length]) != np.asarray(first[:length]))
        length = int(mismatch[0]) if len(mismatch) else length
    return length


def _group(backend, prompts: list[list[int]]) -> list[PromptLogprobs]:
    """Prompts sharing a first token: their common prefix once, then each remainder."""
    p = _common_prefix(prompts)
    shared = prompts[0][:p]
    # Positions 1..p-1, inside the prefix: its tokens extending its first token, once.
    inside = _extend(backend, shared[:1], [shared[1:]]) if p > 1 else None
    rows = _extend(backend, shared, [prompt[p:] for prompt in prompts])
    results = []
    for prompt, (picked, values, ids) in zip(prompts, rows, strict=True):
        n = len(prompt)
        token_logprobs = np.full(n, np.nan, np.float32)
        if inside is not None:
            in_picked, in_values, in_ids = inside[0]
            token_logprobs[1:p] = in_picked[: p - 1]
            values = np.concatenate([in_values[: p - 1], values[: n - p + 1]])
            ids = np.concatenate([in_ids[: p - 1], ids[: n - p + 1]])
        else:
            values, ids = values[: n - p + 1], ids[: n - p + 1]
        token_logprobs[p:] = picked[: n - p]
        for array in (token_logprobs, values, ids):
            array.setflags(write=False)
        results.append(PromptLogprobs(prompt, token_logprobs, ids, values))
    return results


def _extend(backend, prefix_tokens: list[int], remainders: list[list[int]]):
    """(picked [r], top values [r + 1, TOP], top ids [r + 1, TOP]) per remainder of length r
    continuing prefix_tokens; an empty remainder runs as one padding token, read at 0 only."""
    model = backend.model
    prefix = backend.query_prefix(np.asarray(prefix_tokens, np.int32))
    lens = np.array([max(len(r), 1) for r in remainders], np.int64)
    pending = []
    for rows, length in backend.continuation_batches(lens):
        tokens = np.zeros((model.layout.rows(len(rows)), length), np.int32)
        for r, i in enumerate(rows):
            tokens[r, : len(remainders[i])] = remainders[i]
        tokens = model.layout.put_rows(tokens)
        out = _positions(model.params, prefix, tokens, model.config, TOP)
        pending.append((rows, out))
    results: list[Any] = [None] * len(remainders)
    for rows, out in pending:  # read back after every batch is dispatched
        picked, values, ids = (to_host(x) for x in out)
        for r, i in enumerate(rows):
            n = len(remainders[i])
            results[i] = (
                picked[r, :n].astype(np.float32),
                values[r, : n + 1].astype(np.float32),
                ids[r, : n + 1].astype(np.int64),
            )
    return results
