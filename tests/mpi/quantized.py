"""Quantized collections across ranks (run by tests/test_quantized_collection.py as a
chain in one work directory WORK):

``quantized.py save WORK`` (n=2): a collection with the mixed plan (a column_wise
table among them) trains a step, then ``quantized(bits=4)``: each table's
``full_weights`` is ``quantize_rows(float table, 4).dequantize()`` bit for bit on
every rank (a column_wise row shares one scale and bias over its slices), the
forward of a global batch matches the float64 model on those tables, backward is
a TypeError; saves to WORK/q; rank 0 writes WORK/q.npz (the dequantized tables).

``quantized.py load WORK`` (n=3): ``load(WORK/q)`` re-planned at 3 ranks: the same
tables bit for bit, the same forward against the model.

``quantized.py bad WORK`` (n=2): a NaN in a row only rank 1 holds: ``quantized``
raises ValueError naming the row there and CommError on rank 0 (no hang).

Prints ``OK rank r`` at the end."""
import os
import sys
from pathlib import Path

import numpy as np

import collection_reference as cr
import hbkernels as hbk
from harness import finish

MODE, WORK = sys.argv[1], Path(sys.argv[2])
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
TABLES = cr.table_specs(hbk)
SERVED = [t._replace(dtype="float32") for t in TABLES]  # a quantized table gives float32
BITS = 4


def same_shards(a, b):
    """The same rows and columns of every table on the same ranks (the same plan)."""
    def shards(coll):
        return {(s.table, s.slice, s.rank, s.row_start, s.row_step, s.num_rows, s.c0, s.c1)
                for t in coll.tables for s in coll.layout.shards[t]}
    return shards(a) == shards(b)


def check_serving(q, tables, key):
    """``q``'s tables equal ``tables`` (name -> float32) on every rank; its forward of a
    global batch matches the float64 model of them."""
    assert q.quantize == {t.name: BITS for t in TABLES}, q.quantize
    for t in TABLES:
        got = q.full_weights(t.name)
        assert got.dtype == np.float32 and np.array_equal(got, tables[t.name]), t.name
    ref = cr.Reference(SERVED, cr.make_optimizer(hbk, "SGD"), tables)
    gb = cr.global_batch(SERVED, key, 0, 30)
    bounds = cr.split(30, W, 1)
    feats, psw, grads = gb.local(int(bounds[R]), int(bounds[R + 1]))
    out = q.forward(feats, per_sample_weights=psw or None)
    for f, e in ref.forward(gb).items():
        assert out[f].dtype == np.float32, (f, out[f].dtype)
        cr.assert_close(out[f], e[bounds[R]:bounds[R + 1]], "float32", f"rank {R} forward {f}")
    try:
        q.backward(grads)
    except TypeError as e:
        assert "forward only" in str(e), e
    else:
        raise AssertionError("backward of a quantized collection did not raise")


if MODE == "save":
    assert W == 2, W
    opt = cr.make_optimizer(hbk, "Adagrad")
    coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan=cr.plan_request("mixed"),
                                   seed=7)
    assert coll.plan["item"].kind == "column_wise" and len(coll.plan["item"].ranks) == 2
    cr.check_training(hbk, coll, comm, TABLES, opt, key="quantized", steps=1)
    q = coll.quantized(bits=BITS)
    assert same_shards(q, coll)
    tables = {t.name: hbk.quantize_rows(coll.full_weights(t.name), bits=BITS).dequantize()
              for t in TABLES}
    check_serving(q, tables, "serve")
    q.save(str(WORK / "q"))
    if R == 0:
        np.savez(WORK / "q.tmp.npz", **tables)
        os.replace(WORK / "q.tmp.npz", WORK / "q.npz")
    comm.barrier()
elif MODE == "load":
    assert W == 3, W
    q = hbk.EmbeddingCollection.load(str(WORK / "q"), comm=comm)
    assert q.comm.world_size == 3 and len(q.plan["item"].ranks) == 3, q.plan
    with np.load(WORK / "q.npz", allow_pickle=False) as z:
        tables = {k: z[k] for k in z.files}
    check_serving(q, tables, "serve-again")
elif MODE == "bad":
    assert W == 2, W
    coll = hbk.EmbeddingCollection(TABLES, comm=comm, plan={"user": "row_wise"}, seed=7)
    for shard in coll.local_shards():
        if shard.table == "user" and R == 1:  # its local row 2: table row 1 + 2 * 2 = 5
            coll.shard_arrays(shard)["weights"][2, 3] = np.nan
    try:
        coll.quantized(bits=8)
    except ValueError as e:
        assert R == 1 and "row 5 of the table holds NaN" in str(e), (R, e)
    except hbk.dist.CommError as e:
        assert R == 0, (R, e)
    else:
        raise AssertionError(f"rank {R}: a NaN row was quantized")
else:
    raise SystemExit(f"unknown mode {MODE!r}")
finish(comm)
