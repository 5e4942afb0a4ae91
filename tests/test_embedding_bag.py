import itertools

import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import raises
from hypothesis import given, settings
from hypothesis import strategies as st

import hbkernels as hbk
from hbkernels import reference
from hbkernels.cpu._common import STACK_ROW_MAX_BYTES

try:
    import ml_dtypes

    FLOATS = [np.float16, np.dtype(ml_dtypes.bfloat16), np.float32, np.float64]
except ImportError:
    FLOATS = [np.float16, np.float32, np.float64]
# every vector width and row-group shape of the CUDA kernels: V = 16 bytes / itemsize
# down to 1 (odd D), G = 1..32 lanes per bag, 1 or 2 vectors per lane, ragged rows
VECTOR_DIMS = [1, 2, 3, 4, 6, 8, 16, 33, 64, 128, 200]


def make_case(rng, backend, num_rows, dim, batch, max_len, dtype, id_dtype, off_dtype):
    weights = rng.standard_normal((num_rows, dim)).astype(dtype)
    offsets = random_offsets(rng, batch, max_len).astype(off_dtype)
    values = rng.integers(0, num_rows, size=int(offsets[-1])).astype(id_dtype)
    if values.size:  # ids at both edges of the table, and duplicates
        values[0] = num_rows - 1
        values[-1] = 0
        values[len(values) // 2] = values[0]
    return weights, values, offsets


COMBINERS = ["sum", "mean", "sqrtn"]
# fp32 with every combiner, the other dtypes with one each (the simulator is slow)
CASES = [(dtype, dim, combiner)
         for i, (dtype, dim) in enumerate(itertools.product(FLOATS, VECTOR_DIMS + [70]))
         for combiner in (COMBINERS if dtype == np.float32 else [COMBINERS[i % 3]])]


@pytest.mark.parametrize("dtype, dim, combiner", CASES)
def test_matches_reference(backend, rng, combiner, dim, dtype):
    batch, max_len = (5, 4) if backend.small else (300, 40)
    weights, values, offsets = make_case(rng, backend, 50, dim, batch, max_len, dtype, np.int64, np.int64)
    out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                            combiner=combiner)
    out = backend.get(out)
    assert out.shape == (batch, dim)
    assert_close(out, reference.embedding_bag(weights, values, offsets, combiner), dtype)


@pytest.mark.parametrize("dtype, dim", [
    (np.float32, STACK_ROW_MAX_BYTES // 4), (np.float32, STACK_ROW_MAX_BYTES // 4 + 1),
    (np.float16, STACK_ROW_MAX_BYTES // 4), (np.float16, STACK_ROW_MAX_BYTES // 4 + 1),
    (np.float64, STACK_ROW_MAX_BYTES // 8 + 1)])
def test_rows_on_both_sides_of_the_stack_row_limit_cpu(rng, dtype, dim):
    """The CPU kernel sums a bag in a stack row up to STACK_ROW_MAX_BYTES of
    accumulator, in the output row itself beyond. fp16 accumulates in fp32:
    rounded from the stack row into the fp16 output, or beyond the limit
    into a float32 output that is rounded afterwards."""
    values = ()
    while len(values) < 2:  # a bad id goes at position 1 (random bags may all be empty)
        weights, values, offsets = make_case(rng, None, 40, dim, 6, 9, dtype, np.int64, np.int32)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32)
    values[1] = 40  # skipped under bounds="zero"
    out = hbk.embedding_bag(weights, values, offsets, combiner="mean", per_sample_weights=psw,
                            bounds="zero")
    assert_close(out, reference.embedding_bag(weights, values, offsets, "mean", psw, bounds="zero"),
                 dtype)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [5, 64])
def test_int_dtypes_and_weights(backend, rng, id_dtype, off_dtype, combiner, dim):
    batch, max_len = (4, 6) if backend.small else (200, 20)
    weights, values, offsets = make_case(rng, backend, 30, dim, batch, max_len, np.float32, id_dtype, off_dtype)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32)
    out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                            combiner=combiner, per_sample_weights=backend.put(psw))
    assert_close(backend.get(out), reference.embedding_bag(weights, values, offsets, combiner, psw),
                 np.float32)


def lengths_to_offsets(lengths, dtype=np.int64):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


@pytest.mark.parametrize("dim, dtype", [(1, np.float32), (2, np.float32), (8, np.float32),
                                        (16, np.float32), (64, np.float32), (128, np.float16),
                                        (200, np.float32), (6, np.float64)])
def test_bags_longer_than_an_id_batch(backend, rng, dim, dtype):
    """A row group reads a bag's ids by batches of max(G, 4) and its rows 4 at a time:
    bags longer than a batch, not a multiple of 4, empty, of one id."""
    offsets = lengths_to_offsets([37, 0, 45, 1, 6])
    weights = rng.standard_normal((40, dim)).astype(dtype)
    values = rng.integers(0, 40, size=int(offsets[-1]))
    values[[0, 36, -1]] = [39, 0, 39]
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32)
    for combiner in ["sqrtn"] if backend.small else COMBINERS:
        out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                                combiner=combiner, per_sample_weights=backend.put(psw))
        assert_close(backend.get(out),
                     reference.embedding_bag(weights, values, offsets, combiner, psw), dtype)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("psw_dtype", FLOATS)
