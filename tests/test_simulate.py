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
    two_nodes = make_plan(TABLES, 4, kind, batch_size_hint=256, ranks_per_node=2, exchange="flat")
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
                     batch_size_hint=64, ranks_per_node=2, exchange="flat")
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


@pytest.mark.parametrize("kind", ["table_row_wise", "table_column_wise", "grid"])
def test_placements_over_a_nodes_ranks(kind):
    spec = hbk.TableSpec("t", num_rows=10_000, dim=8, hotness=2)
    plan = make_plan([spec], 8, kind, batch_size_hint=128, ranks_per_node=4, exchange="flat")
    p, est = plan["t"], plan.estimates["t"]
    held = [r for r in range(8) if est.memory_bytes[r] > 0]
    if kind == "grid":  # a column slice per node, each row-wise over its 4 ranks
        assert p.columns == (0, 4, 8) and sorted(p.ranks) == list(range(8)) and held == list(range(8))
        assert est.memory_bytes[0] == pytest.approx(2500 * 4 * 4)
    else:  # one node's ranks
        assert {r // 4 for r in p.ranks} == {0} and held == list(p.ranks)
        assert p.columns == ((0, 8) if kind == "table_row_wise" else (0, 2, 4, 6, 8))
    # the ranks of the other node send every id of this table across
    if kind != "grid":
        assert est.across_bytes[5] == pytest.approx(est.wire_bytes[5])
    one_node = make_plan([spec], 8, kind, batch_size_hint=128)
    flat = {"table_row_wise": "row_wise", "table_column_wise": "column_wise", "grid": "row_wise"}[kind]
    same = make_plan([spec], 8, flat, batch_size_hint=128)
    assert one_node.estimates["t"].wire_bytes == pytest.approx(same.estimates["t"].wire_bytes)


def test_auto_takes_the_placements_over_a_nodes_ranks_only_across_nodes():
    tables = [hbk.TableSpec(f"t{k}", num_rows=10 ** (3 + k % 4), dim=8 * (1 + k % 3), hotness=1 + k)
              for k in range(12)]
    for g in (None, 8):
        kinds = {p.kind for p in make_plan(tables, 8, "auto", batch_size_hint=256, ranks_per_node=g).values()}
        assert not kinds & {"table_row_wise", "table_column_wise", "grid"}, kinds
    kinds = {p.kind for p in make_plan(tables, 8, "auto", batch_size_hint=256, ranks_per_node=2,
                                       state_floats_per_row=1).values()}
    assert not kinds & {"column_wise", "table_column_wise", "grid"}, kinds  # whole rows


def test_a_profile_gives_the_placements_over_a_nodes_ranks_their_one_node_costs():
    from hbkernels.sharding.profile import MachineProfile, assumed_profile

    d = assumed_profile([8]).to_json()
    for field in ("step_us", "table_us", "host_ns_per_id", "host_ns_per_bag"):
        d[field] = {k: [i + 1.0] * 3 for i, k in enumerate(("data_parallel", "row_wise", "table_wise",
                                                             "column_wise"))}
    p = MachineProfile.from_json(d)
    assert p.step_us["grid"] == p.step_us["table_row_wise"] == p.step_us["row_wise"]
    assert p.step_us["table_column_wise"] == p.step_us["column_wise"]
    d["step_us"] = {k: v for k, v in d["step_us"].items() if k != "table_wise"}
    with raises(ValueError, match="field 'step_us'"):
        MachineProfile.from_json(d)


def test_the_hierarchical_exchange_crosses_nodes_once_per_id():
    """table_row_wise on node 0 of 2 nodes of 4: under the hierarchical exchange rank 4 + j
    relays node 1's ids of owner j, once for the node, instead of each rank sending its own."""
    from hbkernels.sharding.cost import expected_distinct

    spec = hbk.TableSpec("t", num_rows=10_000, dim=8, hotness=2)
    flat = make_plan([spec], 8, "table_row_wise", batch_size_hint=128, ranks_per_node=4, exchange="flat")
    relayed = make_plan([spec], 8, "table_row_wise", batch_size_hint=128, ranks_per_node=4)
    assert relayed.assumptions["exchange"] == "hierarchical" and flat["t"] == relayed["t"] == \
        flat["t"].__class__("table_row_wise", (0, 1, 2, 3), (0, 8))
    node_ids = expected_distinct(10_000, 4 * 128 * 2)
    asks = node_ids / 4 * (8 + 8 * 4)  # rank 5 relays owner 1's quarter: ids and gradients
    assert relayed.estimates["t"].across_bytes[5] == pytest.approx(asks)
    per_rank = expected_distinct(10_000, 128 * 2)
    assert flat.estimates["t"].across_bytes[5] == pytest.approx(per_rank * (8 + 8 * 4))
    assert sum(relayed.estimates["t"].across_bytes) < sum(flat.estimates["t"].across_bytes)
    one_rank_nodes = make_plan([spec], 8, "table_row_wise", batch_size_hint=128, ranks_per_node=1)
    assert one_rank_nodes.assumptions["exchange"] == "flat"
    with raises(ValueError, match="exchange must be"):
        make_plan([spec], 8, "row_wise", exchange="tree")
