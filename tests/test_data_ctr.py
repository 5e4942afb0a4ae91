"""hbkernels.data.ctr: SyntheticClicks (determinism, rank slices, id ranges, bag
lengths, labels against the planted logistic model recomputed here) and
ParquetClicks (column detection, the dense / id transforms against values read
back from the files in plain Python, errors, the rank split, the Criteo sample)."""
import csv
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import write_parquet_files

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import hbkernels as hbk  # noqa: E402
from hbkernels.data import ClickBatch, ParquetClicks, SyntheticClicks, convert_criteo, hash_strings  # noqa: E402
from hbkernels.data.ctr import EVAL, TRAIN  # noqa: E402
from hbkernels.data.synthetic import SyntheticTable  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"

TABLES = [SyntheticTable("user", 1000), SyntheticTable("item", 300, 3),
          SyntheticTable("hist", 500, 4, True), SyntheticTable("geo", 7, 1, True)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in ((a.label, b.label), (a.dense, b.dense)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    assert list(a.sparse) == list(b.sparse)
    for name in a.sparse:
        x, y = a.sparse[name], b.sparse[name]
        assert type(x) is type(y), name
        if isinstance(x, hbk.Ragged):
            np.testing.assert_array_equal(x.values, y.values, err_msg=name)
            np.testing.assert_array_equal(x.offsets, y.offsets, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


def check_ragged(r, n):
    assert isinstance(r, hbk.Ragged)
    assert r.offsets.shape == (n + 1,) and r.offsets.dtype == np.int64
    assert r.values.dtype == np.int64
    assert r.offsets[0] == 0 and r.offsets[-1] == len(r.values)
    assert (np.diff(r.offsets) >= 0).all()


def bags_of(ids):
    """Per-sample lists of ids of a 1-D id array or a Ragged."""
    if isinstance(ids, hbk.Ragged):
        o = ids.offsets
        return [ids.values[o[b]:o[b + 1]].tolist() for b in range(len(o) - 1)]
    return [[int(i)] for i in ids]


# -- SyntheticClicks -----------------------------------------------------------------------------
def test_synthetic_layout(rng):
    seed = int(rng.integers(2**31))
    clicks = SyntheticClicks(TABLES, num_dense=5, seed=seed)
    assert clicks.features == ["user", "item", "hist", "geo"]
    n = 257
    b = clicks.batch(index=int(rng.integers(1000)), size=n)
    assert isinstance(b, ClickBatch) and len(b) == n
    assert b.label.dtype == np.float32 and b.label.shape == (n,)
    assert b.dense.dtype == np.float32 and b.dense.shape == (n, 5)
    assert set(np.unique(b.label)) <= {0.0, 1.0}
    assert list(b.sparse) == clicks.features
    # hotness 1, not variable: one int64 id per sample; everything else a Ragged
    assert isinstance(b.sparse["user"], np.ndarray)
    assert b.sparse["user"].dtype == np.int64 and b.sparse["user"].shape == (n,)
    for name in ("item", "hist", "geo"):
        check_ragged(b.sparse[name], n)
    for t in TABLES:
        ids = b.sparse[t.name]
        values = ids.values if isinstance(ids, hbk.Ragged) else ids
        assert values.min() >= 0 and values.max() < t.num_rows, t.name
    assert (np.diff(b.sparse["item"].offsets) == 3).all()
    assert (np.diff(b.sparse["geo"].offsets) == 1).all()  # variable with hotness 1: [1, 1]
    # tuples work as tables too
    same = SyntheticClicks([tuple(t) for t in TABLES], num_dense=5, seed=seed)
    assert_batches_equal(same.batch(3, 20), clicks.batch(3, 20))


def test_synthetic_variable_lengths(rng):
    clicks = SyntheticClicks([SyntheticTable("a", 50, 3, True), SyntheticTable("b", 50, 5, False),
                              SyntheticTable("c", 50, 1)], num_dense=1, seed=int(rng.integers(2**31)))
    b = clicks.batch(0, 4000)
    lengths = np.diff(b.sparse["a"].offsets)
    assert lengths.min() == 1 and lengths.max() == 5  # [1, 2h - 1], both ends reached
    assert set(np.unique(lengths)) == {1, 2, 3, 4, 5}
    assert abs(lengths.mean() - 3) < 0.15  # mean hotness (sd of the mean ~0.022)
    assert (np.diff(b.sparse["b"].offsets) == 5).all()


def test_synthetic_determinism(rng):
    seed = int(rng.integers(2**31))
    a = SyntheticClicks(TABLES, num_dense=3, seed=seed)
    b = SyntheticClicks(TABLES, num_dense=3, seed=seed)
    for index, stream in [(0, TRAIN), (7, TRAIN), (7, EVAL), (123456, EVAL)]:
        assert_batches_equal(a.batch(index, 64, stream), b.batch(index, 64, stream))
        assert_batches_equal(a.batch(index, 64, stream), a.batch(index, 64, stream))
    np.testing.assert_array_equal(a.dense_effect, b.dense_effect)
    base = a.batch(7, 64)
    assert base.dense.shape == (64, 3)
    others = [a.batch(8, 64), a.batch(7, 64, EVAL),
              SyntheticClicks(TABLES, num_dense=3, seed=seed + 1).batch(7, 64)]
    for other in others:
        assert not np.array_equal(other.dense, base.dense)
        assert not np.array_equal(other.sparse["user"], base.sparse["user"])
        assert not np.array_equal(other.sparse["hist"].values[:10], base.sparse["hist"].values[:10])
    # a different seed plants a different model too
    c = SyntheticClicks(TABLES, num_dense=3, seed=seed + 1)
    assert not np.array_equal(c.dense_effect, a.dense_effect)
    assert not np.array_equal(c.row_effect[0], a.row_effect[0])


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_synthetic_batches_made_ahead_are_the_batches(rng, threads):
    clicks = SyntheticClicks(TABLES, num_dense=3, seed=int(rng.integers(2**31)))
    indices = [int(i) for i in rng.integers(0, 1000, 11)] + [4, 4]
    made = list(clicks.batches(indices, 40, EVAL, threads=threads))
    assert len(made) == len(indices)
    for index, batch in zip(indices, made):
        assert_batches_equal(batch, clicks.batch(index, 40, EVAL))
    assert list(clicks.batches([], 40, threads=threads)) == []


def test_synthetic_batches_stop_early_and_report_errors(rng):
    import threading

    clicks = SyntheticClicks(TABLES, num_dense=3, seed=1)
    batches = clicks.batches(range(10**6), 8, threads=2)
    first = next(batches)
    assert_batches_equal(first, clicks.batch(0, 8))
    batches.close()  # cancels what is ahead: no worker left running
    assert not [t for t in threading.enumerate() if t.name.startswith("hbkernels-batches")]
    with pytest.raises(ValueError, match="negative|size|>= 0"):
        list(clicks.batches([0, 1], -1, threads=2))
    with pytest.raises(ValueError, match="threads must be >= 0"):
        next(clicks.batches([0], 8, threads=-1))


@pytest.mark.parametrize("size, world", [(50, 2), (50, 3), (64, 4), (5, 7), (1, 1), (0, 2)])
def test_synthetic_rank_slices_concatenate_to_the_global_batch(rng, size, world):
    clicks = SyntheticClicks(TABLES, num_dense=2, seed=int(rng.integers(2**31)))
    full = clicks.batch(int(rng.integers(100)), size)
    parts = []
    for r in range(world):
        lo, hi = r * size // world, (r + 1) * size // world
        part = full.rows(lo, hi)
        assert len(part) == hi - lo and part.dense.shape == (hi - lo, 2)
        for name, ids in part.sparse.items():
            if isinstance(ids, hbk.Ragged):
                check_ragged(ids, hi - lo)
            else:
                assert ids.shape == (hi - lo,)
        parts.append(part)
    np.testing.assert_array_equal(np.concatenate([p.label for p in parts]), full.label)
    np.testing.assert_array_equal(np.concatenate([p.dense for p in parts]), full.dense)
    for name in full.sparse:
        got = [bag for p in parts for bag in bags_of(p.sparse[name])]
        assert got == bags_of(full.sparse[name]), name
        if isinstance(full.sparse[name], hbk.Ragged):
            np.testing.assert_array_equal(
                np.concatenate([p.sparse[name].values for p in parts]), full.sparse[name].values)


def test_synthetic_size_zero(rng):
    clicks = SyntheticClicks(TABLES, num_dense=4, seed=int(rng.integers(2**31)))
    b = clicks.batch(3, 0)
    assert len(b) == 0 and b.label.shape == (0,) and b.dense.shape == (0, 4)
    assert b.sparse["user"].shape == (0,)
    for name in ("item", "hist", "geo"):
        check_ragged(b.sparse[name], 0)
        assert b.sparse[name].offsets.tolist() == [0]
    assert len(b.rows(0, 0)) == 0


def planted_probability(clicks, batch):
    """sigmoid(dense @ v + sum_t mean(h_t[ids of t]) - 1), recomputed bag by bag."""
    logit = batch.dense.astype(np.float64) @ np.asarray(clicks.dense_effect, np.float64) - 1.0
    for t, effect in zip(clicks.tables, clicks.row_effect):
        effect = np.asarray(effect, np.float64)
        logit = logit + np.array([effect[bag].mean() for bag in bags_of(batch.sparse[t.name])])
    return 1.0 / (1.0 + np.exp(-logit))


def test_synthetic_labels_follow_the_planted_model(rng):
    tables = [SyntheticTable("user", 200), SyntheticTable("hist", 100, 3, True),
              SyntheticTable("item", 50, 2)]
    clicks = SyntheticClicks(tables, num_dense=4, seed=int(rng.integers(2**31)))
    assert len(clicks.row_effect) == 3
    assert [e.shape for e in clicks.row_effect] == [(200,), (100,), (50,)]
    assert np.shape(clicks.dense_effect) == (4,)
    n = 40000
    b = clicks.batch(int(rng.integers(1000)), n)
    p = planted_probability(clicks, b)
    y = b.label.astype(np.float64)

    def within(mask, z=5.0):
        q, k = p[mask], int(mask.sum())
        se = math.sqrt((q * (1 - q)).sum()) / k
        assert abs(y[mask].mean() - q.mean()) < z * se, (y[mask].mean(), q.mean(), se, k)

    within(np.ones(n, bool))
    # calibrated across the range of p, not only on average: quintiles of p
    edges = np.quantile(p, [0.2, 0.4, 0.6, 0.8])
    bins = np.digitize(p, edges)
    for k in range(5):
        within(bins == k)
    assert p[bins == 4].mean() - p[bins == 0].mean() > 0.2  # the model has signal
    assert y[bins == 4].mean() > y[bins == 0].mean() + 0.1
    # the effects are tied to the right table: shuffling a table's effect breaks the match
    other = SyntheticClicks(tables, num_dense=4, seed=clicks.seed)
    other.row_effect = [other.row_effect[0][::-1].copy(), *other.row_effect[1:]]
    q = planted_probability(other, b)
    assert not np.allclose(q, p)


def test_synthetic_no_dense(rng):
    clicks = SyntheticClicks([SyntheticTable("a", 30, 2, True)], num_dense=0, seed=int(rng.integers(2**31)))
    b = clicks.batch(0, 30)
    assert b.dense.shape == (30, 0)
    check_ragged(b.sparse["a"], 30)
    with pytest.raises(ValueError):
        SyntheticClicks([], num_dense=3)


# -- ParquetClicks -------------------------------------------------------------------------------
NUM_ROWS = 97  # a table size that no id column is a multiple of


def make_table(rng, first, n):
    """Rows ``first .. first + n - 1``: every column kind ParquetClicks sorts."""
    rid = np.arange(first, first + n, dtype=np.int64)
    f32 = rng.normal(0, 5, size=n).astype(np.float32)
    f32 = [None if rng.random() < 0.2 else float(v) for v in f32]
    f64 = rng.exponential(1000, size=n) * rng.choice([-1, 1], size=n)
    f64 = [None if rng.random() < 0.2 else float(v) for v in f64]
    big = rng.integers(-2**62, 2**62, size=n)
    big[: min(n, 3)] = [2**63 - 1, -2**63, 0][: min(n, 3)]
    big = [None if rng.random() < 0.1 and i >= 3 else int(v) for i, v in enumerate(big)]
    small = rng.integers(0, 10**6, size=n).astype(np.int32)
    words = [None if rng.random() < 0.2 else f"w{int(v)}" for v in rng.integers(0, 50, size=n)]
    if n >= 5:  # at least one null and one negative where the tests read them
        f32[-1] = f64[-1] = big[-1] = words[-1] = None
        f64[-2] = -abs(f64[-2] or 1.5)
    hist = []
    for _ in range(n):
        u = rng.random()
        if u < 0.15:
            hist.append(None)
        elif u < 0.3:
            hist.append([])
        else:
            hist.append([None if rng.random() < 0.1 else int(v)
                         for v in rng.integers(-2**40, 2**40, size=rng.integers(1, 5))])
    tags = [[f"t{int(v)}" for v in rng.integers(0, 9, size=rng.integers(0, 3))] for _ in range(n)]
    return pa.table({
        "label": pa.array((rng.random(n) < 0.3).astype(np.int32)),
        "f32": pa.array(f32, pa.float32()),
        "rid": pa.array(rid),
        "f64": pa.array(f64, pa.float64()),
        "big": pa.array(big, pa.int64()),
        "small": pa.array(small),
        "word": pa.array(words, pa.string()),
        "hist": pa.array(hist, pa.list_(pa.int64())),
        "tags": pa.array(tags, pa.list_(pa.string())),
        "flag": pa.array(rng.random(n) < 0.5),
    })


def write_files(tmp_path, rng, sizes, row_group_size=4):
    return write_parquet_files(tmp_path, rng, sizes, row_group_size, make_table)


def expected_rows(table, dense, sparse, num_rows):
    """Per row: (label, [dense values], {feature: [ids]}) from the Arrow table in plain Python."""
    cols = {c: table[c].to_pylist() for c in ["label", *dense, *sparse]}
    out = []
    for i in range(table.num_rows):
        d = [math.log1p(max(cols[c][i] or 0.0, 0.0)) for c in dense]
        s = {}
        for c in sparse:
            v = cols[c][i]
            if isinstance(table.schema.field(c).type, pa.ListType):
                items = v or []
            else:
                items = [v]
            ids = []
            for x in items:
                if isinstance(x, str) or (x is None and pa.types.is_string(_leaf_type(table, c))):
                    # strings, nulls as "": hash_strings, then % num_rows
                    ids.append(int(hash_strings([x or ""])[0]) % num_rows)
                else:
                    ids.append((x or 0) % num_rows)  # integers, nulls as 0; Python's %: in [0, n)
            s[c] = ids
        out.append((float(cols["label"][i]), d, s))
    return out


def _leaf_type(table, c):
    t = table.schema.field(c).type
    return t.value_type if isinstance(t, pa.ListType) else t


def flatten(batches, dense, sparse):
    """The batches' rows in the form of ``expected_rows``, checking each batch's layout."""
    rows = []
    for b in batches:
        n = len(b)
        assert isinstance(b, ClickBatch)
        assert b.label.dtype == np.float32 and b.label.shape == (n,)
        assert b.dense.dtype == np.float32 and b.dense.shape == (n, len(dense))
        assert list(b.sparse) == list(sparse)
        per_feature = {}
        for c in sparse:
            ids = b.sparse[c]
            if isinstance(ids, hbk.Ragged):
                check_ragged(ids, n)
            else:
                assert ids.dtype == np.int64 and ids.shape == (n,)
            per_feature[c] = bags_of(ids)
        for i in range(n):
            rows.append((float(b.label[i]), b.dense[i].tolist(), {c: per_feature[c][i] for c in sparse}))
    return rows


def assert_rows_match(got, expected):
    assert len(got) == len(expected)
    for (gl, gd, gs), (el, ed, es) in zip(got, expected):
        assert gl == el
        np.testing.assert_allclose(gd, ed, rtol=3e-7, atol=0)
        assert gs == es


def test_parquet_default_columns_and_values(tmp_path, rng):
    paths, table = write_files(tmp_path, rng, [11, 6])
    clicks = ParquetClicks(paths, 5, num_rows=NUM_ROWS)
    assert clicks.label == "label"
    assert clicks.dense == ["f32", "f64"]  # float columns, file order
    assert clicks.sparse == ["rid", "big", "small", "word", "hist", "tags"]  # not label, not bool
    assert clicks.features == clicks.sparse
    assert len(clicks) == 4  # 17 rows in batches of 5
    batches = list(clicks)
    assert [len(b) for b in batches] == [5, 5, 5, 2]
    got = flatten(batches, clicks.dense, clicks.sparse)
    expected = expected_rows(table, clicks.dense, clicks.sparse, NUM_ROWS)
    assert_rows_match(got, expected)
    for b in batches:
        for c in clicks.sparse:
            ids = b.sparse[c]
            v = ids.values if isinstance(ids, hbk.Ragged) else ids
            assert v.size == 0 or (v.min() >= 0 and v.max() < NUM_ROWS), c
        assert np.isfinite(b.dense).all() and (b.dense >= 0).all()
    assert isinstance(batches[0].sparse["hist"], hbk.Ragged)
    assert isinstance(batches[0].sparse["tags"], hbk.Ragged)
    # the data really has what the test claims to cover
    assert table["f32"].null_count and table["f64"].null_count and table["word"].null_count
    assert min(v for v in table["f64"].to_pylist() if v is not None) < 0
    assert table["big"].to_pylist()[:2] == [2**63 - 1, -2**63]
    # a second epoch reads the same rows
    assert_rows_match(flatten(list(clicks), clicks.dense, clicks.sparse), expected)


def test_parquet_strings_hash_with_hash_strings(tmp_path, rng):
    paths, table = write_files(tmp_path, rng, [9])
    clicks = ParquetClicks(paths, 9, num_rows=NUM_ROWS, dense=[], sparse=["word", "tags"])
    (b,) = list(clicks)
    words = table["word"].to_pylist()
    expected = hash_strings([w if w is not None else "" for w in words]) % NUM_ROWS
    np.testing.assert_array_equal(b.sparse["word"], expected)
    np.testing.assert_array_equal(b.sparse["word"], hash_strings([w or "" for w in words], NUM_ROWS))
    tags = [t for row in table["tags"].to_pylist() for t in row]
    np.testing.assert_array_equal(b.sparse["tags"].values, hash_strings(tags) % NUM_ROWS)
    assert b.dense.shape == (9, 0)


def test_parquet_explicit_columns(tmp_path, rng):
    paths, table = write_files(tmp_path, rng, [7, 8])
    dense, sparse = ["f64"], ["hist", "word", "small"]
    clicks = ParquetClicks(paths, 4, num_rows=NUM_ROWS, dense=dense, sparse=sparse)
    assert clicks.dense == dense and clicks.sparse == sparse
    got = flatten(list(clicks), dense, sparse)
    assert_rows_match(got, expected_rows(table, dense, sparse, NUM_ROWS))
    # a label column of another name, a float one: not in the default dense features
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"click": pa.array([1.0, 0.0, 1.0], pa.float32()),
                             "x": pa.array([0.5, None, -2.0], pa.float64()),
                             "id": pa.array([5, 2**40, -3], pa.int64())}), path)
    c = ParquetClicks(str(path), 8, num_rows=10, label="click")
    assert c.dense == ["x"] and c.sparse == ["id"]
    (b,) = list(c)
    assert b.label.tolist() == [1.0, 0.0, 1.0]
    np.testing.assert_allclose(b.dense[:, 0], [math.log1p(0.5), 0.0, 0.0], rtol=1e-7)
    assert b.sparse["id"].tolist() == [5, 2**40 % 10, -3 % 10]


