"""hbk.data.ParquetDataset: rebatching, rank partition, shuffle, nulls, prefetch."""
import threading

import numpy as np
import pytest
from helpers import write_parquet_files

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import hbkernels as hbk  # noqa: E402
from hbkernels.data import ParquetDataset, hash_strings  # noqa: E402

PREFETCH_THREAD = "hbk-parquet-prefetch"


def make_table(rng, first_row, n):
    """Rows numbered from ``first_row``: scalars, list<int32> and large_list<int64> (some empty)."""
    len32 = rng.integers(0, 4, size=n)
    len32[rng.random(n) < 0.3] = 0
    len64 = rng.integers(0, 3, size=n)
    ids32 = [rng.integers(-2**31, 2**31, size=k).astype(np.int32).tolist() for k in len32]
    ids64 = [rng.integers(-2**62, 2**62, size=k).tolist() for k in len64]
    return pa.table({
        "row": pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
        "label": pa.array(rng.random(n).astype(np.float32)),
        "cat": pa.array(rng.integers(0, 100, size=n).astype(np.int32)),
        "ids32": pa.array(ids32, pa.list_(pa.int32())),
        "ids64": pa.array(ids64, pa.large_list(pa.int64())),
    })


def write_files(tmp_path, rng, sizes, row_group_size, make=make_table):
    return write_parquet_files(tmp_path, rng, sizes, row_group_size, make)


def expected_columns(table):
    out = {"row": table["row"].to_numpy(), "label": table["label"].to_numpy(),
           "cat": table["cat"].to_numpy()}
    for name in ("ids32", "ids64"):
        rows = table[name].to_pylist()
        values = np.array([v for r in rows for v in r],
                          dtype=np.int32 if name == "ids32" else np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        out[name] = hbk.Ragged(values, offsets)
    return out


def concat(batches):
    """The batches glued back together (offsets rebased), checking each batch's form."""
    out = {}
    for name in batches[0]:
        parts = [b[name] for b in batches]
        if isinstance(parts[0], hbk.Ragged):
            values, offsets, base = [], [np.zeros(1, np.int64)], 0
            for r in parts:
                assert r.offsets.dtype == np.int64 and r.offsets[0] == 0
                assert r.offsets[-1] == len(r.values)
                assert np.all(np.diff(r.offsets) >= 0)
                values.append(r.values)
                offsets.append(r.offsets[1:] + base)
                base += len(r.values)
            out[name] = hbk.Ragged(np.concatenate(values), np.concatenate(offsets))
        else:
            for p in parts:
                assert p.ndim == 1
            out[name] = np.concatenate(parts)
    return out


def rows_of(batch):
    return len(batch["row"])


def ragged_rows(r):
    return [r.values[r.offsets[i]:r.offsets[i + 1]].tolist() for i in range(r.batch_size)]


def assert_same(got, want):
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, hbk.Ragged):
            assert isinstance(g, hbk.Ragged), name
            assert g.values.dtype == w.values.dtype, name
            np.testing.assert_array_equal(g.values, w.values, err_msg=name)
            np.testing.assert_array_equal(g.offsets, w.offsets, err_msg=name)
        else:
            assert g.dtype == w.dtype, name
            np.testing.assert_array_equal(g, w, err_msg=name)


