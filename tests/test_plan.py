"""The placement planner: its cost formulas, "auto" choices, requests and serialisation."""
import json

import pytest

import hbkernels.plan
from hbkernels.plan import DEFAULT_BATCH_SIZE, DEFAULT_COST, Placement, Plan, estimate, make_plan
from hbkernels.types import PLACEMENTS, TableSpec

HUGE = TableSpec("huge", 10**7, 64, hotness=10)
TINY = TableSpec("tiny", 10, 8, hotness=50)


def small_case(kind, **kw):
    """R=4, D=2 fp32, B=2, h=1, N=2: u = 4(1 - (3/4)^2) = 1.75, U = 4(1 - (3/4)^4) = 175/64."""
    return make_plan([TableSpec("t", 4, 2)], 2, kind, batch_size_hint=2, **kw)


def test_estimates_by_hand():
    u, big_u = 1.75, 175 / 64
    expected = {  # wire, lookup, memory of each rank
        "row_wise": ((0.5 * u * (8 + 2 * 2 * 4),) * 2, (2 * 0.5 * u * 2 * 4 + 2 * 0.5 * big_u * 8,) * 2, (16,) * 2),
        "data_parallel": ((u * (8 + 4 * 2),) * 2, (u * 8 + 2 * big_u * 8,) * 2, (32,) * 2),
        # owner: receives u ids and rows from rank 1, sends u rows; rank 1 sends u * (8 + 8)
        "table_wise": ((28.0, 28.0), (2 * u * 8 + 2 * big_u * 8, 0.0), (32, 0)),
        # per rank: one 1-column slice; sends u * (8 + 4) as requester and u * 4 as owner
        "column_wise": ((u * 12 + u * 4,) * 2, (2 * u * 4 + 2 * big_u * 4,) * 2, (16,) * 2),
    }
    for kind, (wire, lookup, memory) in expected.items():
        est = small_case(kind).estimates["t"]
        assert est.wire_bytes == pytest.approx(wire, rel=1e-12), kind
        assert est.lookup_bytes == pytest.approx(lookup, rel=1e-12), kind
        assert est.memory_bytes == pytest.approx(memory, rel=1e-12), kind


def test_optimizer_state_wire_dtype_and_step_cost_by_hand():
    plan = small_case("row_wise", state_floats_per_element=1, state_floats_per_row=1, wire_itemsize=2)
    est = plan.estimates["t"]
    assert est.memory_bytes == (2 * (2 * (4 + 4) + 4),) * 2    # ceil(4/2) rows x (2 cols x (4 + 4) + 4)
    assert est.wire_bytes == pytest.approx((0.5 * 1.75 * (8 + 2 * 2 * 2),) * 2)
    seconds = est.wire_bytes[0] / 10e9 + est.lookup_bytes[0] / 50e9 + 3 * 50e-6
    assert plan.step_seconds == pytest.approx(seconds, rel=1e-12)
    replicated = small_case("data_parallel")
    est = replicated.estimates["t"]
    seconds = est.wire_bytes[0] / 10e9 + est.lookup_bytes[0] / 50e9 + 1 * 50e-6   # one gradient allgatherv
    assert replicated.step_seconds == pytest.approx(seconds, rel=1e-12)
    assert DEFAULT_COST == {"network_bytes_per_s": 10e9, "memory_bytes_per_s": 50e9, "collective_latency_s": 50e-6}


def test_distinct_ids_count_the_features_sharing_a_table():
    one = make_plan([TableSpec("t", 100, 4)], 2, "row_wise", batch_size_hint=8).estimates["t"]
    two = make_plan([TableSpec("t", 100, 4, features=("a", "b"))], 2, "row_wise", batch_size_hint=8).estimates["t"]
    u1, u2 = 100 * (1 - 0.99 ** 8), 100 * (1 - 0.99 ** 16)
    assert two.wire_bytes[0] / one.wire_bytes[0] == pytest.approx(u2 / u1)


