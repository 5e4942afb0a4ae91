"""hbk.EmbeddingCollection against an independent float64 NumPy model
(tests/mpi/collection_reference.py).

* the model itself: pooling against ``hbk.embedding_bag``, its table gradient
  against finite differences of its forward, its optimizer steps against
  ``hbk.optim`` (tested against torch and the formulas in test_optim.py);
* one process (``comm=hbk.dist.init("local")``): bad specs and plan requests,
  training under every plan and optimizer against the model, initial weights
  that depend only on the seed and the table, forward/backward errors, an
  empty global batch, checkpoints (round trip, a corrupted or missing file
  raises CheckpointError naming it, a save that crashes midway leaves the
  previous checkpoint intact);
* across processes (``mpiexec -n 2`` and ``-n 3``): tests/mpi/collection.py
  and the checkpoint chain save (n=2) -> load (n=3) -> load again (n=1) of
  tests/mpi/checkpoint.py, each bounded by a timeout (a hang is a failure).
"""
import builtins
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
import collection_reference as cr  # noqa: E402
from mpirun import _env, assert_ok, mpirun, needs_mpi  # noqa: E402

TABLES = cr.table_specs(hbk)


def local():
    return hbk.dist.init("local")


def make(plan="table_wise", kind="Adagrad", tables=None, seed=0, **kw):
    tables = TABLES if tables is None else tables
    return hbk.EmbeddingCollection(tables, comm=local(), optimizer=cr.make_optimizer(hbk, kind),
                                   plan=cr.plan_request(plan), seed=seed, **kw)


# -- the model ------------------------------------------------------------------------------------
def test_reference_pooling_matches_embedding_bag():
    rng = np.random.default_rng(0)
    for step in range(3):
        gb = cr.global_batch(TABLES, "pool", step, 17 + step)
        for f, (values, offsets) in gb.bags.items():
            t = next(t for t in TABLES if f in cr.features_of(t))
            w = rng.standard_normal((t.num_rows, t.dim))
            psw = gb.psw.get(f)
            ours = cr.pool(w, values, offsets, t.combiner, psw)
            psw64 = None if psw is None else psw.astype(np.float64)
            theirs = hbk.embedding_bag(w, values, offsets, combiner=t.combiner,
                                       per_sample_weights=psw64)
            np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12, err_msg=f)
    # TF semantics by hand: mean = Σw·e/Σw, sqrtn = Σw·e/sqrt(Σw²), an empty bag is 0
    w = np.array([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]])
    values, offsets, psw = np.array([0, 2, 1]), np.array([0, 2, 2, 3]), np.array([0.5, 2.0, 3.0])
    np.testing.assert_allclose(cr.pool(w, values, offsets, "mean", psw),
                               [[(0.5 + 14) / 2.5, (1 + 22) / 2.5], [0, 0], [3, 5]])
    np.testing.assert_allclose(cr.pool(w, values, offsets, "sqrtn", psw),
                               [[14.5 / np.sqrt(4.25), 23 / np.sqrt(4.25)], [0, 0], [3, 5]])


def _loss(tables, weights, gb):
    """Σ over features and bags of <grad_out, pooled>, with a naive forward."""
    total = 0.0
    for t in tables:
        for f in cr.features_of(t):
            values, offsets = gb.bags[f]
            psw = gb.psw.get(f)
            for b in range(len(offsets) - 1):
                ids = values[offsets[b]:offsets[b + 1]]
                if len(ids) == 0:
                    continue
                wb = np.ones(len(ids)) if psw is None else psw[offsets[b]:offsets[b + 1]].astype(float)
                s = (wb[:, None] * weights[t.name][ids]).sum(axis=0)
                denom = {"sum": 1.0, "mean": wb.sum(), "sqrtn": np.sqrt((wb * wb).sum())}[t.combiner]
                pooled = s / denom if denom else 0 * s
                total += float(np.dot(gb.grads[f][b].astype(float), pooled))
    return total