def take_rows(cols, rows):
    """Expected columns restricted to global rows ``rows`` (in that order)."""
    out = {}
    for name, v in cols.items():
        if isinstance(v, hbk.Ragged):
            parts = [v.values[v.offsets[r]:v.offsets[r + 1]] for r in rows]
            lengths = [len(p) for p in parts]
            out[name] = hbk.Ragged(np.concatenate(parts) if parts else v.values[:0],
                                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        else:
            out[name] = v[np.asarray(rows, dtype=np.int64)]
    return out


@pytest.fixture
def files(tmp_path, rng):
    return write_files(tmp_path, rng, [23, 0, 41, 17], row_group_size=10)


@pytest.mark.parametrize("batch_size", [1, 7, 10, 64, 1000])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_round_trip_across_files_and_row_groups(files, batch_size, prefetch):
    paths, table = files
    ds = ParquetDataset(paths, batch_size, prefetch=prefetch)
    batches = list(ds)
    sizes = [rows_of(b) for b in batches]
    assert all(s == batch_size for s in sizes[:-1]) and 0 < sizes[-1] <= batch_size
    assert len(batches) == ds.num_batches == len(ds) == -(-81 // batch_size)
    assert_same(concat(batches), expected_columns(table))
    for b in batches:  # every batch has the same flags: read-only
        assert not b["row"].flags.writeable and not b["ids32"].values.flags.writeable


def test_directory_and_column_selection(tmp_path, rng):
    paths, table = write_files(tmp_path, rng, [5, 12], row_group_size=4)
    ds = ParquetDataset(tmp_path, 4, columns=["ids32", "row"])
    batches = list(ds)
    assert set(batches[0]) == {"ids32", "row"}
    want = expected_columns(table)
    assert_same(concat(batches), {"ids32": want["ids32"], "row": want["row"]})
    assert ParquetDataset(paths[1], 4).total_rows == 12


def test_sliced_list_offsets_are_rebased(tmp_path):
    # one row group of 6 rows, two ranks: rank 1 starts mid row group and mid list values
    t = pa.table({"ids": pa.array([[1, 2], [3], [], [4, 5, 6], [7], [8, 9]], pa.list_(pa.int64()))})
    path = tmp_path / "one.parquet"
    pq.write_table(t, path)
    (b,) = list(ParquetDataset(path, 10, rank=1, world_size=2))
    assert b["ids"].offsets.tolist() == [0, 3, 4, 6]
    assert b["ids"].values.tolist() == [4, 5, 6, 7, 8, 9]


CONFIGS = {
    # name: (file sizes, row group size)
    "many-small-groups": ([5, 0, 3, 1], 2),          # 9 rows: W up to 5 > T/2
    "awkward": ([23, 0, 41, 17], 10),
    "one-big-group": ([30], 100),                    # every rank's range inside one group
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("shuffle_buffer", [0, 5])
@pytest.mark.parametrize("batch_size", [2, 7])
def test_every_row_once_across_ranks(tmp_path, rng, config, shuffle_buffer, batch_size):
    sizes, group = CONFIGS[config]
    paths, table = write_files(tmp_path, rng, sizes, group)
    want = expected_columns(table)
    T = table.num_rows
    for W in range(1, 6):
        seen = []
        counts = []
        for r in range(W):
            ds = ParquetDataset(paths, batch_size, rank=r, world_size=W,
                                shuffle_buffer=shuffle_buffer, seed=3, prefetch=r % 2)
            batches = list(ds)
            assert ds.batches_per_rank == ParquetDataset(paths, batch_size, rank=0, world_size=W,
                                                         shuffle_buffer=shuffle_buffer).batches_per_rank
            assert len(batches) == ds.num_batches == ds.batches_per_rank[r]
            counts.append(len(batches))
            sizes_r = [rows_of(b) for b in batches]
            assert all(s == batch_size for s in sizes_r[:-1])
            assert all(s > 0 for s in sizes_r)
            lo, hi = r * T // W, (r + 1) * T // W
            if not batches:
                assert lo == hi
                continue
            got = concat(batches)
            rows = got["row"]
            if shuffle_buffer:
                assert sorted(rows.tolist()) == list(range(lo, hi))
            else:
                assert rows.tolist() == list(range(lo, hi))
            assert_same(got, take_rows(want, rows))  # every column follows its row
            seen.extend(rows.tolist())
        assert sorted(seen) == list(range(T))
        assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("W,B,counts,dropped", [
    (3, 3, (2, 3, 3), (2, 2, 2)),               # ranks of 6, 7, 7 rows
    (3, 7, (1, 1, 1), (0, 1, 1)),
    (6, 3, (1, 1, 2, 1, 1, 2), (1,) * 6),       # ranks of 3, 3, 4, 3, 3, 4 rows
    (15, 2, (1,) * 15, (0, 0, 1) * 5),          # ranks of 1, 1, 2 rows
    (25, 2, (0, 1, 1, 1, 1) * 5, (0,) * 25),    # more ranks than rows
])
def test_batches_per_rank_and_equal_batches(tmp_path, rng, drop_remainder, W, B, counts, dropped):
    paths, table = write_files(tmp_path, rng, [11, 0, 9], 4)  # 20 rows
    counts = dropped if drop_remainder else counts
    plain = ParquetDataset(paths, B, world_size=W, drop_remainder=drop_remainder)
    assert plain.batches_per_rank == counts
    seen = []
    for r in range(W):
        ds = ParquetDataset(paths, B, rank=r, world_size=W, equal_batches=True,
                            drop_remainder=drop_remainder, shuffle_buffer=4, prefetch=r % 2)
        assert ds.batches_per_rank == (max(counts),) * W == (ds.num_batches,) * W
        batches = list(ds)
        assert len(batches) == max(counts)
        sizes = [rows_of(b) for b in batches]
        real = counts[r]
        assert all(s > 0 for s in sizes[:real]) and all(s == 0 for s in sizes[real:])
        for b in batches[real:]:
            assert b["row"].dtype == np.int64 and b["label"].dtype == np.float32
            assert b["row"].shape == (0,)
            assert b["ids32"].values.dtype == np.int32 and b["ids32"].values.shape == (0,)
            assert b["ids64"].offsets.tolist() == [0] and b["ids64"].offsets.dtype == np.int64
        seen += [x for b in batches for x in b["row"].tolist()]
    if not drop_remainder:
        assert sorted(seen) == list(range(20))


def test_drop_remainder(files):
    paths, table = files
    ds = ParquetDataset(paths, 7, drop_remainder=True)
    batches = list(ds)
    assert len(batches) == len(ds) == 81 // 7
    assert all(rows_of(b) == 7 for b in batches)
    assert concat(batches)["row"].tolist() == list(range(81 // 7 * 7))
    assert len(list(ParquetDataset(paths, 100, drop_remainder=True))) == 0


def shuffled_rows(paths, **kw):
    return [x for b in ParquetDataset(paths, 6, **kw) for x in b["row"].tolist()]


def test_shuffle_is_a_seeded_permutation(files):
    paths, table = files
    want = expected_columns(table)
    ds = ParquetDataset(paths, 6, shuffle_buffer=16, seed=7, rank=1, world_size=2)
    epochs = [concat(list(ds)) for _ in range(3)]
    assert ds.epoch == 3
    lo, hi = 81 // 2, 81
    orders = [e["row"].tolist() for e in epochs]
    for e, order in zip(epochs, orders):
        assert sorted(order) == list(range(lo, hi))
        assert order != list(range(lo, hi))
        assert_same(e, take_rows(want, order))
    assert orders[0] != orders[1] != orders[2]
    again = ParquetDataset(paths, 6, shuffle_buffer=16, seed=7, rank=1, world_size=2, prefetch=0)
    assert concat(list(again))["row"].tolist() == orders[0]
    again.set_epoch(2)
    assert concat(list(again))["row"].tolist() == orders[2]
    other_seed = ParquetDataset(paths, 6, shuffle_buffer=16, seed=8, rank=1, world_size=2)
    assert concat(list(other_seed))["row"].tolist() != orders[0]
    # a buffer larger than the data: one full permutation
    full = shuffled_rows(paths, shuffle_buffer=10**6, seed=1)
    assert sorted(full) == list(range(81)) and full != list(range(81))


def test_multiple_epochs_without_shuffle_repeat(files):
    paths, _ = files
    ds = ParquetDataset(paths, 9)
    first = concat(list(ds))
    for _ in range(2):
        assert_same(concat(list(ds)), first)
    assert ds.epoch == 3


@pytest.mark.parametrize("shuffle_buffer", [0, 20])
def test_prefetch_on_and_off_give_identical_batches(files, shuffle_buffer):
    paths, _ = files
    runs = [list(ParquetDataset(paths, 7, shuffle_buffer=shuffle_buffer, prefetch=p, seed=2))
            for p in (0, 1, 3)]
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other):
            assert_same(a, b)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD) and t.is_alive()]


def test_early_break_stops_the_thread(files):
    paths, _ = files
    assert not prefetch_threads()
    ds = ParquetDataset(paths, 1, prefetch=2)
    for i, _ in enumerate(ds):
        assert len(prefetch_threads()) == 1  # the thread runs while we iterate
        if i == 3:
            break
    assert not prefetch_threads()
    it = iter(ds)
    next(it)
    assert len(prefetch_threads()) == 1
    it.close()
    assert not prefetch_threads()
    # a full epoch ends its thread too, and the next epoch starts from the top
    assert [b["row"][0] for b in ds][:2] == [0, 1]
    assert not prefetch_threads()


def test_missing_and_corrupt_files(tmp_path, files):
    paths, _ = files
    missing = str(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ParquetDataset(paths + [missing], 4)
    bad = tmp_path / "garbage.parquet"
    bad.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(ValueError, match="garbage.parquet"):
        ParquetDataset([paths[0], str(bad)], 4)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no \\*.parquet"):
        ParquetDataset(empty_dir, 4)


def test_missing_column_and_schema_mismatch(tmp_path, files):
    paths, _ = files
    with pytest.raises(ValueError, match="'nope'.*part-00.parquet"):
        ParquetDataset(paths, 4, columns=["row", "nope"])
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"row": pa.array([1, 2], pa.int64())}), other)
    with pytest.raises(ValueError, match="'label'.*other.parquet"):
        ParquetDataset(paths + [str(other)], 4, columns=["row", "label"])
    ParquetDataset(paths + [str(other)], 4, columns=["row"])  # the shared column alone is fine
    mismatch = tmp_path / "mismatch.parquet"
    pq.write_table(pa.table({"row": pa.array([1.5], pa.float64())}), mismatch)
    with pytest.raises(ValueError, match="different schemas.*'row'"):
        ParquetDataset([paths[0], str(mismatch)], 4, columns=["row"])


