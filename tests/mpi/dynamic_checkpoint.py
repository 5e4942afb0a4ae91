"""Checkpoints of a dynamic table across world sizes (run by
tests/test_dynamic_collection.py as a chain in one work directory WORK):

``dynamic_checkpoint.py save WORK`` (n=2): raw 64-bit ids, LRU eviction, admission
at the second call, Adam: trains 12 steps, saves to WORK/ckpt (loaded back at once, each
rank's hash table as saved); rank 0 writes WORK/expected.npz (ids, rows, state, counts);
3 more steps, each followed by an incremental save (WORK/incr1, WORK/incr2, WORK/incr,
chained to WORK/ckpt: each rank's packs appended to one file), and
WORK/expected_incr.npz.

``dynamic_checkpoint.py load WORK`` (n=3): ``load(WORK/incr)`` replays the chain (the
manifests of incr1 and incr2 moved away: those saves are read through their packs);
``load(WORK/ckpt)``: the ids re-hashed to
their new owners, a shard given more ids than its 4 slots leaving out those its
policy evicts first (a RuntimeWarning on that rank), the others with the same rows
and state bit for bit; a full save of an ``evict="none"`` table whose ids overflow
rank 0's share: CapacityError there, CommError on the others;
trains a step on live ids, saves to WORK/again and writes
WORK/expected_again.npz.

``dynamic_checkpoint.py load-again WORK`` (n=1): ``load(WORK/again)`` equals
expected_again.npz. Prints ``OK rank r`` at the end."""
import os
import sys
import warnings
from pathlib import Path

import numpy as np

import hbkernels as hbk
from harness import finish, rng_for
from hbkernels.sharding.kinds.row_wise import dynamic_owner

MODE, WORK = sys.argv[1], Path(sys.argv[2])
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size


def pool():
    """24 raw 64-bit ids, 20 of them owned by rank 0 at 3 ranks: any 9 of them put 5 on
    that rank's 4 slots, so the load at 3 ranks always overflows a shard."""
    ids = rng_for("pool").integers(-2**63, 2**63 - 1, 400, dtype=np.int64, endpoint=True)
    first = dynamic_owner(np, ids, 3) == 0
    return np.concatenate([ids[first][:20], ids[~first][:4]])


POOL = pool()


def train(coll, steps, key, ids, per_rank):
    """Steps of one bag of ``per_rank`` ids from ``ids`` on each rank: a call sees at most
    ``per_rank * W`` distinct ids, which every shard has room for."""
    for step in range(steps):
        rng = rng_for(key, step, R)
        values = rng.choice(ids, per_rank)
        out = coll.forward({"t": hbk.Ragged(values, np.array([0, per_rank]))})
        coll.backward({"t": rng.standard_normal(out["t"].shape).astype(np.float32)})


def snapshot(coll):
    ids, rows = coll.full_weights("t")
    state = coll.full_state("t")
    counts = coll.dynamic_counts("t")
    return {"ids": ids, "rows": rows, "size": np.array(counts["size"]),
            **{f"state_{k}": np.asarray(v) for k, v in state.items() if k not in ("ids", "step")}}


def write_expected(coll, path):
    arrays = snapshot(coll)
    if R == 0:
        tmp = str(path) + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    comm.barrier()


def compare(coll, path, dropped=0):
    """The loaded table equals the saved one, but for the ``dropped`` ids that shards
    with more ids than slots left out (the rows of the others unchanged)."""
    got = snapshot(coll)
    with np.load(path, allow_pickle=False) as z:
        assert set(z.files) == set(got), (z.files, list(got))
        kept = np.isin(z["ids"], got["ids"])
        assert int((~kept).sum()) == dropped == int(z["size"]) - int(got["size"]), (
            int((~kept).sum()), dropped)
        for k in z.files:
            if k != "size":
                np.testing.assert_array_equal(got[k], z[k][kept], err_msg=k)


if MODE == "save":
    spec = hbk.TableSpec("t", num_rows=None, capacity=12, dim=4, evict="lru", admit_count=2)
    coll = hbk.EmbeddingCollection([spec], comm=comm, optimizer=hbk.optim.Adam(lr=0.1), seed=6)
    train(coll, 12, "before", POOL, 3)
    assert coll.dynamic_counts("t")["evicted"] > 0, coll.dynamic_counts("t")
    coll.save(WORK / "ckpt")
    write_expected(coll, WORK / "expected.npz")
    # loaded at the same world size, each rank's hash table is as saved, its call counter too
    saved, back = coll.hash_tables["t"].state(), hbk.EmbeddingCollection.load(
        WORK / "ckpt", comm=comm).hash_tables["t"].state()
    assert back["step"] == saved["step"], (back["step"], saved["step"])
    for k in ("ids", "last", "count"):
        np.testing.assert_array_equal(back[k], saved[k], err_msg=k)
        np.testing.assert_array_equal(back["pending"][k], saved["pending"][k], err_msg=k)
    for k, name in enumerate(("incr1", "incr2", "incr")):
        train(coll, 1, f"more{k}", POOL, 3)
        assert coll.save(WORK / name, incremental=True, chain_limit=np.inf) == "incremental"
    files = [next((WORK / name).glob(f"save-*/r{R}.pack.npy")) for name in ("incr1", "incr2", "incr")]
    assert len({f.stat().st_ino for f in files}) == 1, files  # each rank's chain: one file
    write_expected(coll, WORK / "expected_incr.npz")
elif MODE == "load":
    if R == 0:  # the saves between the full one and the newest are read through their packs
        for name in ("incr1", "incr2"):
            os.rename(WORK / name / "manifest.json", WORK / name / "manifest.json.unread")
    comm.barrier()
    incr = hbk.EmbeddingCollection.load(WORK / "incr", comm=comm)
    compare(incr, WORK / "expected_incr.npz", incr.dynamic_counts("t")["evicted"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coll = hbk.EmbeddingCollection.load(WORK / "ckpt", comm=comm)
    dropped = coll.dynamic_counts("t")["evicted"]  # 12 slots as 4 + 4 + 4: rank 0's overflows
    assert dropped > 0, "no shard overflowed: the test checks nothing of it"
    mine = coll.hash_tables["t"].evicted
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert bool(mine) == any("left out" in m for m in said), (R, mine, said)
    if R == 0:  # evict="none": a shard that cannot take its ids fails the load on every rank
        full = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=None, capacity=3 * 4, dim=3,
                                                      evict="none")], comm=hbk.dist.init("local"))
        full.forward({"t": pool()[:12]})  # all owned by rank 0 at 3 ranks: 12 ids, 4 slots
        full.save(WORK / "none")
    comm.barrier()
    try:
        hbk.EmbeddingCollection.load(WORK / "none", comm=comm)
        raise AssertionError("12 ids loaded into 4 slots")
    except (hbk.CapacityError, hbk.dist.CommError) as error:
        assert isinstance(error, hbk.CapacityError) == (R == 0), (R, error)
    compare(coll, WORK / "expected.npz", dropped)
    pending = sum(comm.allgatherv(np.array([coll.hash_tables["t"].state()["pending"]["ids"].size]))[0])
    assert pending > 0, "no id was waiting for admission: the test checks nothing of them"
    train(coll, 1, "after", coll.full_weights("t")[0], 1)
    coll.save(WORK / "again")
    write_expected(coll, WORK / "expected_again.npz")
else:
    coll = hbk.EmbeddingCollection.load(WORK / "again", comm=comm)
    compare(coll, WORK / "expected_again.npz")
finish(comm)
