"""Scoring backends and their registry.

Built in: "prefill_extend" (the query once, then every item against its cached K/V), "serial"
(one sequence per item, jitted and batched: the baseline) and "reference" (plain numpy, one
sequence at a time: the oracle). Register your own with `register`.
"""

from tpuscore.backends.prefill_extend import PrefillExtendBackend
from tpuscore.backends.reference import ReferenceBackend
from tpuscore.backends.registry import AUTO, Backend, BackendFactory, available, register
from tpuscore.backends.serial import SerialBackend

register("prefill_extend", PrefillExtendBackend)
register("serial", SerialBackend)
register("reference", ReferenceBackend)

__all__ = ["AUTO", "Backend", "BackendFactory", "available", "register"]
