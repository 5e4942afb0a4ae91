import numpy as np
import pytest
from conftest import assert_close
from helpers import raises
from hypothesis import given, settings
from hypothesis import strategies as st

import hbkernels as hbk
from hbkernels import reference


@pytest.mark.parametrize("shape", [(), (1,), (3,), (17,), (2, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_matches_reference(backend, rng, shape, dtype, id_dtype):
    n, num_segments = (6, 4) if backend.small else (500, 37)
    data = rng.standard_normal((n,) + shape).astype(dtype)
    seg = rng.integers(0, num_segments, size=n).astype(id_dtype)
    seg[0], seg[-1] = num_segments - 1, 0
    out = backend.get(hbk.segment_sum(backend.put(data), backend.put(seg), num_segments))
    assert out.shape == (num_segments,) + shape
    assert_close(out, reference.segment_sum(data, seg, num_segments), dtype)


@pytest.mark.parametrize("shape", [(), (1,), (3,), (17,)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_data_sums_in_its_dtype(backend, rng, shape, dtype):
    """int32 and int64 sum as np.add.at does (wrapping on overflow), one segment taking
    many rows; bounds as for floats."""
    n, num_segments = (8, 4) if backend.small else (500, 37)
    info = np.iinfo(dtype)
    data = rng.integers(info.min // 2, info.max // 2, size=(n,) + shape, dtype=dtype)
    seg = rng.integers(0, num_segments, size=n)
    seg[: n // 2] = num_segments - 1  # a segment of half the rows: its sum wraps
    expected = np.zeros((num_segments,) + shape, dtype)
    np.add.at(expected, seg, data)
    out = backend.get(hbk.segment_sum(backend.put(data), backend.put(seg), num_segments))
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, expected)
    seg[1] = num_segments
    with raises(hbk.BoundsError, match=r"segment_ids\[1\]"):
        backend.get(hbk.segment_sum(backend.put(data), backend.put(seg), num_segments))
    out = backend.get(hbk.segment_sum(backend.put(data), backend.put(seg), num_segments,
                                      bounds="zero"))
    expected[num_segments - 1] -= data[1]
    np.testing.assert_array_equal(out, expected)


def test_empty_and_zero_segments(backend):
    out = backend.get(hbk.segment_sum(backend.put(np.zeros((0, 3), np.float32)),
                                      backend.put(np.zeros(0, np.int64)), 2))
    np.testing.assert_array_equal(out, np.zeros((2, 3), np.float32))
    out = backend.get(hbk.segment_sum(backend.put(np.zeros((0,), np.float32)),
                                      backend.put(np.zeros(0, np.int64)), 0))
    assert out.shape == (0,)


def test_bounds_modes(backend):
    data = np.array([[1.0], [2.0], [4.0], [8.0]], np.float32)
    seg = np.array([0, 3, -1, 1], np.int64)
    with raises(hbk.BoundsError, match=r"segment_ids\[1\] = 3 .*\[0, 3\)"):
        hbk.segment_sum(backend.put(data), backend.put(seg), 3)
    out = backend.get(hbk.segment_sum(backend.put(data), backend.put(seg), 3, bounds="zero"))
    np.testing.assert_array_equal(out, [[1.0], [8.0], [0.0]])


def test_bad_arguments():
    with raises(ValueError, match="one entry per row"):
        hbk.segment_sum(np.ones(3, np.float32), np.array([0, 1]), 2)
    with raises(ValueError, match="num_segments must be >= 0"):
        hbk.segment_sum(np.ones(2, np.float32), np.array([0, 1]), -1)
    with raises(ValueError, match="num_segments must be an integer"):
        hbk.segment_sum(np.ones(2, np.float32), np.array([0, 1]), 2.5)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), width=st.sampled_from([1, 2, 3, 8, 9]),  # a kernel per width
       num_segments=st.integers(1, 30),
       seed=st.integers(0, 2**32 - 1))
def test_property_random_shapes_cpu(n, width, num_segments, seed):
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((n, width)).astype(np.float32)
    seg = rng.integers(0, num_segments, size=n)
    assert_close(hbk.segment_sum(data, seg, num_segments),
                 reference.segment_sum(data, seg, num_segments), np.float32)
