"""Packing one device's sequences into microbatches under a token cap."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import DEEPSEEK_R1_DISTILL_QWEN_1_5B, min_microbatches, pack_microbatches, part_sums, try_pack

FLOPS = DEEPSEEK_R1_DISTILL_QWEN_1_5B.sequence_forward_flops


@st.composite
def device_share(draw):
    cap = draw(st.integers(16, 4096))
    lengths = draw(st.lists(st.integers(1, cap), min_size=0, max_size=24))
    return np.asarray(lengths, dtype=np.int64), cap


@given(device_share(), st.integers(0, 6))
@settings(max_examples=60, deadline=None)
def test_every_sequence_once_caps_respected_heaviest_first(share, at_least):
    lengths, cap = share
    costs = FLOPS(lengths)
    packed = pack_microbatches(lengths, costs, cap, at_least=at_least)
    assert sorted(i for mb in packed for i in mb) == list(range(lengths.size))
    assert all(lengths[mb].sum() <= cap for mb in packed)
    assert len(packed) >= max(at_least, math.ceil(lengths.sum() / cap))
    assert len(packed) <= max(at_least, lengths.size)
    sums = part_sums(costs, packed)
    assert np.all(np.diff(sums) <= 0)


def test_count_grows_until_everything_fits():
    # 3 x 600 tokens under a cap of 1000: 1800 tokens would fit in 2 by count, but no two share a microbatch
    packed = pack_microbatches([600, 600, 600], [1.0, 1.0, 1.0], 1000)
    assert sorted(map(sorted, packed)) == [[0], [1], [2]]
    assert try_pack([600, 600, 600], [1.0, 1.0, 1.0], 1000, 2) is None


def test_packs_into_the_minimum_when_possible_and_balances_cost():
    lengths = np.array([500, 500, 400, 400, 100, 100])  # 2000 tokens, cap 1000 -> 2 microbatches
    packed = pack_microbatches(lengths, lengths.astype(float), 1000)
    assert len(packed) == 2
    assert sorted(lengths[mb].sum() for mb in packed) == [1000, 1000]


def test_cost_balance_is_kept_within_the_cap():
    # by cost alone the two long sequences would be split apart and short ones piled up beyond the cap
    lengths = np.array([900, 900, 100, 100, 100, 100, 100, 100, 100, 100])
    costs = lengths.astype(float) ** 2
    packed = pack_microbatches(lengths, costs, 1000)
    assert all(lengths[mb].sum() <= 1000 for mb in packed)
    assert len(packed) == 3


def test_empty_share_and_extra_empty_microbatches():
    assert pack_microbatches([], [], 100) == []
    assert pack_microbatches([], [], 100, at_least=2) == [[], []]
    packed = pack_microbatches([10], [1.0], 100, at_least=3)
    assert packed == [[0], [], []]
    assert min_microbatches([60, 60, 1], 100) == 2


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="more than token_cap"):
        pack_microbatches([101], [1.0], 100)
    with pytest.raises(ValueError, match="differ in size"):
        try_pack([1, 2], [1.0], 100, 1)
    with pytest.raises(ValueError, match="at_least"):
        pack_microbatches([1], [1.0], 100, at_least=-1)
    with pytest.raises(ValueError, match="num_microbatches"):
        try_pack([1], [1.0], 100, 0)
