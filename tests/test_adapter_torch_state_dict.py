"""EmbeddingCollectionModule.state_dict() / load_state_dict(): the tables (weights,
optimizer slots, step) travel through ``torch.save(model.state_dict())`` and
``load_state_dict(torch.load(...))`` into a fresh model (any seed, plan or
placement), which then gives the same forward outputs and trains identically;
strict loading reports missing, unexpected and mis-shaped table keys as torch
does. The 2-rank case (sharded plans, collective gathering, write-back into
another plan's shards) runs under mpiexec when it is installed."""
import io
import textwrap

import numpy as np
import pytest
from conftest import random_offsets
from mpirun import assert_ok, mpirun, needs_mpi

torch = pytest.importorskip("torch")

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters import torch as hbt  # noqa: E402

TABLES = [("user", 20, 4, "sum", "float32"), ("item", 30, 4, "mean", "float32"),
          ("geo", 7, 3, "sum", "float32"), ("half", 9, 5, "mean", "float16")]
OPTIMIZERS = {"SGD": lambda: hbk.optim.SGD(lr=0.3), "Adagrad": lambda: hbk.optim.Adagrad(lr=0.2),
              "RowWiseAdagrad": lambda: hbk.optim.RowWiseAdagrad(lr=0.2),
              "Adam": lambda: hbk.optim.Adam(lr=0.05)}


def make_collection(opt="Adagrad", seed=3, plan="auto"):
    tables = [hbk.TableSpec(n, num_rows=r, dim=d, combiner=c, dtype=t) for n, r, d, c, t in TABLES]
    return hbk.EmbeddingCollection(tables, comm=hbk.dist.init("local"), optimizer=OPTIMIZERS[opt](),
                                   device="cpu", seed=seed, plan=plan)


class Model(torch.nn.Module):
    """A tiny DLRM: the collection, then a linear layer over the pooled features."""

    def __init__(self, coll):
        super().__init__()
        self.sparse = hbt.EmbeddingCollectionModule(coll)
        self.top = torch.nn.Linear(sum(d for _, _, d, _, _ in TABLES), 1)

    def forward(self, features):
        pooled = self.sparse(features)
        return self.top(torch.cat([pooled[n].float() for n, *_ in TABLES], 1))


def batch(rng, size=12):
    features = {}
    for name, rows, *_ in TABLES:
        offsets = random_offsets(rng, size, 4)
        values = rng.integers(0, rows, size=int(offsets[-1]))
        if values.shape[0] >= 2:
            values[:2] = [0, rows - 1]
        features[name] = (torch.from_numpy(values), torch.from_numpy(offsets))
    return features


def train(model, batches):
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    for features in batches:
        opt.zero_grad()
        model(features).square().mean().backward()
        opt.step()


def roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only: plain tensors


def assert_same_tables(a, b):
    for name in a.tables:
        np.testing.assert_array_equal(a.full_weights(name), b.full_weights(name), err_msg=name)
        sa, sb = a.full_state(name), b.full_state(name)
        assert sa.keys() == sb.keys()
        for slot in sa:
            np.testing.assert_array_equal(sa[slot], sb[slot], err_msg=f"{name}.{slot}")


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_state_dict_holds_the_tables(rng, opt):
    coll = make_collection(opt)
    module = hbt.EmbeddingCollectionModule(coll)
    train_batches = [batch(rng) for _ in range(2)]
    for features in train_batches:
        sum(o.float().sum() for o in module(features).values()).backward()
    state = module.state_dict()
    slots = [s for s, _ in coll.optimizer.slots]
    expected = [f"tables.{n}.{item}" for n, *_ in TABLES
                for item in ["weight"] + [f"optimizer.{s}" for s in slots] + ["optimizer.step"]]
    assert list(state) == expected
    for name, rows, dim, _, dtype in TABLES:
        w = state[f"tables.{name}.weight"]
        assert w.shape == (rows, dim) and w.dtype == getattr(torch, dtype)
        np.testing.assert_array_equal(w.numpy(), coll.full_weights(name))
        full = coll.full_state(name)
        for slot in slots:
            np.testing.assert_array_equal(state[f"tables.{name}.optimizer.{slot}"].numpy(), full[slot])
        assert int(state[f"tables.{name}.optimizer.step"]) == full["step"] == 2
    assert list(module.parameters()) == []  # still no nn.Parameter


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("plans", [("auto", "auto"), ("row_wise", "table_wise"),
                                   ("data_parallel", "column_wise")])
