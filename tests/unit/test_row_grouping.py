"""Grouping a job's pair rows into requests (jobs/grouping.py)."""

import hypothesis
import hypothesis.strategies as st
import numpy as np

from tpuscore.jobs.grouping import freeze, group_rows


def test_rows_of_one_query_meet_in_first_appearance_order():
    assert group_rows(["q1", "q1", "q2", "q1", "q3"]) == [[0, 1, 3], [2], [4]]
    assert group_rows([]) == []
    assert group_rows([("q", 1), ("q", 2), ("q", 1)]) == [[0, 2], [1]]


def test_cells_freeze_to_equal_keys_when_equal():
    assert freeze([1, [2, 3]]) == (1, (2, 3)) == freeze((1, (2, 3)))
    assert freeze({"b": [1], "a": 2}) == (("a", 2), ("b", (1,))) == freeze({"a": 2, "b": [1]})
    assert freeze({1, 2}) == repr({1, 2})  # unhashable: its repr
    assert freeze(np.array([1, 2])) == freeze(np.array([1, 2])) != freeze(np.array([1, 3]))
    assert freeze(None) is None and freeze("q") == "q"
    keys = [freeze(v) for v in ([1, 2], {"x": [1]}, [1, 2], {"x": [1]}, [2, 1])]
    assert group_rows(keys) == [[0, 2], [1, 3], [4]]


@hypothesis.given(st.lists(st.sampled_from("abcd"), max_size=40))
def test_groups_partition_the_rows_in_order(keys):
    groups = group_rows(keys)
    assert sorted(i for g in groups for i in g) == list(range(len(keys)))
    assert all(g == sorted(g) and len({keys[i] for i in g}) == 1 for g in groups)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # first appearance order
    assert len(groups) == len(set(keys))
