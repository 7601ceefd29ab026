"""lm-evaluation-harness on tpuscore: the harness's model "tpuscore".

Importing this module registers the model with the harness (`pip install -e '.[eval]'`):

    import lm_eval
    import tpuscore.integrations.lm_eval  # noqa: F401  registers "tpuscore"

    lm_eval.simple_evaluate(
        model="tpuscore", model_args="pretrained=HuggingFaceTB/SmolLM2-135M,dtype=float32",
        tasks=["arc_easy"],
    )

and `python -m tpuscore.integrations.lm_eval` is the harness's own command line with it
registered (`... --model tpuscore --model_args pretrained=PATH --tasks arc_easy`).

What runs:
- `loglikelihood` (multiple choice): text is tokenized as the harness's `hf` model does
  (`TemplateLM._encode_pair`: the context and context + continuation encoded whole, the
  continuation being the tokens past the context's), so both score the same tokens. Requests are
  grouped by context and each context runs once, in one `Scorer.loglikelihood` call with all of
  its continuations; results come back in request order.
- `loglikelihood_rolling` (perplexity): the harness's rolling windows
  (`get_rolling_token_windows` + `make_disjoint_window`, one token of context), each window
  scored as token ids.
- `generate_until` raises `NotImplementedError`: tpuscore scores text, it does not generate.
- A model with a classification head is refused when the harness makes it: it has no token
  log-likelihoods.

Max length: the harness's `hf` model feeds at most `max_length` tokens and scores up to
`max_length + 1` tokens (the last one is only predicted); tpuscore takes sequences of at most
`max_position_embeddings` tokens counting that last one, so `max_length` defaults to
`max_position_embeddings - 1`. Give both models the same `max_length` to get the same windows.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    import lm_eval.models  # the harness's own models: registered first, or get_model skips them
    import lm_eval.utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as missing:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tpuscore.integrations.lm_eval needs lm-evaluation-harness: "
        "pip install -e '.[eval]' (or pip install 'lm-eval>=0.4')"
    ) from missing
from tqdm import tqdm

from tpuscore import Scorer
from tpuscore.tasks import loglikelihood

__all__ = ["TpuscoreLM"]

logger = logging.getLogger(__name__)

ADAPTER = "peft"  # the name the `peft` model arg's adapter is loaded under
Request = tuple[Any, list[int], list[int]]  # (request strings or None, context ids, continuation)


@register_model("tpuscore")
class TpuscoreLM(TemplateLM):
    """A harness model that scores with a `tpuscore.Scorer`.

    Model args (`--model_args key=value,...`):
        pretrained: what `Scorer.from_pretrained` loads (a Hugging Face directory or hub id, a
            .gguf file, a `Scorer.save` directory); default the embedded SmolLM2-135M-Instruct.
        dtype: `Scorer.from_pretrained`'s: "float32", "bfloat16", "mixed" (bfloat16 matmuls
            with float32 accumulation: the fastest on a CPU) or "int8"; default float32 on CPU,
            bfloat16 on accelerators.
        backend: the backend `Scorer.loglikelihood` runs on (None, "auto", "prefill_extend").
        max_length: the longest model input, as the `hf` model's; default
            max_position_embeddings - 1 (the module docstring says why).
        prefix_token_id: the token an empty context or a rolling window starts from; default,
            as the `hf` model's, the checkpoint's BOS, else its EOS (from tokenizer_config.json
            or config.json, or the GGUF metadata).
        revision, local_files_only, cache_dir: passed to `Scorer.from_pretrained` for hub ids.
        peft: a PEFT LoRA adapter directory every request is scored under, as the `hf`
            model's `peft=` (docs/adapters.md says which adapters load).
        batch_size, max_batch_size, device: the harness passes them to every model; ignored,
            as tpuscore sizes its own batches and runs on JAX's default device.
    """

    def __init__(
        self,
        pretrained: str | os.PathLike | None = None,
        dtype: str | None = None,
        backend: str | None = None,
        max_length: int | None = None,
        prefix_token_id: int | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        cache_dir: str | None = None,
        peft: str | os.PathLike | None = None,
        batch_size: Any = None,
        max_batch_size: Any = None,
        device: Any = None,
    ) -> None:
        super().__init__()
        del batch_size, max_batch_size, device
        loglikelihood.check_backend(backend)  # before loading the model, not at the first request
        self.scorer = Scorer.from_pretrained(
            pretrained,
            dtype=dtype,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            adapters=None if peft is None else {ADAPTER: peft},
        )
        self.adapter = None if peft is None else ADAPTER
        self.peft = peft
        if self.scorer.tokenizer is None:
            raise ValueError(f"{pretrained!r} has no tokenizer; the harness sends text")
        if self.scorer.config.num_labels:  # refused here, not at the first of many requests
            raise ValueError(
                f"{pretrained!r} has a classification head, not an LM head: it has no token "
                "log-likelihoods for the harness's tasks to score"
            )
        self.pretrained = pretrained
        self.scoring_backend = backend
        limit = self.scorer.config.max_position_embeddings - 1
        if max_length is not None and not 0 < int(max_length) <= limit:
            raise ValueError(
                f"max_length={max_length} is outside [1, {limit}]: tpuscore scores at most "
                f"max_position_embeddings ({limit + 1}) tokens, the last one predicted only"
            )
        self._max_length = limit if max_length is None else int(max_length)
        bos, eos = special_token_ids(
            pretrained,
            self.scorer.tokenizer,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
        )
        self._eos = eos
        self._prefix = prefix_token_id if prefix_token_id is not None else bos
        if self._prefix is None:
            self._prefix = eos

    @property
    def eot_token_id(self) -> int | None:
        return self._eos

    @property
    def prefix_token_id(self) -> int:
        if self._prefix is None:
            raise ValueError(
                f"{self.pretrained!r} declares neither a BOS nor an EOS token, so an empty "
                "context or a rolling window has nothing to start from; pass "
                "prefix_token_id=ID in the model args"
            )
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained)

    def get_model_info(self) -> dict[str, Any]:
        info = {"model_name": str(self.pretrained), "model_dtype": str(self.scorer.dtype)}
        return info if self.peft is None else info | {"peft": str(self.peft)}

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of `string`, with the tokenizer's special tokens unless told otherwise or
        the string already starts with the prefix token's text (the `hf` model's rule)."""
        if add_special_tokens is None:
            add_special_tokens = not (
                self._prefix is not None
                and string.startswith(
                    self.scorer.tokenizer.decode([self._prefix], skip_special_tokens=False)
                )
            )
        return self.scorer.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def _loglikelihood_tokens(
        self, requests: Sequence[Request], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) per request, in order; one `Scorer.loglikelihood` call per
        distinct context (after the `hf` model's left truncation to max_length + 1 tokens)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        continuations = []
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens is longer than "
                    f"max_length={self.max_length}"
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            groups.setdefault(tuple(whole[: len(whole) - len(continuation)]), []).append(i)
            continuations.append(list(continuation))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="tpuscore loglikelihood", disable=disable_tqdm)
        for context, members in groups.items():
            scored = self.scorer.loglikelihood(
                list(context),
                [continuations[i] for i in members],
                backend=self.scoring_backend,
                adapter=self.adapter,
            )
            for i, result in zip(members, scored, strict=True):
                answer = (result.logprob, result.is_greedy)
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(members))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False):
        """The log-likelihood of each request's whole text, summed over the `hf` model's
        rolling windows of max_length tokens."""
        windows: list[Request] = []
        owners: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            pairs = lm_eval.utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_eval.utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        scored = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        for i, (logprob, _) in zip(owners, scored, strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False):
        tasks = sorted({str(getattr(req, "task_name", None)) for req in requests})
        raise NotImplementedError(
            f"tpuscore scores text, it does not generate: task(s) {', '.join(tasks)} need "
            "generate_until. Run multiple-choice (loglikelihood) and perplexity "
            "(loglikelihood_rolling) tasks on tpuscore, generative tasks on another model"
        )


