"""Reranker templates (api/templates.py) render their text literally: the query and item text
are inserted as given (braces included), never formatted again."""

import pytest

from tpuscore.api import templates
from tpuscore.api.errors import ValidationError


def test_plain_renders_its_parts():
    t = templates.get("plain")
    assert t.render_query("cats?", "Is it about cats?") == "Is it about cats?\n\nQuery: cats?\n"
    assert t.render_query("cats?") == (
        "Judge whether the document is relevant to the query. Answer yes or no.\n\nQuery: cats?\n"
    )
    assert t.render_query("cats?", "") == "\n\nQuery: cats?\n"  # an empty instruction stays empty
    assert t.render_item("A cat sat.") == "Document: A cat sat."
    assert (t.item_suffix, t.labels) == ("\nRelevant:", (" yes", " no"))


def test_qwen3_reranker_puts_the_item_after_the_query_part_and_the_suffix_last():
    t = templates.get("qwen3-reranker")
    query = t.render_query("q", "find it")
    assert query.startswith("<|im_start|>system\nJudge whether the Document meets")
    assert query.endswith("<|im_start|>user\n<Instruct>: find it\n<Query>: q\n")
    assert t.render_item("d") == "<Document>: d"
    assert t.item_suffix == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert t.labels == ("yes", "no")


@pytest.mark.parametrize("name", sorted(templates.TEMPLATES))
def test_braces_in_the_text_are_kept_as_given(name):
    t = templates.get(name)
    text = "{instruction} {query} {item} {0} }{"
    assert text in t.render_query(text, "{x}") and "{x}" in t.render_query("q", "{x}")
    assert t.render_item(text).endswith(text)
    assert t.name == name


@pytest.mark.parametrize("name", ["qwen4", "", "Plain", None, 3])
def test_an_unknown_template_names_the_known_ones(name):
    with pytest.raises(ValidationError) as raised:
        templates.get(name)
    assert (raised.value.code, raised.value.param) == ("unknown_template", "template")
    assert str(raised.value).endswith("available: qwen3-reranker, plain")
