"""Arrow values as JSON and back, for the id columns a job writes to JSON (the errors file, a
JSON Lines output): every Arrow type an id can have survives the round trip, given its type.

    type                                  JSON
    ints, bool, strings, null             as is
    floats                                numbers; NaN and infinities as "NaN", "Infinity", ...
    binary (all kinds)                    base64 text
    timestamp, date, decimal              text, as Arrow casts them ("2020-01-02 03:04:05.5Z")
    time, duration                        integers in their unit
    list, large_list, fixed_size_list     arrays
    struct                                objects; map: arrays of {"key", "value"} objects
    dictionary                            its values

`to_json(array)` encodes a column; `from_json(values, type)` decodes it to the same array.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import pyarrow as pa

_TEXT = (pa.types.is_timestamp, pa.types.is_date, pa.types.is_decimal)
_INTEGER = (pa.types.is_time, pa.types.is_duration)
_BINARY = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary)
_LISTS = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
if hasattr(pa.types, "is_binary_view"):
    _BINARY += (pa.types.is_binary_view,)
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _is(t: pa.DataType, kinds) -> bool:
    return any(kind(t) for kind in kinds)


def to_json(array: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The values of `array` as JSON values (the table above), None for nulls."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    t = array.type
    if pa.types.is_dictionary(t):
        return to_json(array.dictionary_decode())
    if isinstance(t, pa.ExtensionType):
        return to_json(array.storage)
    if _is(t, _TEXT):
        return array.cast(pa.string()).to_pylist()
    if _is(t, _INTEGER):
        return array.cast(pa.int64()).to_pylist()
    if _is(t, _BINARY):
        return [None if v is None else base64.b64encode(v).decode() for v in array.to_pylist()]
    if pa.types.is_floating(t):
        return [_float(v) for v in array.cast(pa.float64()).to_pylist()]
    if pa.types.is_map(t):
        return [None if not s.is_valid else to_json(s.values) for s in array]
    if _is(t, _LISTS):
        return [None if not s.is_valid else to_json(s.values) for s in array]
    if pa.types.is_struct(t):
        fields = [to_json(child) for child in array.flatten()]
        names = [t.field(i).name for i in range(t.num_fields)]
        return [
            dict(zip(names, (f[r] for f in fields), strict=True)) if array[r].is_valid else None
            for r in range(len(array))
        ]
    return array.to_pylist()


def _float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def from_json(values: list[Any], t: pa.DataType) -> pa.Array:
    """The Arrow array of type `t` that `to_json` encoded as `values`."""
    if pa.types.is_dictionary(t):
        return from_json(values, t.value_type).dictionary_encode().cast(t)
    if isinstance(t, pa.ExtensionType):
        return pa.ExtensionArray.from_storage(t, from_json(values, t.storage_type))
    if _is(t, _TEXT):
        return pa.array(values, pa.string()).cast(t)
    if _is(t, _INTEGER):
        return pa.array(values, pa.int64()).cast(t)
    if _is(t, _BINARY):
        return pa.array([None if v is None else base64.b64decode(v) for v in values], t)
    if pa.types.is_floating(t):
        floats = [_NON_FINITE.get(v, v) if isinstance(v, str) else v for v in values]
        return pa.array(floats, pa.float64()).cast(t)
    mask = pa.array([v is None for v in values], pa.bool_())
    if pa.types.is_struct(t):
        children = [
            from_json([None if v is None else v[f.name] for v in values], f.type) for f in t
        ]
        return pa.StructArray.from_arrays(children, fields=list(t), mask=mask)
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        flat = [x for v in values for x in (v if v is not None else [None] * size)]
        child = from_json(flat, t.value_type)
        return pa.FixedSizeListArray.from_arrays(child, type=t, mask=mask)
    if pa.types.is_map(t) or _is(t, _LISTS):
        offsets, flat = [0], []
        for v in values:
            flat.extend(v or [])
            offsets.append(len(flat))
        if pa.types.is_map(t):
            keys = from_json([kv["key"] for kv in flat], t.key_type)
            items = from_json([kv["value"] for kv in flat], t.item_type)
            offsets_array = pa.array(offsets, pa.int32())
            return pa.MapArray.from_arrays(offsets_array, keys, items, type=t, mask=mask)
        child = from_json(flat, t.value_type)
        large = pa.types.is_large_list(t)
        offsets_array = pa.array(offsets, pa.int64() if large else pa.int32())
        kind = pa.LargeListArray if large else pa.ListArray
        return kind.from_arrays(offsets_array, child, type=t, mask=mask)
    return pa.array(values, t)
