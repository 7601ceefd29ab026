"""Multi-token log-likelihood: log P(continuation | context), the multiple-choice eval score.

For a context c and a continuation x_1..x_n, `Scorer.loglikelihood` returns
sum_j log P(x_j | c + x_1..x_{j-1}) over the full vocabulary, each term, and whether every x_j is
the model's argmax there (lm-evaluation-harness's `(logprob, is_greedy)`).

What is tokenized, and how it compares with lm-evaluation-harness (checked against its source,
`lm_eval/api/model.py` `_encode_pair` and `loglikelihood`, `lm_eval/models/huggingface.py`
`tok_encode`):

- Trailing whitespace of a text context moves to the front of every continuation, as the harness
  does: context "Answer: " and continuation "Paris" score " Paris" after "Answer:", so the space
  sits where BPE vocabularies put it, at the start of the next word.
- The context is encoded with the tokenizer's special tokens (a BOS where the tokenizer adds
  one), as the harness's HF model does since v0.4.9.2 with `add_bos_token` unset; v0.4.9 and
  earlier added none for causal models unless `add_bos_token=True`.
- Each continuation is encoded on its own, without special tokens, so the context's tokens are
  the same for every continuation and its K/V is computed once (and kept in the prefix cache).
  The harness instead encodes context + continuation as one string and takes the tokens past
  the context's. The two agree whenever the tokenizer's pre-tokenizer breaks at the boundary,
  as byte-level BPE does before a space-led word; they differ where BPE merges across it
  (context "(" and continuation "A)" may join into one token). Pass token ids to score any
  other split.
- An empty context is an error unless the tokenizer adds a BOS (the harness substitutes its
  prefix token, BOS or EOS: pass token ids starting with it to do the same). An empty
  continuation is an error.

It runs on prefill_extend's machinery: the context is prefilled once (or found in the prefix
cache) and every continuation extends it, with log-probabilities read at every continuation
position, not only the last.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry
from tpuscore.backends.prefill_extend.backend import PrefillExtendBackend
from tpuscore.engine import executables
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import to_host

if TYPE_CHECKING:
    from tpuscore.engine.runner import Engine

BACKEND = "prefill_extend"


@attrs.frozen
class LoglikelihoodResult:
    """One continuation's log-likelihood.

    Attributes:
        logprob: sum of the continuation tokens' log-probabilities given everything before them.
        is_greedy: whether every continuation token is the model's argmax at its position.
        token_logprobs: each token's log-probability, read-only float32 [num_tokens].
        num_tokens: the continuation's token count.
    """

    logprob: float
    is_greedy: bool
    token_logprobs: np.ndarray
    num_tokens: int


@functools.partial(jax.jit, static_argnames="config")
def continuation_logprobs(
    params: Params, prefix: Prefix, tokens: jax.Array, config: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities [B, L] of tokens [B, L] (rows right-padded continuations of `prefix`),
    each given the prefix and the row's tokens before it, and whether each is the argmax [B, L].

    Token j is predicted by the hidden state before it: the prefix's last token for j = 0, the
    row's token j - 1 after. Positions past a row's length hold padding: the caller drops them
    (causal attention keeps padding from reaching real tokens)."""
    B, L = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, tokens, causal)  # [B, L, D]
    first = jnp.broadcast_to(prefix.last_hidden, (B, 1, hidden.shape[-1]))
    before = jnp.concatenate([first, hidden[:, :-1]], axis=1)  # [B, L, D]
    vocab = jnp.arange(config.vocab_size)
    logprobs = decoder.label_logprobs(params, config, before.reshape(B * L, -1), vocab)
    logprobs = logprobs.reshape(B, L, -1)  # [B, L, V]
    picked = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logprobs, axis=-1) == tokens


def loglikelihood(
    engine: Engine, context: Any, continuations: Any, *, backend: str | None = None
) -> list[LoglikelihoodResult]:
    """`Scorer.loglikelihood`: validate, then run on the engine's prefill_extend instance."""
    name = registry.backend_name(BACKEND if backend is None else backend)
    if name not in (registry.AUTO, BACKEND):
        raise ValidationError(
            "unsupported_option",
            f"loglikelihood runs on {BACKEND}'s prefill and extend steps; backend {name!r} "
            f"cannot run it (use None, 'auto' or {BACKEND!r})",
            "backend",
        )
    request = validation.validate_loglikelihood(context, continuations, engine.facts)
    results = run(engine.backends.get(BACKEND), request)
    executables.guard().check()
    return results


def run(
    backend: PrefillExtendBackend, request: validation.LoglikelihoodRequest
) -> list[LoglikelihoodResult]:
    """Prefill the context once (or reuse it from the prefix cache), then extend it by
    length-sorted batches of continuations."""
    model = backend.model
    prefix = backend.query_prefix(np.asarray(request.context, np.int32))
    lens = np.array([len(c) for c in request.continuations], np.int64)
    pending = []
    for rows, length in backend.continuation_batches(lens):
        tokens = np.zeros((model.layout.rows(len(rows)), length), np.int32)
        for r, i in enumerate(rows):
            tokens[r, : lens[i]] = request.continuations[i]
        tokens = model.layout.put_rows(tokens)
        pending.append((rows, continuation_logprobs(model.params, prefix, tokens, model.config)))
    results: list[LoglikelihoodResult | None] = [None] * len(lens)
    for rows, (picked, greedy) in pending:  # read back after every batch is dispatched
        picked, greedy = to_host(picked), to_host(greedy)
        for r, i in enumerate(rows):
            n = int(lens[i])
            token_logprobs = picked[r, :n].astype(np.float32)
            token_logprobs.setflags(write=False)
            results[i] = LoglikelihoodResult(
                logprob=float(token_logprobs.astype(np.float64).sum()),
                is_greedy=bool(greedy[r, :n].all()),
                token_logprobs=token_logprobs,
                num_tokens=n,
            )
    return results
