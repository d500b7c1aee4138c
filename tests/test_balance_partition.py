"""Partitioning: Karmarkar-Karp, LPT, pairwise refinement, the bounded search, and their combination."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    improve_by_search,
    karmarkar_karp,
    lpt,
    order_parts,
    part_sums,
    partition,
    refine_by_swaps,
)

FLOPS = DEEPSEEK_R1_DISTILL_QWEN_1_5B.sequence_forward_flops


def brute_force_makespan(costs, k, equal_sizes=False):
    """The optimal heaviest part over every assignment of items to k parts."""
    costs = np.asarray(costs, dtype=np.float64)
    assign = np.array(list(itertools.product(range(k), repeat=costs.size)))
    if equal_sizes:
        counts = np.stack([(assign == p).sum(axis=1) for p in range(k)], axis=1)
        assign = assign[counts.max(axis=1) - counts.min(axis=1) <= 1]
    sums = np.stack([((assign == p) * costs).sum(axis=1) for p in range(k)], axis=1)
    return sums.max(axis=1).min()


def assert_is_partition(parts, n, k):
    assert len(parts) == k
    assert sorted(i for part in parts for i in part) == list(range(n))


# Costs as the planners see them: FLOPs of sequences of realistic lengths, or raw token counts.
small_instances = st.tuples(
    st.lists(st.integers(1, 65536), min_size=1, max_size=7),
    st.integers(2, 4),
    st.sampled_from(["flops", "tokens"]),
)


def instance_costs(lengths, kind):
    return FLOPS(lengths) if kind == "flops" else np.asarray(lengths, dtype=np.float64)


@given(small_instances, st.booleans())
@settings(max_examples=300, deadline=None)
def test_partition_is_within_two_percent_of_brute_force_optimum(instance, equal_sizes):
    lengths, k, kind = instance
    costs = instance_costs(lengths, kind)
    parts = partition(costs, k, equal_sizes=equal_sizes)
    assert_is_partition(parts, len(lengths), k)
    optimum = brute_force_makespan(costs, k, equal_sizes)
    assert part_sums(costs, parts).max() <= optimum * 1.02
    if equal_sizes:
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@given(st.lists(st.integers(1, 65536), min_size=1, max_size=64), st.integers(1, 8), st.sampled_from(["flops", "tokens"]))
@settings(max_examples=80, deadline=None)
def test_partition_never_worse_than_lpt_by_more_than_one_percent(lengths, k, kind):
    costs = instance_costs(lengths, kind)
    ours = part_sums(costs, partition(costs, k)).max()
    greedy = part_sums(costs, lpt(costs, k)).max()
    assert ours <= greedy * 1.01


@given(st.lists(st.integers(1, 65536), min_size=0, max_size=40), st.integers(1, 9), st.booleans())
@settings(max_examples=40, deadline=None)
def test_karmarkar_karp_partitions_and_equal_sizes_keeps_counts_within_one(lengths, k, equal_sizes):
    costs = np.asarray(lengths, dtype=np.float64)
    parts = karmarkar_karp(costs, k, equal_sizes=equal_sizes)
    assert_is_partition(parts, len(lengths), k)
    sums = part_sums(costs, parts)
    assert np.all(np.diff(sums) <= 0)  # heaviest first
    if equal_sizes:
        counts = [len(p) for p in parts]
        assert max(counts) - min(counts) <= 1


def test_karmarkar_karp_classic_two_way_example():
    # differencing 8,7,6,5,4: (8,7)->1, (6,5)->1, (4,1)->3, (3,1)->2: parts differ by 2 (optimum is 0: 8+7 = 6+5+4)
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(part_sums([8, 7, 6, 5, 4], parts))
    assert sums == [14.0, 16.0]
    refined = partition([8, 7, 6, 5, 4], 2)
    assert sorted(part_sums([8, 7, 6, 5, 4], refined)) == [15.0, 15.0]


def test_order_parts_heaviest_first_ties_by_first_index_empty_last():
    costs = [3.0, 1.0, 2.0, 2.0]
    assert order_parts(costs, [[], [3], [1, 0], [2]]) == [[0, 1], [2], [3], []]


def test_lpt_assigns_heaviest_first_to_lightest_part():
    # 5 -> A, 4 -> B, 3 -> B (7), 3 -> A (8), 3 -> B (10): the classic case where LPT (10) misses the optimum (9)
    assert lpt([5, 4, 3, 3, 3], 2) == [[1, 2, 4], [0, 3]]
    assert sorted(part_sums([5, 4, 3, 3, 3], partition([5, 4, 3, 3, 3], 2))) == [9.0, 9.0]


@given(st.lists(st.integers(1, 65536), min_size=2, max_size=30), st.integers(2, 6), st.booleans())
@settings(max_examples=40, deadline=None)
def test_refinement_never_raises_the_heaviest_part_and_keeps_counts_when_asked(lengths, k, allow_moves):
    costs = FLOPS(lengths)
    start = lpt(costs, k)
    refined = refine_by_swaps(costs, start, allow_moves=allow_moves)
    assert_is_partition(refined, len(lengths), k)
    assert part_sums(costs, refined).max() <= part_sums(costs, start).max() * (1 + 1e-12)
    if not allow_moves:
        assert sorted(map(len, refined)) == sorted(map(len, start))


def test_refinement_swaps_to_a_perfect_split():
    # {8, 6} = 14 vs {7, 5, 4} = 16: swapping 7 for 6 closes the gap of 2
    assert sorted(part_sums([8, 7, 6, 5, 4], refine_by_swaps([8, 7, 6, 5, 4], [[0, 2], [1, 3, 4]]))) == [15.0, 15.0]


@given(st.lists(st.integers(1, 1000), min_size=2, max_size=20), st.integers(2, 5))
@settings(max_examples=40, deadline=None)
def test_refinement_and_search_respect_a_size_capacity(sizes, k):
    sizes = np.asarray(sizes)
    capacity = int(np.ceil(sizes.sum() / k)) + int(sizes.max())  # first-fit always succeeds under this cap
    parts: list[list[int]] = [[] for _ in range(k)]
    room = [capacity] * k
    for i in range(sizes.size):
        p = next(p for p in range(k) if room[p] >= sizes[i])
        parts[p].append(i)
        room[p] -= sizes[i]
    costs = sizes.astype(np.float64) ** 2
    for improved in (refine_by_swaps(costs, parts, sizes=sizes, capacity=capacity),
                     improve_by_search(costs, parts, sizes=sizes, capacity=capacity)):
        assert_is_partition(improved, sizes.size, k)
        assert all(sizes[p].sum() <= capacity for p in improved if p)
        assert part_sums(costs, improved).max() <= part_sums(costs, parts).max() * (1 + 1e-12)


def test_search_finds_what_pairwise_refinement_misses():
    # a three-part rearrangement: no single move or swap between two parts lowers the heaviest part
    costs = [50474.0, 209598.0, 44896.0, 278459.0, 70727.0, 18128.0, 147893.0, 88996.0]
    start = [[2, 3], [1, 4, 5], [0, 6, 7]]
    assert refine_by_swaps(costs, start) == start
    found = improve_by_search(costs, start)
    assert part_sums(costs, found).max() == pytest.approx(brute_force_makespan(costs, 3))
    assert improve_by_search(costs, start, node_budget=0) == start


@given(st.lists(st.integers(1, 65536), min_size=1, max_size=50), st.integers(1, 8), st.booleans())
@settings(max_examples=25, deadline=None)
def test_partition_is_deterministic(lengths, k, equal_sizes):
    costs = FLOPS(lengths)
    assert partition(costs, k, equal_sizes=equal_sizes) == partition(list(costs), k, equal_sizes=equal_sizes)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="num_parts"):
        karmarkar_karp([1.0], 0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        partition([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="exactly once"):
        refine_by_swaps([1.0, 2.0], [[0], [0]])
    with pytest.raises(ValueError, match="outside range"):
        refine_by_swaps([1.0, 2.0], [[0], [5]])
    with pytest.raises(ValueError, match="together"):
        refine_by_swaps([1.0, 2.0], [[0], [1]], sizes=[1, 1])
    with pytest.raises(ValueError, match="max_group"):
        refine_by_swaps([1.0, 2.0], [[0], [1]], max_group=3)
    with pytest.raises(ValueError, match="node_budget"):
        improve_by_search([1.0, 2.0], [[0], [1]], node_budget=-1)
    with pytest.raises(ValueError, match="exactly once"):
        improve_by_search([1.0, 2.0], [[0, 1], [1]])
    with pytest.raises(ValueError, match="sizes has 1 entries"):
        improve_by_search([1.0, 2.0], [[0], [1]], sizes=[1], capacity=2)
    with pytest.raises(ValueError, match="at least one part"):
        improve_by_search([1.0], [])
