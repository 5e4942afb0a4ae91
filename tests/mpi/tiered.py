"""Tables in a slow tier across ranks (run by tests/test_tiered_storage.py under
``mpiexec -n 2``; argv[1]: a directory for the table files and checkpoints).

1. Every placement, static (and a dynamic row_wise table), with ``storage="host"``
   and a cache, ``"mmap"`` with a cache smaller than a batch, and ``"mmap"`` without
   one, against the same tables on the device: outputs, gathered rows and state equal
   bit for bit over steps with uneven and empty local batches, ``prefetch`` called
   with the next batch between forward and backward.
2. A save at two ranks loads at two ranks and at one (a local collection on rank 0)
   and goes on like the collection that saved it.
Prints ``OK rank r`` at the end."""
import os
import sys

import numpy as np

import hbkernels as hbk
from harness import finish, rng_for

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
ROOT = sys.argv[1]
STORES = [("host", 5, "lru"), ("mmap", 3, "lfu"), ("mmap", None, "lru")]


def specs(plan, storage, cache, policy, where):
    tier = {} if storage == "device" else dict(storage=storage, cache_rows=cache,
                                               cache_policy=policy,
                                               path=where if storage == "mmap" else None)
    dynamic = plan == "dynamic"
    t = (hbk.TableSpec("t", num_rows=None, capacity=64, dim=6, init_scale=0.1, **tier) if dynamic
         else hbk.TableSpec("t", num_rows=40, dim=6, combiner="mean", **tier))
    return [t, hbk.TableSpec("u", num_rows=9, dim=6)]


def batch(step, rank):
    rng = rng_for("tiered", step, rank)
    bags = 0 if (step == 1 and rank == 1) else int(rng.integers(2, 6))
    lengths = rng.integers(0, 5, bags)
    values = rng.zipf(1.2, int(lengths.sum())) % 40
    return {"t": hbk.Ragged(values, np.concatenate([[0], np.cumsum(lengths)])),
            "u": rng.integers(0, 9, bags)}


def grads(step, rank, out):
    rng = rng_for("grad", step, rank)
    return {f: rng.standard_normal(o.shape).astype(np.float32) for f, o in out.items()}


def same(a, b, what):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            same(x, y, what)
    else:
        np.testing.assert_array_equal(a, b, err_msg=str(what))


def train(coll, steps, first=0, prefetch=False):
    outs = []
    for step in range(first, first + steps):
        out = coll.forward(batch(step, R))
        if prefetch:
            coll.prefetch(batch(step + 1, R))
        coll.backward(grads(step, R, out))
        outs.append(out)
    return outs


def tables_equal(a, b, what):
    for name in ("t", "u"):
        same(a.full_weights(name), b.full_weights(name), (what, name))
        sa, sb = a.full_state(name), b.full_state(name)
        for k in sa:
            same(sa[k], sb[k], (what, name, k))


OPT = hbk.optim.Adagrad
for plan in ("data_parallel", "row_wise", "table_wise", "column_wise", "dynamic"):
    place = {} if plan == "dynamic" else {"t": plan}
    ref = hbk.EmbeddingCollection(specs(plan, "device", None, None, None), comm=comm, plan=place,
                                  optimizer=OPT(lr=0.2), seed=3)
    ref_out = train(ref, 4)
    for k, (storage, cache, policy) in enumerate(STORES):
        where = os.path.join(ROOT, f"{plan}-{k}")
        got = hbk.EmbeddingCollection(specs(plan, storage, cache, policy, where), comm=comm,
                                      plan=place, optimizer=OPT(lr=0.2), seed=3)
        for a, b in zip(ref_out, train(got, 4, prefetch=True)):
            for f in a:
                same(a[f], b[f], (plan, storage, cache, f))
        tables_equal(ref, got, (plan, storage, cache))
        if cache is not None:
            stats = got.cache_stats("t")
            assert stats["misses"] <= stats["lookups"] and stats["rows"] >= cache, stats

# 2. save at two ranks; load at two and at one; both go on like the saver
for storage, cache, policy in STORES[1:]:
    where = os.path.join(ROOT, f"save-{storage}-{cache}")
    saver = hbk.EmbeddingCollection(specs("row_wise", storage, cache, policy, where), comm=comm,
                                    plan={"t": "row_wise"}, optimizer=hbk.optim.Adam(lr=0.05), seed=5)
    train(saver, 3)
    saver.save(os.path.join(where, "ck"))
    train(saver, 2, first=3)
    back = hbk.EmbeddingCollection.load(os.path.join(where, "ck"), comm=comm,
                                        paths={"t": os.path.join(where, "two")})
    loaded = back.full_weights("t"), back.full_state("t")
    train(back, 2, first=3)
    tables_equal(saver, back, ("load at two", storage, cache))
    if R == 0:
        one = hbk.EmbeddingCollection.load(os.path.join(where, "ck"), comm=hbk.dist.init("local"),
                                           paths={"t": os.path.join(where, "one")})
        same(one.full_weights("t"), loaded[0], ("load at one", storage, cache))
        state = one.full_state("t")
        for k in state:
            same(state[k], loaded[1][k], ("load at one", storage, cache, k))
comm.barrier()
finish(comm)
