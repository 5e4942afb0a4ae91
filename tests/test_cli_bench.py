"""``hbkernels bench``: a short CPU run end to end (table, CSV, JSON, PNG), the
one-line errors a user can hit, a failing op among working ones, and how the
command finds the ``bench/`` package of the checkout."""
import csv
import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the bench package lives at the repository root
    sys.path.insert(0, str(ROOT))

from hbkernels.bench import common, run_all  # noqa: E402
from hbkernels import cli  # noqa: E402
from hbkernels.cli import bench as cli_bench  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HEADER = re.compile(r"^op\s+mode\s+dtype\s+size\s+provider\s+median ms\s+GB/s\s+% copy\s+speedup\s+vs$",
                    re.M)


def hbkernels_bench(*argv, cwd):
    """``python -m hbkernels bench ARGV`` in ``cwd``, the checkout importable (editable
    install or not); returns the CompletedProcess."""
    env = dict(os.environ, HBK_PROGRESS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "hbkernels", "bench", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def only(folder, pattern):
    found = sorted(Path(folder).glob(pattern))
    assert len(found) == 1, found
    return found[0]


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == common.COLUMNS
        return list(reader)


def test_short_cpu_run_writes_table_csv_json_png(tmp_path):
    out = tmp_path / "out"
    res = hbkernels_bench("--device", "cpu", "--smoke", "--out", str(out),
                          "--ops", "embedding_bag,unique", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert HEADER.search(res.stdout), res.stdout
    assert "bench 3/3 100%" in res.stderr  # the progress bar: copy + 2 ops
    assert "verified" not in res.stdout  # the scripts' own prints went to the log

    rows = read_csv(only(out, "bench-*.csv"))
    assert [r["op"] for r in rows].count("copy") == 1
    peers = {"numpy", "torch", "jax"}
    for op in ("embedding_bag", "unique"):
        providers = {r["provider"] for r in rows if r["op"] == op}
        assert "hbkernels" in providers and providers & peers, (op, providers)

    doc = json.loads(only(out, "bench-*.json").read_text())
    assert doc["device"]["kind"] == "cpu" and doc["device"]["name"]
    assert doc["copy_gbps"] > 0
    assert doc["versions"]["numpy"] == np.__version__ and doc["versions"]["hbkernels"]
    assert doc["args"]["ops"] == ["embedding_bag", "unique"] and doc["failed"] == []
    assert len(doc["rows"]) == len(rows)
    copy_row = next(r for r in doc["rows"] if r["op"] == "copy")
    assert copy_row["pct_copy"] == pytest.approx(100)
    hbk = [r for r in doc["rows"] if r["provider"] == "hbkernels"]
    assert {r["op"] for r in hbk} == {"embedding_bag", "unique"}
    for r in hbk:
        assert isinstance(r["speedup"], float) and r["speedup"] > 0, r
        assert isinstance(r["pct_copy"], float) and r["pct_copy"] > 0, r
        assert r["vs"] in peers

    png = only(out, "bench-*.png")
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    log = only(out, "bench-*.log").read_text()
    assert "verified hbkernels" in log
    for path in (png, only(out, "bench-*.csv"), only(out, "bench-*.json")):
        assert str(path) in res.stdout


def _real_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    if _real_gpu():
        pytest.skip("CuPy finds a real GPU here")
    res = hbkernels_bench("--device", "cuda", "--smoke", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 1
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hbkernels bench: error:"), res.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_unknown_op_is_a_clear_error(tmp_path):
    res = hbkernels_bench("--ops", "embedding_bag,no_such_op", "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stdout + res.stderr
    assert res.stderr.strip() == ("hbkernels bench: error: unknown op no_such_op; choose from "
                                  + ", ".join(run_all.BENCHMARKS))


@pytest.mark.parametrize("providers, ops, expected", [
    ("bogus", "embedding_bag", "unknown provider bogus; choose from "
     "hbkernels, hbkernels-unchecked, numpy, torch, fbgemm-tbe, gather-scatter (what the ops chosen time on cpu)"),
    ("torch,cupy,nope", "lookup,unique", "unknown providers cupy, nope; choose from hbkernels, "
     "hbkernels-unchecked, numpy, torch, hbkernels-sorted (what the ops chosen time on cpu)"),
    ("torch", "hash_table", "--providers does not apply to hash_table: it times every provider"),
], ids=["one unknown", "two unknown", "no choice"])
def test_unknown_provider_is_a_clear_error(tmp_path, capsys, providers, ops, expected):
    out = tmp_path / "out"
    assert cli.main(["bench", "--smoke", "--out", str(out), "--ops", ops,
                     "--providers", providers]) == 1
    assert capsys.readouterr().err.strip() == f"hbkernels bench: error: {expected}"
    assert not out.exists()  # refused before anything ran


# -- in process: a fake op module beside a failing one --------------------------
def _fine(ctx):
    x = np.arange(1000.0)
    providers = [common.Provider(common.HBK, lambda a: a["x"] * 2),
                 common.Provider("numpy", lambda a: a["x"] + a["x"])]
    ctx.compare("fine", "m", "n=1000", "float64", {"x": x}, providers, nbytes=16000,
                reference=("numpy",))


def _boom(ctx):
    raise RuntimeError("kaput\nsecond line")


def test_a_failing_op_is_one_line_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_all, "BENCHMARKS", {"boom": types.SimpleNamespace(run=_boom),
                                                "fine": types.SimpleNamespace(run=_fine)})
    argv = ["bench", "--smoke", "--out", str(tmp_path), "--reps", "1"]
    assert cli.main(argv + ["--ops", "boom,fine"]) == 1
    out = capsys.readouterr().out
    assert "  FAILED boom: RuntimeError: kaput\n" in out
    assert "second line" not in out
    assert "Traceback" in only(tmp_path, "bench-*.log").read_text()
    assert {r["op"] for r in read_csv(only(tmp_path, "bench-*.csv"))} == {"copy", "fine"}
    assert json.loads(only(tmp_path, "bench-*.json").read_text())["failed"] == [
        "boom: RuntimeError: kaput"]

    # a second run starts a fresh CSV instead of appending to the first
    assert cli.main(argv + ["--ops", "fine"]) == 0
    rows = read_csv(only(tmp_path, "bench-*.csv"))
    assert [r["op"] for r in rows] == ["copy", "fine", "fine"]
    doc = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert doc["failed"] == []
    assert [r["speedup"] is not None for r in doc["rows"]] == [False, True, False]
    assert only(tmp_path, "bench-*.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_provider_that_does_not_run_here_is_a_note(tmp_path, monkeypatch, capsys):
    """A provider an op can time but that does not run here (a peer not installed):
    the op is verified, nothing is timed, a note says why; the run succeeds."""
    monkeypatch.setattr(run_all, "BENCHMARKS", {"fine": types.SimpleNamespace(run=_fine)})
    monkeypatch.setitem(run_all.PROVIDERS, "fine", (common.HBK, "numpy", "no-such-peer"))
    assert cli.main(["bench", "--smoke", "--out", str(tmp_path), "--reps", "1", "--ops", "fine",
                     "--providers", "no-such-peer"]) == 0
    out = capsys.readouterr().out
    assert ("note: fine: none of --providers no-such-peer runs here (it has hbkernels, numpy): "
            "nothing timed") in out
    assert [r["op"] for r in read_csv(only(tmp_path, "bench-*.csv"))] == ["copy"]
    assert "verified hbkernels against numpy" in only(tmp_path, "bench-*.log").read_text()


def test_no_matplotlib_is_a_note_not_an_error(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib.* -> ImportError
    rows = [{"provider": "hbkernels", "speedup": 2.0, "op": "x", "mode": "m", "dtype": "f",
             "size": "n", "vs": "numpy"}]
    note = cli_bench.write_chart(tmp_path / "c.png", rows, "dev")
    assert "matplotlib" in note and not (tmp_path / "c.png").exists()




def test_speedups_are_against_the_fastest_named_peer():
    def row(provider, ms):
        return {"op": "embedding_bag", "provider": provider, "mode": "sum", "size": "n",
                "dtype": "float32", "median_ms": str(ms), "p20_ms": str(ms), "p80_ms": str(ms),
                "gbps": "", "device": "cpu", "_reference": ("numpy", "torch")}

    rows = common.results([row("hbkernels", 1.0), row("numpy", 12.9), row("torch", 2.0),
                           row("jax", 0.5)])   # jax is not a named peer of this case
    by = {r["provider"]: r for r in rows}
    assert by["hbkernels"]["vs"] == "torch" and by["hbkernels"]["speedup"] == pytest.approx(2.0)
    assert by["numpy"]["vs"] == "torch" and by["torch"]["speedup"] is None
