"""Prompt templates for yes/no rerankers: how a query and each item become the scored text.

A template has a query part (with the task instruction), an item part, a suffix shared by every
item (tokenized once and appended to each, such as the assistant-turn opener) and a label pair,
positive first. `Scorer.rank(..., template="qwen3-reranker")` applies one:

    query tokens  = encode(template.render_query(query, instruction), with special tokens)
    item tokens   = encode(template.render_item(item)) + encode(template.item_suffix)
    score         = P(labels[0]) / (P(labels[0]) + P(labels[1])) after query + item tokens

Shipped templates:

- "qwen3-reranker": Qwen3-Reranker's published format (Qwen/Qwen3-Reranker-0.6B, -4B, -8B). Its
  model card builds `prefix + "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}"
  + suffix` and reads P("yes") against P("no") at the last position. The strings here were
  checked against copies of the card's example (the card itself was not reachable from where
  this was written): vLLM's `examples/offline_inference/qwen3_reranker.py` (vllm-project/vllm,
  which splits the prompt into a query template and a document template exactly as this module
  does), the "Qwen3-Reranker" tutorial of the vLLM Ascend docs, and the
  mlx-community/Qwen3-Reranker-0.6B-4bit model card; all spell the same prefix, suffix and
  default instruction. The card tokenizes prefix, content and suffix as three pieces; tpuscore
  tokenizes the query part (prefix + instruction + query), the item part (`<Document>: ...`)
  and the suffix. Both split at a newline followed by `<`, which Qwen's pre-tokenizer regex
  already puts in separate pieces, so the token sequences are the same
  (`tests/test_templates.py` checks this on the tests' byte-level tokenizers). It needs a
  Qwen3 reranker checkpoint: a base or chat model was not trained to answer this prompt.
- "plain": a model-agnostic instruction prompt for instruction-tuned models that were not
  trained as rerankers (the embedded SmolLM2 included). The query part is the instruction and
  `Query: ...`, the item part `Document: ...`, the suffix a newline and `Relevant:`; the labels
  " yes" and " no", with the leading space that follows a colon: single tokens in SmolLM2's
  vocabulary, as in most byte-level BPE vocabularies (not in the tests' tiny 313-token one).
"""

from __future__ import annotations

import attrs

from tpuscore.api.errors import ValidationError


@attrs.frozen
class Template:
    """A reranker prompt.

    Attributes:
        name: the name `get` knows it by.
        query: a format string with `{instruction}` and `{query}`: the query part.
        item: a format string with `{item}`: each item's own part.
        item_suffix: text appended to every item, tokenized once on its own (pass it as
            `Scorer.score(..., item_suffix=)`), such as the assistant-turn opener.
        labels: (positive, negative); each must encode to one token on the model's tokenizer.
        default_instruction: the instruction when none is given.
    """

    name: str
    query: str
    item: str
    item_suffix: str
    labels: tuple[str, str]
    default_instruction: str

    def render_query(self, query: str, instruction: str | None = None) -> str:
        """The query part for `query`, under `instruction` (default: `default_instruction`)."""
        if instruction is None:
            instruction = self.default_instruction
        return self.query.format(instruction=instruction, query=query)

    def render_item(self, item: str) -> str:
        """The item part for `item`, without the suffix (the scorer appends that once tokenized)."""
        return self.item.format(item=item)


QWEN3_RERANKER = Template(
    name="qwen3-reranker",
    query=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
        'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
        "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
    ),
    item="<Document>: {item}",
    item_suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    labels=("yes", "no"),
    default_instruction=(
        "Given a web search query, retrieve relevant passages that answer the query"
    ),
)

PLAIN = Template(
    name="plain",
    query="{instruction}\n\nQuery: {query}\n",
    item="Document: {item}",
    item_suffix="\nRelevant:",
    labels=(" yes", " no"),
    default_instruction=("Judge whether the document is relevant to the query. Answer yes or no."),
)

TEMPLATES: dict[str, Template] = {t.name: t for t in (QWEN3_RERANKER, PLAIN)}


def get(name: str) -> Template:
    """The shipped template called `name`.

    Raises:
        ValidationError: code "unknown_template", listing the names there are.
    """
    if not isinstance(name, str) or name not in TEMPLATES:
        raise ValidationError(
            "unknown_template",
            f"template {name!r} is unknown; available: {', '.join(TEMPLATES)}",
            "template",
        )
    return TEMPLATES[name]
