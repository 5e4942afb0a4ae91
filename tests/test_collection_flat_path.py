"""The collection's flat path on the CUDA path: at world size 1, where one launch pools
every table, a forward of plain features (``hbk.Ragged`` of C-contiguous int32 or int64
arrays on the device, no weights) is checked and pooled from what its signature (its
features' names and batches) lays out once, and its backward updates from what that
forward laid out. Its outputs, weights and optimizer state against the CPU collection's
over steps whose signatures change (batch sizes, features left out, their order);
errors; the inputs it leaves to the general path; an incremental save after its steps."""
import numpy as np
import pytest
from helpers import make_opt, raises, same_collections

import hbkernels as hbk
from hbkernels._dispatch import device_family, host

pytestmark = pytest.mark.cuda
LOCAL = hbk.dist.init("local")

# one dtype; widths 1, 3 (odd) and 16, two tables of width 16 in one fused array, a table
# with two features, each combiner, a replicated table: every table in one launch
SPECS = [hbk.TableSpec("a", num_rows=40, dim=16, combiner="sum"),
         hbk.TableSpec("b", num_rows=9, dim=16, combiner="mean"),
         hbk.TableSpec("c", num_rows=30, dim=3, combiner="sqrtn", features=["c", "c2"]),
         hbk.TableSpec("d", num_rows=25, dim=1, combiner="sum"),
         hbk.TableSpec("r", num_rows=12, dim=3, combiner="sum")]
PLAN = {"r": "data_parallel"}
FEATURES = ("a", "b", "c", "c2", "d", "r")
ROWS = {"a": 40, "b": 9, "c": 30, "c2": 30, "d": 25, "r": 12}


def collections(opt_name):
    return {device: hbk.EmbeddingCollection(SPECS, comm=LOCAL, device=device, plan=PLAN,
                                            optimizer=make_opt(opt_name), seed=7)
            for device in ("cpu", "cuda")}


def batch_of(rng, batch, features=FEATURES, id_dtype=np.int64, empty=()):
    """``{feature: (values, offsets)}``: bags of 0 to 6 ids, Zipf-repeated, the table's last
    row in each feature with ids; ``empty``: features whose bags hold no id."""
    out = {}
    for f in features:
        lengths = np.zeros(batch, np.int64) if f in empty else rng.integers(0, 7, batch)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(id_dtype)
        values = ((rng.zipf(1.3, int(offsets[-1])) - 1) % ROWS[f]).astype(id_dtype)
        if values.size:
            values[-1] = ROWS[f] - 1
        out[f] = (values, offsets)
    return out


def forward(coll, batch):
    put = device_family(coll.device).put
    return coll.forward({f: hbk.Ragged(put(v), put(o)) for f, (v, o) in batch.items()})


def step_both(colls, batch, rng, flat=True, tolerance=1e-6):
    """A forward and backward of ``batch`` on both collections; the outputs compared.
    ``flat``: whether the CUDA collection's forward must take the flat path."""
    outs = {device: forward(coll, batch) for device, coll in colls.items()}
    assert (colls["cuda"]._saved.flat is not None) == flat
    assert list(outs["cuda"]) == list(outs["cpu"])  # the collection's order of features
    for f in batch:
        np.testing.assert_allclose(host(outs["cuda"][f]), host(outs["cpu"][f]),
                                   rtol=10 * tolerance, atol=tolerance, err_msg=f)
    grads = {f: rng.standard_normal(host(o).shape).astype(np.float32)
             for f, o in outs["cpu"].items()}
    for device, coll in colls.items():
        coll.backward({f: device_family(device).put(g) for f, g in grads.items()})
    hbk.synchronize()


def same_tables(colls, tolerance=1e-6):
    for spec in SPECS:
        np.testing.assert_allclose(host(colls["cuda"].full_weights(spec.name)),
                                   host(colls["cpu"].full_weights(spec.name)),
                                   rtol=10 * tolerance, atol=tolerance, err_msg=spec.name)
        want = colls["cpu"].full_state(spec.name)
        for slot, got in colls["cuda"].full_state(spec.name).items():
            if slot == "step":
                assert got == want[slot], spec.name
            else:
                np.testing.assert_allclose(host(got), host(want[slot]), rtol=10 * tolerance,
                                           atol=tolerance, err_msg=f"{spec.name} {slot}")


