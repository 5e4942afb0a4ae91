"""Tables in a slow tier (TableSpec(storage="host" | "mmap", cache_rows=K)): one rank
here, two under mpiexec (tests/mpi/tiered.py); the cache alone (Tier) on the CPU and
the CUDA path."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import raises
from mpirun import ROOT, assert_ok, mpirun, needs_mpi

import hbkernels as hbk
from hbkernels._dispatch import host
from hbkernels.errors import CheckpointError
from hbkernels.plan import make_plan
from hbkernels.sharding.checkpoint import read_manifest
from hbkernels.sharding.tier import FusedArrays, Store, Tier

LOCAL = hbk.dist.init("local")
OPTIMIZERS = {"Adagrad": lambda: hbk.optim.Adagrad(lr=0.2),
              "Adam": lambda: hbk.optim.Adam(lr=0.05),
              "RowWiseAdagrad": lambda: hbk.optim.RowWiseAdagrad(lr=0.2)}
TIERS = [("host", None), ("host", 4), ("mmap", None), ("mmap", 1), ("mmap", 6), ("mmap", 1000)]


def tables(tmp_path, storage="device", cache=None, dim=5, rows=50, dynamic=False, policy="lru",
           where="t"):
    tier = {} if storage == "device" else dict(
        storage=storage, cache_rows=cache, cache_policy=policy,
        path=str(tmp_path / where) if storage == "mmap" else None)
    t = (hbk.TableSpec("t", num_rows=None, capacity=rows, dim=dim, init_scale=0.1, features=("t", "t2"),
                       **tier) if dynamic
         else hbk.TableSpec("t", num_rows=rows, dim=dim, features=("t", "t2"), **tier))
    return [t, hbk.TableSpec("u", num_rows=30, dim=dim, combiner="mean")]


def collection(specs, opt="Adagrad", **kw):
    return hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=OPTIMIZERS[opt](), device="cpu", **kw)


def batch(rng, rows=50, id_dtype=np.int64, bags=7):
    """Zipf ids (one row repeated many times), the table's last row, empty bags."""
    out = {}
    for f, n in (("t", rows), ("t2", rows), ("u", 30)):
        lengths = rng.integers(0, 5, bags)
        lengths[0] = 0
        values = (rng.zipf(1.2, int(lengths.sum())) % n).astype(id_dtype)
        if values.shape[0]:
            values[-1] = n - 1
        out[f] = hbk.Ragged(values, np.concatenate([[0], np.cumsum(lengths)]).astype(id_dtype))
    return out


def grads(rng, out):
    return {f: rng.standard_normal(o.shape).astype(np.float32) for f, o in out.items()}


def assert_same(a, b, what=""):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            assert_same(x, y, what)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(what))


def assert_tables_equal(a, b):
    for name in a.tables:
        assert_same(a.full_weights(name), b.full_weights(name), name)
        sa, sb = a.full_state(name), b.full_state(name)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert_same(sa[k], sb[k], (name, k))


def train_both(rng, ref, got, steps, prefetch=False, **batch_kw):
    batches = [batch(rng, **batch_kw) for _ in range(steps + 1)]
    for k in range(steps):
        a, b = ref.forward(batches[k]), got.forward(batches[k])
        for f in a:
            assert_same(a[f], b[f], (k, f))
        if prefetch:
            got.prefetch(batches[k + 1])
        g = grads(rng, a)
        ref.backward(g)
        got.backward(g)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("storage,cache", TIERS)
def test_equals_the_table_in_memory(rng, tmp_path, opt, storage, cache):
    """Outputs, rows and optimizer state bit for bit like the same table on the device,
    over several steps, for caches of one row (smaller than a batch), a few rows and
    more than the table; no cache: the slow tier read in place."""
    ref = collection(tables(tmp_path), opt)
    got = collection(tables(tmp_path, storage, cache), opt)
    train_both(rng, ref, got, 6, prefetch=cache is not None)
    assert_tables_equal(ref, got)
    if cache is not None:
        stats = got.cache_stats("t")
        assert stats["lookups"] > stats["misses"] > 0 and stats["rows"] >= min(cache, 50)
        assert stats["prefetched"] > 0


@pytest.mark.parametrize("dim,id_dtype,opt", [(1, np.int32, "RowWiseAdagrad"), (7, np.int64, "Adam")])
@pytest.mark.parametrize("dynamic", [False, True])
def test_edges_and_dynamic_tables(rng, tmp_path, dim, id_dtype, opt, dynamic):
    """D = 1 and odd D, int32 and int64 ids, and a dynamic table (its slots in the
    store), with and without a cache."""
    kw = dict(dim=dim, dynamic=dynamic)
    for k, (storage, cache) in enumerate([("mmap", 2), ("mmap", None), ("host", 3)]):
        ref = collection(tables(tmp_path, **kw), opt)
        got = collection(tables(tmp_path, storage, cache, where=f"t{k}", **kw), opt)
        train_both(rng, ref, got, 4, prefetch=True, id_dtype=id_dtype)
        assert_tables_equal(ref, got)


