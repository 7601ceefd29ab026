"""Packed layouts (backends/packed/packing.py) as literal arrays: tokens, RoPE positions, segment
starts, the positions scored, and the mask they imply (written out as in gemma's tests)."""

import numpy as np

from tpuscore.backends.contract import make_batch
from tpuscore.backends.packed import packing

Q0, Q1, A0, A1, B0 = 11, 12, 21, 22, 31


def mask(prefix_len: int, seg_start: np.ndarray) -> str:
    """The segment mask rule (kernels/segment/mask.py) in numpy, one row per line: row r sees key
    c when c <= r and (c < prefix_len or c >= seg_start[r])."""
    T = len(seg_start)
    r, c = np.arange(T)[:, None], np.arange(T)[None, :]
    sees = (c <= r) & ((c < prefix_len) | (c >= seg_start[:, None]))
    return "\n".join("".join("x" if s else "." for s in row) for row in sees)


def test_the_documented_layout():
    """The module docstring's example: query [q0 q1], items [a0 a1], [] and [b0], bucket 8."""
    batch = make_batch([Q0, Q1], [[A0, A1], [], [B0]], [5], item_first=False)
    chunk = packing.pack(batch, np.arange(3), 8)
    np.testing.assert_array_equal(chunk.tokens, [Q0, Q1, A0, A1, B0, 0, 0, 0])
    np.testing.assert_array_equal(chunk.positions, [0, 1, 2, 3, 2, 0, 0, 0])
    np.testing.assert_array_equal(chunk.seg_start, [0, 0, 2, 2, 4, 5, 6, 7])
    # a is scored at its last token, the empty item at the query's last, b at its own; 4 slots,
    # the last one unfilled.
    np.testing.assert_array_equal(chunk.score_index, [3, 1, 4, packing.NO_SLOT])
    assert chunk.prefix_len == 2 and chunk.rows.tolist() == [0, 1, 2]
    assert mask(chunk.prefix_len, chunk.seg_start) == "\n".join(
        [
            "x.......",  # q0
            "xx......",  # q1
            "xxx.....",  # a0: the query and itself
            "xxxx....",  # a1
            "xx..x...",  # b0: the query, not a
            "xx...x..",  # padding: a segment of its own (something to attend to)
            "xx....x.",
            "xx.....x",
        ]
    )


def test_a_chunk_of_later_rows_starts_after_the_query():
    batch = make_batch([Q0], [[A0, A1], [B0, B0, B0], [7]], [5], item_first=False)
    chunk = packing.pack(batch, np.array([1, 2]), 6)
    np.testing.assert_array_equal(chunk.tokens, [Q0, B0, B0, B0, 7, 0])
    np.testing.assert_array_equal(chunk.positions, [0, 1, 2, 3, 1, 0])
    np.testing.assert_array_equal(chunk.seg_start, [0, 1, 1, 1, 4, 5])
    np.testing.assert_array_equal(chunk.score_index, [3, 4])
    assert mask(chunk.prefix_len, chunk.seg_start) == "\n".join(
        ["x.....", "xx....", "xxx...", "xxxx..", "x...x.", "x....x"]
    )


def test_plan_splits_items_in_order_by_tokens_and_count():
    batch = make_batch([Q0, Q1], [[1] * n for n in (3, 5, 1, 9, 2)], [5], item_first=False)
    chunks = lambda *args: [c.tolist() for c in packing.plan(batch, *args)]  # noqa: E731
    # query 2 + 3 + 5 = 10 fits; 1 more does not; the 9-token item overflows alone.
    assert chunks(10) == [[0, 1], [2], [3], [4]]
    assert chunks(100) == [[0, 1, 2, 3, 4]]
    assert chunks(100, 2) == [[0, 1], [2, 3], [4]]
    assert chunks(1) == [[0], [1], [2], [3], [4]]  # every item too long gets a chunk of its own
    empty = make_batch([Q0], [], [5], item_first=False)
    assert list(packing.plan(empty, 10)) == []


def test_stack_puts_chunks_in_rows_and_pads_the_rest():
    batch = make_batch([Q0, Q1], [[A0], [B0, B0]], [5], item_first=False)
    first = packing.pack(batch, np.array([0]), 4)
    second = packing.pack(batch, np.array([1]), 4)
    rows = packing.stack([first, second], rows=3, slots=2)
    np.testing.assert_array_equal(rows.tokens, [[Q0, Q1, A0, 0], [Q0, Q1, B0, B0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.positions, [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.seg_start, [[0, 0, 2, 3], [0, 0, 2, 2], [0, 1, 2, 3]])
    np.testing.assert_array_equal(rows.prefix_len, [2, 2, 0])
    none = packing.NO_SLOT  # an unfilled slot, and every slot of a padding row
    np.testing.assert_array_equal(rows.score_index, [[2, none], [3, none], [none, none]])
    assert mask(0, rows.seg_start[2]) == "x...\n.x..\n..x.\n...x"  # padding sees itself only