def test_reference_gradient_is_the_dense_gradient():
    """Finite differences of the (linear) loss Σ <grad_out, forward> give the table
    gradient; the touched rows are exactly the ids of the batch."""
    defs = [dict(name="a", num_rows=6, dim=2, combiner="mean", features=("a", "item_hist")),
            dict(name="tiny", num_rows=4, dim=1, combiner="sqrtn"),
            dict(name="c", num_rows=5, dim=3, combiner="sum", features=("c", "cat"))]
    tables = cr.table_specs(hbk, defs)
    rng = np.random.default_rng(1)
    weights = {t.name: rng.standard_normal((t.num_rows, t.dim)) for t in tables}
    opt = cr.make_optimizer(hbk, "SGD")
    ref = cr.Reference(tables, opt, weights)
    gb = cr.global_batch(tables, "fd", 0, 9)
    grads = ref.gradients(gb)
    for t in tables:
        ids, rows = grads[t.name]
        seen = np.unique(np.concatenate([gb.bags[f][0] for f in cr.features_of(t)]))
        np.testing.assert_array_equal(ids, seen)
        dense = np.zeros((t.num_rows, t.dim))
        dense[ids] = rows
        fd = np.zeros_like(dense)
        for r in range(t.num_rows):
            for d in range(t.dim):
                plus = {k: v.copy() for k, v in weights.items()}
                minus = {k: v.copy() for k, v in weights.items()}
                plus[t.name][r, d] += 1.0
                minus[t.name][r, d] -= 1.0
                fd[r, d] = (_loss(tables, plus, gb) - _loss(tables, minus, gb)) / 2
        np.testing.assert_allclose(dense, fd, rtol=1e-9, atol=1e-9, err_msg=t.name)
    # a zero per-sample weight still touches its row
    assert any(np.any(w == 0) for w in gb.psw.values())


@pytest.mark.parametrize("kind", sorted(cr.SLOTS))
def test_reference_optimizers_match_hbk_optim(kind):
    """The model's update rules and fp16 storage against hbk.optim applied to the
    per-feature gradients of embedding_bag_backward (one step of every table per
    backward, also when a table has no ids; Adam's only when it has some, as the
    collection steps it)."""
    rng = np.random.default_rng(2)
    opt = cr.make_optimizer(hbk, kind)
    w0 = {t.name: rng.standard_normal((t.num_rows, t.dim)).astype(t.dtype) for t in TABLES}
    ref = cr.Reference(TABLES, opt, w0)
    w = {n: v.copy() for n, v in w0.items()}
    state = {n: opt.init_state(v) for n, v in w.items()}
    for step in range(3):
        gb = cr.global_batch(TABLES, "opt", step, 20, empty_features=("tiny",) if step == 1 else ())
        ref.backward(gb)
        for t in TABLES:
            ids, rows = [], []
            for f in cr.features_of(t):
                values, offsets = gb.bags[f]
                g = hbk.embedding_bag_backward(gb.grads[f], values, offsets, num_rows=t.num_rows,
                                               combiner=t.combiner, per_sample_weights=gb.psw.get(f))
                ids.append(g.ids)
                rows.append(g.rows)
            ids = np.concatenate(ids)
            if len(ids) or kind != "Adam":
                opt.step(w[t.name], state[t.name],
                         hbk.SparseGrad(ids, np.concatenate(rows).astype(np.float32)))
    for t in TABLES:
        cr.assert_close(w[t.name], ref.w[t.name], t.dtype, f"{kind} {t.name}")
        empty_once = kind == "Adam" and t.name == "tiny"  # its one feature empty at step 1
        assert int(state[t.name]["step"][0]) == ref.step[t.name] == (2 if empty_once else 3)
        for k in cr.SLOTS[kind]:
            cr.assert_close(state[t.name][k], ref.state[t.name][k], "float32", f"{kind} {t.name}.{k}")


def test_reference_global_batches_have_the_edge_cases():
    for W in (1, 2, 3):
        for step in range(3):
            b = cr.split(25, W, step)
            assert b[0] == 0 and b[-1] == 25 and all(x <= y for x, y in zip(b, b[1:]))
            if W > 1 and step != 1:
                assert any(x == y for x, y in zip(b, b[1:])), (W, step, b)  # an empty rank
    gb = cr.global_batch(TABLES, "edges", 0, 24)
    for t in TABLES:
        for f in cr.features_of(t):
            values, offsets = gb.bags[f]
            assert values.min() == 0 and values.max() == t.num_rows - 1, f
            assert len(np.unique(values)) < len(values), f  # duplicates
            if f not in cr.ONE_HOT:
                assert np.any(np.diff(offsets) == 0), f     # empty bags
    gb = cr.global_batch(TABLES, "edges", 1, 24, empty_features=("tiny",))
    assert len(gb.bags["tiny"][0]) == 0


# -- specs and plans ------------------------------------------------------------------------------
TS = hbk.TableSpec


@pytest.mark.parametrize("tables, exc", [
    (lambda: [], ValueError),
    (lambda: ["user"], TypeError),
    (lambda: [dict(name="a", num_rows=3, dim=2)], TypeError),
    (lambda: [TS("a", 0, 2)], ValueError),
    (lambda: [TS("a", 3, 0)], ValueError),
    (lambda: [TS("a", 2.5, 2)], ValueError),
    (lambda: [TS("", 3, 2)], ValueError),
    (lambda: [TS("a", 3, 2, combiner="max")], ValueError),
    (lambda: [TS("a", 3, 2, dtype="int32")], ValueError),
    (lambda: [TS("a", 3, 2, features=())], ValueError),
    (lambda: [TS("a", 3, 2), TS("a", 4, 2)], ValueError),
    (lambda: [TS("a", 3, 2, features=("x",)), TS("b", 3, 2, features=("y", "x"))], ValueError),
], ids=["empty", "str", "dict", "rows0", "dim0", "rows-float", "no-name", "combiner", "dtype",
        "no-features", "duplicate-name", "feature-in-two-tables"])
