"""prefill_extend: the query once, then every item against its cached K/V (`backend.py`)."""

from tpuscore.backends.prefill_extend.backend import PrefillExtendBackend, PrefillExtendOptions

__all__ = ["PrefillExtendBackend", "PrefillExtendOptions"]