@pytest.mark.parametrize("dim, dtype", [(3, np.float32), (8, np.float32), (128, np.float32),
                                        (16, np.float16), (4, np.float64)])
def test_weights_of_every_float_dtype(backend, rng, combiner, psw_dtype, dim, dtype):
    batch, max_len = (4, 9) if backend.small else (60, 20)
    weights, values, offsets = make_case(rng, backend, 25, dim, batch, max_len, dtype,
                                         np.int64, np.int64)
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(psw_dtype)
    out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                            combiner=combiner, per_sample_weights=backend.put(psw))
    assert_close(backend.get(out), reference.embedding_bag(weights, values, offsets, combiner, psw),
                 dtype)


@pytest.mark.parametrize("dim, dtype, widths", [
    (2, np.float32, (2, 2)),    # the view starts 8 bytes into a 16-byte line: 8-byte vectors
    (6, np.float32, (2, 2)),    # 24 bytes: 8-byte vectors
    (4, np.float32, (4, 4)),    # 16 bytes: still 16-byte vectors
    (3, np.float32, (1, 1)),    # odd D: scalars
    (4, np.float16, (4, 4)),    # 8 bytes: 4 halves
    (2, np.float16, (2, 2)),    # 4 bytes: 2 halves
    (5, np.float16, (1, 1)),
    (1, np.float64, (1, 1)),
    (2, np.float64, (2, 2)),
    (3, np.float64, (1, 1)),
])
def test_table_views_off_a_16_byte_boundary(backend, rng, dim, dtype, widths):
    """``table[1:]`` starts D * itemsize bytes into the table: the CUDA kernels choose the
    widest vector whose loads stay aligned (``widths``: the table's, the view's)."""
    table = rng.standard_normal((21, dim)).astype(dtype)
    device = backend.put(table)
    view = device[1:]
    if backend.is_cuda:
        from hbkernels.cuda._vector import data_pointer, vector_width
        if data_pointer(device) % 16:
            pytest.skip("the device allocation is not 16-byte aligned")
        assert (vector_width(device), vector_width(view)) == widths
    offsets = lengths_to_offsets([3, 0, 9, 1])
    values = rng.integers(0, 20, size=int(offsets[-1]))
    values[[0, -1]] = [19, 0]
    for combiner in ["sum", "mean"]:
        out = hbk.embedding_bag(view, backend.put(values), backend.put(offsets), combiner=combiner)
        assert_close(backend.get(out), reference.embedding_bag(table[1:], values, offsets, combiner),
                     dtype)


