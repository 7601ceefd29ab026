"""The `Scorer` facade: load, validate, plan, run, return."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import numpy as np
import tokenizers

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.api.templates import Template
from tpuscore.backends import registry
from tpuscore.backends.pool import BackendPool
from tpuscore.engine import compilation_cache, memory_guard, planning, progress, selection
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.engine.warmup import DEFAULT_GEOMETRIES, Warmed, warm
from tpuscore.models import loaders as loading
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import orbax as checkpoint
from tpuscore.models.model import Model, resolve_dtype
from tpuscore.models.weights import Params
from tpuscore.parallel import sharding
from tpuscore.tasks import loglikelihood, ranking
from tpuscore.tasks.loglikelihood import LoglikelihoodResult
from tpuscore.tasks.ranking import RankedItem


class Scorer:
    """Scores items against a query with a decoder-only LM: log P(label | query + item).

    Build one with `Scorer.from_pretrained(...)` and reuse it: it holds the weights on device and
    its backends keep their compiled shapes and caches. Safe to call from several threads.
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
        selector: planning.Selector | None = None,
        profile: DeviceProfile | str | os.PathLike | None = None,
        mesh: jax.sharding.Mesh | None = None,
        devices: Sequence[jax.Device] | None = None,
    ):
        """Args: as `from_pretrained`, with the model given as its config, parameters (a tree as
        `models/weights.py` describes) and tokenizer (None: token-id inputs only). selector: what
        "auto" runs for a call's groups (default `selection.CostModel` with `profile`)."""
        layout = sharding.make_layout(config, mesh, devices)
        self.model = Model.build(config, params, dtype, layout)
        self.tokenizer = tokenizer
        self.default_backend = backend
        if profile is not None and not isinstance(profile, DeviceProfile):
            profile = DeviceProfile.load(profile)
        self.cost_model = selection.CostModel(profile)
        self.selector = selector or self.cost_model
        self.backends = BackendPool(self.model, backend_options)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def params(self) -> Params:
        return self.model.params

    @property
    def dtype(self) -> np.dtype:
        return self.model.dtype

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The mesh the scorer is sharded over (axes "data" and "model"), or None: one device."""
        return self.model.layout.mesh

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
        compilation_cache_dir: str | os.PathLike | None = None,
        profile: DeviceProfile | str | os.PathLike | None = None,
        mesh: jax.sharding.Mesh | None = None,
        devices: Sequence[jax.Device] | None = None,
    ) -> Scorer:
        """Load a model and build a scorer on it.

        Args:
            model: a Hugging Face directory or hub id, a .gguf file, a directory written by
                `save`, or None for the embedded default model (SmolLM2-135M-Instruct).
            dtype: "float32" or "bfloat16"; default float32 on CPU, bfloat16 on accelerators.
            backend: the backend `score` runs when none is named; "auto" lets the scorer pick.
            backend_options: backend name -> its options, e.g.
                `{"prefill_extend": {"prefix_cache_bytes": 2**30, "batch_items": 64}}`.
            revision, local_files_only, cache_dir: passed to `huggingface_hub` for hub ids.
            compilation_cache_dir: keep compiled executables in this directory, so a restarted
                process loads them instead of compiling (default: the TPUSCORE_COMPILATION_CACHE
                environment variable; neither: off). Process-wide, as JAX's setting is.
            profile: the device profile "auto" prices backends with: a `DeviceProfile` or the
                path of one (`python -m tpuscore.cli.calibrate` writes it); default the built-in
                profile of this device kind (`tpuscore.engine.profiles`).
            mesh: shard the scorer over this `jax.sharding.Mesh` with axes "data" (request rows)
                and "model" (attention heads and the MLP width; it must divide the kv heads).
                On several hosts, a mesh over every process's devices (docs/sharding.md).
            devices: shorthand for a data-parallel mesh over these devices (not with mesh).
                Neither: the default device.

        Returns:
            A `Scorer` holding the weights on device.

        Raises:
            ValidationError: unknown backend in backend_options, or a bad option
                (`unknown_backend`, `invalid_backend_option`); a bad mesh (`invalid_mesh`).
            FileNotFoundError, UnsupportedModelError, CheckpointMismatchError: the model cannot
                be found, is of an unsupported kind, or its tensors do not match its config.
        """
        compilation_cache.enable(compilation_cache_dir)
        np_dtype = resolve_dtype(dtype)
        config, params, tokenizer = loading.load(
            model,
            dtype=np_dtype,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            layout_for=lambda config: sharding.make_layout(config, mesh, devices),
        )
        return cls(
            config,
            params,
            tokenizer,
            dtype=np_dtype,
            backend=backend,
            backend_options=backend_options,
            profile=profile,
            mesh=mesh,
            devices=devices,
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
        item_suffix: str | list[int] | None = None,
        max_item_tokens: int | None = None,
        truncate: str = "right",
        backend: str | None = None,
    ) -> ScoreResult:
        """log P(label | query + item) at the next-token position after each item.

        Text queries get the tokenizer's special tokens, items none; see
        `tpuscore.api.tokenization` for why the pieces are tokenized separately.

        Args:
            query: text, or token ids.
            items: texts, or token-id lists (the same kind as query). May be empty.
            label_token_ids: the labels as token ids; or give `labels`.
            labels: the labels as strings that each encode to exactly one token.
            apply_softmax: whether `result.scores` is the softmax over the labels (else the
                model's probabilities over the full vocabulary).
            item_first: score item + query instead of query + item.
            item_suffix: text (tokenized once, without special tokens) or token ids appended
                to every item, such as a reranker's assistant-turn opener.
            max_item_tokens: truncate each item to this many of its own tokens (the suffix is
                not counted and never cut); None: a too-long sequence is an error.
            truncate: "right" keeps an item's first max_item_tokens tokens, "left" its last.
            backend: a registered backend's name or "auto"; default the scorer's.

        Returns:
            A `ScoreResult`; `logprobs` is float32 [len(items), n_labels].

        Raises:
            ValidationError: any bad input, before anything runs; its `code` says which (the
                docs/api.md lists them) and `param` names the argument.
        """
        request = self.prepare(
            query,
            items,
            label_token_ids,
            labels=labels,
            apply_softmax=apply_softmax,
            item_first=item_first,
            item_suffix=item_suffix,
            max_item_tokens=max_item_tokens,
            truncate=truncate,
        )
        return self.run([request], backend=backend)[0]

    def plan(
        self,
        query: str | list[int],
        items: list[str] | list[list[int]],
        label_token_ids: list[int] | None = None,
        **options: Any,
    ) -> selection.Plan:
        """What `score` with these arguments would run, without running anything: each built-in
        backend's estimated seconds, peak bytes on one device against its budget, and steps, and
        `pick`, the backend "auto" would take (with the scorer's prefix cache as it is now).

        Args: as `score` (`backend` is not needed: every candidate is estimated).

        Raises:
            ValidationError: as `score`.
        """
        options.pop("backend", None)
        request = self.prepare(query, items, label_token_ids, **options)
        batches = [g.batch for g in planning.group([request])]
        plan = self.cost_model.plan(batches, self.backends)
        if self.selector is not self.cost_model:  # a user's selector picks; the model estimates
            plan = attrs.evolve(plan, pick=self.selector.select(batches, self.backends))
        return plan

    def score_batch(
        self,
        requests: Sequence[Mapping[str, Any]],
        *,
        backend: str | None = None,
        show_progress: bool = False,
    ) -> list[ScoreResult]:
        """Score many requests in one call. Requests with the same query, labels and item_first
        share their query's work; requests with different queries share device steps where the
        backend can mix them (every built-in one but serial and reference).

        Args:
            requests: mappings of `score`'s arguments (query, items, and label_token_ids or
                labels; optionally apply_softmax, item_first, item_suffix, max_item_tokens and
                truncate).
            backend: as in `score`, for every request.
            show_progress: show a progress bar (tqdm, on stderr) over the requests.

        Returns:
            One `ScoreResult` per request, in request order.

        Raises:
            ValidationError: a bad request, before any runs; `param` names it
                (`"requests[3].items"`), and an unknown or missing argument is `invalid_argument`.
        """
        prepared = []
        for i, request in enumerate(requests):
            where = f"requests[{i}]"
            arguments = validation.batch_request(request, where)
            try:
                prepared.append(self.prepare(**arguments))
            except ValidationError as e:
                raise e.within(where) from None
        with progress.bar(len(prepared), "request", enabled=show_progress) as advance:
            return self.run(prepared, backend=backend, on_progress=advance)

    def prepare(
        self,
        query: Any,
        items: Any,
        label_token_ids: Any = None,
        *,
        labels: Any = None,
        apply_softmax: Any = False,
        item_first: Any = False,
        item_suffix: Any = None,
        max_item_tokens: Any = None,
        truncate: Any = "right",
    ) -> ScoreRequest:
        """Validate one request (`score`'s arguments but backend) and turn it into token ids,
        ready for `run`. Raises ValidationError as `score` does."""
        return validation.validate(
            query,
            items,
            ScoreOptions(
                label_token_ids=label_token_ids,
                labels=labels,
                apply_softmax=apply_softmax,
                item_first=item_first,
                item_suffix=item_suffix,
                max_item_tokens=max_item_tokens,
                truncate=truncate,
            ),
            tokenizer=self.tokenizer,
            vocab_size=self.config.vocab_size,
            max_sequence_length=self.config.max_position_embeddings,
            num_classes=self.config.num_labels,
            pad_token_id=self.config.pad_token_id,
        )

    def run(
        self,
        requests: Sequence[ScoreRequest],
        *,
        backend: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[ScoreResult]:
        """Score requests from `prepare`. Requests that share a query, labels and item_first form
        a group; each backend gets all the groups that picked it in one call, so groups with
        different queries can share device steps. Every group's backend is checked before any
        runs. on_progress, if given, is called with the number of requests each backend call
        completes.

        Raises:
            ValidationError: an unknown backend, or one that cannot score a request
                (`unknown_backend`, `unsupported_option`).
        """
        name = registry.backend_name(self.default_backend if backend is None else backend)
        results = [
            ScoreResult.empty(len(r.label_ids), r.apply_softmax, r.classification) for r in requests
        ]
        planned = planning.plan(requests, name, self.selector, self.backends)
        if on_progress is not None:
            on_progress(sum(not r.items for r in requests))  # nothing to run for these
        for chosen, groups in planning.by_backend(planned).items():
            backend = self.backends.get(chosen)
            outputs = memory_guard.score_groups(chosen, backend, [g.batch for g in groups])
            for group, output in zip(groups, outputs, strict=True):
                split = planning.split(output, group, requests, chosen)
                for i, result in zip(group.members, split, strict=True):
                    results[i] = result
            if on_progress is not None:
                on_progress(sum(len(g.members) for g in groups))
        return results

    def rank(
        self,
        query: str | list[int],
        items: list[str] | list[list[int]],
        *,
        labels: list[str] | None = None,
        label_token_ids: list[int] | None = None,
        positive: int = 0,
        top_k: int | None = None,
        template: str | Template | None = None,
        instruction: str | None = None,
        item_suffix: str | list[int] | None = None,
        max_item_tokens: int | None = None,
        truncate: str = "right",
        backend: str | None = None,
        show_progress: bool = False,
    ) -> list[RankedItem]:
        """The items sorted by score, highest first; equal scores keep their input order.

        The score is the positive label's probability within the labels: P(yes) / (P(yes) +
        P(no)) for a yes/no pair. Conventions follow sentence-transformers' CrossEncoder.rank.

        Args:
            query, items: as in `score`.
            labels, label_token_ids: as in `score`, at least two; not with a template.
            positive: the index of the positive label.
            top_k: return only the best top_k (default all).
            template: a `tpuscore.api.templates` name (e.g. "qwen3-reranker", "plain") or a
                `Template`: it renders the query and items and supplies the item suffix and
                the labels.
            instruction: the template's instruction (default the template's own).
            item_suffix, max_item_tokens, truncate, backend: as in `score`.
            show_progress: show a progress bar (tqdm, on stderr) over the items; the items then
                run in pages of `ranking.PROGRESS_PAGE_ITEMS`.

        Returns:
            `RankedItem(index, score, item)` per item, best first (item as given, not rendered).

        Raises:
            ValidationError: as `score`, and `invalid_argument` for a bad positive or top_k, or
                labels / item_suffix given together with a template; `unknown_template`.
        """
        return ranking.rank(
            self,
            query,
            items,
            labels=labels,
            label_token_ids=label_token_ids,
            positive=positive,
            top_k=top_k,
            template=template,
            instruction=instruction,
            item_suffix=item_suffix,
            max_item_tokens=max_item_tokens,
            truncate=truncate,
            backend=backend,
            show_progress=show_progress,
        )

    def loglikelihood(
        self,
        context: str | list[int],
        continuations: list[str] | list[list[int]],
        *,
        backend: str | None = None,
    ) -> list[LoglikelihoodResult]:
        """log P(continuation | context) for each continuation, with lm-evaluation-harness
        semantics (`tpuscore.tasks.loglikelihood` documents the tokenization).

        Args:
            context: text (encoded with special tokens) or token ids.
            continuations: texts (each encoded without special tokens) or token-id lists, the
                same kind as context; none may be empty.
            backend: None, "auto" or "prefill_extend", the backend whose prefill and extend
                steps (and prefix cache) it runs on.

        Returns:
            One `LoglikelihoodResult(logprob, is_greedy, token_logprobs, num_tokens)` per
            continuation, in order.

        Raises:
            ValidationError: bad input (codes as `score`'s, and `empty_continuation`), or a
                backend that cannot run it (`unsupported_option`).
        """
        return loglikelihood.loglikelihood(self, context, continuations, backend=backend)

    def warmup(
        self,
        geometries: Sequence[Sequence[int]] | None = None,
        *,
        backends: Sequence[str] | None = None,
    ) -> list[Warmed]:
        """Compile ahead of time every step that requests of these geometries will meet.

        Args:
            geometries: (query_tokens, num_items, item_tokens) triples; default
                `tpuscore.engine.warmup.DEFAULT_GEOMETRIES`, a typical ranking service's.
            backends: the backends to warm for each; default the one `score` would run.

        Returns:
            What ran per geometry and backend, with its seconds (also logged at INFO). A
            geometry already compiled costs its run time only, no compilation.

        Raises:
            ValidationError: a geometry that is not three ints with num_items > 0
                (`invalid_geometry`), or one whose requests `score` would refuse (for example
                `sequence_too_long`), with `param` naming it ("geometries[1]"); checked before
                any runs. An unknown backend (`unknown_backend`).
        """
        names = [registry.backend_name(b) for b in backends or [self.default_backend]]
        geometries = DEFAULT_GEOMETRIES if geometries is None else geometries
        return warm(self.backends, self.prepare, self.selector, names, geometries)

    def get_backend(self, name: str) -> registry.Backend:
        """The backend instance `name`, built on first use with its options; for example
        `scorer.get_backend("prefill_extend").cache` holds the query K/V cache."""
        return self.backends.get(name)
