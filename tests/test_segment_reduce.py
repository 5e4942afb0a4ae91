import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import raises

import hbkernels as hbk
from hbkernels import reference


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("shape", [(), (1,), (5,), (2, 3), (4,), (2, 8), (33,)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_matches_reference(backend, rng, combiner, shape, dtype):
    offsets = random_offsets(rng, 4 if backend.small else 100, 3 if backend.small else 10)
    data = rng.standard_normal((int(offsets[-1]),) + shape).astype(dtype)
    out = backend.get(hbk.segment_reduce(backend.put(data), backend.put(offsets.astype(np.int32)),
                                         combiner=combiner))
    assert out.shape == (len(offsets) - 1,) + shape
    assert_close(out, reference.segment_reduce(data, offsets, combiner), dtype)


@pytest.mark.parametrize("width", [1, 8, 64])
def test_segments_longer_than_a_row_batch(backend, rng, width):
    """Rows go 4 at a time by batches of max(G, 4): segments of 37 and 45 rows."""
    offsets = np.array([0, 37, 37, 82, 83, 89])
    data = rng.standard_normal((89, width)).astype(np.float32)
    for combiner in ["mean"] if backend.small else ["sum", "mean", "sqrtn"]:
        out = backend.get(hbk.segment_reduce(backend.put(data), backend.put(offsets),
                                             combiner=combiner))
        assert_close(out, reference.segment_reduce(data, offsets, combiner), np.float32)


def test_empty(backend):
    out = backend.get(hbk.segment_reduce(backend.put(np.zeros((0, 2), np.float32)),
                                         backend.put(np.zeros(3, np.int64))))
    np.testing.assert_array_equal(out, np.zeros((2, 2), np.float32))


def test_malformed_offsets(backend):
    with raises(ValueError, match=r"expected data.shape\[0\] = 3"):
        hbk.segment_reduce(backend.put(np.ones(3, np.float32)), backend.put(np.array([0, 2])))


@pytest.mark.parametrize("offsets, message", [
    ([0, 2, 5], r"malformed offsets: offsets\[2\] = 5, expected data.shape\[0\] = 6"),
    ([0], r"malformed offsets: offsets\[0\] = 0, expected data.shape\[0\] = 6"),
])
def test_malformed_offsets_name_the_rows_of_data(backend, offsets, message):
    """segment_reduce has no ``values``: the last offset must be data.shape[0], and the
    message says so (embedding_bag's says len(values))."""
    data = backend.put(np.ones((6, 2), np.float32))
    with raises(ValueError, match=message):
        hbk.segment_reduce(data, backend.put(np.array(offsets)))


@pytest.mark.parametrize("shape", [(), (1,), (5,), (2, 3)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_sums_in_their_dtype(backend, rng, shape, dtype):
    """int32 and int64 sum as np.add.reduceat does (wrapping on overflow), empty
    segments give 0, and their malformed offsets are refused as the floats' are."""
    offsets = random_offsets(rng, 5 if backend.small else 100, 4 if backend.small else 10)
    info = np.iinfo(dtype)
    data = rng.integers(info.min // 2, info.max // 2, size=(int(offsets[-1]),) + shape,
                        dtype=dtype)  # most sums of 3 or more wrap
    expected = np.zeros((len(offsets) - 1,) + shape, dtype)
    with np.errstate(over="ignore"):
        for b in range(len(offsets) - 1):
            for j in range(offsets[b], offsets[b + 1]):
                expected[b] += data[j]
    out = backend.get(hbk.segment_reduce(backend.put(data), backend.put(offsets)))
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, expected)
    past = np.concatenate([offsets[:-1], [offsets[-1] + 1]])
    with raises(ValueError, match=r"expected data.shape\[0\] = "):
        backend.get(hbk.segment_reduce(backend.put(data), backend.put(past)))


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_integer_means_and_roots_are_refused(combiner):
    with raises(ValueError, match=f"combiner='{combiner}' of int64 data: a mean or a root is "
                                  "no integer"):
        hbk.segment_reduce(np.arange(6).reshape(3, 2), np.array([0, 2, 3]), combiner=combiner)
    with raises(ValueError, match="data must be float16, bfloat16, float32 or float64, int32 or "
                                  "int64, got uint8"):
        hbk.segment_reduce(np.ones(3, np.uint8), np.array([0, 3]))
