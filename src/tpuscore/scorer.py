"""The `Scorer` facade: validate, pick a backend, run it, post-process."""

from __future__ import annotations

import logging
import os
import threading
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
from tpuscore.validation import ValidationError, validate

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
    its backends keep their compiled shapes. Safe to call from several threads.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        tokenizer: tokenizers.Tokenizer | None,
        *,
        dtype: Any = None,
        backend: str = registry.AUTO,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.dtype = resolve_dtype(dtype)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, self.dtype), params)
        self.default_backend = backend
        self._backends: dict[str, backends.Backend] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        *,
        dtype: Any = None,
        backend: str = registry.AUTO,
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
        return cls(config, params, tokenizer, dtype=np_dtype, backend=backend)

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
        name = self.default_backend if backend is None else backend
        if name != registry.AUTO and name not in registry.available():
            raise ValidationError(
                "unknown_backend",
                f"backend {name!r} is not registered; available: "
                f"{', '.join([registry.AUTO, *registry.available()])}",
                "backend",
            )
        request = validate(
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
        n, c = len(request.items), len(request.label_ids)
        if n == 0:  # nothing to run: no backend is called
            empty = np.zeros((0, c), np.float32)
            return ScoreResult(empty, backend="none", num_tokens=0, apply_softmax=apply_softmax)
        batch = make_batch(request.query, request.items, request.label_ids, request.item_first)
        if name == registry.AUTO:
            name = registry.select(batch)
        out = self._backend(name).score(batch)
        if not out.valid[:n].all():
            raise RuntimeError(
                f"backend {name!r} left items unscored: {np.flatnonzero(~out.valid[:n])}"
            )
        logprobs = np.array(out.logprobs[:n, :c], dtype=np.float32)
        logprobs.setflags(write=False)
        logger.debug("scored %d items x %d labels with %s (%d tokens)", n, c, name, out.num_tokens)
        return ScoreResult(
            logprobs, backend=name, num_tokens=out.num_tokens, apply_softmax=apply_softmax
        )

    def _backend(self, name: str) -> backends.Backend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = registry.factory(name)(self.config, self.params)
            return self._backends[name]