@pytest.mark.parametrize("bounds", ["raise", "zero", "unchecked"])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dim", [1, 16, 128])
def test_bad_ids_in_every_bounds_mode(backend, rng, bounds, id_dtype, dim):
    """Bad ids in several bags and batches (the first at position 38, lane 6 of the second
    id batch of bag 0 when G = 32): "raise" names the first exactly, "zero" skips them all
    (and does not count them), "unchecked" on the GPU skips them too (never reads out of
    range), with no host read."""
    num_rows = 30
    offsets = lengths_to_offsets([40, 1, 49, 0, 6])
    weights = rng.standard_normal((num_rows, dim)).astype(np.float32)
    values = rng.integers(0, num_rows, size=int(offsets[-1])).astype(id_dtype)
    bad = {45: num_rows, 38: -1, 70: np.iinfo(id_dtype).max, 93: -(2**31), 95: num_rows + 1}
    for position, value in bad.items():
        values[position] = value
    values[[0, 1]] = [num_rows - 1, 0]  # the table's edges
    args = (backend.put(weights), backend.put(values), backend.put(offsets))
    if bounds == "raise":
        with raises(hbk.BoundsError) as info:
            hbk.embedding_bag(*args)
        assert (info.value.position, info.value.value, info.value.limit) == (38, -1, num_rows)
        return
    if bounds == "unchecked" and not backend.is_cuda:
        return  # the CPU kernels trust the caller
    expected = reference.embedding_bag(weights, values, offsets, "mean", bounds="zero")
    out = backend.get(hbk.embedding_bag(*args, combiner="mean", bounds=bounds))
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("dim", [1, 16, 128])
def test_one_id_thousands_of_times(backend, dim):
    """Integer rows, so the sums are exact in any order (100 ids under the simulator: a
    bag still spans several batches of a lane group, the last one partial)."""
    n = 100 if backend.small else 5000
    weights = np.arange(9 * dim, dtype=np.float32).reshape(9, dim) % 13 - 6
    values = np.full(n, 7, np.int64)
    values[[0, n - 1]] = [8, 0]
    offsets = np.array([0, n - 100, n - 100, n - 1, n], np.int64)
    for combiner in ["sum", "mean"]:
        out = backend.get(hbk.embedding_bag(backend.put(weights), backend.put(values),
                                            backend.put(offsets), combiner=combiner))
        expected = reference.embedding_bag(weights, values, offsets, combiner)
        if combiner == "sum":
            np.testing.assert_array_equal(out, expected)
        assert_close(out, expected, np.float32)


@pytest.mark.parametrize("dim, dtype", [(1, np.float32), (16, np.float32), (128, np.float16),
                                        (3, np.float64)])
def test_positions_past_a_bag_and_bad_ids_add_nothing(backend, rng, dim, dtype):
    """Padding positions of a 4-row step and bad ids load row 0, which holds inf and NaN
    here: their contributions are selected away, never multiplied by 0 (0 * inf is NaN)."""
    weights = rng.standard_normal((10, dim)).astype(dtype)
    weights[0, ::2], weights[0, 1::2] = np.inf, np.nan
    offsets = lengths_to_offsets([1, 2, 3, 5, 0, 6])
    values = rng.integers(1, 10, size=int(offsets[-1]))
    values[[4, 12]] = [10, -1]  # bad: skipped under bounds="zero"
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32)
    out = backend.get(hbk.embedding_bag(backend.put(weights), backend.put(values),
                                        backend.put(offsets), combiner="mean",
                                        per_sample_weights=backend.put(psw), bounds="zero"))
    assert np.isfinite(out.astype(np.float64)).all()
    assert_close(out, reference.embedding_bag(weights, values, offsets, "mean", psw, bounds="zero"),
                 dtype)



# -- one id per bag (the CPU's one_id_kernel) --------------------------------------------
ONE_ID_BAGS = 300  # at least hbkernels.cpu.embedding_bag.ONE_ID_MIN_BAGS


def one_id_case(rng, num_rows, dim, dtype, id_dtype):
    weights = rng.standard_normal((num_rows, dim)).astype(dtype)
    values = ((rng.zipf(1.3, ONE_ID_BAGS) - 1) % num_rows).astype(id_dtype)
    values[[0, 7, -1]] = [num_rows - 1, 0, num_rows - 1]  # the table's edges
    return weights, values, np.arange(ONE_ID_BAGS + 1, dtype=np.int64)


