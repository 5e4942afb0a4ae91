"""hbk.per_sample_weights_backward on both backends against the float64 reference, and
the reference against torch autograd through a plain float64 forward."""
import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import raises

import hbkernels as hbk
from hbkernels import reference

COMBINERS = ["sum", "mean", "sqrtn"]


def make_case(rng, num_rows, dim, batch, max_len, dtype=np.float32, id_dtype=np.int64):
    offsets = random_offsets(rng, batch, max_len)
    n = int(offsets[-1])
    values = rng.integers(0, num_rows, size=n).astype(id_dtype)
    if n:  # both edges of the table and a duplicate
        values[0], values[-1] = num_rows - 1, 0
        values[n // 2] = values[0]
    weights = rng.standard_normal((num_rows, dim)).astype(dtype)
    psw = rng.uniform(0.2, 2.0, size=n).astype(dtype)
    grad_out = rng.standard_normal((batch, dim)).astype(dtype)
    return grad_out, weights, values, offsets, psw


def run(backend, grad_out, weights, values, offsets, psw, **kw):
    put = backend.put
    out = hbk.per_sample_weights_backward(put(grad_out), put(weights), put(values),
                                          put(offsets), put(psw), **kw)
    return backend.get(out)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("dim", [1, 3, 33])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_matches_reference(backend, rng, combiner, dtype, dim, id_dtype):
    batch, max_len = (4, 3) if backend.small else (60, 9)
    grad_out, weights, values, offsets, psw = make_case(rng, 20, dim, batch, max_len, dtype,
                                                        id_dtype)
    out = run(backend, grad_out, weights, values, offsets.astype(id_dtype), psw,
              combiner=combiner)
    assert out.dtype == np.dtype(dtype) and out.shape == values.shape
    expected = reference.per_sample_weights_backward(grad_out, weights, values, offsets, psw,
                                                     combiner)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_reference_matches_torch_autograd(rng, combiner):
    """The reference's quotient rule against autograd of a float64 forward in torch."""
    torch = pytest.importorskip("torch")
    grad_out, weights, values, offsets, psw = make_case(rng, 12, 5, 30, 6, np.float64)
    psw[: len(psw) // 4] = 0.0  # zero weights, and bags whose weights are all zero
    w = torch.tensor(psw, requires_grad=True)
    rows = torch.tensor(weights)[torch.tensor(values)] * w[:, None]
    bag = torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.tensor(np.diff(offsets)))
    summed = torch.zeros(len(offsets) - 1, 5, dtype=torch.float64).index_add(0, bag, rows)
    if combiner == "sum":
        out = summed
    else:
        z = torch.zeros(len(offsets) - 1, dtype=torch.float64).index_add(
            0, bag, w if combiner == "mean" else w * w)
        if combiner == "sqrtn":  # sqrt only where positive: its derivative at 0 is inf
            z = torch.where(z > 0, torch.sqrt(torch.where(z > 0, z, 1)), 0)
        out = torch.where(z[:, None] != 0, summed / torch.where(z != 0, z, 1)[:, None], 0)
    out.backward(torch.tensor(grad_out))
    expected = reference.per_sample_weights_backward(grad_out, weights, values, offsets, psw,
                                                     combiner)
    np.testing.assert_allclose(expected, w.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_bad_ids_get_zero_and_count_in_no_denominator(backend, rng, combiner):
    grad_out, weights, values, offsets, psw = make_case(rng, 10, 4, 5, 4)
    while len(values) < 4:  # every bag drawn empty: redraw, the bad ids need positions
        grad_out, weights, values, offsets, psw = make_case(rng, 10, 4, 5, 4)
    values[::3] = np.resize([-1, 10, 10**9, -7], len(values[::3]))
    bad = (values < 0) | (values >= 10)
    for bounds in ("zero", "unchecked"):
        out = run(backend, grad_out, weights, values, offsets, psw, combiner=combiner,
                  bounds=bounds)
        expected = reference.per_sample_weights_backward(grad_out, weights, values, offsets, psw,
                                                         combiner, bounds="zero")
        assert_close(out, expected, np.float32)
        assert np.all(out[bad] == 0)
    with raises(hbk.BoundsError, match=r"values\[0\] = -1 is out of range \[0, 10\)"):
        run(backend, grad_out, weights, values, offsets, psw, combiner=combiner)


def test_one_id_thousands_of_times_and_empty_bags(backend, rng):
    n = 40 if backend.small else 5000
    offsets = np.array([0, 0, n, n, n + 1])
    values = np.full(n + 1, 7, np.int64)
    weights = rng.standard_normal((8, 6)).astype(np.float32)
    psw = rng.uniform(0.5, 1.5, size=n + 1).astype(np.float32)
    grad_out = rng.standard_normal((4, 6)).astype(np.float32)
    for combiner in COMBINERS:
        out = run(backend, grad_out, weights, values, offsets, psw, combiner=combiner)
        expected = reference.per_sample_weights_backward(grad_out, weights, values, offsets, psw,
                                                         combiner)
        np.testing.assert_allclose(out, expected, rtol=2e-4, atol=1e-5)


def test_empty_inputs(backend):
    weights = np.ones((3, 2), np.float32)
    no_ids = np.zeros(0, np.int64)
    out = run(backend, np.zeros((2, 2), np.float32), weights, no_ids, np.zeros(3, np.int64),
              np.zeros(0, np.float32), combiner="mean")
    assert out.shape == (0,) and out.dtype == np.float32
    out = run(backend, np.zeros((0, 2), np.float32), weights, no_ids, np.zeros(1, np.int64),
              np.zeros(0, np.float32))
    assert out.shape == (0,)


def test_bad_input_is_a_clear_error():
    g, w = np.ones((1, 2), np.float32), np.ones((3, 2), np.float32)
    values, offsets, psw = np.array([0, 1]), np.array([0, 2]), np.ones(2, np.float32)
    with raises(ValueError, match="grad_out has D = 3 columns but the table has 2"):
        hbk.per_sample_weights_backward(np.ones((1, 3), np.float32), w, values, offsets, psw)
    with raises(ValueError, match=r"grad_out must be \[B, D\]"):
        hbk.per_sample_weights_backward(np.ones((2, 2), np.float32), w, values, offsets, psw)
    with raises(ValueError, match="per_sample_weights must have the shape of values"):
        hbk.per_sample_weights_backward(g, w, values, offsets, np.ones(3, np.float32))
    with raises(TypeError, match="per_sample_weights must be a NumPy or CUDA array"):
        hbk.per_sample_weights_backward(g, w, values, offsets, None)
    with raises(ValueError, match="offsets"):
        hbk.per_sample_weights_backward(g, w, values, np.array([0, 3]), psw)
    with raises(ValueError, match="combiner must be one of"):
        hbk.per_sample_weights_backward(g, w, values, offsets, psw, combiner="max")


@pytest.mark.parametrize("combiner", COMBINERS)
def test_bfloat16(backend, rng, combiner):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    grad_out, weights, values, offsets, psw = make_case(rng, 20, 5, 4 if backend.small else 40, 4)
    grad_out, weights, psw = grad_out.astype(bf16), weights.astype(bf16), psw.astype(bf16)
    out = run(backend, grad_out, weights, values, offsets, psw, combiner=combiner)
    assert out.dtype == bf16
    expected = reference.per_sample_weights_backward(
        grad_out.astype(np.float64), weights.astype(np.float64), values, offsets,
        psw.astype(np.float64), combiner)
    assert_close(out, expected, bf16)
