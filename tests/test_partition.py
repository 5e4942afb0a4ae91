import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk
from hbkernels import reference


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
@pytest.mark.parametrize("mode", ["mod", "div"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_matches_stable_argsort(backend, rng, num_shards, mode, dtype):
    num_rows = 50
    ids = rng.integers(0, num_rows, size=20 if backend.small else 3000).astype(dtype)
    ids[0], ids[-1] = num_rows - 1, 0
    p = hbk.partition(backend.put(ids), num_shards, mode=mode, num_rows=num_rows)
    assert isinstance(p, hbk.Partitioned)
    parted, counts, order = backend.get(p.ids), backend.get(p.counts), backend.get(p.order)
    ref_ids, ref_counts, ref_order = reference.partition(ids, num_shards, mode, num_rows)
    assert parted.dtype == dtype and counts.dtype == np.int64 and order.dtype == np.int64
    np.testing.assert_array_equal(parted, ids[order])
    np.testing.assert_array_equal(parted, ref_ids)
    np.testing.assert_array_equal(counts, ref_counts)
    np.testing.assert_array_equal(order, ref_order)


def test_more_shards_than_ids_and_empty(backend):
    p = hbk.partition(backend.put(np.array([5, 1], np.int64)), 8)
    np.testing.assert_array_equal(backend.get(p.counts), [0, 1, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(backend.get(p.ids), [1, 5])
    p = hbk.partition(backend.put(np.zeros(0, np.int64)), 3, mode="div", num_rows=10)
    np.testing.assert_array_equal(backend.get(p.counts), [0, 0, 0])
    assert backend.get(p.order).shape == (0,)


def test_div_uneven_blocks(backend):
    # 10 rows on 4 shards: blocks of 3 -> shards own [0,3), [3,6), [6,9), [9,10)
    ids = np.arange(10, dtype=np.int64)[::-1].copy()
    p = hbk.partition(backend.put(ids), 4, mode="div", num_rows=10)
    np.testing.assert_array_equal(backend.get(p.counts), [3, 3, 3, 1])
    np.testing.assert_array_equal(backend.get(p.ids), [2, 1, 0, 5, 4, 3, 8, 7, 6, 9])


def test_bad_ids(backend):
    with raises(hbk.BoundsError, match=r"ids\[2\] = -4"):
        hbk.partition(backend.put(np.array([1, 2, -4, -5])), 2)
    with raises(hbk.BoundsError, match=r"ids\[1\] = 10 is out of range \[0, 10\)"):
        hbk.partition(backend.put(np.array([1, 10])), 2, mode="div", num_rows=10)


def test_bad_arguments():
    with raises(ValueError, match="needs num_rows"):
        hbk.partition(np.array([1]), 2, mode="div")
    with raises(ValueError, match="num_shards must be >= 1"):
        hbk.partition(np.array([1]), 0)
    with raises(ValueError, match="mode must be one of"):
        hbk.partition(np.array([1]), 2, mode="hash")
    with raises(ValueError, match="1-D"):
        hbk.partition(np.array([[1]]), 2)
