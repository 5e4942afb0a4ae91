"""hbkernels/bench/bench_embedding_collection.py runs: ``--smoke`` under ``mpiexec -n 2``
and at world size 1 without a launcher (with and without the torch peer).
The script checks every plan against the reference (torch, else the first
plan) before timing it, so these runs also check the collection's two steps
at tiny sizes. CSV and markdown go to tmp_path."""
import csv
import importlib.util
import subprocess
import sys

import pytest
from mpirun import HAVE_MPI4PY, MPIEXEC, ROOT, _env, mpirun

if str(ROOT) not in sys.path:  # the bench package lives at the repository root
    sys.path.insert(0, str(ROOT))

from hbkernels.bench.bench_embedding_collection import OP, PLANS, TORCH_MODE  # noqa: E402
from hbkernels.bench.common import COLUMNS, DISABLE_ENV  # noqa: E402

SCRIPT = "-m hbkernels.bench.bench_embedding_collection"
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def check_run(out, csv_path, n, torch_expected):
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    for r in rows:
        assert r["op"] == OP and r["dtype"] == "float32" and r["device"], r
        assert r["size"] == f"smoke-N{n}-B64", r
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"]), r
        assert float(r["gbps"]) > 0, r
    hbk_modes = [r["mode"] for r in rows if r["provider"] == "hbkernels"]
    assert len(hbk_modes) == len(set(hbk_modes)), hbk_modes
    for plan in PLANS:  # measured, or skipped with the reason printed
        assert plan in hbk_modes or f"skip {plan}:" in out, f"plan {plan} neither measured nor explained:\n{out}"
    assert {r["provider"] for r in rows} == ({"hbkernels", "torch"} if torch_expected else {"hbkernels"})
    if torch_expected:
        assert [r["mode"] for r in rows if r["provider"] == "torch"] == [TORCH_MODE]
    for plan in hbk_modes:
        assert f"verified {plan} against" in out or f"{plan}: no torch peer, so it is the reference" in out, out
    md = csv_path.with_name(f"{csv_path.stem}-embedding-collection.md")
    assert md.exists(), out
    text = md.read_text()
    for part in ("### Step time", "### Bytes on the wire", "### Framework overhead", "| row_wise | off | float16 |"):
        assert part in text, text
    assert ("saved of the bytes without dedup in float32: dedup" in text if n > 1
            else "n/a (nothing leaves the rank at N=1)" in text), text
    assert "| rank | step ms | kernels ms | comm ms | overhead |" in text, text
    return rows


@pytest.mark.skipif(not (MPIEXEC and HAVE_MPI4PY), reason="needs mpiexec and mpi4py (pip install 'hbkernels[mpi]')")
def test_bench_embedding_collection_two_ranks(tmp_path):
    out_csv = tmp_path / "b.csv"
    rc, out, _ = mpirun(2, SCRIPT, "--smoke", "--out", str(out_csv), timeout=300)
    assert rc == 0, out[-6000:]
    check_run(out, out_csv, 2, HAVE_TORCH)


@pytest.mark.parametrize("torch", [True, False], ids=["with-torch", "without-torch"])
def test_bench_embedding_collection_world_of_one(tmp_path, torch):
    if torch and not HAVE_TORCH:
        pytest.skip("torch is not installed")
    out_csv = tmp_path / "b.csv"
    env = _env() if torch else _env(**{DISABLE_ENV: "torch"})
    res = subprocess.run([sys.executable, *SCRIPT.split(), "--smoke", "--out", str(out_csv)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    check_run(out, out_csv, 1, torch)
