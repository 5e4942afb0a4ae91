"""hbkernels.adapters.torch: the embedding_bag op against torch's own
(``F.embedding_bag``; for sqrtn and weighted mean a reference built from torch
ops), its gradients (dense and sparse, gradcheck in float64), the custom op
(opcheck, torch.compile), zero-copy crossings, EmbeddingCollectionModule in a
tiny DLRM step, the CUDA path (real GPU only) and the adapter benchmark."""
import copy
import csv
import doctest
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_offsets
from helpers import raises

torch = pytest.importorskip("torch")

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters import torch as hbt  # noqa: E402

F = torch.nn.functional
ROOT = Path(__file__).resolve().parents[1]
COMBINERS = ("sum", "mean", "sqrtn")
ID_DTYPES = {"int32": torch.int32, "int64": torch.int64}


@pytest.fixture(params=["fast", "op"])
def path(request, monkeypatch):
    """Eager calls through the autograd.Function fast path, or through the custom op."""
    monkeypatch.setattr(hbt, "EAGER_FAST_PATH", request.param == "fast")
    return request.param


def make_case(rng, num_rows=40, dim=7, batch=24, max_len=6, values_dtype="int64",
              offsets_dtype="int64", dtype=torch.float32):
    """Random table and CSR batch with empty bags, duplicate ids and both table edges."""
    offsets = random_offsets(rng, batch, max_len)
    n = int(offsets[-1])
    values = rng.integers(0, num_rows, size=n)
    if n >= 4:
        values[:4] = [0, num_rows - 1, num_rows - 1, 0]  # edges, duplicated
    weight = torch.from_numpy(rng.standard_normal((num_rows, dim))).to(dtype)
    return (weight, torch.from_numpy(values).to(ID_DTYPES[values_dtype]),
            torch.from_numpy(offsets).to(ID_DTYPES[offsets_dtype]))


def torch_ops_reference(weight, values, offsets, combiner, psw=None):
    """embedding_bag from differentiable torch ops: index_select, segment sums (index_add),
    mean = Σw·e / Σw, sqrtn = Σw·e / sqrt(Σw²); zero where the denominator is 0."""
    num_bags = offsets.shape[0] - 1
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    bag = torch.repeat_interleave(torch.arange(num_bags), lengths)
    w = torch.ones(values.shape[0], dtype=weight.dtype) if psw is None else psw
    rows = weight.index_select(0, values.to(torch.int64)) * w[:, None]
    sums = torch.zeros(num_bags, weight.shape[1], dtype=weight.dtype).index_add(0, bag, rows)
    if combiner == "sum":
        return sums
    denom = torch.zeros(num_bags, dtype=weight.dtype).index_add(0, bag, w if combiner == "mean" else w * w)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scale = 1.0 / (safe if combiner == "mean" else safe.sqrt())
    return sums * torch.where(denom > 0, scale, torch.zeros_like(scale))[:, None]


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# -- forward and gradients ------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 7, 16])
@pytest.mark.parametrize("mode", ["sum", "mean", "sum-weighted"])
@pytest.mark.parametrize("values_dtype,offsets_dtype", [("int64", "int64"), ("int32", "int32"),
                                                        ("int32", "int64")])
