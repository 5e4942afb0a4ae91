"""Dynamic tables (TableSpec(num_rows=None)) in an EmbeddingCollection: one rank here,
2 and 3 ranks under mpiexec (tests/mpi/dynamic.py)."""
import zlib

import numpy as np
import pytest
from helpers import raises, same_collections
from mpirun import assert_ok, mpirun, needs_mpi

import hbkernels as hbk
from hbkernels.sharding import initial_weights
from hbkernels.sharding.checkpoint import read_manifest

LOCAL = hbk.dist.init("local")
SCALE = 0.05


def static(name="t", num_rows=64, **kw):
    return hbk.TableSpec(name, num_rows=num_rows, dim=kw.pop("dim", 5), init_scale=SCALE, **kw)


def dynamic(name="t", capacity=64, **kw):
    kw.setdefault("evict", "none")
    return hbk.TableSpec(name, num_rows=None, dim=kw.pop("dim", 5), capacity=capacity,
                         init_scale=SCALE, **kw)


def batch(rng, ids, bags=6, max_len=4):
    lengths = rng.integers(0, max_len + 1, bags)
    values = rng.choice(ids, int(lengths.sum()))
    return hbk.Ragged(values, np.concatenate([[0], np.cumsum(lengths)]))


@pytest.mark.parametrize("optimizer", ["Adagrad", "Adam", "RowWiseAdagrad"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_trains_bit_for_bit_like_a_static_table(rng, optimizer, combiner):
    """evict="none", admit_count=1: the same outputs and rows, bit for bit, as static
    tables whose row i is id i; two dynamic tables share one fused array (with Adam each
    has its own), beside a static one."""
    opt = lambda: getattr(hbk.optim, optimizer)(lr=0.1)  # noqa: E731
    other = hbk.TableSpec("u", num_rows=7, dim=5)
    third = hbk.TableSpec("w", num_rows=9, dim=5, combiner="sqrtn")
    dyn_other = other._replace(num_rows=None, capacity=8, init_scale=other.scale, evict="none")
    twin = hbk.EmbeddingCollection([static(combiner=combiner), other, third], comm=LOCAL,
                                   optimizer=opt(), seed=3)
    dyn = hbk.EmbeddingCollection([dynamic(combiner=combiner), dyn_other, third], comm=LOCAL,
                                  optimizer=opt(), seed=3)
    groups = {g for g in dyn.arrays if g.dynamic}  # Adam: each table its arrays (its steps)
    assert [len(dyn.local_shards(g)) for g in groups] == ([1, 1] if optimizer == "Adam" else [2])
    for step in range(4):
        feats = {"t": batch(rng, np.arange(64)), "u": rng.integers(0, 7, 6),
                 "w": batch(rng, np.arange(9))}
        a, b = twin.forward(feats), dyn.forward(feats)
        for f in feats:
            np.testing.assert_array_equal(a[f], b[f])
        grads = {f: rng.standard_normal(a[f].shape).astype(np.float32) for f in feats}
        twin.backward(grads)
        dyn.backward(grads)
    ids, rows = dyn.full_weights("t")
    assert ids.tolist() == sorted(set(ids.tolist()))
    np.testing.assert_array_equal(rows, twin.full_weights("t")[ids])
    u_ids, u_rows = dyn.full_weights("u")
    np.testing.assert_array_equal(u_rows, twin.full_weights("u")[u_ids])
    np.testing.assert_array_equal(dyn.full_weights("w"), twin.full_weights("w"))
    assert dyn.dynamic_counts("t") == {"size": len(ids), "admitted": len(ids), "evicted": 0,
                                      "forgotten": 0}


def test_raw_hashes_start_from_their_id(rng):
    """Any int64 id (negative, the edges) gets the row initial_weights gives that id."""
    spec = dynamic(capacity=16)
    coll = hbk.EmbeddingCollection([spec], comm=LOCAL, optimizer=hbk.optim.SGD(lr=0.1), seed=9)
    edges = np.array([-2**63, 2**63 - 1, -1, 0, 12345678901234567], np.int64)
    out = coll.forward({"t": hbk.Ragged(edges, np.arange(6))})
    np.testing.assert_array_equal(out["t"], initial_weights(spec, 9, edges))
    ids, rows = coll.full_weights("t")
    assert ids.tolist() == sorted(edges.tolist())
    np.testing.assert_array_equal(rows, initial_weights(spec, 9, ids))


SEEDS = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, -2**32, -1, 2**40, 2**63, -2**63, 2**64 - 1]


def test_every_bit_of_the_seed_counts():
    """Seeds that differ only above bit 32, or only in sign, make different tables; the
    accepted seeds are the integers in [-2**63, 2**64), anything else a ValueError."""
    spec = static(num_rows=8, dim=4)
    tables = [initial_weights(spec, s) for s in SEEDS]
    for i, a in enumerate(tables):
        for j in range(i):
            assert not np.array_equal(a, tables[j]), (SEEDS[i], SEEDS[j])
    assert np.array_equal(initial_weights(spec, np.uint64(2**64 - 1)), tables[-1])
    assert np.array_equal(initial_weights(spec, np.int64(-1)), tables[SEEDS.index(-1)])
    for seed in (0, 2**32, -2**32):  # the collection's tables and a dynamic table's rows too
        coll = hbk.EmbeddingCollection([spec, dynamic("d", dim=4)], comm=LOCAL, seed=seed)
        np.testing.assert_array_equal(coll.full_weights("t"), tables[SEEDS.index(seed)])
        out = coll.forward({"d": hbk.Ragged(np.array([3], np.int64), np.array([0, 1]))})
        np.testing.assert_array_equal(out["d"], initial_weights(static("d", dim=4), seed, [3]))
    for bad in (2**64, -2**63 - 1, 1.5, 2.0, "3", None, True, np.float32(1)):
        with raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
            initial_weights(spec, bad)


@pytest.mark.parametrize("dim", [1, 2, 6, 64])
def test_distinct_ids_get_distinct_rows(dim):
    """Ids that agree in their low 58 bits, or are 2**63 apart, start from different rows
    (at an even dim, or 64, the element hash of row·dim + column made them equal), in a
    static table's initial weights and in a dynamic table's admitted rows alike."""
    ids = np.array([7, 7 + 2**58, 7 - 2**63, -3, 2**63 - 3, 0, -2**63, 2**63 - 1, -1, 2**62],
                   np.int64)
    rows = initial_weights(static(dim=dim), 5, ids)
    for i in range(len(ids)):
        for j in range(i):
            assert not np.array_equal(rows[i], rows[j]), (ids[i], ids[j])
    coll = hbk.EmbeddingCollection([dynamic(dim=dim)], comm=LOCAL, seed=5)
    out = coll.forward({"t": hbk.Ragged(ids, np.arange(len(ids) + 1))})
    np.testing.assert_array_equal(out["t"], rows)


def _plain_initial_rows(seed, name, rows, dim, scale):
    """The initial-weights formula once more, vectorised in NumPy uint64 over the rows."""
    def mix(x):  # splitmix64, wrapping
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        crc = zlib.crc32(name.encode())
        key = mix(np.uint64(((seed % 2**32) << 32) | crc))
        if not 0 <= seed < 2**32:
            key = mix(key ^ np.uint64((seed >> 32) % 2**64))
        state = mix(np.asarray(rows, np.int64).view(np.uint64) ^ key)[:, None]
        cols = np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        u = (mix(state + cols) >> np.uint64(40)).astype(np.float64) / 2.0**24
    return ((2.0 * u - 1.0) * scale).astype(np.float32)


@pytest.mark.parametrize("dim", [1, 5, 64])
@pytest.mark.parametrize("seed", [0, 3, -1, 2**32 + 3, -2**63, 2**64 - 1])
def test_initial_weights_follow_the_formula(dim, seed):
    """Rows (negative ids, the int64 edges) and column slices equal the formula written
    plainly: hbk.reference.initial_weights (Python ints) and a NumPy uint64 version."""
    spec = static("user", dim=dim)
    ids = np.array([0, 1, 7, -1, -7, 2**63 - 1, -2**63, 7 + 2**58, 123456789012345], np.int64)
    rows = initial_weights(spec, seed, ids)
    np.testing.assert_array_equal(rows, _plain_initial_rows(seed, "user", ids, dim, SCALE))
    np.testing.assert_array_equal(
        rows, hbk.reference.initial_weights(spec, seed, ids).astype(np.float32))
    np.testing.assert_array_equal(initial_weights(spec, seed, ids, dim // 2, dim),
                                  rows[:, dim // 2:])
    np.testing.assert_array_equal(  # a whole static table, default scale 1/sqrt(num_rows)
        initial_weights(hbk.TableSpec("v", num_rows=9, dim=dim), seed),
        hbk.reference.initial_weights(hbk.TableSpec("v", num_rows=9, dim=dim), seed)
        .astype(np.float32))
    assert np.abs(rows).max() <= SCALE


def test_admission_and_eviction_reset_rows_and_state():
    """admit_count=2: an id adds nothing and gets no update until its second call; an
    evicted id that comes back starts again from its initial row and fresh state."""
    spec = dynamic(capacity=2, evict="lru", admit_count=2, dim=3)
    coll = hbk.EmbeddingCollection([spec], comm=LOCAL, optimizer=hbk.optim.Adagrad(lr=0.5), seed=1)
    one = lambda *ids: {"t": hbk.Ragged(np.array(ids, np.int64), np.array([0, len(ids)]))}  # noqa: E731
    start = initial_weights(spec, 1, [10, 20, 30])
    out = coll.forward(one(10, 20))
    np.testing.assert_array_equal(out["t"], 0)  # seen once: not admitted, nothing added
    coll.backward({"t": np.ones((1, 3), np.float32)})
    assert coll.full_weights("t")[0].size == 0
    out = coll.forward(one(10, 20))  # second call: both admitted, from their initial rows
    np.testing.assert_allclose(out["t"][0], start[0] + start[1], rtol=1e-6)
    coll.backward({"t": np.ones((1, 3), np.float32)})
    trained = coll.full_weights("t")[1][0].copy()
    assert not np.allclose(trained, start[0])
    coll.forward(one(30))
    coll.backward({"t": np.ones((1, 3), np.float32)})
    coll.forward(one(30))  # admitted: evicts 10 (call 2, smaller id than 20)
    coll.backward({"t": np.zeros((1, 3), np.float32)})
    assert coll.full_weights("t")[0].tolist() == [20, 30]
    coll.forward(one(10))
    coll.forward(one(10))  # back, evicting 20: its initial row again
    ids, rows = coll.full_weights("t")
    assert ids.tolist() == [10, 30]
    np.testing.assert_array_equal(rows[0], start[0])
    coll.backward({"t": np.ones((1, 3), np.float32)})  # fresh Adagrad state: the first step's size
    np.testing.assert_allclose(coll.full_weights("t")[1][0], trained, rtol=1e-6)
    assert coll.dynamic_counts("t") == {"size": 2, "admitted": 4, "evicted": 2, "forgotten": 0}


def test_a_full_table_raises_capacity_error():
    coll = hbk.EmbeddingCollection([dynamic(capacity=3)], comm=LOCAL)
    coll.forward({"t": np.array([1, 2, 3])})
    with raises(hbk.CapacityError, match="t is full: capacity 3"):
        coll.forward({"t": np.array([4])})


@pytest.mark.parametrize("width", [5, 3])  # b beside a in one fused array, and in its own
def test_a_forward_that_one_full_table_refuses_changes_no_table(width):
    a = dynamic(name="a", capacity=100)
    b = dynamic(name="b", capacity=2, dim=width, evict="none")
    coll = hbk.EmbeddingCollection([a, b], comm=LOCAL)
    with raises(hbk.CapacityError, match="b is full: capacity 2"):
        coll.forward({"a": np.array([1, 2, 3]), "b": np.array([7, 8, 9])})
    assert coll.dynamic_counts("a") == {"size": 0, "admitted": 0, "evicted": 0, "forgotten": 0}
    assert coll.dynamic_counts("b") == {"size": 0, "admitted": 0, "evicted": 0, "forgotten": 0}
    coll.forward({"a": np.array([1, 2, 3]), "b": np.array([7, 8])})  # fits: both admit
    assert coll.dynamic_counts("a")["size"] == 3 and coll.dynamic_counts("b")["size"] == 2


def test_bad_specs():
    with raises(ValueError, match="needs a capacity"):
        hbk.TableSpec("t", num_rows=None, dim=4)
        hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=None, dim=4)], comm=LOCAL)
    with raises(ValueError, match="capacity is for dynamic tables"):
        hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=4, dim=4, capacity=9)], comm=LOCAL)
    with raises(ValueError, match="evict must be one of"):
        hbk.EmbeddingCollection([dynamic(evict="fifo")], comm=LOCAL)
    with raises(ValueError, match="placed row_wise"):
        hbk.EmbeddingCollection([dynamic()], comm=LOCAL, plan="data_parallel")


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_dynamic_tables_across_ranks(n):
    """At n ranks: bit for bit like a static row_wise and table_wise twin, and equal to
    one rank fed the whole batch up to summation order (raw 64-bit ids)."""
    rc, out, _ = mpirun(n, "dynamic.py", timeout=300)
    assert_ok(rc, out, range(n))


