"""The example backend of docs/development.md ("Adding a backend"), written only against the
documented protocol, registers and scores as serial does, through score, score_batch, warmup and
the shape set."""

import pathlib
import re

import numpy as np
import pytest

from helpers import FAMILY_CASES, random_tokens
from tpuscore import Scorer, backends
from tpuscore.backends import registry

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "development.md"
NAME = "one_item_per_step"


def example_source() -> str:
    match = re.search(r"<!-- example-backend -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/development.md lost its example backend"
    return match.group(1)


@pytest.fixture(scope="module")
def example():
    namespace: dict = {}
    exec(compile(example_source(), str(DOC), "exec"), namespace)  # registers NAME
    yield namespace["OneItemPerStep"]
    registry._REGISTRY.pop(NAME, None)


def test_the_example_is_about_sixty_lines_and_uses_no_private_name():
    source = example_source()
    assert 40 <= len(source.splitlines()) <= 80
    assert not re.search(r"\._[a-z]", source)


# One family in CI: the example shows the contract, and every family meets serial and
# transformers through the built-in backends (test_parity_hf.py); the others run as slow tests.
@pytest.mark.parametrize(
    "case",
    [FAMILY_CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in FAMILY_CASES[1:])],
)
def test_the_example_backend_equals_serial(example, case, scorers, rng):
    assert registry.missing_members(example) == []
    base = scorers(case)
    scorer = Scorer(base.config, base.params, base.tokenizer)
    vocab = scorer.config.vocab_size
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    requests = [
        {
            "query": random_tokens(rng, int(rng.integers(1, 40)), vocab),
            "items": [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 20, size=5)],
            "label_token_ids": labels,
        }
        for _ in range(3)
    ]
    got = scorer.score_batch(requests, backend=NAME)
    expected = scorer.score_batch(requests, backend="serial")
    for g, e in zip(got, expected, strict=True):
        assert g.backend == NAME
        np.testing.assert_allclose(g.logprobs, e.logprobs, atol=1e-5, rtol=0)
        assert g.num_tokens == e.num_tokens
    item_first = scorer.score(**requests[0], item_first=True, backend=NAME)
    expected = scorer.score(**requests[0], item_first=True, backend="serial")
    np.testing.assert_allclose(item_first.logprobs, expected.logprobs, atol=1e-5, rtol=0)


def test_the_example_backend_lists_and_warms_its_shapes(example, scorers):
    base = scorers("qwen3_qknorm")
    scorer = Scorer(base.config, base.params, base.tokenizer)
    limits = {"query_tokens": 8, "item_tokens": 4, "labels": 1}
    shapes = scorer.shapes(limits, backends=[NAME])
    assert shapes and {s.step for s in shapes} == {"one_sequence"}
    warmed = scorer.warmup(all=True, limits=limits, backends=[NAME])
    assert [(w.backend, w.steps) for w in warmed] == [(NAME, len(shapes))]


def test_a_backend_without_run_is_refused_naming_it():
    class NoRun:
        def __init__(self, model, options): ...

        plan = price = replan = shapes = grow_safety = lambda *a: None
        steps, safety, budget, peak_budget = {}, 1.0, 1, 1

    with pytest.raises(TypeError, match=r"lacks run of the backend protocol"):
        backends.register("no_run", NoRun)