def test_matches_torch_embedding_bag(rng, path, dim, mode, values_dtype, offsets_dtype):
    weight, values, offsets = make_case(rng, dim=dim, values_dtype=values_dtype,
                                        offsets_dtype=offsets_dtype)
    weighted = mode == "sum-weighted"
    combiner = "sum" if weighted else mode
    psw = torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]).astype(np.float32)) if weighted else None
    grad_out = torch.from_numpy(rng.standard_normal((offsets.shape[0] - 1, dim)).astype(np.float32))

    w_hbk, w_ref = leaf(weight), leaf(weight)
    p_hbk, p_ref = (leaf(psw), leaf(psw)) if weighted else (None, None)
    out = hbt.embedding_bag(w_hbk, values, offsets, combiner=combiner, per_sample_weights=p_hbk)
    ref = F.embedding_bag(values.to(torch.int64), w_ref, offsets.to(torch.int64), mode=combiner,
                          per_sample_weights=p_ref, include_last_offset=True)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.requires_grad
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(grad_out)
    ref.backward(grad_out)
    assert w_hbk.grad.layout == torch.strided and w_hbk.grad.shape == weight.shape
    torch.testing.assert_close(w_hbk.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    if weighted:
        torch.testing.assert_close(p_hbk.grad, p_ref.grad, rtol=1e-5, atol=1e-5)
    # rows no bag looks up get exactly zero gradient
    untouched = np.setdiff1d(np.arange(weight.shape[0]), values.numpy())
    assert (w_hbk.grad[torch.from_numpy(untouched)] == 0).all()


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 5])
def test_matches_torch_ops_reference(rng, path, combiner, weighted, dim):
    """All combiners, weighted or not (torch has no sqrtn and no weighted mean)."""
    weight, values, offsets = make_case(rng, dim=dim, dtype=torch.float64)
    psw = torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0])) if weighted else None
    grad_out = torch.from_numpy(rng.standard_normal((offsets.shape[0] - 1, dim)))
    w_hbk, w_ref = leaf(weight), leaf(weight)
    p_hbk, p_ref = (leaf(psw), leaf(psw)) if weighted else (None, None)
    out = hbt.embedding_bag(w_hbk, values, offsets, combiner=combiner, per_sample_weights=p_hbk)
    ref = torch_ops_reference(w_ref, values, offsets, combiner, p_ref)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(w_hbk.grad, w_ref.grad, rtol=1e-12, atol=1e-12)
    if weighted:
        torch.testing.assert_close(p_hbk.grad, p_ref.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_sparse_grad_is_the_dense_one(rng, path, combiner):
    weight, values, offsets = make_case(rng, dim=3)
    psw = torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]).astype(np.float32))
    grad_out = torch.randn(offsets.shape[0] - 1, 3, generator=torch.Generator().manual_seed(1))
    w_dense, w_sparse = leaf(weight), leaf(weight)
    hbt.embedding_bag(w_dense, values, offsets, combiner=combiner,
                      per_sample_weights=psw).backward(grad_out)
    hbt.embedding_bag(w_sparse, values, offsets, combiner=combiner, per_sample_weights=psw,
                      sparse=True).backward(grad_out)
    g = w_sparse.grad
    assert g.layout == torch.sparse_coo and g.shape == weight.shape
    ids = g._indices()[0]
    assert sorted(ids.tolist()) == sorted(set(values.tolist()))  # the distinct ids, once each
    torch.testing.assert_close(g.to_dense(), w_dense.grad, rtol=1e-6, atol=1e-6)


def test_sparse_grad_trains_with_sparse_adam(rng, path):
    weight, values, offsets = make_case(rng, dim=4)
    w = leaf(weight)
    opt = torch.optim.SparseAdam([w], lr=0.1)
    hbt.embedding_bag(w, values, offsets, sparse=True).pow(2).sum().backward()
    opt.step()
    moved = (w.detach() != weight).any(1)
    assert set(torch.nonzero(moved)[:, 0].tolist()) == set(values.tolist())