@needs_mpi
def test_dynamic_tables_through_the_hierarchical_exchange():
    """The same at 4 ranks as 2 nodes of 2, the exchange hierarchical."""
    rc, out, _ = mpirun(4, "dynamic.py", 2, timeout=300)
    assert_ok(rc, out, range(4))


def _train(coll, rng, pool, steps):
    for _ in range(steps):
        out = coll.forward({"t": batch(rng, pool)})
        coll.backward({"t": rng.standard_normal(out["t"].shape).astype(np.float32)})


def test_checkpoint_keeps_ids_rows_state_and_scores(rng, tmp_path):
    """save -> load: the same ids, rows, Adam state and LRU scores; the two then train
    alike, evicting the same ids."""
    pool = rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64)
    spec = dynamic(capacity=24, evict="lru", admit_count=2)
    coll = hbk.EmbeddingCollection([spec, static("u")], comm=LOCAL, optimizer=hbk.optim.Adam(lr=0.1))
    _train(coll, rng, pool, 6)
    coll.save(tmp_path / "ckpt")
    back = hbk.EmbeddingCollection.load(tmp_path / "ckpt", comm=LOCAL)
    ids, rows = coll.full_weights("t")
    np.testing.assert_array_equal(back.full_weights("t")[0], ids)
    np.testing.assert_array_equal(back.full_weights("t")[1], rows)
    for table in ("t", "u"):
        a, b = coll.full_state(table), back.full_state(table)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(back.hash_tables["t"].scores(ids), coll.hash_tables["t"].scores(ids))
    assert back.dynamic_counts("t")["size"] == coll.dynamic_counts("t")["size"]
    seed = int(rng.integers(1 << 30))
    _train(coll, np.random.default_rng(seed), pool, 3)
    _train(back, np.random.default_rng(seed), pool, 3)
    for a, b in zip(coll.full_weights("t"), back.full_weights("t")):
        np.testing.assert_array_equal(a, b)


