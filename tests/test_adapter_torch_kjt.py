"""TorchRec KeyedJaggedTensor input of hbkernels.adapters.torch: features_from_kjt
against the KJT's own per-key jagged tensors (to_dict), EmbeddingCollectionModule
given a KJT against the same features given as a dict, and against TorchRec's
EmbeddingBagCollection holding the same weights; zero-copy ids, int32/int64
lengths, keys without ids, weights, variable stride, and no torchrec import
by hbkernels itself."""
import copy
import subprocess
import sys

import numpy as np
import pytest
from helpers import raises

torch = pytest.importorskip("torch")
jagged = pytest.importorskip("torchrec.sparse.jagged_tensor")

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters import torch as hbt  # noqa: E402

KJT = jagged.KeyedJaggedTensor
LENGTH_DTYPES = {"int32": torch.int32, "int64": torch.int64}
TABLES = {"user": (20, 4, "sum"), "item": (30, 3, "mean"), "geo": (7, 1, "sum")}


def random_kjt(rng, keys, batch, rows, lengths_dtype="int64", values_dtype="int64",
               weighted=False, empty=()):
    """A KJT of ``batch`` samples per key: random lengths (some 0), ids with both
    table edges; keys in ``empty`` have no ids at all."""
    values, lengths = [], []
    for key in keys:
        n = np.zeros(batch, np.int64) if key in empty else rng.integers(0, 5, size=batch)
        ids = rng.integers(0, rows[key], size=int(n.sum()))
        if ids.shape[0] >= 2:
            ids[:2] = [0, rows[key] - 1]
        values.append(ids)
        lengths.append(n)
    values = torch.from_numpy(np.concatenate(values)).to(LENGTH_DTYPES[values_dtype])
    weights = (torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]).astype(np.float32))
               if weighted else None)
    return KJT(keys=list(keys), values=values, weights=weights,
               lengths=torch.from_numpy(np.concatenate(lengths)).to(LENGTH_DTYPES[lengths_dtype]))


def as_dict(kjt):
    """The KJT's features as the module's dict input, from TorchRec's own split."""
    jts = kjt.to_dict()
    features = {k: (jt.values(), jt.offsets()) for k, jt in jts.items()}
    weights = ({k: jt.weights() for k, jt in jts.items()} if kjt.weights_or_none() is not None
               else None)
    return features, weights


def make_collection(seed=3):
    tables = [hbk.TableSpec(name, num_rows=r, dim=d, combiner=c) for name, (r, d, c) in TABLES.items()]
    return hbk.EmbeddingCollection(tables, comm=hbk.dist.init("local"),
                                   optimizer=hbk.optim.SGD(lr=0.2), device="cpu", seed=seed)


# -- features_from_kjt --------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths_dtype", ["int32", "int64"])
@pytest.mark.parametrize("values_dtype", ["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True])
def test_features_from_kjt_matches_torchrec_split(rng, lengths_dtype, values_dtype, weighted):
    rows = {k: r for k, (r, _, _) in TABLES.items()}
    kjt = random_kjt(rng, ["user", "item", "geo"], 9, rows, lengths_dtype, values_dtype,
                     weighted, empty=("item",))
    features, psw = hbt.features_from_kjt(kjt)
    assert list(features) == ["user", "item", "geo"]
    expected, expected_w = as_dict(kjt)
    base = kjt.values().numpy()
    for key, (v, o) in expected.items():
        got = features[key]
        assert isinstance(got, hbk.Ragged) and isinstance(got.values, np.ndarray)
        np.testing.assert_array_equal(got.values, v.numpy())
        np.testing.assert_array_equal(got.offsets, o.numpy())
        assert got.offsets[0] == 0 and got.batch_size == 9
        assert got.values.dtype == base.dtype and got.offsets.dtype == kjt.offsets().numpy().dtype
        if got.values.size:
            assert np.shares_memory(got.values, base)  # zero-copy ids
    assert features["item"].values.shape == (0,) and not features["item"].offsets.any()
    if weighted:
        for key, w in expected_w.items():
            np.testing.assert_array_equal(psw[key], w.numpy())
    else:
        assert psw is None


def test_features_from_kjt_variable_stride_and_no_keys():
    kjt = KJT(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2, 0]),
              stride_per_key_per_rank=[[1], [2]])
    features, _ = hbt.features_from_kjt(kjt)
    np.testing.assert_array_equal(features["a"].offsets, [0, 1])
    np.testing.assert_array_equal(features["a"].values, [1])
    np.testing.assert_array_equal(features["b"].offsets, [0, 2, 2])
    np.testing.assert_array_equal(features["b"].values, [2, 3])
    empty = KJT(keys=[], values=torch.zeros(0, dtype=torch.int64),
                lengths=torch.zeros(0, dtype=torch.int64), stride=3)
    assert hbt.features_from_kjt(empty) == ({}, None)