def test_empty_batch_and_float16(rng, path):
    w = leaf(torch.randn(5, 3))
    out = hbt.embedding_bag(w, torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape == (0, 3)
    out.sum().backward()
    assert (w.grad == 0).all() and w.grad.shape == (5, 3)
    w16 = leaf(torch.randn(6, 4).half())
    v, o = torch.tensor([1, 5, 5]), torch.tensor([0, 1, 3])
    out16 = hbt.embedding_bag(w16, v, o, combiner="mean")
    assert out16.dtype == torch.float16
    ref = F.embedding_bag(v, w16.detach().float(), o, mode="mean", include_last_offset=True)
    torch.testing.assert_close(out16.float(), ref, rtol=1e-3, atol=1e-3)
    out16.float().sum().backward()
    assert w16.grad.dtype == torch.float16
    torch.testing.assert_close(w16.grad[5].float(), torch.full((4,), 1.0))


def test_bounds(rng, path):
    weight = torch.randn(6, 2, dtype=torch.float64)
    v, o = torch.tensor([1, 9, 2, -1]), torch.tensor([0, 2, 4])
    with raises(hbk.BoundsError, match="9"):
        hbt.embedding_bag(leaf(weight), v, o)
    psw = torch.tensor([0.5, 2.0, 1.5, 3.0], dtype=torch.float64)
    keep = torch.tensor([True, False, True, False])
    for combiner in COMBINERS:
        w, p = leaf(weight), leaf(psw)
        out = hbt.embedding_bag(w, v, o, combiner=combiner, per_sample_weights=p, bounds="zero")
        # a bad id is absent: the same as the bags without it
        w_ref, p_ref = leaf(weight), leaf(psw[keep])
        ref = torch_ops_reference(w_ref, v[keep], torch.tensor([0, 1, 2]), combiner, p_ref)
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(w.grad, w_ref.grad)
        torch.testing.assert_close(p.grad[keep], p_ref.grad)
        assert (p.grad[~keep] == 0).all()


def test_argument_errors():
    w = torch.randn(4, 2)
    v, o = torch.tensor([0, 1]), torch.tensor([0, 2])
    with raises(ValueError, match="combiner"):
        hbt.embedding_bag(w, v, o, combiner="max")
    with raises(ValueError, match="bounds"):
        hbt.embedding_bag(w, v, o, bounds="clip")
    with raises(ValueError, match="float16/bfloat16/float32/float64"):
        hbt.embedding_bag(w.to(torch.float8_e5m2), v, o)
    with raises(ValueError, match="malformed offsets"):
        hbt.embedding_bag(w, v, torch.tensor([0, 3]))
    with raises(ValueError, match="int32 or int64"):
        hbt.embedding_bag(w, v.to(torch.int16), o)


@pytest.mark.parametrize("grad", [False, True])
def test_arguments_that_are_not_tensors_are_type_errors(grad):
    """A NumPy array or a list where a tensor goes: a TypeError naming the argument, a
    torch tensor and what came (the API's rule for mixing array families)."""
    w = torch.randn(5, 2, requires_grad=grad)
    v, o = torch.tensor([1]), torch.tensor([0, 1])
    table = np.ones((5, 2), np.float32)
    with raises(TypeError, match=r"^weight must be a torch.Tensor or an hbk.QuantizedTable, "
                                 r"got numpy.ndarray$"):
        hbt.embedding_bag(table, v, o)
    with raises(TypeError, match="^weight must be .*, got list$"):
        hbt.embedding_bag(table.tolist(), v, o)
    with raises(TypeError, match=r"^values must be a torch.Tensor, got numpy.ndarray$"):
        hbt.embedding_bag(w, v.numpy(), o)
    with raises(TypeError, match=r"^offsets must be a torch.Tensor, got list$"):
        hbt.embedding_bag(w, v, [0, 1])
    with raises(TypeError, match=r"^per_sample_weights must be a torch.Tensor or None, got list$"):
        hbt.embedding_bag(w, v, o, per_sample_weights=[1.0])
    with raises(TypeError, match=r"^values must be a torch.Tensor, got numpy.ndarray$"):
        hbt.embedding_bag(hbk.quantize_rows(table, bits=8), v.numpy(), o)
    bag = hbt.EmbeddingBag(5, 2, mode="sum")
    with raises(TypeError, match=r"^offsets must be a torch.Tensor or None, got numpy.ndarray$"):
        bag(v, np.array([0]))
    with raises(TypeError, match=r"^per_sample_weights must be a torch.Tensor or None, got list$"):
        bag(v, torch.tensor([0]), per_sample_weights=[1.0])
    with raises(TypeError, match=r"^embeddings must be a torch.Tensor, got numpy.ndarray$"):
        hbt.EmbeddingBag.from_pretrained(table)
    with raises(TypeError, match=r"^expected a NumPy or CuPy array .*, got list$"):
        hbt.from_kernel_array([1.0, 2.0])


def test_no_grad_and_frozen_table_skip_autograd(rng):
    weight, values, offsets = make_case(rng)
    out = hbt.embedding_bag(weight, values, offsets)
    assert not out.requires_grad and out.grad_fn is None
    with torch.no_grad():
        assert hbt.embedding_bag(leaf(weight), values, offsets).grad_fn is None


def test_docstring_examples():
    result = doctest.testmod(hbt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- zero copy ------------------------------------------------------------------------------------
def test_cpu_zero_copy(rng, path, monkeypatch):
    weight, values, offsets = make_case(rng, dim=4)
    psw = torch.rand(values.shape[0])
    w = leaf(weight)
    seen = {}
    real_fwd, real_bwd = hbk.ops.embedding_bag, hbk.ops.embedding_bag_backward

    def ptr(a):
        return a.__array_interface__["data"][0]

    def spy_fwd(weights, v, o, **kw):
        seen["fwd"] = (ptr(weights), ptr(v), ptr(o), ptr(kw["per_sample_weights"]))
        seen["out"] = real_fwd(weights, v, o, **kw)
        return seen["out"]

    def spy_bwd(grad_out, v, o, **kw):
        seen["bwd"] = (ptr(grad_out), ptr(v), ptr(o))
        return real_bwd(grad_out, v, o, **kw)

    monkeypatch.setattr(hbt._ops, "embedding_bag", spy_fwd)
    monkeypatch.setattr(hbt._ops, "embedding_bag_backward", spy_bwd)
    out = hbt.embedding_bag(w, values, offsets, per_sample_weights=psw)
    assert seen["fwd"] == (w.data_ptr(), values.data_ptr(), offsets.data_ptr(), psw.data_ptr())
    assert out.data_ptr() == ptr(seen["out"])  # the kernel's output, not a copy
    grad = torch.randn(out.shape)
    out.backward(grad)
    assert seen["bwd"] == (grad.data_ptr(), values.data_ptr(), offsets.data_ptr())


# -- the custom op ----------------------------------------------------------------------------------
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck(rng, combiner, weighted):
    weight, values, offsets = make_case(rng, num_rows=12, dim=3, batch=6, values_dtype="int32")
    psw = torch.rand(values.shape[0]) + 0.5 if weighted else None
    for args in [(weight, values, offsets, combiner, psw, "raise", False),
                 (leaf(weight), values, offsets, combiner, None if psw is None else leaf(psw),
                  "raise", False),
                 (leaf(weight), values, offsets, combiner, psw, "zero", True)]:
        result = torch.library.opcheck(torch.ops.hbkernels.embedding_bag.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result
    grad = torch.randn(offsets.shape[0] - 1, 3)
    result = torch.library.opcheck(torch.ops.hbkernels.embedding_bag_backward.default,
                                   (grad, values, offsets, 12, combiner, psw, "raise"))
    assert all(v == "SUCCESS" for v in result.values()), result
    if weighted:
        result = torch.library.opcheck(torch.ops.hbkernels.per_sample_weights_backward.default,
                                       (grad, weight, values, offsets, psw, combiner, "zero"))
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_gradcheck_float64(rng, path, combiner, weighted):
    weight, values, offsets = make_case(rng, num_rows=9, dim=3, batch=7, max_len=4,
                                        dtype=torch.float64)
    inputs = [leaf(weight)]
    if weighted:
        inputs.append(leaf(torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]))))

    def fn(w, psw=None):
        return hbt.embedding_bag(w, values, offsets, combiner=combiner, per_sample_weights=psw)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("sparse", [False, True])
