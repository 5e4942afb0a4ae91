"""``python -m hbkernels.bench.exchange_bytes`` under ``mpiexec -n 4`` as 2 nodes of 2 (tiny
sizes): a row per layout and exchange, the hierarchical exchange sending fewer bytes across
nodes where Zipf ids repeat across a node's ranks."""
import csv

from mpirun import assert_ok, mpirun, needs_mpi

from hbkernels.bench.exchange_bytes import COLUMNS


@needs_mpi
def test_rows_per_layout_and_exchange(tmp_path):
    out = tmp_path / "exchange.csv"
    rc, printed, _ = mpirun(4, "-m hbkernels.bench.exchange_bytes", "--ranks-per-node", "2", "--steps", "2",
                            "--batch-size", "256", "--out", out, timeout=300)
    assert rc == 0, printed[-4000:]
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == list(COLUMNS)
    got = {(r["layout"], r["exchange"]): r for r in rows}
    assert sorted(got) == sorted((lay, ex) for lay in ("scattered", "ranked", "uniform")
                                 for ex in ("flat", "hierarchical"))
    for layout in ("scattered", "ranked", "uniform"):
        flat, relayed = got[layout, "flat"], got[layout, "hierarchical"]
        assert int(flat["across_node_bytes"]) > 0 and float(flat["step_ms"]) > 0
        fewer = int(relayed["across_node_bytes"]) < int(flat["across_node_bytes"])
        assert fewer or layout == "uniform", (layout, flat, relayed)
        for r in (flat, relayed):  # every byte sent is within or across nodes (each a step's mean)
            assert abs(int(r["within_node_bytes"]) + int(r["across_node_bytes"])
                       - sum(int(r[k]) for k in ("ids_bytes", "rows_bytes", "grads_bytes"))) <= 3