def test_save_load_then_same_outputs_and_training(rng, opt, plans):
    if opt == "RowWiseAdagrad" and "column_wise" in plans:
        pytest.skip("RowWiseAdagrad cannot be column_wise (the collection says so)")
    a = Model(make_collection(opt, seed=3, plan=plans[0]))
    train(a, [batch(rng) for _ in range(3)])
    saved = roundtrip(a.state_dict())
    assert "sparse.tables.user.weight" in saved and "top.weight" in saved
    b = Model(make_collection(opt, seed=11, plan=plans[1]))  # other initial tables
    assert not np.array_equal(a.sparse.collection.full_weights("user"),
                              b.sparse.collection.full_weights("user"))
    result = b.load_state_dict(saved)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same_tables(a.sparse.collection, b.sparse.collection)
    features = batch(rng)
    with torch.no_grad():
        torch.testing.assert_close(a(features), b(features), rtol=0, atol=0)
    more = [batch(rng) for _ in range(3)]
    train(a, more)
    train(b, more)
    assert_same_tables(a.sparse.collection, b.sparse.collection)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_strict_reports_missing_and_unexpected_table_keys(rng):
    a, b = Model(make_collection()), Model(make_collection(seed=9))
    state = a.state_dict()
    del state["sparse.tables.geo.weight"]
    state["sparse.tables.nope.weight"] = torch.zeros(2, 2)
    state["sparse.tables.user.optimizer.exp_avg"] = torch.zeros(20, 4)
    before = b.sparse.collection.full_weights("user").copy()
    with pytest.raises(RuntimeError) as info:
        b.load_state_dict(state)
    message = str(info.value)
    assert 'Missing key(s) in state_dict: "sparse.tables.geo.weight"' in message
    assert '"sparse.tables.nope.weight"' in message and "Unexpected key(s)" in message
    assert '"sparse.tables.user.optimizer.exp_avg"' in message
    result = b.load_state_dict(state, strict=False)
    assert result.missing_keys == ["sparse.tables.geo.weight"]
    assert sorted(result.unexpected_keys) == ["sparse.tables.nope.weight",
                                              "sparse.tables.user.optimizer.exp_avg"]
    assert not np.array_equal(before, a.sparse.collection.full_weights("user"))
    np.testing.assert_array_equal(b.sparse.collection.full_weights("user"),
                                  a.sparse.collection.full_weights("user"))
    assert not np.array_equal(b.sparse.collection.full_weights("geo"),
                              a.sparse.collection.full_weights("geo"))  # missing: left as it was


def test_size_mismatch_writes_nothing(rng):
    a, b = Model(make_collection()), Model(make_collection(seed=9))
    state = a.state_dict()
    state["sparse.tables.item.weight"] = torch.zeros(31, 4)
    before = {n: b.sparse.collection.full_weights(n).copy() for n, *_ in TABLES}
    with pytest.raises(RuntimeError, match=r"size mismatch for sparse.tables.item.weight"):
        b.load_state_dict(state)
    for name, w in before.items():
        np.testing.assert_array_equal(b.sparse.collection.full_weights(name), w)