def test_bad_table_specs(tables, exc):
    with raises(exc):
        hbk.EmbeddingCollection(tables(), comm=local(), optimizer=hbk.optim.SGD(lr=0.1),
                                plan="table_wise")


@pytest.mark.parametrize("kwargs", [
    dict(plan="diagonal"), dict(plan={"nope": "row_wise"}), dict(plan={"user": "diagonal"}),
    dict(plan=42), dict(wire_dtype="int8"), dict(batch_size_hint=0), dict(memory_per_rank=-1),
    dict(plan="auto", memory_per_rank=64), dict(plan="table_wise", memory_per_rank=64),
    dict(optimizer="adagrad"), dict(device="tpu"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_requests(kwargs):
    kwargs = {"plan": "table_wise", "optimizer": hbk.optim.SGD(lr=0.1), **kwargs}
    with raises((ValueError, TypeError)):
        hbk.EmbeddingCollection(TABLES, comm=local(), **kwargs)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(hbk.CheckpointError, ValueError)


# -- training in one process -----------------------------------------------------------------------
LOCAL_CASES = [(p, "Adagrad", {}) for p in cr.PLANS + cr.NODE_PLANS] + [
    ("table_wise", "SGD", {}), ("row_wise", "Adam", {}), ("column_wise", "RowWiseAdagrad", {}),
    ("data_parallel", "Ftrl", {}), ("mixed", "Adam", {}), ("row_wise", "Adagrad", {"dedup": False}),
    ("column_wise", "Adagrad", {"wire_dtype": "float16"}),
]


@pytest.mark.parametrize("plan, kind, kw", LOCAL_CASES,
                         ids=[f"{p}-{k}{''.join(f'-{a}={b}' for a, b in kw.items())}"
                              for p, k, kw in LOCAL_CASES])
def test_training_matches_the_model(plan, kind, kw):
    opt = cr.make_optimizer(hbk, kind)
    request = cr.plan_request(plan)
    coll = hbk.EmbeddingCollection(TABLES, comm=local(), optimizer=opt, plan=request, seed=4,
                                   batch_size_hint=16, **kw)
    cr.check_plan(coll, TABLES, request, 1)
    init = None
    if plan != "table_wise":
        ref_coll = make("table_wise", "SGD", seed=4)
        init = {t.name: ref_coll.full_weights(t.name) for t in TABLES}
    cr.check_training(hbk, coll, local(), TABLES, opt, key=("local", plan, kind), steps=3,
                      init_weights=init, empty_at=1)


@pytest.mark.parametrize("plan", ["table_wise", "data_parallel"])
def test_training_one_array_of_several_combiners(plan):
    """Tables of one width share a fused array, pooled once per combiner: at world size 1 a
    group of one pool takes the fused backward-and-step, a group of several the backward
    of each pool and one step."""
    tables = cr.table_specs(hbk, (
        dict(name="user", num_rows=50, dim=3, combiner="sum", hotness=3.0),
        dict(name="item", num_rows=40, dim=3, combiner="mean", features=("item", "item_hist"),
             hotness=2.5),
        dict(name="tiny", num_rows=5, dim=3, combiner="sqrtn", hotness=2.0)))
    opt = cr.make_optimizer(hbk, "Adagrad")
    coll = hbk.EmbeddingCollection(tables, comm=local(), optimizer=opt, plan=plan, seed=1,
                                   batch_size_hint=16)
    assert len(coll.arrays) == 1
    cr.check_training(hbk, coll, local(), tables, opt, key=("local", "combiners", plan), steps=3,
                      empty_at=1)


@pytest.mark.parametrize("plan", ["table_wise", "data_parallel", "column_wise"])
def test_adam_counts_each_tables_steps(plan):
    """Adam's tables each keep their arrays and step count (the steps whose batch holds
    their ids), so a table first touched at step 3 takes torch SparseAdam's first
    update there, whatever the other tables did."""
    torch = pytest.importorskip("torch")
    tables = [hbk.TableSpec("a", num_rows=30, dim=4), hbk.TableSpec("b", num_rows=20, dim=4)]
    opt = hbk.optim.Adam(lr=0.1)
    coll = hbk.EmbeddingCollection(tables, comm=local(), optimizer=opt, plan=plan, seed=3)
    assert len({s.group for t in tables for s in coll.layout.shards[t.name]}) >= 2
    start = coll.full_weights("b").copy()
    rng = np.random.default_rng(5)
    params = {t.name: torch.nn.Parameter(torch.from_numpy(coll.full_weights(t.name).copy()))
              for t in tables}
    ref = {name: torch.optim.SparseAdam([p], lr=0.1) for name, p in params.items()}
    for step in range(3):
        ids = {"a": rng.integers(0, 30, 6), "b": rng.integers(0, 20, 6 if step == 2 else 0)}
        grads = {name: rng.standard_normal((6, 4)).astype(np.float32) for name in ids}
        lengths = {"a": np.ones(6, np.int64), "b": np.full(6, 1 if step == 2 else 0)}
        feats = {n: hbk.Ragged(ids[n], np.concatenate([[0], np.cumsum(lengths[n])])) for n in ids}
        coll.forward(feats)
        coll.backward(grads)
        for name, p in params.items():
            if len(ids[name]) == 0:
                continue  # torch: no gradient, no step
            dense = np.zeros(tuple(p.shape), np.float32)
            np.add.at(dense, ids[name], grads[name][np.repeat(np.arange(6), lengths[name])])
            rows = np.unique(ids[name])
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(rows[None]),
                                             torch.from_numpy(dense[rows]), tuple(p.shape),
                                             check_invariants=True)
            ref[name].step()
    assert [int(coll.full_state(n)["step"]) for n in ("a", "b")] == [3, 1]
    for name, p in params.items():
        np.testing.assert_allclose(coll.full_weights(name), p.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    moved = np.abs(coll.full_weights("b") - start).max()
    assert moved == pytest.approx(0.1, rel=1e-3)  # Adam's first step: lr, not 0.64 lr


def test_initial_weights_depend_only_on_the_seed_and_the_table():
    a = make("table_wise", "SGD", seed=7)
    # other tables beside them, another order, optimizer and plan: same tables
    sub = [TABLES[4], TABLES[0], cr.table_specs(hbk, [dict(name="other", num_rows=9, dim=2)])[0]]
    b = make("row_wise", "Adam", tables=sub, seed=7)
    c = make("table_wise", "SGD", seed=8)
    for t in (TABLES[4], TABLES[0]):
        wa = a.full_weights(t.name)
        np.testing.assert_array_equal(wa, b.full_weights(t.name), err_msg=t.name)
        assert not np.array_equal(wa, c.full_weights(t.name)), f"{t.name}: the seed changed nothing"
    assert not np.array_equal(a.full_weights("user")[:9, :2], b.full_weights("other"))


def test_forward_returns_the_table_dtype_and_accepts_int32_ids():
    coll = make("row_wise")
    ref = cr.Reference(TABLES, cr.make_optimizer(hbk, "Adagrad"),
                       {t.name: coll.full_weights(t.name) for t in TABLES})
    gb = cr.global_batch(TABLES, "int32", 0, 10)
    feats, psw, _ = gb.local(0, 10)
    feats32 = {f: (v.astype(np.int32) if isinstance(v, np.ndarray)
                   else hbk.Ragged(v.values.astype(np.int32), v.offsets.astype(np.int32)))
               for f, v in feats.items()}
    out = coll.forward(feats32, per_sample_weights=psw)
    for f, e in ref.forward(gb).items():
        t = ref.tables[ref.feature_table[f]]
        assert out[f].dtype == np.dtype(t.dtype)
        cr.assert_close(out[f], e, t.dtype, f)


def test_call_seconds_add_up_each_forward_and_backward():
    """``call_seconds``: the host seconds of every forward and backward call, failed
    ones included (each adds to its own entry only)."""
    coll = make("row_wise")
    assert coll.call_seconds == {"forward": 0.0, "backward": 0.0}
    feats, psw, _ = cr.global_batch(TABLES, "int64", 0, 10).local(0, 10)
    out = coll.forward(feats, per_sample_weights=psw)
    after_forward = dict(coll.call_seconds)
    assert after_forward["forward"] > 0 and after_forward["backward"] == 0
    coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})
    assert coll.call_seconds["forward"] == after_forward["forward"]
    assert coll.call_seconds["backward"] > 0
    before = coll.call_seconds["backward"]
    with raises(RuntimeError, match="needs a forward first"):
        coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})
    assert coll.call_seconds["backward"] > before


