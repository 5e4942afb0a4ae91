"""hbk.lookup_backward against torch.nn.Embedding's autograd (the dense weight.grad)
and NumPy's np.add.at, on both backends: any ids shape, D = 1 and odd D, int32 and
int64 ids, duplicates, one id thousands of times, the table's edges, empty ids,
the bounds modes and bad input."""
import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk

torch = pytest.importorskip("torch")


def dense(grad, num_rows):
    """SparseGrad -> dense [num_rows, D] (each id at most once)."""
    ids, rows = np.asarray(grad.ids), np.asarray(grad.rows)
    assert len(np.unique(ids)) == len(ids), "ids must be distinct"
    out = np.zeros((num_rows, rows.shape[1]), np.float64)
    out[ids] = rows
    return out


def torch_grad(ids, grad_out, num_rows):
    emb = torch.nn.Embedding(num_rows, grad_out.shape[-1], dtype=torch.float64)
    emb(torch.from_numpy(ids.astype(np.int64))).backward(torch.from_numpy(grad_out.astype(np.float64)))
    return emb.weight.grad.numpy()


@pytest.mark.parametrize("dim", [1, 3, 16, 33])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(40,), (6, 7), (0,), (3, 0, 2)])
def test_matches_torch_embedding_autograd(backend, rng, dim, id_dtype, shape):
    num_rows = 23
    ids = rng.integers(0, num_rows, size=shape).astype(id_dtype)
    if ids.size >= 2:
        ids.flat[0], ids.flat[-1] = 0, num_rows - 1   # both edges of the table
    grad_out = rng.standard_normal(shape + (dim,)).astype(np.float32)
    got = hbk.lookup_backward(backend.put(grad_out), backend.put(ids), num_rows=num_rows)
    got = hbk.SparseGrad(backend.get(got.ids), backend.get(got.rows))
    assert got.ids.dtype == id_dtype and got.rows.dtype == np.float32
    assert sorted(got.ids.tolist()) == sorted(set(ids.ravel().tolist()))
    np.testing.assert_allclose(dense(got, num_rows), torch_grad(ids, grad_out, num_rows),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_extremely_repeated_and_zipf_ids(backend, rng, monkeypatch, dtype):
    """One id thousands of times (under the simulator 50 times, cut into chunks of 4 so
    the partial-row levels run, as real sizes do at CHUNK) among Zipf ids."""
    if backend.is_cuda:
        from hbkernels.cuda import _segments

        monkeypatch.setattr(_segments, "CHUNK", 4)
    num_rows, dim = 50, 5
    n = 100 if backend.small else 5000
    ids = np.minimum(rng.zipf(1.2, size=n) - 1, num_rows - 1).astype(np.int64)
    ids[: n // 2] = 7                                   # one id thousands of times
    grad_out = rng.uniform(-1, 1, (n, dim)).astype(dtype)
    got = hbk.lookup_backward(backend.put(grad_out), backend.put(ids), num_rows=num_rows)
    rows = backend.get(got.rows)
    assert rows.dtype == dtype
    expected = np.zeros((num_rows, dim))
    np.add.at(expected, ids, grad_out.astype(np.float64))
    tol = 2e-2 if dtype == np.float16 else 1e-9
    np.testing.assert_allclose(dense(hbk.SparseGrad(backend.get(got.ids), rows), num_rows), expected,
                               rtol=tol, atol=tol * 10)


def test_bounds_modes(backend):
    grad_out = np.arange(8, dtype=np.float32).reshape(4, 2)
    ids = np.array([1, 9, 1, -1])
    with raises(hbk.BoundsError, match=r"ids\[1\] = 9"):
        hbk.lookup_backward(backend.put(grad_out), backend.put(ids), num_rows=5)
    got = hbk.lookup_backward(backend.put(grad_out), backend.put(ids), num_rows=5, bounds="zero")
    assert backend.get(got.ids).tolist() == [1]
    np.testing.assert_array_equal(backend.get(got.rows), [[4.0, 6.0]])


def test_a_bad_id_of_nd_ids_is_named_by_its_index(backend):
    grad_out = np.ones((2, 2, 3), np.float32)
    ids = np.array([[1, 2], [9, 0]])
    with raises(hbk.BoundsError, match=r"ids\[1, 0\] = 9 is out of range \[0, 4\)") as info:
        hbk.lookup_backward(backend.put(grad_out), backend.put(ids), num_rows=4)
    assert info.value.position == 2


def test_bad_input_is_a_clear_error():
    ids = np.array([[0, 1], [2, 3]])
    with raises(ValueError, match=r"ids.shape \+ \(D,\)"):
        hbk.lookup_backward(np.ones((4, 3), np.float32), ids, num_rows=5)
    with raises(ValueError, match="int32 or int64"):
        hbk.lookup_backward(np.ones((2, 3), np.float32), np.array([0.0, 1.0]), num_rows=5)
    with raises(ValueError, match="num_rows"):
        hbk.lookup_backward(np.ones((2, 3), np.float32), np.array([0, 1]), num_rows=-1)
    with raises(ValueError, match="bounds"):
        hbk.lookup_backward(np.ones((2, 3), np.float32), np.array([0, 1]), num_rows=5, bounds="clip")
