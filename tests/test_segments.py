"""The work decomposition of the sparse backward (:mod:`hbkernels.cuda._segments`),
built with NumPy exactly as the GPU builds it with CuPy: every sum it describes is
the sum of the right occurrences, and no row group walks more than CHUNK items."""
import numpy as np
import pytest

from hbkernels.cuda import _segments


def evaluate(keys, values, chunk):
    """Per distinct key, the sum of ``values`` the plan describes (float64), the
    distinct keys, and the longest serial walk."""
    grouping = _segments.group(np, keys)
    plan = _segments.plan(np, grouping, chunk)
    num = int(grouping.count[0])
    items = values[grouping.order]
    partials = np.zeros(plan.partial_rows)
    longest = 0
    for level, lev in enumerate(plan.levels):
        src = items if level == 0 else partials
        for c in range(lev.rows):
            partials[lev.base + c] = src[lev.lo[c]:lev.hi[c]].sum()
            longest = max(longest, lev.hi[c] - lev.lo[c])
    sums = np.empty(num)
    for r in range(num):
        src = items if plan.final_level[r] == 0 else partials
        sums[r] = src[plan.final_lo[r]:plan.final_hi[r]].sum()
        longest = max(longest, plan.final_hi[r] - plan.final_lo[r])
    return grouping.ids[:num], sums, longest


def reference(keys, values):
    uniq, inverse = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inverse, weights=values, minlength=len(uniq))


@pytest.mark.parametrize("chunk", [2, 3, 4, 16])
@pytest.mark.parametrize("case", ["random", "one id", "all distinct", "zipf", "hot among few"])
def test_plan_sums_every_occurrence_once(rng, chunk, case):
    n = int(rng.integers(1, 3000))
    keys = {"random": lambda: rng.integers(-1, 20, n),
            "one id": lambda: np.full(n, 7),
            "all distinct": lambda: rng.permutation(n) * 3 - 1,
            "zipf": lambda: rng.zipf(1.2, n) % 500,
            "hot among few": lambda: np.where(rng.random(n) < 0.9, 5, rng.integers(0, 9, n)),
            }[case]()
    values = rng.random(n)
    ids, sums, longest = evaluate(keys, values, chunk)
    ref_ids, ref_sums = reference(keys, values)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-12)
    assert longest <= chunk


@pytest.mark.parametrize("length", [1, 4, 5, 16, 17, 64, 65])
def test_plan_at_chunk_boundaries(length):
    keys = np.concatenate([np.full(length, 2), [0, 9, 9]])
    values = np.arange(keys.shape[0], dtype=np.float64)
    ids, sums, longest = evaluate(keys, values, 4)
    assert ids.tolist() == [0, 2, 9]
    assert sums[1] == values[:length].sum()
    assert longest <= 4


def test_sorted_positions_keep_input_order_within_an_id(rng):
    keys = rng.integers(0, 5, 500)
    grouping = _segments.group(np, keys)
    for k in range(5):
        positions = grouping.order[keys[grouping.order] == k]
        assert np.all(np.diff(positions) > 0)


def test_bench_ids_walk_at_most_a_chunk():
    """The issue's case: Zipf(1.05) over 1e7 rows, B*L = 2,097,152 ids; the top id occurs
    ~100,000 times, yet no row group sums more than CHUNK items (<= 1024)."""
    from bench.common import zipf_ids

    ids = zipf_ids(2_097_152, 10**7, 1.05, seed=0)
    assert np.bincount(np.unique(ids, return_inverse=True)[1]).max() > 50_000
    assert _segments.max_serial_items(np, ids) == _segments.CHUNK <= 1024


def test_one_id_two_million_times_walks_at_most_a_chunk():
    assert _segments.max_serial_items(np, np.zeros(2_097_152, np.int64)) <= _segments.CHUNK
