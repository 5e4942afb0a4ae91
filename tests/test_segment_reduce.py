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
