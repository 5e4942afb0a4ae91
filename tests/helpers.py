"""Fixtures shared by several test modules: optimizer tables, CSR bags with repeated
ids, dense views of the reference gradients, Parquet files, a small training run, the
kernels a call launches, collections of mixed widths. Test modules import
from here (and from ``conftest``), never from each other; the references
themselves are :mod:`hbkernels.reference`."""
import contextlib

import numpy as np
import pytest
from conftest import random_offsets

import hbkernels as hbk
from hbkernels import optim, reference
from hbkernels._dispatch import device_family

RULES = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl"]
# a small ``hbkernels train``; --threads 1: the pools' size fixed, so torch's reductions
# sum in the same order in every run however busy the machine is ("auto" follows the
# other processes' load)
# the collections of mixed widths (mixed_width_tables): a table of each width, combiners
# mixed (None: a sequence table)
MIXED_DIMS = (1, 4, 16, 24, 64, 128, 200)
MIXED_COMBINERS = ("sum", "mean", "sqrtn", None, "mean", "sum", "sqrtn")
TRAIN_SMALL = ["--table", "a:5000:1", "--table", "b:2000:4:var", "--table", "c:300:1",
               "--dense-features", "5", "--batch-size", "128", "--eval-samples", "512",
               "--dim", "7", "--bottom", "16", "--top", "16", "--threads", "1", "--seed", "3"]


def recorded_launches(call):
    """``(call(), the kernels it launched, in order)`` (the CUDA launcher's recorder; a
    recorder already set still sees every launch)."""
    from hbkernels.cuda import _launcher

    seen, chained = [], _launcher.RECORDER[0]

    def record(kernel, argtypes, threads):
        seen.append(kernel)
        if chained is not None:
            chained(kernel, argtypes, threads)

    _launcher.RECORDER[0] = record
    try:
        result = call()
    finally:
        _launcher.RECORDER[0] = chained
    return result, seen


@contextlib.contextmanager
def raises(expected, **kwargs):
    """``pytest.raises`` for calls that may leave their checks pending on a GPU: the
    block ends with ``hbk.synchronize()``, where such an error is raised at the latest
    (on the CPU the call itself raises, before it)."""
    with pytest.raises(expected, **kwargs) as info:
        yield info
        hbk.synchronize()