@pytest.mark.parametrize("dim, dtype, id_dtype", [
    (1, np.float32, np.int64), (5, np.float32, np.int32), (64, np.float64, np.int64),
    (16, np.float16, np.int64)] + ([(16, FLOATS[1], np.int32)] if len(FLOATS) == 4 else []))
def test_one_id_bags_are_the_rows_cpu(rng, monkeypatch, dim, dtype, id_dtype):
    """A batch of one id per bag gives each bag its row exactly under every combiner,
    the same bits as the general pooling kernel (made to take the batch)."""
    from hbkernels.cpu import embedding_bag as cpu_bag

    weights, values, offsets = one_id_case(rng, 40, dim, dtype, id_dtype)
    got = {c: hbk.embedding_bag(weights, values, offsets, combiner=c) for c in COMBINERS}
    monkeypatch.setattr(cpu_bag, "ONE_ID_MIN_BAGS", 10**9)
    for combiner, out in got.items():
        assert out.dtype == weights.dtype
        np.testing.assert_array_equal(out.view(np.uint8), weights[values].view(np.uint8))
        general = hbk.embedding_bag(weights, values, offsets, combiner=combiner)
        np.testing.assert_array_equal(out.view(np.uint8), general.view(np.uint8))


def test_one_id_bags_of_a_table_view_cpu(rng):
    """Rows of a column slice (row stride 20 elements) and of every other row."""
    weights, values, offsets = one_id_case(rng, 80, 20, np.float32, np.int64)
    for view in (weights[:, 3:19], weights[::2]):
        ids = values % view.shape[0]
        np.testing.assert_array_equal(hbk.embedding_bag(view, ids, offsets), view[ids])


@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_one_id_bags_with_bad_ids_cpu(rng, bounds):
    """Bad ids in several chunks: "raise" names the first, "zero" gives zero rows."""
    weights, values, offsets = one_id_case(rng, 30, 16, np.float32, np.int64)
    bad = {291: 30, 150: -1, 40: 2**40, 41: -(2**62)}
    for position, value in bad.items():
        values[position] = value
    if bounds == "raise":
        with raises(hbk.BoundsError) as info:
            hbk.embedding_bag(weights, values, offsets)
        assert (info.value.position, info.value.value, info.value.limit) == (40, 2**40, 30)
        return
    out = hbk.embedding_bag(weights, values, offsets, combiner="mean", bounds=bounds)
    expected = reference.embedding_bag(weights, values, offsets, "mean", bounds="zero")
    np.testing.assert_array_equal(out, expected.astype(np.float32))
    assert not out[sorted(bad)].any()


@pytest.mark.parametrize("where", [0, 150, ONE_ID_BAGS - 2])
def test_as_many_ids_as_bags_but_not_one_each_cpu(rng, where):
    """An empty bag and a bag of two ids among one-id bags (the batch still has as many
    ids as bags): pooled as bags, and decreasing offsets there are still named."""
    weights, values, offsets = one_id_case(rng, 50, 8, np.float32, np.int64)
    offsets[where + 1] = offsets[where]  # bag `where` empty, bag `where + 1` of two ids
    for combiner in COMBINERS:
        out = hbk.embedding_bag(weights, values, offsets, combiner=combiner)
        assert_close(out, reference.embedding_bag(weights, values, offsets, combiner), np.float32)
    offsets[where + 1] = offsets[where + 2] + 1
    with raises(ValueError, match="offsets"):
        hbk.embedding_bag(weights, values, offsets)


def test_table_without_rows(backend):
    weights = np.ones((0, 4), np.float32)
    values, offsets = np.array([0, 1, 0]), np.array([0, 2, 2, 3])
    args = (backend.put(weights), backend.put(values), backend.put(offsets))
    with raises(hbk.BoundsError) as info:
        hbk.embedding_bag(*args)
    assert info.value.position == 0
    np.testing.assert_array_equal(backend.get(hbk.embedding_bag(*args, bounds="zero")),
                                  np.zeros((3, 4), np.float32))


