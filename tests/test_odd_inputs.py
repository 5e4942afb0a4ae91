"""Every op fed what users actually pass: strided views, Fortran order, column slices,
read-only and big-endian arrays, 0-d arrays, and options of the wrong type or out of
range. Each gives the result of the plain C-contiguous input bit for bit, or a
ValueError / TypeError that says what was expected; never a crash or garbage."""
import warnings

import numpy as np
import pytest
from helpers import raises
from hypothesis import given, settings
from hypothesis import strategies as st

import hbkernels as hbk

E, D = 12, 5


def case(rng):
    offsets = np.array([0, 3, 3, 7, 9])
    values = rng.integers(0, E, 9)
    values[[0, -1]] = [E - 1, 0]
    return {
        "weights": rng.standard_normal((E, D)).astype(np.float32),
        "values": values,
        "offsets": offsets,
        "psw": rng.uniform(0.5, 1.5, 9).astype(np.float32),
        "grad": rng.standard_normal((4, D)).astype(np.float32),
        "rows": rng.standard_normal((9, D)).astype(np.float32),
        "segments": rng.integers(0, 4, 9),
    }


OPS = {
    "lookup": (lambda a: hbk.lookup(a["weights"], a["values"]), ("weights", "values")),
    "lookup_backward": (lambda a: hbk.lookup_backward(a["rows"], a["values"], num_rows=E),
                        ("rows", "values")),
    "embedding_bag": (lambda a: hbk.embedding_bag(a["weights"], a["values"], a["offsets"],
                                                  combiner="mean", per_sample_weights=a["psw"]),
                      ("weights", "values", "offsets", "psw")),
    "embedding_bag_backward": (lambda a: hbk.embedding_bag_backward(
        a["grad"], a["values"], a["offsets"], num_rows=E, combiner="sqrtn",
        per_sample_weights=a["psw"]), ("grad", "values", "offsets", "psw")),
    "per_sample_weights_backward": (lambda a: hbk.per_sample_weights_backward(
        a["grad"], a["weights"], a["values"], a["offsets"], a["psw"], combiner="mean"),
        ("grad", "weights", "values", "offsets", "psw")),
    "segment_sum": (lambda a: hbk.segment_sum(a["rows"], a["segments"], 4), ("rows", "segments")),
    "segment_reduce": (lambda a: hbk.segment_reduce(a["rows"], a["offsets"], combiner="sqrtn"),
                       ("rows", "offsets")),
    "unique": (lambda a: hbk.unique(a["values"], return_inverse=True, return_counts=True),
               ("values",)),
    "partition": (lambda a: hbk.partition(a["values"], 3, mode="div", num_rows=E), ("values",)),
}


def strided(x):
    return np.repeat(x, 2, axis=0)[::2]


def column_slice(x):
    return np.concatenate([x, x[:, :1]], axis=1)[:, :-1] if x.ndim == 2 else strided(x)


def read_only(x):
    y = x.copy()
    y.flags.writeable = False
    return y


def big_endian(x):
    return x.astype(x.dtype.newbyteorder(">"))


def reversed_twice(x):
    return x[::-1].copy()[::-1]


VARIANTS = {"strided": strided, "column_slice": column_slice, "fortran": np.asfortranarray,
            "read_only": read_only, "big_endian": big_endian, "negative_stride": reversed_twice}


