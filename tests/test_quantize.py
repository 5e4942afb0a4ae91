"""hbk.quantize_rows and hbk.QuantizedTable against an independent NumPy quantizer written
out here (codes unpacked bit by bit, scale and bias by float16 rounding in float64),
on both backends: the layout (low bits first, a last byte's unused bits zero), the size,
half-a-step accuracy, rows of one value, D = 1 and odd D, chunks, and the errors."""
import re

import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk

BITS = [8, 4, 2]


def codes_of(q, backend):
    """``[E, D]`` integer codes unpacked one element at a time (low bits first)."""
    packed = backend.get(q.codes)
    out = np.zeros((packed.shape[0], q.dim), np.int64)
    per_byte = 8 // q.bits
    for d in range(q.dim):
        byte = packed[:, d // per_byte].astype(np.int64)
        out[:, d] = (byte >> (q.bits * (d % per_byte))) & ((1 << q.bits) - 1)
    return out


def table(rng, rows, dim, dtype=np.float32):
    w = rng.standard_normal((rows, dim)) * rng.uniform(0.01, 50, (rows, 1))
    w[rows // 2] = 1.3  # a row of one value
    w[0, 0] = w[0].min() - 3  # an outlier
    return w.astype(dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [1, 3, 7, 8, 16, 33, 130])
def test_layout_size_and_accuracy(backend, rng, bits, dim):
    w = table(rng, 6 if backend.small else 300, dim)
    q = hbk.quantize_rows(backend.put(w), bits=bits, chunk_rows=5 if backend.small else 64)
    width = -(-dim * bits // 8)
    assert (q.num_rows, q.dim, q.bits) == (w.shape[0], dim, bits)
    assert q.codes.shape == (w.shape[0], width) and q.codes.dtype == np.uint8
    assert q.scale.dtype == q.bias.dtype == np.float16
    assert q.nbytes == w.shape[0] * (width + 4)
    scale = backend.get(q.scale).astype(np.float64)
    bias = backend.get(q.bias).astype(np.float64)
    codes = codes_of(q, backend)
    assert codes.max() <= (1 << bits) - 1
    # bias: the minimum rounded down to a float16; scale: the step rounded up
    lo, hi = w.min(axis=1).astype(np.float64), w.max(axis=1).astype(np.float64)
    assert np.all(bias <= lo) and np.all(bias > lo - np.abs(lo) / 512 - 1e-7)
    step = (hi - bias) / ((1 << bits) - 1)  # computed in float32 by the library
    assert np.all(scale >= step * (1 - 2**-22)) and np.all(scale <= step * (1 + 1 / 512) + 1e-7)
    deq = scale[:, None] * codes + bias[:, None]
    # half a step, plus the float32 rounding of x - bias (the codes are computed in float32)
    slack = 2**-22 * (np.abs(w) + np.abs(bias)[:, None]) + 1e-7
    assert np.all(np.abs(deq - w) <= scale[:, None] / 2 + slack)
    got = backend.get(q.dequantize())
    assert got.dtype == np.float32 and got.shape == w.shape
    np.testing.assert_allclose(got, deq, rtol=1e-6, atol=1e-6)
    unused = (width * 8 - dim * bits)
    if unused:  # the last byte's high bits beyond the row are zero
        assert np.all(backend.get(q.codes)[:, -1] >> (8 - unused) == 0)


def test_rows_of_one_value_and_zero_rows(backend, rng):
    w = np.array([[2.5, 2.5, 2.5], [0.0, 0.0, 0.0], [-7.0, -7.0, -7.0]], np.float32)
    q = hbk.quantize_rows(backend.put(w), bits=4)
    np.testing.assert_array_equal(backend.get(q.dequantize()), w)  # representable: exact
    empty = hbk.quantize_rows(backend.put(np.zeros((0, 5), np.float32)), bits=2)
    assert empty.codes.shape == (0, 2) and empty.nbytes == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float64, "bfloat16"])
def test_table_dtypes(backend, rng, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    w = table(rng, 20, 9, dtype)
    q = hbk.quantize_rows(backend.put(w), bits=8)
    ref = w.astype(np.float32)
    scale = backend.get(q.scale).astype(np.float32)
    assert np.all(np.abs(backend.get(q.dequantize()) - ref) <= scale[:, None] / 2 + 1e-5)


def test_a_memory_mapped_table_goes_through_in_chunks(tmp_path, rng):
    w = table(rng, 1000, 12)
    path = tmp_path / "table.npy"
    np.save(path, w)
    mapped = np.load(path, mmap_mode="r")
    q = hbk.quantize_rows(mapped, bits=4, chunk_rows=97)
    whole = hbk.quantize_rows(w, bits=4)
    np.testing.assert_array_equal(q.codes, whole.codes)
    np.testing.assert_array_equal(q.scale, whole.scale)


def test_errors(backend, rng):
    w = rng.standard_normal((6, 4)).astype(np.float32)
    for bits in (1, 3, 16, True, "8"):
        with raises(ValueError, match="bits must be one of"):
            hbk.quantize_rows(backend.put(w), bits=bits)
    bad = w.copy()
    bad[4, 2] = np.nan
    with raises(ValueError, match="row 4 of the table holds NaN or Inf"):
        hbk.quantize_rows(backend.put(bad), bits=8, chunk_rows=3)
    bad[4, 2] = 0
    bad[2, 1] = -np.inf
    with raises(ValueError, match="row 2 of the table holds NaN or Inf"):
        hbk.quantize_rows(backend.put(bad), bits=8)
    wide = w.astype(np.float64)
    wide[3] = [1e6, 0, 0, 0]
    with raises(ValueError, match="row 3 of the table spans .* beyond float16's range"):
        hbk.quantize_rows(backend.put(wide), bits=4)
    with raises(ValueError, match="2-D table"):
        hbk.quantize_rows(backend.put(w[0]), bits=8)
    with raises(ValueError, match="chunk_rows must be >= 1"):
        hbk.quantize_rows(backend.put(w), chunk_rows=0)


@pytest.mark.parametrize("bits", [8.0, 4.0, np.float64(8), np.float32(2)])
def test_bits_that_are_not_integers_are_refused(backend, rng, bits):
    """8.0 == 8, but bits is an integer: a float is a ValueError naming it, in
    quantize_rows and in the QuantizedTable constructor; NumPy integers pass."""
    w = rng.standard_normal((3, 4)).astype(np.float32)
    message = rf"bits must be one of \(8, 4, 2\) \(an integer\), got {re.escape(repr(bits))}"
    with raises(ValueError, match=message):
        hbk.quantize_rows(backend.put(w), bits=bits)
    codes, half = np.zeros((3, 2), np.uint8), np.zeros(3, np.float16)
    with pytest.raises(ValueError, match=message):
        hbk.QuantizedTable(codes, half, half, bits, 4)
    q = hbk.quantize_rows(backend.put(w), bits=np.int64(4))
    assert type(q.bits) is int and q.bits == 4


def test_a_float64_value_beyond_float32s_range_is_named_as_it_is(backend, rng):
    """A finite float64 value that float32 cannot hold (1e300) is beyond float16's range,
    not NaN or Inf: the message says so, naming the row and its range."""
    wide = rng.standard_normal((5, 4))
    wide[2, 1] = 1e300
    with raises(ValueError, match=r"row 2 of the table spans \[.*, 1e\+300\], beyond float16's "
                                  r"range"):
        hbk.quantize_rows(backend.put(wide), bits=8, chunk_rows=2)
    wide[2, 1] = -1e300
    with raises(ValueError, match=r"row 2 of the table spans \[-1e\+300, .*\], beyond"):
        hbk.quantize_rows(backend.put(wide), bits=4)
    wide[2, 1] = np.inf
    with raises(ValueError, match="row 2 of the table holds NaN or Inf"):
        hbk.quantize_rows(backend.put(wide), bits=4)


def test_a_quantized_table_is_for_inference(backend, rng):
    w = rng.standard_normal((6, 4)).astype(np.float32)
    q = hbk.quantize_rows(backend.put(w), bits=8)
    opt = hbk.optim.SGD(lr=0.1)
    with raises(TypeError, match="a QuantizedTable is for inference"):
        opt.init_state(q)
    with raises(TypeError, match="a QuantizedTable is for inference"):
        hbk.embedding_bag_backward(q, backend.put(np.array([1])), backend.put(np.array([0, 1])),
                                   num_rows=6)
    assert "QuantizedTable(num_rows=6, dim=4, bits=8, nbytes=48" in repr(q)


def test_constructor_checks_its_arrays():
    codes, half = np.zeros((3, 2), np.uint8), np.zeros(3, np.float16)
    assert hbk.QuantizedTable(codes, half, half, 4, 3).nbytes == 3 * 6
    with pytest.raises(ValueError, match=r"codes must be uint8 \[num_rows, 1\]"):
        hbk.QuantizedTable(codes, half, half, 2, 3)
    with pytest.raises(ValueError, match=r"scale must be float16 \[3\]"):
        hbk.QuantizedTable(codes, half.astype(np.float32), half, 4, 3)
    with pytest.raises(ValueError, match="bits must be one of"):
        hbk.QuantizedTable(codes, half, half, 5, 3)