def test_a_batch_larger_than_the_cache_grows_it(rng, tmp_path):
    got = collection(tables(tmp_path, "mmap", 2))
    ref = collection(tables(tmp_path))
    values = np.arange(50)
    feats = {"t": hbk.Ragged(values, np.array([0, 20, 50]))}
    out = got.forward(feats)
    assert_same(out["t"], ref.forward(feats)["t"])
    assert got.cache_stats("t")["rows"] >= 50  # the batch's 50 distinct rows fit
    got.backward({"t": np.ones((2, 5), np.float32)})
    ref.backward({"t": np.ones((2, 5), np.float32)})
    assert_tables_equal(ref, got)


def _zipf_hit_rate(rng, policy, rows=20000, cache=1000, calls=60, ids=2000):
    store = Store(FusedArrays(np.zeros((rows, 2), np.float32), {"step": np.zeros(1, np.int64)}), [])
    tier = Tier(store, 2, np.float32, "cpu", cache_rows=cache, policy=policy)
    shuffle = rng.permutation(rows)
    for k in range(calls):
        if k == 10:  # warmed up
            tier.stats = dict.fromkeys(tier.stats, 0)
        tier.rows(shuffle[(rng.zipf(1.1, ids) - 1) % rows])
    return 1 - tier.stats["misses"] / tier.stats["lookups"]


def test_lfu_keeps_more_of_a_zipf_stream_than_lru(rng):
    """On a stationary Zipf(1.1) stream LFU hits more than LRU (the hot rows stay
    whatever came last), and both far more than the cache's share of the rows (5%)."""
    seed = int(rng.integers(2**31))
    lru = _zipf_hit_rate(np.random.default_rng(seed), "lru")
    lfu = _zipf_hit_rate(np.random.default_rng(seed), "lfu")
    assert lfu > lru > 0.15, (lru, lfu)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tier_against_a_model(rng, device):
    """The cache alone, on both backends: every call's slots read the model's rows,
    updates through them reach the store on eviction and flush, prefetched rows are
    those of the store (also after rows were set since), state rows too."""
    from conftest import HAVE_NUMBA_CUDA, Backend

    if device == "cuda" and not HAVE_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    be = Backend(device)
    rows, width = 40, 3
    model = rng.standard_normal((rows, width)).astype(np.float32)
    acc = np.zeros(rows, np.float32)
    store = Store(FusedArrays(model.copy(), {"step": np.zeros(1, np.int64), "acc": acc.copy()}),
                  [("acc", True)])
    tier = Tier(store, width, np.float32, device, cache_rows=5, policy="lru")
    for call in range(30):
        keys = rng.integers(0, rows, size=int(rng.integers(0, 9)))
        if call % 4 == 1:
            tier.prefetch(be.put(np.append(keys, rng.integers(0, rows, 3))))
            if call % 8 == 1:  # rows set between a prefetch and its use (a dynamic table's
                # new slots): the staged copies are stale, cached or not
                reset = np.unique(np.append(keys[:2], rng.integers(0, rows, 2)))
                model[reset] = rng.standard_normal((reset.shape[0], width))
                acc[reset] = 0.5
                tier.write(reset, model[reset], {"acc": np.float32(0.5)})
        slots = be.get(tier.rows(be.put(keys)))
        assert slots.shape == keys.shape and ((0 <= slots) & (slots < tier.capacity)).all()
        assert_same(be.get(tier.fast.weights)[slots], model[keys], call)
        weights, state = be.get(tier.fast.weights), be.get(tier.fast.state["acc"])
        distinct = np.unique(keys)
        at = be.get(tier.rows(be.put(distinct)))
        weights[at] += 1
        state[at] += 2
        tier.fast.weights[be.put(at)] = be.put(weights[at])
        tier.fast.state["acc"][be.put(at)] = be.put(state[at])
        model[distinct] += 1
        acc[distinct] += 2
    tier.flush()
    assert_same(store.arrays.weights, model)
    assert_same(store.arrays.state["acc"], acc)
    assert tier.stats["prefetched"] > 0 and tier.stats["evictions"] > 0


