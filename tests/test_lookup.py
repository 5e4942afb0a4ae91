import numpy as np
import pytest
from conftest import assert_close
from helpers import raises

import hbkernels as hbk

try:
    import ml_dtypes

    FLOATS = [np.float16, np.dtype(ml_dtypes.bfloat16), np.float32, np.float64]
except ImportError:
    FLOATS = [np.float16, np.float32, np.float64]


def bits(a):
    """The bytes of ``a``'s elements (a gather copies them exactly)."""
    return np.ascontiguousarray(a).view(np.uint8)


# every vector width and row-group shape: rows of 2 to 1600 bytes, whole 32-bit words
# or not, 1 or 2 vectors per lane
@pytest.mark.parametrize("dim", [1, 2, 3, 4, 6, 8, 16, 33, 64, 128, 200])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_matches_numpy_take(backend, rng, dim, dtype, id_dtype):
    num_rows = 17
    weights = rng.standard_normal((num_rows, dim)).astype(dtype)
    ids = rng.integers(0, num_rows, size=(3, 5) if backend.small else (50, 7)).astype(id_dtype)
    ids.flat[0], ids.flat[-1] = num_rows - 1, 0
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids)))
    assert out.shape == ids.shape + (dim,) and out.dtype == weights.dtype
    np.testing.assert_array_equal(bits(out), bits(np.take(weights, ids, axis=0)))


@pytest.mark.parametrize("dim, dtype, widths", [
    (2, np.float32, (2, 2)),   # 8 bytes into a 16-byte line: 8-byte vectors
    (4, np.float32, (4, 4)),
    (3, np.float32, (1, 1)),
    (4, np.float16, (2, 2)),   # 2 words, 8 bytes in: 8-byte vectors
    (3, np.float16, (1, 1)),   # 6-byte rows are not whole words: halves, one at a time
    (1, np.float64, (2, 2)),   # 2 words, 8 bytes in
])
def test_table_views_off_a_16_byte_boundary(backend, rng, dim, dtype, widths):
    """``table[1:]``: the gather copies the widest aligned vectors of words it can
    (``widths``: the table's and the view's, in elements of :func:`as_bits`)."""
    table = rng.standard_normal((9, dim)).astype(dtype)
    device = backend.put(table)
    view = device[1:]
    if backend.is_cuda:
        from hbkernels.cuda._vector import data_pointer, vector_width
        from hbkernels.cuda.lookup import as_bits
        if data_pointer(device) % 16:
            pytest.skip("the device allocation is not 16-byte aligned")
        assert tuple(vector_width(as_bits(a)) for a in (device, view)) == widths
    ids = np.array([7, 0, 3, 3, 5, 1, 7])
    out = backend.get(hbk.lookup(view, backend.put(ids)))
    np.testing.assert_array_equal(bits(out), bits(table[1:][ids]))


@pytest.mark.parametrize("dim", [1, 16, 128])
def test_one_id_thousands_of_times(backend, dim):
    weights = np.arange(5 * dim, dtype=np.float32).reshape(5, dim)
    ids = np.full(500 if backend.small else 5000, 3, np.int64)
    ids[[0, -1]] = [4, 0]
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids)))
    np.testing.assert_array_equal(out, weights[ids])


def test_empty_ids(backend):
    weights = np.ones((3, 5), np.float32)
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(np.zeros((0,), np.int64))))
    assert out.shape == (0, 5)


