import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import dense_backward, raises
from hypothesis import given, settings
from hypothesis import strategies as st

import hbkernels as hbk

torch = pytest.importorskip("torch")


def check_against_dense(ids, rows, dense, touched, grad_dtype, values_dtype):
    assert ids.dtype == np.dtype(values_dtype)
    assert rows.dtype == np.dtype(grad_dtype)
    assert rows.shape == (ids.shape[0], dense.shape[1])
    assert len(np.unique(ids)) == len(ids), "ids must be distinct"
    np.testing.assert_array_equal(np.sort(ids.astype(np.int64)), touched)
    assert_close(rows, dense[ids.astype(np.int64)], grad_dtype)


def run_backward(backend, grad_out, values, offsets, num_rows, **kw):
    if kw.get("per_sample_weights") is not None:
        kw["per_sample_weights"] = backend.put(kw["per_sample_weights"])
    g = hbk.embedding_bag_backward(backend.put(grad_out), backend.put(values), backend.put(offsets),
                                   num_rows=num_rows, **kw)
    assert isinstance(g, hbk.SparseGrad)
    return backend.get(g.ids), backend.get(g.rows)


def make_case(rng, num_rows, dim, batch, max_len, dtype=np.float32, id_dtype=np.int64,
              off_dtype=np.int64):
    """Bags with some empty, ids at both table edges and repeated within and across bags."""
    offsets = random_offsets(rng, batch, max_len).astype(off_dtype)
    n = int(offsets[-1])
    values = rng.integers(0, num_rows, size=n)
    if n:
        values[0] = num_rows - 1
        values[-1] = 0
        values[n // 2] = values[0]
        values[rng.integers(0, n, size=min(32, max(1, n // 4)))] = values[n // 3]  # a hot id
    grad_out = rng.standard_normal((batch, dim)).astype(dtype)
    return grad_out, values.astype(id_dtype), offsets


def sizes(backend):
    return (6, 4, 40) if backend.small else (300, 30, 200)  # batch, max_len, num_rows


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 3, 16, 33, 200])  # 200: 4 columns per lane, ragged
def test_matches_dense_reference(backend, rng, combiner, weighted, dim):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, dim, batch, max_len)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32) if weighted else None
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner=combiner,
                             per_sample_weights=psw)
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, combiner, psw)
    check_against_dense(ids, rows, dense, touched, np.float32, np.int64)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_grad_dtypes(backend, rng, dtype, combiner):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, 8, batch, max_len, dtype=dtype)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(dtype)
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner=combiner,
                             per_sample_weights=psw)
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, combiner, psw)
    check_against_dense(ids, rows, dense, touched, dtype, np.int64)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
def test_int_dtypes(backend, rng, id_dtype, off_dtype):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, 5, batch, max_len, np.float32,
                                          id_dtype, off_dtype)
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner="mean")
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, "mean")
    check_against_dense(ids, rows, dense, touched, np.float32, id_dtype)


def torch_grad(grad_out, values, offsets, num_rows, mode, psw=None):
    """Dense float64 table gradient by torch autograd of F.embedding_bag."""
    weight = torch.zeros((num_rows, grad_out.shape[1]), dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.embedding_bag(
        torch.from_numpy(values.astype(np.int64)), weight,
        torch.from_numpy(offsets.astype(np.int64)), mode=mode, include_last_offset=True,
        per_sample_weights=None if psw is None else torch.from_numpy(psw.astype(np.float64)),
    )
    out.backward(torch.from_numpy(grad_out.astype(np.float64)))
    return weight.grad.numpy()


@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_matches_torch_autograd(backend, rng, mode, weighted):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, 7, batch, max_len)
    psw = rng.uniform(-1.0, 2.0, size=values.shape).astype(np.float32) if weighted else None
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner=mode,
                             per_sample_weights=psw)
    expected = torch_grad(grad_out, values, offsets, num_rows, mode, psw)
    np.testing.assert_array_equal(np.sort(ids), np.unique(values))
    assert_close(rows, expected[ids], np.float32)
    untouched = np.setdiff1d(np.arange(num_rows), ids)
    np.testing.assert_array_equal(expected[untouched], 0.0)


