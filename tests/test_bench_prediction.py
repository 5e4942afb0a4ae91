"""``python -m hbkernels.bench.prediction``: calibrates, trains under each plan and writes
one CSV row per run, measured beside predicted (tiny sizes)."""
import csv
import json

import pytest
from mpirun import needs_mpi

from hbkernels.bench.prediction import COLUMNS, main

pytest.importorskip("torch")

TINY = ["--steps", "6", "--calibrate-args",
        "--widths 4,16 --layouts scattered --rows 500 --bags 8 --reps 2 --batch-size 32 --tables a:500:16 b:90:4",
        "--train-args", "--batch-size 64 --eval-samples 128"]


def run(tmp_path, capsys, ranks, plans):
    out = tmp_path / "prediction.csv"
    assert main(["--ranks", ranks, "--plans", plans, "--out", str(out), "--profiles", str(tmp_path), *TINY]) == 0
    machine = json.loads((tmp_path / f"profile-{ranks}-ranks.json").read_text())["machine"]
    assert machine["collection_tables"] == [["a", 500, 16], ["b", 90, 4]]
    assert machine["collection_batch"] == 32 // int(ranks)
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == list(COLUMNS)
    printed = capsys.readouterr().out
    assert printed.startswith("| ranks | plan | measured | predicted |")
    return rows


def test_one_rank_rows_hold_measured_and_predicted(tmp_path, capsys):
    rows = run(tmp_path, capsys, "1", "auto,column_wise")
    assert [(r["ranks"], r["plan"]) for r in rows] == [("1", "auto"), ("1", "column_wise")]
    for r in rows:
        assert int(r["steps"]) == 5 and float(r["measured_ms"]) > 0 and float(r["predicted_ms"]) > 0
        parts = sum(float(r[k]) for k in ("host_ms", "lookup_ms", "update_ms", "exchange_ms"))
        assert parts == pytest.approx(float(r["predicted_ms"]), rel=1e-3)
        assert float(r["ratio"]) == pytest.approx(float(r["measured_ms"]) / float(r["predicted_ms"]), rel=1e-3)
        assert "profile measured on" in r["profile"] and "at 1 rank(s)" in r["profile"]
    assert [r["placements"] for r in rows] == ["table_wise", "column_wise"]  # auto: table_wise


@needs_mpi
def test_two_ranks_calibrate_and_train_under_mpiexec(tmp_path, capsys):
    (row,) = run(tmp_path, capsys, "2", "row_wise")
    assert row["placements"] == "row_wise" and "at 2 rank(s)" in row["profile"]
    assert float(row["exchange_ms"]) > 0


def test_unknown_plans_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--plans", "auto,everywhere", "--out", str(tmp_path / "x.csv")])
    assert "--plans takes some of" in capsys.readouterr().err
