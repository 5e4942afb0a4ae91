"""hbk.EmbeddingCollection checkpoints across world sizes (run by
tests/test_embedding_collection.py as a chain in one work directory WORK):

``checkpoint.py save WORK`` (n=2): a collection with a mixed plan and Adam
trains 2 steps against the float64 model, saves to WORK/ckpt; rank 0 writes
WORK/expected.npz (full weights and state of every table, plain npz).

``checkpoint.py load WORK`` (n=3): ``load(WORK/ckpt)`` with plan and
optimizer None (the saved request re-planned, the saved optimizer): full
weights and state equal expected.npz bit for bit; one more step against the
model started from expected.npz; saves to WORK/again and writes
WORK/expected_again.npz.

``checkpoint.py load-again WORK`` (n=1): ``load(WORK/again)`` with an explicit
optimizer and plan "row_wise": equal to expected_again.npz bit for bit, then
one more step against the model.

``checkpoint.py nodes-save WORK`` (n=2, as 2 nodes of 1): each placement over a node's
ranks (and a mix of them), and each one-node placement, trains 2 steps and saves to
WORK/<plan>, rank 0 writing WORK/<plan>.npz. ``checkpoint.py nodes-load WORK`` (any n, in
nodes of 2): each such save loads into its own placement and each one-node one (a
one-node save: into each placement over a node's ranks) bit for bit, and trains on.

Prints ``OK rank r`` at the end."""
import os
import sys
from pathlib import Path

import numpy as np

import collection_reference as cr
import hbkernels as hbk
from harness import finish, log

MODE, WORK = sys.argv[1], Path(sys.argv[2])
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
TABLES = cr.table_specs(hbk)
KEY = "checkpoint"
SEED = 21
FLAT = ("data_parallel", "row_wise", "table_wise", "column_wise")  # the one-node placements


def optimizer():
    return cr.make_optimizer(hbk, "Adam")


def snapshot(coll):
    """Every table's full weights and state (collective)."""
    arrays = {}
    for t in TABLES:
        arrays[f"w/{t.name}"] = coll.full_weights(t.name)
        st = coll.full_state(t.name)
        for k, v in st.items():
            if k == "step":
                arrays[f"step/{t.name}"] = np.array(int(np.asarray(v).reshape(-1)[0]), np.int64)
            else:
                arrays[f"s/{t.name}/{k}"] = np.asarray(v)
    return arrays


def write_expected(coll, path):
    arrays = snapshot(coll)
    if R == 0:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    comm.barrier()


def compare_to_expected(coll, path):
    """Bit-equal full weights and state; returns the model continuing from them."""
    with np.load(path, allow_pickle=False) as z:
        expected = {k: z[k] for k in z.files}
    got = snapshot(coll)
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for k, e in expected.items():
        g = got[k]
        assert g.dtype == e.dtype and g.shape == e.shape, \
            f"{k}: {g.dtype}{g.shape} vs {e.dtype}{e.shape}"
        assert np.array_equal(g.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8)), \
            f"{k}: restored values differ"
    weights = {t.name: expected[f"w/{t.name}"] for t in TABLES}
    state = {t.name: {k: expected[f"s/{t.name}/{k}"] for k in cr.SLOTS["Adam"]} for t in TABLES}
    step = {t.name: int(expected[f"step/{t.name}"]) for t in TABLES}
    return cr.Reference(TABLES, optimizer(), weights, state, step)


if MODE == "save":
    assert W == 2, W
    opt = optimizer()
    request = cr.plan_request("mixed")
    coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan=request, seed=SEED)
    cr.check_plan(coll, TABLES, request, W)
    cr.check_training(hbk, coll, comm, TABLES, opt, key=KEY, steps=2, empty_at=1)
    coll.save(str(WORK / "ckpt"))
    write_expected(coll, WORK / "expected.npz")
    log(comm, "saved")
elif MODE == "load":
    assert W == 3, W
    coll = hbk.EmbeddingCollection.load(str(WORK / "ckpt"), comm=comm)
    cr.check_plan(coll, TABLES, cr.plan_request("mixed"), W)  # the saved request, re-planned
    ref = compare_to_expected(coll, WORK / "expected.npz")
    for n, s in ref.step.items():  # Adam counts a table's steps with ids: tiny's were empty once
        assert s == (1 if n == "tiny" else 2), (n, s)
    cr.check_training(hbk, coll, comm, TABLES, ref.opt, key=KEY, steps=1, first_step=2, ref=ref)
    coll.save(str(WORK / "again"))
    write_expected(coll, WORK / "expected_again.npz")
elif MODE == "load-again":
    assert W == 1, W
    coll = hbk.EmbeddingCollection.load(str(WORK / "again"), comm=comm, plan="row_wise",
                                        optimizer=optimizer())
    cr.check_plan(coll, TABLES, "row_wise", W)
    ref = compare_to_expected(coll, WORK / "expected_again.npz")
    for n, s in ref.step.items():
        assert s == (2 if n == "tiny" else 3), (n, s)
    cr.check_training(hbk, coll, comm, TABLES, ref.opt, key=KEY, steps=1, first_step=3, ref=ref)
elif MODE == "nodes-save":  # 2 ranks as 2 nodes of 1
    assert W == 2, W
    for plan in cr.NODE_PLANS + FLAT:
        opt = optimizer()
        request = cr.plan_request(plan)
        coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan=request, seed=SEED,
                                       ranks_per_node=1)
        cr.check_plan(coll, TABLES, request, W)
        cr.check_training(hbk, coll, comm, TABLES, opt, key=(KEY, plan), steps=2, empty_at=1)
        coll.save(str(WORK / plan))
        write_expected(coll, WORK / f"{plan}.npz")
    log(comm, "saved")
elif MODE == "nodes-load":  # any world size, in nodes of 2
    for saved in cr.NODE_PLANS + FLAT:
        into = FLAT + (saved,) if saved in cr.NODE_PLANS else cr.NODE_PLANS
        for plan in into:
            request = cr.plan_request(plan)
            coll = hbk.EmbeddingCollection.load(str(WORK / saved), comm=comm, plan=request,
                                                ranks_per_node=2)
            cr.check_plan(coll, TABLES, request, W)
            compare_to_expected(coll, WORK / f"{saved}.npz")
        if R == 0:
            print(f"{saved} saved at 2 ranks, loaded at {W} as {', '.join(into)}: equal", flush=True)
    # and trains on from there
    ref = compare_to_expected(coll, WORK / f"{saved}.npz")
    cr.check_training(hbk, coll, comm, TABLES, ref.opt, key=(KEY, saved), steps=1, first_step=2, ref=ref)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
finish(comm)
