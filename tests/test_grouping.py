"""hbkernels.cpu.grouping: the occurrences of a batch grouped by distinct id inside
parallel hash partitions, against a plain NumPy grouping; independent of the thread
count."""
import numba
import numpy as np
import pytest
from conftest import random_offsets

from hbkernels._modes import Combiner
from hbkernels.cpu import grouping
from hbkernels.cpu.grouping import group_occurrences


def numpy_grouping(values, offsets, weights, combiner, num_rows, skip_bad):
    """{id: [(bag, coef), ...] in input order} by loops over the bags."""
    groups = {}
    for b in range(len(offsets) - 1):
        js = [j for j in range(offsets[b], offsets[b + 1])
              if not (skip_bad and not 0 <= values[j] < num_rows)]
        w = [1.0 if weights is None else float(weights[j]) for j in js]
        scale = 1.0
        if combiner == Combiner.MEAN:
            scale = 1.0 / sum(w) if sum(w) != 0 else 0.0
        elif combiner == Combiner.SQRTN:
            sq = sum(x * x for x in w)
            scale = 1.0 / np.sqrt(sq) if sq != 0 else 0.0
        for j, wj in zip(js, w):
            groups.setdefault(int(values[j]), []).append((b, scale * wj))
    return groups


def as_groups(g):
    """{id: [(bag, coef), ...]} read from a Groups, walking each partition's occurrences
    in order; checks the layout the kernels rely on on the way."""
    parts = g.parts
    unit = parts.coef.shape[0] == 0
    assert g.first[0] == 0 and g.first.shape[0] == parts.lo.shape[0]
    groups = {}
    for p in range(parts.count):
        lo, hi = int(parts.lo[p]), int(parts.lo[p + 1])
        n = int(g.first[p + 1] - g.first[p])
        seen = 0
        for i in range(lo, hi):
            u = int(g.local[i])
            assert 0 <= u < n
            if u == seen:                 # distinct ids numbered in first-occurrence order
                seen += 1
                key = int(g.ids[lo + u])
                assert key not in groups, f"id {key} in two partitions or twice in one"
                groups[key] = []
            assert u < seen
            assert int(parts.ids[i]) == int(g.ids[lo + u]), "local names the occurrence's id"
            coef = 1.0 if unit else float(parts.coef[i])
            groups[int(g.ids[lo + u])].append((int(parts.bag[i]), coef))
        assert seen == n
    return groups


def check(values, offsets, weights=None, combiner=Combiner.SUM, num_rows=None, skip_bad=True):
    num_rows = num_rows if num_rows is not None else int(values.max(initial=0)) + 1
    g = group_occurrences(values, offsets, weights, combiner, num_rows, skip_bad, np.float32)
    expected = numpy_grouping(values, offsets, weights, combiner, num_rows, skip_bad)
    # kept ids (all in range when bad ones are dropped) in int32 where they fit
    want_ids = np.int32 if skip_bad and num_rows <= 2**31 else values.dtype
    assert g.ids.dtype == g.parts.ids.dtype == want_ids and g.parts.bag.dtype == np.int32
    assert g.parts.count >= 2 ** grouping.MIN_PARTITION_BITS
    unit = combiner == Combiner.SUM and weights is None
    assert (g.parts.coef.shape[0] == 0) == unit, "coefficients are left out exactly when all are 1"
    got = as_groups(g)
    assert sorted(got) == sorted(expected), "every kept id exactly once"
    assert g.count == len(expected) and g.parts.total == sum(len(v) for v in expected.values())
    for i, want in expected.items():
        assert [b for b, _ in got[i]] == [b for b, _ in want], f"id {i}: bags in input order"
        np.testing.assert_allclose([c for _, c in got[i]], [c for _, c in want], rtol=1e-6)
    return g


def zipf_batch(rng, n_bags, max_len, num_rows, id_dtype=np.int64):
    offsets = random_offsets(rng, n_bags, max_len)
    values = (rng.zipf(1.2, size=int(offsets[-1])) - 1) % num_rows
    values[::7] = 3                       # one id thousands of times
    values[:2] = [0, num_rows - 1]        # the table's edges
    return values.astype(id_dtype), offsets


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n_bags", [1, 40, 12000])   # the least partitions, and more
def test_matches_numpy_grouping(id_dtype, n_bags):
    rng = np.random.default_rng(n_bags)
    values, offsets = zipf_batch(rng, n_bags, 40, 5000, id_dtype)
    g = check(values, offsets)
    if n_bags == 12000:
        assert g.parts.bits > grouping.MIN_PARTITION_BITS