# no state, a per-row slot, per-table step counts (Adam counts a table's steps only where the
# batch holds its ids)
@pytest.mark.parametrize("opt_name", ["SGD", "RowWiseAdagrad", "Adam"])
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_steps_equal_the_cpu_collection(cuda_backend, rng, opt_name, id_dtype):
    colls = collections(opt_name)
    assert colls["cuda"]._flat_key is not None
    step_both(colls, batch_of(rng, 4, id_dtype=id_dtype), rng)
    # the features in another order, one with no id: the same signature's layout
    step_both(colls, batch_of(rng, 4, FEATURES[::-1], id_dtype, empty=("b",)), rng)
    # another batch size; some features left out (their tables' steps still count, but
    # with Adam's per-table counts, and a table absent or idle counts none)
    step_both(colls, batch_of(rng, 2, ("d", "a", "c2"), id_dtype), rng)
    step_both(colls, batch_of(rng, 4, id_dtype=id_dtype), rng)  # the first signature again
    same_tables(colls)


def test_one_id_hundreds_of_times(cuda_backend, rng):
    colls = collections("RowWiseAdagrad")
    batch = batch_of(rng, 3)
    batch["a"] = (np.full(512, 39, np.int64), np.array([0, 1, 300, 512], np.int64))
    step_both(colls, batch, rng, tolerance=1e-5)  # (512 fp32 terms summed in another order)
    same_tables(colls, tolerance=1e-5)


def test_errors(cuda_backend, rng):
    colls = collections("RowWiseAdagrad")
    coll = colls["cuda"]
    batch = batch_of(rng, 4)
    values, offsets = batch["c2"]
    bad = values.copy()
    bad[0] = 30
    with raises(hbk.BoundsError, match=r"feature 'c2': values\[0\] = 30"):
        forward(coll, {**batch, "c2": (bad, offsets)})
    with raises(ValueError, match="feature 'c2': malformed offsets"):
        forward(coll, {**batch, "c2": (values, offsets[::-1].copy())})
    with raises(ValueError, match="unknown features"):
        forward(coll, {**batch, "z": (values, offsets)})
    out = forward(coll, batch)
    put = device_family("cuda").put
    grads = {f: put(np.zeros(host(o).shape, np.float32)) for f, o in out.items()}
    with raises(ValueError, match=r"grad of 'a' must be \[B, dim\] = \[4, 16\]"):
        coll.backward({**grads, "a": put(np.zeros((4, 15), np.float32))})
    with raises(ValueError, match="a gradient for exactly the features of the forward"):
        coll.backward({f: g for f, g in grads.items() if f != "d"})
    coll.backward(grads)  # the forward's backward, after the refused ones
    with raises(RuntimeError, match="backward needs a forward first"):
        coll.backward(grads)
    # the collection is as the CPU one after the failed calls (the zero gradient counted a step)
    forward(colls["cpu"], batch)
    colls["cpu"].backward({f: np.zeros(host(o).shape, np.float32) for f, o in out.items()})
    step_both(colls, batch, rng)
    same_tables(colls)