def test_auto_on_one_rank_is_table_wise_on_rank_0():
    plan = make_plan([HUGE, TINY], 1)
    assert all(p == Placement("table_wise", (0,), (0, p.columns[-1])) for p in plan.values())
    assert plan.step_seconds == pytest.approx(sum(e.lookup_bytes[0] for e in plan.estimates.values()) / 50e9)


@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_replicates_tiny_and_shards_huge(world_size):
    plan = make_plan([HUGE, TINY], world_size, batch_size_hint=4096)
    assert plan["tiny"].kind == "data_parallel"
    assert plan["huge"].kind == "row_wise"
    assert plan.estimates["huge"].memory_bytes == (-(-10**7 // world_size) * 64 * 4,) * world_size


def test_replication_is_a_cost_decision():
    # same width as the sharded table: the exchange round stays, so the gradient allgather only adds bytes
    plan = make_plan([HUGE, TINY._replace(dim=64)], 4, batch_size_hint=4096)
    assert plan["tiny"].kind == "row_wise"
    # with no latency, replicating a tiny table of its own width buys nothing either
    plan = make_plan([HUGE, TINY], 4, batch_size_hint=4096, cost={"collective_latency_s": 0})
    assert plan["tiny"].kind != "data_parallel"


def test_memory_limit_forbids_replication():
    table = TableSpec("small", 1000, 8, hotness=50)          # 32 kB whole, 16 kB per row_wise shard
    assert make_plan([table], 2, batch_size_hint=4096)["small"].kind == "data_parallel"
    plan = make_plan([table], 2, batch_size_hint=4096, memory_per_rank=20_000)
    assert plan["small"].kind in ("row_wise", "column_wise")
    assert max(plan.estimates["small"].memory_bytes) <= 20_000
    with pytest.raises(ValueError, match=r"'small'.*memory_per_rank=20000"):
        make_plan([table], 2, "data_parallel", memory_per_rank=20_000)


def test_memory_limit_counts_optimizer_state_and_other_tables():
    a, b = TableSpec("a", 1000, 8), TableSpec("b", 1000, 8)
    make_plan([a, b], 2, "row_wise", memory_per_rank=32_000)
    with pytest.raises(ValueError, match="'b'"):
        make_plan([a, b], 2, "row_wise", memory_per_rank=31_999)
    with pytest.raises(ValueError, match="'a'"):
        make_plan([a], 2, "row_wise", memory_per_rank=20_000, state_floats_per_element=1)


def test_owner_is_a_rank_with_room():
    # "a" is big but rarely read: rank 0 is the least loaded but full when "c" comes
    tables = [TableSpec("a", 2000, 16, hotness=0.001), TableSpec("b", 1000, 16, hotness=10),
              TableSpec("c", 1000, 16, hotness=10)]
    plan = make_plan(tables, 2, "table_wise", memory_per_rank=128_000)
    assert [p.ranks for p in plan.values()] == [(0,), (1,), (1,)]
    assert make_plan(tables, 2, "table_wise")["c"].ranks == (0,)


def test_table_too_big_for_any_placement():
    with pytest.raises(ValueError, match=r"'huge'.*memory_per_rank=1000000000.*1280000000 bytes"):
        make_plan([TINY, HUGE], 2, memory_per_rank=10**9)


def test_explicit_placements():
    tables = [HUGE, TINY]
    for kind in PLACEMENTS:
        plan = make_plan(tables, 4, kind)
        assert [p.kind for p in plan.values()] == [kind, kind]
        assert plan.request == kind
    plan = make_plan(tables, 4, "row_wise")
    assert plan["tiny"] == Placement("row_wise", (0, 1, 2, 3), (0, 8))
    plan = make_plan(tables, 4, {"tiny": "column_wise"}, batch_size_hint=4096)
    assert plan["tiny"].kind == "column_wise" and plan["huge"].kind == "row_wise"
    plan = make_plan(tables, 4, {"tiny": "table_wise", "huge": "auto"}, batch_size_hint=4096)
    assert plan["tiny"].kind == "table_wise" and plan["huge"].kind == "row_wise"


@pytest.mark.parametrize("request_", ["sharded", 3, None, {"nope": "row_wise"}, {"tiny": "rows"}])
def test_bad_requests(request_):
    with pytest.raises(ValueError, match="nope|rows|sharded|'auto'"):
        make_plan([HUGE, TINY], 2, request_)


def test_column_slices():
    plan = make_plan([TableSpec("t", 100, 3)], 5, "column_wise")
    assert plan["t"].columns == (0, 1, 2, 3) and len(set(plan["t"].ranks)) == 3
    plan = make_plan([TableSpec("t", 100, 10)], 4, "column_wise")
    assert plan["t"].columns == (0, 3, 6, 8, 10) and sorted(plan["t"].ranks) == [0, 1, 2, 3]
    assert plan.estimates["t"].memory_bytes == (100 * 3 * 4, 100 * 3 * 4, 100 * 2 * 4, 100 * 2 * 4)
    # slices go to the least loaded ranks, the widest slice first
    plan = make_plan([TableSpec("big", 10**6, 16), TableSpec("t", 100, 5)], 3,
                     {"big": "table_wise", "t": "column_wise"})
    assert plan["big"].ranks == (0,) and plan["t"].ranks == (1, 2, 0) and plan["t"].columns == (0, 2, 4, 5)


def test_table_wise_spreads_equal_tables():
    tables = [TableSpec(f"t{i}", 1000, 16) for i in range(5)]
    plan = make_plan(tables, 4, "table_wise")
    assert [p.ranks for p in plan.values()] == [(0,), (1,), (2,), (3,), (0,)]
    plan = make_plan(tables[:2] + [TableSpec("big", 10**6, 16)], 2, "table_wise")
    assert plan["big"].ranks == (0,) and plan["t0"].ranks == plan["t1"].ranks == (1,)


def test_deterministic():
    tables = [HUGE, TINY, TableSpec("c", 5000, 32, hotness=3), TableSpec("d", 5000, 32, hotness=3),
              TableSpec("e", 10**5, 16, features=("e1", "e2"))]
    plans = [make_plan(tables, 3, batch_size_hint=512) for _ in range(2)]
    assert plans[0] == plans[1] and str(plans[0]) == str(plans[1])


def test_str_and_json_round_trip():
    tables = [HUGE, TINY, TableSpec("c", 5000, 32, dtype="float16", features=("c1", "c2"))]
    plan = make_plan(tables, 3, {"c": "column_wise"}, state_floats_per_element=1)
    text = str(plan)
    for name, placement in plan.items():
        assert name in text and placement.kind in text
    assert "estimated step cost" in text and f"batch {DEFAULT_BATCH_SIZE} (default" in text
    restored = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert restored == plan and dict(restored) == dict(plan)
    assert restored.estimates == plan.estimates and restored.step_seconds == plan.step_seconds
    assert restored.tables["c"].features == ("c1", "c2")
    assert restored != make_plan(tables, 3, {"c": "row_wise"}, state_floats_per_element=1)


def test_duplicate_names():
    with pytest.raises(ValueError, match="duplicate table name 'a'"):
        make_plan([TableSpec("a", 10, 4), TableSpec("a", 20, 4)], 2)
    with pytest.raises(ValueError, match="'f'.*'a'.*'b'"):
        make_plan([TableSpec("a", 10, 4, features="f"), TableSpec("b", 20, 4, features=("g", "f"))], 2)


def test_estimate_matches_plan():
    plan = make_plan([HUGE], 2, "column_wise")
    assert estimate(plan.tables["huge"], plan["huge"], 2, plan.assumptions) == plan.estimates["huge"]
