"""hbkernels/bench/bench_parquet.py runs: ``--smoke`` as a script (it spawns its own RSS
processes, so it does not fit test_bench_smoke.py's in-process ``main`` calls),
with and without the pandas peer. Every batch provider is checked equal to
hbkernels batch by batch before timing. CSV and markdown go to tmp_path."""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the bench package lives at the repository root
    sys.path.insert(0, str(ROOT))

from hbkernels.bench.common import COLUMNS, DISABLE_ENV  # noqa: E402

SCRIPT = "-m hbkernels.bench.bench_parquet"
HAVE_PANDAS = importlib.util.find_spec("pandas") is not None
ALWAYS = {"hbkernels", "hbkernels-noprefetch", "pyarrow-read_table", "pyarrow-iter_batches"}


@pytest.mark.parametrize("pandas", [True, False], ids=["with-pandas", "without-pandas"])
def test_bench_parquet_smoke(tmp_path, pandas):
    if pandas and not HAVE_PANDAS:
        pytest.skip("pandas is not installed")
    env = {**os.environ, DISABLE_ENV: "" if pandas else "pandas"}
    out_csv = tmp_path / "b.csv"
    res = subprocess.run([sys.executable, *SCRIPT.split(), "--smoke", "--out", str(out_csv)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "against hbkernels" in out, out
    with open(out_csv, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    assert {r["provider"] for r in rows} == (ALWAYS | {"pandas-rowwise"} if pandas else ALWAYS)
    for r in rows:
        assert (r["op"], r["mode"], r["size"], r["dtype"]) == ("parquet_load", "rows", "20000x41cols", "mixed")
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"]), r
        assert float(r["gbps"]) > 0 and r["device"], r
    text = (tmp_path / "b-parquet.md").read_text()
    for part in ("| hbkernels | ", "Peak RSS", "| pyarrow-read_table | ", "hbkernels peak RSS 4x/1x =",
                 "pyarrow-read_table rows/s = **"):
        assert part in text, text
    assert ("pandas-rowwise rows/s = **" in text) == pandas, text