def test_other_inputs_take_the_general_path(cuda_backend, rng):
    """Values a strided view, weights, one id per sample: the general path reads them,
    with the same results (and the same update of a fused array holding a replicated
    table and a sharded one)."""
    colls = collections("Adagrad")
    step_both(colls, batch_of(rng, 3), rng)
    put = device_family("cuda").put
    for kind in ("strided", "weighted", "one id"):
        batch = batch_of(rng, 3)
        if kind == "one id":
            batch = {f: (batch[f][0][:3], np.arange(4)) for f in ("a", "c") if batch[f][0].size >= 3}
        weights = ({f: rng.random(v.size).astype(np.float32) for f, (v, _) in batch.items()}
                   if kind == "weighted" else None)
        outs = {}
        for device, coll in colls.items():
            on = device_family(device).put
            if kind == "strided" and device == "cuda":
                given = {f: hbk.Ragged(put(np.repeat(v, 2))[::2], put(o)) for f, (v, o) in batch.items()}
            elif kind == "one id":
                given = {f: on(v) for f, (v, _) in batch.items()}
            else:
                given = {f: hbk.Ragged(on(v), on(o)) for f, (v, o) in batch.items()}
            outs[device] = coll.forward(given, per_sample_weights=weights and {
                f: on(w) for f, w in weights.items()})
        assert colls["cuda"]._saved.flat is None, kind
        grads = {f: rng.standard_normal(host(o).shape).astype(np.float32)
                 for f, o in outs["cpu"].items()}
        for f in batch:
            np.testing.assert_allclose(host(outs["cuda"][f]), host(outs["cpu"][f]), rtol=1e-5,
                                       atol=1e-6, err_msg=f"{kind} {f}")
        for device, coll in colls.items():
            coll.backward({f: device_family(device).put(g) for f, g in grads.items()})
        same_tables(colls)


def test_a_collection_the_flat_path_does_not_take(cuda_backend):
    weighted = hbk.EmbeddingCollection(SPECS + [hbk.TableSpec("s", num_rows=5, dim=3,
                                                              combiner=None)],
                                       comm=LOCAL, device="cuda")
    assert weighted._flat_key is None  # a sequence table: its own path
    two_dtypes = hbk.EmbeddingCollection(SPECS + [hbk.TableSpec("h", num_rows=5, dim=4,
                                                                dtype="float16")],
                                         comm=LOCAL, device="cuda")
    assert two_dtypes._flat_key is None  # two flat arrays


def test_an_incremental_save_after_flat_steps(cuda_backend, rng, tmp_path):
    colls = collections("RowWiseAdagrad")
    coll = colls["cuda"]
    step_both(colls, batch_of(rng, 4), rng)
    coll.save(tmp_path / "full")
    forward(coll, batch_of(rng, 4))  # a forward before the save, its backward after it
    assert coll.save(tmp_path / "first", incremental=True, chain_limit=np.inf) == "incremental"
    out = forward(coll, batch_of(rng, 3))
    coll.backward({f: device_family("cuda").put(rng.standard_normal(host(o).shape)
                                                 .astype(np.float32)) for f, o in out.items()})
    assert coll.save(tmp_path / "second", incremental=True, chain_limit=np.inf) == "incremental"
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "second", comm=LOCAL))


@pytest.mark.parametrize("dims", [(16, 16, 16), (16, 3, 1)])
def test_a_gradient_with_nan(cuda_backend, rng, dims):
    """A NaN in a gradient raises at the next wait, naming its feature and row, and the
    step changes nothing (tables of one width: the gradient checked by rows of it)."""
    specs = [hbk.TableSpec(name, num_rows=20, dim=d, combiner=c)
             for name, d, c in zip("xyz", dims, ("sum", "mean", "sqrtn"))]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, device="cuda",
                                   optimizer=make_opt("RowWiseAdagrad"))
    put = device_family("cuda").put
    batch = {f: (rng.integers(0, 20, 9), np.array([0, 2, 5, 9])) for f in "xyz"}
    before = {f: host(coll.full_weights(f)).copy() for f in "xyz"}
    out = forward(coll, batch)
    assert coll._saved.flat is not None
    grads = {f: rng.standard_normal(host(o).shape).astype(np.float32) for f, o in out.items()}
    grads["y"][2, dims[1] - 1] = np.nan
    with raises(ValueError, match="grad of 'y' has NaN or Inf in row 2"):
        coll.backward({f: put(g) for f, g in grads.items()})
    for f in "xyz":
        np.testing.assert_array_equal(host(coll.full_weights(f)), before[f], err_msg=f)
        assert coll.full_state(f)["step"] == 0