def test_parquet_errors(tmp_path, rng):
    paths, _ = write_files(tmp_path, rng, [5])
    with pytest.raises(ValueError, match="'click'"):
        ParquetClicks(paths, 2, num_rows=10, label="click")
    with pytest.raises(ValueError, match="'nope'"):
        ParquetClicks(paths, 2, num_rows=10, sparse=["rid", "nope"])
    with pytest.raises(ValueError, match="'nope'"):
        ParquetClicks(paths, 2, num_rows=10, dense=["nope"])
    with pytest.raises(ValueError, match="'f32'"):
        ParquetClicks(paths, 2, num_rows=10, sparse=["rid", "f32"])
    with pytest.raises(ValueError, match="'rid'"):
        ParquetClicks(paths, 2, num_rows=10, dense=["rid"])
    with pytest.raises(ValueError, match="'flag'"):
        ParquetClicks(paths, 2, num_rows=10, sparse=["flag"])
    with pytest.raises(ValueError, match="categorical"):
        ParquetClicks(paths, 2, num_rows=10, sparse=[])
    only_floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"label": [0.0, 1.0], "x": [1.0, 2.0]}), only_floats)
    with pytest.raises(ValueError, match="categorical"):
        ParquetClicks(str(only_floats), 2, num_rows=10)