def test_forward_and_backward_errors():
    coll = make("row_wise")
    w_before = {t.name: coll.full_weights(t.name).copy() for t in TABLES}
    gb = cr.global_batch(TABLES, "errors", 0, 8)
    feats, psw, grads = gb.local(0, 8)
    with raises(ValueError, match="nope"):
        coll.forward({**feats, "nope": np.zeros(8, np.int64)}, per_sample_weights=psw)
    with raises(ValueError, match="nope"):
        coll.forward(feats, per_sample_weights={**psw, "nope": np.ones(2, np.float32)})
    with raises(ValueError):  # per-sample weights of the wrong length
        long = np.ones(len(psw["tiny"]) + 1, np.float32)
        coll.forward(feats, per_sample_weights={**psw, "tiny": long})
    with raises((ValueError, TypeError)):  # float ids
        coll.forward({**feats, "cat": feats["cat"].astype(np.float32)}, per_sample_weights=psw)
    bad = dict(feats)
    v, o = feats["user"]
    v = v.copy()
    v[1] = 300
    bad["user"] = hbk.Ragged(v, o)
    with raises(hbk.BoundsError, match=r"feature 'user': values\[1\] = 300"):
        coll.forward(bad, per_sample_weights=psw)
    with raises(ValueError, match="feature 'user': malformed offsets"):
        coll.forward({**feats, "user": hbk.Ragged(v, o[::-1].copy())}, per_sample_weights=psw)
    with raises(hbk.BoundsError, match="-1"):
        coll.forward({**feats, "cat": np.concatenate([[-1], feats["cat"][1:]])}, per_sample_weights=psw)
    for t in TABLES:
        np.testing.assert_array_equal(coll.full_weights(t.name), w_before[t.name])

    coll2 = make("table_wise")
    with raises((ValueError, RuntimeError)):  # backward before any forward
        coll2.backward(grads)
    coll.forward(feats, per_sample_weights=psw)
    with raises(ValueError, match="user"):
        coll.backward({k: g for k, g in grads.items() if k != "user"})
    with raises(ValueError, match="user"):
        coll.backward({**grads, "user": np.zeros((8, 9), np.float32)})
    with raises(ValueError, match="item"):
        coll.backward({**grads, "item": np.zeros((9, 5), np.float32)})
    with raises(ValueError, match="nope"):
        coll.backward({**grads, "nope": np.zeros((8, 2), np.float32)})
    for f in grads:  # a NaN or Inf in any feature's gradient: no table is updated
        bad = {**grads, f: grads[f].copy()}
        bad[f][-1, -1] = np.inf if f == "user" else np.nan
        with raises(ValueError, match=f"grad of {f!r} has NaN or Inf in row {len(bad[f]) - 1}"):
            coll.backward(bad)
    for t in TABLES:  # rejected calls change nothing
        np.testing.assert_array_equal(coll.full_weights(t.name), w_before[t.name])
        assert int(np.asarray(coll.full_state(t.name)["step"]).reshape(-1)[0]) == 0