@needs_mpi
def test_checkpoint_across_world_sizes(tmp_path):
    """save at 2 ranks -> load at 3 (bit-equal, ids re-hashed to their owners, trains on)
    -> save -> load at 1."""
    for n, mode in [(2, "save"), (3, "load"), (1, "load-again")]:
        rc, out, _ = mpirun(n, "dynamic_checkpoint.py", mode, str(tmp_path), timeout=150)
        assert_ok(rc, out, range(n))


def test_incremental_saves_chain_and_replay(rng, tmp_path):
    """full save, then two incremental ones holding only the changed rows (static and
    dynamic tables, Adagrad state); loading the last replays the chain bit for bit."""
    pool = rng.integers(-2**63, 2**63 - 1, 50, dtype=np.int64)
    specs = [dynamic(capacity=20, evict="lfu", admit_count=2), static("u", num_rows=500)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=hbk.optim.Adagrad(lr=0.2))

    def train(steps):
        for _ in range(steps):
            # t: at most 18 ids a call, within capacity; u: rows < 20 change
            feats = {"t": batch(rng, pool, max_len=3), "u": rng.integers(0, 20, 6)}
            out = coll.forward(feats)
            coll.backward({f: rng.standard_normal(o.shape).astype(np.float32) for f, o in out.items()})

    train(4)
    coll.save(tmp_path / "a")
    for name in ("b", "c"):
        train(3)
        coll.forward({"t": batch(rng, pool, max_len=3), "u": rng.integers(0, 20, 6)})  # admits, no update
        coll.save(tmp_path / name, incremental=True, chain_limit=np.inf)
        manifest = read_manifest(tmp_path / name)
        assert manifest["parent"]["path"] == ("../a" if name == "b" else "../b")
        u_rows = [f["num_rows"] for f in manifest["files"] if f["table"] == "u" and f["array"] == "weights"]
        assert 0 < sum(u_rows) <= 20, u_rows  # the changed rows only, not all 500
    back = hbk.EmbeddingCollection.load(tmp_path / "c", comm=LOCAL)
    same_collections(coll, back)
    with raises(ValueError, match="new directory"):
        coll.save(tmp_path / "b", incremental=True)
    fresh = hbk.EmbeddingCollection(specs, comm=LOCAL)
    with raises(ValueError, match="needs an earlier save"):
        fresh.save(tmp_path / "d", incremental=True)


