"""The collection's forward on the CUDA path: the static tables of one dtype, whatever
their widths and combiners, pooled in one launch (``hbkernels.cuda.pool_tables``),
each feature's output against ``hbkernels.reference`` of its own table; the launches a
forward makes (training steps against the CPU collection: ``test_update_tables.py``)."""
import numpy as np
import pytest
from helpers import forward_on as forward
from helpers import mixed_width_features as features
from helpers import mixed_width_tables as tables
from helpers import recorded_launches

import hbkernels as hbk
from hbkernels import reference
from hbkernels._dispatch import device_family, host

pytestmark = pytest.mark.cuda
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def launches(call):
    """``(result, launches, pool_tables launches)`` of ``call()``."""
    result, seen = recorded_launches(call)
    names = [getattr(kernel, "built_by", ("", ""))[1] for kernel in seen]
    return result, len(names), names.count("pool_tables_kernel")


def expected(coll, spec, values, offsets, psw):
    """The reference output of a feature of table ``spec``."""
    weights = host(coll.full_weights(spec.name)).astype(np.float64)
    if spec.combiner is None:
        return reference.lookup(weights, values)
    return reference.embedding_bag(weights, values, offsets, spec.combiner, psw)


@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "float16")])
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_one_launch_per_dtype_equals_each_table_alone(cuda_backend, rng, dtypes, id_dtype):
    specs = tables(dtypes)
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda",
                                   optimizer=hbk.optim.SGD(lr=0.1), plan={"t64": "data_parallel"})
    assert coll.layout.replica_groups  # pooled in the same launch as the sharded tables
    batch, psw = features(rng, specs, 3, id_dtype, weighted=("t16", "t4b", "t200"))
    out, total, pooling = launches(lambda: forward(coll, batch, psw))
    assert pooling == len(dtypes)
    assert total == pooling + 1  # and the check of every feature's ids and offsets
    for spec in specs:
        for f in spec.features or [spec.name]:
            got = out[f].values if spec.combiner is None else out[f]
            want = expected(coll, spec, *batch[f], psw.get(f))
            assert got.shape == want.shape
            np.testing.assert_allclose(host(got).astype(np.float64), want,
                                       rtol=TOLERANCE[spec.dtype], atol=TOLERANCE[spec.dtype],
                                       err_msg=f)
            if spec.combiner is not None:  # the same sums in the same order as embedding_bag's
                put = device_family("cuda").put
                alone = hbk.embedding_bag(put(host(coll.full_weights(spec.name))),
                                          *map(put, batch[f]), combiner=spec.combiner,
                                          per_sample_weights=put(psw[f]) if f in psw else None)
                np.testing.assert_array_equal(host(got), host(alone), err_msg=f)


def test_empty_and_absent_features(cuda_backend, rng):
    specs = tables(("float32",))
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda")
    before = {spec.name: host(coll.full_weights(spec.name)) for spec in specs}
    batch, _ = features(rng, specs[:3], 0, np.int64)  # three features, no bags
    out, _, pooling = launches(lambda: forward(coll, batch, {}))
    assert pooling == 1 and sorted(out) == sorted(batch)
    assert all(out[f].shape == (0, coll.tables[coll.feature_table[f]].dim) for f in out)
    put = device_family("cuda").put
    coll.backward({f: put(np.zeros(o.shape, np.float32)) for f, o in out.items()})
    for spec in specs:
        np.testing.assert_array_equal(host(coll.full_weights(spec.name)), before[spec.name])
    batch, _ = features(rng, specs[4:], 2, np.int64)  # only some tables
    out, _, pooling = launches(lambda: forward(coll, batch, {}))
    assert pooling == 1
    for spec in specs[4:]:
        want = expected(coll, spec, *batch[spec.name], None)
        got = out[spec.name].values if spec.combiner is None else out[spec.name]
        np.testing.assert_allclose(host(got), want, rtol=1e-5, atol=1e-6)


def test_plain_features_check_rides_with_the_pooling_plan(cuda_backend, rng):
    """Features with no weights and no sequence table: the input check's table and the
    pooling's plan reach the device in one copy. The outputs are the reference's, and a
    bad id or offset raises at the next wait, naming its feature."""
    specs = [s for s in tables(("float32",)) if s.combiner is not None]
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda")
    batch, _ = features(rng, specs, 3, np.int64)
    name, rows = specs[2].name, specs[2].num_rows
    batch[name] = (np.array([0, rows - 1, 1, 0]), np.array([0, 0, 2, 4]))  # (bad below)
    out, total, pooling = launches(lambda: forward(coll, batch, {}))
    assert (total, pooling) == (2, 1)
    for spec in specs:
        for f in spec.features or [spec.name]:
            np.testing.assert_allclose(host(out[f]), expected(coll, spec, *batch[f], None),
                                       rtol=1e-5, atol=1e-6, err_msg=f)
    values, offsets = batch[name]
    bad = values.copy()
    bad[-1] = rows
    with pytest.raises(hbk.BoundsError, match=rf"feature '{name}': values\[3\] = {rows}"):
        forward(coll, {**batch, name: (bad, offsets)}, {})
        hbk.synchronize()
    with pytest.raises(ValueError, match=f"feature '{name}': malformed offsets"):
        forward(coll, {**batch, name: (values, offsets[::-1].copy())}, {})
        hbk.synchronize()
    forward(coll, batch, {})
    hbk.synchronize()  # the errors were raised once
    # a forward with no pooling launch (a table in host memory alone) checks them too, first
    slow = hbk.EmbeddingCollection(
        specs + [hbk.TableSpec("h", num_rows=30, dim=4, storage="host", cache_rows=8)],
        comm=hbk.dist.init("local"), device="cuda")
    with pytest.raises(ValueError, match="feature 'h': malformed offsets"):
        forward(slow, {"h": (np.array([5, 29, 7]), np.array([0, 2, 1]))}, {})
        hbk.synchronize()