def test_bad_arguments(files):
    paths, _ = files
    for kw in ({"rank": 2, "world_size": 2}, {"shuffle_buffer": -1}, {"device": "tpu"},
               {"fill_null": {"nope": 0}}, {"num_buckets": {"row": 5}}):
        with pytest.raises(ValueError):
            ParquetDataset(paths, 4, **kw)
    with pytest.raises(ValueError):
        ParquetDataset(paths, 0)


def null_files(tmp_path):
    a = pa.table({"x": pa.array(np.arange(12), pa.int64()),
                  "ids": pa.array([[i] for i in range(12)], pa.list_(pa.int32()))})
    b = pa.table({
        "x": pa.array([0, 1, 2, 3, None, 5, 6, 7], pa.int64()),
        "ids": pa.array([[1], [2, None], [], None, [5], [6, 6], None, [8]], pa.list_(pa.int32())),
    })
    pa_, pb = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(a, pa_, row_group_size=5)
    pq.write_table(b, pb, row_group_size=3)
    return [str(pa_), str(pb)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_null_without_fill_names_column_file_and_row(tmp_path, prefetch):
    paths = null_files(tmp_path)
    # exceptions of the prefetch thread re-raise in the loop
    with pytest.raises(ValueError, match=r"'x'.* row 4 of .*b\.parquet.*fill_null"):
        list(ParquetDataset(paths, 5, columns=["x"], prefetch=prefetch))
    # a null element (row 1 of b) comes before the first null list (row 3)
    with pytest.raises(ValueError, match=r"'ids'.* row 1 of .*b\.parquet"):
        list(ParquetDataset(paths, 5, columns=["ids"], prefetch=prefetch))
    # rank 1 of 2 starts at global row 10 (row 10 of a): b's null element is still its row 1
    with pytest.raises(ValueError, match=r"'ids'.* row 1 of .*b\.parquet"):
        list(ParquetDataset(paths, 5, columns=["ids"], rank=1, world_size=2, prefetch=prefetch))
    # rank 9 of 10 reads global rows 18, 19 = b's rows 6 (a null list) and 7
    with pytest.raises(ValueError, match=r"'ids'.* row 6 of .*b\.parquet"):
        list(ParquetDataset(paths, 5, columns=["ids"], rank=9, world_size=10, prefetch=prefetch))
    # rank 8 of 10 reads b's rows 4, 5: no null lists or elements there
    (batch,) = ParquetDataset(paths, 5, columns=["ids"], rank=8, world_size=10, prefetch=prefetch)
    assert ragged_rows(batch["ids"]) == [[5], [6, 6]]


def test_fill_null_scalar_and_list(tmp_path):
    paths = null_files(tmp_path)
    ds = ParquetDataset(paths, 6, fill_null={"x": -1, "ids": 0}, rank=1, world_size=2)
    got = concat(list(ds))  # rank 1: rows 10..19 = a[10:12] + b
    assert got["x"].tolist() == [10, 11, 0, 1, 2, 3, -1, 5, 6, 7]
    assert got["x"].dtype == np.int64 and got["ids"].values.dtype == np.int32
    assert ragged_rows(got["ids"]) == [[10], [11], [1], [2, 0], [], [], [5], [6, 6], [], [8]]


def test_null_lists_backed_by_values_become_empty(tmp_path):
    # Parquet writes null lists with no values behind them, Arrow need not: the conversion
    # must drop what a null list's offsets span (here [9, 9] behind the null second row)
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1]], pa.list_(pa.int64()))}), path)
    ds = ParquetDataset(path, 4, fill_null={"ids": 0})
    arr = pa.ListArray.from_arrays(pa.array([0, 1, 3, 4, 6], pa.int32()),
                                   pa.array([1, 9, 9, 2, None, 3], pa.int64()),
                                   mask=pa.array([False, True, False, False]))
    got = ds._convert(ds._columns[0], pa.chunked_array([arr.slice(1)]), "mem", 0)
    assert got.offsets.tolist() == [0, 0, 1, 3] and got.values.tolist() == [2, 0, 3]