def special_token_ids(
    pretrained: str | os.PathLike | None,
    tokenizer: Any,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    cache_dir: str | None = None,
) -> tuple[int | None, int | None]:
    """(BOS, EOS) ids the checkpoint declares: its tokenizer_config.json first, as a Hugging
    Face tokenizer reads them, then config.json; for a .gguf file, its metadata. None where it
    declares none (a `Scorer.save` directory keeps no such record)."""
    if pretrained is None:
        from tpuscore.models.loaders.default import default_model_path

        return _gguf_ids(default_model_path())
    path = Path(pretrained)
    if path.suffix == ".gguf":
        return _gguf_ids(path)
    if path.is_dir():
        files = {name: path / name for name in ("tokenizer_config.json", "config.json")}
    else:
        files = _hub_files(str(pretrained), revision, local_files_only, cache_dir)
    found: list[int | None] = [None, None]
    for name in ("tokenizer_config.json", "config.json"):
        config = _read_json(files.get(name))
        for slot, key in enumerate(("bos", "eos")):
            if found[slot] is None:
                found[slot] = _token_id(config, key, tokenizer)
    return found[0], found[1]


def _token_id(config: dict[str, Any], key: str, tokenizer: Any) -> int | None:
    """`{key}_token` (text, or {"content": text}) or `{key}_token_id` (an id or a list)."""
    token = config.get(f"{key}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        return tokenizer.token_to_id(token)
    token_id = config.get(f"{key}_token_id")
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    return token_id if isinstance(token_id, int) else None


def _read_json(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _hub_files(
    repo: str, revision: str | None, local_files_only: bool, cache_dir: str | None
) -> dict[str, Path]:
    import huggingface_hub

    files = {}
    for name in ("tokenizer_config.json", "config.json"):
        try:
            files[name] = Path(
                huggingface_hub.hf_hub_download(
                    repo,
                    name,
                    revision=revision,
                    local_files_only=local_files_only,
                    cache_dir=cache_dir,
                )
            )
        except Exception as error:  # a repo without the file, or offline without it cached
            logger.debug("no %s for %s: %s", name, repo, error)
    return files


def _gguf_ids(path: Path) -> tuple[int | None, int | None]:
    import gguf

    reader = gguf.GGUFReader(path, "r")

    def value(key: str) -> int | None:
        field = reader.get_field(key)
        return None if field is None else int(field.contents())

    return value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