def test_rows_are_made_on_first_touch(tmp_path):
    """A file table starts as sparse files: only the rows a batch touched are written."""
    coll = collection(tables(tmp_path, "mmap", None, rows=1 << 16, dim=64))
    coll.forward({"t": np.array([5, 70000 % (1 << 16)])})
    store = next(iter(coll.tiers.values())).store
    assert_same(store.touched_rows(), np.array([5, 70000 % (1 << 16)]))
    weights = os.path.join(tmp_path, "t", "rank0.w64.weights")
    assert os.path.getsize(weights) == (1 << 16) * 64 * 4
    assert os.stat(weights).st_blocks * 512 < (1 << 16) * 64 * 4 // 8  # sparse on disk


def test_checkpoints_hold_touched_rows_and_chain(rng, tmp_path, monkeypatch):
    """A file table's save holds the rows its files hold, not the files, written and
    restored a chunk of rows at a time; incremental saves the rows changed; the chain
    loads (into another path) as the table in memory was."""
    from hbkernels.sharding.checkpoint import _format, _restore

    for module in (_format, _restore):  # rows gathered to be saved, and restored
        monkeypatch.setattr(module, "CHUNK_ROWS", 7)
    ref = collection(tables(tmp_path, rows=400))
    got = collection(tables(tmp_path, "mmap", 4, rows=400))
    train_both(rng, ref, got, 3, rows=400)
    got.save(tmp_path / "full")
    saved = [f for f in read_manifest(tmp_path / "full")["files"] if f["table"] == "t"]
    held = int(next(iter(got.tiers.values())).store.touched_rows().shape[0])
    assert {f["num_rows"] for f in saved} == {held} and 0 < held < 400
    train_both(rng, ref, got, 2, rows=400)
    got.save(tmp_path / "inc", incremental=True)
    snapshot = {name: (ref.full_weights(name), ref.full_state(name)) for name in ref.tables}
    train_both(rng, ref, got, 1, rows=400)  # after the save: not in it
    back = hbk.EmbeddingCollection.load(tmp_path / "inc", comm=LOCAL, paths={"t": tmp_path / "b"})
    for name, (weights, state) in snapshot.items():
        assert_same(back.full_weights(name), weights, name)
        loaded = back.full_state(name)
        for k in state:
            assert_same(loaded[k], state[k], (name, k))
    with raises(ValueError, match="not tables of storage='mmap'"):
        hbk.EmbeddingCollection.load(tmp_path / "inc", comm=LOCAL, paths={"u": tmp_path / "d"})


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_load_goes_on_like_the_saver(rng, tmp_path, opt):
    got = collection(tables(tmp_path, "mmap", 3, rows=60), opt)
    batches = [batch(rng, rows=60) for _ in range(6)]
    gs = [grads(rng, {f: np.zeros((7, 5)) for f in batches[0]}) for _ in range(6)]
    for k in range(3):
        got.forward(batches[k])
        got.backward(gs[k])
    got.save(tmp_path / "ck")
    back = hbk.EmbeddingCollection.load(tmp_path / "ck", comm=LOCAL, paths={"t": tmp_path / "b"})
    for coll in (got, back):
        for k in range(3, 6):
            coll.forward(batches[k])
            coll.backward(gs[k])
    assert_tables_equal(got, back)


CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import hbkernels as hbk
    from hbkernels.sharding import tier

    where, mode = sys.argv[1], sys.argv[2]
    spec = hbk.TableSpec("t", num_rows=300, dim=4, storage="mmap", path=os.path.join(where, "t"),
                         cache_rows=8)
    coll = hbk.EmbeddingCollection([spec], comm=hbk.dist.init("local"), device="cpu",
                                   optimizer=hbk.optim.Adam(lr=0.1))

    def step(k):
        rng = np.random.default_rng(k)
        ids = rng.integers(0, 300, 40)
        out = coll.forward({"t": hbk.Ragged(ids, np.array([0, 20, 40]))})
        coll.backward({"t": rng.standard_normal(out["t"].shape).astype(np.float32)})

    for k in range(3):
        step(k)
    coll.save(os.path.join(where, "ck"))
    write = tier.Store.write

    def dying(self, rows, weights, state):  # half the rows written, then SIGKILL
        half = rows.shape[0] // 2
        write(self, rows[:half], weights[:half], {s: v[:half] for s, v in state.items()})
        os.kill(os.getpid(), signal.SIGKILL)

    tier.Store.write = dying
    step(3)  # its evictions are written back in a background thread
    if mode == "save":
        coll.save(os.path.join(where, "ck"))
    else:
        step(4)  # its lookup waits for step 3's write-backs
    print("not killed")