def test_bounds_modes(backend):
    weights = np.arange(8, dtype=np.float32).reshape(4, 2)
    ids = np.array([[3, -1], [4, 0]], np.int64)
    with raises(hbk.BoundsError, match=r"ids\[0, 1\] = -1"):
        hbk.lookup(backend.put(weights), backend.put(ids))
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids), bounds="zero"))
    np.testing.assert_array_equal(out, [[[6, 7], [0, 0]], [[0, 0], [0, 1]]])
    good = np.array([1, 2])
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(good), bounds="unchecked"))
    np.testing.assert_array_equal(out, weights[good])


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
@pytest.mark.parametrize("dim, dtype", [(3, np.float32), (16, np.float16), (128, np.float32)])
def test_bad_ids_in_every_bounds_mode(backend, rng, bounds, dim, dtype):
    """Bad ids in several steps of 4 ids: "raise" names the first exactly, "zero" gives
    zero rows (+0.0), and so does "unchecked" on the GPU (never reading out of range)."""
    weights = rng.standard_normal((12, dim)).astype(dtype)
    ids = rng.integers(0, 12, size=23)
    ids[[0, 1]] = [11, 0]
    for position, value in {13: 12, 9: -1, 18: 2**40, 22: -7}.items():
        ids[position] = value
    args = (backend.put(weights), backend.put(ids))
    if bounds == "raise":
        with raises(hbk.BoundsError) as info:
            hbk.lookup(*args)
        assert (info.value.position, info.value.value, info.value.limit) == (9, -1, 12)
        return
    if bounds == "unchecked" and not backend.is_cuda:
        return  # the CPU kernels trust the caller
    expected = np.where(((ids >= 0) & (ids < 12))[:, None], weights[np.clip(ids, 0, 11)], 0)
    out = backend.get(hbk.lookup(*args, bounds=bounds))
    np.testing.assert_array_equal(bits(out), bits(expected.astype(dtype)))


@pytest.mark.parametrize("quantized", [False, True])
def test_a_bad_id_of_nd_ids_is_named_by_its_index(backend, quantized):
    """The message names an id of N-D ids by its index (``ids[1, 0]``), on the CPU and in
    the GPU's pending check; ``position`` stays the flat position; 1-D ids keep ``ids[k]``."""
    weights = np.ones((4, 2), np.float32)
    table = hbk.quantize_rows(backend.put(weights)) if quantized else backend.put(weights)
    for ids, where, position in [([[1, 2], [9, 0]], "1, 0", 2), ([[[0], [3]], [[2], [-1]]], "1, 1, 0", 3),
                                 ([1, 2, 9, 0], "2", 2)]:
        with raises(hbk.BoundsError, match=rf"ids\[{where}\] = {np.ravel(ids)[position]} is out of "
                                           rf"range \[0, 4\)") as info:
            hbk.lookup(table, backend.put(np.array(ids)))
        assert info.value.position == position


@pytest.mark.parametrize("dim", [1, 4, 5])
def test_rows_are_copied_bit_for_bit(backend, dim):
    """NaN payloads (quiet and signalling), -0.0 and subnormals come out as they went in."""
    patterns = np.array([0x7FC12345, 0x7F800001, 0xFFA00002, 0x80000000, 0x00000001, 0x807FFFFF,
                         0x7F7FFFFF, 0x3F800000], np.uint32)
    weights = np.resize(patterns, (6, dim)).view(np.float32)
    ids = np.array([5, 0, 3, 3, 1, 4, 2])
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids)))
    np.testing.assert_array_equal(bits(out), bits(weights[ids]))


def test_bad_ids_give_zero_rows_whatever_row_0_holds(backend):
    """A bad id loads row 0 (inf and NaN here) and stores zeros in its place."""
    weights = np.arange(15, dtype=np.float32).reshape(5, 3)
    weights[0] = [np.inf, np.nan, -np.inf]
    ids = np.array([1, 9, 4, -2, 2])
    out = backend.get(hbk.lookup(backend.put(weights), backend.put(ids), bounds="zero"))
    np.testing.assert_array_equal(out, [weights[1], [0, 0, 0], weights[4], [0, 0, 0], weights[2]])
    assert not np.signbit(out[[1, 3]]).any()


def test_table_without_rows(backend):
    args = (backend.put(np.ones((0, 4), np.float32)), backend.put(np.array([[2, 0]])))
    with raises(hbk.BoundsError) as info:
        hbk.lookup(*args)
    assert info.value.position == 0
    np.testing.assert_array_equal(backend.get(hbk.lookup(*args, bounds="zero")),
                                  np.zeros((1, 2, 4), np.float32))


def test_bad_arguments():
    with raises(ValueError, match="int32 or int64"):
        hbk.lookup(np.ones((2, 2), np.float32), np.array([0.0]))
    with raises(ValueError, match="D >= 1"):
        hbk.lookup(np.ones((2, 0), np.float32), np.array([0]))
