"""Scoring backends and their registry.

Built in: "prefill_extend" (the query once, then every item against its cached K/V),
"packed_dense" and "packed_segment" (the query and many items in one sequence, isolated by a
dense mask or by a Pallas kernel's procedural mask), "serial"
(one sequence per item, jitted and batched: the baseline) and "reference" (plain numpy, one
sequence at a time: the oracle). Register your own with `register`.
"""

from tpuscore.backends.packed import PackedDenseBackend, PackedSegmentBackend
from tpuscore.backends.prefill_extend import PrefillExtendBackend
from tpuscore.backends.reference import ReferenceBackend
from tpuscore.backends.registry import AUTO, Backend, BackendFactory, available, register
from tpuscore.backends.serial import SerialBackend

register("prefill_extend", PrefillExtendBackend)
register("packed_dense", PackedDenseBackend)
register("packed_segment", PackedSegmentBackend)
register("serial", SerialBackend)
register("reference", ReferenceBackend)

__all__ = ["AUTO", "Backend", "BackendFactory", "available", "register"]