def test_sqrtn_by_hand(backend):
    # bag 0: ids 2, 2, 5 with weights 1, 2, 2 -> scale 1/3; bag 1: id 5 weight 4 -> 1/4
    grad_out = np.array([[3.0, 6.0], [8.0, -4.0]], np.float32)
    values = np.array([2, 2, 5, 5])
    psw = np.array([1.0, 2.0, 2.0, 4.0], np.float32)
    ids, rows = run_backward(backend, grad_out, values, np.array([0, 3, 4]), 6, combiner="sqrtn",
                             per_sample_weights=psw)
    got = dict(zip(ids.tolist(), rows.tolist()))
    assert got.keys() == {2, 5}
    np.testing.assert_allclose(got[2], [3.0, 6.0], rtol=1e-6)        # (1 + 2)/3 * g0
    np.testing.assert_allclose(got[5], [2.0 + 8.0, 4.0 - 4.0], rtol=1e-6, atol=1e-6)


def test_empty_inputs(backend, rng):
    grad3 = rng.standard_normal((3, 4)).astype(np.float32)
    empty = np.zeros(0, np.int32)
    # B = 0
    ids, rows = run_backward(backend, np.zeros((0, 4), np.float32), empty, np.zeros(1, np.int64), 5)
    assert ids.shape == (0,) and ids.dtype == np.int32
    assert rows.shape == (0, 4) and rows.dtype == np.float32
    # B = 3 empty bags, no values
    ids, rows = run_backward(backend, grad3, empty, np.zeros(4, np.int64), 5, combiner="mean")
    assert ids.shape == (0,) and rows.shape == (0, 4)
    # fp16 grads, empty
    ids, rows = run_backward(backend, grad3.astype(np.float16), empty, np.zeros(4, np.int64), 5)
    assert rows.shape == (0, 4) and rows.dtype == np.float16
    # num_rows = 0 and nothing looked up
    ids, rows = run_backward(backend, grad3, empty, np.zeros(4, np.int64), 0)
    assert ids.shape == (0,)


def test_bounds_raise_names_first_bad_position(backend):
    grad_out = np.ones((2, 2), np.float32)
    values = np.array([1, 10, 3, -1, 12], np.int64)
    with raises(hbk.BoundsError, match=r"values\[1\] = 10 .*\[0, 10\)") as info:
        run_backward(backend, grad_out, values, np.array([0, 2, 5]), 10)
    assert isinstance(info.value, IndexError) and info.value.position == 1
    with raises(hbk.BoundsError, match=r"values\[2\] = -1 "):
        run_backward(backend, grad_out, np.array([1, 2, -1, 3], np.int32), np.array([0, 2, 4]), 10)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_bounds_zero_drops_bad_ids(backend, rng, combiner):
    grad_out = rng.standard_normal((4, 3)).astype(np.float32)
    values = np.array([0, 6, 5, -3, 2, 99, 5, 7], np.int64)
    offsets = np.array([0, 3, 4, 6, 8], np.int64)  # bag 1 holds only a bad id
    psw = rng.uniform(0.5, 1.5, size=values.shape).astype(np.float32)
    ids, rows = run_backward(backend, grad_out, values, offsets, 6, combiner=combiner,
                             per_sample_weights=psw, bounds="zero")
    dense, touched = dense_backward(grad_out, values, offsets, 6, combiner, psw, bounds="zero")
    np.testing.assert_array_equal(touched, [0, 2, 5])
    check_against_dense(ids, rows, dense, touched, np.float32, np.int64)


def test_calls_after_a_bad_one_see_only_their_own_input(backend, rng):
    """A bad id's error, a bad offset's, then valid calls under each mode: each call reports
    what its own input holds (on the GPU the slots it reads back are kept between calls)."""
    grad_out = rng.standard_normal((2, 3)).astype(np.float32)
    good, offsets = np.array([1, 4, 4], np.int64), np.array([0, 1, 3], np.int64)
    dense, touched = dense_backward(grad_out, good, offsets, 6, "sum")
    for bad, bad_offsets, bounds in [(np.array([1, 9, 4]), offsets, "raise"),
                                     (np.array([1, 9, 4]), offsets, "zero"),
                                     (good, np.array([0, 2, 1]), "raise")]:
        if bounds == "zero":
            run_backward(backend, grad_out, bad, bad_offsets, 6, bounds="zero")
        else:
            with raises((hbk.BoundsError, ValueError)):  # a bad id, a bad offset
                run_backward(backend, grad_out, bad, bad_offsets, 6, bounds=bounds)
        for mode in ("raise", "zero", "unchecked", "raise"):
            ids, rows = run_backward(backend, grad_out, good, offsets, 6, bounds=mode)
            check_against_dense(ids, rows, dense, touched, np.float32, np.int64)