def test_strings_are_hashed(tmp_path):
    s = ["a", "bb", "", "héllo", "a", "zz", "q"]
    tags = [["x", "y"], [], ["a"], None, ["b", "b", "c"], [""], ["q"]]
    t = pa.table({"s": pa.array(s), "tags": pa.array(tags, pa.list_(pa.string())),
                  "ls": pa.array(s, pa.large_string())})
    path = tmp_path / "s.parquet"
    pq.write_table(t, path, row_group_size=3)
    flat = [x for r in tags if r for x in r]
    offsets = np.concatenate([[0], np.cumsum([len(r or []) for r in tags])])

    got = concat(list(ParquetDataset(path, 2, fill_null={"tags": "?"}, rank=0)))
    np.testing.assert_array_equal(got["s"], hash_strings(s))
    np.testing.assert_array_equal(got["ls"], hash_strings(s))
    assert got["s"].dtype == np.int64
    np.testing.assert_array_equal(got["tags"].values, hash_strings(flat))
    np.testing.assert_array_equal(got["tags"].offsets, offsets)

    got = concat(list(ParquetDataset(path, 4, num_buckets=10, fill_null={"tags": "?"})))
    np.testing.assert_array_equal(got["s"], hash_strings(s, 10))
    np.testing.assert_array_equal(got["tags"].values, hash_strings(flat, 10))
    assert got["s"].max() < 10

    got = concat(list(ParquetDataset(path, 3, num_buckets={"s": 5}, columns=["s", "ls"])))
    np.testing.assert_array_equal(got["s"], hash_strings(s, 5))
    np.testing.assert_array_equal(got["ls"], hash_strings(s))


