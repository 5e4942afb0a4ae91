"""hbk.embedding_bag and hbk.lookup on a hbk.QuantizedTable, on both backends, against the
same calls on its dequantized table (float32, up to summation order): every combiner,
per-sample weights, every bounds mode, empty bags and batches, D = 1 and odd D, int32
and int64 ids, one id thousands of times, ids at the table's edge."""
import numpy as np
import pytest
from conftest import random_offsets
from helpers import raises

import hbkernels as hbk
from hbkernels import reference

BITS = [8, 4, 2]


def quantized(backend, rng, rows, dim, bits):
    w = (rng.standard_normal((rows, dim)) * rng.uniform(0.1, 4, (rows, 1))).astype(np.float32)
    q = hbk.quantize_rows(backend.put(w), bits=bits)
    return q, backend.get(q.dequantize())


def float32_slack(q, backend, table, values, offsets, combiner, psw):
    """What float32 sums may differ by, in any order: 2^-18 of the magnitudes of a bag's
    terms (scale·code and bias apart), up to 64 terms a bag, times the combiner's factor;
    for "mean", also the error of the weights' own sum, relative to that sum."""
    bias = backend.get(q.bias).astype(np.float64)[:, None]
    terms = np.abs(table - bias) + np.abs(bias)
    weights = np.ones(values.shape[0]) if psw is None else psw.astype(np.float64)
    magnitude = reference.embedding_bag(terms, values, offsets, per_sample_weights=np.abs(weights))
    sums = np.add.reduceat(np.append(weights, 0), offsets[:-1])[:, None] * (np.diff(offsets) > 0)[:, None]
    squares = np.add.reduceat(np.append(weights**2, 0), offsets[:-1])[:, None]
    with np.errstate(divide="ignore"):
        factor = {"sum": np.ones_like(sums), "mean": 1 / np.abs(sums),
                  "sqrtn": 1 / np.sqrt(squares)}[combiner]
    factor = np.where(np.isfinite(factor), factor, 0)
    # "mean" divides by the float32 sum of the weights, whose own error grows as they cancel
    absolute = np.add.reduceat(np.append(np.abs(weights), 0), offsets[:-1])[:, None]
    result = magnitude * factor
    cancelled = result * absolute * factor if combiner == "mean" else 0
    return 2**-18 * (result + cancelled) + 1e-7


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_the_dequantized_table(backend, rng, bits, dim, combiner, weighted):
    rows = 40
    q, table = quantized(backend, rng, rows, dim, bits)
    offsets = random_offsets(rng, 5 if backend.small else 60, 4 if backend.small else 20)
    values = rng.integers(0, rows, int(offsets[-1]))
    edges = np.array([0, rows - 1])[:values.shape[0]]
    values[:edges.shape[0]] = edges  # both edges of the table
    psw = rng.uniform(-1, 2, values.shape[0]).astype(np.float32) if weighted else None
    got = backend.get(hbk.embedding_bag(q, backend.put(values), backend.put(offsets),
                                        combiner=combiner, per_sample_weights=backend.put(psw)))
    want = reference.embedding_bag(table, values, offsets, combiner=combiner,
                                   per_sample_weights=psw)
    assert got.dtype == np.float32 and got.shape == (offsets.shape[0] - 1, dim)
    assert np.all(np.abs(got - want) <= float32_slack(q, backend, table, values, offsets,
                                                      combiner, psw))


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_one_id_thousands_of_times_and_int32(backend, rng, id_dtype):
    rows, dim = 50, 7
    q, table = quantized(backend, rng, rows, dim, 4)
    n = 300 if backend.small else 5000
    values = np.where(rng.random(n) < 0.9, 17, rng.integers(0, rows, n)).astype(id_dtype)
    offsets = np.array([0, n // 3, n // 3, n], id_dtype)
    got = backend.get(hbk.embedding_bag(q, backend.put(values), backend.put(offsets),
                                        combiner="mean"))
    want = reference.embedding_bag(table, values, offsets, combiner="mean")
    # float32 sums of thousands of rows against float64: about n * 2^-24 of the magnitude
    np.testing.assert_allclose(got, want, rtol=n * 2**-23, atol=n * 2**-23)


def test_empty_batches_and_bags(backend, rng):
    q, _ = quantized(backend, rng, 10, 5, 8)
    out = backend.get(hbk.embedding_bag(q, backend.put(np.zeros(0, np.int64)),
                                        backend.put(np.zeros(1, np.int64))))
    assert out.shape == (0, 5) and out.dtype == np.float32
    out = backend.get(hbk.embedding_bag(q, backend.put(np.zeros(0, np.int64)),
                                        backend.put(np.zeros(4, np.int64)), combiner="mean"))
    np.testing.assert_array_equal(out, np.zeros((3, 5), np.float32))
    assert backend.get(hbk.lookup(q, backend.put(np.zeros((0, 3), np.int64)))).shape == (0, 3, 5)


@pytest.mark.parametrize("bits", BITS)
def test_lookup(backend, rng, bits):
    q, table = quantized(backend, rng, 30, 9, bits)
    ids = rng.integers(0, 30, (4, 6))
    ids[0, 0], ids[-1, -1] = 0, 29
    got = backend.get(hbk.lookup(q, backend.put(ids)))
    assert got.shape == (4, 6, 9) and got.dtype == np.float32
    np.testing.assert_allclose(got, table[ids], rtol=1e-6, atol=1e-6)


def test_float16_output_on_request(backend, rng):
    q, table = quantized(backend, rng, 20, 5, 4)
    values, offsets = np.array([0, 19, 3, 3]), np.array([0, 1, 4])
    full = backend.get(hbk.embedding_bag(q, backend.put(values), backend.put(offsets)))
    for dtype in ("float16", np.float16):
        half = backend.get(hbk.embedding_bag(q, backend.put(values), backend.put(offsets),
                                             output_dtype=dtype))
        assert half.dtype == np.float16 and np.array_equal(half, full.astype(np.float16))
    rows = backend.get(hbk.lookup(q, backend.put(values), output_dtype="float16"))
    assert rows.dtype == np.float16 and np.array_equal(rows, table[values].astype(np.float16))
    assert backend.get(hbk.lookup(q, backend.put(values), output_dtype="float32")).dtype == np.float32
    with pytest.raises(ValueError, match="output_dtype must be one of"):
        hbk.lookup(q, backend.put(values), output_dtype="int8")
    with pytest.raises(ValueError, match="applies to a QuantizedTable"):
        hbk.embedding_bag(backend.put(table), backend.put(values), backend.put(offsets),
                          output_dtype="float16")


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
@pytest.mark.parametrize("dim", [6, 8])  # the GPU's byte and word kernels
def test_bad_ids_in_every_bounds_mode(backend, rng, bounds, dim):
    rows = 12
    q, table = quantized(backend, rng, rows, dim, 8)
    values = np.array([3, 12, 5, -1, 7, 2, 12, 12, 4, 0, 11])  # bags of 3, 3 and 5 ids
    offsets = np.array([0, 3, 6, 11])
    call = lambda: hbk.embedding_bag(q, backend.put(values), backend.put(offsets),  # noqa: E731
                                     combiner="mean", bounds=bounds)
    if bounds == "raise":
        with raises(hbk.BoundsError, match=r"values\[1\] = 12 is out of range \[0, 12\)"):
            call()
        with raises(hbk.BoundsError, match=r"ids\[1\] = 12 is out of range"):
            hbk.lookup(q, backend.put(values), bounds=bounds)
        return
    good = [3, 5], [7, 2], [4, 0, 11]  # bad ids are absent: no row, no share of the mean
    want = np.stack([table[g].mean(axis=0) for g in good])
    if bounds == "zero" or backend.is_cuda:  # the CPU trusts unchecked ids
        np.testing.assert_allclose(backend.get(call()), want, rtol=1e-5, atol=1e-6)
    if bounds == "zero":
        looked = backend.get(hbk.lookup(q, backend.put(values), bounds="zero"))
        np.testing.assert_array_equal(looked[[1, 3]], np.zeros((2, dim), np.float32))


def test_malformed_offsets_and_mixed_families(backend, rng):
    q, _ = quantized(backend, rng, 8, 3, 4)
    with raises(ValueError, match=r"offsets\[2\] = 1 < offsets\[1\] = 3"):
        hbk.embedding_bag(q, backend.put(np.array([1, 2, 3, 4])), backend.put(np.array([0, 3, 1, 4])))
    if backend.is_cuda:
        with raises(TypeError, match="move them to one device"):
            hbk.embedding_bag(q, np.array([1]), np.array([0, 1]))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_same_as_fbgemm_int_n_tbe_on_the_same_codes(rng, bits, dim, combiner):
    """FBGEMM's int-N inference TBE (CPU build) holds the same codes, scales and biases
    (its layout is ours) and pools them as hbkernels does."""
    from hbkernels.bench.anchors import tbe_quantized_table

    torch = pytest.importorskip("torch")
    q = hbk.quantize_rows(rng.standard_normal((500, dim)).astype(np.float32), bits=bits)
    tbe = tbe_quantized_table(q, combiner=combiner)
    if tbe is None:
        pytest.skip("FBGEMM's int-N TBE (fbgemm-gpu-cpu) is not installed")
    offsets = random_offsets(rng, 40, 12)
    values = rng.integers(0, 500, int(offsets[-1]))
    with torch.no_grad():
        want = tbe(torch.from_numpy(values.astype(np.int32)),
                   torch.from_numpy(offsets.astype(np.int32))).numpy()
    got = hbk.embedding_bag(q, values, offsets, combiner=combiner)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_word_kernel_takes_only_rows_it_can_read_in_words(backend, rng):
    """No rows, a row of codes not a multiple of 4 bytes, rows off 4-byte boundaries: the
    byte kernel (and the same answers)."""
    from hbkernels.cuda.quantized_bag import word_rows

    empty = hbk.quantize_rows(backend.put(np.zeros((0, 8), np.float32)), bits=8)
    out = hbk.embedding_bag(empty, backend.put(np.array([3])), backend.put(np.array([0, 1])),
                            bounds="zero")
    np.testing.assert_array_equal(backend.get(out), np.zeros((1, 8), np.float32))
    with raises(hbk.BoundsError, match="out of range"):
        hbk.embedding_bag(empty, backend.put(np.array([3])), backend.put(np.array([0, 1])))
    q = hbk.quantize_rows(rng.standard_normal((6, 8)).astype(np.float32), bits=8)
    assert word_rows(q) is not None
    assert word_rows(hbk.quantize_rows(rng.standard_normal((6, 6)).astype(np.float32))) is None
    shifted = np.zeros(q.rows.size + 1, np.uint8)[1:].reshape(q.rows.shape)
    shifted[...] = q.rows
    assert word_rows(hbk.QuantizedTable.from_rows(shifted, 8, 8)) is None