def test_torch_compile(rng, backend, sparse):
    """fullgraph compile: same outputs and gradients as eager. Each table is looked up
    once: with sparse=True, two sparse gradients of one table would have to be added
    inside the AOT backward graph, which torch 2.13 cannot trace (see the docstring)."""
    weight, values, offsets = make_case(rng, dim=5)
    other = torch.from_numpy(rng.standard_normal((50, 5)).astype(np.float32))
    psw = torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]).astype(np.float32))

    def model(w, w2, p, v, o):
        a = hbt.embedding_bag(w, v, o, combiner="sqrtn", per_sample_weights=p, sparse=sparse)
        b = hbt.embedding_bag(w2, v, o, combiner="mean", sparse=sparse)
        return (a * b).tanh().sum(), a

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    w1, o1, p1, w2, o2, p2 = (leaf(t) for t in (weight, other, psw, weight, other, psw))
    loss1, a1 = compiled(w1, o1, p1, values, offsets)
    loss2, a2 = model(w2, o2, p2, values, offsets)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(loss1, loss2)
    loss1.backward()
    loss2.backward()
    for g1, g2 in [(w1.grad, w2.grad), (o1.grad, o2.grad)]:
        assert g1.layout == g2.layout == (torch.sparse_coo if sparse else torch.strided)
        torch.testing.assert_close(g1.to_dense(), g2.to_dense())
        assert torch.abs(g1.to_dense()).sum() > 0
    torch.testing.assert_close(p1.grad, p2.grad)


