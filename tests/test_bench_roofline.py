"""hbkernels/bench/bench_roofline.py (issue 9's sweep): it runs at smoke sizes on the CPU, with
and without torch; its report can be rebuilt from the CSV alone; its target
checks read the right rows and compare the right way."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the bench package lives at the repository root
    sys.path.insert(0, str(ROOT))

from hbkernels.bench import bench_roofline as roofline  # noqa: E402
from hbkernels.bench import common  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def test_smoke_run_writes_rows_report_and_rebuilds_it_from_the_csv(tmp_path):
    out = tmp_path / "roofline.csv"
    ctx = roofline.main(["--device", "cpu", "--smoke", "--out", str(out)])
    rows = roofline.read_csv(out)
    assert rows == [{k: r[k] for k in common.COLUMNS} for r in ctx.rows]
    assert {r["op"] for r in rows} == {"copy", roofline.BAG, roofline.TABLES, roofline.STEP, "unique"}
    providers = {r["provider"] for r in rows}
    assert {"hbkernels", roofline.UNCHECKED, roofline.PER_TABLE, roofline.UNFUSED, "numpy"} <= providers
    assert ("torch" in providers) == HAVE_TORCH
    report = (tmp_path / "roofline.md").read_text()
    checks = roofline.targets(rows)
    for t in checks:
        assert f"| {t['target']} | {t['measured']} |" in report
    # smoke sizes: D in (1, 8), L in (1, 4): no 75% check (D < 64); every other kind is there
    kinds = {t["target"].split(":")[1].strip() for t in checks}
    assert "one call >= 2x 26 calls" in kinds and ">= 50% of copy bandwidth" in kinds
    assert "<= 0.6x the fp32 time" in kinds and ">= 2x torch.unique" in kinds
    assert all(t["met"] is not None for t in checks) == HAVE_TORCH

    first = report.split("\n", 3)[3]  # all but the title and the command
    roofline.main(["--report", str(out)])
    assert (tmp_path / "roofline.md").read_text().split("\n", 3)[3] == first


def test_smoke_run_without_torch(tmp_path, monkeypatch):
    monkeypatch.setenv(common.DISABLE_ENV, "torch,jax")
    out = tmp_path / "roofline.csv"
    roofline.main(["--device", "cpu", "--smoke", "--out", str(out)])
    rows = roofline.read_csv(out)
    assert "torch" not in {r["provider"] for r in rows}
    assert not any(r["mode"] == "fwd+bwd+rowwise_adagrad" for r in rows)
    checks = {t["target"]: t for t in roofline.targets(rows)}
    assert checks["26 tables D=8 L=4: one call >= 2x 26 calls"]["met"] is not None
    assert checks["embedding_bag D=8 L=4: >= 1.5x torch"]["measured"] == "not measured"


def row(op, mode, size, dtype, provider, ms, gbps=""):
    return dict(op=op, mode=mode, size=size, dtype=dtype, provider=provider,
                median_ms=str(ms), p20_ms=str(ms), p80_ms=str(ms), gbps=str(gbps), device="gpu")


@pytest.mark.parametrize("torch_ms, pct, met_speed, met_pct", [
    (3.0, 80.0, True, True),    # 1.5x torch exactly, 80% of copy
    (2.9, 74.0, False, False),  # just under both
])
def test_targets_compare_against_the_right_rows(torch_ms, pct, met_speed, met_pct):
    copy = 2000.0
    bag = "E=10000000 D=128 B=65536 L=32 zipf=1.05"
    small = "E=10000000 D=16 B=65536 L=32 zipf=1.05"
    tables = "T=26 E=1000000 D=128 B=65536 L=1 zipf=1.05"
    rows = [
        row("copy", "d2d", "bytes=1", "uint8", "cupy", 1.0, copy),
        row(roofline.BAG, "sum", bag, "float32", "hbkernels", 2.0, copy * pct / 100),
        row(roofline.BAG, "sum", bag, "float32", "torch", torch_ms),
        row(roofline.BAG, "sum", bag, "float16", "hbkernels", 1.3),
        row(roofline.BAG, "sum", small, "float32", "hbkernels", 1.0, 10.0),
        row(roofline.TABLES, "sum x26", tables, "float32", "hbkernels", 1.0),
        row(roofline.TABLES, "sum x26", tables, "float32", roofline.PER_TABLE, 1.9),
        row("unique", "inverse", "N=4194304 E=10000000 zipf=1.05", "int64", "hbkernels", 1.0),
        row("unique", "inverse", "N=4194304 E=10000000 zipf=1.05", "int64", "torch", 2.5),
    ]
    got = {t["target"]: t for t in roofline.targets(rows)}
    assert got["embedding_bag D=128 L=32: >= 1.5x torch"]["met"] is met_speed
    assert got["embedding_bag D=128 L=32: >= 75% of copy bandwidth"]["met"] is met_pct
    assert got["embedding_bag D=128 L=32: >= 75% of copy bandwidth"]["measured"] == f"{pct:.0f}%"
    assert "embedding_bag D=16 L=32: >= 75% of copy bandwidth" not in got  # only D >= 64
    assert got["embedding_bag D=16 L=32: >= 1.5x torch"]["met"] is None  # no torch row
    fp16 = got["embedding_bag fp16 D=128 L=32: <= 0.6x the fp32 time"]
    assert fp16["measured"] == "0.65x" and fp16["met"] is False  # 1.3 / 2.0, at most 0.6
    assert got["26 tables D=128 L=1: one call >= 2x 26 calls"]["met"] is False  # 1.9x
    assert got["unique, inverse, N=4194304: >= 2x torch.unique"]["measured"] == "2.50x"
