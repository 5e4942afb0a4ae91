import numpy as np
import pytest
from helpers import raises
from hypothesis import given, settings
from hypothesis import strategies as st

import hbkernels as hbk
from hbkernels import reference


def check_against_numpy(ids, uniq, inverse, counts, sorted_):
    ref_uniq, _, ref_counts = reference.unique(ids)
    assert uniq.dtype == ids.dtype
    assert inverse.shape == ids.shape and inverse.dtype == np.int64
    assert counts.dtype == np.int64
    if sorted_:
        np.testing.assert_array_equal(uniq, ref_uniq)
        np.testing.assert_array_equal(counts, ref_counts)
    else:
        order = np.argsort(uniq)
        np.testing.assert_array_equal(uniq[order], ref_uniq)
        np.testing.assert_array_equal(counts[order], ref_counts)
    np.testing.assert_array_equal(uniq[inverse], ids)


@pytest.mark.parametrize("sorted_", [False, True])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_matches_numpy(backend, rng, sorted_, dtype):
    n = 24 if backend.small else 5000
    ids = (rng.zipf(1.3, size=n) % 1000).astype(dtype)  # heavy duplicates
    ids[:3] = [0, np.iinfo(dtype).max, np.iinfo(dtype).min]  # extremes of the dtype
    uniq, inverse, counts = hbk.unique(backend.put(ids), return_inverse=True,
                                       return_counts=True, sorted=sorted_)
    check_against_numpy(ids, backend.get(uniq), backend.get(inverse), backend.get(counts), sorted_)


def test_return_shapes(backend):
    ids = np.array([[5, -2], [5, 7]], np.int64)
    u = backend.get(hbk.unique(backend.put(ids), sorted=True))
    np.testing.assert_array_equal(u, [-2, 5, 7])
    u, inv = hbk.unique(backend.put(ids), return_inverse=True, sorted=True)
    np.testing.assert_array_equal(backend.get(inv), [[1, 0], [1, 2]])
    u, cnt = hbk.unique(backend.put(ids), return_counts=True, sorted=True)
    np.testing.assert_array_equal(backend.get(cnt), [1, 2, 1])


@pytest.mark.parametrize("ids", [[], [4], [3, 3, 3, 3]])
def test_small_inputs(backend, ids):
    ids = np.array(ids, np.int64)
    uniq, inverse, counts = hbk.unique(backend.put(ids), return_inverse=True, return_counts=True)
    check_against_numpy(ids, backend.get(uniq), backend.get(inverse), backend.get(counts), False)


def test_cpu_order_is_first_occurrence():
    np.testing.assert_array_equal(hbk.unique(np.array([9, 2, 9, 5, 2])), [9, 2, 5])


def test_bad_dtype():
    with raises(ValueError, match="int32 or int64"):
        hbk.unique(np.array([1.0, 2.0]))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=300), st.booleans())
def test_property_any_int64_cpu(values, sorted_):
    ids = np.array(values, np.int64)
    uniq, inverse, counts = hbk.unique(ids, return_inverse=True, return_counts=True, sorted=sorted_)
    check_against_numpy(ids, uniq, inverse, counts, sorted_)


def test_large_growth_cpu(rng):
    ids = rng.integers(0, 10**9, size=200_000)  # forces many rehashes
    uniq, inverse, counts = hbk.unique(ids, return_inverse=True, return_counts=True)
    check_against_numpy(ids, uniq, inverse, counts, False)


def test_cpu_slots_spread_ids_of_one_grouping_partition():
    """The CPU backward hands its distinct ids over partition by partition, grouped by
    the top bits of the Fibonacci hash (hbkernels.cpu.grouping); the dedup table's
    slots must not follow those bits, or each partition's ids fill one stretch of the
    table and every insert probes along it."""
    from hbkernels import _bits
    from hbkernels.cpu import unique as cpu_unique

    ids = np.arange(300_000, dtype=np.int64)
    top = _bits.fib_hash(ids.view(np.uint64)) >> np.uint64(56)   # the widest partitioning
    one_partition = ids[top == 0]
    bits = 12
    slots = {int(cpu_unique._slot.py_func(k, 64 - bits)) for k in one_partition}
    assert len(one_partition) > 1000
    assert len(slots) > 3 * len(one_partition) // 4, f"{len(one_partition)} ids, {len(slots)} slots"


def test_cpu_backward_ids_dedup_like_shuffled_ones():
    """unique over the backward's own id order gives what NumPy gives."""
    rng = np.random.default_rng(5)
    values = (rng.zipf(1.1, 200_000) % 100_000).astype(np.int64)
    offsets = np.arange(0, values.shape[0] + 1, 8, dtype=np.int64)
    grad = hbk.embedding_bag_backward(np.ones((offsets.shape[0] - 1, 1), np.float32), values,
                                      offsets, num_rows=100_000)
    ids = np.concatenate([grad.ids, grad.ids[::-1]])
    uniq, inverse = hbk.unique(ids, return_inverse=True)
    np.testing.assert_array_equal(np.sort(uniq), np.unique(values))
    np.testing.assert_array_equal(uniq[inverse], ids)
