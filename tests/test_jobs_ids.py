"""Every Arrow type an id column can have round-trips into a job's output (Parquet, and JSON
Lines read back with `read_output`) and its errors file (`read_errors`), and an id no JSON holds
never stops the job."""

import datetime
import decimal
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_jobs import CASE, LABELS, pairs_table
from tpuscore.jobs import load_scorer, read_errors, read_output, score_table
from tpuscore.jobs.values import from_json, to_json

ROWS = 6
BAD = (1, 4)  # rows with no item: they go to the errors file


def id_columns() -> dict[str, pa.Array]:
    """One column of each kind of type, ROWS values each, nulls included."""
    when = datetime.datetime(2020, 1, 2, 3, 4, 5, 123456)
    columns = {
        "i8": pa.array([1, None, -3, 4, 5, 6], pa.int8()),
        "u64": pa.array([2**64 - 1, 0, None, 3, 4, 5], pa.uint64()),
        "text": pa.array(["a", None, "é", "d", "e", "f"], pa.string()),
        "large_text": pa.array(["a", "b", None, "d", "e", "f"], pa.large_string()),
        "blob": pa.array([b"\x00\xff", None, b"", b"\x80", b"x", b"y"], pa.binary()),
        "large_blob": pa.array([b"x", b"\xfe", None, b"", b"q", b"r"], pa.large_binary()),
        "fixed_blob": pa.array([b"ab", b"\xff\x00", None, b"cd", b"ef", b"gh"], pa.binary(2)),
        "ts_ns_utc": pa.array(
            [1577934245123456789, None, 0, -1, 2, 3], pa.timestamp("ns", tz="UTC")
        ),
        "ts_us": pa.array([when, None, when, when, when, when], pa.timestamp("us")),
        "ts_paris": pa.array([0, 1, None, 3, 4, 5], pa.timestamp("s", tz="Europe/Paris")),
        "day": pa.array([datetime.date(2020, 1, 2), None] + [datetime.date(1, 1, 1)] * 4),
        "day64": pa.array([datetime.date(2020, 1, 2)] * 5 + [None], pa.date64()),
        "money": pa.array(
            [decimal.Decimal("12345678901234567890.123"), None] + [decimal.Decimal("-1.000")] * 4,
            pa.decimal128(25, 3),
        ),
        "big_money": pa.array([decimal.Decimal("1.5")] * 5 + [None], pa.decimal256(40, 1)),
        "clock": pa.array([3723000000, None, 0, 1, 2, 3], pa.time64("us")),
        "wait": pa.array([5, None, -7, 0, 1, 2], pa.duration("ms")),
        "real": pa.array([float("nan"), float("inf"), None, -0.0, 1.5, -float("inf")]),
        "half": pa.array([1.5, None, 2.0, 0, 1, 2], pa.float16()),
        "ints": pa.array([[1, None], None, [], [2], [3], [4]], pa.list_(pa.int64())),
        "blobs": pa.array([[b"a"], None, [], [b""], [b"\xff"], []], pa.large_list(pa.binary())),
        "pair": pa.array(
            [[1, 2], None, [3, None], [4, 5], [6, 7], [8, 9]], pa.list_(pa.int32(), 2)
        ),
        "record": pa.array(
            [{"a": 1, "b": [datetime.date(2020, 1, 1)]}, None, {"a": None, "b": None}] * 2,
            pa.struct([("a", pa.int16()), ("b", pa.list_(pa.date32()))]),
        ),
        "tags": pa.array(
            [[("k", 1)], None, [], [("x", None)], [], []], pa.map_(pa.string(), pa.int64())
        ),
        "category": pa.array(["x", "y", None, "x", "y", "x"]).dictionary_encode(),
        "nothing": pa.nulls(ROWS),
        "flag": pa.array([True, None, False, True, False, True]),
    }
    assert all(len(c) == ROWS for c in columns.values())
    return columns


def same(a: pa.Array | pa.ChunkedArray, b: pa.Array | pa.ChunkedArray) -> bool:
    """Equal values of equal types (NaN equal to NaN; a dictionary's values, not its order)."""
    a, b = (x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x for x in (a, b))
    if a.type != b.type:
        return False
    return repr(to_json(a)) == repr(to_json(b))


def test_values_round_trip_through_json():
    for name, column in id_columns().items():
        for part in (column, column.slice(2, 3)):
            encoded = json.loads(json.dumps(to_json(part), allow_nan=False))
            assert same(from_json(encoded, part.type), part), name


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_every_id_type_reaches_the_output_and_the_errors_file(fmt, checkpoint_dir, rng, tmp_path):
    ids = id_columns()
    pairs = pairs_table(rng, ROWS).to_pydict()
    for row in BAD:
        pairs["item_text"][row] = None
    table = pa.table({**ids, "user_text": pairs["user_text"], "item_text": pairs["item_text"]})
    pq.write_table(table, tmp_path / "pairs.parquet")
    output = tmp_path / f"out.{fmt}"
    summary = score_table(
        tmp_path / "pairs.parquet", output, scorer=load_scorer(checkpoint_dir(CASE)),
        query_column="user_text", item_column="item_text", id_columns=list(ids), labels=LABELS,
        shard_rows=4,
    )  # fmt: skip
    assert (summary.rows, summary.errors) == (ROWS, len(BAD))
    out = read_output(output)
    good = [r for r in range(ROWS) if r not in BAD]
    assert out.column("row").to_pylist() == good
    errors = read_errors(output)
    assert errors.column("row").to_pylist() == list(BAD)
    assert set(errors.column("code").to_pylist()) == {"invalid_items"}
    stored = pq.read_table(tmp_path / "pairs.parquet")  # Parquet stores timestamp[s] as [ms]
    for name in ids:
        column = stored.column(name).combine_chunks()
        assert same(out.column(name), column.take(good)), name
        assert same(errors.column(name), column.take(list(BAD))), name