def test_empty_batch_and_all_empty_bags(backend):
    weights = np.ones((4, 3), np.float32)
    empty = np.zeros(0, np.int64)
    out = backend.get(hbk.embedding_bag(backend.put(weights), backend.put(empty),
                                        backend.put(np.zeros(1, np.int64))))
    assert out.shape == (0, 3)
    out = backend.get(hbk.embedding_bag(backend.put(weights), backend.put(empty),
                                        backend.put(np.zeros(4, np.int64)), combiner="mean"))
    np.testing.assert_array_equal(out, np.zeros((3, 3), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_sums_start_at_positive_zero(backend, combiner, dtype):
    """Bags sum from +0.0, as torch's embedding_bag and NumPy 2's sum do: a bag of
    -0.0 rows gives +0.0, as do empty bags and bags of only bad ids."""
    weights = np.array([[-0.0, 1.0], [0.0, -0.0], [-0.0, -0.0]], dtype)
    values = np.array([0, 2, 0, 1, 5, 2], np.int64)
    offsets = np.array([0, 1, 3, 3, 4, 5, 6], np.int64)
    out = backend.get(hbk.embedding_bag(backend.put(weights), backend.put(values),
                                        backend.put(offsets), combiner=combiner, bounds="zero"))
    expected = reference.embedding_bag(weights, values, offsets, combiner, bounds="zero")
    assert_close(out, expected, dtype)
    assert not np.signbit(out[out == 0]).any()


def test_zero_weight_sum_gives_zeros(backend):
    weights = np.arange(6, dtype=np.float32).reshape(3, 2)
    psw = np.array([1.0, -1.0, 2.0], np.float32)
    out = backend.get(hbk.embedding_bag(
        backend.put(weights), backend.put(np.array([0, 1, 2])), backend.put(np.array([0, 2, 3])),
        combiner="mean", per_sample_weights=backend.put(psw)))
    np.testing.assert_array_equal(out, [[0.0, 0.0], [4.0, 5.0]])


def test_bounds_raise_names_first_bad_position(backend):
    weights = np.ones((10, 2), np.float32)
    values = np.array([1, 10, 3, -1, 12], np.int64)
    offsets = np.array([0, 2, 5], np.int64)
    with raises(hbk.BoundsError, match=r"values\[1\] = 10 .*\[0, 10\)") as info:
        hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets))
    assert isinstance(info.value, IndexError) and info.value.position == 1



