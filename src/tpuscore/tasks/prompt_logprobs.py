"""Prompt log-probabilities: for every token of a prompt, log P(token | the tokens before it) and
the TOP most likely tokens there, and the same for the token after the prompt (OpenAI's
`/v1/completions` with `echo` and `logprobs`, docs/completions.md).

Prompts are grouped by their first token and each group's longest common prefix (p tokens) is
computed once for all its prompts: prefilled once (or found in prefill_extend's prefix cache),
every prompt's remainder extending it; the prefix's own positions 1..p-1 are read once, from
its tokens extending its first. So the choices of one question, which share the question, share
its computation. This module validates, groups and assembles; the groups' (prefix, remainders)
pairs run through the engine (`Engine.prompt_logprobs`) on prefill_extend's prompt
log-probabilities plans, under the memory guard, with their step in the shape set. A token's
log-probability here equals `Scorer.loglikelihood`'s for the same tokens
(tests/test_completions.py checks it against transformers through lm-evaluation-harness).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from tpuscore.api import bounds, validation
from tpuscore.api.argument_checks import is_token_list, listed, token_ids
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.backends.contract import TOP_LOGPROBS, PositionScores

if TYPE_CHECKING:
    from tpuscore.engine.runner import Engine

TOP = TOP_LOGPROBS  # the most alternatives a position reports


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


def validate(engine: Engine, prompts: Any, param: str = "prompt") -> list[list[int]]:
    """The prompts as token-id lists, each non-empty, in the vocabulary and within the model's
    positions; a classification model has no next-token distribution and is refused. Anything
    but a list of token-id lists is `invalid_prompt` (a float or bool is no token id)."""
    config = engine.model.config
    if config.num_labels:
        raise ValidationError(
            "no_language_model_head",  # as loglikelihood says it: one code for one cause
            "this model has a classification head, not an LM head: it has no next-token "
            "probabilities to report",
            param,
        )
    prompts = listed(prompts)
    bounds.check_size(
        engine.facts.limits,
        items=(param, prompts),
        values={},
        holder=validation.SCORER_BOUNDS,
        check_ids=False,
    )
    if not is_token_list(prompts) or isinstance(prompts, np.ndarray):
        raise ValidationError(
            "invalid_prompt",
            f"{param} must be a list of token-id lists, got {short(prompts)}",
            param,
        )
    checked = []
    for i, prompt in enumerate(prompts):
        where = f"{param}[{i}]" if len(prompts) > 1 else param
        if not is_token_list(prompt):
            raise ValidationError(
                "invalid_prompt", f"{where} must be a list of token ids, got {short(prompt)}", where
            )
        if len(prompt) == 0:
            raise ValidationError("empty_prompt", f"{where} has no token", where)
        prompt = token_ids(prompt, where, "invalid_prompt", config.vocab_size)  # noqa: PLW2901
        if len(prompt) > config.max_position_embeddings:
            raise ValidationError(
                "sequence_too_long",
                f"{where} has {len(prompt)} tokens; the model takes at most "
                f"{config.max_position_embeddings}",
                where,
            )
        checked.append(prompt)
    return checked


def prompt_logprobs(
    engine: Engine, prompts: Sequence[Sequence[int]], adapter: str | None = None
) -> list[PromptLogprobs]:
    """`Scorer.prompt_logprobs`: validate, group by first token, run every group's common prefix
    and remainders in one engine call (module doc) under the LoRA adapter named `adapter`
    (None: the base model), assemble each prompt's result."""
    prompts = validate(engine, prompts)
    adapter_at = validation.adapter_index(adapter, tuple(engine.model.adapter_names))
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt[0], []).append(i)
    extensions, members_of = [], []
    for members in groups.values():
        group = [prompts[i] for i in members]
        p = _common_prefix(group)
        shared = group[0][:p]
        if p > 1:  # positions 1..p-1, inside the prefix: its tokens extending its first, once
            extensions.append((shared[:1], [shared[1:]]))
        extensions.append((shared, [prompt[p:] for prompt in group]))
        members_of.append((members, p))
    scored = iter(engine.prompt_logprobs(extensions, adapter_at))
    results: list[PromptLogprobs | None] = [None] * len(prompts)
    for members, p in members_of:
        inside = next(scored)[0] if p > 1 else None
        for i, rows in zip(members, next(scored), strict=True):
            results[i] = _assemble(prompts[i], p, inside, rows)
    return results


def _common_prefix(prompts: list[list[int]]) -> int:
    first = prompts[0]
    length = min(map(len, prompts))
    for prompt in prompts[1:]:
        mismatch = np.flatnonzero(np.asarray(prompt[:length]) != np.asarray(first[:length]))
        length = int(mismatch[0]) if len(mismatch) else length
    return length


def _assemble(
    prompt: list[int], p: int, inside: PositionScores | None, rest: PositionScores
) -> PromptLogprobs:
    """One prompt's result from its group's prefix read inside (positions 1..p-1; None when
    p = 1) and its remainder's positions after the prefix."""
    n = len(prompt)
    token_logprobs = np.full(n, np.nan, np.float32)
    if inside is not None:
        token_logprobs[1:p] = inside.token_logprobs[: p - 1]
        values = np.concatenate([inside.top_logprobs[: p - 1], rest.top_logprobs[: n - p + 1]])
        ids = np.concatenate([inside.top_ids[: p - 1], rest.top_ids[: n - p + 1]])
    else:
        values, ids = rest.top_logprobs[: n - p + 1], rest.top_ids[: n - p + 1]
    token_logprobs[p:] = rest.token_logprobs[: n - p]
    for array in (token_logprobs, values, ids):
        array.setflags(write=False)
    return PromptLogprobs(prompt, token_logprobs, ids, values)
