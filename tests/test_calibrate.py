"""Machine profiles (hbkernels.sharding.profile) and their calibration
(hbkernels.bench.calibrate, ``hbkernels plan --calibrate``)."""
import json

import numpy as np
import pytest
from helpers import raises
from mpirun import HAVE_MPI4PY, MPIEXEC, mpirun, torchrun

import hbkernels as hbk
from hbkernels.bench.calibrate import calibrate
from hbkernels.bench.common import LAYOUTS
from hbkernels.cli import main
from hbkernels.types import PLACEMENTS
from hbkernels.sharding.profile import DEFAULT_COST
from hbkernels.sharding.profile import (ASSUMED, CALLS, MEASURED, PER_KEY, PER_KIND, MachineProfile, Spread,
                                        assumed_profile)

TINY = dict(rows=1000, bags=16, hotness=3, reps=2)


@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_spread_is_numpys_median_and_20th_80th_percentiles(rng, n):
    values = rng.standard_normal(n)
    s = Spread.of(list(values))
    assert (s.median, s.low, s.high) == pytest.approx(tuple(np.percentile(values, [50, 20, 80])))
    assert Spread.from_json(s.to_json()) == s
    with raises(ValueError, match="at least one"):
        Spread.of([])


def test_assumed_profile_is_the_planners_default_cost():
    p = assumed_profile([16, 3])
    assert p.source == ASSUMED and not p.measured_collectives
    assert set(p.lookup_ns_per_id) == {(d, lay) for d in (16, 3) for lay in LAYOUTS}
    assert p.lookup_ns_per_id[16, "ranked"].median == pytest.approx(1e9 * 64 / DEFAULT_COST["memory_bytes_per_s"])
    assert p.update_ns_per_id[3, "uniform"].median == pytest.approx(2e9 * 12 / DEFAULT_COST["memory_bytes_per_s"])
    assert p.collective_latency_us.median == pytest.approx(1e6 * DEFAULT_COST["collective_latency_s"])
    assert p.network_bytes_per_s.median == DEFAULT_COST["network_bytes_per_s"]
    assert set(p.call_us) == set(CALLS) and all(s.median == 0 for s in p.call_us.values())
    assert all(s.median == 0 for field in PER_KIND for s in getattr(p, field).values())
    assert MachineProfile.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_calibrate_measures_every_width_and_layout(tmp_path):
    p = calibrate(hbk.dist.init("local"), (1, 5), ("ranked", "uniform"), **TINY)
    assert p.source == MEASURED and not p.measured_collectives  # one rank: collectives assumed
    keys = {(d, lay) for d in (1, 5) for lay in ("ranked", "uniform")}
    assert all(set(getattr(p, field)) == keys for field in PER_KEY)
    assert set(p.unique_ns_per_id) == {"ranked", "uniform"}
    for s in [*(v for field in PER_KEY for v in getattr(p, field).values()),
              *p.unique_ns_per_id.values(), *p.call_us.values()]:
        assert 0 <= s.low <= s.median <= s.high and np.isfinite(s.high)
    assert tuple(sorted(p.call_us)) == tuple(sorted(CALLS))
    assert p.call_us["update"].median > 0 and p.call_us["lookup"].median > 0
    for field in PER_KIND:  # each placement: a collection's step, a table more, per id and per bag
        assert set(getattr(p, field)) == set(PLACEMENTS)
        assert all(0 <= s.low <= s.median <= s.high for s in getattr(p, field).values())
    assert all(s.median > 0 for s in p.step_us.values())
    assert p.collective_latency_us == assumed_profile([1]).collective_latency_us
    assert p.machine["world_size"] == 1 and p.machine["optimizer"] == "Adagrad"
    p.save(tmp_path / "p.json")
    assert MachineProfile.load(tmp_path / "p.json") == p


