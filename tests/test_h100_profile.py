"""The H100 node profile shipped with hbkernels (hbkernels.sharding.h100): its figures are
those of the committed measurements, its constants follow its stated fits and each names
its source; the MLPerf DLRM-DCNv2 shape; a profile's own link to other nodes."""
import csv
import dataclasses
from pathlib import Path

import pytest
from helpers import raises

import hbkernels as hbk
from hbkernels.cli import main
from hbkernels.sharding import h100
from hbkernels.sharding.cost import ProfileCost
from hbkernels.sharding.plan import make_plan
from hbkernels.sharding.profile import PER_KEY, PER_KIND, MachineProfile, Spread, as_profile
from hbkernels.sharding.simulate import (MLPERF_DCNV2_BATCH, MLPERF_DCNV2_HOTNESS,
                                         mlperf_dcnv2_tables, simulate)

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_kernel_figures_are_the_committed_h100_measurement():
    found = {}
    for r in rows(RESULTS / "h100-measured-2026-11-27.csv"):
        if r["case"] == "unique" and r["provider"] == "hbkernels":
            found[("unique", None, int(r["ids"]), None)] = float(r["event_ms"])
        elif r["provider"] == "hbkernels-unchecked" and r["dtype"] == "float32":
            found[(r["case"], int(r["D"]), int(r["L"]), r["ids"])] = float(r["event_ms"])
    assert h100.MEASURED == {k: found[k] for k in h100.MEASURED}


def test_the_host_figures_are_the_committed_h200_host_measurement():
    cases = {"step": "main job sparse step 8 tables, batch 1024", "unique": "unique inverse",
             "partition": "partition mod 8"}
    where = RESULTS / "nvidia-h200-gpu-check-2026-11-30"
    for key, mode in cases.items():
        runs = [next(float(r["median_ms"]) for r in rows(where / f"run{k}-host.csv") if r["mode"] == mode)
                for k in (1, 2)]
        assert h100.HOST_US[key] == pytest.approx([1e3 * ms for ms in runs], abs=0.051)


def test_the_profile_follows_its_fits_and_names_every_source():
    p = as_profile(h100.NAME)
    m = h100.MEASURED
    # lookup: the L = 32 call less the L = 1 call, per id of the 31 more
    assert p.lookup_ns_per_id[(128, "scattered")].median == pytest.approx(
        1e6 * (m[("forward", 128, 32, "zipf")] - m[("forward", 128, 1, "zipf")]) / (31 * 65536))
    assert p.lookup_ns_per_id[(64, "uniform")].median == pytest.approx(
        1e6 * (m[("forward", 64, 32, "uniform")] - m[("forward", 64, 1, "zipf")]) / (31 * 65536))
    update = {d: 1e6 * m[("fused_rowwise_adagrad", d, 32, "zipf")] / (32 * 65536) for d in (64, 128)}
    assert p.update_ns_per_id[(128, "uniform")].median == pytest.approx(update[128])
    assert p.update_ns_per_id[(16, "scattered")].median == pytest.approx(
        update[64] - 48 * (update[128] - update[64]) / 64)
    assert p.unique_ns_per_id["scattered"].median == pytest.approx(
        1e6 * (8.5920 - 1.3130) / (67_108_864 - 4_194_304))
    assert p.network_bytes_per_s.median == 450e9 and p.across == 50e9
    assert p.step_us["row_wise"].median - p.step_us["data_parallel"].median == pytest.approx(238.4)
    fields = PER_KEY + PER_KIND + ("unique_ns_per_id", "call_us", "collective_latency_us",
                                   "network_bytes_per_s", "across_bytes_per_s")
    assert set(p.sources) == set(fields)
    assert all(p.sources[f].split(":")[0] in ("measured", "modelled", "published", "assumed", "none separable from the measured cases")
               for f in fields)
    assert MachineProfile.from_json(p.to_json()) == p


def test_a_file_of_the_shipped_name_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / h100.NAME).write_text("{}")
    with raises(ValueError, match="field 'version'"):
        as_profile(h100.NAME)