def test_a_broken_link_is_refused_naming_its_file(rng, tmp_path):
    coll = hbk.EmbeddingCollection([dynamic(capacity=20), static("u")], comm=LOCAL)
    feats = {"t": batch(rng, np.arange(20)), "u": rng.integers(0, 64, 6)}  # within capacity
    coll.forward(feats)
    coll.save(tmp_path / "a")
    coll.forward(feats)
    coll.save(tmp_path / "b", incremental=True)
    other = hbk.EmbeddingCollection([dynamic(capacity=20), static("u")], comm=LOCAL, seed=5)
    other.forward(feats)
    other.save(tmp_path / "a")  # a different save where b's parent was
    with raises(hbk.CheckpointError, match=r"a/manifest.json: not the save .*b/manifest.json"):
        hbk.EmbeddingCollection.load(tmp_path / "b", comm=LOCAL)


def test_torch_state_dict_round_trip(rng):
    """EmbeddingCollectionModule.state_dict() holds a dynamic table's ids, scores, rows
    and state; load_state_dict into a fresh module gives the same tables; eval mode
    admits nothing."""
    torch = pytest.importorskip("torch")
    from hbkernels.adapters.torch import EmbeddingCollectionModule

    def module():
        return EmbeddingCollectionModule(hbk.EmbeddingCollection(
            [dynamic(capacity=16, evict="lru"), static("u")], comm=LOCAL,
            optimizer=hbk.optim.Adam(lr=0.1)))

    src = module()
    pool = rng.integers(-2**63, 2**63 - 1, 30, dtype=np.int64)
    for _ in range(4):
        b = batch(rng, pool, max_len=2)  # at most 12 distinct ids a call: within capacity
        out = src({"t": (torch.from_numpy(b.values), torch.from_numpy(b.offsets)),
                   "u": torch.from_numpy(rng.integers(0, 64, 6))})
        sum(o.sum() for o in out.values()).backward()
    state = src.state_dict()
    size = src.collection.dynamic_counts("t")["size"]
    assert state["tables.t.ids"].shape == state["tables.t.last"].shape == (size,)
    dst = module()
    dst.load_state_dict(state)
    a, b = src.collection, dst.collection
    for x, y in zip(a.full_weights("t") + a.dynamic_scores("t"), b.full_weights("t") + b.dynamic_scores("t")):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.full_weights("u"), b.full_weights("u"))
    for k, v in a.full_state("t").items():
        np.testing.assert_array_equal(v, b.full_state("t")[k])
    dst.eval()
    before = dst.collection.dynamic_counts("t")
    new = torch.tensor([123456789, 987654321])
    with torch.no_grad():
        out = dst({"t": (new, torch.tensor([0, 2])), "u": torch.tensor([1])})
    assert float(out["t"].abs().sum()) == 0 and dst.collection.dynamic_counts("t") == before