@pytest.mark.parametrize("world, batch_size, shuffle", [(2, 3, 0), (3, 2, 0), (3, 4, 0), (2, 3, 5),
                                                         (5, 4, 0)])
def test_parquet_rank_split(tmp_path, rng, world, batch_size, shuffle):
    paths, table = write_files(tmp_path, rng, [6, 7], row_group_size=3)  # 13 rows
    dense, sparse = ["f32"], ["rid", "hist", "word"]
    expected = {e[2]["rid"][0]: e for e in expected_rows(table, dense, sparse, 10**6)}
    assert sorted(expected) == list(range(13))
    seen, lengths, empties = [], set(), 0
    for rank in range(world):
        clicks = ParquetClicks(paths, batch_size, num_rows=10**6, dense=dense, sparse=sparse,
                               rank=rank, world_size=world, shuffle_buffer=shuffle, seed=3)
        lengths.add(len(clicks))
        batches = list(clicks)
        assert len(batches) == len(clicks)
        for b in batches:
            assert len(b) <= batch_size
            if len(b) == 0:
                empties += 1
                assert b.dense.shape == (0, 1) and b.label.shape == (0,)
                assert b.sparse["rid"].shape == (0,)
                assert b.sparse["hist"].offsets.tolist() == [0]
                assert b.sparse["hist"].values.shape == (0,)
        for row in flatten(batches, dense, sparse):
            seen.append(row)
            rid = row[2]["rid"][0]
            assert_rows_match([row], [expected[rid]])
    assert len(lengths) == 1  # every rank takes the same number of steps
    assert sorted(r[2]["rid"][0] for r in seen) == list(range(13))  # each row exactly once
    rows_per_rank = [(r + 1) * 13 // world - r * 13 // world for r in range(world)]
    most = max(-(-k // batch_size) for k in rows_per_rank)
    assert lengths == {most}
    assert empties == sum(most - -(-k // batch_size) for k in rows_per_rank)


def test_parquet_short_rank_gets_empty_batches(tmp_path, rng):
    """13 rows over 2 ranks in batches of 3: rank 0 has 6 rows (2 batches), rank 1 has 7 (3)."""
    paths, _ = write_files(tmp_path, rng, [13])
    r0 = list(ParquetClicks(paths, 3, num_rows=50, rank=0, world_size=2))
    r1 = list(ParquetClicks(paths, 3, num_rows=50, rank=1, world_size=2))
    assert [len(b) for b in r0] == [3, 3, 0] and [len(b) for b in r1] == [3, 3, 1]
    empty = r0[-1]
    for c in ("hist", "tags"):
        assert empty.sparse[c].offsets.tolist() == [0] and empty.sparse[c].values.size == 0
    for c in ("rid", "big", "small", "word"):
        assert empty.sparse[c].shape == (0,) and empty.sparse[c].dtype == np.int64
    assert empty.dense.shape == (0, 2) and empty.label.shape == (0,)


def test_criteo_sample(tmp_path):
    src = DATA / "criteo_sample.txt"
    dst = tmp_path / "criteo.parquet"
    convert_criteo(str(src), str(dst))
    clicks = ParquetClicks(str(dst), 64, num_rows=1000)
    dense = [f"I{i}" for i in range(1, 14)]
    sparse = [f"C{i}" for i in range(1, 27)]
    assert clicks.dense == dense and clicks.sparse == sparse
    batches = list(clicks)
    assert sum(len(b) for b in batches) == 200 and len(batches) == 4
    got = flatten(batches, dense, sparse)
    with open(src, newline="") as f:
        records = list(csv.DictReader(f))
    assert len(records) == 200
    for (label, d, s), rec in zip(got, records):
        assert label == float(rec["label"])
        ed = [math.log1p(max(float(rec[c]), 0.0)) if rec[c] else 0.0 for c in dense]
        np.testing.assert_allclose(d, ed, rtol=3e-7)
        es = {c: [int(hash_strings([rec[c]])[0]) % 1000 if rec[c] else 0] for c in sparse}
        assert s == es
    assert any(rec["I2"].startswith("-") for rec in records)  # negatives clipped to log1p(0)


def test_parquet_dictionary_strings_uint64_ids_and_nan(tmp_path):
    """pandas 'category' columns (dictionary-encoded strings) are ids; uint64 ids
    are reduced exactly (no wrap through int64); NaN dense values count as 0."""
    words = ["a", "b", None, "a"]
    big = [2**64 - 1, 2**63, 5, 0]
    path = tmp_path / "dict.parquet"
    pq.write_table(pa.table({
        "label": [1, 0, 1, 0],
        "x": pa.array([float("nan"), -1.0, 3.0, None], pa.float64()),
        "cat": pa.array(words).dictionary_encode(),
        "u": pa.array(big, pa.uint64()),
    }), path)
    clicks = ParquetClicks(path, 4, num_rows=97)
    assert clicks.dense == ["x"] and clicks.sparse == ["cat", "u"]
    (b,) = list(clicks)
    np.testing.assert_array_equal(b.sparse["u"], [v % 97 for v in big])
    np.testing.assert_array_equal(b.sparse["cat"], hash_strings([w or "" for w in words], 97))
    np.testing.assert_allclose(b.dense[:, 0], [0.0, 0.0, math.log1p(3.0), 0.0])