def test_a_version_2_profile_has_one_network():
    d = as_profile(h100.NAME).to_json()
    d["version"] = 2
    del d["across_bytes_per_s"], d["sources"]
    old = MachineProfile.from_json(d)
    assert old.across_bytes_per_s is None and old.sources == {}
    assert old.across == old.network_bytes_per_s.median


def test_bytes_across_nodes_go_over_their_own_link_at_once_with_the_rest():
    p = as_profile(h100.NAME)
    cost = ProfileCost(p, "scattered", 1024)
    wire, across = (9e9, 9e9, 4.5e9), (0.0, 1e9, 4e9)
    assert cost.wire_seconds(wire, across) == pytest.approx(
        (9e9 / 450e9, max(8e9 / 450e9, 1e9 / 50e9), max(0.5e9 / 450e9, 4e9 / 50e9)))
    assert cost.wire_seconds(wire) == pytest.approx([w / 450e9 for w in wire])  # one node
    one_link = dataclasses.replace(p, across_bytes_per_s=None)
    assert ProfileCost(one_link, "scattered", 1024).wire_seconds(wire, across) == \
        pytest.approx([w / 450e9 for w in wire])
    tables = [hbk.TableSpec("t", num_rows=10**6, dim=64, hotness=4)]
    one = make_plan(tables, 16, "row_wise", batch_size_hint=512, profile=p)
    two = make_plan(tables, 16, "row_wise", batch_size_hint=512, profile=p, ranks_per_node=8)
    assert two.predict().parts_ms()["exchange"] > one.predict().parts_ms()["exchange"]
    assert two.predict().parts_ms()["lookup"] == pytest.approx(one.predict().parts_ms()["lookup"])


def test_the_mlperf_dcnv2_shape():
    tables = mlperf_dcnv2_tables()
    assert len(tables) == 26 and {t.dim for t in tables} == {128}
    assert max(t.num_rows for t in tables) == 40_000_000
    assert sum(t.num_rows == 40_000_000 for t in tables) == 5
    assert [t.hotness for t in tables] == list(MLPERF_DCNV2_HOTNESS) and sum(MLPERF_DCNV2_HOTNESS) == 214
    runs = {s.request: s for s in simulate(tables, 64, ranks_per_node=8, profile=as_profile(h100.NAME),
                                           batch_size_hint=MLPERF_DCNV2_BATCH // 64,
                                           memory_per_rank=80e9)}
    assert "does not fit memory_per_rank" in runs["data_parallel"].refused
    assert runs["auto"].step.seconds <= min(s.step.seconds for s in runs.values() if not s.refused)
    assert 0 < runs["row_wise"].across_bytes < runs["row_wise"].wire_bytes


def test_cli_simulates_the_shape_on_the_shipped_profile(capsys):
    assert main(["plan", "--simulate", "--shape", "mlperf-dcnv2", "--profile", "h100-node",
                 "--world-size", "16", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("16 ranks (2 node(s) of 8), 26 tables, global batch 65536 (4096 per rank)")
    assert "H100 node profile" in out[0]
    assert main(["plan", "--simulate", "--shape", "mlperf-dcnv2", "--tables", "t:10:4"]) == 1
    assert "give --shape or --tables, not both" in capsys.readouterr().err


@pytest.mark.parametrize("gpus", [8, 64, 512])
def test_what_the_docs_say_of_the_simulated_mlperf_cluster(gpus):
    """docs/sharding.md: on h100-node the host's calls are about 5 ms of the step, row_wise is
    the fastest placement and auto chooses it."""
    runs = {s.request: s for s in simulate(mlperf_dcnv2_tables(), gpus, ranks_per_node=8,
                                           profile=as_profile(h100.NAME),
                                           batch_size_hint=MLPERF_DCNV2_BATCH // gpus, memory_per_rank=80e9)}
    made = {k: s for k, s in runs.items() if not s.refused}
    assert min(made, key=lambda k: (made[k].step.seconds, k != "row_wise")) == "row_wise"
    assert {p.kind for p in runs["auto"].plan.values()} == {"row_wise"}
    assert 5.0 < runs["row_wise"].step.parts_ms()["host"] < 5.6