def test_torch_compile_dense_table_used_twice(rng):
    weight, values, offsets = make_case(rng, dim=3)

    def model(w, v, o):
        return (hbt.embedding_bag(w, v, o) * hbt.embedding_bag(w, v, o, combiner="mean")).sum()

    torch._dynamo.reset()
    w1, w2 = leaf(weight), leaf(weight)
    torch.compile(model, backend="aot_eager", fullgraph=True)(w1, values, offsets).backward()
    model(w2, values, offsets).backward()
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.slow
def test_torch_compile_inductor(rng):
    weight, values, offsets = make_case(rng, dim=4)

    def model(w, v, o):
        return (hbt.embedding_bag(w, v, o, combiner="mean") * 3).sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    w1, w2 = leaf(weight), leaf(weight)
    loss1, loss2 = compiled(w1, values, offsets), model(w2, values, offsets)
    torch.testing.assert_close(loss1, loss2)
    loss1.backward()
    loss2.backward()
    torch.testing.assert_close(w1.grad, w2.grad)


# -- EmbeddingCollectionModule ---------------------------------------------------------------------
def dlrm_setup(rng, optimizer):
    tables = [hbk.TableSpec("user", num_rows=20, dim=4, combiner="sum"),
              hbk.TableSpec("item", num_rows=30, dim=4, combiner="mean", features=("item", "clicked")),
              hbk.TableSpec("geo", num_rows=7, dim=3, combiner="sqrtn")]
    coll = hbk.EmbeddingCollection(tables, comm=hbk.dist.init("local"), optimizer=optimizer,
                                   device="cpu", seed=3)
    batch = 16
    features, ragged = {}, {}
    for f, rows, dtype in [("user", 20, torch.int64), ("item", 30, torch.int32),
                           ("clicked", 30, torch.int64)]:
        offsets = random_offsets(rng, batch, 4)
        values = rng.integers(0, rows, size=int(offsets[-1]))
        ragged[f] = (torch.from_numpy(values).to(dtype), torch.from_numpy(offsets).to(dtype))
        features[f] = ragged[f]
    features["geo"] = torch.from_numpy(rng.integers(0, 7, size=batch))
    psw = {"user": torch.from_numpy(rng.uniform(0.5, 1.5, ragged["user"][0].shape[0]).astype(np.float32))}
    labels = torch.from_numpy(rng.integers(0, 2, size=(batch, 1)).astype(np.float32))
    return coll, features, psw, labels


def reference_outputs(tables, features, psw):
    """The pooled outputs from dense torch tables with F.embedding_bag (sqrtn of one id
    per bag is the row itself)."""
    out = {}
    for f, table, mode in [("user", "user", "sum"), ("item", "item", "mean"), ("clicked", "item", "mean")]:
        v, o = features[f]
        out[f] = F.embedding_bag(v.to(torch.int64), tables[table], o.to(torch.int64), mode=mode,
                                 per_sample_weights=psw.get(f), include_last_offset=True)
    out["geo"] = F.embedding(features["geo"], tables["geo"])
    return out


