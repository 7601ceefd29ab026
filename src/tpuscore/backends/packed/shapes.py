"""The packed backends' step table and shape set (docs/serving.md, "Compiled shapes")."""

from __future__ import annotations

import functools

import numpy as np

from tpuscore.backends.buckets import row_buckets
from tpuscore.backends.contract import ShapeLimits, Step, StepShape, StepTable, step_table
from tpuscore.backends.packed.steps import SCORE_PACKED
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models.model import Model


class PackedStepShapes:
    """The step table and shape set of the packed backends."""

    model: Model
    block_sizes: BlockSizes | GpuBlockSizes | None
    interpret: bool | None  # the segment kernel in interpret mode (`PackedBackend.interpret`)

    @property
    def steps(self) -> StepTable:
        """Its one step, score_packed (rows, T, slots, C)."""
        return step_table(Step(SCORE_PACKED, self.score_packed, self._packed_zeros))

    def _packed_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, slots, width = shape
        zeros = functools.partial(np.zeros, dtype=np.int32)
        inputs = [zeros((rows, length))] * 2 + [zeros(rows), zeros((rows, length))]
        inputs += [zeros((rows, slots)), zeros((rows, width))]
        args = (self.model.params, *map(self.model.layout.put_rows, inputs))
        kwargs = {
            "config": self.model.config,
            "block_sizes": self.block_sizes,
            "layout": self.model.layout,
            "interpret": self.interpret,
            "adapters": self.model.row_adapters(zeros(rows)),
        }
        return args, kwargs

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape this backend can compile for requests within `limits`, on its
        budget as it is: score_packed (rows, T, slots(T), C) for T a packed length up to the
        longest chunk (`max_tokens`, or a query and one item past it), rows a power of two
        within T's budget, C a label bucket (docs/serving.md, "Compiled shapes")."""
        longest = max(self.max_tokens, limits.query_tokens + limits.item_tokens)
        lengths = sorted({self.bucket(n) for n in range(1, longest + 1)})
        return {
            StepShape(SCORE_PACKED, (rows, length, self.slots(length), width))
            for length in lengths
            for rows in row_buckets(1, self.rows(length), self.model.layout.data)
            for width in limits.label_widths()
        }