def test_a_call_that_raises_an_earlier_error_leaves_no_trace(backend, rng):
    """A fused step's bad id (left pending on the GPU), then a backward with bad offsets
    (on the GPU its wait raises the step's error first), then a valid backward: it sees
    only its own input."""
    opt = hbk.optim.SGD(lr=0.1)
    table = backend.put(np.ones((5, 3), np.float32))
    state = opt.init_state(table)
    with raises(hbk.BoundsError):  # on the GPU, at the next wait
        opt.fused_step(table, state, backend.put(np.ones((1, 3), np.float32)),
                       backend.put(np.array([99])), backend.put(np.array([0, 1])))
        run_backward(backend, np.ones((2, 3), np.float32), np.array([1, 2, 3]),
                     np.array([0, 2, 1]), 5)
    grad_out = rng.standard_normal((2, 3)).astype(np.float32)
    good, offsets = np.array([1, 4, 4], np.int64), np.array([0, 1, 3], np.int64)
    dense, touched = dense_backward(grad_out, good, offsets, 5, "sum")
    ids, rows = run_backward(backend, grad_out, good, offsets, 5)
    check_against_dense(ids, rows, dense, touched, np.float32, np.int64)


def test_bounds_unchecked_on_valid_input(backend, rng):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, 4, batch, max_len, np.float32,
                                          np.int32, np.int32)
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner="sqrtn",
                             bounds="unchecked")
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, "sqrtn")
    check_against_dense(ids, rows, dense, touched, np.float32, np.int32)


@pytest.mark.parametrize("padded", [False, True])
def test_bounds_unchecked_positions_no_bag_covers_are_left_out(backend, padded):
    """Unchecked offsets that start past 0 and end before the last value: the values they
    miss are in no bag, so in no row (never garbage from unset memory)."""
    values = np.array([7, 0, 1, 2, 3, 0, 9, 0], np.int64)
    offsets = np.array([2, 4, 5], np.int64)
    grad_out = np.array([[1.0, 2.0], [4.0, 8.0]], np.float32)
    for _ in range(2):  # a second call, in memory the first left
        ids, rows = run_backward(backend, grad_out, values, offsets, 10, bounds="unchecked",
                                 padded=padded)
        kept = ids >= 0
        np.testing.assert_array_equal(np.sort(ids[kept]), [1, 2, 3])
        by_id = dict(zip(ids[kept].tolist(), rows[kept].tolist()))
        assert by_id == {1: [1.0, 2.0], 2: [1.0, 2.0], 3: [4.0, 8.0]}
        assert not rows[~kept].any()


@pytest.mark.parametrize("offsets, message", [
    ([1, 2, 3], r"offsets\[0\] = 1, expected 0"),
    ([0, 3, 2], r"offsets\[2\] = 2 < offsets\[1\] = 3"),
    ([0, 1, 2], r"offsets\[2\] = 2, expected len\(values\) = 3"),
    ([0, 1, 4], r"offsets\[2\] = 4, expected len\(values\) = 3"),
])
@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_malformed_offsets(backend, offsets, message, bounds):
    with raises(ValueError, match=message):
        run_backward(backend, np.ones((2, 2), np.float32), np.array([0, 1, 2]), np.array(offsets),
                     5, bounds=bounds)


def test_malformed_offsets_empty_batch(backend):
    with raises(ValueError, match=r"offsets\[0\] = 0, expected len\(values\) = 3"):
        run_backward(backend, np.ones((0, 2), np.float32), np.array([0, 1, 2]), np.array([0]), 5)


def test_bad_arguments(backend):
    v, o = backend.put(np.array([0, 1, 1])), backend.put(np.array([0, 1, 3]))
    g = np.ones((2, 3), np.float32)

    def call(grad, **kw):
        return hbk.embedding_bag_backward(backend.put(grad), v, o, **dict(dict(num_rows=4), **kw))

    with raises(ValueError, match=r"grad_out must be \[B, D\] = \[2"):
        call(np.ones((3, 3), np.float32))
    with raises(ValueError, match=r"grad_out must be \[B, D\]"):
        call(np.ones(2, np.float32))
    with raises(ValueError, match=r"grad_out must be \[B, D\]"):
        call(np.ones((2, 0), np.float32))
    with raises(ValueError, match="float16, bfloat16, float32 or float64"):
        call(g.astype(np.int32))
    with raises(ValueError, match="num_rows must be >= 0"):
        call(g, num_rows=-1)
    with raises(ValueError, match="num_rows must be an integer"):
        call(g, num_rows=4.0)
    with raises(ValueError, match="combiner must be one of"):
        call(g, combiner="max")
    with raises(ValueError, match="bounds must be one of"):
        call(g, bounds="clip")
    with raises(ValueError, match="shape of values"):
        call(g, per_sample_weights=backend.put(np.ones(2, np.float32)))
    with raises(TypeError):
        hbk.embedding_bag_backward(g, [0, 1, 1], np.array([0, 1, 3]), num_rows=4)