def test_other_optimizer_loads_the_weights_with_strict_false(rng):
    a = Model(make_collection("Adam"))
    train(a, [batch(rng)])
    b = Model(make_collection("SGD", seed=4))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict(), strict=False)
    for name, *_ in TABLES:
        np.testing.assert_array_equal(b.sparse.collection.full_weights(name),
                                      a.sparse.collection.full_weights(name))


# -- two ranks -------------------------------------------------------------------------------------
SCRIPT = """
import io, sys
import numpy as np, torch
import hbkernels as hbk
from hbkernels.adapters import torch as hbt
from hbkernels.sharding.kinds.row_wise import dynamic_owner

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
TABLES = [hbk.TableSpec("a", num_rows=23, dim=6), hbk.TableSpec("b", num_rows=17, dim=6, combiner="mean"),
          hbk.TableSpec("c", num_rows=11, dim=4), hbk.TableSpec("d", num_rows=5, dim=6),
          hbk.TableSpec("e", num_rows=None, capacity=24, dim=6, evict="lfu", admit_count=2)]
POOL = np.random.default_rng(5).integers(-2**63, 2**63 - 1, 40, dtype=np.int64)

def module(plan, seed):
    coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=hbk.optim.Adagrad(lr=0.2),
                                   device="cpu", seed=seed, plan=plan)
    return hbt.EmbeddingCollectionModule(coll)

def step(m, k, pool=POOL):
    rng = np.random.default_rng([k, R])
    feats = {}
    for t in TABLES:
        lengths = rng.integers(0, 4, size=5)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = (rng.choice(pool, int(offsets[-1])) if t.dynamic
               else rng.integers(0, t.num_rows, size=int(offsets[-1])))
        feats[t.name] = (torch.from_numpy(ids), torch.from_numpy(offsets))
    out = m(feats)
    sum((o * o).sum() for o in out.values()).backward()
    return out

a = module({"a": "row_wise", "b": "column_wise", "c": "table_wise", "d": "data_parallel"}, 3)
for k in range(2):
    step(a, k)
step(a, 2, POOL[dynamic_owner(np, POOL, W) == 0])  # rank 1's shard gets no id: its clock counts it
buf = io.BytesIO()
torch.save(a.state_dict(), buf)  # collective: every rank gathers every table
buf.seek(0)
b = module({"a": "table_wise", "b": "row_wise", "c": "column_wise", "d": "row_wise"}, 8)
b.load_state_dict(torch.load(buf))

def same(x, y):
    for t in TABLES:
        wx, wy = x.full_weights(t.name), y.full_weights(t.name)
        for u, v in zip(wx, wy) if t.dynamic else [(wx, wy)]:
            np.testing.assert_array_equal(u, v)
        sx, sy = x.full_state(t.name), y.full_state(t.name)
        for slot in sx:
            np.testing.assert_array_equal(sx[slot], sy[slot])
    # the dynamic table's shard on this rank: its ids, scores, pending ids and clock
    hx, hy = x.hash_tables["e"].state(), y.hash_tables["e"].state()
    assert hx["step"] == hy["step"] > 0, (hx["step"], hy["step"])
    for k in ("ids", "last", "count"):
        np.testing.assert_array_equal(hx[k], hy[k], err_msg=k)
        np.testing.assert_array_equal(hx["pending"][k], hy["pending"][k], err_msg=k)

same(a.collection, b.collection)
live = a.collection.full_weights("e")[0]  # an id admitted later gets a row from the seed
for k in range(3, 5):
    oa, ob = step(a, k, live), step(b, k, live)
    for name in oa:
        assert torch.equal(oa[name], ob[name]), name
same(a.collection, b.collection)
print(f"OK rank {R}", flush=True)
"""


@needs_mpi
def test_two_ranks_sharded_save_and_load_into_another_plan(tmp_path):
    script = tmp_path / "state_dict_ranks.py"
    script.write_text(textwrap.dedent(SCRIPT))
    rc, out, _ = mpirun(2, script, timeout=240)
    assert_ok(rc, out, range(2))