@pytest.mark.parametrize("kind", ["Adam", "Adagrad"])
@pytest.mark.parametrize("plan", ["row_wise", "data_parallel"])
def test_empty_global_batch_moves_nothing(plan, kind):
    """Nothing moves; Adam counts no step (no table had ids), Adagrad, whose update does
    not use the count, counts one."""
    coll = make(plan, kind)
    before = {t.name: coll.full_weights(t.name).copy() for t in TABLES}
    state = {t.name: {k: np.array(v, copy=True) for k, v in coll.full_state(t.name).items()}
             for t in TABLES}
    feats = {}
    for t in TABLES:
        for f in cr.features_of(t):
            feats[f] = (np.zeros(0, np.int64) if f in cr.ONE_HOT
                        else hbk.Ragged(np.zeros(0, np.int64), np.zeros(1, np.int64)))
    out = coll.forward(feats)
    grads = {}
    for t in TABLES:
        for f in cr.features_of(t):
            assert out[f].shape == (0, t.dim) and out[f].dtype == np.dtype(t.dtype), f
            grads[f] = np.zeros((0, t.dim), np.float32)
    coll.backward(grads)
    for t in TABLES:
        np.testing.assert_array_equal(coll.full_weights(t.name), before[t.name])
        st = coll.full_state(t.name)
        assert int(np.asarray(st["step"]).reshape(-1)[0]) == (0 if kind == "Adam" else 1), t.name
        for slot in cr.SLOTS[kind]:
            np.testing.assert_array_equal(st[slot], state[t.name][slot])


