"""The `Scorer` facade: validate, pick a backend, run it, post-process."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers

from tpuscore import backends
from tpuscore.backends import registry
from tpuscore.batching import make_batch
from tpuscore.models import checkpoint, loading
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params
from tpuscore.results import ScoreResult
from tpuscore.validation import ScoreRequest, ValidationError, validate

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any) -> np.dtype:
    """float32 on CPU, bfloat16 on accelerators, unless asked: "float32" or "bfloat16"."""
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return np.dtype(DTYPES[name])


class Scorer:
    """Scores items against a query with a decoder-only LM: log P(label | query + item).

    Build one with `Scorer.from_pretrained(...)` and reuse it: it holds the weights on device and
    its backends keep their compiled shapes and caches. Safe to call from several threads.

    backend_options maps a backend name to its constructor options, for example
    `{"prefill_extend": {"prefix_cache_bytes": 2**30, "batch_items": 64}}`.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        tokenizer: tokenizers.Tokenizer | None,
        *,
        dtype: Any = None,
        backend: str = registry.AUTO,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = resolve_dtype(dtype)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, self.dtype), params)
        self.default_backend = backend
        self.backend_options = {name: dict(opts) for name, opts in (backend_options or {}).items()}
        self._backends: dict[str, backends.Backend] = {}
        self._lock = threading.Lock()
        for name in self.backend_options:  # bad names or options fail here, not mid-request
            if name not in registry.available():
                raise ValueError(f"backend_options names unknown backend {name!r}")
            self.get_backend(name)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        *,
        dtype: Any = None,
        backend: str = registry.AUTO,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        cache_dir: str | os.PathLike | None = None,
    ) -> Scorer:
        """Load a model: a Hugging Face directory or hub id, a .gguf file, a directory written by
        `save`, or None for the embedded default model (SmolLM2-135M-Instruct)."""
        np_dtype = resolve_dtype(dtype)
        config, params, tokenizer = loading.load(
            model,
            dtype=np_dtype,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
        )
        return cls(
            config,
            params,
            tokenizer,
            dtype=np_dtype,
            backend=backend,
            backend_options=backend_options,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write an Orbax checkpoint that `from_pretrained(path)` restores exactly."""
        if self.tokenizer is None:
            raise ValueError("a scorer without a tokenizer cannot be saved")
        checkpoint.save(path, self.config, self.params, self.tokenizer)

    def score(
        self,
        query: str | list[int],
        items: list[str] | list[list[int]],
        label_token_ids: list[int] | None = None,
        *,
        labels: list[str] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        backend: str | None = None,
    ) -> ScoreResult:
        """log P(label | query + item) at the next-token position after each item.

        query and items are text or token ids (the same kind). Give labels as token ids or as
        strings that encode to single tokens. Text queries get the tokenizer's special tokens,
        items none; see `tpuscore.tokenization` for why the pieces are tokenized separately.
        """
        name = self._backend_name(backend)
        request = self._validate(
            query,
            items,
            label_token_ids,
            labels=labels,
            apply_softmax=apply_softmax,
            item_first=item_first,
        )
        return self._run([request], name)[0]

    def score_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None
    ) -> list[ScoreResult]:
        """Score many requests in one call; results come back in request order.

        Each request is a mapping of `score`'s arguments: query, items, and label_token_ids or
        labels, optionally apply_softmax and item_first. Every request is validated before any
        runs; an error names the request (`param="requests[3].items"`). Requests with the same
        query, labels and item_first run as one backend call, so their items fill batches
        together and the query is processed once.
        """
        name = self._backend_name(backend)
        validated = []
        for i, request in enumerate(requests):
            where = f"requests[{i}]"
            if not isinstance(request, Mapping):
                raise ValidationError(
                    "invalid_argument",
                    f"{where} must be a mapping of score() arguments, got {type(request).__name__}",
                    where,
                )
            try:
                validated.append(self._validate(**request))
            except ValidationError as e:
                raise ValidationError(e.code, f"{where}: {e}", f"{where}.{e.param}") from None
            except TypeError as e:  # a missing or unknown argument
                raise ValidationError("invalid_argument", f"{where}: {e}", where) from None
        return self._run(validated, name)

    # prepare/run: stand-ins for issue 9's public pair on main (the lead keeps main's versions).
    def prepare(
        self,
        query: Any,
        items: Any,
        label_token_ids: Any = None,
        *,
        labels: Any = None,
        apply_softmax: Any = False,
        item_first: Any = False,
    ) -> ScoreRequest:
        """Validate one request (`score`'s arguments but backend), ready for `run`."""
        return self._validate(
            query,
            items,
            label_token_ids,
            labels=labels,
            apply_softmax=apply_softmax,
            item_first=item_first,
        )

    def run(
        self, requests: Sequence[ScoreRequest], *, backend: str | None = None
    ) -> list[ScoreResult]:
        """Score requests from `prepare`, one backend call per group that shares a query."""
        return self._run(list(requests), self._backend_name(backend))

    def get_backend(self, name: str) -> backends.Backend:
        """The backend instance `name`, built on first use with its `backend_options`; for
        example `scorer.get_backend("prefill_extend").cache` holds the query K/V cache."""
        with self._lock:
            if name not in self._backends:
                options = self.backend_options.get(name, {})
                self._backends[name] = registry.factory(name)(self.config, self.params, **options)
            return self._backends[name]

    def _backend_name(self, backend: str | None) -> str:
        name = self.default_backend if backend is None else backend
        if name != registry.AUTO and name not in registry.available():
            raise ValidationError(
                "unknown_backend",
                f"backend {name!r} is not registered; available: "
                f"{', '.join([registry.AUTO, *registry.available()])}",
                "backend",
            )
        return name

    def _validate(
        self,
        query: Any,
        items: Any,
        label_token_ids: Any = None,
        *,
        labels: Any = None,
        apply_softmax: Any = False,
        item_first: Any = False,
    ) -> ScoreRequest:
        return validate(
            query,
            items,
            label_token_ids,
            labels,
            apply_softmax=apply_softmax,
            item_first=item_first,
            tokenizer=self.tokenizer,
            vocab_size=self.config.vocab_size,
            max_sequence_length=self.config.max_position_embeddings,
        )

    def _run(self, requests: list[ScoreRequest], name: str) -> list[ScoreResult]:
        """Run validated requests, one backend call per group of requests that share a query,
        labels and item_first. Requests without items get an empty result from no backend."""
        results = [
            ScoreResult(
                np.zeros((0, len(request.label_ids)), np.float32),
                backend="none",
                num_tokens=0,
                apply_softmax=request.apply_softmax,
            )
            for request in requests
        ]
        for batch, backend, members in self._groups(requests, name):
            out = self.get_backend(backend).score(batch)
            n, c = batch.num_items, batch.num_labels
            if not out.valid[:n].all():
                raise RuntimeError(
                    f"backend {backend!r} left items unscored: {np.flatnonzero(~out.valid[:n])}"
                )
            logger.debug("scored %d items x %d labels with %s", n, c, backend)
            counts = [len(requests[i].items) for i in members]
            item_tokens = [sum(map(len, requests[i].items)) for i in members]
            tokens = _share_tokens(out.num_tokens, counts, item_tokens)
            start = 0
            for i, count, num_tokens in zip(members, counts, tokens, strict=True):
                results[i] = ScoreResult(
                    out.logprobs[start : start + count, :c],
                    backend=backend,
                    num_tokens=num_tokens,
                    apply_softmax=requests[i].apply_softmax,
                )
                start += count
        return results

    def _groups(self, requests: list[ScoreRequest], name: str):
        """(batch, backend name, member request indices) per group, all checked before any runs."""
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            if request.items:
                key = (tuple(request.query), tuple(request.label_ids), request.item_first)
                groups.setdefault(key, []).append(i)
        plan = []
        for (query, label_ids, item_first), members in groups.items():
            items = [item for i in members for item in requests[i].items]
            batch = make_batch(query, items, label_ids, item_first)
            backend = registry.select(batch) if name == registry.AUTO else name
            if item_first and not getattr(registry.factory(backend), "supports_item_first", True):
                raise ValidationError(
                    "unsupported_option",
                    f"backend {backend!r} runs the query once as a prefix shared by all items, "
                    "so it cannot put items first; use backend='serial' or 'auto'",
                    "item_first",
                )
            plan.append((batch, backend, members))
        return plan


def _share_tokens(total: int, counts: list[int], item_tokens: list[int]) -> list[int]:
    """Split a group's processed tokens between its requests: each its own item tokens, plus the
    query work in proportion to its item count (the remainder to the first request)."""
    shared = total - sum(item_tokens)
    shares = [shared * c // sum(counts) for c in counts]
    shares[0] += shared - sum(shares)
    return [t + s for t, s in zip(item_tokens, shares, strict=True)]