def test_only_overlapping_row_groups_are_read(tmp_path, rng, monkeypatch):
    paths, _ = write_files(tmp_path, rng, [20, 20], 5)  # 8 groups of 5 rows
    reads = []
    original = pq.ParquetFile.read_row_group

    def counting(self, i, *args, **kwargs):
        table = original(self, i, *args, **kwargs)
        reads.append(table.num_rows)
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    list(ParquetDataset(paths, 3, rank=1, world_size=4, prefetch=0))  # rows 10..19
    assert len(reads) == 2
    reads.clear()
    list(ParquetDataset(paths, 3, rank=1, world_size=3, prefetch=0))  # rows 13..25
    assert len(reads) == 4  # groups 10-14, 15-19 (file 0), 20-24, 25-29 (file 1)
    reads.clear()
    list(ParquetDataset(paths, 3, rank=5, world_size=8, prefetch=0))  # rows 25..29
    assert len(reads) == 1


@pytest.mark.gpu
def test_cuda_batches(files):
    cupy = pytest.importorskip("cupy")
    paths, table = files
    batches = list(ParquetDataset(paths, 7, device="cuda", shuffle_buffer=10))
    assert isinstance(batches[0]["row"], cupy.ndarray)
    assert isinstance(batches[0]["ids32"].values, cupy.ndarray)
    host = [{k: (hbk.Ragged(cupy.asnumpy(v.values), cupy.asnumpy(v.offsets))
                 if isinstance(v, hbk.Ragged) else cupy.asnumpy(v)) for k, v in b.items()}
            for b in batches]
    got = concat(host)
    assert_same(got, take_rows(expected_columns(table), got["row"]))


