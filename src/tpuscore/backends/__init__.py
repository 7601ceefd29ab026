"""Scoring backends and their registry.

Built in: "prefill_extend" (the query once, then every item against its cached K/V),
"packed_dense" and "packed_segment" (the query and many items in one sequence, isolated by a
dense mask or by a kernel's procedural mask), "serial" (one sequence per item, jitted and
batched: the baseline) and "reference" (plain numpy, one sequence at a time: the oracle).
Register your own with `register`.
"""

from tpuscore.backends.base import PerGroupBackend
from tpuscore.backends.contract import Backend, BackendOutput, Plan, ScoreBatch, StepStats
from tpuscore.backends.packed import (
    PackedDenseBackend,
    PackedOptions,
    PackedSegmentBackend,
    PackedSegmentOptions,
)
from tpuscore.backends.prefill_extend import PrefillExtendBackend, PrefillExtendOptions
from tpuscore.backends.reference import ReferenceBackend
from tpuscore.backends.registry import (
    AUTO,
    BackendFactory,
    Capabilities,
    available,
    register,
)
from tpuscore.backends.serial import SerialBackend, SerialOptions

# The query must come first to be a shared prefix, so only serial and reference put items first.
# packed_* cannot be batch-invariant: an item's neighbours in a packed row change its sums.
# Registration order is auto's order of candidates (and so breaks its ties).
# The fixed rule: prefill_extend when the query comes first, serial for items first; serial is
# also auto's fallback. prefill_extend runs loglikelihood (a context prefilled once).
register(
    "prefill_extend",
    PrefillExtendBackend,
    options=PrefillExtendOptions,
    item_first=False,
    auto=True,
    batch_invariant=True,
    fixed_rule={False},
    loglikelihood=True,
    adapters=True,
)
register(
    "packed_segment",
    PackedSegmentBackend,
    options=PackedSegmentOptions,
    item_first=False,
    auto=True,
    adapters=True,
)
register(
    "packed_dense",
    PackedDenseBackend,
    options=PackedOptions,
    item_first=False,
    auto=True,
    adapters=True,
)
register(
    "serial",
    SerialBackend,
    options=SerialOptions,
    auto=True,
    batch_invariant=True,
    fixed_rule={True},
    fallback=True,
    adapters=True,
)
# The oracle, never auto's pick; one sequence at a time, so invariant as it is.
register("reference", ReferenceBackend, batch_invariant=True)
# tpuscore's own backends, whatever a user (or a test) registers beside them later.
BUILT_IN = tuple(available())

__all__ = [
    "AUTO",
    "BUILT_IN",
    "Backend",
    "BackendFactory",
    "BackendOutput",
    "Capabilities",
    "PerGroupBackend",
    "Plan",
    "ScoreBatch",
    "StepStats",
    "available",
    "register",
]