@pytest.mark.parametrize("opt_name", ["SGD", "Adagrad"])
def test_module_dlrm_step_matches_reference(rng, opt_name):
    make_opt = {"SGD": lambda: hbk.optim.SGD(lr=0.3), "Adagrad": lambda: hbk.optim.Adagrad(lr=0.2)}[opt_name]
    coll, features, psw, labels = dlrm_setup(rng, make_opt())
    module = hbt.EmbeddingCollectionModule(coll)
    assert list(module.parameters()) == []
    names = ["user", "item", "clicked", "geo"]
    initial = {t: coll.full_weights(t).copy() for t in coll.tables}
    top = torch.nn.Linear(4 + 4 + 4 + 3, 1)
    top_ref = copy.deepcopy(top)
    dense_opt, dense_opt_ref = (torch.optim.SGD(top.parameters(), lr=0.1),
                                torch.optim.SGD(top_ref.parameters(), lr=0.1))
    loss_fn = torch.nn.BCEWithLogitsLoss()

    # the module's step
    pooled = module(features, per_sample_weights=psw)
    assert list(pooled) == list(features)
    assert all(p.requires_grad for p in pooled.values())
    loss = loss_fn(top(torch.cat([pooled[f] for f in names], 1)), labels)
    dense_opt.zero_grad()
    loss.backward()
    dense_opt.step()

    # the reference: torch autograd on dense copies, then hbk.optim on the touched rows
    tables = {t: torch.from_numpy(w.copy()).requires_grad_() for t, w in initial.items()}
    ref_pooled = reference_outputs(tables, features, psw)
    for f in names:
        torch.testing.assert_close(pooled[f].detach(), ref_pooled[f].detach(), rtol=1e-5, atol=1e-6)
    loss_ref = loss_fn(top_ref(torch.cat([ref_pooled[f] for f in names], 1)), labels)
    torch.testing.assert_close(loss.detach(), loss_ref.detach())
    dense_opt_ref.zero_grad()
    loss_ref.backward()
    dense_opt_ref.step()
    for p, q in zip(top.parameters(), top_ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
    touched = {"user": features["user"][0], "geo": features["geo"],
               "item": torch.cat([features["item"][0].to(torch.int64), features["clicked"][0]])}
    for t in coll.tables:
        ids = np.unique(touched[t].numpy()).astype(np.int64)
        expected = initial[t].copy()
        opt = make_opt()
        opt.step(expected, opt.init_state(expected),
                 hbk.SparseGrad(ids, tables[t].grad.numpy()[ids].copy()))
        got = coll.full_weights(t)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=t)
        untouched = np.setdiff1d(np.arange(got.shape[0]), ids)
        np.testing.assert_array_equal(got[untouched], initial[t][untouched])  # bit-exact
        assert (got[ids] != initial[t][ids]).any(axis=1).all(), t  # every touched row moved


def test_module_one_backward_per_forward(rng):
    coll, features, psw, _ = dlrm_setup(rng, hbk.optim.SGD(lr=0.1))
    module = hbt.EmbeddingCollectionModule(coll)
    out = module(features)
    loss = sum(o.sum() for o in out.values())
    loss.backward(retain_graph=True)
    with raises(RuntimeError, match="twice"):
        loss.backward()
    stale = sum(o.sum() for o in module(features).values())
    module(features)  # a newer forward: the stale graph may no longer update the tables
    before = coll.full_weights("user").copy()
    with raises(RuntimeError, match="older forward"):
        stale.backward()
    np.testing.assert_array_equal(coll.full_weights("user"), before)


def test_module_eval_and_unused_outputs(rng):
    coll, features, psw, _ = dlrm_setup(rng, hbk.optim.SGD(lr=0.5))
    module = hbt.EmbeddingCollectionModule(coll)
    before = {t: coll.full_weights(t).copy() for t in coll.tables}
    with torch.no_grad():
        out = module(features)
    assert not any(o.requires_grad for o in out.values())
    for t in coll.tables:
        np.testing.assert_array_equal(coll.full_weights(t), before[t])
    # only "geo" reaches the loss: the other features get zero gradient, their rows stay
    module(features)["geo"].sum().backward()
    for t in ("user", "item"):
        np.testing.assert_array_equal(coll.full_weights(t), before[t])
    geo_ids = np.unique(features["geo"].numpy())
    expected = before["geo"].copy()
    counts = np.bincount(features["geo"].numpy(), minlength=7)[:, None]
    expected -= 0.5 * counts.astype(np.float32)  # SGD, d sum / d row = count of the row
    np.testing.assert_allclose(coll.full_weights("geo"), expected, rtol=1e-6)
    assert (coll.full_weights("geo")[geo_ids] != before["geo"][geo_ids]).all()