def make_opt(name, **options):
    """Each optimizer with non-default hyper-parameters (so a mix-up shows)."""
    if name == "SGD":
        return optim.SGD(lr=0.3, **options)
    if name == "Adagrad":
        return optim.Adagrad(lr=0.2, eps=1e-3, initial_accumulator_value=0.1, **options)
    if name == "RowWiseAdagrad":
        return optim.RowWiseAdagrad(lr=0.2, eps=1e-4, **options)
    if name == "Adam":
        return optim.Adam(**{"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, **options})
    if name == "Ftrl":
        return optim.Ftrl(lr=0.4, l1=0.05, l2=0.1, **options)
    if name == "Ftrl-p0.7":
        return optim.Ftrl(lr=0.4, l1=0.05, l2=0.1, lr_power=-0.7, initial_accumulator_value=0.3,
                          **options)
    if name == "Ftrl-p0":
        return optim.Ftrl(lr=0.4, l1=0.02, l2=0.0, lr_power=0.0, **options)
    raise AssertionError(name)


class Table:
    """A table and its optimizer state on the backend under test."""

    def __init__(self, backend, opt, weights):
        self.backend, self.opt = backend, opt
        self.w = backend.put(weights.copy())
        self.state = opt.init_state(self.w)

    def step(self, ids, rows):
        put = self.backend.put
        self.opt.step(self.w, self.state, hbk.SparseGrad(put(ids), put(rows)))

    def bag_step(self, grad_out, values, offsets, fused, psw=None, **kw):
        put = self.backend.put
        if fused:
            self.opt.fused_step(self.w, self.state, put(grad_out), put(values), put(offsets),
                                per_sample_weights=put(psw), **kw)
        else:
            g = hbk.embedding_bag_backward(put(grad_out), put(values), put(offsets),
                                           num_rows=self.w.shape[0], per_sample_weights=put(psw),
                                           **kw)
            self.opt.step(self.w, self.state, g)

    def weights(self):
        return np.array(self.backend.get(self.w), copy=True)

    def states(self):
        """Host copies (the step counter included) of the state arrays."""
        return {k: np.array(v if k == "step" else self.backend.get(v), copy=True)
                for k, v in self.state.items()}


def bags(rng, num_rows, dim, batch, max_len, touch_below=None):
    """CSR bags whose ids repeat within and across bags (ids < ``touch_below``)."""
    offsets = random_offsets(rng, batch, max_len)
    n = int(offsets[-1])
    values = rng.integers(0, touch_below or num_rows, size=n)
    if n:
        values[rng.integers(0, n, size=max(1, n // 5))] = values[0]
    grad_out = rng.standard_normal((batch, dim)).astype(np.float32)
    return grad_out, values, offsets


def state_names(opt):
    return [name for name, _ in opt.slots]


def within_one_ulp(actual, expected, dtype):
    """|actual - expected| <= one ulp of ``dtype`` (fp16, or bf16 of ml_dtypes) at expected."""
    assert actual.dtype == expected.dtype == np.dtype(dtype)
    gap = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    assert np.all(gap <= np.spacing(np.abs(expected)).astype(np.float64)), np.max(gap)


def dense_backward(grad_out, values, offsets, num_rows, combiner, psw=None, bounds="raise"):
    """:func:`hbkernels.reference.embedding_bag_backward` as ``(dense float64 table
    gradient [num_rows, D], sorted ids looked up)``."""
    grad = reference.embedding_bag_backward(grad_out, values, offsets, num_rows, combiner, psw,
                                            bounds)
    dense = np.zeros((num_rows, np.shape(grad_out)[1]))
    dense[grad.ids] = grad.rows
    return dense, grad.ids


def write_parquet_files(tmp_path, rng, sizes, row_group_size, make):
    """Files of ``sizes`` rows (0 = an empty file) in row groups of ``row_group_size``,
    each table built by ``make(rng, first_row, n)``; returns ``(paths, all rows as
    one table)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, tables, first = [], [], 0
    for i, n in enumerate(sizes):
        t = make(rng, first, n)
        path = tmp_path / f"part-{i:02d}.parquet"
        pq.write_table(t, path, row_group_size=row_group_size)
        paths.append(str(path))
        tables.append(t)
        first += n
    return paths, pa.concat_tables(tables).combine_chunks()


def same_collections(a, b):
    """Two collections hold the same tables, optimizer state, dynamic scores, pending ids
    and call counters, bit for bit."""
    for name, spec in a.tables.items():
        wa, wb = a.full_weights(name), b.full_weights(name)
        for x, y in zip(wa, wb) if spec.dynamic else [(wa, wb)]:
            np.testing.assert_array_equal(on_host(x), on_host(y), err_msg=name)
        sa, sb = a.full_state(name), b.full_state(name)
        assert sa.keys() == sb.keys()
        for k in sa:
            np.testing.assert_array_equal(on_host(sa[k]), on_host(sb[k]), err_msg=f"{name} {k}")
        if spec.dynamic:
            ka, kb = a.hash_tables[name].state(), b.hash_tables[name].state()
            for k in ("ids", "last", "count"):
                np.testing.assert_array_equal(on_host(ka[k]), on_host(kb[k]), err_msg=f"{name} {k}")
            assert (ka["pending"] is None) == (kb["pending"] is None)
            for k in ("ids", "last", "count") if ka["pending"] is not None else ():
                np.testing.assert_array_equal(on_host(ka["pending"][k]), on_host(kb["pending"][k]))
            assert a.hash_tables[name].step == b.hash_tables[name].step


def mixed_width_tables(dtypes):
    """A table of each width of :data:`MIXED_DIMS`, combiners mixed (None: a sequence table),
    the dtypes taken in turn; table ``t4`` has two features, and ``u16`` shares the
    fused array of ``t16`` (same width and dtype) from its row 5 on."""
    specs = [hbk.TableSpec(f"t{d}", num_rows=5 + i, dim=d, combiner=c,
                           dtype=dtypes[i % len(dtypes)],
                           features=[f"t{d}", f"t{d}b"] if d == 4 else None)
             for i, (d, c) in enumerate(zip(MIXED_DIMS, MIXED_COMBINERS))]
    return specs + [hbk.TableSpec("u16", num_rows=4, dim=16, combiner="mean", dtype=specs[2].dtype)]


def mixed_width_features(rng, specs, batch, id_dtype, weighted=()):
    """``({feature: (values, offsets)}, {feature: weights})``: bags of 0 to 5 ids (the
    first bag empty), ids drawn so that row 0 repeats and the table's last row appears."""
    out, psw = {}, {}
    for spec in specs:
        for f in spec.features or [spec.name]:
            lengths = rng.integers(0, 6, batch)
            if batch:
                lengths[0] = 0
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            values = np.where(rng.random(offsets[-1]) < 0.4, 0,
                              rng.integers(0, spec.num_rows, offsets[-1])).astype(id_dtype)
            if values.size:
                values[-1] = spec.num_rows - 1
            out[f] = (values, offsets)
            if f in weighted:
                psw[f] = rng.random(values.size).astype(np.float32)
    return out, psw


def forward_on(coll, batch, psw):
    """``coll.forward`` of ``batch`` and ``psw`` (as :func:`mixed_width_features` gives
    them), put on the collection's device."""
    put = device_family(coll.device).put
    return coll.forward({f: hbk.Ragged(put(v), put(o)) for f, (v, o) in batch.items()},
                        per_sample_weights={f: put(w) for f, w in psw.items()} or None)


# -- reserved steps (EmbeddingCollection.reserve, capture) ----------------------------------
RESERVE_BATCH = 5  # a reserved step's bags (test_reserve, test_capture)
RESERVE_CAP = 24  # and ids per feature

RESERVE_SPECS = [hbk.TableSpec("a", num_rows=60, dim=4, combiner="sum", features=["a", "a2"]),
                 hbk.TableSpec("b", num_rows=40, dim=16, combiner="mean"),
                 hbk.TableSpec("c", num_rows=30, dim=3, combiner="sqrtn"),
                 hbk.TableSpec("d", num_rows=50, dim=1, combiner="sum")]


def reserve_collection(optimizer, specs=RESERVE_SPECS, device="cuda"):
    return hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), optimizer=optimizer,
                                   device=device, seed=3)


def cuda_host(a):
    return np.asarray(device_family("cuda").to_numpy(a))


def on_host(a):
    """``a`` as a NumPy array, wherever it lives (a device array is copied)."""
    return a if isinstance(a, np.ndarray) else cuda_host(a)


def reserve_batches(rng):
    """Five ``(batch, psw, padded)``: int32 then int64 ids; the third with no ids for ``d``
    and exactly the reserved count for ``a2``; the fourth of fewer bags; the fifth with
    ``padded``, the same batch with every feature's values (and weights) padded to the
    reserved count by ids out of every table (and NaN weights), never read."""
    out = []
    for step in range(5):
        batch, psw = mixed_width_features(rng, RESERVE_SPECS, RESERVE_BATCH - 2 if step == 3
                                          else RESERVE_BATCH,
                                          np.int64 if step % 2 else np.int32, weighted=["b"])
        if step == 2:
            batch["d"] = (batch["d"][0][:0], np.zeros(RESERVE_BATCH + 1, np.int64))
            lengths = np.full(RESERVE_BATCH, RESERVE_CAP // RESERVE_BATCH)
            lengths[-1] += RESERVE_CAP - lengths.sum()
            batch["a2"] = (rng.integers(0, 60, RESERVE_CAP).astype(np.int32),
                           np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        pad = None
        if step == 4:
            pad = ({f: (np.concatenate([v, np.full(RESERVE_CAP - v.size, -7, v.dtype)]), o)
                    for f, (v, o) in batch.items()},
                   {f: np.concatenate([w, np.full(RESERVE_CAP - w.size, np.nan, w.dtype)])
                    for f, w in psw.items()})
        out.append((batch, psw, pad))
    return out
