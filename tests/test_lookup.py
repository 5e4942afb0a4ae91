import numpy as np
import pytest
from conftest import assert_close

import hbkernels as hbk


@pytest.mark.parametrize("dim", [1, 3, 8, 33])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_matches_numpy_take(backend, rng, dim, dtype, id_dtype):
    num_rows = 17
    weights = rng.standard_normal((num_rows, dim)).astype(dtype)
    ids = rng.integers(0, num_rows, size=(3, 4) if backend.small else (50, 7)).astype(id_dtype)
    ids.flat[0], ids.flat[-1] = num_rows - 1, 0
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids)))
    assert out.shape == ids.shape + (dim,)
    assert_close(out, np.take(weights, ids, axis=0).astype(np.float64), dtype)


def test_empty_ids(backend):
    weights = np.ones((3, 5), np.float32)
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(np.zeros((0,), np.int64))))
    assert out.shape == (0, 5)


def test_bounds_modes(backend):
    weights = np.arange(8, dtype=np.float32).reshape(4, 2)
    ids = np.array([[3, -1], [4, 0]], np.int64)
    with pytest.raises(hbk.BoundsError, match=r"ids\[1\] = -1"):
        hbk.lookup(backend.put(weights), backend.put(ids))
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids), bounds="zero"))
    np.testing.assert_array_equal(out, [[[6, 7], [0, 0]], [[0, 0], [0, 1]]])
    good = np.array([1, 2])
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(good), bounds="unchecked"))
    np.testing.assert_array_equal(out, weights[good])


def test_bad_arguments():
    with pytest.raises(ValueError, match="int32 or int64"):
        hbk.lookup(np.ones((2, 2), np.float32), np.array([0.0]))
    with pytest.raises(ValueError, match="D >= 1"):
        hbk.lookup(np.ones((2, 0), np.float32), np.array([0]))
