"""hbkernels._sorted, the host helpers on ascending keys, against NumPy's own."""
import numpy as np
import pytest

from hbkernels._sorted import distinct, find_sorted

CASES = ["empty", "one", "distinct", "repeated", "one id thousands of times", "edges"]


def keys_of(case, rng, dtype):
    info = np.iinfo(dtype)
    return {"empty": np.zeros(0, dtype),
            "one": np.array([3], dtype),
            "distinct": rng.permutation(rng.choice(info.max, 500, replace=False)).astype(dtype),
            "repeated": rng.zipf(1.3, 800).astype(dtype),
            "one id thousands of times": np.full(5000, -7, dtype),
            "edges": rng.choice(np.array([info.min, info.max, 0, -1], dtype), 40)}[case]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", CASES)
def test_distinct_is_numpys_unique(rng, case, dtype):
    keys = keys_of(case, rng, dtype)
    before = keys.copy()
    got = distinct(keys)
    np.testing.assert_array_equal(got, np.unique(keys, return_counts=True)[0])
    assert got.dtype == keys.dtype
    np.testing.assert_array_equal(keys, before)  # its input unchanged


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", CASES)
def test_find_sorted_finds_each_key(rng, case, dtype):
    table = distinct(keys_of(case, rng, dtype))
    asked = np.concatenate([table, keys_of("repeated", rng, dtype), keys_of("edges", rng, dtype)])
    at, hit = find_sorted(table, asked)
    expected = np.isin(asked, table)
    np.testing.assert_array_equal(hit, expected)
    np.testing.assert_array_equal(table[at[hit]], asked[hit])
    assert at.shape == asked.shape and (table.shape[0] == 0 or (at < table.shape[0]).all())
