"""hbkernels.models.dlrm.DLRM against a reference written out by hand here: the
bottom and top MLPs as explicit matmuls with the model's own Linear weights, the
pooled embeddings as sums of rows of ``collection.full_weights`` bag by bag, the
dot interaction as a double loop over the pairs i > j. The reference runs in
float64 torch (autograd gives the reference gradients), and the collection's SGD
step is checked row by row against it."""
import numpy as np
import pytest
from conftest import HAVE_NUMBA_CUDA, SIMULATOR

torch = pytest.importorskip("torch")

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters.torch import EmbeddingCollectionModule  # noqa: E402
from hbkernels.models.dlrm import DLRM  # noqa: E402

LR = 0.5
# table -> (num_rows, the features looked up in it); num_rows unlike any layer width
TABLES = {"user": (23, ("user",)), "item": (31, ("item", "clicked")), "geo": (7, ("geo",))}
FEATURE_TABLE = {f: t for t, (_, fs) in TABLES.items() for f in fs}


def make_collection(dim, seed, device="cpu", optimizer=None):
    specs = [hbk.TableSpec(t, num_rows=n, dim=dim, features=fs) for t, (n, fs) in TABLES.items()]
    return hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"),
                                   optimizer=optimizer or hbk.optim.SGD(lr=LR), device=device,
                                   seed=seed)


def make_batch(rng, batch, kinds, dense_width):
    """``kinds``: feature -> "one" (1-D id tensor) or "multi" ((values, offsets), some bags
    empty, bag 0 empty when batch > 1). Returns (dense, model input, bags as lists of ids)."""
    sparse, bags = {}, {}
    for f, kind in kinds.items():
        rows = TABLES[FEATURE_TABLE[f]][0]
        if kind == "one":
            ids = rng.integers(0, rows, size=batch)
            if batch >= 2:
                ids[:2] = [0, rows - 1]  # both edges of the table
            sparse[f] = torch.from_numpy(ids.astype(np.int64))
            bags[f] = [[int(i)] for i in ids]
        else:
            lengths = rng.integers(0, 5, size=batch)
            if batch > 1:
                lengths[0] = 0
                lengths[1] = max(lengths[1], 2)
            values = rng.integers(0, rows, size=int(lengths.sum()))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            if values.size >= 3:
                values[-3:] = [rows - 1, rows - 1, 0]  # a repeated id, both edges
            dtype = torch.int32 if f == "clicked" else torch.int64
            sparse[f] = (torch.from_numpy(values).to(dtype), torch.from_numpy(offsets).to(dtype))
            bags[f] = [values[offsets[b]:offsets[b + 1]].tolist() for b in range(batch)]
    dense = torch.from_numpy(rng.standard_normal((batch, dense_width)).astype(np.float32))
    return dense, sparse, bags


def linears(seq):
    return [] if seq is None else [m for m in seq if isinstance(m, torch.nn.Linear)]


class Reference:
    """The DLRM forward written out in float64 torch, with leaf copies of the model's
    Linear weights and of the collection's tables (so autograd gives their gradients)."""

    def __init__(self, model, collection):
        self.bottom = [(l.weight.detach().double().clone().requires_grad_(),
                        l.bias.detach().double().clone().requires_grad_()) for l in linears(model.bottom)]
        self.top = [(l.weight.detach().double().clone().requires_grad_(),
                     l.bias.detach().double().clone().requires_grad_()) for l in linears(model.top)]
        self.initial = {t: collection.full_weights(t).copy() for t in TABLES}
        self.tables = {t: torch.from_numpy(w.astype(np.float64)).requires_grad_()
                       for t, w in self.initial.items()}

    def forward(self, dense, bags, features, num_dense, dim):
        batch = dense.shape[0]
        vectors = []
        if num_dense:
            h = dense.double()
            for w, b in self.bottom:  # Linear + ReLU, ReLU after the last one too
                h = torch.relu(h @ w.T + b)
            vectors.append(h)
        for f in features:
            table = self.tables[FEATURE_TABLE[f]]
            pooled = []
            for ids in bags[f]:
                acc = torch.zeros(dim, dtype=torch.float64)
                for i in ids:
                    acc = acc + table[i]
                pooled.append(acc)
            vectors.append(torch.stack(pooled) if pooled else torch.zeros((0, dim), dtype=torch.float64))
        n = len(vectors)
        order = [(i, j) for i in range(n) for j in range(i)]
        rows, cols = torch.tril_indices(n, n, -1)
        assert order == list(zip(rows.tolist(), cols.tolist()))  # the order the model documents
        per_sample = []
        for s in range(batch):
            dots = []
            for i in range(n):
                for j in range(i):
                    acc = torch.zeros((), dtype=torch.float64)
                    for k in range(dim):
                        acc = acc + vectors[i][s, k] * vectors[j][s, k]
                    dots.append(acc)
            per_sample.append(torch.stack(dots))
        pairs = torch.stack(per_sample) if per_sample else torch.zeros((0, len(order)), dtype=torch.float64)
        h = torch.cat([vectors[0], pairs], 1) if num_dense else pairs
        for k, (w, b) in enumerate(self.top):  # Linear + ReLU, bare Linear at the end
            h = h @ w.T + b
            if k < len(self.top) - 1:
                h = torch.relu(h)
        assert h.shape == (batch, 1)
        return h[:, 0]


