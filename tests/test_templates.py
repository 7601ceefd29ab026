"""Templates render the published prompts; the scorer scores exactly the tokens built by hand."""

import pytest

from tpuscore import ValidationError
from tpuscore.api import templates

# Qwen3-Reranker's model card example as vLLM's examples/offline_inference/qwen3_reranker.py
# copies it: tokens = encode(prefix) + encode(format_instruction(...)) + encode(suffix).
CARD_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def card_content(instruction, query, doc):
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"


QUERY = "What is the capital of China? "
DOCS = ["The capital of China is Beijing.", " Gravity is a force.\n", "", "naïve café 12, 345"]


@pytest.mark.parametrize("instruction", [None, "Find the passage that answers the question"])
def test_qwen3_reranker_renders_the_model_card_text(instruction):
    t = templates.get("qwen3-reranker")
    for doc in DOCS:
        rendered = t.render_query(QUERY, instruction) + t.render_item(doc) + t.item_suffix
        card = CARD_PREFIX + card_content(instruction or CARD_INSTRUCTION, QUERY, doc)
        assert rendered == card + CARD_SUFFIX
    assert t.labels == ("yes", "no")
    assert t.default_instruction == CARD_INSTRUCTION


@pytest.mark.parametrize("case", ["llama3_rope_tied", "qwen3_qknorm"])  # with and without BOS
def test_qwen3_reranker_sequences_equal_the_card_tokens(scorers, case):
    scorer = scorers(case)
    t = templates.get("qwen3-reranker")
    request = scorer.prepare(
        t.render_query(QUERY), [t.render_item(d) for d in DOCS], [1, 2], item_suffix=t.item_suffix
    )

    def encode(text):
        return scorer.tokenizer.encode(text, add_special_tokens=False).ids

    special = scorer.tokenizer.encode("", add_special_tokens=True).ids  # [BOS] or []
    for doc, item in zip(DOCS, request.items, strict=True):
        by_hand = (
            special
            + encode(CARD_PREFIX)
            + encode(card_content(CARD_INSTRUCTION, QUERY, doc))
            + encode(CARD_SUFFIX)
        )
        assert request.query + item == by_hand


def test_plain_sequences_equal_tokens_built_by_hand(scorers):
    scorer = scorers("llama3_rope_tied")
    t = templates.get("plain")
    instruction = "Does the document mention an animal?"
    request = scorer.prepare(
        t.render_query(QUERY, instruction),
        [t.render_item(d) for d in DOCS],
        [1, 2],
        item_suffix=t.item_suffix,
    )
    tok = scorer.tokenizer
    query = tok.encode(f"{instruction}\n\nQuery: {QUERY}\n", add_special_tokens=True).ids
    suffix = tok.encode("\nRelevant:", add_special_tokens=False).ids
    assert query[0] == tok.token_to_id("<|bos|>")
    assert request.query == query
    for doc, item in zip(DOCS, request.items, strict=True):
        assert item == tok.encode(f"Document: {doc}", add_special_tokens=False).ids + suffix
    assert t.labels == (" yes", " no")


def test_an_unknown_template_lists_the_known_ones():
    with pytest.raises(ValidationError) as raised:
        templates.get("qwen4")
    assert (raised.value.code, raised.value.param) == ("unknown_template", "template")
    assert all(name in str(raised.value) for name in templates.TEMPLATES)
    assert set(templates.TEMPLATES) == {"qwen3-reranker", "plain"}
