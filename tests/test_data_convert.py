"""The converters on DeepCTR's real samples, value by value against an
independent csv-module parse and a pure-Python FNV-1a."""
import csv
import datetime
import gzip
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from hbkernels.data import convert_avazu, convert_criteo, convert_movielens  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "tests" / "data"  # DeepCTR's real-data samples (tests/data/README.md)


def sample(name):
    return SAMPLES / f"{name}_sample.txt"


def reference_id(text, num_buckets):
    """FNV-1a 64 of the UTF-8 bytes, masked to 63 bits, then % num_buckets; None stays None."""
    if text == "":
        return None
    h = 14695981039346656037
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 1099511628211) % 2**64
    h &= 2**63 - 1
    return h if num_buckets is None else h % num_buckets


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def float32_or_none(text):
    return None if text == "" else float(np.float32(float(text)))


def check_row_groups(path, summary, num_rows, row_group_size):
    meta = pq.ParquetFile(path).metadata
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    expected = [row_group_size] * (num_rows // row_group_size)
    expected += [num_rows % row_group_size] if num_rows % row_group_size else []
    assert sizes == expected
    assert (summary.num_rows, summary.num_row_groups, summary.path) == (
        num_rows, len(expected), str(path))


def criteo_expected(rows, num_buckets):
    return [{"label": int(r["label"]),
             **{f"I{i}": float32_or_none(r[f"I{i}"]) for i in range(1, 14)},
             **{f"C{i}": reference_id(r[f"C{i}"], num_buckets) for i in range(1, 27)}}
            for r in rows]


# block_size 4096 cuts the samples into several blocks; row groups straddle them
@pytest.mark.parametrize("num_buckets, block_size, row_group_size",
                         [(None, 1 << 24, 1 << 18), (1000, 4096, 64)])
def test_criteo_sample(tmp_path, num_buckets, block_size, row_group_size):
    src = sample("criteo")
    dst = tmp_path / "criteo.parquet"
    summary = convert_criteo(src, dst, num_buckets=num_buckets, block_size=block_size,
                             row_group_size=row_group_size)
    table = pq.read_table(dst)
    assert table.schema.names == ["label", *[f"I{i}" for i in range(1, 14)],
                                  *[f"C{i}" for i in range(1, 27)]]
    assert table.schema.field("label").type == pa.int32()
    assert {table.schema.field(f"I{i}").type for i in range(1, 14)} == {pa.float32()}
    assert {table.schema.field(f"C{i}").type for i in range(1, 27)} == {pa.int64()}
    rows = csv_rows(src)
    assert table.to_pylist() == criteo_expected(rows, num_buckets)
    assert table["I1"].null_count > 0 and table["C26"].null_count > 0  # the sample has gaps
    check_row_groups(dst, summary, len(rows), row_group_size)
    assert table.schema.metadata[b"hbkernels.num_buckets"] == str(num_buckets).encode()


def test_criteo_original_tab_separated_layout(tmp_path):
    """The original files: tab-separated, no header; plain and gzip-compressed."""
    src = sample("criteo")
    rows = csv_rows(src)
    with open(src, newline="") as f:
        lines = ["\t".join(fields) + "\n" for fields in list(csv.reader(f))[1:]]
    tsv = tmp_path / "day_0"
    tsv.write_text("".join(lines))
    with gzip.open(tmp_path / "day_0.gz", "wt") as f:
        f.writelines(lines)
    for name in ["day_0", "day_0.gz"]:
        summary = convert_criteo(tmp_path / name, tmp_path / f"{name}.parquet", num_buckets=4096)
        assert summary.num_rows == len(rows)
        table = pq.read_table(tmp_path / f"{name}.parquet")
        assert table.to_pylist() == criteo_expected(rows, 4096)


@pytest.mark.parametrize("num_buckets", [None, 100_000])
def test_avazu_sample(tmp_path, num_buckets):
    src = sample("avazu")
    dst = tmp_path / "avazu.parquet"
    summary = convert_avazu(src, dst, num_buckets=num_buckets, block_size=4096,
                            row_group_size=30)
    rows = csv_rows(src)
    categorical = [c for c in rows[0] if c not in ("id", "click", "hour")]
    table = pq.read_table(dst)
    assert table.schema.names == ["click", "hour", "hour_of_day", "weekday", *categorical]
    assert [table.schema.field(c).type for c in ["click", "hour", "hour_of_day", "weekday"]] == [
        pa.int32(), pa.int64(), pa.int32(), pa.int32()]
    assert {table.schema.field(c).type for c in categorical} == {pa.int64()}
    expected = []
    for r in rows:
        yymmddhh = r["hour"]
        day = datetime.date(2000 + int(yymmddhh[:2]), int(yymmddhh[2:4]), int(yymmddhh[4:6]))
        expected.append({"click": int(r["click"]), "hour": int(yymmddhh),
                         "hour_of_day": int(yymmddhh[6:]), "weekday": day.weekday(),
                         **{c: reference_id(r[c], num_buckets) for c in categorical}})
    assert table.to_pylist() == expected
    check_row_groups(dst, summary, len(rows), 30)


@pytest.mark.parametrize("num_buckets", [None, 997])
def test_movielens_sample(tmp_path, num_buckets):
    src = sample("movielens")
    dst = tmp_path / "movielens.parquet"
    summary = convert_movielens(src, dst, num_buckets=num_buckets, block_size=2048,
                                row_group_size=50)
    hashed = ["gender", "age", "occupation", "zip", "title"]
    table = pq.read_table(dst)
    assert table.schema.names == ["rating", "user_id", "movie_id", "timestamp", *hashed, "genres"]
    assert table.schema.field("rating").type == pa.float32()
    assert table.schema.field("genres").type.value_type == pa.int64()
    assert pa.types.is_list(table.schema.field("genres").type)
    rows = csv_rows(src)
    expected = [{"rating": float(r["rating"]), "user_id": int(r["user_id"]),
                 "movie_id": int(r["movie_id"]), "timestamp": int(r["timestamp"]),
                 **{c: reference_id(r[c], num_buckets) for c in hashed},
                 "genres": [reference_id(g, num_buckets) for g in r["genres"].split("|")]}
                for r in rows]
    assert table.to_pylist() == expected
    assert max(len(r["genres"]) for r in expected) > 1  # genres is really multi-valued
    check_row_groups(dst, summary, len(rows), 50)


def test_malformed_line_names_the_file_and_leaves_no_output(tmp_path):
    lines = sample("criteo").read_text().splitlines(keepends=True)
    bad = tmp_path / "bad_criteo.csv"
    short_line = lines[150].rsplit(",", 1)[0] + "\n"  # 39 fields
    bad.write_text("".join(lines[:150]) + short_line + "".join(lines[151:]))
    dst = tmp_path / "bad.parquet"
    with pytest.raises(ValueError, match=r"bad_criteo\.csv.*Expected 40 columns, got 39"):
        convert_criteo(bad, dst, block_size=4096)
    assert list(tmp_path.iterdir()) == [bad]


def test_bad_values_and_headers_name_the_file(tmp_path):
    lines = sample("avazu").read_text().splitlines(keepends=True)
    bad_hour = tmp_path / "bad_hour.csv"
    bad_hour.write_text(lines[0] + lines[1].replace(",14102100,", ",14133100,", 1))
    with pytest.raises(ValueError, match=r"bad_hour\.csv"):
        convert_avazu(bad_hour, tmp_path / "out.parquet")
    no_genres = tmp_path / "no_genres.csv"
    no_genres.write_text("user_id,movie_id,rating,timestamp,title,gender,age,occupation,zip\n")
    with pytest.raises(ValueError, match=r"no_genres\.csv.*lacks the columns genres"):
        convert_movielens(no_genres, tmp_path / "out.parquet")
    bad_number = tmp_path / "bad_number.csv"
    bad_number.write_text(lines[0] + lines[1].replace(",0,14102100,", ",zero,14102100,", 1))
    with pytest.raises(ValueError, match=r"bad_number\.csv.*zero"):
        convert_avazu(bad_number, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "hbkernels.data", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_convert(tmp_path):
    src = sample("movielens")
    dst = tmp_path / "cli.parquet"
    res = run_cli("convert", "movielens", src, dst, "--num-buckets", 1000)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"wrote 200 rows in 1 row groups to {dst}\n"
    convert_movielens(src, tmp_path / "api.parquet", num_buckets=1000)
    assert pq.read_table(dst).equals(pq.read_table(tmp_path / "api.parquet"))
    missing = run_cli("convert", "criteo", tmp_path / "missing.txt", dst)
    assert missing.returncode == 1 and "missing.txt" in missing.stderr
    unknown = run_cli("convert", "kdd", src, dst)
    assert unknown.returncode == 1 and "invalid choice" in unknown.stderr