def test_module_rejects_bad_input(rng):
    coll, features, _, _ = dlrm_setup(rng, hbk.optim.SGD(lr=0.1))
    module = hbt.EmbeddingCollectionModule(coll)
    with raises(TypeError, match="dict"):
        module([features["geo"]])
    with raises(ValueError, match="values, offsets"):
        module({"user": (features["user"][0],)})
    with raises(TypeError, match="EmbeddingCollection"):
        hbt.EmbeddingCollectionModule(object())


def test_module_rejects_arrays_that_are_not_tensors(rng):
    coll, features, _, _ = dlrm_setup(rng, hbk.optim.SGD(lr=0.1))
    module = hbt.EmbeddingCollectionModule(coll)
    values, offsets = features["user"]
    with raises(TypeError, match=r"^feature 'geo' ids must be a torch.Tensor, got numpy.ndarray$"):
        module({**features, "geo": features["geo"].numpy()})
    with raises(TypeError, match=r"^feature 'user' offsets must be a torch.Tensor, got list$"):
        module({**features, "user": (values, offsets.tolist())})
    with raises(TypeError, match=r"^per_sample_weights\['geo'\] must be a torch.Tensor, got "
                                 r"numpy.ndarray$"):
        module(features, per_sample_weights={"geo": np.ones(len(features["geo"]), np.float32)})
    with raises(TypeError, match=r"^per_sample_weights must be a dict name -> weights or None, "
                                 r"got torch.Tensor$"):
        module(features, per_sample_weights=torch.ones(3))


# -- CUDA (real GPU only) --------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_zero_copy_on_current_stream(rng, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    cupy = pytest.importorskip("cupy")
    weight, values, offsets = make_case(rng, num_rows=1000, dim=33, batch=500, max_len=20)
    psw = torch.rand(values.shape[0], dtype=torch.float32)
    w_cpu = leaf(weight)
    ref = hbt.embedding_bag(w_cpu, values, offsets, combiner="sqrtn", per_sample_weights=psw)
    grad = torch.randn(ref.shape)
    ref.backward(grad)

    seen = {}
    real_fwd, real_bwd = hbk.ops.embedding_bag, hbk.ops.embedding_bag_backward

    def spy_fwd(weights, v, o, **kw):
        seen["fwd"] = (weights.data.ptr, v.data.ptr, o.data.ptr, cupy.cuda.get_current_stream().ptr)
        return real_fwd(weights, v, o, **kw)

    def spy_bwd(grad_out, v, o, **kw):
        seen["bwd"] = (grad_out.data.ptr, cupy.cuda.get_current_stream().ptr)
        return real_bwd(grad_out, v, o, **kw)

    monkeypatch.setattr(hbt._ops, "embedding_bag", spy_fwd)
    monkeypatch.setattr(hbt._ops, "embedding_bag_backward", spy_bwd)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        w = leaf(weight.cuda())
        v, o, p, g = values.cuda(), offsets.cuda(), psw.cuda(), grad.cuda()
        out = hbt.embedding_bag(w, v, o, combiner="sqrtn", per_sample_weights=p)
        assert seen["fwd"] == (w.data_ptr(), v.data_ptr(), o.data_ptr(), stream.cuda_stream)
        assert out.is_cuda
        out.backward(g)
        assert seen["bwd"][1] == stream.cuda_stream
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad, rtol=1e-5, atol=1e-5)


# -- the adapter benchmark ------------------------------------------------------------------------
def test_bench_adapters_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("HBK_BENCH_NO", "jax,tensorflow")  # the torch adapter's rows only
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    bench = importlib.import_module("hbkernels.bench.bench_adapters")
    common = importlib.import_module("hbkernels.bench.common")
    out = tmp_path / "x.csv"
    ctx = bench.main(["--smoke", "--out", str(out)])
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == common.COLUMNS
        rows = [r for r in reader if r["op"] == bench.OP]
    assert {(r["provider"], r["mode"]) for r in rows} == {
        (p, m) for p in ("hbkernels", "torch-adapter") for m in bench.ALL_MODES}
    for r in rows:
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"]), r
        assert r["size"] == "E=1000 D=16 B=64 L=4" and r["dtype"] == "float32" and r["device"]
    assert {(m, p) for m, p, *_ in bench.overheads(ctx)} == {(m, "torch-adapter") for m in bench.ALL_MODES}
