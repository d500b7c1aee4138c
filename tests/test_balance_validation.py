"""Input checks shared by the planners and partitioners."""
import numpy as np
import pytest

from jodc.balance.validation import (
    check_partition,
    costs_array,
    lengths_within_cap,
    planner_inputs,
    positive_int,
    sequence_lengths,
)


def test_positive_int():
    assert positive_int(3, "x") == 3
    assert positive_int(np.int64(2), "x") == 2
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="x must be a positive integer"):
            positive_int(bad, "x")


def test_sequence_lengths_accepts_integers_and_integral_floats():
    out = sequence_lengths([3, 1, 2])
    assert out.dtype == np.int64 and out.tolist() == [3, 1, 2]
    assert sequence_lengths(np.array([4.0, 5.0])).tolist() == [4, 5]
    assert sequence_lengths([], allow_empty=True).shape == (0,)


@pytest.mark.parametrize(
    "lengths, message",
    [
        ([], "empty"),
        ([3, -2], r"lengths\[1\] = -2 is negative"),
        ([0], r"lengths\[0\] = 0 is zero"),
        ([1.5], "must be integers"),
        ([float("nan")], "must be integers"),
        ([True, False], "must be integers"),
        (["a"], "must be integers"),
        ([[1, 2]], "1-D"),
    ],
)
def test_sequence_lengths_rejects(lengths, message):
    with pytest.raises(ValueError, match=message):
        sequence_lengths(lengths)


def test_lengths_within_cap_names_the_first_offender():
    lengths_within_cap(np.array([5, 10]), 10)
    with pytest.raises(ValueError, match="sequence 2 has 12 tokens, more than token_cap=10.*2 sequence"):
        lengths_within_cap(np.array([5, 10, 12, 11]), 10)


def test_planner_inputs_checks_all_three():
    lengths, devices, cap = planner_inputs([5, 6], 2, 8)
    assert lengths.tolist() == [5, 6] and (devices, cap) == (2, 8)
    with pytest.raises(ValueError, match="num_devices"):
        planner_inputs([5], 0, 8)
    with pytest.raises(ValueError, match="token_cap"):
        planner_inputs([5], 1, -8)
    with pytest.raises(ValueError, match="more than token_cap"):
        planner_inputs([9], 1, 8)


def test_costs_array():
    assert costs_array([1, 2.5]).tolist() == [1.0, 2.5]
    assert costs_array([]).shape == (0,)
    with pytest.raises(ValueError, match="is empty"):
        costs_array([], allow_empty=False)
    with pytest.raises(ValueError, match=r"c\[1\]"):
        costs_array([1.0, float("inf")], "c")
    with pytest.raises(ValueError, match="1-D"):
        costs_array([[1.0]])


def test_check_partition():
    check_partition([[0, 2], [1], []], 3)
    with pytest.raises(ValueError, match="item 1 appears 0 times"):
        check_partition([[0], [2]], 3)
    with pytest.raises(ValueError, match="item 0 appears 2 times"):
        check_partition([[0], [0, 1]], 2)
    with pytest.raises(ValueError, match="outside range"):
        check_partition([[0, 3]], 2)