def build(rng, dim, num_dense, features, bottom=(64,), top=(64, 32)):
    torch.manual_seed(int(rng.integers(2**31)))
    coll = make_collection(dim, seed=int(rng.integers(2**31)))
    module = EmbeddingCollectionModule(coll)
    model = DLRM(module, features, num_dense=num_dense, dim=dim, bottom=bottom, top=top)
    return coll, model


CASES = {
    # name: (dim, num_dense, feature -> input kind), in the model's feature order
    "mixed": (4, 3, {"item": "multi", "user": "one", "geo": "one", "clicked": "multi"}),
    "dim1": (1, 2, {"user": "one", "item": "multi"}),
    "odd_dim": (5, 4, {"geo": "multi", "clicked": "one", "user": "multi"}),
    "no_dense": (3, 0, {"user": "one", "item": "multi"}),
    "no_dense_three": (6, 0, {"clicked": "multi", "geo": "one", "user": "one"}),
    "one_sparse": (4, 5, {"item": "multi"}),
    "one_hot_only": (7, 1, {"geo": "one", "user": "one"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_reference(rng, case):
    dim, num_dense, kinds = CASES[case]
    features = list(kinds)
    coll, model = build(rng, dim, num_dense, features)
    assert (model.bottom is None) == (num_dense == 0)
    batch = 9
    dense, sparse, bags = make_batch(rng, batch, kinds, num_dense)
    ref = Reference(model, coll)
    expected = ref.forward(dense, bags, features, num_dense, dim)

    with torch.no_grad():  # evaluation: the collection's no-grad path, tables untouched
        logits_eval = model(dense, sparse)
    torch.testing.assert_close(logits_eval.double(), expected.detach(), rtol=1e-4, atol=1e-5)
    for t in TABLES:
        np.testing.assert_array_equal(coll.full_weights(t), ref.initial[t])

    logits = model(dense, sparse)
    assert logits.shape == (batch,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), expected.detach(), rtol=1e-4, atol=1e-5)

    labels = torch.from_numpy((rng.random(batch) < 0.5).astype(np.float32))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    loss_fn(logits, labels).backward()  # nothing else: the collection steps by itself
    loss_fn(expected, labels.double()).backward()

    # dense parameters: gradients as the reference's
    model_linears = linears(model.bottom) + linears(model.top)
    assert len(model_linears) == len(ref.bottom) + len(ref.top)
    for layer, (w, b) in zip(model_linears, ref.bottom + ref.top):
        assert layer.weight.grad is not None and layer.bias.grad is not None
        torch.testing.assert_close(layer.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer.bias.grad.double(), b.grad, rtol=1e-4, atol=1e-6)
    assert any(layer.weight.grad.abs().sum() > 0 for layer in model_linears)

    # tables: SGD on exactly the rows the batch touched
    touched = {t: set() for t in TABLES}
    for f in features:
        for ids in bags[f]:
            touched[FEATURE_TABLE[f]].update(ids)
    for t in TABLES:
        got = coll.full_weights(t)
        initial = ref.initial[t]
        ids = np.array(sorted(touched[t]), np.int64)
        untouched = np.setdiff1d(np.arange(initial.shape[0]), ids)
        np.testing.assert_array_equal(got[untouched], initial[untouched])  # bit for bit
        grad = ref.tables[t].grad
        grad = np.zeros(initial.shape) if grad is None else grad.numpy()  # a table no feature uses
        assert not grad[untouched].any()
        # a touched row moves unless its gradient is 0 (e.g. one-hot row x an empty bag only)
        moving = ids[grad[ids].any(axis=1)]
        assert moving.size >= min(ids.size, 1), t  # not vacuous
        assert (got[moving] != initial[moving]).any(axis=1).all(), f"{t}: a touched row did not move"
        expected_rows = initial.astype(np.float64) - LR * grad
        np.testing.assert_allclose(got, expected_rows, rtol=1e-4, atol=1e-6, err_msg=t)
    assert any(touched.values())


def test_only_dense_parameters(rng):
    coll, model = build(rng, 4, 3, ["user", "item", "clicked"], bottom=(8, 6), top=(5,))
    params = list(model.parameters())
    expected = [p for l in linears(model.bottom) + linears(model.top) for p in (l.weight, l.bias)]
    assert len(params) == len(expected) == 2 * (3 + 2)
    assert {id(p) for p in params} == {id(p) for p in expected}
    assert all(name.startswith(("bottom.", "top.")) for name, _ in model.named_parameters())
    assert list(model.embeddings.parameters()) == []
    shapes = {tuple(p.shape) for p in params}
    for t, (rows, _) in TABLES.items():
        assert (rows, 4) not in shapes and coll.full_weights(t).shape == (rows, 4)
    # the layer widths DLRM documents: bottom num_dense -> ... -> dim, top pairs + dim -> ... -> 1
    assert [l.in_features for l in linears(model.bottom)] == [3, 8, 6]
    assert linears(model.bottom)[-1].out_features == 4
    assert linears(model.top)[0].in_features == 4 * 3 // 2 + 4
    assert linears(model.top)[-1].out_features == 1


def test_fewer_than_two_vectors_raise(rng):
    coll = make_collection(4, seed=0)
    module = EmbeddingCollectionModule(coll)
    with pytest.raises(ValueError, match="at least two"):
        DLRM(module, ["user"], num_dense=0, dim=4)
    with pytest.raises(ValueError, match="at least two"):
        DLRM(module, [], num_dense=3, dim=4)
    with pytest.raises(ValueError, match="at least two"):
        DLRM(module, [], num_dense=0, dim=4)
    DLRM(module, ["user"], num_dense=1, dim=4)  # two vectors: fine
    DLRM(module, ["user", "geo"], num_dense=0, dim=4)


@pytest.mark.parametrize("num_dense", [0, 3])
def test_empty_batch(rng, num_dense):
    dim = 5
    kinds = {"user": "one", "item": "multi", "geo": "one"}
    coll, model = build(rng, dim, num_dense, list(kinds))
    dense, sparse, bags = make_batch(rng, 0, kinds, num_dense)
    assert sparse["user"].shape == (0,) and sparse["item"][1].tolist() == [0]
    before = {t: coll.full_weights(t).copy() for t in TABLES}
    logits = model(dense, sparse)
    assert logits.shape == (0,)
    logits.sum().backward()
    for t in TABLES:
        np.testing.assert_array_equal(coll.full_weights(t), before[t])
    for p in model.parameters():
        assert p.grad is not None and p.grad.abs().sum() == 0
    # the model still trains normally on the next (non-empty) batch
    dense, sparse, bags = make_batch(rng, 4, kinds, num_dense)
    ref = Reference(model, coll)
    expected = ref.forward(dense, bags, list(kinds), num_dense, dim)
    torch.testing.assert_close(model(dense, sparse).double(), expected.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_the_gpu_training_step_gives_the_cpu_result_without_waiting(rng):
    """The DLRM step with the collection on device="cuda" (in CI Numba's simulator, whose
    collection takes the CPU tensors as its CUDA arrays; torch on the GPU otherwise):
    the CPU's losses and tables, 4 kernel launches a step (one CSR check of the four
    features, one pooling launch for every table of the dtype, which also joins their bags
    for the backward, the fused Adagrad step's two kernels around its sort) and no host
    synchronisation."""
    if not HAVE_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    if not SIMULATOR and not torch.cuda.is_available():
        pytest.skip("needs torch on the GPU")
    from hbkernels._dispatch import host
    from hbkernels.cuda import _device, _launcher

    kinds = {"item": "multi", "user": "one", "geo": "one", "clicked": "multi"}
    batches = [make_batch(rng, 6, kinds, 3)[:2] for _ in range(3)]
    seed, tables = int(rng.integers(2**31)), {}
    for device in ("cpu", "cuda"):
        torch_device = "cuda" if device == "cuda" and not SIMULATOR else "cpu"
        coll = make_collection(4, seed, device, hbk.optim.Adagrad(lr=0.1))
        torch.manual_seed(seed)
        model = DLRM(EmbeddingCollectionModule(coll), list(kinds), num_dense=3, dim=4,
                     bottom=(4,), top=(4,)).to(torch_device)
        losses, counts = [], []
        for dense, sparse in batches:
            dense = dense.to(torch_device)
            sparse = {f: tuple(t.to(torch_device) for t in x) if isinstance(x, tuple)
                      else x.to(torch_device) for f, x in sparse.items()}
            hbk.synchronize()
            launches, syncs = _launcher.LAUNCHES[0], _device.HOST_SYNCS[0]
            loss = model(dense, sparse).sum()
            loss.backward()
            counts.append((_launcher.LAUNCHES[0] - launches, _device.HOST_SYNCS[0] - syncs))
            losses.append(float(loss.detach()))
        tables[device] = (losses, {t: np.asarray(host(coll.full_weights(t))) for t in TABLES})
        if device == "cuda":
            assert counts == [(4, 0)] * len(batches)
    np.testing.assert_allclose(tables["cuda"][0], tables["cpu"][0], rtol=1e-5)
    for t in TABLES:
        np.testing.assert_allclose(tables["cuda"][1][t], tables["cpu"][1][t], rtol=1e-5,
                                   atol=1e-6)