def test_torch_state_dict_keeps_ids_waiting_for_admission(rng):
    """admit_count=3: state_dict() holds the ids seen but not yet admitted and their
    sightings; a module loaded from it admits the same ids on the same next batches."""
    torch = pytest.importorskip("torch")
    from hbkernels.adapters.torch import EmbeddingCollectionModule

    def module():
        return EmbeddingCollectionModule(hbk.EmbeddingCollection(
            [dynamic(capacity=40, evict="lfu", admit_count=3)], comm=LOCAL,
            optimizer=hbk.optim.Adagrad(lr=0.1)))

    def step(m, b):
        out = m({"t": (torch.from_numpy(b.values), torch.from_numpy(b.offsets))})
        out["t"].sum().backward()

    src = module()
    pool = rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64)
    for _ in range(5):
        step(src, batch(rng, pool, bags=8))
    # the last call before saving only sees new ids: its number is kept with them alone
    step(src, hbk.Ragged(rng.integers(2**40, 2**41, 3), np.arange(4)))
    state = src.state_dict()
    ids, last, count = src.collection.dynamic_pending("t")
    assert ids.shape[0] > 0 and (count > 0).all() and (count < 3).all()
    np.testing.assert_array_equal(state["tables.t.pending_ids"].numpy(), ids)
    np.testing.assert_array_equal(state["tables.t.pending_count"].numpy(), count)
    dst = module()
    step(dst, hbk.Ragged(rng.integers(2**41, 2**42, 3), np.arange(4)))  # replaced by the load
    dst.load_state_dict(state)
    for x, y in zip(dst.collection.dynamic_pending("t"), (ids, last, count)):
        np.testing.assert_array_equal(x, y)
    for _ in range(3):
        b = batch(rng, pool, bags=8)
        step(src, b)
        step(dst, b)
    for x, y in zip(src.collection.full_weights("t") + src.collection.dynamic_scores("t"),
                    dst.collection.full_weights("t") + dst.collection.dynamic_scores("t")):
        np.testing.assert_array_equal(x, y)
    del state["tables.t.pending_count"]
    with raises(RuntimeError, match="pending_count"):
        module().load_state_dict(state)


def test_pending_ids_beyond_the_share_of_capacity_are_counted():
    """admit_count=2: the ids waiting for their second sighting are held in a pending
    table of the table's capacity (a rank's share of it); a batch of more new ids than
    that leaves the rest uncounted, and dynamic_counts says how many."""
    coll = hbk.EmbeddingCollection([dynamic(capacity=4, admit_count=2, evict="lru")],
                                   comm=LOCAL)
    coll.forward({"t": np.arange(10, dtype=np.int64)})  # 10 new ids, 4 held
    assert coll.dynamic_counts("t") == {"size": 0, "admitted": 0, "evicted": 0, "forgotten": 6}
    coll.forward({"t": np.arange(4, dtype=np.int64)})  # the 4 held: their second sighting
    assert coll.dynamic_counts("t") == {"size": 4, "admitted": 4, "evicted": 0, "forgotten": 6}
