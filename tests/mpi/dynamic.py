"""Dynamic tables across ranks (run by tests/test_dynamic_collection.py under
``mpiexec -n 2`` and ``-n 3``).

1. A dynamic table (evict="none", admit_count=1) and its static twin (row i is id i,
   the same seed and init_scale) placed row_wise and table_wise, beside a static
   table: every rank's outputs and the gathered rows are equal bit for bit, over
   steps with uneven and empty local batches.
2. Raw 64-bit ids: the N-rank collection against one rank (a local collection on
   every rank) fed the whole batch: outputs and rows equal up to summation order,
   and the same live ids and counts, and the same last use of each id, over a step
   whose ids all belong to rank 0's shard (every shard's clock counts each call).
3. Rank 0's shard given more new ids than it has slots: CapacityError there, CommError
   on the other ranks, without waiting for the communicator's timeout, and no rank
   admits any id of the call (rank 1's share could take its one).
``dynamic.py G``: the same with the ranks in nodes of G and the exchange hierarchical.
Prints ``OK rank r`` at the end."""
import sys
import time

import numpy as np

import hbkernels as hbk
from harness import finish, rng_for
from hbkernels.sharding.kinds.row_wise import dynamic_owner

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
SCALE = 0.05
# the collections' exchange: as the launch places the ranks, or through nodes of G ranks
NODES = {"ranks_per_node": int(sys.argv[1]), "exchange": "hierarchical"} if len(sys.argv) > 1 else {}


def specs(dynamic, combiner="sum"):
    table = (hbk.TableSpec("t", num_rows=None, capacity=3 * 64, dim=6, combiner=combiner,
                           evict="none", init_scale=SCALE) if dynamic else
             hbk.TableSpec("t", num_rows=64, dim=6, combiner=combiner, init_scale=SCALE))
    return [table, hbk.TableSpec("u", num_rows=9, dim=6)]


def batch(step, rank, ids):
    rng = rng_for("dynamic", step, rank)
    bags = 0 if (step == 1 and rank == 1) else int(rng.integers(2, 6))
    lengths = rng.integers(0, 4, bags)
    values = rng.choice(ids, int(lengths.sum()))
    return {"t": hbk.Ragged(values, np.concatenate([[0], np.cumsum(lengths)])),
            "u": rng.integers(0, 9, bags)}


def grads(step, rank, out):
    rng = rng_for("grad", step, rank)
    return {f: rng.standard_normal(o.shape).astype(np.float32) for f, o in out.items()}


# 1. bit for bit against a static twin
for plan, combiner in [("row_wise", "sum"), ("table_wise", "mean")]:
    twin = hbk.EmbeddingCollection(specs(False, combiner), comm=comm, plan={"t": plan}, **NODES,
                                   optimizer=hbk.optim.Adagrad(lr=0.2), seed=4)
    dyn = hbk.EmbeddingCollection(specs(True, combiner), comm=comm, **NODES,
                                  optimizer=hbk.optim.Adagrad(lr=0.2), seed=4)
    for step in range(3):
        feats = batch(step, R, np.arange(64))
        a, b = twin.forward(feats), dyn.forward(feats)
        for f in feats:
            np.testing.assert_array_equal(a[f], b[f])
        g = grads(step, R, a)
        twin.backward(g)
        dyn.backward(g)
    ids, rows = dyn.full_weights("t")
    np.testing.assert_array_equal(rows, twin.full_weights("t")[ids])
    np.testing.assert_array_equal(dyn.full_weights("u"), twin.full_weights("u"))

# 2. raw 64-bit ids: N ranks against one rank fed the whole batch
pool = rng_for("pool").integers(-2**63, 2**63 - 1, 100, dtype=np.int64, endpoint=True)
pool[:2] = [-2**63, 2**63 - 1]
dyn = hbk.EmbeddingCollection(specs(True), comm=comm, optimizer=hbk.optim.Adam(lr=0.1), seed=2,
                              **NODES)
one = hbk.EmbeddingCollection(specs(True), comm=hbk.dist.init("local"),
                              optimizer=hbk.optim.Adam(lr=0.1), seed=2)
mine0 = pool[dynamic_owner(np, pool, W) == 0]  # a step of these leaves the other shards no id
for step, ids in enumerate([pool, pool, pool, mine0, pool]):
    mine = batch(step, R, ids)
    every = [batch(step, r, ids) for r in range(W)]
    whole = {"t": hbk.Ragged(np.concatenate([b["t"].values for b in every]),
                             np.concatenate([[0]] + [b["t"].offsets[1:] + sum(
                                 len(x["t"].values) for x in every[:r]) for r, b in enumerate(every)])),
             "u": np.concatenate([b["u"] for b in every])}
    out, ref = dyn.forward(mine), one.forward(whole)
    first = sum(len(b["u"]) for b in every[:R])
    for f in out:
        np.testing.assert_allclose(out[f], ref[f][first:first + len(mine["u"])], rtol=1e-5, atol=1e-6)
    g = [grads(step, r, {f: np.zeros((len(b["u"]), 6)) for f in b}) for r, b in enumerate(every)]
    dyn.backward(g[R])
    one.backward({f: np.concatenate([x[f] for x in g]) for f in g[0]})
ids, rows = dyn.full_weights("t")
ref_ids, ref_rows = one.full_weights("t")
np.testing.assert_array_equal(ids, ref_ids)
np.testing.assert_allclose(rows, ref_rows, rtol=1e-5, atol=1e-6)
assert dyn.dynamic_counts("t") == one.dynamic_counts("t"), (dyn.dynamic_counts("t"),
                                                            one.dynamic_counts("t"))
# every shard's clock counted the call that gave it no id: the same last uses as one rank's
for got, expected in zip(dyn.dynamic_scores("t"), one.dynamic_scores("t")):
    np.testing.assert_array_equal(got, expected)

# 3. one owner's shard cannot take its ids: CapacityError there, CommError on the others,
#    at once (not after the communicator's timeout)
candidates = np.arange(1000, dtype=np.int64)
theirs = candidates[dynamic_owner(np, candidates, W) == 0][:5]
fits = candidates[dynamic_owner(np, candidates, W) == 1][:1]  # rank 1's one slot takes it
tiny = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=None, capacity=W, dim=2, evict="none")],
                               comm=comm, **NODES)
start = time.monotonic()
try:
    tiny.forward({"t": np.concatenate([theirs, fits]) if R == 1 else theirs[:0]})
    raise AssertionError("a shard took 5 ids in 1 slot")
except (hbk.CapacityError, hbk.dist.CommError) as error:
    assert isinstance(error, hbk.CapacityError) == (R == 0), (R, error)
    assert R != 0 or "t on rank 0 (its share of capacity" in str(error), error
assert time.monotonic() - start < 60
counts = tiny.dynamic_counts("t")
assert counts == {"size": 0, "admitted": 0, "evicted": 0, "forgotten": 0}, counts  # no rank admitted an id
finish(comm)