def sorted_by_id(ids, rows):
    order = np.argsort(ids)
    return ids[order], rows[order]


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_deterministic_and_atomic_agree(backend, rng, combiner):
    batch, max_len, num_rows = sizes(backend)
    grad_out, values, offsets = make_case(rng, num_rows, 6, batch, max_len)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32)
    kw = dict(combiner=combiner, per_sample_weights=psw)
    ids1, rows1 = sorted_by_id(*run_backward(backend, grad_out, values, offsets, num_rows, **kw))
    ids2, rows2 = sorted_by_id(*run_backward(backend, grad_out, values, offsets, num_rows, **kw))
    np.testing.assert_array_equal(ids1, ids2)
    np.testing.assert_array_equal(rows1, rows2)  # deterministic: the same bits run to run
    ids3, rows3 = sorted_by_id(*run_backward(backend, grad_out, values, offsets, num_rows,
                                             deterministic=False, **kw))
    np.testing.assert_array_equal(ids1, ids3)
    dense, _ = dense_backward(grad_out, values, offsets, num_rows, combiner, psw)
    assert_close(rows3, dense[ids3], np.float32)


def test_hot_id_sums_in_input_order(backend):
    # 1 + 1e8 - 1e8 + ... : input order gives a value the other orders do not
    n = 64 if backend.small else 4096
    values = np.zeros(n, np.int64)
    grad_out = np.ones((n, 1), np.float32)
    grad_out[1::2, 0] = 2.0 ** 24
    grad_out[2::2, 0] = -(2.0 ** 24)
    ids, rows = run_backward(backend, grad_out, values, np.arange(n + 1), 1)
    expected = np.float32(0.0)
    for x in grad_out[:, 0]:
        expected = np.float32(expected + x)
    assert ids.tolist() == [0]
    assert rows[0, 0] == expected


def test_matches_forward_vjp(rng):
    """<grad_out, embedding_bag(W)> is linear in W; its gradient is the backward."""
    num_rows, dim = 30, 4
    grad_out, values, offsets = make_case(rng, num_rows, dim, 50, 6, np.float64)
    psw = rng.uniform(0.1, 2.0, size=values.shape)
    g = hbk.embedding_bag_backward(grad_out, values, offsets, num_rows=num_rows,
                                   combiner="sqrtn", per_sample_weights=psw)
    dense = np.zeros((num_rows, dim))
    dense[g.ids] = g.rows
    w = rng.standard_normal((num_rows, dim))
    lhs = np.sum(grad_out * hbk.embedding_bag(w, values, offsets, combiner="sqrtn",
                                              per_sample_weights=psw))
    np.testing.assert_allclose(lhs, np.sum(dense * w), rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    num_rows=st.integers(1, 40), dim=st.sampled_from([1, 2, 5, 8]), batch=st.integers(0, 30),
    max_len=st.integers(0, 12), combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
    weighted=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_property_random_shapes_cpu(num_rows, dim, batch, max_len, combiner, weighted, seed):
    rng = np.random.default_rng(seed)
    grad_out = rng.standard_normal((batch, dim)).astype(np.float32)
    offsets = random_offsets(rng, batch, max_len)
    values = rng.integers(0, num_rows, size=int(offsets[-1]))
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32) if weighted else None
    g = hbk.embedding_bag_backward(grad_out, values, offsets, num_rows=num_rows,
                                   combiner=combiner, per_sample_weights=psw)
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, combiner, psw)
    check_against_dense(g.ids, g.rows, dense, touched, np.float32, np.int64)


@pytest.fixture
def small_chunks(backend, monkeypatch):
    """On the CUDA path, cut ids into chunks of 4 occurrences, so small inputs take the
    partial-row levels of the decomposition that real sizes take at CHUNK."""
    if backend.is_cuda:
        from hbkernels.cuda import _segments

        monkeypatch.setattr(_segments, "CHUNK", 4)