def flat(result):
    if isinstance(result, tuple):  # SparseGrad, Partitioned, unique's tuple
        return [np.asarray(r) for r in result]
    return [np.asarray(result)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", OPS)
def test_every_layout_gives_the_plain_result(rng, op, variant):
    run, names = OPS[op]
    inputs = case(rng)
    expected = flat(run(inputs))
    for name in names:
        odd = VARIANTS[variant](inputs[name])
        np.testing.assert_array_equal(odd, inputs[name])
        got = flat(run(dict(inputs, **{name: odd})))
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype.newbyteorder("=") and g.shape == e.shape, (name, g.dtype)
            np.testing.assert_array_equal(g, e, err_msg=f"{op}: {name} {variant}")


def test_zero_d_ids_and_tables(rng):
    inputs = case(rng)
    w = inputs["weights"]
    np.testing.assert_array_equal(hbk.lookup(w, np.array(3)), w[3])
    with raises(ValueError, match="2-D table"):
        hbk.lookup(np.ones((), np.float32), np.array([0]))
    with raises(ValueError, match="2-D table"):
        hbk.lookup(np.float32(1.0), np.array([0]))  # a NumPy scalar is a 0-d array
    with raises(ValueError, match="values must be 1-D"):
        hbk.embedding_bag(w, np.array(3), np.array([0, 1]))
    with raises(ValueError, match="offsets must be 1-D"):
        hbk.embedding_bag(w, np.array([3]), np.array(1))
    with raises(ValueError, match="ids must be 1-D"):
        hbk.partition(np.array(3), 2)


BAD_CHOICES = [["sum"], {"sum": 1}, 1, 1.5, None, b"sum", "SUM"]


@pytest.mark.parametrize("value", BAD_CHOICES, ids=repr)
def test_options_of_the_wrong_type(rng, value):
    a = case(rng)
    w, v, o = a["weights"], a["values"], a["offsets"]
    calls = [
        lambda: hbk.embedding_bag(w, v, o, bounds=value),
        lambda: hbk.embedding_bag(w, v, o, combiner=value),
        lambda: hbk.lookup(w, v, bounds=value),
        lambda: hbk.segment_reduce(a["rows"], o, combiner=value),
        lambda: hbk.segment_sum(a["rows"], a["segments"], 4, bounds=value),
        lambda: hbk.partition(v, 2, mode=value),
        lambda: hbk.embedding_bag_backward(a["grad"], v, o, num_rows=E, combiner=value),
        lambda: hbk.optim.SGD(lr=0.1, rounding=value),
        lambda: hbk.optim.Adagrad(lr=0.1, nonfinite=value),
    ]
    for call in calls:
        with raises(ValueError, match=r"must be one of \[.*\], got"):
            call()


@pytest.mark.parametrize("value", [-1, 1.5, "12", None, True, 2**63, 2**64, np.float64(3)],
                         ids=repr)
def test_counts_out_of_range_or_of_the_wrong_type(rng, value):
    a = case(rng)
    calls = [
        lambda: hbk.lookup_backward(a["rows"], a["values"], num_rows=value),
        lambda: hbk.embedding_bag_backward(a["grad"], a["values"], a["offsets"], num_rows=value),
        lambda: hbk.segment_sum(a["rows"], a["segments"], value),
        lambda: hbk.partition(a["values"], value),
        lambda: hbk.partition(a["values"], 2, mode="div", num_rows=value),
    ]
    for call in calls:
        with raises(ValueError, match="must be (an integer|>= |<= )|needs num_rows"):
            call()


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 3, 6]), st.sampled_from(list(VARIANTS)), st.integers(0, 2**32 - 1))
def test_property_embedding_bag_any_layout(dim, variant, seed):
    """Widths from a set: each draws a kernel compile per dtype and layout."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 12))
    w = rng.standard_normal((7, dim)).astype(rng.choice([np.float32, np.float64, np.float16]))
    values = rng.integers(0, 7, n).astype(rng.choice([np.int32, np.int64]))
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 4))))
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    plain = hbk.embedding_bag(w, values, offsets, combiner="mean")
    odd = VARIANTS[variant]
    np.testing.assert_array_equal(hbk.embedding_bag(odd(w), odd(values), odd(offsets),
                                                    combiner="mean"), plain)


ROW_VIEWS = {
    "column_slice": lambda parent: parent[:, 1:7],
    "every_other_row": lambda parent: parent[::2, :6],
    "reversed_rows": lambda parent: parent[::-1, 2:8],
}


@pytest.mark.parametrize("rule", ["SGD", "Adagrad", "RowWiseAdagrad", "Adam"])
@pytest.mark.parametrize("view", ROW_VIEWS)
def test_tables_with_contiguous_rows_are_read_and_updated_where_they_are(rng, view, rule):
    """A table whose rows are contiguous (any row stride) is never copied: the forward
    reads it in place and the optimizer's update lands in the caller's array."""
    parent = rng.standard_normal((80, 9)).astype(np.float32)
    untouched = parent.copy()
    table = ROW_VIEWS[view](parent)
    assert not table.flags.c_contiguous
    assert hbk._dispatch.resolve(row_tables=("w",), w=table)[1]["w"] is table
    plain = np.ascontiguousarray(table)
    offsets = np.array([0, 3, 3, 9, 12])
    values = rng.integers(0, table.shape[0], 12)
    values[:2] = [0, table.shape[0] - 1]
    for combiner in ("sum", "mean"):
        np.testing.assert_array_equal(hbk.embedding_bag(table, values, offsets, combiner=combiner),
                                      hbk.embedding_bag(plain, values, offsets, combiner=combiner))
    np.testing.assert_array_equal(hbk.lookup(table, values), plain[values])
    grad = rng.standard_normal((4, table.shape[1])).astype(np.float32)
    opt = getattr(hbk.optim, rule)(lr=0.1)
    state, plain_state = opt.init_state(table), opt.init_state(plain)
    for _ in range(2):
        opt.fused_step(table, state, grad, values, offsets, combiner="mean")
        opt.fused_step(plain, plain_state, grad, values, offsets, combiner="mean")
        g = hbk.embedding_bag_backward(grad, values, offsets, num_rows=table.shape[0])
        opt.step(table, state, g)
        opt.step(plain, plain_state, g)
    np.testing.assert_array_equal(table, plain)
    assert not np.array_equal(table, ROW_VIEWS[view](untouched))
    outside = np.ones(parent.size, bool)
    outside[ROW_VIEWS[view](np.arange(parent.size).reshape(parent.shape)).ravel()] = False
    np.testing.assert_array_equal(parent.ravel()[outside], untouched.ravel()[outside])


def test_a_large_table_that_must_be_copied_warns_once(rng, monkeypatch):
    monkeypatch.setattr(hbk._dispatch, "COPY_WARN_BYTES", 1024)
    monkeypatch.setattr(hbk._dispatch, "_warned_copy", [])
    table = np.asfortranarray(rng.standard_normal((300, 8)).astype(np.float32))
    values, offsets = np.array([0, 299, 5]), np.array([0, 1, 3])
    with pytest.warns(RuntimeWarning, match=r"np.ascontiguousarray\(weights\) once"):
        hbk.embedding_bag(table, values, offsets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hbk.embedding_bag(table, values, offsets)
        hbk.embedding_bag(np.ascontiguousarray(table[:10]), np.array([1]), np.array([0, 1]))


def shapes(x):
    """``x`` as a 0-d array (its first element), as it is, and with a leading axis."""
    return {"0-d": np.asarray(x.reshape(-1)[0]), "as-is": x, "n-d": x[None]}


def answer(run, inputs, put=lambda a: a, get=np.asarray):
    """What a call answers: ``("ok", arrays)`` or ``(error type, message)``."""
    try:
        result = run({k: put(v) for k, v in inputs.items()})
        hbk.synchronize()
    except (ValueError, TypeError, IndexError) as e:
        return type(e).__name__, str(e)
    return "ok", [get(r) for r in (result if isinstance(result, tuple) else (result,))]


def same_answer(a, b, what):
    assert a[0] == b[0], f"{what}: {a[0]} {a[1] if a[0] != 'ok' else ''} vs {b[0]} " \
                         f"{b[1] if b[0] != 'ok' else ''}"
    if a[0] != "ok":
        return
    for x, y in zip(a[1], b[1]):
        assert x.shape == y.shape, (what, x.shape, y.shape)
        np.testing.assert_array_equal(x, y, err_msg=what)


@pytest.mark.parametrize("op", OPS)
def test_0d_1d_nd_inputs_answer_alike_in_both_byte_orders_and_on_both_backends(rng, backend, op):
    """The same call in native and non-native byte order gives the same answer, result or
    error (the caller's shape is what validation sees); the CUDA path gives the CPU's."""
    run, names = OPS[op]
    inputs = case(rng)
    for name in names:
        for label, x in shapes(inputs[name]).items():
            odd = dict(inputs, **{name: x})
            native = answer(run, odd)
            swapped = answer(run, dict(odd, **{name: big_endian(x)}))
            same_answer(swapped, native, f"{op}: {name} {label}, byte order")
            if backend.is_cuda:  # the same answer; values up to float order and id order
                gpu = answer(run, odd, backend.put, backend.get)
                assert gpu[0] == native[0], (op, name, label, gpu, native)
                pairs = list(zip(gpu[1], native[1])) if gpu[0] == "ok" else []
                if op == "unique":  # the distinct ids and their counts; inverse by their order
                    pairs = pairs[:1] + pairs[2:]
                for x, y in pairs:
                    assert x.shape == y.shape, (op, name, label, x.shape, y.shape)
                    np.testing.assert_allclose(np.sort(x, axis=None), np.sort(y, axis=None),
                                               rtol=1e-5, atol=1e-6, err_msg=f"{op} {name}")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("num_rows", [2**31 - 1, 2**31, 2**40])
@pytest.mark.parametrize("mode", ["div", "mod"])
def test_partition_of_ids_against_tables_past_2_31_rows(backend, dtype, num_rows, mode):
    """Index arithmetic in 64 bits whatever the ids' dtype: the CPU's and the CUDA path's
    answers are equal, results and errors alike."""
    top = min(np.iinfo(dtype).max, num_rows - 1)  # the largest id in range
    ids = np.array([529685, 7, top, 0, top // 2], dtype)
    for case_ids in (ids, np.append(ids, -1).astype(dtype)):  # a bad id: a BoundsError
        def run(a):
            return hbk.partition(a["ids"], 3, mode=mode, num_rows=num_rows)
        cpu = answer(run, {"ids": case_ids})
        if case_ids.shape[0] > ids.shape[0]:
            assert cpu[0] == "BoundsError" or cpu[0] == "IndexError", cpu
        else:
            assert cpu[0] == "ok", cpu
            block = -(-num_rows // 3)
            wide = case_ids.astype(np.int64)
            expected = np.minimum(wide // block, 2) if mode == "div" else wide % 3
            np.testing.assert_array_equal(np.diff(np.searchsorted(np.sort(expected), range(4))),
                                          cpu[1][1])
        if backend.is_cuda:
            same_answer(answer(run, {"ids": case_ids}, backend.put, backend.get), cpu,
                        f"partition {mode} {dtype.__name__} num_rows={num_rows}")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("num_rows", [2**31 - 1, 2**31, 2**40])
def test_backward_ops_against_tables_past_2_31_rows(rng, backend, dtype, num_rows):
    """The sparse gradients of ids near the int32 limit, and a bad id's error, are the
    same on the CPU and the CUDA path."""
    top = min(np.iinfo(dtype).max, num_rows - 1)
    values = np.array([top, 5, top, 0, top - 1], dtype)
    offsets = np.array([0, 2, 2, 5], dtype)
    grad = rng.standard_normal((3, 4)).astype(np.float32)
    ops = {
        "embedding_bag_backward": lambda a: hbk.embedding_bag_backward(
            a["grad"], a["values"], a["offsets"], num_rows=num_rows, combiner="mean"),
        "lookup_backward": lambda a: hbk.lookup_backward(
            a["rows"], a["values"], num_rows=num_rows),
    }
    inputs = {"grad": grad, "values": values, "offsets": offsets,
              "rows": rng.standard_normal((5, 4)).astype(np.float32)}
    for name, run in ops.items():
        for ids in (values, np.append(values[:-1], -1).astype(dtype)):
            case_inputs = dict(inputs, values=ids)
            cpu = answer(run, case_inputs)
            assert cpu[0] == ("ok" if ids is values else "BoundsError"), (name, cpu)
            if cpu[0] == "ok":  # the distinct ids, and each one's summed row
                order = np.argsort(cpu[1][0])
                assert sorted(cpu[1][0].tolist()) == sorted(set(values.tolist()))
            if backend.is_cuda:
                gpu = answer(run, case_inputs, backend.put, backend.get)
                assert gpu[0] == cpu[0], (name, gpu, cpu)
                if gpu[0] == "ok":
                    mine = np.argsort(gpu[1][0])
                    np.testing.assert_array_equal(gpu[1][0][mine], cpu[1][0][order])
                    np.testing.assert_allclose(gpu[1][1][mine], cpu[1][1][order], rtol=1e-6,
                                               atol=1e-6)