def test_a_forward_without_a_replicated_tables_features():
    """A forward that leaves out every feature of a data_parallel table: its
    backward adds nothing to it (it used to concatenate an empty list)."""
    tables = [hbk.TableSpec("small", num_rows=10, dim=3), hbk.TableSpec("big", num_rows=50, dim=3)]
    coll = hbk.EmbeddingCollection(tables, comm=local(), optimizer=hbk.optim.SGD(lr=0.5),
                                   plan={"small": "data_parallel", "big": "row_wise"}, seed=2)
    small, big = coll.full_weights("small").copy(), coll.full_weights("big").copy()
    out = coll.forward({"big": np.array([4, 49])})
    assert set(out) == {"big"}
    coll.backward({"big": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(coll.full_weights("small"), small)
    expected = big.copy()
    expected[[4, 49]] -= 0.5
    np.testing.assert_allclose(coll.full_weights("big"), expected, rtol=1e-6)


def test_a_replicated_and_a_sharded_table_in_one_fused_array():
    """Tables of one width share a fused array whether replicated or sharded: at world
    size 1 each pools its own features once, and the backward updates both (it used to
    keep one pool's fused step and drop the other's)."""
    tables = [hbk.TableSpec("small", num_rows=12, dim=3), hbk.TableSpec("big", num_rows=30, dim=3)]
    coll = hbk.EmbeddingCollection(tables, comm=local(), optimizer=hbk.optim.SGD(lr=0.5),
                                   plan={"small": "data_parallel"}, seed=2)
    assert len(coll.arrays) == 1
    rng = np.random.default_rng(3)
    want = {t.name: coll.full_weights(t.name).astype(np.float64) for t in tables}
    features, grads = {}, {}
    for t in tables:
        offsets = np.array([0, 3, 3, 7])
        values = rng.integers(0, t.num_rows, 7)
        values[0] = values[1] = t.num_rows - 1  # a repeated id, at the table's edge
        features[t.name] = hbk.Ragged(values, offsets)
        grads[t.name] = rng.standard_normal((3, 3)).astype(np.float32)
        for b in range(3):
            np.subtract.at(want[t.name], values[offsets[b]:offsets[b + 1]], 0.5 * grads[t.name][b])
    coll.forward(features)
    coll.backward(grads)
    for t in tables:
        np.testing.assert_allclose(coll.full_weights(t.name), want[t.name], rtol=1e-5, atol=1e-6,
                                   err_msg=t.name)


# -- checkpoints in one process -----------------------------------------------------------------
def _trained(tmp_path, kind="Adam", plan="mixed", steps=2, key="ckpt-local"):
    opt = cr.make_optimizer(hbk, kind)
    coll = hbk.EmbeddingCollection(TABLES, comm=local(), optimizer=opt,
                                   plan=cr.plan_request(plan), seed=9)
    ref = cr.check_training(hbk, coll, local(), TABLES, opt, key=key, steps=steps, empty_at=1)
    return coll, ref


def _snapshot(coll):
    out = {}
    for t in TABLES:
        out[f"w/{t.name}"] = coll.full_weights(t.name).copy()
        for k, v in coll.full_state(t.name).items():
            out[f"s/{t.name}/{k}"] = np.array(v, copy=True)
    return out


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)), k


def _files(root):
    return sorted(p for p in Path(root).rglob("*") if p.is_file())


def _digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in _files(root)}


def test_checkpoint_round_trip_and_replan(tmp_path):
    coll, ref = _trained(tmp_path)
    path = tmp_path / "ckpt"
    coll.save(str(path))
    snap = _snapshot(coll)
    loaded = hbk.EmbeddingCollection.load(str(path), comm=local())   # saved optimizer and plan
    cr.check_plan(loaded, TABLES, cr.plan_request("mixed"), 1)
    _assert_same(_snapshot(loaded), snap)
    cr.check_training(hbk, loaded, local(), TABLES, ref.opt, key="ckpt-local", steps=1,
                      first_step=2, ref=ref)
    other = hbk.EmbeddingCollection.load(path, comm=local(), plan="column_wise",
                                         optimizer=cr.make_optimizer(hbk, "Adam"))
    cr.check_plan(other, TABLES, "column_wise", 1)
    _assert_same(_snapshot(other), snap)
    # saving over an existing checkpoint replaces it
    loaded.save(str(path))
    _assert_same(_snapshot(hbk.EmbeddingCollection.load(str(path), comm=local())), _snapshot(loaded))


def test_load_a_subset_of_the_tables(tmp_path):
    coll, _ = _trained(tmp_path)  # the "mixed" plan: a dict naming every table
    path = tmp_path / "ckpt"
    coll.save(str(path))
    snap = _snapshot(coll)
    names = [TABLES[1].name, TABLES[-1].name]
    part = hbk.EmbeddingCollection.load(path, comm=local(), tables=names)
    assert list(part.tables) == names
    assert set(part.feature_table.values()) == set(names)
    for name in names:
        assert np.array_equal(part.full_weights(name), snap[f"w/{name}"]), name
        for k, v in part.full_state(name).items():
            assert np.array_equal(np.asarray(v), snap[f"s/{name}/{k}"]), (name, k)
    only = hbk.EmbeddingCollection.load(path, comm=local(), tables=TABLES[0].name)  # one name
    assert list(only.tables) == [TABLES[0].name]
    for bad in (["nobody"], [], [TABLES[0].name, "nobody"]):
        with raises(ValueError, match="tables must name tables of"):
            hbk.EmbeddingCollection.load(path, comm=local(), tables=bad)