def skewed_case(rng, backend, dim, dtype=np.float64):
    """One id thousands of times (hundreds under the simulator) among a few others,
    ids at the table's edges, in bags of mixed lengths."""
    num_rows = 50
    n = 100 if backend.small else 5000
    values = np.where(rng.random(n) < 0.9, 17, rng.choice([0, 3, num_rows - 1], n))
    cuts = np.sort(rng.choice(np.arange(1, n), size=n // 10, replace=False))
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    grad_out = rng.standard_normal((len(offsets) - 1, dim)).astype(dtype)
    return grad_out, values, offsets, num_rows


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [1, 33])
def test_extremely_repeated_id(backend, rng, small_chunks, combiner, dim):
    if backend.small and dim == 33 and combiner != "mean":
        pytest.skip("D = 33 under the CUDA simulator: one combiner (the combiners differ in the "
                    "bag scale alone, tested at D = 1)")
    grad_out, values, offsets, num_rows = skewed_case(rng, backend, dim)
    psw = rng.uniform(0.1, 2.0, size=values.shape)
    kw = dict(combiner=combiner, per_sample_weights=psw)
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, **kw)
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, combiner, psw)
    check_against_dense(ids, rows, dense, touched, np.float64, values.dtype)
    again = run_backward(backend, grad_out, values, offsets, num_rows, **kw)
    np.testing.assert_array_equal(ids, again[0])
    np.testing.assert_array_equal(rows, again[1])  # the same bits every run


def test_extremely_repeated_id_fp32_matches_float64(backend, rng, small_chunks):
    grad_out, values, offsets, num_rows = skewed_case(rng, backend, 4, np.float32)
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, combiner="sum")
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, "sum")
    np.testing.assert_array_equal(np.sort(ids), touched)
    # The hot row is a sum of thousands of fp32 terms (in input order on the CPU). Its
    # rounding error scales with the terms' magnitudes, not with the sum, which may
    # cancel to near 0: 3e-5 of the sum of |terms| is 9x the largest error over 1500
    # seeds and 1/16 of one fp16 rounding step of it.
    magnitude, _ = dense_backward(np.abs(grad_out), values, offsets, num_rows, "sum")
    np.testing.assert_array_less(np.abs(rows - dense[ids]), 3e-5 * magnitude[ids] + 1e-6)


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
def test_padded(backend, rng, small_chunks, bounds):
    grad_out, values, offsets, num_rows = skewed_case(rng, backend, 3)
    if bounds == "zero":
        values[[1, 7]] = [num_rows, -4]
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, bounds=bounds,
                             padded=True)
    assert ids.shape == (values.shape[0],) and rows.shape == (values.shape[0], 3)
    real = ids != -1
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, "sum", bounds=bounds)
    check_against_dense(ids[real], rows[real], dense, touched, np.float64, values.dtype)
    assert np.all(rows[~real] == 0)
    pad = 1 + np.flatnonzero(ids[1:] == -1)  # ids[0] may be the -1 of the bad ids on the GPU
    assert pad.size == 0 or np.all(ids[pad[0]:] == -1), "the distinct ids come first"


@pytest.mark.parametrize("beyond", [0, 1])  # one tile of sorted positions exactly, or one more
@pytest.mark.parametrize("padded", [False, True])
def test_one_tile_and_beyond(backend, rng, small_chunks, beyond, padded):
    """On a GPU up to one tile of occurrences is summed by the launch that numbers its runs
    (``hbkernels.cuda._runs.tile_runs``); past it the runs are numbered by launches of
    their own. Both agree with the dense reference, with a hot id and out-of-range ids."""
    from hbkernels.cuda import _launch, _runs

    n = (_launch.threads_per_block() * _runs.ITEMS if backend.is_cuda else 300) + beyond
    num_rows = 40
    values = np.where(rng.random(n) < 0.5, 7, rng.integers(0, num_rows, n))
    values[[3, n - 1]] = [num_rows, -2]  # dropped under bounds="zero"
    offsets = np.concatenate([[0], np.sort(rng.integers(0, n, 60)), [n]])
    grad_out = rng.standard_normal((len(offsets) - 1, 2))
    ids, rows = run_backward(backend, grad_out, values, offsets, num_rows, bounds="zero",
                             padded=padded)
    dense, touched = dense_backward(grad_out, values, offsets, num_rows, "sum", bounds="zero")
    real = ids != -1
    if padded:
        assert ids.shape == (n,) and np.all(rows[~real] == 0)
    else:
        assert real.all()
    check_against_dense(ids[real], rows[real], dense, touched, np.float64, values.dtype)