def test_a_collections_own_costs_are_measured_on_the_given_tables():
    tables = [hbk.TableSpec("a", num_rows=300, dim=3), hbk.TableSpec("b", num_rows=50, dim=5)]
    p = calibrate(hbk.dist.init("local"), (3,), ("uniform",), **TINY, tables=tables, batch=6)
    assert p.machine["collection_tables"] == [["a", 300, 3], ["b", 50, 5]]
    assert p.machine["collection_batch"] == 6 and set(p.host_ns_per_bag) == set(PLACEMENTS)
    default = calibrate(hbk.dist.init("local"), (3,), ("uniform",), **TINY)
    assert default.machine["collection_tables"] == [[f"t{k}", 125, 3] for k in range(8)]
    assert default.machine["collection_batch"] == TINY["bags"] // 4
    with raises(ValueError, match="one or more static TableSpecs"):
        calibrate(hbk.dist.init("local"), (3,), ("uniform",), **TINY, tables=[])


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="Lion"), "optimizer must be one of"),
    (dict(widths=()), "widths must be"),
    (dict(widths=(0,)), "widths must be"),
    (dict(layouts=("hashed",)), "layouts must be some of"),
    (dict(reps=0), "reps must be an integer >= 1"),
    (dict(rows=2.5), "rows must be an integer >= 1"),
    (dict(bags=3), "bags must be an integer >= 4"),
    (dict(hotness=1), "hotness must be an integer >= 2"),
])
def test_calibrate_refuses_bad_arguments(kwargs, match):
    args = dict(TINY, widths=(2,))
    args.update(kwargs)
    with raises(ValueError, match=match):
        calibrate(hbk.dist.init("local"), **args)


def test_a_bad_profile_names_its_file_and_field(tmp_path):
    good = assumed_profile([4]).to_json()
    cases = [({**good, "version": 9}, "'version'"), ({**good, "source": "guessed"}, "'source'"),
             ({k: v for k, v in good.items() if k != "call_us"}, "'call_us'"),
             ({**good, "lookup_ns_per_id": {"4/hashed": [1, 1, 1]}}, "'lookup_ns_per_id'"),
             ({**good, "update_ns_per_bag": {"5/uniform": [1, 1, 1]}}, "'update_ns_per_bag'"),
             ({**good, "unique_ns_per_id": {"uniform": [1, 1, 1]}}, "'unique_ns_per_id'"),
             ({**good, "table_us": {"row_wise": [1, 1, 1]}}, "'table_us'"),
             ({**good, "network_bytes_per_s": [1, 2]}, "'network_bytes_per_s'")]
    for d, field in cases:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(d))
        with raises(ValueError, match=f"bad.json: field {field}"):
            MachineProfile.load(path)
    path.write_text("{")
    with raises(ValueError, match="not a profile"):
        MachineProfile.load(path)


def test_cli_writes_the_profile_and_prints_its_constants(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["plan", "--calibrate", "--out", str(out), "--widths", "2,3", "--layouts", "scattered",
                 "--rows", "500", "--bags", "8", "--hotness", "2", "--reps", "2"]) == 0
    printed = capsys.readouterr().out
    p = MachineProfile.load(out)
    assert set(p.lookup_ns_per_id) == {(2, "scattered"), (3, "scattered")}
    assert "lookup ns/id" in printed and "ns/bag" in printed and "unique, ns/id: scattered" in printed and "not measured at one rank" in printed
    assert f"profile -> {out}" in printed


@pytest.mark.parametrize("argv, match", [
    (["--widths", "0"], "--widths takes widths >= 1"),
    (["--layouts", "scattered,hashed"], "--layouts takes some of"),
    (["--out", "/nonexistent-dir/p.json"], "no directory"),
])
def test_cli_refuses_bad_options(tmp_path, capsys, argv, match):
    assert main(["plan", "--calibrate", "--rows", "100", *argv]) == 1
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("launch", ["mpiexec", "torchrun"])
def test_two_ranks_measure_the_collectives(tmp_path, launch):
    if launch == "mpiexec" and not (MPIEXEC and HAVE_MPI4PY):
        pytest.skip("needs mpiexec and mpi4py (pip install 'hbkernels[mpi]')")
    if launch == "torchrun":
        pytest.importorskip("torch")
    out = tmp_path / "profile.json"
    rc, text, _ = (mpirun if launch == "mpiexec" else torchrun)(
        2, "-m hbkernels", "plan", "--calibrate", "--out", out, "--widths", "2", "--layouts",
        "uniform", "--rows", "500", "--bags", "8", "--reps", "2", timeout=240, cwd=tmp_path)
    assert rc == 0, text[-4000:]
    p = MachineProfile.load(out)
    assert p.measured_collectives and p.machine["world_size"] == 2
    assert p.machine["backend"] == ("mpi" if launch == "mpiexec" else "torch")
    assert p.collective_latency_us.median > 0 and p.network_bytes_per_s.median > 0
    assert "alltoallv latency" in text and text.count("profile ->") == 1  # rank 0 alone writes
