"""Bytes across nodes in the planner's estimates, ``hbkernels.sharding.simulate`` and
``hbkernels plan --simulate``."""
import pytest
from helpers import raises

import hbkernels as hbk
from hbkernels.cli import main
from hbkernels.sharding.plan import make_plan
from hbkernels.sharding.simulate import PLANS, simulate, table

TABLES = [hbk.TableSpec("big", num_rows=10**6, dim=32, hotness=4),
          hbk.TableSpec("small", num_rows=500, dim=8)]


@pytest.mark.parametrize("kind", ["row_wise", "data_parallel", "column_wise"])
def test_across_nodes_is_the_share_of_the_peers_on_other_nodes(kind):
    one_node = make_plan(TABLES, 4, kind, batch_size_hint=256)
    two_nodes = make_plan(TABLES, 4, kind, batch_size_hint=256, ranks_per_node=2)
    singles = make_plan(TABLES, 4, kind, batch_size_hint=256, ranks_per_node=1)
    for name in one_node:
        wire = one_node.estimates[name].wire_bytes
        assert one_node.estimates[name].across_bytes == (0.0,) * 4
        assert two_nodes.estimates[name].wire_bytes == wire
        assert singles.estimates[name].across_bytes == pytest.approx(wire)  # every peer is remote
        # each rank's traffic goes evenly to its 3 peers, 2 of them on the other node
        assert two_nodes.estimates[name].across_bytes == pytest.approx([2 / 3 * w for w in wire])


def test_table_wise_counts_the_owners_node():
    plan = make_plan([hbk.TableSpec("t", num_rows=1000, dim=16)], 4, "table_wise",
                     batch_size_hint=64, ranks_per_node=2)
    (owner,) = plan["t"].ranks
    est = plan.estimates["t"]
    for r in range(4):
        remote = r // 2 != owner // 2
        expected = 2 / 3 if r == owner else 1.0 if remote else 0.0  # the owner: 2 of its 3 peers
        assert est.across_bytes[r] == pytest.approx(expected * est.wire_bytes[r])


def test_simulate_gives_every_plan_or_why_not():
    runs = simulate(TABLES, 8, ranks_per_node=4, batch_size_hint=128,
                    memory_per_rank=100e6)  # big replicated takes 128 MB
    assert [s.request for s in runs] == list(PLANS)
    by = {s.request: s for s in runs}
    assert "does not fit memory_per_rank" in by["data_parallel"].refused
    made = [s for s in runs if not s.refused]
    for s in made:
        assert s.step.seconds > 0 and 0 < s.across_bytes <= s.wire_bytes and s.memory_bytes <= 100e6
        assert s.plan.estimates["big"].across_bytes
    lines = table(runs)
    assert lines[0].startswith("plan") and len(lines) == 1 + len(PLANS)
    assert any(line.startswith("data_parallel") and "refused" in line for line in lines)
    with raises(ValueError, match="ranks_per_node must be None or an integer >= 1"):
        make_plan(TABLES, 4, ranks_per_node=0)


def test_cli_simulates_a_cluster(tmp_path, capsys):
    from hbkernels.sharding.profile import assumed_profile

    assumed_profile([8, 32]).save(tmp_path / "p.json")
    assert main(["plan", "--simulate", "--world-size", "16", "--ranks-per-node", "8", "--tables",
                 "big:1000000:32:4", "small:500:8", "--batch-size", "4096",
                 "--profile", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("16 ranks (2 node(s) of 8), 2 tables, global batch 4096 (256 per rank)")
    assert out[1].split()[:3] == ["plan", "predicted", "ms"]
    assert [line.split()[0] for line in out[2:]] == list(PLANS)


@pytest.mark.parametrize("argv, match", [
    (["--table", "big:10:x"], "expected NAME:ROWS:DIM[:HOTNESS]"),
    (["--profile", "/nonexistent/p.json"], "--profile: cannot read"),
])
def test_cli_refuses_bad_tables_and_profiles(capsys, argv, match):
    try:
        rc = main(["plan", "--simulate", *argv])
    except SystemExit as stop:
        rc = stop.code
    assert rc in (1, 2) and match in capsys.readouterr().err
