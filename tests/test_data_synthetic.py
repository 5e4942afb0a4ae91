"""write_synthetic: schema, row groups, bag lengths, id range and the Zipf law."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from hbkernels.data import write_synthetic  # noqa: E402
from hbkernels.data.synthetic import (  # noqa: E402
    POSITIVE_RATE, SyntheticTable, ZipfIds)

ROOT = Path(__file__).resolve().parents[1]
TABLES = [("user", 1000, 1), ("item", 5000, 3), ("history", 20000, 4, True),
          {"name": "one_var", "num_rows": 50, "hotness": 1, "variable": True}]


def zipf_law(num_rows, alpha):
    """P(rank k) = k**-alpha / sum(j**-alpha), k = 1..num_rows."""
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -alpha
    return weights / weights.sum()


def within_sigmas(observed, expected, sigma, n_sigmas=5):
    return abs(observed - expected) <= n_sigmas * sigma


@pytest.fixture
def seed(rng):
    return int(rng.integers(2**31))


def test_schema_rows_and_row_groups(tmp_path, seed):
    path = tmp_path / "s.parquet"
    summary = write_synthetic(path, 10_000, TABLES, seed=seed, dense=3, row_group_size=3000)
    schema = pq.read_schema(path)
    assert schema.names == ["label", "d0", "d1", "d2", "user", "item", "history", "one_var"]
    assert [schema.field(n).type for n in schema.names[:5]] == [
        pa.int32(), pa.float32(), pa.float32(), pa.float32(), pa.int64()]
    for name in ["item", "history", "one_var"]:
        assert pa.types.is_list(schema.field(name).type)
        assert schema.field(name).type.value_type == pa.int64()
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [3000] * 3 + [1000]
    assert (summary.num_rows, summary.num_row_groups, summary.path) == (10_000, 4, str(path))

    table = pq.read_table(path)
    assert table.num_rows == 10_000 and table.column("user").null_count == 0
    labels = table.column("label").to_numpy()
    assert set(np.unique(labels)) <= {0, 1}
    assert within_sigmas(labels.mean(), POSITIVE_RATE,
                         np.sqrt(POSITIVE_RATE * (1 - POSITIVE_RATE) / 10_000))
    dense = np.stack([table.column(f"d{i}").to_numpy() for i in range(3)])
    assert dense.min() >= 0 and dense.max() < 1
    assert within_sigmas(dense.mean(), 0.5, np.sqrt(1 / 12 / dense.size))


def test_bag_lengths_and_id_range(tmp_path, seed):
    path = tmp_path / "s.parquet"
    write_synthetic(path, 10_000, TABLES, seed=seed, row_group_size=4096)
    table = pq.read_table(path)
    for spec in [SyntheticTable(**t) if isinstance(t, dict) else SyntheticTable(*t)
                 for t in TABLES]:
        column = table.column(spec.name).combine_chunks()
        if spec.hotness == 1 and not spec.variable:
            ids = column.to_numpy()
        else:
            lengths = np.diff(column.offsets.to_numpy())
            ids = column.values.to_numpy()
            if spec.variable:
                # uniform on [1, 2h - 1]: mean h, variance ((2h - 1)**2 - 1) / 12
                assert lengths.min() == 1 and lengths.max() == 2 * spec.hotness - 1
                sigma = np.sqrt(((2 * spec.hotness - 1) ** 2 - 1) / 12 / lengths.size)
                assert within_sigmas(lengths.mean(), spec.hotness, max(sigma, 1e-12))
            else:
                assert (lengths == spec.hotness).all()
        assert ids.dtype == np.int64
        assert ids.min() >= 0 and ids.max() < spec.num_rows


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.5])
def test_ids_follow_the_zipf_law(tmp_path, seed, alpha):
    path = tmp_path / "s.parquet"
    num_rows, table_rows, hotness = 20_000, 2000, 5
    write_synthetic(path, num_rows, [("t", table_rows, hotness)], alpha=alpha, seed=seed)
    ids = pq.read_table(path).column("t").combine_chunks().values.to_numpy()
    n = ids.size
    counts = np.bincount(ids, minlength=table_rows)
    law = zipf_law(table_rows, alpha)
    top = np.sort(counts)[::-1][:3] / n
    for share, p in zip(top, law[:3]):  # the hottest ids take the law's first ranks' shares
        assert within_sigmas(share, p, np.sqrt(p * (1 - p) / n)), (top, law[:3])
    # the permutation scatters the hot rows: they are not the table's first rows
    assert set(np.argsort(counts)[::-1][:3]) != {0, 1, 2}


def test_seeded_determinism(tmp_path, seed):
    paths = [tmp_path / f"{i}.parquet" for i in range(3)]
    for path, s in zip(paths, [seed, seed, seed + 1]):
        write_synthetic(path, 3000, TABLES, seed=s, dense=1, row_group_size=1000)
    first, same, other = (pq.read_table(p) for p in paths)
    assert first.equals(same)
    assert not first.column("history").equals(other.column("history"))


def test_empty_file_and_bad_arguments(tmp_path):
    summary = write_synthetic(tmp_path / "empty.parquet", 0, [("t", 10, 2)])
    assert (summary.num_rows, summary.num_row_groups) == (0, 0)
    assert pq.read_table(tmp_path / "empty.parquet").num_rows == 0
    with pytest.raises(ValueError, match="distinct"):
        write_synthetic(tmp_path / "x.parquet", 10, [("d0", 10, 1)], dense=1)
    with pytest.raises(ValueError, match="hotness must be >= 1"):
        write_synthetic(tmp_path / "x.parquet", 10, [("t", 10, 0)])
    with pytest.raises(ValueError, match="num_rows must be a non-negative integer"):
        write_synthetic(tmp_path / "x.parquet", -1, [("t", 10, 1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.parquet"]


def test_cli_synthetic(tmp_path):
    dst = tmp_path / "cli.parquet"
    res = subprocess.run(
        [sys.executable, "-m", "hbkernels.data", "synthetic", str(dst), "--rows", "500",
         "--table", "user:100:1", "--table", "item:300:4:var", "--alpha", "1.2",
         "--seed", "7", "--dense", "2", "--row-group-size", "200"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"wrote 500 rows in 3 row groups to {dst}\n"
    write_synthetic(tmp_path / "api.parquet", 500, [("user", 100, 1), ("item", 300, 4, True)],
                    alpha=1.2, seed=7, dense=2, row_group_size=200)
    assert pq.read_table(dst).equals(pq.read_table(tmp_path / "api.parquet"))
    bad = subprocess.run([sys.executable, "-m", "hbkernels.data", "synthetic", str(dst),
                          "--rows", "5", "--table", "user:100"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 1 and "NAME:ROWS:HOTNESS[:var]" in bad.stderr


@pytest.mark.parametrize("num_rows, alpha", [(1, 1.05), (7, 0.0), (1000, 1.05), (5000, 0.0),
                                              (20000, 2.5), (100000, 1.05)])
def test_rows_are_the_permuted_searchsorted_ranks_and_their_effects(num_rows, alpha):
    """The guide-table sampler gives np.searchsorted's ranks, bit for bit, sent through
    the seed's permutation, and each row's effect: on random uniforms, on every step
    j / N of the guide and on the floats just below them (where u * N may round up to
    the next step), on the CDF's own values and below them. ``sample`` draws its
    uniforms from ``rng``."""
    zipf = ZipfIds(num_rows, alpha, np.random.default_rng(num_rows))
    row_of_rank = np.random.default_rng(num_rows).permutation(num_rows)
    steps = np.arange(num_rows + 1) / num_rows
    u = np.concatenate([
        np.random.default_rng(1).random(50_000), steps[:-1], np.nextafter(steps[1:], 0),
        zipf.cdf[:-1], np.nextafter(zipf.cdf, 0), [0.0, np.nextafter(1.0, 0)],
    ])
    want = row_of_rank[np.minimum(np.searchsorted(zipf.cdf, u, side="right"), num_rows - 1)]
    ids, effects = zipf.rows(u)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(effects, np.zeros(u.shape[0]))  # no effect set yet
    effect = np.random.default_rng(2).standard_normal(num_rows).astype(np.float32)
    zipf.set_effect(effect)
    ids, effects = zipf.rows(u)
    assert ids.dtype == np.int64 and effects.dtype == np.float64
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(effects, effect[want].astype(np.float64))
    drawn = zipf.sample(500, np.random.default_rng(4))
    np.testing.assert_array_equal(drawn, zipf.rows(np.random.default_rng(4).random(500))[0])
    assert zipf.rows(np.empty(0))[0].shape == (0,)