@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_first_bad_position_among_many_bags(backend, rng, bounds):
    """Several bad ids in each run of bags a thread takes, and decreasing offsets in one
    run and in another: the first of each is named (ids under raise; offsets under both)."""
    n_bags = 40 if backend.small else 3000
    offsets = random_offsets(rng, n_bags, 6)
    values = rng.integers(0, 10, size=int(offsets[-1]))
    first = int(offsets[n_bags // 3]) + 1
    values[first::5] = 10        # from `first` on, every 5th id is one past the table
    args = (backend.put(np.ones((10, 3), np.float32)), backend.put(values))
    if bounds == "raise":
        with raises(hbk.BoundsError) as info:
            hbk.embedding_bag(*args, backend.put(offsets))
        assert info.value.position == first
    bad = offsets.copy()
    for k in (n_bags // 2 + 10, n_bags // 2 + 13, 3 * n_bags // 4):
        bad[k] = bad[k - 1] - 1 if bad[k - 1] > 0 else bad[k + 1] + 1
    first_bad_offset = min(k for k in range(1, n_bags + 1) if bad[k] < bad[k - 1])
    with raises(ValueError, match=rf"offsets\[{first_bad_offset}\] = "):
        hbk.embedding_bag(*args, backend.put(bad), bounds=bounds)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_bounds_zero_skips_bad_ids(backend, rng, combiner, weighted):
    """A skipped id adds nothing and is not counted by mean or sqrtn."""
    weights = rng.standard_normal((6, 3)).astype(np.float32)
    values = np.array([0, 6, 5, -3, 2, 99], np.int64)
    offsets = np.array([0, 3, 4, 6], np.int64)
    psw = rng.uniform(0.5, 1.5, size=6).astype(np.float32) if weighted else None
    out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                            combiner=combiner, bounds="zero",
                            per_sample_weights=None if psw is None else backend.put(psw))
    expected = reference.embedding_bag(weights, values, offsets, combiner, psw, bounds="zero")
    assert_close(backend.get(out), expected, np.float32)


def test_bounds_unchecked_on_valid_input(backend, rng):
    weights, values, offsets = make_case(rng, backend, 20, 4, 4, 3, np.float32, np.int32, np.int32)
    out = hbk.embedding_bag(backend.put(weights), backend.put(values), backend.put(offsets),
                            bounds="unchecked")
    assert_close(backend.get(out), reference.embedding_bag(weights, values, offsets, "sum"), np.float32)


@pytest.mark.parametrize("offsets, message", [
    ([1, 2, 3], r"offsets\[0\] = 1, expected 0"),
    ([0, 3, 2], r"offsets\[2\] = 2 < offsets\[1\] = 3"),
    ([0, 1, 2], r"offsets\[2\] = 2, expected len\(values\) = 3"),
    ([0, 1, 4], r"offsets\[2\] = 4, expected len\(values\) = 3"),
    ([0], r"offsets\[0\] = 0, expected len\(values\) = 3"),
])
@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_malformed_offsets(backend, offsets, message, bounds):
    weights = np.ones((5, 2), np.float32)
    with raises(ValueError, match=message):
        hbk.embedding_bag(backend.put(weights), backend.put(np.array([0, 1, 2])),
                          backend.put(np.array(offsets)), bounds=bounds)


def test_bad_arguments():
    w = np.ones((4, 2), np.float32)
    v, o = np.array([0, 1]), np.array([0, 2])
    with raises(ValueError, match="int32 or int64"):
        hbk.embedding_bag(w, v.astype(np.float32), o)
    with raises(ValueError, match="int32 or int64"):
        hbk.embedding_bag(w, v, o.astype(np.uint8))
    with raises(ValueError, match="2-D table"):
        hbk.embedding_bag(w[0], v, o)
    with raises(ValueError, match="float16, bfloat16, float32 or float64"):
        hbk.embedding_bag(w.astype(np.int32), v, o)
    with raises(ValueError, match="combiner must be one of"):
        hbk.embedding_bag(w, v, o, combiner="max")
    with raises(ValueError, match="bounds must be one of"):
        hbk.embedding_bag(w, v, o, bounds="clip")
    with raises(ValueError, match="shape of values"):
        hbk.embedding_bag(w, v, o, per_sample_weights=np.ones(3, np.float32))
    with raises(ValueError, match="B \\+ 1 >= 1"):
        hbk.embedding_bag(w, v, np.zeros(0, np.int64))
    with raises(TypeError, match="NumPy array or a CUDA array"):
        hbk.embedding_bag(w, [0, 1], o)


def _plain_and_odd_inputs(rng, bad=False):
    """(name, weights, values, offsets, plain): arrays the NumPy fast path of
    ``hbk.embedding_bag`` takes as they are (plain), and ones it must leave to the
    general path, which copies, converts or rejects them; with ``bad``, ``values[2]``
    is the first id past the table."""
    w = rng.standard_normal((40, 5)).astype(np.float32)
    offsets = np.array([0, 3, 3, 4, 9])
    values = rng.integers(0, 40, 9)
    values[0], values[-1] = 39, 0
    if bad:
        values[2] = 40
    wide = np.zeros((40, 10), np.float32)
    wide[:, ::2] = w
    big_endian = values.astype(">i8")
    cases = [
        ("plain", w, values, offsets, True),
        ("int32", w, values.astype(np.int32), offsets.astype(np.int32), True),
        ("D=1", w[:, :1].copy(), values, offsets, True),
        ("fp64", w.astype(np.float64), values, offsets, True),
        ("fp16", w.astype(np.float16), values, offsets, True),
        ("row slice", w[1:], np.where(values >= 39, values - 1, values), offsets, True),
        ("strided rows", wide[:, ::2], values, offsets, False),
        ("Fortran table", np.asfortranarray(w), values, offsets, False),
        ("strided ids", w, np.repeat(values, 2)[::2], offsets, False),
        ("big-endian ids", w, big_endian, offsets, False),
        ("int table", w.astype(np.int32), values, offsets, False),
        ("1-D table", w[0], values, offsets, False),
        ("empty offsets", w, values, np.zeros(0, np.int64), False),
        ("memmap-like subclass", w.view(np.memmap), values, offsets, False),
    ]
    return cases


def _outcome(call):
    try:
        return "ok", call()
    except (ValueError, TypeError, hbk.BoundsError) as error:
        return type(error).__name__, str(error)


def test_plain_numpy_inputs_skip_the_general_path_and_agree_with_it_cpu(rng, monkeypatch):
    """Plain NumPy arrays skip ``resolve`` and the array checks; every input, plain or
    not, gives the same bits or the same error as the general path, in every bounds
    mode and with ids outside the table."""
    from hbkernels import ops

    resolved = []
    real_resolve = ops.resolve

    def spy(*args, **kwargs):
        resolved.append(True)
        return real_resolve(*args, **kwargs)

    monkeypatch.setattr(ops, "resolve", spy)
    for bad in (False, True):
        for (name, w, ids, o, plain), bounds in itertools.product(
                _plain_and_odd_inputs(rng, bad), ("raise", "zero")):
            resolved.clear()
            fast = _outcome(lambda: hbk.embedding_bag(w, ids, o, combiner="mean", bounds=bounds))
            assert bool(resolved) != plain, name
            with monkeypatch.context() as m:
                m.setattr(ops, "_plain_inputs", lambda *a: None)
                general = _outcome(lambda: hbk.embedding_bag(w, ids, o, combiner="mean",
                                                             bounds=bounds))
            assert fast[0] == general[0], (name, bounds, bad, fast, general)
            if fast[0] == "ok":
                assert fast[1].dtype == general[1].dtype
                np.testing.assert_array_equal(fast[1], general[1], err_msg=name)
            else:
                assert fast[1] == general[1], name
    w, v, o = _plain_and_odd_inputs(rng)[0][1:4]
    for bounds in ("raise", "zero"):  # bad offsets: the same message either way
        bad_offsets = o.copy()
        bad_offsets[2] = 1
        fast = _outcome(lambda: hbk.embedding_bag(w, v, bad_offsets, bounds=bounds))
        with monkeypatch.context() as m:
            m.setattr(ops, "_plain_inputs", lambda *a: None)
            general = _outcome(lambda: hbk.embedding_bag(w, v, bad_offsets, bounds=bounds))
        assert fast == general and fast[0] == "ValueError"


# widths with no, one and several vectors, each with and without a tail: a kernel
# compiles per width, so the widths are a set, not a range
PROPERTY_DIMS = [1, 2, 3, 5, 8, 16, 20]


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 40), dim=st.sampled_from(PROPERTY_DIMS), batch=st.integers(0, 30),
    max_len=st.integers(0, 12), combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
    weighted=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
def test_property_random_shapes_cpu(num_rows, dim, batch, max_len, combiner, weighted, seed):
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((num_rows, dim)).astype(np.float32)
    offsets = random_offsets(rng, batch, max_len)
    values = rng.integers(0, num_rows, size=int(offsets[-1]))
    psw = rng.uniform(0.1, 2.0, size=values.shape).astype(np.float32) if weighted else None
    out = hbk.embedding_bag(weights, values, offsets, combiner=combiner, per_sample_weights=psw)
    assert_close(out, reference.embedding_bag(weights, values, offsets, combiner, psw), np.float32)