def test_load_on_a_collection_says_it_returns_a_new_one(tmp_path):
    coll, _ = _trained(tmp_path, steps=1)
    coll.save(str(tmp_path / "ckpt"))
    with raises(TypeError, match="class method returning a new collection.*"
                                 "coll = hbk.EmbeddingCollection.load"):
        coll.load(tmp_path / "ckpt", local())


def _corruption_case(tmp_path):
    coll, _ = _trained(tmp_path, steps=1)
    path = tmp_path / "ckpt"
    coll.save(str(path))
    files = _files(path)
    assert files, "save wrote no files"
    return path, files


def _expect_checkpoint_error(path, name):
    with raises(hbk.CheckpointError) as e:
        hbk.EmbeddingCollection.load(str(path), comm=local())
    assert name in str(e.value), f"the message does not name {name}: {e.value}"


def test_a_corrupted_file_raises_checkpoint_error_naming_it(tmp_path):
    path, files = _corruption_case(tmp_path)
    for f in files:
        rel = f.relative_to(path)
        broken = tmp_path / f"broken-{len(rel.parts)}-{f.name}"
        shutil.copytree(path, broken)
        target = broken / rel
        data = bytearray(target.read_bytes())
        mid = len(data) // 2
        for i in range(mid, min(mid + 4, len(data))):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
        _expect_checkpoint_error(broken, f.name)
        target.write_bytes(bytes(data[: len(data) // 3]))   # truncated
        _expect_checkpoint_error(broken, f.name)
        shutil.rmtree(broken)


def test_a_missing_file_raises_checkpoint_error_naming_it(tmp_path):
    path, files = _corruption_case(tmp_path)
    for f in files:
        rel = f.relative_to(path)
        broken = tmp_path / "broken"
        shutil.copytree(path, broken)
        (broken / rel).unlink()
        _expect_checkpoint_error(broken, f.name)
        shutil.rmtree(broken)
    _expect_checkpoint_error(tmp_path / "never-saved", "never-saved")


class _Crash(OSError):
    pass


def _crashed(e):
    """``e`` is the simulated crash or was raised from it."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, _Crash) or "simulated crash" in str(e):  # raised, wrapped or reported
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _patch_writes(monkeypatch, root, crash_at):
    """Count the file writes and renames under ``root`` (open for writing, os.open
    with O_WRONLY/O_RDWR, os.replace, os.rename); raise _Crash at number
    ``crash_at`` (never when None). Returns the list of events."""
    root = os.path.realpath(root)
    events = []

    def under(p):
        try:
            return os.path.realpath(os.fspath(p)).startswith(root)
        except TypeError:
            return False

    def event(what):
        events.append(what)
        if crash_at is not None and len(events) == crash_at:
            raise _Crash(f"simulated crash at {what}")

    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open
    real_replace, real_rename = os.replace, os.rename

    def fake_open(file, mode="r", *a, **k):
        if not isinstance(file, int) and any(c in mode for c in "wax+") and under(file):
            event(f"open {file}")
        return real_open(file, mode, *a, **k)

    def fake_io_open(file, mode="r", *a, **k):
        if not isinstance(file, int) and any(c in mode for c in "wax+") and under(file):
            event(f"open {file}")
        return real_io_open(file, mode, *a, **k)

    def fake_os_open(file, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR) and under(file):
            event(f"os.open {file}")
        return real_os_open(file, flags, *a, **k)

    def fake_replace(src, dst, *a, **k):
        if under(src) or under(dst):
            event(f"replace {src} -> {dst}")
        return real_replace(src, dst, *a, **k)

    def fake_rename(src, dst, *a, **k):
        if under(src) or under(dst):
            event(f"rename {src} -> {dst}")
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_io_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "replace", fake_replace)
    monkeypatch.setattr(os, "rename", fake_rename)
    return events


def test_a_save_that_crashes_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The crash hits every write or rename of a save in turn (a save over an
    existing checkpoint): each time the checkpoint at the path still loads, equal
    bit for bit to the previous save or, once the new one is complete, to the new
    one; a crash at the first write leaves the previous files untouched."""
    coll, ref = _trained(tmp_path, steps=1)
    path = tmp_path / "ckpt"
    coll.save(str(path))
    old = _snapshot(coll)
    pristine = tmp_path / "pristine"
    shutil.copytree(path, pristine, symlinks=True)
    old_files = _digest(path)
    cr.check_training(hbk, coll, local(), TABLES, ref.opt, key="ckpt-local", steps=1,
                      first_step=1, ref=ref)
    new = _snapshot(coll)

    scratch = tmp_path / "count"
    shutil.copytree(path, scratch, symlinks=True)
    with monkeypatch.context() as m:
        events = _patch_writes(m, tmp_path, None)
        coll.save(str(scratch))
    n = len(events)
    assert n >= 2, f"a save wrote only {events}; the crash test cannot reach midway"
    _assert_same(_snapshot(hbk.EmbeddingCollection.load(str(scratch), comm=local())), new)

    for k in range(1, n + 1):
        with monkeypatch.context() as m:
            events = _patch_writes(m, tmp_path, k)
            with raises(Exception) as e:
                coll.save(str(path))
            assert _crashed(e.value), f"save raised {e.value!r}, not the simulated crash"
        try:
            got = _snapshot(hbk.EmbeddingCollection.load(str(path), comm=local()))
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"a crash at {events[-1]} (write {k} of {n}) left no loadable "
                                 f"checkpoint: {e!r}") from e
        if k == 1:
            assert _digest(path) == old_files, "a crash at the first write changed the old files"
        try:
            _assert_same(got, old)
        except AssertionError:
            assert k > 1, "a crash at the first write loads as the new checkpoint"
            _assert_same(got, new)   # the new checkpoint, whole
        # back to the old checkpoint for the next crash point (leftovers stay, as after a crash)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        shutil.copytree(pristine, path, symlinks=True)


# -- across processes ----------------------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collection_across_ranks(n):
    """Every plan and optimizer, dedup off, fp16 on the wire, uneven and empty
    local batches: each rank's forward slice and the full tables and state
    against the model."""
    rc, out, _ = mpirun(n, "collection.py", "train", timeout=300)
    assert_ok(rc, out, range(n))


@needs_mpi
@pytest.mark.parametrize("n, g", [(2, 1), (3, 2), (4, 2)])
def test_hierarchical_exchange_across_nodes(n, g):
    """Ranks in nodes of g, the exchange hierarchical: sharded plans and optimizers train
    as one rank does (dedup off, fp16 on the wire too); the forward equals the flat
    exchange's and one rank's bit for bit, with strictly fewer bytes across nodes."""
    rc, out, _ = mpirun(n, "collection.py", "hierarchical", g, timeout=300)
    assert_ok(rc, out, range(n))
    assert "bytes across nodes, within nodes" in out


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collection_errors_across_ranks(n):
    """ValueErrors on every rank change nothing; an out-of-range id on rank 1 is a
    BoundsError there and a CommError elsewhere within HBK_COMM_TIMEOUT=20 s."""
    rc, out, _ = mpirun(n, "collection.py", "errors", env=_env(HBK_COMM_TIMEOUT=20), timeout=150)
    assert_ok(rc, out, range(n))


@needs_mpi
def test_checkpoint_across_world_sizes(tmp_path):
    """save at 2 ranks -> load at 3 (bit-equal, trains on) -> save -> load at 1."""
    for n, mode in [(2, "save"), (3, "load"), (1, "load-again")]:
        rc, out, _ = mpirun(n, "checkpoint.py", mode, str(tmp_path), timeout=150)
        assert_ok(rc, out, range(n))
        assert (tmp_path / "expected.npz").exists()


@needs_mpi
def test_checkpoints_of_the_placements_over_nodes(tmp_path):
    """table_row_wise, table_column_wise, grid and a mix, saved at 2 ranks (2 nodes of 1),
    load at 1, 3 and 4 ranks (nodes of 2) into themselves and each one-node placement bit
    for bit, and one-node saves load into each of them."""
    rc, out, _ = mpirun(2, "checkpoint.py", "nodes-save", str(tmp_path), timeout=200)
    assert_ok(rc, out, range(2))
    for n in (1, 3, 4):
        rc, out, _ = mpirun(n, "checkpoint.py", "nodes-load", str(tmp_path), timeout=300)
        assert_ok(rc, out, range(n))
        assert f"grid saved at 2 ranks, loaded at {n} as data_parallel, row_wise" in out


@pytest.mark.parametrize("name", ["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_the_launcher_says_the_ranks_of_a_node(monkeypatch, name):
    for var in hbk.dist.LOCAL_SIZE_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert hbk.dist.ranks_per_node() is None
    monkeypatch.setenv(name, "4")
    assert hbk.dist.ranks_per_node() == 4
    coll = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=10, dim=2)], comm=local())
    assert (coll.ranks_per_node, coll.exchange) == (1, "flat")  # one rank: one node of it
    monkeypatch.setenv(name, "x")
    assert hbk.dist.ranks_per_node() is None


def test_bad_exchange_arguments_are_value_errors():
    tables = [hbk.TableSpec("t", num_rows=10, dim=2)]
    with raises(ValueError, match="exchange must be one of"):
        hbk.EmbeddingCollection(tables, comm=local(), exchange="tree")
    with raises(ValueError, match="ranks_per_node"):
        hbk.EmbeddingCollection(tables, comm=local(), ranks_per_node=0)
    assert hbk.EmbeddingCollection(tables, comm=local(), exchange="hierarchical").exchange == "flat"
