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

It runs through the engine (`Engine.loglikelihood`) on prefill_extend's loglikelihood plans: the
context is prefilled once (or found in the prefix cache) and every continuation extends it, with
log-probabilities read at every continuation position, not only the last; under the memory guard,
with its step in the shape set. Under a LoRA adapter (`adapter=`), the context's prefill and every
continuation step run under it, and the prefix cache keeps its K/V apart from the base model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry

if TYPE_CHECKING:
    from tpuscore.engine.runner import Engine


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


def check_backend(backend: Any) -> str:
    """The backend loglikelihood runs on; `backend` (None, "auto" or that one's name) checked:
    any other is `unsupported_option`."""
    runs_it = registry.loglikelihood_backend()
    name = registry.backend_name(runs_it if backend is None else backend)
    if name not in (registry.AUTO, runs_it):
        raise ValidationError(
            "unsupported_option",
            f"loglikelihood runs on {runs_it}'s prefill and extend steps; backend {name!r} "
            f"cannot run it (use None, 'auto' or {runs_it!r})",
            "backend",
        )
    return runs_it


def loglikelihood(
    engine: Engine,
    context: Any,
    continuations: Any,
    *,
    backend: str | None = None,
    adapter: str | None = None,
) -> list[LoglikelihoodResult]:
    """`Scorer.loglikelihood`: validate, then run on the engine (`Engine.loglikelihood`), under
    the LoRA adapter named `adapter` (None: the base model)."""
    runs_it = check_backend(backend)
    request = validation.validate_loglikelihood(context, continuations, engine.facts, adapter)
    if request.adapter:
        registry.check_capabilities(runs_it, item_first=False, adapter=True)
    return [
        LoglikelihoodResult(
            logprob=float(scores.token_logprobs.astype(np.float64).sum()),
            is_greedy=scores.is_greedy,
            token_logprobs=scores.token_logprobs,
            num_tokens=len(scores.token_logprobs),
        )
        for scores in engine.loglikelihood(request)
    ]