""")


@pytest.mark.parametrize("mode", ["evict", "save"])
def test_a_kill_during_write_back_leaves_the_last_save_loadable(tmp_path, mode):
    """SIGKILL while evicted rows (or a save's flush) are half written to the files:
    the last save loads and holds the state it saved."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), mode], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    back = hbk.EmbeddingCollection.load(tmp_path / "ck", comm=LOCAL, paths={"t": tmp_path / "b"})
    spec = hbk.TableSpec("t", num_rows=300, dim=4)
    ref = hbk.EmbeddingCollection([spec], comm=LOCAL, device="cpu", optimizer=hbk.optim.Adam(lr=0.1))
    for k in range(3):
        r = np.random.default_rng(k)
        ids = r.integers(0, 300, 40)
        out = ref.forward({"t": hbk.Ragged(ids, np.array([0, 20, 40]))})
        ref.backward({"t": r.standard_normal(out["t"].shape).astype(np.float32)})
    assert_tables_equal(ref, back)


def test_bad_specs_and_a_path_in_use(tmp_path):
    bad = [dict(storage="disk"), dict(storage="mmap"), dict(storage="host", path=str(tmp_path)),
           dict(cache_rows=4), dict(storage="host", cache_rows=0),
           dict(storage="host", cache_rows=2, cache_policy="none"),
           dict(storage="host", device="cpu")]
    for kw in bad:
        with raises(ValueError, match="table 't'"):
            hbk.types.table_spec(hbk.TableSpec("t", num_rows=5, dim=2, **kw))
    spec = [hbk.TableSpec("t", num_rows=5, dim=2, storage="mmap", path=str(tmp_path / "x"))]
    first = collection(spec)
    with raises(ValueError, match="in use"):
        collection(spec)
    del first
    collection(spec)  # the files are free again once their collection is gone
    with raises(ValueError, match="has no cache"):
        collection(tables(tmp_path, "host")).cache_stats("t")


def test_plan_counts_the_cache_not_the_table(tmp_path):
    """A file table larger than memory_per_rank is placed: a rank holds its cache."""
    big = 10**9 * 1000  # rows of dim 5
    spec = [hbk.TableSpec("t", num_rows=big, dim=5, storage="mmap", path=str(tmp_path / "t"),
                          cache_rows=1000)]
    plan = make_plan(spec, 1, memory_per_rank=10**6)
    assert plan["t"].kind in hbk.types.PLACEMENTS
    with raises(ValueError, match="does not fit"):
        make_plan([spec[0]._replace(storage="device", path=None, cache_rows=None)], 1,
                           memory_per_rank=10**6)


@needs_mpi
def test_two_ranks(tmp_path):
    """Every placement and a dynamic table at two ranks, bit for bit like the tables in
    memory; a save at two ranks loads at two and at one."""
    rc, out, _ = mpirun(2, "tiered.py", str(tmp_path), timeout=300)
    assert_ok(rc, out, range(2))


def test_checkpoint_error_names_a_missing_rows_file(tmp_path, rng):
    got = collection(tables(tmp_path, "mmap", 3))
    train_both(rng, collection(tables(tmp_path)), got, 1)
    got.save(tmp_path / "ck")
    manifest = read_manifest(tmp_path / "ck")
    rows = next(f for f in manifest["files"] if f["table"] == "t" and f["array"] == "rows")
    os.remove(tmp_path / "ck" / rows["file"])
    with raises(CheckpointError, match="rows"):
        hbk.EmbeddingCollection.load(tmp_path / "ck", comm=LOCAL, paths={"t": tmp_path / "b"})


def test_shard_arrays_hand_out_the_store(tmp_path, rng):
    """Writes through shard_arrays (the torch state_dict's load) are what the next
    batch reads: the cache is written back and emptied first."""
    got = collection(tables(tmp_path, "mmap", 4))
    train_both(rng, collection(tables(tmp_path)), got, 2)
    shard = next(s for s in got.local_shards() if s.table == "t")
    arrays = got.shard_arrays(shard)
    arrays["weights"][:] = 1.0
    out = got.forward({"t": np.arange(3)})
    assert_same(host(out["t"]), np.ones((3, 5), np.float32))


def test_a_full_disk_is_an_error_not_a_crash(tmp_path, monkeypatch):
    """Writes to a mapped file past a full disk would kill the process: the store checks
    the room first, and an eviction's write-back in the background raises at the next
    call."""
    import errno

    got = collection(tables(tmp_path, "mmap", 2))
    real = os.statvfs

    class Full:
        def __init__(self, path):
            self.f_frsize, self.f_bavail = real(path).f_frsize, 0

    got.forward({"t": np.array([1, 2])})
    monkeypatch.setattr(os, "statvfs", Full)
    with raises(OSError) as error:
        got.forward({"t": np.array([3, 4])})  # evicts rows 1 and 2: their write-back fails
        got.forward({"t": np.array([5])})
    assert error.value.errno == errno.ENOSPC and "free on its disk" in str(error.value)
    uncached = collection(tables(tmp_path, "mmap", None, where="u"))
    with raises(OSError, match="free on its disk"):
        uncached.forward({"t": np.array([3])})
