"""packed_dense and packed_segment: the query and many items in one packed sequence
(`backend.py`), laid out by `packing.py`."""

from tpuscore.backends.packed.backend import (
    PackedDenseBackend,
    PackedOptions,
    PackedSegmentBackend,
    PackedSegmentOptions,
)

__all__ = ["PackedDenseBackend", "PackedOptions", "PackedSegmentBackend", "PackedSegmentOptions"]