def test_features_from_kjt_rejects_other_objects():
    with raises(TypeError, match="KeyedJaggedTensor"):
        hbt.features_from_kjt({"user": torch.tensor([1])})
    assert not hbt.is_keyed_jagged_tensor({"a": 1})


def test_importing_hbkernels_does_not_import_torchrec():
    code = ("import sys, hbkernels, hbkernels.adapters.torch as t; "
            "assert not any(m.startswith('torchrec') for m in sys.modules), 'torchrec imported'; "
            "assert not t.is_keyed_jagged_tensor(object())")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- EmbeddingCollectionModule given a KJT -------------------------------------------------------------
@pytest.mark.parametrize("lengths_dtype", ["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True])
def test_module_kjt_trains_like_the_dict(rng, lengths_dtype, weighted):
    rows = {k: r for k, (r, _, _) in TABLES.items()}
    a, b = hbt.EmbeddingCollectionModule(make_collection()), hbt.EmbeddingCollectionModule(make_collection())
    for step in range(3):
        kjt = random_kjt(rng, ["user", "item", "geo"], 11, rows, lengths_dtype, weighted=weighted,
                         empty=("geo",) if step == 1 else ())
        features, psw = as_dict(kjt)
        out_a, out_b = a(kjt), b(features, per_sample_weights=psw)
        assert list(out_a) == list(out_b) == ["user", "item", "geo"]
        for key in out_a:
            assert out_a[key].shape == (11, TABLES[key][1])
            torch.testing.assert_close(out_a[key], out_b[key], rtol=0, atol=0)
        grad = {k: torch.from_numpy(rng.standard_normal(tuple(o.shape)).astype(np.float32))
                for k, o in out_a.items()}
        torch.autograd.backward(list(out_a.values()), [grad[k] for k in out_a])
        torch.autograd.backward(list(out_b.values()), [grad[k] for k in out_b])
    for t in TABLES:
        np.testing.assert_array_equal(a.collection.full_weights(t), b.collection.full_weights(t))
        assert not np.array_equal(a.collection.full_weights(t), make_collection().full_weights(t))


def test_module_kjt_weights_and_explicit_weights_conflict(rng):
    rows = {k: r for k, (r, _, _) in TABLES.items()}
    module = hbt.EmbeddingCollectionModule(make_collection())
    kjt = random_kjt(rng, ["user"], 4, rows, weighted=True)
    with raises(ValueError, match="weights"):
        module(kjt, per_sample_weights={"user": kjt.weights()})
    bad = KJT(keys=["user"], values=torch.tensor([20]), lengths=torch.tensor([1]))
    with raises(hbk.BoundsError):
        module(bad)


@pytest.mark.parametrize("weighted", [False, True])
def test_module_kjt_matches_torchrec_embedding_bag_collection(rng, weighted):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    coll = make_collection()
    module = hbt.EmbeddingCollectionModule(coll)
    pooling = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
    configs = [EmbeddingBagConfig(name=name, embedding_dim=d, num_embeddings=r, feature_names=[name],
                                  pooling=pooling[c])
               for name, (r, d, c) in TABLES.items() if not (weighted and c == "mean")]
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("cpu"))
    with torch.no_grad():
        for cfg in configs:
            ebc.embedding_bags[cfg.name].weight.copy_(torch.from_numpy(coll.full_weights(cfg.name)))
    keys = [cfg.name for cfg in configs]
    rows = {k: r for k, (r, _, _) in TABLES.items()}
    kjt = random_kjt(rng, keys, 13, rows, weighted=weighted)
    expected = ebc(copy.copy(kjt)).to_dict()
    with torch.no_grad():
        got = module(kjt)
    for key in keys:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


# -- the framework-free core: EmbeddingCollection.forward -------------------------------------------
@pytest.mark.parametrize("weighted", [False, True])
def test_collection_forward_and_backward_take_a_kjt(rng, weighted):
    kjt = random_kjt(rng, list(TABLES), 6, {k: v[0] for k, v in TABLES.items()}, weighted=weighted,
                     empty=("geo",))
    features, weights = as_dict(kjt)
    by_kjt, by_dict = make_collection(), make_collection()
    out = by_kjt.forward(kjt)
    expected = by_dict.forward({k: hbk.Ragged(v.numpy(), o.numpy()) for k, (v, o) in features.items()},
                               per_sample_weights=None if weights is None else
                               {k: w.numpy() for k, w in weights.items()})
    assert sorted(out) == sorted(TABLES)
    for k in TABLES:
        np.testing.assert_allclose(out[k], expected[k], rtol=1e-6)
    grads = {k: rng.standard_normal(out[k].shape).astype(np.float32) for k in TABLES}
    by_kjt.backward(grads)
    by_dict.backward(grads)
    for t in TABLES:
        np.testing.assert_array_equal(by_kjt.full_weights(t), by_dict.full_weights(t))
    if weighted:
        with raises(ValueError, match="KeyedJaggedTensor has weights"):
            by_kjt.forward(kjt, per_sample_weights={k: w.numpy() for k, w in weights.items()})
