"""Step tables: warming a shape runs its step on its zeros; one step-shape type (compiles
nothing)."""

import pytest
from contract_fakes import FakeBackend

from tpuscore.backends.contract import ShapeLimits, StepShape, StepStats, warm
from tpuscore.backends.packed.backend import PackedBackend
from tpuscore.backends.packed.steps import SCORE_PACKED
from tpuscore.backends.prefill_extend.backend import PrefillExtendBackend
from tpuscore.backends.serial import SCORE_SEQUENCES, SerialBackend


def test_warm_runs_the_named_step_on_its_zeros():
    backend = FakeBackend()
    warm(backend.steps, StepShape("fake_step", (4, 16)))
    assert backend.warmed == [(4, 16)]


def test_warm_refuses_a_step_the_table_lacks():
    with pytest.raises(ValueError, match="no step 'missing'.*fake_step"):
        warm(FakeBackend().steps, StepShape("missing", (1,)))


def test_the_shapes_a_backend_lists_are_steps_of_its_table():
    backend = FakeBackend()
    shapes = backend.shapes(ShapeLimits(query_tokens=8, item_tokens=8, labels=1))
    assert {s.step for s in shapes} <= set(backend.steps)


@pytest.mark.parametrize(
    ("cls", "steps"),
    [
        (SerialBackend, {SCORE_SEQUENCES}),
        (PackedBackend, {SCORE_PACKED}),
        (
            PrefillExtendBackend,
            {
                "prefill",
                "prefill_rows",
                "stack",
                "unstack",
                "resize",
                "score_items",
                "score_mixed_items",
                "continuation_logprobs",
                "prompt_logprobs",
            },
        ),
    ],
)
def test_the_built_in_step_tables(cls, steps):
    backend = object.__new__(cls)  # the table reads no state until a step's zeros are built
    backend.model = None
    assert set(cls.steps.fget(backend)) == steps


def test_step_stats_record_the_one_step_shape_type():
    stats = StepStats(shapes=[StepShape("s", (1, 2))])
    assert stats.shapes[0] == StepShape("s", (1, 2), "")
    assert (
        sorted([StepShape("b", (1,), "x"), StepShape("a", (2,), "y")], key=StepShape.sort_key)[
            0
        ].backend
        == "x"
    )