@pytest.mark.parametrize("combiner", [Combiner.SUM, Combiner.MEAN, Combiner.SQRTN])
def test_bag_scales_count_only_kept_ids(combiner):
    rng = np.random.default_rng(7)
    values, offsets = zipf_batch(rng, 2000, 30, 1000)
    values[::5] = -1
    values[1::11] = 1000                  # one past the table
    weights = rng.random(values.shape[0]).astype(np.float32)
    check(values, offsets, weights, combiner, num_rows=1000)
    check(values, offsets, None, combiner, num_rows=1000)


def test_the_first_bad_id_is_found_and_can_stop_the_grouping():
    """``first_bad``: the first position in input order of an id outside the table, over
    every chunk of bags; with ``stop_at_bad`` nothing is grouped then."""
    rng = np.random.default_rng(3)
    values, offsets = zipf_batch(rng, 4000, 30, 1000)
    assert grouping.bag_chunks(offsets).shape[0] > 3  # several chunks
    clean = group_occurrences(values, offsets, None, Combiner.SUM, 1000, True, np.float32,
                              stop_at_bad=True)
    assert clean.parts.first_bad == -1 and clean.count > 0
    n = values.shape[0]
    for position, bad in ((n - 2, 1000), (n // 3, -1), (2 * n // 3, 5000)):
        values[position] = bad
    kept = group_occurrences(values, offsets, None, Combiner.SUM, 1000, True, np.float32)
    assert kept.parts.first_bad == n // 3 and kept.count > 0  # dropped, grouped without them
    stopped = group_occurrences(values, offsets, None, Combiner.SUM, 1000, True, np.float32,
                                stop_at_bad=True)
    assert stopped.parts.first_bad == n // 3 and stopped.count == 0


def test_without_skipping_bad_ids_they_are_grouped_too():
    values = np.array([5, -3, 5, 10**12], np.int64)
    g = check(values, np.array([0, 2, 4]), num_rows=6, skip_bad=False)
    assert sorted(as_groups(g)) == [-3, 5, 10**12]


def test_ids_past_int32_in_a_table_that_large():
    values = np.array([2**40 + 5, 3, 2**31, 2**40 + 5, 2**31 - 1], np.int64)
    g = check(values, np.array([0, 2, 5]), num_rows=2**41)
    assert g.ids.dtype == np.int64 and sorted(as_groups(g)) == [3, 2**31 - 1, 2**31, 2**40 + 5]


@pytest.mark.parametrize("values, offsets", [
    (np.zeros(0, np.int64), np.array([0])),            # no bags
    (np.zeros(0, np.int64), np.array([0, 0, 0])),      # empty bags
    (np.full(9000, -1, np.int64), np.array([0, 4500, 9000])),   # every id bad
])
def test_empty_results(values, offsets):
    g = group_occurrences(values, offsets, None, Combiner.SUM, 10, True, np.float32)
    assert g.count == 0 and g.parts.total == 0 and not g.first.any()


def test_same_result_on_any_number_of_threads():
    rng = np.random.default_rng(3)
    values, offsets = zipf_batch(rng, 4000, 50, 20000)
    before = numba.get_num_threads()
    try:
        results = []
        for n in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(n)
            g = group_occurrences(values, offsets, None, Combiner.MEAN, 20000, True, np.float32)
            results.append([a.copy() for a in (g.parts.lo, g.parts.ids, g.parts.bag, g.parts.coef,
                                               g.ids[:g.parts.total], g.local, g.first)])
    finally:
        numba.set_num_threads(before)
    for a, b in zip(results[0], results[-1]):
        np.testing.assert_array_equal(a, b)


def test_scratch_is_reused_and_large_requests_are_fresh(monkeypatch):
    a = grouping.scratch("test", 100, np.int64)
    b = grouping.scratch("test", 50, np.int64)
    assert b.base is a.base and b.shape == (50,)
    monkeypatch.setattr(grouping, "SCRATCH_MAX_BYTES", 64)
    c = grouping.scratch("test", 100, np.int64)
    assert c.base is None and c.shape == (100,)