def _flip_value_byte(path, value):
    data = bytearray(path.read_bytes())
    at = data.find(int(value).to_bytes(8, "little"))
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_page_checksums_are_verified_and_damage_names_the_file(tmp_path):
    values = np.arange(1000, dtype=np.int64) * 7919
    for checksum in (True, False):
        path = tmp_path / f"checksum-{checksum}.parquet"
        pq.write_table(pa.table({"x": values}), path, compression="none", use_dictionary=False,
                       write_page_checksum=checksum)
        _flip_value_byte(path, values[500])
        ds = ParquetDataset(str(path), 100)
        if checksum:  # the page's CRC catches it
            with pytest.raises(hbk.errors.DataError, match=f"row group 0 of Parquet file {path}.*CRC"):
                list(ds)
        else:  # no checksum in the file: nothing can tell
            got = np.concatenate([b["x"] for b in ds])
            assert (got != values).sum() == 1


def test_a_damaged_page_or_a_rewritten_file_names_the_file(tmp_path, rng):
    paths, _ = write_files(tmp_path, rng, [40, 30], row_group_size=10)
    ds = ParquetDataset(paths, 8, columns=["row", "ids64"])
    pq.write_table(pa.table({"row": pa.array(["a"] * 5)}), paths[1])  # rewritten since
    with pytest.raises(hbk.errors.DataError, match=paths[1]):
        list(ds)
    data = bytearray(open(paths[0], "rb").read())
    footer = int.from_bytes(data[-8:-4], "little")
    end = len(data) - 8 - footer
    data[4:end] = b"\xff" * (end - 4)  # every page garbage, the footer intact
    open(paths[0], "wb").write(bytes(data))
    with pytest.raises(hbk.errors.DataError, match=paths[0]):
        list(ParquetDataset(paths[:1], 8, columns=["row", "ids64"]))


@pytest.mark.parametrize("paths", [None, 3, object()])
def test_paths_of_the_wrong_type(paths):
    with pytest.raises(TypeError, match="paths must be a Parquet file, a directory or a list"):
        ParquetDataset(paths, 8)
